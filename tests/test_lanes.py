"""The lane thread (``balancer/aio/lanes.py``, ``balancer/_offload.c``): a kept-alive connection's
next requests of the same routing are served in C, byte for byte as the event loop serves them,
and everything else goes back to the event loop.

The referees: a worker that records the bytes it is sent (the first request of a connection is
the event loop's, the next ones the thread's: they must be the same bytes), the stock FastAPI app
of ``test_http_proxy.py`` under uvicorn, aiohttp and raw sockets for what no client would send.
Without the C module (``WSLB_PURE_PYTHON``, no compiler) the lane tests skip; the behaviour
tests run all the same against the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import jwt
import pytest
from websockets.asyncio.client import connect

from balancer.aio import lanes
from tests.procs import Wslb, free_port
from tests.test_http_proxy import (
    App,
    Raw,
    Stack,
    config,
    metric,
    raw_exchange,
    serve,
    status_of,
)
from tests.waits import settled, until

needs_lanes = pytest.mark.skipif(not lanes.AVAILABLE, reason="balancer._offload is not built")


def exchanges(lb: Wslb) -> float:
    return metric(lb, "wslb_http_lane_events_total", event="exchanges")


async def served(lb: Wslb, at_least: float, timeout: float = 3.0) -> float:
    """The thread's count of requests served, once it is ``at_least`` (bounded): an exchange
    is counted when its end is seen, a moment after the client has its last byte."""
    deadline = time.monotonic() + timeout
    while (n := exchanges(lb)) < at_least and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    return n


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with serve(tmp_path_factory.mktemp("lanes")) as st:
        yield st


# -- the recording worker: what the thread writes is what the event loop writes -----------------


class Recorder:
    """A plain HTTP/1.1 worker on a socket of its own that keeps every request head it reads
    and answers each with a fixed JSON body (or SSE for ``/sse``), keeping the connection."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.port = free_port()
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                m = re.search(rb"\r\ncontent-length: (\d+)\r\n", head)
                if m:
                    await r.readexactly(int(m.group(1)))
                if head.startswith(b"GET /healthz"):
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                elif head.startswith(b"GET /sse"):
                    w.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\nX-Trace: 1\r\n\r\n"
                        b"9;ext=1\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\nX-T: end\r\n\r\n"
                    )
                else:
                    body = b'{"ok":true}'
                    w.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Connection: keep-alive, X-Private\r\nX-Private: no\r\n"
                        b"X-Session-Id: worker-made\r\nContent-Length: %d\r\n\r\n%b"
                        % (len(body), body)
                    )
                await w.drain()
        w.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def recorded(tmp_path: Path) -> AsyncIterator[tuple[Wslb, Recorder]]:
    rec = Recorder()
    await rec.start()
    cfg = {
        "pools": [
            {
                "name": "p",
                "backends": [{"id": "r", "url": f"ws://127.0.0.1:{rec.port}"}],
                "health": {"enabled": False},
            }
        ]
    }
    lb = Wslb(cfg, tmp_path)
    await asyncio.to_thread(lb.start)
    try:
        yield lb, rec
    finally:
        await asyncio.to_thread(lb.stop)
        await rec.stop()


def _heads_without_health(rec: Recorder) -> list[bytes]:
    """The heads of the test's requests (not the health probes' and the scraper's)."""
    return [h for h in rec.heads if not h.startswith((b"GET /healthz", b"GET /metrics"))]


