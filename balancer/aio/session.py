"""A live proxied WebSocket, the I/O shell: its two transports around a ``SessionCore``.

Once a worker has accepted wslb's own upgrade (``proxy.py``), the worker leg's protocol becomes
the ``Session`` (its ``data_received`` is the hot worker-to-client path, with no indirection)
and the client leg's a thin ``ClientLeg``. Every rule (how each leg closes, the mode, the
heartbeat, the replay log) is the core's (``balancer/session_core.py``, where the rules are
written down); this module feeds it events and carries out the actions it returns, and owns
only what is I/O: the transports, the timer's bucket in the wheel, the relay thread's handle
and what the thread read and did not forward.

Rule 7 (the relay thread, ``offload.py``): a streaming session in the steady state may be
handed to the relay thread, which then reads the worker and writes the client for it (mode
OFFLOADED; ``relay`` is its handle there). Every rule runs in Python only: each entry point that
writes to the client, closes a leg or decides on the worker's stream first takes the session
back (``reclaim``), and the thread returns it by itself at anything but a whole data frame.
What the thread read and did not forward (``carry``) is scanned before the next read. A session
with a TLS leg (a ``wss://`` client, a ``wss://`` or ``https://`` worker) never goes to the
thread: the socket's descriptor carries ciphertext there, as asyncio's TLS runs OpenSSL over
memory buffers inside the transport, so only the transport may read or write it
(``plain_socket``).

The timers of all sessions share one ``TimerWheel`` (``wheel.py``): a session is an entry in a
bucket, not a loop timer of its own, and fires up to 1/16 of its delay late (at most 1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
from dataclasses import dataclass
from typing import Any, Protocol, cast

from balancer.aio.offload import NOMEM, OFFLOAD_AFTER, Offload, plain_socket
from balancer.aio.wheel import Bucket, TimerWheel
from balancer.config import Config, FailoverCfg, Limits, ResumeCfg, Timeouts
from balancer.frames import OP_CLOSE, CloseCode, FrameScanner, build_frame, close_payload
from balancer.handshake import ClientRequest
from balancer.journal import Journal
from balancer.metrics import Stats
from balancer.pool import ACTIVE, Backend, Pool
from balancer.session_core import (
    PAUSES_KEPT,
    Action,
    Leg,
    Mode,
    Op,
    Phase,
    SessionCore,
    Side,
)

__all__ = [
    "PAUSES_KEPT",
    "ClientLeg",
    "Leg",
    "Mode",
    "Parked",
    "Phase",
    "Retired",
    "Session",
    "SessionHost",
    "SessionSettings",
    "pause_reading",
]

NEVER = 1 << 62  # an ``offload_at`` no frame count reaches
# Client bytes kept per session for replay after a migration. Chat clients send little (prompts),
# so 256 KiB covers many messages; a session that outgrows it falls back to the graceful close.
REPLAY_LIMIT = 256 * 1024

log = logging.getLogger("wslb.server")


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """What a session needs of the config, fixed when it is built (shared by a pool's)."""

    timeouts: Timeouts
    limits: Limits
    replay_limit: int  # 0: no replay log (the pool does not migrate)
    first_tick: float  # the first heartbeat/idle/backpressure timer, 0 for none
    journal_limit: int = 0  # 0: no journal (the pool has no crash failover)
    resume_buffer: int = 0  # 0: the pool's sessions are not resumed (Rule 8)
    grace: float = 0.0

    @classmethod
    def of(
        cls,
        config: Config,
        migrate: bool,
        failover: FailoverCfg | None = None,
        resume: ResumeCfg | None = None,
    ) -> SessionSettings:
        t = config.timeouts
        timers = [x for x in (t.ping_interval, t.idle, t.backpressure) if x > 0]
        journal = failover.journal_limit if failover is not None and failover.enabled else 0
        on = resume is not None and resume.enabled
        return cls(
            t,
            config.limits,
            REPLAY_LIMIT if migrate else 0,
            min(timers, default=0.0),
            journal,
            resume.buffer if on and resume is not None else 0,
            resume.grace if on and resume is not None else 0.0,
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

    def detached(self, s: Session, on: bool, counted: bool = True) -> None:
        """The session's client left without a close (Rule 8), or came back (``on`` False);
        ``counted``: its client connection was counted in this process."""

    def handed_off(self, s: Session) -> None:
        """The session lives on in another process (``handover.py``): forget it here."""

    def token_bound(self, s: Session, old: str | None) -> None:
        """``s.resume_token`` was set (``old`` its previous one): the token index follows."""

    def wall_time(self) -> float: ...


class Upgraded(Protocol):
    """A worker leg's handshake protocol once the 101 came (``proxy.UpstreamHandshake``)."""

    extra: bytearray  # bytes that arrived after the 101, before the switch-over
    eof: bool
    parks: bool  # the worker parks this leg if it drops without a close


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to ``transport`` its peer has not acknowledged: its write buffer and the
    socket's send queue (``SIOCOUTQ``), as far as they can still be read (best effort)."""
    n = 0
    with contextlib.suppress(Exception):
        n = cast(asyncio.WriteTransport, transport).get_write_buffer_size()
    sock = plain_socket(transport)
    if sock is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            n += int.from_bytes(buf, sys.byteorder)
    return n


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


class Parked(asyncio.Protocol):
    """The protocol of a transport made around an adopted socket until its session takes it
    (``Session.adopt``): it stops reading at once and keeps anything that came meanwhile, so
    no byte goes to a protocol that drops it."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.ReadTransport, transport).pause_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data

    def eof_received(self) -> bool | None:
        self.eof = True
        return True  # keep the transport: its session decides


class Gone(asyncio.Transport):
    """The client leg of a detached session adopted by this process, until its client's new
    connection is attached: closed, so nothing is written to it (the shell's writes check)."""

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        pass  # a detached session handed on again (a restart): nothing reads this leg


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
        s = self.session
        s.client_lost(unsent_bytes(s.ct) if s.core.window is not None else 0)

    def pause_writing(self) -> None:
        """The client does not keep up: stop reading the worker."""
        self.full = True
        s = self.session
        s.core.paused_since = s.state.loop.time()
        pause_reading(s.wt, True)

    def resume_writing(self) -> None:
        self.full = False
        s = self.session
        s.core.paused_since = 0.0
        if s.relay is None:  # else the relay thread reads the worker
            pause_reading(s.wt, False)


class Session(asyncio.Protocol):
    """A live proxied WebSocket; the protocol object of its worker leg. See the module doc."""

    # Slots, not a dict: a few hundred bytes per idle session (docs/benchmarks.md).
    __slots__ = (
        "backend",
        "carry",
        "core",
        "ct",
        "frame_waiter",
        "journal",
        "offload_at",
        "parks",
        "peer",
        "pool",
        "relay",
        "req",
        "secure",
        "settings",
        "sid",
        "since",
        "started_wall",
        "state",
        "subprotocol",
        "timer",
        "timing",
        "token",
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
        core: SessionCore | None = None,
        journal: Journal | None = None,
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
        self.core = core or SessionCore(
            sid,
            backend.id,
            max_frame_size=limits.max_frame_size,
            max_message_size=limits.max_message_size,
            replay_limit=settings.replay_limit,
            resume_buffer=settings.resume_buffer,
            grace=settings.grace,
            now=self.since,
        )
        self.token: str | None = None  # Rule 8: the client's secret (set via ``resume_token``)
        # The worker said it parks this leg (``X-WSLB-Park: ok``): a leg it loses without a
        # close keeps the session there, which a stop hands over (``hand_over``).
        self.parks = False
        self.subprotocol: str | None = None  # agreed in the first 101 (a reconnect's too)
        for t in (ct, wt):
            t.set_write_buffer_limits(high=limits.write_buffer_high)
        self.req = req.for_resume()
        self.secure = secure
        self.timing = (0.0, 0.0)  # the first worker leg's connect and answer (the access log)
        self.timer: Bucket | None = None  # the wheel bucket this session is due in
        # Crash failover: the journal of what was relayed.
        if journal is None and settings.journal_limit:
            journal = Journal(settings.journal_limit, sid)
        self.journal = journal
        # Rule 7: the handle in the relay thread while it relays the session, the frame count
        # at which the session is offered to it next, and what it read but did not forward.
        self.relay: int | None = None
        self.offload_at = OFFLOAD_AFTER if state.offload is not None else NEVER
        self.carry = b""
        # A migration step waiting for the worker leg's next frame (``migrate.wait_frames``):
        # woken from ``_offload``, which ``offload_at`` brings in at that frame, so the hot
        # path pays nothing for it.
        self.frame_waiter: asyncio.Future[None] | None = None
        pool.attach(sid, backend, state.loop.time())
        state.session_started(self)
        self._schedule_tick(settings.first_tick)

    @property
    def resume_token(self) -> str | None:
        """Rule 8: the client's secret for its reconnect."""
        return self.token

    @resume_token.setter
    def resume_token(self, token: str | None) -> None:
        """Bound to this session in the host's index (a reconnect finds its session by token,
        whatever newer session its key has), wherever the session is made or adopted."""
        old, self.token = self.token, token
        self.state.token_bound(self, old)

    # -- the core's state, read-only here (the core's rules change it) ----------------------

    @property
    def cs(self) -> FrameScanner:
        return self.core.cs

    @property
    def ws(self) -> FrameScanner:
        return self.core.ws

    @property
    def client(self) -> Leg:
        return self.core.client

    @property
    def worker(self) -> Leg:
        return self.core.worker

    @property
    def phase(self) -> Phase:
        return self.core.phase

    @property
    def mode(self) -> Mode:
        return self.core.mode

    @property
    def closing(self) -> bool:
        """A close has been sent or received (the close timer runs), or the session is over."""
        return self.core.phase is not Phase.RELAYING

    @property
    def finished(self) -> bool:
        return self.core.phase is Phase.FINISHED

    @property
    def ended(self) -> str | None:
        return self.core.ended

    @property
    def close_to_client(self) -> int | None:
        return self.core.close_to_client

    @property
    def close_to_worker(self) -> int | None:
        return self.core.close_to_worker

    @property
    def migrations(self) -> int:
        return self.core.migrations

    @property
    def failovers(self) -> int:
        return self.core.failovers

    @property
    def resumes(self) -> int:
        return self.core.resumes

    @property
    def window_full(self) -> bool:
        """Rule 8: detached, and its worker not read since its window filled (mid-answer)."""
        w = self.core.window
        return w is not None and bool(self.core.detached_at) and len(w.buf) > w.high

    @property
    def pauses(self) -> tuple[float, ...]:
        return self.core.pauses

    # -- hot path --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Bytes from the worker."""
        ws = self.core.ws
        if self.carry:  # read by the relay thread before these (Rule 7)
            data = self.carry + data
            self.carry = b""
        out = ws.feed(data)
        if out:
            window = self.core.window
            if window is not None:  # Rule 8: kept for the client's reconnect
                window.buf += out
                if len(window.buf) > window.high:
                    self._window_full()
            if not self.ct.is_closing():  # uvloop raises on a write to a closed handle
                self.ct.write(out)
            if self.journal is not None:  # also while detached: the window has it for the client
                self.journal.worker(out)
        if ws.notable:
            # The one scanner field the relay writes: it takes the event the flag announces
            # (a method call here would cost every read).
            ws.notable = False
            self.reclaim()
            self._run(self.core.worker_event())
        if ws.frames >= self.offload_at:
            self._offload()

    def client_data(self, data: bytes) -> None:
        """Bytes from the client."""
        core = self.core
        cs = core.cs
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
            if core.clog is not None:
                core.log_client(out)
            if journal is not None:
                journal.client(out)
        if cs.notable:
            cs.notable = False
            self.reclaim()
            self._run(core.client_event())

    def replay_from(self, msg_index: int) -> bytes | None:
        return self.core.replay_from(msg_index)

    # -- the core's actions ----------------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        """Carry out what the core decided, in order."""
        for op, side, arg in actions:
            if op is Op.SCHEDULE:
                self._schedule_tick(self.settings.timeouts.close if arg is None else arg)
                continue
            if op is Op.COUNTED:
                self.state.stats.closes["client" if side is Side.CLIENT else "worker", arg] += 1
                continue
            self.reclaim()  # Rule 7: only Python writes or closes a leg
            t = self.ct if side is Side.CLIENT else self.wt
            if op is Op.WRITE:
                if not t.is_closing():
                    t.write(arg)
            elif op is Op.SEND_CLOSE:
                if not t.is_closing():
                    if arg is None:
                        t.abort()  # Rule 4: not at a frame boundary
                    else:
                        t.write(arg)
            elif op is Op.CLOSE:
                t.close()
            elif op is Op.ABORT:
                t.abort()
            elif op is Op.PAUSE:
                pause_reading(t, True)
            elif op is Op.READ:
                pause_reading(t, False)
            elif op is Op.LATER:
                self.state.loop.call_later(arg, self._grace_over)
            elif op is Op.BACKPRESSURE:
                self.state.stats.backpressure_closes += 1
            elif op is Op.FINISH:
                self._finish()
            elif op is Op.FAIL_OVER:
                self.state.worker_lost(self)

    def _grace_over(self) -> None:
        self.reclaim()
        self._run(self.core.grace_over())

    def _finish(self) -> None:
        """FINISHED (Rule 5): detached from the backend, the host told, once."""
        self.state.wheel.cancel(self)
        cs = self.core.cs
        relayed = (cs.bytes, cs.messages, self.counts()[1])  # the key's size
        self.pool.detach(self.backend, self.sid, self.state.loop.time(), relayed, self.peer)
        self.state.session_finished(self)

    # -- the relay thread (Rule 7) ---------------------------------------------------------

    def _offload(self) -> None:
        """Hand the session to the relay thread if it is in the steady state (``offload.py``);
        first wake a migration step waiting for this frame (``frame_waiter``)."""
        waiter = self.frame_waiter
        if waiter is not None:
            self.frame_waiter = None
            if not waiter.done():
                waiter.set_result(None)
        core = self.core
        ws = core.ws
        off = self.state.offload
        if off is None:
            self.offload_at = NEVER
            return
        self.offload_at = ws.frames + OFFLOAD_AFTER
        if (
            not core.may_offload()
            or self.carry
            or self.backend.admin_state != ACTIVE
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
        limit = min(ws.max_frame_size, ws.max_message_size)
        try:
            wfd = wsock.fileno()
            cfd = csock.fileno()
            record = self.journal is not None or core.window is not None
            self.relay = off.take(self, wfd, cfd, limit, record)
        except (OSError, AttributeError) as exc:  # a transport without a socket (tests), EMFILE
            log.debug("session %s stays in the event loop: %s", self.sid, exc)
            self.offload_at = NEVER
            return
        core.enter(Mode.OFFLOADED)
        pause_reading(self.wt, True)

    def reclaim(self) -> None:
        """Take the session back from the relay thread (nothing when it is not there)."""
        handle = self.relay
        if handle is None:
            return
        self.relay = None
        core = self.core
        if core.mode is Mode.OFFLOADED:
            core.enter(Mode.RELAYING)
        off = self.state.offload
        assert off is not None
        r = off.give_back(handle)
        ws = core.ws
        if r.frames or r.nbytes:
            ws.credit(r.frames, r.nbytes)
        if r.record:
            self._recorded(r.record)
        # A session the thread relayed streams: offered again at its next data frame (after a
        # heartbeat or a pong, only that frame and the carry pass through Python).
        self.offload_at = ws.frames + 1
        if r.backlog and not self.ct.is_closing():
            self.ct.write(r.backlog)  # before anything the event loop writes to the client
        if r.reason == NOMEM:  # every byte came back (carry, backlog): Python relays it on
            log.warning("session %s: the relay thread ran out of memory; relayed here", self.sid)
            self.offload_at = NEVER
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
        if self.carry and self.core.phase is not Phase.FINISHED:
            self.data_received(b"")

    def _recorded(self, record: bytes) -> None:
        """What the relay thread forwarded: into the journal and the resume window."""
        if self.journal is not None:
            self.journal.worker(record)
        window = self.core.window
        if window is not None:
            window.buf += record
            if len(window.buf) > window.high:
                self._window_full()

    def _window_full(self) -> None:
        """Rule 8's bound: an attached session forgets its oldest messages; a detached one
        stops reading the worker (backpressure, never a drop) until its client is back."""
        core = self.core
        if core.detached_at:
            pause_reading(self.wt, True)
        else:
            assert core.window is not None
            core.window.trim()

    def flush_record(self) -> None:
        """Move what the relay thread forwarded into the journal and the resume window."""
        if self.relay is not None and (self.journal is not None or self.core.window is not None):
            off = self.state.offload
            assert off is not None
            record = off.take_record(self.relay)
            if record:
                self._recorded(record)

    def counts(self) -> tuple[int, int, int]:
        """Frames, data messages and bytes worker->client over all legs, including what the
        relay thread forwarded (without taking the session back)."""
        if self.relay is not None and self.state.offload is not None:
            return self.core.counts(*self.state.offload.counts(self.relay))
        return self.core.counts()

    # -- migration and failover: the mode's steps, as their state machines take them -------

    def begin_migration(self) -> bool:
        """MIGRATING, from the relay thread if need be (or detached: Rule 8); False if the
        session is busy, or detached with a full window (the flush would have to read past
        ``resume.buffer``: it waits for its client)."""
        core = self.core
        if core.closing or core.mode not in (Mode.RELAYING, Mode.OFFLOADED, Mode.DETACHED):
            return False
        if self.window_full:
            return False
        self.reclaim()  # the migration reads the worker scanner
        core.enter(Mode.MIGRATING)
        return True

    def end_migration(self) -> None:
        """The migration is over (moved or not). A worker lost meanwhile is failed over now
        (Rule 6: the migration had it); else the client is read again."""
        core = self.core
        if core.mode is Mode.FAILING_OVER:
            if not core.finished:
                self.state.worker_lost(self)
            return
        if core.mode is Mode.HELD:
            core.enter(Mode.MIGRATING)
            if not core.finished:
                pause_reading(self.ct, False)
        if core.mode is Mode.MIGRATING:
            core.enter(core.settled)  # a detached session waits for its client again

    def hold(self) -> bool:
        """HELD: stop reading the client (its bytes wait in the kernel: bounded by the socket).
        False if the migration no longer has the session (its worker was lost: Rule 6)."""
        if self.core.mode is not Mode.MIGRATING:
            return False
        self.reclaim()
        self.core.enter(Mode.HELD)
        pause_reading(self.ct, True)
        return True

    def release(self) -> None:
        """The migration's hold is over: the client is read again (MIGRATING)."""
        if self.core.mode is Mode.HELD:
            self.core.enter(Mode.MIGRATING)
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
        core = self.core
        start = core.leg_start_msg + processed
        replay = core.replay_from(start)
        if replay is None:
            raise RuntimeError("client messages to replay are no longer buffered")
        old_wt = self.wt
        old_wt.set_protocol(Retired())
        if core.cs.at_frame_boundary and not old_wt.is_closing():  # it may have died meanwhile
            payload = close_payload(CloseCode.GOING_AWAY, "session moved")
            old_wt.write(build_frame(OP_CLOSE, payload, mask=True))
        old_wt.close()
        self._adopt(target, wt, proto, trailing, replay, start, moved=True)

    def resume_on(
        self, target: Backend, wt: asyncio.Transport, proto: Upgraded, trailing: bytes
    ) -> None:
        """Failover: continue on ``target``, which thawed the journal's transcript. The old
        leg is gone; the transcript holds every client message, so nothing is replayed."""
        self._adopt(target, wt, proto, trailing, b"", self.core.cs.messages, moved=False)
        if not self.core.client_held:  # the new leg may have been lost at once (Rule 6 again)
            pause_reading(self.ct, False)

    def _adopt(
        self,
        target: Backend,
        wt: asyncio.Transport,
        proto: Upgraded,
        trailing: bytes,
        replay: bytes,
        leg_start_msg: int,
        *,
        moved: bool,
    ) -> None:
        """Make ``wt`` (open on ``target`` with ``X-WSLB-Resume``) the worker leg."""
        old_backend = self.backend
        self.core.new_leg(target.id, leg_start_msg, moved=moved)
        self.parks = proto.parks
        # The new leg is offered to the relay thread afresh (it may be plain where the old was TLS).
        self.offload_at = OFFLOAD_AFTER if self.state.offload is not None else NEVER
        self.wt = wt
        wt.set_write_buffer_limits(high=self.settings.limits.write_buffer_high)
        self.pool.detach(old_backend)
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

    def worker_gone(self) -> None:
        """Rule 2 for a worker leg that is gone (also when a failover could not save it)."""
        self.reclaim()
        self._run(self.core.worker_gone(draining=self.backend.admin_state != ACTIVE))

    # -- flow control (worker leg) ---------------------------------------------------------

    def pause_writing(self) -> None:
        """The worker does not keep up: stop reading the client."""
        self.core.paused_since = self.state.loop.time()
        pause_reading(self.ct, True)

    def resume_writing(self) -> None:
        self.core.paused_since = 0.0
        if not self.core.client_held:
            pause_reading(self.ct, False)

    # -- events from the transports and operators ------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        """The worker leg closed (Rule 2), or failover takes the session (Rule 6)."""
        self.reclaim()
        if self.carry:  # what the relay thread read before the end is relayed first
            self.data_received(b"")
        self._run(
            self.core.worker_lost(
                journal=self.journal is not None,
                draining=self.backend.admin_state != ACTIVE,
            )
        )

    def client_lost(self, unsent: int = 0) -> None:
        """The client leg closed: detached (Rule 8) or Rule 2."""
        self.reclaim()
        core = self.core
        self._run(core.client_lost(self.state.loop.time(), unsent))
        if core.detached_at:
            log.info("session %s: client left without a close; kept %.0fs", self.sid, core.grace)
            self.state.detached(self, True)

    def send_away(self, code: int, reason: str) -> bool:
        """A restart cannot move this client leg (TLS: its crypto state stays here): tell the
        client to come back (a close frame with ``code``); ``drop_client`` then drops its
        connection, so the session detaches (Rule 8) and moves without it. False (nothing
        done) unless it may detach now, between frames towards the client."""
        self.reclaim()
        core = self.core
        if not core.may_detach() or not core.ws.at_frame_boundary:
            return False
        pause_reading(self.wt, True)  # nothing more towards the client on this connection
        self.ct.write(build_frame(OP_CLOSE, close_payload(code, reason)))
        return True

    def hand_over(self, code: int, reason: str) -> bool:
        """A stop hands the session to its worker and its client to the tier: the worker leg
        is let go without a close frame (a FIN once what wslb sent is flushed: the worker
        parks the session and goes on answering into its window), and the client gets a close
        frame saying where to go on (``code``, ``reason``: reconnect and resume). Only between
        messages both ways, so the client's count is exact; False (nothing done) otherwise:
        the caller tries again. A detached session (no client) only lets the worker go."""
        self.reclaim()
        core = self.core
        detached = bool(core.detached_at)
        if not self.parks or core.closing or not core.ws.at_message_boundary:
            return False
        if not detached and not core.may_detach():
            return False
        self.state.wheel.cancel(self)
        wt = self.wt
        wt.set_protocol(Retired())
        pause_reading(wt, False)  # read and dropped: the worker's window has it
        if wt.can_write_eof():
            wt.write_eof()  # the worker reads what wslb sent, then its EOF: it parks
            self.state.loop.call_later(self.settings.timeouts.close, wt.abort)
        else:
            wt.close()
        if not detached:
            ct = self.ct
            ct.set_protocol(Retired())
            ct.write(build_frame(OP_CLOSE, close_payload(code, reason)))
            ct.close()
        self.pool.detach(self.backend)
        self.state.handed_off(self)
        return True

    def drop_client(self) -> None:
        """After ``send_away``'s frame is flushed: the connection goes (no TLS shutdown to
        wait for), and its ``connection_lost`` detaches the session."""
        self.ct.abort()

    def attach(self, ct: asyncio.Transport, n: int, preamble: bytes) -> int:
        """Rule 8: the client is back on ``ct`` with ``n`` messages; it gets ``preamble`` (the
        101), what it missed, then the live stream. The bytes replayed, for the log. Raises
        ``ResumeRefused`` before anything is written."""
        core = self.core
        missed = core.attach(n)  # refusals raise before anything changes
        self.state.detached(self, False)
        self.ct = ct
        ct.set_write_buffer_limits(high=self.settings.limits.write_buffer_high)
        ct.set_protocol(ClientLeg(self))
        ct.write(preamble)
        if missed:
            ct.write(missed)
        self.offload_at = core.ws.frames + OFFLOAD_AFTER if self.state.offload else NEVER
        if not core.client_held:
            pause_reading(ct, False)
        if self.relay is None:
            pause_reading(self.wt, False)  # a full window had paused it (or an adoption)
        if self.carry:  # read before the session was attached here (``adopt``)
            self.state.loop.call_soon(self._scan_carry)
        if not core.closing:
            self._schedule_tick(self.settings.first_tick)
        return len(missed)

    def take_over(self) -> None:
        """A reconnect while the old client leg still looks open (half-open after a network
        change): the old one is dropped as if lost without a close, so the session detaches."""
        self.reclaim()
        old = self.ct
        unsent = unsent_bytes(old) if self.core.window is not None else 0
        old.set_protocol(Retired())
        old.abort()
        self.client_lost(unsent)

    def close(self, code: int, reason: str) -> None:
        """End the session from wslb's side (shutdown, idle, drain)."""
        self.reclaim()
        self._run(self.core.close(code, reason))

    def abort(self) -> None:
        """Both transports aborted at once (the end of a shutdown's grace)."""
        self.reclaim()
        self.ct.abort()
        self.wt.abort()

    # -- heartbeat and idle timer ----------------------------------------------------------

    def _schedule_tick(self, delay: float) -> None:
        if delay > 0:
            self.state.wheel.schedule(self, delay)
        else:
            self.state.wheel.cancel(self)

    def _tick(self) -> None:
        """Called by the wheel (which has cleared ``self.timer``)."""
        core = self.core
        if core.phase is Phase.FINISHED:
            return
        if not core.awaiting_pong or core.phase is Phase.CLOSING or core.cs.own_ping is not None:
            # This tick pings both legs (or ends a close), or the client missed its pong,
            # which may detach the session (Rule 8: the thread gives the worker's stream
            # back first). A pong check that passes needs no hand-back: it reads the Python
            # scanners only (the worker's pong is a control frame, which the thread hands
            # back itself), and every action that writes takes it back.
            self.reclaim()
        t = self.settings.timeouts
        self._run(
            core.tick(
                self.state.loop.time(),
                core.cs.messages + self.counts()[1],  # the relay thread's messages included
                ping_interval=t.ping_interval,
                ping_timeout=t.ping_timeout,
                idle=t.idle,
                backpressure=t.backpressure,
                first_tick=self.settings.first_tick,
                journal=self.journal is not None,
            )
        )

    # -- as data (hot restart; ``SessionCore.snapshot`` is the rules' part) -----------------

    def quiesce(self) -> None:
        """Stop both legs' reads and bring every byte wslb holds into the core's scanners (the
        relay thread's session taken back, its carry scanned), so ``snapshot`` is complete."""
        self.reclaim()
        self.offload_at = NEVER  # not offered to the thread again while described
        pause_reading(self.ct, True)
        pause_reading(self.wt, True)
        if self.carry:
            self.data_received(b"")

    def snapshot(self) -> dict[str, Any]:
        """The live session as a JSON value: the core (scanners, legs, mode, replay log,
        counters, heartbeat), the journal, its placement (pool, backend, key), what it keeps
        of the client's request, its timer. Taken after ``quiesce``; ``adopt`` rebuilds it."""
        self.quiesce()
        now = self.state.loop.time()
        req = self.req
        return {
            "v": 1,
            "clock": now,
            "core": self.core.snapshot(),
            "journal": None if self.journal is None else self.journal.snapshot(),
            "pool": self.pool.name,
            "backend": self.backend.id,
            "sid": self.sid,
            "peer": self.peer,
            "secure": self.secure,
            "req": {
                "path": req.path,
                "query": req.query,
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in req.headers],
                "subprotocols": list(req.subprotocols),
                "host": req.host,
            },
            "age": now - self.since,
            "started_wall": self.started_wall,
            "timing": list(self.timing),
            "timer": None if self.timer is None else max(0.0, self.timer.when - now),
            "resume_token": self.resume_token,
            "subprotocol": self.subprotocol,
            "parks": self.parks,
        }

    @classmethod
    def adopt(
        cls,
        state: SessionHost,
        settings: SessionSettings,
        pool: Pool,
        data: dict[str, Any],
        ct: asyncio.Transport,
        wt: asyncio.Transport,
    ) -> Session:
        """The session ``snapshot`` described, around ``ct`` and ``wt`` (the same connections,
        adopted by this process); both legs are read again. ``ct``'s protocol becomes the
        session's ``ClientLeg``."""
        if data.get("v") != 1:
            raise ValueError(f"unknown session snapshot version {data.get('v')!r}")
        backend = pool.backends.get(data["backend"])
        if backend is None:
            raise ValueError(f"backend {data['backend']!r} is not in pool {pool.name!r}")
        now = state.loop.time()
        core = SessionCore.restore(data["core"], now_offset=now - data["clock"])
        journal = None
        if data["journal"] is not None:
            journal = Journal.restore(data["journal"])
        r = data["req"]
        req = ClientRequest(
            "",
            r["path"],
            r["query"],
            [(k.encode("latin-1"), v.encode("latin-1")) for k, v in r["headers"]],
            b"",
            list(r["subprotocols"]),
            r["host"],
        )
        s = cls(
            state,
            settings,
            pool,
            backend,
            data["sid"],
            data["peer"],
            ct,
            wt,
            req,
            data["secure"],
            core=core,
            journal=journal,
        )
        s.since = now - data["age"]
        s.started_wall = data["started_wall"]
        s.timing = (data["timing"][0], data["timing"][1])
        s.resume_token = data["resume_token"]
        s.subprotocol = data["subprotocol"]
        s.parks = bool(data.get("parks", False))  # an older snapshot: a leg that does not park
        if data["timer"] is not None:
            s._schedule_tick(data["timer"] or 0.001)
        parked = wt.get_protocol()
        wt.set_protocol(s)
        if isinstance(parked, Parked) and parked.buf:  # came before the session took it
            s.carry = bytes(parked.buf)
        if core.detached_at:
            # Waiting for its client: ``ct`` is the reconnect, whose 101 ``attach`` writes
            # first; until then nothing goes to it, and the worker is read from then on.
            s.ct = Gone()
            state.detached(s, True, counted=False)
            return s
        ct.set_protocol(ClientLeg(s))
        if not core.client_held:
            pause_reading(ct, False)
        pause_reading(wt, False)
        if s.carry:
            state.loop.call_soon(s._scan_carry)
        return s

    def handed_off(self) -> None:
        """The session was adopted by another process (its sockets are there now): let go of
        it here without an event to either peer (the other process holds their connections)."""
        self.state.wheel.cancel(self)
        for t in (self.ct, self.wt):
            t.set_protocol(Retired())
            t.abort()  # this process's descriptor only: the adopter's keeps the connection
        self.pool.detach(self.backend)
        self.state.handed_off(self)

    def resume_reading(self) -> None:
        """After a ``snapshot`` that did not move the session: both legs are read again."""
        if not self.core.detached_at and not self.core.client_held:
            pause_reading(self.ct, False)
        pause_reading(self.wt, False)
        self.offload_at = self.core.ws.frames + OFFLOAD_AFTER if self.state.offload else NEVER

    # -- introspection ---------------------------------------------------------------------

    @property
    def pool_name(self) -> str:
        return self.pool.name

    @property
    def backends(self) -> tuple[str, ...]:
        """The workers the session was on, in order (more than one after migrations)."""
        return (*self.core.prior_backends, self.backend.id)

    @property
    def totals(self) -> tuple[int, int, int, int]:
        """Data messages client->worker and worker->client, then bytes each way."""
        _, messages, nbytes = self.counts()
        cs = self.core.cs
        return cs.messages, messages, cs.bytes, nbytes

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
        cs = self.core.cs
        return {
            "id": self.sid,
            "pool": self.pool.name,
            "backend": self.backend.id,
            "client": self.peer,
            "since": self.started_wall,
            "mode": self.core.mode.name.lower(),
            "messages": {
                "client_to_worker": cs.messages,
                "worker_to_client": messages,
            },
            "frames": {
                "client_to_worker": cs.frames,
                "worker_to_client": frames,
            },
            "relayed_by": "thread" if self.relay is not None else "event loop",
            "migrations": self.core.migrations,
            "migration_pauses_ms": [round(p * 1e3, 3) for p in self.core.pauses],
            "failover": self.failover_view(),
            "resume": self.resume_view(),
        }

    def resume_view(self) -> dict[str, Any] | None:
        """Rule 8 as operators see it: whether the client is away, since when, what is kept."""
        core = self.core
        w = core.window
        if w is None:
            return None
        away = core.detached_at
        return {
            "detached": bool(away),
            "detached_for_s": round(self.state.loop.time() - away, 3) if away else None,
            "window_bytes": len(w.buf),
            "resumes": core.resumes,
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
            "failovers": self.core.failovers,
            "protected": trouble is None,
            "why_not": None if trouble is None else trouble.detail,
        }
