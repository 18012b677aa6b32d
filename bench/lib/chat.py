"""A chat session through wslb checked token by token (every token once, in order, with the
text the reference worker gives it), with the time of every message: what the migration and
failover benchmarks measure a pause from. And a probe of this process's event-loop lag, which
inflates every such time."""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from backends.model import token_text

__all__ = ["LAG_TICK", "LagMonitor", "Stream", "open_session"]

LAG_TICK = 0.005  # the client's event-loop lag probe interval


async def open_session(
    http: aiohttp.ClientSession, url: str, sid: str
) -> tuple[aiohttp.ClientWebSocketResponse, dict[str, Any]]:
    """A chat session ``sid`` through wslb at ``url``, and its ``hello`` (checked)."""
    ws = await http.ws_connect(f"{url}/ws?session={sid}", autoping=True, max_msg_size=0)
    hello = await ws.receive_json(timeout=10)
    if hello.get("type") != "hello" or hello.get("session") != sid:
        raise RuntimeError(f"{sid}: expected hello, got {hello!r}")
    return ws, dict(hello)


@dataclass
class Stream:
    """One chat session through wslb, checked token by token."""

    sid: str
    answer: int
    first_worker: str = ""
    workers: list[str] = field(default_factory=list)  # the worker of each ``done``
    turn: int = 0
    expect: int = 0  # next token index of the current turn
    missing: set[int] = field(default_factory=set)
    prompt_words: int = 0  # words of every prompt sent so far (they are context tokens)
    times: array.array[float] = field(default_factory=lambda: array.array("d"))
    tokens: int = 0
    lost: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    bad_text: int = 0
    unexpected: int = 0
    closes: int = 0  # closes the client did not ask for
    close_info: str = ""
    connected: bool = False
    stopping: bool = False
    ws: aiohttp.ClientWebSocketResponse | None = None

    def in_answer(self) -> bool:
        return 0 < self.expect < self.answer

    async def prompt(self) -> None:
        assert self.ws is not None
        self.turn += 1
        self.expect = 0
        self.missing.clear()
        text = f"turn {self.turn} of {self.sid}: please keep talking"
        self.prompt_words += len(text.split())
        await self.ws.send_str(
            json.dumps({"type": "prompt", "text": text, "max_tokens": self.answer})
        )

    def on_token(self, msg: dict[str, Any]) -> None:
        turn, i = msg.get("turn"), msg.get("i")
        if turn != self.turn or not isinstance(i, int):
            self.unexpected += 1
            return
        self.tokens += 1
        if msg.get("text") != token_text(self.sid, turn, i):
            self.bad_text += 1
        if i == self.expect:
            self.expect += 1
        elif i > self.expect:
            self.missing.update(range(self.expect, i))
            self.expect = i + 1
        elif i in self.missing:
            self.missing.discard(i)
            self.out_of_order += 1
        else:
            self.duplicated += 1

    def finish(self) -> None:
        """The client stopped: tokens skipped in the unfinished answer count as lost too."""
        self.lost += len(self.missing)
        self.missing.clear()

    def context_at(self, sent: int) -> int:
        """Context tokens the worker held when it had sent ``sent`` messages on the session:
        the prompts plus every token (messages less the hello and the ``done`` of each earlier
        turn; exact while the session is in its first answer, the default)."""
        return self.prompt_words + max(0, sent - 1 - len(self.workers))

    def on_done(self, msg: dict[str, Any]) -> None:
        if msg.get("turn") != self.turn or msg.get("tokens") != self.answer:
            self.unexpected += 1
        if self.expect < self.answer:
            self.missing.update(range(self.expect, self.answer))
        self.lost += len(self.missing)
        self.missing.clear()
        self.workers.append(str(msg.get("worker")))

    async def run(self, http: aiohttp.ClientSession, url: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            self.ws, hello = await open_session(http, url, self.sid)
            self.first_worker = str(hello["worker"])
            self.connected = True
        await self.prompt()
        ws, times, now = self.ws, self.times, time.monotonic
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                if not self.stopping:
                    self.closes += 1
                    self.close_info = f"{msg.type.name} {ws.close_code} {msg.extra!r}"
                return
            times.append(now())
            obj = json.loads(msg.data)
            kind = obj.get("type")
            if kind == "token":
                self.on_token(obj)
            elif kind == "done":
                self.on_done(obj)
                if not self.stopping:
                    await self.prompt()
            else:
                self.unexpected += 1

    def stall(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(largest gap ending in [t0, t1], median gap) in seconds; None if too few messages."""
        t = self.times
        if len(t) < 5:
            return None
        gaps = [t[k] - t[k - 1] for k in range(1, len(t))]
        window = [t[k] - t[k - 1] for k in range(1, len(t)) if t0 <= t[k] <= t1]
        if not window:
            return None
        return max(window), statistics.median(gaps)


class LagMonitor:
    """How late this process's event loop wakes up (it timestamps the tokens)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_TICK)
            now = time.monotonic()
            self.samples.append((now, now - t - LAG_TICK))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def window(self, t0: float, t1: float) -> list[float]:
        return [lag for at, lag in self.samples if t0 <= at <= t1]
