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
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from balancer import frames
from balancer.aio import lanes, offload, tls
from balancer.aio.admin import Admin
from balancer.aio.cluster import Cluster, ClusterControl
from balancer.aio.control import Control, ControlError, LocalControl, new_backend
from balancer.aio.drain import Drainer
from balancer.aio.failover import Failover
from balancer.aio.fanout import FanoutControl
from balancer.aio.handoff import HandoffClient
from balancer.aio.handover import Handover
from balancer.aio.loops import GcPacer
from balancer.aio.monitors import BoardFollower, LocalMonitors, Monitors
from balancer.aio.multi import ProcessGroup
from balancer.aio.proxy import ClientConnection
from balancer.aio.restart import Handed, Restarter, RestartError, TakeOver, announce, exec_now
from balancer.aio.state import ServerState
from balancer.auth import key_owner
from balancer.board import Board
from balancer.config import Config, ConfigError, Listener, ListenError
from balancer.frames import CloseCode
from balancer.logs import count
from balancer.metrics import HTTP_BUCKETS, BalancerCollector, Stats
from balancer.pool import Pool
from balancer.resume import HANDOVER_REASON
from balancer.version import version

__all__ = ["ProcessLink", "Runtime", "build", "run", "run_loop", "serve"]

log = logging.getLogger("wslb")

