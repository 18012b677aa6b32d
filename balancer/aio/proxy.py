"""A client connection until its upgrade succeeds or is refused, and wslb's own upgrade to a
worker.

``ClientConnection`` is the protocol of every accepted connection: h11 parses the upgrade
request (``handshake.py`` checks it, sans-I/O), a pool is routed by path, a session key found,
and a backend chosen and connected (``open_upstream``: wslb is the WebSocket client there, with
``UpstreamHandshake`` as the worker leg's protocol until the 101). A failed connect or a busy
answer walks on to the next candidate; every refusal is an HTTP status before any byte is
tunnelled. Once the worker's 101 is checked, both transports are handed to a ``Session``
(``session.py``), which owns them from then on.

In a pool that binds WebSocket sessions late (``prefix_placement.websocket``), a new session is
answered by wslb first, its first message read (``balancer/late.py``, whose rules say what
changes: a refusal is a close after the 101), and only then placed and connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

import h11

from balancer import late, proxyproto, workerauth
from balancer.aio.httpproxy import HttpClient
from balancer.aio.peers import (
    PEER_CLIENT_HEADER,
    PEER_HEADER,
    carry,
    peer_address,
    peer_request,
    valid_peer,
)
from balancer.aio.session import ClientLeg, Leg, Session, pause_reading
from balancer.aio.state import ServerState
from balancer.frames import OP_CLOSE, build_frame, close_payload
from balancer.handshake import (
    WORKER_BODY_LIMIT,
    ClientRequest,
    HandshakeReject,
    RequestReader,
    UpstreamReject,
    accept_headers,
    check_client_request,
    check_upstream_response,
    upstream_request,
)
from balancer.httpmsg import is_handshake
from balancer.prefix import Prompt
from balancer.proxyproto import is_trusted
from balancer.resume import (
    NO_RESUME,
    PARK_HEADER,
    REATTACH_FROM_HEADER,
    REATTACH_HEADER,
    RESUMED_HEADER,
    TOKEN_HEADER,
    Resume,
    answers_in_band,
    in_band_close,
    new_token,
    park_value,
    read_resume,
)
from balancer.router import Walk, route
from balancer.session_core import ResumeRefused

if TYPE_CHECKING:
    from balancer.pool import Backend, Pool

__all__ = ["ClientConnection", "UpstreamHandshake", "http_response", "open_upstream"]

log = logging.getLogger("wslb.server")


ARRIVAL_WAIT = 35.0  # a resume during a restart: the old code's sessions moving (30 s at most)

_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    426: "Upgrade Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def http_response(
    status: int,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    details: dict[str, Any] | None = None,
) -> bytes:
    """A complete HTTP/1.1 response with a short text body, closing the connection.

    With ``details`` the body is JSON instead: ``{"error": message, **details}`` (what an API
    client such as the OpenAI SDK reads).
    """
    if details is None:
        body, kind = (message + "\n").encode("utf-8"), b"text/plain; charset=utf-8"
    else:
        body, kind = json.dumps({"error": message, **details}).encode(), b"application/json"
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}".encode()]
    for name, value in headers or ():
        lines.append(name + b": " + value)
    lines += [
        b"content-type: " + kind,
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def switching_protocols(headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 101 Switching Protocols"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def ending(s: Session) -> bool:
    """Rule 8: a session that can no longer be resumed nor taken over (its close has begun)."""
    return not s.core.detached_at and (s.client is not Leg.OPEN or s.closing)


class WorkerRefused(HandshakeReject):
    """The worker refused the upgrade itself; ``raw`` is its answer as the client gets it."""

    def __init__(self, status: int, raw: bytes, backend_id: str) -> None:
        super().__init__(status, f"refused by worker {backend_id}")
        self.raw = raw


class ClientConnection(asyncio.Protocol):
    """A client connection until its upgrade succeeds or is refused.

    ``peer`` is the client's address as wslb counts it (``max_connections_per_client``) and
    logs it: the TCP peer's, unless that peer is one of the ``trusted_proxies``; then it is the
    address the proxy names, in a PROXY protocol header (on a ``proxy_protocol`` listener) or
    in ``X-Forwarded-For``, and the per-client limit is checked once that address is known.
    """

    def __init__(
        self, state: ServerState, secure: bool = False, proxy_protocol: bool = False
    ) -> None:
        self.state = state
        self.secure = secure
        self.opened = state.loop.time()  # made at accept: the handshake's histogram
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.trusted = False  # the TCP peer is a trusted proxy
        # Bytes of a PROXY header not yet complete; None once read (or on other listeners).
        self.proxy_buf: bytearray | None = bytearray() if proxy_protocol else None
        self.proxied = False  # a PROXY header named the client
        limits = state.limits
        self.reader = RequestReader(limits.max_header_bytes, limits.max_headers)
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.session: Session | None = None
        self.gone = False
        self.counted = False
        self.method = "-"  # the request's, once read (for the log line of a refusal)
        self.target = "-"
        self.http: HttpClient | None = None  # serving plain HTTP (aio/httpproxy.py)
        self.resume = NO_RESUME  # what the upgrade said about resuming (balancer/resume.py)
        self.token: str | None = None  # the session's resume token, once decided
        self.carried = False  # another instance of the tier carried this resume here
        # A browser's resume (token in the query): its refusals are a 101 and a close
        # (balancer/resume.py); the request's key and first subprotocol make that 101.
        self.in_band: tuple[bytes, str | None] | None = None
        self.lingering = False  # closed in band: waiting for the client's close
        # Late binding (balancer/late.py): wslb's own 101 is sent and the first message read.
        self.late: late.Reader | None = None
        self.late_done: asyncio.Future[late.Outcome] | None = None
        self.answered = False  # wslb's 101 went out: a refusal is a close from now on
        self.late_kept = bytearray()  # what the client sent meanwhile, for its worker

    # -- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0])
        st = self.state
        st.stats.connections_total += 1
        if st.closing or st.at_capacity():
            reason = "shutting down" if st.closing else "too many connections"
            self.reject(HandshakeReject(503, reason))
            return
        self.trusted = is_trusted(self.peer, st.trusted_proxies)
        if self.proxy_buf is not None and not self.trusted:
            # Anyone else could claim any address in the header.
            self.reject(HandshakeReject(400, "PROXY protocol header from an untrusted address"))
            return
        if not self.trusted and self._over_client_limit():
            self.reject(HandshakeReject(429, "too many connections from this address"))
            return
        st.connection_opened(self.peer)
        self.counted = True
        self.timer = st.loop.call_later(st.timeouts.handshake, self._handshake_timeout)

    def _over_client_limit(self) -> bool:
        limit = self.state.per_client_limit
        return bool(limit) and self.state.per_client[self.peer] >= limit

    def _client_is(self, address: str) -> None:
        """The client's address as a trusted proxy names it: counted under it from now on."""
        if address != self.peer:
            self.state.client_renamed(self.peer, address)
            self.peer = address

    def data_received(self, data: bytes) -> None:
        if self.http is not None:
            self.http.data_received(data)
            return
        if self.lingering:  # the client's close (or whatever it sent before it): done
            self._close()
            return
        if self.late is not None:
            self._late_data(data)
            return
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
            self.task = self.state.loop.create_task(self._upgrade(event))

    def eof_received(self) -> bool | None:
        if self.http is not None:
            return self.http.eof_received()
        if self.task is None:
            self._close()
        return None

    def pause_writing(self) -> None:
        if self.http is not None:
            self.http.pause_writing()

    def resume_writing(self) -> None:
        if self.http is not None:
            self.http.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self.http is not None:
            self.http.connection_lost(exc)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.counted and self.session is None:
            self.counted = False
            self.state.connection_closed(self.peer)

    # -- handshake -------------------------------------------------------------------------

    def _over_limit_once_named(self) -> bool:
        """The per-client check deferred for a trusted proxy's connection; True if refused.
        The connection is counted under its new name already: over means above the limit."""
        limit = self.state.per_client_limit
        if limit and self.state.per_client[self.peer] > limit:
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

    def reject(self, rej: HandshakeReject, logged: bool = True) -> None:
        """Answer a refused handshake with its status and close, with a log line (the client,
        the status and why: HAProxy logs every refused request too) unless not ``logged`` (a
        refusal its caller logs once for many)."""
        self.state.stats.rejections[rej.status] += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if logged:
            log.info(
                "refused %s %s from %s: %d %s",
                self.method,
                self.target,
                self.peer,
                rej.status,
                rej.message,
            )
        if self.transport is not None and not self.transport.is_closing():
            if self.answered:  # late binding: the 101 is out, so a close says it (late.py)
                self._close_in_band(*late.refusal_close(rej.status, rej.message))
                return
            # A carried resume is answered in statuses: the instance that carried it reads
            # them (aio/peers.py) and answers its client in the client's form.
            in_band = self.in_band is not None and not self.carried
            closing = in_band_close(rej) if in_band else None
            if isinstance(rej, WorkerRefused):
                self.transport.write(rej.raw)
            elif closing is not None:
                self._close_in_band(*closing)
                return
            else:
                body = http_response(rej.status, rej.message, rej.headers, rej.details)
                self.transport.write(body)
            self.transport.close()

    def _close_in_band(self, code: int, reason: str) -> None:
        """Refuse a browser's resume as a browser can see it: a 101, then a close with
        ``code`` and ``reason``; the TCP connection ends when the client answers the close (or
        after ``timeouts.close``): closed with the client's close unread, it would be reset,
        and the reset may destroy the close frame before the browser reads it."""
        assert self.transport is not None
        head = b""
        if not self.answered:
            assert self.in_band is not None
            key, subprotocol = self.in_band
            head = switching_protocols(accept_headers(key, subprotocol, None))
        self.transport.write(head + build_frame(OP_CLOSE, close_payload(code, reason)))
        self.late = None
        self.lingering = True
        self.transport.resume_reading()
        self.timer = self.state.loop.call_later(self.state.timeouts.close, self._close)

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
        st = self.state
        self.method = event.method.decode("latin-1", "replace")
        self.target = event.target.decode("latin-1", "replace").partition("?")[0][:200]
        if not is_handshake(event):  # plain HTTP: this connection's requests from now on
            self._plain(event)
            return
        raw = check_client_request(event)
        if answers_in_band(raw):
            self.in_band = (raw.key, raw.subprotocols[0] if raw.subprotocols else None)
        resume = self.resume = read_resume(raw)  # before route() strips the wslb_ parameters
        routed = route(self.state, raw, self)
        if routed is None:
            return
        pool, req, key, sid, _ = routed
        self._from_peer(event, pool)
        if pool.cfg.resume.enabled and resume.token is not None:
            if not self.carried and self._resume_throttled(pool):
                return
            live = st.find_resumable(resume.token)  # by token: a newer session may have the key
            arriving = st.arriving
            if live is None and arriving is not None and resume.count is not None:
                with contextlib.suppress(TimeoutError):  # a restart is handing it on
                    await asyncio.wait_for(arriving.wait(), ARRIVAL_WAIT)
                live = st.find_resumable(resume.token)
            if live is None and st.fetch_session is not None and resume.count is not None:
                # workers: N: another serving process may hold it (handover.py)
                assert self.transport is not None
                live = await st.fetch_session(sid, resume.token, self.transport)
                if self.gone:  # adopted, and still detached: it waits here for its client
                    return
            if live is not None and live.sid == sid:
                if resume.count is not None or not ending(live):
                    self._resume(pool, live, req, key, resume)
                    return
                # A plain upgrade naming the token of its own session that is closing: the
                # new session takes the token over.
            elif resume.count is not None:  # a reconnect, and nothing to resume here
                if not self.carried and await self._elsewhere(event, pool, req, key, sid, resume):
                    return
                self._resume_failed(pool, "unknown")
                raise HandshakeReject(
                    409,
                    "no session to resume: unknown or expired token, or another key",
                    details={"resume": "unknown"},
                )
            elif live is not None:
                self._token_taken(pool)
        extra: list[tuple[bytes, bytes]] = []
        if pool.cfg.resume.enabled:  # Rule 8: the client's secret for its reconnect
            self.token = self.resume.token or new_token()
            r = pool.cfg.resume
            extra.append((PARK_HEADER, park_value(0, r.grace, r.buffer, self.token)))
        prompt: Prompt | None = None
        client_bytes = self.reader.trailing
        if self._binds_late(pool, sid):
            outcome = await self._read_first_message(pool, req, key)
            if outcome is None:
                return
            prompt, client_bytes = outcome.prompt, bytes(self.late_kept)
            if self.transport is None or self.transport.is_closing():
                return
            # Only the subprotocol the client was told: the worker must speak that one.
            req = dataclasses.replace(req, subprotocols=req.subprotocols[:1])
        opened = await self._open_worker(pool, req, sid, extra, prompt)
        if opened is None:
            return
        backend, transport, proto, response, trailing = opened
        if self.answered and response != (req.subprotocols[0] if req.subprotocols else None):
            transport.close()
            raise HandshakeReject(502, "the worker did not accept the session's subprotocol")
        self._start_session(
            pool,
            backend,
            sid,
            req,
            transport,
            proto,
            response,
            trailing,
            key,
            client_bytes=client_bytes,
        )
        if prompt is not None:
            pool.learn(prompt, backend)

    def _binds_late(self, pool: Pool, sid: str) -> bool:
        """Late binding (``balancer/late.py``): a new session of a pool that asks for it, whose
        key has no place yet (a known key goes home as soon as it asks)."""
        pp = pool.cfg.prefix_placement
        return pp.websocket and pool.prefix is not None and not self.carried and not pool.knows(sid)

    async def _read_first_message(
        self, pool: Pool, req: ClientRequest, key: str
    ) -> late.Outcome | None:
        """Send wslb's own 101 and read the session's first message (late.py rules 1-4);
        None: the read ended the session (a close answered here)."""
        st = self.state
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        headers = accept_headers(req.key, req.subprotocols[0] if req.subprotocols else None, key)
        if self.token is not None:
            headers.append((TOKEN_HEADER, self.token.encode()))
        pp = pool.cfg.prefix_placement
        reader = self.late = late.Reader(pool.prefix_rules, pp.max_body)
        self.late_done = st.loop.create_future()
        self.answered = True
        self.transport.write(switching_protocols(headers))
        st.stats.handshake_duration.observe(st.loop.time() - self.opened)
        wait = st.loop.call_later(pp.first_message_wait, self._late_timeout)
        try:
            self._late_data(self.reader.trailing)
            if not self.late_done.done():
                pause_reading(self.transport, False)
            outcome = await self.late_done
        finally:
            wait.cancel()
            self.late_kept = reader.kept
            self.late = None
            self.late_done = None
        if outcome.state is late.Read.END:
            st.stats.late_bound[(pool.name, "closed")] += 1
            self._close_in_band(outcome.code, outcome.reason)
            return None
        if outcome.prompt is None:
            st.stats.late_bound[(pool.name, "none")] += 1
        return outcome

    def _late_data(self, data: bytes) -> None:
        assert self.late is not None
        outcome = self.late.feed(data)
        if outcome is not None and self.late_done is not None and not self.late_done.done():
            pause_reading(self.transport, True)  # until the session reads on
            self.late_done.set_result(outcome)

    def _late_timeout(self) -> None:
        if self.late is not None and self.late_done is not None and not self.late_done.done():
            self.late_done.set_result(self.late.timeout())

    async def _open_worker(
        self,
        pool: Pool,
        req: ClientRequest,
        sid: str,
        extra: Sequence[tuple[bytes, bytes]],
        prompt: Prompt | None,
    ) -> tuple[Backend, asyncio.Transport, UpstreamHandshake, str | None, bytes] | None:
        """The session's worker, connected and upgraded: the pool's choice (by ``prompt``
        when it has one), walking on past workers that fail or are busy; None: the client
        went meanwhile.

        Raises:
            WorkerRefused: the worker's own refusal, passed on as it sent it.
            HandshakeReject: 502 (no worker took it, or a bad answer), 503 (none ready).
        """
        st = self.state
        walk = Walk(pool, sid, st.loop.time, prompt, st.stats.late_bound)
        last_error = "no worker available"
        while (backend := walk.next()) is not None:
            try:
                transport, proto, response, trailing = await open_upstream(
                    st, backend, req, sid, self.secure, extra=extra
                )
            except UpstreamReject as exc:
                st.stats.handshake_failures[backend.id] += 1
                if exc.status is None or (exc.status >= 500 and exc.status != 503):
                    # A 503 is a worker saying it is busy or draining, not a broken one: the
                    # health probe takes it out; ejecting it would outlast its restart. A 4xx
                    # is its answer to this client (its own auth, a path it does not serve).
                    st.worker_failed(pool, backend)
                if exc.status in (502, 503, 504):
                    # Busy or going away (a worker draining itself): nothing was tunnelled, so
                    # walk on like a connect failure (HAProxy's retry-on 503).
                    last_error = f"worker {backend.id}: {exc}"
                    log.info("worker %s refused the upgrade: %s; trying the next", backend.id, exc)
                    continue
                relayed = exc.relayed()
                if relayed is not None:  # the worker's own refusal, passed on as it sent it
                    raise WorkerRefused(exc.status or 502, relayed, backend.id) from None
                log.warning("worker %s gave a bad answer to the upgrade: %s", backend.id, exc)
                raise HandshakeReject(502, "the worker gave a bad answer to the upgrade") from None
            except (OSError, TimeoutError) as exc:
                st.stats.connect_failures[backend.id] += 1
                st.worker_failed(pool, backend)
                last_error = f"worker {backend.id}: {exc or type(exc).__name__}"
                log.warning("connect to %s failed: %s", backend.id, last_error)
                continue
            if self.gone:
                transport.close()
                return None
            token = self.resume.token
            if pool.cfg.resume.enabled and token is not None:
                other = st.find_resumable(token)  # named meanwhile by another upgrade?
                if other is not None and not (other.sid == sid and ending(other)):
                    transport.close()
                    self._token_taken(pool)
            return backend, transport, proto, response, trailing
        tried = bool(walk.tried)
        if tried:
            log.warning("no worker took the upgrade for %s (%s)", req.path, last_error)
        # The client is told what happened, not which worker (ids are the operator's).
        raise HandshakeReject(
            502 if tried else 503, "no worker could take the session" if tried else last_error
        )

    def named(self, address: str) -> bool:
        """``router.Client``: a trusted proxy names the client; counted under that address,
        False when that puts it over the per-client limit (refused here)."""
        self._client_is(address)
        return not self._over_limit_once_named()

    def _resume_throttled(self, pool: Pool) -> bool:
        """Rule 8: True (refused here with 429) while this address has spent its failed
        resumes; the refusal is logged once per address and window, counted each time."""
        st = self.state
        now = st.loop.time()
        failures = st.resume_failures(pool)
        wait = failures.retry_after(self.peer, now)
        if wait <= 0:
            return False
        st.stats.resumes["throttled"] += 1
        logged = failures.first_refusal(self.peer, now)
        if logged:
            log.warning("too many failed resumes from %s: refused for a while", self.peer)
        rej = HandshakeReject(
            429,
            "too many failed resumes from this address; try again later",
            headers=[(b"retry-after", str(max(1, math.ceil(wait))).encode())],
            details={"resume": "throttled"},
        )
        self.reject(rej, logged=False)
        return True

    def _token_taken(self, pool: Pool) -> NoReturn:
        """A token is one session's, never shared: refused (409), counted as a failure."""
        self._resume_failed(pool, "taken")
        raise HandshakeReject(
            409,
            "this resume token belongs to another session: name a new one",
            details={"resume": "taken"},
        )

    def _resume_failed(self, pool: Pool, result: str) -> None:
        """A resume that failed: counted by ``result`` and taken from this address's bucket.
        Not a resume another instance carried here: that one counts its client's outcome."""
        if self.carried:
            return
        st = self.state
        st.stats.resumes[result] += 1
        st.resume_failures(pool).failed(self.peer, st.loop.time())

    def _resume(self, pool: Pool, s: Session, req: ClientRequest, key: str, resume: Resume) -> None:
        """Rule 8: the reconnect of a session's client (its token matched). A half-open old
        connection is taken over; the client gets a 101 with ``X-WSLB-Resumed: N``, what it
        missed from message N on, then the live stream. 409 when that cannot be done."""
        st = self.state
        core = s.core
        if not core.detached_at and s.client is Leg.OPEN and not s.closing:
            s.take_over()  # the old connection still looked open (a network change)
        if not core.detached_at:
            self._resume_failed(pool, "closed")
            raise HandshakeReject(
                409, "the session has ended; start a new one", details={"resume": "closed"}
            )
        n = resume.count if resume.count is not None else core.best_effort_count()
        assert self.transport is not None and resume.token is not None
        headers = accept_headers(req.key, s.subprotocol, key)
        headers += [(RESUMED_HEADER, str(n).encode()), (TOKEN_HEADER, resume.token.encode())]
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.session = s
        ct = self.transport
        try:
            missed = s.attach(ct, n, switching_protocols(headers))
        except ResumeRefused as exc:
            self.session = None
            self._resume_failed(pool, "refused")
            raise HandshakeReject(
                409,
                f"cannot resume: {exc.reason}",
                details={"resume": "refused", "reason": exc.why},
            ) from None
        s.peer = self.peer
        st.by_sid.setdefault(s.sid, s)  # its key's newest session may have ended meanwhile
        st.stats.resumes["resumed"] += 1
        st.stats.resume_pause.observe(st.loop.time() - self.opened)
        st.emit("resumed", session=s.sid, backend=s.backend.id, count=n, replayed_bytes=missed)
        log.info("session %s resumed from message %d (%d bytes replayed)", s.sid, n, missed)
        if self.reader.trailing:
            s.client_data(self.reader.trailing)

    def _from_peer(self, event: h11.Request, pool: Pool) -> None:
        """A resume another instance of the tier carried here (``aio/peers.py``): believed
        only with the tier's peer credential; counted under the client's address it names."""
        given = client = None
        for name, value in event.headers:
            if name == PEER_HEADER:
                given = bytes(value)
            elif name == PEER_CLIENT_HEADER:
                client = peer_address(bytes(value))
        # Most upgrades carry no peer header: the secret (an environment read) is not looked up.
        if given is None or not valid_peer(given, workerauth.tier_secret(pool.cfg)):
            return
        self.carried = True
        if client is not None:
            self._client_is(client)

    async def _elsewhere(
        self,
        event: h11.Request,
        pool: Pool,
        req: ClientRequest,
        key: str,
        sid: str,
        resume: Resume,
    ) -> bool:
        """A reconnect this instance holds nothing of: carried to the instance of the tier
        that holds the session, else reattached at a worker that parked it. True when done
        (the client has its answer)."""
        st = self.state
        secret = workerauth.tier_secret(pool.cfg)
        assert self.transport is not None
        if st.peers is not None and secret is not None:
            request = peer_request(event, secret, self.peer)
            t = st.timeouts
            ct = self.transport
            holder = await carry(
                st.loop, ct, request, st.peers(), st.carried, t.connect, t.handshake
            )
            if holder is not None:
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
                self.gone = True  # the splice has the connection now
                if self.counted:
                    self.counted = False
                    st.connection_closed(self.peer)
                st.stats.resumes["carried"] += 1
                log.info("session %s: resume carried to instance %s", sid, holder)
                return True
        return await self._reattach(pool, req, key, sid, resume)

    async def _reattach(
        self, pool: Pool, req: ClientRequest, key: str, sid: str, resume: Resume
    ) -> bool:
        """Reattach the session at a worker that parked it when its leg to another instance
        dropped (docs/protocol.md, "Parking"): the key's worker first, then the pool's others.
        Raises ``HandshakeReject`` (409 refused) when the worker holds it but not from that
        count."""
        st = self.state
        n, token = resume.count, resume.token
        assert n is not None and token is not None
        r = pool.cfg.resume
        extra = [
            (REATTACH_HEADER, sid.encode("latin-1")),
            (REATTACH_FROM_HEADER, str(n).encode()),
            (PARK_HEADER, park_value(n, r.grace, r.buffer, token)),
        ]
        first = pool.last_backend(sid)
        order = sorted(pool.backends.values(), key=lambda b: (b.id != first, b.id))
        for backend in order:
            try:
                transport, proto, subprotocol, trailing = await open_upstream(
                    st, backend, req, sid, self.secure, extra=extra, handoff=True
                )
            except UpstreamReject as exc:
                if exc.status == 409:
                    details = _json_object(exc.body)
                    if details.get("resume") == "refused":
                        self._resume_failed(pool, "refused")
                        reason = str(details.get("reason", "refused"))
                        raise HandshakeReject(
                            409,
                            f"cannot resume: {reason}",
                            details={"resume": "refused", "reason": reason},
                        ) from None
                continue
            except (OSError, TimeoutError):
                continue
            if self.gone:
                transport.close()
                return True
            self.token = token
            self._start_session(
                pool, backend, sid, req, transport, proto, subprotocol, trailing, key, resumed=n
            )
            st.stats.resumes["reattached"] += 1
            st.emit("resumed", session=sid, backend=backend.id, count=n, replayed_bytes=0)
            log.info("session %s reattached at worker %s from message %d", sid, backend.id, n)
            return True
        return False

    def _plain(self, event: h11.Request) -> None:
        """Serve this connection's plain HTTP (``aio/httpproxy.py``) from this request on."""
        assert self.transport is not None
        if self.timer is not None:  # the first head is in: timeout_request and the rest
            self.timer.cancel()
            self.timer = None
        self.http = HttpClient(
            self.state, self, self.transport, self.reader.connection, self.secure
        )
        self.http.start(event)

    def fresh_connection(self) -> h11.Connection:
        """A new h11 connection for plain HTTP and a later upgrade alike (``reader.renew``)."""
        return self.reader.renew()

    def upgrade(self, event: h11.Request) -> None:
        """A handshake after plain requests on this connection: the upgrade path takes it."""
        self.http = None
        self.method = event.method.decode("latin-1", "replace")
        self.target = event.target.decode("latin-1", "replace").partition("?")[0][:200]
        self.task = self.state.loop.create_task(self._upgrade(event))

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
        client_key: str,
        resumed: int | None = None,
        client_bytes: bytes | None = None,
    ) -> None:
        """Hand both legs to a new ``Session``: the client's 101 (unless late binding sent it
        already), then what each side sent meanwhile (``client_bytes``: the client's after its
        request, by default what the request reader kept)."""
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        ctransport = self.transport
        state = self.state
        session = Session(
            state,
            state.settings(pool),
            pool,
            backend,
            sid,
            self.peer,
            ctransport,
            wtransport,
            req,
            self.secure,
        )
        self.session = session
        session.timing = (proto.connect_s, proto.answer_s)
        session.subprotocol = subprotocol
        headers = accept_headers(req.key, subprotocol, client_key)
        session.parks = proto.parks
        if pool.cfg.resume.enabled and self.token is not None:  # Rule 8
            session.resume_token = self.token
            if resumed is not None:  # reattached at a worker that parked the session
                assert session.core.window is not None
                session.core.window.base_msg = resumed
                headers.append((RESUMED_HEADER, str(resumed).encode()))
            headers.append((TOKEN_HEADER, self.token.encode()))
        if not self.answered:
            ctransport.write(switching_protocols(headers))
            state.stats.handshake_duration.observe(state.loop.time() - self.opened)
        ctransport.set_protocol(ClientLeg(session))
        wtransport.set_protocol(session)
        client_trailing = self.reader.trailing if client_bytes is None else client_bytes
        worker_trailing += bytes(proto.extra)
        if worker_trailing:
            session.data_received(worker_trailing)
        if client_trailing:
            session.client_data(client_trailing)
        if proto.eof:
            session.connection_lost(None)
        pause_reading(ctransport, False)
        pause_reading(wtransport, False)


