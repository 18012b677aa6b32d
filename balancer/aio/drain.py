"""Draining a worker: no new sessions, live ones migrated or closed gracefully, then drained.

States of a backend's drain (``Backend.admin_state``):

    active --drain--> draining --all sessions gone--> drained --DELETE--> removed
       ^                 |  \\--timeout: the rest closed with 1012--/
       \\----undrain-----/------------------undrain------------------/

While draining, the backend's ring points are skipped (it is not ready), so migration targets and
new sessions go where the ring sends them as if it were gone. With ``migrate`` each live session
is moved by the handoff protocol (``migrate.py``); a session that cannot move (the worker has no
handoff API, a bound was exceeded, a step failed) gets the graceful fallback: it is closed with
1012 once its current answer is over (the worker has been quiet for ``QUIET`` seconds after its
last message, with no client message waiting for an answer), so the client reconnects with the
same key and lands elsewhere.

Plain HTTP requests (``httpproxy.py``) get no new ones either; those in flight finish, until
the same ``timeout``, after which they are cut (``requests_cut``). The idle kept-alive
connections to the worker are closed at the start.

Who drained it matters for undoing it. A worker that reports ``503 draining`` on its health
endpoint (SIGTERM, pod termination) is drained by wslb (``worker_drains``) and undrained once it
is healthy again (``worker_back``: it restarted); an operator's drain (``start``) is never undone
by probes. That bookkeeping lives here alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from balancer.aio.handoff import HandoffClient
from balancer.aio.migrate import migrate
from balancer.aio.session import Mode, Session
from balancer.aio.state import ServerState
from balancer.frames import CloseCode
from balancer.logs import count
from balancer.pool import ACTIVE, DRAINED, DRAINING, Backend, Pool

__all__ = ["DrainProgress", "Drainer"]

log = logging.getLogger("wslb.drain")

QUIET = 0.5  # seconds without worker messages that mark the end of an answer
# Migrations in flight per drain: as few as finish the drain within half its timeout at
# HANDOFF_S a handoff, at most MAX_PARALLEL. Each in flight adds its steps to the others' pauses
# (the old worker answers the freezes one after another in its event loop, the targets the thaws
# and resumes): 200 sessions on 2 cores, pause p50/p99 6.0/11.5 ms one at a time, 15/27.5 ms
# three at a time, 24/45 ms eight at a time, the drain taking 0.2 s in each case (a slot is freed
# at the switch, not after the wait for the new leg's first message). 10,000 sessions in a 60 s
# drain still get 4 at a time.
HANDOFF_S = 0.01
MAX_PARALLEL = 8


def parallel(sessions: int, timeout: float) -> int:
    """Migrations in flight for a drain of ``sessions`` within ``timeout`` seconds."""
    need = math.ceil(sessions * HANDOFF_S / max(timeout / 2, HANDOFF_S))
    return max(1, min(MAX_PARALLEL, need))


@dataclass
class DrainProgress:
    """What ``GET /backends/{id}`` shows of a drain."""

    migrate: bool
    timeout: float
    started: float  # wall clock
    sessions_at_start: int
    migrated: int = 0
    migration_failures: int = 0
    closed_after_answer: int = 0
    closed_at_timeout: int = 0
    requests_cut: int = 0  # plain HTTP requests still running at the timeout
    finished: float | None = None
    left: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Drainer:
    """Runs the drains of one balancer process."""

    def __init__(self, state: ServerState, handoff: HandoffClient | None = None) -> None:
        self.state = state
        self.handoff = handoff or HandoffClient(state)  # the process's, shared with failover
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.progress: dict[str, DrainProgress] = {}
        self._self_drained: set[str] = set()  # drained because the worker said "draining"
        self.suspended = False  # a restart hands the drains on: start no more migrations

    def start(
        self,
        pool: Pool,
        backend: Backend,
        migrate_: bool,
        timeout: float,
        *,
        by_worker: bool = False,
    ) -> DrainProgress:
        """Begin draining (idempotent while a drain runs). An operator's drain (not
        ``by_worker``) is not undone when the worker's probes pass again."""
        if not by_worker:
            self._self_drained.discard(backend.id)
        if backend.admin_state == DRAINING and backend.id in self.tasks:
            return self.progress[backend.id]
        backend.set_admin(DRAINING)
        self.state.keepalive.drop(backend.id)
        if self.state.lanes is not None:  # no next request of a lane goes there either
            self.state.lanes.release_on(backend)
        progress = DrainProgress(migrate_, timeout, time.time(), backend.sessions)
        self.progress[backend.id] = progress
        self.tasks[backend.id] = self.state.loop.create_task(
            self._run(pool, backend, progress), name=f"drain-{backend.id}"
        )
        log.info(
            "draining %s (%s, migrate=%s)", backend.id, count(backend.sessions, "session"), migrate_
        )
        self.state.emit(
            "drain",
            backend=backend.id,
            pool=pool.name,
            phase="started",
            migrate=migrate_,
            sessions=backend.sessions,
            by_worker=by_worker,
        )
        return progress

    def worker_drains(self, pool: Pool, backend: Backend) -> bool:
        """The worker reports draining (module docstring); True if that started a drain."""
        if backend.admin_state != ACTIVE:
            return False
        log.info("worker %s reports draining; draining it", backend.id)
        self.start(pool, backend, pool.cfg.drain.migrate, pool.cfg.drain.timeout, by_worker=True)
        self._self_drained.add(backend.id)
        return True

    def worker_back(self, backend: Backend) -> bool:
        """A probe passed: a worker that drained itself takes sessions again (it restarted);
        True if that undrains it."""
        if backend.id not in self._self_drained:
            return False
        self._self_drained.discard(backend.id)
        log.info("worker %s is healthy again after draining itself; undraining", backend.id)
        self.state.spawn(self.undrain(backend))
        return True

    def keep_drained(self, backend: Backend) -> None:
        """An operator's drain now holds the backend (it may have drained itself first):
        probes that pass again do not undrain it."""
        self._self_drained.discard(backend.id)

    def forget(self, backend: Backend) -> None:
        """The backend is removed: its drain's record goes."""
        self.progress.pop(backend.id, None)
        self._self_drained.discard(backend.id)

    async def undrain(self, backend: Backend) -> None:
        task = self.tasks.pop(backend.id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if backend.admin_state != ACTIVE:
            self.state.emit("undrain", backend=backend.id)
        backend.set_admin(ACTIVE)

    def suspend(self) -> dict[str, dict[str, Any]]:
        """A restart is handing this process's sessions on: start no migration from now on
        (those in flight finish), and leave the drains' sessions alone. The drains running,
        by backend id, with what the new code needs to go on with each."""
        self.suspended = True
        now = time.time()
        out = {}
        for bid in self.tasks:
            p = self.progress[bid]
            out[bid] = {
                "migrate": p.migrate,
                "timeout_left": max(0.0, p.timeout - (now - p.started)),
                "by_worker": bid in self._self_drained,
            }
        return out

    def resume(self) -> None:
        """The restart failed: the drains go on here."""
        self.suspended = False

    async def stop(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        for task in list(self.tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks.clear()

    def view(self, backend: Backend) -> dict[str, Any] | None:
        p = self.progress.get(backend.id)
        if p is None:
            return None
        p.left = backend.sessions
        return p.as_dict()

    def _sessions(self, backend: Backend) -> list[Session]:
        return [s for s in self.state.sessions if s.backend is backend and not s.closing]

    def _requests(self, backend: Backend) -> list[Callable[[str], None]]:
        """How to cut each plain request still on ``backend`` (those of the lane thread's too:
        ``aio/lanes.py``)."""
        out: list[Callable[[str], None]] = [
            ex.abort for ex in self.state.requests if ex.backend is backend and not ex.closed
        ]
        if self.state.lanes is not None:
            out += [lane.abort_lane for lane in self.state.lanes.on(backend)]
        return out

    async def _run(self, pool: Pool, backend: Backend, progress: DrainProgress) -> None:
        loop = self.state.loop
        t0 = loop.time()
        deadline = t0 + progress.timeout
        gate = asyncio.Semaphore(parallel(len(self._sessions(backend)), progress.timeout))

        async def one(s: Session) -> None:
            if progress.migrate:
                await gate.acquire()
                held = [True]

                def free() -> None:  # at the switch: the slot bounds the handoff's steps only
                    if held[0]:
                        held[0] = False
                        gate.release()

                try:
                    if s.backend is not backend or s.closing or self.suspended:
                        return
                    result = await migrate(self.handoff, s, on_switched=free)
                finally:
                    free()
                if result.ok:
                    progress.migrated += 1
                    return
                progress.migration_failures += 1
            if await close_after_answer(s, backend, deadline):
                progress.closed_after_answer += 1

        try:
            tasks = [loop.create_task(one(s)) for s in self._sessions(backend)]
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
                for t in tasks:
                    t.cancel()
            if self.suspended:  # the sessions are handed on, and the drain with them
                return
            while self._requests(backend) and loop.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            for cut in self._requests(backend):
                cut("worker drained")
                progress.requests_cut += 1
            for s in self._sessions(backend):
                s.close(CloseCode.SERVICE_RESTART, "worker drained")
                progress.closed_at_timeout += 1
            # Wait for the close handshakes, bounded.
            close_by = loop.time() + self.state.timeouts.close + 1.0
            while backend.sessions > 0 and loop.time() < close_by:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        finally:
            if backend.admin_state == DRAINING and not self.suspended:
                backend.set_admin(DRAINED)
                progress.finished = time.time()
                self.state.stats.drain_duration.observe(loop.time() - t0)
                log.info(
                    "drained %s in %.2fs: %d migrated, %d closed after their answer, %d at timeout",
                    backend.id, loop.time() - t0, progress.migrated,
                    progress.closed_after_answer, progress.closed_at_timeout,
                )  # fmt: skip
                self.state.emit(
                    "drain",
                    backend=backend.id,
                    pool=pool.name,
                    phase="finished",
                    migrated=progress.migrated,
                    migration_failures=progress.migration_failures,
                    closed_after_answer=progress.closed_after_answer,
                    closed_at_timeout=progress.closed_at_timeout,
                    requests_cut=progress.requests_cut,
                    seconds=round(loop.time() - t0, 3),
                )
            self.tasks.pop(backend.id, None)


async def close_after_answer(s: Session, backend: Backend, deadline: float) -> bool:
    """Close the session with 1012 once its current answer is over; False if time ran out, or
    if it left ``backend`` otherwise (its worker died and a failover moved it)."""
    loop = asyncio.get_running_loop()
    s.reclaim()  # from the relay thread; a session on a draining worker is not offloaded again
    last_c, last_w = s.totals[:2]
    awaiting = False  # a client message has had no answer yet
    while loop.time() + QUIET <= deadline:
        await asyncio.sleep(QUIET)
        if s.finished or s.closing or s.backend is not backend:
            return False
        if s.mode is Mode.FAILING_OVER:
            continue  # quiet because its worker is gone: the failover decides
        c, w = s.totals[:2]
        if w != last_w:
            awaiting = False  # the worker is answering (or has answered)
        elif c != last_c:
            awaiting = True  # a prompt went out and nothing came back yet
        quiet = c == last_c and w == last_w
        last_c, last_w = c, w
        # Rule 8: a detached session is closed after its answer too; one whose full window
        # stopped its worker mid-answer is not done (its client may still come for the rest).
        between = s.mode is Mode.RELAYING or (s.mode is Mode.DETACHED and not s.window_full)
        if quiet and not awaiting and s.ws.at_message_boundary and between:
            s.close(CloseCode.SERVICE_RESTART, "worker draining")
            return True
    return False
