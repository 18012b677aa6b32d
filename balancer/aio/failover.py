"""Crash failover: a session whose worker was lost without a close continues on another worker.

The session (``session.py``, Rule 6) holds its client and calls ``Failover.lost``. Then, as one
bounded task per session (at most ``PARALLEL`` of a process at once, so a worker that dies with
200 sessions does not stampede its neighbours):

    CONFIRMING  the lost worker gets its pool's health check once (shared by all its
                sessions); a failed one marks it down at once (passive health), so neither the
                ring nor new sessions pick it while its regular checks catch up
    TRANSCRIPT  the session's journal (``balancer.journal``) gives the transcript state
                (``"v": 2``); a journal over its limit, of an unknown protocol, or cut in the
                middle of a message ends the failover here
    THAWED      the worker the ring picks next (the lost one and those tried excluded; bounds
                and drains honoured) accepted ``POST /wslb/sessions/{sid}/thaw``
    RESUMED     a worker leg is open there with ``X-WSLB-Resume``; the client is read again,
                its held messages flow to the new worker

A thaw or resume that fails tries the next worker, ``failover.attempts`` in all. Sessions of
one key lost together (a client gone for good left one detached, and came back as a new session
with the same key) go with the attached first: a worker refuses the thaw of a key it has an open
connection for, and a session whose client is there must not lose its place to one whose client
may never return.
A migration running when the worker died finishes first and starts the failover itself if it
did not move the session (Rule 6 in ``balancer/session_core.py``). The steps are the handoff
client's (``handoff.py``), shared with migration.
Whatever cannot be saved gets Rule 2's 1011, as without failover. The pause is recorded from the
loss to the resumed leg (``wslb_failover_pause_seconds``); every outcome is counted
(``wslb_failovers_total{result}``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from balancer.aio.handoff import HandoffClient, HandoffError
from balancer.aio.health import HealthChecker
from balancer.aio.session import Mode, Session
from balancer.journal import JournalError
from balancer.pool import Backend, Pool

__all__ = ["Failover"]

log = logging.getLogger("wslb.failover")

# Failovers in flight per process: each thaws a whole conversation on its target, so more at
# once only lengthens every pause on a busy CPU (the drain keeps 8 for the same reason).
PARALLEL = 8
PROBE_REUSE = 2.0  # seconds a probe's verdict answers for the worker's other sessions
ATTACHED_FIRST_WAIT = 10.0  # the longest a detached session waits for one of its key


class Failover:
    """The failovers of one balancer process (module docstring)."""

    def __init__(self, handoff: HandoffClient) -> None:
        self.handoff = handoff
        self.state = handoff.state
        self.slots = asyncio.Semaphore(PARALLEL)
        self._probes: dict[str, tuple[float, asyncio.Task[bool]]] = {}
        self._checkers: dict[str, HealthChecker] = {}
        # Sessions with their client there failing over now, by (pool, key): ``_attached_first``.
        self._attached: Counter[tuple[str, str]] = Counter()

    def lost(self, s: Session) -> None:
        """Rule 6: ``s`` is FAILING_OVER, its worker leg gone."""
        key = None
        if not s.core.detached_at:
            key = (s.pool.name, s.sid)
            self._attached[key] += 1
        self.state.spawn(self._run(s, s.backend, self.state.loop.time(), key))

    async def _run(
        self, s: Session, dead: Backend, t_lost: float, key: tuple[str, str] | None
    ) -> None:
        result = "error"
        try:
            result = await self._fail_over(s, dead, t_lost)
        except Exception:
            log.exception("session %s: failover from %s failed", s.sid, dead.id)
        finally:
            if key is not None:
                self._attached[key] -= 1
                if self._attached[key] <= 0:
                    del self._attached[key]
            if s.mode is Mode.FAILING_OVER:  # not resumed: Rule 2 after all
                s.worker_gone()
            self.state.stats.failovers[result] += 1
            self.state.stats.failed_over[dead.id] += 1
            resumed = result == "resumed"
            self.state.emit(
                "failover",
                session=s.sid,
                **{"from": dead.id, "to": s.backend.id if resumed else None},
                result=result,
                pause_ms=round((self.state.loop.time() - t_lost) * 1e3, 2) if resumed else None,
            )

    async def _fail_over(self, s: Session, dead: Backend, t_lost: float) -> str:
        loop = self.state.loop
        await self._confirm(s.pool, dead)
        if s.core.detached_at:
            await self._attached_first(s, dead)
        async with self.slots:
            if s.closing or s.finished or s.client.gone:
                return "closed"
            assert s.journal is not None
            try:
                transcript = s.journal.transcript(s.sid)
            except JournalError as exc:
                log.warning(
                    "session %s: worker %s lost; no failover (%s); closing it with 1011",
                    s.sid,
                    dead.id,
                    exc.detail,
                )
                return exc.reason
            tried = [dead.id]
            for _ in range(s.pool.cfg.failover.attempts):
                target = s.pool.select(s.sid, tried, loop.time())
                if target is None:
                    break
                tried.append(target.id)
                outcome = await self._resume(s, target, transcript)
                if outcome == "resumed":
                    pause = loop.time() - t_lost
                    self.state.stats.failover_pause.observe(pause)
                    log.info(
                        "session %s: worker %s lost; resumed on %s in %.1f ms",
                        s.sid,
                        dead.id,
                        target.id,
                        pause * 1e3,
                    )
                    return "resumed"
                if outcome in ("rejected", "closed"):
                    return outcome
            log.warning(
                "session %s: worker %s lost; no worker took it over (tried %s); closing it",
                s.sid,
                dead.id,
                ", ".join(tried[1:]) or "none ready",
            )
            return "no_target" if len(tried) == 1 else "failed"

    async def _attached_first(self, s: Session, dead: Backend) -> None:
        """A detached session waits while a session of the same key with its client there
        fails over: a worker refuses the thaw of a key it has an open connection for (409), so
        the second thaw of a key fails wherever the first went; the client who is there goes
        first.

        The live session of the key may not have seen the loss yet (the relay thread hands
        it back a loop turn or more later): it is waited for while it is still on ``dead``."""
        loop = self.state.loop
        key = (s.pool.name, s.sid)
        until = loop.time() + ATTACHED_FIRST_WAIT
        while loop.time() < until:
            live = self.state.by_sid.get(s.sid)
            coming = (
                live is not None
                and live is not s
                and live.pool is s.pool
                and not live.core.detached_at
                and live.backend is dead
                and not live.closing
                and not live.finished
            )
            if not coming and not self._attached.get(key):
                return
            await asyncio.sleep(0.005)

    async def _resume(self, s: Session, target: Backend, transcript: dict[str, Any]) -> str:
        """THAWED and RESUMED on ``target``: resumed, or why not (the next worker may do)."""
        handoff = self.handoff
        try:
            with handoff.reserve(target):
                try:
                    await handoff.thaw(target, s.sid, transcript)
                except HandoffError as exc:
                    if exc.reason == "network":
                        self.state.worker_failed(s.pool, target)
                        log.info("session %s: %s", s.sid, exc)
                        return "thaw"
                    log.log(
                        logging.WARNING if exc.reason == "rejected" else logging.INFO,
                        "session %s: %s",
                        s.sid,
                        exc,
                    )
                    return "rejected" if exc.reason == "rejected" else "thaw"
                wt, proto, trailing = await handoff.resume(target, s)
        except HandoffError as exc:
            if exc.reason == "closed":
                return "closed"
            log.info("session %s: resume on %s failed: %s", s.sid, target.id, exc)
            self.state.worker_failed(s.pool, target)
            return "resume"
        s.resume_on(target, wt, proto, trailing)
        return "resumed"

    async def _confirm(self, pool: Pool, backend: Backend) -> None:
        """CONFIRMING: one probe per lost worker answers for all its sessions."""
        loop = self.state.loop
        now = loop.time()
        known = self._probes.get(backend.id)
        if known is None or now - known[0] > PROBE_REUSE:
            known = (now, loop.create_task(self._probe(pool, backend)))
            self._probes[backend.id] = known
        await asyncio.shield(known[1])

    async def _probe(self, pool: Pool, backend: Backend) -> bool:
        """The pool's own health check, once, now (a TCP connect, or ``GET health.path``: an
        engine bridge whose engine died still accepts connections but answers 503). True if it
        passed; else the worker is marked down at once, and its checks bring it back."""
        if not pool.cfg.health.enabled:
            return True  # no checks would bring it back: passive ejection deals with it
        checker = self._checkers.get(backend.id)
        if checker is None:
            checker = HealthChecker(self.handoff.http(backend), lambda b, ok, draining: None)
            self._checkers[backend.id] = checker
        result = await checker.check(pool, backend)
        if result is None or result.ok or result.draining:
            return True
        await self.handoff.drop(backend)  # its pooled connections lead nowhere now
        self._checkers.pop(backend.id, None)
        if backend.healthy:
            backend.set_health(  # its checks must pass ``rise`` times in a row from here
                False, f"lost mid-session; {result.reason}", result.kind, self.state.wall_time()
            )
            log.warning(
                "backend %s is down: a session's connection was lost, then %s",
                backend.id,
                result.reason,
            )
        return False