def _json_object(body: bytes) -> dict[str, Any]:
    """A worker's JSON answer as a dict ({} when it is not one)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


async def open_upstream(
    state: ServerState,
    backend: Backend,
    req: ClientRequest,
    sid: str,
    secure: bool,
    resume: bool = False,
    extra: Sequence[tuple[bytes, bytes]] = (),
    handoff: bool | None = None,
) -> tuple[asyncio.Transport, UpstreamHandshake, str | None, bytes]:
    """Connect to a worker and complete wslb's own upgrade there.

    ``extra``: wslb's own headers (``upstream_request``); ``handoff``: show the worker the
    handoff secret (default: on a ``resume`` upgrade), as a reattach must. The handshake
    protocol says whether the worker parks the leg (``UpstreamHandshake.parks``).

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
        worker_token=state.worker_token(backend, handoff=resume if handoff is None else handoff),
        extra=extra,
    )
    timeouts = state.timeouts
    # perf_counter, not loop.time(): uvloop's clock is cached per loop turn in milliseconds,
    # so a loopback 101 arriving within one turn measured 0.0 ms.
    dialled = time.perf_counter()
    transport, proto = await asyncio.wait_for(
        state.loop.create_connection(
            lambda: UpstreamHandshake(request),
            up.host,
            up.port,
            ssl=state.upstream_ssl(backend),
            ssl_handshake_timeout=timeouts.connect if up.secure else None,
        ),
        timeouts.connect,
    )
    connected = proto.sent_at or time.perf_counter()
    proto.connect_s = connected - dialled
    state.stats.upstream_connect.observe(backend.id, proto.connect_s)
    try:
        response, trailing = await asyncio.wait_for(proto.done, timeouts.handshake)
        proto.answer_s = (proto.answered_at or time.perf_counter()) - connected
        if response.status_code != 101:  # a refusal: ``trailing`` holds its body
            check_upstream_response(response, nonce, req.subprotocols, trailing)
        subprotocol = check_upstream_response(response, nonce, req.subprotocols)
        proto.parks = any(n == PARK_HEADER and v.strip() == b"ok" for n, v in response.headers)
    except BaseException:
        transport.abort()
        raise
    return transport, proto, subprotocol, trailing


