"""The balancer process: listeners, pools, sessions, spawned workers, admin, lifecycle.

Shutdown follows websockets' ``Server.close()``: stop accepting (new handshakes get 503), give
live sessions ``timeouts.shutdown_grace`` to end by themselves, close the rest with 1001, wait
``timeouts.close`` for the close handshakes, abort what is left, then stop spawned workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from balancer import frames
from balancer.aio.admin import Admin
from balancer.aio.cluster import Cluster
from balancer.aio.drain import Drainer
from balancer.aio.health import HealthChecker
from balancer.aio.loops import GcPacer, LagMeter
from balancer.aio.scraper import Scraper
from balancer.aio.server import ClientConnection, Session
from balancer.aio.spawn import Spawner
from balancer.aio.wheel import TimerWheel
from balancer.auth import Authenticator
from balancer.board import Board
from balancer.config import BackendCfg, Config, ConfigError, Listener
from balancer.config import load as load_config
from balancer.handshake import ClientRequest
from balancer.logs import log_access
from balancer.metrics import BackendView, Stats
from balancer.pool import ACTIVE, Backend, Pool
from balancer.weights import Signals

__all__ = ["Balancer", "ProcessLink", "run", "run_loop", "serve"]

log = logging.getLogger("wslb")

BOARD_FOLLOW = 0.1  # how often a serving process of workers: N rereads health and signals


@dataclass(frozen=True, slots=True)
class ProcessLink:
    """How one serving process of ``workers: N`` finds the rest of its balancer.

    Such a process listens with SO_REUSEPORT, serves its admin API on a Unix socket for the
    supervisor, and neither spawns, scrapes nor probes workers: it follows the supervisor's
    board (``balancer/board.py``) for health and signals and publishes its session counts there.
    """

    index: int
    processes: int
    board: str
    admin_socket: str


class Balancer:
    """Everything one wslb process runs."""

    def __init__(
        self, config: Config, config_path: str | None = None, link: ProcessLink | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.link = link
        self.loop = asyncio.get_running_loop()
        self.wheel = TimerWheel(self.loop)  # the sessions' timers (heartbeat, idle, close)
        self.stats = Stats()
        self.pools = [Pool(p) for p in config.pools]
        self.board: Board | None = None
        # Per client address; the kernel spreads one client's connections over the serving
        # processes of workers: N by port, so each enforces its share.
        self.per_client_limit = config.limits.max_connections_per_client
        if link is not None:
            self.board = Board(link.board, link.processes, link.index)
            for pool in self.pools:
                pool.shared = self.board
            self.per_client_limit = -(-self.per_client_limit // link.processes)
        # Longest prefix first, so the most specific pool wins.
        self._routes = sorted(self.pools, key=lambda p: len(p.cfg.path_prefix), reverse=True)
        self.sessions: dict[Session, None] = {}
        self.connections = 0
        self.per_client: Counter[str] = Counter()  # open connections per client address
        self.closing = False
        self.spawner = Spawner()
        # Cluster mode (etcd): created before the admin API, which registers its metrics.
        self.cluster = Cluster(self, config.cluster) if config.cluster is not None else None
        self.admin = Admin(self)
        self.http: aiohttp.ClientSession | None = None
        self.handoff_http: aiohttp.ClientSession | None = None
        self.scraper: Scraper | None = None
        self.health: HealthChecker | None = None
        self.lag: LagMeter | None = None
        self.gc_pacer = GcPacer(self.loop)
        self.drainer = Drainer(self)
        self.auth = Authenticator(config.auth)
        self._listener_tls: list[tuple[ssl.SSLContext, str, str]] = []
        self._upstream_tls: dict[str, ssl.SSLContext] = {}
        self.background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks alive
        self.self_drained: set[str] = set()  # backends drained because they said "draining"
        self._servers: list[asyncio.Server] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self.hurry = asyncio.Event()  # set by a second signal: skip the grace period

    # -- startup / shutdown ----------------------------------------------------------------

    async def start(self) -> None:
        await self.start_serving()
        await self.admin.start()

    async def start_serving(self) -> None:
        """Everything but the admin API, which opens last: once it answers, wslb serves."""
        # One pooled HTTP client for scrapes and probes; limit_per_host keeps a slow worker
        # from taking every connection.
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=4, force_close=False),
            headers={"User-Agent": "wslb"},
        )
        # Handoff calls get their own pool without a per-host cap: a drain freezes many
        # sessions on one worker at once, and a queued freeze would stretch its client's pause.
        self.handoff_http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0)
        )
        if self.link is None:  # a serving process of workers: N follows the board instead
            self.scraper = Scraper(self.http, self._scrape_failed)
            self.lag = LagMeter(self.loop)
            self.lag.start()
            self.health = HealthChecker(self.http, self._probe_result, self.lag)
        else:
            self._spawn_background(self._follow_board())
        for pool in self.pools:
            for b in pool.backends.values():
                self.watch(pool, b)
        if self.cluster is not None:  # etcd's backends replace the file's, before listening
            await self.cluster.start()
        for lst in self.listeners():
            ctx = None
            if lst.tls is not None:
                ctx = self._listener_ssl(lst.tls.cert, lst.tls.key)
                self._listener_tls.append((ctx, lst.tls.cert, lst.tls.key))
            server = await self.loop.create_server(
                lambda lst=lst: ClientConnection(
                    self, secure=lst.tls is not None, proxy_protocol=lst.proxy_protocol
                ),
                lst.host,
                lst.port,
                backlog=4096,
                reuse_address=True,
                reuse_port=self.link is not None,
                ssl=ctx,
                ssl_handshake_timeout=self.config.timeouts.handshake if ctx else None,
            )
            self._servers.append(server)
            log.info("listening on %s:%d", lst.host, lst.port)
        self.gc_pacer.start()  # start-up's objects are all built: freeze them
        if os.environ.get("WSLB_PURE_PYTHON"):
            log.warning("frame scanner: the Python loop (WSLB_PURE_PYTHON is set)")
        elif not frames.ACCELERATED:
            log.warning(
                "frame scanner: the Python loop (balancer._scan is not built); reinstall with "
                "a C compiler for ~3x less CPU per frame at saturation"
            )

    def listeners(self) -> tuple[Listener, ...]:
        """The addresses this process accepts clients on."""
        return self.config.listen

    def _spawn_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a fire-and-forget task, kept alive until it ends."""
        task = self.loop.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _follow_board(self) -> None:
        """Take each backend's health and scraped signals from the supervisor's board."""
        board = self.board
        assert board is not None
        seen: dict[str, int] = {}
        while not self.closing:
            now, mono = self.loop.time(), time.monotonic()
            for pool in self.pools:
                for b in pool.backends.values():
                    info = board.read_info(b.id)
                    if info is None or seen.get(b.id) == info.seq:
                        continue
                    seen[b.id] = info.seq
                    b.healthy = info.healthy
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

    @staticmethod
    def _listener_ssl(cert: str, key: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        return ctx

    def upstream_ssl(self, backend: Backend) -> ssl.SSLContext | None:
        """TLS context for a ``wss://`` worker: its pool's CA and client certificate."""
        if not backend.upstream.secure:
            return None
        found = self.find_backend(backend.id)
        tls = found[0].cfg.upstream_tls if found is not None else None
        key = found[0].name if found is not None else ""
        ctx = self._upstream_tls.get(key)
        if ctx is None:
            ctx = ssl.create_default_context(cafile=tls.ca if tls else None)
            if tls is not None and tls.cert and tls.key:
                ctx.load_cert_chain(tls.cert, tls.key)
            self._upstream_tls[key] = ctx
        return ctx

    def reload_certificates(self) -> None:
        """Reread listener certificates (new handshakes use them) and upstream TLS files."""
        for ctx, cert, key in self._listener_tls:
            ctx.load_cert_chain(cert, key)
        self._upstream_tls.clear()

    async def shutdown(self) -> None:
        """Graceful stop; see the module docstring."""
        if self.closing:
            return
        self.closing = True
        t = self.config.timeouts
        for server in self._servers:
            server.close()
        if self.sessions:
            log.info(
                "shutdown: waiting up to %.1fs for %d sessions",
                t.shutdown_grace,
                len(self.sessions),
            )
            waits = {
                self.loop.create_task(self._idle.wait()),
                self.loop.create_task(self.hurry.wait()),
            }
            _, pending = await asyncio.wait(
                waits, timeout=t.shutdown_grace, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
        for s in list(self.sessions):
            s.close(1001, "balancer shutting down")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), t.close + 0.5)
        for s in list(self.sessions):
            s.ct.abort()
            s.wt.abort()
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        await self.drainer.stop()
        await self.stop_monitors()
        await self.spawner.stop()
        await self.admin.stop()
        if self.board is not None:
            self.board.close()

    async def stop_monitors(self) -> None:
        self.gc_pacer.stop()
        if self.lag is not None:
            self.lag.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.health is not None:
            await self.health.stop()
        for session in (self.http, self.handoff_http):
            if session is not None:
                await session.close()
        self.http = self.handoff_http = None

    def watch(self, pool: Pool, b: Backend) -> None:
        """Start what a backend needs: its worker process, scrapes, health checks."""
        if b.cfg.spawn == "reference" and self.link is None:
            self.spawner.start(b)
        if self.scraper is not None:
            self.scraper.start(pool, b)
        if self.health is not None and pool.cfg.health.enabled:
            self.health.start(pool, b)

    def _scrape_failed(self, b: Backend) -> None:
        self.stats.scrape_failures[b.id] += 1

    def _probe_result(self, b: Backend, ok: bool, draining: bool) -> None:
        if not ok:
            self.stats.probe_failures[b.id] += 1
        if draining and b.admin_state == ACTIVE:
            # The worker drains itself (SIGTERM, pod termination): move its sessions away.
            found = self.find_backend(b.id)
            if found is not None:
                pool = found[0]
                log.info("worker %s reports draining; draining it", b.id)
                self.drainer.start(pool, b, pool.cfg.drain.migrate, pool.cfg.drain.timeout)
                self.self_drained.add(b.id)
        elif ok and b.id in self.self_drained:
            # The worker that drained itself is back (restarted): it takes sessions again.
            self.self_drained.discard(b.id)
            log.info("worker %s is healthy again after draining itself; undraining", b.id)
            self._spawn_background(self.drainer.undrain(b))

    # -- operator actions ------------------------------------------------------------------

    def pool(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)

    def find_session(self, sid: str) -> Session | None:
        return next((s for s in self.sessions if s.sid == sid), None)

    def add_backend(self, pool: Pool, cfg: BackendCfg) -> Backend:
        b = pool.add(cfg)
        self.watch(pool, b)
        log.info("added backend %s to pool %s", b.id, pool.name)
        return b

    async def remove_backend(self, pool: Pool, b: Backend) -> None:
        await self.unwatch(b)
        pool.remove(b.id)
        self.drainer.progress.pop(b.id, None)
        log.info("removed backend %s from pool %s", b.id, pool.name)

    async def unwatch(self, b: Backend) -> None:
        if self.scraper is not None:
            await self.scraper.stop(b.id)
        if self.health is not None:
            await self.health.stop(b.id)
        if b.cfg.spawn == "reference" and self.link is None:
            await self.spawner.stop(b.id)

    async def reload(self) -> dict[str, Any]:
        """Reread the config file: backends and weights change; live sessions stay put.

        A backend gone from the file stops taking sessions (draining, without migration) and is
        removed once its sessions have ended. Other settings need a restart; they are listed.
        """
        if self.config_path is None:
            raise ConfigError(["no config file to reload"])
        new = load_config(self.config_path)
        report: dict[str, Any] = {"added": [], "removed": [], "updated": [], "ignored": []}
        try:
            self.reload_certificates()
        except (OSError, ssl.SSLError) as exc:
            report["ignored"].append(f"certificates not reloaded: {exc}")
        if self.cluster is not None:
            report["ignored"].append("backends: in cluster mode they live in etcd (admin API)")
        for pcfg in new.pools if self.cluster is None else ():
            pool = self.pool(pcfg.name)
            if pool is None:
                report["ignored"].append(f"new pool {pcfg.name} (restart to add pools)")
                continue
            wanted = {b.id: b for b in pcfg.backends}
            for bid, bcfg in wanted.items():
                cur = pool.backends.get(bid)
                if cur is None:
                    self.add_backend(pool, bcfg)
                    report["added"].append(bid)
                elif cur.cfg != bcfg:
                    if (cur.cfg.url, cur.cfg.spawn, cur.cfg.args) != (
                        bcfg.url,
                        bcfg.spawn,
                        bcfg.args,
                    ):
                        report["ignored"].append(f"{bid}: url/spawn change (remove, then add)")
                        continue
                    pool.update(bid, bcfg)
                    report["updated"].append(bid)
            for bid in [b for b in pool.backends if b not in wanted]:
                b = pool.backends[bid]
                if b.admin_state == ACTIVE:
                    self.drainer.start(pool, b, False, float("inf"))
                self._spawn_background(self._remove_when_drained(pool, b))
                report["removed"].append(bid)
        if (new.listen, new.admin, new.timeouts, new.limits) != (
            self.config.listen,
            self.config.admin,
            self.config.timeouts,
            self.config.limits,
        ):
            report["ignored"].append("listen/admin/timeouts/limits (restart to apply)")
        log.info("reloaded %s: %s", self.config_path, report)
        return report

    async def _remove_when_drained(self, pool: Pool, b: Backend) -> None:
        while b.load > 0 and pool.backends.get(b.id) is b:  # noqa: ASYNC110 (rare, coarse)
            await asyncio.sleep(0.5)
        if pool.backends.get(b.id) is b:
            await self.drainer.undrain(b)
            await self.remove_backend(pool, b)

    # -- used by connections ---------------------------------------------------------------

    def route(self, path: str) -> Pool | None:
        """The pool whose path prefix is the longest match for the request path."""
        for pool in self._routes:
            if path.startswith(pool.cfg.path_prefix):
                return pool
        return None

    def authorize(self, req: ClientRequest) -> str | None:
        """Origin allow-list (403) and JWT (401); return the session key a claim gives, if any."""
        return self.auth.session_key(self.auth.check(req))

    def worker_failed(self, pool: Pool, backend: Backend) -> None:
        """A connect or handshake to the worker failed: passive outlier detection."""
        if pool.failed(backend, self.loop.time()):
            self.stats.ejections[backend.id] += 1
            log.warning(
                "backend %s ejected for %.0fs after repeated failures",
                backend.id,
                backend.ejected_until - self.loop.time(),
            )

    @staticmethod
    def wall_time() -> float:
        return time.time()

    def session_started(self, s: Session) -> None:
        self.sessions[s] = None
        self._idle.clear()

    def at_capacity(self) -> bool:
        """``limits.max_connections`` reached, over every serving process of ``workers: N``."""
        if self.board is not None:
            return self.board.connections() >= self.config.limits.max_connections
        return self.connections >= self.config.limits.max_connections

    def connection_opened(self, peer: str) -> None:
        self.connections += 1
        self.per_client[peer] += 1
        if self.board is not None:
            self.board.publish_connections(self.connections)

    def client_renamed(self, old: str, new: str) -> None:
        """A trusted proxy named the client of a counted connection: count it under that."""
        n = self.per_client[old] - 1
        if n > 0:
            self.per_client[old] = n
        else:
            del self.per_client[old]
        self.per_client[new] += 1

    def connection_closed(self, peer: str) -> None:
        self.connections -= 1
        if self.board is not None:
            self.board.publish_connections(self.connections)
        n = self.per_client[peer] - 1
        if n > 0:
            self.per_client[peer] = n
        else:
            del self.per_client[peer]

    def session_finished(self, s: Session) -> None:
        self.sessions.pop(s, None)
        self.connection_closed(s.peer)
        self.stats.session_done(s)
        if self.config.log.access:
            log_access(s)
        if not self.sessions:
            self._idle.set()

    # -- views -----------------------------------------------------------------------------

    def backend_views(self) -> Iterator[BackendView]:
        now = self.loop.time()
        for pool in self.pools:
            pool.refresh(now)
            for b in pool.backends.values():
                sig = b.signals
                yield BackendView(
                    pool=pool.name,
                    id=b.id,
                    sessions=b.sessions,
                    sessions_total=b.sessions_total,
                    ready=b.ready,
                    state=b.state,
                    weight=b.weight,
                    effective_weight=b.effective_weight,
                    healthy=b.healthy,
                    stale=b.stale,
                    signals=sig.as_dict() if sig is not None else {},
                    scrape_age=now - sig.at if sig is not None else None,
                    ejected_for=max(0.0, b.ejected_until - now) if b.ejected else 0.0,
                    ejections=b.ejections,
                    held=b.held,
                    health_reason=b.health_reason,
                    health_kind=b.health_kind,
                    health_since=b.health_since,
                    last_check=b.last_check,
                )

    def find_backend(self, backend_id: str) -> tuple[Pool, Backend] | None:
        for pool in self.pools:
            b = pool.backends.get(backend_id)
            if b is not None:
                return pool, b
        return None


