"""What operators change, behind one interface: ``Control``.

The admin API (``admin.py``) is HTTP only: each route is one ``Control`` call, whose ``Reply``
it serialises (``ControlError`` becomes ``{"error": ...}`` with its status). Three
implementations, one per way a balancer is assembled (``app.py``):

- ``LocalControl`` (here): one process owns its pools and sessions: standalone, and each
  serving process of ``workers: N`` (whose admin API answers only its supervisor).
- ``ClusterControl`` (``cluster.py``): cluster mode; writes go to etcd and come back through
  the watch to the ``LocalControl`` of every instance; views add the shared state.
- ``FanoutControl`` (``fanout.py``): the supervisor of ``workers: N``; every call goes to each
  serving process and the answers are merged into one balancer's.

``LocalControl`` also holds the primitives the other two build on (``add``, ``remove``,
``remove_when_drained``, the reload of the file's backends), and the rule for what a worker's
own health report means (``worker_reports``: it drains itself, or is back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import psutil
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from balancer import frames
from balancer.aio.drain import Drainer
from balancer.aio.migrate import migrate
from balancer.aio.monitors import Monitors
from balancer.aio.state import ServerState
from balancer.config import BackendCfg, ConfigError, own_address, parse_backend, parse_duration
from balancer.config import load as load_config
from balancer.events import EventLog
from balancer.metrics import BackendView
from balancer.pool import ACTIVE, DRAINED, Backend, Change, Pool
from balancer.selection import MOVED, REFUSED

__all__ = ["Control", "ControlError", "LocalControl", "Reply", "backend_body", "new_backend"]

log = logging.getLogger("wslb")


class ControlError(Exception):
    """An operator's request that cannot be carried out: the HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Reply:
    """A JSON answer and its status (202 for a drain that started, 409 for a failed move)."""

    body: Any
    status: int = 200


class Control(Protocol):
    """Views and operator actions of one balancer, however it is assembled."""

    async def ready(self) -> Reply: ...

    async def metrics(self) -> bytes: ...

    async def backends(self) -> list[dict[str, Any]]: ...

    async def backend(self, backend_id: str) -> dict[str, Any]: ...

    async def sessions(self, backend_id: str | None) -> list[dict[str, Any]]: ...

    async def session(self, sid: str) -> dict[str, Any]: ...

    async def debug_stats(self) -> dict[str, Any]: ...

    async def add_backend(self, body: dict[str, Any]) -> Reply: ...

    async def remove_backend(self, backend_id: str) -> Reply: ...

    async def drain(self, backend_id: str, body: dict[str, Any]) -> Reply: ...

    async def undrain(self, backend_id: str) -> Reply: ...

    async def migrate(self, sid: str, body: dict[str, Any]) -> Reply: ...

    async def reload(self) -> Reply: ...

    async def restart(self, body: dict[str, Any] | None = None) -> Reply:
        """The code installed now takes over every listener and session (``aio/restart.py``);
        ``body``: a supervisor's request to one of its serving processes (``socket``)."""
        ...

    async def events(self, since: int, wait: float) -> tuple[list[dict[str, Any]], int]:
        """Events after ``since`` (waiting up to ``wait`` s for one) and the last sequence."""
        ...


async def wait_events(
    events: EventLog, since: int, wait: float
) -> tuple[list[dict[str, Any]], int]:
    """``Control.events`` over one log. A ``since`` past its end (a reader from before a
    restart) reads from its start."""
    if since > events.seq:
        since = 0
    got = events.since(since)
    if got or wait <= 0:
        return got, events.seq
    woken = asyncio.Event()

    def wake(_: dict[str, Any]) -> None:
        woken.set()

    events.listen(wake)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), wait)
    finally:
        events.unlisten(wake)
    return events.since(since), events.seq


def placement_counters(v: BackendView) -> dict[str, int]:
    """The backend's placement decisions (``balancer.selection``), flat so that ``workers: N``
    adds them up like the other counters: ``refused_REASON`` new keys that hashed here and went
    elsewhere, ``moved_REASON`` returning keys that left."""
    out = {f"refused_{r}": v.refused.get(r, 0) for r in REFUSED}
    out.update({f"moved_{r}": v.moved.get(r, 0) for r in MOVED})
    return out


def new_backend(state: ServerState, body: dict[str, Any]) -> tuple[Pool, BackendCfg]:
    """The pool (``pool`` in the body, else the first) and config of a backend to add."""
    body = dict(body)
    pool_name = body.pop("pool", None)
    pool = state.pools[0] if pool_name is None else state.pool(str(pool_name))
    if pool is None:
        raise ControlError(404, f"no pool {pool_name!r}")
    try:
        cfg = parse_backend(body)
    except ConfigError as exc:
        raise ControlError(400, "; ".join(exc.errors)) from None
    c = state.config
    problem = None if cfg.spawn else own_address(cfg, c.listen, c.admin, c.metrics)
    if problem is not None:
        raise ControlError(400, f"url: {problem}")
    return pool, cfg


