"""Scraped signals -> effective weights; outlier ejection and health flips on the pool."""

from __future__ import annotations

import math

import pytest

from balancer.weights import (
    PRESETS,
    Coefficients,
    Signals,
    denoise,
    effective_weight,
    parse_signals,
    resolve_mapping,
    speed,
)
from tests.test_pool import make_pool, place

REFERENCE = """\
# HELP wslb_worker_gpu_utilization GPU utilisation
# TYPE wslb_worker_gpu_utilization gauge
wslb_worker_gpu_utilization 0.8
# TYPE wslb_worker_kv_cache_usage gauge
wslb_worker_kv_cache_usage 0.5
# TYPE wslb_worker_active_sessions gauge
wslb_worker_active_sessions 12
# TYPE wslb_worker_queue_depth gauge
wslb_worker_queue_depth 2
# TYPE wslb_worker_kv_hit_tokens counter
wslb_worker_kv_hit_tokens_total 100
# TYPE wslb_worker_inter_token_latency_seconds histogram
wslb_worker_inter_token_latency_seconds_bucket{le="0.025"} 30.0
wslb_worker_inter_token_latency_seconds_bucket{le="+Inf"} 40.0
wslb_worker_inter_token_latency_seconds_count 40.0
wslb_worker_inter_token_latency_seconds_sum 1.0
"""


def itl(total: float, count: float, name: str = "wslb_worker_inter_token_latency_seconds") -> str:
    return f"# TYPE {name} histogram\n{name}_sum {total}\n{name}_count {count}\n"


def test_reference_preset() -> None:
    s = parse_signals(REFERENCE, PRESETS["reference"], at=5.0)
    assert (s.gpu_util, s.kv_cache_usage, s.running, s.waiting, s.at) == (0.8, 0.5, 12, 2, 5.0)
    assert (s.tpot_sum, s.tpot_count, s.tpot) == (1.0, 40.0, None)  # one scrape: no window


def test_tpot_is_the_mean_time_per_token_since_the_previous_scrape() -> None:
    ref = PRESETS["reference"]
    first = parse_signals(itl(1.0, 40), ref, 1.0).since(None, 0.0)
    assert first.tpot is None  # the totals may hold hours of history
    second = parse_signals(itl(4.0, 100), ref, 2.0).since(first, 0.0)
    assert second.tpot == pytest.approx(3.0 / 60)  # not the lifetime mean 0.04
    assert second.as_dict()["tpot"] == second.tpot
    idle = parse_signals(itl(4.0, 100), ref, 3.0).since(second, 0.0)
    assert idle.tpot == second.tpot  # nothing decoded since: the last figure stands
    restarted = parse_signals(itl(0.5, 10), ref, 4.0).since(idle, 0.0)
    assert restarted.tpot is None  # the counter went back: start over
    again = parse_signals(itl(0.8, 20), ref, 5.0).since(restarted, 0.0)
    assert again.tpot == pytest.approx(0.03)
    # No histogram at all (a worker that does not export it): no signal, no penalty.
    plain = parse_signals("wslb_worker_queue_depth 1\n", ref, 6.0).since(second, 0.0)
    assert plain.tpot is None


def test_tpot_weighs_tokens_by_their_age_and_starts_from_the_first_ones() -> None:
    ref = PRESETS["reference"]
    tau = 10.0
    s = parse_signals(itl(0.0, 0), ref, 0.0).since(None, tau)
    s = parse_signals(itl(5.0, 100), ref, 1.0).since(s, tau)
    assert s.tpot == pytest.approx(0.05)  # the first tokens alone: no prior to creep from
    s = parse_signals(itl(6.0, 200), ref, 11.0).since(s, tau)  # 100 faster tokens, 10 s later
    old = math.exp(-1.0)
    assert s.tpot == pytest.approx((5.0 * old + 1.0) / (100 * old + 100))
    before = s.tpot
    for t in range(12, 100):  # idle: both totals decay alike, the figure stands
        s = parse_signals(itl(6.0, 200), ref, float(t)).since(s, tau)
    assert s.tpot == pytest.approx(before)
    s = parse_signals(itl(7.0, 300), ref, 100.0).since(s, tau)
    assert s.tpot == pytest.approx(0.01, rel=0.01)  # the old tokens have faded
    # Labelled series (several models behind one endpoint) are summed before dividing.
    labelled = (
        'x_seconds_sum{model="a"} 1.0\nx_seconds_count{model="a"} 10\n'
        'x_seconds_sum{model="b"} 3.0\nx_seconds_count{model="b"} 10\n'
    )
    one = parse_signals(labelled, resolve_mapping((("tpot", "x_seconds"),)), 0.0)
    assert (one.tpot_sum, one.tpot_count) == (4.0, 20.0)


