"""Path forwarding: a backend URL without a path sends the client's path and query on.

The worker is a stock ``websockets`` server that answers with the request target it was asked
for, so what wslb sent is read off the wire, not off wslb's own bookkeeping.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from balancer.handshake import ClientRequest
from balancer.pool import Upstream
from tests.procs import Wslb, free_port, stop, wait_port

TARGET_SERVER = """
import asyncio, json, sys
from websockets.asyncio.server import serve

async def tell(ws):
    await ws.send(json.dumps({"target": ws.request.path,
                              "xff": ws.request.headers.get("X-Forwarded-For")}))
    async for _ in ws:
        pass

async def main():
    async with serve(tell, "127.0.0.1", int(sys.argv[1])):
        await asyncio.Future()

asyncio.run(main())
"""


def test_upstream_urls() -> None:
    assert Upstream.parse("ws://10.0.0.5:9001").path is None  # forward the client's
    assert Upstream.parse("ws://10.0.0.5:9001/").path == "/"
    assert Upstream.parse("ws://10.0.0.5:9001/ws").path == "/ws"
    assert Upstream.parse("ws://h:1?x=1").path == "/?x=1"
    assert Upstream.parse("wss://h/chat?x=1") == Upstream("h", 443, "/chat?x=1", True)


def test_a_resumed_leg_keeps_the_path_and_forwarded_for() -> None:
    req = ClientRequest(
        "/v1/realtime?model=m",
        "/v1/realtime",
        "model=m",
        [(b"x-forwarded-for", b"203.0.113.7"), (b"cookie", b"a=b")],
        b"k",
        [],
        "h",
    )
    kept = req.forwarded_for("10.0.0.2").for_resume()
    assert (kept.path, kept.query) == ("/v1/realtime", "model=m")
    assert kept.header(b"x-forwarded-for") == b"203.0.113.7, 10.0.0.2"


@pytest.fixture
def target_server() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", TARGET_SERVER, str(port)])
    wait_port(port, proc=proc)
    yield port
    stop(proc)


async def test_path_less_and_path_urls(target_server: int, tmp_path: Path) -> None:
    cfg = {
        "pools": [
            {
                "name": "fixed",
                "match": {"path_prefix": "/fixed"},
                "backends": [{"id": "f", "url": f"ws://127.0.0.1:{target_server}/chat"}],
            },
            {
                "name": "any",
                "backends": [{"id": "a", "url": f"ws://127.0.0.1:{target_server}"}],
            },
        ]
    }
    lb = Wslb(cfg, tmp_path).start()
    try:
        for asked, seen in (
            ("/ws/chat?session=s1&x=%20y", "/ws/chat?session=s1&x=%20y"),
            ("/v1/realtime?model=gemma", "/v1/realtime?model=gemma"),
            ("/", "/"),
            ("/fixed/anything?session=s2", "/chat?session=s2"),
        ):
            async with connect(lb.url + asked) as ws:
                got = json.loads(await ws.recv())
                assert got["target"] == seen, asked
                assert got["xff"] == "127.0.0.1"
    finally:
        lb.stop()
