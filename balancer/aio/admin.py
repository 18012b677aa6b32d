"""Admin HTTP listener (aiohttp): health, readiness, metrics, and read-only views.

Everything but ``/healthz`` and ``/readyz`` requires ``Authorization: Bearer TOKEN`` when a token
is configured, compared in constant time. Errors are JSON ``{"error": ...}``. The write side
(drain, migrate, reload) is added by the drain work (SPEC section 7).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from balancer.metrics import BackendView, BalancerCollector

if TYPE_CHECKING:
    from balancer.aio.app import Balancer

__all__ = ["Admin"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN = frozenset({"/healthz", "/readyz"})


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
        token = app.config.admin.token
        self._token = f"Bearer {token}".encode() if token else None

    def make_app(self) -> web.Application:
        web_app = web.Application(middlewares=[self._auth, self._errors])
        r = web_app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/backends", self.backends)
        r.add_get("/backends/{id}", self.backend)
        r.add_get("/sessions", self.sessions)
        r.add_get("/sessions/{sid}", self.session)
        return web_app

    async def start(self) -> None:
        cfg = self.app.config.admin
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.host, cfg.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middleware ------------------------------------------------------------------------

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

    # -- handlers --------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.app.closing:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _backend_json(self, v: BackendView) -> dict[str, Any]:
        found = self.app.find_backend(v.id)
        return {
            "id": v.id,
            "pool": v.pool,
            "url": found[1].url if found is not None else None,
            "state": v.state,
            "healthy": v.healthy,
            "weight": v.weight,
            "effective_weight": round(v.effective_weight, 4),
            "sessions": v.sessions,
            "sessions_total": v.sessions_total,
            "signals": v.signals,
            "signals_age": None if v.scrape_age is None else round(v.scrape_age, 3),
            "signals_stale": v.stale,
            "ejected_for": round(v.ejected_for, 3),
            "ejections": v.ejections,
        }

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
