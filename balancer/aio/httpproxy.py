"""Plain HTTP on the client listener: each request routed as a session is, its bodies streamed
both ways, the worker connections kept alive in a bounded pool per worker.

``ClientConnection`` (``proxy.py``) reads the first request head; when it is not a WebSocket
handshake (``httpmsg.is_handshake``) it hands the connection's h11 state to an ``HttpClient``,
which serves that request and the ones after it on the same connection. What crosses and what
wslb answers itself is ``balancer/httpmsg.py`` (sans-I/O); this module moves the bytes.

States of a client connection serving HTTP:

    ROUTING --worker connected--> EXCHANGE --both messages done--> IDLE --next head--> ROUTING
       |                            |                               |  \\--a handshake--> upgrade
       \\--wslb's answer--> CLOSED <--error, timeout, client gone----/--timeout_keepalive--/

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
   ``router.Walk``), before any byte goes to it; a connect that fails walks on to the next. Once the
   request is written nothing is retried, except a bodiless request of an idempotent method
   on a kept-alive connection that died before any answer: it goes again on a new connection.
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
   client first, what it read but did not forward is read here next).
8. After an exchange that ended well, a kept-alive connection whose key the client named goes
   to the lane thread with its worker connection (``aio/lanes.py``, ``_offload.c``): it serves
   the next requests of the same routing as this module would, and gives the connection back
   (``lane_back``) for the first one it does not take, which is then served here.
9. A request without a key the client named, or whose named key the pool has not placed yet
   (a conversation's first request), in a pool with ``prefix_placement``, with a body (a POST
   of at most its ``max_body``) is read whole before its worker is chosen: its prompt places
   it (``balancer.prefix``, ``Pool.place_prompt``; a named key then stays where its first
   request went, by affinity), then the head and the body go as one
   write. A body that turns out larger is placed without a prompt once past ``max_body`` and
   streamed from there; one that is not a prompt (not JSON, no messages) is placed as any
   keyless request. ``Expect: 100-continue`` is answered before the read;
   ``timeout_request`` runs during it.
10. The answer to a request placed by its prompt is read here to its end, never by the relay
    thread: what the engine says it had cached (``usage``, llama.cpp's ``timings``) is told
    to the pool's table (``prefix`` rule 6) when the exchange ends.
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
from balancer.aio.lanes import Spec
from balancer.aio.offload import OFFLOAD_AFTER, plain_socket
from balancer.handshake import ClientRequest, ClosedBeforeRequest, HandshakeReject, next_request
from balancer.httpmsg import (
    END,
    IDEMPOTENT,
    LANE_DROP,
    LAST_CHUNK,
    NEED_DATA,
    RESPONSE_DROP,
    SESSION_ID,
    BadResponse,
    ResponseHead,
    ResponseReader,
    chunk,
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
LANE_SKIP: Final = 8
"""Requests served here after a lane that served none (its next request differed) before the
next try: a client whose requests differ each time would otherwise cost a hand-over each."""
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
        self.sent = False  # the whole request is written (with its body's end)
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
            self.exchange.client.worker_full(True)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client.worker_full(False)

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
    """A client connection serving plain HTTP (the module docstring's states and rules)."""

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
        self.exchange: Exchange | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None  # keep-alive wait between requests
        self.reading = False  # ClientConnection paused it at the first head
        self.full = False  # the worker's write buffer is full
        self.eof = False
        self.gone = False
        self.unread = 0  # bytes read past the request being served (pipelined)
        self.handed_over = False
        self.lingering = False
        self.keepalive_s = 60.0
        # Rule 8: while the lane thread serves this connection, its handle and what it holds.
        self.lane: int | None = None
        self.lane_backend: Backend | None = None
        self.lane_pool: Pool | None = None
        self.lane_sid = ""
        self.lane_worker: WorkerConn | None = None
        self.lane_cfg: HttpCfg | None = None
        self.lane_skip = 0  # exchanges served here before a lane is tried again
        transport.set_write_buffer_limits(high=host.limits.write_buffer_high)

    # -- ClientConnection's callbacks -------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        self.conn.receive_data(data)
        ex = self.exchange
        if ex is None:
            if self.task is None:
                self._next_head()
        elif ex.request_done:
            self.unread += len(data)
            if self.unread > self.host.limits.max_header_bytes:
                self._read(False)
        elif ex.worker is not None or ex.held is not None:
            self._pump()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.lingering:
            return None
        ex = self.exchange
        if ex is not None and ex.request_done:
            return True  # half-closed after its request: the answer still goes out
        if ex is not None:
            self.conn.receive_data(b"")
            if ex.worker is not None or ex.held is not None:
                self._pump()
            if self.exchange is not None:
                self.exchange.client_gone("client closed before its request ended")
            return None
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._cancel_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.exchange is not None:
            self.exchange.client_gone("client went away")

    def pause_writing(self) -> None:
        ex = self.exchange
        if ex is not None and ex.worker is not None:
            ex.worker.read(False)
            ex.paused_by_client = True
            ex.client_paused()

    def resume_writing(self) -> None:
        ex = self.exchange
        if ex is not None and ex.worker is not None:
            ex.paused_by_client = False
            ex.last = self.host.loop.time()
            ex.worker.read(True)

    # -- reading the client -----------------------------------------------------------------

    def _read(self, on: bool) -> None:
        if on != self.reading and not self.transport.is_closing():
            self.reading = on
            with contextlib.suppress(RuntimeError):
                if on:
                    self.transport.resume_reading()
                else:
                    self.transport.pause_reading()

    def worker_full(self, full: bool) -> None:
        self.full = full
        ex = self.exchange
        if ex is not None and not ex.request_done:
            self._read(not full)

    def _pump(self) -> None:
        """Pass the request body's events on to the worker (rule 2)."""
        ex = self.exchange
        assert ex is not None
        conn = self.conn
        while self.exchange is ex and not ex.request_done:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                ex.fail(400, f"malformed request body: {exc}", "client broke the protocol")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            kind = type(event)
            if kind is h11.Data:
                ex.request_data(cast(h11.Data, event).data)
            elif kind is h11.EndOfMessage:
                ex.request_end()
            elif kind is h11.ConnectionClosed:
                ex.client_gone("client closed before its request ended")

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
            self._refuse(rej, None)
            return
        if event is None:
            if conn.their_state is h11.CLOSED or self.eof:
                self.close()
            else:
                self._read(True)
            return
        self.start(event)

    # -- one request ------------------------------------------------------------------------

    def start(self, event: h11.Request) -> None:
        """Route a request head and send it on (``ROUTING``)."""
        self._cancel_timer()
        self.unread = 0
        if is_handshake(event):
            self.handed_over = True
            self.front.upgrade(event)
            return
        self._read(False)  # until a worker takes the body
        ex = Exchange(self, event)
        try:
            req = plain_request(event)
            routed = route(self.host, req, self.front)
        except HandshakeReject as rej:
            self._refuse(rej, ex)
            return
        if routed is None:
            return  # refused and closed by the front (per-client limit)
        ex.routed(routed)
        cfg = routed.pool.cfg.http
        self.keepalive_s = cfg.timeout_keepalive
        if not cfg.enabled:
            upgrade = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade")]
            self._refuse(HandshakeReject(426, "this endpoint speaks WebSocket only", upgrade), ex)
            return
        length = ex.length
        if length is not None and length > cfg.max_body:
            self._refuse(HandshakeReject(413, "request body too large"), ex)
            return
        self.exchange = ex
        self.host.request_started(ex)
        if ex.wants_prompt():
            ex.hold_body()
            return
        if not ex.pick_pooled():
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

    def _refuse(self, rej: HandshakeReject, ex: Exchange | None) -> None:
        """wslb's own answer before any worker heard of the request; the connection closes."""
        if ex is not None:
            ex.status = rej.status
            ex.end = rej.message
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
        self.full = False
        conn = self.conn
        if (
            not keep
            or self.gone
            or self.eof
            or self.host.closing
            or conn.our_state is not h11.DONE
            or conn.their_state is not h11.DONE
        ):
            if spare is not None:
                ex.keep_worker(spare)
            self.close()
            return
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            if spare is not None:
                ex.keep_worker(spare)
            self.close()
            return
        if spare is not None and not self._to_lane(ex, spare):
            ex.keep_worker(spare)
        if self.lane is not None:
            return
        self.timer = self.host.loop.call_later(self.keepalive_s, self._idle_timeout)
        self._next_head()

    # -- the lane thread (rule 8) -----------------------------------------------------------

    def _to_lane(self, ex: Exchange, worker: WorkerConn) -> bool:
        """Hand this connection and ``worker`` to the lane thread, if all is plain (rule 8)."""
        lanes = self.host.lanes
        if lanes is None or lanes.stopping or worker.transport is None:
            return False
        if self.lane_skip:
            self.lane_skip -= 1
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
        self._read(False)
        worker.read(False)
        try:
            handle = lanes.add(self, csock.fileno(), wsock.fileno(), bytes(carry), spec)
        except OSError as exc:
            log.warning("lane thread refused a connection: %s", exc)
            worker.read(True)
            return False
        assert ex.pool is not None and ex.backend is not None and ex.cfg is not None
        self.lane = handle
        self.lane_pool, self.lane_backend, self.lane_sid = ex.pool, ex.backend, ex.sid
        self.lane_worker, self.lane_cfg = worker, ex.cfg
        worker.exchange = None
        ex.pool.attach(ex.sid, ex.backend, self.host.loop.time())  # its key's place (rule 6)
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
        pool, backend, worker, cfg = (
            self.lane_pool,
            self.lane_backend,
            self.lane_worker,
            self.lane_cfg,
        )
        self.lane = None
        self.lane_pool = self.lane_backend = self.lane_worker = self.lane_cfg = None
        now = host.loop.time()
        if pool is not None and backend is not None:
            pool.detach(backend, self.lane_sid, now, client=self.front.peer)
        if worker is not None:
            if back.worker_ok and cfg is not None and not worker.lost:
                worker.read(True)
                host.keepalive.put(worker, cfg.pool_size, now)
            else:
                worker.abort()
        if back.client_ended or self.gone or host.closing:
            if back.client_gone:
                self.transport.abort()
            else:
                self.transport.close()
            return
        if back.exchanges == 0:  # its next request was not the same again: not so soon
            self.lane_skip = LANE_SKIP
        self.conn = self.front.fresh_connection()
        self.unread = 0
        if back.carry:
            self.conn.receive_data(back.carry)
        wait = max(self.keepalive_s - back.idle_for, 0.01)
        self.timer = host.loop.call_later(wait, self._idle_timeout)
        self._next_head()

    def _idle_timeout(self) -> None:
        self.timer = None
        if self.exchange is None and self.task is None:
            self.close()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close(self) -> None:
        """Close the connection; while the client may still be sending its request, after a
        linger (``LINGER_S``)."""
        self._cancel_timer()
        transport = self.transport
        if transport.is_closing():
            return
        if self.gone or self.eof or self.lingering or self.conn.their_state in _SETTLED:
            transport.close()
            return
        self.lingering = True
        if transport.can_write_eof():
            transport.write_eof()
        self._read(True)
        self.timer = self.host.loop.call_later(LINGER_S, transport.close)


class Exchange:
    """One request and its response between a client and a worker."""

    def __init__(self, client: HttpClient, event: h11.Request) -> None:
        self.client = client
        host = client.host
        self.host = host
        self.event = event
        self.method = event.method
        # Durations by the monotonic clock: uvloop's loop.time() moves once per loop turn, in
        # milliseconds (the access log's connect and headers times are often less).
        self.t0 = time.perf_counter()
        self.started = host.loop.time()
        self.pool: Pool | None = None
        self.backend: Backend | None = None
        self.worker: WorkerConn | None = None
        self.key = "-"
        self.sid = "-"
        self.named = False
        self.req: ClientRequest | None = None
        self.cfg: HttpCfg | None = None
        self.length: int | None = None
        self.chunked = False
        for name, value in event.headers:
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = True
        self.bodyless = not self.chunked and not self.length
        self.walk: Walk | None = None  # the candidates (router.Walk), from the first choice on
        self.retried = False
        self.request_done = False
        self.response_started = False
        self.response_done = False
        self.closed = False
        self.counted = False
        self.status = 0
        self.kind = "plain"
        self.bytes_in = 0
        self.bytes_out = 0
        self.connect_s = 0.0
        self.headers_s = 0.0
        self.end = "done"
        self.last = self.started  # the worker's last sign of life (timeout_server)
        self.paused_by_client = False
        self.paused_at = 0.0  # when the client last stopped taking the answer (rule 2)
        self.stall_timer: asyncio.TimerHandle | None = None
        self.server_timer: asyncio.TimerHandle | None = None
        self.request_timer: asyncio.TimerHandle | None = None
        self.out: list[bytes] = []  # for the client, written once per read of the worker
        # Rule 7: the relay thread's handle while it forwards the response body's chunks; the
        # data events read here first (a short answer never goes there); the client's framing
        # is chunked too (h11 re-frames for an HTTP/1.0 client, and then the thread must not).
        self.relay: int | None = None
        self.data_events = 0
        self.chunked_out = False
        # Rule 9: a keyless body read whole before its worker is chosen, and its prompt.
        self.held: list[bytes] | None = None
        self.held_size = 0
        self.placed = False
        self.prompt: Prompt | None = None
        # Rule 10: what the table recorded of the send, and the answer's end, for its report.
        self.sent: Sent | None = None
        self.report: Report | None = None

    def routed(self, r: Routed) -> None:
        self.pool, self.req, self.key, self.sid, self.named = r
        self.cfg = r.pool.cfg.http

    # -- placing by the prompt (rule 9) --------------------------------------------------------

    def wants_prompt(self) -> bool:
        """Whether the request is placed by its prompt: a body, a pool that asks, and no
        placement of its key yet (a known key goes home by affinity instead)."""
        pool = self.pool
        if pool is None or pool.prefix is None or self.bodyless:
            return False
        if self.named and pool.knows(self.sid):
            return False
        limit = pool.cfg.prefix_placement.max_body
        return self.method == b"POST" and (self.length is None or self.length <= limit)

    def hold_body(self) -> None:
        """Read the body before choosing a worker (rule 9); ``_place`` when it is in."""
        assert self.cfg is not None
        host = self.host
        self.held = []
        self.request_timer = host.loop.call_later(self.cfg.timeout_request, self._request_timeout)
        client = self.client
        if client.conn.they_are_waiting_for_100_continue:
            client.transport.write(
                client.conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )
        client._pump()
        if client.exchange is self and not self.placed:
            client._read(True)

    def _place(self, whole: bool) -> None:
        """The body is in (``whole``) or past ``prefix_placement.max_body``: choose a worker."""
        assert self.pool is not None and self.held is not None
        self.placed = True
        self.client._read(False)
        if self.request_timer is not None:  # ``_begin`` arms it again for the rest
            self.request_timer.cancel()
            self.request_timer = None
        if whole:
            self.prompt = prompt_of(b"".join(self.held), self.pool.prefix_rules)
        if not self.pick_pooled():
            self.client.task = self.host.loop.create_task(self.client._connect(self))

    # -- choosing a worker (rule 3) ----------------------------------------------------------

    def _select(self) -> Backend | None:
        """The next candidate (rule 3): by the prompt once it is read (rule 9)."""
        if self.walk is None:
            assert self.pool is not None
            host = self.host
            self.walk = Walk(
                self.pool, self.sid, host.loop.time, self.prompt, host.stats.http_placed
            )
        return self.walk.next()

    def pick_pooled(self) -> bool:
        """Start at once on a kept-alive connection to the chosen worker, if the pool has one;
        False: a connection must be made (``connect``)."""
        backend = self._select()
        if backend is None:
            self.fail(503, "no worker available", "no worker available")
            return True
        self.backend = backend
        conn = self.host.keepalive.take(backend, self.host.loop.time())
        if conn is None:
            return False
        self.host.stats.http_upstream["reused"] += 1
        self._begin(conn)
        return True

    async def connect(self) -> None:
        """Connect to the chosen worker, walking on past those that refuse (rule 3)."""
        host = self.host
        assert self.pool is not None
        pool = self.pool
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
            if self.closed:
                conn.close()
                return
            self._begin(conn)
            return
        if self.walk is not None and self.walk.tried:
            log.warning("no worker took %s (%s)", self.event.target[:200], last_error)
            self.fail(502, "no worker could take the request", "no worker could take it")
        else:
            self.fail(503, "no worker available", "no worker available")

    def _count(self) -> None:
        assert self.pool is not None and self.backend is not None
        if self.counted:
            return
        self.counted = True
        now = self.host.loop.time()
        if self.named:
            self.pool.attach(self.sid, self.backend, now)
        else:
            self.pool.cancel(self.sid)
            self.pool.attach_request(self.backend)
        self.sent = self.pool.learn(self.prompt, self.backend, answer=True)
        if self.sent is not None:
            self.report = Report()
        self.host.stats.http_active[self.pool.name] += 1

    def _begin(self, conn: WorkerConn) -> None:
        """Write the request head to the worker and let the body flow (``EXCHANGE``)."""
        assert self.req is not None and self.backend is not None and self.cfg is not None
        host = self.host
        self._count()
        conn.exchange = self
        conn.uses += 1
        self.worker = conn
        backend = self.backend
        up = backend.upstream
        headers = request_headers(
            self.req,
            authority=up.authority,
            session_id=self.sid,
            secure=self.client.secure,
            worker_token=host.worker_token(backend, handoff=False),
            length=self.length,
            chunked=self.chunked,
        )
        try:
            target = upstream_target(up.path, self.req).encode("latin-1")
        except UnicodeEncodeError:
            head = None
        else:
            head = request_head(self.method, target, headers)
        if head is None:
            self.fail(400, "request cannot be forwarded: bad characters", "bad request")
            return
        conn.reader.start(self.method == b"HEAD")
        conn.sent = False
        conn.batch = [head]  # the head and what of the body is here already: one write
        self.last = host.loop.time()
        if self.server_timer is None:
            self.server_timer = host.loop.call_later(self.cfg.timeout_server, self._server_check)
        client = self.client
        if client.conn.they_are_waiting_for_100_continue:
            client.transport.write(
                client.conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            )
        held, self.held = self.held, None
        if held is not None:  # read before the worker was chosen (rule 9)
            for data in held:
                conn.write(chunk(data) if self.chunked else data)
            if self.request_done and self.chunked:
                conn.write(LAST_CHUNK)
        if self.request_done:  # a retry of a bodiless request, or a body read whole
            conn.sent = True
            conn.flush()
            return
        self.request_timer = host.loop.call_later(self.cfg.timeout_request, self._request_timeout)
        client._pump()
        conn.flush()
        if self.client.exchange is self and not self.request_done:
            client._read(not client.full)

    # -- the request body -------------------------------------------------------------------

    def request_data(self, data: bytes) -> None:
        assert self.cfg is not None
        self.bytes_in += len(data)
        self.last = self.host.loop.time()
        if self.bytes_in > self.cfg.max_body:
            self.fail(413, "request body too large", "request body too large")
            return
        held = self.held
        if held is not None:  # rule 9: no worker yet
            held.append(data)
            self.held_size += len(data)
            assert self.pool is not None
            if not self.placed and self.held_size > self.pool.cfg.prefix_placement.max_body:
                self._place(False)
            return
        worker = self.worker
        if worker is not None and not worker.lost:
            worker.write(chunk(data) if self.chunked else data)

    def request_end(self) -> None:
        self.request_done = True
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None
        if self.held is not None:  # rule 9: the worker is chosen now, or is being connected
            if not self.placed:
                self._place(True)
            return
        worker = self.worker
        if worker is not None and not worker.lost:
            if self.chunked:
                worker.write(LAST_CHUNK)
            worker.sent = True
        if self.response_done:
            self._finish(True)

    # -- the response -----------------------------------------------------------------------

    def worker_events(self) -> None:
        worker = self.worker
        if worker is None:
            return
        self.last = self.host.loop.time()
        try:
            self._worker_events(worker, worker.reader)
        finally:
            self._flush()
        if (
            self.chunked_out
            and self.data_events >= OFFLOAD_AFTER
            and self.relay is None
            and self.report is None
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
                self.response_data(event)
            elif event is END:
                self.response_end()
                return
            else:
                head = cast(ResponseHead, event)
                if head.status >= 200:
                    self.response_head(head)
                elif head.status == 101:
                    self.worker_failed("the worker switched protocols on a plain request")
                    return
                # other 1xx: wslb answered the client's 100-continue itself

    def response_head(self, event: ResponseHead) -> None:
        client = self.client
        self.headers_s = time.perf_counter() - self.t0
        headers = response_headers(event.headers, self.key)
        sized = False  # a Content-Length answer (most): h11 cannot have written it chunked
        for name, value in headers:
            if name == b"content-type" and value.startswith(b"text/event-stream"):
                self.kind = "sse"
            elif name == b"content-length":
                sized = True
        try:
            data = client.conn.send(
                h11.Response(status_code=event.status, headers=headers, reason=event.reason)
            )
        except h11.LocalProtocolError as exc:
            self.worker_failed(f"response cannot be forwarded: {exc}")
            return
        self.status = event.status
        self.response_started = True
        if data:
            # What h11 wrote, not what the worker sent: it frames the body itself (chunked for
            # HTTP/1.1 without a length, delimited by the close for an HTTP/1.0 client).
            self.chunked_out = not sized and b"\r\ntransfer-encoding: chunked\r\n" in data.lower()
            self.out.append(data)

    def response_data(self, data: bytes) -> None:
        if self.report is not None:
            self.report.feed(data)
        self.data_events += 1
        self.bytes_out += len(data)
        out = self.client.conn.send(h11.Data(data=data))
        if out:
            self.out.append(out)

    def response_end(self) -> None:
        self.response_done = True
        client = self.client
        try:
            out = client.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            self.worker_failed(f"response cannot be forwarded: {exc}")
            return
        if out:
            self.out.append(out)
        if self.request_done:
            self._finish(True)
        else:  # answered before the request ended: neither connection can go on
            self.end = "answered before the request body ended"
            self._finish(False)

    # -- the relay thread (rule 7) ------------------------------------------------------------

    def _offload(self) -> None:
        """Hand the rest of a chunked response body to the relay thread, if nothing else is
        going on: the request sent whole, the worker read (not held back by the client), the
        reader between chunks, nothing waiting to be written to the client, both legs plain TCP.
        """
        off = self.host.offload
        worker = self.worker
        client = self.client
        if (
            off is None
            or worker is None
            or worker.transport is None
            or self.closed
            or self.response_done
            or not self.request_done
            or not worker.reading
            or self.paused_by_client
            or not worker.reader.at_chunk_boundary
            or worker.transport.is_closing()
            or client.transport.is_closing()
            or client.transport.get_write_buffer_size()
        ):
            return
        wsock, csock = plain_socket(worker.transport), plain_socket(client.transport)
        if wsock is None or csock is None:  # a TLS leg: the event loop relays it
            self.chunked_out = False
            return
        try:
            self.relay = off.take(self, wsock.fileno(), csock.fileno(), CHUNK_LIMIT, False, True)
        except OSError as exc:
            log.warning("relay thread refused a response body: %s", exc)
            self.chunked_out = False
            return
        worker.read(False)

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
        self.bytes_out += back.nbytes  # the chunks' data
        if back.frames:  # the worker spoke since the thread took it (when: not known)
            self.last = self.host.loop.time()
        worker = self.worker
        if back.backlog and not self.client.transport.is_closing():
            self.client.transport.write(back.backlog)  # may pause reading the worker
        if worker is None:
            return
        if back.carry:
            worker.reader.receive(back.carry)
        if not self.paused_by_client:
            worker.read(True)
        if back.carry:  # read next, outside whatever called this (a failure may have)
            self.host.loop.call_soon(self.worker_events)

    def flush_record(self) -> None:
        """No journal for plain HTTP (the relay thread records nothing for it)."""

    # -- failures (rule 4) ------------------------------------------------------------------

    def worker_lost(self, exc: Exception | None) -> None:
        self.worker_failed(f"the worker closed the connection{f': {exc}' if exc else ''}")

    def worker_failed(self, why: str) -> None:
        self.reclaim()
        worker = self.worker
        if self.closed or worker is None:
            return
        retry = (
            not self.response_started
            and worker.uses > 1
            and not self.retried
            and self.bodyless
            and self.method in IDEMPOTENT
        )
        worker.abort()
        self.worker = None
        if retry:
            # A kept-alive connection that died before any answer: again on a new one.
            self.retried = True
            self.client.task = self.host.loop.create_task(self.client._connect(self))
            return
        assert self.backend is not None
        log.warning("worker %s failed a plain request: %s", self.backend.id, why)
        if not self.response_started:
            self.fail(502, "the worker failed to answer", why)
        else:
            self.end = why
            self._finish(False)

    def client_gone(self, why: str) -> None:
        if self.closed:
            return
        self.reclaim()
        if not self.response_started:
            self.status = 499  # nginx's: the client closed before the answer
        self.end = why
        if self.worker is not None:
            self.worker.abort()
            self.worker = None
        self._finish(False)

    def fail(self, status: int, message: str, why: str) -> None:
        """wslb's answer if the client has heard nothing yet, else the cut; then the end."""
        if self.closed:
            return
        self.reclaim()
        if self.worker is not None:
            self.worker.abort()
            self.worker = None
        self.end = why
        client = self.client
        if not self.response_started and not client.transport.is_closing():
            self.status = status
            client.transport.write(error_response(status, message))
        self._finish(False)

    def _server_check(self) -> None:
        assert self.cfg is not None
        self.server_timer = None
        if self.closed:
            return
        self.reclaim()  # back here to judge it (the thread keeps no clock)
        now = self.host.loop.time()
        quiet = now - self.last
        if self.paused_by_client or quiet < self.cfg.timeout_server:
            wait = self.cfg.timeout_server - (0.0 if self.paused_by_client else quiet)
            self.server_timer = self.host.loop.call_later(max(wait, 0.01), self._server_check)
            return
        self.fail(504, "the worker did not answer in time", "timeout_server")

    def client_paused(self) -> None:
        """The client stopped taking the answer (rule 2): it has ``timeouts.backpressure`` to
        take it again. One timer per exchange, re-armed only when it fires."""
        host = self.host
        self.paused_at = host.loop.time()
        limit = host.timeouts.backpressure
        if limit > 0 and self.stall_timer is None:
            self.stall_timer = host.loop.call_later(limit, self._stall_check)

    def _stall_check(self) -> None:
        self.stall_timer = None
        if self.closed or not self.paused_by_client:
            return
        host = self.host
        left = self.paused_at + host.timeouts.backpressure - host.loop.time()
        if left > 0:
            self.stall_timer = host.loop.call_later(left, self._stall_check)
            return
        log.info(
            "plain HTTP client %s read nothing for %.0fs: exchange ended",
            self.client.front.peer,
            host.timeouts.backpressure,
        )
        self.fail(503, "the client did not read the answer", "client not reading")
        self.client.transport.abort()  # what it did not read would keep it open

    def _request_timeout(self) -> None:
        assert self.cfg is not None
        self.request_timer = None
        if self.closed or self.request_done:
            return
        if self.client.full:  # the worker is slow to take the body, not the client to send it
            self.request_timer = self.host.loop.call_later(
                self.cfg.timeout_request, self._request_timeout
            )
            return
        self.fail(408, "the request body did not arrive in time", "timeout_request")

    def abort(self, why: str) -> None:
        """End the exchange now (a drain's timeout, a shutdown)."""
        if self.closed:
            return
        self.reclaim()
        self.end = why
        if self.worker is not None:
            self.worker.abort()
            self.worker = None
        if not self.response_started and not self.client.transport.is_closing():
            self.status = 503
            self.client.transport.write(error_response(503, why))
        self._finish(False)

    # -- the end ----------------------------------------------------------------------------

    def _finish(self, keep: bool) -> None:
        if self.closed:
            return
        self.reclaim()
        self._flush()  # the answer before anything of the next request
        self.closed = True
        host = self.host
        for timer in (self.server_timer, self.request_timer, self.stall_timer):
            if timer is not None:
                timer.cancel()
        self.server_timer = self.request_timer = self.stall_timer = None
        worker = self.worker
        self.worker = None
        spare = None
        if worker is not None:
            worker.exchange = None
            if keep and worker.sent and worker.reader.reusable and self.cfg is not None:
                if host.lanes is not None and self.named:
                    spare = worker  # a lane's, perhaps (rule 8): the client decides
                else:
                    self.keep_worker(worker)
            else:
                worker.close()
        if self.counted and self.pool is not None and self.backend is not None:
            self.counted = False
            if self.named:
                self.pool.detach(
                    self.backend, self.sid, host.loop.time(), client=self.client.front.peer
                )
            else:
                self.pool.detach_request(self.backend)
            host.stats.http_active[self.pool.name] -= 1
            if self.sent is not None and self.prompt is not None:
                ended = self.report is not None and self.response_done and self.status == 200
                said = self.report.result() if ended and self.report is not None else None
                result = self.pool.settle(self.sent, self.prompt, said)
                if result is not None:
                    host.stats.prefix_reports[(self.pool.name, result)] += 1
        host.request_finished(self)
        self.logged()
        self.client.finished(self, keep, spare)

    def keep_worker(self, worker: WorkerConn) -> None:
        """Back to the pool of kept-alive worker connections (rule 5)."""
        assert self.cfg is not None
        worker.read(True)
        self.host.keepalive.put(worker, self.cfg.pool_size, self.host.loop.time())

    def lane_spec(self) -> Spec | None:
        """What the lane thread needs to serve this request's next ones as this module would
        (rule 8, ``_offload.c``), or None where it may not: a key wslb made, a pool not hashed
        by key, JWT."""
        host = self.host
        pool, backend, req, cfg = self.pool, self.backend, self.req, self.cfg
        if (
            pool is None
            or backend is None
            or req is None
            or cfg is None
            or not self.named
            or pool.balance != "consistent"
            or host.auth.cfg.jwt is not None
        ):
            return None
        up = backend.upstream
        try:
            target = upstream_target(up.path, req).encode("latin-1")
        except UnicodeEncodeError:
            return None
        pre, post = request_blocks(
            req,
            authority=up.authority,
            session_id=self.sid,
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
            SESSION_ID + b": " + self.key.encode("latin-1") + b"\r\n",
            limits.max_header_bytes,
            limits.max_headers,
            cfg.max_body,
            cfg.timeout_request,
            cfg.timeout_server,
            min(LANE_IDLE_S, cfg.timeout_keepalive),
            host.timeouts.backpressure,
            self.client.front.peer.encode("latin-1", "replace"),
            self.key.encode("latin-1"),
            pool.name.encode("utf-8"),
            backend.id.encode("utf-8"),
        )

    def logged(self) -> None:
        """Count the request and write its access line (``log.access``)."""
        host = self.host
        stats = host.stats
        duration = time.perf_counter() - self.t0
        pool = self.pool.name if self.pool is not None else "-"
        stats.http_requests[(pool, self.kind, self.status)] += 1
        stats.http_bytes["client_to_worker"] += self.bytes_in
        stats.http_bytes["worker_to_client"] += self.bytes_out
        stats.http_duration.observe(f"{pool}\x00{self.kind}", duration)
        if not host.config.log.access:
            return
        log_http_access(
            {
                "client": self.client.front.peer,
                "method": self.method.decode("latin-1"),
                "path": self.event.target.decode("latin-1").partition("?")[0][:200],
                "status": self.status,
                "session": self.key,
                "pool": pool,
                "backend": self.backend.id if self.backend is not None else None,
                "kind": self.kind,
                "connect_ms": round(self.connect_s * 1000, 1),
                "headers_ms": round(self.headers_s * 1000, 1),
                "duration_s": round(duration, 3),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "end": self.end,
                "user_agent": next(
                    (v.decode("latin-1") for k, v in self.event.headers if k == b"user-agent"),
                    None,
                ),
            }
        )
