"""The event feed: what happened to backends and sessions, for the dashboard and for tools.

Sans-I/O: ``emit`` appends an event (a plain JSON object with ``seq``, ``time`` and ``kind``) to
a bounded log and calls the listeners (the shell wakes its waiting readers there); ``since``
gives what came after a sequence number, so a reader that reconnects misses nothing still in
the log. Sequence numbers are this log's own: the supervisor of ``workers: N`` re-emits its
serving processes' events into its log (``absorb``), tagged with their ``process``.

Kinds (docs/admin-api.md): ``drain`` (phase ``started`` / ``finished``), ``undrain``,
``migration``, ``failover``, ``detached`` and ``resumed`` (a client left without a close and
came back: docs/resume.md), ``state`` (a backend's state changed: a health flip, an ejection, a
drain's end), ``reload``, ``backend_added``, ``backend_removed``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["EVENTS_KEPT", "EventLog"]

EVENTS_KEPT = 1000


class EventLog:
    """A bounded, numbered log of events with listeners (module docstring)."""

    def __init__(self, size: int = EVENTS_KEPT) -> None:
        self.seq = 0
        self._events: deque[dict[str, Any]] = deque(maxlen=size)
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, kind: str, at: float, **fields: Any) -> dict[str, Any]:
        """Record an event that happened at wall time ``at``."""
        self.seq += 1
        event = {"seq": self.seq, "time": round(at, 3), "kind": kind, **fields}
        self._events.append(event)
        for listener in list(self._listeners):
            listener(event)
        return event

    def absorb(self, event: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Re-emit another log's event (its time and fields kept, a new ``seq``)."""
        fields = {k: v for k, v in event.items() if k not in ("seq", "time", "kind")}
        return self.emit(str(event.get("kind")), float(event.get("time") or 0.0), **fields, **extra)

    def since(self, seq: int, limit: int = EVENTS_KEPT) -> list[dict[str, Any]]:
        """Events after ``seq``, oldest first, at most the last ``limit`` of them."""
        if seq >= self.seq:
            return []
        newer = [e for e in self._events if e["seq"] > seq]
        return newer[-limit:]

    def listen(self, callback: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(callback)

    def unlisten(self, callback: Callable[[dict[str, Any]], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)
