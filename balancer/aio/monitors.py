"""What watches the backends: spawned worker processes, health probes, load scrapes.

Two implementations of one small interface (``watch``/``unwatch`` a backend, ``start``/``stop``):

- ``LocalMonitors``: the process itself spawns ``spawn: reference`` workers, probes and scrapes
  (standalone, cluster mode, and the supervisor of ``workers: N``). Probe results go to
  ``on_probe`` (self-drain detection lives in ``Control``), scrape failures are counted, and
  ``on_scrape`` (cluster mode's remote session counts) is called after each good scrape.
  A worker it spawns is probed and scraped from its process's first accepted connection on:
  before that it is starting, and a refused probe then would count as an error of a backend
  that never failed (every backend showed ``Errors 1`` on a fresh start).
- ``BoardFollower``: a serving process of ``workers: N`` does none of that; it follows the
  supervisor's board (``balancer/board.py``) for each backend's health and signals.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import aiohttp

from balancer.aio.health import HealthChecker
from balancer.aio.loops import LagMeter
from balancer.aio.scraper import Scraper
from balancer.aio.spawn import Spawner
from balancer.board import Board
from balancer.metrics import Stats
from balancer.pool import Backend, Pool
from balancer.weights import Signals

__all__ = ["BOARD_FOLLOW", "BoardFollower", "LocalMonitors", "Monitors"]

BOARD_FOLLOW = 0.1  # how often a serving process of workers: N rereads health and signals


class Monitors(Protocol):
    """Starts and stops what a backend needs while it is a member of a pool."""

    def watch(self, pool: Pool, b: Backend) -> None: ...

    async def unwatch(self, b: Backend) -> None: ...

    async def start(self, pools: list[Pool]) -> None: ...

    async def stop(self) -> None: ...

    async def stop_workers(self) -> None: ...

    def spawned(self) -> dict[str, int]:
        """The spawned workers running now, by backend id (a restart hands them on)."""
        ...

    async def release_workers(self) -> None:
        """Let go of the spawned workers without stopping them (a restart's new code has
        them)."""
        ...


class LocalMonitors:
    """Spawned workers, probes and scrapes run by this process (module docstring)."""

    def __init__(self, stats: Stats, loop: asyncio.AbstractEventLoop) -> None:
        self.stats = stats
        self.loop = loop
        self.spawner = Spawner(self._spawned_state)
        # Spawned backends whose probes and scrapes wait for their new process's first accept:
        # one that has not bound its port yet is starting, not failing (no error counted).
        self._starting: dict[str, Pool] = {}
        self.http: aiohttp.ClientSession | None = None
        self.scraper: Scraper | None = None
        self.health: HealthChecker | None = None
        self.lag: LagMeter | None = None
        # Set by the composition root: probe results (self-drains), good scrapes (cluster).
        self.on_probe: Callable[[Backend, bool, bool], object] = lambda b, ok, draining: None
        self.on_scrape: Callable[[Backend], None] | None = None
        # A TLS worker's context (its pool's upstream_tls), for probes and scrapes.
        self.tls: Callable[[Backend], ssl.SSLContext | None] = lambda b: None
        # Spawned workers a restart handed on, by backend id: adopted, not started again.
        self.adopt: dict[str, int] = {}

    async def start(self, pools: list[Pool]) -> None:
        # One pooled HTTP client for scrapes and probes; limit_per_host keeps a slow worker
        # from taking every connection.
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=4, force_close=False),
            headers={"User-Agent": "wslb"},
        )
        self.scraper = Scraper(self.http, self._scrape_failed, self.tls)
        self.scraper.on_scrape = self._scraped
        self.lag = LagMeter(self.loop)
        self.lag.start()
        self.health = HealthChecker(self.http, self._probe_result, self.lag, self.tls)
        for pool in pools:
            for b in pool.backends.values():
                self.watch(pool, b)

    def watch(self, pool: Pool, b: Backend) -> None:
        """Start what a backend needs: its worker process, scrapes, health checks (for a worker
        this process starts, once the process accepts connections)."""
        if b.cfg.spawn == "reference":
            adopt = self.adopt.pop(b.id, None)
            if adopt is None:
                self._starting[b.id] = pool
            self.spawner.start(b, adopt)
            if adopt is None:
                return
        self._check(pool, b)

    def _spawned_state(self, b: Backend, healthy: bool) -> None:
        """The spawner's word on a worker process: the first accept starts its checks."""
        pool = self._starting.pop(b.id, None) if healthy else None
        if pool is not None:
            self._check(pool, b)

    def _check(self, pool: Pool, b: Backend) -> None:
        if self.scraper is not None:
            self.scraper.start(pool, b)
        if self.health is not None and pool.cfg.health.enabled:
            self.health.start(pool, b)

    async def unwatch(self, b: Backend) -> None:
        self._starting.pop(b.id, None)
        if self.scraper is not None:
            await self.scraper.stop(b.id)
        if self.health is not None:
            await self.health.stop(b.id)
        if b.cfg.spawn == "reference":
            await self.spawner.stop(b.id)

    async def stop(self) -> None:
        """Probes and scrapes (spawned workers go last, with ``stop_workers``)."""
        if self.lag is not None:
            self.lag.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.health is not None:
            await self.health.stop()
        if self.http is not None:
            await self.http.close()
            self.http = None

    async def stop_workers(self) -> None:
        await self.spawner.stop()

    def spawned(self) -> dict[str, int]:
        return self.spawner.pids()

    async def release_workers(self) -> None:
        await self.spawner.release()

    def _scrape_failed(self, b: Backend) -> None:
        self.stats.scrape_failures[b.id] += 1

    def _scraped(self, b: Backend) -> None:
        if self.on_scrape is not None:
            self.on_scrape(b)

    def _probe_result(self, b: Backend, ok: bool, draining: bool) -> None:
        if not ok:
            self.stats.probe_failures[b.id] += 1
        self.on_probe(b, ok, draining)


class BoardFollower:
    """A serving process of ``workers: N``: health and signals from the supervisor's board."""

    def __init__(self, board: Board, loop: asyncio.AbstractEventLoop) -> None:
        self.board = board
        self.loop = loop
        self._pools: list[Pool] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self, pools: list[Pool]) -> None:
        self._pools = pools
        self._task = self.loop.create_task(self._follow(), name="board-follow")

    def watch(self, pool: Pool, b: Backend) -> None:
        pass  # the supervisor spawns, probes and scrapes; _follow picks the backend up

    async def unwatch(self, b: Backend) -> None:
        pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop_workers(self) -> None:
        pass

    def spawned(self) -> dict[str, int]:
        return {}  # the supervisor's

    async def release_workers(self) -> None:
        pass

    async def _follow(self) -> None:
        """Take each backend's health and scraped signals from the supervisor's board."""
        board = self.board
        seen: dict[str, int] = {}
        while True:
            now, mono = self.loop.time(), time.monotonic()
            for pool in self._pools:
                for b in pool.backends.values():
                    info = board.read_info(b.id)
                    if info is None or seen.get(b.id) == info.seq:
                        continue
                    seen[b.id] = info.seq
                    b.set_health(info.healthy, at=time.time())
                    b.signals = (
                        None
                        if info.scraped_at is None
                        else Signals(
                            at=now - (mono - info.scraped_at),
                            gpu_util=info.gpu_util,
                            kv_cache_usage=info.kv_cache_usage,
                            running=info.running,
                            waiting=info.waiting,
                            tpot=info.tpot,
                        )
                    )
            await asyncio.sleep(BOARD_FOLLOW)
