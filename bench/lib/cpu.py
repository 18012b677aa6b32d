"""CPU and memory of the processes a benchmark measures, from /proc (psutil): per process, per
process tree (a multi-process proxy is measured whole), and per role over a window with the
machine's own busy time beside it (other jobs share the machine)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

__all__ = [
    "CpuSample",
    "cpu_sample",
    "cpu_seconds",
    "cpu_split",
    "cpu_window",
    "process_cpu_seconds",
    "rss_bytes",
    "tree",
]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


@dataclass
class CpuSample:
    """CPU seconds so far per role, and the machine's busy and total CPU seconds."""

    at: float
    roles: dict[str, float]
    busy: float
    total: float


def cpu_sample(pids: dict[str, list[int]]) -> CpuSample:
    sys_t = psutil.cpu_times()
    idle = sys_t.idle + getattr(sys_t, "iowait", 0.0)
    total = float(sum(sys_t))
    return CpuSample(
        time.monotonic(),
        {role: sum(process_cpu_seconds(p) for p in ps) for role, ps in pids.items()},
        total - idle,
        total,
    )


def cpu_window(a: CpuSample, b: CpuSample) -> dict[str, float]:
    """Per role: % of one core over the window; ``machine``: % of all cores busy."""
    span = max(b.at - a.at, 1e-9)
    out = {role: 100.0 * (b.roles[role] - a.roles[role]) / span for role in a.roles}
    ours = sum(out.values())
    out["machine"] = 100.0 * (b.busy - a.busy) / max(b.total - a.total, 1e-9)
    # Everything else on the machine (other jobs), in % of one core.
    out["others"] = max(0.0, out["machine"] * (os.cpu_count() or 1) - ours)
    out["seconds"] = span
    return out


def tree(pid: int) -> list[psutil.Process]:
    """A process and its descendants (a multi-process proxy is measured whole)."""
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_split(pids: Sequence[int]) -> tuple[float, float]:
    """User and system CPU seconds of the processes and their descendants (10 ms resolution),
    from one reading of each process."""
    user = system = 0.0
    for pid in pids:
        for p in tree(pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                user += t.user
                system += t.system
    return user, system


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes and their descendants."""
    return sum(cpu_split(pids))


def rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        for p in tree(pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    return total
