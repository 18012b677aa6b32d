"""The asyncio shell of the proxy: one client connection, its upgrade, and the relay.

A client connection starts as ``ClientConnection`` (h11 parses the upgrade request). Once a
worker has accepted wslb's own upgrade, the worker leg's protocol becomes the ``Session`` (its
``data_received`` is the hot worker-to-client path, with no indirection) and the client leg's
becomes a thin ``ClientLeg``.

Close rules of a session (RFC 6455 7.1; wslb stands between two close handshakes):

- A close frame from one endpoint is forwarded to the other; the other's answer is forwarded back.
  When a leg has both sent and received a close, it is finished: wslb closes the client's TCP
  connection itself (the server closes first) and waits for the worker to close its own.
- Worker lost without a close: the client gets 1011 (1012 while the worker drains). Client lost:
  the worker gets 1001. A framing violation by the client: wslb sends the worker 1001, relays what
  the worker still had in flight, then gives the client the violation's code (1002, 1007, 1009).
  A framing violation by the worker: the worker gets 1002 and the client 1014 (bad gateway).
- wslb only injects a frame of its own at a frame boundary of the stream it goes into; where that
  is impossible (a worker died mid-frame), the connection is dropped instead.
- Every close waits at most ``timeouts.close`` for the peer; then the transport is aborted.

Heartbeat: one timer per session that reschedules itself (not re-armed per message, as in
aiohttp's ``web_ws``). It pings both legs every ``ping_interval`` with a random payload that the
scanners recognise in the pong, so endpoints' own pings and pongs pass through untouched; no pong
within ``ping_timeout`` ends the session with 1011. The same timer enforces the idle timeout. The
timers of all sessions share the balancer's ``TimerWheel`` (``app.wheel``, ``wheel.py``): a
session is an entry in a bucket, not a loop timer of its own, and fires up to 1/16 of its delay
late (at most 1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any, cast

import h11

from balancer import proxyproto
from balancer.frames import OP_CLOSE, OP_PING, FrameScanner, build_frame, close_payload
from balancer.handshake import (
    ClientRequest,
    HandshakeReject,
    RequestReader,
    UpstreamReject,
    accept_headers,
    check_client_request,
    check_upstream_response,
    new_session_id,
    session_key,
    upstream_request,
)
from balancer.proxyproto import forwarded_client, is_trusted

if TYPE_CHECKING:
    from balancer.aio.app import Balancer
    from balancer.aio.wheel import Bucket
    from balancer.pool import Backend, Pool

__all__ = ["ClientConnection", "Session", "open_upstream"]

# Client bytes kept per session for replay after a migration. Chat clients send little (prompts),
# so 256 KiB covers many messages; a session that outgrows it falls back to the graceful close.
REPLAY_LIMIT = 256 * 1024
PAUSES_KEPT = 20  # migration pauses a session remembers (GET /sessions)
# After a client's framing violation, the worker gets this long to send what it was answering
# before wslb closes its leg (the client gets its close code after that).
VIOLATION_GRACE = 0.05

log = logging.getLogger("wslb.server")

_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    426: "Upgrade Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def http_response(
    status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> bytes:
    """A complete HTTP/1.1 response with a short text body, closing the connection."""
    body = (message + "\n").encode("utf-8")
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}".encode()]
    for name, value in headers or ():
        lines.append(name + b": " + value)
    lines += [
        b"content-type: text/plain; charset=utf-8",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def switching_protocols(headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 101 Switching Protocols"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _pause(transport: asyncio.BaseTransport | None, pause: bool) -> None:
    if transport is None or transport.is_closing():
        return
    transport = cast(asyncio.ReadTransport, transport)
    with contextlib.suppress(RuntimeError):
        if pause:
            transport.pause_reading()
        else:
            transport.resume_reading()


class ClientConnection(asyncio.Protocol):
    """A client connection until its upgrade succeeds or is refused.

    ``peer`` is the client's address as wslb counts it (``max_connections_per_client``) and
    logs it: the TCP peer's, unless that peer is one of the ``trusted_proxies``; then it is the
    address the proxy names, in a PROXY protocol header (on a ``proxy_protocol`` listener) or
    in ``X-Forwarded-For``, and the per-client limit is checked once that address is known.
    """

    def __init__(self, app: Balancer, secure: bool = False, proxy_protocol: bool = False) -> None:
        self.app = app
        self.secure = secure
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.trusted = False  # the TCP peer is a trusted proxy
        # Bytes of a PROXY header not yet complete; None once read (or on other listeners).
        self.proxy_buf: bytearray | None = bytearray() if proxy_protocol else None
        self.proxied = False  # a PROXY header named the client
        limits = app.config.limits
        self.reader = RequestReader(limits.max_header_bytes, limits.max_headers)
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.session: Session | None = None
        self.gone = False
        self.counted = False

    # -- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0])
        app = self.app
        app.stats.connections_total += 1
        if app.closing or app.at_capacity():
            reason = "shutting down" if app.closing else "too many connections"
            self.reject(HandshakeReject(503, reason))
            return
        self.trusted = is_trusted(self.peer, app.config.trusted_proxies)
        if self.proxy_buf is not None and not self.trusted:
            # Anyone else could claim any address in the header.
            self.reject(HandshakeReject(400, "PROXY protocol header from an untrusted address"))
            return
        if not self.trusted and self._over_client_limit():
            self.reject(HandshakeReject(429, "too many connections from this address"))
            return
        app.connection_opened(self.peer)
        self.counted = True
        self.timer = app.loop.call_later(app.config.timeouts.handshake, self._handshake_timeout)

    def _over_client_limit(self) -> bool:
        limit = self.app.per_client_limit
        return bool(limit) and self.app.per_client[self.peer] >= limit

    def _client_is(self, address: str) -> None:
        """The client's address as a trusted proxy names it: counted under it from now on."""
        if address != self.peer:
            self.app.client_renamed(self.peer, address)
            self.peer = address

    def data_received(self, data: bytes) -> None:
        if self.proxy_buf is not None:
            self.proxy_buf += data
            try:
                found = proxyproto.parse(self.proxy_buf)
            except proxyproto.ProxyHeaderError as exc:
                self.reject(HandshakeReject(400, str(exc)))
                return
            if found is None:
                return
            header, size = found
            data = bytes(self.proxy_buf[size:])
            self.proxy_buf = None
            if header.source is not None:
                self.proxied = True
                self._client_is(header.source)
            if self._over_limit_once_named():
                return
            if not data:
                return
        # Bytes sent right behind the request (frames from an eager client) are kept by the
        # reader as trailing data for the session.
        try:
            event = self.reader.feed(data)
        except HandshakeReject as rej:
            self.reject(rej)
            return
        if event is not None:
            assert self.transport is not None
            self.transport.pause_reading()
            self.task = self.app.loop.create_task(self._upgrade(event))

    def eof_received(self) -> bool | None:
        if self.task is None:
            self._close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.counted and self.session is None:
            self.counted = False
            self.app.connection_closed(self.peer)

    # -- handshake -------------------------------------------------------------------------

    def _over_limit_once_named(self) -> bool:
        """The per-client check deferred for a trusted proxy's connection; True if refused.
        The connection is counted under its new name already: over means above the limit."""
        limit = self.app.per_client_limit
        if limit and self.app.per_client[self.peer] > limit:
            self.reject(HandshakeReject(429, "too many connections from this address"))
            return True
        return False

    def _handshake_timeout(self) -> None:
        self.timer = None
        if self.task is None:
            self.reject(HandshakeReject(408, "handshake timeout"))

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def reject(self, rej: HandshakeReject) -> None:
        """Answer a refused handshake with its status and close (no worker is contacted)."""
        self.app.stats.rejections[rej.status] += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(http_response(rej.status, rej.message, rej.headers))
            self.transport.close()

    async def _upgrade(self, event: h11.Request) -> None:
        try:
            await self._do_upgrade(event)
        except HandshakeReject as rej:
            self.reject(rej)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("upgrade failed")
            self.reject(HandshakeReject(500, "internal error"))

    async def _do_upgrade(self, event: h11.Request) -> None:
        app = self.app
        req = check_client_request(event)
        # X-Forwarded-For gets the address wslb took the connection from (a PROXY header's
        # client: that proxy is transparent), once, whatever worker legs the session opens.
        xff = req.header(b"x-forwarded-for")
        req = req.forwarded_for(self.peer)
        if self.trusted and not self.proxied and xff is not None:
            named = forwarded_client(xff.decode("latin-1"), app.config.trusted_proxies)
            if named is not None:
                self._client_is(named)
                if self._over_limit_once_named():
                    return
        pool = app.route(req.path)
        if pool is None:
            raise HandshakeReject(404, f"no pool serves {req.path}")
        sid = app.authorize(req) or session_key(pool.cfg.session_key, req) or new_session_id()
        tried: list[str] = []
        limit = len(pool.backends)
        last_error = "no worker available"
        while len(tried) < limit:
            backend = pool.select(sid, tried, app.loop.time())
            if backend is None:
                break
            tried.append(backend.id)
            try:
                transport, proto, response, trailing = await open_upstream(
                    app, backend, req, sid, self.secure
                )
            except UpstreamReject as exc:
                app.stats.handshake_failures[backend.id] += 1
                if exc.status != 503:
                    # A 503 is a worker saying it is busy or draining, not a broken one: the
                    # health probe takes it out; ejecting it would outlast its restart.
                    app.worker_failed(pool, backend)
                if exc.status in (502, 503, 504):
                    # Busy or going away (a worker draining itself): nothing was tunnelled, so
                    # walk on like a connect failure (HAProxy's retry-on 503).
                    last_error = f"worker {backend.id}: {exc}"
                    continue
                # Any other refusal is the worker's answer to this request: a 502.
                raise HandshakeReject(502, f"worker {backend.id}: {exc}") from None
            except (OSError, TimeoutError) as exc:
                app.stats.connect_failures[backend.id] += 1
                app.worker_failed(pool, backend)
                last_error = f"worker {backend.id}: {exc or type(exc).__name__}"
                log.warning("connect to %s failed: %s", backend.id, last_error)
                continue
            if self.gone:
                transport.close()
                return
            self._start_session(pool, backend, sid, req, transport, proto, response, trailing)
            return
        status = 502 if tried else 503
        raise HandshakeReject(status, last_error)

    def _start_session(
        self,
        pool: Pool,
        backend: Backend,
        sid: str,
        req: ClientRequest,
        wtransport: asyncio.Transport,
        proto: UpstreamHandshake,
        subprotocol: str | None,
        worker_trailing: bytes,
    ) -> None:
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        ctransport = self.transport
        session = Session(
            self.app, pool, backend, sid, self.peer, ctransport, wtransport, req, self.secure
        )
        self.session = session
        ctransport.write(switching_protocols(accept_headers(req.key, subprotocol, sid)))
        ctransport.set_protocol(ClientLeg(session))
        wtransport.set_protocol(session)
        client_trailing = self.reader.trailing
        worker_trailing += bytes(proto.extra)
        if worker_trailing:
            session.data_received(worker_trailing)
        if client_trailing:
            session.client_data(client_trailing)
        if proto.eof:
            session.connection_lost(None)
        _pause(ctransport, False)
        _pause(wtransport, False)