def backend_body(b: Backend) -> dict[str, Any]:
    """The ``POST /backends`` body that adds ``b`` as it is configured (a serving process
    that restarted, a restart's new code)."""
    cfg = b.cfg
    body: dict[str, Any] = {"id": cfg.id, "url": cfg.url, "weight": cfg.weight}
    if cfg.spawn:
        body["spawn"] = cfg.spawn
    if cfg.args:
        body["args"] = list(cfg.args)
    if cfg.metrics_url:
        body["metrics_url"] = cfg.metrics_url
    return body


def drain_args(pool: Pool, body: dict[str, Any]) -> tuple[bool, float]:
    """``migrate`` and ``timeout`` of a drain request, the pool's defaults where absent."""
    migrate_ = body.get("migrate", pool.cfg.drain.migrate)
    if not isinstance(migrate_, bool):
        raise ControlError(400, "migrate must be true or false")
    try:
        timeout = parse_duration(body.get("timeout", pool.cfg.drain.timeout))
    except (ValueError, TypeError) as exc:
        raise ControlError(400, f"timeout: {exc}") from None
    return migrate_, timeout


class LocalControl:
    """The pools and sessions of this process (module docstring)."""

    def __init__(
        self,
        state: ServerState,
        drainer: Drainer,
        monitors: Monitors,
        registry: CollectorRegistry,
        config_path: str | None = None,
        reload_tls: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        self.drainer = drainer
        self.monitors = monitors
        self.registry = registry
        self.config_path = config_path
        self.reload_tls = reload_tls
        # Set by the composition root: the hot restart of this process (``aio/restart.py``);
        # it raises ``ControlError`` with the reason when the new code did not take over.
        self.restarter: Callable[[str | None], Awaitable[dict[str, Any]]] | None = None

    # -- primitives ------------------------------------------------------------------------

    def find(self, backend_id: str) -> tuple[Pool, Backend]:
        found = self.state.find_backend(backend_id)
        if found is None:
            raise ControlError(404, f"no backend {backend_id!r}")
        return found

    def add(self, pool: Pool, cfg: BackendCfg) -> Backend:
        """Add a backend and start watching it."""
        b = pool.add(cfg)
        self.monitors.watch(pool, b)
        log.info("added backend %s to pool %s", b.id, pool.name)
        self.state.emit("backend_added", backend=b.id, pool=pool.name)
        return b

    async def remove(self, pool: Pool, b: Backend) -> None:
        await self.monitors.unwatch(b)
        pool.remove(b.id)
        self.drainer.forget(b)
        log.info("removed backend %s from pool %s", b.id, pool.name)
        self.state.emit("backend_removed", backend=b.id, pool=pool.name)

    async def remove_when_drained(self, pool: Pool, b: Backend) -> None:
        """Remove ``b`` once its last session has ended (it is draining or drained)."""
        while b.load > 0 and pool.backends.get(b.id) is b:  # noqa: ASYNC110 (rare, coarse)
            await asyncio.sleep(0.5)
        if pool.backends.get(b.id) is b:
            await self.drainer.undrain(b)
            await self.remove(pool, b)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a fire-and-forget task (the state keeps it alive)."""
        self.state.spawn(coro)

    def worker_reports(self, b: Backend, ok: bool, draining: bool) -> str | None:
        """A health probe's answer: the worker drains itself (SIGTERM, pod termination), or a
        worker that did is healthy again (it restarted). Returns ``"drain"`` or ``"undrain"``
        when that changed the backend's state, else None."""
        if draining:
            found = self.state.find_backend(b.id)
            if found is not None and self.drainer.worker_drains(found[0], b):
                return "drain"
        elif ok and self.drainer.worker_back(b):
            return "undrain"
        return None

    # -- views -----------------------------------------------------------------------------

    def backend_views(self) -> Iterator[BackendView]:
        now = self.state.loop.time()
        for pool in self.state.pools:
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
                    overloaded=b.id in pool.overloaded,
                    held=b.held,
                    kv_headroom=b.kv_headroom,
                    refused=dict(b.refused),
                    moved=dict(b.moved),
                    health_reason=b.health_reason,
                    health_kind=b.health_kind,
                    health_since=b.health_since,
                    last_check=b.last_check,
                )

    def backend_json(self, v: BackendView) -> dict[str, Any]:
        found = self.state.find_backend(v.id)
        return {
            "id": v.id,
            "pool": v.pool,
            "url": found[1].url if found is not None else None,
            "state": v.state,
            "healthy": v.healthy,
            "health": {
                "ok": v.healthy,
                "reason": v.health_reason,
                "since": v.health_since,
                "last_check": v.last_check,
            },
            "weight": v.weight,
            "effective_weight": round(v.effective_weight, 4),
            "sessions": v.sessions,
            "held": v.held,
            "sessions_total": v.sessions_total,
            "signals": v.signals,
            "signals_age": None if v.scrape_age is None else round(v.scrape_age, 3),
            "signals_stale": v.stale,
            "overloaded": v.overloaded,
            "kv_headroom": None if v.kv_headroom is None else round(v.kv_headroom, 4),
            "ejected_for": round(v.ejected_for, 3),
            "ejections": v.ejections,
            "drain": self.drainer.view(found[1]) if found is not None else None,
            "sessions_remote": found[1].remote_sessions if found is not None else 0,
            "counters": {**self.counters(v.id), **placement_counters(v)},
        }

    def counters(self, backend_id: str) -> dict[str, int]:
        """What happened to the backend's sessions and checks in this process (the dashboard's
        migrations, failovers and errors columns)."""
        st = self.state.stats
        return {
            "migrated_away": st.migrated_away[backend_id],
            "failed_over": st.failed_over[backend_id],
            "connect_failures": st.connect_failures[backend_id],
            "health_check_failures": st.probe_failures[backend_id],
        }

    def watch_states(self) -> None:
        """From now on (the composition root calls it once serving starts), emit a ``state``
        event whenever a backend's state word changes (a health flip, an ejection or its end, a
        drain's progress), as it happens: the sources are many (probes, spawned processes,
        failover's probe, the board, drains, ejections), their one writer ``Backend`` tells
        its pool's listeners (``balancer.backend``)."""
        for pool in self.state.pools:
            pool.listen(self._state_changed)

    def _state_changed(self, pool: Pool, b: Backend, change: Change) -> None:
        if change.before != change.after:
            self.state.emit(
                "state",
                backend=b.id,
                pool=pool.name,
                **{"from": change.before, "to": change.after},
                reason=b.health_reason,
            )

    async def ready(self) -> Reply:
        if self.state.closing:
            return Reply({"status": "shutting down"}, 503)
        return Reply({"status": "ready"})

    async def metrics(self) -> bytes:
        return generate_latest(self.registry)

    async def backends(self) -> list[dict[str, Any]]:
        return [self.backend_json(v) for v in self.backend_views()]

    async def backend(self, backend_id: str) -> dict[str, Any]:
        for v in self.backend_views():
            if v.id == backend_id:
                return self.backend_json(v)
        raise ControlError(404, f"no backend {backend_id!r}")

    async def sessions(self, backend_id: str | None) -> list[dict[str, Any]]:
        return [
            s.describe()
            for s in self.state.sessions
            if backend_id is None or s.backend.id == backend_id
        ]

    async def session(self, sid: str) -> dict[str, Any]:
        s = self.state.find_session(sid)
        if s is None:
            raise ControlError(404, f"no live session {sid!r}")
        return s.describe()

    async def debug_stats(self) -> dict[str, Any]:
        """Process figures for soak tests: tasks, sessions, connections, RSS, open FDs, and
        which frame-scanner loop runs (``c``, or ``python`` where ``balancer._scan`` was not
        built)."""
        proc = psutil.Process()
        return {
            "tasks": len(asyncio.all_tasks()),
            "sessions": len(self.state.sessions),
            "connections": self.state.connections,
            "rss": proc.memory_info().rss,
            "fds": proc.num_fds(),
            "scanner": "c" if frames.ACCELERATED else "python",
        }

    # -- operator actions ------------------------------------------------------------------

    async def add_backend(self, body: dict[str, Any]) -> Reply:
        pool, cfg = new_backend(self.state, body)
        if self.state.find_backend(cfg.id) is not None:
            raise ControlError(409, f"backend {cfg.id!r} exists")
        b = self.add(pool, cfg)
        return Reply({"id": b.id, "pool": pool.name, "state": b.state}, 201)

    async def remove_backend(self, backend_id: str) -> Reply:
        pool, b = self.find(backend_id)
        if b.admin_state != DRAINED or b.load:
            raise ControlError(409, f"backend {b.id!r} is {b.state}; drain it first")
        await self.remove(pool, b)
        return Reply({"id": b.id, "removed": True})

    async def drain(self, backend_id: str, body: dict[str, Any]) -> Reply:
        pool, b = self.find(backend_id)
        migrate_, timeout = drain_args(pool, body)
        if b.admin_state == DRAINED:  # nothing to do: drains are idempotent
            return Reply(await self.backend(b.id))
        self.drainer.start(pool, b, migrate_, timeout)
        return Reply(await self.backend(b.id), 202)

    async def undrain(self, backend_id: str) -> Reply:
        _, b = self.find(backend_id)
        await self.drainer.undrain(b)
        return Reply(await self.backend(b.id))

    async def migrate(self, sid: str, body: dict[str, Any]) -> Reply:
        to = body.get("to")
        if to is not None and not isinstance(to, str):
            raise ControlError(400, "to must be a backend id")
        session = self.state.find_session(sid)
        if session is None:
            raise ControlError(404, f"no live session {sid!r}")
        result = await migrate(self.drainer.handoff, session, to)
        out = {
            "session": sid,
            "migrated": result.ok,
            "result": result.reason,
            "backend": session.backend.id,
            "pause_ms": None if result.pause is None else round(result.pause * 1e3, 2),
        }
        return Reply(out, 200 if result.ok else 409)

    async def events(self, since: int, wait: float) -> tuple[list[dict[str, Any]], int]:
        return await wait_events(self.state.events, since, wait)

    async def restart(self, body: dict[str, Any] | None = None) -> Reply:
        if self.restarter is None:
            raise ControlError(501, "this process cannot restart itself")
        path = (body or {}).get("socket")
        if path is not None and not isinstance(path, str):
            raise ControlError(400, "socket must be a path")
        return Reply(await self.restarter(path))

    async def reload(self, backends: bool = True) -> Reply:
        """``reread`` as the admin API's answer, with its event; ``backends``: as there."""
        try:
            report = await self.reread(backends)
        except ConfigError as exc:
            self.state.emit("reload", ok=False, error="; ".join(exc.errors))
            raise ControlError(400, "; ".join(exc.errors)) from None
        self.state.emit("reload", ok=True, report=report)
        return Reply(report)

    async def reread(self, backends: bool = True) -> dict[str, Any]:
        """Reread the config file: backends and weights change; live sessions stay put.

        A backend gone from the file stops taking sessions (draining, without migration) and is
        removed once its sessions have ended. Other settings need a restart; they are listed.
        ``backends`` False (cluster mode: they live in etcd) leaves the pools alone.
        """
        if self.config_path is None:
            raise ConfigError(["no config file to reload"])
        new = load_config(self.config_path)
        current = self.state.config
        report: dict[str, Any] = {"added": [], "removed": [], "updated": [], "ignored": []}
        try:
            self.reload_tls()
            self.state.forget_upstream_tls()
        except (OSError, ssl.SSLError) as exc:
            report["ignored"].append(f"certificates not reloaded: {exc}")
        if not backends:
            report["ignored"].append("backends: in cluster mode they live in etcd (admin API)")
        for pcfg in new.pools if backends else ():
            pool = self.state.pool(pcfg.name)
            if pool is None:
                continue  # a new pool: below
            wanted = {b.id: b for b in pcfg.backends}
            for bid, bcfg in wanted.items():
                cur = pool.backends.get(bid)
                if cur is None:
                    self.add(pool, bcfg)
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
                self.spawn(self.remove_when_drained(pool, b))
                report["removed"].append(bid)
        # What needs a restart. (In cluster mode too: only the backends live in etcd.)
        for pcfg in new.pools:
            if self.state.pool(pcfg.name) is None:
                report["ignored"].append(f"new pool {pcfg.name} (restart to add pools)")
                continue
            changed = _changed(current.pool(pcfg.name), pcfg, ("name", "backends"))
            if changed:
                keys = ", ".join(changed)
                report["ignored"].append(f"pool {pcfg.name}: {keys} (restart to apply)")
        names = {p.name for p in new.pools}
        for pcfg in current.pools:
            if pcfg.name not in names:
                report["ignored"].append(f"pool {pcfg.name} removed (restart to remove pools)")
        changed = _changed(current, new, ("pools", "source"))
        if changed:
            report["ignored"].append(f"{', '.join(changed)} (restart to apply)")
        done = "; ".join(
            f"{what} {', '.join(map(str, items))}"
            for what, items in report.items()
            if what != "ignored" and isinstance(items, list) and items
        )
        log.info("reloaded %s: %s", self.config_path, done or "no backend changed")
        for what in report["ignored"]:
            log.warning("reload of %s did not apply: %s", self.config_path, what)
        return report


def _changed(old: Any, new: Any, skip: tuple[str, ...]) -> list[str]:
    """Names of the dataclass fields that differ between ``old`` and ``new``, but ``skip``."""
    if old is None:
        return []
    return [
        f.name
        for f in fields(new)
        if f.name not in skip and getattr(old, f.name) != getattr(new, f.name)
    ]
