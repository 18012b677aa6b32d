"""Plain HTTP through wslb (SPEC section 16), against servers and clients nobody wrote for wslb.

The worker is a stock FastAPI app under uvicorn's own CLI (``tests/servers/http_app.py``): a JSON
route, SSE, a streamed echo, a flood for backpressure, a slow route, a route that kills its
process mid-answer and a WebSocket route, all on one port, behind one wslb listener with a
path-less backend URL. The clients are aiohttp, ``curl``, ``websockets`` and raw sockets (for
what no client library would send: smuggling attempts, pipelined and mixed requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import h11
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from balancer.aio import offload
from balancer.contract import proxied_credential
from tests.procs import WORKER_TOKEN, Wslb, free_port, spawn, stop, wait_port
from tests.test_tls_stream import make_certs, tls_listener, with_listeners

APP = "tests.servers.http_app:app"
TIMEOUT_SERVER = 2.0
MAX_BODY = 8 * 1024 * 1024


class App:
    """The stock FastAPI app as a user starts it: ``python -m uvicorn MODULE:app --port N``."""

    def __init__(self, logdir: Path) -> None:
        self.port = free_port()
        self.log = logdir / f"http-app-{self.port}.log"
        cmd = [sys.executable, "-m", "uvicorn", APP, "--port", str(self.port), "--no-access-log"]
        self.proc = spawn(cmd, log=self.log)
        wait_port(self.port, proc=self.proc)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.proc, 5)


@dataclass
class Stack:
    lb: Wslb
    apps: list[App]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.lb.port}"

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.lb, name, **labels)


def metric(lb: Wslb, name: str, **labels: str) -> float:
    """The sum of a family's samples named ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(lb.admin("/metrics"))
        for s in fam.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def config(apps: list[App], **http: Any) -> dict[str, Any]:
    settings = {"timeout_server": f"{TIMEOUT_SERVER}s", "max_body": MAX_BODY, **http}
    return {
        "pools": [
            {
                "name": "p",
                "backends": [{"id": f"a{i}", "url": a.url} for i, a in enumerate(apps)],
                "http": settings,
                "drain": {"timeout": "10s", "migrate": False},
            },
            {"name": "empty", "match": {"path_prefix": "/empty"}, "backends": []},
            {
                "name": "dead",
                "match": {"path_prefix": "/dead"},
                "health": {"enabled": False},
                "backends": [{"id": "dead", "url": f"ws://127.0.0.1:{free_port()}"}],
            },
            {
                "name": "ws_only",
                "match": {"path_prefix": "/wsonly"},
                "http": {"enabled": False},
                "backends": [{"id": "w", "url": apps[0].url}],
            },
        ],
        "timeouts": {"close": "1s", "shutdown_grace": "0.5s"},
    }


@contextlib.contextmanager
def serve(
    tmp: Path, config_of: Callable[[list[App]], dict[str, Any]] | None = None
) -> Iterator[Stack]:
    """Two uvicorn apps and a wslb with ``config`` (or ``config_of`` the apps) in front, every
    backend active; all stopped at the end."""
    apps = [App(tmp), App(tmp)]
    lb = Wslb((config_of or config)(apps), tmp)
    try:
        lb.start(wait_ready=False)
        lb.wait_ready(until=lambda bs: all(b["state"] == "active" for b in bs))
        yield Stack(lb, apps)
    finally:
        if lb.proc is not None:
            lb.stop()
        for a in apps:
            a.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with serve(tmp_path_factory.mktemp("http")) as st:
        yield st


# -- a raw HTTP/1.1 client: one connection, h11 as the parser ---------------------------------


