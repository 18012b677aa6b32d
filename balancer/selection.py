"""The balance algorithms: which ready backend a new session goes to.

Kept apart from ``balancer.pool`` so that each policy is a small, sans-I/O function of what it is
given (the ready backends, the key's ring walk, their counts and effective weights) and can be
read and tested alone; the pool owns the state they read (membership, holds, the affinity table)
and dispatches on ``balance``. Nothing here imports the pool.

``consistent``: the first ready backend on the key's ring walk that is under its bound
(``ring.load_bound``), counting held places as ``balancer.pool`` describes. One refinement keeps
KV caches warm: when the bound pushed a key past its first ready backend, the placement is
remembered (a bounded LRU table, like an HAProxy stick table) and reused while that backend is
ready and under its bound *and* the key's first ready backend is still the same one. If readiness
changed instead (a worker went down and came back), the ring decides again, so keys return to a
worker when it returns. A key holding a place on a ready backend is already counted there: placing
it anywhere adds nothing to the total, and taking its own place back adds nothing there.

``least_conn``: the fewest live sessions (every process's) per unit of effective weight, ties to
the lowest id. ``round_robin``: smooth weighted round robin, as nginx does it. ``random``: a
weighted draw from the pool's seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from balancer.backend import Backend
from balancer.ring import load_bound

__all__ = ["SmoothRoundRobin", "consistent", "least_conn", "weighted_random"]


def consistent(
    ready: Sequence[Backend],
    walk: Iterable[str],
    factor: float,
    held_on: Backend | None = None,
    remembered: tuple[str, str | None] | None = None,
) -> Backend:
    """Bounded-load consistent hashing over ``ready`` (not empty).

    ``walk`` is the key's ring walk (backend ids, nearest first); ``factor`` the pool's
    ``hash_balance_factor``. ``held_on`` is the backend the key holds a place on, if any;
    ``remembered`` its last placement: (backend placed on, the key's first ready backend then).
    """
    by_id = {b.id: b for b in ready}
    holder = held_on if held_on is not None and by_id.get(held_on.id) is held_on else None
    total_after = sum(b.counted for b in ready) + (0 if holder is not None else 1)
    weight_sum = sum(b.effective_weight for b in ready)

    def fits(b: Backend) -> bool:
        after = b.counted if b is holder else b.counted + 1
        return after <= load_bound(total_after, factor, b.effective_weight, weight_sum)

    on_ring = [b for bid in walk if (b := by_id.get(bid)) is not None]
    first = on_ring[0].id if on_ring else None
    if remembered is not None and remembered[1] == first:
        b = by_id.get(remembered[0])
        if b is not None and fits(b):
            return b
    for b in on_ring:
        if fits(b):
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
