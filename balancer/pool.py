"""Backends, their state, and the choice of a backend for a new session.

Operator state (``admin_state``: active, draining, drained) is kept apart from probe state
(``healthy``), as pingora does with ``enabled`` and health: a backend receives new sessions only
when it is both active and healthy. The selector's ring is built off the hot path when membership
changes and swapped in as one reference.

Selection for ``balance: consistent``: the first ready backend on the key's ring walk that is
under its bound (``ring.load_bound``). One refinement keeps KV caches warm: when the bound pushed a
key past its first ready backend, the placement is remembered (a bounded LRU table, like an
HAProxy stick table) and reused while that backend is ready and under its bound *and* the key's
first ready backend is still the same one. If readiness changed instead (a worker went down and
came back), the ring decides again, so keys return to a worker when it returns.

Held places: when a session ends, its key keeps its place on the backend for ``hold_s`` seconds
(the pool's ``affinity_hold``, 30 s by default): the worker still holds the conversation's KV
cache, and chat clients that open a connection per turn (as HTTP-style clients do) come back
after a think time. A held place counts in the backend's counted load (``Backend.counted``) and
in the pool's total, as a live session does, until the key returns (its session takes the place
back: the count does not grow) or the hold expires. So the bounded-load rule counts
conversations rather than open sockets, and a returning key is not pushed off its worker because
it was between turns. The rule, exactly: a placement never takes a backend's counted load above
``ring.load_bound`` of the pool's counted total after it, with the backends' *effective* weights
at that moment. A key taking back its held place (on the backend it was last placed on, its ring
order unchanged) adds nothing to either, so it fits wherever the backend is within its bound
counting the key's place already: as docs/config.md has it, affinity holds while the worker is
under its bound. It moves only when that backend's bound fell below its count meanwhile
(effective weights moved, sessions ended elsewhere); ``weights.denoise`` and the smoothing keep
scrape noise out of the weights so that this is rare. A held place is a reservation, not a
session: when its backend's counted load is above its bound (the same bound, of the current
total), places held there are given up, the longest-quiet conversations first, until it is
within the bound again or holds none; live sessions are never moved for the bound.

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
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from balancer.config import BackendCfg, PoolCfg
from balancer.ring import Ring, load_bound
from balancer.weights import Signals, denoise, effective_weight, median, speed

__all__ = ["Backend", "Pool", "SharedLoad", "Upstream"]

# How long a key's last placement is remembered after its session ends: longer than a worker
# keeps a disconnected session's context (the reference worker's --session-ttl is 300 s).
AFFINITY_TTL = 600.0
# How long a key keeps its place (counted in its backend's load) after its session ends.
HOLD_S = PoolCfg("").affinity_hold

ACTIVE = "active"
DRAINING = "draining"
DRAINED = "drained"


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where to open a worker's WebSocket, parsed once from its URL.

    ``path`` None: the URL has no path (``ws://10.0.0.5:9001``), so the client's own path goes
    to the worker, as nginx's ``proxy_pass`` without a URI does; one pool then serves every
    endpoint of its workers. A URL with a path (``/`` included) sends that path instead. The
    client's query is appended either way (``handshake.upstream_request``).
    """

    host: str
    port: int
    path: str | None
    secure: bool

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url)
        secure = parts.scheme == "wss"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if secure else 80)
        path: str | None = parts.path or ("/" if parts.query else None)
        if parts.query:
            path = f"{path}?{parts.query}"
        return cls(host, port, path, secure)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class Backend:
    """A worker as the balancer sees it: address, weights, state and live load."""

    __slots__ = (
        "admin_state",
        "cfg",
        "connect_failures",
        "consecutive_failures",
        "effective_weight",
        "ejected_until",
        "ejections",
        "factor",
        "factor_at",
        "headroom",
        "health_kind",
        "health_reason",
        "health_since",
        "healthy",
        "held",
        "id",
        "last_check",
        "probe_fails",
        "probe_oks",
        "remote_sessions",
        "returned_at",
        "sessions",
        "sessions_total",
        "signals",
        "stale",
        "upstream",
        "url",
        "weight",
    )

    def __init__(self, cfg: BackendCfg) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.url = cfg.url
        self.upstream = Upstream.parse(cfg.url)
        self.weight = cfg.weight
        self.effective_weight = cfg.weight
        self.admin_state = ACTIVE
        self.healthy = True
        # Why it is down, for operators: the last failed check's reason and its kind (a metric
        # label: refused, timeout, reset, http_status, error, process), None while up.
        self.health_reason: str | None = None
        self.health_kind: str | None = None
        self.health_since: float | None = None  # wall clock of the last flip
        self.last_check: float | None = None  # wall clock of the last conclusive check
        self.probe_oks = 0
        self.probe_fails = 0
        self.sessions = 0  # live sessions this process placed on the backend
        # Sessions that other balancer processes or instances hold on it (``workers: N``'s
        # shared board, or cluster mode's scraped counts); bounds and least_conn see both.
        self.remote_sessions = 0
        self.held = 0  # keys whose session ended here less than ``hold_s`` ago (Pool docstring)
        self.sessions_total = 0
        self.connect_failures = 0  # total, for metrics
        self.consecutive_failures = 0  # connect/handshake failures since the last success
        self.ejected_until = 0.0  # loop time; 0 when not ejected
        self.ejections = 0  # multiplier of the next ejection time
        self.returned_at = 0.0
        self.signals: Signals | None = None
        self.stale = True
        self.headroom = 1.0  # smoothed load signals' factor, at factor_at
        self.factor_at = 0.0
        self.factor = 1.0  # headroom x speed: effective_weight = weight x factor

    @property
    def ejected(self) -> bool:
        return self.ejected_until > 0.0

    @property
    def load(self) -> int:
        """Live sessions on the backend from every balancer process that shares it."""
        return self.sessions + self.remote_sessions

    @property
    def counted(self) -> int:
        """What the bounded-load rule counts: ``load`` plus the places this process holds for
        keys between sessions (see the module docstring)."""
        return self.load + self.held

    @property
    def ready(self) -> bool:
        """May receive new sessions."""
        return self.healthy and self.admin_state == ACTIVE and self.ejected_until == 0.0

    @property
    def state(self) -> str:
        """One word for operators: active, draining, drained, down or ejected."""
        if self.admin_state != ACTIVE:
            return self.admin_state
        if not self.healthy:
            return "down"
        return "ejected" if self.ejected else ACTIVE

    def set_health(
        self, healthy: bool, reason: str | None = None, kind: str | None = None, at: float = 0.0
    ) -> bool:
        """Set the probe state directly (a spawned worker's process came or went); True when it
        flipped. ``reason``/``kind`` say why it is down; ``at`` is the wall clock."""
        flipped = healthy != self.healthy
        self.healthy = healthy
        if flipped:
            self.health_since = at or None
        if healthy:
            self.health_reason = self.health_kind = None
        elif reason is not None:
            self.health_reason, self.health_kind = reason, kind
        return flipped

    def probe(
        self,
        ok: bool,
        rise: int,
        fall: int,
        reason: str | None = None,
        kind: str | None = None,
        at: float = 0.0,
    ) -> bool:
        """Record an active health check; return True when ``healthy`` flipped.

        Health flips only after ``rise`` consecutive successes or ``fall`` consecutive failures,
        so one lost probe does not move sessions. A failed check's ``reason`` (and ``kind``) is
        kept while the backend is down; ``at`` is the wall clock of the check.
        """
        if at:
            self.last_check = at
        if not ok and (not self.healthy or self.probe_fails + 1 >= fall):
            self.health_reason, self.health_kind = reason, kind
        flipped = self._count_probe(ok, rise, fall)
        if flipped:
            self.health_since = at or None
            if self.healthy:
                self.health_reason = self.health_kind = None
        return flipped

    def _count_probe(self, ok: bool, rise: int, fall: int) -> bool:
        if ok:
            self.probe_oks += 1
            self.probe_fails = 0
            if not self.healthy and self.probe_oks >= rise:
                self.healthy = True
                return True
        else:
            self.probe_fails += 1
            self.probe_oks = 0
            if self.healthy and self.probe_fails >= fall:
                self.healthy = False
                return True
        return False


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
    """The backends of one pool and the selection policy over them."""

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
        self.backends: dict[str, Backend] = {}
        self.ring = Ring({})
        # key -> (backend placed on, the key's first ready backend on the ring then, loop time)
        self._affinity: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()
        self._affinity_size = affinity_size
        # key -> (backend holding its place, loop time the hold ends), in expiry order
        self._held: OrderedDict[str, tuple[Backend, float]] = OrderedDict()
        self.hold_s = cfg.affinity_hold if hold_s is None else hold_s
        self._rr_current: dict[str, float] = {}
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
        self._rr_current.pop(backend_id, None)
        self._rebuild()
        return b

    # -- selection -------------------------------------------------------------------------

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
        for bid, f in denoise(fresh, w.coefficients.noise_band).items():
            b = self.backends[bid]
            b.effective_weight = b.weight * f
        if held and self.balance == "consistent":
            self._trim_holds()

    def _trim_holds(self) -> None:
        """Give up held places on backends above their bound (module docstring), oldest first.

        Giving one up lowers the total, and so every bound a little: repeat until no backend is
        over, or those that are hold no places.
        """
        ready = [b for b in self.backends.values() if b.ready]
        weight_sum = sum(b.effective_weight for b in ready)
        total = sum(b.counted for b in ready)

        def over(b: Backend) -> bool:
            return b.counted > load_bound(total, self.factor, b.effective_weight, weight_sum)

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
            return self._select_consistent(key, ready)
        if self.balance == "least_conn":
            return min(ready, key=lambda b: ((b.load + 1) / b.effective_weight, b.id))
        if self.balance == "round_robin":
            return self._select_round_robin(ready)
        return self._random.choices(ready, weights=[b.effective_weight for b in ready])[0]

    def _select_consistent(self, key: str, ready: list[Backend]) -> Backend:
        by_id = {b.id: b for b in ready}
        # A key that holds a place on a ready backend is already counted there: placing it
        # anywhere adds nothing to the total, and taking its own place back adds nothing there.
        hold = self._held.get(key)
        holder = hold[0] if hold is not None and by_id.get(hold[0].id) is hold[0] else None
        total_after = sum(b.counted for b in ready) + (0 if holder is not None else 1)
        weight_sum = sum(b.effective_weight for b in ready)

        def fits(b: Backend) -> bool:
            after = b.counted if b is holder else b.counted + 1
            return after <= load_bound(total_after, self.factor, b.effective_weight, weight_sum)

        walk = [b for bid in self.ring.walk(key) if (b := by_id.get(bid)) is not None]
        first = walk[0].id if walk else None
        remembered = self._remembered(key)
        if remembered is not None and remembered[1] == first:
            b = by_id.get(remembered[0])
            if b is not None and fits(b):
                return b
        for b in walk:
            if fits(b):
                return b
        # Unreachable with factor > 1 (the bounds sum above the load); be safe regardless.
        return min(ready, key=lambda b: (b.counted / b.effective_weight, b.id))

    def _select_round_robin(self, ready: list[Backend]) -> Backend:
        """Smooth weighted round robin, as nginx does it."""
        total = 0.0
        best: Backend | None = None
        for b in ready:
            cur = self._rr_current.get(b.id, 0.0) + b.effective_weight
            self._rr_current[b.id] = cur
            total += b.effective_weight
            if best is None or cur > self._rr_current[best.id]:
                best = b
        assert best is not None
        self._rr_current[best.id] -= total
        return best

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
