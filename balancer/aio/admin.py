"""Admin HTTP listener (aiohttp): routes, each one ``Control`` call (``control.py``).

Safe by default, because loopback is reachable from every web page the operator has open:

- Everything but ``/healthz``, ``/readyz`` and the dashboard's static files (``/ui``, which
  hold no data) requires ``Authorization: Bearer TOKEN``, compared in constant time. With no
  token configured one is generated at start (``admintoken.py``).
- A request whose ``Origin`` is not the listener's own (a page of another site) gets 403.
- On a loopback listener, a ``Host`` that is a DNS name other than ``localhost`` gets 403: a
  rebinding attack reaches 127.0.0.1 under the attacker's own name.
- POST needs ``Content-Type: application/json`` (415): the requests a page may send to another
  origin without a CORS preflight cannot carry it, and wslb answers no preflight.

A serving process of ``workers: N`` listens on a Unix socket in a private directory for its
supervisor only, and has none of these checks.

``metrics.listen`` adds a listener that serves ``GET /metrics`` alone, without the token (what
Prometheus expects of an exporter; the metrics name backends, never a secret), still refusing
other origins and, on loopback, rebinding names. Errors are JSON ``{"error": ...}``: a
``ControlError``'s status and message, 400 for a body that is not a JSON object.

Slow heads: aiohttp waits for a request head as long as its client trickles it, so a few
hundred connections sending a byte a second would hold the admin API's sockets for good. On
both TCP listeners a connection's first head must arrive within ``timeouts.handshake``
(``_HeadDeadline``), and every later one within as long of the answer before it (aiohttp's
keep-alive timeout, which closes a connection still waiting for a whole head).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from balancer import admintoken
from balancer.aio import ui
from balancer.aio.control import Control, ControlError, Reply
from balancer.aio.openapi import OPENAPI
from balancer.aio.spawn import KEEPER_PID_ENV
from balancer.config import Admin as AdminCfg
from balancer.config import Listener, ListenError, is_loopback
from balancer.version import started_iso, version

__all__ = ["Admin"]

log = logging.getLogger("wslb.admin")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN = frozenset({"/healthz", "/readyz", *ui.PATHS})  # the page holds no data (ui.py)
MAX_WAIT = 30  # seconds a long poll of GET /events may wait
KEEPALIVE = 15.0  # seconds between comments on a quiet event stream
BACKLOG = 100  # events a new reader of the stream gets first
STREAM_POLL = 1.0  # seconds an event stream waits before it looks at its reader again
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def rebinding_safe(host_header: str | None) -> bool:
    """A ``Host`` a browser sends only for a page of this machine: an IP literal (DNS
    rebinding needs a name), ``localhost`` or a ``.localhost`` name (RFC 6761), any port."""
    if not host_header:
        return True  # no browser omits it; a script that does is not a page
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _int_arg(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ControlError(400, f"{name} must be a non-negative integer")
    return int(raw)


class _HeadDeadline(asyncio.Protocol):
    """aiohttp's handler of one connection, closed if its first request head is not whole
    within ``timeout`` (module docstring). Everything else is the handler's."""

    def __init__(self, inner: asyncio.Protocol, timeout: float) -> None:
        self.inner = inner
        self.timeout = timeout
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes seen, for a blank line across two reads
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.timer = asyncio.get_running_loop().call_later(self.timeout, self._expired)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen:
                self.timer.cancel()
                self.timer = None
                self.tail = b""
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _expired(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        log.info(
            "admin connection from %s: no whole request head in %gs (timeouts.handshake)",
            peer[0] if isinstance(peer, tuple) else peer,
            self.timeout,
        )
        transport.abort()  # nothing is owed to it


class _Site(web.SockSite):
    """``web.SockSite`` whose connections get ``_HeadDeadline``."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, head_timeout: float) -> None:
        super().__init__(runner, sock)
        self.head_timeout = head_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        timeout = self.head_timeout
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _HeadDeadline(server(), timeout), sock=self._sock, backlog=self._backlog
        )


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Admin:
    """The admin listener of one balancer process: HTTP in front of its ``Control``."""

    def __init__(
        self,
        control: Control,
        cfg: AdminCfg,
        unix_socket: str | None = None,
        metrics: Listener | None = None,
        head_timeout: float = 10.0,
    ) -> None:
        """``unix_socket``: a serving process of ``workers: N`` (no token, no browser checks).
        Else ``cfg``'s TCP address; ``admin.token``, ``WSLB_ADMIN_TOKEN``, or one generated.
        ``metrics``: the address of the token-less ``GET /metrics`` (``metrics.listen``).
        ``head_timeout``: ``timeouts.handshake``, for a request head (module docstring)."""
        self.control = control
        self.cfg = cfg
        self.unix_socket = unix_socket
        self.metrics_listen = metrics if unix_socket is None else None
        self.head_timeout = head_timeout
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()  # GET /events/stream handlers
        token = cfg.token or os.environ.get("WSLB_ADMIN_TOKEN") or None
        self._token = f"Bearer {token}".encode() if token and unix_socket is None else None
        self._generated: str | None = None  # the token start() made, removed at stop()
        # A restart's listeners: the admin and metrics sockets the old code listened on.
        self._adopted: tuple[socket.socket | None, socket.socket | None] | None = None
        self._sock: socket.socket | None = None
        self._metrics_sock: socket.socket | None = None
        self._spare: list[tuple[web.AppRunner, socket.socket]] = []  # stop_listening(keep=True)
        self._guarded = unix_socket is None  # Origin, Host and Content-Type checks
        self._check_host = is_loopback(cfg.host)

    def make_app(self) -> web.Application:
        web_app = web.Application(middlewares=[self._guard, self._auth, self._errors])
        r = web_app.router
        r.add_get("/version", self.version)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/backends", self.backends)
        r.add_get("/backends/{id}", self.backend)
        r.add_get("/sessions", self.sessions)
        r.add_get("/sessions/{sid}", self.session)
        r.add_post("/backends", self.add_backend)
        r.add_delete("/backends/{id}", self.delete_backend)
        r.add_post("/backends/{id}/drain", self.drain)
        r.add_post("/backends/{id}/undrain", self.undrain)
        r.add_post("/sessions/{sid}/migrate", self.migrate)
        r.add_post("/reload", self.reload)
        r.add_post("/restart", self.restart)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/debug/stats", self.debug_stats)
        r.add_get("/events", self.events)
        r.add_get("/events/stream", self.event_stream)
        ui.add_routes(r)
        return web_app

    async def start(self) -> None:
        cfg = self.cfg
        self._runner = self._runner_of(self.make_app())
        await self._runner.setup()
        if self.unix_socket is not None:
            # Answers its supervisor only, in the supervisor's private (0700) run directory.
            await web.UnixSite(self._runner, self.unix_socket).start()
            return
        # Bound before the token file is written (the file names an API that is there), and the
        # file written before requests are served (a client that gets an answer finds it).
        sock = self._sock = self._listening(0, cfg.host, cfg.port)
        if self._token is None:
            token, path = admintoken.generate(cfg.port)
            self._generated = token
            self._token = f"Bearer {token}".encode()
            log.warning(
                "admin API on %s:%d: no admin.token configured; generated one in %s "
                "(wslb ctl reads it from there; set WSLB_ADMIN_TOKEN to choose one)",
                cfg.host,
                cfg.port,
                path,
            )
        await _Site(self._runner, sock, self.head_timeout).start()
        if self.metrics_listen is not None:
            await self._start_metrics(self.metrics_listen)

    async def _start_metrics(self, at: Listener) -> None:
        """The ``metrics.listen`` listener: ``GET /metrics`` and nothing else."""
        app = web.Application(middlewares=[self._metrics_guard, self._errors])
        app.router.add_get("/metrics", self.metrics)
        self._metrics_runner = self._runner_of(app)
        await self._metrics_runner.setup()
        sock = self._metrics_sock = self._listening(1, at.host, at.port)
        await _Site(self._metrics_runner, sock, self.head_timeout).start()

    def _runner_of(self, app: web.Application) -> web.AppRunner:
        """A runner whose kept-alive connections wait ``head_timeout`` for a next head (on
        TCP; the supervisor's Unix socket keeps aiohttp's wait)."""
        if self.unix_socket is not None:
            return web.AppRunner(app, access_log=None, handle_signals=False)
        return web.AppRunner(
            app, access_log=None, handle_signals=False, keepalive_timeout=self.head_timeout
        )

    def _listening(self, which: int, host: str, port: int) -> socket.socket:
        """The old code's socket a restart passed (``which``: 0 admin, 1 metrics), else one
        bound now."""
        adopted = None if self._adopted is None else self._adopted[which]
        if adopted is not None:
            return adopted
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            return socket.create_server((host, port), family=family, backlog=128)
        except OSError as err:
            key = "metrics.listen" if which else "admin.listen"
            default = not which and self.cfg.listen_default
            raise ListenError(key, str(Listener(host, port)), err, default) from None

    # -- a hot restart ---------------------------------------------------------------------

    def adopt(
        self,
        sock: socket.socket | None,
        metrics: socket.socket | None,
        token: str | None,
        generated: bool,
    ) -> None:
        """Before ``start``: listen on the old code's sockets, with its token."""
        self._adopted = (sock, metrics)
        if token is not None and self.unix_socket is None:
            self._token = f"Bearer {token}".encode()
            if generated:
                self._generated = token  # its file is this process's to remove now

    def handed(self) -> tuple[socket.socket | None, socket.socket | None, str | None, bool]:
        """The listening sockets and the token a restart hands on; from here on the token
        file is the new code's (not removed at this process's stop)."""
        token = self._token.decode()[len("Bearer ") :] if self._token is not None else None
        generated = self._generated is not None
        return self._sock, self._metrics_sock, token, generated

    def release_token(self) -> None:
        self._generated = None

    async def stop_listening(self, keep: bool = False) -> None:
        """A restart handed the listeners on: accept nothing more here (requests being
        answered still are). ``keep``: the new code may yet fail; keep a copy of each TCP
        socket to ``listen_again`` on. A Unix socket stays: the new code binds its path anew,
        which sends new connects there, and the old one answers its supervisor if that fails."""
        if keep and self.unix_socket is not None:
            return
        if keep:
            for runner, sock in (
                (self._runner, self._sock),
                (self._metrics_runner, self._metrics_sock),
            ):
                if runner is not None and sock is not None:
                    self._spare.append((runner, socket.socket(fileno=os.dup(sock.fileno()))))
        for runner in (self._runner, self._metrics_runner):
            if runner is not None:
                for site in list(runner.sites):
                    await site.stop()

    async def listen_again(self) -> None:
        """The restart failed after the new code took the listeners: answer here again."""
        spare, self._spare = self._spare, []
        for runner, sock in spare:
            if runner is self._runner:
                self._sock = sock
            else:
                self._metrics_sock = sock
            await _Site(runner, sock, self.head_timeout).start()

    async def stop(self) -> None:
        for task in list(self._streams):
            task.cancel()  # a stream never ends by itself
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._generated is not None:
            admintoken.remove(self.cfg.port, self._generated)
            self._generated = None

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Refuse what a web page of another origin could send (module docstring)."""
        if not self._guarded:
            return await handler(request)
        host = request.headers.get("Host")
        if self._check_host and not rebinding_safe(host):
            return _error(403, f"Host {host!r} is not this machine's (DNS rebinding?)")
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() != f"http://{host or ''}".lower():
            return _error(403, f"cross-origin request from {origin!r} refused")
        if request.method in _BODY_METHODS and request.content_type != "application/json":
            return _error(415, "Content-Type must be application/json")
        return await handler(request)

    @web.middleware
    async def _metrics_guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """No token there, so no page of another site may read it (the admin guard's rules)."""
        host = request.headers.get("Host")
        at = self.metrics_listen
        if at is not None and is_loopback(at.host) and not rebinding_safe(host):
            return _error(403, f"Host {host!r} is not this machine's (DNS rebinding?)")
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() != f"http://{host or ''}".lower():
            return _error(403, f"cross-origin request from {origin!r} refused")
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if self._token is not None and request.path not in _OPEN:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._token):
                return _error(401, "missing or wrong bearer token")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ControlError as exc:
            return _error(exc.status, exc.message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason)

    # -- routes ----------------------------------------------------------------------------

    @staticmethod
    def _reply(reply: Reply) -> web.Response:
        return web.json_response(reply.body, status=reply.status)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError:
            raise ControlError(400, "body is not JSON") from None
        except RecursionError:  # json's C parser recurses per nesting level
            raise ControlError(400, "body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ControlError(400, "body must be a JSON object")
        return body

    async def version(self, request: web.Request) -> web.Response:
        """What code serves: its version, when it was loaded (ISO 8601, UTC) and the pid."""
        keeper = os.environ.get(KEEPER_PID_ENV)
        return web.json_response(
            {
                "version": version(),
                "started": started_iso(),
                "pid": os.getpid(),
                # After a hot restart: the pid a supervisor tracks (the keeper), else null.
                "keeper": int(keeper) if keeper and keeper.isdigit() else None,
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        return self._reply(await self.control.ready())

    async def metrics(self, request: web.Request) -> web.Response:
        body = await self.control.metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def backends(self, request: web.Request) -> web.Response:
        return web.json_response(await self.control.backends())

    async def backend(self, request: web.Request) -> web.Response:
        return web.json_response(await self.control.backend(request.match_info["id"]))

    async def sessions(self, request: web.Request) -> web.Response:
        return web.json_response(await self.control.sessions(request.query.get("backend")))

    async def session(self, request: web.Request) -> web.Response:
        return web.json_response(await self.control.session(request.match_info["sid"]))

    async def add_backend(self, request: web.Request) -> web.Response:
        return self._reply(await self.control.add_backend(await self._body(request)))

    async def delete_backend(self, request: web.Request) -> web.Response:
        return self._reply(await self.control.remove_backend(request.match_info["id"]))

    async def drain(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return self._reply(await self.control.drain(request.match_info["id"], body))

    async def undrain(self, request: web.Request) -> web.Response:
        return self._reply(await self.control.undrain(request.match_info["id"]))

    async def migrate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return self._reply(await self.control.migrate(request.match_info["sid"], body))

    async def reload(self, request: web.Request) -> web.Response:
        return self._reply(await self.control.reload())

    async def restart(self, request: web.Request) -> web.Response:
        """The new code takes over (``aio/restart.py``); answered when it has."""
        body = await self._body(request) if self.unix_socket is not None else None
        return self._reply(await self.control.restart(body))

    async def debug_stats(self, request: web.Request) -> web.Response:
        return web.json_response(await self.control.debug_stats())

    async def events(self, request: web.Request) -> web.Response:
        """``?since=N&wait=S``: the events after N, waiting up to S seconds (at most 30) for
        one: a long poll (the supervisor of ``workers: N`` follows its serving processes so)."""
        since, wait = _int_arg(request, "since", 0), float(_int_arg(request, "wait", 0))
        events, last = await self.control.events(since, min(wait, MAX_WAIT))
        return web.json_response({"events": events, "last": last})

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the recent backlog (or what followed ``Last-Event-ID``), then
        each event as it happens; a comment every ``KEEPALIVE`` s keeps proxies from closing
        a quiet stream. A browser reads it with ``fetch`` (``EventSource`` cannot send the
        token, and a token never goes in a URL)."""
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        since = _int_arg(request, "since", 0)
        last_id = request.headers.get("Last-Event-ID", "")
        _, last = await self.control.events(0, 0)
        if last_id.isdigit() and int(last_id) <= last:
            since = int(last_id)
        elif since == 0 or since > last:  # a new reader (or one from before a restart)
            since = max(0, last - BACKLOG)
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        try:
            # Short waits, so a reader that left is noticed within a second (aiohttp does not
            # cancel a handler whose client went away) and shutdown need not wait for it.
            while request.transport is not None and not request.transport.is_closing():
                events, last = await self.control.events(since, STREAM_POLL)
                if not events and loop.time() - quiet_since >= KEEPALIVE:
                    await resp.write(b": keepalive\n\n")
                    quiet_since = loop.time()
                for e in events:
                    data = json.dumps(e, separators=(",", ":"))
                    await resp.write(
                        f"id: {e['seq']}\nevent: {e['kind']}\ndata: {data}\n\n".encode()
                    )
                    quiet_since = loop.time()
                since = last
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass  # the reader left, or wslb stops
        finally:
            if task is not None:
                self._streams.discard(task)
        return resp

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)
