"""The offload thread (``balancer/_offload.c``) as the event loop sees it, and its relay.

One thread per serving process serves what is handed to it out of the interpreter: the relay's
sessions (here) and plain HTTP's lanes (``aio/lanes.py``, on this thread: ``Offload.lanes``).

At stream load the relay's cost is per read: a token is one small frame, and entering Python for
it costs more than nginx spends on the whole frame; in one event loop each read also waits
behind the others' Python work. A session that streams is therefore handed to a thread written
in C, which forwards its worker-to-client data frames itself and hands the session back for
everything the relay's rules must see. The rules, from the event loop's side:

- **Taken** (``Session._offload``): only in the steady state - both legs open, the session
  relaying, no migration, hold, failover or drain, the worker's stream between messages with
  nothing held back, nothing waiting to be written to the client, and the session has streamed
  ``OFFLOAD_AFTER`` frames (an idle session stays in Python: it costs nothing there, and the
  heartbeat would take it back every ``ping_interval`` anyway); one the thread gave back is
  offered again at its next data frame.
  The event loop stops reading the worker; the thread reads it and writes the client.
- **Given back** (``Session.reclaim``), before the event loop writes to the client, closes either
  leg, or reads the worker's scanner for a decision (heartbeat, migration, drain, failover,
  shutdown), and when the thread returns the session (a control frame, a fragment, anything its
  walk does not take, the worker's EOF, an error). The thread's counts are credited to the
  worker's scanner, its unsent bytes are written to the client first, and the bytes it had read
  but not forwarded are scanned by Python next, before anything read later (the session keeps
  them as its ``carry`` until its worker leg is read again).
- The client leg stays with the event loop throughout (client frames are few in LLM serving and
  carry what migration and failover log). Counters shown while a session is away are its
  scanner's plus the thread's (``Session.counts``).

``AVAILABLE`` is false where the C module is not built or ``WSLB_PURE_PYTHON`` is set (to
anything non-empty, as for the frame scanner: ``balancer/frames.py``); config
``relay.thread: false`` turns the thread off too. Every session then runs in Python, as before.

The thread's events come here, one queue for both kinds: a session's go to it, a lane's to
``lanes`` (its lines and counts taken first). The thread stops once both sides are closed: the
relay's ``close`` leaves it to the lanes' when they use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from types import ModuleType
from typing import Any, Protocol

__all__ = ["AVAILABLE", "OFFLOAD_AFTER", "Offload", "Offloadable", "Returned", "plain_socket"]

log = logging.getLogger("wslb.server")

_offload: ModuleType | None
try:
    from balancer import _offload
except ImportError:  # no C compiler at install, or not Linux
    _offload = None

AVAILABLE = _offload is not None and not os.environ.get("WSLB_PURE_PYTHON")
# Frames a session streams in Python before it is handed to the thread (again).
OFFLOAD_AFTER = 4

# Why the thread returned a session (``Returned.reason``) and the event kinds of
# ``Thread.events()``: the C module's own numbers (without it nothing goes to the thread).
REASONS: dict[int, str] = {}
NOMEM = RETURNED = RECORD = FLUSH = -1
if _offload is not None:
    REASONS = {
        _offload.TAKEN_BACK: "taken back",
        _offload.FRAME: "frame",
        _offload.EOF: "eof",
        _offload.READ_ERROR: "read error",
        _offload.WRITE_ERROR: "write error",
        _offload.NOMEM: "no memory",
    }
    NOMEM, RETURNED = _offload.NOMEM, _offload.RETURNED
    RECORD, FLUSH = _offload.RECORD, _offload.FLUSH


def plain_socket(transport: asyncio.BaseTransport) -> Any:
    """The transport's socket when its descriptor carries the stream's bytes themselves, else
    ``None``: on a TLS transport (``ssl_object`` set) the descriptor carries ciphertext, and
    anything that reads or writes it directly (the relay thread) would corrupt the stream."""
    if transport.get_extra_info("ssl_object") is not None:
        return None
    return transport.get_extra_info("socket")


class Offloadable(Protocol):
    """What the offload calls on a session it relays."""

    def reclaim(self) -> None: ...

    def flush_record(self) -> None: ...


class LaneSide(Protocol):
    """What the thread's lane events go to (``aio/lanes.py``'s ``Lanes``)."""

    owners: Any

    def returned(self, handles: list[int]) -> None: ...


class Returned:
    """What a session gets back from the thread (``Offload.give_back``)."""

    __slots__ = ("backlog", "carry", "frames", "nbytes", "reason", "record")

    def __init__(
        self, carry: bytes, backlog: bytes, record: bytes, frames: int, nbytes: int, reason: int
    ) -> None:
        self.carry = carry  # read from the worker, not scanned yet (from a frame boundary)
        self.backlog = backlog  # scanned and counted, not yet written to the client
        self.record = record  # forwarded since the last take_record (record set)
        self.frames = frames  # whole data messages forwarded (one frame each)
        self.nbytes = nbytes  # bytes forwarded (including the backlog)
        self.reason = reason


class Offload:
    """One serving process's offload thread, and the sessions it relays now."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        counts: Counter[str],
        buckets: tuple[float, ...] = (),
    ) -> None:
        """``counts``: where hand-overs are counted (``Stats.relay_thread``); ``buckets``: the
        lanes' latency histogram's."""
        assert _offload is not None
        self.loop = loop
        self.c: Any = _offload.Thread(buckets)
        self._fd: int = self.c.fileno()
        loop.add_reader(self._fd, self._events)
        self.sessions: dict[int, Offloadable] = {}
        self.handovers = counts
        self.lanes: LaneSide | None = None  # set by the lanes that use this thread
        self._stopped = False

    def take(
        self,
        s: Offloadable,
        worker_fd: int,
        client_fd: int,
        limit: int,
        record: bool,
        chunked: bool = False,
    ) -> int:
        """Hand ``s`` to the thread (``chunked``: a plain-HTTP response body, its whole chunks
        forwarded; else WebSocket frames); its handle. Raises OSError (``s`` stays here)."""
        handle: int = self.c.add(worker_fd, client_fd, limit, record, chunked)
        self.sessions[handle] = s
        self.handovers["taken"] += 1
        return handle

    def give_back(self, handle: int) -> Returned:
        """Take a session back from the thread (it touches its sockets no more)."""
        self.sessions.pop(handle, None)
        carry, backlog, record, frames, nbytes, reason, err = self.c.remove(handle)
        self.handovers[REASONS.get(reason, str(reason))] += 1
        if reason == NOMEM:
            log.error("relay thread out of memory (errno %d)", err)
        return Returned(carry, backlog, record, frames, nbytes, reason)

    def counts(self, handle: int) -> tuple[int, int]:
        """(frames, bytes) the thread forwarded for a session it relays."""
        frames, nbytes = self.c.counts(handle)
        return int(frames), int(nbytes)

    def take_record(self, handle: int) -> bytes:
        record: bytes = self.c.take_record(handle)
        return record

    def _events(self) -> None:
        lanes: list[int] = []
        flush = False
        for handle, kind in self.c.events():
            s = self.sessions.get(handle)
            if s is not None:
                if kind == RETURNED:
                    s.reclaim()
                elif kind == RECORD:
                    s.flush_record()
            elif self.lanes is not None and handle in self.lanes.owners:
                if kind == RETURNED:
                    lanes.append(handle)
                flush = True
            # else: taken back meanwhile
        if flush and self.lanes is not None:
            self.lanes.returned(lanes)

    def close(self) -> None:
        """Take every session back; stop the thread unless lanes still use it (their
        ``close`` stops it)."""
        for s in list(self.sessions.values()):
            s.reclaim()
        if self.lanes is None:
            self.stop()

    def stop(self) -> list[int] | None:
        """Take every session back and stop the thread: the handles of the lanes left in it
        (RETURNED with CLOSED), or None when it did not stop in time (logged; what it holds
        stays until the process's exit)."""
        for s in list(self.sessions.values()):
            s.reclaim()
        if self._stopped:
            return []
        self._stopped = True
        self.loop.remove_reader(self._fd)
        try:
            handles: list[int] = self.c.close()
        except TimeoutError as exc:  # the thread is stuck: what it holds stays until the exit
            log.error("%s", exc)
            return None
        return handles
