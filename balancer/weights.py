"""Scraped load signals and the effective weight they give a backend.

A worker publishes how busy it is (GPU utilisation, KV-cache usage, requests running and
waiting) and how fast it decodes (the inter-token latency histogram) in Prometheus text. wslb
maps those metrics to five signals through a preset or an explicit mapping, and turns them into
an effective weight:

    headroom  = (1 - a * gpu_util) * (1 - b * kv_cache_usage) / (1 + q * waiting)
    speed     = min(1, median_tpot / tpot) ** t
    effective = static_weight * clamp(smoothed(headroom) * speed, min_factor, 1)

with ``a``, ``b``, ``q``, ``t`` and ``min_factor`` from ``weights.coefficients``. Missing
signals count as 0 (no penalty). ``tpot`` is the worker's mean time per output token (its
inter-token latency histogram's sum and count, differenced between scrapes), and
``median_tpot`` the median of the pool's fresh backends: a worker that decodes slower than its
peers (a GPU shared with something else, a smaller card, throttling) loses weight from its first
answers, before its streams pile up and its other signals show it. ``tpot`` is averaged over
tokens with exponentially decaying weights (time constant ``weights.smoothing``), so it needs no
smoothing of its own: the first tokens give the worker's speed as it is, not a value that creeps
there from "no penalty" while the worker fills up. A worker that decodes nothing keeps its last
figure. The bounded-load rule (``ring.load_bound``) then gives each backend at most
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

Two more signals feed placement and the move rule (``balancer.selection``), not the weight:
``prefill``, the worker's seconds per prefilled token (its prefill time and prefilled-token
counters, differenced and decayed as ``tpot`` is: what a move's re-prefill costs there), and
``kv_capacity``, its KV cache's size in tokens (what the conversations placed there must fit in).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "PRESETS",
    "SIGNALS",
    "Coefficients",
    "Signals",
    "denoise",
    "effective_weight",
    "median",
    "parse_signals",
    "resolve_mapping",
    "speed",
]

SIGNALS = ("gpu_util", "kv_cache_usage", "running", "waiting", "tpot", "prefill", "kv_capacity")

# signal -> candidate metric names, first present wins (vLLM renamed its KV-cache gauge).
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "reference": {
        "gpu_util": ("wslb_worker_gpu_utilization",),
        "kv_cache_usage": ("wslb_worker_kv_cache_usage",),
        "running": ("wslb_worker_active_sessions",),
        "waiting": ("wslb_worker_queue_depth",),
        "tpot": ("wslb_worker_inter_token_latency_seconds",),
        "prefill_seconds": ("wslb_worker_prefill_seconds_total",),
        "prefill_tokens": ("wslb_worker_prefill_tokens_total",),
        "kv_capacity": ("wslb_worker_kv_capacity_tokens",),
    },
    "vllm": {
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        # Renamed in vLLM 0.10 (V1); the old name stayed as a deprecated alias for a while.
        "tpot": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        # Prefill time per request over prompt tokens processed (prefix-cache hits are
        # counted apart, in vllm:prefix_cache_hits_total). The KV size is in the labels of
        # cache_config_info (num_gpu_blocks x block_size).
        "prefill_seconds": ("vllm:request_prefill_time_seconds_sum",),
        "prefill_tokens": ("vllm:prompt_tokens_total",),
        "kv_capacity": ("vllm:cache_config_info",),
    },
    "sglang": {
        "kv_cache_usage": ("sglang:token_usage",),
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        # Older releases exported the per-token histogram under vLLM's old name.
        "tpot": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "kv_capacity": ("sglang:max_total_num_tokens",),
    },
    # llama.cpp's llama-server with --metrics: slot counts only. It exports no KV-cache gauge
    # and no inter-token histogram (its tokens_predicted_seconds_total and
    # tokens_predicted_total counters are not a _sum/_count pair), so no kv_cache_usage or tpot.
    "llamacpp": {
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "prefill_seconds": ("llamacpp:prompt_seconds_total",),
        "prefill_tokens": ("llamacpp:prompt_tokens_total",),
    },
    "dcgm": {"gpu_util": ("DCGM_FI_DEV_GPU_UTIL",)},
}

# Fractions are averaged over label sets (several GPUs, several models); counts are summed.
_FRACTIONS = frozenset({"gpu_util", "kv_cache_usage"})
# Histograms: the mapped name is the family; its _sum and _count are read (summed over labels).
_HISTOGRAMS = frozenset({"tpot"})
# Counters read as exposed (``_total`` / ``_sum`` included), summed over labels: the pair that
# gives ``prefill`` (``Signals.since``).
_COUNTERS = frozenset({"prefill_seconds", "prefill_tokens"})
# An info gauge whose labels carry the value: the KV size is their product (vLLM).
_LABEL_PRODUCTS: dict[str, tuple[str, ...]] = {
    "vllm:cache_config_info": ("num_gpu_blocks", "block_size"),
}


@dataclass(frozen=True, slots=True)
class Coefficients:
    """How strongly each signal lowers a backend's weight."""

    gpu: float = 0.5
    kv_cache: float = 0.5
    queue: float = 0.25
    tpot: float = 1.0
    """Exponent of ``median_tpot / tpot`` for a backend slower than the pool's median."""
    min_factor: float = 0.05
    noise_band: float = 0.15
    """Relative differences between backends' load factors up to this much are scrape noise
    (``denoise``)."""


