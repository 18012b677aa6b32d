"""The proxy end to end: real wslb and worker processes on loopback, real WebSocket clients.

Workers that must misbehave (wrong accept key, non-101, recording close codes) are real servers
in the test process: the websockets library or raw asyncio sockets.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from backends.model import token_text
from balancer.frames import OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, OP_TEXT, close_payload
from tests.procs import Worker, Wslb, free_port, pool_config
from tests.waits import settled, until
from tests.wsraw import RawClient

FAST = {"ping_interval": "30s", "ping_timeout": "30s", "close": "2s", "shutdown_grace": "0.2s"}


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    ws = [Worker(f"w{i}", ["--tokens-per-s", "400"]).start() for i in range(1, 4)]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def lb(workers: list[Worker], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wslb]:
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers], hash_balance_factor=1.25)
    cfg["timeouts"] = FAST
    cfg["limits"] = {"max_frame_size": "64KiB", "max_message_size": "256KiB"}
    proc = Wslb(cfg, tmp_path_factory.mktemp("lb")).start()
    yield proc
    proc.stop()


async def chat(
    url: str, session: str, prompts: list[str], max_tokens: int = 8
) -> tuple[str, list[dict[str, Any]]]:
    """One connection: returns the worker that said hello and the done messages."""
    async with connect(f"{url}/ws?session={session}") as ws:
        hello = json.loads(await ws.recv())
        dones = []
        for p in prompts:
            await ws.send(json.dumps({"type": "prompt", "text": p, "max_tokens": max_tokens}))
            dones.append(await read_answer(ws, session))
        return hello["worker"], dones


async def read_answer(ws: ClientConnection, session: str) -> dict[str, Any]:
    """Read one answer, checking every token arrives once, in order, with the right text."""
    i = 0
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if msg["type"] == "done":
            assert msg["tokens"] == i
            return dict(msg)
        assert msg["type"] == "token", msg
        assert msg["i"] == i
        assert msg["text"] == token_text(session, msg["turn"], i)
        i += 1


# -- streaming and routing -------------------------------------------------------------------


async def test_streaming_through_the_proxy(lb: Wslb) -> None:
    worker, dones = await chat(lb.url, "stream-1", ["hello there", "and more"], max_tokens=20)
    assert [d["turn"] for d in dones] == [1, 2]
    assert all(d["worker"] == worker for d in dones)
    assert dones[1]["cached_tokens"] > 0  # the second turn found the first in the KV cache


async def test_reconnect_with_same_key_returns_to_its_worker(lb: Wslb) -> None:
    first, _ = await chat(lb.url, "affine-7", ["one"])
    for _ in range(3):
        again, dones = await chat(lb.url, "affine-7", ["next"])
        assert again == first
        assert dones[0]["cached_tokens"] > 0


async def test_keys_spread_over_all_workers(lb: Wslb, workers: list[Worker]) -> None:
    async def hello(key: str) -> str:
        async with connect(f"{lb.url}/ws?session={key}") as ws:
            return str(json.loads(await ws.recv())["worker"])

    # One at a time: with many live at once the bound (tested below) moves keys on purpose.
    counts = Counter([await hello(f"spread-{i}") for i in range(60)])
    assert set(counts) == {w.id for w in workers}
    assert min(counts.values()) >= 8


async def test_bounded_load_holds_with_many_live_sessions(lb: Wslb) -> None:
    conns = []
    try:
        for i in range(45):
            ws = await connect(f"{lb.url}/ws?session=bound-{i}")
            json.loads(await ws.recv())
            conns.append(ws)
            # What the bound counts: live sessions and the places held for keys between their
            # sessions (the earlier tests' keys hold theirs here for a while).
            live = {b["id"]: b["sessions"] + b["held"] for b in lb.admin("/backends")}
            total = sum(live.values())
            bound = math.ceil(1.25 * total / 3)
            assert max(live.values()) <= bound, live
    finally:
        for ws in conns:
            await ws.close()


async def test_session_key_from_header_and_generated_key_returned(lb: Wslb) -> None:
    async with connect(f"{lb.url}/ws", additional_headers={"X-Session-Id": "hdr-key"}) as ws:
        assert json.loads(await ws.recv())["session"] == "hdr-key"
        assert ws.response.headers["X-Session-Id"] == "hdr-key"
    async with connect(f"{lb.url}/ws") as ws:
        generated = ws.response.headers["X-Session-Id"]
        assert len(generated) >= 16
        assert json.loads(await ws.recv())["session"] == generated
    async with connect(f"{lb.url}/ws", additional_headers={"Cookie": "a=b; wslb_session=ck"}) as ws:
        assert json.loads(await ws.recv())["session"] == "ck"


# -- handshake answers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Sec-WebSocket-Key": "short"}, 400),
        ({"Sec-WebSocket-Key": ""}, 400),
        ({"Sec-WebSocket-Version": "8"}, 426),
        ({"Upgrade": ""}, 426),
        ({"Connection": "keep-alive"}, 426),
    ],
)
async def test_bad_handshakes_are_refused(lb: Wslb, headers: dict[str, str], status: int) -> None:
    c = await RawClient.connect(lb.port, headers=headers)
    assert c.status == status
    if status == 426 and "Sec-WebSocket-Version" in headers:
        assert c.headers["sec-websocket-version"] == "13"
    assert await c.eof()
    c.close()


async def test_malformed_http_and_wrong_method(lb: Wslb) -> None:
    c = await RawClient.connect(lb.port, raw_request=b"GARBAGE\r\n\r\n")
    assert c.status == 400
    # An upgrade by POST (a plain POST is proxied: tests/test_http_proxy.py).
    c = await RawClient.connect(
        lb.port,
        raw_request=b"POST /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nContent-Length: 0\r\n\r\n",
    )
    assert c.status == 400


async def test_metrics_report_rejections_and_traffic(lb: Wslb) -> None:
    await chat(lb.url, "metrics-1", ["x"])
    text = lb.admin("/metrics")
    for name in (
        "wslb_frames_total",
        "wslb_bytes_total",
        "wslb_messages_total",
        "wslb_sessions_active",
        "wslb_sessions_total",
        "wslb_handshake_rejections_total",
        "wslb_upstream_connect_failures_total",
        "wslb_close_frames_total",
    ):
        assert name in text, name
    assert 'direction="worker_to_client"' in text


# -- framing violations and close codes ------------------------------------------------------


async def _open_raw(lb: Wslb, key: str) -> RawClient:
    c = await RawClient.connect(lb.port, path=f"/ws?session={key}")
    assert c.status == 101
    op, payload = await c.read_frame()  # hello
    assert op == OP_TEXT and json.loads(payload)["type"] == "hello"
    return c


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (lambda c: c.send_frame(OP_TEXT, b"{}", mask=False), 1002),
        (lambda c: c.send(bytes([0xC1, 0x80, 1, 2, 3, 4])), 1002),  # RSV1
        (lambda c: c.send_frame(0x3, b"x"), 1002),  # reserved opcode
        (lambda c: c.send_frame(0x0, b"x"), 1002),  # continuation without a message
        (lambda c: c.send_frame(OP_PING, b"x", fin=False), 1002),
        (lambda c: c.send_frame(OP_CLOSE, b"\x03\xe7"), 1002),  # code 999
        (lambda c: c.send_frame(OP_BINARY, b"x" * (64 * 1024 + 1)), 1009),
        (
            lambda c: (
                [c.send_frame(OP_TEXT, b"x" * 60000, fin=False) for _ in range(1)]
                + [c.send_frame(0, b"x" * 60000, fin=False) for _ in range(4)]
            ),
            1009,
        ),
    ],
)
async def test_client_violations_get_close_codes(lb: Wslb, frame: Any, code: int) -> None:
    c = await _open_raw(lb, f"violation-{code}-{id(frame)}")
    frame(c)
    got, _ = await c.read_until_close()
    assert got == code
    c.send_frame(OP_CLOSE, close_payload(code))
    assert await c.eof()


async def test_client_close_is_relayed_and_answered(lb: Wslb) -> None:
    c = await _open_raw(lb, "close-1")
    c.send_frame(OP_CLOSE, close_payload(1000, "bye"))
    code, _ = await c.read_until_close()
    assert code == 1000  # the worker's answer, relayed
    assert await c.eof()


async def test_endpoint_pings_pass_through(lb: Wslb) -> None:
    c = await _open_raw(lb, "ping-1")
    c.send_frame(OP_PING, b"mine")
    op, payload = await c.read_frame()
    assert (op, payload) == (OP_PONG, b"mine")  # answered by the worker, through wslb
    c.close()


# -- misbehaving and lost workers ------------------------------------------------------------


class Recorder:
    """A websockets echo server that records what it saw."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.closes: list[int | None] = []
        self.connections = 0
        self.port = free_port()
        self.subprotocols: list[str] | None = None

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        assert ws.request is not None
        self.headers.append({k.lower(): v for k, v in ws.request.headers.raw_items()})
        try:
            async for msg in ws:
                if msg == "flood":
                    for _ in range(4000):
                        await ws.send("x" * 8192)
                    await ws.send("flood-done")
                else:
                    await ws.send(msg)
        except ConnectionClosed:
            pass
        self.closes.append(ws.close_code)


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()

    def pick(conn: ServerConnection, offered: Sequence[str]) -> Subprotocol | None:
        return Subprotocol("chat.v2") if "chat.v2" in offered else None

    async with serve(rec.handler, "127.0.0.1", rec.port, select_subprotocol=pick):
        yield rec


