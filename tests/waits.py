"""Waiting in tests: a test waits for the condition it means, with a deadline, and never asserts
a state after a fixed sleep (a sleep long enough on an idle machine is too short on a loaded one,
and too long everywhere else).

``until`` polls a condition until it holds; ``settled`` reads a value until it stays put for a
quiet spell ("X stopped"). Both are bounded and fail with what they waited for. A check may be a
plain function or a coroutine function; a blocking one (an admin call) runs in a thread only if
the caller wraps it so: these poll on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["settled", "until"]

T = TypeVar("T")


async def _call(fn: Callable[[], T | Awaitable[T]]) -> T:
    got = fn()
    if inspect.isawaitable(got):
        return await got
    return got


async def until(
    check: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    what: str = "condition",
    every: float = 0.02,
) -> T:
    """Poll ``check`` every ``every`` seconds until it returns something truthy, and return that
    (AssertionError naming ``what`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not (got := await _call(check)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what} (last: {got!r})")
        await asyncio.sleep(every)
    return got


async def settled(
    read: Callable[[], T | Awaitable[T]],
    quiet: float = 1.0,
    timeout: float = 20.0,
    what: str = "value",
    every: float = 0.05,
) -> T:
    """Read a value until it stays the same for ``quiet`` seconds, and return it (AssertionError
    naming ``what`` if it still changes after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    last = await _call(read)
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} still changes after {timeout}s (last: {last!r})")
        await asyncio.sleep(every)
        now = await _call(read)
        if now != last:
            last, since = now, time.monotonic()
    return last
