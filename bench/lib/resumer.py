"""A client that keeps its session across drops, as docs/resume.md tells a client to: the
resume token from the first 101, the count of data messages received, a reconnect with both
after a drop without a close (or a ``1012`` whose reason ends in ``: resume``), with backoff,
until the session is back or a deadline passes. The tier tests and ``bench/rollout.py`` use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

__all__ = ["Resumer", "SessionLost", "resumable_close"]


class SessionLost(Exception):
    """The session cannot go on: a close that is an ending, a 409, or no reconnect in time."""


def resumable_close(exc: ConnectionClosed) -> bool:
    """A drop without a close frame, or wslb's close saying "resume"."""
    rcvd = exc.rcvd
    if rcvd is None:
        return True
    return rcvd.code == 1012 and rcvd.reason.endswith(": resume")


@dataclass
class Resumer:
    """One session through ``url`` (``?session=key`` is added)."""

    url: str
    key: str
    deadline: float = 30.0  # seconds a reconnect may take in all
    ssl_ctx: ssl.SSLContext | None = None
    token: str | None = None
    count: int = 0
    ws: ClientConnection | None = None
    reconnects: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds from a drop to the resumed 101
    outcomes: list[str] = field(default_factory=list)  # how each drop ended
    retries: list[str] = field(default_factory=list)  # each failed reconnect: status or error
    last_at: float = 0.0
    pending: list[str | bytes] = field(default_factory=list)  # read while resuming a send

    def target(self) -> str:
        sep = "&" if "?" in self.url else "?"
        return f"{self.url}{sep}session={self.key}"

    async def open(self) -> None:
        self.ws = await connect(self.target(), ssl=self.ssl_ctx, open_timeout=10, max_size=None)
        assert self.ws.response is not None
        self.token = self.ws.response.headers.get("X-WSLB-Resume-Token")

    async def send(self, obj: dict[str, Any] | str) -> None:
        """Send a message (JSON unless a string); a connection found dropped is resumed
        first (its unread data messages are read on, as ``recv`` would: none is lost)."""
        data = obj if isinstance(obj, str) else json.dumps(obj)
        while True:
            assert self.ws is not None
            try:
                await self.ws.send(data)
                return
            except ConnectionClosed as exc:
                if not resumable_close(exc):
                    raise SessionLost(f"closed: {exc}") from None
                # Messages that came before the close are still to be read: they count.
                drained = await self._drain()
                self.count += len(drained)
                self.pending.extend(drained)
                await self._resume(f"{exc.rcvd.code}" if exc.rcvd else "drop")

    async def _drain(self) -> list[str | bytes]:
        """What the dropped connection received and nobody read yet."""
        out: list[str | bytes] = []
        assert self.ws is not None
        while True:
            try:
                out.append(await asyncio.wait_for(self.ws.recv(), 0.01))
            except (ConnectionClosed, TimeoutError):
                return out

    async def recv(self) -> dict[str, Any]:
        """The session's next message as JSON; a drop is resumed underneath."""
        value = json.loads(await self.recv_raw())
        assert isinstance(value, dict)
        return value

    async def recv_raw(self) -> str | bytes:
        """The session's next message; a drop is resumed underneath."""
        if self.pending:  # counted when they were read (``send``)
            return self.pending.pop(0)
        while True:
            assert self.ws is not None
            try:
                raw = await self.ws.recv()
            except ConnectionClosed as exc:
                if not resumable_close(exc):
                    raise SessionLost(f"closed: {exc}") from None
                await self._resume(f"{exc.rcvd.code}" if exc.rcvd else "drop")
                continue
            self.count += 1
            self.last_at = time.monotonic()
            return raw

    async def _resume(self, why: str) -> None:
        if self.token is None:
            raise SessionLost("no resume token")
        t0 = time.monotonic()
        delay = 0.02
        while True:
            headers = {"X-WSLB-Resume-Token": self.token, "X-WSLB-Resume-From": str(self.count)}
            try:
                ws = await connect(
                    self.target(),
                    ssl=self.ssl_ctx,
                    additional_headers=headers,
                    open_timeout=10,
                    max_size=None,
                )
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status == 409:
                    raise SessionLost(f"409 {exc.response.body!r}") from None
                # 429, 502, 503: the tier is busy or moving; try again
                self.retries.append(str(status))
            except (OSError, TimeoutError, ConnectionClosed) as exc:
                self.retries.append(type(exc).__name__)
            else:
                assert ws.response is not None
                got = ws.response.headers.get("X-WSLB-Resumed")
                if got != str(self.count):
                    await ws.close()
                    raise SessionLost(f"resumed from {got}, not {self.count}")
                self.ws = ws
                self.reconnects += 1
                self.gaps.append(time.monotonic() - t0)
                self.outcomes.append(why)
                return
            if time.monotonic() - t0 > self.deadline:
                raise SessionLost(f"no resume within {self.deadline}s")
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    async def resume(self) -> None:
        """Reconnect now with the token and count (after ``drop``, say): a burst of resumes."""
        await self._resume("asked")

    def drop(self) -> None:
        """Cut the connection without a close (a network change)."""
        if self.ws is not None:
            transport = self.ws.transport
            transport.abort()

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
