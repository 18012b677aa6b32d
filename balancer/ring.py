"""Bounded-load consistent hashing over a uhashring ketama ring.

The ring is built from the backends' static weights and is rebuilt only when membership changes;
readiness (health, drain) and load never touch it. A backend that is not ready is skipped during
the walk, not removed, so its keys come back to it when it returns (pingora's
``select_with``). The bound follows Mirrokni, Thorup and Zadimoghaddam (SODA 2018), as in
HAProxy's and Envoy's ``hash_balance_factor``: a backend accepts a new session only while its load
after the placement stays within ``ceil(c * (L + 1) * w / W)``, where ``L`` is the load on the
ready backends and ``w / W`` its share of their (effective) weight. The pool counts as load the
live sessions and the places held for keys between sessions (``balancer.pool``). With ``c > 1``
the bounds sum to more than ``L + 1``, so some ready backend always accepts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from uhashring import HashRing

__all__ = ["Ring", "load_bound"]


def load_bound(total_after: int, factor: float, weight: float, weight_sum: float) -> int:
    """Most sessions a backend may hold once ``total_after`` sessions are placed."""
    if weight_sum <= 0:
        return 0
    return math.ceil(factor * total_after * weight / weight_sum - 1e-9)


class Ring:
    """An immutable ketama ring of backend ids; build a new one to change membership."""

    __slots__ = ("_ring", "ids")

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.ids = tuple(sorted(weights))
        # ketama wants integer weights; hundredths keep fractional weights meaningful. Nodes go
        # in sorted order: should two points collide, the same one wins on every instance,
        # whatever order each learned its backends in (cluster mode).
        nodes = {bid: {"weight": max(1, round(w * 100))} for bid, w in sorted(weights.items())}
        self._ring = HashRing(nodes=nodes, hash_fn="ketama") if nodes else None

    def walk(self, key: str) -> Iterator[str]:
        """Distinct backend ids in ring order starting at the key's point."""
        if self._ring is None:
            return iter(())
        return self._ring.iterate_nodes(key)  # type: ignore[no-any-return]

    def owner(self, key: str) -> str | None:
        """The backend the key hashes to, ignoring readiness and load."""
        return next(self.walk(key), None)