OLD_TPOT = "vllm:time_per_output_token_seconds"


def test_vllm_preset_prefers_new_name_and_falls_back_to_old() -> None:
    new = 'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    new += 'vllm:num_requests_running{model_name="m"} 3\n'
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
    old += 'vllm:num_requests_waiting{model_name="m"} 4\n'
    assert parse_signals(new, PRESETS["vllm"], 0).kv_cache_usage == 0.25
    both = itl(2.0, 10, OLD_TPOT) + itl(1.0, 10, "vllm:inter_token_latency_seconds")
    assert parse_signals(both, PRESETS["vllm"], 0).tpot_sum == 1.0  # vLLM 0.10's name first
    legacy = parse_signals(itl(2.0, 10, OLD_TPOT), PRESETS["vllm"], 0)
    assert legacy.tpot_sum == 2.0
    s = parse_signals(old, PRESETS["vllm"], 0)
    assert (s.kv_cache_usage, s.waiting, s.running) == (0.75, 4, None)


SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="1"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.42
sglang:token_usage{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="1"} 0.44
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.5
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.02",model_name="Qwen/Qwen3-8B"} 700.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="Qwen/Qwen3-8B"} 1000.0
sglang:inter_token_latency_seconds_count{model_name="Qwen/Qwen3-8B"} 1000.0
sglang:inter_token_latency_seconds_sum{model_name="Qwen/Qwen3-8B"} 18.5
"""

# GET /metrics of llama.cpp's llama-server (--metrics, 2 slots) serving three streams: two in
# the slots, one waiting for a slot (tests/engines.py's server, captured).
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 93
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 4
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.860496
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 129
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 6.71818
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 135
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 78
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 0
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 0
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 0
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 0
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 0
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.00741
"""  # noqa: E501 (its help texts as served)


def test_sglang_preset() -> None:
    s = parse_signals(SGLANG, PRESETS["sglang"], at=1.0)
    assert s.kv_cache_usage == pytest.approx(0.43)  # a fraction: averaged over the TP ranks
    assert (s.running, s.waiting, s.gpu_util) == (10, 3, None)  # counts: summed
    assert (s.tpot_sum, s.tpot_count) == (18.5, 1000.0)
    old = parse_signals(itl(2.0, 50, "sglang:time_per_output_token_seconds"), PRESETS["sglang"], 0)
    assert (old.tpot_sum, old.tpot_count) == (2.0, 50.0)  # older releases' name


def test_llamacpp_preset_reads_slots_and_queue_of_a_real_llama_server() -> None:
    s = parse_signals(LLAMACPP, PRESETS["llamacpp"], at=2.0)
    assert (s.running, s.waiting) == (2, 1)
    # No KV-cache gauge and no inter-token histogram: no signal, no penalty.
    assert (s.kv_cache_usage, s.gpu_util, s.tpot_sum, s.tpot_count) == (None,) * 4
    w, stale = effective_weight(1.0, s, 2.0, 5.0, Coefficients(queue=0.25))
    assert w == pytest.approx(1 / 1.25) and not stale  # the queued request costs weight


def test_preset_names() -> None:
    assert set(PRESETS) == {"reference", "vllm", "sglang", "llamacpp", "dcgm"}
    assert all(resolve_mapping(name) is PRESETS[name] for name in PRESETS)


def test_dcgm_percent_is_scaled_and_averaged_over_gpus() -> None:
    text = 'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 90\nDCGM_FI_DEV_GPU_UTIL{gpu="1"} 50\n'
    assert parse_signals(text, PRESETS["dcgm"], 0).gpu_util == pytest.approx(0.7)


def test_explicit_mapping() -> None:
    mapping = resolve_mapping((("gpu_util", "my_util"), ("waiting", "my_queue")))
    s = parse_signals("my_util 0.4\nmy_queue 7\n", mapping, 0)
    assert (s.gpu_util, s.waiting) == (0.4, 7)


def test_garbage_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_signals("this is { not prometheus", PRESETS["reference"], 0)


