"""Scraped load signals and the effective weight they give a backend.

A worker publishes how busy it is (GPU utilisation, KV-cache usage, requests running and
waiting) in Prometheus text. wslb maps those metrics to four signals through a preset or an
explicit mapping, and turns them into an effective weight:

    headroom  = (1 - a * gpu_util) * (1 - b * kv_cache_usage) / (1 + q * waiting)
    effective = static_weight * clamp(headroom, min_factor, 1)

with ``a``, ``b``, ``q`` and ``min_factor`` from ``weights.coefficients``. Missing signals count
as 0 (no penalty). The bounded-load rule (``ring.load_bound``) then gives each backend at most
``c x`` its *effective* share of the live sessions, so wslb's own session counts and the workers'
reported load act together: a hot worker keeps its existing keys while it has room and takes
fewer new ones. A scrape older than ``stale_after`` is ignored: the backend falls back to its
static weight, i.e. plain connection-count weighting, and is reported stale. The pool smooths
each backend's load factor (``effective / static``) exponentially over ``weights.smoothing``
seconds, so one noisy scrape (a burst of queued prefills) does not move keys between workers.

The signals are partly the pool's own doing: a worker given more sessions decodes more streams
and holds more KV, so its factor drops, its share and bound with it, and sessions of identical
workers are pushed around by sampling noise. ``denoise`` therefore measures each backend's
smoothed factor against the median of the pool's and shrinks the ratio towards 1 by
``noise_band`` (in log terms, a soft threshold): identical workers within +/-15% of each other get
the same factor, a hot worker at 0.57 of the median keeps 0.66 of it. Only shares matter to the
bounded-load rule, so the level (all workers busier) passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "PRESETS",
    "SIGNALS",
    "Coefficients",
    "Signals",
    "denoise",
    "effective_weight",
    "parse_signals",
    "resolve_mapping",
]

SIGNALS = ("gpu_util", "kv_cache_usage", "running", "waiting")

# signal -> candidate metric names, first present wins (vLLM renamed its KV-cache gauge).
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "reference": {
        "gpu_util": ("wslb_worker_gpu_utilization",),
        "kv_cache_usage": ("wslb_worker_kv_cache_usage",),
        "running": ("wslb_worker_active_sessions",),
        "waiting": ("wslb_worker_queue_depth",),
    },
    "vllm": {
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
    },
    "dcgm": {"gpu_util": ("DCGM_FI_DEV_GPU_UTIL",)},
}

# Fractions are averaged over label sets (several GPUs, several models); counts are summed.
_FRACTIONS = frozenset({"gpu_util", "kv_cache_usage"})


@dataclass(frozen=True, slots=True)
class Coefficients:
    """How strongly each signal lowers a backend's weight."""

    gpu: float = 0.5
    kv_cache: float = 0.5
    queue: float = 0.25
    min_factor: float = 0.05
    noise_band: float = 0.15
    """Relative differences between backends' load factors up to this much are scrape noise
    (``denoise``)."""


@dataclass(frozen=True, slots=True)
class Signals:
    """One scrape of one backend; ``at`` is the loop time it completed."""

    at: float
    gpu_util: float | None = None
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {s: getattr(self, s) for s in SIGNALS}


def resolve_mapping(
    metrics: str | Iterable[tuple[str, str]],
) -> dict[str, tuple[str, ...]]:
    """The signal -> metric names mapping for a preset name or an explicit mapping."""
    if isinstance(metrics, str):
        return PRESETS[metrics]
    return {signal: (name,) for signal, name in metrics}


def parse_signals(text: str, mapping: Mapping[str, tuple[str, ...]], at: float) -> Signals:
    """Extract the mapped signals from Prometheus text (raises ValueError if unparsable).

    Percent-scale utilisation (DCGM reports 0..100) is brought to 0..1.
    """
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # keyed by the exposed name (counters keep "_total")
            values.setdefault(sample.name, []).append(float(sample.value))
    found: dict[str, float] = {}
    for signal, names in mapping.items():
        for name in names:
            samples = values.get(name)
            if not samples:
                continue
            if signal in _FRACTIONS:
                v = sum(samples) / len(samples)
                if v > 1.0:
                    v /= 100.0
                found[signal] = min(max(v, 0.0), 1.0)
            else:
                found[signal] = max(sum(samples), 0.0)
            break
    return Signals(at=at, **found)


def denoise(factors: Mapping[str, float], band: float) -> dict[str, float]:
    """Load factors with relative differences up to ``band`` removed (see the module docstring).

    Each factor's ratio to the median factor is shrunk towards 1 by ``1 + band`` (multiplied or
    divided, never crossing 1); a ratio within ``[1 / (1 + band), 1 + band]`` becomes 1.
    """
    if band <= 0 or len(factors) < 2:
        return dict(factors)
    ordered = sorted(factors.values())
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if median <= 0:
        return dict(factors)
    out = {}
    for key, f in factors.items():
        ratio = f / median
        if ratio > 1.0 + band:
            ratio /= 1.0 + band
        elif ratio * (1.0 + band) < 1.0:
            ratio *= 1.0 + band
        else:
            ratio = 1.0
        out[key] = median * ratio
    return out


def effective_weight(
    static: float, signals: Signals | None, now: float, stale_after: float, coef: Coefficients
) -> tuple[float, bool]:
    """The backend's weight for load bounds, and whether its scrape is stale (or missing)."""
    if signals is None or now - signals.at > stale_after:
        return static, True
    headroom = (
        (1.0 - coef.gpu * (signals.gpu_util or 0.0))
        * (1.0 - coef.kv_cache * (signals.kv_cache_usage or 0.0))
        / (1.0 + coef.queue * (signals.waiting or 0.0))
    )
    return static * min(1.0, max(coef.min_factor, headroom)), False
