"""Affinity first (``balancer.selection``): a returning key stays on its worker unless the
move pays, up to a hard ceiling; new keys obey the bound; overload is measured and reported.
Sans-I/O: pools and signals built by hand, no clock, no sockets. (The placement of new keys
and the move rule's formula: tests/test_placement.py.)"""

from __future__ import annotations

import pytest

from balancer.config import BackendCfg, ConfigError, PoolCfg, WeightsCfg, parse
from balancer.pool import Pool
from balancer.ring import Ring, load_bound
from balancer.selection import overloaded
from balancer.weights import Coefficients, Signals

# No noise band: the pressures below are the ratios the signals give.
COEF = Coefficients(noise_band=0.0)


def make_pool(n: int = 3, c: float = 1.25, ceiling: float = 2.0, ratio: float = 1.5) -> Pool:
    cfg = PoolCfg(
        name="p",
        hash_balance_factor=c,
        affinity_ceiling=ceiling,
        overload_ratio=ratio,
        weights=WeightsCfg(coefficients=COEF, smoothing=0.0),
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in range(n)),
    )
    return Pool(cfg, seed=1)


def keys_owned_by(pool: Pool, owner: str, n: int, prefix: str = "k") -> list[str]:
    out = [k for k in (f"{prefix}{i}" for i in range(10_000)) if pool.ring.owner(k) == owner]
    return out[:n]


def scrape(pool: Pool, at: float, **gpu: float) -> None:
    """Fresh signals for every backend (GPU utilisation by id, 0 for the others)."""
    for b in pool.backends.values():
        b.signals = Signals(at=at, gpu_util=gpu.get(b.id, 0.0))


def bound(pool: Pool, b_id: str, c: float, extra: int = 0) -> int:
    ready = [b for b in pool.backends.values() if b.ready]
    total = sum(b.counted for b in ready) + extra
    w = sum(b.effective_weight for b in ready)
    return load_bound(total, c, pool.backends[b_id].effective_weight, w)


# -- overloaded(): the threshold and its hysteresis ---------------------------------------------


def test_overloaded_enters_at_the_ratio_and_leaves_half_way_back() -> None:
    # pressure = median factor / own factor; median of {1, 1, f} is 1
    def over(f: float, was: set[str]) -> bool:
        return "hot" in overloaded({"a": 1.0, "b": 1.0, "hot": f}, was, 1.5)

    assert not over(1 / 1.49, set())  # pressure 1.49: not yet
    assert over(1 / 1.5, set())  # 1.5: overloaded
    assert over(1 / 1.3, {"hot"})  # 1.3: still, having been (leaves below 1.25)
    assert not over(1 / 1.3, set())  # ... but 1.3 alone does not make it
    assert not over(1 / 1.2, {"hot"})  # 1.2: recovered
    assert overloaded({"a": 1.0, "b": 1.0, "hot": 0.0}, set(), 1.5) == {"hot"}


def test_overloaded_needs_peers_and_a_ratio_above_one() -> None:
    assert overloaded({"alone": 0.1}, set(), 1.5) == set()  # nothing to compare with
    assert overloaded({"a": 1.0, "hot": 0.1}, set(), 1.0) == set()  # the test turned off
    # Two workers: the median is their mean, so the hot one's pressure is 0.55 / 0.1.
    assert overloaded({"a": 1.0, "hot": 0.1}, set(), 1.5) == {"hot"}


def test_the_pool_keeps_overload_across_refreshes_and_ignores_stale_backends() -> None:
    pool = make_pool()
    scrape(pool, 1.0, w0=0.7)  # factor 1 - 0.5 x 0.7 = 0.65: pressure 1.54
    pool.refresh(1.0)
    assert pool.overloaded == {"w0"}
    scrape(pool, 2.0, w0=0.5)  # 0.75: pressure 1.33, between the thresholds
    pool.refresh(2.0)
    assert pool.overloaded == {"w0"}
    scrape(pool, 3.0, w0=0.3)  # 0.85: pressure 1.18
    pool.refresh(3.0)
    assert pool.overloaded == set()
    scrape(pool, 4.0, w0=0.5)  # 1.33 again: not enough to enter
    pool.refresh(4.0)
    assert pool.overloaded == set()
    scrape(pool, 5.0, w0=1.0)
    pool.refresh(5.0 + WeightsCfg().stale_after + 1)  # every scrape stale: nothing measured
    assert pool.overloaded == set()


