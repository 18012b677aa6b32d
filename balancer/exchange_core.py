"""Plain HTTP on the client listener as data: the rules of one exchange and of the client
connection's sequence of exchanges, sans I/O.

``ClientConnection`` (``aio/proxy.py``) reads the first request head; when it is not a
WebSocket handshake (``httpmsg.is_handshake``) the connection serves plain HTTP: each request
routed as a session is, its bodies streamed both ways, the worker connections kept alive in a
bounded pool per worker. The cores here decide everything about it: ``ClientCore`` the
connection's state (``State``, changed only by ``enter``, which raises ``IllegalTransition`` on
a step the table ``TRANSITIONS`` does not list), ``ExchangeCore`` one request and its answer
(its timers, its status, keep-alive or close, the retry, the backpressure cut, the hand-over to
the relay thread, rule 9's placing read). They have no socket, no clock and no event loop: the
shell (``aio/httpproxy.py``) keeps the h11 connection and the worker's ``ResponseReader``,
feeds the cores what they parse (a head routed, a worker connected, a body chunk, a response
head, a worker lost, the client gone, a timer fired, the lane back) and carries out the actions
they return (``Op``). ``tests/test_exchange_core.py`` drives every rule below with no socket.

The hot path is not an event: a response body's data go from the reader through h11 to the
client in the shell, which tells the core only their size (``response_data``).

States of a client connection serving HTTP (``State``)::

    IDLE --next head--> ROUTING --worker connected--> EXCHANGE --both messages done--> IDLE
     | \\                 |   ^                        |  ^   \\--rule 7--> RELAYED --+
     |  \\--a handshake--> UPGRADED  \\--rule 9--> PLACING  \\--retry (rule 3)--> ROUTING
     |--rule 8--> LANE --lane back--> IDLE
     \\--error, timeout, client gone, wslb's answer (from any but UPGRADED)--> CLOSED

Rules:

1. One exchange at a time. h11 holds a pipelined request (``PAUSED``) until the one before it
   is done both ways; at most ``limits.max_header_bytes`` of it are read meanwhile.
2. No body is buffered beyond one read (rule 9 aside): a client's body chunk goes to the worker
   as it arrives, a worker's to the client. A full write buffer (``limits.write_buffer_high``)
   on one leg pauses reading on the other, so a slow SSE reader stops the worker's writes. A
   client that stays paused for ``timeouts.backpressure`` (the WebSocket side's setting) ends
   its exchange: the answer is cut and the worker connection closed, not reused. The relay
   thread gives a body back when the client stops taking it, so the clock is kept here (rule
   7); the lane thread keeps its own (``_offload.c``).
3. The worker is chosen as a session's is (``router.route``, then the candidates of a
   ``router.Walk``), before any byte goes to it; a connect that fails walks on to the next.
   Once the request is written nothing is retried, except a bodiless request of an idempotent
   method on a kept-alive connection that died before any answer: it goes again on a new
   connection.
4. Before the worker's response head, wslb's own answer ends the exchange and the connection:
   502 (the worker broke or closed), 503 (no worker ready), 504 (``timeout_server``), 408
   (``timeout_request``), 413 (``max_body``), 400 (malformed), each with a JSON reason. After
   the head a failure can only cut the response: the client connection closes without the
   chunked terminator (or short of its ``Content-Length``), which every client reports.
5. A worker connection goes back to the pool only with both its messages complete; the client
   connection stays open only where h11 allows it (HTTP/1.1, no ``Connection: close``, its
   whole request read) and wslb is not shutting down.
6. While it runs, a request counts on its worker as a session does (bounded load, drains): with
   a key the client named it is placed as a session of that key (affinity, held place after
   it); with a key wslb made for it, it counts only while it runs.
7. A chunked answer (SSE) past its first ``OFFLOAD_AFTER`` chunks goes to the relay thread
   (``_offload.c``, ``walk_chunks``) in the steady state: the request sent whole, the reader
   between chunks, nothing waiting for the client, the worker read, the client's framing chunked
   too, both legs plain TCP. The thread forwards whole chunks as they are; every decision above
   is taken here, after the exchange is taken back (``reclaim``: its unsent bytes go to the
   client first, what it read but did not forward is read here next). So every entry point of
   the shell that decides anything takes the answer back first (RELAYED to EXCHANGE).
8. After an exchange that ended well, a kept-alive connection whose key the client named goes
   to the lane thread with its worker connection (``aio/lanes.py``, ``_offload.c``): it serves
   the next requests of the same routing as this module would, and gives the connection back
   (``lane_back``) for the first one it does not take, which is then served here. A lane that
   served none (the next request differed) is not tried again for ``LANE_SKIP`` requests.
9. A request without a key the client named, or whose named key the pool has not placed yet
   (a conversation's first request), in a pool with ``prefix_placement``, with a body (a POST
   of at most its ``max_body``) is read whole before its worker is chosen (PLACING): its prompt
   places it (``balancer.prefix``, ``Pool.place_prompt``; a named key then stays where its
   first request went, by affinity), then the head and the body go as one write. A body that
   turns out larger is placed without a prompt once past ``max_body`` and streamed from there;
   one that is not a prompt (not JSON, no messages) is placed as any keyless request.
   ``Expect: 100-continue`` is answered before the read; ``timeout_request`` runs during it.
10. The answer to a request placed by its prompt is read here to its end, never by the relay
    thread: what the engine says it had cached (``usage``, llama.cpp's ``timings``) is told
    to the pool's table (``prefix`` rule 6) when the exchange ends (the shell's ``Report``),
    and the id of a response it made is remembered with its worker (``prefix`` rule 8).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import Any, Final

from balancer.config.model import HttpCfg
from balancer.handshake import HandshakeReject
from balancer.httpmsg import IDEMPOTENT, LAST_CHUNK, chunk
from balancer.session_core import IllegalTransition

__all__ = [
    "LANE_SKIP",
    "TRANSITIONS",
    "Action",
    "ClientCore",
    "ExchangeCore",
    "Fate",
    "IllegalTransition",
    "Op",
    "State",
    "Timer",
]

LANE_SKIP: Final = 8
"""Requests served here after a lane that served none (its next request differed) before the
next try: a client whose requests differ each time would otherwise cost a hand-over each."""


class State(IntEnum):
    """The client connection's state (the module docstring's diagram)."""

    IDLE = 0  # between requests (or the first head read): the next head is awaited
    ROUTING = 1  # a head routed: its worker is being chosen or connected (rule 3)
    PLACING = 2  # rule 9: the body is read whole before the worker is chosen
    EXCHANGE = 3  # a worker connection serves the request: bodies stream both ways
    RELAYED = 4  # rule 7: the relay thread forwards the answer's chunks
    LANE = 5  # rule 8: the lane thread serves the connection
    UPGRADED = 6  # a WebSocket handshake: the upgrade path took the connection
    CLOSED = 7  # closed, or lingering before it closes


TRANSITIONS: dict[State, frozenset[State]] = {
    State.IDLE: frozenset({State.ROUTING, State.LANE, State.UPGRADED, State.CLOSED}),
    State.ROUTING: frozenset({State.PLACING, State.EXCHANGE, State.CLOSED}),
    # ROUTING: placed, a worker is being connected; EXCHANGE: a kept-alive one took it at once.
    State.PLACING: frozenset({State.ROUTING, State.EXCHANGE, State.CLOSED}),
    # ROUTING: rule 3's retry on a new connection.
    State.EXCHANGE: frozenset({State.RELAYED, State.ROUTING, State.IDLE, State.CLOSED}),
    State.RELAYED: frozenset({State.EXCHANGE}),
    State.LANE: frozenset({State.IDLE, State.CLOSED}),
    State.UPGRADED: frozenset(),
    State.CLOSED: frozenset(),
}

# State's members as module globals, for the per-request paths (see the codes below).
_IDLE, _ROUTING, _PLACING, _EXCHANGE, _RELAYED, _LANE, _UPGRADED, _CLOSED = State


# The codes below are plain ints, not Enum members: reading a member off an Enum class costs
# about 170 ns in CPython 3.11 (a plain class attribute about 35), and a request reads dozens.


class Timer:
    """The shell's timers, at most one of each per exchange (``ExchangeCore.armed``'s index)."""

    SERVER: Final = 0  # ``timeout_server``: the worker's silence (rule 4: 504)
    REQUEST: Final = 1  # ``timeout_request``: the request body's arrival (rule 4: 408)
    STALL: Final = 2  # ``timeouts.backpressure``: a client not taking the answer (rule 2)


_TIMERS: Final = (Timer.SERVER, Timer.REQUEST, Timer.STALL)
_UNROUTED: Final = HttpCfg()


class Fate:
    """What becomes of the worker connection when its exchange ends (rule 5)."""

    NONE: Final = 0  # it had none (any more)
    CLOSE: Final = 1  # not reusable: closed
    KEEP: Final = 2  # to the pool of kept-alive connections
    SPARE: Final = 3  # the client connection's to give to a lane (rule 8), else to the pool


class Op:
    """What the shell does for an ``Action`` ``(op, arg)``, in order."""

    REFUSE: Final = 0  # ``arg`` (a ``HandshakeReject``): wslb's answer before any worker heard
    ANSWER: Final = 1  # ``arg`` ``(status, message)``: wslb's own answer (rule 4), if writable
    CONTINUE: Final = 2  # answer the client's ``Expect: 100-continue`` if it waits for it
    CHOOSE: Final = 3  # choose a worker (rule 3; by the prompt if rule 9 read one): then ``chosen``
    CONNECT: Final = 4  # connect to the chosen worker, walking on past refusals (rule 3)
    WRITE: Final = 5  # ``arg`` bytes to the worker, held with the head until FLUSH
    FLUSH: Final = 6  # the worker's held writes go out as one
    PUMP: Final = 7  # pass the body h11 holds on; ``arg``: then read the client if ``wants_body``
    READ_CLIENT: Final = 8  # ``arg``: read the client (True) or stop (False)
    READ_WORKER: Final = 9  # ``arg``: read the worker (True) or stop (False)
    ARM: Final = 10  # ``arg`` ``(Timer, seconds)``
    CANCEL: Final = 11  # ``arg``: the ``Timer``
    COUNT: Final = 12  # the request counts on its worker now (rule 6)
    ABORT_WORKER: Final = 13  # the worker connection is aborted and let go
    FAILED: Final = 14  # ``arg``: why the worker failed the request (a warning)
    STALLED: Final = 15  # the client took nothing for ``backpressure``: log, abort its transport
    FINISH: Final = 16  # ``arg`` ``(keep, Fate, uncount)``: the exchange is over (uncount: rule 6)


Action = tuple[int, Any]


class ClientCore:
    """A client connection's state and its rules between exchanges (rules 1, 5, 8)."""

    __slots__ = ("eof", "gone", "keepalive_s", "lane_skip", "lingering", "state", "unread")

    def __init__(self) -> None:
        self.state = _IDLE
        self.keepalive_s = 60.0  # the routed pool's ``timeout_keepalive``
        self.unread = 0  # bytes read past the request being served (rule 1)
        self.eof = False  # the client half-closed
        self.gone = False  # the client's transport is lost
        self.lingering = False  # closed for writing, reading and discarding (``LINGER_S``)
        self.lane_skip = 0  # exchanges served here before a lane is tried again (rule 8)

    def enter(self, state: State) -> None:
        """Change the state (the table ``TRANSITIONS``); an illegal step raises."""
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"plain HTTP connection: {self.state.name} -> {state.name}")
        self.state = state

    def head(self, handshake: bool) -> bool:
        """A request head is in; True: it is plain HTTP, served here (ROUTING); False: the
        upgrade path takes the connection."""
        self.unread = 0
        self.enter(_UPGRADED if handshake else _ROUTING)
        return not handshake

    def read_ahead(self, n: int, limit: int) -> bool:
        """``n`` bytes read past a request read whole (rule 1); False: stop reading, ``limit``
        (``max_header_bytes``) is reached."""
        self.unread += n
        return self.unread <= limit

    def may_go_on(self, keep: bool, closing: bool, cycled: bool) -> bool:
        """Rule 5: after an exchange, whether the connection serves another: the exchange ended
        well (``keep``), the client is still there, wslb is not shutting down (``closing``) and
        h11 has both messages done (``cycled``)."""
        return keep and not self.gone and not self.eof and not closing and cycled

    def lane_due(self) -> bool:
        """Rule 8: whether to try a lane now (after one that served none, not so soon)."""
        if self.lane_skip:
            self.lane_skip -= 1
            return False
        return True

    def lane_back(
        self, *, client_ended: bool, served: int, idle_for: float, closing: bool
    ) -> tuple[bool, float]:
        """The lane thread gave the connection back (LANE to IDLE, or CLOSED) after ``served``
        exchanges: whether the connection goes on, and how long it may stay idle now (its
        keep-alive, less what it waited in the lane)."""
        if client_ended or self.gone or closing:
            self.enter(_CLOSED)
            return False, 0.0
        self.enter(_IDLE)
        if served == 0:  # its next request was not the same again: not so soon
            self.lane_skip = LANE_SKIP
        self.unread = 0
        return True, max(self.keepalive_s - idle_for, 0.01)

    def close(self, settled: bool) -> bool:
        """The connection ends (CLOSED); True: close it now; False: linger first, its write
        side shut, while the client may still be sending its request (``settled``: h11 says it
        is not): a close with unread bytes is a reset that can destroy wslb's answer."""
        if self.state is not _CLOSED:
            self.enter(_CLOSED)
        if self.gone or self.eof or self.lingering or settled:
            return True
        self.lingering = True
        return False


