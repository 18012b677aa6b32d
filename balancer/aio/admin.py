"""Admin HTTP listener (aiohttp): health, readiness, metrics, views and operator actions.

Safe by default, because loopback is reachable from every web page the operator has open:

- Everything but ``/healthz`` and ``/readyz`` requires ``Authorization: Bearer TOKEN``, compared
  in constant time. With no token configured one is generated at start (``admintoken.py``).
- A request whose ``Origin`` is not the listener's own (a page of another site) gets 403.
- On a loopback listener, a ``Host`` that is a DNS name other than ``localhost`` gets 403: a
  rebinding attack reaches 127.0.0.1 under the attacker's own name.
- POST needs ``Content-Type: application/json`` (415): the requests a page may send to another
  origin without a CORS preflight cannot carry it, and wslb answers no preflight.

A serving process of ``workers: N`` listens on a Unix socket in a private directory for its
supervisor only, and has none of these checks. Errors are JSON ``{"error": ...}``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import psutil
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from balancer import admintoken, frames
from balancer.aio.cluster import EtcdError
from balancer.aio.migrate import migrate
from balancer.aio.openapi import OPENAPI
from balancer.config import BackendCfg, ConfigError, parse_backend, parse_duration
from balancer.metrics import BackendView, BalancerCollector
from balancer.pool import DRAINED, Backend, Pool

if TYPE_CHECKING:
    from balancer.aio.app import Balancer

__all__ = ["Admin"]

log = logging.getLogger("wslb.admin")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN = frozenset({"/healthz", "/readyz"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _is_loopback(host: str) -> bool:
    """``host`` (an address to listen on) reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Admin:
    """The admin listener of one balancer process."""

    def __init__(self, app: Balancer) -> None:
        self.app = app
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            BalancerCollector(
                app.stats, lambda: list(app.sessions), app.backend_views, lambda: app.connections
            )
        )
        self._runner: web.AppRunner | None = None
        if app.cluster is not None:
            self.registry.register(app.cluster.collector())
        # WSLB_ADMIN_TOKEN is the admin token when the config names none; with neither, start()
        # generates one (module docstring).
        token = app.config.admin.token or os.environ.get("WSLB_ADMIN_TOKEN") or None
        self._token = f"Bearer {token}".encode() if token else None
        self._generated: str | None = None  # the token start() made, removed at stop()
        self._guarded = True  # Origin, Host and Content-Type checks (off on a Unix socket)
        self._check_host = _is_loopback(app.config.admin.host)

    def make_app(self) -> web.Application:
        web_app = web.Application(middlewares=[self._guard, self._auth, self._errors])
        r = web_app.router
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
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/debug/stats", self.debug_stats)
        return web_app

    async def start(self) -> None:
        cfg = self.app.config.admin
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        link = self.app.link
        if link is not None:
            # A serving process of workers: N answers its supervisor only, on a Unix socket in
            # the supervisor's private (0700) run directory; the token guards the public API.
            self._token = None
            self._guarded = False
            await web.UnixSite(self._runner, link.admin_socket).start()
            return
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        # Bound before the token file is written (the file names an API that is there), and the
        # file written before requests are served (a client that gets an answer finds it).
        sock = socket.create_server((cfg.host, cfg.port), family=family, backlog=128)
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
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._generated is not None:
            admintoken.remove(self.app.config.admin.port, self._generated)
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
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason)
        except EtcdError as exc:  # cluster mode: a write could not reach the store
            return _error(503, f"cluster store unreachable: {exc}")

    # -- handlers --------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.app.closing:
            return web.json_response({"status": "shutting down"}, status=503)
        if self.app.cluster is not None:
            # 200 either way: routing goes on with the last known state, and a store blip must
            # not pull every replica out of its Service at once.
            cluster = self.app.cluster.status()
            body = {"status": "ready", "degraded": not cluster["connected"], "cluster": cluster}
            return web.json_response(body)
        return web.json_response({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _backend_json(self, v: BackendView) -> dict[str, Any]:
        found = self.app.find_backend(v.id)
        out: dict[str, Any] = {
            "id": v.id,
            "pool": v.pool,
            "url": found[1].url if found is not None else None,
            "state": v.state,
            "healthy": v.healthy,
            "health": {
                "ok": v.healthy,
                "reason": v.health_reason,
                "since": v.health_since,
                "last_check": v.last_check,
            },
            "weight": v.weight,
            "effective_weight": round(v.effective_weight, 4),
            "sessions": v.sessions,
            "held": v.held,
            "sessions_total": v.sessions_total,
            "signals": v.signals,
            "signals_age": None if v.scrape_age is None else round(v.scrape_age, 3),
            "signals_stale": v.stale,
            "ejected_for": round(v.ejected_for, 3),
            "ejections": v.ejections,
            "drain": self.app.drainer.view(found[1]) if found is not None else None,
            "sessions_remote": found[1].remote_sessions if found is not None else 0,
        }
        if self.app.cluster is not None:
            out["cluster"] = self.app.cluster.backend_view(v.id)
        return out

    async def backends(self, request: web.Request) -> web.Response:
        return web.json_response([self._backend_json(v) for v in self.app.backend_views()])

    async def backend(self, request: web.Request) -> web.Response:
        bid = request.match_info["id"]
        for v in self.app.backend_views():
            if v.id == bid:
                return web.json_response(self._backend_json(v))
        return _error(404, f"no backend {bid!r}")

    async def sessions(self, request: web.Request) -> web.Response:
        backend = request.query.get("backend")
        out = [
            s.describe() for s in self.app.sessions if backend is None or s.backend.id == backend
        ]
        return web.json_response(out)

    async def session(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        for s in self.app.sessions:
            if s.sid == sid:
                return web.json_response(s.describe())
        return _error(404, f"no live session {sid!r}")

    # -- write side ------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(reason="body is not JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(reason="body must be a JSON object")
        return body

    def _find(self, request: web.Request) -> tuple[Pool, Backend]:
        found = self.app.find_backend(request.match_info["id"])
        if found is None:
            raise web.HTTPNotFound(reason=f"no backend {request.match_info['id']!r}")
        return found

    def _new_backend(self, body: dict[str, Any]) -> tuple[Pool, BackendCfg]:
        """The pool (``pool`` in the body, else the first) and config of a backend to add."""
        pool_name = body.pop("pool", None)
        pool = self.app.pools[0] if pool_name is None else self.app.pool(str(pool_name))
        if pool is None:
            raise web.HTTPNotFound(reason=f"no pool {pool_name!r}")
        try:
            return pool, parse_backend(body)
        except ConfigError as exc:
            raise web.HTTPBadRequest(reason="; ".join(exc.errors)) from None

    async def add_backend(self, request: web.Request) -> web.Response:
        pool, cfg = self._new_backend(await self._body(request))
        if self.app.cluster is not None:
            return await self._cluster_add(pool, cfg)
        if self.app.find_backend(cfg.id) is not None:
            return _error(409, f"backend {cfg.id!r} exists")
        b = self.app.add_backend(pool, cfg)
        return web.json_response({"id": b.id, "pool": pool.name, "state": b.state}, status=201)

    async def _cluster_add(self, pool: Pool, cfg: BackendCfg) -> web.Response:
        """Cluster mode: write the backend to etcd; the watch adds it everywhere."""
        assert self.app.cluster is not None
        if cfg.spawn is not None:
            return _error(400, "spawn: not shared in cluster mode (every instance would start it)")
        if not await self.app.cluster.add_backend(pool, cfg):
            return _error(409, f"backend {cfg.id!r} exists")
        found = self.app.find_backend(cfg.id)
        state = found[1].state if found is not None else "pending"
        return web.json_response({"id": cfg.id, "pool": pool.name, "state": state}, status=201)

    async def delete_backend(self, request: web.Request) -> web.Response:
        pool, b = self._find(request)
        if self.app.cluster is not None:  # drained on every instance, then gone everywhere
            why = await self.app.cluster.remove_backend(b.id)
            if why is not None:
                return _error(409, why)
            return web.json_response({"id": b.id, "removed": True})
        if b.admin_state != DRAINED or b.load:
            return _error(409, f"backend {b.id!r} is {b.state}; drain it first")
        await self.app.remove_backend(pool, b)
        return web.json_response({"id": b.id, "removed": True})

    async def drain(self, request: web.Request) -> web.Response:
        pool, b = self._find(request)
        body = await self._body(request)
        migrate = body.get("migrate", pool.cfg.drain.migrate)
        if not isinstance(migrate, bool):
            return _error(400, "migrate must be true or false")
        try:
            timeout = parse_duration(body.get("timeout", pool.cfg.drain.timeout))
        except (ValueError, TypeError) as exc:
            return _error(400, f"timeout: {exc}")
        if self.app.cluster is not None:  # written to etcd; every instance drains its sessions
            written = await self.app.cluster.set_state(b, "draining", migrate, timeout)
            view = self._backend_json(self._view(b.id))
            return web.json_response(view, status=202 if written else 200)
        if b.admin_state == DRAINED:  # nothing to do: drains are idempotent
            return web.json_response(self._backend_json(self._view(b.id)))
        self.app.self_drained.discard(b.id)  # an operator's drain is not undone by probes
        self.app.drainer.start(pool, b, migrate, timeout)
        return web.json_response(self._backend_json(self._view(b.id)), status=202)

    async def undrain(self, request: web.Request) -> web.Response:
        _, b = self._find(request)
        if self.app.cluster is not None:
            await self.app.cluster.set_state(b, "active", True, 0.0)
        else:
            await self.app.drainer.undrain(b)
        return web.json_response(self._backend_json(self._view(b.id)))

    def _view(self, bid: str) -> BackendView:
        return next(v for v in self.app.backend_views() if v.id == bid)

    async def migrate(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        body = await self._body(request)
        to = body.get("to")
        if to is not None and not isinstance(to, str):
            return _error(400, "to must be a backend id")
        session = self.app.find_session(sid)
        if session is None:
            return _error(404, f"no live session {sid!r}")
        result = await migrate(self.app, session, to)
        out = {
            "session": sid,
            "migrated": result.ok,
            "result": result.reason,
            "backend": session.backend.id,
            "pause_ms": None if result.pause is None else round(result.pause * 1e3, 2),
        }
        return web.json_response(out, status=200 if result.ok else 409)

    async def reload(self, request: web.Request) -> web.Response:
        try:
            report = await self.app.reload()
        except ConfigError as exc:
            return _error(400, "; ".join(exc.errors))
        return web.json_response(report)

    async def debug_stats(self, request: web.Request) -> web.Response:
        """Process figures for soak tests: tasks, sessions, connections, RSS, open FDs, and
        which frame-scanner loop runs (``c``, or ``python`` where ``balancer._scan`` was not
        built)."""
        proc = psutil.Process()
        return web.json_response(
            {
                "tasks": len(asyncio.all_tasks()),
                "sessions": len(self.app.sessions),
                "connections": self.app.connections,
                "rss": proc.memory_info().rss,
                "fds": proc.num_fds(),
                "scanner": "c" if frames.ACCELERATED else "python",
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)
