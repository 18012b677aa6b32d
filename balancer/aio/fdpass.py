"""Messages with descriptors attached over a Unix stream socket (``SCM_RIGHTS``), on the loop.

Two exchanges move sockets between processes: a detached session to the serving process its
client reconnected to (``handover.py``) and, on a restart, the listeners and every live session
to the new code (``restart.py``). Both frame a message as a short head sent with the
descriptors attached and a body read to its exact length, so a read never runs into the next
message's descriptors.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import struct

__all__ = ["LEN", "Truncated", "read_exact", "read_line", "readable", "recv_head", "send_head"]

LEN = struct.Struct("!Q")  # a body's length, after a message's one-byte kind


async def readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(sock.fileno(), ready)
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


async def read_line(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int) -> bytes:
    """One line (without its newline) of at most ``limit`` bytes; ValueError otherwise."""
    buf = b""
    while b"\n" not in buf:
        chunk = await loop.sock_recv(sock, limit)
        if not chunk or len(buf) + len(chunk) > limit:
            raise ValueError("bad or cut-short line")
        buf += chunk
    return buf.partition(b"\n")[0]


async def read_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, min(n - len(buf), 1 << 20))
        if not chunk:
            raise ValueError("peer closed mid-message")
        buf += chunk
    return bytes(buf)


async def send_head(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """``data`` (a few bytes) with ``fds`` attached; retried while the socket would block."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while True:
        try:
            sent = sock.sendmsg([data], anc)
        except BlockingIOError:
            await asyncio.sleep(0.001)
            continue
        if sent < len(data):  # the descriptors went with the first byte
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, data[sent:])
        return


class Truncated(OSError):
    """Descriptors sent with a message did not all arrive (this process is at its open-file
    limit: the kernel drops what it cannot install). ``data`` is the message's head."""

    def __init__(self, data: bytes) -> None:
        super().__init__("descriptors lost in transit: at the open-file limit (ulimit -n)?")
        self.data = data


async def recv_head(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, maxfds: int = 1
) -> tuple[bytes, list[int]]:
    """``n`` bytes (or fewer if the peer's answer is one byte shorter by design: "N") and the
    descriptors that came with them. ValueError when the peer closed; ``Truncated`` (the
    head read whole, the descriptors that came closed) when some did not come."""
    while True:
        await readable(loop, sock)
        try:
            data, fds, flags, _ = socket.recv_fds(sock, n, maxfds)
        except BlockingIOError:
            continue
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            if len(data) < n:
                data += await read_exact(loop, sock, n - len(data))
            raise Truncated(data)
        for fd in fds:
            # Not inherited by a child started later (recvmsg leaves received descriptors
            # inheritable, and uvloop's spawn keeps those): a copy of a client's socket in
            # a spawned process would keep the connection open after wslb closed it.
            os.set_inheritable(fd, False)
        if not data:
            for fd in fds:
                socket.close(fd)
            raise ValueError("peer closed")
        if len(data) < n and data[:1] != b"N":
            data += await read_exact(loop, sock, n - len(data))
        return data, list(fds)