class ExchangeCore:
    """One request and its answer (rules 2 to 7 and 9). Methods named after events return the
    actions the shell carries out, in order; once ``done`` they return nothing."""

    __slots__ = (
        "armed",
        "backpressure",
        "bodyless",
        "bytes_in",
        "bytes_out",
        "cfg",
        "chunked",
        "chunked_out",
        "client",
        "counted",
        "data_events",
        "done",
        "end",
        "expects",
        "full",
        "has_worker",
        "held",
        "held_size",
        "kind",
        "last",
        "length",
        "method",
        "named",
        "paused",
        "paused_at",
        "place_limit",
        "placed",
        "request_done",
        "response_done",
        "response_started",
        "retried",
        "sent",
        "status",
    )

    def __init__(
        self,
        client: ClientCore,
        method: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        now: float,
        backpressure: float,
    ) -> None:
        self.client = client
        self.method = method
        self.length: int | None = None
        self.chunked = False
        self.expects = False  # an ``Expect`` header: h11 says if a 100-continue is owed
        for name, value in headers:
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = True
            elif name == b"expect":
                self.expects = True
        self.bodyless = not self.chunked and not self.length
        self.backpressure = backpressure  # ``timeouts.backpressure`` (rule 2)
        self.cfg = _UNROUTED  # the routed pool's
        self.named = False  # the client named the key (rule 6)
        self.retried = False
        self.request_done = False  # the whole request is read from the client
        self.sent = False  # the whole request is written to the worker
        self.response_started = False  # the response head went to the client
        self.response_done = False
        self.done = False
        self.has_worker = False  # a worker connection serves it (EXCHANGE, RELAYED)
        self.counted = False  # counted on its worker (rule 6)
        self.armed = [False, False, False]  # by ``Timer``
        self.status = 0
        self.kind = "plain"
        self.end = "done"
        self.bytes_in = 0
        self.bytes_out = 0
        self.last = now  # the worker's last sign of life (``timeout_server``)
        self.full = False  # the worker's write buffer is full (rule 2)
        self.paused = False  # the client's write buffer is full: the worker is not read
        self.paused_at = 0.0
        self.data_events = 0  # response body reads (rule 7)
        self.chunked_out = False  # the client's framing is chunked (rule 7)
        self.held: list[bytes] | None = None  # rule 9: the body read before a worker is chosen
        self.held_size = 0
        self.placed = False
        self.place_limit = -1  # rule 9's ``prefix_placement.max_body``; -1: no placing read

    # -- routing (rules 3, 9) ------------------------------------------------------------------

    def refuse(self, rej: HandshakeReject) -> list[Action]:
        """wslb's answer before any worker heard of the request; the connection closes."""
        self.status = rej.status
        self.end = rej.message
        self.done = True
        return [(Op.REFUSE, rej)]

    def routed(
        self, cfg: HttpCfg, *, named: bool, prefix_limit: int | None, known: bool
    ) -> list[Action]:
        """The head is routed to a pool (``cfg`` its ``http``); ``prefix_limit``: its
        ``prefix_placement.max_body`` if it places by prompt; ``known``: the pool has placed
        this named key already. Refused (426, 413), or on: rule 9's read or a worker chosen."""
        self.cfg = cfg
        self.named = named
        self.client.keepalive_s = cfg.timeout_keepalive
        if not cfg.enabled:
            upgrade = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade")]
            return self.refuse(HandshakeReject(426, "this endpoint speaks WebSocket only", upgrade))
        if self.length is not None and self.length > cfg.max_body:
            return self.refuse(HandshakeReject(413, "request body too large"))
        if (
            prefix_limit is not None
            and not self.bodyless
            and not (named and known)
            and self.method == b"POST"
            and (self.length is None or self.length <= prefix_limit)
        ):
            self.client.enter(_PLACING)
            self.place_limit = prefix_limit
            self.held = []
            self.armed[Timer.REQUEST] = True
            out: list[Action] = [(Op.ARM, (Timer.REQUEST, cfg.timeout_request))]
            if self.expects:
                out.append((Op.CONTINUE, None))
            out.append((Op.PUMP, True))
            return out
        return [(Op.CHOOSE, None)]

    @property
    def pumped(self) -> bool:
        """The request body is passed on as it comes: to the worker, or held (rule 9)."""
        return self.has_worker or self.held is not None

    @property
    def wants_body(self) -> bool:
        """The client is read for the body: it is awaited and has somewhere to go."""
        if self.done or self.request_done:
            return False
        if self.has_worker:
            return not self.full
        return self.held is not None and not self.placed

    @property
    def prompt_wanted(self) -> bool:
        """Rule 9: the worker is to be chosen by the prompt of the body read whole."""
        return self.held is not None and self.request_done

    def _place(self) -> list[Action]:
        """Rule 9: the body is in, or past the limit: choose a worker now."""
        self.placed = True
        self.client.enter(_ROUTING)
        out: list[Action] = [(Op.READ_CLIENT, False)]
        if self.armed[Timer.REQUEST]:  # ``begin`` arms it again for the rest
            self.armed[Timer.REQUEST] = False
            out.append((Op.CANCEL, Timer.REQUEST))
        out.append((Op.CHOOSE, None))
        return out

    def chosen(self, found: bool, pooled: bool) -> list[Action]:
        """The pool chose a worker (``found``; else none is ready: 503); ``pooled``: a
        kept-alive connection to it is at hand (the shell begins on it), else one is made."""
        if not found:
            return self.fail(503, "no worker available", "no worker available")
        return [] if pooled else [(Op.CONNECT, None)]

    def no_worker_took(self, tried: bool) -> list[Action]:
        """Every connect failed (502: ``tried``), or no candidate was left to try (503)."""
        if tried:
            return self.fail(502, "no worker could take the request", "no worker could take it")
        return self.fail(503, "no worker available", "no worker available")

    # -- the exchange (rules 2, 4, 6) -------------------------------------------------------------

    def begin(self, now: float, head_ok: bool) -> list[Action]:
        """A worker connection serves the request now (EXCHANGE), its head held to go out
        (``head_ok``; False: the target cannot be written: 400)."""
        self.client.enter(_EXCHANGE)
        self.has_worker = True
        out: list[Action] = []
        if not self.counted:
            self.counted = True
            out.append((Op.COUNT, None))
        if not head_ok:
            out += self.fail(400, "request cannot be forwarded: bad characters", "bad request")
            return out
        self.last = now
        self.sent = False
        if not self.armed[Timer.SERVER]:
            self.armed[Timer.SERVER] = True
            out.append((Op.ARM, (Timer.SERVER, self.cfg.timeout_server)))
        if self.expects:
            out.append((Op.CONTINUE, None))
        held, self.held = self.held, None
        if held is not None:  # read before the worker was chosen (rule 9)
            chunked = self.chunked
            out += [(Op.WRITE, chunk(data) if chunked else data) for data in held]
            if self.request_done and chunked:
                out.append((Op.WRITE, LAST_CHUNK))
        if self.request_done:  # a retry of a bodiless request, or a body read whole
            self.sent = True
            out.append((Op.FLUSH, None))
            return out
        if not self.bodyless:  # a bodiless request ends in the pump at once: no clock for it
            self.armed[Timer.REQUEST] = True
            out.append((Op.ARM, (Timer.REQUEST, self.cfg.timeout_request)))
        out += [(Op.PUMP, True), (Op.FLUSH, None)]
        return out

    def request_data(self, data: bytes, now: float) -> list[Action]:
        """A chunk of the request body (rule 2; rule 9 holds it while PLACING)."""
        if self.done:
            return []
        self.bytes_in += len(data)
        self.last = now
        if self.bytes_in > self.cfg.max_body:
            return self.fail(413, "request body too large", "request body too large")
        held = self.held
        if held is not None:  # rule 9: no worker yet
            held.append(data)
            self.held_size += len(data)
            if not self.placed and self.held_size > self.place_limit:
                return self._place()
            return []
        if self.has_worker:
            return [(Op.WRITE, chunk(data) if self.chunked else data)]
        return []

    def request_end(self) -> list[Action]:
        """The request is read whole. (An answer complete before this ended the exchange,
        ``response_end``: the request's end finishes nothing.)"""
        if self.done:
            return []
        self.request_done = True
        out: list[Action] = []
        if self.armed[Timer.REQUEST]:
            self.armed[Timer.REQUEST] = False
            out.append((Op.CANCEL, Timer.REQUEST))
        if self.held is not None:  # rule 9: the worker is chosen now, or is being connected
            if not self.placed:
                out += self._place()
            return out
        if self.has_worker:
            if self.chunked:
                out.append((Op.WRITE, LAST_CHUNK))
            self.sent = True
        return out

    def worker_full(self, full: bool) -> list[Action]:
        """The worker's write buffer filled up or drained (rule 2): the client's body waits."""
        self.full = full
        if self.done or self.request_done:
            return []
        return [(Op.READ_CLIENT, not full)]

    def client_full(self, full: bool, now: float) -> list[Action]:
        """The client's write buffer filled up or drained (rule 2): the worker is not read
        meanwhile, for at most ``backpressure``."""
        if self.done or not self.has_worker:
            return []
        self.paused = full
        if not full:
            self.last = now
            return [(Op.READ_WORKER, True)]
        self.paused_at = now
        out: list[Action] = [(Op.READ_WORKER, False)]
        if self.backpressure > 0 and not self.armed[Timer.STALL]:  # re-armed only when it fires
            self.armed[Timer.STALL] = True
            out.append((Op.ARM, (Timer.STALL, self.backpressure)))
        return out

    # -- the response ----------------------------------------------------------------------------

    def heard(self, now: float) -> None:
        """The worker sent something (``timeout_server`` counts its silence)."""
        self.last = now

    def informational(self, status: int) -> str | None:
        """A 1xx response head: None if it is skipped (wslb answered the client's
        100-continue itself), else why the worker failed (101 on a plain request)."""
        if status == 101:
            return "the worker switched protocols on a plain request"
        return None

    def response_head(self, status: int, sse: bool, chunked_out: bool) -> None:
        """The response head went to the client (``chunked_out``: h11 framed it chunked)."""
        self.status = status
        self.response_started = True
        if sse:
            self.kind = "sse"
        self.chunked_out = chunked_out

    def response_data(self, n: int) -> None:
        """``n`` bytes of the response body went to the client (the hot path: no actions)."""
        self.data_events += 1
        self.bytes_out += n

    def response_end(self, reusable: bool) -> list[Action]:
        """The response is complete (rule 5: the exchange ends; kept alive if the request is
        read whole too and the worker's reader says it may be: ``reusable``)."""
        if self.done:
            return []
        self.response_done = True
        if self.request_done:
            return self.finish(True, reusable)
        self.end = "answered before the request body ended"  # neither connection can go on
        return self.finish(False, False)

    # -- the relay thread (rule 7) -------------------------------------------------------------

    def offload_due(self, after: int) -> bool:
        """Rule 7: the answer is chunked both ways, past ``after`` reads, and the exchange in
        the steady state the relay thread may take (the shell checks the transports)."""
        return (
            self.chunked_out
            and self.data_events >= after
            and self.client.state is _EXCHANGE
            and not self.done
            and not self.response_done
            and self.request_done
            and not self.paused
        )

    def offloaded(self, taken: bool) -> list[Action]:
        """The relay thread took the answer (RELAYED), or could not (a TLS leg, a refusal): the
        event loop relays it to the end."""
        if not taken:
            self.chunked_out = False
            return []
        self.client.enter(_RELAYED)
        return [(Op.READ_WORKER, False)]

    def reclaimed(self, nbytes: int, spoke: bool, now: float) -> list[Action]:
        """The relay thread gave the answer back (EXCHANGE): ``nbytes`` of data it forwarded,
        ``spoke``: the worker sent something meanwhile."""
        self.client.enter(_EXCHANGE)
        self.bytes_out += nbytes
        if spoke:
            self.last = now
        return [] if self.paused else [(Op.READ_WORKER, True)]

    # -- failures (rules 3, 4) -------------------------------------------------------------------

    def worker_failed(self, why: str, reused: bool) -> list[Action]:
        """The worker broke the protocol or its connection closed (``reused``: a kept-alive
        one): rule 3's retry, else 502 before the head, a cut after it."""
        if self.done or not self.has_worker:
            return []
        self.has_worker = False
        out: list[Action] = [(Op.ABORT_WORKER, None)]
        if (
            not self.response_started
            and reused
            and not self.retried
            and self.bodyless
            and self.method in IDEMPOTENT
        ):
            # A kept-alive connection that died before any answer: again on a new one.
            self.retried = True
            self.client.enter(_ROUTING)
            out.append((Op.CONNECT, None))
            return out
        out.append((Op.FAILED, why))
        if not self.response_started:
            out += self.fail(502, "the worker failed to answer", why)
        else:
            self.end = why
            out += self.finish(False, False)
        return out

    def client_gone(self, why: str) -> list[Action]:
        """The client closed or reset its connection: the exchange ends (499 if it was told
        nothing yet, nginx's)."""
        if self.done:
            return []
        if not self.response_started:
            self.status = 499
        self.end = why
        out: list[Action] = []
        if self.has_worker:
            self.has_worker = False
            out.append((Op.ABORT_WORKER, None))
        out += self.finish(False, False)
        return out

    def fail(self, status: int, message: str, why: str) -> list[Action]:
        """wslb's answer if the client has heard nothing yet, else the cut; then the end."""
        if self.done:
            return []
        out: list[Action] = []
        if self.has_worker:
            self.has_worker = False
            out.append((Op.ABORT_WORKER, None))
        self.end = why
        if not self.response_started:
            self.status = status
            out.append((Op.ANSWER, (status, message)))
        out += self.finish(False, False)
        return out

    def abort(self, why: str) -> list[Action]:
        """End the exchange now (a drain's timeout, a shutdown): 503 or a cut."""
        return self.fail(503, why, why)

    def fired(self, timer: int, now: float) -> list[Action]:
        """``timer`` is due (for SERVER the shell took the answer back from the relay thread
        first: the thread keeps no clock; the other two find nothing to do while RELAYED). One
        this exchange did not arm (the connection's clock, run on from the exchange before it)
        is nothing to it."""
        if not self.armed[timer] or self.done:
            return []
        self.armed[timer] = False
        if timer == Timer.SERVER:
            limit = self.cfg.timeout_server
            quiet = now - self.last
            if self.paused or quiet < limit:  # a client not reading is not the worker's doing
                self.armed[timer] = True
                wait = limit - (0.0 if self.paused else quiet)
                return [(Op.ARM, (timer, max(wait, 0.01)))]
            return self.fail(504, "the worker did not answer in time", "timeout_server")
        if timer == Timer.REQUEST:
            if self.request_done:
                return []
            if self.full:  # the worker is slow to take the body, not the client to send it
                self.armed[timer] = True
                return [(Op.ARM, (timer, self.cfg.timeout_request))]
            return self.fail(408, "the request body did not arrive in time", "timeout_request")
        if not self.paused:  # STALL
            return []
        left = self.paused_at + self.backpressure - now
        if left > 0:
            self.armed[timer] = True
            return [(Op.ARM, (timer, left))]
        out = self.fail(503, "the client did not read the answer", "client not reading")
        out.append((Op.STALLED, None))  # what it did not read would keep it open
        return out

    # -- the end (rule 5) ------------------------------------------------------------------------

    def finish(self, keep: bool, reusable: bool) -> list[Action]:
        """The exchange is over: its timers cancelled, its worker connection's fate (kept
        alive only if both messages are complete and the reader says it may be), its count
        dropped; then the connection goes on or closes (``ClientCore.may_go_on``). ``reusable``
        is the worker's reader's word (no framing left open)."""
        if self.done:
            return []
        self.done = True
        out: list[Action] = []
        armed = self.armed
        if True in armed:
            for timer in _TIMERS:
                if armed[timer]:
                    armed[timer] = False
                    out.append((Op.CANCEL, timer))
        if not self.has_worker:
            fate = Fate.NONE
        elif keep and self.sent and reusable:
            fate = Fate.SPARE if self.named else Fate.KEEP
        else:
            fate = Fate.CLOSE
        self.has_worker = False
        uncount, self.counted = self.counted, False
        out.append((Op.FINISH, (keep, fate, uncount)))
        return out
