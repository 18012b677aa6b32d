"""The shared timer wheel (balancer/aio/wheel.py): order, precision, cancel, reentrancy."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import uvloop

from balancer.aio.wheel import FIRE_CHUNK, Bucket, TimerWheel, granularity
from tests.waits import until


class FakeHandle:
    def __init__(self, when: float, cb: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when, self.cb, self.args = when, cb, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """A clock that only moves when told, with call_at and nothing else."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._heap: list[tuple[float, int, FakeHandle]] = []
        self._seq = itertools.count()
        self.errors: list[dict[str, Any]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, cb: Callable[..., None], *args: Any) -> FakeHandle:
        h = FakeHandle(when, cb, args)
        heapq.heappush(self._heap, (when, next(self._seq), h))
        return h

    def call_soon(self, cb: Callable[..., None], *args: Any) -> FakeHandle:
        return self.call_at(self.now, cb, *args)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        self.errors.append(context)

    @property
    def live(self) -> int:
        """Loop timers armed and not cancelled."""
        return sum(1 for _, _, h in self._heap if not h.cancelled)

    def advance(self, to: float) -> None:
        while self._heap and self._heap[0][0] <= to:
            when, _, h = heapq.heappop(self._heap)
            if not h.cancelled:
                self.now = max(self.now, when)
                h.cb(*h.args)
        self.now = max(self.now, to)


class Obj:
    __slots__ = ("fired", "name", "on_tick", "timer")

    def __init__(self, name: object = None, on_tick: Callable[[Obj], None] | None = None) -> None:
        self.name = name
        self.timer: Bucket | None = None
        self.fired: list[float] = []
        self.on_tick = on_tick

    def _tick(self) -> None:
        assert self.timer is None  # cleared before the call
        self.fired.append(LOOP.now)
        if self.on_tick is not None:
            self.on_tick(self)


LOOP = FakeLoop()


@pytest.fixture
def wheel() -> TimerWheel:
    global LOOP
    LOOP = FakeLoop()
    return TimerWheel(cast(asyncio.AbstractEventLoop, LOOP))


def test_granularity() -> None:
    assert granularity(20.0) == 1.0  # heartbeats: at most 1 s late
    assert granularity(3600.0) == 1.0
    assert granularity(0.2) == 2**-7  # a test's ping timeout: under 8 ms late
    assert granularity(0.3) == 2**-6
    assert granularity(0.001) == 2**-10
    assert granularity(0.0) == 2**-10
    for d in (0.003, 0.07, 0.5, 1.7, 9.0, 16.0, 17.0):
        g = granularity(d)
        assert g <= max(d / 16, 2**-10)
        assert g > d / 32 or g == 2**-10


def test_order(wheel: TimerWheel) -> None:
    order: list[Obj] = []
    objs = {d: Obj(d, order.append) for d in (0.5, 0.1, 0.3, 0.02, 0.2, 0.4, 30.0, 2.0)}
    for d, o in objs.items():
        wheel.schedule(o, d)
    LOOP.advance(LOOP.now + 40)
    assert [o.name for o in order] == sorted(objs)


def test_scattered_precision(wheel: TimerWheel) -> None:
    rnd = random.Random(6)
    objs: list[tuple[Obj, float, float]] = []
    order: list[Obj] = []
    for i in range(3000):
        LOOP.advance(LOOP.now + rnd.random() * 0.01)  # scheduled at scattered times
        delay = rnd.choice([rnd.uniform(0.0005, 0.05), rnd.uniform(0.05, 2), rnd.uniform(2, 60)])
        o = Obj(i, order.append)
        wheel.schedule(o, delay)
        objs.append((o, LOOP.now + delay, delay))
    assert wheel.buckets < 1500  # shared loop timers
    LOOP.advance(LOOP.now + 120)
    assert len(wheel) == 0 and wheel.buckets == 0 and LOOP.live == 0
    for o, due, delay in objs:
        assert len(o.fired) == 1, o.name
        late = o.fired[0] - due
        assert 0 <= late <= granularity(delay), (o.name, delay, late)  # never early
    assert len(order) == len(objs)
    assert all(a.fired[0] <= b.fired[0] for a, b in itertools.pairwise(order))


