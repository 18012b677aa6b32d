"""The relay thread (``balancer/_offload.c``, ``balancer/aio/offload.py``; Rule 7 of session.py).

Two halves. The C module alone, on socket pairs, against the Python scanner as the referee: for
random server streams cut at random, what the thread forwards is a prefix of whole fast frames
that the scanner counts the same way, it stops exactly at the first frame it must not take, and
forwarded + unsent + carried + still unread is the stream, byte for byte, wherever it is taken
back; a client that stops reading stops the thread reading the worker. Then a real wslb in
front of a stock ``websockets`` echo server (nobody wrote it for wslb), with the config a new
user writes: thousands of echoes of every size, pings among them, come back intact and in order
with the thread on, exactly as with ``relay: {thread: false}``.
"""

from __future__ import annotations

import asyncio
import random
import select
import shutil
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from websockets.asyncio.client import connect

from balancer.aio import offload
from balancer.frames import OP_BINARY, OP_CLOSE, OP_CONT, OP_PING, OP_PONG, OP_TEXT, FrameScanner
from balancer.httpmsg import END, NEED_DATA, BadResponse, ResponseReader
from tests.procs import Wslb
from tests.servers import Server

_relay: ModuleType | None
try:
    from balancer import _offload as _relay
except ImportError:  # not built: the C half is skipped, the wslb half runs in Python
    _relay = None


def C() -> ModuleType:
    """The C module (the tests that use it are skipped without it)."""
    assert _relay is not None
    return _relay


LIMIT = 65535
MESSAGES = 2000


def frame(opcode: int, payload: bytes, fin: bool = True, rsv: int = 0, mask: bool = False) -> bytes:
    """A frame as a server sends it (``mask`` only to make a bad one)."""
    b0 = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    mbit = 0x80 if mask else 0
    if n < 126:
        head = bytes([b0, mbit | n])
    elif n < 65536:
        head = bytes([b0, mbit | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([b0, mbit | 127]) + n.to_bytes(8, "big")
    return head + (b"\0\0\0\0" if mask else b"") + payload


def fast_frame(rng: random.Random) -> bytes:
    size = rng.choice([0, 1, 10, 60, 125, 126, 300, 4000, 65535])
    return frame(rng.choice([OP_TEXT, OP_BINARY]), rng.randbytes(size))


def other_frame(rng: random.Random) -> bytes:
    """A frame the thread must hand back at."""
    kind = rng.randrange(6)
    if kind == 0:
        return frame(OP_PING, b"p" * rng.randrange(10))
    if kind == 1:
        return frame(OP_PONG, b"")
    if kind == 2:
        return frame(OP_TEXT, b"part", fin=False) + frame(OP_CONT, b"end")
    if kind == 3:
        return frame(OP_BINARY, rng.randbytes(70_000))  # a 64-bit length
    if kind == 4:
        return frame(OP_TEXT, b"x", rsv=0x40)
    return frame(OP_CLOSE, (1000).to_bytes(2, "big"))


def stream(rng: random.Random) -> tuple[bytes, int]:
    """Fast frames, then (mostly) one the thread must not take, then more: the stream and
    where the first other frame starts (its length when there is none)."""
    fast = b"".join(fast_frame(rng) for _ in range(rng.randrange(0, 60)))
    if rng.random() < 0.2:
        return fast, len(fast)
    rest = other_frame(rng) + b"".join(fast_frame(rng) for _ in range(rng.randrange(0, 5)))
    return fast + rest, len(fast)


need_relay = pytest.mark.skipif(_relay is None, reason="balancer._offload is not built")


def test_built_where_it_can_be() -> None:
    """On Linux with a C compiler the install builds the thread (CI must not lose it quietly)."""
    if sys.platform.startswith("linux") and shutil.which("cc"):
        assert _relay is not None


class Pair:
    """A relay on two socket pairs: ``wpeer`` plays the worker, ``cpeer`` the client."""

    def __init__(
        self, relay: Any, record: bool = True, sndbuf: int | None = None, chunked: bool = False
    ) -> None:
        self.wpeer, self.wours = socket.socketpair()
        self.cours, self.cpeer = socket.socketpair()
        if sndbuf is not None:
            self.cours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            self.cpeer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        for s in (self.wours, self.cours):
            s.setblocking(False)
        self.relay = relay
        self.handle: int = relay.add(
            self.wours.fileno(), self.cours.fileno(), LIMIT, record, chunked
        )

    def close(self) -> None:
        for s in (self.wpeer, self.wours, self.cours, self.cpeer):
            s.close()


@pytest.fixture
def relay() -> Iterator[Any]:
    if _relay is None:
        pytest.skip("balancer._offload is not built")
    r = _relay.Thread()
    yield r
    r.close()


def write_chunks(sock: socket.socket, data: bytes, rng: random.Random, eof: bool) -> None:
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 2, 7, 100, 1500, 70_000])
        sock.sendall(data[pos : pos + n])
        pos += n
        if rng.random() < 0.3:
            time.sleep(0.0005)
    if eof:
        sock.shutdown(socket.SHUT_WR)