HANDOVER_POLL = 0.01  # a session in the middle of a message is tried again this much later


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

    def __init__(
        self,
        state: ServerState,
        listen: tuple[Listener, ...],
        reuse_port: bool,
        default: bool = False,
    ) -> None:
        """``default``: the file set no ``listen`` (a taken port says so)."""
        self.state = state
        self.listen = listen
        self.reuse_port = reuse_port
        self.default = default
        self._servers: list[asyncio.Server] = []
        self._tls: list[tuple[ssl.SSLContext, str, str]] = []
        self._factories: list[Callable[[], asyncio.BaseProtocol]] = []
        self.adopted: list[socket.socket] | None = None  # a restart's: the old code's sockets
        self._spare: list[socket.socket] = []  # copies kept while a restart hands on
        self._handshakes: tls.Admission[tls.TlsGate] = tls.Admission()  # all TLS listeners'

    async def start(self) -> None:
        for i, lst in enumerate(self.listen):
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
                factory = tls.gate_factory(
                    ctx, app, self.state.timeouts.handshake, self._failed, self._handshakes
                )
            self._factories.append(factory)
            if self.adopted is not None and i < len(self.adopted):
                server = await self.state.loop.create_server(
                    factory, sock=self.adopted[i], backlog=4096
                )
                log.info("listening on %s:%d (the old code's socket)", lst.host, lst.port)
            else:
                try:
                    server = await self.state.loop.create_server(
                        factory,
                        lst.host,
                        lst.port,
                        backlog=4096,
                        reuse_address=True,
                        reuse_port=self.reuse_port,
                    )
                except OSError as err:
                    key = "listen" if len(self.listen) == 1 else f"listen[{i}]"
                    raise ListenError(key, str(lst), err, self.default) from None
                log.info("listening on %s:%d", lst.host, lst.port)
            self._servers.append(server)

    def fds(self) -> list[int]:
        """The listening sockets' descriptors, in the config's order (a restart hands them
        on)."""
        return [server.sockets[0].fileno() for server in self._servers]

    def stop_accepting(self) -> None:
        """A restart's taker listens on these sockets now: stop accepting here, keeping a
        copy of each to listen again if it fails."""
        self._spare = [socket.socket(fileno=os.dup(fd)) for fd in self.fds()]
        for server in self._servers:
            server.close()
        self._servers = []

    async def accept_again(self) -> None:
        for factory, sock in zip(self._factories, self._spare, strict=False):
            self._servers.append(
                await self.state.loop.create_server(factory, sock=sock, backlog=4096)
            )
        self._spare = []

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
    config_path: str | None = None

    def __post_init__(self) -> None:
        self.gc_pacer = GcPacer(self.state.loop)
        self.hurry = asyncio.Event()  # set by a second signal: skip the grace period
        self.stop = asyncio.Event()  # SIGTERM, SIGINT, or a restart's end
        self.then_exec: list[str] | None = None  # a restart's end: become the keeper
        self.handed_on = False  # a restart's end: the sessions live in the new code
        self.successor = 0  # and the pid of the process that has them
        self._publisher: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []

    # -- a hot restart (``aio/restart.py``'s ``Host``) ---------------------------------------

    def handed(self) -> Handed:
        sock, metrics, token, generated = self.admin.handed()
        return Handed(
            self.listeners.fds() if self.listeners is not None else [],
            sock,
            metrics,
            token,
            generated,
        )

    def cluster_instance(self) -> str | None:
        return self.cluster.instance if self.cluster is not None else None

    async def stop_accepting(self) -> None:
        """The new code accepts from here on, the admin API's connects too: a request after
        the new code answered one must not reach the old (it would see a restart running)."""
        if self.listeners is not None:
            self.listeners.stop_accepting()
        await self.admin.stop_listening(keep=True)

    async def accept_again(self) -> None:
        if self.listeners is not None:
            await self.listeners.accept_again()
        await self.admin.listen_again()
        if self.state.lanes is not None:  # the restart failed: serve lanes again
            self.state.lanes.stopping = False

    def done(self, then_exec: list[str] | None, successor: int) -> None:
        self.handed_on = True
        self.then_exec = then_exec
        self.successor = successor
        self.admin.release_token()
        self.state.spawn(self._hand_admin_on())

    async def _hand_admin_on(self) -> None:
        """The restart's own answer is being written: accept no admin request more here (the
        new code answers them), then stop."""
        await asyncio.sleep(0)
        await self.admin.stop_listening()
        await asyncio.sleep(0.2)
        self.stop.set()

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
                self.state.loop, self.state.stats.relay_thread, HTTP_BUCKETS
            )  # Rule 7 of session.py
        elif self.listeners is not None and self.state.config.relay.thread:
            log.info("relay thread: off (balancer._offload is not built, or WSLB_PURE_PYTHON)")
        if self.state.offload is not None and lanes.AVAILABLE:
            self.state.lanes = lanes.Lanes(
                self.state.offload, self.state.stats, self.state.config.log.access
            )  # plain HTTP's steady state (aio/lanes.py), in the same thread
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

    async def _hand_over(self, deadline: float) -> None:
        """Before the grace: each session whose worker parks it is handed over (its worker
        keeps it, its client is told to resume through another instance), at its next
        message boundary; carried connections (``aio/peers.py``) are dropped, so their clients
        resume again. Sessions on other servers keep relaying through the grace."""
        state = self.state
        for splice in list(state.carried):
            splice.end()
        handed = 0
        while True:
            left = [s for s in state.sessions if s.parks and s.core.window is not None]
            if not left or state.loop.time() >= deadline:
                break
            now = sum(s.hand_over(CloseCode.SERVICE_RESTART, HANDOVER_REASON) for s in left)
            handed += now
            if now < len(left):  # some were mid-message: their turn comes next
                await asyncio.sleep(HANDOVER_POLL)
        if handed:
            log.info("shutdown: %s handed over to their workers", count(handed, "session"))

    async def shutdown(self) -> None:
        """Graceful stop; see the module docstring."""
        state = self.state
        if state.closing:
            return
        state.closing = True
        if self.handed_on:
            await self._after_restart()
            return
        t = state.timeouts
        if self.group is not None:
            await self.group.stop(self.hurry)
        if self.listeners is not None:
            self.listeners.close()
        if state.lanes is not None:  # lanes come back at their next boundary, then close
            state.lanes.stop()
            await state.lanes.wait_empty(t.shutdown_grace)
        await self._hand_over(state.loop.time() + t.shutdown_grace)
        if state.sessions or state.requests:
            log.info(
                "shutdown: waiting up to %.1fs for %s and %s",
                t.shutdown_grace,
                count(len(state.sessions), "session"),
                count(len(state.requests), "HTTP request"),
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
        if state.lanes is not None:
            state.lanes.close()
            state.lanes = None
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

    async def _after_restart(self) -> None:
        """The new code has the listeners, the sessions and the spawned workers: stop the
        rest here, touching none of them (a session that was closing ends first, bounded)."""
        state = self.state
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle(), state.timeouts.close + 0.5)
        for s in list(state.sessions):
            s.abort()
        if state.offload is not None:
            state.offload.close()
            state.offload = None
        if state.lanes is not None:
            state.lanes.close()
            state.lanes = None
        await self.drainer.stop()
        if self.handover is not None:
            await self.handover.stop()
        await self.stop_monitors()
        await self.monitors.release_workers()
        # The admin API is not stopped: it accepts nothing since the hand-on, and a clean stop
        # would wait for a supervisor's long poll (or remove a Unix socket's path, the new
        # code's now); the process's exit ends what is left.
        if self.board is not None:
            self.board.close()

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
    client_of = key_owner if config.auth.jwt is not None else None  # affinity_hold_per_client
    pools = [Pool(p, client_of=client_of) for p in config.pools]
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
        local_monitors.tls = state.upstream_ssl
    # One handoff client (its pools of connections to the workers) for drains, operators'
    # moves and failovers.
    drainer = Drainer(state, HandoffClient(state))
    state.on_worker_lost = Failover(drainer.handoff).lost
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)  # process_*: CPU, memory, fds, start time (Linux)
    listeners = (
        None
        if supervising
        else Listeners(state, config.listen, link is not None, config.listen_default)
    )
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
            stats,
            lambda: list(state.sessions),
            local.backend_views,
            lambda: state.connections,
            before=lambda: state.lanes.flush() if state.lanes is not None else None,
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
            state.peers = cluster.peers  # a resume held by another instance (aio/peers.py)
            registry.register(cluster.collector())
            control = ClusterControl(local, cluster)
            if local_monitors is not None:
                local_monitors.on_scrape = cluster.scraped
    admin = Admin(
        control,
        config.admin,
        link.admin_socket if link is not None else None,
        config.metrics.listen,
        head_timeout=config.timeouts.handshake,
    )
    background: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if isinstance(control, FanoutControl):
        background.append(control.follow)
    handover = None
    if link is not None and link.processes > 1:  # a reconnect may land on a sibling
        handover = Handover(state, os.path.dirname(link.board), link.index, link.processes)
        state.fetch_session = handover.fetch
    rt = Runtime(
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
        config_path=config_path,
    )
    if listeners is not None:  # a process with sessions restarts (its supervisor's asks it)
        restarter = Restarter(rt)

        async def restart(path: str | None) -> dict[str, Any]:
            if link is not None and path is None:
                raise ControlError(409, "a serving process is restarted by its supervisor")
            try:
                return await restarter.restart(path)
            except RestartError as exc:
                status = 409 if exc.reason == "busy" else 500
                raise ControlError(status, f"restart failed ({exc.reason}): {exc.detail}") from None

        local.restarter = restart
    return rt


