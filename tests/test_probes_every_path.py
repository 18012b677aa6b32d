"""Request-smuggling probes answered alike on every path: the event loop's (a connection's first
request) and the offload thread's (a kept-alive connection whose requests it serves).

Each probe is sent twice, on a fresh connection and on a lane (two requests of the probe's own
routing first), followed by a ``Connection: close`` request that ends the connection whatever the
probe left behind. What must be the same on both paths: the statuses the client reads (parsed by
llhttp, the referee) and the requests the worker saw. And on each path the worker never sees more
requests than the client got 200s for: a request hidden in another's body or after a refused
head never reaches it.

The worker parses with h11 (strict, written by nobody here): every request it completes (head
and body) is counted by its ``X-Probe`` tag and answered 200; one it cannot parse closes its
connection. A head whose body wslb then refused is not counted: the event loop may read a small
body before it forwards the head, the thread forwards as it reads, and either way the worker's
connection is cut before that request is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import pytest

from balancer.aio import lanes
from tests.fuzz import referee
from tests.procs import Wslb, free_port
from tests.test_lanes import exchanges, served
from tests.waits import settled

KEY = b"X-Session-Id: probe\r\n"
OK = b'{"ok":true}'


def _h(tag: str, *extra: bytes) -> bytes:
    """Host, the routing key and the tag, then ``extra`` header lines."""
    return b"Host: x\r\n" + KEY + b"X-Probe: " + tag.encode() + b"\r\n" + b"".join(extra)


def _probes() -> dict[str, bytes]:
    """Name -> bytes. ``{t}`` in a probe is its tag (every request in it carries one), three
    characters like ``{t}`` itself: the lengths and chunk sizes hold after the replacement."""
    p: dict[str, bytes] = {}

    def add(name: str, make: bytes) -> None:
        p[name] = make

    def req(tag: str, head: bytes, *lines: bytes, body: bytes = b"") -> bytes:
        return head + b"\r\n" + _h(tag, *lines) + b"\r\n" + body

    post = b"POST /json HTTP/1.1"
    get = b"GET /json HTTP/1.1"
    inner = req("{t}", get)  # a request hidden where a body should be
    cl = b"Content-Length: %d\r\n"
    te = b"Transfer-Encoding: chunked\r\n"
    # Content-Length against Transfer-Encoding, both orders and disguised.
    add("CL then TE", req("{t}", post, cl % 4, te, body=b"0\r\n\r\n" + inner))
    add("TE then CL", req("{t}", post, te, cl % 4, body=b"0\r\n\r\n" + inner))
    for value in (
        b"chunked, chunked",
        b"xchunked",
        b"chunked;q=1",
        b"gzip, chunked",
        b"chunked, gzip",
        b"identity",
        b"",
        b"\x0bchunked",
        b"chunked\x00",
    ):
        add(
            f"TE {value!r} with CL",
            req(
                "{t}",
                post,
                b"Transfer-Encoding: " + value + b"\r\n",
                cl % 5,
                body=b"0\r\n\r\n" + inner,
            ),
        )
    add(
        "TE Chunked (case)",
        req("{t}", post, b"Transfer-Encoding: Chunked\r\n", body=b"3\r\nabc\r\n0\r\n\r\n"),
    )
    add("TE obs-fold", req("{t}", post, b"Transfer-Encoding:\r\n chunked\r\n", cl % 3, body=b"abc"))
    add("TE twice", req("{t}", post, te, te, body=b"0\r\n\r\n"))
    add("TE in HTTP/1.0", req("{t}", b"POST /json HTTP/1.0", te, body=b"3\r\nabc\r\n0\r\n\r\n"))
    # Content-Length alone, malformed.
    add("two different CLs", req("{t}", post, cl % 3, cl % 4, body=b"abcd"))
    add("two equal CLs", req("{t}", post, cl % 3, cl % 3, body=b"abc"))
    add("CL list", req("{t}", post, b"Content-Length: 3, 3\r\n", body=b"abc"))
    for value in (b"+3", b"-1", b"0x3", b"3a", b"3 3", b"99999999999999999999", b"", b" 3 "):
        add(f"CL {value!r}", req("{t}", post, b"Content-Length: " + value + b"\r\n", body=b"abc"))
    add("CL shorter than the body", req("{t}", post, cl % 1, body=b"a" + inner))
    add("GET with a body", req("{t}", get, cl % len(inner), body=inner))
    # Header syntax.
    add("obs-fold", req("{t}", get, b"X-A: 1\r\n  folded\r\n"))
    add("space before colon", req("{t}", get, b"X-A : 1\r\n"))
    add("space before colon of CL", req("{t}", post, b"Content-Length : 3\r\n", body=b"abc"))
    add("tab in a name", req("{t}", get, b"X\tA: 1\r\n"))
    add("no colon", req("{t}", get, b"X-A 1\r\n"))
    add("empty name", req("{t}", get, b": 1\r\n"))
    add("NUL in a value", req("{t}", get, b"X-A: a\x00b\r\n"))
    add("bare CR in a value", req("{t}", get, b"X-A: a\rb\r\n"))
    add("bare LF lines", (get + b"\n" + _h("{t}") + b"\n").replace(b"\r\n", b"\n"))
    add("bare LF end of head", get + b"\r\n" + _h("{t}") + b"\n")
    add("two Hosts", req("{t}", get, b"Host: y\r\n"))
    add("no Host", get + b"\r\n" + KEY + b"X-Probe: {t}\r\n\r\n")
    add("huge header", req("{t}", get, b"X-A: " + b"a" * 70_000 + b"\r\n"))
    add("many headers", req("{t}", get, *(b"X-%d: 1\r\n" % i for i in range(300))))
    # The request line.
    for line in (
        b"GET /json HTTP/1.1 extra",
        b"GET  /json HTTP/1.1",
        b"GET /json HTTP/1.2",
        b"GET /json HTTP/2.0",
        b"GET /json HTTP/1.1 ",
        b"get /json HTTP/1.1",
        b"G@T /json HTTP/1.1",
        b"GET /js on HTTP/1.1",
        b"GET /js\x00on HTTP/1.1",
        b"GET http://x/json HTTP/1.1",
        b"OPTIONS * HTTP/1.1",
        b"CONNECT x:80 HTTP/1.1",
        b"GET json HTTP/1.1",
    ):
        add(f"line {line!r}", req("{t}", line))
    add("HTTP/0.9", b"GET /json\r\n\r\n")
    add("empty lines before a request", b"\r\n\r\n" + req("{t}", get))
    # Chunks.
    for size in (
        b"zz",
        b"-1",
        b"0x3",
        b"+3",
        b"3 ",
        b"3;ext=x",
        b'3;ext="a;b"',
        b"03",
        b"ffffffffffffffffffff",
        b"3;" + b"e" * 5000,
        b"3\x00",
    ):
        add(f"chunk size {size!r}", req("{t}", post, te, body=size + b"\r\nabc\r\n0\r\n\r\n"))
    add("chunk without its CRLF", req("{t}", post, te, body=b"3\r\nabcX0\r\n\r\n"))
    add("chunk longer than said", req("{t}", post, te, body=b"3\r\nabcdef\r\n0\r\n\r\n"))
    add(
        "chunk hiding a request",
        req("{t}", post, te, body=b"%x\r\n%b\r\n0\r\n\r\n" % (len(inner), inner)),
    )
    add("last chunk with a bare LF", req("{t}", post, te, body=b"3\r\nabc\r\n0\n\n"))
    # Trailers.
    add("a trailer", req("{t}", post, te, body=b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"))
    add("CL in a trailer", req("{t}", post, te, body=b"3\r\nabc\r\n0\r\nContent-Length: 9\r\n\r\n"))
    add("obs-fold in a trailer", req("{t}", post, te, body=b"0\r\nX-T: 1\r\n 2\r\n\r\n"))
    # Pipelining and upgrades.
    add("two requests in one write", req("{t}", get) + req("{t}", get))
    add("a refused head then a request", req("{t}", get, b"X-A : 1\r\n") + inner)
    add(
        "h2c upgrade",
        req(
            "{t}",
            get,
            b"Connection: Upgrade, HTTP2-Settings\r\n",
            b"Upgrade: h2c\r\n",
            b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n",
        ),
    )
    add(
        "websocket upgrade without a key",
        req("{t}", get, b"Connection: Upgrade\r\n", b"Upgrade: websocket\r\n"),
    )
    add("Expect: something else", req("{t}", post, b"Expect: 200-ok\r\n", cl % 3, body=b"abc"))
    return p


PROBES = _probes()


class Worker:
    """A keep-alive HTTP/1.1 server on h11: each whole request counted by its tag, answered 200."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.port = free_port()
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        tag = "-"
        with contextlib.suppress(ConnectionError, h11.ProtocolError):
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await r.read(65536)
                    conn.receive_data(data)
                    if not data:
                        break
                    continue
                if isinstance(ev, h11.Request):
                    tag = dict(ev.headers).get(b"x-probe", b"-").decode("latin-1")
                elif isinstance(ev, h11.EndOfMessage):
                    self.seen[tag] += 1
                    headers = [("content-type", "application/json"), ("content-length", "11")]
                    w.write(conn.send(h11.Response(status_code=200, headers=headers)))
                    w.write(conn.send(h11.Data(data=OK)))
                    w.write(conn.send(h11.EndOfMessage()))
                    await w.drain()
                    if conn.our_state is h11.MUST_CLOSE:
                        break
                    conn.start_next_cycle()
                elif isinstance(ev, h11.ConnectionClosed):
                    break
        w.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[tuple[Wslb, Worker]]:
    worker = Worker()
    await worker.start()
    cfg = {
        "pools": [
            {
                "name": "p",
                "backends": [{"id": "w", "url": f"http://127.0.0.1:{worker.port}"}],
                "health": {"enabled": False},
                "weights": {"scrape_interval": "60s"},
                "http": {"timeout_request": "2s", "timeout_server": "5s"},
            }
        ],
    }
    lb = Wslb(cfg, tmp_path)
    await asyncio.to_thread(lb.start)
    try:
        yield lb, worker
    finally:
        await asyncio.to_thread(lb.stop)
        await worker.stop()


