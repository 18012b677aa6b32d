"""A worker as the balancer sees it: where it is, its operator and probe state, its load.

Its own module so that the pool (membership, holds, affinity) and the balance algorithms
(``balancer.selection``) share one definition of a backend without importing each other, and so
that the admin states are defined once (``AdminState``), for the pool, the drains and cluster
mode's etcd records alike.

Operator state (``admin_state``: active, draining, drained) is kept apart from probe state
(``healthy``), as pingora does with ``enabled`` and health: a backend receives new sessions only
when it is both active and healthy (and not ejected, ``balancer.pool``'s outlier detection).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from balancer.config import BackendCfg
from balancer.weights import Signals

__all__ = ["AdminState", "Backend", "Upstream"]


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
        "context_counted",
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
        "kv_capacity",
        "kv_demand",
        "last_check",
        "moved",
        "pending",
        "prefill_s",
        "probe_fails",
        "probe_oks",
        "refused",
        "remote_sessions",
        "returned_at",
        "sessions",
        "sessions_total",
        "signals",
        "stale",
        "turns_counted",
        "upstream",
        "url",
        "wait_at",
        "wait_s",
        "weight",
    )

    def __init__(self, cfg: BackendCfg) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.url = cfg.url
        self.upstream = Upstream.parse(cfg.url)
        self.weight = cfg.weight
        self.effective_weight = cfg.weight
        self.admin_state: AdminState = _ACTIVE
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
        self.held = 0  # keys whose session ended here less than ``hold_s`` ago (balancer.pool)
        # Keys placed here whose session is not attached yet (its handshake is under way): a
        # burst arriving at once is counted from its placements, not from its first answers.
        self.pending = 0
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

    @property
    def ready(self) -> bool:
        """May receive new sessions."""
        return self.healthy and self.admin_state == _ACTIVE and self.ejected_until == 0.0

    @property
    def state(self) -> str:
        """One word for operators: active, draining, drained, down or ejected (a plain ``str``)."""
        if self.admin_state != _ACTIVE:
            return str(self.admin_state)
        if not self.healthy:
            return "down"
        return "ejected" if self.ejected else "active"

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