async def _raw_server(answer: bytes) -> tuple[asyncio.Server, int, list[int]]:
    port = free_port()
    seen: list[int] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics "):  # wslb's load scrape, not a session
                w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                return
            seen.append(1)
            w.write(answer)
            await w.drain()
            await asyncio.wait_for(r.read(), 5)  # until wslb hangs up
        finally:
            w.close()

    return await asyncio.start_server(handle, "127.0.0.1", port), port, seen


def _lb_for(urls: list[tuple[str, str]], tmp: Path, **extra: Any) -> Wslb:
    # These test servers have no HTTP health endpoint: only the handshake reaches them.
    cfg = pool_config([{"id": i, "url": u} for i, u in urls], health={"enabled": False})
    cfg["timeouts"] = {**FAST, **extra.pop("timeouts", {})}
    cfg.update(extra)
    return Wslb(cfg, tmp).start(wait_ready=False)


async def test_headers_subprotocol_and_echo_through_recorder(
    recorder: Recorder, tmp_path: Path
) -> None:
    lb = _lb_for([("rec", f"ws://127.0.0.1:{recorder.port}/echo")], tmp_path)
    try:
        async with connect(
            f"{lb.url}/ws?session=s1&x=1",
            subprotocols=["nope", "chat.v2"],  # type: ignore[list-item]
            additional_headers={"X-Forwarded-For": "10.1.1.1", "Authorization": "Bearer t"},
        ) as ws:
            assert ws.subprotocol == "chat.v2"
            await ws.send("ping-me")
            assert await ws.recv() == "ping-me"
        h = recorder.headers[0]
        assert h["x-session-id"] == "s1"
        assert h["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
        assert h["authorization"] == "Bearer t"
        assert "sec-websocket-extensions" not in h
        # The client's close (1000) reached the worker.
        for _ in range(50):
            if recorder.closes:
                break
            await asyncio.sleep(0.05)
        assert recorder.closes == [1000]
    finally:
        lb.stop()


async def test_client_lost_gives_worker_1001(recorder: Recorder, tmp_path: Path) -> None:
    lb = _lb_for([("rec", f"ws://127.0.0.1:{recorder.port}/")], tmp_path)
    try:
        c = await RawClient.connect(lb.port)
        assert c.status == 101
        c.writer.transport.abort()
        for _ in range(100):
            if recorder.closes:
                break
            await asyncio.sleep(0.05)
        assert recorder.closes == [1001]
    finally:
        lb.stop()


async def test_backpressure_stops_a_flooding_worker(recorder: Recorder, tmp_path: Path) -> None:
    lb = _lb_for(
        [("rec", f"ws://127.0.0.1:{recorder.port}/")],
        tmp_path,
        limits={"write_buffer_high": "64KiB"},
    )
    try:
        c = await RawClient.connect(lb.port)
        c.send_frame(OP_TEXT, b"flood")

        def session() -> dict[str, Any]:
            (view,) = lb.admin("/sessions")
            return dict(view)

        # The client reads nothing meanwhile: the relayed count stops (bounded).
        await until(lambda: session()["frames"]["worker_to_client"] > 0, 10, "the flood")
        await settled(lambda: session()["frames"]["worker_to_client"], 1.0, 20, "frames relayed")
        m = session()
        # 4000 x 8 KiB = 32 MiB offered; only what fits the kernel's loopback socket buffers
        # (a few MiB) and wslb's 64 KiB passed: the worker is blocked, nothing piles up.
        assert m["frames"]["worker_to_client"] < 1500, m
        # Reading resumes the flow, and everything arrives.
        n = 0
        while True:
            _, payload = await c.read_frame(10)
            if payload == b"flood-done":
                break
            n += 1
        assert n == 4000
        c.close()
    finally:
        lb.stop()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: d3Jvbmcga2V5IQ==\r\n\r\n\x81\x05hello",
    ],
    ids=["non-101", "wrong-accept"],
)
async def test_bad_worker_answer_gives_502_and_nothing_tunnelled(
    answer: bytes, tmp_path: Path
) -> None:
    server, port, seen = await _raw_server(answer)
    lb = _lb_for([("bad", f"ws://127.0.0.1:{port}/")], tmp_path)
    try:
        c = await RawClient.connect(lb.port)
        assert c.status == 502
        rest = await asyncio.wait_for(c.reader.read(), 5)
        assert b"hello" not in rest and b"\x81\x05" not in rest
        assert seen == [1]
    finally:
        lb.stop()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.05)