def test_effective_weight_formula_and_staleness() -> None:
    c = Coefficients(gpu=0.5, kv_cache=0.5, queue=0.25, min_factor=0.05)
    idle = Signals(at=10.0, gpu_util=0.0, kv_cache_usage=0.0, waiting=0)
    busy = Signals(at=10.0, gpu_util=1.0, kv_cache_usage=1.0, waiting=4)
    assert effective_weight(2.0, idle, 11.0, 5.0, c) == (2.0, False)
    w, stale = effective_weight(2.0, busy, 11.0, 5.0, c)
    assert w == pytest.approx(2.0 * 0.5 * 0.5 / 2.0) and not stale
    assert effective_weight(2.0, busy, 16.0, 5.0, c) == (2.0, True)  # too old: static weight
    assert effective_weight(2.0, None, 0.0, 5.0, c) == (2.0, True)
    floor = Coefficients(gpu=1.0, kv_cache=1.0, queue=0.0, min_factor=0.1)
    assert effective_weight(1.0, busy, 10.0, 5.0, floor)[0] == pytest.approx(0.1)
    # Decode speed: only slower than the pool's median costs weight, by the ratio ^ tpot.
    assert speed(0.05, 0.02, c) == pytest.approx(0.4)
    assert speed(0.05, 0.08, c) == 1.0
    assert speed(0.05, None, c) == speed(None, 0.02, c) == 1.0  # no peers, or no figure
    assert speed(0.05, 0.02, Coefficients(tpot=0.5)) == pytest.approx(0.4**0.5)
    assert speed(0.05, 0.02, Coefficients(tpot=0.0)) == 1.0


def test_a_slow_decoder_loses_weight_before_its_streams_pile_up() -> None:
    """Same load signals everywhere, one worker decodes 2.5x slower: its share of new sessions
    falls at once (relative to the median of the fresh backends, so a pool that is slow as a
    whole keeps equal shares), and a stale or missing figure does not count."""
    pool = make_pool(n=4, c=1.25)  # smoothing 20 s
    slow = pool.backends["w3"]
    for x in pool.backends.values():  # before the first tokens: no figure yet
        x.signals = Signals(at=9.0, gpu_util=0.3)
    pool.refresh(9.0)
    assert slow.effective_weight == pytest.approx(0.85)
    for x in pool.backends.values():  # a second later, not 20 s of smoothing later
        x.signals = Signals(at=10.0, gpu_util=0.3, tpot=0.05 if x is slow else 0.02)
    pool.refresh(10.0)
    assert slow.effective_weight == pytest.approx(0.85 * 0.4 * 1.15)  # band: 0.4 -> 0.46
    assert [pool.backends[f"w{i}"].effective_weight for i in range(3)] == [pytest.approx(0.85)] * 3
    counts = {b: 0 for b in pool.backends}
    for i in range(400):
        b = pool.select(f"k{i}", now=10.0)
        assert b is not None
        pool.attach(f"k{i}", b, 10.0)
        counts[b.id] += 1
    share = slow.effective_weight / sum(b.effective_weight for b in pool.backends.values())
    assert counts["w3"] <= math.ceil(1.25 * 400 * share) < 0.7 * 100, counts  # its ring: 1/4
    # Everyone equally slow: equal weights again.
    even = make_pool(n=4)
    for b in even.backends.values():
        b.signals = Signals(at=10.0, tpot=0.2)
    even.refresh(10.0)
    assert {b.effective_weight for b in even.backends.values()} == {1.0}


def test_hot_worker_takes_fewer_new_sessions_and_keeps_ring_and_affinity() -> None:
    pool = make_pool(n=3, c=1.25)
    keys = [f"k{i}" for i in range(300)]
    owners_before = {k: pool.ring.owner(k) for k in keys}
    ring = pool.ring
    pool.backends["w0"].signals = Signals(at=100.0, gpu_util=1.0, kv_cache_usage=0.9, waiting=6)
    for bid in ("w1", "w2"):
        pool.backends[bid].signals = Signals(at=100.0, gpu_util=0.1, kv_cache_usage=0.1)
    counts = {"w0": 0, "w1": 0, "w2": 0}
    for k in keys:
        b = pool.select(k, now=101.0)
        assert b is not None
        pool.attach(k, b)
        counts[b.id] += 1
    assert counts["w0"] < 0.5 * min(counts["w1"], counts["w2"])
    assert pool.ring is ring  # weights changed, the ring did not
    assert {k: pool.ring.owner(k) for k in keys} == owners_before
    # Stale signals: back to connection counts on static weights.
    fresh = make_pool(n=3, c=1.25)
    fresh.backends["w0"].signals = Signals(at=100.0, gpu_util=1.0, kv_cache_usage=0.9, waiting=6)
    for k in keys:
        b = fresh.select(k, now=200.0)
        assert b is not None
        fresh.attach(k, b)
    assert fresh.backends["w0"].stale
    assert fresh.backends["w0"].sessions >= 80


