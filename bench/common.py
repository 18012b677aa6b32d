"""Helpers the benchmark scripts share: ports and child processes, wslb's admin API,
percentiles, CPU accounting from /proc, wslb's log.

Benchmarks only (not imported by ``balancer``); each script puts the repository root on
``sys.path`` before importing this module as ``bench.common``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

import psutil

__all__ = [
    "CpuSample",
    "admin_get",
    "admin_headers",
    "cpu_sample",
    "cpu_seconds",
    "cpu_window",
    "die_with_parent",
    "free_port",
    "log_problems",
    "pct",
    "sigterm_as_interrupt",
    "wait_port",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In a child (``preexec_fn``): SIGKILL if the script dies without cleaning up (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler (``signal.signal(signal.SIGTERM, sigterm_as_interrupt)``): the script
    stops as on Ctrl-C, so its cleanup kills what it started."""
    raise KeyboardInterrupt


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Until ``port`` on 127.0.0.1 accepts a connection; raises if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening after {timeout:g}s")


def admin_headers(token: str) -> dict[str, str]:
    """What wslb's admin API requires on every request but ``GET /healthz`` and ``/readyz``.

    A script's config names the token (``admin.token``, one per run from
    ``secrets.token_urlsafe``): with none, wslb would generate one, write it to a file in
    ``$WSLB_STATE_DIR`` and log a warning that the benchmarks' log summaries would count.
    POSTs also need ``Content-Type: application/json`` (aiohttp's ``json=`` sets it).
    """
    return {"Authorization": f"Bearer {token}"}


def admin_get(port: int, path: str, token: str, timeout: float = 5.0) -> str:
    """The body of ``GET path`` on wslb's admin API at 127.0.0.1:``port``, with the token.

    Raises ``urllib.error.HTTPError`` (an OSError) on a status >= 400, e.g. 401 for a wrong token.
    """
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=admin_headers(token))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return str(r.read().decode())


def pct(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` in [0, 100], linear between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def cpu_seconds(pid: int) -> float:
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
        {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()},
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


_ADDR = re.compile(r"0x[0-9a-f]+|\b\d+\.\d+\.\d+\.\d+(:\d+)?\b|session \S+|pid \d+")


def log_problems(text: str) -> Counter[str]:
    """wslb's ERROR and WARNING lines, and the exception ending each traceback, counted by
    message (addresses, session ids and pids folded so repeats count together)."""
    out: Counter[str] = Counter()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\S+ \S+ (ERROR|WARNING|CRITICAL) (\S+): (.*)", line)
        if m:
            out[f"{m[1]} {m[2]}: {_ADDR.sub('_', m[3])[:120]}"] += 1
        elif line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                j += 1
            if j < len(lines):
                out[f"  raised {_ADDR.sub('_', lines[j])[:160]}"] += 1
    return out