def test_precision_per_delay(wheel: TimerWheel) -> None:
    for delay in (0.0, 0.0004, 0.01, 0.2, 0.3, 0.5, 1.0, 5.0, 20.0, 3600.0):
        for start_offset in (0.0, 0.0001, 0.123456, 0.999):
            LOOP.advance(LOOP.now + start_offset)
            o = Obj(delay)
            start = LOOP.now
            wheel.schedule(o, delay)
            LOOP.advance(start + delay + granularity(delay))
            assert len(o.fired) == 1, (delay, start_offset)
            late = o.fired[0] - (start + delay)
            assert 0 <= late <= granularity(delay), (delay, start_offset, late)


def test_cancel(wheel: TimerWheel) -> None:
    objs = [Obj(i) for i in range(100)]
    for o in objs:
        wheel.schedule(o, 1.0)
    assert wheel.buckets == 1 and LOOP.live == 1 and len(wheel) == 100
    for o in objs[::2]:
        wheel.cancel(o)
        assert o.timer is None
    wheel.cancel(objs[0])  # twice: nothing
    wheel.cancel(Obj())  # never scheduled: nothing
    assert len(wheel) == 50
    LOOP.advance(LOOP.now + 2)
    assert [bool(o.fired) for o in objs] == [i % 2 == 1 for i in range(100)]
    # Cancelling the last object of a bucket disarms its loop timer.
    o = Obj()
    wheel.schedule(o, 5.0)
    assert LOOP.live == 1
    wheel.cancel(o)
    assert LOOP.live == 0 and wheel.buckets == 0
    LOOP.advance(LOOP.now + 10)
    assert not o.fired


def test_reschedule_replaces(wheel: TimerWheel) -> None:
    o = Obj()
    start = LOOP.now
    wheel.schedule(o, 10.0)
    wheel.schedule(o, 0.2)
    assert wheel.buckets == 1 and len(wheel) == 1 and LOOP.live == 1
    LOOP.advance(start + 0.2 + granularity(0.2))
    assert len(o.fired) == 1
    LOOP.advance(start + 20)
    assert len(o.fired) == 1
    o2 = Obj()
    wheel.schedule(o2, 0.2)
    wheel.schedule(o2, 10.0)  # later: the early bucket is dropped
    LOOP.advance(LOOP.now + 1)
    assert not o2.fired
    LOOP.advance(LOOP.now + 10)
    assert len(o2.fired) == 1


def test_reschedule_and_cancel_inside_callbacks(wheel: TimerWheel) -> None:
    # A periodic object (the heartbeat pattern): it reschedules itself from its tick.
    def again(o: Obj) -> None:
        if len(o.fired) < 5:
            wheel.schedule(o, 0.2)

    periodic = Obj("periodic", again)
    start = LOOP.now
    wheel.schedule(periodic, 0.2)
    # Three more in the same bucket: the first cancels the second and pushes the third later.
    victim, pushed = Obj("victim"), Obj("pushed")

    def meddle(o: Obj) -> None:
        wheel.cancel(victim)
        wheel.schedule(pushed, 1.0)

    first = Obj("first", meddle)
    for o in (first, victim, pushed):
        wheel.schedule(o, 0.2)
    assert wheel.buckets == 1
    # One that reschedules itself with delay 0 from its tick fires again, in a later callback.
    zero = Obj("zero", lambda o: wheel.schedule(o, 0) if len(o.fired) < 3 else None)
    wheel.schedule(zero, 0.2)
    LOOP.advance(start + 5)
    assert len(periodic.fired) == 5
    for a, b in itertools.pairwise([start, *periodic.fired]):
        assert 0.2 <= b - a <= 0.2 + granularity(0.2)
    assert len(first.fired) == 1
    assert victim.fired == []
    assert len(pushed.fired) == 1 and pushed.fired[0] >= first.fired[0] + 1.0
    assert len(zero.fired) == 3 and zero.fired[0] <= zero.fired[1] <= zero.fired[2]
    assert len(wheel) == 0 and wheel.buckets == 0 and LOOP.live == 0


