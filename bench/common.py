"""Helpers the benchmark scripts share: percentiles, CPU accounting from /proc, wslb's log and
metrics, SIGTERM as Ctrl-C, the machine's description, a list-of-sizes argument.

Benchmarks only (not imported by ``balancer``); each script puts the repository root on
``sys.path`` before importing this module as ``bench.common``. The processes they start (wslb,
reference workers, their own children), the ports and wslb's admin API are ``tests/procs.py``'s
(``tests.procs``), the launcher the integration tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import FrameType

import psutil

__all__ = [
    "CpuSample",
    "PromHistogram",
    "cpu_model",
    "cpu_sample",
    "cpu_seconds",
    "cpu_window",
    "dist_version",
    "log_problems",
    "machine_line",
    "parse_sizes",
    "pct",
    "prom_by_label",
    "prom_histogram",
    "sigterm_as_interrupt",
]


def require_modules(names: Sequence[str], why: str) -> None:
    """Stop before a long run, not after it, when a module it will need is missing."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise SystemExit(
            f"{why} needs {', '.join(missing)}: pip install -e '.[bench]' (or without {why})"
        )


def sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler (``signal.signal(signal.SIGTERM, sigterm_as_interrupt)``): the script
    stops as on Ctrl-C, so its cleanup kills what it started."""
    raise KeyboardInterrupt


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
        m = re.match(r"\S+(?: \S+)? (ERROR|WARNING|CRITICAL) (\S+): (.*)", line)
        if m:
            out[f"{m[1]} {m[2]}: {_ADDR.sub('_', m[3])[:120]}"] += 1
        elif line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                j += 1
            if j < len(lines):
                out[f"  raised {_ADDR.sub('_', lines[j])[:160]}"] += 1
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` (exactly) in a Prometheus text exposition."""
    out: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if m is None or m[1] != name:
            continue
        with contextlib.suppress(ValueError):
            out.append((dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return out


def prom_by_label(text: str, name: str, label: str) -> Counter[str]:
    """A labelled counter (``wslb_failovers_total{result=...}``) as label value -> count, summed
    over its other labels."""
    out: Counter[str] = Counter()
    for labels, value in _samples(text, name):
        out[labels.get(label, "")] += int(value)
    return out


@dataclass
class PromHistogram:
    """One unlabelled Prometheus histogram: cumulative counts by upper bound, ``+Inf`` last."""

    buckets: list[tuple[float, int]]
    count: int
    sum: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile ``q`` in [0, 100] (a bound, not an
        estimate: the exposition has nothing finer); ``inf`` past the last finite bound, NaN
        when empty."""
        if not self.count:
            return math.nan
        rank = q / 100.0 * self.count
        for bound, cum in self.buckets:
            if cum >= rank and cum > 0:
                return bound
        return math.inf


def prom_histogram(text: str, name: str) -> PromHistogram:
    """Histogram ``name`` (``_bucket``, ``_count``, ``_sum``) of an exposition; empty if absent."""
    buckets = sorted(
        (float(labels["le"]), int(v))
        for labels, v in _samples(text, f"{name}_bucket")
        if "le" in labels
    )
    count = sum(int(v) for _, v in _samples(text, f"{name}_count"))
    total = sum(v for _, v in _samples(text, f"{name}_sum"))
    return PromHistogram(buckets, count, total)


# -- the machine, and arguments -----------------------------------------------------------------


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


def machine_line() -> str:
    """One line for a report: CPUs, kernel, Python."""
    return (
        f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def parse_sizes(text: str) -> list[int]:
    """``N`` or ``N,N,...`` (session counts of a sweep), each at least 1: an argparse type."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,...: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("session counts must be at least 1")
    return sizes
