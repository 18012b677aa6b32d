"""Active health checks: TCP by default, HTTP with a path, and why a backend is down.

The servers probed are aiohttp apps written with no thought of wslb (no health route, a
redirect, a 503), and a closed port.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from balancer.aio.health import HealthChecker, ProbeResult
from balancer.config import BackendCfg, HealthCfg, PoolCfg
from balancer.pool import Backend, Pool
from tests.procs import ROOT, Wslb, free_port, pool_config, stop, wait_port
from tests.test_http_proxy import metric
from tests.waits import until


def pool_for(port: int, path: str | None) -> Pool:
    cfg = PoolCfg(
        "p",
        health=HealthCfg(timeout=0.5, path=path),
        backends=(BackendCfg("b", f"ws://127.0.0.1:{port}"),),
    )
    return Pool(cfg)


@pytest.fixture
async def site() -> AsyncIterator[int]:
    """An app with a redirect and a 503 "draining", but no /healthz."""

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async def draining(request: web.Request) -> web.Response:
        return web.json_response({"status": "draining"}, status=503)

    app = web.Application()
    app.router.add_get("/moved", moved)
    app.router.add_get("/stopping", draining)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


async def probe(port: int, path: str | None) -> ProbeResult | None:
    pool = pool_for(port, path)
    async with aiohttp.ClientSession() as http:
        checker = HealthChecker(http, lambda b, ok, d: None)
        return await checker.check(pool, pool.backends["b"])


async def test_tcp_probe_needs_no_route(site: int) -> None:
    assert await probe(site, None) == ProbeResult(True)
    closed = free_port()
    assert await probe(closed, None) == ProbeResult(False, False, "connect refused", "refused")


async def test_http_probe_reasons(site: int) -> None:
    assert await probe(site, "/healthz") == ProbeResult(
        False, False, "GET /healthz -> 404", "http_status"
    )
    assert await probe(site, "/moved") == ProbeResult(True)  # 3xx is up, not followed
    assert await probe(site, "/stopping") == ProbeResult(
        False, True, "GET /stopping -> 503 (draining)", "http_status"
    )
    assert await probe(free_port(), "/healthz") == ProbeResult(
        False, False, "GET /healthz: connect refused", "refused"
    )


def seen(b: Backend) -> tuple[str, str | None, str | None, float | None]:
    return b.state, b.health_reason, b.health_kind, b.health_since


def test_the_reason_is_kept_while_down() -> None:
    b = Backend(BackendCfg("b", "ws://h:1"))
    assert not b.probe(False, 2, 3, "connect refused", "refused", at=100.0)
    assert seen(b) == ("active", None, None, None) and b.last_check == 100.0
    assert not b.probe(False, 2, 3, "connect refused", "refused", at=102.0)
    assert b.probe(False, 2, 3, "GET /healthz -> 500", "http_status", at=104.0)
    assert seen(b) == ("down", "GET /healthz -> 500", "http_status", 104.0)
    assert not b.probe(True, 2, 3, at=106.0)  # one success: still down, reason kept
    assert seen(b) == ("down", "GET /healthz -> 500", "http_status", 104.0)
    assert b.probe(True, 2, 3, at=108.0)
    assert seen(b) == ("active", None, None, 108.0)
    assert b.set_health(False, "worker process exited with 1", "process", at=110.0)
    assert seen(b) == ("down", "worker process exited with 1", "process", 110.0)


def ctl(lb: Wslb, *args: str) -> subprocess.CompletedProcess[str]:
    admin = f"http://127.0.0.1:{lb.admin_port}"
    cmd = [sys.executable, "-m", "balancer", "ctl", "--admin", admin, *args]
    return subprocess.run(cmd, cwd=ROOT, env=lb.env, capture_output=True, text=True, timeout=30)


def echo_server(port: int) -> subprocess.Popen[bytes]:
    """A stock ``websockets`` echo server: no health route, no /metrics."""
    code = (
        "import asyncio, sys\n"
        "from websockets.asyncio.server import serve\n"
        "async def echo(ws):\n"
        "    async for m in ws:\n"
        "        await ws.send(m)\n"
        "async def main():\n"
        "    async with serve(echo, '127.0.0.1', int(sys.argv[1])):\n"
        "        await asyncio.Future()\n"
        "asyncio.run(main())\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(port)])


async def test_a_dead_backend_says_why_everywhere(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    servers = [echo_server(p) for p in ports]
    for p, s in zip(ports, servers, strict=True):
        wait_port(p, proc=s)
    cfg = pool_config(
        [{"id": f"e{i}", "url": f"ws://127.0.0.1:{p}"} for i, p in enumerate(ports)],
        health={"interval": "0.2s", "fall": 2},
    )
    lb = Wslb(cfg, tmp_path).start()
    try:
        (first,) = [b for b in lb.admin("/backends") if b["id"] == "e0"]
        assert first["health"]["ok"] and first["health"]["reason"] is None
        assert first["health"]["last_check"] is not None
        stop(servers[0])
        for _ in range(100):
            e0 = lb.admin("/backends/e0")
            if e0["state"] == "down":
                break
            await asyncio.sleep(0.05)
        assert e0["state"] == "down" and e0["health"]["ok"] is False
        assert e0["health"]["reason"] == "connect refused"
        assert e0["health"]["since"] >= e0["health"]["last_check"] - 1.0
        metrics = lb.admin("/metrics")
        assert 'wslb_backend_down{backend="e0",pool="chat",reason="refused"} 1.0' in metrics
        assert 'wslb_backend_down{backend="e1"' not in metrics
        assert "backend e0 is down: connect refused (2 checks failed in a row" in lb.output()
        out = ctl(lb, "backends")
        assert out.returncode == 0, out.stderr
        (row,) = [line for line in out.stdout.splitlines() if line.startswith("e0 ")]
        assert row.split()[1] == "down" and row.endswith("connect refused")
        # A server without /metrics: one line per backend, however many scrapes failed.
        await until(
            lambda: metric(lb, "wslb_scrape_failures_total", backend="e1") >= 3,
            20,
            "three failed scrapes of e1",
        )
        assert lb.output().count("no load signals") == 2, lb.output()
    finally:
        lb.stop()
        for s in servers:
            stop(s)
