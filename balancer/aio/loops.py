"""Background loops: one per backend (scrapes, probes), the event loop's lag meter, and the
pacing of full garbage collections."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any

__all__ = ["GcPacer", "LagMeter", "PerBackend"]

log = logging.getLogger("wslb")


class GcPacer:
    """Full garbage collections on wslb's schedule instead of CPython's.

    CPython runs a full (generation 2) collection whenever the long-lived objects grew by a
    quarter since the last one, and it walks every tracked object: about 17 per live session
    (docs/benchmarks.md). While 9,925 sessions opened, three took 22, 59 and 105 ms, and the
    relay stood still meanwhile. They found nothing: a session leaves no cyclic garbage when it
    closes (a 90 s soak with automatic full collections off left 47 collectable objects, all from
    start-up). So the pacer freezes what start-up built (never walked again), turns the automatic
    full collections off (the young generations are collected as before, which is where the
    relay's short-lived cycles die) and runs one full collection every ``FULL_EVERY`` seconds,
    for whatever cycles other code (HTTP clients, exceptions) leaves behind.
    """

    FULL_EVERY = 600.0
    NEVER = 1 << 30  # a generation-2 threshold CPython never reaches

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.collections = 0
        self.last_ms = 0.0
        self._saved: tuple[int, int, int] | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self._saved is not None:
            return
        gc.collect()
        gc.freeze()
        self._saved = gc.get_threshold()
        gc.set_threshold(self._saved[0], self._saved[1], self.NEVER)
        self._handle = self.loop.call_later(self.FULL_EVERY, self._full)

    def _full(self) -> None:
        started = time.perf_counter()
        found = gc.collect()
        self.last_ms = (time.perf_counter() - started) * 1e3
        self.collections += 1
        log.log(
            logging.INFO if self.last_ms > 50 else logging.DEBUG,
            "full garbage collection: %.1f ms, %d objects freed",
            self.last_ms,
            found,
        )
        self._handle = self.loop.call_later(self.FULL_EVERY, self._full)

    def stop(self) -> None:
        """CPython's own thresholds again (a test or an embedding process lives on)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            gc.unfreeze()
            self._saved = None


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


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any that goes on.

    A cancellation can be lost: Python 3.11's ``asyncio.wait_for`` returns the inner result
    when it completes in the same loop turn as the cancel (a probe refused at once, at the
    moment a failed start stops everything), and a loop then sleeps on for good: a plain
    ``cancel(); await task`` waited forever there.
    """
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)


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
        await cancel_and_wait([t for i in ids if (t := self._tasks.pop(i, None)) is not None])
