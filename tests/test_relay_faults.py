"""The relay thread when memory runs out (``balancer/_offload.c``: "Out of memory").

``_offload._fail_next`` (test-only) makes the next allocations of the relay thread fail, or the
next ``events()``. Whatever fails, the thread loses no byte and strands no session: every byte
the worker sent is forwarded (and recorded), or handed back as backlog or carry, or still unread
in the worker's socket, the Python scanner agreeing on the frames; and a session the thread
gives back reaches the event loop (``Offload`` calls its ``reclaim``), even with every
allocation failing and many sessions returning at once.

Two halves, as in ``tests/test_offload.py``: the C module on socket pairs, then ``Offload`` on
an event loop relaying a stock ``websockets`` echo server over loopback TCP.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import pytest
from websockets.asyncio.server import serve

from balancer.aio import offload
from balancer.frames import OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, OP_TEXT
from tests.servers.websockets_echo import echo
from tests.test_offload import python_scan, read_available
from tests.waits import until

_relay: ModuleType | None
try:
    from balancer import _offload as _relay
except ImportError:
    _relay = None

pytestmark = pytest.mark.skipif(_relay is None, reason="balancer._offload is not built")

LIMIT = 65535
ALWAYS = 1 << 30  # every allocation fails


def C() -> ModuleType:
    assert _relay is not None
    return _relay


@pytest.fixture(autouse=True)
def _inert_afterwards() -> Iterator[None]:
    yield
    if _relay is not None:
        _relay._fail_next("alloc", 0)
        _relay._fail_next("events", 0)


@pytest.fixture
def relay() -> Iterator[Any]:
    r = C().Thread()
    yield r
    r.close()


def frame(opcode: int, payload: bytes, mask: bytes | None = None) -> bytes:
    """A frame with FIN set (masked, as a client sends it, when ``mask`` is given)."""
    n = len(payload)
    mbit = 0x80 if mask is not None else 0
    if n < 126:
        head = bytes([0x80 | opcode, mbit | n])
    elif n < 65536:
        head = bytes([0x80 | opcode, mbit | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, mbit | 127]) + n.to_bytes(8, "big")
    if mask is None:
        return head + payload
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


def frames_of(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each whole server frame in ``data`` (all of it must be frames)."""
    out = []
    pos = 0
    while pos < len(data):
        b0, b1 = data[pos], data[pos + 1]
        n, pos = b1 & 0x7F, pos + 2
        if n == 126:
            n, pos = int.from_bytes(data[pos : pos + 2], "big"), pos + 2
        elif n == 127:
            n, pos = int.from_bytes(data[pos : pos + 8], "big"), pos + 8
        assert pos + n <= len(data), "a frame cut short"
        out.append((b0 & 0x0F, data[pos : pos + n]))
        pos += n
    return out


