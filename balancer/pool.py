"""A pool's backends: membership, refresh and smoothing, ejection, held places and affinity.

``Pool`` keeps the state the balance algorithms read and hands them what they need
(``balancer.selection``); the backends themselves and their admin states are in
``balancer.backend`` (re-exported here). The ring is built off the hot path when membership
changes and swapped in as one reference.

Held places: when a session ends, its key keeps its place on the backend for ``hold_s`` seconds
(the pool's ``affinity_hold``, 30 s by default): the worker still holds the conversation's KV
cache, and chat clients that open a connection per turn (as HTTP-style clients do) come back
after a think time. A held place counts in the backend's counted load (``Backend.counted``) and
in the pool's total, as a live session does, until the key returns (its session takes the place
back: the count does not grow) or the hold expires. So the bounded-load rule counts
conversations rather than open sockets, and a returning key is not pushed off its worker because
it was between turns. The rule, exactly: a placement never takes a backend's counted load above
its *limit*, ``ring.load_bound`` of the pool's counted total after it with the backends'
*effective* weights at that moment and a factor that ``balancer.selection`` states:
``hash_balance_factor`` for new keys and for any key on an overloaded backend,
``affinity_ceiling`` for a key returning to a backend that is not overloaded. A key taking back
its held place adds nothing to either count, so it fits wherever the backend is within its
limit counting the key's place already. A held place is a reservation, not a session: when its
backend's counted load is above its limit (of the current total), places held there are given
up, the longest-quiet conversations first, until it is within the limit again or holds none;
live sessions are never moved for a bound.

Overload is the pool's state, refreshed with the weights (``refresh``): the set of backends
``selection.overloaded`` finds among the ready backends with fresh signals, given the set before,
so that its hysteresis holds across refreshes. Under ``workers: N`` every process works it out
from the same published signals.

Under ``workers: N`` each process keeps its own holds and publishes its live sessions plus
held places on the board, so every process's bounds count them (``remote_sessions``); a key that
returns through another process than the one holding its place is counted twice until that hold
expires, which errs on the side of a tighter bound.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from balancer import selection
from balancer.backend import AdminState, Backend, Upstream
from balancer.config import BackendCfg, PoolCfg
from balancer.ring import Ring, load_bound
from balancer.weights import denoise, effective_weight, median, speed

__all__ = [
    "ACTIVE",
    "DRAINED",
    "DRAINING",
    "AdminState",
    "Backend",
    "Pool",
    "SharedLoad",
    "Upstream",
]

# How long a key's last placement is remembered after its session ends: longer than a worker
# keeps a disconnected session's context (the reference worker's --session-ttl is 300 s).
AFFINITY_TTL = 600.0
# How long a key keeps its place (counted in its backend's load) after its session ends.
HOLD_S = PoolCfg("").affinity_hold

# The admin states, as the names every caller imports (``balancer.backend.AdminState``).
ACTIVE = AdminState.ACTIVE
DRAINING = AdminState.DRAINING
DRAINED = AdminState.DRAINED


class SharedLoad(Protocol):
    """Where the processes of one balancer publish their per-backend session counts."""

    def publish(self, backend_id: str, sessions: int) -> None:
        """Set what this process counts on the backend (live sessions and held places)."""
        ...

    def remote(self, backend_id: str) -> int:
        """Sessions the *other* processes hold on the backend."""
        ...

    def remember(self, key: str, backend_id: str, first: str | None) -> None:
        """Record a key's placement for every process (the affinity table, shared)."""
        ...

    def touch(self, key: str, backend_id: str) -> None:
        """Restart the key's expiry if it is still placed on ``backend_id``."""
        ...

    def recall(self, key: str, ttl: float) -> tuple[str, str | None, float] | None:
        """The key's placement (backend, first ready backend then, time) if younger than ttl."""
        ...