class UpstreamHandshake(asyncio.Protocol):
    """The worker leg while wslb's upgrade request is answered."""

    def __init__(self, request: h11.Request) -> None:
        self.request = request
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self.done: asyncio.Future[tuple[h11.InformationalResponse | h11.Response, bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self.eof = False
        self.parks = False  # the worker's 101 said ``X-WSLB-Park: ok`` (it parks this leg)
        self.extra = bytearray()  # bytes that arrive after the 101, before the switch-over
        self.transport: asyncio.Transport | None = None
        # A refusal (a final answer other than 101) and its body, read up to the limit, so
        # the client hears the worker's own answer (``UpstreamReject.relayed``).
        self.refusal: h11.Response | None = None
        self.body = bytearray()
        # Seconds: the TCP (and TLS) connect, then the worker's answer (the access log).
        self.connect_s = 0.0
        self.answer_s = 0.0
        # When the request went and the answer came, taken in the callbacks themselves: the
        # awaits resume a loop turn later, and on a busy loop the 101 is often in by then.
        self.sent_at = 0.0
        self.answered_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.sent_at = time.perf_counter()
        self.transport.write(self.h11.send(self.request) or b"")

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.extra += data
            return
        self.answered_at = time.perf_counter()
        try:
            self.h11.receive_data(data)
            while not self.done.done():
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                self._event(event)
        except h11.RemoteProtocolError as exc:
            if self.refusal is not None:  # a refusal with a broken body: what came of it
                self._refused()
            else:
                self.done.set_exception(UpstreamReject(f"malformed response: {exc}"))

    def _event(self, event: object) -> None:
        if isinstance(event, h11.InformationalResponse):
            if event.status_code == 101:
                pause_reading(self.transport, True)  # the session resumes it once wired
                self.done.set_result((event, self.h11.trailing_data[0]))
            # other 1xx: keep waiting for the final answer
            elif event.status_code != 100:
                self.done.set_result((event, b""))
        elif isinstance(event, h11.Response):
            self.refusal = event
        elif isinstance(event, h11.Data):
            room = WORKER_BODY_LIMIT - len(self.body)
            self.body += bytes(event.data)[: max(0, room)]
            if len(self.body) >= WORKER_BODY_LIMIT:
                self._refused()
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            self._refused()

    def _refused(self) -> None:
        if self.refusal is not None and not self.done.done():
            self.done.set_result((self.refusal, bytes(self.body)))

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.refusal is not None:  # a body that ends with the connection
            self._refused()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._refused()
        if not self.done.done():
            self.done.set_exception(ConnectionResetError("worker closed during the handshake"))
