"""Other LLM routers as peers for the keyless benchmark (``bench/lib/keyless.py``): SGLang's
gateway (``smg``, PyPI ``smg``) and vLLM's router (``vllm-router``, PyPI ``vllm-router``), each
a subprocess on a free loopback port pointed at the engines' URLs.

Neither is a dependency of wslb or its tests: ``find`` looks for the command on ``$PATH`` and
beside this Python (a virtual environment's ``bin``), and a peer that is not there is skipped
with the line that installs it (``pip install smg vllm-router``, e.g. in a venv of their own:
their wheels pin what they need).

Ready means routing: both answer ``GET /v1/models`` by proxying it to a worker once they have
registered one (``smg`` also probes its workers' ``/health`` at start), so ``start`` waits for a
200 there; nothing is sent that an engine would cache.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.lib.launch import Procs, free_port, wait_port

__all__ = ["PEERS", "Peer", "find", "start", "version"]


@dataclass(frozen=True)
class Peer:
    """A router as the benchmark runs it: its command, policy and how to install it."""

    name: str
    command: str
    package: str
    policy: str

    def argv(self, binary: str, port: int, urls: Sequence[str]) -> list[str]:
        base = [binary]
        if self.command == "smg":
            base.append("launch")
        base += ["--host", "127.0.0.1", "--port", str(port), "--policy", self.policy]
        base += ["--worker-urls", *urls]
        if self.command == "smg":
            # Its own Prometheus listener defaults to a fixed port: one per run, never shared.
            base += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
        else:
            base += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
        return base


PEERS = {
    "smg": Peer("smg", "smg", "smg", "cache_aware"),
    "vllm-cache_aware": Peer("vllm-cache_aware", "vllm-router", "vllm-router", "cache_aware"),
    "vllm-round_robin": Peer("vllm-round_robin", "vllm-router", "vllm-router", "round_robin"),
}


def find(command: str) -> str | None:
    """The command's path: on ``$PATH``, else beside this interpreter."""
    found = shutil.which(command)
    if found:
        return found
    beside = Path(sys.executable).parent / command
    return str(beside) if beside.exists() else None


def version(peer: Peer) -> str:
    """``PACKAGE VERSION`` as the Python of the command's script reports it; ``PACKAGE ?``."""
    binary = find(peer.command)
    with contextlib.suppress(OSError, IndexError, subprocess.SubprocessError):
        if binary is None:
            return f"{peer.package} ?"
        first = Path(binary).read_bytes()[:256].split(b"\n", 1)[0]
        python = first[2:].decode().strip() if first.startswith(b"#!") else sys.executable
        code = f"from importlib.metadata import version; print(version({peer.package!r}))"
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return f"{peer.package} {out.stdout.strip()}"
    return f"{peer.package} ?"


def start(peer: Peer, procs: Procs, urls: Sequence[str], name: str, timeout: float = 60.0) -> str:
    """Start ``peer`` in front of ``urls``; its base URL once it proxies ``GET /v1/models``.
    Raises ``FileNotFoundError`` if it is not installed, ``RuntimeError`` if it exits."""
    binary = find(peer.command)
    if binary is None:
        raise FileNotFoundError(f"{peer.command} not installed: pip install {peer.package}")
    port = free_port()
    proc = procs.spawn(name, peer.argv(binary, port, urls))
    wait_port(port, timeout, proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{peer.name} exited with {proc.returncode}:\n{procs.log_tail(name)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return url
        except (OSError, urllib.error.HTTPError) as e:
            last = str(e)
        time.sleep(0.2)
    raise TimeoutError(
        f"{peer.name} not routing after {timeout:g}s ({last}):\n{procs.log_tail(name)}"
    )