async def serve(
    config: Config, config_path: str | None = None, link: ProcessLink | None = None
) -> int:
    """Run a balancer until SIGTERM or SIGINT; return the exit status.

    With ``workers: N`` above 1 this process is the supervisor of N serving processes
    (``balancer/aio/multi.py``); ``link`` is given to each of those.
    """
    loop = asyncio.get_running_loop()
    app: Balancer
    if link is None and config.workers > 1:
        from balancer.aio.multi import Supervisor

        app = Supervisor(config, config_path)
    else:
        app = Balancer(config, config_path, link)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:
        async def run() -> None:
            try:
                await app.reload()
            except ConfigError as exc:
                log.error("reload failed, configuration unchanged:\n%s", exc)

        task = loop.create_task(run())
        app.background.add(task)
        task.add_done_callback(app.background.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        await app.start()
    except (OSError, TimeoutError) as exc:
        log.error("cannot start: %s", exc)
        await app.stop_monitors()
        await app.spawner.stop()
        await app.admin.stop()
        return 1
    await stop.wait()
    log.info("shutting down")
    # A second signal skips the grace period.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.hurry.set)
    await app.shutdown()
    return 0


def run(config: Config, config_path: str | None = None) -> int:
    """Run a balancer on a uvloop event loop (the process's main job)."""
    return run_loop(serve(config, config_path))


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` to completion on a uvloop event loop."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        return runner.run(main)
