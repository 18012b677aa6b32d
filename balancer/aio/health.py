"""Active health checks: ``GET {path}`` on each backend every ``health.interval``.

A backend turns down after ``fall`` consecutive failures and up again after ``rise`` successes
(``Backend.probe``). A probe that timed out while wslb's own event loop lagged for more than a
quarter of the timeout counts neither way (``LagMeter``): the answer may have been waiting
unread. A down backend receives no new session; its ring points stay, so its keys return when it
does. One task per backend: a hanging check delays only its own backend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from balancer.aio.loops import LagMeter, PerBackend
from balancer.pool import Backend, Pool

__all__ = ["HealthChecker", "health_url"]

log = logging.getLogger("wslb.health")


def health_url(backend: Backend, path: str) -> str:
    up = backend.upstream
    return f"{'https' if up.secure else 'http'}://{up.authority}{path}"


class HealthChecker:
    """Probe loops for the backends of the pools."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        on_result: Callable[[Backend, bool, bool], None],
        lag: LagMeter | None = None,
    ) -> None:
        """``on_result(backend, ok, draining)`` is called after every conclusive probe."""
        self._session = session
        self._lag = lag
        self.inconclusive = 0  # timed-out probes not counted because wslb itself lagged
        self._on_result = on_result  # (backend, ok, draining)
        self._loops = PerBackend("health")

    def start(self, pool: Pool, backend: Backend) -> None:
        self._loops.spawn(backend.id, self._loop(pool, backend))

    async def stop(self, backend_id: str | None = None) -> None:
        await self._loops.stop(backend_id)

    async def check(self, pool: Pool, backend: Backend) -> tuple[bool, bool] | None:
        """One probe: (2xx within ``health.timeout``, the worker says it is draining), or None
        when it timed out because wslb's loop lagged (module docstring).

        A worker that drains itself answers 503 with ``{"status": "draining"}`` (SPEC 6).
        """
        h = pool.cfg.health
        lag0 = self._lag.total if self._lag is not None else 0.0
        try:
            async with self._session.get(
                health_url(backend, h.path), timeout=aiohttp.ClientTimeout(total=h.timeout)
            ) as resp:
                body = await resp.read()
                draining = resp.status == 503 and b"draining" in body[:512]
                return 200 <= resp.status < 300, draining
        except TimeoutError:
            if self._lag is not None and self._lag.total - lag0 > 0.25 * h.timeout:
                self.inconclusive += 1
                return None
            return False, False
        except aiohttp.ClientError:
            return False, False

    async def _loop(self, pool: Pool, backend: Backend) -> None:
        h = pool.cfg.health
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result = await self.check(pool, backend)
            if result is not None:
                ok, draining = result
                flipped = backend.probe(ok, h.rise, h.fall)
                self._on_result(backend, ok, draining)
                if flipped:
                    state = "up" if backend.healthy else "down"
                    log.warning("backend %s is %s", backend.id, state)
            await asyncio.sleep(max(0.0, h.interval - (loop.time() - started)))