# -- the rule in the pool -----------------------------------------------------------------------


def fill_past_the_bound(pool: Pool) -> tuple[str, list[str]]:
    """w0's own keys placed on it while the pool was busy, then the pool emptied around them:
    w0 ends above its ``c`` bound, below the ceiling. Returns w0's id and its keys."""
    own = keys_owned_by(pool, "w0", 4)
    w1, w2 = keys_owned_by(pool, "w1", 4, "o"), keys_owned_by(pool, "w2", 4, "o")
    order = [k for three in zip(w1, w2, own, strict=True) for k in three]
    others = w1 + w2
    for k in order:
        b = pool.select(k, now=1.0)
        assert b is not None
        pool.attach(k, b, now=1.0)
    assert all(pool.last_backend(k) == "w0" for k in own)
    assert all(pool.last_backend(k) != "w0" for k in others)
    for i, k in enumerate(own):
        pool.detach(pool.backends["w0"], k, now=2.0 + i)  # between turns: held
    for k in others[:5]:  # five other conversations end for good (no hold)
        pool.detach(pool.backends[pool.last_backend(k) or ""], None, now=2.0)
    # 7 counted, 4 on w0: its bound is ceil(1.25 x 7 / 3) = 3, its ceiling ceil(2 x 7 / 3) = 5.
    return "w0", own


def test_a_returning_key_stays_above_the_bound_while_its_worker_is_not_overloaded() -> None:
    pool = make_pool()
    home, own = fill_past_the_bound(pool)
    pool.refresh(3.0)
    assert pool.backends[home].counted == 4 > bound(pool, home, 1.25)  # above c x its share
    for k in own:
        b = pool.select(k, now=3.0)
        assert b is not None and b.id == home
        pool.attach(k, b, now=3.0)


def test_the_strict_bound_when_the_ceiling_is_not_above_it() -> None:
    """``affinity_ceiling`` at or below ``hash_balance_factor``: the rule before (keys move)."""
    pool = make_pool(ceiling=1.25)
    home, own = fill_past_the_bound(pool)
    pool.refresh(3.0)  # held places above the bound give way
    assert pool.backends[home].counted == bound(pool, home, 1.25) < 4
    moved = 0
    for k in own:
        b = pool.select(k, now=3.0)
        assert b is not None
        moved += b.id != home
        pool.attach(k, b, now=3.0)
    assert moved > 0


def test_an_overloaded_worker_keeps_its_returning_keys() -> None:
    """Overload alone moves nothing: a miss costs the same whoever takes it."""
    pool = make_pool()
    home, own = fill_past_the_bound(pool)
    scrape(pool, 3.0, w0=0.8)  # factor 0.6: pressure 1.67
    pool.refresh(3.0)
    assert pool.overloaded == {home}
    b0 = pool.backends[home]
    assert b0.counted == 4  # its held places stay: within the ceiling
    for k in own:
        b = pool.select(k, now=3.0)
        assert b is b0
        pool.attach(k, b, now=3.0)
    assert b0.moved == {}


