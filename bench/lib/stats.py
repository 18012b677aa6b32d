"""The one percentile summary of the benchmarks: of a list of values, or of a histogram of
integer bins (a client process counts latencies in 1 us bins instead of keeping each one)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["hist_pct", "pct", "summary"]


def pct(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` in [0, 100], linear between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def hist_pct(hist: Mapping[int, int], q: float) -> float:
    """Percentile ``q`` in [0, 100] of a histogram (bin -> count): the middle of the bin that
    holds rank ``q``% of the count (nearest rank: a bin has no finer detail); NaN when empty."""
    n = sum(hist.values())
    if not n:
        return math.nan
    rank, seen = q * n / 100.0, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return b + 0.5
    return math.nan


def summary(
    values: Sequence[float] | Mapping[int, int],
    qs: Sequence[float] = (50, 99),
    *,
    peak: bool = True,
    unit: str = "",
) -> dict[str, float]:
    """``{"n", "p50", "p99", "max"}`` of ``values`` (a list, or a histogram as ``hist_pct``
    reads one): a key per percentile in ``qs`` (99.9 is ``p999``), ``max`` unless not ``peak``,
    ``unit`` appended to every key but ``n`` (``p50_us``). NaN where there are no values."""
    if isinstance(values, Mapping):
        n = sum(values.values())
        at = [hist_pct(values, q) for q in qs]
        top = max(values) + 0.5 if values else math.nan
    else:
        n = len(values)
        at = [pct(values, q) for q in qs]
        top = max(values) if values else math.nan
    out: dict[str, float] = {"n": n}
    out |= {f"p{q:g}".replace(".", "") + unit: v for q, v in zip(qs, at, strict=True)}
    if peak:
        out["max" + unit] = top
    return out
