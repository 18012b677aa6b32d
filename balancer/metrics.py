"""Counters of the balancer and their Prometheus exposition.

Nothing on the hot path touches prometheus-client: a ``Counter.inc`` takes a lock, which per frame
would cost more than scanning the frame. Live sessions keep plain integers in their scanners;
``Stats`` accumulates the figures of finished sessions and of rare events, and the collector adds
the live ones at scrape time.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from balancer.selection import MOVED, REFUSED
from balancer.version import version

__all__ = ["BalancerCollector", "LiveSession", "Stats"]

C2W = "client_to_worker"
W2C = "worker_to_client"


class _ScannerCounts(Protocol):
    frames: int
    messages: int
    bytes: int


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class LiveSession(Protocol):
    """What the collector reads of a live session."""

    @property
    def pool(self) -> _Named: ...

    @property
    def cs(self) -> _ScannerCounts: ...

    @property
    def ws(self) -> _ScannerCounts: ...

    since: float  # loop time the client's 101 was sent
    relay: int | None  # the handle in the relay thread while it relays the session

    def counts(self) -> tuple[int, int, int]:
        """Worker->client frames, messages and bytes over all legs, up to now."""
        ...


class Histogram:
    """A fixed-bucket histogram of plain numbers (no lock, single-threaded), read by the
    collector: once per handshake or session at most, never per frame."""

    def __init__(self, buckets: tuple[float, ...], keep: bool = True) -> None:
        """``keep``: also keep the last few values (the admin API and benchmarks read them)."""
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0
        self.keep = keep
        self.samples: list[float] = []

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        if self.keep:
            self.samples.append(v)
            if len(self.samples) > 10_000:
                del self.samples[:5_000]

    def add_to(self, m: HistogramMetricFamily, labels: list[str]) -> None:
        buckets = [(str(b), c) for b, c in zip(self.buckets, self.counts, strict=True)]
        m.add_metric(labels, [*buckets, ("+Inf", self.count)], sum_value=self.sum)

    def metric(self, name: str, doc: str) -> HistogramMetricFamily:
        m = HistogramMetricFamily(name, doc)
        self.add_to(m, [])
        return m


class Histograms:
    """One ``Histogram`` per key (a backend's id, a pool's name), made on first use."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.by: dict[str, Histogram] = {}

    def observe(self, key: str, v: float) -> None:
        h = self.by.get(key)
        if h is None:
            h = self.by[key] = Histogram(self.buckets, keep=False)
        h.observe(v)


PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A real engine re-prefills the conversation before its first token after a move: seconds.
FIRST_MESSAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DRAIN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A client's upgrade includes the worker's: loopback takes about a millisecond, a remote worker
# or a TLS handshake tens; the last buckets are the handshake timeout's neighbourhood.
HANDSHAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONNECT_BUCKETS = HANDSHAKE_BUCKETS
# A JSON answer takes milliseconds; a streamed completion seconds to minutes.
HTTP_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
# Chat sessions last from one answer (seconds) to a tab left open for the idle timeout (hours).
SESSION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0)
# Each load signal a scrape gives (balancer.weights.SIGNALS), as its own gauge with its unit.
SIGNAL_FAMILIES: dict[str, tuple[str, str]] = {
    "gpu_util": ("wslb_backend_gpu_utilization_ratio", "Last scraped GPU utilisation (0..1)"),
    "kv_cache_usage": ("wslb_backend_kv_cache_usage_ratio", "Last scraped KV-cache usage (0..1)"),
    "running": ("wslb_backend_running_requests", "Last scraped requests the engine runs"),
    "waiting": ("wslb_backend_waiting_requests", "Last scraped requests queued in the engine"),
    "tpot": ("wslb_backend_tpot_seconds", "Time per output token (decayed mean of scrapes)"),
    "prefill": (
        "wslb_backend_prefill_seconds_per_token",
        "Prefill time per prompt token (decayed mean of scrapes)",
    ),
    "kv_capacity": ("wslb_backend_kv_capacity_tokens", "Tokens the engine's KV cache holds"),
}


