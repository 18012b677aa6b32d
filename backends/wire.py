"""What the reference worker and the engine bridge share: the wire constants, the inter-token
latency histogram and the Realtime connections' outbox, so the two workers cannot drift apart.

A leaf module: ``backends.worker`` (whose ``main`` dispatches to the bridge) and
``backends.bridge`` both import it, neither imports the other back. What wslb's journal must
agree on too (the queue's bound, the prompt rules) is ``balancer.contract``'s; the bound is
re-exported here with the rest of the wire.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from backends.protocol.realtime import Send
from balancer.contract import MAX_QUEUED_PROMPTS

__all__ = [
    "ITL_BUCKETS",
    "MAX_QUEUED_PROMPTS",
    "MAX_SESSION_ID_LEN",
    "MAX_STATE_BYTES",
    "METRICS_CONTENT_TYPE",
    "PARK_HEADER",
    "READY_PREFIX",
    "REALTIME_PATH",
    "REATTACH_FROM_HEADER",
    "REATTACH_HEADER",
    "RESPONSES_PATH",
    "RESUMED_HEADER",
    "RESUME_HEADER",
    "Histogram",
    "Outbox",
]

READY_PREFIX = "wslb-worker ready"  # the line printed once listening
RESUME_HEADER = "X-WSLB-Resume"
# Parking (``backends.park``): the park parameters of an upgrade, and a reattach's headers.
PARK_HEADER = "X-WSLB-Park"
REATTACH_HEADER = "X-WSLB-Reattach"
REATTACH_FROM_HEADER = "X-WSLB-Reattach-From"
RESUMED_HEADER = "X-WSLB-Resumed"
REALTIME_PATH = "/v1/realtime"  # the OpenAI Realtime protocol; every other path: the chat protocol
RESPONSES_PATH = "/v1/responses"  # the OpenAI Responses API's WebSocket mode
MAX_SESSION_ID_LEN = 512  # wslb's keys: 256 characters, plus an owner's scope (TAG~KEY) with JWT
MAX_STATE_BYTES = 64 * 1024 * 1024  # a thaw carries the whole conversation
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets for vllm:inter_token_latency_seconds, which wslb's tpot signal reads.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A lock-free histogram for one event loop (prometheus-client's takes a lock per
    observation, and this one is observed once per token)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: ``(le, observations <= le)``, ending with ``+Inf``."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


class Outbox(deque[Send]):
    """A Realtime connection's server events not written yet, in order.

    Whoever flushes writes them: each event is popped and written with no await between, so a
    freeze finds every event either still here (it moves with the session: ``snapshot(unsent=
    outbox)``) or sent (counted in the connection's ``sent``).
    """

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        super().__init__()
        self._send = send

    async def flush(self, *, quiet: bool = False) -> None:
        """Write what is queued; ``quiet``: a connection gone meanwhile is not an error here."""
        with contextlib.suppress(*((ConnectionError,) if quiet else ())):
            while self:
                await self._send(self.popleft().event)

    async def push(self, events: Iterable[Send]) -> None:
        """Queue ``events`` and write everything queued (a gone connection is no error)."""
        self.extend(events)
        await self.flush(quiet=True)
