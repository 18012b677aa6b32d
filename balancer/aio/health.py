"""Active health checks of each backend every ``health.interval``.

Two kinds of probe, chosen by the pool's config:

- No ``health.path`` (the default): a TCP connect to the backend's host:port, as HAProxy's plain
  ``check`` does. A WebSocket server nobody wrote for wslb has no health route, and asking it
  for one (``GET /healthz`` -> 404) would mark every such backend down.
- ``health.path`` set: ``GET path``. 2xx and 3xx are up; ``503`` with ``draining`` in the body
  is a worker draining itself (docs/protocol.md: wslb drains it); anything else is down.

A probe of a ``wss://`` or ``https://`` worker goes over TLS with its pool's ``upstream_tls``
(``tls``), as the proxied traffic does: a private CA or a client certificate the sessions need,
the probe needs too.

A backend turns down after ``fall`` consecutive failures and up again after ``rise`` successes
(``Backend.probe``). Every failure carries a reason an operator can act on (``connect refused``,
``GET /healthz -> 404``, ``timeout after 1s``): kept on the backend while it is down, shown in
``GET /backends``, the log line of the flip and the ``wslb_backend_down`` metric. A probe that
timed out while wslb's own event loop lagged for more than a quarter of the timeout counts
neither way (``LagMeter``): the answer may have been waiting unread. A down backend receives no
new session; its ring points stay, so its keys return when it does. One task per backend: a
hanging check delays only its own backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from balancer.aio.loops import LagMeter, PerBackend
from balancer.pool import Backend, Pool

__all__ = ["HealthChecker", "ProbeResult", "health_url"]

log = logging.getLogger("wslb.health")


def health_url(backend: Backend, path: str) -> str:
    up = backend.upstream
    return f"{'https' if up.secure else 'http'}://{up.authority}{path}"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One conclusive probe: up or not, the worker says it drains, and why it failed."""

    ok: bool
    draining: bool = False
    reason: str | None = None
    kind: str | None = None  # refused, timeout, reset, http_status, error (a metric label)


def _os_failure(exc: OSError) -> tuple[str, str]:
    """(reason, kind) of a failed connect, in the words ``ss``/``curl`` users know."""
    if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
        return "connect refused", "refused"
    if isinstance(exc, ConnectionResetError) or exc.errno == errno.ECONNRESET:
        return "connection reset", "reset"
    return f"connect failed: {exc.strerror or exc}", "error"


class HealthChecker:
    """Probe loops for the backends of the pools."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        on_result: Callable[[Backend, bool, bool], None],
        lag: LagMeter | None = None,
        tls: Callable[[Backend], ssl.SSLContext | None] = lambda b: None,
    ) -> None:
        """``on_result(backend, ok, draining)`` is called after every conclusive probe; ``tls``
        gives a TLS worker's context (its pool's ``upstream_tls``)."""
        self._session = session
        self._tls = tls
        self._lag = lag
        self.inconclusive = 0  # timed-out probes not counted because wslb itself lagged
        self._on_result = on_result  # (backend, ok, draining)
        self._loops = PerBackend("health")

    def start(self, pool: Pool, backend: Backend) -> None:
        self._loops.spawn(backend.id, self._loop(pool, backend))

    async def stop(self, backend_id: str | None = None) -> None:
        await self._loops.stop(backend_id)

    async def check(self, pool: Pool, backend: Backend) -> ProbeResult | None:
        """One probe within ``health.timeout``, or None when it timed out because wslb's loop
        lagged (module docstring)."""
        h = pool.cfg.health
        lag0 = self._lag.total if self._lag is not None else 0.0
        what = f"GET {h.path}: " if h.path is not None else ""
        try:
            if h.path is None:
                return await self._connect(backend, h.timeout)
            return await self._get(backend, h.path, h.timeout)
        except TimeoutError:
            if self._lag is not None and self._lag.total - lag0 > 0.25 * h.timeout:
                self.inconclusive += 1
                return None
            return ProbeResult(False, reason=f"{what}timeout after {h.timeout:g}s", kind="timeout")
        except aiohttp.ClientConnectorError as exc:
            reason, kind = _os_failure(exc.os_error)
            return ProbeResult(False, reason=what + reason, kind=kind)
        except OSError as exc:
            reason, kind = _os_failure(exc)
            return ProbeResult(False, reason=what + reason, kind=kind)
        except aiohttp.ClientError as exc:
            text = str(exc) or type(exc).__name__
            return ProbeResult(False, reason=f"{what}{text}", kind="error")

    @staticmethod
    async def _connect(backend: Backend, timeout: float) -> ProbeResult:
        """The TCP probe: the port accepts a connection (closed at once, nothing sent)."""
        up = backend.upstream
        _, writer = await asyncio.wait_for(asyncio.open_connection(up.host, up.port), timeout)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return ProbeResult(True)

    async def _get(self, backend: Backend, path: str, timeout: float) -> ProbeResult:
        """The HTTP probe; a worker that drains itself answers 503 ``{"status": "draining"}``."""
        async with self._session.get(
            health_url(backend, path),
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
            ssl=self._tls(backend) or True,
        ) as resp:
            body = await resp.read()
        if 200 <= resp.status < 400:
            return ProbeResult(True)
        draining = resp.status == 503 and b"draining" in body[:512]
        reason = f"GET {path} -> {resp.status}" + (" (draining)" if draining else "")
        return ProbeResult(False, draining, reason, "http_status")

    async def _loop(self, pool: Pool, backend: Backend) -> None:
        h = pool.cfg.health
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result = await self.check(pool, backend)
            if result is not None:
                fails = backend.probe_fails + 1
                oks = backend.probe_oks + 1
                flipped = backend.probe(
                    result.ok, h.rise, h.fall, result.reason, result.kind, time.time()
                )
                self._on_result(backend, result.ok, result.draining)
                if flipped and backend.healthy:
                    log.warning("backend %s is up (%d checks passed)", backend.id, oks)
                elif flipped:
                    log.warning(
                        "backend %s is down: %s (%d checks failed in a row; %s)",
                        backend.id,
                        result.reason,
                        fails,
                        "TCP connect" if h.path is None else f"GET {health_url(backend, h.path)}",
                    )
            await asyncio.sleep(max(0.0, h.interval - (loop.time() - started)))
