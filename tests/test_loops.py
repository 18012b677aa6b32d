"""GcPacer: wslb's own schedule for full garbage collections (balancer/aio/loops.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref

from balancer.aio.loops import GcPacer, cancel_and_wait


class Node:
    me: Node | None = None


async def test_pacer_freezes_start_up_and_replaces_automatic_full_collections() -> None:
    before = gc.get_threshold()
    pacer = GcPacer(asyncio.get_running_loop())
    pacer.FULL_EVERY = 0.05
    try:
        pacer.start()
        assert gc.get_freeze_count() > 0  # start-up's objects are out of every collection
        assert gc.get_threshold() == (before[0], before[1], GcPacer.NEVER)
        pacer.start()  # idempotent
        # A cycle that reaches the oldest generation is still freed: by the pacer's own run.
        node = Node()
        node.me = node
        alive = weakref.ref(node)
        gc.collect(1)  # promoted to generation 2, which CPython no longer collects by itself
        del node
        for _ in range(5):
            gc.collect(1)
        assert alive() is not None
        for _ in range(100):  # the pacer's runs are 50 ms apart; a busy machine delays them
            if pacer.collections >= 2:
                break
            await asyncio.sleep(0.05)
        assert alive() is None
        assert pacer.collections >= 2 and pacer.last_ms >= 0.0
    finally:
        pacer.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    pacer.stop()  # twice is harmless


async def test_cancel_and_wait_ends_a_task_that_swallowed_its_cancellation() -> None:
    """Python 3.11's ``wait_for`` returns its inner result when that completes in the same
    loop turn as a cancel, and the task goes on; a plain ``cancel(); await`` then waits for
    good (a failed start hung this way). ``cancel_and_wait`` cancels again until it ends."""
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # lost, as wait_for loses it
        await asyncio.sleep(30)

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task]), 5)
    assert swallowed.is_set() and task.cancelled()