async def test_no_worker_gives_503_and_connect_failure_tries_next(tmp_path: Path) -> None:
    dead = free_port()
    lb = _lb_for([("dead", f"ws://127.0.0.1:{dead}/")], tmp_path)
    try:
        c = await RawClient.connect(lb.port)
        assert c.status == 502  # the only worker refused the connection
        failed = 'wslb_upstream_connect_failures_total{backend="dead",pool="chat"}'
        assert failed in lb.admin("/metrics")
    finally:
        lb.stop()
    w = Worker("alive").start()
    lb = _lb_for([("dead", f"ws://127.0.0.1:{dead}/ws"), ("alive", w.url)], tmp_path)
    try:
        # Every key works: those hashing to the dead worker walk on to the next one.
        for i in range(10):
            async with connect(f"{lb.url}/ws?session=next-{i}") as ws:
                assert json.loads(await ws.recv())["worker"] == "alive"
    finally:
        lb.stop()
        w.stop()


async def test_unknown_path_gives_404_and_prefix_routes(tmp_path: Path) -> None:
    w = Worker("p").start()
    cfg = pool_config([{"id": "p", "url": w.url}], match={"path_prefix": "/chat"})
    lb = Wslb({**cfg, "timeouts": FAST}, tmp_path).start(wait_ready=False)
    try:
        c = await RawClient.connect(lb.port, path="/other")
        assert c.status == 404
        async with connect(f"{lb.url}/chat/x") as ws:
            assert json.loads(await ws.recv())["worker"] == "p"
    finally:
        lb.stop()
        w.stop()


