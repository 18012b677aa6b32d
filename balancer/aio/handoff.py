"""wslb's one client of the handoff API (docs/protocol.md): freeze, thaw, resumed upgrade, and a
reserved place on the target. Migration (``migrate.py``) and failover (``failover.py``) are two
state machines over these steps; neither speaks HTTP itself.

Connections: each worker gets its own small pool (``CONNS_PER_WORKER``, the most handoffs a
drain or a failover runs at once, so a queued freeze never stretches a client's pause), and a
worker that fails a step at the network level has its pool dropped at once: its connections
are closed, not left ESTABLISHED to a dead process until the kernel notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from balancer import workerauth
from balancer.aio.proxy import open_upstream
from balancer.aio.session import Session, Upgraded
from balancer.aio.state import ServerState
from balancer.handshake import UpstreamReject, quote_key
from balancer.pool import Backend
from balancer.resume import PARK_HEADER, park_value

__all__ = [
    "CONNS_PER_WORKER",
    "Frozen",
    "HandoffClient",
    "HandoffError",
    "handoff_url",
    "wait_until",
]

log = logging.getLogger("wslb.migrate")

STEP_TIMEOUT = 5.0  # each HTTP step
CONNS_PER_WORKER = 8  # failover.PARALLEL handoffs at once (a drain runs fewer)
POLL = 0.002


class HandoffError(Exception):
    """A step failed; ``reason`` is a short label for metrics (no_api, freeze, thaw, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Frozen:
    """A freeze's answer: the worker's state of the session, and how many messages it sent
    (``sent``) and processed (``received``) on this leg."""

    state: Any
    sent: int
    received: int


def handoff_url(backend: Backend, sid: str, step: str) -> yarl.URL:
    """``POST``'s target for a handoff ``step`` (freeze, thaw) of session ``sid`` on ``backend``.

    The key is one percent-encoded path segment (``quote_key``) and the URL is taken as
    encoded, so no key can name another session or route (``a/freeze?``, ``..``) and every key
    reaches the worker as it is.
    """
    up = backend.upstream
    scheme = "https" if up.secure else "http"
    return yarl.URL(
        f"{scheme}://{up.authority}/wslb/sessions/{quote_key(sid)}/{step}", encoded=True
    )


async def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` passes (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(POLL)
    return True


class HandoffClient:
    """The handoff steps towards a process's workers (module docstring)."""

    def __init__(self, state: ServerState, conns_per_worker: int = CONNS_PER_WORKER) -> None:
        self.state = state
        self.conns_per_worker = conns_per_worker
        self._http: dict[str, aiohttp.ClientSession] = {}

    def http(self, backend: Backend) -> aiohttp.ClientSession:
        """The pooled HTTP client towards ``backend`` (also its failover probe's)."""
        http = self._http.get(backend.id)
        if http is None or http.closed:
            http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.conns_per_worker),
                headers={"User-Agent": "wslb"},
            )
            self._http[backend.id] = http
        return http

    async def drop(self, backend: Backend) -> None:
        """Close every connection to ``backend`` (it was lost, or failed a step)."""
        http = self._http.pop(backend.id, None)
        if http is not None:
            await http.close()

    async def close(self) -> None:
        for http in list(self._http.values()):
            await http.close()
        self._http.clear()

    async def post(
        self, backend: Backend, sid: str, step: str, body: dict[str, Any]
    ) -> tuple[int, Any]:
        """POST a handoff step to ``backend``, with wslb's credential and over the pool's
        ``upstream_tls`` for a ``wss://`` or ``https://`` worker; the status and the JSON answer
        (None if not JSON). A network failure drops the worker's connections and raises
        ``network``."""
        token = self.state.worker_token(backend, handoff=True)
        headers = {workerauth.HEADER: token} if token is not None else {}
        try:
            async with self.http(backend).post(
                handoff_url(backend, sid, step),
                json=body,
                headers=headers,
                ssl=self.state.upstream_ssl(backend) or True,
                timeout=aiohttp.ClientTimeout(total=STEP_TIMEOUT),
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = None
                return resp.status, data
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            await self.drop(backend)
            raise HandoffError("network", f"{step} on {backend.id}: {exc!r}") from None

    async def freeze(self, backend: Backend, sid: str) -> Frozen:
        """FROZEN: the worker stops sending on the session and says what it sent and read."""
        status, body = await self.post(backend, sid, "freeze", {})
        if status == 404:  # a worker without the handoff API, or one that lost the session
            raise HandoffError("no_api", f"freeze answered {status}")
        if status == 401:  # the worker has no credential, or another one than wslb shows
            log.warning(
                "backend %s refused wslb's credential (401): give it the pool's worker_auth "
                "(docs/hardening.md#sessions-belong-to-their-owner)",
                backend.id,
            )
            raise HandoffError("unauthorized", "freeze answered 401")
        if status != 200 or not isinstance(body, dict):
            raise HandoffError("freeze", f"freeze answered {status}")
        try:
            return Frozen(body["state"], int(body["sent"]), int(body["received"]))
        except (KeyError, TypeError, ValueError):
            raise HandoffError("freeze", "malformed freeze answer") from None

    async def thaw(self, backend: Backend, sid: str, frozen: Any) -> None:
        """THAWED: ``backend`` holds the session's state; ``rejected`` when it refused the
        state itself (400: the next worker would too)."""
        status, body = await self.post(backend, sid, "thaw", {"state": frozen})
        if status == 200:
            return
        if status == 400:
            why = body.get("error") if isinstance(body, dict) else None
            raise HandoffError("rejected", f"{backend.id} rejected the state: {why or status}")
        if status == 401:
            log.warning(
                "session %s: thaw on %s answered 401 (wslb's credential refused: see the "
                "pool's worker_auth)",
                sid,
                backend.id,
            )
        raise HandoffError("thaw", f"{backend.id} answered {status}")

    async def resume(
        self, backend: Backend, s: Session
    ) -> tuple[asyncio.Transport, Upgraded, bytes]:
        """A worker leg on ``backend`` with ``X-WSLB-Resume`` (after its thaw); closed again if
        the session ended meanwhile (``closed``)."""
        extra = []
        window, token, r = s.core.window, s.resume_token, s.pool.cfg.resume
        if window is not None and token is not None:  # the new leg parks as the first did
            extra.append((PARK_HEADER, park_value(window.sent(), r.grace, r.buffer, token)))
        try:
            wt, proto, _, trailing = await open_upstream(
                self.state, backend, s.req, s.sid, s.secure, resume=True, extra=extra
            )
        except (OSError, TimeoutError, UpstreamReject) as exc:
            raise HandoffError("resume", str(exc) or type(exc).__name__) from None
        if s.closing or s.finished or s.client.gone:
            wt.close()
            raise HandoffError("closed")
        return wt, proto, trailing

    @staticmethod
    @contextlib.contextmanager
    def reserve(backend: Backend) -> Iterator[None]:
        """A place on ``backend`` while a session is being moved there, so concurrent moves
        (a drain's, a failover's) see it in their bounds."""
        backend.sessions += 1
        try:
            yield
        finally:
            backend.sessions -= 1
