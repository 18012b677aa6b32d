"""Counters of the balancer and their Prometheus exposition.

Nothing on the hot path touches prometheus-client: a ``Counter.inc`` takes a lock, which per frame
would cost more than scanning the frame. Live sessions keep plain integers in their scanners;
``Stats`` accumulates the figures of finished sessions and of rare events, and the collector adds
the live ones at scrape time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = ["BalancerCollector", "LiveSession", "Stats"]

C2W = "client_to_worker"
W2C = "worker_to_client"


class _ScannerCounts(Protocol):
    frames: int
    messages: int
    bytes: int


class LiveSession(Protocol):
    """What the collector reads of a live session."""

    @property
    def cs(self) -> _ScannerCounts: ...

    @property
    def ws(self) -> _ScannerCounts: ...

    prior_frames: int
    prior_messages: int
    prior_bytes: int
    relay: int | None  # the handle in the relay thread while it relays the session

    def counts(self) -> tuple[int, int, int]:
        """Worker->client frames, messages and bytes over all legs, up to now."""
        ...


class Histogram:
    """A fixed-bucket histogram for rare events (migrations, drains), read by the collector."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0
        self.samples: list[float] = []  # the last few, for the admin API and benchmarks

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.samples.append(v)
        if len(self.samples) > 10_000:
            del self.samples[:5_000]

    def metric(self, name: str, doc: str) -> HistogramMetricFamily:
        m = HistogramMetricFamily(name, doc)
        buckets = [(str(b), c) for b, c in zip(self.buckets, self.counts, strict=True)]
        m.add_metric([], [*buckets, ("+Inf", self.count)], sum_value=self.sum)
        return m


PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A real engine re-prefills the conversation before its first token after a move: seconds.
FIRST_MESSAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DRAIN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


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
    drain_duration: Histogram = field(default_factory=lambda: Histogram(DRAIN_BUCKETS))
    connections_total: int = 0
    backpressure_closes: int = 0
    # The relay thread (aio/offload.py): "taken" hand-overs, and hand-backs by reason.
    relay_thread: Counter[str] = field(default_factory=Counter)

    def session_done(self, s: LiveSession) -> None:
        """Fold a finished session's counts into the totals."""
        for direction, sc in ((C2W, s.cs), (W2C, s.ws)):
            self.frames[direction] += sc.frames
            self.messages[direction] += sc.messages
            self.bytes[direction] += sc.bytes
        self.frames[W2C] += s.prior_frames
        self.messages[W2C] += s.prior_messages
        self.bytes[W2C] += s.prior_bytes


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
    ) -> None:
        self._stats = stats
        self._sessions = sessions
        self._backends = backends
        self._connections = connections

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
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
        age = GaugeMetricFamily(
            "wslb_backend_scrape_age_seconds",
            "Age of the last good scrape",
            labels=["pool", "backend"],
        )
        signal = GaugeMetricFamily(
            "wslb_backend_signal", "Last scraped load signal", labels=["pool", "backend", "signal"]
        )
        ejected = GaugeMetricFamily(
            "wslb_backend_ejected_seconds",
            "Seconds of ejection left (0 if not ejected)",
            labels=["pool", "backend"],
        )
        overloaded = GaugeMetricFamily(
            "wslb_backend_overloaded",
            "1 while measured overloaded relative to its peers (returning keys get the c bound)",
            labels=["pool", "backend"],
        )
        down = GaugeMetricFamily(
            "wslb_backend_down",
            "1 while health checks hold the backend down, labelled with the kind of failure",
            labels=["pool", "backend", "reason"],
        )
        for b in self._backends():
            labels = [b.pool, b.id]
            active.add_metric(labels, b.sessions)
            total.add_metric(labels, b.sessions_total)
            up.add_metric(labels, 1 if b.ready else 0)
            state.add_metric([*labels, b.state], 1)
            weight.add_metric(labels, b.effective_weight)
            healthy.add_metric(labels, 1 if b.healthy else 0)
            stale.add_metric(labels, 1 if b.stale else 0)
            if b.scrape_age is not None:
                age.add_metric(labels, b.scrape_age)
            for name, value in sorted(b.signals.items()):
                if value is not None:
                    signal.add_metric([*labels, name], value)
            ejected.add_metric(labels, b.ejected_for)
            overloaded.add_metric(labels, 1 if b.overloaded else 0)
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
            age,
            signal,
            ejected,
            overloaded,
            down,
        )
        for name, doc, counts in (
            ("wslb_backend_ejections", "Outlier ejections", st.ejections),
            ("wslb_scrape_failures", "Failed metrics scrapes", st.scrape_failures),
            ("wslb_health_check_failures", "Failed active health checks", st.probe_failures),
        ):
            fam = CounterMetricFamily(name, doc, labels=["backend"])
            for bid, n in sorted(counts.items()):
                fam.add_metric([bid], n)
            yield fam

        rej = CounterMetricFamily(
            "wslb_handshake_rejections",
            "Client handshakes refused, by HTTP status",
            labels=["status"],
        )
        for status, n in sorted(st.rejections.items()):
            rej.add_metric([str(status)], n)
        yield rej
        tls = CounterMetricFamily(
            "wslb_tls_handshake_failures",
            "Client TLS handshakes that failed, by reason (OpenSSL's, or timeout/reset/closed)",
            labels=["reason"],
        )
        for reason, n in sorted(st.tls_failures.items()):
            tls.add_metric([reason], n)
        yield tls
        cf = CounterMetricFamily(
            "wslb_upstream_connect_failures",
            "Failed TCP connects to a worker",
            labels=["backend"],
        )
        for bid, n in sorted(st.connect_failures.items()):
            cf.add_metric([bid], n)
        yield cf
        hf = CounterMetricFamily(
            "wslb_upstream_handshake_failures",
            "Worker upgrade answers that were not a valid 101",
            labels=["backend"],
        )
        for bid, n in sorted(st.handshake_failures.items()):
            hf.add_metric([bid], n)
        yield hf
        closes = CounterMetricFamily(
            "wslb_close_frames",
            "Close frames sent, by receiving side and code (forwarded or wslb's own)",
            labels=["to", "code"],
        )
        for (side, code), n in sorted(st.closes.items()):
            closes.add_metric([side, str(code)], n)
        yield closes
        mig = CounterMetricFamily(
            "wslb_migrations",
            "Session migrations by result (migrated or why not)",
            labels=["result"],
        )
        for result, n in sorted(st.migrations.items()):
            mig.add_metric([result], n)
        yield mig
        yield st.migration_pause.metric(
            "wslb_migration_pause_seconds", "From freeze to the first message on the new leg"
        )
        yield st.migration_first_message.metric(
            "wslb_migration_first_message_seconds",
            "From freeze to the first worker message after a move, however late (a real "
            "engine's re-prefill included); moves of sessions that stayed quiet are not counted",
        )
        failovers = CounterMetricFamily(
            "wslb_failovers",
            "Sessions whose worker was lost, by outcome (resumed on another worker, or why not)",
            labels=["result"],
        )
        for result, n in sorted(st.failovers.items()):
            failovers.add_metric([result], n)
        yield failovers
        yield st.failover_pause.metric(
            "wslb_failover_pause_seconds",
            "From the loss of a worker to its session's resumed leg on another worker",
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
        rt = CounterMetricFamily(
            "wslb_relay_thread_handovers",
            "Sessions handed to the relay thread (taken) and back (by reason)",
            labels=["event"],
        )
        for event, n in sorted(st.relay_thread.items()):
            rt.add_metric([event], n)
        yield rt
        live = GaugeMetricFamily("wslb_relay_thread_sessions", "Sessions the relay thread relays")
        live.add_metric([], sum(1 for s in self._sessions() if s.relay is not None))
        yield live
        ct = CounterMetricFamily("wslb_connections", "Client connections accepted")
        ct.add_metric([], st.connections_total)
        yield ct