async def open_upstream(
    app: Balancer,
    backend: Backend,
    req: ClientRequest,
    sid: str,
    secure: bool,
    resume: bool = False,
) -> tuple[asyncio.Transport, UpstreamHandshake, str | None, bytes]:
    """Connect to a worker and complete wslb's own upgrade there.

    Returns the transport (reading paused), its handshake protocol (holding any bytes that came
    after the 101), the negotiated subprotocol and the bytes that came with the 101.
    Raises OSError/TimeoutError (connect) or UpstreamReject (bad answer).
    """
    up = backend.upstream
    request, nonce = upstream_request(
        req.path if up.path is None else up.path,
        up.authority,
        req,
        sid,
        secure_client=secure,
        resume=resume,
    )
    timeouts = app.config.timeouts
    transport, proto = await asyncio.wait_for(
        app.loop.create_connection(
            lambda: UpstreamHandshake(request),
            up.host,
            up.port,
            ssl=app.upstream_ssl(backend),
            ssl_handshake_timeout=timeouts.connect if up.secure else None,
        ),
        timeouts.connect,
    )
    try:
        response, trailing = await asyncio.wait_for(proto.done, timeouts.handshake)
        subprotocol = check_upstream_response(response, nonce, req.subprotocols)
    except BaseException:
        transport.abort()
        raise
    return transport, proto, subprotocol, trailing