def test_returning_keys_move_when_the_wait_costs_more_than_the_reprefill() -> None:
    """A queue whose expected wait exceeds re-prefilling the conversation elsewhere moves its
    returning keys, counted on the worker they left. (Weights off: no bound or ceiling acts.)"""
    cfg = PoolCfg(
        name="p",
        weights=WeightsCfg(
            coefficients=Coefficients(gpu=0, kv_cache=0, queue=0, tpot=0, noise_band=0),
            smoothing=0.0,
        ),
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in range(3)),
    )
    pool = Pool(cfg, seed=1)
    home, own = fill_past_the_bound(pool)
    b0 = pool.backends[home]
    for k in own:  # a turn each: ~1,000 tokens of context, 50-token answers
        b = pool.select(k, now=3.0)
        assert b is b0
        pool.attach(k, b, now=3.0)
        pool.detach(b0, k, now=4.0, relayed=(4000, 1, 50))
    for b in pool.backends.values():
        b.signals = Signals(at=4.0, waiting=0.0, running=1.0, tpot=0.05)
    # w0 queues 2 requests per running one at 50 ms a token: a turn waits 2 x 50 x 0.05 = 5 s.
    b0.signals = Signals(at=4.0, waiting=20.0, running=10.0, tpot=0.05)
    pool.refresh(4.0)
    assert b0.wait_s == pytest.approx(5.0)
    first = own[0]
    conv = pool._convs[first]
    assert conv.turns == 1 and conv.context == pytest.approx(4000 / 4 + 50)
    placed = []
    for k in own:
        b = pool.select(k, now=4.0)
        assert b is not None
        placed.append(b.id)
        pool.attach(k, b, now=4.0)
    # 5 s > 1.5 x (1,050 tokens x 0.2 ms): each move pays while a target is within its
    # bound; the last finds w1 and w2 at theirs (ceil(1.25 x 7 / 3) = 3) and stays.
    assert placed == ["w1", "w1", "w1", "w0"]
    assert b0.moved == {"cost": 3}
    assert pool.backends["w1"].context_counted == pytest.approx(3 * 1050)  # they went along


def test_the_ceiling_stops_a_worker_that_is_not_overloaded() -> None:
    """Returning keys fill their worker only up to ``affinity_ceiling`` x its share."""
    pool = make_pool(n=2, ceiling=1.5)
    own = keys_owned_by(pool, "w0", 30)
    b0, b1 = pool.backends["w0"], pool.backends["w1"]
    for k in own:  # 30 conversations on w0, placed there by hand
        pool.attach(k, b0, now=1.0)
    for k in own:
        pool.detach(b0, k, now=2.0)
    for i in range(6):
        pool.attach(f"live{i}", b1, now=2.0)
    pool.refresh(2.5)  # 30 places held on w0 of 36: above its ceiling, the oldest give way
    assert bound(pool, "w0", 1.25) < b0.counted == bound(pool, "w0", 1.5) < 30
    placed = []
    for k in own:
        b = pool.select(k, now=3.0)
        assert b is not None
        pool.attach(k, b, now=3.0)
        placed.append(b.id)
        if b is b0:
            assert b0.counted <= bound(pool, "w0", 1.5)
    assert "w1" in placed and b0.counted > bound(pool, "w0", 1.25)


def test_new_keys_obey_the_bound_next_to_returning_keys_above_it() -> None:
    pool = make_pool()
    home, own = fill_past_the_bound(pool)
    for k in own:
        b = pool.select(k, now=3.0)
        assert b is not None and b.id == home
        pool.attach(k, b, now=3.0)
    placed = []
    for k in keys_owned_by(pool, home, 20, prefix="new"):
        b = pool.select(k, now=4.0)
        assert b is not None
        pool.attach(k, b, now=4.0)
        placed.append(b.id)
        assert b.counted <= bound(pool, b.id, 1.25)  # only returning keys go above it
    # w0 above c x its share: the first new keys walk on; it takes more once the others fill.
    assert home not in placed[:2]