class Raw:
    """One TCP connection speaking HTTP/1.1 by hand (h11 parses the answers)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> Raw:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def event(self, timeout: float = 10.0) -> Any:
        while True:
            ev = self.h11.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            self.h11.receive_data(data)

    async def request(
        self, method: str, target: str, headers: list[tuple[str, str]] | None = None
    ) -> tuple[h11.Response, bytes]:
        hdrs = [("host", "wslb"), *(headers or [])]
        self.writer.write(self.h11.send(h11.Request(method=method, target=target, headers=hdrs)))
        self.writer.write(self.h11.send(h11.EndOfMessage()))
        head = await self.event()
        assert isinstance(head, h11.Response), head
        body = bytearray()
        while True:
            ev = await self.event()
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                break
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        return head, bytes(body)

    def close(self) -> None:
        self.writer.close()


async def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a new connection; everything the peer sends until it closes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


# -- JSON, headers, keys ------------------------------------------------------------------------


async def test_json_route_with_forwarded_headers_and_no_hop_headers(stack: Stack) -> None:
    headers = {
        "X-Session-Id": "alice-1",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "secret",
        "Keep-Alive": "timeout=5",
        "X-Forwarded-For": "6.6.6.6",
        "X-Forwarded-Proto": "gopher",
        "X-WSLB-Worker-Token": "forged",
        "X-Custom": "kept",
    }
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.base}/json?x=1", headers=headers) as r,
    ):
        assert r.status == 200
        assert r.headers["X-Session-Id"] == "alice-1"
        seen = await r.json()
    got = seen["headers"]
    assert seen["path"] == "/json" and seen["query"] == "x=1"
    assert got["x-session-id"] == "alice-1"
    assert got["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"  # nginx's $proxy_add_x_forwarded_for
    assert got["x-real-ip"] == "127.0.0.1"
    assert got["x-forwarded-proto"] == "http"
    assert got["x-forwarded-host"] == f"127.0.0.1:{stack.lb.port}"
    assert got["host"] == f"127.0.0.1:{stack.apps[0].port}" or got["host"].startswith("127.0.0.1:")
    # wslb's credential (its proxied form: it opens no handoff route), never the client's
    assert got["x-wslb-worker-token"] == proxied_credential(WORKER_TOKEN)
    assert got["x-custom"] == "kept"
    for hop in ("x-hop", "keep-alive", "connection"):
        assert hop not in got, hop


async def test_a_key_sticks_to_its_worker_and_a_made_one_is_returned(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        pids = set()
        for _ in range(5):
            async with http.get(f"{stack.base}/json", headers={"X-Session-Id": "sticky"}) as r:
                pids.add((await r.json())["pid"])
        assert len(pids) == 1
        async with http.get(f"{stack.base}/json?session=q-key") as r:
            assert r.headers["X-Session-Id"] == "q-key"
        async with http.get(f"{stack.base}/json") as r:
            made = r.headers["X-Session-Id"]
            assert len(made) >= 16 and (await r.json())["headers"]["x-session-id"] == made
        async with http.get(f"{stack.base}/json", headers={"X-Session-Id": "bad key!"}) as r:
            assert r.status == 400
            assert "session key" in (await r.json())["error"]


# -- streaming ----------------------------------------------------------------------------------


async def test_sse_first_event_arrives_before_the_last_is_sent(stack: Stack) -> None:
    arrivals: list[tuple[float, float]] = []  # (arrived, sent) per event
    timeout = aiohttp.ClientTimeout(total=15)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(f"{stack.base}/sse?n=3&gap=1.0") as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                _, _, sent = line.decode().split()
                arrivals.append((time.time(), float(sent)))
    assert len(arrivals) == 3
    first_arrived, first_sent = arrivals[0]
    last_sent = arrivals[-1][1]
    assert first_arrived < last_sent - 1.0, arrivals  # long before the last was written
    assert first_arrived - first_sent < 0.5, arrivals  # and when it was written


async def test_a_long_sse_answer_goes_through_the_relay_thread_whole(stack: Stack) -> None:
    """Past its first events a chunked answer is forwarded by the relay thread (rule 7): every
    event arrives once, in order, as sent; the access line counts the body's bytes; the
    connection serves the next request after it. Without the thread (pure Python builds) the
    same answer goes through the event loop."""
    taken = stack.metric("wslb_relay_thread_handovers_total", event="taken")
    raw = await Raw.open(stack.lb.port)
    try:
        head, body = await raw.request("GET", "/sse?n=60&gap=0.005", [("x-session-id", "sse-t")])
        assert head.status_code == 200
        events = [e for e in body.decode().split("\n\n") if e]
        assert [int(e.split()[1]) for e in events] == list(range(60)), events[:3]
        head, again = await raw.request("GET", "/json", [("x-session-id", "sse-t")])
        assert head.status_code == 200 and json.loads(again)["ok"] is True
    finally:
        raw.close()
    if offload.AVAILABLE:
        assert stack.metric("wslb_relay_thread_handovers_total", event="taken") > taken
    deadline = time.monotonic() + 5
    while f"bytes_out={len(body)} " not in stack.lb.output():
        assert time.monotonic() < deadline, stack.lb.log_tail()
        await asyncio.sleep(0.05)


async def test_an_http_1_0_client_gets_a_close_delimited_sse_answer(stack: Stack) -> None:
    """An HTTP/1.0 client cannot read chunks: its answer is re-framed (delimited by the close),
    so the relay thread, which forwards chunks as they are, never takes it."""
    answer = await raw_exchange(
        stack.lb.port, b"GET /sse?n=30&gap=0.005 HTTP/1.0\r\nHost: x\r\n\r\n", 10
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    events = [e for e in body.decode().split("\n\n") if e]
    assert [int(e.split()[1]) for e in events] == list(range(30))


async def test_4mib_post_echoed_byte_for_byte_both_framings(stack: Stack) -> None:
    body = os.urandom(4 * 1024 * 1024)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.base}/echo", data=io.BytesIO(body)) as r:  # length
            assert r.status == 200
            assert await r.read() == body

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(body), 256 * 1024):
                yield body[i : i + 256 * 1024]

        async with http.post(f"{stack.base}/echo", data=chunks()) as r:  # chunked
            assert r.status == 200
            assert await r.read() == body


async def test_200_requests_on_one_kept_alive_connection(stack: Stack) -> None:
    reused = stack.metric("wslb_http_upstream_connections_total", result="reused")
    c = await Raw.open(stack.lb.port)
    try:
        for i in range(200):
            head, body = await c.request("GET", f"/json?i={i}", [("x-session-id", "ka")])
            assert head.status_code == 200
            assert json.loads(body)["query"] == f"i={i}"
    finally:
        c.close()
    after = stack.metric("wslb_http_upstream_connections_total", result="reused")
    assert after - reused >= 190  # the worker side kept alive too


async def test_pipelined_requests_are_answered_in_order(stack: Stack) -> None:
    req = b"GET /json?n=%d HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /json?n=3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer = await raw_exchange(stack.lb.port, req % 1 + req % 2 + last)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    order = [int(m) for m in re.findall(rb'"query":"n=(\d)"', answer)]
    assert order == [1, 2, 3]


async def test_websocket_on_the_same_listener_and_after_plain_requests(stack: Stack) -> None:
    async with connect(f"ws://127.0.0.1:{stack.lb.port}/ws/echo") as ws:
        await ws.send("hi")
        assert await ws.recv() == "echo:hi"
    # One connection: two plain requests, then the upgrade.
    c = await Raw.open(stack.lb.port)
    try:
        for _ in range(2):
            head, _ = await c.request("GET", "/json")
            assert head.status_code == 200
        c.writer.write(
            b"GET /ws/echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        head_bytes = await asyncio.wait_for(c.reader.readuntil(b"\r\n\r\n"), 5)
        assert head_bytes.startswith(b"HTTP/1.1 101")
        mask = b"\x01\x02\x03\x04"
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(b"yo"))
        c.writer.write(b"\x81\x82" + mask + payload)
        frame = await asyncio.wait_for(c.reader.readexactly(2 + len("echo:yo")), 5)
        assert frame == b"\x81\x07echo:yo"
    finally:
        c.close()


# -- curl ---------------------------------------------------------------------------------------


def curl(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[bytes]:
    exe = shutil.which("curl")
    if exe is None:
        pytest.skip("curl not installed (apt-get install curl)")
    return subprocess.run([exe, "-sS", *args], capture_output=True, timeout=timeout, check=False)


def test_curl_json_sse_upload_and_connection_reuse(stack: Stack, tmp_path: Path) -> None:
    r = curl("--fail", f"{stack.base}/json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    r = curl("-N", "--fail", f"{stack.base}/sse?n=3&gap=0.2")
    assert r.stdout.count(b"data: ") == 3
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(4 * 1024 * 1024))
    out = tmp_path / "out"
    # curl sends Expect: 100-continue for a body this large: wslb answers it.
    r = curl("--fail", "--data-binary", f"@{blob}", "-o", str(out), f"{stack.base}/echo")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == blob.read_bytes()
    r = curl(
        "-v",
        "--fail",
        "-o",
        "/dev/null",
        f"{stack.base}/json",
        "-o",
        "/dev/null",
        f"{stack.base}/json",
    )
    assert b"Re-using existing connection" in r.stderr or b"Reusing existing" in r.stderr
    r = curl("--http1.0", "--fail", f"{stack.base}/json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    r = curl("-I", "--max-time", "5", f"{stack.base}/json")  # HEAD: a head, no body
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"HTTP/1.1 405") and r.stdout.endswith(b"\r\n\r\n")


# -- refusals, errors and limits ----------------------------------------------------------------


SMUGGLING = {
    "duplicate differing Content-Length": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde"
    ),
    "Content-Length and Transfer-Encoding": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "obs-fold": b"GET /json HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n",
    "obs-fold of Transfer-Encoding": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n"
    ),
    "bad chunk size": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n"
    ),
    "space before colon": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length : 3\r\n\r\nabc",
    "signed Content-Length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
    "two Host headers": b"GET /json HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(SMUGGLING))
async def test_smuggling_attempts_are_refused_with_400(stack: Stack, name: str) -> None:
    answer = await raw_exchange(stack.lb.port, SMUGGLING[name])
    assert status_of(answer) == 400, answer[:200]
    assert b"HTTP/1.1 200" not in answer


async def test_smuggling_after_a_good_request_on_the_same_connection(stack: Stack) -> None:
    good = b"GET /json HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = await raw_exchange(
        stack.lb.port, good + SMUGGLING["Content-Length and Transfer-Encoding"]
    )
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 400" in answer
    assert answer.count(b"HTTP/1.1 ") == 2


async def test_unsupported_transfer_coding_is_refused(stack: Stack) -> None:
    req = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    assert status_of(await raw_exchange(stack.lb.port, req)) == 501  # h11: RFC 9112 6.1


async def json_error(
    http: aiohttp.ClientSession, method: str, url: str, **kw: Any
) -> tuple[int, Any]:
    async with http.request(method, url, **kw) as r:
        assert r.headers["Content-Type"] == "application/json"
        return r.status, await r.json()


async def test_503_no_worker_502_dead_worker_404_no_pool_426_ws_only(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        status, body = await json_error(http, "GET", f"{stack.base}/empty/x")
        assert status == 503 and body["error"] == "no worker available"
        status, body = await json_error(http, "GET", f"{stack.base}/dead/x")
        assert status == 502 and "error" in body
        async with http.get(f"{stack.base}/wsonly") as r:
            assert r.status == 426


async def test_504_when_the_worker_is_silent_past_timeout_server(stack: Stack) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        status, body = await json_error(http, "GET", f"{stack.base}/sleep?s={TIMEOUT_SERVER + 2}")
        assert status == 504 and "in time" in body["error"]
        assert TIMEOUT_SERVER - 0.2 < time.monotonic() - t0 < TIMEOUT_SERVER + 1.5
        async with http.get(f"{stack.base}/sleep?s=0.5") as r:  # below it: answered
            assert r.status == 200


async def test_413_for_a_body_over_max_body(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        big = io.BytesIO(b"x" * (MAX_BODY + 1))
        status, _ = await json_error(http, "POST", f"{stack.base}/echo", data=big)
        assert status == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_BODY // (1024 * 1024) + 2):
                yield b"y" * (1024 * 1024)

        with contextlib.suppress(aiohttp.ClientError):  # wslb may close before it all went
            async with http.post(f"{stack.base}/echo", data=chunks()) as r:
                assert r.status in (200, 413)
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    got = await r.read()
                    assert r.status == 413 or len(got) <= MAX_BODY


async def test_slow_sse_reader_blocks_the_workers_writes(stack: Stack) -> None:
    """Backpressure: a client that stops reading stops the worker, with bounded buffers. The
    buffers on the way (the kernel's grow while they fill) take a while to fill, so the test
    waits for the worker's count to stay put for a second (bounded), not for a fixed time."""
    before = await _progress(stack)
    r, w = await asyncio.open_connection("127.0.0.1", stack.lb.port)
    try:
        # The app and the client share the host: pin the key so the flood and /progress meet.
        w.write(b"GET /flood?n=300000&size=1024 HTTP/1.1\r\nHost: x\r\nX-Session-Id: flood\r\n\r\n")
        await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        b = await _settled(stack, quiet=1.0, timeout=20.0)  # the worker is blocked
        written = b - before
        assert written < 40 * 1024 * 1024, written  # kernel buffers + wslb's write buffer
        got = 0
        while got < 4 * 1024 * 1024:  # reading again lets it go on
            got += len(await asyncio.wait_for(r.read(65536), 5))
        deadline = time.monotonic() + 5
        while await _progress(stack) <= b:
            assert time.monotonic() < deadline, "the worker did not write again"
            await asyncio.sleep(0.05)
    finally:
        w.close()


async def _settled(stack: Stack, quiet: float, timeout: float) -> int:
    """The worker's flood count once it has not moved for ``quiet`` seconds (at most
    ``timeout`` seconds of polling, else the test fails)."""
    deadline = time.monotonic() + timeout
    last, since = await _progress(stack), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"the worker still writes: {last} bytes"
        await asyncio.sleep(0.1)
        now = await _progress(stack)
        if now != last:
            last, since = now, time.monotonic()
    return last


async def _progress(stack: Stack) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.base}/progress", headers={"X-Session-Id": "flood"}) as r,
    ):
        return int((await r.json())["bytes"])