def returned(relay: Any, handles: set[int], timeout: float = 5.0) -> set[int]:
    """Which of ``handles`` the thread reports RETURNED within ``timeout``."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and seen != handles:
        select.select([relay.fileno()], [], [], 0.05)
        seen |= {h for h, kind in relay.events() if kind == C().RETURNED and h in handles}
    return seen


class Pair:
    """A relay on two socket pairs: ``wpeer`` plays the worker, ``cpeer`` the client."""

    def __init__(self, relay: Any, record: bool, sndbuf: int | None = None) -> None:
        self.wpeer, self.wours = socket.socketpair()
        self.cours, self.cpeer = socket.socketpair()
        if sndbuf is not None:
            self.cours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            self.cpeer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        for s in (self.wours, self.cours):
            s.setblocking(False)
        self.handle: int = relay.add(self.wours.fileno(), self.cours.fileno(), LIMIT, record)

    def close(self) -> None:
        for s in (self.wpeer, self.wours, self.cours, self.cpeer):
            s.close()


# -- the C module on socket pairs ----------------------------------------------------------------


def fast_stream(rng: random.Random, count: int) -> bytes:
    sizes = [0, 1, 10, 60, 125, 126, 300, 4000, 20_000, 65535]
    return b"".join(
        frame(rng.choice([OP_TEXT, OP_BINARY]), rng.randbytes(rng.choice(sizes)))
        for _ in range(count)
    )


@pytest.mark.parametrize("seed", range(40))
def test_an_allocation_that_fails_loses_no_byte(relay: Any, seed: int) -> None:
    """The first allocations fail wherever the thread needs one (a carry of a frame cut by the
    read, the backlog of a client that does not keep up, the record): the session comes back
    NOMEM with its bytes, and forwarded + backlog + carry + unread is the stream."""
    rng = random.Random(seed)
    data = fast_stream(rng, rng.randrange(20, 120))
    record = rng.random() < 0.5
    slow = rng.random() < 0.4
    fails = rng.choice([1, 1, 2, 5])
    p = Pair(relay, record=record, sndbuf=4096 if slow else None)
    try:
        C()._fail_next("alloc", fails)
        # The first bytes end inside the first frame: the read that takes them alone must keep
        # a carry, so an allocation is needed at once (mostly: the rest follows soon).
        first = len(frame(OP_TEXT, frames_of(data)[0][1]))
        cut = rng.randrange(1, first)
        p.wpeer.sendall(data[:cut])
        time.sleep(0.01)

        def write() -> None:
            pos = cut
            while pos < len(data):
                n = rng.choice([1, 7, 1500, 70_000])
                try:
                    p.wpeer.sendall(data[pos : pos + n])
                except OSError:
                    return
                pos += n

        writer = threading.Thread(target=write)
        writer.start()
        got = bytearray()
        back = False
        deadline = time.monotonic() + 10
        settled = 0.0
        while not back and time.monotonic() < deadline:
            if not slow:
                got += read_available(p.cpeer, timeout=0.05)
            back = p.handle in returned(relay, {p.handle}, timeout=0.05)
            if not writer.is_alive():
                settled = settled or time.monotonic() + 0.5
                if time.monotonic() > settled:
                    break
        if not back:  # every read was whole frames, and the client kept up
            assert C()._fail_next("alloc", -1) == fails, "an allocation failed, no hand-back"
        carry, backlog, rec, frames, nbytes, reason, _ = relay.remove(p.handle)
        assert reason == (C().NOMEM if back else C().TAKEN_BACK)
        got += read_available(p.cpeer)
        rest = read_available(p.wours, timeout=1.0)
        while True:  # the writer may still be blocked on a full worker socket
            writer.join(timeout=0.05)
            if not writer.is_alive():
                break
            rest += read_available(p.wours, timeout=0.05)
        rest += read_available(p.wours, timeout=0.2)
        forwarded = bytes(got) + backlog
        assert forwarded + carry + rest == data, "bytes lost or repeated"
        assert nbytes == len(forwarded)
        assert python_scan(forwarded).frames == frames
        # What Python scans next starts at a frame boundary: the rest is whole frames.
        assert python_scan(carry + rest).frames + frames == len(frames_of(data))
        if record:
            assert rec == forwarded, "the journal would miss bytes"
    finally:
        p.close()


def test_returns_reach_the_event_loop_with_every_allocation_failing(relay: Any) -> None:
    """Many sessions returned at once, nothing allocatable: each one's RETURNED is reported
    (a queued event needs no memory of its own)."""
    pairs = [Pair(relay, record=False) for _ in range(100)]
    try:
        C()._fail_next("alloc", ALWAYS)
        for i, p in enumerate(pairs):
            if i % 2:
                p.wpeer.shutdown(socket.SHUT_WR)  # EOF
            else:
                p.wpeer.sendall(frame(OP_PING, b"p"))  # a frame it must not take
        handles = {p.handle for p in pairs}
        assert returned(relay, handles) == handles, "sessions stranded in the thread"
        for i, p in enumerate(pairs):
            carry, _, _, _, _, reason, _ = relay.remove(p.handle)
            # NOMEM once the thread has no read buffer left (it became a carry): unread then.
            assert reason in ((C().EOF if i % 2 else C().FRAME), C().NOMEM)
            assert carry + read_available(p.wours) == (b"" if i % 2 else frame(OP_PING, b"p"))
    finally:
        for p in pairs:
            p.close()


def test_events_that_cannot_be_listed_are_reported_next_time(relay: Any) -> None:
    """``events()`` raising MemoryError keeps the events: the next call has them."""
    p = Pair(relay, record=False)
    try:
        p.wpeer.shutdown(socket.SHUT_WR)
        select.select([relay.fileno()], [], [], 5.0)
        time.sleep(0.05)
        C()._fail_next("events", 1)
        with pytest.raises(MemoryError):
            relay.events()
        assert select.select([relay.fileno()], [], [], 5.0)[0], "nothing says events wait"
        assert (p.handle, C().RETURNED) in relay.events()
    finally:
        relay.remove(p.handle)
        p.close()


def test_fail_next_is_test_only_and_inert_unless_set() -> None:
    assert C()._fail_next("alloc", 0) == 0
    C()._fail_next("alloc", 3)
    assert C()._fail_next("alloc", -1) == 3  # only told
    assert C()._fail_next("alloc", 0) == 3  # what was left of it
    with pytest.raises(ValueError):
        C()._fail_next("disk", 1)


# -- Offload on an event loop, a stock websockets echo server behind it ------------------------


class Held:
    """A session as ``Offload`` sees it: it only records how it came back."""

    def __init__(self, off: offload.Offload) -> None:
        self.off = off
        self.handle = -1
        self.back: asyncio.Future[offload.Returned] = asyncio.get_running_loop().create_future()

    def reclaim(self) -> None:
        if not self.back.done():
            self.back.set_result(self.off.give_back(self.handle))

    def flush_record(self) -> None:
        pass


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async with serve(echo, "127.0.0.1", 0, max_size=None) as server:
        yield server.sockets[0].getsockname()[1]


async def upgraded(port: int) -> tuple[socket.socket, bytes]:
    """A worker leg as wslb has it: a plain socket past the 101; the bytes read after it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    await loop.sock_sendall(sock, request.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await loop.sock_recv(sock, 4096)
        assert chunk, "the server closed before its 101"
        head += chunk
    status, _, after = head.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 101")
    return sock, after


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP connection: (the end wslb holds, the client's end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    ours.setblocking(False)
    peer.setblocking(False)
    return ours, peer


async def relay_echoes(off: offload.Offload, port: int, rng: random.Random) -> None:
    """Echoes through the thread until it gives the session back (a pong, or NOMEM); then
    everything the server sent is accounted for, in order."""
    loop = asyncio.get_running_loop()
    wsock, pre = await upgraded(port)
    cours, cpeer = tcp_pair()
    s = Held(off)
    got = bytearray()

    async def client_reads() -> None:
        while True:
            chunk = await loop.sock_recv(cpeer, 1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = asyncio.create_task(client_reads())
    try:
        s.handle = off.take(s, wsock.fileno(), cours.fileno(), LIMIT, True)
        sizes = [1, 20, 125, 126, 4000, 30_000, 65535]
        sent = [rng.randbytes(rng.choice(sizes)) for _ in range(60)]
        for m in sent:  # the event loop writes the worker (Rule 7); the thread reads it
            await loop.sock_sendall(wsock, frame(OP_BINARY, m, mask=os.urandom(4)))
        await loop.sock_sendall(wsock, frame(OP_PING, b"end", mask=os.urandom(4)))
        r = await asyncio.wait_for(s.back, 20)  # through Offload._events, not by the test
        assert r.reason in (C().NOMEM, C().FRAME)
        # What the thread forwarded has reached the client's reader.
        await until(lambda: len(got) + len(r.backlog) >= r.nbytes, 10, "the forwarded bytes")
        forwarded = bytes(got) + r.backlog
        assert r.record == forwarded and r.nbytes == len(forwarded)
        assert python_scan(forwarded).frames == r.frames
        # The rest, read by "Python" now, until every echo and the pong are in (the server
        # answers a ping at once: its pong may overtake echoes it has not sent yet).
        rest = bytearray(r.carry)

        def whole() -> list[tuple[int, bytes]]:
            return frames_of_prefix(pre + forwarded + bytes(rest))

        while len(whole()) < len(sent) + 1:
            chunk = await asyncio.wait_for(loop.sock_recv(wsock, 1 << 20), 10)
            assert chunk
            rest += chunk
        stream = frames_of(pre + forwarded + bytes(rest))
        assert [p for op, p in stream if op == OP_BINARY] == sent, "lost, repeated or reordered"
        assert [p for op, p in stream if op == OP_PONG] == [b"end"]
        await loop.sock_sendall(wsock, frame(OP_CLOSE, b"\x03\xe8", mask=os.urandom(4)))
    finally:
        reader.cancel()
        for sock in (wsock, cours, cpeer):
            sock.close()


def frames_of_prefix(data: bytes) -> list[tuple[int, bytes]]:
    """The whole frames at the start of ``data``."""
    out = []
    pos = 0
    while pos + 2 <= len(data):
        n, head = data[pos + 1] & 0x7F, 2
        if n == 126:
            if pos + 4 > len(data):
                break
            n, head = int.from_bytes(data[pos + 2 : pos + 4], "big"), 4
        elif n == 127:
            if pos + 10 > len(data):
                break
            n, head = int.from_bytes(data[pos + 2 : pos + 10], "big"), 10
        if pos + head + n > len(data):
            break
        out.append((data[pos] & 0x0F, data[pos + head : pos + head + n]))
        pos += head + n
    return out


@pytest.mark.parametrize(("sessions", "fails"), [(1, 0), (1, 1), (1, 3), (8, ALWAYS)])
async def test_offload_gets_every_session_back_intact(
    echo_port: int, sessions: int, fails: int
) -> None:
    loop = asyncio.get_running_loop()
    off = offload.Offload(loop, Counter())
    try:
        C()._fail_next("alloc", fails)
        rng = random.Random(sessions * 100 + fails)
        await asyncio.gather(*(relay_echoes(off, echo_port, rng) for _ in range(sessions)))
        assert off.sessions == {}
        if fails:
            assert off.handovers["no memory"] > 0
    finally:
        C()._fail_next("alloc", 0)
        off.close()
