"""Live session migration: the handoff protocol of docs/protocol.md, as a state machine.

States of one migration (each step bounded in time; any failure before SWITCHED leaves the
session on its old worker, reading again, and the caller falls back to the graceful close):

    HOLDING   the client's stream is at a message boundary; wslb stops reading it, so client
              messages wait in the kernel (bounded by the socket buffer)
    FROZEN    ``POST /wslb/sessions/{sid}/freeze`` answered ``{state, sent S, received R}``;
              the old worker sends nothing more on the session
    FLUSHED   wslb has forwarded the old worker's messages up to S (they were in flight)
    THAWED    the target (chosen by the ring as if the old worker were gone, or named by the
              operator) accepted ``POST /wslb/sessions/{sid}/thaw {state}``
    SWITCHED  a new worker leg is open with ``X-WSLB-Resume``; the client messages after R are
              replayed on it, the old leg is closed, the client is read again

The client sees one unbroken stream: no close, no lost or repeated message. The pause it sees
is from FROZEN to the first message on the new leg, recorded as the migration pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from balancer.aio.handoff import STEP_TIMEOUT, HandoffClient, HandoffError, wait_until
from balancer.aio.session import PAUSES_KEPT, Mode, Session
from balancer.frames import CloseCode, FrameScanner
from balancer.pool import Backend

__all__ = ["MigrationError", "MigrationResult", "migrate"]

log = logging.getLogger("wslb.migrate")

# After the switch, how long a move waits inline for the new worker's first message (the pause
# then ends there), and how long a watcher waits beyond that for the first-message figure.
FIRST_MESSAGE_INLINE = 0.2
FIRST_MESSAGE_WAIT = 30.0
FIRST_MESSAGE_POLL = 0.02

MigrationError = HandoffError  # a step failed; ``reason`` labels the metric


@dataclass
class MigrationResult:
    ok: bool
    reason: str
    target: str | None = None
    pause: float | None = None  # seconds from freeze to the first message on the new leg


async def migrate(
    handoff: HandoffClient,
    s: Session,
    to: str | None = None,
    on_switched: Callable[[], None] | None = None,
) -> MigrationResult:
    """Move a live session to another worker; see the module docstring. ``on_switched`` is
    called once the new leg is in place, before the wait for its first message (a drain frees
    its slot there: an idle session's first message never comes, and its 0.2 s wait held the
    slot that the next session's freeze needed)."""
    state = handoff.state
    if not s.begin_migration():
        return MigrationResult(False, "busy")
    old = s.backend
    loop = asyncio.get_running_loop()
    try:
        result = await _migrate(handoff, s, old, to, loop, on_switched)
    except HandoffError as exc:
        log.info("session %s: migration from %s failed: %s", s.sid, old.id, exc)
        result = MigrationResult(False, exc.reason)
    except Exception:
        log.exception("session %s: migration from %s failed", s.sid, old.id)
        result = MigrationResult(False, "error")
    finally:
        s.end_migration()
    state.stats.migrations[result.reason if not result.ok else "migrated"] += 1
    if result.ok:
        state.stats.migrated_away[old.id] += 1
    state.emit(
        "migration",
        session=s.sid,
        **{"from": old.id, "to": result.target if result.ok else None},
        ok=result.ok,
        result=result.reason,
        pause_ms=None if result.pause is None else round(result.pause * 1e3, 2),
    )
    if result.pause is not None:
        state.stats.migration_pause.observe(result.pause)
        s.core.pauses = (*s.core.pauses[-(PAUSES_KEPT - 1) :], result.pause)
    return result


WAKE_CHECK = 0.02  # a frame wait re-checks its condition at least this often (a close)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_frames(s: Session, cond: Callable[[], bool], timeout: float) -> bool:
    """Until ``cond`` holds (True) or ``timeout`` passes (False), checked at each frame read
    from the session's worker leg (``Session.frame_waiter``), and every ``WAKE_CHECK`` for what
    no frame announces (a close). Polling every 2 ms instead woke 2-3 ms late on uvloop's
    millisecond timers, and each of those milliseconds was the client's pause."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        left = deadline - loop.time()
        if left <= 0:
            return False
        fut: asyncio.Future[None] = loop.create_future()
        s.frame_waiter = fut
        s.offload_at = min(s.offload_at, s.core.ws.frames + 1)
        timer = loop.call_later(min(left, WAKE_CHECK), _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if s.frame_waiter is fut:
                s.frame_waiter = None
    return True


def _lost(s: Session) -> bool:
    """The old worker died during the migration: its failover (Rule 6) takes the session."""
    return s.mode is Mode.FAILING_OVER


async def _migrate(
    handoff: HandoffClient,
    s: Session,
    old: Backend,
    to: str | None,
    loop: asyncio.AbstractEventLoop,
    on_switched: Callable[[], None] | None = None,
) -> MigrationResult:
    core = s.core
    if core.clog is None:
        raise MigrationError("disabled", "drain.migrate is false for this pool")
    if to is not None:
        _named(s, old, to)  # a target that cannot take the session costs it no pause
    # HOLDING: wait for the client to finish a message in flight, then stop reading it.
    if not await wait_until(lambda: core.cs.at_message_boundary or s.closing, STEP_TIMEOUT):
        raise MigrationError("client_mid_message")
    if s.closing:
        raise MigrationError("closed")
    if not s.hold():
        raise MigrationError("worker_lost")
    # FROZEN. The pause is timed with perf_counter: uvloop's loop.time() is the loop turn's
    # start in whole milliseconds, which moved a ~6 ms pause by up to a millisecond either way.
    t_freeze = time.perf_counter()
    frozen = await handoff.freeze(old, s.sid)
    # FLUSHED: everything the old worker sent has reached the client. From here on the old
    # worker has let go of the session: a failure either restores it or ends it with 1012.
    sent, received = frozen.sent, frozen.received
    try:
        if not await wait_frames(s, lambda: core.ws.messages >= sent or s.closing, STEP_TIMEOUT):
            raise MigrationError("flush", f"forwarded {core.ws.messages} of {sent}")
        if s.closing or core.ws.messages != sent or not core.ws.at_message_boundary:
            raise MigrationError("flush", f"forwarded {core.ws.messages}, worker sent {sent}")
        leg_msgs = core.cs.messages - core.leg_start_msg
        if not 0 <= received <= leg_msgs:
            raise MigrationError("freeze", f"worker processed {received} of {leg_msgs}")
        if core.replay_from(core.leg_start_msg + received) is None:
            raise MigrationError("replay_overflow")
    except MigrationError as exc:
        if _lost(s):
            raise MigrationError("worker_lost", str(exc)) from None
        log.warning("session %s: cannot be moved safely (%s); closing it", s.sid, exc)
        s.close(CloseCode.SERVICE_RESTART, "session could not be moved")
        raise MigrationError(f"{exc.reason}_lost") from None
    # THAWED: the target, chosen as if the old worker were gone.
    try:
        target = _target(s, old, to, loop)
        with handoff.reserve(target):
            await _move(handoff, s, target, frozen.state, received)
    except MigrationError as exc:
        # The old worker has let go of the session: give it back, or end it cleanly.
        try:
            if not old.healthy:
                raise MigrationError("rollback", f"{old.id} is down") from None
            await _move(handoff, s, old, frozen.state, received)
        except MigrationError as back:
            if _lost(s):
                raise MigrationError("worker_lost", str(back)) from None
            log.warning("session %s: could not move or restore it (%s; %s)", s.sid, exc, back)
            s.close(CloseCode.SERVICE_RESTART, "session could not be moved")
            raise MigrationError(f"{exc.reason}_lost") from None
        log.info("session %s: migration failed (%s), restored on %s", s.sid, exc, old.id)
        raise
    # The pause ends with the first message on the new leg; an idle session (no answer
    # streaming) has none due, and its pause ends with the switch. A slower first message (an
    # engine re-prefilling the conversation) is timed by a watcher, off the drain's slot.
    state = handoff.state
    if on_switched is not None:
        on_switched()
    t_switch = time.perf_counter()
    ws = core.ws
    first = await wait_frames(s, lambda: ws.messages > 0 or s.closing, FIRST_MESSAGE_INLINE)
    if first and ws.messages:
        t_switch = time.perf_counter()
        state.stats.migration_first_message.observe(t_switch - t_freeze)
    elif not s.closing:
        state.spawn(watch_first_message(state, s, ws, t_freeze))
    pause = t_switch - t_freeze
    log.info("session %s moved %s -> %s in %.1f ms", s.sid, old.id, target.id, pause * 1e3)
    return MigrationResult(True, "migrated", target.id, pause)


async def watch_first_message(state: Any, s: Session, ws: FrameScanner, t_freeze: float) -> None:
    """Observe when the new leg's first message came (``wslb_migration_first_message_seconds``),
    at most ``FIRST_MESSAGE_WAIT`` after the freeze; a session that closes, moves again or stays
    quiet is not counted."""
    while time.perf_counter() - t_freeze < FIRST_MESSAGE_WAIT:
        if s.closing or s.ws is not ws:
            return
        if ws.messages:
            state.stats.migration_first_message.observe(time.perf_counter() - t_freeze)
            return
        await asyncio.sleep(FIRST_MESSAGE_POLL)


def _target(s: Session, old: Backend, to: str | None, loop: asyncio.AbstractEventLoop) -> Backend:
    if to is not None:
        return _named(s, old, to)  # again: it may have gone down during the freeze
    chosen = s.pool.select(s.sid, [old.id], loop.time())
    if chosen is None:
        raise MigrationError("no_target")
    return chosen


def _named(s: Session, old: Backend, to: str) -> Backend:
    target = s.pool.backends.get(to)
    if target is None or not target.ready:
        raise MigrationError("target", f"{to} is not a ready backend of the pool")
    if target is old:
        raise MigrationError("target", f"the session is on {to} already")
    return target


async def _move(
    handoff: HandoffClient, s: Session, target: Backend, frozen: Any, received: int
) -> None:
    """THAWED then SWITCHED on ``target`` (also used to put a session back on its old worker)."""
    try:
        await handoff.thaw(target, s.sid, frozen)
    except HandoffError as exc:
        if exc.reason == "network":
            raise
        raise MigrationError("thaw", exc.detail) from None
    wt, proto, trailing = await handoff.resume(target, s)
    s.switch(target, wt, proto, trailing, received)
    s.release()