# -- a worker that dies -------------------------------------------------------------------------


@pytest.fixture
def lone(tmp_path: Path) -> Iterator[Stack]:
    """A wslb in front of one app of its own (the tests kill it)."""
    app = App(tmp_path)
    lb = Wslb(config([app]), tmp_path).start()
    try:
        yield Stack(lb, [app])
    finally:
        lb.stop()
        app.stop()


async def test_worker_dying_mid_body_cuts_the_chunked_answer(lone: Stack) -> None:
    answer = await raw_exchange(lone.lb.port, b"GET /die HTTP/1.1\r\nHost: x\r\n\r\n", 10)
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in answer.lower()
    assert b"part one;" in answer
    assert not answer.endswith(b"0\r\n\r\n")  # no terminator: the client sees a cut answer
    async with aiohttp.ClientSession() as http:  # the worker is gone now: 502
        status, body = await json_error(http, "GET", f"{lone.base}/json")
        assert status == 502 and "error" in body


async def test_worker_dying_while_the_relay_thread_has_the_body_cuts_it(lone: Stack) -> None:
    """The worker is killed after 12 chunks (the thread forwarding them): the client has every
    chunk and no terminator; the next request gets a clean 502."""
    answer = await raw_exchange(lone.lb.port, b"GET /die?parts=12 HTTP/1.1\r\nHost: x\r\n\r\n", 10)
    assert answer.startswith(b"HTTP/1.1 200")
    for i in range(2, 13):
        assert f"part {i};".encode() in answer
    assert not answer.endswith(b"0\r\n\r\n")
    async with aiohttp.ClientSession() as http:
        status, body = await json_error(http, "GET", f"{lone.base}/json")
        assert status == 502 and "error" in body