async def serve(
    config: Config,
    config_path: str | None = None,
    link: ProcessLink | None = None,
    take_over: str | None = None,
) -> int:
    """Run a balancer until SIGTERM or SIGINT; return the exit status.

    With ``workers: N`` above 1 this process is the supervisor of N serving processes
    (``multi.py``); ``link`` is given to each of those. ``take_over``: a restart's new code,
    taking the listeners and sessions of the process serving that Unix socket.
    """
    loop = asyncio.get_running_loop()
    rt = build(config, config_path, link)
    stop = rt.stop

    def passed_on(sig: int) -> bool:
        """After a restart handed everything on, a signal is for the new code."""
        if rt.handed_on and rt.successor:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rt.successor, sig)
            return True
        return False

    def stop_signal(sig: int) -> None:
        if not passed_on(sig):
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_signal, sig)
    tasks: set[asyncio.Task[Any]] = set()

    def background(coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def reload() -> None:
        if passed_on(signal.SIGHUP):
            return

        async def run() -> None:
            try:
                await rt.control.reload()
            except ControlError as exc:
                log.error("reload failed, configuration unchanged:\n%s", exc.message)

        background(run())

    def restart() -> None:
        if passed_on(signal.SIGUSR2):
            return

        async def run() -> None:
            try:
                await rt.control.restart()
            except ControlError as exc:
                log.error("SIGUSR2: %s", exc.message)

        background(run())

    loop.add_signal_handler(signal.SIGHUP, reload)
    loop.add_signal_handler(signal.SIGUSR2, restart)
    taker: TakeOver | None = None
    if take_over is not None:
        taker = TakeOver(take_over)
        try:
            await take_listeners(rt, taker)
        except (OSError, ValueError, KeyError) as err:
            log.error("restart: could not take over from the running wslb: %r", err)
            return 1
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
    if taker is not None:
        await taker.listening()
        background(taker.sessions(rt.state, lambda: took_over(rt, taker.body, taker.adopted)))
    await stop.wait()
    log.info("handed on to the new code" if rt.handed_on else "shutting down")
    # A second signal skips the grace period.
    if not rt.handed_on:

        def hurry(sig: int) -> None:
            if not rt.hurry.is_set():  # the serving processes of workers: N say their own
                left = "" if rt.group else f", closing {count(len(rt.state.sessions), 'session')}"
                log.info(
                    "second %s: skipping the rest of timeouts.shutdown_grace%s",
                    signal.Signals(sig).name,
                    left,
                )
            rt.hurry.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, hurry, sig)
    await rt.shutdown()
    if rt.then_exec is not None:
        exec_now(rt.then_exec)  # the keeper, in this pid (does not return)
    return 0


