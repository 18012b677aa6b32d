"""Polls each backend's Prometheus endpoint for load signals (``weights.scrape_interval``).

One task per backend, each with its own timeout, so a slow or dead metrics endpoint delays
nothing but its own next scrape; routing never waits for a scrape. A failed scrape keeps the last
signals, which turn stale after ``weights.stale_after`` (``balancer.weights``): routing then
counts sessions only, which is all a server without ``/metrics`` (one nobody wrote for wslb) can
give. Such a server fails every scrape, so a failure is logged once per backend, when scrapes
start failing, and once more when they work again; never once per scrape. The worker URL's own
``/metrics`` of a ``wss://`` or ``https://`` worker is read over TLS with its pool's
``upstream_tls`` (``tls``); a ``metrics_url`` elsewhere with the system trust store.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

import aiohttp

from balancer.aio.loops import PerBackend
from balancer.pool import Backend, Pool
from balancer.weights import parse_signals, resolve_mapping

__all__ = ["Scraper", "metrics_url"]

log = logging.getLogger("wslb.scraper")


def metrics_url(backend: Backend) -> str:
    """The backend's ``metrics_url``, or its worker URL's host:port + ``/metrics``."""
    if backend.cfg.metrics_url:
        return backend.cfg.metrics_url
    up = backend.upstream
    return f"{'https' if up.secure else 'http'}://{up.authority}/metrics"


class Scraper:
    """Scrape loops for the backends of the pools."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        on_failure: Callable[[Backend], None],
        tls: Callable[[Backend], ssl.SSLContext | None] = lambda b: None,
    ):
        self._session = session
        self._tls = tls
        self._on_failure = on_failure
        self._loops = PerBackend("scrape")
        # Called after each good scrape (cluster mode counts other instances' sessions there).
        self.on_scrape: Callable[[Backend], None] | None = None
        self._failing: set[str] = set()  # backends whose last scrape failed (logged once)

    def start(self, pool: Pool, backend: Backend) -> None:
        self._loops.spawn(backend.id, self._loop(pool, backend))

    async def stop(self, backend_id: str | None = None) -> None:
        await self._loops.stop(backend_id)

    async def scrape(self, pool: Pool, backend: Backend) -> bool:
        """One scrape; stores the signals on the backend. False on any failure."""
        cfg = pool.cfg.weights
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=max(0.2, min(cfg.scrape_interval, 2.0)))
        url = metrics_url(backend)
        ctx = None if backend.cfg.metrics_url else self._tls(backend)
        try:
            async with self._session.get(url, timeout=timeout, ssl=ctx or True) as resp:
                if resp.status != 200:
                    raise ValueError(f"-> {resp.status}")
                text = await resp.text()
            signals = parse_signals(text, resolve_mapping(cfg.metrics), loop.time())
            backend.signals = signals.since(backend.signals, cfg.smoothing)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            why = str(exc) or type(exc).__name__
            # Logged once, and only for a backend that is up: a worker still starting (wslb
            # spawns its workers as the scrapes begin) or down has its own log lines.
            if backend.id not in self._failing and backend.healthy:
                self._failing.add(backend.id)
                log.info(
                    "backend %s: no load signals (GET %s %s); its weight follows session "
                    "counts until a scrape works (failures are counted in "
                    "wslb_scrape_failures_total, not logged again)",
                    backend.id,
                    url,
                    why,
                )
            else:
                log.debug("scrape of %s failed: %s", backend.id, why)
            self._on_failure(backend)
            return False
        if backend.id in self._failing:
            self._failing.discard(backend.id)
            log.info("backend %s: load signals from %s again", backend.id, url)
        if self.on_scrape is not None:
            self.on_scrape(backend)
        return True

    async def _loop(self, pool: Pool, backend: Backend) -> None:
        interval = pool.cfg.weights.scrape_interval
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape(pool, backend)
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))