async def test_worker_dying_before_its_answer_is_a_502(lone: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        status, body = await json_error(http, "GET", f"{lone.base}/die?early=1")
        assert status == 502 and "error" in body
    deadline = time.monotonic() + 5  # the line is written just after the answer
    while "GET /die status=502" not in lone.lb.output():
        assert time.monotonic() < deadline, lone.lb.log_tail()
        await asyncio.sleep(0.05)


# -- drain, log, metrics ------------------------------------------------------------------------


async def test_drain_lets_requests_in_flight_finish_and_sends_none_new(stack: Stack) -> None:
    lb = stack.lb
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.get(f"{stack.base}/json", headers={"X-Session-Id": "drainee"}) as r:
            pid = (await r.json())["pid"]
        victim = next(
            b["id"]
            for b in lb.admin("/backends")
            if b["pool"] == "p" and _pid_of(stack, b["id"]) == pid
        )
        async with http.get(
            f"{stack.base}/sse?n=3&gap=0.7", headers={"X-Session-Id": "drainee"}
        ) as stream:
            assert stream.status == 200
            await asyncio.to_thread(lb.admin_post, f"/backends/{victim}/drain", {"migrate": False})
            for _ in range(10):
                async with http.get(f"{stack.base}/json", headers={"X-Session-Id": "drainee"}) as r:
                    assert (await r.json())["pid"] != pid
            body = await stream.read()
        assert body.count(b"data: ") == 3  # finished on the draining worker
        await asyncio.to_thread(lb.admin_post, f"/backends/{victim}/undrain", {})
        lb.wait_ready(until=lambda bs: all(b["state"] == "active" for b in bs))


def _pid_of(stack: Stack, backend_id: str) -> int:
    app = stack.apps[int(backend_id[1:])]
    return int(app.proc.pid)


async def test_access_log_line_and_metrics_per_kind(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.base}/sse?n=1&gap=0", headers={"User-Agent": "ua-sse"}) as r:
            await r.read()
        async with http.get(f"{stack.base}/json?secret=1", headers={"User-Agent": "ua-json"}) as r:
            await r.read()
    deadline = time.monotonic() + 5
    while "ua=ua-json" not in stack.lb.output() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    lines = [ln for ln in stack.lb.output().splitlines() if "ua=ua-json" in ln]
    assert lines, stack.lb.log_tail()
    line = lines[-1]
    assert "127.0.0.1 GET /json status=200" in line and "secret" not in line
    assert re.search(r"pool=p backend=a\d kind=plain", line)
    assert re.search(r"bytes_in=0 bytes_out=\d+", line)
    assert any("ua=ua-sse" in ln and "kind=sse" in ln for ln in stack.lb.output().splitlines())
    requests = "wslb_http_requests_total"
    assert stack.metric(requests, pool="p", kind="sse", code="200") >= 1
    assert stack.metric(requests, pool="p", kind="plain", code="200") >= 1
    assert stack.metric("wslb_http_body_bytes_total", direction="worker_to_client") > 0
    assert stack.metric("wslb_http_requests_active", pool="p") == 0


# -- TLS and workers: 2 -------------------------------------------------------------------------


async def test_https_listener(tmp_path: Path) -> None:
    app = App(tmp_path)
    certs = make_certs(tmp_path)
    port = free_port()
    lb = with_listeners(config([app]), tmp_path, tls_listener(port, certs))
    lb.start()
    ctx = certs.client_ctx()
    base = f"https://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
            for _ in range(3):  # kept alive over TLS
                async with http.get(f"{base}/json") as r:
                    assert r.status == 200
                    assert (await r.json())["headers"]["x-forwarded-proto"] == "https"
            async with http.get(f"{base}/sse?n=3&gap=0.2") as r:
                assert (await r.read()).count(b"data: ") == 3
            body = os.urandom(1024 * 1024)
            async with http.post(f"{base}/echo", data=io.BytesIO(body)) as r:
                assert await r.read() == body
        async with connect(f"wss://127.0.0.1:{port}/ws/echo", ssl=ctx) as ws:
            await ws.send("tls")
            assert await ws.recv() == "echo:tls"
        r2 = curl("--cacert", str(certs.ca_file), "--fail", f"{base}/json")
        assert r2.returncode == 0 and json.loads(r2.stdout)["ok"] is True
    finally:
        lb.stop()
        app.stop()


async def test_two_serving_processes(tmp_path: Path) -> None:
    app = App(tmp_path)
    cfg = config([app])
    cfg["workers"] = 2
    lb = Wslb(cfg, tmp_path).start()
    try:

        async def one(i: int) -> int:
            async with aiohttp.ClientSession() as http:
                n = 0
                for j in range(10):
                    async with http.get(f"http://127.0.0.1:{lb.port}/json?{i}-{j}") as r:
                        assert r.status == 200
                        n += 1
                return n

        assert sum(await asyncio.gather(*(one(i) for i in range(6)))) == 60
        total = metric(lb, "wslb_http_requests_total", pool="p", kind="plain", code="200")
        assert total == 60
    finally:
        lb.stop()
        app.stop()