def read_available(sock: socket.socket, until_eof: bool = False, timeout: float = 2.0) -> bytes:
    out = bytearray()
    deadline = time.monotonic() + timeout
    sock.setblocking(False)
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], 0.02)
        if not r:
            if not until_eof:
                break
            continue
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def wait_returned(relay: Any, handle: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([relay.fileno()], [], [], 0.05)
        if any(h == handle and kind == C().RETURNED for h, kind in relay.events()):
            return True
    return False


def python_scan(data: bytes) -> FrameScanner:
    sc = FrameScanner(masked=False, max_frame_size=16 << 20, max_message_size=1 << 62)
    assert sc.feed(data) == data
    return sc


@dataclass
class Run:
    """What a relayed stream became: sent to the client, kept, left unread, and the counts."""

    forwarded: bytes
    carry: bytes
    rest: bytes
    record: bytes
    frames: int
    nbytes: int
    reason: int
    returned: bool

    def check_returned(self, stopped: bool, eof: bool) -> None:
        """Returned at what it must not take (``stopped``), else at the worker's EOF."""
        if stopped:
            assert self.returned and self.reason == C().FRAME
        elif eof:
            assert self.returned and self.reason == C().EOF


def run_until_returned(
    p: Pair, data: bytes, first_other: int, eof: bool, rng: random.Random
) -> Run:
    """The worker writes ``data`` in random pieces until the thread returns the session (or
    has forwarded all of it, when nothing would); then the session is taken back."""
    relay = p.relay
    writer = threading.Thread(target=write_chunks, args=(p.wpeer, data, rng, eof))
    writer.start()
    got = bytearray()
    returned = False
    # Bounded generously: the loop ends as soon as the thread returns the session (or has
    # forwarded everything); 10 s was not always enough on a machine busy with other work.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not returned:
        got += read_available(p.cpeer)
        # RETURNED only: a RECORD event (8 KiB recorded) says nothing of where the stream is,
        # and taking the session back at it cut the stream short on a slow machine.
        returned = any(h == p.handle and kind == C().RETURNED for h, kind in relay.events())
        if not returned and len(got) == len(data) == first_other and not eof:
            break  # all fast, no end: nothing will return it
    carry, backlog, record, frames, nbytes, reason, _ = relay.remove(p.handle)
    got += read_available(p.cpeer)
    # What the worker still writes is read here while it does: a session given back early (a
    # chunked body whose client stopped taking it) leaves more than a socket buffer unread.
    rest = bytearray()
    while writer.is_alive():
        rest += read_available(p.wours, timeout=0.05)
    writer.join()
    rest += read_available(p.wours, until_eof=eof, timeout=1.0)
    return Run(bytes(got) + backlog, carry, bytes(rest), record, frames, nbytes, reason, returned)


@pytest.mark.parametrize("seed", range(60))
def test_stops_at_the_first_frame_it_must_not_take(relay: Any, seed: int) -> None:
    rng = random.Random(seed)
    data, first_other = stream(rng)
    eof = first_other == len(data) or rng.random() < 0.5
    p = Pair(relay)
    try:
        run = run_until_returned(p, data, first_other, eof, rng)
        forwarded, carry, rest, record = run.forwarded, run.carry, run.rest, run.record
        frames, nbytes = run.frames, run.nbytes
        assert forwarded + carry + rest == data
        assert record == forwarded
        # Exactly the fast frames, up to the first other one (or the end).
        assert len(forwarded) == first_other
        sc = python_scan(forwarded)
        assert (frames, nbytes) == (sc.frames, len(forwarded))
        assert sc.messages == frames and sc.at_rest
        run.check_returned(first_other < len(data), eof)
    finally:
        p.close()


def fast_chunk(rng: random.Random) -> bytes:
    data = rng.randbytes(rng.choice([1, 2, 50, 300, 4000, LIMIT]))
    size = (
        f"{len(data):x}" if rng.random() < 0.5 else f"{len(data):X}".rjust(rng.randint(1, 8), "0")
    )
    return size.encode() + b"\r\n" + data + b"\r\n"


OTHER_CHUNKS = [
    b"0\r\n\r\n",  # the last chunk: Python ends the body
    b"0\r\nx-trailer: 1\r\n\r\n",
    b"5;name=value\r\nhello\r\n",  # an extension: Python's reader takes it
    b"5 \r\nhello\r\n",  # whitespace after the size
    f"{LIMIT + 1:x}\r\n".encode() + b"x" * (LIMIT + 1) + b"\r\n",  # larger than ``limit``
    b"000000005\r\nhello\r\n",  # 9 digits
    b"5\r\nhelloXY",  # data not followed by CRLF: Python's reader refuses it
    b"zz\r\n",
    b"5\n\nhello\r\n",  # bare LF
]


def chunk_stream(rng: random.Random) -> tuple[bytes, int]:
    """Whole fast chunks, then (mostly) one the thread must not take and more after it; the
    length of the fast prefix."""
    fast = b"".join(fast_chunk(rng) for _ in range(rng.randint(0, 40)))
    if rng.random() < 0.15:
        return fast, len(fast)
    other = rng.choice(OTHER_CHUNKS)
    return fast + other + b"".join(fast_chunk(rng) for _ in range(3)), len(fast)


def count_chunks(body: bytes) -> int:
    n = pos = 0
    while pos < len(body):
        line_end = body.index(b"\r\n", pos)
        pos = line_end + 2 + int(body[pos:line_end], 16) + 2
        n += 1
    return n


def python_chunks(body: bytes) -> tuple[bytes, str]:
    """What ``httpmsg.ResponseReader`` makes of a chunked body: its data, and how it ended."""
    reader = ResponseReader(1 << 16)
    reader.start(False)
    reader.receive(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)
    reader.receive(b"")
    out = bytearray()
    try:
        while True:
            event = reader.next_event()
            if event is END:
                return bytes(out), "end"
            if event is NEED_DATA:
                return bytes(out), "need data"
            if isinstance(event, bytes):
                out += event
    except BadResponse as exc:
        return bytes(out), f"bad: {exc}"


@pytest.mark.parametrize("seed", range(40))
def test_chunked_stops_at_the_first_chunk_it_must_not_take(relay: Any, seed: int) -> None:
    """An HTTP response body (``chunked``): exactly the whole fast chunks go, the rest stays
    for Python from a chunk boundary, and Python's reader makes the same of the pieces as of the
    whole body."""
    rng = random.Random(5000 + seed)
    data, first_other = chunk_stream(rng)
    eof = first_other == len(data) or rng.random() < 0.5
    p = Pair(relay, record=False, chunked=True)
    try:
        run = run_until_returned(p, data, first_other, eof, rng)
        forwarded, carry, rest, record = run.forwarded, run.carry, run.rest, run.record
        frames, nbytes = run.frames, run.nbytes
        assert forwarded + carry + rest == data and record == b""
        assert nbytes == len(python_chunks(forwarded)[0]) and frames == count_chunks(forwarded)
        # The client stopped taking the body (its socket buffer full: a loaded machine's reader
        # here lags): given back at a chunk boundary before the one it must not take (or before
        # the EOF), and the event loop keeps the clock.
        client_full = (
            run.returned
            and run.reason == C().FRAME
            and (len(forwarded) < first_other or first_other == len(data))
        )
        if not client_full:
            assert len(forwarded) == first_other
        # Python's reader, from the chunk boundary on, ends as it would have on the whole body.
        head, _ = python_chunks(forwarded)
        tail_data, tail_end = python_chunks(carry + rest)
        all_data, all_end = python_chunks(data)
        assert head + tail_data == all_data and tail_end == all_end
        if not client_full:
            run.check_returned(first_other < len(data), eof)
    finally:
        p.close()


@pytest.mark.parametrize("seed", range(30))
def test_taken_back_anywhere_loses_and_repeats_nothing(relay: Any, seed: int) -> None:
    """``remove`` at a random moment while fast frames stream: the pieces add up to the stream."""
    rng = random.Random(1000 + seed)
    data = b"".join(fast_frame(rng) for _ in range(400))
    p = Pair(relay)
    try:
        writer = threading.Thread(target=write_chunks, args=(p.wpeer, data, rng, True))
        writer.start()
        time.sleep(rng.random() * 0.02)
        carry, backlog, record, frames, nbytes, _, _ = relay.remove(p.handle)
        got = read_available(p.cpeer)
        rest = read_available(p.wours, until_eof=True, timeout=5.0)
        writer.join()
        forwarded = got + backlog
        assert forwarded + carry + rest == data
        assert record == forwarded and nbytes == len(forwarded)
        assert python_scan(forwarded).frames == frames
        # What Python scans next starts at a frame boundary: the whole remainder is frames.
        assert python_scan(carry + rest).frames == 400 - frames
    finally:
        p.close()


def test_a_client_that_stops_reading_stops_the_worker_reads(relay: Any) -> None:
    one = frame(OP_TEXT, b"t" * 60)
    total = 20_000
    p = Pair(relay, record=False, sndbuf=4096)
    try:
        p.wpeer.setblocking(False)
        sent = 0
        stalled_at = -1
        deadline = time.monotonic() + 10
        # Write until the worker's socket is full: the thread stopped reading it.
        while sent < total and time.monotonic() < deadline:
            try:
                p.wpeer.send(one)
                sent += 1
            except BlockingIOError:
                frames, _ = relay.counts(p.handle)
                time.sleep(0.05)
                if relay.counts(p.handle)[0] == frames:
                    stalled_at = frames
                    break
        assert 0 < stalled_at < total, "the thread kept reading a worker whose client is full"
        # The unsent bytes it holds are at most one read's worth.
        assert stalled_at * len(one) < 4 * C().BUF_SIZE + 8 * 4096 * 64
        p.wpeer.setblocking(True)
        reader_out = bytearray()

        def drain() -> None:
            while len(reader_out) < total * len(one):
                chunk = p.cpeer.recv(1 << 16)
                if not chunk:
                    return
                reader_out.extend(chunk)

        reader = threading.Thread(target=drain)
        reader.start()
        for _ in range(total - sent):
            p.wpeer.sendall(one)
        reader.join(timeout=30)
        assert bytes(reader_out) == one * total
        assert relay.counts(p.handle) == (total, total * len(one))
    finally:
        relay.remove(p.handle)
        p.close()


def test_a_client_gone_returns_the_session(relay: Any) -> None:
    p = Pair(relay, record=False)
    try:
        p.cpeer.close()
        for _ in range(50):
            p.wpeer.send(frame(OP_TEXT, b"x" * 100))
        assert wait_returned(relay, p.handle)
        _, _, _, _, _, reason, _ = relay.remove(p.handle)
        assert reason == C().WRITE_ERROR
    finally:
        for s in (p.wpeer, p.wours, p.cours):
            s.close()


def test_removed_handles_are_refused(relay: Any) -> None:
    p = Pair(relay)
    try:
        relay.remove(p.handle)
        with pytest.raises(KeyError):
            relay.remove(p.handle)
        with pytest.raises(KeyError):
            relay.counts(p.handle)
        assert relay.live == 0
    finally:
        p.close()


# -- through wslb, in front of a stock websockets echo server ------------------------------------


def metric(lb: Wslb, name: str, labels: str = "") -> float:
    """A sample of wslb's /metrics (0 when absent)."""
    req = urllib.request.Request(f"http://127.0.0.1:{lb.admin_port}/metrics", headers=lb.auth)
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or line.startswith(name + "_total" + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def echo_run(lb: Wslb, seed: int) -> list[str | bytes]:
    """Many messages of every size, pings among them; what came back, in order."""
    rng = random.Random(seed)
    sent: list[str | bytes] = []
    got: list[str | bytes] = []
    pongs: list[Awaitable[float]] = []
    # No keepalive of the client's own (wslb has its heartbeat): on a loaded machine the
    # echoes queued before a keepalive pong can outlast its timeout. The pings below are awaited.
    url = f"{lb.url}/echo?session=s{seed}"
    async with connect(url, max_size=None, ping_interval=None) as ws:

        async def reader() -> None:
            for _ in range(MESSAGES):
                got.append(await ws.recv())

        task = asyncio.create_task(reader())
        for i in range(MESSAGES):
            size = rng.choice([1, 20, 60, 200, 5000, 70_000]) if i % 50 else 200_000
            msg: str | bytes = rng.randbytes(size) if rng.random() < 0.5 else "t" * size
            sent.append(msg)
            await ws.send(msg)
            if i % 400 == 0:
                pongs.append(await ws.ping())
            if i % 100 == 0:
                await asyncio.sleep(0.01)  # let echoes stream in reads of their own
        await asyncio.wait_for(task, 60)
        await asyncio.wait_for(asyncio.gather(*pongs), 30)  # every pong came back
    assert got == sent
    return got


@pytest.fixture
def echo_server(tmp_path: Path) -> Iterator[Server]:
    with Server("websockets", tmp_path) as server:
        yield server


@pytest.mark.parametrize("thread", [True, False])
async def test_stock_echo_server_through_the_thread(
    echo_server: Server, tmp_path: Path, thread: bool
) -> None:
    config: dict[str, Any] = {
        "pools": [{"name": "chat", "backends": [{"id": "a", "url": echo_server.url}]}]
    }
    if not thread:
        config["relay"] = {"thread": False}
    lb = Wslb(config, tmp_path).start()
    try:
        await asyncio.gather(*(echo_run(lb, seed) for seed in range(6)))
        taken = metric(lb, "wslb_relay_thread_handovers", '{event="taken"}')
        if thread and offload.AVAILABLE:
            assert taken > 0, "no session went to the relay thread"
            assert metric(lb, "wslb_relay_thread_handovers", '{event="frame"}') > 0
        else:
            assert taken == 0
    finally:
        lb.stop()
    assert "Traceback" not in lb.log.read_text()


def test_offload_reads_the_module_constants() -> None:
    """``offload.py`` numbers reasons and events as the C module does (not copies of them)."""
    if _relay is None:
        pytest.skip("balancer._offload is not built")
    reasons = ("TAKEN_BACK", "FRAME", "EOF", "READ_ERROR", "WRITE_ERROR", "NOMEM")
    assert set(offload.REASONS) == {getattr(_relay, name) for name in reasons}
    assert (offload.NOMEM, offload.RETURNED) == (_relay.NOMEM, _relay.RETURNED)
