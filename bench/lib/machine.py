"""The one description of the machine a report gives: ``machine()`` for its JSON and
``machine_line()`` for its text, so figures from different scripts name the same facts; and the
code under test (``tree_state``, ``source_state``), which the figures depend on as much."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.lib.launch import ROOT

__all__ = [
    "command_output",
    "cpu_model",
    "dist_version",
    "loadavg",
    "lscpu",
    "machine",
    "machine_line",
    "source_state",
    "tree_state",
]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, "unknown CPU" where it has none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def dist_version(dist: str) -> str:
    """An installed distribution's version, "absent" when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def machine() -> dict[str, Any]:
    """The machine and the libraries the figures depend on (a report's ``machine``); a script
    adds what only it needs (``lscpu()``, the load average, another proxy's version)."""
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "kernel": platform.release(),
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "python": platform.python_version(),
        "uvloop": dist_version("uvloop"),
        "aiohttp": dist_version("aiohttp"),
    }


def machine_line(info: Mapping[str, Any] | None = None) -> str:
    """``machine()`` (or an earlier one, ``info``) as the line every report prints."""
    m = machine() if info is None else info
    return (
        f"{m['nproc']} CPUs ({m['cpu']}), {m['memory']}, {platform.system()} {m['kernel']}, "
        f"Python {m['python']}, uvloop {m['uvloop']}, aiohttp {m['aiohttp']}"
    )


def loadavg() -> str:
    """The 1/5/15-minute load averages, one decimal each (the machine may be shared)."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def command_output(cmd: Sequence[str]) -> str:
    """``cmd``'s stdout and stderr, stripped; "absent" when it cannot run."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    return (r.stdout + r.stderr).strip()


def lscpu() -> str:
    """The CPU's topology, caches and hypervisor from ``lscpu``, one line: what CPU time per
    frame depends on beyond the model name."""
    keep = {"Architecture", "CPU(s)", "Model name", "Thread(s) per core", "Core(s) per socket"}
    keep |= {"Socket(s)", "CPU max MHz", "L2 cache", "L3 cache", "Hypervisor vendor"}
    lines = [
        ln for ln in command_output(["lscpu"]).splitlines() if ln.split(":")[0].strip() in keep
    ]
    return "; ".join(" ".join(ln.split()) for ln in lines)


def tree_state() -> str:
    """The commit under test, and whether balancer/ or backends/ differ from it."""

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(
                ["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.rstrip()  # not lstrip: porcelain lines begin with a status column

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "balancer", "backends").splitlines()
    if not dirty:
        return f"{head} (balancer/ and backends/ clean)"
    names = ", ".join(line[3:] for line in dirty[:6]) + (" ..." if len(dirty) > 6 else "")
    return f"{head} + uncommitted changes in {names}"


def source_state(src: Path) -> str:
    """The commit wslb ran from (another checkout: ``--wslb-src``), whether its balancer/ had
    uncommitted changes, and whether its frame scanner's C loop is built there."""
    head = command_output(["git", "-C", str(src), "log", "-1", "--format=%h %s"])[:80]
    dirty = command_output(["git", "-C", str(src), "status", "--porcelain", "--", "balancer"])
    n = len([ln for ln in dirty.splitlines() if ln.strip()])
    if head.startswith("fatal:"):  # a copy of a tree (--wslb-variant, a snapshot)
        head, n = "(not a git checkout)", 0
    loop = command_output(
        [
            "env",
            "-C",
            str(src),
            sys.executable,
            "-c",
            "import balancer.frames as f; "
            "print('C' if f.ACCELERATED else 'Python (balancer._scan not built there)')",
        ]
    )
    return (
        f"{src} at {head}"
        + (f" + uncommitted changes in {n} balancer/ file(s)" if n else "")
        + f"; frame scanner's fast loop: {loop.strip() or 'unknown'}"
    )