class Pool:
    """The backends of one pool, the state selection reads, and ``select`` (which dispatches
    on ``balance`` to ``balancer.selection``)."""

    def __init__(
        self,
        cfg: PoolCfg,
        *,
        affinity_size: int = 100_000,
        seed: int | None = None,
        hold_s: float | None = None,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.balance = cfg.balance
        self.factor = cfg.hash_balance_factor
        self.ceiling = cfg.affinity_ceiling
        self.overload_ratio = cfg.overload_ratio
        # Backends measured overloaded relative to their peers (``selection.overloaded``).
        self.overloaded: set[str] = set()
        self.backends: dict[str, Backend] = {}
        self.ring = Ring({})
        # key -> (backend placed on, the key's first ready backend on the ring then, loop time)
        self._affinity: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()
        self._affinity_size = affinity_size
        # key -> (backend holding its place, loop time the hold ends), in expiry order
        self._held: OrderedDict[str, tuple[Backend, float]] = OrderedDict()
        self.hold_s = cfg.affinity_hold if hold_s is None else hold_s
        self._rr = selection.SmoothRoundRobin()
        self._random = random.Random(seed)
        # Session counts shared with the other processes of ``workers: N`` (None: alone).
        self.shared: SharedLoad | None = None
        for b in cfg.backends:
            self.backends[b.id] = Backend(b)
        self._rebuild()

    # -- membership ------------------------------------------------------------------------

    def _rebuild(self) -> None:
        self.ring = Ring({b.id: b.weight for b in self.backends.values()})

    def add(self, cfg: BackendCfg) -> Backend:
        """Add a backend (a new ring is built and swapped in)."""
        if cfg.id in self.backends:
            raise ValueError(f"backend {cfg.id!r} exists")
        b = self.backends[cfg.id] = Backend(cfg)
        self._rebuild()
        return b

    def update(self, backend_id: str, cfg: BackendCfg) -> None:
        """Apply a new weight (or metrics URL) to a backend; a weight change rebuilds the ring."""
        b = self.backends[backend_id]
        b.cfg = cfg
        if b.weight != cfg.weight:
            b.weight = cfg.weight
            self._rebuild()

    def remove(self, backend_id: str) -> Backend:
        """Remove a backend; its live sessions are the caller's business."""
        b = self.backends.pop(backend_id)
        self._rr.forget(backend_id)
        self._rebuild()
        return b

    # -- refresh and selection -------------------------------------------------------------

    def refresh(self, now: float) -> None:
        """Bring time-dependent state up to ``now``: ejections that ended, held places that
        expired, effective weights."""
        held = self._held
        while held:
            key, (hb, until) = next(iter(held.items()))
            if until > now:
                break
            del held[key]
            hb.held -= 1
            self._publish(hb)
        w = self.cfg.weights
        shared = self.shared
        mid_tpot = (
            median(
                b.signals.tpot
                for b in self.backends.values()
                if b.ready
                and b.signals is not None
                and b.signals.tpot
                and now - b.signals.at <= w.stale_after
            )
            if w.coefficients.tpot > 0  # else speed() ignores it: skip the walk
            else None
        )
        for b in self.backends.values():
            if shared is not None:
                b.remote_sessions = shared.remote(b.id)
            if b.ejected_until and now >= b.ejected_until:
                b.ejected_until = 0.0
                b.returned_at = now
            was_stale = b.stale
            raw, b.stale = effective_weight(1.0, b.signals, now, w.stale_after, w.coefficients)
            if b.stale or was_stale or w.smoothing <= 0:  # no history to smooth against
                b.headroom = raw
            elif now > b.factor_at:
                # Exponential smoothing in time, however often this runs.
                b.headroom += (raw - b.headroom) * (
                    1.0 - math.exp((b.factor_at - now) / w.smoothing)
                )
            b.factor_at = now
            b.factor = b.headroom
            if not b.stale and b.signals is not None:  # tpot is a decayed mean already
                slower = speed(b.signals.tpot, mid_tpot, w.coefficients)
                b.factor = max(w.coefficients.min_factor, b.headroom * slower)
            b.effective_weight = b.weight * b.factor
        # Shares among the ready backends with fresh signals, without the scrape noise.
        fresh = {b.id: b.factor for b in self.backends.values() if b.ready and not b.stale}
        denoised = denoise(fresh, w.coefficients.noise_band)
        for bid, f in denoised.items():
            b = self.backends[bid]
            b.effective_weight = b.weight * f
        self.overloaded = selection.overloaded(denoised, self.overloaded, self.overload_ratio)
        if held and self.balance == "consistent":
            self._trim_holds()

    def limit(self, b: Backend) -> float:
        """The factor of ``b``'s bound for a key returning to it (module docstring)."""
        return self.factor if b.id in self.overloaded else max(self.factor, self.ceiling)

    def _trim_holds(self) -> None:
        """Give up held places on backends above their limit (module docstring), oldest first.

        Giving one up lowers the total, and so every bound a little: repeat until no backend is
        over, or those that are hold no places.
        """
        ready = [b for b in self.backends.values() if b.ready]
        weight_sum = sum(b.effective_weight for b in ready)
        total = sum(b.counted for b in ready)

        def over(b: Backend) -> bool:
            return b.counted > load_bound(total, self.limit(b), b.effective_weight, weight_sum)

        in_pool = set(ready)
        held = self._held
        for _ in range(len(held)):
            if not any(b.held and over(b) for b in ready):
                return
            trimmed = False
            for key, (hb, _until) in list(held.items()):  # in expiry order: the oldest first
                if hb in in_pool and over(hb):
                    del held[key]
                    hb.held -= 1
                    total -= 1
                    self._publish(hb)
                    trimmed = True
            if not trimmed:
                return

    def select(self, key: str, exclude: Iterable[str] = (), now: float = 0.0) -> Backend | None:
        """Pick the backend for a new session with this key, or None if no backend is ready.

        ``exclude`` holds backends already tried for this session (connect failures), so the
        caller walks on to the next candidate. ``now`` is the clock of the scraped signals.
        """
        self.refresh(now)
        skip = set(exclude)
        ready = [b for b in self.backends.values() if b.ready and b.id not in skip]
        if not ready:
            return None
        if self.balance == "consistent":
            hold = self._held.get(key)
            remembered = self._remembered(key)
            return selection.consistent(
                ready,
                self.ring.walk(key),
                self.factor,
                held_on=hold[0] if hold is not None else None,
                remembered=remembered[:2] if remembered is not None else None,
                ceiling=self.ceiling,
                overloaded=self.overloaded,
            )
        if self.balance == "least_conn":
            return selection.least_conn(ready)
        if self.balance == "round_robin":
            return self._rr.pick(ready)
        return selection.weighted_random(self._random, ready)

    # -- accounting ------------------------------------------------------------------------

    def attach(self, key: str, backend: Backend, now: float = 0.0) -> None:
        """Count a session placed on ``backend`` and remember the key's worker; a place the key
        held (wherever) is taken back."""
        self._release(key)
        backend.sessions += 1
        backend.sessions_total += 1
        backend.consecutive_failures = 0
        self._publish(backend)
        aff = self._affinity
        first = next(
            (bid for bid in self.ring.walk(key) if (b := self.backends.get(bid)) and b.ready), None
        )
        aff[key] = (backend.id, first, now)
        if self.shared is not None:
            self.shared.remember(key, backend.id, first)
        aff.move_to_end(key)
        self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget placements older than ``AFFINITY_TTL`` (their KV cache is gone by then) and
        beyond the table's size, so memory follows the live key set, not every key ever seen."""
        aff = self._affinity
        while len(aff) > self._affinity_size:
            aff.popitem(last=False)
        if now > 0.0:
            horizon = now - AFFINITY_TTL
            while aff and next(iter(aff.values()))[2] < horizon:
                aff.popitem(last=False)

    def failed(self, backend: Backend, now: float) -> bool:
        """Passive outlier detection: count a connect/handshake failure; True if now ejected.

        After ``consecutive_failures`` in a row the backend is ejected for
        ``base_ejection_time x n`` (n grows with each ejection, capped at ``max_ejection_time``;
        it starts over once the backend has stayed in for ``max_ejection_time``). No more than
        ``max_ejection_percent`` of the pool is ejected at once, so a network blip cannot empty it.
        """
        o = self.cfg.outlier
        backend.connect_failures += 1
        backend.consecutive_failures += 1
        if backend.ejected or backend.consecutive_failures < o.consecutive_failures:
            return False
        ejected = sum(1 for b in self.backends.values() if b.ejected)
        # As Envoy does, one backend may always be ejected, whatever the percentage.
        if ejected and (ejected + 1) * 100 > o.max_ejection_percent * len(self.backends):
            return False
        if backend.returned_at and now - backend.returned_at > o.max_ejection_time:
            backend.ejections = 0
        backend.ejections += 1
        backend.ejected_until = now + min(
            o.base_ejection_time * backend.ejections, o.max_ejection_time
        )
        backend.consecutive_failures = 0
        return True

    def succeeded(self, backend: Backend) -> None:
        """A connect and handshake worked: the failure streak ends."""
        backend.consecutive_failures = 0

    def _release(self, key: str) -> None:
        """Give back the place the key holds, if any."""
        hold = self._held.pop(key, None)
        if hold is not None:
            hold[0].held -= 1
            self._publish(hold[0])

    def detach(self, backend: Backend, key: str | None = None, now: float = 0.0) -> None:
        """Count a session gone from ``backend``; its key's placement counts from now, and the
        key holds its place there for ``hold_s`` (module docstring)."""
        backend.sessions -= 1
        if key is not None:
            entry = self._affinity.get(key)
            if entry is not None and entry[0] == backend.id:
                self._affinity[key] = (entry[0], entry[1], now)
                self._affinity.move_to_end(key)
            if self.shared is not None:
                self.shared.touch(key, backend.id)
            if self.hold_s > 0 and self.backends.get(backend.id) is backend:
                self._release(key)
                self._held[key] = (backend, now + self.hold_s)
                backend.held += 1
        self._publish(backend)

    def _publish(self, backend: Backend) -> None:
        """Tell the other processes of ``workers: N`` what this one counts on the backend:
        its live sessions and the places it holds."""
        if self.shared is not None:
            self.shared.publish(backend.id, backend.sessions + backend.held)

    def _remembered(self, key: str) -> tuple[str, str | None, float] | None:
        """The key's last placement: from the board under ``workers: N`` (the process that
        accepts a key's reconnect need not be the one that placed it), else this process's."""
        if self.shared is not None:
            return self.shared.recall(key, AFFINITY_TTL)
        return self._affinity.get(key)

    def last_backend(self, key: str) -> str | None:
        """The backend this key was last placed on, if remembered."""
        entry = self._remembered(key)
        return entry[0] if entry is not None else None