@needs_lanes
async def test_the_thread_writes_the_event_loops_bytes_both_ways(
    recorded: tuple[Wslb, Recorder],
) -> None:
    """Five identical requests on one connection (a body, odd header case and spacing, a
    forwarded-for claim, a header the client's Connection does not name): the first goes
    through the event loop, the next four through the thread; the worker sees the same head
    each time and the client gets the same answer (hop-by-hop and Connection-named headers
    dropped, wslb's key, not the worker's)."""
    lb, rec = recorded
    req = (
        b"POST /v1/x?a=1 HTTP/1.1\r\nHost: api.example\r\nX-Session-Id: conv-1\r\n"
        b"user-AGENT:   agent/1.0  \r\nX-Forwarded-For: 10.0.0.9\r\nKeep-Alive: 5\r\n"
        b"Connection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: 7\r\n"
        b'X-Empty:\r\n\r\n{"a":1}'
    )
    before = exchanges(lb)
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    answers = []
    try:
        for _ in range(5):
            w.write(req)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            n = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
            answers.append(head + await r.readexactly(n))
    finally:
        w.close()
    heads = _heads_without_health(rec)
    assert len(heads) == 5
    assert all(h == heads[0] for h in heads), heads
    assert all(a == answers[0] for a in answers), answers
    worker_head = heads[0].decode()
    assert worker_head.startswith("POST /v1/x?a=1 HTTP/1.1\r\nhost: 127.0.0.1:")
    assert "x-forwarded-for: 10.0.0.9, 127.0.0.1\r\n" in worker_head
    assert "user-agent: agent/1.0\r\n" in worker_head and "x-empty: \r\n" in worker_head
    assert "keep-alive" not in worker_head.lower().replace("connection", "")
    answer = answers[0].decode()
    assert "x-session-id: conv-1\r\n" in answer and "worker-made" not in answer
    assert "x-private" not in answer.lower() and "connection:" not in answer.lower()
    assert await served(lb, before + 4) - before == 4