async def take_listeners(rt: Runtime, taker: TakeOver) -> None:
    """A restart's new code, before it starts: the old code's listeners and states."""
    body, socks = await taker.listeners()
    rt.state.arriving = asyncio.Event()  # until the last session came (TakeOver.sessions)
    n = int(body["listen"])
    if rt.listeners is not None:
        rt.listeners.adopted = socks[:n]
    rest = socks[n:]
    admin_sock = rest.pop(0) if body.get("admin") else None
    metrics_sock = rest.pop(0) if body.get("metrics") else None
    rt.admin.adopt(admin_sock, metrics_sock, body.get("token"), bool(body.get("generated")))
    if rt.cluster is not None and body.get("cluster_instance"):
        rt.cluster.instance = str(body["cluster_instance"])  # its place in etcd, kept
    if isinstance(rt.monitors, LocalMonitors):
        rt.monitors.adopt = {str(k): int(v) for k, v in body.get("spawned", {}).items()}
    now = time.time()
    for bid, was in body.get("backends", {}).items():
        if rt.state.find_backend(bid) is None and "spec" in was:  # added at run time
            try:
                pool, cfg = new_backend(rt.state, {**was["spec"], "pool": was["pool"]})
            except ControlError as exc:
                log.warning("restart: backend %s cannot be added here: %s", bid, exc.message)
                continue
            rt.local.add(pool, cfg)
    known = body.get("backends", {})
    for pool, b in list(rt.state.backends()):
        if known and b.id not in known:  # removed at run time: not back from the file
            await rt.local.remove(pool, b)
    for _, b in rt.state.backends():
        was = body.get("backends", {}).get(b.id)
        if was is None:
            continue
        b.set_health(bool(was["healthy"]), was.get("reason"), "restart", now)
        if was.get("admin") in ("draining", "drained"):
            b.set_admin("drained" if was["admin"] == "drained" else "draining")


def took_over(rt: Runtime, body: dict[str, Any], adopted: int) -> None:
    """Every session is here: the drains go on here, and the keeper learns who serves."""
    announce(os.getpid())
    frm = body.get("from", {})
    rt.state.emit(
        "restart",
        phase="taken",
        sessions=adopted,
        version=version(),
        old_pid=frm.get("pid"),
        old_version=frm.get("version"),
    )
    for bid, d in body.get("drains", {}).items():
        found = rt.state.find_backend(bid)
        if found is None:
            continue
        pool, b = found
        rt.drainer.start(
            pool,
            b,
            bool(d["migrate"]),
            float(d["timeout_left"]),
            by_worker=bool(d.get("by_worker")),
        )


def run(config: Config, config_path: str | None = None, take_over: str | None = None) -> int:
    """Run a balancer on a uvloop event loop (the process's main job); ``take_over``: a
    restart's new code (``aio/restart.py``)."""
    return run_loop(serve(config, config_path, take_over=take_over))


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` to completion on a uvloop event loop."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        return runner.run(main)