def test_outlier_ejection_grows_and_is_capped() -> None:
    pool = make_pool(n=4)
    # Defaults: 5 consecutive failures, 30 s base ejection, at most 50% ejected.
    b = pool.backends["w1"]
    for _ in range(4):
        assert not pool.failed(b, now=0.0)
    assert pool.failed(b, now=0.0) and b.state == "ejected"
    assert pool.select("x", [], now=1.0) is not None
    assert all(pool.select(f"k{i}", now=1.0).id != "w1" for i in range(50))  # type: ignore[union-attr]
    pool.refresh(now=30.0)
    assert b.ready and b.state == "active"
    for _ in range(5):
        pool.failed(b, now=31.0)
    assert b.ejected_until == pytest.approx(31.0 + 60.0)  # second ejection lasts twice as long
    # No more than max_ejection_percent (50%) of the pool at once: 2 of 4.
    for name in ("w2", "w3"):
        for _ in range(5):
            pool.failed(pool.backends[name], now=32.0)
    assert sum(x.ejected for x in pool.backends.values()) == 2


def test_success_resets_the_failure_streak() -> None:
    pool = make_pool(n=2)
    b = pool.backends["w0"]
    for _ in range(4):
        pool.failed(b, now=0.0)
    pool.succeeded(b)
    for _ in range(4):
        assert not pool.failed(b, now=0.0)


def test_probe_flips_after_fall_and_rise() -> None:
    pool = make_pool(n=2)
    b = pool.backends["w0"]
    assert not b.probe(False, rise=2, fall=3)
    assert not b.probe(False, rise=2, fall=3)
    assert b.probe(False, rise=2, fall=3) and b.state == "down"
    assert not b.probe(True, rise=2, fall=3)
    assert b.probe(True, rise=2, fall=3) and b.state == "active"
    assert place(pool, "after") in {"w0", "w1"}


def test_load_factor_is_smoothed_over_time_but_starts_from_the_first_scrape() -> None:
    pool = make_pool(n=2)  # weights.smoothing defaults to 20 s
    b = pool.backends["w0"]
    b.signals = Signals(at=10.0, gpu_util=1.0)  # factor 0.5
    pool.refresh(10.0)
    assert b.effective_weight == pytest.approx(0.5)  # first good scrape: taken as is
    b.signals = Signals(at=11.0, gpu_util=0.0)  # one idle scrape...
    pool.refresh(11.0)
    assert 0.5 < b.effective_weight < 0.55  # ...moves it only part of the way (1 - e^-1/20)
    for t in range(12, 140):
        b.signals = Signals(at=float(t), gpu_util=0.0)
        pool.refresh(float(t))
    assert b.effective_weight == pytest.approx(1.0, abs=0.01)
    pool.refresh(200.0)  # stale: straight back to the static weight
    assert b.stale and b.effective_weight == 1.0


def test_denoise_equalises_noise_and_shrinks_real_differences_by_the_band() -> None:
    assert denoise({"a": 0.50, "b": 0.55, "c": 0.47, "d": 0.52}, 0.15) == {
        k: pytest.approx(0.51)
        for k in "abcd"  # median of the four; all within +/-15%
    }
    out = denoise({"a": 0.50, "b": 0.50, "c": 0.50, "hot": 0.25}, 0.15)
    assert out["a"] == out["b"] == out["c"] == pytest.approx(0.50)
    assert out["hot"] == pytest.approx(0.25 * 1.15)  # half the median: still well below it
    assert denoise({"a": 1.0, "b": 2.0}, 0.15)["b"] == pytest.approx(1.5 / 1.15 * 2.0 / 1.5)
    assert denoise({"a": 0.3}, 0.15) == {"a": 0.3}
    assert denoise({"a": 0.3, "b": 0.6}, 0.0) == {"a": 0.3, "b": 0.6}


def test_identical_workers_with_noisy_signals_get_equal_weights() -> None:
    """Scrape noise (here +/-10% of GPU utilisation) must not set identical workers' shares
    apart, or returning keys are pushed off their worker by a bound that moved."""
    pool = make_pool(n=4)
    for b, util in zip(pool.backends.values(), (0.8, 0.7, 0.9, 0.75), strict=True):
        b.signals = Signals(at=10.0, gpu_util=util)
    pool.refresh(10.0)
    weights = {b.effective_weight for b in pool.backends.values()}
    assert len(weights) == 1
    hot = pool.backends["w3"]
    utils = {b.id: b.signals.gpu_util if b.signals else 0.0 for b in pool.backends.values()}
    for t in range(11, 60):  # hot for longer than the smoothing: factor 0.5 / 3
        for b in pool.backends.values():
            hot_now = b is hot
            b.signals = Signals(
                at=float(t), gpu_util=1.0 if hot_now else utils[b.id], waiting=8 if hot_now else 0
            )
        pool.refresh(float(t))
    assert hot.effective_weight < 0.5 * pool.backends["w0"].effective_weight