@needs_lanes
async def test_a_chunked_answer_through_the_thread_is_the_event_loops(
    recorded: tuple[Wslb, Recorder],
) -> None:
    """Chunk extensions and trailers dropped, the sizes kept, the same bytes both ways."""
    lb, rec = recorded
    req = b"GET /sse HTTP/1.1\r\nHost: h\r\nX-Session-Id: s-1\r\n\r\n"
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    answers = []
    try:
        for _ in range(3):
            w.write(req)
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                more = await asyncio.wait_for(r.read(65536), 5)
                assert more, (data, lb.log_tail())  # closed short of the end
                data += more
            answers.append(data)
    finally:
        w.close()
    assert answers[1] == answers[0] and answers[2] == answers[0], answers
    assert answers[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
    assert len(set(_heads_without_health(rec))) == 1


# -- what goes back to the event loop --------------------------------------------------------


async def _lane(stack: Stack, key: str) -> Raw:
    """A connection that the thread serves: two requests of one routing."""
    c = await Raw.open(stack.lb.port)
    for _ in range(2):
        head, _ = await c.request("GET", "/json", [("x-session-id", key)])
        assert head.status_code == 200
    return c


BAD = {
    "duplicate Content-Length": b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Session-Id: bad\r\n"
    b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "CL and TE": b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Session-Id: bad\r\n"
    b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "obs-fold": b"GET /json HTTP/1.1\r\nHost: x\r\nX-Session-Id: bad\r\nX-A: 1\r\n 2\r\n\r\n",
    "space before colon": b"GET /json HTTP/1.1\r\nHost : x\r\nX-Session-Id: bad\r\n\r\n",
}


@needs_lanes
@pytest.mark.parametrize("name", sorted(BAD))
async def test_smuggling_on_a_lane_is_refused_with_400(stack: Stack, name: str) -> None:
    c = await _lane(stack, "bad")
    try:
        c.writer.write(BAD[name])
        rest = await asyncio.wait_for(c.reader.read(), 10)  # answered, then closed
    finally:
        c.close()
    assert status_of(rest) == 400, rest


@needs_lanes
async def test_what_the_thread_does_not_take_is_served_by_the_event_loop(stack: Stack) -> None:
    """On a connection the thread serves: another target, another key, a body, Expect,
    HTTP/1.0, a lowercase method, a WebSocket upgrade; each is answered as ever."""
    before = exchanges(stack.lb)
    c = await _lane(stack, "mixed")
    try:
        head, body = await c.request("GET", "/json?other=1", [("x-session-id", "mixed")])
        assert head.status_code == 200 and json.loads(body)["query"] == "other=1"
        head, body = await c.request("GET", "/json", [("x-session-id", "mixed-2")])
        assert head.status_code == 200
        assert dict(head.headers)[b"x-session-id"] == b"mixed-2"
        for _ in range(3):  # the same again: a lane anew, after the skip
            head, body = await c.request("GET", "/json", [("x-session-id", "mixed-2")])
            assert head.status_code == 200
    finally:
        c.close()
    assert await served(stack.lb, before + 1) > before
    body = os.urandom(100_000)
    req = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Session-Id: e\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    r, w = await asyncio.open_connection("127.0.0.1", stack.lb.port)
    try:
        for _ in range(3):
            w.write(req)
            interim = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100")
            w.write(body)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            n = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
            assert await r.readexactly(n) == body
        w.write(b"GET /json HTTP/1.0\r\nHost: x\r\nX-Session-Id: e\r\n\r\n")
        last = await asyncio.wait_for(r.read(), 5)  # an HTTP/1.0 answer closes
        assert last.startswith(b"HTTP/1.1 200") and b'"ok":true' in last
    finally:
        w.close()


@needs_lanes
async def test_connection_close_and_a_websocket_after_a_lane(stack: Stack) -> None:
    c = await _lane(stack, "closer")
    try:
        c.writer.write(
            b"GET /json HTTP/1.1\r\nHost: x\r\nX-Session-Id: closer\r\nConnection: close\r\n\r\n"
        )
        rest = await asyncio.wait_for(c.reader.read(), 5)
        assert rest.startswith(b"HTTP/1.1 200") and b"connection: close" in rest.lower()
    finally:
        c.close()
    # The upgrade on the very connection the thread served (no client library does that).
    c = await _lane(stack, "upgrader")
    try:
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        c.writer.write(
            b"GET /ws/echo HTTP/1.1\r\nHost: x\r\nX-Session-Id: upgrader\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: "
            + key.encode()
            + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        head = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 101"), head
        c.writer.write(b"\x81\x82abcd" + bytes(x ^ y for x, y in zip(b"hi", b"ab", strict=True)))
        frame = await asyncio.wait_for(c.reader.readexactly(9), 5)
        assert frame == b"\x81\x07echo:hi"
    finally:
        c.close()


# -- the stock app through the thread -----------------------------------------------------------


@needs_lanes
async def test_200_kept_alive_requests_mostly_served_by_the_thread(stack: Stack) -> None:
    before = exchanges(stack.lb)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        pids = set()
        for _ in range(200):
            async with http.get(f"{stack.base}/json", headers={"X-Session-Id": "k200"}) as r:
                assert r.status == 200
                assert r.headers["X-Session-Id"] == "k200"
                pids.add((await r.json())["pid"])
    assert len(pids) == 1  # one key, one worker
    assert await served(stack.lb, before + 190) - before >= 190


@needs_lanes
async def test_sse_and_a_4mib_post_through_the_thread(stack: Stack) -> None:
    """4 MiB POSTs, then SSE answers, on one kept-alive connection: the thread serves both, the
    bodies whole and the events as they come. A connection goes to a lane only once the answer
    before has left wslb (a 4 MiB echo may still be on its way when its exchange ends), so each
    kind is sent until the thread's count says it served what is wanted (bounded)."""
    body = os.urandom(4 * 1024 * 1024)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1), timeout=timeout
    ) as http:
        hdrs = {"X-Session-Id": "big"}

        async def post() -> None:
            async with http.post(f"{stack.base}/echo", data=io.BytesIO(body), headers=hdrs) as r:
                assert r.status == 200 and await r.read() == body

        async def sse() -> None:
            arrivals: list[tuple[float, float]] = []
            async with http.get(f"{stack.base}/sse?n=3&gap=0.4", headers=hdrs) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.startswith(b"data: "):
                        _, _, sent = line.decode().split()
                        arrivals.append((time.time(), float(sent)))
            assert len(arrivals) == 3
            assert arrivals[0][0] < arrivals[-1][1] - 0.5, arrivals  # not buffered

        for send, wanted in ((post, 2), (sse, 1)):
            before = exchanges(stack.lb)
            for _ in range(12):
                await send()
                if await served(stack.lb, before + wanted, timeout=1.0) >= before + wanted:
                    break
            assert exchanges(stack.lb) - before >= wanted, send.__name__


