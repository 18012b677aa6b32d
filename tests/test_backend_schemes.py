"""Backend URLs as a user writes them: ``http://`` and ``https://`` beside ``ws://`` and ``wss://``.

A pool in front of HTTP servers names them ``http://host:port``, as nginx's ``proxy_pass`` does;
the scheme says only whether wslb speaks TLS to the server (``https``/``wss``, with the pool's
``upstream_tls``). The same server gets plain requests and WebSocket upgrades, health checks and
metrics scrapes. Tested with ``wslb check``, the reference worker behind wslb (the ``openai``
SDK streaming a chat completion, aiohttp, ``websockets``), a worker behind an mTLS terminator,
and ``POST /backends``. Real sockets on loopback; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
import yaml
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from balancer.backend import Upstream
from balancer.config import BackendCfg
from tests.procs import ROOT, Worker, Wslb, pool_config, running
from tests.test_worker_auth import tls_front

TIMEOUT = 10.0


# -- the one rule: which schemes mean TLS ------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secure", "port"),
    [
        ("ws://h:9001", False, 9001),
        ("http://h:9001", False, 9001),
        ("http://h", False, 80),
        ("HTTP://h/v1", False, 80),
        ("wss://h", True, 443),
        ("https://h", True, 443),
        ("https://h:8443/x", True, 8443),
    ],
)
def test_http_is_ws_and_https_is_wss(url: str, secure: bool, port: int) -> None:
    cfg = BackendCfg(id="b", url=url)
    up = Upstream.parse(url)
    assert (cfg.secure, cfg.port, up.secure, up.port) == (secure, port, secure, port)


def test_a_path_means_the_same_for_http_and_ws() -> None:
    for scheme in ("ws", "http"):
        assert Upstream.parse(f"{scheme}://10.0.0.5:9001").path is None
        assert Upstream.parse(f"{scheme}://10.0.0.5:9001/ws?m=1").path == "/ws?m=1"


# -- wslb check -----------------------------------------------------------------------------------


def check(tmp_path: Path, urls: list[str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "b.yaml"
    backends = [{"id": f"b{i}", "url": u} for i, u in enumerate(urls)]
    path.write_text(yaml.safe_dump(pool_config(backends)))
    return subprocess.run(
        [sys.executable, "-m", "balancer", "check", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_accepts_http_and_https_backends(tmp_path: Path) -> None:
    urls = ["http://10.0.0.5:8000", "https://llm.example/v1", "ws://10.0.0.6:9001", "wss://h"]
    done = check(tmp_path, urls)
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


def test_check_still_refuses_other_schemes_by_yaml_path(tmp_path: Path) -> None:
    done = check(tmp_path, ["http://10.0.0.5:8000", "ftp://10.0.0.5:21", "http:10.0.0.7", "h:1"])
    assert done.returncode == 2
    errors = done.stderr
    want = "is not a ws://, wss://, http:// or https:// URL"
    assert f"pools[0].backends[1].url: 'ftp://10.0.0.5:21' {want}" in errors, errors
    assert f"pools[0].backends[2].url: 'http:10.0.0.7' {want}" in errors, errors
    assert f"pools[0].backends[3].url: 'h:1' {want}" in errors, errors
    assert "backends[0]" not in errors, errors


def test_check_refuses_an_http_url_that_is_wslb_itself(tmp_path: Path) -> None:
    path = tmp_path / "self.yaml"
    cfg = pool_config([{"id": "me", "url": "http://127.0.0.1:18080"}])
    cfg["listen"] = "127.0.0.1:18080"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "balancer", "check", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "pools[0].backends[0].url: 'http://127.0.0.1:18080' is wslb's own" in done.stderr


# -- a pool of http:// backends ----------------------------------------------------------------


def backends_of(lb: Wslb) -> dict[str, dict[str, Any]]:
    return {b["id"]: b for b in lb.admin("/backends")}


def wait_scraped(lb: Wslb, ids: list[str], timeout: float = TIMEOUT) -> dict[str, dict[str, Any]]:
    """Until every backend in ``ids`` is active with signals from a scrape; the listing."""
    deadline = time.monotonic() + timeout
    while True:
        listing = backends_of(lb)
        if all(
            listing.get(i, {}).get("state") == "active" and listing[i].get("signals") for i in ids
        ):
            return listing
        if time.monotonic() > deadline:
            raise TimeoutError(f"not active and scraped after {timeout:g}s: {listing}")
        time.sleep(0.05)


async def chat_over_sdk(base: str, sid: str) -> str:
    """One streamed chat completion through the ``openai`` SDK; its text."""
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    async with client:
        stream = await client.chat.completions.create(
            model="wslb-reference",
            messages=[{"role": "user", "content": "over http"}],
            max_tokens=3,
            stream=True,
            extra_headers={"X-Session-Id": sid},
        )
        text = ""
        async with asyncio.timeout(TIMEOUT):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        return text


async def hello_over_ws(url: str, sid: str, ssl_ctx: ssl.SSLContext | None = None) -> str:
    """The worker that says hello on a WebSocket to ``url``/ws for ``sid``."""
    async with asyncio.timeout(TIMEOUT), connect(f"{url}/ws?session={sid}", ssl=ssl_ctx) as ws:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello", hello
        return str(hello["worker"])


async def test_http_backends_serve_plain_requests_and_websockets(tmp_path: Path) -> None:
    """Three reference workers named ``http://127.0.0.1:PORT`` (path-less): HTTP health checks
    and scrapes make them active with signals; the SDK streams a chat completion, aiohttp gets
    ``/v1/models``, and a WebSocket upgrade on the same URL reaches a worker."""
    workers = [Worker(f"h{i}").start() for i in range(3)]
    cfg = pool_config(
        [{"id": w.id, "url": f"http://127.0.0.1:{w.port}"} for w in workers],
        balance="consistent",
        health={"path": "/healthz", "interval": "0.2s", "rise": 1},
        weights={"scrape_interval": "0.2s"},
    )
    lb = Wslb(cfg, tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(lb.start)
        await asyncio.to_thread(wait_scraped, lb, [w.id for w in workers])
        base = f"http://127.0.0.1:{lb.port}"
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(TIMEOUT)) as resp,
        ):
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["wslb-reference"]
        for n in range(6):
            sid = f"plain-{n}"
            text = await chat_over_sdk(base, sid)
            assert len(text.split()) == 3, text
            assert await hello_over_ws(lb.url, sid) in {w.id for w in workers}
        line = 'wslb_http_requests_total{code="200",kind="sse",pool="chat"} 6.0'
        deadline = time.monotonic() + TIMEOUT  # counted as each exchange ends
        while line not in (metrics := await asyncio.to_thread(lb.admin, "/metrics")):
            assert time.monotonic() < deadline, metrics
            await asyncio.sleep(0.05)


async def test_post_backends_takes_an_http_url(tmp_path: Path) -> None:
    """``POST /backends`` with ``http://``: 201, then active and serving; an ``ftp://`` URL is
    a 400 naming the field."""
    first, added = Worker("p0").start(), Worker("p1").start()
    cfg = pool_config(
        [{"id": "p0", "url": f"http://127.0.0.1:{first.port}"}],
        health={"path": "/healthz", "interval": "0.2s", "rise": 1},
    )
    lb = Wslb(cfg, tmp_path)
    with running(first, added, lb):
        await asyncio.to_thread(lb.start)
        url = f"http://127.0.0.1:{added.port}"
        answer = await asyncio.to_thread(lb.admin_post, "/backends", {"id": "p1", "url": url})
        assert answer["id"] == "p1"
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(
                lb.admin_post, "/backends", {"id": "p2", "url": "ftp://127.0.0.1:1"}
            )
        assert refused.value.code == 400
        body = json.loads(refused.value.read())
        assert (
            "url: 'ftp://127.0.0.1:1' is not a ws://, wss://, http:// or https://"
            in (body["error"])
        ), body
        await asyncio.to_thread(lb.wait_ready)
        assert backends_of(lb)["p1"]["url"] == url
        await asyncio.to_thread(lb.admin_post, "/backends/p0/drain", {"migrate": False})
        assert await hello_over_ws(lb.url, "after-add") == "p1"


# -- an https:// backend --------------------------------------------------------------------------


async def test_an_https_backend_gets_tls_with_the_pools_upstream_tls(tmp_path: Path) -> None:
    """A worker behind an mTLS terminator with a private CA, named ``https://``: wslb's plain
    requests, WebSocket upgrades, HTTP health checks and scrapes go over TLS with the pool's CA
    and client certificate (probes and scrapes used the system trust and no certificate, so
    such a worker never came up with ``health.path``)."""
    worker_ca, client_ca = trustme.CA(), trustme.CA()
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    worker_ca.issue_cert("127.0.0.1").configure_cert(sctx)
    client_ca.configure_trust(sctx)
    sctx.verify_mode = ssl.CERT_REQUIRED
    worker_ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    mine = client_ca.issue_cert("wslb")
    mine.cert_chain_pems[0].write_to_path(str(tmp_path / "client.crt"))
    mine.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    plain = Worker("tls-h").start()
    with running(plain):
        async with tls_front(sctx, plain.port) as port:
            cfg = pool_config(
                [{"id": "tls-h", "url": f"https://127.0.0.1:{port}"}],
                upstream_tls={
                    "ca": str(tmp_path / "ca.pem"),
                    "cert": str(tmp_path / "client.crt"),
                    "key": str(tmp_path / "client.key"),
                },
                health={"path": "/healthz", "interval": "0.2s", "rise": 1},
                weights={"scrape_interval": "0.2s"},
            )
            lb = Wslb(cfg, tmp_path)
            await asyncio.to_thread(lb.start)
            try:
                await asyncio.to_thread(wait_scraped, lb, ["tls-h"])
                base = f"http://127.0.0.1:{lb.port}"
                assert len((await chat_over_sdk(base, "secure")).split()) == 3
                assert await hello_over_ws(lb.url, "secure") == "tls-h"
            finally:
                await asyncio.to_thread(lb.stop)
