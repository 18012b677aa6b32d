"""What ``bench/rollout.py`` reads off a ``wslb.client`` session (the resuming client of its
streams), and the storm's bare resume handshake.

A session's events say how each loss went: ``reconnecting`` (attempt 1 carries what ended the
connection, later attempts why the try before failed) and ``resumed`` (``gap``: seconds from the
loss to the resumed 101). The storm times wslb's resumes in a burst, so its clients are not the
library (which reconnects at once by itself): ``Cut`` opens a session, cuts its TCP without a
close and, when told, makes the one reconnect with token and count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from websockets.asyncio.client import ClientConnection, connect

from wslb.client import FROM_HEADER, RESUMED_HEADER, TOKEN_HEADER, Session, new_token

__all__ = ["Cut", "gaps", "outcomes", "reconnects", "retries"]


def reconnects(s: Session) -> int:
    """Losses the session came back from."""
    return sum(e.kind == "resumed" for e in s.events)


def gaps(s: Session) -> list[float]:
    """Seconds from each loss to its resumed 101."""
    return [float(e.detail["gap"]) for e in s.events if e.kind == "resumed"]


def outcomes(s: Session) -> list[str]:
    """What ended each lost connection: ``lost`` (no close frame), ``1012`` (handed over),
    ``idle``, ``dropped``."""
    return [
        e.detail["why"] for e in s.events if e.kind == "reconnecting" and e.detail["attempt"] == 1
    ]


def retries(s: Session) -> list[str]:
    """Each failed reconnect try: its status (``503``) or error (``ConnectionRefusedError``)."""
    return [
        e.detail["why"] for e in s.events if e.kind == "reconnecting" and e.detail["attempt"] > 1
    ]


@dataclass
class Cut:
    """One idle session for the storm: ``open`` (hello read), ``cut`` (no close frame), then
    ``resume`` once (raises unless wslb resumed it from its count)."""

    url: str
    key: str
    token: str = ""
    count: int = 0
    ws: ClientConnection | None = None

    def target(self) -> str:
        return f"{self.url}{'&' if '?' in self.url else '?'}session={self.key}"

    async def open(self) -> None:
        self.token = new_token()
        self.ws = await connect(
            self.target(), additional_headers={TOKEN_HEADER: self.token}, open_timeout=30
        )
        hello = json.loads(await self.ws.recv())
        if hello.get("type") != "hello":
            raise RuntimeError(f"{self.key}: {hello}")
        self.count = 1

    def cut(self) -> None:
        if self.ws is not None:
            self.ws.transport.abort()

    async def resume(self) -> None:
        headers = {TOKEN_HEADER: self.token, FROM_HEADER: str(self.count)}
        self.ws = await connect(self.target(), additional_headers=headers, open_timeout=60)
        assert self.ws.response is not None
        got = self.ws.response.headers.get(RESUMED_HEADER)
        if got != str(self.count):
            raise RuntimeError(f"{self.key}: resumed from {got}, not {self.count}")

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
