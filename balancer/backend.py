"""A worker as the balancer sees it: what it is, its health and state, its load.

Its own module so that the pool (membership, holds, affinity) and the balance algorithms
(``balancer.selection``) share one definition of a backend without importing each other, and so
that the admin states are defined once (``AdminState``), for the pool, the drains and cluster
mode's etcd records alike.

A ``Backend`` has three parts, as pingora keeps discovery, health and selection apart:

- **What it is**, ``spec``: a frozen ``BackendSpec`` (id, URL, parsed upstream, configured weight,
  its ``BackendCfg``). A new weight swaps in a new one (``configure``); nothing edits it.
- **Its health and state**, owned here and written nowhere else (``tests/test_backend.py`` reads
  every module to check): the probe state (``healthy``, the streaks, why it is down and since
  when), the operator's ``admin_state`` (active, draining, drained), kept apart from health as
  pingora does with ``enabled``, and the passive ejection (``ejected_until``). Every source goes
  through a method: ``probe`` (active checks), ``set_health`` (a spawned process came or went,
  the ``workers: N`` board, failover's verdict on a lost worker), ``set_admin`` (drains),
  ``eject``/``readmit`` (``balancer.pool``'s outlier detection). Each recomputes ``state``
  (one word: active, draining, drained, down, ejected) and ``ready`` (may receive new sessions:
  active, healthy and not ejected), and calls the listeners once when the word or the health
  changed, and not otherwise: that is what the event feed's ``state`` events are made of, with
  no polling.
- **Its load**: sessions, held places, signals, weights and estimates, which ``balancer.pool``
  and the shell count as sessions come and go.

``id``, ``ready`` and ``state`` are plain slots rather than properties, because every selection
reads them of every backend (a slot read costs a sixth of a property's on CPython 3.11); they
are written only by this module like the rest of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias
from urllib.parse import urlsplit

from balancer.config import BackendCfg, uses_tls
from balancer.weights import Signals

__all__ = ["AdminState", "Backend", "BackendSpec", "Change", "Listener", "Upstream"]


class AdminState(StrEnum):
    """The operator's intent for a backend. The members are ``str``: they compare equal to, and
    serialize as (JSON, metrics labels, etcd), the plain words."""

    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"


# Bound once: an enum member looked up on its class costs a call, and ``ready`` is on the hot
# path (every select and refresh asks it of every backend).
_ACTIVE = AdminState.ACTIVE


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where to open a worker's WebSocket and send its plain requests, parsed once from its URL
    (``ws://`` and ``http://`` alike; ``secure`` for ``wss://`` and ``https://``).

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
        secure = uses_tls(url)
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


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What a backend is, from its config: immutable, so that a change of weight is one new
    value swapped in (``Backend.configure``), never an edit a reader could see half done."""

    id: str
    url: str
    upstream: Upstream
    weight: float  # the configured (static) weight; the effective one is load state
    cfg: BackendCfg

    @classmethod
    def of(cls, cfg: BackendCfg) -> BackendSpec:
        return cls(cfg.id, cfg.url, Upstream.parse(cfg.url), cfg.weight, cfg)


@dataclass(frozen=True, slots=True)
class Change:
    """What a listener hears: the state word before and after, and whether health flipped
    (a draining backend that goes down keeps its word, but its health changed)."""

    before: str
    after: str
    flipped: bool


Listener: TypeAlias = Callable[["Backend", Change], None]
"""Called after a backend's state word or health changed (``Backend.listen``)."""


