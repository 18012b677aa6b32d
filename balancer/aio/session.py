"""A live proxied WebSocket: the relay between its two legs, their close states, the heartbeat.

Once a worker has accepted wslb's own upgrade (``proxy.py``), the worker leg's protocol becomes
the ``Session`` (its ``data_received`` is the hot worker-to-client path, with no indirection)
and the client leg's a thin ``ClientLeg``.

The rules of the session's state machine. Everything that decides how a session closes lives in
three fields: the state of each leg (``client`` and ``worker``, a ``Leg``) and the session's
``phase``; plus ``pending_client_close``, a close the client is owed once the worker's in-flight
messages are through. Nothing else is consulted.

A leg's state::

    OPEN --close sent--> CLOSING --transport lost--> CLOSED
      \\--transport lost--> LOST --close forwarded--> CLOSED

"close sent" means a close frame went to that leg's peer: forwarded from the other peer or
wslb's own. The session's phase::

    RELAYING --any close sent or received--> CLOSING --both legs gone--> FINISHED

Rule 1: a close frame from one peer is forwarded to the other (the other leg is CLOSING), and
the other's answer is forwarded back. When the client leg is CLOSING and the client's own close
has been seen, the client leg's TCP is closed by wslb (the server closes first); a CLOSING
worker leg is closed by wslb once the client is gone and the worker's close has been seen.

Rule 2: a worker leg lost while the client leg is OPEN gives the client 1012 if the worker was
draining, else 1011 (or the client's own code, completing its handshake, if it was closing). A
client leg lost while the worker leg is OPEN gives the worker 1001.

Rule 3: a framing violation by the client: the worker gets 1001 after ``VIOLATION_GRACE``
(what it had in flight is relayed first), then the client gets the violation's code (1002,
1007, 1009), held in ``pending_client_close`` meanwhile. A framing violation by the worker: the
worker gets 1002 and the client 1014 (bad gateway).

Rule 4: wslb injects a frame of its own only at a frame boundary of the stream it goes into;
where that is impossible (a worker died mid-frame), the leg's transport is aborted instead.

Rule 5: from CLOSING, every close waits at most ``timeouts.close`` for the peers; then the
owed close is sent and the transports still open are aborted. FINISHED comes when both legs
are gone, exactly once: the session is detached from its backend and the state is told.

Rule 6 (crash failover, pools with ``failover.enabled``): a worker leg lost without a close
(reset, EOF, kill -9, a ping without a pong) while both legs are OPEN, the session RELAYING and
both streams between messages is not Rule 2's: the worker leg stays OPEN, the client is held
(not read) and ``failing_over`` is set; the host's ``worker_lost`` runs the failover
(``failover.py``). It ends in ``resume_on`` (a new worker leg, the client read again) or in
``worker_gone`` (Rule 2 after all: 1011). The session's ``journal`` of what was relayed is
what the new worker is given.

Rule 7 (the relay thread, ``offload.py``): a streaming session in the steady state may be
handed to the relay thread, which then reads the worker and writes the client for it; the
session's ``relay`` is its handle there. Every rule above runs in Python only: each entry point
that writes to the client, closes a leg or decides on the worker's stream first takes the
session back (``reclaim``), and the thread returns it by itself at anything but a whole data
frame. What the thread read and did not forward (``carry``) is scanned before the next read.
A session with a TLS leg (a ``wss://`` client or worker) never goes to the thread: the socket's
descriptor carries ciphertext there, as asyncio's TLS runs OpenSSL over memory buffers inside the
transport, so only the transport may read or write it (``plain_socket``).

Heartbeat: one timer per session that reschedules itself (not re-armed per message, as in
aiohttp's ``web_ws``). It pings both legs every ``ping_interval`` with a random payload that the
scanners recognise in the pong, so endpoints' own pings and pongs pass through untouched; no pong
within ``ping_timeout`` ends the session with 1011. The same timer enforces the idle timeout and
the backpressure limit. The timers of all sessions share one ``TimerWheel`` (``wheel.py``): a
session is an entry in a bucket, not a loop timer of its own, and fires up to 1/16 of its delay
late (at most 1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, cast

from balancer.aio.offload import NOMEM, OFFLOAD_AFTER, Offload
from balancer.aio.wheel import Bucket, TimerWheel
from balancer.config import Config, FailoverCfg, Limits, Timeouts
from balancer.frames import OP_CLOSE, OP_PING, CloseCode, FrameScanner, build_frame, close_payload
from balancer.handshake import ClientRequest
from balancer.journal import Journal
from balancer.metrics import Stats
from balancer.pool import ACTIVE, Backend, Pool

__all__ = [
    "PAUSES_KEPT",
    "ClientLeg",
    "Leg",
    "Phase",
    "Retired",
    "Session",
    "SessionHost",
    "SessionSettings",
    "pause_reading",
]

NEVER = 1 << 62  # an ``offload_at`` no frame count reaches
PAUSES_KEPT = 20  # migration pauses a session remembers (GET /sessions)
# Client bytes kept per session for replay after a migration. Chat clients send little (prompts),
# so 256 KiB covers many messages; a session that outgrows it falls back to the graceful close.
REPLAY_LIMIT = 256 * 1024
# After a client's framing violation, the worker gets this long to send what it was answering
# before wslb closes its leg (the client gets its close code after that).
VIOLATION_GRACE = 0.05

log = logging.getLogger("wslb.server")


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """What a session needs of the config, fixed when it is built (shared by a pool's)."""

    timeouts: Timeouts
    limits: Limits
    replay_limit: int  # 0: no replay log (the pool does not migrate)
    first_tick: float  # the first heartbeat/idle/backpressure timer, 0 for none
    journal_limit: int = 0  # 0: no journal (the pool has no crash failover)

    @classmethod
    def of(
        cls, config: Config, migrate: bool, failover: FailoverCfg | None = None
    ) -> SessionSettings:
        t = config.timeouts
        timers = [x for x in (t.ping_interval, t.idle, t.backpressure) if x > 0]
        journal = failover.journal_limit if failover is not None and failover.enabled else 0
        return cls(
            t, config.limits, REPLAY_LIMIT if migrate else 0, min(timers, default=0.0), journal
        )


class SessionHost(Protocol):
    """What a session uses of the process it lives in (``state.ServerState``)."""

    loop: asyncio.AbstractEventLoop
    wheel: TimerWheel
    stats: Stats
    offload: Offload | None  # the relay thread, where it runs

    def session_started(self, s: Session) -> None: ...

    def session_finished(self, s: Session) -> None: ...

    def worker_lost(self, s: Session) -> None:
        """The worker leg was lost and the session is held for failover (``failover.py``)."""

    def wall_time(self) -> float: ...


class Upgraded(Protocol):
    """A worker leg's handshake protocol once the 101 came (``proxy.UpstreamHandshake``)."""

    extra: bytearray  # bytes that arrived after the 101, before the switch-over
    eof: bool


class Leg(IntEnum):
    """One leg's close state (the module docstring's first diagram)."""

    OPEN = 0
    CLOSING = 1  # a close went to this peer; its transport is still open
    LOST = 2  # the transport is gone and no close went to this peer
    CLOSED = 3  # a close went to this peer and its transport is gone

    @property
    def close_sent(self) -> bool:
        return self is Leg.CLOSING or self is Leg.CLOSED

    @property
    def gone(self) -> bool:
        return self >= Leg.LOST

    def sent(self) -> Leg:
        """The state after a close went to this peer."""
        return Leg.CLOSED if self.gone else Leg.CLOSING

    def lost(self) -> Leg:
        """The state after the transport closed."""
        return Leg.CLOSED if self.close_sent else Leg.LOST


class Phase(IntEnum):
    """The session's phase (the module docstring's second diagram)."""

    RELAYING = 0
    CLOSING = 1  # the close timer runs
    FINISHED = 2


def plain_socket(transport: asyncio.BaseTransport) -> Any:
    """The transport's socket when its descriptor carries the WebSocket bytes themselves, else
    ``None``: on a TLS transport (``ssl_object`` set) the descriptor carries ciphertext, and
    anything that reads or writes it directly (the relay thread) would corrupt the stream."""
    if transport.get_extra_info("ssl_object") is not None:
        return None
    return transport.get_extra_info("socket")


def pause_reading(transport: asyncio.BaseTransport | None, pause: bool) -> None:
    """Pause or resume reading a transport that may be closing (then: nothing)."""
    if transport is None or transport.is_closing():
        return
    transport = cast(asyncio.ReadTransport, transport)
    with contextlib.suppress(RuntimeError):
        if pause:
            transport.pause_reading()
        else:
            transport.resume_reading()


class Retired(asyncio.Protocol):
    """The old worker leg after a migration: its bytes are discarded, its end is no event."""

    def data_received(self, data: bytes) -> None:
        pass


class ClientLeg(asyncio.Protocol):
    """The client leg of a live session: hands everything to the session."""

    # Slots, not a dict. ``data_received`` is a slot holding the session's bound ``client_data``
    # (the transport calls the session directly: one Python call per read, not two); uvloop keeps
    # the same bound method, so it costs nothing more.
    __slots__ = ("data_received", "full", "session")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.data_received = session.client_data  # type: ignore[method-assign]
        self.full = False  # the client's transport asked us to stop writing (backpressure)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.client_lost()

    def pause_writing(self) -> None:
        """The client does not keep up: stop reading the worker."""
        self.full = True
        self.session.paused_since = self.session.state.loop.time()
        pause_reading(self.session.wt, True)

    def resume_writing(self) -> None:
        self.full = False
        self.session.paused_since = 0.0
        if self.session.relay is None:  # else the relay thread reads the worker
            pause_reading(self.session.wt, False)


def _scanners(limits: Any) -> tuple[FrameScanner, FrameScanner]:
    """The client-direction scanner (framing enforced) and a worker-direction one."""
    cs = FrameScanner(
        masked=True,
        max_frame_size=limits.max_frame_size,
        max_message_size=limits.max_message_size,
    )
    return cs, _worker_scanner(limits)


def _worker_scanner(limits: Any) -> FrameScanner:
    return FrameScanner(
        masked=False,
        max_frame_size=max(limits.max_frame_size, limits.max_message_size),
        max_message_size=1 << 62,
    )


class Session(asyncio.Protocol):
    """A live proxied WebSocket; the protocol object of its worker leg. See the module doc."""

    # Slots, not a dict: a few hundred bytes per idle session (docs/benchmarks.md).
    __slots__ = (
        "_awaiting_pong",
        "_last_active",
        "_last_msgs",
        "backend",
        "carry",
        "client",
        "clog",
        "clog_base",
        "close_to_client",
        "close_to_worker",
        "cs",
        "ct",
        "ended",
        "failing_over",
        "failovers",
        "holding",
        "journal",
        "leg_start_msg",
        "migrating",
        "migrations",
        "offload_at",
        "paused_since",
        "pauses",
        "peer",
        "pending_client_close",
        "phase",
        "pool",
        "prior_backends",
        "prior_bytes",
        "prior_frames",
        "prior_messages",
        "relay",
        "req",
        "secure",
        "settings",
        "sid",
        "since",
        "started_wall",
        "state",
        "timer",
        "timing",
        "worker",
        "ws",
        "wt",
    )

    def __init__(
        self,
        state: SessionHost,
        settings: SessionSettings,
        pool: Pool,
        backend: Backend,
        sid: str,
        peer: str,
        ct: asyncio.Transport,
        wt: asyncio.Transport,
        req: ClientRequest,
        secure: bool,
    ) -> None:
        limits = settings.limits
        self.state = state
        self.settings = settings
        self.pool = pool
        self.backend = backend
        self.sid = sid
        self.peer = peer
        self.ct = ct
        self.wt = wt
        self.since = state.loop.time()
        self.started_wall = state.wall_time()
        self.cs, self.ws = _scanners(limits)
        for t in (ct, wt):
            t.set_write_buffer_limits(high=limits.write_buffer_high)
        self.req = req.for_resume()
        self.secure = secure
        self.timing = (0.0, 0.0)  # the first worker leg's connect and answer (the access log)
        # Migration: a bounded log of the client bytes sent on the current worker leg and where
        # each client message ends in it, to replay what the old worker had not processed.
        self.migrations = 0
        # Seconds, one per migration, the last PAUSES_KEPT (a tuple: the empty one is shared).
        self.pauses: tuple[float, ...] = ()
        self.migrating = False
        self.holding = False
        self.clog: bytearray | None = bytearray() if settings.replay_limit else None
        self.clog_base = 0  # absolute client-stream offset of clog[0]
        self.leg_start_msg = 0  # client message index of the first one sent on this leg
        if self.clog is not None:
            self.cs.keep_message_ends()
        # Counts of earlier worker legs (each leg has its own scanner).
        self.prior_frames = 0
        self.prior_messages = 0
        self.prior_bytes = 0
        self.client = Leg.OPEN
        self.worker = Leg.OPEN
        self.phase = Phase.RELAYING
        self.pending_client_close: tuple[int, str] | None = None
        self.timer: Bucket | None = None  # the wheel bucket this session is due in
        self._awaiting_pong = False
        self.paused_since = 0.0  # loop time backpressure paused a leg; 0 when flowing
        self._last_msgs = 0
        self._last_active = self.since
        # For the access log: the close code each side was sent, why the session ended (the
        # first cause) and the workers it left by migration (a tuple: the empty one is shared).
        self.close_to_client: int | None = None
        self.close_to_worker: int | None = None
        self.ended: str | None = None
        self.prior_backends: tuple[str, ...] = ()
        # Crash failover: the journal of what was relayed, and whether a failover holds the
        # session now (its worker leg is gone, the client is not read).
        self.journal = Journal(settings.journal_limit, sid) if settings.journal_limit else None
        self.failovers = 0
        self.failing_over = False
        # Rule 7: the handle in the relay thread while it relays the session, the frame count
        # at which the session is offered to it next, and what it read but did not forward.
        self.relay: int | None = None
        self.offload_at = OFFLOAD_AFTER if state.offload is not None else NEVER
        self.carry = b""
        pool.attach(sid, backend, state.loop.time())
        state.session_started(self)
        self._schedule_tick(settings.first_tick)

    @property
    def closing(self) -> bool:
        """A close has been sent or received (the close timer runs), or the session is over."""
        return self.phase is not Phase.RELAYING

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    # -- hot path --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Bytes from the worker."""
        ws = self.ws
        if self.carry:  # read by the relay thread before these (Rule 7)
            data = self.carry + data
            self.carry = b""
        out = ws.feed(data)
        if out and not self.ct.is_closing():  # uvloop raises on a write to a closed handle
            self.ct.write(out)
            if self.journal is not None:
                self.journal.worker(out)
        if ws.notable:
            # The one scanner field the relay writes: it takes the event the flag announces
            # (a method call here would cost every read).
            ws.notable = False
            self._worker_event()
        if ws.frames >= self.offload_at:
            self._offload()

    def client_data(self, data: bytes) -> None:
        """Bytes from the client."""
        cs = self.cs
        out = cs.feed(data)
        if out:
            journal = self.journal
            if journal is not None and self.relay is not None:
                # The worker's bytes before this message come first in the journal: taken
                # before the write, as the thread may forward the worker's answer to it (the
                # worker's ``response.created``) before this thread gets to the next line.
                self.flush_record()
            if not self.wt.is_closing():
                self.wt.write(out)
            # Logged even when a lost worker leg did not take it: the replay log mirrors the
            # client's stream without a gap, and a failover hands these messages on.
            if self.clog is not None:
                self._log_client(out)
            if journal is not None:
                journal.client(out)
        if cs.notable:
            cs.notable = False
            self._client_event()

    def _log_client(self, out: bytes) -> None:
        clog = self.clog
        assert clog is not None
        clog += out
        excess = len(clog) - self.settings.replay_limit
        if excess > 0:
            del clog[:excess]
            self.clog_base += excess
            ends = self.cs.ends
            if ends is not None and len(ends) > 1024:
                del ends[:-1024]  # keep message ends bounded too

    def replay_from(self, msg_index: int) -> bytes | None:
        """Client bytes after the first ``msg_index`` messages of the session, or None when
        they are no longer in the bounded log."""
        ends = self.cs.ends
        if ends is None or self.clog is None:
            return None
        start = 0
        if msg_index > 0:
            # ``ends`` holds the last message ends; index from the end.
            back = self.cs.messages - msg_index
            if back < 0 or back >= len(ends):
                return None
            start = ends[len(ends) - 1 - back]
        if start < self.clog_base:
            return None
        return bytes(self.clog[start - self.clog_base :])

    # -- the relay thread (Rule 7) ---------------------------------------------------------

    def _offload(self) -> None:
        """Hand the session to the relay thread if it is in the steady state (``offload.py``)."""
        ws = self.ws
        self.offload_at = ws.frames + OFFLOAD_AFTER
        off = self.state.offload
        limit = min(ws.max_frame_size, ws.max_message_size)
        if (
            off is None
            or self.relay is not None
            or self.phase is not Phase.RELAYING
            or self.client is not Leg.OPEN
            or self.worker is not Leg.OPEN
            or self.migrating
            or self.holding
            or self.failing_over
            or self.paused_since
            or self.pending_client_close is not None
            or self.backend.admin_state != ACTIVE
            or not ws.at_rest
            or ws.closed
            or ws.drop_close
            or self.carry
            or limit < 125
            or self.ct.is_closing()
            or self.wt.is_closing()
            or self.ct.get_write_buffer_size()
            or self._client_full()
        ):
            return
        wsock, csock = plain_socket(self.wt), plain_socket(self.ct)
        if wsock is None or csock is None:  # a TLS leg: the event loop relays it (Rule 7)
            self.offload_at = NEVER
            return
        try:
            wfd = wsock.fileno()
            cfd = csock.fileno()
            self.relay = off.take(self, wfd, cfd, limit, self.journal is not None)
        except (OSError, AttributeError) as exc:  # a transport without a socket (tests), EMFILE
            log.debug("session %s stays in the event loop: %s", self.sid, exc)
            self.offload_at = NEVER
            return
        pause_reading(self.wt, True)

    def reclaim(self) -> None:
        """Take the session back from the relay thread (nothing when it is not there)."""
        handle = self.relay
        if handle is None:
            return
        self.relay = None
        off = self.state.offload
        assert off is not None
        r = off.give_back(handle)
        ws = self.ws
        if r.frames or r.nbytes:
            ws.credit(r.frames, r.nbytes)
        if r.record and self.journal is not None:
            self.journal.worker(r.record)
        # A session the thread relayed streams: offered again at its next data frame (after a
        # heartbeat or a pong, only that frame and the carry pass through Python).
        self.offload_at = ws.frames + 1
        if r.backlog and not self.ct.is_closing():
            self.ct.write(r.backlog)  # before anything the event loop writes to the client
        if r.reason == NOMEM:  # the stream lost bytes: it cannot go on
            self._end("relay out of memory")
            self.ct.abort()
            self.wt.abort()
            return
        self.carry = r.carry
        # Read the worker again unless the client is the one not keeping up: ``paused_since``
        # is also set when the *worker* does not read (its leg's backpressure), and keeping the
        # worker's stream unread then would deadlock both.
        if not self._client_full():
            pause_reading(self.wt, False)
        if self.carry:
            self.state.loop.call_soon(self._scan_carry)

    def _client_full(self) -> bool:
        leg = self.ct.get_protocol()
        return isinstance(leg, ClientLeg) and leg.full

    def _scan_carry(self) -> None:
        if self.carry and self.phase is not Phase.FINISHED:
            self.data_received(b"")

    def flush_record(self) -> None:
        """Move what the relay thread forwarded into the journal (failover pools)."""
        if self.relay is not None and self.journal is not None:
            off = self.state.offload
            assert off is not None
            record = off.take_record(self.relay)
            if record:
                self.journal.worker(record)

    def counts(self) -> tuple[int, int, int]:
        """Frames, data messages and bytes worker->client over all legs, including what the
        relay thread forwarded (without taking the session back)."""
        ws = self.ws
        frames, messages, nbytes = ws.frames, ws.messages, ws.bytes
        if self.relay is not None and self.state.offload is not None:
            f, b = self.state.offload.counts(self.relay)
            frames, messages, nbytes = frames + f, messages + f, nbytes + b
        return (
            self.prior_frames + frames,
            self.prior_messages + messages,
            self.prior_bytes + nbytes,
        )

    def hold(self) -> None:
        """Stop reading the client (its bytes wait in the kernel: bounded by the socket)."""
        self.reclaim()
        self.holding = True
        pause_reading(self.ct, True)

    def release(self) -> None:
        if self.failing_over:
            return  # the failover reads the client again once it has a worker leg
        self.holding = False
        pause_reading(self.ct, False)

    def switch(
        self,
        target: Backend,
        wt: asyncio.Transport,
        proto: Upgraded,
        trailing: bytes,
        processed: int,
    ) -> None:
        """Move the worker leg to ``target``.

        ``processed`` is how many client messages of the old leg the old worker handled; the
        client messages after those are replayed on the new leg, before anything held.
        """
        replay = self.replay_from(self.leg_start_msg + processed)
        if replay is None:
            raise RuntimeError("client messages to replay are no longer buffered")
        old_wt = self.wt
        old_wt.set_protocol(Retired())
        if self.cs.at_frame_boundary and not old_wt.is_closing():  # it may have died meanwhile
            payload = close_payload(CloseCode.GOING_AWAY, "session moved")
            old_wt.write(build_frame(OP_CLOSE, payload, mask=True))
        old_wt.close()
        self.migrations += 1
        self._adopt(target, wt, proto, trailing, replay, self.leg_start_msg + processed)

    def resume_on(
        self, target: Backend, wt: asyncio.Transport, proto: Upgraded, trailing: bytes
    ) -> None:
        """Failover: continue on ``target``, which thawed the journal's transcript. The old
        leg is gone; the transcript holds every client message, so nothing is replayed."""
        self.failing_over = False
        self.failovers += 1
        self._adopt(target, wt, proto, trailing, b"", self.cs.messages)
        self.release()

    def _adopt(
        self,
        target: Backend,
        wt: asyncio.Transport,
        proto: Upgraded,
        trailing: bytes,
        replay: bytes,
        leg_start_msg: int,
    ) -> None:
        """Make ``wt`` (open on ``target`` with ``X-WSLB-Resume``) the worker leg."""
        old_backend = self.backend
        self.prior_frames += self.ws.frames
        self.prior_messages += self.ws.messages
        self.prior_bytes += self.ws.bytes
        limits = self.settings.limits
        self.ws = _worker_scanner(limits)
        # The new leg is offered to the relay thread afresh (it may be plain where the old was TLS).
        self.offload_at = OFFLOAD_AFTER if self.state.offload is not None else NEVER
        self.leg_start_msg = leg_start_msg
        self.wt = wt
        wt.set_write_buffer_limits(high=limits.write_buffer_high)
        self.pool.detach(old_backend)
        self.prior_backends += (old_backend.id,)
        self.backend = target
        self.pool.attach(self.sid, target, self.state.loop.time())
        wt.set_protocol(self)
        data = trailing + bytes(proto.extra)
        if replay:
            wt.write(replay)
        if data:
            self.data_received(data)
        if proto.eof:
            self.connection_lost(None)
        else:
            pause_reading(wt, False)

    # -- flow control (worker leg) ---------------------------------------------------------

    def pause_writing(self) -> None:
        """The worker does not keep up: stop reading the client."""
        self.paused_since = self.state.loop.time()
        pause_reading(self.ct, True)

    def resume_writing(self) -> None:
        self.paused_since = 0.0
        if not self.holding:
            pause_reading(self.ct, False)

    # -- events (the rules of the module docstring) ----------------------------------------

    def _client_event(self) -> None:
        self.reclaim()
        cs = self.cs
        if cs.error is not None:
            self._client_violation(cs.error.code, cs.error.reason)
        elif cs.close is not None and not self.worker.close_sent:
            # Rule 1: the client's close was forwarded to the worker.
            self.worker = self.worker.sent()
            self.close_to_worker = cs.close[0]
            self._end("client closed")
            self.state.stats.closes["worker", cs.close[0]] += 1
            self._begin_closing()
        self._maybe_finish()

    def _worker_event(self) -> None:
        ws = self.ws
        if ws.error is not None:  # Rule 3
            log.warning(
                "session %s: worker %s broke framing: %s", self.sid, self.backend.id, ws.error
            )
            self._end(f"worker broke framing: {ws.error.reason}")
            self._send_worker_close(CloseCode.PROTOCOL_ERROR, ws.error.reason)
            self._send_client_close(CloseCode.BAD_GATEWAY, "bad frame from worker")
        elif ws.close is not None:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
                self._send_client_close(code, reason)
            elif not self.client.close_sent:
                # Rule 1: the worker's close went through to the client.
                self.client = self.client.sent()
                self.close_to_client = ws.close[0]
                self._end("worker closed")
                self.state.stats.closes["client", ws.close[0]] += 1
            self._begin_closing()
        self._maybe_finish()

    def _client_violation(self, code: int, reason: str) -> None:
        """Rule 3, the client's side."""
        self._end(f"client broke the protocol: {reason}")
        if self.worker is not Leg.OPEN:
            self._send_client_close(code, reason)
            return
        # Let the worker's in-flight messages through first (answers to what the client sent
        # before the bad frame), then give the client its code.
        self.pending_client_close = (code, reason)
        self.ws.drop_next_close()
        self._begin_closing()
        self.state.loop.call_later(
            VIOLATION_GRACE,
            self._send_worker_close,
            CloseCode.GOING_AWAY,
            "client protocol error",
        )

    def connection_lost(self, exc: Exception | None) -> None:
        """The worker leg closed (Rule 2), or failover takes the session (Rule 6)."""
        self.reclaim()
        if self.carry:  # what the relay thread read before the end is relayed first
            self.data_received(b"")
        if self._may_fail_over():
            self.failing_over = True
            self.hold()
            self.state.worker_lost(self)
            return
        self.worker_gone()

    def _may_fail_over(self) -> bool:
        """Rule 6: lost without a close, while both sides were relaying, between messages."""
        return (
            self.journal is not None
            and not self.failing_over
            and self.phase is Phase.RELAYING
            and self.client is Leg.OPEN
            and self.worker is Leg.OPEN
            and self.pending_client_close is None
            and self.ws.close is None
            and self.ws.error is None
            and self.cs.close is None
            and self.cs.at_message_boundary
        )

    def worker_gone(self) -> None:
        """Rule 2 for a worker leg that is gone (also when a failover could not save it)."""
        if self.failing_over:
            self.failing_over = False
            self.release()  # the client's answer to our close must be read
        self.worker = self.worker.lost()
        if self.client is Leg.OPEN:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
            elif self.cs.close is not None:
                # The client was closing anyway: complete its handshake with its own code.
                code, reason = self.cs.close
                code = CloseCode.NORMAL if code == CloseCode.NO_STATUS else code
            elif self.backend.admin_state != ACTIVE:
                code, reason = CloseCode.SERVICE_RESTART, "worker restarting"
            else:
                code, reason = CloseCode.INTERNAL_ERROR, "worker lost"
            lost = code in (CloseCode.INTERNAL_ERROR, CloseCode.SERVICE_RESTART)
            self._end(reason if lost else "worker closed")
            self._send_client_close(code, reason)
        self._maybe_finish()

    def client_lost(self) -> None:
        """The client leg closed (Rule 2)."""
        self.reclaim()
        self.client = self.client.lost()
        if self.worker is Leg.OPEN:
            self._end("client went away")
            self._send_worker_close(CloseCode.GOING_AWAY, "client went away")
        self._maybe_finish()

    # -- closing ---------------------------------------------------------------------------

    def _send_client_close(self, code: int, reason: str) -> None:
        self.reclaim()
        self.pending_client_close = None
        if self.client is not Leg.OPEN:
            return
        self.client = Leg.CLOSING
        self.close_to_client = code
        self.ws.stop()  # nothing more goes to the client after our close
        self.state.stats.closes["client", code] += 1
        # Failing the connection (RFC 6455 7.1.7) after a client's violation: close TCP at
        # once, without waiting for an answer.
        failing = self.cs.error is not None
        self._write_close(self.ct, self.ws, code, reason, mask=False, fail=failing)
        self._begin_closing()

    def _send_worker_close(self, code: int, reason: str) -> None:
        self.reclaim()
        if self.worker is not Leg.OPEN:
            return
        self.worker = Leg.CLOSING
        self.close_to_worker = code
        self.cs.stop()
        self.state.stats.closes["worker", code] += 1
        self._write_close(self.wt, self.cs, code, reason, mask=True, fail=False)
        self._begin_closing()

    @staticmethod
    def _write_close(
        t: asyncio.Transport, into: FrameScanner, code: int, reason: str, *, mask: bool, fail: bool
    ) -> None:
        """wslb's own close frame into a stream, at a frame boundary only (Rule 4)."""
        if t.is_closing():
            return
        if into.at_frame_boundary:
            t.write(build_frame(OP_CLOSE, close_payload(code, reason), mask=mask))
            if fail:
                t.close()
        else:
            t.abort()

    def close(self, code: int, reason: str) -> None:
        """End the session from wslb's side (shutdown, idle, drain): both legs get ``code``
        (the worker 1001 where the client gets 1012: it is the one going away)."""
        self.reclaim()
        self._end(reason)
        self._send_client_close(code, reason)
        worker_code = CloseCode.GOING_AWAY if code == CloseCode.SERVICE_RESTART else code
        self._send_worker_close(worker_code, reason)
        self._maybe_finish()

    def _end(self, why: str) -> None:
        """Record why the session ends, for the access log: the first cause wins."""
        if self.ended is None:
            self.ended = why

    def _begin_closing(self) -> None:
        if self.phase is not Phase.RELAYING:
            return
        self.phase = Phase.CLOSING
        self._schedule_tick(self.settings.timeouts.close)

    def _maybe_finish(self) -> None:
        """Rule 1's TCP closes, and Rule 5's single FINISHED."""
        self.reclaim()
        # A close wslb sent on the worker's behalf waits for the client's answer (or the timer).
        if self.client is Leg.CLOSING and self.cs.close is not None:
            self.ct.close()
        if self.worker is Leg.CLOSING and self.client.gone and self.ws.close is not None:
            self.wt.close()
        if self.client.gone and self.worker.gone and self.phase is not Phase.FINISHED:
            self.phase = Phase.FINISHED
            self.state.wheel.cancel(self)
            relayed = (self.cs.bytes, self.cs.messages, self.counts()[1])  # the key's size
            self.pool.detach(self.backend, self.sid, self.state.loop.time(), relayed)
            self.state.session_finished(self)

    def _close_timeout(self) -> None:
        """Rule 5: the peers had ``timeouts.close`` to finish their close handshakes."""
        if self.pending_client_close is not None:
            code, reason = self.pending_client_close
            self._send_client_close(code, reason)
        if not self.client.gone:
            self.ct.abort()
        if not self.worker.gone:
            self.wt.abort()

    # -- heartbeat and idle timer ----------------------------------------------------------

    def _schedule_tick(self, delay: float) -> None:
        if delay > 0:
            self.state.wheel.schedule(self, delay)
        else:
            self.state.wheel.cancel(self)

    def _tick(self) -> None:
        """Called by the wheel (which has cleared ``self.timer``)."""
        if self.phase is Phase.FINISHED:
            return
        if not self._awaiting_pong or self.phase is Phase.CLOSING:
            # This tick pings both legs (or ends a close). The pong check needs no hand-back:
            # it reads the Python scanners only (the worker's pong is a control frame, which
            # the thread hands back itself), and every close below takes the session back.
            self.reclaim()
        if self.phase is Phase.CLOSING:
            self._close_timeout()
            return
        t = self.settings.timeouts
        if self.failing_over:  # no worker leg to ping; the failover's steps are bounded
            self._schedule_tick(self.settings.first_tick)
            return
        now = self.state.loop.time()
        msgs = self.cs.messages + self.counts()[1]  # the relay thread's messages included
        if msgs != self._last_msgs:
            self._last_msgs = msgs
            self._last_active = now
        elif t.idle > 0 and now - self._last_active >= t.idle:
            self.close(CloseCode.GOING_AWAY, "idle timeout")
            return
        if self.paused_since and t.backpressure > 0 and now - self.paused_since >= t.backpressure:
            log.info("session %s: paused by backpressure for %.0fs", self.sid, t.backpressure)
            self.state.stats.backpressure_closes += 1
            self.close(CloseCode.POLICY, "peer not reading")
            return
        if t.ping_interval <= 0:
            self._schedule_tick(self.settings.first_tick)
            return
        if self._awaiting_pong:
            self._awaiting_pong = False
            if self.cs.own_ping is not None:
                log.info("session %s: client ping timeout", self.sid)
                self._end("client ping timeout")
                self._send_client_close(CloseCode.INTERNAL_ERROR, "ping timeout")
                self._send_worker_close(CloseCode.GOING_AWAY, "client ping timeout")
                self._maybe_finish()
                return
            if self.ws.own_ping is not None:
                log.info("session %s: worker %s ping timeout", self.sid, self.backend.id)
                self.reclaim()
                if self.journal is None:
                    self._end("worker ping timeout")
                    self._send_client_close(CloseCode.INTERNAL_ERROR, "worker ping timeout")
                self.wt.abort()  # with a journal, the loss is a failover's (Rule 6)
                return
            self._schedule_tick(max(0.0, t.ping_interval - t.ping_timeout) or 0.001)
            return
        # Ping each leg whose outgoing stream is at a frame boundary (else skip it this round).
        self._ping(self.ws, self.cs, self.ct, mask=False)
        self._ping(self.cs, self.ws, self.wt, mask=True)
        self._awaiting_pong = True
        self._schedule_tick(t.ping_timeout)

    @staticmethod
    def _ping(into: FrameScanner, answers: FrameScanner, t: asyncio.Transport, mask: bool) -> None:
        """A ping on transport ``t`` if the stream into it (``into``) is between frames; the
        pong comes back through ``answers``, which consumes it."""
        if into.at_frame_boundary and answers.own_ping is None:
            payload = os.urandom(8)
            answers.expect_pong(payload)
            t.write(build_frame(OP_PING, payload, mask=mask))

    # -- introspection ---------------------------------------------------------------------

    @property
    def pool_name(self) -> str:
        return self.pool.name

    @property
    def backends(self) -> tuple[str, ...]:
        """The workers the session was on, in order (more than one after migrations)."""
        return (*self.prior_backends, self.backend.id)

    @property
    def totals(self) -> tuple[int, int, int, int]:
        """Data messages client->worker and worker->client, then bytes each way."""
        _, messages, nbytes = self.counts()
        return self.cs.messages, messages, self.cs.bytes, nbytes

    @property
    def path(self) -> str:
        return self.req.path

    @property
    def user_agent(self) -> str | None:
        ua = self.req.header(b"user-agent")
        return ua.decode("latin-1", "replace")[:200] if ua is not None else None

    def describe(self) -> dict[str, Any]:
        """The session as the admin API shows it."""
        frames, messages, _ = self.counts()
        return {
            "id": self.sid,
            "pool": self.pool.name,
            "backend": self.backend.id,
            "client": self.peer,
            "since": self.started_wall,
            "messages": {
                "client_to_worker": self.cs.messages,
                "worker_to_client": messages,
            },
            "frames": {
                "client_to_worker": self.cs.frames,
                "worker_to_client": frames,
            },
            "relayed_by": "thread" if self.relay is not None else "event loop",
            "migrations": self.migrations,
            "migration_pauses_ms": [round(p * 1e3, 3) for p in self.pauses],
            "failover": self.failover_view(),
        }

    def failover_view(self) -> dict[str, Any] | None:
        """The journal as operators see it: its size, and whether a crash would be survived."""
        j = self.journal
        if j is None:
            return None
        self.flush_record()
        trouble = j.trouble
        return {
            "journal_bytes": j.size,
            "protocol": j.protocol,
            "failovers": self.failovers,
            "protected": trouble is None,
            "why_not": None if trouble is None else trouble.detail,
        }