class Retired(asyncio.Protocol):
    """The old worker leg after a migration: its bytes are discarded, its end is no event."""

    def data_received(self, data: bytes) -> None:
        pass


class UpstreamHandshake(asyncio.Protocol):
    """The worker leg while wslb's upgrade request is answered."""

    def __init__(self, request: h11.Request) -> None:
        self.request = request
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self.done: asyncio.Future[tuple[h11.InformationalResponse | h11.Response, bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self.eof = False
        self.extra = bytearray()  # bytes that arrive after the 101, before the switch-over
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.h11.send(self.request) or b"")

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.extra += data
            return
        try:
            self.h11.receive_data(data)
            event = self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            self.done.set_exception(UpstreamReject(f"malformed response: {exc}"))
            return
        if isinstance(event, h11.InformationalResponse):
            if event.status_code == 101:
                _pause(self.transport, True)  # the session resumes it once it is wired
                self.done.set_result((event, self.h11.trailing_data[0]))
            # other 1xx: keep waiting for the final answer
            elif event.status_code != 100:
                self.done.set_result((event, b""))
        elif isinstance(event, h11.Response):
            self.done.set_result((event, b""))

    def eof_received(self) -> bool | None:
        self.eof = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if not self.done.done():
            self.done.set_exception(ConnectionResetError("worker closed during the handshake"))


class ClientLeg(asyncio.Protocol):
    """The client leg of a live session: hands everything to the session."""

    # Slots, not a dict. ``data_received`` is a slot holding the session's bound ``client_data``
    # (the transport calls the session directly: one Python call per read, not two); uvloop keeps
    # the same bound method, so it costs nothing more.
    __slots__ = ("data_received", "session")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.data_received = session.client_data  # type: ignore[method-assign]

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.client_lost()

    def pause_writing(self) -> None:
        """The client does not keep up: stop reading the worker."""
        self.session.paused_since = self.session.app.loop.time()
        _pause(self.session.wt, True)

    def resume_writing(self) -> None:
        self.session.paused_since = 0.0
        _pause(self.session.wt, False)


class Session(asyncio.Protocol):
    """A live proxied WebSocket; the protocol object of its worker leg. See the module doc."""

    # Slots, not a dict: a few hundred bytes per idle session (docs/benchmarks.md).
    __slots__ = (
        "_awaiting_pong",
        "_last_active",
        "_last_msgs",
        "app",
        "backend",
        "client_close_sent",
        "client_gone",
        "clog",
        "clog_base",
        "close_to_client",
        "close_to_worker",
        "closing",
        "cs",
        "ct",
        "ended",
        "finished",
        "holding",
        "leg_start_msg",
        "migrating",
        "migrations",
        "paused_since",
        "pauses",
        "peer",
        "pending_client_close",
        "pool",
        "prior_backends",
        "prior_bytes",
        "prior_frames",
        "prior_messages",
        "replay_limit",
        "req",
        "secure",
        "sid",
        "since",
        "started_wall",
        "timer",
        "worker_close_sent",
        "worker_gone",
        "ws",
        "wt",
    )

    def __init__(
        self,
        app: Balancer,
        pool: Pool,
        backend: Backend,
        sid: str,
        peer: str,
        ct: asyncio.Transport,
        wt: asyncio.Transport,
        req: ClientRequest,
        secure: bool,
    ) -> None:
        limits = app.config.limits
        self.app = app
        self.pool = pool
        self.backend = backend
        self.sid = sid
        self.peer = peer
        self.ct = ct
        self.wt = wt
        self.since = app.loop.time()
        self.started_wall = app.wall_time()
        self.cs = FrameScanner(
            masked=True,
            max_frame_size=limits.max_frame_size,
            max_message_size=limits.max_message_size,
        )
        self.ws = FrameScanner(
            masked=False,
            max_frame_size=max(limits.max_frame_size, limits.max_message_size),
            max_message_size=1 << 62,
        )
        for t in (ct, wt):
            t.set_write_buffer_limits(high=limits.write_buffer_high)
        self.req = req.for_resume()
        self.secure = secure
        # Migration: a bounded log of the client bytes sent on the current worker leg and where
        # each client message ends in it, to replay what the old worker had not processed.
        self.migrations = 0
        # Seconds, one per migration, the last PAUSES_KEPT (a tuple: the empty one is shared).
        self.pauses: tuple[float, ...] = ()
        self.migrating = False
        self.holding = False
        self.replay_limit = REPLAY_LIMIT if pool.cfg.drain.migrate else 0
        self.clog: bytearray | None = bytearray() if self.replay_limit else None
        self.clog_base = 0  # absolute client-stream offset of clog[0]
        self.leg_start_msg = 0  # client message index of the first one sent on this leg
        if self.clog is not None:
            self.cs.ends = []
        # Counts of earlier worker legs (each leg has its own scanner).
        self.prior_frames = 0
        self.prior_messages = 0
        self.prior_bytes = 0
        self.client_close_sent = False
        self.worker_close_sent = False
        self.client_gone = False
        self.worker_gone = False
        self.pending_client_close: tuple[int, str] | None = None
        self.closing = False
        self.finished = False
        # For the access log: the close code each side was sent, why the session ended (the
        # first cause) and the workers it left by migration (a tuple: the empty one is shared).
        self.close_to_client: int | None = None
        self.close_to_worker: int | None = None
        self.ended: str | None = None
        self.prior_backends: tuple[str, ...] = ()
        self.timer: Bucket | None = None  # the app.wheel bucket this session is due in
        self._awaiting_pong = False
        self.paused_since = 0.0  # loop time backpressure paused a leg; 0 when flowing
        self._last_msgs = 0
        self._last_active = self.since
        pool.attach(sid, backend, app.loop.time())
        app.session_started(self)
        self._schedule_tick(self._first_tick_delay())

    # -- hot path --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Bytes from the worker."""
        ws = self.ws
        out = ws.feed(data)
        if out and not self.ct.is_closing():  # uvloop raises on a write to a closed handle
            self.ct.write(out)
        if ws.notable:
            ws.notable = False
            self._worker_event()

    def client_data(self, data: bytes) -> None:
        """Bytes from the client."""
        cs = self.cs
        out = cs.feed(data)
        if out and not self.wt.is_closing():
            self.wt.write(out)
            if self.clog is not None:
                self._log_client(out)
        if cs.notable:
            cs.notable = False
            self._client_event()

    def _log_client(self, out: bytes) -> None:
        clog = self.clog
        assert clog is not None
        clog += out
        excess = len(clog) - self.replay_limit
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

    def hold(self) -> None:
        """Stop reading the client (its bytes wait in the kernel: bounded by the socket)."""
        self.holding = True
        _pause(self.ct, True)

    def release(self) -> None:
        self.holding = False
        _pause(self.ct, False)

    def switch(
        self,
        target: Backend,
        wt: asyncio.Transport,
        proto: UpstreamHandshake,
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
        old_wt, old_backend = self.wt, self.backend
        old_wt.set_protocol(Retired())
        if self.cs.at_frame_boundary:
            old_wt.write(build_frame(OP_CLOSE, close_payload(1001, "session moved"), mask=True))
        old_wt.close()
        self.prior_frames += self.ws.frames
        self.prior_messages += self.ws.messages
        self.prior_bytes += self.ws.bytes
        limits = self.app.config.limits
        self.ws = FrameScanner(
            masked=False,
            max_frame_size=max(limits.max_frame_size, limits.max_message_size),
            max_message_size=1 << 62,
        )
        self.ws.own_ping = None
        self.leg_start_msg += processed
        self.wt = wt
        wt.set_write_buffer_limits(high=limits.write_buffer_high)
        self.pool.detach(old_backend)
        self.prior_backends += (old_backend.id,)
        self.backend = target
        self.pool.attach(self.sid, target, self.app.loop.time())
        self.migrations += 1
        wt.set_protocol(self)
        data = trailing + bytes(proto.extra)
        if replay:
            wt.write(replay)
        if data:
            self.data_received(data)
        if proto.eof:
            self.connection_lost(None)
        else:
            _pause(wt, False)

    # -- flow control (worker leg) ---------------------------------------------------------

    def pause_writing(self) -> None:
        """The worker does not keep up: stop reading the client."""
        self.paused_since = self.app.loop.time()
        _pause(self.ct, True)

    def resume_writing(self) -> None:
        self.paused_since = 0.0
        if not self.holding:
            _pause(self.ct, False)

    # -- events ----------------------------------------------------------------------------

    def _client_event(self) -> None:
        cs = self.cs
        if cs.error is not None:
            self._client_violation(cs.error.code, cs.error.reason)
        elif cs.close is not None and not self.worker_close_sent:
            # The client's close was forwarded to the worker.
            self.worker_close_sent = True
            self.close_to_worker = cs.close[0]
            self._end("client closed")
            self.app.stats.closes["worker", cs.close[0]] += 1
            self._begin_closing()
        self._maybe_finish()

    def _worker_event(self) -> None:
        ws = self.ws
        if ws.error is not None:
            log.warning(
                "session %s: worker %s broke framing: %s", self.sid, self.backend.id, ws.error
            )
            self._end(f"worker broke framing: {ws.error.reason}")
            self._send_worker_close(1002, ws.error.reason)
            self._send_client_close(1014, "bad frame from worker")
        elif ws.close is not None:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
                self._send_client_close(code, reason)
            elif not self.client_close_sent:
                self.client_close_sent = True  # the worker's close went through
                self.close_to_client = ws.close[0]
                self._end("worker closed")
                self.app.stats.closes["client", ws.close[0]] += 1
            self._begin_closing()
        self._maybe_finish()

    def _client_violation(self, code: int, reason: str) -> None:
        self._end(f"client broke the protocol: {reason}")
        if self.worker_gone or self.worker_close_sent:
            self._send_client_close(code, reason)
            return
        # Let the worker's in-flight messages through first (answers to what the client sent
        # before the bad frame), then give the client its code.
        self.pending_client_close = (code, reason)
        self.ws.drop_close = True
        self._begin_closing()
        self.app.loop.call_later(
            VIOLATION_GRACE, self._send_worker_close, 1001, "client protocol error"
        )

    def connection_lost(self, exc: Exception | None) -> None:
        """The worker leg closed."""
        self.worker_gone = True
        if not self.client_close_sent and not self.client_gone:
            if self.pending_client_close is not None:
                code, reason = self.pending_client_close
            elif self.cs.close is not None:
                # The client was closing anyway: complete its handshake with its own code.
                code, reason = self.cs.close
                code = 1000 if code == 1005 else code
            elif self.backend.admin_state != "active":
                code, reason = 1012, "worker restarting"
            else:
                code, reason = 1011, "worker lost"
            self._end(reason if code in (1011, 1012) else "worker closed")
            self._send_client_close(code, reason)
        self._maybe_finish()

    def client_lost(self) -> None:
        """The client leg closed."""
        self.client_gone = True
        if not self.worker_close_sent and not self.worker_gone:
            self._end("client went away")
            self._send_worker_close(1001, "client went away")
        self._maybe_finish()

    # -- closing ---------------------------------------------------------------------------

    def _send_client_close(self, code: int, reason: str) -> None:
        self.pending_client_close = None
        if self.client_close_sent or self.client_gone:
            return
        self.client_close_sent = True
        self.close_to_client = code
        self.ws.closed = True  # nothing more goes to the client after our close
        self.app.stats.closes["client", code] += 1
        if self.ct.is_closing():
            pass
        elif self.ws.at_frame_boundary:
            self.ct.write(build_frame(OP_CLOSE, close_payload(code, reason)))
            if self.cs.error is not None:
                # Failing the connection (RFC 6455 7.1.7): close TCP, don't wait for an answer.
                self.ct.close()
        else:
            self.ct.abort()
        self._begin_closing()

    def _send_worker_close(self, code: int, reason: str) -> None:
        if self.worker_close_sent or self.worker_gone:
            return
        self.worker_close_sent = True
        self.close_to_worker = code
        self.cs.closed = True
        self.app.stats.closes["worker", code] += 1
        if self.wt.is_closing():
            pass
        elif self.cs.at_frame_boundary:
            self.wt.write(build_frame(OP_CLOSE, close_payload(code, reason), mask=True))
        else:
            self.wt.abort()
        self._begin_closing()

    def close(self, code: int, reason: str) -> None:
        """End the session from wslb's side (shutdown, idle, drain): both legs get ``code``."""
        self._end(reason)
        self._send_client_close(code, reason)
        self._send_worker_close(1001 if code == 1012 else code, reason)
        self._maybe_finish()

    def _end(self, why: str) -> None:
        """Record why the session ends, for the access log: the first cause wins."""
        if self.ended is None:
            self.ended = why

    def _begin_closing(self) -> None:
        if self.closing:
            return
        self.closing = True
        self._schedule_tick(self.app.config.timeouts.close)

    def _maybe_finish(self) -> None:
        """Close TCP where both close frames have passed; clean up once both legs are gone."""
        # A close wslb sent on the worker's behalf waits for the client's answer (or the timer).
        if not self.client_gone and self.client_close_sent and self.cs.close is not None:
            self.ct.close()
        if (
            not self.worker_gone
            and self.client_gone
            and self.worker_close_sent
            and self.ws.close is not None
        ):
            self.wt.close()
        if self.client_gone and self.worker_gone and not self.finished:
            self.finished = True
            self.app.wheel.cancel(self)
            self.pool.detach(self.backend, self.sid, self.app.loop.time())
            self.app.session_finished(self)

    def _close_timeout(self) -> None:
        """The peers had ``timeouts.close`` to finish their close handshakes."""
        if self.pending_client_close is not None:
            code, reason = self.pending_client_close
            self._send_client_close(code, reason)
        if not self.client_gone:
            self.ct.abort()
        if not self.worker_gone:
            self.wt.abort()

    # -- heartbeat and idle timer ----------------------------------------------------------

    def _first_tick_delay(self) -> float:
        t = self.app.config.timeouts
        timers = [x for x in (t.ping_interval, t.idle, t.backpressure) if x > 0]
        return min(timers) if timers else 0.0

    def _schedule_tick(self, delay: float) -> None:
        if delay > 0:
            self.app.wheel.schedule(self, delay)
        else:
            self.app.wheel.cancel(self)

    def _tick(self) -> None:
        """Called by the wheel (which has cleared ``self.timer``)."""
        if self.finished:
            return
        if self.closing:
            self._close_timeout()
            return
        t = self.app.config.timeouts
        now = self.app.loop.time()
        msgs = self.cs.messages + self.ws.messages
        if msgs != self._last_msgs:
            self._last_msgs = msgs
            self._last_active = now
        elif t.idle > 0 and now - self._last_active >= t.idle:
            self.close(1001, "idle timeout")
            return
        if self.paused_since and t.backpressure > 0 and now - self.paused_since >= t.backpressure:
            log.info("session %s: paused by backpressure for %.0fs", self.sid, t.backpressure)
            self.app.stats.backpressure_closes += 1
            self.close(1008, "peer not reading")
            return
        if t.ping_interval <= 0:
            self._schedule_tick(self._first_tick_delay())
            return
        if self._awaiting_pong:
            self._awaiting_pong = False
            if self.cs.own_ping is not None:
                log.info("session %s: client ping timeout", self.sid)
                self._end("client ping timeout")
                self._send_client_close(1011, "ping timeout")
                self._send_worker_close(1001, "client ping timeout")
                self._maybe_finish()
                return
            if self.ws.own_ping is not None:
                log.info("session %s: worker %s ping timeout", self.sid, self.backend.id)
                self._end("worker ping timeout")
                self._send_client_close(1011, "worker ping timeout")
                self.wt.abort()
                return
            self._schedule_tick(max(0.0, t.ping_interval - t.ping_timeout) or 0.001)
            return
        # Send a ping on each leg that is at a frame boundary (else skip it this round).
        if self.ws.at_frame_boundary and self.cs.own_ping is None:
            payload = os.urandom(8)
            self.cs.own_ping = payload
            self.cs.pong_received = False
            self.ct.write(build_frame(OP_PING, payload))
        if self.cs.at_frame_boundary and self.ws.own_ping is None:
            payload = os.urandom(8)
            self.ws.own_ping = payload
            self.ws.pong_received = False
            self.wt.write(build_frame(OP_PING, payload, mask=True))
        self._awaiting_pong = True
        self._schedule_tick(t.ping_timeout)

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
        return (
            self.cs.messages,
            self.prior_messages + self.ws.messages,
            self.cs.bytes,
            self.prior_bytes + self.ws.bytes,
        )

    def describe(self) -> dict[str, Any]:
        """The session as the admin API shows it."""
        return {
            "id": self.sid,
            "pool": self.pool.name,
            "backend": self.backend.id,
            "client": self.peer,
            "since": self.started_wall,
            "messages": {
                "client_to_worker": self.cs.messages,
                "worker_to_client": self.prior_messages + self.ws.messages,
            },
            "frames": {
                "client_to_worker": self.cs.frames,
                "worker_to_client": self.prior_frames + self.ws.frames,
            },
            "migrations": self.migrations,
            "migration_pauses_ms": [round(p * 1e3, 3) for p in self.pauses],
        }