@dataclass(frozen=True, slots=True)
class Signals:
    """One scrape of one backend; ``at`` is the loop time it completed.

    ``tpot_sum`` and ``tpot_count`` are the histogram's running totals as scraped; ``tpot`` is
    the decayed mean that ``since`` works out from the previous scrape, ``tpot_wsum`` and
    ``tpot_wcount`` its decayed totals.
    """

    at: float
    gpu_util: float | None = None
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    tpot: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None
    tpot_wsum: float = 0.0
    tpot_wcount: float = 0.0
    prefill: float | None = None
    """Seconds per prefilled token, decayed as ``tpot`` (``since``)."""
    prefill_seconds: float | None = None
    prefill_tokens: float | None = None
    prefill_wsum: float = 0.0
    prefill_wcount: float = 0.0
    kv_capacity: float | None = None
    """KV cache size in tokens."""

    def as_dict(self) -> dict[str, float | None]:
        return {s: getattr(self, s) for s in SIGNALS}

    def since(self, prev: Signals | None, tau: float) -> Signals:
        """This scrape with ``tpot`` and ``prefill``: the mean time per token (decoded, and
        prefilled), each token weighted by ``exp(-age / tau)`` (``tau`` 0: the tokens since
        ``prev`` only).

        No tokens since ``prev``: the previous figure stands. A first scrape gives none (its
        totals may hold hours of history); a counter that went back (the worker restarted)
        starts over.
        """
        if prev is None:
            return self
        decay = math.exp(-max(0.0, self.at - prev.at) / tau) if tau > 0 else 0.0
        out = self
        tpot = _decayed(
            (self.tpot_sum, self.tpot_count),
            (prev.tpot_sum, prev.tpot_count),
            (prev.tpot, prev.tpot_wsum, prev.tpot_wcount),
            decay,
        )
        if tpot is not None:
            out = replace(out, tpot=tpot[0], tpot_wsum=tpot[1], tpot_wcount=tpot[2])
        prefill = _decayed(
            (self.prefill_seconds, self.prefill_tokens),
            (prev.prefill_seconds, prev.prefill_tokens),
            (prev.prefill, prev.prefill_wsum, prev.prefill_wcount),
            decay,
        )
        if prefill is not None:
            out = replace(
                out, prefill=prefill[0], prefill_wsum=prefill[1], prefill_wcount=prefill[2]
            )
        return out


def _decayed(
    now: tuple[float | None, float | None],
    before: tuple[float | None, float | None],
    mean: tuple[float | None, float, float],
    decay: float,
) -> tuple[float | None, float, float] | None:
    """A decayed mean of time per unit from two running totals (time, units) scraped now and
    before, and the mean so far (value, decayed time, decayed units); None: no figure yet."""
    (s, n), (ps, pn) = now, before
    if s is None or n is None or ps is None or pn is None:
        return None
    dn = n - pn
    if dn < 0:  # the counter went back: the worker restarted
        return None
    value, wsum, wcount = mean
    wsum = wsum * decay + max(0.0, s - ps)
    wcount = wcount * decay + dn
    if dn == 0 or wcount <= 0:
        return value, wsum, wcount
    return wsum / wcount, wsum, wcount


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
            value = float(sample.value)
            labels = _LABEL_PRODUCTS.get(sample.name)
            if labels is not None:
                try:
                    value = math.prod(float(sample.labels[k]) for k in labels)
                except (KeyError, ValueError):
                    continue
            values.setdefault(sample.name, []).append(value)
    found: dict[str, float] = {}
    for signal, names in mapping.items():
        for name in names:
            if signal in _HISTOGRAMS:
                sums, counts = values.get(f"{name}_sum"), values.get(f"{name}_count")
                if not sums or not counts:
                    continue
                found[f"{signal}_sum"] = max(sum(sums), 0.0)
                found[f"{signal}_count"] = max(sum(counts), 0.0)
                break
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
    mid = median(factors.values())
    if mid is None or mid <= 0:
        return dict(factors)
    out = {}
    for key, f in factors.items():
        ratio = f / mid
        if ratio > 1.0 + band:
            ratio /= 1.0 + band
        elif ratio * (1.0 + band) < 1.0:
            ratio *= 1.0 + band
        else:
            ratio = 1.0
        out[key] = mid * ratio
    return out


def median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def effective_weight(
    static: float, signals: Signals | None, now: float, stale_after: float, coef: Coefficients
) -> tuple[float, bool]:
    """The backend's weight for load bounds from its load signals (``speed`` aside), and
    whether its scrape is stale (or missing)."""
    if signals is None or now - signals.at > stale_after:
        return static, True
    headroom = (
        (1.0 - coef.gpu * (signals.gpu_util or 0.0))
        * (1.0 - coef.kv_cache * (signals.kv_cache_usage or 0.0))
        / (1.0 + coef.queue * (signals.waiting or 0.0))
    )
    return static * min(1.0, max(coef.min_factor, headroom)), False


def speed(tpot: float | None, median_tpot: float | None, coef: Coefficients) -> float:
    """The factor for decoding slower than the pool's median ``tpot`` (1: not slower)."""
    if coef.tpot <= 0 or not tpot or not median_tpot or tpot <= median_tpot:
        return 1.0
    return float((median_tpot / tpot) ** coef.tpot)