@needs_lanes
async def test_slow_reader_on_a_lane_holds_the_worker_back(stack: Stack) -> None:
    """A client that stops reading a flood on a lane: the worker's writes stop too."""
    c = await _lane(stack, "flood")
    try:
        c.writer.write(
            b"GET /flood?n=100000&size=1024 HTTP/1.1\r\nHost: x\r\nX-Session-Id: flood\r\n\r\n"
        )

        async def progress() -> int:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{stack.base}/progress", headers={"X-Session-Id": "flood"}) as r,
            ):
                return int((await r.json())["bytes"])

        await until(progress, 10, "the flood under way")
        sent = await settled(progress, quiet=1.0, timeout=20, what="the worker's bytes sent")
        # 100 MiB were asked for; what is written before the pause takes hold is the kernel's
        # buffers both ways and the lane's write buffer: 20-34 MiB seen, more on a busy machine
        # (the event loop's test allows 40 MiB too).
        assert sent < 40 * 1024 * 1024, sent
    finally:
        c.close()


@needs_lanes
async def test_access_lines_and_metrics_of_the_thread(stack: Stack) -> None:
    """Six requests on one connection, the first the event loop's and the rest the thread's:
    six access lines of one shape, and the metrics count them all."""
    lb = stack.lb
    reqs = metric(lb, "wslb_http_requests_total", pool="p", kind="plain", code="200")
    before = exchanges(lb)
    c = await Raw.open(stack.lb.port)
    try:
        for _ in range(6):
            await c.request("GET", "/json?q=1", [("x-session-id", "logged"), ("user-agent", "x y")])
    finally:
        c.close()
    deadline = time.monotonic() + 5
    while lb.output().count('ua="x y"') < 6:
        assert time.monotonic() < deadline, lb.log_tail()
        await asyncio.sleep(0.05)
    lines = [ln for ln in lb.output().splitlines() if 'ua="x y"' in ln]
    shape = re.compile(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d INFO wslb\.access: 127\.0\.0\.1 "
        r"GET /json status=200 session=logged pool=p backend=a\d kind=plain connect=[\d.]+ms "
        r"headers=[\d.]+ms duration=\d+\.\d{3}s bytes_in=0 bytes_out=(\d+) end=done ua=\"x y\"$"
    )
    sizes = set()
    for ln in lines:
        m = shape.match(ln)
        assert m, ln
        sizes.add(m.group(1))
    assert len(sizes) == 1, lines  # the thread counts the body's bytes as the event loop does
    assert await served(lb, before + 5) - before >= 5
    assert metric(lb, "wslb_http_requests_total", pool="p", kind="plain", code="200") - reqs >= 6
    assert metric(lb, "wslb_http_request_duration_seconds_count", pool="p", kind="plain") >= 6


@needs_lanes
async def test_json_access_lines_of_the_thread_parse(tmp_path: Path) -> None:
    app = App(tmp_path)
    cfg = config([app])
    cfg["log"] = {"format": "json"}
    lb = Wslb(cfg, tmp_path)
    await asyncio.to_thread(lb.start)
    try:
        c = await Raw.open(lb.port)
        ua = b'a"\\b \xc3\xa9'  # a quote, a backslash, UTF-8 bytes (read as latin-1)
        try:
            for _ in range(4):
                await c.request("GET", "/json", [("x-session-id", "j-1"), ("user-agent", ua)])  # type: ignore[list-item]
        finally:
            c.close()
        deadline = time.monotonic() + 5
        while True:
            rows = []
            for ln in lb.output().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(ln)
                    if row.get("logger") == "wslb.access" and row.get("method") == "GET":
                        rows.append(row)
            if len(rows) >= 4:
                assert await served(lb, 3) >= 3
                break
            assert time.monotonic() < deadline, lb.log_tail()
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(lb.stop)
        app.stop()
    assert {r["session"] for r in rows} == {"j-1"}
    for r in rows:  # the event loop's line (the first) and the thread's, field for field
        assert r["user_agent"] == ua.decode("latin-1") and r["status"] == 200
        assert list(r) == list(rows[0]), (rows[0], r)
        assert r["message"].split(" connect=")[0] == rows[0]["message"].split(" connect=")[0]


