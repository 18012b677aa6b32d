"""``workers: N``: one balancer in N serving processes on one port, run by a supervisor.

The kernel spreads new connections over the N serving processes' listening sockets
(SO_REUSEPORT), so the hot path stays one process's: no lock, no message per frame. What must be
one balancer is kept so by the supervisor, this process:

- **Routing agrees.** Every serving process builds the same ring from the same config. Health and
  scraped signals come from the supervisor alone (it probes and scrapes once, not N times) through
  the board (``balancer/board.py``), and every process publishes its live session counts there,
  so the bounded-load rule sees the balancer's total load, not a 1/N share of it.
- **One admin API.** The supervisor serves ``admin.listen`` and fans requests out to each serving
  process's admin API on a Unix socket: backends and sessions are merged (session counts summed,
  drain progress added up), metrics are summed (counters, histograms and the session/connection
  gauges; per-backend gauges such as weights and health are the supervisor's own), and every
  write (drain, undrain, add/remove backend, reload) reaches every process, so a drain migrates
  the worker's sessions wherever they live. ``wslb ctl`` sees one balancer.
- **Lifecycle.** Spawned reference workers belong to the supervisor, so a serving process that
  crashes takes only its own sessions with it; it is restarted with backoff, its board row is
  cleared, and admin changes made since start (added backends, drains) are replayed into it.
  SIGTERM/SIGINT stop every serving process gracefully (a second signal hurries them), SIGHUP
  reloads all.

Passive outlier ejection stays per process: each ejects on the failures it sees itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from balancer.aio.spawn import Backoff, child_env, die_with_parent, python_module
from balancer.board import Board
from balancer.config import Config, ListenError
from balancer.pool import Pool

__all__ = ["SERVING_MODULE", "ProcessGroup", "ServingProcess"]

log = logging.getLogger("wslb.multi")

SERVING_MODULE = "balancer.aio.serving"  # the entry point of a serving process
PUBLISH_EVERY = 0.1  # seconds between board updates of health and signals
CHILD_READY_TIMEOUT = 30.0


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class ServingProcess:
    """One serving process: started, watched and restarted by the supervisor."""

    def __init__(self, group: ProcessGroup, index: int) -> None:
        self.group = group
        self.index = index
        self.socket = os.path.join(group.run_dir, f"admin-{index}.sock")
        self.proc: asyncio.subprocess.Process | None = None
        self.http: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()
        self.restarts = 0
        self.task: asyncio.Task[None] | None = None
        self._next: asyncio.subprocess.Process | None = None  # a restart's new code

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set()

    def command(self) -> list[str]:
        g = self.group
        return python_module(
            SERVING_MODULE,
            "--config", g.config_path, "--index", str(self.index),
            "--processes", str(g.processes), "--run-dir", g.run_dir,
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        )  # fmt: skip

    async def supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket), base_url="http://wslb"
        )
        while True:
            started = loop.time()
            if self._next is not None:  # a restart's new code, ready (``replace``)
                self.proc, self._next = self._next, None
                waiter = loop.create_task(self.proc.wait())
            else:
                self.group.board.clear_row(self.index)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket)
                self.proc = await asyncio.create_subprocess_exec(
                    *self.command(), preexec_fn=die_with_parent, env=child_env()
                )
                log.info("serving process %d started (pid %d)", self.index, self.proc.pid)
                waiter = loop.create_task(self.proc.wait())
                while not waiter.done() and loop.time() - started < CHILD_READY_TIMEOUT:
                    if await self._answers():
                        if self.restarts and self.group.on_restart is not None:
                            await self.group.on_restart(self)
                        self.ready.set()
                        break
                    await asyncio.wait({waiter}, timeout=0.05)
            code = await waiter
            if self.replaced():  # it handed on to a restart's new code and exited
                continue
            self.ready.clear()
            if self.group.closing:
                return
            self.restarts += 1
            delay = backoff.next(loop.time() - started)
            log.warning(
                "serving process %d exited with %s; restarting in %.1fs", self.index, code, delay
            )
            await asyncio.sleep(delay)

    def replaced(self) -> bool:
        """A restart's new code is starting in this slot (the old process's exit is no
        crash)."""
        return self._next is not None

    async def replace(self, timeout: float = 120.0) -> dict[str, Any]:
        """A hot restart of this serving process (``aio/restart.py``): it is asked to hand
        everything to a new one started here, with the code installed now, on a socket in the
        run directory; the answer is the old one's. The new one is watched from then on."""
        loop = asyncio.get_running_loop()
        take = os.path.join(self.group.run_dir, f"take-{self.index}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(take)
        asked = loop.create_task(self.call("POST", "/restart", {"socket": take}, timeout=timeout))
        deadline = loop.time() + 10.0
        exists = os.path.exists  # a tmpfs lookup, not blocking I/O
        while not exists(take) and not asked.done() and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        if not exists(take):
            asked.cancel()
            status, body = (await asked) if asked.done() and not asked.cancelled() else (0, None)
            raise RuntimeError(f"serving process {self.index} did not get ready: {status} {body}")
        # The old process has its admin connection; its path is the new one's from now on.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        new = await asyncio.create_subprocess_exec(
            *self.command(), "--take-over", take, preexec_fn=die_with_parent, env=child_env()
        )
        log.info("serving process %d: new code starting (pid %d)", self.index, new.pid)
        self._next = new  # before the old one exits: its exit is not a crash
        try:
            status, body = await asked
        except BaseException:
            self._next = None
            new.kill()
            raise
        if status != 200:
            self._next = None
            if new.returncode is None:
                new.kill()
            raise RuntimeError(f"serving process {self.index}: {body}")
        if self.http is not None:  # its kept connections went to the old process
            await self.http.close()
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket), base_url="http://wslb"
        )
        return dict(body)

    async def _answers(self) -> bool:
        try:
            status, _ = await self.call("GET", "/readyz", timeout=1.0)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 200

    async def call(
        self, method: str, path: str, body: Any = None, *, timeout: float = 30.0
    ) -> tuple[int, Any]:
        """One admin request to this process: (status, JSON or text)."""
        assert self.http is not None
        async with self.http.request(
            method, path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, await resp.text()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, timeout: float) -> None:
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.http is not None:
            await self.http.close()


