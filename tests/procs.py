"""The tests' handle on real processes: the launcher is ``bench/lib/launch.py`` (one for the
benchmarks and the tests, so both start wslb and workers alike); this re-exports it under the
name the tests import, beside two helpers only tests use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from bench.lib.launch import (
    ROOT,
    WORKER_AUTH,
    WORKER_TOKEN,
    Backends,
    Procs,
    Worker,
    Wslb,
    all_active,
    child_env,
    die_with_parent,
    free_port,
    free_ports,
    spawn,
    stop,
    wait_port,
)

__all__ = [
    "ROOT",
    "WORKER_AUTH",
    "WORKER_TOKEN",
    "Backends",
    "Procs",
    "Worker",
    "Wslb",
    "all_active",
    "child_env",
    "die_with_parent",
    "free_port",
    "free_ports",
    "pool_config",
    "running",
    "spawn",
    "stop",
    "wait_port",
]


def pool_config(backends: Sequence[dict[str, Any]], **pool: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"name": "chat", "backends": list(backends)}
    p.update(pool)
    return {"pools": [p]}


@contextlib.contextmanager
def running(*procs: Worker | Wslb) -> Iterator[None]:
    try:
        yield
    finally:
        for p in reversed(procs):
            p.stop()