def test_many_in_one_bucket(wheel: TimerWheel) -> None:
    objs = [Obj(i) for i in range(20000)]
    order: list[Obj] = []
    for o in objs:
        o.on_tick = order.append
        wheel.schedule(o, 20.0)
    assert wheel.buckets == 1 and LOOP.live == 1  # one loop timer, not 20,000
    assert all(o.timer is objs[0].timer for o in objs)
    LOOP.advance(LOOP.now + 21)
    assert order == objs  # in scheduling order, each once
    assert all(len(o.fired) == 1 and o.timer is None for o in objs)
    assert len(wheel) == 0 and wheel.buckets == 0


def test_a_big_bucket_fires_in_chunks_with_the_loop_running_between(wheel: TimerWheel) -> None:
    """Sessions opened together are due together: their ticks must not hold the loop for the
    whole bucket (the relay's reads wait behind it)."""
    seen: list[str] = []
    objs = [Obj(i) for i in range(3 * FIRE_CHUNK + 5)]
    late_victim = objs[-1]

    def first_tick(o: Obj) -> None:
        seen.append("tick 0")
        LOOP.call_soon(lambda: seen.append("other callback"))  # e.g. a socket read
        wheel.cancel(late_victim)  # not yet ticked, in a later chunk: it never fires

    objs[0].on_tick = first_tick
    for o in objs[1:]:
        o.on_tick = lambda o: seen.append("tick")
    for o in objs:
        wheel.schedule(o, 20.0)
    LOOP.advance(LOOP.now + 21)
    # The other callback ran after the first chunk, long before the bucket's end.
    assert seen.index("other callback") == FIRE_CHUNK
    assert all(len(o.fired) == 1 for o in objs[:-1]) and late_victim.fired == []
    assert seen.count("tick") + 1 == len(objs) - 1
    assert len(wheel) == 0 and wheel.buckets == 0


def test_len_counts_due_objects_until_they_tick(wheel: TimerWheel) -> None:
    objs = [Obj(i) for i in range(2 * FIRE_CHUNK)]
    counted: list[int] = []
    objs[0].on_tick = lambda o: counted.append(len(wheel))
    for o in objs:
        wheel.schedule(o, 1.0)
    LOOP.advance(LOOP.now + 2)
    assert counted == [2 * FIRE_CHUNK - 1]  # the rest of the bucket is still to tick
    assert len(wheel) == 0


def test_a_failing_callback_does_not_stop_the_bucket(wheel: TimerWheel) -> None:
    def boom(o: Obj) -> None:
        raise RuntimeError("boom")

    objs = [Obj(0), Obj(1, boom), Obj(2)]
    for o in objs:
        wheel.schedule(o, 0.5)
    LOOP.advance(LOOP.now + 1)
    assert all(len(o.fired) == 1 for o in objs)
    assert len(LOOP.errors) == 1 and isinstance(LOOP.errors[0]["exception"], RuntimeError)


class RealObj:
    __slots__ = ("fired", "loop", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.timer: Bucket | None = None
        self.fired: list[float] = []

    def _tick(self) -> None:
        self.fired.append(self.loop.time())


async def _real_loop_check() -> None:
    loop = asyncio.get_running_loop()
    wheel = TimerWheel(loop)
    cases = []
    for delay in (0.02, 0.2, 0.3, 0.2, 0.5):
        o = RealObj(loop)
        cases.append((o, loop.time() + delay, delay))
        wheel.schedule(o, delay)
        await asyncio.sleep(0.013)
    await until(lambda: all(o.fired for o, _, _ in cases), 10, "every timer fired")
    for o, due, delay in cases:
        assert len(o.fired) == 1
        late = o.fired[0] - due
        # The loop's own clock rounds timers to a millisecond; a busy shared CPU adds lateness.
        assert -0.002 <= late <= granularity(delay) + 0.1, (delay, late)


def test_real_asyncio_loop() -> None:
    asyncio.run(_real_loop_check())


def test_real_uvloop() -> None:
    uvloop.run(_real_loop_check())
