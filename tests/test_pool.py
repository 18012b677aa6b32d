"""Backend selection: bounded-load consistent hashing, affinity, readiness, other policies."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from balancer.config import (
    BackendCfg,
    DrainCfg,
    HealthCfg,
    KeySource,
    OutlierCfg,
    PoolCfg,
    WeightsCfg,
)
from balancer.pool import DRAINING, Pool
from balancer.weights import Signals


def make_pool(
    n: int = 4,
    balance: str = "consistent",
    c: float = 1.25,
    weights: list[float] | None = None,
    ceiling: float = PoolCfg("").affinity_ceiling,
) -> Pool:
    ws = weights or [1.0] * n
    cfg = PoolCfg(
        name="p",
        path_prefix="/",
        session_key=(KeySource("query", "session"),),
        balance=balance,
        hash_balance_factor=c,
        affinity_ceiling=ceiling,
        weights=WeightsCfg(),
        health=HealthCfg(),
        outlier=OutlierCfg(),
        drain=DrainCfg(),
        backends=tuple(
            BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}/ws", weight=ws[i])
            for i in range(len(ws))
        ),
    )
    return Pool(cfg, seed=1)


def peek(pool: Pool, key: str) -> str:
    """Where ``select`` would place the key, without counting the placement."""
    b = pool.select(key)
    assert b is not None
    pool.cancel(key)
    return b.id


def place(pool: Pool, key: str) -> str:
    b = pool.select(key)
    assert b is not None
    pool.attach(key, b)
    return b.id


@pytest.mark.parametrize("weights", [[1.0] * 4, [1.0, 2.0, 1.0], [3.0, 1.0]])
@pytest.mark.parametrize("c", [1.1, 1.25, 2.0])
def test_bounded_load_never_exceeded(weights: list[float], c: float) -> None:
    pool = make_pool(weights=weights, c=c)
    # A skewed workload: many keys hash to the same worker unless the bound stops it.
    keys = [f"hot-{i % 7}-{i}" for i in range(2000)]
    total_w = sum(weights)
    for i, k in enumerate(keys, start=1):
        place(pool, k)
        for b in pool.backends.values():
            assert b.sessions <= math.ceil(c * i * b.weight / total_w)


def test_sessions_detached_lower_the_load() -> None:
    pool = make_pool()
    placed = [(k, pool.select(k)) for k in ("a", "b", "c")]
    for k, b in placed:
        assert b is not None
        pool.attach(k, b)
    for _, b in placed:
        assert b is not None
        pool.detach(b)
    assert all(b.sessions == 0 for b in pool.backends.values())


def test_same_key_returns_to_its_worker_while_under_bound() -> None:
    pool = make_pool()
    first = {f"k{i}": place(pool, f"k{i}") for i in range(200)}
    again = {k: place(pool, k) for k in first}
    assert again == first


def test_key_placed_off_owner_by_the_bound_returns_to_that_worker() -> None:
    pool = make_pool(n=2, c=1.1)
    owner = pool.backends[pool.ring.owner("x") or ""]
    # Load the owner up to its bound, so "x" is placed on the other worker.
    for i in range(10):
        pool.attach(f"fill{i}", owner)
    b = pool.select("x")
    assert b is not None and b is not owner
    pool.attach("x", b)
    pool.detach(b)
    for _ in range(10):
        pool.detach(owner)  # the owner has room again...
    # ...but "x" returns to the worker that holds its KV cache, while that one has room.
    assert place(pool, "x") == b.id


def test_not_ready_backends_are_skipped_and_keys_come_back() -> None:
    pool = make_pool()
    keys = [f"s{i}" for i in range(300)]
    before = {k: pool.ring.owner(k) for k in keys}
    pool.backends["w1"].set_health(False)
    for k in keys:
        b = peek(pool, k)
        assert b != "w1"
        if before[k] != "w1":
            assert b == before[k]
    pool.backends["w1"].set_health(True)
    assert all(peek(pool, k) == before[k] for k in keys)
    pool.backends["w2"].set_admin(DRAINING)
    assert all(peek(pool, k) != "w2" for k in keys)


def test_exclude_walks_to_the_next_candidate() -> None:
    pool = make_pool()
    first = pool.select("key")
    assert first is not None
    second = pool.select("key", [first.id])
    assert second is not None and second.id != first.id
    assert pool.select("key", list(pool.backends)) is None


def test_add_and_remove_rebuild_the_ring() -> None:
    pool = make_pool(n=3)
    keys = [f"m{i}" for i in range(3000)]
    before = {k: pool.ring.owner(k) for k in keys}
    pool.add(BackendCfg(id="w9", url="ws://127.0.0.1:9999/ws"))
    moved = sum(before[k] != pool.ring.owner(k) for k in keys) / len(keys)
    assert 0.15 < moved < 0.35
    pool.remove("w9")
    assert all(before[k] == pool.ring.owner(k) for k in keys)


def test_least_conn_round_robin_random() -> None:
    lc = make_pool(balance="least_conn")
    counts = Counter(place(lc, f"k{i}") for i in range(400))
    assert set(counts.values()) == {100}
    rr = make_pool(balance="round_robin", weights=[2.0, 1.0, 1.0])
    seq = [place(rr, "same") for _ in range(8)]
    assert Counter(seq) == {"w0": 4, "w1": 2, "w2": 2}
    rnd = make_pool(balance="random")
    counts = Counter(place(rnd, f"k{i}") for i in range(2000))
    assert all(350 < n < 650 for n in counts.values())


def test_no_ready_backend_gives_none() -> None:
    pool = make_pool(n=2)
    for b in pool.backends.values():
        b.set_health(False)
    assert pool.select("k") is None


def test_placements_are_forgotten_after_the_ttl_and_kept_while_live() -> None:
    from balancer.pool import AFFINITY_TTL

    pool = make_pool(n=2)
    b = pool.select("old", now=1.0)
    assert b is not None
    pool.attach("old", b, now=1.0)
    live = pool.select("live", now=1.0)
    assert live is not None
    pool.attach("live", live, now=1.0)
    pool.detach(b, "old", now=2.0)  # "old" ended at t=2; "live" is still connected
    pool.detach(live, "live", now=AFFINITY_TTL)  # ...until AFFINITY_TTL
    other = pool.select("x", now=AFFINITY_TTL + 3.0)
    assert other is not None
    pool.attach("x", other, now=AFFINITY_TTL + 3.0)  # pruning happens on attach
    assert pool.last_backend("old") is None
    assert pool.last_backend("live") == live.id


def test_returning_key_takes_back_its_held_place() -> None:
    """Between turns a key's place stays counted on its worker, so new keys that hash there
    fill it only up to the bound *with* that place, and the key gets it back. Without holds
    the worker would be full of new keys and the key would move (and lose its KV cache)."""
    pool = make_pool(n=2, c=1.25)
    owner = pool.backends[pool.ring.owner("x") or ""]
    assert place(pool, "x") == owner.id
    pool.detach(owner, "x", now=1.0)
    assert (owner.sessions, owner.held, owner.counted) == (0, 1, 1)
    same = [k for k in (f"n{i}" for i in range(400)) if pool.ring.owner(k) == owner.id][:40]
    for k in same:
        b = pool.select(k, now=2.0)
        assert b is not None
        pool.attach(k, b, now=2.0)
    assert owner.sessions < len(same)  # the bound sent some of them to the other worker
    assert pool.select("x", now=3.0) is owner
    pool.attach("x", owner, now=3.0)
    assert (owner.held, owner.sessions) == (0, owner.counted)


def test_held_places_expire_and_attaching_elsewhere_releases_them() -> None:
    pool = make_pool(n=3)
    a, b = pool.backends["w0"], pool.backends["w1"]
    pool.attach("k", a, now=0.0)
    pool.detach(a, "k", now=10.0)
    pool.attach("j", a, now=10.0)
    pool.detach(a, "j", now=20.0)
    assert a.held == 2
    pool.refresh(10.0 + pool.hold_s)  # k's hold ends, j's does not
    assert a.held == 1
    pool.attach("j", b, now=21.0)  # j came back elsewhere: its place on a is given back
    assert (a.held, a.counted, b.counted) == (0, 0, 1)
    pool.detach(b, None, now=22.0)  # a migration's old leg: no hold
    assert b.held == 0


def test_held_places_yield_when_their_worker_goes_above_its_bound() -> None:
    """A held place is a reservation: when the worker's weight falls below what it counts,
    its places go, the longest-quiet first, down to its limit (here the strict bound: the
    ceiling at c). Live sessions stay."""
    pool = make_pool(n=2, c=1.25, ceiling=1.25)
    hot, cool = pool.backends["w0"], pool.backends["w1"]
    for i in range(6):
        pool.attach(f"a{i}", hot, now=0.0)
        pool.attach(f"b{i}", cool, now=0.0)
    for i in range(4):
        pool.detach(hot, f"a{i}", now=1.0 + i)  # a0 quiet longest
    for i in range(3):
        pool.detach(cool, f"b{i}", now=1.0 + i)
    pool.refresh(5.0)
    assert (hot.sessions, hot.held, cool.sessions, cool.held) == (2, 4, 3, 3)  # within bounds
    hot.signals = Signals(at=6.0, gpu_util=1.0, kv_cache_usage=1.0)
    cool.signals = Signals(at=6.0)
    pool.refresh(6.0)
    total = hot.counted + cool.counted
    weights = hot.effective_weight + cool.effective_weight
    bound = math.ceil(1.25 * total * hot.effective_weight / weights - 1e-9)
    assert hot.sessions == 2 and hot.held == 2 and hot.counted == bound  # two places gone
    assert cool.held == 3  # a worker within its bound keeps its places
    # The places given up were a0 and a1: a2 still takes its own place back.
    before = hot.counted
    pool.attach("a2", hot, now=7.0)
    assert hot.counted == before
    pool.attach("a0", hot, now=7.0)
    assert hot.counted == before + 1


@pytest.mark.parametrize(("c", "ceiling"), [(1.1, 1.1), (1.25, 1.25), (1.1, 2.0), (1.25, 2.0)])
def test_bound_holds_at_every_placement_with_held_places(c: float, ceiling: float) -> None:
    """No placement takes a backend's counted load (live + held) above its limit: the bound
    for a new key, the ceiling for a key returning to its worker (none is overloaded here)."""
    import random

    pool = make_pool(n=4, c=c, ceiling=ceiling)
    rng = random.Random(7)
    live: dict[str, str] = {}
    now = 0.0
    for step in range(3000):
        now += 0.05
        key = f"c{rng.randrange(300)}"
        if key in live and rng.random() < 0.7:
            pool.detach(pool.backends[live.pop(key)], key, now=now)
            continue
        if key in live:
            continue
        returning = pool.last_backend(key)
        b = pool.select(key, now=now)
        assert b is not None
        before = b.counted
        pool.attach(key, b, now=now)
        live[key] = b.id
        total = sum(x.counted for x in pool.backends.values())
        limit = max(c, ceiling) if returning == b.id else c
        # Taking back its own held place leaves the count as it was; anything else fits.
        assert b.counted == before or b.counted <= math.ceil(limit * total / 4 - 1e-9), step
