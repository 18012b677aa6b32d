"""A raw WebSocket client over asyncio streams, for sending what real clients never would."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import struct

from balancer.frames import OP_CLOSE, build_frame, parse_close_payload


class RawClient:
    opened: list[RawClient] = []  # closed by the autouse fixture in conftest.py

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        RawClient.opened.append(self)
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def connect(
        cls,
        port: int,
        path: str = "/ws",
        headers: dict[str, str] | None = None,
        raw_request: bytes | None = None,
    ) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        c = cls(reader, writer)
        if raw_request is None:
            key = base64.b64encode(os.urandom(16)).decode()
            h = {
                "Host": f"127.0.0.1:{port}",
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Key": key,
                "Sec-WebSocket-Version": "13",
            }
            h.update(headers or {})
            lines = [f"GET {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items() if v]
            raw_request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        writer.write(raw_request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status_line, *rest = head.decode("latin-1").split("\r\n")
        c.status = int(status_line.split()[1])
        for line in rest:
            if ":" in line:
                k, v = line.split(":", 1)
                c.headers[k.strip().lower()] = v.strip()
        return c

    async def read_frame(self, timeout: float = 5.0) -> tuple[int, bytes]:
        async def read() -> tuple[int, bytes]:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", await self.reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
            return b0 & 0x0F, await self.reader.readexactly(n)

        return await asyncio.wait_for(read(), timeout)

    async def read_until_close(self, timeout: float = 5.0) -> tuple[int, str]:
        """Skip data and control frames until a close frame; return its code and reason."""
        while True:
            op, payload = await self.read_frame(timeout)
            if op == OP_CLOSE:
                return parse_close_payload(payload)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def send_frame(
        self, op: int, payload: bytes = b"", mask: bool = True, fin: bool = True
    ) -> None:
        self.writer.write(build_frame(op, payload, mask=mask, fin=fin))

    async def eof(self, timeout: float = 5.0) -> bool:
        """True once the peer has closed the connection (whatever it sent before)."""
        try:
            await asyncio.wait_for(self.reader.read(), timeout)
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        return True

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    @classmethod
    async def close_all(cls) -> None:
        while cls.opened:
            c = cls.opened.pop()
            c.close()
            with contextlib.suppress(Exception):
                await c.writer.wait_closed()
