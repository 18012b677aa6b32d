"""A hostile worker and a hostile client against the C thread (``_offload.c``).

The worker is a raw asyncio server written here: it answers a request naming ``X-Attack: SIZE``
with a chunked head and a chunk-size line of its choosing (16 hex digits and more, sizes past
2^31, 2^32 and 2^63, extensions, a minus sign), some bytes of data, then its close. Each size
goes through every path that parses it: the event loop (the first request of a connection,
``httpmsg.ResponseReader``), the lane thread (the same keyed request again on the kept-alive
connection) and the relay thread (an SSE answer past its first events, ``walk_chunks``). The
client gets a 502 or a cut: never a byte the worker did not send as data, never the worker's head
as it wrote it. Then wslb serves the next request on both paths and stops on SIGTERM in bounded
time. Once ``ffffffffffffffff`` made the lane thread copy SIZE_MAX bytes (heap bytes to the
client, then glibc's abort) and ``8000000000000000`` made it spin forever (every later lane
request hung, and so did SIGTERM).

A hostile client: a request the event loop would treat as a WebSocket handshake, or as a head
too large, gets the same status through a lane as through the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from balancer.aio import lanes, offload
from balancer.metrics import Stats
from balancer.pool import Backend
from tests.procs import Wslb, free_port
from tests.test_http_proxy import metric
from tests.test_lanes import exchanges, served

needs_lanes = pytest.mark.skipif(not lanes.AVAILABLE, reason="balancer._offload is not built")

MARK = b"x-raw-marker"  # in the worker's head only as a hop header: wslb drops it
DATA = b"A" * 64
SSE_EVENTS = 6  # past OFFLOAD_AFTER: the relay thread has the body by the hostile line
STOP_BOUND_S = 15.0

SIZES = [
    "ffffffffffffffff",  # 2^64 - 1
    "8000000000000000",  # 2^63
    "7fffffffffffffff",  # 2^63 - 1
    "10000000000000000",  # 17 digits: 2^64
    "00000000000000001",  # 17 digits, the value 1
    "80000000",  # 2^31
    "100000000",  # 2^32
    "ffffffffffffffff;name=value",
    "8000000000000000 ; x",
    "-1",
    "-8000000000000000",
]


class Hostile:
    """A plain HTTP/1.1 worker: ``ok`` (Content-Length) for any request without ``X-Attack``,
    on a kept-alive connection; with ``X-Attack: SIZE``, a chunked head (after ``SSE_EVENTS``
    well-formed chunks when ``X-Mode: sse``), the line ``SIZE``, ``DATA`` twice and its close."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self._answer(r, w)
        finally:
            self.tasks.discard(task)
            w.close()

    async def _answer(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                attack = re.search(rb"\r\nx-attack: ([^\r]*)\r\n", head, re.IGNORECASE)
                if attack is None:
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await w.drain()
                    continue
                sse = re.search(rb"\r\nx-mode: sse\r\n", head, re.IGNORECASE) is not None
                kind = b"text/event-stream" if sse else b"text/plain"
                w.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\nTransfer-Encoding: chunked\r\n"
                    b"Connection: X-Raw-Marker\r\nX-Raw-Marker: %b\r\n\r\n" % (kind, MARK)
                )
                if sse:
                    for i in range(SSE_EVENTS):
                        event = b"data: %d\n\n" % i
                        w.write(b"%x\r\n%b\r\n" % (len(event), event))
                        await w.drain()
                        await asyncio.sleep(0.03)
                    await asyncio.sleep(0.2)
                w.write(attack[1] + b"\r\n" + DATA)
                await w.drain()
                await asyncio.sleep(0.2)
                w.write(DATA)
                await w.drain()
                await asyncio.sleep(0.1)
                break

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@dataclass
class Setup:
    lb: Wslb
    worker: Hostile


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    worker = Hostile()
    await worker.start()
    cfg = {
        "pools": [
            {
                "name": "p",
                "backends": [{"id": "h", "url": f"ws://127.0.0.1:{worker.port}"}],
                "health": {"enabled": False},
                "http": {"timeout_server": "5s"},
            }
        ],
        "timeouts": {"close": "1s", "shutdown_grace": "0.5s"},
    }
    lb = Wslb(cfg, tmp_path)
    await asyncio.to_thread(lb.start)
    try:
        yield Setup(lb, worker)
    finally:
        if lb.proc is not None and lb.proc.poll() is None:
            await asyncio.to_thread(lb.stop, 0)
        await worker.stop()