async def test_worker_killed_mid_stream_gives_1011_fast_and_others_continue(
    tmp_path: Path,
) -> None:
    a, b = (
        Worker("a", ["--tokens-per-s", "50"]).start(),
        Worker("b", ["--tokens-per-s", "50"]).start(),
    )
    lb = _lb_for([("a", a.url), ("b", b.url)], tmp_path)
    try:
        conns: dict[str, list[ClientConnection]] = {"a": [], "b": []}
        i = 0
        while min(len(v) for v in conns.values()) < 3 and i < 200:
            ws = await connect(f"{lb.url}/ws?session=kill-{i}")
            conns[json.loads(await ws.recv())["worker"]].append(ws)
            i += 1
        for ws in conns["a"] + conns["b"]:
            await ws.send(json.dumps({"type": "prompt", "text": "long", "max_tokens": 500}))
        await until(  # every answer under way: more than the hello came
            lambda: all(s["messages"]["worker_to_client"] > 1 for s in lb.admin("/sessions")),
            10,
            "every answer streaming",
        )
        a.kill()
        t0 = time.monotonic()
        for ws in conns["a"]:
            with pytest.raises(ConnectionClosed) as exc:
                while True:
                    await asyncio.wait_for(ws.recv(), 2)
            assert exc.value.rcvd is not None and exc.value.rcvd.code == 1011
        assert time.monotonic() - t0 < 1.0
        # Sessions on b keep streaming, and new sessions go to b.
        for ws in conns["b"]:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 2))
            assert msg["type"] == "token"
            await ws.close()
        for j in range(5):
            async with connect(f"{lb.url}/ws?session=after-{j}") as ws:
                assert json.loads(await ws.recv())["worker"] == "b"
    finally:
        lb.stop()
        a.stop()
        b.stop()