class Backend:
    """A worker as the balancer sees it: its spec, its health and state (written only by the
    methods below), and its live load (module docstring)."""

    # The spec (``spec``, ``id``); the health and state (``_*``, ``ready``, ``state``: written
    # only by the methods of this class); the load (the rest).
    __slots__ = (
        "_admin",
        "_ejected_until",
        "_ejections",
        "_fails",
        "_healthy",
        "_kind",
        "_last_check",
        "_listeners",
        "_oks",
        "_reason",
        "_returned_at",
        "_since",
        "connect_failures",
        "consecutive_failures",
        "context_counted",
        "effective_weight",
        "factor",
        "factor_at",
        "headroom",
        "held",
        "id",
        "kv_capacity",
        "kv_demand",
        "moved",
        "pending",
        "prefill_s",
        "ready",
        "refused",
        "remote_sessions",
        "sessions",
        "sessions_total",
        "signals",
        "spec",
        "stale",
        "state",
        "turns_counted",
        "wait_at",
        "wait_s",
    )

    def __init__(self, cfg: BackendCfg) -> None:
        self.spec = BackendSpec.of(cfg)
        self.id = cfg.id  # the spec's, as a slot: read for every backend at every selection
        self._admin: AdminState = _ACTIVE
        self._healthy = True
        # Why it is down, for operators: the last failed check's reason and its kind (a metric
        # label: refused, timeout, reset, http_status, error, process), None while up.
        self._reason: str | None = None
        self._kind: str | None = None
        self._since: float | None = None  # wall clock of the last flip
        self._last_check: float | None = None  # wall clock of the last conclusive check
        self._oks = 0  # consecutive passed checks
        self._fails = 0  # consecutive failed checks
        self._ejected_until = 0.0  # loop time; 0 when not ejected
        self._ejections = 0  # multiplier of the next ejection time
        self._returned_at = 0.0  # loop time the last ejection ended
        self._listeners: tuple[Listener, ...] = ()
        self.state = "active"
        self.ready = True
        self.effective_weight = cfg.weight
        self.sessions = 0  # live sessions this process placed on the backend
        # Sessions that other balancer processes or instances hold on it (``workers: N``'s
        # shared board, or cluster mode's scraped counts); bounds and least_conn see both.
        self.remote_sessions = 0
        self.held = 0  # keys whose session ended here less than ``hold_s`` ago (balancer.pool)
        # Keys placed here whose session is not attached yet (its handshake is under way): a
        # burst arriving at once is counted from its placements, not from its first answers.
        self.pending = 0
        self.sessions_total = 0
        self.connect_failures = 0  # total, for metrics
        self.consecutive_failures = 0  # connect/handshake failures since the last success
        self.signals: Signals | None = None
        self.stale = True
        self.headroom = 1.0  # smoothed load signals' factor, at factor_at
        self.factor_at = 0.0
        self.factor = 1.0  # headroom x speed: effective_weight = weight x factor
        # What placement and the move rule read (``balancer.pool`` keeps them, by the rules of
        # ``balancer.selection``): the estimated context tokens and turns of the conversations
        # counted here (live or held), the tokens they are expected to grow into, the KV size
        # (0: unknown), the expected wait before a new turn starts and the prefill time per
        # token (both smoothed; 0: none measured).
        self.context_counted = 0.0
        self.turns_counted = 0
        self.kv_demand = 0.0
        self.kv_capacity = 0.0
        self.wait_s = 0.0
        self.wait_at = 0.0
        self.prefill_s = 0.0
        # New keys that hashed here first and went elsewhere, and returning keys that left
        # this backend, by reason (``selection.REASONS``): why a key moved, for operators.
        self.refused: dict[str, int] = {}
        self.moved: dict[str, int] = {}

    # -- what it is (the spec) ---------------------------------------------------------------

    @property
    def cfg(self) -> BackendCfg:
        return self.spec.cfg

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def upstream(self) -> Upstream:
        return self.spec.upstream

    @property
    def weight(self) -> float:
        """The configured weight (``effective_weight`` is the one selection uses)."""
        return self.spec.weight

    def configure(self, cfg: BackendCfg) -> bool:
        """Swap in the spec of a new config of the same backend (its weight or metrics URL
        changed; a new URL is a new backend). True when the weight changed (the pool's ring
        is rebuilt)."""
        if (cfg.id, cfg.url) != (self.id, self.spec.url):
            raise ValueError(f"backend {self.id!r}: a new id or URL is a new backend")
        old = self.spec.weight
        self.spec = BackendSpec.of(cfg)
        return cfg.weight != old

    # -- its health and state: read ----------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """What the health checks (or the process supervisor, or the board) last concluded."""
        return self._healthy

    @property
    def admin_state(self) -> AdminState:
        return self._admin

    @property
    def health_reason(self) -> str | None:
        return self._reason

    @property
    def health_kind(self) -> str | None:
        return self._kind

    @property
    def health_since(self) -> float | None:
        return self._since

    @property
    def last_check(self) -> float | None:
        return self._last_check

    @property
    def probe_oks(self) -> int:
        return self._oks

    @property
    def probe_fails(self) -> int:
        return self._fails

    @property
    def ejected_until(self) -> float:
        return self._ejected_until

    @property
    def ejected(self) -> bool:
        return self._ejected_until > 0.0

    @property
    def ejections(self) -> int:
        return self._ejections

    @property
    def returned_at(self) -> float:
        return self._returned_at

    # -- its health and state: the only writers ----------------------------------------------

    def listen(self, listener: Listener) -> None:
        """Call ``listener(backend, change)`` after each change of the state word or health."""
        self._listeners = (*self._listeners, listener)

    def unlisten(self, listener: Listener) -> None:
        self._listeners = tuple(f for f in self._listeners if f != listener)

    def _settle(self, before: str, was_healthy: bool) -> None:
        """Recompute ``state`` and ``ready`` after a write; tell the listeners of a change."""
        healthy = self._healthy
        if self._admin is not _ACTIVE:
            state = self._admin.value
        elif not healthy:
            state = "down"
        else:
            state = "ejected" if self._ejected_until > 0.0 else "active"
        self.state = state
        self.ready = state == "active"
        if (state != before or healthy != was_healthy) and self._listeners:
            change = Change(before, state, healthy != was_healthy)
            for listener in self._listeners:
                listener(self, change)

    def set_health(
        self, healthy: bool, reason: str | None = None, kind: str | None = None, at: float = 0.0
    ) -> bool:
        """Set the health directly, not by counting checks: a spawned worker's process came or
        went, the supervisor's board says so, or failover found a lost worker's check failing.
        True when it flipped. ``reason``/``kind`` say why it is down; ``at`` is the wall clock.
        A flip down also ends the run of passed checks: the checks must pass ``rise`` times in
        a row from now on to bring it back."""
        before, was = self.state, self._healthy
        flipped = healthy != was
        self._healthy = healthy
        if flipped:
            self._since = at or None
            if not healthy:
                self._oks = 0
        if healthy:
            self._reason = self._kind = None
        elif reason is not None:
            self._reason, self._kind = reason, kind
        self._settle(before, was)
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
            self._last_check = at
        before, was = self.state, self._healthy
        if not ok and (not was or self._fails + 1 >= fall):
            self._reason, self._kind = reason, kind
        if ok:
            self._oks += 1
            self._fails = 0
            flipped = not was and self._oks >= rise
        else:
            self._fails += 1
            self._oks = 0
            flipped = was and self._fails >= fall
        if not flipped:
            return False
        self._healthy = not was
        self._since = at or None
        if self._healthy:
            self._reason = self._kind = None
        self._settle(before, was)
        return True

    def set_admin(self, admin: AdminState | str) -> bool:
        """The operator's (or a drain's) state; True when it changed."""
        admin = AdminState(admin)
        if admin is self._admin:
            return False
        before = self.state
        self._admin = admin
        self._settle(before, self._healthy)
        return True

    def eject(self, now: float, base: float, longest: float) -> float:
        """Passive outlier detection ejected it (``balancer.pool`` decides when): for ``base``
        times the number of ejections in a row, at most ``longest``; the count starts over
        once it has stayed in for ``longest``. Returns the loop time the ejection ends."""
        if self._returned_at and now - self._returned_at > longest:
            self._ejections = 0
        self._ejections += 1
        before = self.state
        self._ejected_until = now + min(base * self._ejections, longest)
        self._settle(before, self._healthy)
        return self._ejected_until

    def readmit(self, now: float) -> bool:
        """End an ejection that is over at loop time ``now``; True if one ended."""
        until = self._ejected_until
        if not until or now < until:
            return False
        before = self.state
        self._ejected_until = 0.0
        self._returned_at = now
        self._settle(before, self._healthy)
        return True

    # -- its load ----------------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Live sessions on the backend from every balancer process that shares it."""
        return self.sessions + self.remote_sessions

    @property
    def counted(self) -> int:
        """What the bounded-load rule counts: ``load`` plus the places this process holds for
        keys between sessions and the keys it placed here whose handshake is under way
        (``balancer.pool``'s docstring)."""
        return self.load + self.held + self.pending

    @property
    def kv_headroom(self) -> float | None:
        """Share of the KV cache the conversations counted here are not expected to need
        (negative: they will not fit), None while its size is unknown."""
        if self.kv_capacity <= 0:
            return None
        return 1.0 - self.kv_demand / self.kv_capacity