def request(key: str, *extra: str) -> bytes:
    lines = ["GET /chat HTTP/1.1", "Host: h", f"X-Session-Id: {key}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def answer(r: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    """One whole answer (by Content-Length), or everything until the close."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
    m = re.search(rb"\r\ncontent-length: (\d+)\r\n", head, re.IGNORECASE)
    if m is None:
        return head + await asyncio.wait_for(r.read(), timeout)
    return head + await asyncio.wait_for(r.readexactly(int(m[1])), timeout)


def assert_502_or_cut(data: bytes, sse: bool = False) -> None:
    """wslb's 502, or the worker's status with a chunked body cut short whose data is only what
    the worker sent as data (its events, then ``DATA``); never the worker's head."""
    assert MARK not in data.lower(), data[:300]
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data[:300]
    status = int(head.split(b" ", 2)[1])
    if status == 502:
        assert json.loads(body)["error"], body
        return
    assert status == 200 and b"\r\ntransfer-encoding: chunked" in head.lower(), head
    payload = bytearray()
    rest = body
    while rest:
        line, sep, rest = rest.partition(b"\r\n")
        assert sep and re.fullmatch(rb"[0-9a-f]+", line), (line, body[:300])
        size = int(line, 16)
        assert size, body[:300]  # never the last chunk: the answer was cut
        payload += rest[:size]
        rest = rest[size:]
        if rest:
            assert rest.startswith(b"\r\n"), body[:300]
            rest = rest[2:]
    events = b"".join(b"data: %d\n\n" % i for i in range(SSE_EVENTS)) if sse else b""
    assert payload.startswith(events), payload[:300]
    assert len(payload) <= len(events) + 2 * len(DATA), len(payload)
    assert set(payload[len(events) :]) <= {ord("A")}, payload[:300]


async def assert_both_paths_serve(lb: Wslb, key: str) -> None:
    """A new connection: its first request served by the event loop, the next by a lane."""
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        before = exchanges(lb) if lanes.AVAILABLE else 0.0
        for _ in range(2):
            w.write(request(key))
            got = await answer(r)
            assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\nok"), got
    finally:
        w.close()
    if lanes.AVAILABLE:
        assert await served(lb, before + 1) >= before + 1, lb.log_tail()


async def assert_stops_on_sigterm(lb: Wslb) -> None:
    t0 = time.monotonic()
    rc = await asyncio.to_thread(lb.stop, STOP_BOUND_S)
    took = time.monotonic() - t0
    assert rc >= 0 and took < STOP_BOUND_S, (rc, took, lb.log_tail())  # -9: it took SIGKILL


@needs_lanes
@pytest.mark.parametrize("size", SIZES)
async def test_a_hostile_chunk_size_is_a_502_or_a_cut_on_every_path(
    setup: Setup, size: str
) -> None:
    lb = setup.lb
    # The event loop: the first request of a connection.
    got = await asyncio.wait_for(_one(lb, request("k1", f"X-Attack: {size}")), 15)
    assert_502_or_cut(got)
    # The lane thread: the same routing again on the kept-alive connection.
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        w.write(request("k2"))
        first = await answer(r)
        assert first.endswith(b"\r\n\r\nok"), first
        before = exchanges(lb)
        w.write(request("k2", f"X-Attack: {size}"))
        got = await answer(r)
    finally:
        w.close()
    assert_502_or_cut(got)
    assert await served(lb, before + 1) >= before + 1, lb.log_tail()  # the lane had it
    # The relay thread: an SSE answer past its first events.
    taken = metric(lb, "wslb_relay_thread_handovers_total", event="taken")
    got = await asyncio.wait_for(_one(lb, request("k3", f"X-Attack: {size}", "X-Mode: sse")), 15)
    assert_502_or_cut(got, sse=True)
    if offload.AVAILABLE:
        assert metric(lb, "wslb_relay_thread_handovers_total", event="taken") > taken
    # Still up, both paths; then SIGTERM ends it in bounded time.
    await assert_both_paths_serve(lb, "k4")
    await assert_stops_on_sigterm(lb)


async def _one(lb: Wslb, data: bytes) -> bytes:
    """``data`` on a new connection; everything until wslb closes it."""
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        w.write(data)
        return await r.read()
    finally:
        w.close()


# -- a hostile client: what the event loop refuses, the lane refuses the same way -------------

CLIENT = {
    "Sec-WebSocket-Key": ["Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="],
    "Sec-WebSocket-Version": ["Sec-WebSocket-Version: 13"],
    "head over max_header_bytes": [f"X-Pad: {'a' * (16 * 1024 + 900)}"],
}


@needs_lanes
@pytest.mark.parametrize("name", sorted(CLIENT))
async def test_a_request_the_event_loop_refuses_is_refused_the_same_through_a_lane(
    setup: Setup, name: str
) -> None:
    lb = setup.lb
    extra = CLIENT[name]
    direct = await asyncio.wait_for(_one(lb, request("c1", *extra)), 15)
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        w.write(request("c2"))
        assert (await answer(r)).endswith(b"\r\n\r\nok")
        before = exchanges(lb)
        w.write(request("c2", *extra))
        laned = await answer(r)
    finally:
        w.close()
    status = int(direct.split(b" ", 2)[1])
    assert status in (426, 431), direct[:200]
    assert int(laned.split(b" ", 2)[1]) == status, (laned[:200], direct[:200])
    assert exchanges(lb) == before  # not the lane's: the event loop answered it
    await assert_both_paths_serve(lb, "c3")
    await assert_stops_on_sigterm(lb)


# -- a thread that does not stop cannot hold up a shutdown ------------------------------------


class _Owner:
    lane_backend: Backend | None = None

    def lane_back(self, back: lanes.Back) -> None:
        raise AssertionError("a stuck thread's lane came back")

    def lane_check(self) -> None:
        pass

    def abort_lane(self, why: str) -> None:
        pass


@needs_lanes
async def test_close_gives_up_on_a_thread_that_does_not_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lane thread spinning (as ``8000000000000000`` once made it): ``close`` returns after
    its deadline, logs it and leaves the lane to the exit, instead of hanging the shutdown."""
    from balancer import _offload as _lanes

    ln = lanes.Lanes(offload.Offload(asyncio.get_running_loop(), Counter()), Stats(), False)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    spec: _lanes.Spec = (
        b"/x\0host\0h",
        (b"host",),
        b"/x",
        b"",
        b"",
        (),
        (),
        b"",
        16384,
        100,
        1000,
        5.0,
        5.0,
        2.0,
        0.0,
        b"peer",
        b"k",
        b"p",
        b"b",
    )
    ln.add(_Owner(), a.fileno(), c.fileno(), b"", spec)
    _lanes._spin(True)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, "wslb.http"):
            ln.close()  # as the event loop calls it: it blocks until the deadline
        took = time.monotonic() - t0
    finally:
        _lanes._spin(False)  # the thread sees its stop now and ends
        for s in (a, b, c, d):
            s.close()
    assert 4.5 < took < 10, took
    assert "did not stop within 5 s" in caplog.text, caplog.text