async def test_ping_timeout_and_idle_timeout(recorder: Recorder, tmp_path: Path) -> None:
    lb = _lb_for(
        [("rec", f"ws://127.0.0.1:{recorder.port}/")],
        tmp_path,
        timeouts={"ping_interval": "0.3s", "ping_timeout": "0.3s", "idle": "1h"},
    )
    try:
        # A raw client that never answers pings is closed with 1011.
        c = await RawClient.connect(lb.port)
        op, _ = await c.read_frame(3)
        assert op == OP_PING
        code, _ = await c.read_until_close(3)
        assert code == 1011
        # A client that answers (websockets does) stays connected past several intervals.
        async with connect(lb.url) as ws:
            # Negative check: not closed over several ping intervals (no count of pongs to await).
            await asyncio.sleep(1.5)
            await ws.send("still")
            assert await ws.recv() == "still"
    finally:
        lb.stop()
    lb = _lb_for(
        [("rec", f"ws://127.0.0.1:{recorder.port}/")],
        tmp_path,
        timeouts={"ping_interval": "0s", "idle": "0.5s"},
    )
    try:
        async with connect(lb.url) as ws:
            with pytest.raises(ConnectionClosed) as exc:
                await asyncio.wait_for(ws.recv(), 5)
            assert exc.value.rcvd is not None and exc.value.rcvd.code == 1001
    finally:
        lb.stop()


async def test_sigterm_closes_sessions_with_1001(tmp_path: Path) -> None:
    w = Worker("t").start()
    lb = _lb_for([("t", w.url)], tmp_path)
    try:
        ws = await connect(f"{lb.url}/ws?session=term")
        await ws.recv()
        assert lb.proc is not None
        lb.proc.terminate()
        with pytest.raises(ConnectionClosed) as exc:
            await asyncio.wait_for(ws.recv(), 5)
        assert exc.value.rcvd is not None and exc.value.rcvd.code == 1001
        assert await asyncio.to_thread(lb.proc.wait, 10) == 0
    finally:
        lb.stop()
        w.stop()


async def test_handshake_rejected_before_any_worker_connection(
    recorder: Recorder, tmp_path: Path
) -> None:
    lb = _lb_for(
        [("rec", f"ws://127.0.0.1:{recorder.port}/")],
        tmp_path,
        auth={"origins": ["https://app.example"]},
    )
    try:
        for headers, status in (
            ({"Sec-WebSocket-Version": "7"}, 426),
            ({"Sec-WebSocket-Key": "x"}, 400),
            ({"Origin": "https://evil.example"}, 403),
        ):
            c = await RawClient.connect(lb.port, headers=headers)
            assert c.status == status
            c.close()
        with pytest.raises(InvalidStatus):
            async with connect(lb.url, origin="https://evil.example"):  # type: ignore[arg-type]
                pass
        async with connect(lb.url, origin="https://app.example"):  # type: ignore[arg-type]
            pass
        assert recorder.connections == 1
    finally:
        lb.stop()


def test_version_of_websockets() -> None:
    assert int(websockets.__version__.split(".")[0]) >= 13


async def test_frames_pipelined_behind_the_request_are_kept(lb: Wslb) -> None:
    prompt = json.dumps({"type": "prompt", "text": "eager", "max_tokens": 3}).encode()
    request = (
        b"GET /ws?session=eager HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    from balancer.frames import build_frame

    c = await RawClient.connect(
        lb.port, raw_request=request + build_frame(OP_TEXT, prompt, mask=True)
    )
    assert c.status == 101
    assert c.headers["sec-websocket-accept"] == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    kinds = []
    while "done" not in kinds:
        _, payload = await c.read_frame()
        kinds.append(json.loads(payload)["type"])
    assert kinds == ["hello", "token", "token", "token", "done"]


async def test_oversized_headers_get_431(lb: Wslb) -> None:
    c = await RawClient.connect(lb.port, headers={"X-Big": "a" * 20000})
    assert c.status == 431


async def test_worker_answering_503_is_skipped_for_the_next_one(tmp_path: Path) -> None:
    server, port, seen = await _raw_server(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
    )
    w = Worker("ok").start()
    lb = _lb_for([("busy", f"ws://127.0.0.1:{port}/"), ("ok", w.url)], tmp_path)
    try:
        for i in range(24):  # keys that hash to "busy" walk on to "ok"
            async with connect(f"{lb.url}/ws?session=busy-{i}") as ws:
                assert json.loads(await ws.recv())["worker"] == "ok"
        assert seen  # "busy" was tried and refused
        # A 503 is "busy or draining", not a failure: the worker is not ejected for it.
        assert lb.admin("/backends/busy")["state"] == "active"
    finally:
        lb.stop()
        w.stop()
        server.close()
        await server.wait_closed()
