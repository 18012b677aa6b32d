"""Plain HTTP on the client listener, the asyncio shell: each request routed as a session is,
its bodies streamed both ways, the worker connections kept alive in a bounded pool per worker.

``ClientConnection`` (``proxy.py``) reads the first request head; when it is not a WebSocket
handshake (``httpmsg.is_handshake``) it hands the connection's h11 state to an ``HttpClient``,
which serves that request and the ones after it on the same connection. The states and rules
of that connection and of each exchange (what status when, keep-alive or close, the retry, the
backpressure cut, the relay thread, the lanes, placing by the prompt, the cache report) are
``balancer/exchange_core.py``'s (sans-I/O): ``HttpClient`` and ``Exchange`` feed its cores what
h11 and the worker's ``ResponseReader`` parse and carry out the actions they return; what
crosses and what wslb answers itself is ``balancer/httpmsg.py``. This module moves the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from typing import TYPE_CHECKING, Final, Protocol, cast

import h11

from balancer.aio.lanes import IDLE_S as LANE_IDLE_S
from balancer.aio.offload import OFFLOAD_AFTER, plain_socket
from balancer.exchange_core import Action, ClientCore, ExchangeCore, Fate, Op, State, Timer
from balancer.handshake import ClosedBeforeRequest, HandshakeReject, next_request
from balancer.httpmsg import (
    END,
    LANE_DROP,
    NEED_DATA,
    RESPONSE_DROP,
    SESSION_ID,
    BadResponse,
    ResponseHead,
    ResponseReader,
    error_response,
    is_handshake,
    plain_request,
    request_blocks,
    request_head,
    request_headers,
    response_headers,
    upstream_target,
)
from balancer.logs import log_http_access
from balancer.prefix import Prompt, Report, Sent, prompt_of
from balancer.router import Client, Host, Routed, Walk, route

if TYPE_CHECKING:
    from balancer._offload import Spec
    from balancer.aio.lanes import Back, Lanes
    from balancer.aio.offload import Offload
    from balancer.auth import Authenticator
    from balancer.config import Config, HttpCfg, Limits, Timeouts
    from balancer.metrics import Stats
    from balancer.pool import Backend, Pool

__all__ = ["Exchange", "HttpClient", "HttpHost", "Keepalive", "WorkerConn"]

log = logging.getLogger("wslb.http")

IDLE_S: Final = 4.0
"""The longest a worker connection waits in the pool: below the 5 s keep-alive of uvicorn
(vLLM's and SGLang's server) and Node, so wslb drops an idle connection before the worker
closes it and a request never meets a connection the worker is closing."""
RESPONSE_HEAD_LIMIT: Final = 64 * 1024  # bytes of a worker's response head
CHUNK_LIMIT: Final = 65535  # the largest chunk the relay thread forwards (rule 7)
LINGER_S: Final = 5.0
"""How long a connection closed before the client finished sending its request keeps reading
(and discarding) after wslb's answer, its write side shut: a close with unread bytes is a reset
that can destroy the answer before the client reads it (nginx's lingering close)."""
_SETTLED: Final = (h11.IDLE, h11.DONE, h11.CLOSED, h11.MUST_CLOSE)
_IDLE: Final = State.IDLE  # read per request: an Enum member off its class costs ~170 ns
_CLOSED: Final = State.CLOSED
# Rule 8: the headers the routing reads (``ClientConnection.route``), beside the target and the
# pool's key headers; a next request with other values of any of them is served here.
_LANE_SIG: Final = (b"host", b"origin", b"cookie", b"x-forwarded-for", b"forwarded", b"x-real-ip")
_LANE_DROP: Final = tuple(sorted(LANE_DROP))
_RESPONSE_DROP: Final = tuple(sorted(RESPONSE_DROP))


def _lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


class Front(Client, Protocol):
    """What an ``HttpClient`` uses of the ``ClientConnection`` it serves for: the client as
    the router sees it, and the way back to the upgrade path."""

    def upgrade(self, event: h11.Request) -> None:
        """A WebSocket handshake read after plain requests: the upgrade path takes over."""
        ...

    def fresh_connection(self) -> h11.Connection:
        """A new h11 connection, the one the upgrade path reads too (after a lane)."""
        ...


class HttpHost(Host, Protocol):
    """What plain HTTP uses of ``ServerState`` (the router's part included)."""

    loop: asyncio.AbstractEventLoop
    stats: Stats
    timeouts: Timeouts
    limits: Limits
    config: Config
    closing: bool
    keepalive: Keepalive
    offload: Offload | None  # the relay thread, where it runs (rule 7)
    lanes: Lanes | None  # the lane thread, where it runs (rule 8)
    auth: Authenticator

    def worker_token(self, backend: Backend, *, handoff: bool) -> str | None: ...

    def upstream_ssl(self, backend: Backend) -> ssl.SSLContext | None: ...

    def worker_failed(self, pool: Pool, backend: Backend) -> None: ...

    def request_started(self, ex: Exchange) -> None: ...

    def request_finished(self, ex: Exchange) -> None: ...


class Keepalive:
    """Idle kept-alive connections to workers, per backend id, the newest last.

    A connection enters only with both its messages complete, and leaves when a request takes
    it, when its worker closes it or sends anything while idle, when it has waited ``IDLE_S``,
    or when its worker is no longer ready (down, ejected, draining, removed): then all of that
    worker's go.
    """

    def __init__(self) -> None:
        self.idle: dict[str, list[WorkerConn]] = {}

    def take(self, backend: Backend, now: float) -> WorkerConn | None:
        conns = self.idle.get(backend.id)
        while conns:
            conn = conns.pop()
            if conn.backend is backend and not conn.lost and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    def put(self, conn: WorkerConn, size: int, now: float) -> None:
        backend = conn.backend
        if conn.lost or size <= 0 or not backend.ready:
            conn.close()
            if not backend.ready:
                self.drop(backend.id)
            return
        conns = self.idle.setdefault(backend.id, [])
        while conns and (len(conns) >= size or now - conns[0].idle_since >= IDLE_S):
            conns.pop(0).close()
        conn.idle_since = now
        conns.append(conn)

    def forget(self, conn: WorkerConn) -> None:
        conns = self.idle.get(conn.backend.id)
        if conns and conn in conns:
            conns.remove(conn)

    def drop(self, backend_id: str) -> None:
        for conn in self.idle.pop(backend_id, []):
            conn.close()

    def count(self) -> int:
        return sum(len(c) for c in self.idle.values())

    def close(self) -> None:
        for bid in list(self.idle):
            self.drop(bid)


class WorkerConn(asyncio.Protocol):
    """One HTTP/1.1 connection to a worker, idle or serving one exchange: wslb writes the
    request itself and reads the response with ``httpmsg.ResponseReader``."""

    def __init__(self, keepalive: Keepalive, backend: Backend, buffer_high: int) -> None:
        self.keepalive = keepalive
        self.backend = backend
        self.buffer_high = buffer_high
        self.reader = ResponseReader(RESPONSE_HEAD_LIMIT)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.lost = False
        self.uses = 0  # exchanges it has served (more than 0: taken from the pool)
        self.reading = True
        self.batch: list[bytes] | None = None  # writes held to go as one (``flush``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=self.buffer_high)

    def write(self, data: bytes) -> None:
        if not data or self.transport is None:
            return
        if self.batch is not None:
            self.batch.append(data)
        else:
            self.transport.write(data)

    def flush(self) -> None:
        """Write what was held since ``batch`` was set, as one write (one segment)."""
        batch, self.batch = self.batch, None
        if batch and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(batch))

    def read(self, on: bool) -> None:
        if on != self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = on
            if on:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # a worker has nothing to say between requests
            self.close()
            return
        self.reader.receive(data)
        ex.worker_events()

    def eof_received(self) -> bool | None:
        ex = self.exchange
        if ex is None:
            self.close()
            return None
        self.reader.receive(b"")
        ex.worker_events()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.keepalive.forget(self)
        ex = self.exchange
        if ex is not None:
            ex.worker_lost(exc)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.worker_full(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.worker_full(False)

    def close(self) -> None:
        self.lost = True
        self.exchange = None
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.lost = True
        self.exchange = None
        if self.transport is not None:
            self.transport.abort()


class HttpClient:
    """A client connection serving plain HTTP: the shell of a ``ClientCore`` (its states and
    rules are ``balancer/exchange_core.py``'s), and of the ``Exchange`` it serves now."""

    def __init__(
        self,
        host: HttpHost,
        front: Front,
        transport: asyncio.Transport,
        conn: h11.Connection,
        secure: bool,
    ) -> None:
        self.host = host
        self.front = front
        self.transport = transport
        self.conn = conn
        self.secure = secure
        self.core = ClientCore()
        self.exchange: Exchange | None = None
        self.task: asyncio.Task[None] | None = None  # connecting a worker (rule 3)
        # The keep-alive wait (one timer that reschedules itself, not one per request: it
        # checks ``idle_since`` when it fires), or the linger.
        self.timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        # The exchanges' ``timeout_server`` clock, one per connection too: an exchange that
        # begins while it runs (its deadline then comes first) is judged when it fires, and
        # the core arms it again for what is left (``ExchangeCore.fired``).
        self.server_timer: asyncio.TimerHandle | None = None
        self.reading = False  # ClientConnection paused it at the first head
        # Rule 8: while the lane thread serves this connection, its handle and what it holds.
        self.lane: int | None = None
        self.lane_backend: Backend | None = None
        self.lane_held: tuple[Pool, str, WorkerConn, HttpCfg] | None = None
        transport.set_write_buffer_limits(high=host.limits.write_buffer_high)

    # -- ClientConnection's callbacks -------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        core = self.core
        if core.state is _CLOSED:  # lingering: read and discarded
            return
        self.conn.receive_data(data)
        ex = self.exchange
        if ex is None:
            if self.task is None:
                self._next_head()
        elif ex.core.request_done:
            if not core.read_ahead(len(data), self.host.limits.max_header_bytes):
                self.read(False)
        elif ex.core.pumped:
            self.pump()

    def eof_received(self) -> bool | None:
        core = self.core
        core.eof = True
        if core.lingering:
            return None
        ex = self.exchange
        if ex is not None and ex.core.request_done:
            return True  # half-closed after its request: the answer still goes out
        if ex is not None:
            self.conn.receive_data(b"")
            if ex.core.pumped:
                self.pump()
            ex.client_gone("client closed before its request ended")
            return None
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.core.gone = True
        self._cancel_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.exchange is not None:
            self.exchange.client_gone("client went away")

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_full(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client_full(False)

    # -- reading the client -----------------------------------------------------------------

    def read(self, on: bool) -> None:
        if on != self.reading and not self.transport.is_closing():
            self.reading = on
            with contextlib.suppress(RuntimeError):
                if on:
                    self.transport.resume_reading()
                else:
                    self.transport.pause_reading()

    def pump(self) -> None:
        """Pass the request body's events on to the exchange (rule 2)."""
        ex = self.exchange
        assert ex is not None
        conn = self.conn
        core = ex.core
        while self.exchange is ex and not core.request_done:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                ex.fail(400, f"malformed request body: {exc}", "client broke the protocol")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            kind = type(event)
            if kind is h11.Data:
                ex.act(core.request_data(cast(h11.Data, event).data, self.host.loop.time()))
            elif kind is h11.EndOfMessage:
                ex.request_end()
            elif kind is h11.ConnectionClosed:
                ex.client_gone("client closed before its request ended")

    def answer_continue(self) -> None:
        """Answer ``Expect: 100-continue`` if the client waits for it."""
        conn = self.conn
        if conn.they_are_waiting_for_100_continue:
            self.transport.write(
                conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )

    def _next_head(self) -> None:
        """After an exchange (or at the first head): the next request, once its head is in."""
        conn = self.conn
        if conn.their_state is h11.DONE or conn.our_state is h11.DONE:
            return  # not cycled yet
        limits = self.host.limits
        try:
            event = next_request(conn, limits.max_header_bytes, limits.max_headers)
        except ClosedBeforeRequest:  # a kept-alive client's goodbye
            self.close()
            return
        except HandshakeReject as rej:
            self.refuse(rej, None)
            return
        if event is None:
            if conn.their_state is h11.CLOSED or self.core.eof:
                self.close()
            else:
                self.read(True)
            return
        self.start(event)

    # -- one request ------------------------------------------------------------------------

    def start(self, event: h11.Request) -> None:
        """Route a request head and send it on (``ROUTING``)."""
        if not self.core.head(is_handshake(event)):
            self._cancel_timer()
            self.front.upgrade(event)
            return
        self.read(False)  # until a worker takes the body
        ex = Exchange(self, event)
        try:
            routed = route(self.host, plain_request(event), self.front)
        except HandshakeReject as rej:
            ex.act(ex.core.refuse(rej))
            return
        if routed is None:  # refused and closed by the front (per-client limit)
            self.core.close(True)
            return
        ex.route = routed
        pool = routed.pool
        prefix = pool.prefix is not None
        actions = ex.core.routed(
            pool.cfg.http,
            named=routed.named,
            prefix_limit=pool.cfg.prefix_placement.max_body if prefix else None,
            known=routed.named and prefix and pool.knows(routed.sid),
        )
        if not ex.core.done:
            self.exchange = ex
            self.host.request_started(ex)
        ex.act(actions)

    def connect(self, ex: Exchange) -> None:
        """Connect ``ex``'s worker in a task of this connection's (rule 3)."""
        self.task = self.host.loop.create_task(self._connect(ex))

    async def _connect(self, ex: Exchange) -> None:
        try:
            await ex.connect()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("plain HTTP request failed")
            ex.fail(500, "internal error", "internal error")
        finally:
            self.task = None

    def refuse(self, rej: HandshakeReject, ex: Exchange | None) -> None:
        """wslb's answer before any worker heard of the request; the connection closes."""
        if ex is not None:
            ex.logged()
        else:
            self.host.stats.http_requests[("-", "plain", rej.status)] += 1
        log.info("refused plain HTTP from %s: %d %s", self.front.peer, rej.status, rej.message)
        if not self.transport.is_closing():
            self.transport.write(error_response(rej.status, rej.message, rej.headers, rej.details))
        self.close()

    def finished(self, ex: Exchange, keep: bool, spare: WorkerConn | None = None) -> None:
        """The exchange is over: the next request, or the connection's end (rule 5). ``spare``:
        its worker connection, good for another request, for a lane (rule 8) or the pool."""
        self.exchange = None
        conn = self.conn
        core = self.core
        go_on = core.may_go_on(
            keep, self.host.closing, conn.our_state is h11.DONE and conn.their_state is h11.DONE
        )
        if go_on:
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                go_on = False
        if not go_on:
            if spare is not None:
                ex.keep_worker(spare)
            self.close()
            return
        core.enter(_IDLE)
        if spare is not None and not self._to_lane(ex, spare):
            ex.keep_worker(spare)
        if self.lane is not None:
            return
        loop = self.host.loop
        self.idle_since = loop.time()
        if self.timer is None:
            self.timer = loop.call_later(core.keepalive_s, self._idle_timeout)
        self._next_head()

    # -- the lane thread (rule 8) -----------------------------------------------------------

    def _to_lane(self, ex: Exchange, worker: WorkerConn) -> bool:
        """Hand this connection and ``worker`` to the lane thread, if all is plain (rule 8)."""
        lanes = self.host.lanes
        if lanes is None or lanes.stopping or worker.transport is None:
            return False
        if not self.core.lane_due():
            return False
        carry, closed = self.conn.trailing_data
        if closed or self.conn.their_http_version != b"1.1":
            return False
        transport, wt = self.transport, worker.transport
        if (
            transport.is_closing()
            or wt.is_closing()
            or transport.get_write_buffer_size()
            or wt.get_write_buffer_size()
        ):
            return False
        csock, wsock = plain_socket(transport), plain_socket(wt)
        if csock is None or wsock is None:
            return False
        spec = ex.lane_spec()
        if spec is None:
            return False
        self.read(False)
        worker.read(False)
        try:
            handle = lanes.add(self, csock.fileno(), wsock.fileno(), bytes(carry), spec)
        except OSError as exc:
            log.warning("lane thread refused a connection: %s", exc)
            worker.read(True)
            return False
        route, backend = ex.route, ex.backend
        assert route is not None and backend is not None
        self.core.enter(State.LANE)
        self._cancel_timer()  # the lane keeps its own (``LANE_IDLE_S``)
        self.lane = handle
        self.lane_backend = backend
        self.lane_held = (route.pool, route.sid, worker, ex.core.cfg)
        worker.exchange = None
        route.pool.attach(route.sid, backend, self.host.loop.time())  # its key's place (rule 6)
        return True

    def lane_check(self) -> None:
        """Every ``lanes.TICK_S``: a worker that is not ready any more (a drain, its health)
        takes no new request from the lane: back here at its next boundary."""
        backend = self.lane_backend
        lanes = self.host.lanes
        if (
            self.lane is not None
            and lanes is not None
            and backend is not None
            and (not backend.ready or self.host.closing)
        ):
            lanes.release(self.lane)

    def abort_lane(self, why: str) -> None:
        """A drain's or a shutdown's timeout: the lane's exchange ends now (503, or a cut)."""
        lanes = self.host.lanes
        if self.lane is not None and lanes is not None:
            lanes.abort(self.lane, why)

    def lane_back(self, back: Back) -> None:
        """The lane thread gave the connection back: the rest is served here (rule 8)."""
        host = self.host
        backend, held = self.lane_backend, self.lane_held
        self.lane = self.lane_backend = self.lane_held = None
        now = host.loop.time()
        if held is not None:
            pool, sid, worker, cfg = held
            if backend is not None:
                pool.detach(backend, sid, now, client=self.front.peer)
            if back.worker_ok and not worker.lost:
                worker.read(True)
                host.keepalive.put(worker, cfg.pool_size, now)
            else:
                worker.abort()
        go_on, wait = self.core.lane_back(
            client_ended=back.client_ended,
            served=back.exchanges,
            idle_for=back.idle_for,
            closing=host.closing,
        )
        if not go_on:
            if back.client_gone:
                self.transport.abort()
            else:
                self.transport.close()
            return
        self.conn = self.front.fresh_connection()
        if back.carry:
            self.conn.receive_data(back.carry)
        self.idle_since = now - back.idle_for
        self.timer = host.loop.call_later(wait, self._idle_timeout)
        self._next_head()

    def _idle_timeout(self) -> None:
        """The keep-alive wait: the connection closes once it has been idle (between
        requests) for ``timeout_keepalive``; a request served meanwhile arms it again when it
        ends (``finished``)."""
        self.timer = None
        if self.exchange is not None or self.task is not None or self.lane is not None:
            return
        left = self.idle_since + self.core.keepalive_s - self.host.loop.time()
        if left > 0:
            self.timer = self.host.loop.call_later(left, self._idle_timeout)
            return
        self.close()

    def server_clock(self, delay: float) -> None:
        """Arm the ``timeout_server`` clock, unless it runs already (an earlier deadline)."""
        if self.server_timer is None:
            self.server_timer = self.host.loop.call_later(delay, self._server_due)

    def _server_due(self) -> None:
        self.server_timer = None
        if self.exchange is not None:
            self.exchange.fired(Timer.SERVER)

    def _cancel_timer(self) -> None:
        """Stop the connection's clocks (it closes, is upgraded or goes to a lane)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.server_timer is not None:
            self.server_timer.cancel()
            self.server_timer = None

    def close(self) -> None:
        """Close the connection; while the client may still be sending its request, after a
        linger (``LINGER_S``)."""
        self._cancel_timer()
        transport = self.transport
        closing = transport.is_closing()
        if self.core.close(closing or self.conn.their_state in _SETTLED):
            if not closing:
                transport.close()
            return
        if transport.can_write_eof():
            transport.write_eof()
        self.read(True)
        self.timer = self.host.loop.call_later(LINGER_S, transport.close)


class Exchange:
    """One request and its response between a client and a worker: the shell of an
    ``ExchangeCore``, which it feeds what the worker's reader and h11 parse, and whose
    actions it carries out (``act``)."""

    def __init__(self, client: HttpClient, event: h11.Request) -> None:
        self.client = client
        host = client.host
        self.host = host
        self.event = event
        self.method = event.method
        # Durations by the monotonic clock: uvloop's loop.time() moves once per loop turn, in
        # milliseconds (the access log's connect and headers times are often less).
        self.t0 = time.perf_counter()
        self.core = ExchangeCore(
            client.core, event.method, event.headers, host.loop.time(), host.timeouts.backpressure
        )
        self.route: Routed | None = None
        self.backend: Backend | None = None
        self.worker: WorkerConn | None = None
        # By ``Timer`` (SERVER's stays None: that clock is the connection's, ``server_clock``).
        self.timers: list[asyncio.TimerHandle | None] = [None, None, None]
        self.out: list[bytes] = []  # for the client, written once per read of the worker
        self.relay: int | None = None  # the relay thread's handle (rule 7)
        self.prompt: Prompt | None = None  # rule 9: the body's, where it places the request
        # Rule 10: what the table recorded of the send, and the answer's end, for its report.
        self.sent: Sent | None = None
        self.report: Report | None = None
        self.walk: Walk | None = None  # the candidates (router.Walk), from the first choice on
        self.connect_s = 0.0
        self.headers_s = 0.0

    @property
    def closed(self) -> bool:
        return self.core.done

    # -- carrying out the core's actions -------------------------------------------------------

    def act(self, actions: list[Action]) -> None:
        """Carry out what the core decided, in order."""
        for op, arg in actions:  # the most frequent first
            if op == Op.ARM:
                timer, delay = arg
                if timer == Timer.SERVER:
                    self.client.server_clock(delay)
                else:
                    self.timers[timer] = self.host.loop.call_later(delay, self.fired, timer)
            elif op == Op.CANCEL:
                handle = self.timers[arg]  # SERVER's is the connection's: it runs on
                if handle is not None:
                    handle.cancel()
                    self.timers[arg] = None
            elif op == Op.FINISH:
                self._finish(*arg)
            elif op == Op.PUMP:
                self.client.pump()
                core = self.core
                if arg and not core.request_done and core.wants_body:
                    self.client.read(True)
            elif op == Op.FLUSH:
                if self.worker is not None:
                    self.worker.flush()
            elif op == Op.COUNT:
                self._count()
            elif op == Op.CHOOSE:
                self._choose()
            elif op == Op.WRITE:
                worker = self.worker
                if worker is not None and not worker.lost:
                    worker.write(arg)
            elif op == Op.READ_CLIENT:
                self.client.read(arg)
            elif op == Op.READ_WORKER:
                if self.worker is not None:
                    self.worker.read(arg)
            elif op == Op.CONNECT:
                self.client.connect(self)
            elif op == Op.CONTINUE:
                self.client.answer_continue()
            elif op == Op.ABORT_WORKER:
                worker, self.worker = self.worker, None
                if worker is not None:
                    worker.abort()
            elif op == Op.ANSWER:
                transport = self.client.transport
                if not transport.is_closing():
                    transport.write(error_response(*arg))
            elif op == Op.FAILED:
                assert self.backend is not None
                log.warning("worker %s failed a plain request: %s", self.backend.id, arg)
            elif op == Op.STALLED:
                log.info(
                    "plain HTTP client %s read nothing for %.0fs: exchange ended",
                    self.client.front.peer,
                    self.core.backpressure,
                )
                self.client.transport.abort()
            elif op == Op.REFUSE:
                self.client.refuse(arg, self)

    def fired(self, timer: int) -> None:
        """A timer is due: the exchange's own, or the connection's ``timeout_server`` clock."""
        self.timers[timer] = None
        if self.core.done:
            return
        if timer == Timer.SERVER:
            self.reclaim()  # back here to judge it (the thread keeps no clock)
        self.act(self.core.fired(timer, self.host.loop.time()))

    # -- choosing a worker (rules 3, 9) ----------------------------------------------------------

    def _select(self) -> Backend | None:
        """The next candidate (rule 3): by the prompt once it is read (rule 9)."""
        if self.walk is None:
            route, host = self.route, self.host
            assert route is not None
            self.walk = Walk(
                route.pool, route.sid, host.loop.time, self.prompt, host.stats.http_placed
            )
        return self.walk.next()

    def _choose(self) -> None:
        """Choose the worker, and start at once on a kept-alive connection to it if the pool
        has one (else ``connect``)."""
        core = self.core
        route = self.route
        assert route is not None
        if core.held is not None and core.prompt_wanted:
            self.prompt = prompt_of(b"".join(core.held), route.pool.prefix_rules)
        backend = self._select()
        conn = None
        if backend is not None:
            self.backend = backend
            conn = self.host.keepalive.take(backend, self.host.loop.time())
        actions = core.chosen(backend is not None, conn is not None)
        if actions:
            self.act(actions)
        if conn is not None:
            self.host.stats.http_upstream["reused"] += 1
            self._begin(conn)

    async def connect(self) -> None:
        """Connect to the chosen worker, walking on past those that refuse (rule 3)."""
        host = self.host
        assert self.route is not None
        pool = self.route.pool
        core = self.core
        backend = self.backend
        last_error = "no worker available"
        while backend is not None:
            up = backend.upstream
            dialled = time.perf_counter()
            try:
                _, conn = await asyncio.wait_for(
                    host.loop.create_connection(
                        functools.partial(
                            WorkerConn, host.keepalive, backend, host.limits.write_buffer_high
                        ),
                        up.host,
                        up.port,
                        ssl=host.upstream_ssl(backend),
                        ssl_handshake_timeout=host.timeouts.connect if up.secure else None,
                    ),
                    host.timeouts.connect,
                )
            except (OSError, TimeoutError) as exc:
                host.stats.connect_failures[backend.id] += 1
                host.worker_failed(pool, backend)
                last_error = f"worker {backend.id}: {exc or type(exc).__name__}"
                log.warning("connect to %s failed: %s", backend.id, last_error)
                backend = self.backend = self._select()
                continue
            self.connect_s = time.perf_counter() - dialled
            host.stats.upstream_connect.observe(backend.id, self.connect_s)
            host.stats.http_upstream["new"] += 1
            if core.done:
                conn.close()
                return
            self._begin(conn)
            return
        tried = self.walk is not None and bool(self.walk.tried)
        if tried:
            log.warning("no worker took %s (%s)", self.event.target[:200], last_error)
        self.act(core.no_worker_took(tried))

    def _count(self) -> None:
        """Rule 6: the request counts on its worker."""
        route, backend = self.route, self.backend
        assert route is not None and backend is not None
        pool, now = route.pool, self.host.loop.time()
        if route.named:
            pool.attach(route.sid, backend, now)
        else:
            pool.cancel(route.sid)
            pool.attach_request(backend)
        self.sent = pool.learn(self.prompt, backend, answer=True)
        if self.sent is not None:
            self.report = Report()
        self.host.stats.http_active[pool.name] += 1

    def _head(self) -> bytes | None:
        """The request head for the worker, or None if its target cannot be written."""
        route, backend = self.route, self.backend
        assert route is not None and backend is not None
        up = backend.upstream
        headers = request_headers(
            route.req,
            authority=up.authority,
            session_id=route.sid,
            secure=self.client.secure,
            worker_token=self.host.worker_token(backend, handoff=False),
            length=self.core.length,
            chunked=self.core.chunked,
        )
        try:
            target = upstream_target(up.path, route.req).encode("latin-1")
        except UnicodeEncodeError:
            return None
        return request_head(self.method, target, headers)

    def _begin(self, conn: WorkerConn) -> None:
        """Write the request head to the worker and let the body flow (``EXCHANGE``)."""
        conn.exchange = self
        conn.uses += 1
        self.worker = conn
        head = self._head()
        if head is not None:
            conn.reader.start(self.method == b"HEAD")
            conn.batch = [head]  # the head and what of the body is here already: one write
        self.act(self.core.begin(self.host.loop.time(), head is not None))

    # -- the request body -------------------------------------------------------------------

    def request_end(self) -> None:
        actions = self.core.request_end()
        if actions:
            self.act(actions)

    def worker_full(self, full: bool) -> None:
        """The worker's write buffer filled up or drained (rule 2)."""
        self.act(self.core.worker_full(full))

    def client_full(self, full: bool) -> None:
        """The client's write buffer filled up or drained (rule 2)."""
        self.act(self.core.client_full(full, self.host.loop.time()))

    # -- the response -----------------------------------------------------------------------

    def worker_events(self) -> None:
        worker = self.worker
        if worker is None:
            return
        core = self.core
        core.heard(self.host.loop.time())
        try:
            self._worker_events(worker, worker.reader)
        finally:
            self._flush()
        if (
            core.chunked_out
            and self.relay is None
            and self.report is None  # rule 10: read here to its end
            and core.offload_due(OFFLOAD_AFTER)
        ):
            self._offload()

    def _flush(self) -> None:
        out = self.out
        if out:
            self.out = []
            transport = self.client.transport
            if not transport.is_closing():
                transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _worker_events(self, worker: WorkerConn, reader: ResponseReader) -> None:
        core = self.core
        send = self.client.conn.send
        while self.worker is worker:
            try:
                event = reader.next_event()
            except BadResponse as exc:
                why = str(exc)
                self.worker_failed(
                    why if why.startswith("the worker") else f"malformed response: {why}"
                )
                return
            if event is NEED_DATA:
                return
            if type(event) is bytes:
                if self.report is not None:
                    self.report.feed(event)
                core.response_data(len(event))
                out = send(h11.Data(data=event))
                if out:
                    self.out.append(out)
            elif event is END:
                try:
                    out = send(h11.EndOfMessage())
                except h11.LocalProtocolError as exc:
                    self.worker_failed(f"response cannot be forwarded: {exc}")
                    return
                if out:
                    self.out.append(out)
                self.act(core.response_end(reader.reusable))
                return
            else:
                head = cast(ResponseHead, event)
                if head.status >= 200:
                    self._response_head(head)
                elif (broke := core.informational(head.status)) is not None:
                    self.worker_failed(broke)
                    return

    def _response_head(self, event: ResponseHead) -> None:
        assert self.route is not None
        self.headers_s = time.perf_counter() - self.t0
        headers = response_headers(event.headers, self.route.key)
        sse = sized = False  # sized: a Content-Length answer (most): h11 cannot chunk it
        for name, value in headers:
            if name == b"content-type" and value.startswith(b"text/event-stream"):
                sse = True
            elif name == b"content-length":
                sized = True
        try:
            data = self.client.conn.send(
                h11.Response(status_code=event.status, headers=headers, reason=event.reason)
            )
        except h11.LocalProtocolError as exc:
            self.worker_failed(f"response cannot be forwarded: {exc}")
            return
        # What h11 wrote, not what the worker sent: it frames the body itself (chunked for
        # HTTP/1.1 without a length, delimited by the close for an HTTP/1.0 client).
        chunked = bool(data) and not sized and b"\r\ntransfer-encoding: chunked\r\n" in data.lower()
        self.core.response_head(event.status, sse, chunked)
        if data:
            self.out.append(data)

    # -- the relay thread (rule 7) ------------------------------------------------------------

    def _offload(self) -> None:
        """Hand the rest of a chunked response body to the relay thread, if the core's steady
        state holds and the transports allow: the worker read (not held back by the client),
        the reader between chunks, nothing waiting to be written to the client, both legs
        plain TCP."""
        off = self.host.offload
        worker = self.worker
        transport = self.client.transport
        if (
            off is None
            or worker is None
            or worker.transport is None
            or not worker.reading
            or not worker.reader.at_chunk_boundary
            or worker.transport.is_closing()
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return
        wsock, csock = plain_socket(worker.transport), plain_socket(transport)
        handle = None
        if wsock is not None and csock is not None:  # else a TLS leg: the event loop relays it
            try:
                handle = off.take(self, wsock.fileno(), csock.fileno(), CHUNK_LIMIT, False, True)
            except OSError as exc:
                log.warning("relay thread refused a response body: %s", exc)
        self.relay = handle
        self.act(self.core.offloaded(handle is not None))

    def reclaim(self) -> None:
        """Take the response body back from the relay thread (nothing when it is not there):
        what it had not sent goes to the client first, what it had read but not forwarded is
        read here next, from a chunk boundary."""
        handle = self.relay
        if handle is None:
            return
        self.relay = None
        off = self.host.offload
        assert off is not None
        back = off.give_back(handle)
        if back.backlog and not self.client.transport.is_closing():
            self.client.transport.write(back.backlog)  # may pause reading the worker
        worker = self.worker
        if worker is not None and back.carry:
            worker.reader.receive(back.carry)
        self.act(self.core.reclaimed(back.nbytes, back.frames > 0, self.host.loop.time()))
        if worker is not None and back.carry:  # read next, outside whatever called this
            self.host.loop.call_soon(self.worker_events)

    def flush_record(self) -> None:
        """No journal for plain HTTP (the relay thread records nothing for it)."""

    # -- failures (rule 4) ------------------------------------------------------------------

    def worker_lost(self, exc: Exception | None) -> None:
        self.worker_failed(f"the worker closed the connection{f': {exc}' if exc else ''}")

    def worker_failed(self, why: str) -> None:
        self.reclaim()
        worker = self.worker
        self.act(self.core.worker_failed(why, worker is not None and worker.uses > 1))

    def client_gone(self, why: str) -> None:
        if self.core.done:
            return
        self.reclaim()
        self.act(self.core.client_gone(why))

    def fail(self, status: int, message: str, why: str) -> None:
        """wslb's answer if the client has heard nothing yet, else the cut; then the end."""
        if self.core.done:
            return
        self.reclaim()
        self.act(self.core.fail(status, message, why))

    def abort(self, why: str) -> None:
        """End the exchange now (a drain's timeout, a shutdown)."""
        if self.core.done:
            return
        self.reclaim()
        self.act(self.core.abort(why))

    # -- the end ----------------------------------------------------------------------------

    def _finish(self, keep: bool, fate: int, uncount: bool) -> None:
        if self.relay is not None:
            self.reclaim()
        self._flush()  # the answer before anything of the next request
        host = self.host
        worker, self.worker = self.worker, None
        spare = None
        if worker is not None:
            worker.exchange = None
            if fate == Fate.SPARE and host.lanes is not None:
                spare = worker  # a lane's, perhaps (rule 8): the client decides
            elif fate == Fate.KEEP or fate == Fate.SPARE:
                self.keep_worker(worker)
            else:
                worker.close()
        route, backend = self.route, self.backend
        if uncount and route is not None and backend is not None:
            pool = route.pool
            if route.named:
                pool.detach(backend, route.sid, host.loop.time(), client=self.client.front.peer)
            else:
                pool.detach_request(backend)
            host.stats.http_active[pool.name] -= 1
            if self.sent is not None and self.prompt is not None:  # rule 10
                core, report = self.core, self.report
                ended = core.response_done and core.status == 200
                said = report.result() if report is not None and ended else None
                result = pool.settle(self.sent, self.prompt, said)
                if result is not None:
                    host.stats.prefix_reports[(pool.name, result)] += 1
                made = report.response_id() if report is not None and ended else None
                if made is not None:  # prefix rule 8: its continuation goes there
                    pool.responded(made, backend, host.loop.time())
        host.request_finished(self)
        self.logged()
        self.client.finished(self, keep, spare)

    def keep_worker(self, worker: WorkerConn) -> None:
        """Back to the pool of kept-alive worker connections (rule 5)."""
        worker.read(True)
        self.host.keepalive.put(worker, self.core.cfg.pool_size, self.host.loop.time())

    def lane_spec(self) -> Spec | None:
        """What the lane thread needs to serve this request's next ones as this module would
        (rule 8, ``_offload.c``), or None where it may not: a key wslb made, a pool not hashed
        by key, JWT."""
        host, route, backend, cfg = self.host, self.route, self.backend, self.core.cfg
        if (
            route is None
            or backend is None
            or not route.named
            or route.pool.balance != "consistent"
            or host.auth.cfg.jwt is not None
        ):
            return None
        pool, req = route.pool, route.req
        up = backend.upstream
        try:
            target = upstream_target(up.path, req).encode("latin-1")
        except UnicodeEncodeError:
            return None
        pre, post = request_blocks(
            req,
            authority=up.authority,
            session_id=route.sid,
            secure=self.client.secure,
            worker_token=host.worker_token(backend, handoff=False),
        )
        names = list(_LANE_SIG)
        for src in pool.cfg.session_key:
            if src.kind == "header":
                name = src.name.lower().encode("latin-1")
                if name not in names:
                    names.append(name)
        headers = self.event.headers
        sig = [bytes(self.event.target)]
        for name in names:
            values = [v for k, v in headers if k == name]
            sig += [b"\0", name, b"\0", b"\1".join(values)]
        limits = host.limits
        return (
            b"".join(sig),
            tuple(names),
            target,
            _lines(pre),
            _lines(post),
            _LANE_DROP,
            _RESPONSE_DROP,
            SESSION_ID + b": " + route.key.encode("latin-1") + b"\r\n",
            limits.max_header_bytes,
            limits.max_headers,
            cfg.max_body,
            cfg.timeout_request,
            cfg.timeout_server,
            min(LANE_IDLE_S, cfg.timeout_keepalive),
            host.timeouts.backpressure,
            self.client.front.peer.encode("latin-1", "replace"),
            route.key.encode("latin-1"),
            pool.name.encode("utf-8"),
            backend.id.encode("utf-8"),
        )

    def logged(self) -> None:
        """Count the request and write its access line (``log.access``)."""
        host, core, route = self.host, self.core, self.route
        stats = host.stats
        duration = time.perf_counter() - self.t0
        pool = route.pool.name if route is not None else "-"
        stats.http_requests[(pool, core.kind, core.status)] += 1
        stats.http_bytes["client_to_worker"] += core.bytes_in
        stats.http_bytes["worker_to_client"] += core.bytes_out
        stats.http_duration.observe(f"{pool}\x00{core.kind}", duration)
        if not host.config.log.access:
            return
        log_http_access(
            {
                "client": self.client.front.peer,
                "method": self.method.decode("latin-1"),
                "path": self.event.target.decode("latin-1").partition("?")[0][:200],
                "status": core.status,
                "session": route.key if route is not None else "-",
                "pool": pool,
                "backend": self.backend.id if self.backend is not None else None,
                "kind": core.kind,
                "connect_ms": round(self.connect_s * 1000, 1),
                "headers_ms": round(self.headers_s * 1000, 1),
                "duration_s": round(duration, 3),
                "bytes_in": core.bytes_in,
                "bytes_out": core.bytes_out,
                "end": core.end,
                "user_agent": next(
                    (v.decode("latin-1") for k, v in self.event.headers if k == b"user-agent"),
                    None,
                ),
            }
        )