@dataclass
class Stats:
    """Counters of events and of finished sessions (plain ints, single-threaded)."""

    frames: Counter[str] = field(default_factory=Counter)
    messages: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    rejections: Counter[int] = field(default_factory=Counter)
    tls_failures: Counter[str] = field(default_factory=Counter)  # by reason
    connect_failures: Counter[str] = field(default_factory=Counter)
    handshake_failures: Counter[str] = field(default_factory=Counter)
    closes: Counter[tuple[str, int]] = field(default_factory=Counter)
    ejections: Counter[str] = field(default_factory=Counter)
    scrape_failures: Counter[str] = field(default_factory=Counter)
    probe_failures: Counter[str] = field(default_factory=Counter)
    migrations: Counter[str] = field(default_factory=Counter)
    migration_pause: Histogram = field(default_factory=lambda: Histogram(PAUSE_BUCKETS))
    migration_first_message: Histogram = field(
        default_factory=lambda: Histogram(FIRST_MESSAGE_BUCKETS)
    )
    failovers: Counter[str] = field(default_factory=Counter)
    failed_over: Counter[str] = field(default_factory=Counter)  # by the lost backend's id
    migrated_away: Counter[str] = field(default_factory=Counter)  # by the old backend's id
    failover_pause: Histogram = field(default_factory=lambda: Histogram(PAUSE_BUCKETS))
    # Client resume (Rule 8): reconnects by result, sessions detached now, and the pause from
    # a reconnect's request to the first byte it was written.
    resumes: Counter[str] = field(default_factory=Counter)
    detached: int = 0
    resume_pause: Histogram = field(default_factory=lambda: Histogram(PAUSE_BUCKETS))
    # Hot restart (SPEC 14): restarts by result, and what each did with the sessions, as this
    # process saw them (counters start again in the new code; the old code's last figures
    # are in the restart's answer and event).
    restarts: Counter[str] = field(default_factory=Counter)
    restart_sessions: Counter[str] = field(default_factory=Counter)
    restart_pause: Histogram = field(default_factory=lambda: Histogram(PAUSE_BUCKETS))
    drain_duration: Histogram = field(default_factory=lambda: Histogram(DRAIN_BUCKETS))
    handshake_duration: Histogram = field(
        default_factory=lambda: Histogram(HANDSHAKE_BUCKETS, keep=False)
    )
    upstream_connect: Histograms = field(default_factory=lambda: Histograms(CONNECT_BUCKETS))
    session_duration: Histograms = field(default_factory=lambda: Histograms(SESSION_BUCKETS))
    connections_total: int = 0
    backpressure_closes: int = 0
    # The relay thread (aio/offload.py): "taken" hand-overs, and hand-backs by reason.
    relay_thread: Counter[str] = field(default_factory=Counter)
    # Plain HTTP (aio/httpproxy.py): requests by (pool, kind, status), in flight by pool, body
    # bytes by direction, durations by "pool\0kind", worker connections made or reused.
    http_requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    http_active: Counter[str] = field(default_factory=Counter)
    http_bytes: Counter[str] = field(default_factory=Counter)
    http_duration: Histograms = field(default_factory=lambda: Histograms(HTTP_BUCKETS))
    http_upstream: Counter[str] = field(default_factory=Counter)
    # The lane thread (aio/lanes.py): connections "taken", back by reason, "exchanges" served.
    http_lanes: Counter[str] = field(default_factory=Counter)
    # Keyless requests placed by their prompt (prefix_placement), by (pool, how).
    http_placed: Counter[tuple[str, str]] = field(default_factory=Counter)
    # WebSocket sessions bound late (balancer/late.py), by (pool, how): placed by prefix,
    # balance or ring, or why not by a prompt (timeout, too large, not a prompt), or ended.
    late_bound: Counter[tuple[str, str]] = field(default_factory=Counter)
    # What engines said of their cache in answers to requests placed by prompt, by (pool, result).
    prefix_reports: Counter[tuple[str, str]] = field(default_factory=Counter)

    def session_done(self, s: LiveSession, now: float) -> None:
        """Fold a finished session's counts into the totals; ``now``: the loop's time."""
        self.session_duration.observe(s.pool.name, now - s.since)
        cs = s.cs
        self.frames[C2W] += cs.frames
        self.messages[C2W] += cs.messages
        self.bytes[C2W] += cs.bytes
        frames, messages, nbytes = s.counts()  # every worker leg's
        self.frames[W2C] += frames
        self.messages[W2C] += messages
        self.bytes[W2C] += nbytes


