"""The composition root: builds the parts of a wslb process for its mode and runs their lifecycle.

Nothing imports this module but the entry points (``balancer/cli.py``, ``aio/serving.py``).
Three assemblies of the same parts (``docs/architecture.md`` draws them):

- **standalone** (and each instance of cluster mode): listeners (``proxy.py``) over a
  ``ServerState`` (``state.py``); ``LocalMonitors`` spawn, probe and scrape; a ``Drainer``; a
  ``LocalControl`` behind the admin API, or in cluster mode a ``ClusterControl`` over it with
  the etcd sync (``cluster.py``).
- **a serving process of** ``workers: N``: the same, but a ``BoardFollower`` takes health and
  signals from the supervisor's board, the listeners share the port (SO_REUSEPORT), and the
  admin API answers the supervisor on a Unix socket (``ProcessLink``).
- **the supervisor of** ``workers: N``: no listener and no session; ``LocalMonitors`` (it alone
  spawns, probes and scrapes), the board publisher and the serving processes
  (``multi.ProcessGroup``), and a ``FanoutControl`` behind the public admin API.

Shutdown follows websockets' ``Server.close()``: stop accepting (new handshakes get 503), give
live sessions ``timeouts.shutdown_grace`` to end by themselves, close the rest with 1001, wait
``timeouts.close`` for the close handshakes, abort what is left, then stop the monitors, the
spawned workers and the admin API. A supervisor first stops its serving processes (which do
all that for their sessions), a second signal hurrying them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from balancer import frames
from balancer.aio import offload, tls
from balancer.aio.admin import Admin
from balancer.aio.cluster import Cluster, ClusterControl
from balancer.aio.control import Control, ControlError, LocalControl
from balancer.aio.drain import Drainer
from balancer.aio.failover import Failover
from balancer.aio.fanout import FanoutControl
from balancer.aio.handoff import HandoffClient
from balancer.aio.handover import Handover
from balancer.aio.loops import GcPacer
from balancer.aio.monitors import BoardFollower, LocalMonitors, Monitors
from balancer.aio.multi import ProcessGroup
from balancer.aio.proxy import ClientConnection
from balancer.aio.state import ServerState
from balancer.board import Board
from balancer.config import Config, ConfigError, Listener
from balancer.frames import CloseCode
from balancer.metrics import BalancerCollector, Stats
from balancer.pool import Pool

__all__ = ["ProcessLink", "Runtime", "build", "run", "run_loop", "serve"]

log = logging.getLogger("wslb")


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


class Listeners:
    """The client listeners of a serving process, and their TLS certificates."""

    def __init__(self, state: ServerState, listen: tuple[Listener, ...], reuse_port: bool) -> None:
        self.state = state
        self.listen = listen
        self.reuse_port = reuse_port
        self._servers: list[asyncio.Server] = []
        self._tls: list[tuple[ssl.SSLContext, str, str]] = []

    async def start(self) -> None:
        for lst in self.listen:
            ctx = None
            if lst.tls is not None:
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(lst.tls.cert, lst.tls.key)
                self._tls.append((ctx, lst.tls.cert, lst.tls.key))
            app = functools.partial(
                ClientConnection,
                self.state,
                secure=lst.tls is not None,
                proxy_protocol=lst.proxy_protocol,
            )
            factory: Callable[[], asyncio.BaseProtocol] = app
            if ctx is not None:  # TLS by each connection's gate: failed handshakes are logged
                factory = tls.gate_factory(ctx, app, self.state.timeouts.handshake, self._failed)
            server = await self.state.loop.create_server(
                factory,
                lst.host,
                lst.port,
                backlog=4096,
                reuse_address=True,
                reuse_port=self.reuse_port,
            )
            self._servers.append(server)
            log.info("listening on %s:%d", lst.host, lst.port)

    def _failed(self, peer: str, exc: BaseException) -> None:
        """A client's TLS handshake failed: counted by reason and logged (at info: a scanner
        or a client that does not trust the certificate is the client's problem, not wslb's)."""
        reason = tls.failure_reason(exc)
        self.state.stats.tls_failures[reason] += 1
        # A connection closed without a TLS alert is a TCP health check or a client that gave
        # up: counted, logged only at debug.
        level = logging.DEBUG if reason in ("closed", "reset") else logging.INFO
        log.log(level, "TLS handshake from %s failed: %s", peer, reason)

    def reload_certificates(self) -> None:
        """Reread listener certificates (new handshakes use them)."""
        for ctx, cert, key in self._tls:
            ctx.load_cert_chain(cert, key)

    def close(self) -> None:
        for server in self._servers:
            server.close()

    async def wait_closed(self) -> None:
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)


@dataclass
class Runtime:
    """The parts of one process and their lifecycle (built by ``build``)."""

    state: ServerState
    monitors: Monitors
    drainer: Drainer
    local: LocalControl
    control: Control
    admin: Admin
    listeners: Listeners | None = None
    cluster: Cluster | None = None
    group: ProcessGroup | None = None
    board: Board | None = None
    # Loops that run while serving: a supervisor's follow of its serving processes' events.
    background: tuple[Callable[[], Coroutine[Any, Any, None]], ...] = ()
    handover: Handover | None = None  # workers: N: sessions move between serving processes

    def __post_init__(self) -> None:
        self.gc_pacer = GcPacer(self.state.loop)
        self.hurry = asyncio.Event()  # set by a second signal: skip the grace period
        self._publisher: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Everything, the admin API last: once it answers, wslb serves."""
        if self.group is not None:
            self.group.check_ports()
        await self.monitors.start(self.state.pools)
        if self.cluster is not None:  # etcd's backends replace the file's, before listening
            await self.cluster.start()
        if self.handover is not None:  # before the listeners: a reconnect may come at once
            await self.handover.start()
        if self.listeners is not None:
            await self.listeners.start()
        if self.listeners is not None and self.state.config.relay.thread and offload.AVAILABLE:
            self.state.offload = offload.Offload(
                self.state.loop, self.state.stats.relay_thread
            )  # Rule 7 of session.py
        elif self.listeners is not None and self.state.config.relay.thread:
            log.info("relay thread: off (balancer._relay is not built or WSLB_PURE_PYTHON is set)")
        self.gc_pacer.start()  # start-up's objects are all built: freeze them
        if os.environ.get("WSLB_PURE_PYTHON"):
            log.warning("frame scanner: the Python loop (WSLB_PURE_PYTHON is set)")
        elif not frames.ACCELERATED:
            log.warning(
                "frame scanner: the Python loop (balancer._scan is not built); reinstall with "
                "a C compiler for ~3x less CPU per frame at saturation"
            )
        if self.group is not None:
            self._publisher = self.state.loop.create_task(self.group.publish(self.state.pools))
            await self.group.start()
        self.local.watch_states()  # the feed's ``state`` events, from here on
        self._background = [self.state.loop.create_task(run()) for run in self.background]
        await self.admin.start()

    async def shutdown(self) -> None:
        """Graceful stop; see the module docstring."""
        state = self.state
        if state.closing:
            return
        state.closing = True
        t = state.timeouts
        if self.group is not None:
            await self.group.stop(self.hurry)
        if self.listeners is not None:
            self.listeners.close()
        if state.sessions or state.requests:
            log.info(
                "shutdown: waiting up to %.1fs for %d sessions and %d HTTP requests",
                t.shutdown_grace,
                len(state.sessions),
                len(state.requests),
            )
            waits = {
                state.loop.create_task(state.idle()),
                state.loop.create_task(self.hurry.wait()),
            }
            _, pending = await asyncio.wait(
                waits, timeout=t.shutdown_grace, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
        for ex in list(state.requests):
            ex.abort("balancer shutting down")
        state.keepalive.close()
        for s in list(state.sessions):
            s.close(CloseCode.GOING_AWAY, "balancer shutting down")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle(), t.close + 0.5)
        for s in list(state.sessions):
            s.abort()
        if state.offload is not None:
            state.offload.close()
            state.offload = None
        if self.listeners is not None:
            await self.listeners.wait_closed()
        await self.drainer.stop()
        if self.handover is not None:
            await self.handover.stop()
        await self.stop_monitors()
        await self.monitors.stop_workers()
        await self.admin.stop()
        if self.board is not None:
            self.board.close()
        if self.group is not None:
            self.group.close()

    async def stop_monitors(self) -> None:
        self.gc_pacer.stop()
        for task in self._background:
            task.cancel()
        if self._publisher is not None:
            self._publisher.cancel()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.monitors.stop()
        await self.drainer.handoff.close()

    async def failed_start(self) -> None:
        """Undo a start that could not complete (a port taken, etcd or a child too slow)."""
        await self.stop_monitors()
        await self.monitors.stop_workers()
        await self.admin.stop()
        if self.group is not None:
            await self.group.stop(self.hurry)
            self.group.close()


