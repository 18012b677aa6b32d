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
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from balancer import workerauth
from balancer.aio.proxy import open_upstream
from balancer.aio.session import PAUSES_KEPT, Session
from balancer.aio.state import ServerState
from balancer.frames import CloseCode, FrameScanner
from balancer.handshake import UpstreamReject, quote_key
from balancer.pool import Backend

__all__ = [
    "MigrationError",
    "MigrationResult",
    "handoff_post",
    "handoff_url",
    "migrate",
    "wait_until",
]

log = logging.getLogger("wslb.migrate")

STEP_TIMEOUT = 5.0  # each HTTP step and the flush
POLL = 0.002
# After the switch, how long a move waits inline for the new worker's first message (the pause
# then ends there), and how long a watcher waits beyond that for the first-message figure.
FIRST_MESSAGE_INLINE = 0.2
FIRST_MESSAGE_WAIT = 30.0
FIRST_MESSAGE_POLL = 0.02


class MigrationError(Exception):
    """A step failed; ``reason`` is a short label for metrics (no_api, freeze, flush, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class MigrationResult:
    ok: bool
    reason: str
    target: str | None = None
    pause: float | None = None  # seconds from freeze to the first message on the new leg


def handoff_url(backend: Backend, sid: str, step: str) -> yarl.URL:
    """``POST``'s target for a handoff ``step`` (freeze, thaw) of session ``sid`` on ``backend``.

    The key is one percent-encoded path segment (``quote_key``) and the URL is taken as
    encoded, so no key can name another session or route (``a/freeze?``, ``..``) and every key
    reaches the worker as it is.
    """
    up = backend.upstream
    scheme = "https" if up.secure else "http"
    return yarl.URL(
        f"{scheme}://{up.authority}/wslb/sessions/{quote_key(sid)}/{step}", encoded=True
    )


async def handoff_post(
    state: ServerState, backend: Backend, sid: str, step: str, body: dict[str, Any]
) -> tuple[int, Any]:
    """POST a handoff step to ``backend``, with wslb's credential and over the pool's
    ``upstream_tls`` for a ``wss://`` worker; the status and the JSON answer (None if not
    JSON)."""
    assert state.handoff_http is not None
    token = state.worker_token(backend)
    headers = {workerauth.HEADER: token} if token is not None else {}
    async with state.handoff_http.post(
        handoff_url(backend, sid, step),
        json=body,
        headers=headers,
        ssl=state.upstream_ssl(backend) or True,
        timeout=aiohttp.ClientTimeout(total=STEP_TIMEOUT),
    ) as resp:
        try:
            data = await resp.json(content_type=None)
        except ValueError:
            data = None
        return resp.status, data


async def wait_until(cond: Any, timeout: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` passes (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(POLL)
    return True


async def migrate(state: ServerState, s: Session, to: str | None = None) -> MigrationResult:
    """Move a live session to another worker; see the module docstring."""
    if s.migrating or s.failing_over or s.closing or s.finished:
        return MigrationResult(False, "busy")
    s.migrating = True
    s.reclaim()  # from the relay thread (Rule 7): the migration reads the worker scanner
    old = s.backend
    loop = asyncio.get_running_loop()
    try:
        result = await _migrate(state, s, old, to, loop)
    except MigrationError as exc:
        log.info("session %s: migration from %s failed: %s", s.sid, old.id, exc)
        result = MigrationResult(False, exc.reason)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.info("session %s: migration from %s failed: %s", s.sid, old.id, exc)
        result = MigrationResult(False, "network")
    except Exception:
        log.exception("session %s: migration from %s failed", s.sid, old.id)
        result = MigrationResult(False, "error")
    finally:
        s.migrating = False
        if s.holding and not s.finished:
            s.release()
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
        s.pauses = (*s.pauses[-(PAUSES_KEPT - 1) :], result.pause)
    return result


async def _migrate(
    state: ServerState,
    s: Session,
    old: Backend,
    to: str | None,
    loop: asyncio.AbstractEventLoop,
) -> MigrationResult:
    if s.clog is None:
        raise MigrationError("disabled", "drain.migrate is false for this pool")
    if to is not None:
        _named(s, old, to)  # a target that cannot take the session costs it no pause
    # HOLDING: wait for the client to finish a message in flight, then stop reading it.
    if not await wait_until(lambda: s.cs.at_message_boundary or s.closing, STEP_TIMEOUT):
        raise MigrationError("client_mid_message")
    if s.closing:
        raise MigrationError("closed")
    s.hold()
    # FROZEN
    t_freeze = loop.time()
    status, body = await handoff_post(state, old, s.sid, "freeze", {})
    if status == 404:  # a worker without the handoff API, or one that lost the session
        raise MigrationError("no_api", f"freeze answered {status}")
    if status == 401:  # the worker has no credential, or another one than wslb shows
        log.warning(
            "backend %s refused wslb's credential (401): give it the pool's worker_auth "
            "(docs/hardening.md#sessions-belong-to-their-owner)",
            old.id,
        )
        raise MigrationError("unauthorized", "freeze answered 401")
    if status != 200 or not isinstance(body, dict):
        raise MigrationError("freeze", f"freeze answered {status}")
    try:
        frozen, sent, received = body["state"], int(body["sent"]), int(body["received"])
    except (KeyError, TypeError, ValueError):
        raise MigrationError("freeze", "malformed freeze answer") from None
    # FLUSHED: everything the old worker sent has reached the client. From here on the old
    # worker has let go of the session: a failure either restores it or ends it with 1012.
    try:
        if not await wait_until(lambda: s.ws.messages >= sent or s.closing, STEP_TIMEOUT):
            raise MigrationError("flush", f"forwarded {s.ws.messages} of {sent}")
        if s.closing or s.ws.messages != sent or not s.ws.at_message_boundary:
            raise MigrationError("flush", f"forwarded {s.ws.messages}, worker sent {sent}")
        leg_msgs = s.cs.messages - s.leg_start_msg
        if not 0 <= received <= leg_msgs:
            raise MigrationError("freeze", f"worker processed {received} of {leg_msgs}")
        if s.replay_from(s.leg_start_msg + received) is None:
            raise MigrationError("replay_overflow")
    except MigrationError as exc:
        if s.failing_over:  # the old worker died meanwhile: its failover takes the session
            raise MigrationError("worker_lost", str(exc)) from None
        log.warning("session %s: cannot be moved safely (%s); closing it", s.sid, exc)
        s.close(CloseCode.SERVICE_RESTART, "session could not be moved")
        raise MigrationError(f"{exc.reason}_lost") from None
    # THAWED: the target, chosen as if the old worker were gone.
    try:
        target = _target(s, old, to, loop)
        # Reserve the place, so concurrent migrations of a drain see it in their bounds.
        target.sessions += 1
        try:
            await _move(state, s, target, frozen, received)
        finally:
            target.sessions -= 1
    except MigrationError as exc:
        # The old worker has let go of the session: give it back, or end it cleanly.
        try:
            if not old.healthy:
                raise MigrationError("rollback", f"{old.id} is down") from None
            await _move(state, s, old, frozen, received)
        except MigrationError as back:
            if s.failing_over:
                raise MigrationError("worker_lost", str(back)) from None
            log.warning("session %s: could not move or restore it (%s; %s)", s.sid, exc, back)
            s.close(CloseCode.SERVICE_RESTART, "session could not be moved")
            raise MigrationError(f"{exc.reason}_lost") from None
        log.info("session %s: migration failed (%s), restored on %s", s.sid, exc, old.id)
        raise
    # The pause ends with the first message on the new leg; an idle session (no answer
    # streaming) has none due, and its pause ends with the switch. A slower first message (an
    # engine re-prefilling the conversation) is timed by a watcher, off the drain's slot.
    t_switch = loop.time()
    ws = s.ws
    if await wait_until(lambda: ws.messages > 0 or s.closing, FIRST_MESSAGE_INLINE) and ws.messages:
        t_switch = loop.time()
        state.stats.migration_first_message.observe(t_switch - t_freeze)
    elif not s.closing:
        state.spawn(watch_first_message(state, s, ws, t_freeze))
    pause = t_switch - t_freeze
    log.info("session %s moved %s -> %s in %.1f ms", s.sid, old.id, target.id, pause * 1e3)
    return MigrationResult(True, "migrated", target.id, pause)


async def watch_first_message(
    state: ServerState, s: Session, ws: FrameScanner, t_freeze: float
) -> None:
    """Observe when the new leg's first message came (``wslb_migration_first_message_seconds``),
    at most ``FIRST_MESSAGE_WAIT`` after the freeze; a session that closes, moves again or stays
    quiet is not counted."""
    loop = asyncio.get_running_loop()
    while loop.time() - t_freeze < FIRST_MESSAGE_WAIT:
        if s.closing or s.ws is not ws:
            return
        if ws.messages:
            state.stats.migration_first_message.observe(loop.time() - t_freeze)
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
    state: ServerState, s: Session, target: Backend, frozen: Any, received: int
) -> None:
    """THAWED then SWITCHED on ``target`` (also used to put a session back on its old worker)."""
    status, _ = await handoff_post(state, target, s.sid, "thaw", {"state": frozen})
    if status != 200:
        raise MigrationError("thaw", f"{target.id} answered {status}")
    try:
        wt, proto, _, trailing = await open_upstream(
            state, target, s.req, s.sid, s.secure, resume=True
        )
    except (OSError, TimeoutError, UpstreamReject) as exc:
        raise MigrationError("resume", str(exc) or type(exc).__name__) from None
    if s.closing or s.finished:
        wt.close()
        raise MigrationError("closed")
    s.switch(target, wt, proto, trailing, received)
    s.release()