@dataclass
class BackendView:
    """A backend's figures at scrape time."""

    pool: str
    id: str
    sessions: int
    sessions_total: int
    ready: bool
    state: str
    weight: float
    effective_weight: float
    healthy: bool = True
    stale: bool = True
    signals: dict[str, float | None] = field(default_factory=dict)
    scrape_age: float | None = None
    ejected_for: float = 0.0
    ejections: int = 0
    overloaded: bool = False  # measured overloaded relative to its peers (balancer.selection)
    held: int = 0  # places held for keys between sessions (counted in bounds; balancer.pool)
    kv_headroom: float | None = None  # KV share the conversations there are not expected to need
    refused: dict[str, int] = field(default_factory=dict)  # new keys passed over, by reason
    moved: dict[str, int] = field(default_factory=dict)  # returning keys that left, by reason
    health_reason: str | None = None  # why it is down (the last failed check), None while up
    health_kind: str | None = None  # that reason's kind: refused, timeout, http_status, ...
    health_since: float | None = None  # wall clock of the last health flip
    last_check: float | None = None  # wall clock of the last conclusive health check


class BalancerCollector(Collector):
    """Prometheus collector reading the balancer's state on each scrape."""

    def __init__(
        self,
        stats: Stats,
        sessions: Callable[[], Iterable[LiveSession]],
        backends: Callable[[], Iterable[BackendView]],
        connections: Callable[[], int],
        wall: Callable[[], float] = time.time,
        before: Callable[[], None] = lambda: None,
    ) -> None:
        """``wall``: the clock of the ``_timestamp_seconds`` gauges (Unix time); ``before``:
        called first on each scrape (the lane thread's counts come in: ``aio/lanes.py``)."""
        self._before = before
        self._stats = stats
        self._sessions = sessions
        self._backends = backends
        self._connections = connections
        self._wall = wall
        self._build = [version(), platform.python_version()]

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self._before()
        st = self._stats
        frames = Counter(st.frames)
        messages = Counter(st.messages)
        nbytes = Counter(st.bytes)
        for s in self._sessions():
            cs = s.cs
            frames[C2W] += cs.frames
            messages[C2W] += cs.messages
            nbytes[C2W] += cs.bytes
            w_frames, w_messages, w_bytes = s.counts()  # also what the relay thread forwarded
            frames[W2C] += w_frames
            messages[W2C] += w_messages
            nbytes[W2C] += w_bytes
        for name, doc, counts in (
            ("wslb_frames", "WebSocket frames forwarded", frames),
            ("wslb_messages", "WebSocket data messages forwarded", messages),
            ("wslb_bytes", "Bytes received for relay", nbytes),
        ):
            m = CounterMetricFamily(name, doc, labels=["direction"])
            for direction in (C2W, W2C):
                m.add_metric([direction], counts[direction])
            yield m

        active = GaugeMetricFamily(
            "wslb_sessions_active", "Live sessions per backend", labels=["pool", "backend"]
        )
        total = CounterMetricFamily(
            "wslb_sessions", "Sessions placed per backend", labels=["pool", "backend"]
        )
        up = GaugeMetricFamily(
            "wslb_backend_ready", "1 if the backend takes new sessions", labels=["pool", "backend"]
        )
        state = GaugeMetricFamily(
            "wslb_backend_state",
            "Backend state (1 for the current one)",
            labels=["pool", "backend", "state"],
        )
        weight = GaugeMetricFamily(
            "wslb_backend_effective_weight",
            "Weight used for load bounds",
            labels=["pool", "backend"],
        )
        healthy = GaugeMetricFamily(
            "wslb_backend_healthy", "1 if active health checks pass", labels=["pool", "backend"]
        )
        stale = GaugeMetricFamily(
            "wslb_backend_signals_stale",
            "1 if the scraped signals are too old (weight falls back to static)",
            labels=["pool", "backend"],
        )
        # Timestamps, not ages (Prometheus' naming guide): an age is stale as soon as scraped.
        scraped = GaugeMetricFamily(
            "wslb_backend_last_scrape_timestamp_seconds",
            "When the last good scrape of its load signals was (Unix time)",
            labels=["pool", "backend"],
        )
        signals = {
            name: GaugeMetricFamily(family, doc, labels=["pool", "backend"])
            for name, (family, doc) in SIGNAL_FAMILIES.items()
        }
        ejected = GaugeMetricFamily(
            "wslb_backend_ejected_until_timestamp_seconds",
            "When its outlier ejection ends (Unix time; 0 if not ejected)",
            labels=["pool", "backend"],
        )
        overloaded = GaugeMetricFamily(
            "wslb_backend_overloaded",
            "1 while measured overloaded relative to its peers (reported only: see the moves)",
            labels=["pool", "backend"],
        )
        headroom = GaugeMetricFamily(
            "wslb_backend_kv_headroom_ratio",
            "Share of the KV cache the conversations placed there are not expected to need "
            "(negative: they will not fit; absent while its size is unknown)",
            labels=["pool", "backend"],
        )
        refused = CounterMetricFamily(
            "wslb_backend_placements_refused",
            "New keys whose ring candidate this backend was, placed elsewhere: above its bound, "
            "a lighter candidate, or no KV room",
            labels=["pool", "backend", "reason"],
        )
        moved = CounterMetricFamily(
            "wslb_backend_moves",
            "Returning keys that left this backend: the move paid (cost) or it was at its "
            "affinity ceiling",
            labels=["pool", "backend", "reason"],
        )
        down = GaugeMetricFamily(
            "wslb_backend_down",
            "1 while health checks hold the backend down, labelled with the kind of failure",
            labels=["pool", "backend", "reason"],
        )
        wall = self._wall()
        pool_of: dict[str, str] = {}  # the counters kept by backend id get its pool too
        for b in self._backends():
            pool_of[b.id] = b.pool
            labels = [b.pool, b.id]
            active.add_metric(labels, b.sessions)
            total.add_metric(labels, b.sessions_total)
            up.add_metric(labels, 1 if b.ready else 0)
            state.add_metric([*labels, b.state], 1)
            weight.add_metric(labels, b.effective_weight)
            healthy.add_metric(labels, 1 if b.healthy else 0)
            stale.add_metric(labels, 1 if b.stale else 0)
            if b.scrape_age is not None:
                scraped.add_metric(labels, wall - b.scrape_age)
            for name, value in b.signals.items():
                gauge = signals.get(name)
                if value is not None and gauge is not None:
                    gauge.add_metric(labels, value)
            ejected.add_metric(labels, wall + b.ejected_for if b.ejected_for > 0 else 0.0)
            overloaded.add_metric(labels, 1 if b.overloaded else 0)
            if b.kv_headroom is not None:
                headroom.add_metric(labels, b.kv_headroom)
            for reason in REFUSED:
                refused.add_metric([*labels, reason], b.refused.get(reason, 0))
            for reason in MOVED:
                moved.add_metric([*labels, reason], b.moved.get(reason, 0))
            if not b.healthy:
                down.add_metric([*labels, b.health_kind or "unknown"], 1)
        yield from (
            active,
            total,
            up,
            state,
            weight,
            healthy,
            stale,
            scraped,
            *signals.values(),
            ejected,
            overloaded,
            headroom,
            refused,
            moved,
            down,
        )
        # Kept by backend id; a removed backend's series end with it.
        for name, doc, counts in (
            ("wslb_backend_ejections", "Outlier ejections", st.ejections),
            ("wslb_scrape_failures", "Failed metrics scrapes", st.scrape_failures),
            ("wslb_health_check_failures", "Failed active health checks", st.probe_failures),
            (
                "wslb_upstream_connect_failures",
                "Failed TCP connects to a worker",
                st.connect_failures,
            ),
            (
                "wslb_upstream_handshake_failures",
                "Worker upgrade answers that were not a valid 101",
                st.handshake_failures,
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=["pool", "backend"])
            for bid, n in sorted(counts.items()):
                if bid in pool_of:
                    fam.add_metric([pool_of[bid], bid], n)
            yield fam
        connect = HistogramMetricFamily(
            "wslb_upstream_connect_duration_seconds",
            "TCP connect (and TLS handshake) to a worker, for sessions, moves and failovers",
            labels=["pool", "backend"],
        )
        for bid, h in sorted(st.upstream_connect.by.items()):
            if bid in pool_of:
                h.add_to(connect, [pool_of[bid], bid])
        yield connect
        yield st.handshake_duration.metric(
            "wslb_handshake_duration_seconds",
            "From a client connection's accept to its 101, the worker's own upgrade included",
        )
        sessions = HistogramMetricFamily(
            "wslb_session_duration_seconds",
            "From a session's 101 to its end, over all its legs",
            labels=["pool"],
        )
        for pool, h in sorted(st.session_duration.by.items()):
            h.add_to(sessions, [pool])
        yield sessions
        info = GaugeMetricFamily(
            "wslb_build_info", "The running wslb (always 1)", labels=["version", "python"]
        )
        info.add_metric(self._build, 1)
        yield info

        yield labelled(
            "wslb_handshake_rejections",
            "Client handshakes refused, by HTTP status",
            ["status"],
            st.rejections,
        )
        yield labelled(
            "wslb_tls_handshake_failures",
            "Client TLS handshakes that failed, by reason (OpenSSL's, or timeout/reset/closed)",
            ["reason"],
            st.tls_failures,
        )
        yield labelled(
            "wslb_close_frames",
            "Close frames sent, by receiving side and code (forwarded or wslb's own)",
            ["to", "code"],
            st.closes,
        )
        yield labelled(
            "wslb_migrations",
            "Session migrations by result (migrated or why not)",
            ["result"],
            st.migrations,
        )
        yield st.migration_pause.metric(
            "wslb_migration_pause_seconds", "From freeze to the first message on the new leg"
        )
        yield st.migration_first_message.metric(
            "wslb_migration_first_message_seconds",
            "From freeze to the first worker message after a move, however late (a real "
            "engine's re-prefill included); moves of sessions that stayed quiet are not counted",
        )
        yield labelled(
            "wslb_failovers",
            "Sessions whose worker was lost, by outcome (resumed on another worker, or why not)",
            ["result"],
            st.failovers,
        )
        yield st.failover_pause.metric(
            "wslb_failover_pause_seconds",
            "From the loss of a worker to its session's resumed leg on another worker",
        )
        yield labelled(
            "wslb_resumes",
            "Client reconnects that asked to resume a session, by result (resumed, or why not)",
            ["result"],
            st.resumes,
        )
        detached = GaugeMetricFamily(
            "wslb_detached_sessions",
            "Sessions whose client left without a close, kept for its reconnect",
        )
        detached.add_metric([], st.detached)
        yield detached
        yield st.resume_pause.metric(
            "wslb_resume_pause_seconds",
            "From a resuming client's TCP accept to the first byte written back to it (the "
            "101, then what it missed)",
        )
        yield labelled(
            "wslb_restarts",
            "Restarts this process asked for (ok, or why the new code did not take over) or "
            "took over (taken)",
            ["result"],
            st.restarts,
        )
        yield labelled(
            "wslb_restart_sessions",
            "Sessions a restart handed to the new code (moved), or why not",
            ["result"],
            st.restart_sessions,
        )
        yield st.restart_pause.metric(
            "wslb_restart_pause_seconds",
            "Per session handed on by a restart: from its reads stopping in the old code to "
            "its adoption by the new",
        )
        yield st.drain_duration.metric(
            "wslb_drain_duration_seconds", "From drain start to the worker drained"
        )
        conns = GaugeMetricFamily("wslb_connections_active", "Open client connections")
        conns.add_metric([], self._connections())
        yield conns
        bp = CounterMetricFamily(
            "wslb_backpressure_closes", "Sessions closed (1008) after staying paused too long"
        )
        bp.add_metric([], st.backpressure_closes)
        yield bp
        yield labelled(
            "wslb_relay_thread_handovers",
            "Sessions handed to the relay thread (taken) and back (by reason)",
            ["event"],
            st.relay_thread,
        )
        live = GaugeMetricFamily("wslb_relay_thread_sessions", "Sessions the relay thread relays")
        live.add_metric([], sum(1 for s in self._sessions() if s.relay is not None))
        yield live
        ct = CounterMetricFamily("wslb_connections", "Client connections accepted")
        ct.add_metric([], st.connections_total)
        yield ct
        yield from _http_families(st)


def labelled(
    name: str,
    documentation: str,
    labels: Sequence[str],
    counts: Mapping[Any, float],
    family: type[CounterMetricFamily] | type[GaugeMetricFamily] = CounterMetricFamily,
) -> Metric:
    """A family with one sample per entry of ``counts``, sorted: a key is one label's value or
    a tuple of them, each written as text."""
    metric = family(name, documentation, labels=list(labels))
    for key, n in sorted(counts.items()):
        values = key if isinstance(key, tuple) else (key,)
        metric.add_metric([str(v) for v in values], n)
    return metric


def _http_families(st: Stats) -> Iterator[Metric]:
    """Plain HTTP requests (``aio/httpproxy.py``), by pool and kind: ``sse`` for a
    ``text/event-stream`` answer, ``plain`` for any other."""
    yield labelled(
        "wslb_http_requests",
        "Plain HTTP requests ended, by pool, kind (plain or sse) and status",
        ["pool", "kind", "code"],
        st.http_requests,
    )
    yield labelled(
        "wslb_http_requests_active",
        "Plain HTTP requests in flight",
        ["pool"],
        st.http_active,
        family=GaugeMetricFamily,
    )
    nbytes = CounterMetricFamily(
        "wslb_http_body_bytes", "Plain HTTP body bytes relayed", labels=["direction"]
    )
    for direction in (C2W, W2C):
        nbytes.add_metric([direction], st.http_bytes[direction])
    yield nbytes
    duration = HistogramMetricFamily(
        "wslb_http_request_duration_seconds",
        "From a plain HTTP request's head to the end of its answer",
        labels=["pool", "kind"],
    )
    for key, h in sorted(st.http_duration.by.items()):
        h.add_to(duration, key.split("\x00", 1))
    yield duration
    up = CounterMetricFamily(
        "wslb_http_upstream_connections",
        "Worker connections plain HTTP requests went on: new, or reused from the pool",
        labels=["result"],
    )
    for result in ("new", "reused"):
        up.add_metric([result], st.http_upstream[result])
    yield up
    yield labelled(
        "wslb_http_prefix_placements",
        "Keyless plain requests placed by their prompt (prefix_placement), by how: prefix (a "
        "worker holding its prefix), balance (the least loaded: load imbalanced), ring (the "
        "prompt's first bytes on the ring), bound (so, every holder being at its bound)",
        ["pool", "how"],
        st.http_placed,
    )
    yield labelled(
        "wslb_prefix_reports",
        "Answers to requests placed by their prompt whose engine said what it had cached, by "
        "result: agreed (with the prefix table), evicted (the engine had lost a block the table "
        "placed it for: what extends that block there is taken as gone)",
        ["pool", "result"],
        st.prefix_reports,
    )
    yield labelled(
        "wslb_late_bindings",
        "WebSocket sessions placed by their first message (prefix_placement.websocket), by how: "
        "prefix, balance, ring, bound (as keyless requests), none (placed without a prompt: the "
        "wait for it ran out, it was too large or not a prompt), closed (the client closed or "
        "broke the protocol before it)",
        ["pool", "how"],
        st.late_bound,
    )
    yield labelled(
        "wslb_http_lane_events",
        "Kept-alive connections the lane thread took (taken), gave back (by reason), and the "
        "requests it served (exchanges)",
        ["event"],
        st.http_lanes,
    )