def build(
    config: Config, config_path: str | None = None, link: ProcessLink | None = None
) -> Runtime:
    """The parts of this process for its mode (module docstring)."""
    loop = asyncio.get_running_loop()
    stats = Stats()
    pools = [Pool(p) for p in config.pools]
    supervising = link is None and config.workers > 1
    board: Board | None = None
    group: ProcessGroup | None = None
    if supervising:
        if config_path is None:
            raise ConfigError(["workers: a multi-process balancer needs a config file"])
        group = ProcessGroup(config, config_path)
        board = group.board  # Backend.load: the serving processes' sessions
    elif link is not None:
        board = Board(link.board, link.processes, link.index)
    if board is not None:
        for pool in pools:
            pool.shared = board
    state = ServerState(
        loop,
        config,
        pools,
        stats,
        board if link is not None else None,
        link.processes if link is not None else 1,
    )
    monitors: Monitors
    local_monitors: LocalMonitors | None = None
    if link is not None:
        assert board is not None
        monitors = BoardFollower(board, loop)
    else:
        monitors = local_monitors = LocalMonitors(stats, loop)
    # One handoff client (its pools of connections to the workers) for drains, operators'
    # moves and failovers.
    drainer = Drainer(state, HandoffClient(state))
    state.on_worker_lost = Failover(drainer.handoff).lost
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)  # process_*: CPU, memory, fds, start time (Linux)
    listeners = None if supervising else Listeners(state, config.listen, link is not None)
    local = LocalControl(
        state,
        drainer,
        monitors,
        registry,
        config_path,
        listeners.reload_certificates if listeners is not None else (lambda: None),
    )
    registry.register(
        BalancerCollector(
            stats, lambda: list(state.sessions), local.backend_views, lambda: state.connections
        )
    )
    control: Control = local
    cluster: Cluster | None = None
    if group is not None:
        fanout = FanoutControl(local, group.children)
        group.on_restart = fanout.replay
        control = fanout
        if local_monitors is not None:
            local_monitors.on_probe = fanout.worker_reports
    else:
        if local_monitors is not None:
            local_monitors.on_probe = local.worker_reports
        if config.cluster is not None:
            cluster = Cluster(local, config.cluster)
            registry.register(cluster.collector())
            control = ClusterControl(local, cluster)
            if local_monitors is not None:
                local_monitors.on_scrape = cluster.scraped
    admin = Admin(
        control,
        config.admin,
        link.admin_socket if link is not None else None,
        config.metrics.listen,
    )
    background: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if isinstance(control, FanoutControl):
        background.append(control.follow)
    handover = None
    if link is not None and link.processes > 1:  # a reconnect may land on a sibling
        handover = Handover(state, os.path.dirname(link.board), link.index, link.processes)
        state.fetch_session = handover.fetch
    return Runtime(
        state,
        monitors,
        drainer,
        local,
        control,
        admin,
        listeners=listeners,
        cluster=cluster,
        group=group,
        board=board if link is not None else None,
        background=tuple(background),
        handover=handover,
    )


async def serve(
    config: Config, config_path: str | None = None, link: ProcessLink | None = None
) -> int:
    """Run a balancer until SIGTERM or SIGINT; return the exit status.

    With ``workers: N`` above 1 this process is the supervisor of N serving processes
    (``multi.py``); ``link`` is given to each of those.
    """
    loop = asyncio.get_running_loop()
    rt = build(config, config_path, link)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def reload() -> None:
        async def run() -> None:
            try:
                await rt.control.reload()
            except ControlError as exc:
                log.error("reload failed, configuration unchanged:\n%s", exc.message)

        task = loop.create_task(run())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    # A signal during the start (etcd or a spawned worker slow to come) stops it there.
    starting = loop.create_task(rt.start())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.wait((starting,))
        log.info("stopped while starting")
        await rt.failed_start()
        return 0
    stopping.cancel()
    exc = starting.exception()
    if isinstance(exc, OSError | TimeoutError):
        log.error("cannot start: %s", exc)
        await rt.failed_start()
        return 1
    if exc is not None:
        await rt.failed_start()
        raise exc
    await stop.wait()
    log.info("shutting down")
    # A second signal skips the grace period.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.hurry.set)
    await rt.shutdown()
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