async def _answers(port: int, tag: str, probe: bytes, lane: bool) -> list[int]:
    """The statuses the client reads for ``probe`` (and the closing request after it)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        if lane:  # two requests of the probe's routing: the thread takes the connection
            for i in range(2):
                w.write(b"GET /json HTTP/1.1\r\n" + _h(f"lane-{tag}-{i}") + b"\r\n")
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert await asyncio.wait_for(r.readexactly(len(OK)), 10) == OK
        w.write(probe.replace(b"{t}", tag.encode()))
        w.write(b"GET /json HTTP/1.1\r\n" + _h(f"{tag}-end", b"Connection: close\r\n") + b"\r\n")
        data = bytearray()
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(r.read(65536), 15):
                data += chunk
    finally:
        w.close()
    parsed = referee.llhttp(bytes(data), response=True)
    return [m.status for m in parsed.messages if m.head_done]


@pytest.mark.skipif(not lanes.AVAILABLE, reason="balancer._offload is not built")
async def test_probes_get_the_same_answers_on_the_event_loop_and_on_a_lane(
    front: tuple[Wslb, Worker],
) -> None:
    lb, worker = front
    before = exchanges(lb)
    names = sorted(PROBES)
    tags = {name: f"{i:02d}" for i, name in enumerate(names)}  # "{t}"'s length with E or L
    results: dict[bool, dict[str, tuple[list[int], int]]] = {}
    for lane in (False, True):
        path = "L" if lane else "E"
        answers = await asyncio.gather(
            *(_answers(lb.port, path + tags[n], PROBES[n], lane) for n in names)
        )
        seen = await settled(lambda: sum(worker.seen.values()), quiet=0.5, what="worker")
        assert seen
        results[lane] = {
            n: (s, worker.seen[path + tags[n]] + worker.seen[path + tags[n] + "-end"])
            for n, s in zip(names, answers, strict=True)
        }
    differ = {
        n: (results[False][n], results[True][n])
        for n in names
        if results[False][n] != results[True][n]
    }
    assert not differ, differ
    for n, (statuses, forwarded) in results[True].items():
        assert statuses, n  # every probe is answered
        assert forwarded <= statuses.count(200), (n, statuses, forwarded)
    hidden = [
        n for n in names if "hiding" in n or n in ("CL then TE", "TE then CL", "GET with a body")
    ]
    for n in hidden:  # the request in the body never reached the worker as one
        assert results[True][n][1] <= 2, (n, results[True][n])
    assert len(PROBES) >= 67
    # Each lane's second request was the thread's, so every probe met a lane that was serving.
    assert await served(lb, before + len(PROBES)) >= before + len(PROBES)
