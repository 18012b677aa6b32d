"""A burst of wss:// connects (every client reconnecting at once) is admitted, not convoyed:
each handshake completes, none waits out wslb's handshake timeout (``aio/tls.py``)."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections import Counter
from pathlib import Path

import trustme
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from balancer.aio.tls import HANDSHAKES, HOLD, Admission
from tests.procs import Worker, Wslb, free_port, pool_config, running

BURST = 300


def test_admission_takes_slots_in_arrival_order() -> None:
    adm: Admission[str] = Admission(2)
    assert adm.arrive("a") and adm.arrive("b")
    assert not adm.arrive("c") and not adm.arrive("d")
    assert adm.release() == "c"  # a's slot goes to the first waiting
    assert adm.release() == "d"
    assert adm.running == 2 and not adm.waiting
    assert adm.release() is None and adm.release() is None
    assert adm.running == 0
    assert adm.arrive("e")
    adm.waiting.append("f")
    assert not adm.arrive("g")  # a free slot, but others wait first: no overtaking
    assert list(adm.waiting) == ["f", "g"]


def tls_stack(tmp_path: Path, handshake: str = "10s") -> tuple[Wslb, Worker, ssl.SSLContext]:
    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    cert = tmp_path / "edge.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    worker = Worker("w1", ["--tokens-per-s", "20"])
    port = free_port()
    cfg = pool_config([{"id": "w1", "url": worker.url}], health={"enabled": False})
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": {"cert": str(cert), "key": str(cert)}}]
    cfg["timeouts"] = {"handshake": handshake}
    lb = Wslb(cfg, tmp_path)
    lb.port = port
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return lb, worker, ctx


def tls_failures(lb: Wslb) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in re.finditer(
        r'^wslb_tls_handshake_failures_total\{reason="([^"]+)"\} (\S+)$', lb.admin("/metrics"), re.M
    ):
        out[m.group(1)] += int(float(m.group(2)))
    return out


async def ready(url: str, ctx: ssl.SSLContext) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            async with connect(url, ssl=ctx, open_timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_burst_of_wss_connects_all_upgrade(tmp_path: Path) -> None:
    """``BURST`` connects at once from this one process, each then streaming tokens: every one
    gets its 101 (or an immediate 503, which a client retries), and wslb counts no handshake
    that waited out its timeout."""
    lb, worker, ctx = tls_stack(tmp_path)
    url = f"wss://127.0.0.1:{lb.port}/ws"
    outcomes: Counter[str] = Counter()
    conns: list[ClientConnection] = []

    async def one(i: int) -> None:
        try:
            ws = await connect(f"{url}?session=b{i}", ssl=ctx, open_timeout=60)
        except InvalidStatus as exc:
            outcomes[f"status {exc.response.status_code}"] += 1
            return
        conns.append(ws)
        await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 2}))
        while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] != "done":
            pass
        outcomes["101"] += 1

    with running(worker.start(), lb):
        lb.start(wait_ready=False)
        await ready(url, ctx)
        before = tls_failures(lb)["timeout"]
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(BURST))), 90)
        finally:
            await asyncio.gather(*(ws.close() for ws in conns))
        assert set(outcomes) <= {"101", "status 503"}, outcomes
        assert outcomes["101"] + outcomes["status 503"] == BURST
        assert tls_failures(lb)["timeout"] == before, lb.output()[-2000:]


async def test_silent_connects_do_not_hold_the_handshakes(tmp_path: Path) -> None:
    """More TCP connects than there are handshake slots, each sending nothing: a real client
    behind them still gets its handshake after ``HOLD`` seconds, long before the silent ones
    time out (each with its own handshake timeout)."""
    lb, worker, ctx = tls_stack(tmp_path, handshake="20s")
    url = f"wss://127.0.0.1:{lb.port}/ws"
    with running(worker.start(), lb):
        lb.start(wait_ready=False)
        await ready(url, ctx)
        silent = [await asyncio.open_connection("127.0.0.1", lb.port) for _ in range(HANDSHAKES)]
        try:
            async with connect(url, ssl=ctx, open_timeout=5 + 2 * HOLD) as ws:
                await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 1}))
                assert json.loads(await ws.recv())["type"] in ("hello", "token")
        finally:
            for _, writer in silent:
                writer.close()
        assert tls_failures(lb)["timeout"] == 0