@needs_lanes
async def test_a_worker_dying_mid_body_on_a_lane_cuts_the_answer(tmp_path: Path) -> None:
    app = App(tmp_path)
    lb = Wslb(config([app]), tmp_path)
    await asyncio.to_thread(lb.start)
    try:
        c = await _lane(Stack(lb, [app]), "dies")
        try:
            c.writer.write(b"GET /die?parts=3 HTTP/1.1\r\nHost: x\r\nX-Session-Id: dies\r\n\r\n")
            answer = await asyncio.wait_for(c.reader.read(), 10)
        finally:
            c.close()
        assert answer.startswith(b"HTTP/1.1 200") and b"part one;" in answer
        assert not answer.endswith(b"0\r\n\r\n")
        answer = await raw_exchange(lb.port, b"GET /json HTTP/1.1\r\nHost: x\r\n\r\n", 10)
        assert status_of(answer) == 502
    finally:
        await asyncio.to_thread(lb.stop)
        app.stop()


@needs_lanes
async def test_drain_releases_a_lane_and_its_next_request_goes_elsewhere(stack: Stack) -> None:
    lb = stack.lb
    c = await _lane(stack, "drained-lane")
    try:
        head, body = await c.request("GET", "/json", [("x-session-id", "drained-lane")])
        pid = json.loads(body)["pid"]
        victim = next(
            b["id"]
            for b in lb.admin("/backends")
            if b["pool"] == "p" and int(stack.apps[int(b["id"][1:])].proc.pid) == pid
        )
        await asyncio.to_thread(lb.admin_post, f"/backends/{victim}/drain", {"migrate": False})
        for _ in range(5):
            head, body = await c.request("GET", "/json", [("x-session-id", "drained-lane")])
            assert head.status_code == 200 and json.loads(body)["pid"] != pid
    finally:
        c.close()
        await asyncio.to_thread(lb.admin_post, f"/backends/{victim}/undrain", {})
        lb.wait_ready(until=lambda bs: all(b["state"] == "active" for b in bs))


async def test_websocket_client_unaffected(stack: Stack) -> None:
    async with connect(f"ws://127.0.0.1:{stack.lb.port}/ws/echo") as ws:
        await ws.send("x")
        assert await ws.recv() == "echo:x"


@needs_lanes
async def test_an_origin_or_token_the_lane_did_not_see_is_checked_again(tmp_path: Path) -> None:
    """As an attacker on a connection a lane serves: a request with another ``Origin`` (or
    none) is not relayed by the thread but refused by the event loop's check (403); on a JWT
    pool no lane is taken at all, so a kept-alive connection's next request without the token
    gets 401."""
    app = App(tmp_path)
    secret = "s3cret-for-the-lanes-test-32-bytes!"
    cfg = config([app])
    cfg["auth"] = {"origins": ["https://ok.example"]}
    (tmp_path / "origins").mkdir()
    lb = Wslb(cfg, tmp_path / "origins")
    await asyncio.to_thread(lb.start)
    try:
        ok = [("x-session-id", "orig"), ("origin", "https://ok.example")]
        before = exchanges(lb)
        c = await Raw.open(lb.port)
        try:
            for _ in range(3):
                head, _ = await c.request("GET", "/json", ok)
                assert head.status_code == 200
            assert await served(lb, before + 1) > before  # the thread served the third
            head, _ = await c.request(
                "GET", "/json", [("x-session-id", "orig"), ("origin", "https://evil.example")]
            )
            assert head.status_code == 403
        finally:
            c.close()
        c = await Raw.open(lb.port)
        try:
            for _ in range(3):
                head, _ = await c.request("GET", "/json", ok)
                assert head.status_code == 200
            head, _ = await c.request("GET", "/json", [("x-session-id", "orig")])
            assert head.status_code == 403
        finally:
            c.close()
    finally:
        await asyncio.to_thread(lb.stop)
    cfg = config([app])
    cfg["auth"] = {"jwt": {"secret": secret}}
    (tmp_path / "jwt").mkdir()
    lb = Wslb(cfg, tmp_path / "jwt")
    await asyncio.to_thread(lb.start)
    try:
        token = jwt.encode({"sub": "alice", "exp": int(time.time()) + 60}, secret)
        alice = [("x-session-id", "j"), ("authorization", f"Bearer {token}")]
        c = await Raw.open(lb.port)
        try:
            for _ in range(3):
                head, _ = await c.request("GET", "/json", alice)
                assert head.status_code == 200
            head, _ = await c.request("GET", "/json", [("x-session-id", "j")])
            assert head.status_code == 401
        finally:
            c.close()
        assert exchanges(lb) == 0
    finally:
        await asyncio.to_thread(lb.stop)
        app.stop()
