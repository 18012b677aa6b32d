"""Placement for the whole conversation, and moves only when they pay (``balancer.selection``).

The unit tests build pools and signals by hand (no sockets, no clock). The last test is the
issue's case end to end: a burst of new conversations on identical reference workers, through
a real wslb, real websockets clients opening a connection per turn and sending the whole
conversation each time: no worker ends with more than its share plus a small margin, and no
returning key moves.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from balancer.backend import Backend
from balancer.config import BackendCfg, PlacementCfg, PoolCfg, WeightsCfg, parse
from balancer.pool import Pool
from balancer.ring import Ring
from balancer.selection import Rules, consistent, evicted, move_pays
from balancer.weights import Coefficients, Signals, parse_signals, resolve_mapping
from tests.procs import Worker, Wslb, pool_config

# Weights off: shares are the static weights, so only the rules under test act.
FLAT = WeightsCfg(
    coefficients=Coefficients(gpu=0, kv_cache=0, queue=0, tpot=0, noise_band=0), smoothing=0.0
)


def make_pool(n: int = 3, placement: PlacementCfg | None = None, **pool: Any) -> Pool:
    cfg = PoolCfg(
        name="p",
        weights=FLAT,
        placement=placement or PlacementCfg(),
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in range(n)),
        **pool,
    )
    return Pool(cfg, seed=1)


def skewed_keys(ids: list[str], n: int, favoured: str, share: float) -> list[str]:
    """``n`` keys of which ``share`` hash to ``favoured`` first (the rest to the others)."""
    ring = Ring(dict.fromkeys(ids, 1.0))
    want = round(n * share)
    mine: list[str] = []
    rest: list[str] = []
    for i in range(100_000):
        k = f"conv-{i}"
        (mine if ring.owner(k) == favoured else rest).append(k)
        if len(mine) >= want and len(rest) >= n - want:
            break
    keys = mine[:want] + rest[: n - want]
    random.Random(5).shuffle(keys)
    return keys


def backend(bid: str, **state: float) -> Backend:
    b = Backend(BackendCfg(id=bid, url="ws://127.0.0.1:9"))
    for k, v in state.items():
        setattr(b, k, v)
    return b


# -- placement of new keys ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5, 8])
def test_a_burst_of_new_keys_is_spread_while_others_have_room(n: int) -> None:
    """All placed before any load shows: the worker the ring favours (40% of the keys) gets
    its share, not its ``c`` bound; ``choices: 1`` (plain bounded-load hashing) stacks it."""
    ids = [f"w{i}" for i in range(n)]
    keys = skewed_keys(ids, 30 * n, "w0", 0.4)
    spread = make_pool(n)
    stacked = make_pool(n, PlacementCfg(choices=1))
    for pool in (spread, stacked):
        for k in keys:
            b = pool.select(k, now=1.0)
            assert b is not None
            pool.attach(k, b, now=1.0)
    share = len(keys) / n
    counts = {b.id: b.counted for b in spread.backends.values()}
    assert max(counts.values()) <= share + 2, counts
    assert stacked.backends["w0"].counted >= math.ceil(1.25 * share) - 1  # at its bound
    refused = spread.backends["w0"].refused
    assert refused.get("load", 0) > 0  # why its keys went elsewhere, for operators


def test_ring_order_decides_among_equals() -> None:
    """At rest, or within ``slack``, a key goes to its ring owner: its worker is predictable."""
    pool = make_pool(4)
    for k in (f"k{i}" for i in range(50)):
        b = pool.select(k, now=1.0)
        assert b is not None and b.id == pool.ring.owner(k)  # nothing counted: all equal
        pool.cancel(k)
    for b in pool.backends.values():  # ten live conversations each: the bounds have room
        for i in range(10):
            pool.attach(f"{b.id}-{i}", b, now=1.0)
    b0 = pool.backends["w0"]
    for i in range(2):  # w0 two conversations ahead: more than slack 1 above the lightest
        pool.attach(f"live{i}", b0, now=1.0)
    own = [k for k in (f"o{i}" for i in range(1000)) if pool.ring.owner(k) == "w0"][:5]

    def peek(k: str) -> Backend | None:
        b = pool.select(k, now=1.0)
        pool.cancel(k)
        return b

    assert all(peek(k) is not b0 for k in own)
    pool.detach(b0, None, now=1.0)  # one ahead: within slack, the ring decides again
    assert all(peek(k) is b0 for k in own)


def test_a_candidate_without_kv_room_is_passed_over_while_another_has_it() -> None:
    rules = Rules(choices=2, kv_limit=0.9)
    full = backend("full", kv_capacity=10_000.0, kv_demand=8_500.0)
    roomy = backend("roomy", kv_capacity=10_000.0, kv_demand=2_000.0)
    walk = ["full", "roomy"]
    # 8,500 + 1,000 > 0.9 x 10,000: the new conversation would not fit in the first.
    choice = consistent([full, roomy], walk, rules, size=1_000.0)
    assert choice.backend is roomy and choice.passed == ((full, "kv"),)
    # A small conversation fits: the ring's first keeps it.
    assert consistent([full, roomy], walk, rules, size=100.0).backend is full
    # Neither has room: the load rule decides (here: the ring's first, all equal).
    roomy.kv_demand = 9_500.0
    assert consistent([full, roomy], walk, rules, size=1_000.0).backend is full
    # Unknown size (no capacity scraped): always room.
    blind = backend("blind")
    assert consistent([blind, roomy], ["blind", "roomy"], rules, size=1e9).backend is blind


def test_candidates_stay_within_the_bound_and_say_so() -> None:
    """A candidate above its ``c`` bound is passed over as ``bound``, as before."""
    rules = Rules(choices=2)
    busy = backend("busy", sessions=10)
    idle = backend("idle")
    choice = consistent([busy, idle], ["busy", "idle"], rules)
    assert choice.backend is idle and choice.passed == ((busy, "bound"),)


# -- the move rule ------------------------------------------------------------------------------


def test_the_move_pays_only_when_the_wait_costs_more_than_the_reprefill() -> None:
    home = backend("home", wait_s=2.0, prefill_s=0.001)
    other = backend("other", wait_s=0.0, prefill_s=0.001)
    # 1,000 tokens re-prefilled: 1 s; waiting 2 s at home > 1.5 x 1 s: move.
    assert move_pays(home, other, 1_000, 1.5, 0.0002)
    # 2,000 tokens: 2 s to re-prefill; 2 s at home is not worth 1.5 x 2 s: stay.
    assert not move_pays(home, other, 2_000, 1.5, 0.0002)
    # Break-even factor 1: 2 s wait against 1.9 s of prefill: move.
    assert move_pays(home, other, 1_900, 1.0, 0.0002)
    # The target's own wait counts against the move.
    other.wait_s = 1.0
    assert not move_pays(home, other, 1_000, 1.5, 0.0002)
    # No wait anywhere (identical workers at rest): never.
    home.wait_s = other.wait_s = 0.0
    assert not move_pays(home, other, 1, 1.5, 0.0002)
    # A backend that reports no prefill time is priced at the default.
    fast = backend("fast", wait_s=0.5)
    assert move_pays(fast, backend("x"), 1_000, 1.5, 0.0002)  # 0.5 > 1.5 x 0.2
    assert not move_pays(fast, backend("x"), 1_000, 1.5, 0.001)  # 0.5 < 1.5 x 1


def test_kv_pressure_at_home_is_a_prefill_paid_anyway() -> None:
    """Where the conversations counted exceed the KV cache, that share of a returning
    conversation is prefilled again even at home: it counts in the cost of staying."""
    home = backend("home", kv_capacity=10_000.0, context_counted=20_000.0, prefill_s=0.001)
    assert evicted(home) == pytest.approx(0.5)
    other = backend("other", prefill_s=0.001, wait_s=0.0)
    home.wait_s = 1.0
    # Stay: 1 + 0.5 x 1,000 x 0.001 = 1.5 s; move: 1 s (x 1.5 = 1.5): not more, stay.
    assert not move_pays(home, other, 1_000, 1.5, 0.0)
    home.wait_s = 1.1
    assert move_pays(home, other, 1_000, 1.5, 0.0)
    assert evicted(backend("fits", kv_capacity=10_000.0, context_counted=5_000.0)) == 0.0
    assert evicted(backend("unknown", context_counted=5_000.0)) == 0.0


def test_a_returning_key_stays_home_unless_the_move_pays() -> None:
    rules = Rules(choices=2)
    home = backend("home", wait_s=5.0, held=1)
    other = backend("other")
    walk = ["home", "other"]
    remembered = ("home", "home")
    # Size unknown (placed by another process): it stays.
    assert consistent([home, other], walk, rules, home, remembered).backend is home
    choice = consistent([home, other], walk, rules, home, remembered, context=1_000.0)
    assert choice.backend is other and choice.left == (home, "cost")
    choice = consistent([home, other], walk, rules, home, remembered, context=100_000.0)
    assert choice.backend is home and choice.left is None


def test_a_home_at_its_ceiling_is_left_and_says_so() -> None:
    rules = Rules(ceiling=1.5)
    home = backend("home", sessions=6)
    other = backend("other")
    choice = consistent([home, other], ["home", "other"], rules, None, ("home", "home"))
    assert choice.backend is other and choice.left == (home, "ceiling")
    assert choice.passed == ()  # the home is not also counted as a refused candidate


# -- the pool's estimates -----------------------------------------------------------------------


def test_conversations_are_sized_from_what_was_relayed() -> None:
    pool = make_pool(2, PlacementCfg(bytes_per_token=4.0))
    b0 = pool.backends["w0"]
    # Turn 1: the client sent 800 bytes (200 tokens), the worker 41 messages.
    pool.attach("c", b0, now=1.0)
    pool.detach(b0, "c", now=2.0, relayed=(800, 1, 41))
    conv = pool._convs["c"]
    assert (conv.turns, conv.context) == (1, pytest.approx(241))
    assert b0.context_counted == pytest.approx(241) and b0.turns_counted == 1  # held: counted
    # Turn 2 resends the whole conversation (1,200 bytes: 300 tokens) and gets 40 more.
    pool.attach("c", b0, now=3.0)
    pool.detach(b0, "c", now=4.0, relayed=(1200, 1, 40))
    assert (conv.turns, conv.context) == (2, pytest.approx(340))
    assert pool._growth.get() == pytest.approx((241 + 99) / 2)
    # An incremental client (one prompt of 40 bytes): the context only grows.
    pool.attach("c", b0, now=5.0)
    pool.detach(b0, "c", now=6.0, relayed=(40, 1, 40))
    assert conv.context == pytest.approx(380)
    # Its place lapses: counted nowhere, and the pool learns a conversation's length.
    pool.refresh(6.0 + pool.hold_s)
    assert b0.context_counted == 0 and b0.turns_counted == 0 and conv.on is None
    assert pool._turns.get() == 3 and pool._final.get() == pytest.approx(380)
    assert pool._new_size() == pytest.approx(380)
    # It comes back elsewhere: counted there, with its size.
    pool.attach("c", pool.backends["w1"], now=7.0)
    assert pool.backends["w1"].context_counted == pytest.approx(380)


def test_kv_demand_wait_and_prefill_come_from_the_signals() -> None:
    pool = make_pool(2)
    b0, b1 = pool.backends["w0"], pool.backends["w1"]
    for i in range(4):  # four conversations of one turn each, 250 tokens
        pool.attach(f"c{i}", b0, now=1.0)
        pool.detach(b0, f"c{i}", now=1.0, relayed=(800, 1, 50))
    b0.signals = Signals(
        at=2.0, waiting=4.0, running=2.0, tpot=0.02, prefill=0.0005, kv_capacity=2000.0
    )
    b1.signals = Signals(at=2.0, prefill=0.001, kv_capacity=4000.0)
    pool.refresh(2.0)
    assert b0.wait_s == pytest.approx(4 / 2 * 50 * 0.02)  # 2 s
    assert (b0.prefill_s, b1.prefill_s, b0.kv_capacity) == (0.0005, 0.001, 2000.0)
    # Context now (4 x 250) plus a turn ahead each at the growth per turn (250).
    assert b0.kv_demand == pytest.approx(4 * 250 + 4 * 250)
    assert b0.kv_headroom == pytest.approx(1 - 2000 / 2000)
    assert b1.kv_headroom == 1.0
    assert pool.rules.prefill_s == pytest.approx(0.00075)  # the median: the default for others


def test_prefill_time_per_token_is_scraped_from_two_counters() -> None:
    mapping = resolve_mapping("reference")
    text = (
        "# TYPE wslb_worker_prefill_seconds counter\n"
        "wslb_worker_prefill_seconds_total {s}\n"
        "# TYPE wslb_worker_prefill_tokens counter\n"
        "wslb_worker_prefill_tokens_total {n}\n"
        "# TYPE wslb_worker_kv_capacity_tokens gauge\n"
        "wslb_worker_kv_capacity_tokens 32000\n"
    )
    first = parse_signals(text.format(s=10.0, n=10_000), mapping, at=0.0).since(None, 20.0)
    assert first.prefill is None and first.kv_capacity == 32000  # history is not a rate
    second = parse_signals(text.format(s=12.0, n=11_000), mapping, at=1.0).since(first, 20.0)
    assert second.prefill == pytest.approx(0.002)  # 2 s for 1,000 tokens
    third = parse_signals(text.format(s=12.0, n=11_000), mapping, at=2.0).since(second, 20.0)
    assert third.prefill == pytest.approx(0.002)  # nothing prefilled: the figure stands


def test_vllm_kv_capacity_is_read_from_its_info_labels() -> None:
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",model="m"} 1.0\n'
    )
    sig = parse_signals(text, resolve_mapping("vllm"), at=0.0)
    assert sig.kv_capacity == 16 * 2048


def test_placement_settings_parse_with_their_defaults() -> None:
    def cfg(**placement: object) -> dict[str, object]:
        backends = [{"id": "w1", "url": "ws://127.0.0.1:9001"}]
        pool: dict[str, object] = {"name": "chat", "backends": backends}
        if placement:
            pool["placement"] = placement
        return {"pools": [pool]}

    (pool,) = parse(cfg()).pools
    assert pool.placement == PlacementCfg()
    (pool,) = parse(cfg(choices=3, slack=0.5, move_cost=2, kv_limit=0.8)).pools
    assert (pool.placement.choices, pool.placement.slack) == (3, 0.5)
    assert (pool.placement.move_cost, pool.placement.kv_limit) == (2.0, 0.8)
    from balancer.config import ConfigError

    with pytest.raises(ConfigError) as err:
        parse(cfg(choices=0))
    assert "pools[0].placement.choices" in str(err.value)


def test_schema_defaults_are_the_dataclass_defaults() -> None:
    from importlib import resources

    schema = json.loads(
        resources.files("balancer").joinpath("schema/balancer.schema.json").read_text()
    )
    props = schema["$defs"]["pool"]["properties"]["placement"]["properties"]
    d = PlacementCfg()
    assert {k: v["default"] for k, v in props.items()} == {
        "choices": d.choices,
        "slack": d.slack,
        "kv_limit": d.kv_limit,
        "move_cost": d.move_cost,
        "bytes_per_token": d.bytes_per_token,
        "prefill_ms_per_token": d.prefill_ms_per_token,
    }


# -- end to end: the burst ----------------------------------------------------------------

WORKER_ARGS = [
    "--tokens-per-s",
    "150",
    "--prefill-ms-per-token",
    "0.5",
    "--max-batch",
    "6",
    "--kv-capacity-tokens",
    "20000",
]
TURNS = 4
CONVERSATIONS = 30


async def conversation(url: str, key: str, seed: int) -> list[str]:
    """One chat: a new WebSocket per turn, the whole conversation sent each time; returns the
    worker of each turn (``done.worker``)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": " ".join(f"s{i}" for i in range(60))}]
    workers = []
    for turn in range(TURNS):
        if turn:
            await asyncio.sleep(rng.uniform(0.05, 0.4))
        prompt = " ".join(f"u{rng.randrange(1000)}" for _ in range(rng.randint(10, 30)))
        messages.append({"role": "user", "content": prompt})
        async with connect(f"{url}/ws?session={key}", compression=None) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            tokens = rng.randint(10, 25)
            await ws.send(
                json.dumps({"type": "prompt", "messages": messages, "max_tokens": tokens})
            )
            texts = []
            while True:
                m = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if m["type"] == "token":
                    texts.append(m["text"])
                elif m["type"] == "done":
                    assert m["tokens"] == tokens == len(texts), m
                    workers.append(str(m["worker"]))
                    break
        messages.append({"role": "assistant", "content": " ".join(texts)})
    return workers


