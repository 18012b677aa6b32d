"""A live session as data: the rules of its two legs, its mode and its heartbeat, sans I/O.

The session core owns everything that decides what a proxied WebSocket does: the two frame
scanners, each leg's close state, the session's phase and its mode, the replay log of client
messages, the counters of earlier worker legs and the heartbeat's bookkeeping. It has no socket,
no clock and no event loop: the shell (``balancer/aio/session.py``) feeds it events (bytes
scanned, a side lost, a timer, an operator's request) and carries out the actions it returns
(write, close, abort, pause or read a side, schedule the timer, finish, fail over). So every
rule below is tested without a socket (``tests/test_session_core.py``), and a session can be
described as a value (``snapshot``) and rebuilt around other sockets (``restore``): what client
resume and hot restart are made of.

The hot path is not an event: the shell feeds the scanners itself and writes what they return
(one call per read); it asks the core only when a scanner raises ``notable``.

A leg's close state (``Leg``)::

    OPEN --close sent--> CLOSING --transport lost--> CLOSED
      \\--transport lost--> LOST --close forwarded--> CLOSED

"close sent" means a close frame went to that leg's peer: forwarded from the other peer or
wslb's own. The session's phase (``Phase``)::

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
are gone, exactly once.

Rule 6 (crash failover, pools with a journal): a worker leg lost without a close (reset, EOF,
kill -9, a ping without a pong) while both legs are OPEN, the session RELAYING and both streams
between messages is not Rule 2's: the worker leg stays OPEN, the client is not read and the
mode is FAILING_OVER; the shell's host runs the failover (``aio/failover.py``). It ends in a new
worker leg (``adopt``) or in Rule 2 after all (``worker_gone``: 1011). A worker lost while a
migration runs is the migration's to hand on: the mode is FAILING_OVER at once, and the
migration starts the failover when it ends without having moved the session.

The mode (``Mode``) says who drives the session now; one value, changed only by ``enter``,
which raises ``IllegalTransition`` on any step the table ``TRANSITIONS`` does not list:

    RELAYING      the event loop relays both directions
    OFFLOADED     the relay thread relays the worker's data frames (Rule 7, ``aio/offload.py``);
                  every rule above runs in Python, so each entry point that decides anything
                  takes the session back first (to RELAYING)
    MIGRATING     a migration runs (``aio/migrate.py``); the client is still read
    HELD          the migration holds the client (not read) at a message boundary
    FAILING_OVER  the worker leg is lost and the client is not read (Rule 6)
    DETACHED      the client leg was lost without a close and the worker leg is kept for
                  the client's resume (SPEC section 13): what the worker sends goes into the
                  resume window only; ``grace`` later it is Rule 2's after all

Rule 8 (client resume, pools with ``resume.enabled``): a client leg lost without a close (RST,
EOF, a ping without a pong) while both legs are OPEN, the session RELAYING (or in a migration:
MIGRATING, HELD) and the client between messages is not Rule 2's: the session is DETACHED
(``detached_at`` set; a migration goes on and gives it back DETACHED). The worker leg stays
open and heartbeated, and what it sends is kept in the ``ResumeWindow`` (at most ``buffer``
bytes while detached: past that the shell stops reading the worker, never drops). A migration
or a failover may take a detached session (MIGRATING, FAILING_OVER) and gives it back DETACHED.
A reconnect with the session's token and a count of messages the client has (``attach``) gets
the window from that message on, then the live stream: RELAYING again; a count beyond what the
lost connection was given (``lost_end``) is another session's and is refused. ``grace`` after the
loss, a session still detached gives its worker 1001 (Rule 2).

Heartbeat: one timer per session that reschedules itself. Every ``ping_interval`` it pings both
legs with a random payload that the scanners recognise in the pong, so endpoints' own pings and
pongs pass through untouched; no pong within ``ping_timeout`` ends the session with 1011 (or,
with a journal, loses the worker leg: Rule 6). The same timer enforces the idle timeout and the
backpressure limit.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from enum import IntEnum
from typing import Any

from balancer.frames import OP_CLOSE, OP_PING, CloseCode, FrameScanner, build_frame, close_payload

__all__ = [
    "PAUSES_KEPT",
    "TRANSITIONS",
    "VIOLATION_GRACE",
    "Action",
    "IllegalTransition",
    "Leg",
    "Mode",
    "Op",
    "Phase",
    "ResumeRefused",
    "ResumeWindow",
    "SessionCore",
    "Side",
]

log = logging.getLogger("wslb.server")

PAUSES_KEPT = 20  # migration pauses a session remembers (GET /sessions)
# After a client's framing violation, the worker gets this long to send what it was answering
# before wslb closes its leg (the client gets its close code after that).
VIOLATION_GRACE = 0.05
MESSAGE_ENDS_KEPT = 1024  # client message ends the replay log keeps


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


class Mode(IntEnum):
    """Who drives the session now (the module docstring's table)."""

    RELAYING = 0
    OFFLOADED = 1
    MIGRATING = 2
    HELD = 3
    FAILING_OVER = 4
    DETACHED = 5


TRANSITIONS: dict[Mode, frozenset[Mode]] = {
    Mode.RELAYING: frozenset({Mode.OFFLOADED, Mode.MIGRATING, Mode.FAILING_OVER, Mode.DETACHED}),
    Mode.OFFLOADED: frozenset({Mode.RELAYING}),
    Mode.MIGRATING: frozenset({Mode.HELD, Mode.RELAYING, Mode.FAILING_OVER, Mode.DETACHED}),
    Mode.HELD: frozenset({Mode.MIGRATING, Mode.RELAYING, Mode.FAILING_OVER, Mode.DETACHED}),
    # HELD: a migration switched the session to its target after the old worker was lost.
    Mode.FAILING_OVER: frozenset({Mode.RELAYING, Mode.HELD, Mode.DETACHED}),
    Mode.DETACHED: frozenset({Mode.RELAYING, Mode.MIGRATING, Mode.FAILING_OVER}),
}

# Modes in which the client is not read.
_CLIENT_HELD = frozenset({Mode.HELD, Mode.FAILING_OVER})
# Rule 8: the modes a lost client leg detaches in (a migration gives the session back DETACHED).
_MAY_DETACH = frozenset({Mode.RELAYING, Mode.MIGRATING, Mode.HELD})


class ResumeWindow:
    """What wslb wrote to the client lately (Rule 8): the bytes as written, from a data
    message boundary, ``base_msg`` data messages after the session's first. Appending is the
    hot path's one cost (``buf += out``: no copy per frame kept, nothing for an idle session);
    frames are walked only to trim it or to resume. ``limit`` is the pool's ``resume.buffer``."""

    __slots__ = ("base_msg", "buf", "high", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.high = limit + limit // 4  # trimmed back to ``limit`` past this (amortised walks)
        self.buf = bytearray()
        self.base_msg = 0

    def trim(self) -> None:
        """Forget the oldest whole messages down to ``limit`` bytes."""
        excess = len(self.buf) - self.limit
        if excess <= 0:
            return
        cut, msgs = walk(self.buf, min_bytes=excess)
        if cut:
            del self.buf[:cut]
            self.base_msg += msgs

    def sent(self) -> int:
        """Data messages written to the client whole, in all."""
        return self.base_msg + walk(self.buf)[1]

    def after(self, n: int) -> bytes | None:
        """The bytes from data message ``n`` (0-based, the session's) on; None when it is
        before the window or beyond what was written."""
        if n < self.base_msg:
            return None
        want = n - self.base_msg
        pos, msgs = walk(self.buf, max_msgs=want) if want else (0, 0)
        if msgs < want:
            return None
        return bytes(self.buf[pos:])

    def snapshot(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "buf": base64.b64encode(self.buf).decode(),
            "base_msg": self.base_msg,
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> ResumeWindow:
        w = cls(data["limit"])
        w.buf = bytearray(base64.b64decode(data["buf"]))
        w.base_msg = data["base_msg"]
        return w


def walk(
    buf: bytes | bytearray, *, min_bytes: int | None = None, max_msgs: int | None = None
) -> tuple[int, int]:
    """Walk server frames (unmasked) from ``buf[0]``, a message boundary: the offset just
    after the last whole data message seen and how many there were, stopping at the first
    boundary at or past ``min_bytes``, after ``max_msgs`` messages, or at the end."""
    pos = boundary = msgs = 0
    n = len(buf)
    while pos + 2 <= n:
        b0, b1 = buf[pos], buf[pos + 1]
        size = b1 & 0x7F
        at = pos + 2
        if size == 126:
            if at + 2 > n:
                break
            size, at = int.from_bytes(buf[at : at + 2], "big"), at + 2
        elif size == 127:
            if at + 8 > n:
                break
            size, at = int.from_bytes(buf[at : at + 8], "big"), at + 8
        if b1 & 0x80:
            at += 4
        end = at + size
        if end > n:
            break
        pos = end
        if b0 & 0x80 and (b0 & 0x0F) < 8:  # FIN of a data frame: a message ends here
            msgs += 1
            boundary = pos
            if (min_bytes is not None and pos >= min_bytes) or msgs == max_msgs:
                break
    return boundary, msgs


class IllegalTransition(RuntimeError):
    """A mode change the table does not allow: a bug in the caller, never a peer's doing."""


class ResumeRefused(Exception):
    """A reconnect the session cannot take (the client gets 409 with ``reason``); ``why`` is
    the word a client acts on: ``count_ahead`` (its count is not this session's: a new session
    counts from 0), ``expired`` (the message is no longer kept), ``not_detached``."""

    def __init__(self, reason: str, why: str = "not_detached") -> None:
        super().__init__(reason)
        self.reason = reason
        self.why = why


class Side(IntEnum):
    CLIENT = 0
    WORKER = 1


class Op(IntEnum):
    """What the shell does for an ``Action`` ``(op, side, arg)``."""

    WRITE = 0  # write ``arg`` (bytes) to ``side`` unless its transport is closing
    SEND_CLOSE = 1  # Rule 4: ``arg`` is the close frame, or None to abort ``side`` instead
    CLOSE = 2  # close ``side``'s transport (after what was written)
    ABORT = 3  # abort ``side``'s transport
    PAUSE = 4  # stop reading ``side``
    READ = 5  # read ``side`` again
    SCHEDULE = 6  # the session's timer in ``arg`` seconds (0: none)
    LATER = 7  # call ``grace_over`` after ``arg`` seconds (Rule 3)
    COUNTED = 8  # a close with code ``arg`` went to ``side`` (the close counters)
    BACKPRESSURE = 9  # the session ends for backpressure (the counter)
    FINISH = 10  # FINISHED: detach the session from its backend, tell the host
    FAIL_OVER = 11  # Rule 6: the host's failover takes the session


Action = tuple[Op, Side | None, Any]


def client_scanner(max_frame_size: int, max_message_size: int) -> FrameScanner:
    """The client-direction scanner: masked, framing limits enforced."""
    return FrameScanner(
        masked=True, max_frame_size=max_frame_size, max_message_size=max_message_size
    )


def worker_scanner(max_frame_size: int, max_message_size: int) -> FrameScanner:
    """A worker-direction scanner: wslb relays what its workers send, one message at a time
    within a frame limit, and never limits a message's total (an answer streams for long)."""
    return FrameScanner(
        masked=False,
        max_frame_size=max(max_frame_size, max_message_size),
        max_message_size=1 << 62,
    )


class SessionCore:
    """The rules of one session (module docstring). Methods named after events return the
    actions the shell carries out, in order."""

    __slots__ = (
        "awaiting_pong",
        "backend_id",
        "client",
        "clog",
        "clog_base",
        "close_to_client",
        "close_to_worker",
        "cs",
        "detached_at",
        "ended",
        "failovers",
        "grace",
        "last_active",
        "last_msgs",
        "leg_start_msg",
        "limits",
        "lost_at",
        "lost_end",
        "migrations",
        "mode",
        "paused_since",
        "pauses",
        "pending_client_close",
        "phase",
        "prior_backends",
        "prior_bytes",
        "prior_frames",
        "prior_messages",
        "rand",
        "replay_limit",
        "resumes",
        "sid",
        "window",
        "worker",
        "ws",
    )

    def __init__(
        self,
        sid: str,
        backend_id: str,
        *,
        max_frame_size: int,
        max_message_size: int,
        replay_limit: int = 0,
        resume_buffer: int = 0,
        grace: float = 0.0,
        now: float = 0.0,
        rand: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.sid = sid
        self.backend_id = backend_id
        self.limits = (max_frame_size, max_message_size)
        self.cs = client_scanner(max_frame_size, max_message_size)
        self.ws = worker_scanner(max_frame_size, max_message_size)
        self.client = Leg.OPEN
        self.worker = Leg.OPEN
        self.phase = Phase.RELAYING
        self.mode = Mode.RELAYING
        self.pending_client_close: tuple[int, str] | None = None
        # For the access log: the close code each side was sent and why the session ended.
        self.close_to_client: int | None = None
        self.close_to_worker: int | None = None
        self.ended: str | None = None
        # Migration: a bounded log of the client bytes sent on the current worker leg and where
        # each client message ends in it, to replay what the old worker had not processed.
        self.replay_limit = replay_limit
        self.clog: bytearray | None = bytearray() if replay_limit else None
        self.clog_base = 0  # absolute client-stream offset of clog[0]
        self.leg_start_msg = 0  # client message index of the first one sent on this leg
        if self.clog is not None:
            self.cs.keep_message_ends()
        # Counts of earlier worker legs (each leg has its own scanner), and the legs.
        self.prior_frames = 0
        self.prior_messages = 0
        self.prior_bytes = 0
        self.prior_backends: tuple[str, ...] = ()
        self.migrations = 0
        self.failovers = 0
        self.pauses: tuple[float, ...] = ()  # seconds, one per migration, the last PAUSES_KEPT
        # Heartbeat and idle bookkeeping.
        self.awaiting_pong = False
        self.paused_since = 0.0  # when backpressure paused a leg; 0 when flowing
        self.last_msgs = 0
        self.last_active = now
        self.rand = rand
        # Rule 8: what the client was sent lately (None: the pool does not resume), and since
        # when its leg is detached (0: attached).
        self.window = ResumeWindow(resume_buffer) if resume_buffer else None
        self.grace = grace
        self.detached_at = 0.0
        self.lost_at = 0  # window offset the lost connection's TCP had delivered up to
        # Window offset where what the lost connection was given ends: a count past the
        # messages before it is not this session's (a client that never reset its count).
        self.lost_end = 0
        self.resumes = 0  # reconnects the session took

    # -- the mode ----------------------------------------------------------------------------

    def enter(self, mode: Mode) -> None:
        """Change the mode (the table ``TRANSITIONS``); an illegal step raises."""
        if mode not in TRANSITIONS[self.mode]:
            raise IllegalTransition(f"session {self.sid}: {self.mode.name} -> {mode.name}")
        self.mode = mode

    @property
    def client_held(self) -> bool:
        """The client is not read in this mode."""
        return self.mode in _CLIENT_HELD

    @property
    def closing(self) -> bool:
        return self.phase is not Phase.RELAYING

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def may_offload(self) -> bool:
        """Rule 7: the steady state in which the relay thread may take the session (what the
        transports must also satisfy is the shell's to check)."""
        ws = self.ws
        return (
            self.mode is Mode.RELAYING
            and self.phase is Phase.RELAYING
            and self.client is Leg.OPEN
            and self.worker is Leg.OPEN
            and not self.paused_since
            and self.pending_client_close is None
            and ws.at_rest
            and not ws.closed
            and not ws.drop_close
            and min(ws.max_frame_size, ws.max_message_size) >= 125
        )

    # -- the replay log ----------------------------------------------------------------------

    def log_client(self, out: bytes) -> None:
        """Client bytes relayed (or owed to a lost worker leg) go into the replay log."""
        clog = self.clog
        assert clog is not None
        clog += out
        excess = len(clog) - self.replay_limit
        if excess > 0:
            del clog[:excess]
            self.clog_base += excess
            ends = self.cs.ends
            if ends is not None and len(ends) > MESSAGE_ENDS_KEPT:
                del ends[:-MESSAGE_ENDS_KEPT]

    def replay_from(self, msg_index: int) -> bytes | None:
        """Client bytes after the first ``msg_index`` messages of the session, or None when
        they are no longer in the bounded log."""
        ends = self.cs.ends
        if ends is None or self.clog is None:
            return None
        start = 0
        if msg_index > 0:
            back = self.cs.messages - msg_index  # ``ends`` holds the last ends: from the end
            if back < 0 or back >= len(ends):
                return None
            start = ends[len(ends) - 1 - back]
        if start < self.clog_base:
            return None
        return bytes(self.clog[start - self.clog_base :])

    def new_leg(self, backend_id: str, leg_start_msg: int, *, moved: bool) -> None:
        """A new worker leg on ``backend_id`` (a migration's or a failover's): the old leg's
        counts are kept, the new one gets its own scanner."""
        ws = self.ws
        self.prior_frames += ws.frames
        self.prior_messages += ws.messages
        self.prior_bytes += ws.bytes
        self.ws = worker_scanner(*self.limits)
        self.leg_start_msg = leg_start_msg
        self.prior_backends += (self.backend_id,)
        self.backend_id = backend_id
        if moved:
            self.migrations += 1
        else:
            self.failovers += 1
        if self.mode is Mode.FAILING_OVER:
            # The worker leg is back: a failover's session relays (or waits detached for its
            # client), a migration's (the old worker was lost during it) is held until the
            # migration releases it.
            self.enter(Mode.HELD if moved else self.settled)

    @property
    def settled(self) -> Mode:
        """The mode a migration or failover leaves the session in."""
        return Mode.DETACHED if self.detached_at else Mode.RELAYING

    def counts(self, thread_frames: int = 0, thread_bytes: int = 0) -> tuple[int, int, int]:
        """Frames, data messages and bytes worker->client over all legs, with what the relay
        thread forwarded (whole one-frame messages) added."""
        ws = self.ws
        return (
            self.prior_frames + ws.frames + thread_frames,
            self.prior_messages + ws.messages + thread_frames,
            self.prior_bytes + ws.bytes + thread_bytes,
        )

    # -- events (the rules of the module docstring) ------------------------------------------

    def client_event(self) -> list[Action]:
        """The client's scanner raised ``notable``."""
        out: list[Action] = []
        cs = self.cs
        if cs.error is not None:
            self._client_violation(cs.error.code, cs.error.reason, out)
        elif cs.close is not None and not self.worker.close_sent:
            # Rule 1: the client's close was forwarded to the worker.
            self.worker = self.worker.sent()
            self.close_to_worker = cs.close[0]
            self.end("client closed")
            out.append((Op.COUNTED, Side.WORKER, cs.close[0]))
            self._begin_closing(out)
        self._maybe_finish(out)
        return out

    def worker_event(self) -> list[Action]:
        """The worker's scanner raised ``notable``."""
        out: list[Action] = []
        ws = self.ws
        if ws.error is not None:  # Rule 3
            log.warning(
                "session %s: worker %s broke framing: %s", self.sid, self.backend_id, ws.error
            )
            self.end(f"worker broke framing: {ws.error.reason}")
            self._send_worker_close(CloseCode.PROTOCOL_ERROR, ws.error.reason, out)
            self._send_client_close(CloseCode.BAD_GATEWAY, "bad frame from worker", out)
        elif ws.close is not None:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
                self._send_client_close(code, reason, out)
            elif not self.client.close_sent:
                # Rule 1: the worker's close went through to the client.
                self.client = self.client.sent()
                self.close_to_client = ws.close[0]
                self.end("worker closed")
                out.append((Op.COUNTED, Side.CLIENT, ws.close[0]))
            self._begin_closing(out)
        self._maybe_finish(out)
        return out

    def _client_violation(self, code: int, reason: str, out: list[Action]) -> None:
        """Rule 3, the client's side."""
        self.end(f"client broke the protocol: {reason}")
        if self.worker is not Leg.OPEN:
            self._send_client_close(code, reason, out)
            return
        # Let the worker's in-flight messages through first (answers to what the client sent
        # before the bad frame), then give the client its code.
        self.pending_client_close = (code, reason)
        self.ws.drop_next_close()
        self._begin_closing(out)
        out.append((Op.LATER, None, VIOLATION_GRACE))

    def grace_over(self) -> list[Action]:
        """Rule 3: the worker had its grace after the client's violation."""
        out: list[Action] = []
        self._send_worker_close(CloseCode.GOING_AWAY, "client protocol error", out)
        return out

    def may_fail_over(self, journal: bool) -> bool:
        """Rule 6: lost without a close, while both sides were relaying, between messages."""
        return (
            journal
            and self.mode is not Mode.FAILING_OVER
            and self.phase is Phase.RELAYING
            and self.client is Leg.OPEN
            and self.worker is Leg.OPEN
            and self.pending_client_close is None
            and self.ws.close is None
            and self.ws.error is None
            and self.cs.close is None
            and self.cs.at_message_boundary
        )

    def worker_lost(self, *, journal: bool, draining: bool) -> list[Action]:
        """The worker leg's transport closed: Rule 6 where it applies, else Rule 2."""
        if self.may_fail_over(journal):
            migrating = self.mode is Mode.MIGRATING or self.mode is Mode.HELD
            self.enter(Mode.FAILING_OVER)
            out: list[Action] = [(Op.PAUSE, Side.CLIENT, None)]
            if not migrating:  # else the migration hands it on when it ends
                out.append((Op.FAIL_OVER, None, None))
            return out
        return self.worker_gone(draining=draining)

    def worker_gone(self, *, draining: bool) -> list[Action]:
        """Rule 2 for a worker leg that is gone (also when a failover could not save it)."""
        out: list[Action] = []
        if self.mode is Mode.FAILING_OVER:
            self.enter(Mode.RELAYING)
            out.append((Op.READ, Side.CLIENT, None))  # the client's answer to our close
        self._drop_detached()
        self.worker = self.worker.lost()
        if self.client is Leg.OPEN:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
            elif self.cs.close is not None:
                # The client was closing anyway: complete its handshake with its own code.
                code, reason = self.cs.close
                code = CloseCode.NORMAL if code == CloseCode.NO_STATUS else code
            elif draining:
                code, reason = CloseCode.SERVICE_RESTART, "worker restarting"
            else:
                code, reason = CloseCode.INTERNAL_ERROR, "worker lost"
            lost = code in (CloseCode.INTERNAL_ERROR, CloseCode.SERVICE_RESTART)
            self.end(reason if lost else "worker closed")
            self._send_client_close(code, reason, out)
        self._maybe_finish(out)
        return out

    def may_detach(self) -> bool:
        """Rule 8: lost without a close, while both sides were relaying, between messages."""
        return (
            self.window is not None
            and self.mode in _MAY_DETACH
            and self.phase is Phase.RELAYING
            and self.client is Leg.OPEN
            and self.worker is Leg.OPEN
            and self.pending_client_close is None
            and self.cs.close is None
            and self.cs.error is None
            and self.cs.at_message_boundary
        )

    def client_lost(self, now: float = 0.0, unsent: int = 0) -> list[Action]:
        """The client leg's transport closed: Rule 8 where it applies, else Rule 2.
        ``unsent``: bytes written that the client's TCP had not acknowledged (best effort)."""
        out: list[Action] = []
        if self.may_detach():
            assert self.window is not None
            if self.mode is Mode.RELAYING:  # a migration's session stays the migration's
                self.enter(Mode.DETACHED)
            self.detached_at = now or 1e-9
            self.lost_end = len(self.window.buf)
            self.lost_at = max(0, self.lost_end - unsent)
            self.awaiting_pong = False  # the client's pong will not come; the worker is pinged
            out.append((Op.SCHEDULE, None, self.grace))
            return out
        self.client = self.client.lost()
        if self.worker is Leg.OPEN:
            self.end("client went away")
            self._send_worker_close(CloseCode.GOING_AWAY, "client went away", out)
        self._maybe_finish(out)
        return out

    def _drop_detached(self) -> None:
        """A detached session ends: its client leg is lost after all."""
        if not self.detached_at:
            return
        self.detached_at = 0.0
        if self.mode is Mode.DETACHED:
            self.enter(Mode.RELAYING)
        self.client = self.client.lost()

    def grace_expired(self) -> list[Action]:
        """Rule 8: the client did not come back within ``grace``: Rule 2 (the worker 1001)."""
        self._drop_detached()
        out: list[Action] = []
        if self.worker is Leg.OPEN:
            self.end("client went away")
            self._send_worker_close(CloseCode.GOING_AWAY, "client went away", out)
        self._maybe_finish(out)
        return out

    def best_effort_count(self) -> int:
        """A reconnect without a count: the messages the lost connection's TCP had delivered
        whole (what it had not acknowledged is written again)."""
        w = self.window
        if w is None:
            return 0
        return w.base_msg + walk(w.buf[: self.lost_at])[1]

    def attach(self, n: int) -> bytes:
        """Rule 8: the client is back and has ``n`` data messages; what it missed (the window
        from message ``n`` on). The session relays again (or stays with the migration or
        failover that has it, the client held). Raises ``ResumeRefused``."""
        w = self.window
        if w is None or not self.detached_at:
            raise ResumeRefused("the session is not waiting for its client")
        want = n - w.base_msg
        given = w.base_msg + walk(w.buf[: self.lost_end], max_msgs=want)[1] if want > 0 else n
        if n > given:
            # More than the lost connection was ever given: a count kept from another session
            # (the same token reused), never served from the wrong place.
            raise ResumeRefused(
                f"the count {n} is more than this session sent before its connection was lost"
                f" ({given}): a new session counts from 0",
                "count_ahead",
            )
        missed = w.after(n)
        if missed is None:
            raise ResumeRefused(
                f"message {n} is no longer kept (the window starts at {w.base_msg})", "expired"
            )
        self.detached_at = 0.0
        self.resumes += 1
        # A ping the lost connection never answered is not the new one's to answer: left
        # pending, the next heartbeat took it for a client ping timeout (1011).
        self.cs.own_ping = None
        self.cs.pong_received = False
        self.awaiting_pong = False
        if self.mode is Mode.DETACHED:
            self.enter(Mode.RELAYING)
        return missed

    def close(self, code: int, reason: str) -> list[Action]:
        """End the session from wslb's side (shutdown, idle, drain): both legs get ``code``
        (the worker 1001 where the client gets 1012: it is the one going away)."""
        out: list[Action] = []
        self._drop_detached()
        self.end(reason)
        self._send_client_close(code, reason, out)
        worker_code = CloseCode.GOING_AWAY if code == CloseCode.SERVICE_RESTART else code
        self._send_worker_close(worker_code, reason, out)
        self._maybe_finish(out)
        return out

    def end(self, why: str) -> None:
        """Record why the session ends, for the access log: the first cause wins."""
        if self.ended is None:
            self.ended = why

    # -- closing -----------------------------------------------------------------------------

    def _send_client_close(self, code: int, reason: str, out: list[Action]) -> None:
        self.pending_client_close = None
        if self.client is not Leg.OPEN:
            return
        self.client = Leg.CLOSING
        self.close_to_client = code
        self.ws.stop()  # nothing more goes to the client after our close
        out.append((Op.COUNTED, Side.CLIENT, code))
        # Failing the connection (RFC 6455 7.1.7) after a client's violation: close TCP at
        # once, without waiting for an answer.
        self._close_frame(Side.CLIENT, self.ws, code, reason, False, out)
        if self.cs.error is not None:
            out.append((Op.CLOSE, Side.CLIENT, None))
        self._begin_closing(out)

    def _send_worker_close(self, code: int, reason: str, out: list[Action]) -> None:
        if self.worker is not Leg.OPEN:
            return
        self.worker = Leg.CLOSING
        self.close_to_worker = code
        self.cs.stop()
        out.append((Op.COUNTED, Side.WORKER, code))
        self._close_frame(Side.WORKER, self.cs, code, reason, True, out)
        self._begin_closing(out)

    @staticmethod
    def _close_frame(
        side: Side, into: FrameScanner, code: int, reason: str, mask: bool, out: list[Action]
    ) -> None:
        """wslb's own close frame into a stream, at a frame boundary only (Rule 4)."""
        frame = (
            build_frame(OP_CLOSE, close_payload(code, reason), mask=mask)
            if into.at_frame_boundary
            else None
        )
        out.append((Op.SEND_CLOSE, side, frame))

    def _begin_closing(self, out: list[Action]) -> None:
        if self.phase is not Phase.RELAYING:
            return
        self.phase = Phase.CLOSING
        out.append((Op.SCHEDULE, None, None))  # the close timer (the shell knows its length)

    def _maybe_finish(self, out: list[Action]) -> None:
        """Rule 1's TCP closes, and Rule 5's single FINISHED."""
        # A close wslb sent on the worker's behalf waits for the client's answer (or the timer).
        if self.client is Leg.CLOSING and self.cs.close is not None:
            out.append((Op.CLOSE, Side.CLIENT, None))
        if self.worker is Leg.CLOSING and self.client.gone and self.ws.close is not None:
            out.append((Op.CLOSE, Side.WORKER, None))
        if self.client.gone and self.worker.gone and self.phase is not Phase.FINISHED:
            self.phase = Phase.FINISHED
            out.append((Op.FINISH, None, None))

    def close_timeout(self) -> list[Action]:
        """Rule 5: the peers had ``timeouts.close`` to finish their close handshakes."""
        out: list[Action] = []
        if self.pending_client_close is not None:
            code, reason = self.pending_client_close
            self._send_client_close(code, reason, out)
        if not self.client.gone:
            out.append((Op.ABORT, Side.CLIENT, None))
        if not self.worker.gone:
            out.append((Op.ABORT, Side.WORKER, None))
        return out

    # -- heartbeat and idle timer ------------------------------------------------------------

    def tick(
        self,
        now: float,
        relayed: int,
        *,
        ping_interval: float,
        ping_timeout: float,
        idle: float,
        backpressure: float,
        first_tick: float,
        journal: bool,
    ) -> list[Action]:
        """The session's timer fired at ``now``; ``relayed`` is the data messages relayed both
        ways so far (the relay thread's included). The actions end with the next SCHEDULE."""
        out: list[Action] = []
        if self.phase is Phase.FINISHED:
            return out
        if self.phase is Phase.CLOSING:
            return self.close_timeout()
        if self.mode is Mode.FAILING_OVER:  # no worker leg to ping; the failover is bounded
            out.append((Op.SCHEDULE, None, first_tick))
            return out
        if self.mode is Mode.DETACHED:
            return self._detached_tick(now, ping_interval, ping_timeout, journal)
        if relayed != self.last_msgs:
            self.last_msgs = relayed
            self.last_active = now
        elif idle > 0 and now - self.last_active >= idle:
            return self.close(CloseCode.GOING_AWAY, "idle timeout")
        if self.paused_since and backpressure > 0 and now - self.paused_since >= backpressure:
            log.info("session %s: paused by backpressure for %.0fs", self.sid, backpressure)
            out.append((Op.BACKPRESSURE, None, None))
            out += self.close(CloseCode.POLICY, "peer not reading")
            return out
        if ping_interval <= 0:
            out.append((Op.SCHEDULE, None, first_tick))
            return out
        if self.awaiting_pong:
            self.awaiting_pong = False
            if self.cs.own_ping is not None:
                if self.may_detach():
                    # Rule 8: a path that went silent (a blackhole, a dead Wi-Fi) is a loss like
                    # a reset: the transport is aborted, and its loss detaches the session.
                    log.info("session %s: client ping timeout: detached for a resume", self.sid)
                    out.append((Op.ABORT, Side.CLIENT, None))
                    return out
                log.info("session %s: client ping timeout", self.sid)
                self.end("client ping timeout")
                self._send_client_close(CloseCode.INTERNAL_ERROR, "ping timeout", out)
                self._send_worker_close(CloseCode.GOING_AWAY, "client ping timeout", out)
                self._maybe_finish(out)
                return out
            if self.ws.own_ping is not None:
                log.info("session %s: worker %s ping timeout", self.sid, self.backend_id)
                if not journal:
                    self.end("worker ping timeout")
                    self._send_client_close(CloseCode.INTERNAL_ERROR, "worker ping timeout", out)
                out.append((Op.ABORT, Side.WORKER, None))  # with a journal: Rule 6's loss
                return out
            out.append((Op.SCHEDULE, None, max(0.0, ping_interval - ping_timeout) or 0.001))
            return out
        # Ping each leg whose outgoing stream is at a frame boundary (else skip it this round).
        self._ping(self.ws, self.cs, Side.CLIENT, False, out)
        self._ping(self.cs, self.ws, Side.WORKER, True, out)
        self.awaiting_pong = True
        out.append((Op.SCHEDULE, None, ping_timeout))
        return out

    def _detached_tick(
        self, now: float, ping_interval: float, ping_timeout: float, journal: bool
    ) -> list[Action]:
        """Rule 8's timer: the grace, and the worker's heartbeat (the client has none)."""
        left = self.grace - (now - self.detached_at)
        if left <= 0:
            return self.grace_expired()
        out: list[Action] = []
        if ping_interval <= 0:
            out.append((Op.SCHEDULE, None, left))
            return out
        if self.awaiting_pong:
            self.awaiting_pong = False
            if self.ws.own_ping is not None:
                log.info("session %s: worker %s ping timeout", self.sid, self.backend_id)
                out.append((Op.ABORT, Side.WORKER, None))  # Rule 6 or Rule 2 from there
                return out
            out.append((Op.SCHEDULE, None, min(left, max(ping_interval - ping_timeout, 0.001))))
            return out
        self._ping(self.cs, self.ws, Side.WORKER, True, out)
        self.awaiting_pong = True
        out.append((Op.SCHEDULE, None, min(left, ping_timeout)))
        return out

    def _ping(
        self, into: FrameScanner, answers: FrameScanner, side: Side, mask: bool, out: list[Action]
    ) -> None:
        """A ping to ``side`` if the stream into it (``into``) is between frames; the pong
        comes back through ``answers``, which consumes it."""
        if into.at_frame_boundary and answers.own_ping is None:
            payload = self.rand(8)
            answers.expect_pong(payload)
            out.append((Op.WRITE, side, build_frame(OP_PING, payload, mask=mask)))

    # -- as data -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The core as a JSON value (``restore`` rebuilds it). Taken where the shell has no
        bytes of its own in flight (the relay thread's counts credited, its carry scanned)."""
        return {
            "sid": self.sid,
            "backend": self.backend_id,
            "limits": list(self.limits),
            "cs": self.cs.snapshot(),
            "ws": self.ws.snapshot(),
            "client": int(self.client),
            "worker": int(self.worker),
            "phase": int(self.phase),
            "mode": self.mode.name,
            "pending_client_close": (
                None if self.pending_client_close is None else list(self.pending_client_close)
            ),
            "close_to_client": self.close_to_client,
            "close_to_worker": self.close_to_worker,
            "ended": self.ended,
            "replay_limit": self.replay_limit,
            "clog": None if self.clog is None else base64.b64encode(self.clog).decode(),
            "clog_base": self.clog_base,
            "leg_start_msg": self.leg_start_msg,
            "prior": [self.prior_frames, self.prior_messages, self.prior_bytes],
            "prior_backends": list(self.prior_backends),
            "migrations": self.migrations,
            "failovers": self.failovers,
            "pauses": list(self.pauses),
            "awaiting_pong": self.awaiting_pong,
            "paused_since": self.paused_since,
            "last_msgs": self.last_msgs,
            "last_active": self.last_active,
            "window": None if self.window is None else self.window.snapshot(),
            "grace": self.grace,
            "detached_at": self.detached_at,
            "lost_at": self.lost_at,
            "lost_end": self.lost_end,
            "resumes": self.resumes,
        }

    @classmethod
    def restore(cls, data: dict[str, Any], *, now_offset: float = 0.0) -> SessionCore:
        """The core ``snapshot`` described. ``now_offset`` moves its clock readings into the
        clock of the process that restores it (loop time differs across processes)."""
        mf, mm = data["limits"]
        core = cls(data["sid"], data["backend"], max_frame_size=mf, max_message_size=mm)
        core.cs = FrameScanner.restore(data["cs"])
        core.ws = FrameScanner.restore(data["ws"])
        core.client = Leg(data["client"])
        core.worker = Leg(data["worker"])
        core.phase = Phase(data["phase"])
        core.mode = Mode[data["mode"]]
        pcc = data["pending_client_close"]
        core.pending_client_close = None if pcc is None else (int(pcc[0]), str(pcc[1]))
        core.close_to_client = data["close_to_client"]
        core.close_to_worker = data["close_to_worker"]
        core.ended = data["ended"]
        core.replay_limit = data["replay_limit"]
        clog = data["clog"]
        core.clog = None if clog is None else bytearray(base64.b64decode(clog))
        core.clog_base = data["clog_base"]
        core.leg_start_msg = data["leg_start_msg"]
        core.prior_frames, core.prior_messages, core.prior_bytes = data["prior"]
        core.prior_backends = tuple(data["prior_backends"])
        core.migrations = data["migrations"]
        core.failovers = data["failovers"]
        core.pauses = tuple(data["pauses"])
        core.awaiting_pong = data["awaiting_pong"]
        ps = data["paused_since"]
        core.paused_since = ps + now_offset if ps else 0.0
        core.last_msgs = data["last_msgs"]
        core.last_active = data["last_active"] + now_offset
        win = data["window"]
        core.window = None if win is None else ResumeWindow.restore(win)
        core.grace = data["grace"]
        da = data["detached_at"]
        core.detached_at = da + now_offset if da else 0.0
        core.lost_at = data["lost_at"]
        # An older process's snapshot has no end: all its window counts as given (as it did).
        core.lost_end = data.get("lost_end", len(core.window.buf) if core.window else 0)
        core.resumes = data["resumes"]
        return core
