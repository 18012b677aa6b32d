"""The balance algorithms: which ready backend a new session goes to.

Kept apart from ``balancer.pool`` so that each policy is a small, sans-I/O function of what it is
given (the ready backends, the key's ring walk, their counts and effective weights) and can be
read and tested alone; the pool owns the state they read (membership, holds, the affinity table,
which backends are overloaded) and dispatches on ``balance``. Nothing here imports the pool.

``consistent``: affinity is the rule, load the exception.

- A *new* key (the pool has no placement for it) takes the first ready backend on its ring walk
  that stays within its bound, ``ring.load_bound`` with ``c = hash_balance_factor`` (HAProxy's
  and Envoy's bounded load), counting held places as ``balancer.pool`` describes.
- A *returning* key has a home: the backend it was last placed on (the affinity table, a bounded
  LRU like an HAProxy stick table), if the key's first ready backend on the ring is still the
  one it was then, else the backend holding its place. It stays there unless the home is
  *overloaded* (below), up to a hard ceiling: the same bound with ``affinity_ceiling`` in place
  of ``c``. An overloaded home keeps it only within the ``c`` bound. A key that leaves walks its
  ring as a new key does. If readiness changed since its placement (a worker went down and came
  back), the ring decides again, so keys return to a worker when it returns.
- So the ``c`` bound still decides where new conversations go, and what an overloaded worker
  keeps; the ceiling (``2`` by default) stops a worker that is not measurably slower from
  collecting everything, e.g. when the pool empties around the conversations it holds. Moving
  a conversation costs a prefill of its whole context on the new worker, which on an unhurried
  worker is never won back: the issue this rule answers measured 9 of 90 sessions moved by the
  bound, each a cold prefill, with no worker slow.
- *Overloaded*, measured relative to the peers: a backend's pressure is the median load factor
  of the ready backends with fresh signals divided by its own, where the load factor is its
  effective weight per unit of static weight (GPU, KV cache, queue and tpot, smoothed and
  denoised: ``balancer.weights``). It becomes overloaded at pressure ``>= overload_ratio``
  (1.5 by default: its measured headroom is two thirds of the median's or less) and stays so
  until its pressure falls below ``1 + (overload_ratio - 1) / 2`` (1.25), so a backend at the
  threshold does not flap. A backend with stale or no signals, or fewer than two fresh ready
  backends, cannot be measured and is never overloaded: the ceiling guards it.

A key holding a place on a ready backend is already counted there: placing it anywhere adds
nothing to the total, and taking its own place back adds nothing there.

``least_conn``: the fewest live sessions (every process's) per unit of effective weight, ties to
the lowest id. ``round_robin``: smooth weighted round robin, as nginx does it. ``random``: a
weighted draw from the pool's seeded ``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence, Set

from balancer.backend import Backend
from balancer.ring import load_bound
from balancer.weights import median

__all__ = ["SmoothRoundRobin", "consistent", "least_conn", "overloaded", "weighted_random"]


def overloaded(factors: Mapping[str, float], was: Set[str], ratio: float) -> set[str]:
    """The backends among ``factors`` (id -> load factor, fresh ready backends only) that are
    overloaded relative to their peers, given those that were (``was``): the hysteresis of the
    module docstring. ``ratio`` of 1 or less turns the test off (none is overloaded)."""
    if ratio <= 1.0 or len(factors) < 2:
        return set()
    mid = median(factors.values())
    if mid is None or mid <= 0:
        return set()
    leave = 1.0 + (ratio - 1.0) / 2.0
    out = set()
    for bid, f in factors.items():
        pressure = mid / f if f > 0 else math.inf
        if pressure >= ratio or (bid in was and pressure >= leave):
            out.add(bid)
    return out


def consistent(
    ready: Sequence[Backend],
    walk: Iterable[str],
    factor: float,
    held_on: Backend | None = None,
    remembered: tuple[str, str | None] | None = None,
    *,
    ceiling: float = 0.0,
    overloaded: Set[str] = frozenset(),
) -> Backend:
    """Affinity-first bounded-load consistent hashing over ``ready`` (not empty).

    ``walk`` is the key's ring walk (backend ids, nearest first); ``factor`` the pool's
    ``hash_balance_factor``, ``ceiling`` its ``affinity_ceiling`` (at or below ``factor``: a
    returning key obeys the ``factor`` bound, the rule before affinity came first).
    ``held_on`` is the backend the key holds a place on, if any; ``remembered`` its last
    placement: (backend placed on, the key's first ready backend then). ``overloaded``: ids of
    the backends measured overloaded (``overloaded()``).
    """
    by_id = {b.id: b for b in ready}
    holder = held_on if held_on is not None and by_id.get(held_on.id) is held_on else None
    total_after = sum(b.counted for b in ready) + (0 if holder is not None else 1)
    weight_sum = sum(b.effective_weight for b in ready)

    def fits(b: Backend, c: float) -> bool:
        after = b.counted if b is holder else b.counted + 1
        return after <= load_bound(total_after, c, b.effective_weight, weight_sum)

    on_ring = [b for bid in walk if (b := by_id.get(bid)) is not None]
    first = on_ring[0].id if on_ring else None
    home: Backend | None = None
    if remembered is not None:
        if remembered[1] == first:
            home = by_id.get(remembered[0])
    else:
        home = holder
    if home is not None:
        limit = factor if home.id in overloaded else max(factor, ceiling)
        if fits(home, limit):
            return home
    for b in on_ring:
        if fits(b, factor):
            return b
    # Unreachable with factor > 1 (the bounds sum above the load); be safe regardless.
    return min(ready, key=lambda b: (b.counted / b.effective_weight, b.id))


def least_conn(ready: Sequence[Backend]) -> Backend:
    """The fewest live sessions per unit of effective weight, counting the new one."""
    return min(ready, key=lambda b: ((b.load + 1) / b.effective_weight, b.id))


def weighted_random(rng: random.Random, ready: Sequence[Backend]) -> Backend:
    """A draw weighted by effective weight (one ``rng.choices`` call per pick)."""
    return rng.choices(ready, weights=[b.effective_weight for b in ready])[0]


class SmoothRoundRobin:
    """Smooth weighted round robin, as nginx does it: each pick adds every ready backend's
    weight to its current value, takes the highest (the first in order on a tie) and takes the
    round's total weight off it."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def pick(self, ready: Sequence[Backend]) -> Backend:
        current = self.current
        total = 0.0
        best: Backend | None = None
        for b in ready:
            cur = current.get(b.id, 0.0) + b.effective_weight
            current[b.id] = cur
            total += b.effective_weight
            if best is None or cur > current[best.id]:
                best = b
        assert best is not None
        current[best.id] -= total
        return best

    def forget(self, backend_id: str) -> None:
        """Drop a removed backend's state."""
        self.current.pop(backend_id, None)
