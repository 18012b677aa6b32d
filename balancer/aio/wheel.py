"""A shared timer for many objects: one loop timer per due time, not one per object.

Each live session needs one timer (heartbeat, idle, backpressure, close timeout). A per-session
``loop.call_later`` costs about 540 bytes of an idle session (uvloop's TimerHandle, its libuv
timer, a context copy and the bound method). The wheel keeps scheduled objects in buckets keyed
by their due time rounded up to a granularity that scales with the delay: the largest power of
two seconds not above ``delay / 16``, clamped to [2^-10 s, 1 s]. So a 20 s ping interval fires
at most about 1 s late (granularity 1 s), a 0.2 s ping timeout at most 8 ms late, and nothing
fires early. Objects that are due together share one bucket and one ``loop.call_at``; a bucket
costs a dict entry per object.

An object is in at most one bucket, and its ``timer`` attribute holds that bucket (``None`` when
it is not scheduled), so cancel is O(1). A due object gets ``timer = None``, then its ``_tick()``
is called; it may reschedule or cancel itself or any other object meanwhile.

A due bucket runs ``FIRE_CHUNK`` objects per loop callback and the rest in later ones
(``call_soon``), so the relay's reads and writes go on between them. Sessions opened together
are due together: 9,925 sessions opened in a few seconds sent their 20 s pings from a handful of
buckets, each one loop callback of tens of milliseconds, and every frame relayed meanwhile
waited (p99 62-75 ms in that window of ``bench/proxies.py``'s hold phase).
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

__all__ = ["Bucket", "Timed", "TimerWheel", "granularity"]

# Granularity bounds, as powers of two seconds: about 1 ms to 1 s.
MIN_EXP = -10
MAX_EXP = 0
# The granularity is at most this fraction of the delay (rounded down to a power of two).
SPREAD = 16
# Objects ticked per loop callback: a ping write each is well under a millisecond in all.
FIRE_CHUNK = 64


class Timed(Protocol):
    """What the wheel schedules: an object with a ``timer`` slot and a ``_tick`` method."""

    timer: Bucket | None

    def _tick(self) -> None: ...


class Bucket(dict[Timed, None]):
    """The objects due at ``when`` (insertion-ordered), and the loop timer that fires them."""

    __slots__ = ("handle", "when")

    def __init__(self, when: float) -> None:
        super().__init__()
        self.when = when
        self.handle: asyncio.TimerHandle | None = None


def granularity(delay: float) -> float:
    """The rounding step for ``delay`` seconds: a power of two, about ``delay / 16``."""
    if delay <= 0:
        return math.ldexp(1.0, MIN_EXP)
    exp = math.frexp(delay / SPREAD)[1] - 1  # floor(log2(delay / SPREAD))
    return math.ldexp(1.0, min(MAX_EXP, max(MIN_EXP, exp)))


class TimerWheel:
    """Calls ``obj._tick()`` once ``delay`` seconds after ``schedule(obj, delay)``, a little
    later (at most the delay's granularity, see the module doc), never earlier."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._buckets: dict[float, Bucket] = {}
        # Due buckets with objects left for later callbacks, by id (a dict is not hashable).
        self._firing: dict[int, Bucket] = {}

    def __len__(self) -> int:
        """How many objects are scheduled (due ones not yet ticked included)."""
        waiting = sum(len(b) for b in self._buckets.values())
        return waiting + sum(sum(o.timer is b for o in b) for b in self._firing.values())

    @property
    def buckets(self) -> int:
        """How many loop timers the wheel holds."""
        return len(self._buckets)

    def schedule(self, obj: Timed, delay: float) -> None:
        """(Re)schedule ``obj``: replaces its pending due time, if any."""
        if obj.timer is not None:
            self.cancel(obj)
        step = granularity(delay)
        due = math.ceil((self.loop.time() + max(0.0, delay)) / step) * step
        bucket = self._buckets.get(due)
        if bucket is None:
            bucket = Bucket(due)
            bucket.handle = self.loop.call_at(due, self._fire, bucket)
            self._buckets[due] = bucket
        bucket[obj] = None
        obj.timer = bucket

    def cancel(self, obj: Timed) -> None:
        """Unschedule ``obj`` (nothing if it is not scheduled)."""
        bucket = obj.timer
        if bucket is None:
            return
        obj.timer = None
        bucket.pop(obj, None)
        if not bucket and self._buckets.get(bucket.when) is bucket:
            del self._buckets[bucket.when]
            if bucket.handle is not None:
                bucket.handle.cancel()
                bucket.handle = None

    def _fire(self, bucket: Bucket) -> None:
        if self._buckets.get(bucket.when) is bucket:
            del self._buckets[bucket.when]
        bucket.handle = None
        # A snapshot: a callback may cancel or reschedule any object, itself included. Objects
        # that left this bucket meanwhile are skipped; rescheduling never lands back in this
        # (detached) bucket, so every object fires at most once here.
        self._firing[id(bucket)] = bucket
        self._run(bucket, list(bucket), 0)

    def _run(self, bucket: Bucket, due: list[Timed], start: int) -> None:
        end = min(start + FIRE_CHUNK, len(due))
        for i in range(start, end):
            obj = due[i]
            if obj.timer is not bucket:
                continue
            obj.timer = None
            try:
                obj._tick()
            except Exception as exc:  # one broken object must not stop the others
                self.loop.call_exception_handler(
                    {"message": "timer wheel callback failed", "exception": exc, "object": obj}
                )
        if end < len(due):
            self.loop.call_soon(self._run, bucket, due, end)
        else:
            self._firing.pop(id(bucket), None)
            bucket.clear()
