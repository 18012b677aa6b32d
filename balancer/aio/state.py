"""The narrow shared state every connection and session of one serving process sees.

uvicorn hands each protocol object a small ``ServerState`` (connections, tasks, default headers)
rather than the server; wslb does the same. A ``ClientConnection``, a ``Session``, a migration
and a drain get this object and nothing else of the balancer: the pools they route over, the
live sessions and connection counts, the shared timer wheel, the counters, the TLS contexts
towards workers and the handoff HTTP client. What operators change goes through ``control.py``;
how the parts are built and run is ``app.py``'s business.

Sessions get their timeouts and limits when they are built (``session.SessionSettings``, one
object per pool shared by its sessions), so a session never reaches back for the config; what
a session uses of this object is ``session.SessionHost``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from balancer import workerauth
from balancer.aio.httpproxy import Exchange, Keepalive
from balancer.aio.lanes import Lanes
from balancer.aio.offload import Offload
from balancer.aio.peers import Splice
from balancer.aio.session import Session, SessionSettings
from balancer.aio.wheel import TimerWheel
from balancer.auth import Authenticator
from balancer.board import Board
from balancer.config import Config
from balancer.events import EventLog
from balancer.handshake import ClientRequest
from balancer.logs import log_access
from balancer.metrics import Stats
from balancer.pool import Backend, Pool
from balancer.resume import FailureThrottle, same_token, token_digest

__all__ = ["ServerState"]

log = logging.getLogger("wslb")


class ServerState:
    """Pools, live sessions, connection counts, closing, counters and timers of one process."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        config: Config,
        pools: list[Pool],
        stats: Stats,
        board: Board | None = None,
        processes: int = 1,
    ) -> None:
        """``board`` and ``processes``: a serving process of ``workers: N`` counts
        ``max_connections`` over the board and enforces its share of the per-client limit."""
        self.loop = loop
        self.config = config
        self.timeouts = config.timeouts
        self.limits = config.limits
        self.trusted_proxies = config.trusted_proxies
        self.pools = pools
        self.stats = stats
        self.board = board
        self.wheel = TimerWheel(loop)  # the sessions' timers (heartbeat, idle, close)
        self.auth = Authenticator(config.auth)
        workerauth.spawn_token()  # made before any child starts, so all of them inherit it
        # Per client address; the kernel spreads one client's connections over the serving
        # processes of workers: N by port, so each enforces its share.
        self.per_client_limit = -(-config.limits.max_connections_per_client // processes)
        self.sessions: dict[Session, None] = {}
        self.by_sid: dict[str, Session] = {}  # the live session of each key (resume, admin)
        self.detached_sessions: dict[Session, None] = {}  # waiting for their client (Rule 8)
        # Rule 8: every session with a resume token, by the token's digest. A token belongs to
        # one session: a new session on a key never hides the detached one its client resumes.
        self.by_token: dict[bytes, Session] = {}
        # Failed resumes per pool and client address (a token is a secret: guessing stays slow).
        self._resume_failures: dict[str, FailureThrottle] = {}
        # workers: N: a session another serving process holds, adopted here (handover.py).
        self.fetch_session: Callable[[str, str, Any], Awaitable[Session | None]] | None = None
        # A restart's new code while the old one is still handing its sessions on: a resume
        # for one not here yet waits for it (aio/restart.py) instead of a 409.
        self.arriving: asyncio.Event | None = None
        # Cluster mode: the other live instances' client listeners, for a resume this one does
        # not hold (aio/peers.py), and the connections this one carries to them.
        self.peers: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None
        self.carried: set[Splice] = set()
        self.connections = 0
        self.per_client: Counter[str] = Counter()  # open connections per client address
        self.closing = False
        self.offload: Offload | None = None  # the relay thread, set while serving (app.py)
        self.lanes: Lanes | None = None  # the lane thread (plain HTTP), likewise
        # Longest prefix first; for one prefix, the pools naming a model before the one that
        # names none.
        self._routes = sorted(
            pools, key=lambda p: (len(p.cfg.path_prefix), p.cfg.model is not None), reverse=True
        )
        self._settings: dict[str, SessionSettings] = {}
        self._upstream_tls: dict[str, ssl.SSLContext] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Crash failover (``failover.Failover.lost``), set where the process is built; without
        # it a lost worker leg ends its session (1011).
        self.on_worker_lost: Callable[[Session], None] | None = None
        self.events = EventLog()  # the feed of GET /events (balancer/events.py)
        # Plain HTTP (aio/httpproxy.py): idle worker connections, and the requests in flight
        # (a drain waits for those on its worker, a shutdown for all of them).
        self.keepalive = Keepalive()
        self.requests: dict[Exchange, None] = {}

    # -- routing and admission -------------------------------------------------------------

    def route(self, path: str, model: str | None = None) -> Pool | None:
        """The pool whose path prefix is the longest match for the request path, among those
        that serve ``model`` (the ``?model=`` parameter) or name no model."""
        for pool in self._routes:
            cfg = pool.cfg
            if path.startswith(cfg.path_prefix) and cfg.model in (None, model):
                return pool
        return None

    def models(self, path: str) -> list[str]:
        """The models pools serve on ``path`` (a 404 names them)."""
        return sorted(
            {
                p.cfg.model
                for p in self._routes
                if p.cfg.model and path.startswith(p.cfg.path_prefix)
            }
        )

    def authorize(self, req: ClientRequest) -> tuple[str | None, str | None]:
        """Origin allow-list (403) and JWT (401); whom the sessions belong to (None without
        JWT: keys are bearer secrets) and the session key a claim gives, if any."""
        claims = self.auth.check(req)
        return self.auth.owner(claims), self.auth.session_key(claims)

    def at_capacity(self) -> bool:
        """``limits.max_connections`` reached, over every serving process of ``workers: N``."""
        if self.board is not None:
            return self.board.connections() >= self.limits.max_connections
        return self.connections >= self.limits.max_connections

    def settings(self, pool: Pool) -> SessionSettings:
        """The settings a session of ``pool`` is built with."""
        s = self._settings.get(pool.name)
        if s is None:
            s = self._settings[pool.name] = SessionSettings.of(
                self.config, pool.cfg.drain.migrate, pool.cfg.failover, pool.cfg.resume
            )
        return s

    def emit(self, kind: str, **fields: Any) -> None:
        """An event for the feed (``balancer/events.py``), at the current wall time."""
        self.events.emit(kind, self.wall_time(), **fields)

    def worker_failed(self, pool: Pool, backend: Backend) -> None:
        """A connect or handshake to the worker failed: passive outlier detection."""
        if pool.failed(backend, self.loop.time()):
            # Its return is a ``state`` event on time, not at the next selection's refresh.
            self.loop.call_at(backend.ejected_until, pool.readmit, backend.ejected_until)
            self.stats.ejections[backend.id] += 1
            log.warning(
                "backend %s ejected for %.0fs after repeated failures",
                backend.id,
                backend.ejected_until - self.loop.time(),
            )

    def upstream_ssl(self, backend: Backend) -> ssl.SSLContext | None:
        """TLS context for a ``wss://`` or ``https://`` worker: its pool's CA and client
        certificate."""
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

    def worker_token(self, backend: Backend, *, handoff: bool) -> str | None:
        """The credential wslb shows this worker (``balancer.workerauth``), or None: the
        handoff one on wslb's own freeze, thaw and resumed upgrade, else the proxied one."""
        found = self.find_backend(backend.id)
        if found is None:
            return None
        return workerauth.credential_for(found[0].cfg, backend.cfg, handoff=handoff)

    def forget_upstream_tls(self) -> None:
        """Reread upstream TLS files on the next connection (a reload)."""
        self._upstream_tls.clear()

    # -- counts ----------------------------------------------------------------------------

    def connection_opened(self, peer: str) -> None:
        self.connections += 1
        self.per_client[peer] += 1
        if self.board is not None:
            self.board.publish_connections(self.connections)

    def client_renamed(self, old: str, new: str) -> None:
        """A trusted proxy named the client of a counted connection: count it under that."""
        self._uncount(old)
        self.per_client[new] += 1

    def connection_closed(self, peer: str) -> None:
        self.connections -= 1
        if self.board is not None:
            self.board.publish_connections(self.connections)
        self._uncount(peer)

    def _uncount(self, peer: str) -> None:
        n = self.per_client[peer] - 1
        if n > 0:
            self.per_client[peer] = n
        else:
            del self.per_client[peer]

    def session_started(self, s: Session) -> None:
        self.sessions[s] = None
        self.by_sid[s.sid] = s
        self._idle.clear()

    def detached(self, s: Session, on: bool, counted: bool = True) -> None:
        """Rule 8: a session's client left without a close (``on``), or came back."""
        if on:  # its client connection is gone: uncounted now, not when the session ends
            self.detached_sessions[s] = None
            if counted:
                self.connection_closed(s.peer)
        else:  # the reconnect's connection (counted when accepted) is the session's now
            self.detached_sessions.pop(s, None)
        self.stats.detached = len(self.detached_sessions)
        if on and counted:
            self.emit("detached", session=s.sid, backend=s.backend.id, grace_s=s.core.grace)

    def resume_failures(self, pool: Pool) -> FailureThrottle:
        """The failed resumes of ``pool``'s clients (``resume.max_failures``), made anew when a
        reload changes its settings."""
        cfg = pool.cfg.resume
        t = self._resume_failures.get(pool.name)
        if t is None or (t.limit, t.window) != (cfg.max_failures, cfg.failure_window):
            t = self._resume_failures[pool.name] = FailureThrottle(
                cfg.max_failures, cfg.failure_window
            )
        return t

    def token_bound(self, s: Session, old: str | None) -> None:
        """``s`` took resume token ``s.resume_token`` (``old``: its previous one)."""
        if old is not None:
            self._unbind(s, old)
        if s.resume_token is not None:
            self.by_token[token_digest(s.resume_token)] = s

    def _unbind(self, s: Session, token: str | None) -> None:
        if token is not None:
            digest = token_digest(token)
            if self.by_token.get(digest) is s:
                del self.by_token[digest]

    def worker_lost(self, s: Session) -> None:
        if self.on_worker_lost is None or self.closing:
            s.worker_gone()
        else:
            self.on_worker_lost(s)

    def handed_off(self, s: Session) -> None:
        """A session another serving process adopted: gone from here, not finished."""
        self.sessions.pop(s, None)
        self._unbind(s, s.resume_token)
        if self.by_sid.get(s.sid) is s:
            del self.by_sid[s.sid]
        if s in self.detached_sessions:
            del self.detached_sessions[s]
            self.stats.detached = len(self.detached_sessions)
        else:
            self.connection_closed(s.peer)
        if not self.sessions and not self.requests:
            self._idle.set()

    def session_finished(self, s: Session) -> None:
        self.sessions.pop(s, None)
        self._unbind(s, s.resume_token)
        if self.by_sid.get(s.sid) is s:
            del self.by_sid[s.sid]
        if s in self.detached_sessions:  # its client never came back
            del self.detached_sessions[s]
            self.stats.detached = len(self.detached_sessions)
        else:
            self.connection_closed(s.peer)
        self.stats.session_done(s, self.loop.time())
        if self.config.log.access:
            log_access(s)
        if not self.sessions and not self.requests:
            self._idle.set()

    def request_started(self, ex: Exchange) -> None:
        self.requests[ex] = None
        self._idle.clear()

    def request_finished(self, ex: Exchange) -> None:
        self.requests.pop(ex, None)
        if not self.sessions and not self.requests:
            self._idle.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a fire-and-forget task (kept alive until it ends: asyncio holds weak ones)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Until no session is live and no plain HTTP request in flight."""
        await self._idle.wait()

    # -- lookups ---------------------------------------------------------------------------

    def find_session(self, sid: str) -> Session | None:
        """The newest live session of key ``sid`` (admin, failover)."""
        return self.by_sid.get(sid)

    def find_resumable(self, token: str) -> Session | None:
        """Rule 8: the session ``token`` belongs to, of whatever key (the caller checks the
        key: a token of another key is not a resume, and another key's session never is)."""
        s = self.by_token.get(token_digest(token))
        return s if s is not None and same_token(s.resume_token, token) else None

    def find_backend(self, backend_id: str) -> tuple[Pool, Backend] | None:
        for pool in self.pools:
            b = pool.backends.get(backend_id)
            if b is not None:
                return pool, b
        return None

    def pool(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)

    def backends(self) -> Iterator[tuple[Pool, Backend]]:
        for pool in self.pools:
            for b in pool.backends.values():
                yield pool, b

    @staticmethod
    def wall_time() -> float:
        return time.time()