@pytest.mark.parametrize("choices", [None, 1])
async def test_a_burst_of_new_conversations_stays_spread_and_none_moves(
    tmp_path: Path, choices: int | None
) -> None:
    """The issue's workload, small: 30 conversations arrive at once on three identical
    workers, 55% of them hashing to one; each grows over four turns. By default no worker
    ends with more than its share + 2, and every turn of a conversation is answered by the
    worker of its first (no returning key moves). ``choices: 1``, the placement before, stacks
    the favoured worker up to its bound: the case the test is about."""
    workers = [Worker(f"w{i}", WORKER_ARGS).start() for i in range(3)]
    ids = [w.id for w in workers]
    placement = {} if choices is None else {"placement": {"choices": choices}}
    cfg = pool_config(
        [{"id": w.id, "url": w.url} for w in workers],
        weights={"scrape_interval": "0.2s"},
        **placement,
    )
    cfg["timeouts"] = {"ping_interval": "30s", "close": "1s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        lb.wait_ready(
            until=lambda bs: all(b["state"] == "active" and not b["signals_stale"] for b in bs)
        )
        keys = skewed_keys(ids, CONVERSATIONS, "w0", 0.55)
        runs = await asyncio.gather(*(conversation(lb.url, k, i) for i, k in enumerate(keys)))
        first = Counter(turns[0] for turns in runs)
        moved = [k for k, turns in zip(keys, runs, strict=True) if len(set(turns)) > 1]
        share = CONVERSATIONS / len(workers)
        views = {b["id"]: b for b in lb.admin("/backends")}
        counters = {b: v["counters"] for b, v in views.items()}
        if choices == 1:
            assert first["w0"] > share + 1, (first, counters)  # up to its bound, 13
            return
        assert max(first.values()) <= share + 2, (first, counters)
        assert moved == [], (moved, first)
        for v in views.values():
            assert v["counters"]["moved_cost"] == v["counters"]["moved_ceiling"] == 0, v
            assert v["kv_headroom"] is not None and 0 < v["kv_headroom"] <= 1, v
            assert v["signals"]["kv_capacity"] == 20000, v["signals"]
            assert v["signals"]["prefill"] is not None, v["signals"]
        assert counters["w0"]["refused_load"] > 0, json.dumps(
            [first, counters]
        )  # why w0's keys went elsewhere
        metrics = lb.admin("/metrics")
        assert 'wslb_backend_kv_headroom_ratio{backend="w0",pool="chat"}' in metrics
        assert 'wslb_backend_placements_refused_total{backend="w0",pool="chat",reason="load"}' in (
            metrics
        )
        assert 'wslb_backend_moves_total{backend="w0",pool="chat",reason="cost"} 0.0' in metrics
    finally:
        lb.stop()
        for w in workers:
            w.stop()
