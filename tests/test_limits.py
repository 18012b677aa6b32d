"""Limits and failure handling: each ends only its own session, with the right code, counted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from balancer.frames import OP_TEXT
from tests.procs import Worker, Wslb, free_port, pool_config
from tests.waits import until
from tests.wsraw import RawClient


class Flood:
    """A websockets worker: "flood" sends 32 MiB, "reset" drops TCP, else echo; counts."""

    def __init__(self) -> None:
        self.port = free_port()
        self.connections = 0
        self.closes: list[int | None] = []

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        try:
            async for msg in ws:
                if msg == "flood":
                    for _ in range(4000):
                        await ws.send("x" * 8192)
                elif msg == "reset":
                    ws.transport.abort()
                    return
                else:
                    await ws.send(msg)
        except ConnectionClosed:
            pass
        self.closes.append(ws.close_code)


@pytest.fixture
async def flood() -> AsyncIterator[Flood]:
    f = Flood()
    async with serve(f.handler, "127.0.0.1", f.port):
        yield f


def lb_for(url: str, tmp: Path, **extra: Any) -> Wslb:
    cfg = pool_config([{"id": "w", "url": url}], health={"enabled": False})
    cfg.update(extra)
    return Wslb(cfg, tmp).start(wait_ready=False)


async def test_per_client_address_limit_gives_429(flood: Flood, tmp_path: Path) -> None:
    lb = lb_for(f"ws://127.0.0.1:{flood.port}/", tmp_path, limits={"max_connections_per_client": 2})
    try:
        held = [await connect(lb.url) for _ in range(2)]
        c = await RawClient.connect(lb.port)
        assert c.status == 429
        assert flood.connections == 2
        await held[0].close()
        await until(lambda: len(lb.admin("/sessions")) == 1, 10, "the closed session let go")
        async with connect(lb.url):
            pass
        for ws in held[1:]:
            await ws.close()
    finally:
        lb.stop()


async def test_session_paused_too_long_by_backpressure_gets_1008(
    flood: Flood, tmp_path: Path
) -> None:
    lb = lb_for(
        f"ws://127.0.0.1:{flood.port}/",
        tmp_path,
        timeouts={"ping_interval": "0s", "backpressure": "1s", "close": "1s"},
        limits={"write_buffer_high": "64KiB"},
    )
    try:
        c = await RawClient.connect(lb.port)
        c.send_frame(OP_TEXT, b"flood")  # then never read
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and lb.admin("/sessions"):  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        assert lb.admin("/sessions") == []
        assert "wslb_backpressure_closes_total 1.0" in lb.admin("/metrics")
        for _ in range(50):
            if flood.closes:
                break
            await asyncio.sleep(0.05)
        assert flood.closes and flood.closes[0] in (1001, 1006, 1008)  # the worker was let go
    finally:
        lb.stop()


async def test_trickling_handshake_is_cut_at_the_timeout(flood: Flood, tmp_path: Path) -> None:
    lb = lb_for(f"ws://127.0.0.1:{flood.port}/", tmp_path, timeouts={"handshake": "1s"})
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", lb.port)
        t0 = time.monotonic()
        writer.write(b"GET /ws HTTP/1.1\r\nHost: x\r\n")
        head = b""
        for _ in range(15):  # a header byte now and then, never the end
            writer.write(b"X")
            try:
                head = await asyncio.wait_for(reader.read(100), 0.2)
            except TimeoutError:
                continue
            break
        assert head.startswith(b"HTTP/1.1 408")
        assert 0.9 < time.monotonic() - t0 < 3
        writer.close()
        assert flood.connections == 0
    finally:
        lb.stop()


async def test_worker_that_never_answers_the_handshake_gives_502(tmp_path: Path) -> None:
    port = free_port()
    accepted: list[int] = []

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await r.read()  # reads and says nothing
        w.close()

    server = await asyncio.start_server(silent, "127.0.0.1", port)
    lb = lb_for(f"ws://127.0.0.1:{port}/", tmp_path, timeouts={"handshake": "0.5s"})
    try:
        t0 = time.monotonic()
        c = await RawClient.connect(lb.port)
        assert c.status == 502
        assert time.monotonic() - t0 < 3
        assert accepted  # it was reached (the load scraper may have knocked too)
        failed = 'wslb_upstream_connect_failures_total{backend="w",pool="chat"} 1.0'
        assert failed in lb.admin("/metrics")
    finally:
        lb.stop()
        server.close()
        await server.wait_closed()


async def test_worker_reset_gives_1011_to_its_session_only(flood: Flood, tmp_path: Path) -> None:
    lb = lb_for(f"ws://127.0.0.1:{flood.port}/", tmp_path)
    try:
        async with connect(lb.url) as other, connect(lb.url) as victim:
            await victim.send("reset")
            with pytest.raises(ConnectionClosed) as exc:
                await asyncio.wait_for(victim.recv(), 5)
            assert exc.value.rcvd is not None and exc.value.rcvd.code == 1011
            await other.send("fine")
            assert await other.recv() == "fine"
        assert 'wslb_close_frames_total{code="1011",to="client"} 1.0' in lb.admin("/metrics")
    finally:
        lb.stop()


async def test_worker_stalled_mid_stream_hits_the_ping_timeout(tmp_path: Path) -> None:
    w = Worker("stall", ["--tokens-per-s", "20"]).start()
    lb = lb_for(w.url, tmp_path, timeouts={"ping_interval": "0.3s", "ping_timeout": "0.3s"})
    assert w.proc is not None
    try:
        async with connect(f"{lb.url}/ws?session=st") as ws:
            json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "prompt", "text": "x", "max_tokens": 100}))
            await ws.recv()
            os.kill(w.proc.pid, signal.SIGSTOP)  # alive, connected, silent
            try:
                with pytest.raises(ConnectionClosed) as exc:
                    while True:
                        await asyncio.wait_for(ws.recv(), 5)
                assert exc.value.rcvd is not None and exc.value.rcvd.code == 1011
                assert "ping timeout" in exc.value.rcvd.reason
            finally:
                os.kill(w.proc.pid, signal.SIGCONT)
    finally:
        lb.stop()
        w.stop()


async def test_no_refused_handshake_reaches_the_worker(tmp_path: Path) -> None:
    w = Worker("count").start()
    cfg = pool_config([{"id": "count", "url": w.url}], match={"path_prefix": "/ws"})
    cfg["limits"] = {"max_headers": 20, "max_connections_per_client": 3}
    cfg["timeouts"] = {"handshake": "0.5s"}
    lb = Wslb(cfg, tmp_path).start()

    def connections() -> float:
        for line in w.metrics().splitlines():
            if line.startswith("wslb_worker_connections_total"):
                return float(line.split()[-1])
        raise AssertionError("no counter")

    try:
        before = connections()
        cases: list[tuple[dict[str, str], str, int]] = [
            ({"Sec-WebSocket-Key": "bad"}, "/ws", 400),
            ({"Sec-WebSocket-Version": "12"}, "/ws", 426),
            ({"Upgrade": ""}, "/ws", 426),
            ({f"X-H{i}": "v" for i in range(30)}, "/ws", 431),
            ({}, "/elsewhere", 404),
        ]
        for headers, path, status in cases:
            c = await RawClient.connect(lb.port, path=path, headers=headers)
            assert c.status == status, (headers, path)
            c.close()
        # Three held connections from this address, then 429.
        held = [await asyncio.open_connection("127.0.0.1", lb.port) for _ in range(3)]
        c = await RawClient.connect(lb.port)
        assert c.status == 429
        for r, wr in held:  # the held ones time out their handshake (408)
            assert (await asyncio.wait_for(r.read(), 10)).startswith(b"HTTP/1.1 408")
            wr.close()
        assert connections() == before
    finally:
        lb.stop()
        w.stop()
