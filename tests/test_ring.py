"""Ketama ring and the bounded-load rule: spread, movement on membership change, bounds."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.ring import Ring, load_bound

KEYS = [f"session-{i}" for i in range(20_000)]


def owners(ring: Ring) -> dict[str, str | None]:
    return {k: ring.owner(k) for k in KEYS}


def test_spread_is_close_to_even() -> None:
    ring = Ring({f"w{i}": 1.0 for i in range(4)})
    counts = Counter(owners(ring).values())
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    for n in counts.values():
        assert 0.6 * 5000 < n < 1.4 * 5000


def test_weights_scale_the_share() -> None:
    ring = Ring({"big": 3.0, "small": 1.0})
    counts = Counter(owners(ring).values())
    assert 2.0 < counts["big"] / counts["small"] < 4.5


@pytest.mark.parametrize("n", [3, 4, 8])
def test_adding_a_backend_moves_about_one_in_n_plus_one(n: int) -> None:
    before = owners(Ring({f"w{i}": 1.0 for i in range(n)}))
    after = owners(Ring({f"w{i}": 1.0 for i in range(n + 1)}))
    moved = [k for k in KEYS if before[k] != after[k]]
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / (n + 1)) < 0.5 / (n + 1)
    # Every moved key went to the new backend: nothing shuffles between old ones.
    assert all(after[k] == f"w{n}" for k in moved)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_removing_a_backend_moves_only_its_keys(n: int) -> None:
    before = owners(Ring({f"w{i}": 1.0 for i in range(n)}))
    after = owners(Ring({f"w{i}": 1.0 for i in range(n - 1)}))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == f"w{n - 1}" for k in moved)
    assert abs(len(moved) / len(KEYS) - 1 / n) < 0.5 / n


def test_walk_visits_each_backend_once_from_the_owner() -> None:
    ring = Ring({"a": 1.0, "b": 1.0, "c": 1.0})
    walk = list(ring.walk("k"))
    assert sorted(walk) == ["a", "b", "c"] and walk[0] == ring.owner("k")
    assert list(Ring({}).walk("k")) == []


def test_ring_is_deterministic_across_instances() -> None:
    a, b = Ring({"x": 1.0, "y": 2.0, "z": 1.0}), Ring({"z": 1.0, "y": 2.0, "x": 1.0})
    assert all(a.owner(k) == b.owner(k) for k in KEYS[:2000])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0.1, max_value=10), min_size=1, max_size=8),
    st.floats(min_value=1.01, max_value=3.0),
    st.integers(min_value=0, max_value=500),
)
def test_bounds_leave_room_for_one_more(weights: list[float], c: float, load: int) -> None:
    total = sum(weights)
    room = sum(load_bound(load + 1, c, w, total) for w in weights)
    assert room >= load + 1
    for w in weights:
        assert load_bound(load + 1, c, w, total) <= math.ceil(c * (load + 1) * w / total)
