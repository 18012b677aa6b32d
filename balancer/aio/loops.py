"""Background loops: one per backend (scrapes, probes), and the event loop's lag meter."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

__all__ = ["LagMeter", "PerBackend"]


class LagMeter:
    """How late the event loop runs its callbacks: the summed lateness of a 50 ms ticker.

    Health probes run on the same loop as the relay. When wslb is saturated, a worker's answer
    can sit unread past the probe's timeout, and the worker would be marked down for wslb's own
    lag (measured: both workers down for 3-8 s at saturation, new sessions refused). The health
    checker compares a timed-out probe with the lag that accrued meanwhile.
    """

    PERIOD = 0.05

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.total = 0.0  # seconds of lateness since start
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._due = self.loop.time() + self.PERIOD
        self._handle = self.loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        self.total += max(0.0, now - self._due)
        self._due = now + self.PERIOD
        self._handle = self.loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class PerBackend:
    """Keeps at most one named task per backend id."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def spawn(self, backend_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` for this backend unless one already runs (then ``coro`` is dropped)."""
        if backend_id in self._tasks:
            coro.close()
            return
        self._tasks[backend_id] = asyncio.get_running_loop().create_task(
            coro, name=f"{self._kind}-{backend_id}"
        )

    async def stop(self, backend_id: str | None = None) -> None:
        """Cancel one backend's task, or all of them, and wait for them to end."""
        ids = [backend_id] if backend_id is not None else list(self._tasks)
        tasks = [t for i in ids if (t := self._tasks.pop(i, None)) is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