@pytest.mark.parametrize("ceiling", [1.25, 2.0])
def test_no_placement_exceeds_its_limit(ceiling: float) -> None:
    """Random arrivals, ends and returns, a worker turning hot and cool: every placement is
    within ``c`` x its share, or within the ceiling for a key back on its own worker while that
    one is not overloaded; taking back a held place adds nothing."""
    import random

    pool = make_pool(n=4, ceiling=ceiling)
    rng = random.Random(3)
    live: dict[str, str] = {}
    now = 0.0
    hot_turns = 0
    for step in range(3000):
        now += 0.05
        if step % 200 == 0:
            scrape(pool, now, w1=0.9 if (step // 200) % 2 else 0.0)
        key = f"c{rng.randrange(300)}"
        if key in live:
            if rng.random() < 0.7:
                pool.detach(pool.backends[live.pop(key)], key, now=now)
            continue
        home = pool.last_backend(key)
        b = pool.select(key, now=now)
        assert b is not None
        hot_turns += "w1" in pool.overloaded
        before = b.counted
        limit = pool.limit(b) if b.id == home else pool.factor
        pool.attach(key, b, now=now)
        live[key] = b.id
        assert b.counted == before or b.counted <= bound(pool, b.id, limit), step
    assert hot_turns > 0  # the overloaded branch was taken


def test_scaling_out_keeps_conversations_on_their_workers() -> None:
    """A worker joins: every bound shrinks, but conversations on workers that are not
    overloaded stay where their KV cache is, and new keys fill the newcomer. (What
    tests/test_routing.py does with real processes.)"""
    pool = make_pool(n=3)
    four = Ring({f"w{i}": 1.0 for i in range(4)})
    own = [k for k in keys_owned_by(pool, "w0", 200) if four.owner(k) == "w0"][:20]
    rest = [k for k in (f"r{i}" for i in range(200)) if pool.ring.owner(k) != "w0"][:10]
    order = [k for pair in zip(own[::2], own[1::2], rest, strict=True) for k in pair]
    where = {}
    for k in order:
        b = pool.select(k, now=1.0)
        assert b is not None
        pool.attach(k, b, now=1.0)
        pool.detach(b, k, now=1.0)
        where[k] = b.id
    on_w0 = [k for k in own if where[k] == "w0"]
    # Its ring share is 2/3 of these keys; placement gave it its share and a little more.
    assert 10 < len(on_w0) == pool.backends["w0"].counted <= 13  # ceil(1.25 x 30 / 3)
    pool.add(BackendCfg(id="w3", url="ws://127.0.0.1:9103"))
    pool.refresh(2.0)
    assert pool.backends["w0"].counted == len(on_w0) > bound(pool, "w0", 1.25) == 10
    for k in on_w0:
        b = pool.select(k, now=2.0)
        assert b is not None and b.id == "w0"
        pool.attach(k, b, now=2.0)
    fresh = [k for k in (f"f{i}" for i in range(400)) if pool.ring.owner(k) == "w0"][:5]
    assert all(pool.select(k, now=2.0).id != "w0" for k in fresh)  # type: ignore[union-attr]


# -- configuration ------------------------------------------------------------------------------


def config(**pool: object) -> dict[str, object]:
    backends = [{"id": "w1", "url": "ws://127.0.0.1:9001"}]
    return {"pools": [{"name": "chat", **pool, "backends": backends}]}


def test_config_defaults_and_values() -> None:
    (pool,) = parse(config()).pools
    assert (pool.affinity_ceiling, pool.overload_ratio) == (2.0, 1.5)
    assert (pool.affinity_ceiling, pool.overload_ratio) == (
        PoolCfg("p").affinity_ceiling,
        PoolCfg("p").overload_ratio,
    )
    (pool,) = parse(config(affinity_ceiling=1.25, overload_ratio=3)).pools
    assert (pool.affinity_ceiling, pool.overload_ratio) == (1.25, 3.0)


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"affinity_ceiling": 0.5}, "pools[0].affinity_ceiling: must be at least 1, got 0.5"),
        ({"affinity_ceiling": "high"}, "pools[0].affinity_ceiling: "),
        ({"overload_ratio": 1}, "pools[0].overload_ratio: must be greater than 1, got 1"),
    ],
)
def test_config_rejects(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(config(**pool))
    assert message in str(err.value)


def test_schema_defaults_are_the_dataclass_defaults() -> None:
    import json
    from importlib import resources

    schema = json.loads(
        resources.files("balancer").joinpath("schema/balancer.schema.json").read_text()
    )
    props = schema["$defs"]["pool"]["properties"]
    assert props["affinity_ceiling"]["default"] == PoolCfg("p").affinity_ceiling
    assert props["overload_ratio"]["default"] == PoolCfg("p").overload_ratio