class ProcessGroup:
    """The serving processes of one supervisor: their private run directory, the shared board,
    start, restart and stop (a second signal hurries them), and the board publisher."""

    def __init__(self, config: Config, config_path: str) -> None:
        self.config = config
        self.config_path = config_path
        self.processes = config.workers
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.run_dir = tempfile.mkdtemp(prefix="wslb-", dir=base)  # mode 0700
        self.board = Board(os.path.join(self.run_dir, "board"), self.processes, None, create=True)
        self.children = [ServingProcess(self, i) for i in range(self.processes)]
        self.closing = False
        # Replays admin changes into a serving process that restarted (the fan-out's).
        self.on_restart: Callable[[ServingProcess], Awaitable[None]] | None = None

    def check_ports(self) -> None:
        """Fail fast, as a single process would, if a listen address is taken."""
        listen = self.config.listen
        for i, lst in enumerate(listen):
            try:
                with socket.create_server(
                    (lst.host, lst.port), reuse_port=True, family=_family(lst.host)
                ):
                    pass
            except OSError as err:
                key = "listen" if len(listen) == 1 else f"listen[{i}]"
                raise ListenError(key, str(lst), err, self.config.listen_default) from None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for child in self.children:
            child.task = loop.create_task(child.supervise(), name=f"serve-{child.index}")
        await asyncio.wait_for(
            asyncio.gather(*(c.ready.wait() for c in self.children)), CHILD_READY_TIMEOUT
        )
        log.info("%d serving processes ready", self.processes)

    async def stop(self, hurry: asyncio.Event) -> None:
        """Stop every serving process gracefully; ``hurry`` (a second signal) is passed on."""
        self.closing = True
        t = self.config.timeouts
        limit = t.shutdown_grace + t.close + 5.0

        async def hurried() -> None:
            await hurry.wait()
            for c in self.children:
                c.signal(signal.SIGTERM)  # their second signal: skip the grace period

        task = asyncio.get_running_loop().create_task(hurried())
        await asyncio.gather(*(c.stop(limit) for c in self.children))
        task.cancel()

    def close(self) -> None:
        self.board.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    async def publish(self, pools: list[Pool]) -> None:
        """Write each backend's health and signals to the board for the serving processes."""
        loop = asyncio.get_running_loop()
        written: dict[str, tuple[object, ...]] = {}
        while not self.closing:
            now = loop.time()
            mono = time.monotonic()  # the board's clock: the same in every process
            for pool in pools:
                for b in pool.backends.values():
                    sig = b.signals
                    state = (b.healthy, sig)
                    if written.get(b.id) == state:
                        continue
                    written[b.id] = state
                    self.board.write_info(
                        b.id,
                        healthy=b.healthy,
                        signals=None
                        if sig is None
                        else (
                            sig.gpu_util,
                            sig.kv_cache_usage,
                            sig.running,
                            sig.waiting,
                            sig.tpot,
                        ),
                        scraped_at=None if sig is None else mono - (now - sig.at),
                    )
            await asyncio.sleep(PUBLISH_EVERY)
