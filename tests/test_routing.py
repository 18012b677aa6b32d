"""Load-aware routing end to end: scraped load, stale scrapes, health checks, ejection."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from tests.procs import Worker, Wslb, free_port, pool_config

FAST = {"ping_interval": "30s", "close": "1s", "shutdown_grace": "0.1s"}


async def wait_for(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def open_sessions(
    url: str, prefix: str, n: int
) -> tuple[list[ClientConnection], Counter[str]]:
    conns, where = [], Counter[str]()
    for i in range(n):
        ws = await connect(f"{url}/ws?session={prefix}-{i}")
        where[json.loads(await ws.recv())["worker"]] += 1
        conns.append(ws)
    return conns, where


async def test_hot_worker_gets_fewer_sessions_and_stale_falls_back(tmp_path: Path) -> None:
    hot = Worker("hot", ["--background-util", "0.9"]).start()
    cold = [Worker(f"cold{i}").start() for i in range(2)]
    dead_metrics = f"http://127.0.0.1:{free_port()}/metrics"
    backends = [{"id": w.id, "url": w.url} for w in [hot, *cold]]
    backends.append({"id": "blind", "url": cold[0].url, "metrics_url": dead_metrics})
    cfg = pool_config(
        backends,
        hash_balance_factor=1.25,
        weights={
            "scrape_interval": "0.2s",
            "stale_after": "1s",
            "coefficients": {"gpu": 0.9, "kv_cache": 0.5, "queue": 0.25},
        },
    )
    cfg["timeouts"] = FAST
    lb = Wslb(cfg, tmp_path).start()
    conns: list[ClientConnection] = []
    try:
        await wait_for(
            lambda: all(
                not b["signals_stale"] for b in lb.admin("/backends") if b["id"] != "blind"
            ),
            what="first scrapes",
        )
        views = {b["id"]: b for b in lb.admin("/backends")}
        assert views["hot"]["signals"]["gpu_util"] >= 0.9
        assert views["hot"]["effective_weight"] < 0.25
        # Below its peers' median / overload_ratio: its returning keys get the c bound too.
        assert [b for b, v in views.items() if v["overloaded"]] == ["hot"]
        # The backend whose metrics endpoint is dead: stale, static weight, still routable.
        assert views["blind"]["signals_stale"] and views["blind"]["effective_weight"] == 1.0
        assert views["blind"]["state"] == "active"
        conns, _ = await open_sessions(lb.url, "load", 60)
        live = {b["id"]: b["sessions"] for b in lb.admin("/backends")}
        # Bound: ceil(1.25 x 60 x 0.19 / 3.19) = 5, far below its ring share of 1/4.
        assert live["hot"] <= 5, live
        assert min(live["cold0"], live["cold1"]) > 2 * live["hot"], live
        metrics = lb.admin("/metrics")
        assert 'wslb_backend_signals_stale{backend="blind",pool="chat"} 1.0' in metrics
        assert 'wslb_scrape_failures_total{backend="blind",pool="chat"}' in metrics
        assert 'wslb_backend_gpu_utilization_ratio{backend="hot",pool="chat"}' in metrics
        assert 'wslb_backend_overloaded{backend="hot",pool="chat"} 1.0' in metrics
        assert 'wslb_backend_overloaded{backend="cold0",pool="chat"} 0.0' in metrics
    finally:
        for ws in conns:
            await ws.close()
        lb.stop()
        for w in [hot, *cold]:
            w.stop()


async def test_a_slow_decoder_gets_fewer_sessions_from_its_inter_token_latency(
    tmp_path: Path,
) -> None:
    """Every other signal off: the worker that decodes 10x slower is seen by its scraped
    inter-token latency alone, and takes a small share of the next sessions. (10x, so that a
    busy machine's loop lag, which slows the fast workers' gaps most, cannot blur it.)"""
    args = ["--max-batch", "64", "--prefill-ms-per-token", "0"]
    slow = Worker("slow", ["--tokens-per-s", "10", *args]).start()
    fast = [Worker(f"fast{i}", ["--tokens-per-s", "100", *args]).start() for i in range(2)]
    cfg = pool_config(
        [{"id": w.id, "url": w.url} for w in [slow, *fast]],
        hash_balance_factor=1.25,
        weights={
            "scrape_interval": "0.2s",
            "smoothing": "0s",
            "coefficients": {"gpu": 0, "kv_cache": 0, "queue": 0, "tpot": 1.0},
        },
    )
    cfg["timeouts"] = FAST
    lb = Wslb(cfg, tmp_path).start()
    conns: list[ClientConnection] = []
    try:
        await wait_for(
            lambda: all(not b["signals_stale"] for b in lb.admin("/backends")),
            what="first scrapes",
        )
        warm, where = await open_sessions(lb.url, "warm", 9)
        assert set(where) == {"slow", "fast0", "fast1"}, where  # equal weights: each has some
        for ws in warm:
            await ws.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": 6}))
        for ws in warm:
            while json.loads(await ws.recv())["type"] != "done":
                pass
            await ws.close()

        def views() -> dict[str, Any]:
            return {b["id"]: b for b in lb.admin("/backends")}

        await wait_for(
            lambda: all(v["signals"]["tpot"] for v in views().values()), what="tpot scraped"
        )
        v = views()
        assert 0.09 < v["slow"]["signals"]["tpot"] < 0.2, v["slow"]["signals"]
        assert all(0.009 < v[f]["signals"]["tpot"] < 0.04 for f in ("fast0", "fast1")), v
        # 1/10 of the median speed, less the 15% noise band.
        assert v["slow"]["effective_weight"] < 0.4 * v["fast0"]["effective_weight"], v
        assert v["fast0"]["effective_weight"] == v["fast1"]["effective_weight"] == 1.0
        conns, where = await open_sessions(lb.url, "next", 60)
        assert where["slow"] < 0.5 * min(where["fast0"], where["fast1"]), where
        metrics = lb.admin("/metrics")
        assert 'wslb_backend_tpot_seconds{backend="slow",pool="chat"}' in metrics
    finally:
        for ws in conns:
            await ws.close()
        lb.stop()
        for w in [slow, *fast]:
            w.stop()


async def hello_worker(url: str, key: str) -> str:
    """Open the key's session, read the worker's hello, close (a turn of a client that opens a
    connection per turn)."""
    async with connect(f"{url}/ws?session={key}") as ws:
        return str(json.loads(await ws.recv())["worker"])


@pytest.mark.parametrize("ceiling", [None, 1.25])
async def test_conversations_stay_on_their_workers_when_a_worker_joins(
    tmp_path: Path, ceiling: float | None
) -> None:
    """A new user's config (backends only). 30 conversations between turns hold their places,
    13 of them on w0 (its bound, ceil(1.25 x 30 / 3)); a fourth worker joins and every bound
    shrinks (w0's to 10). w0 is not overloaded, so its conversations come back to it, above the
    bound, and new keys that hash to w0 go elsewhere. With ``affinity_ceiling: 1.25`` (the
    strict bound, the rule before) some of them are pushed off to a cold KV cache."""
    from balancer.ring import Ring

    workers = [Worker(f"w{i}").start() for i in range(4)]
    backends = [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers[:3]]
    # Plain bounded-load placement (``choices: 1``), so that w0 fills to its bound as before.
    pool = {
        "placement": {"choices": 1},
        **({} if ceiling is None else {"affinity_ceiling": ceiling}),
    }
    cfg = pool_config(backends, **pool)
    lb = Wslb(cfg, tmp_path).start()
    try:
        three = Ring({w.id: 1.0 for w in workers[:3]})
        four = Ring({w.id: 1.0 for w in workers})
        names = (f"chat-{i}" for i in range(10_000))
        own = [k for k in names if three.owner(k) == "w0" == four.owner(k)][:20]
        rest = [k for k in (f"rest-{i}" for i in range(1000)) if three.owner(k) != "w0"][:10]
        order = [k for t in zip(own[::2], own[1::2], rest, strict=True) for k in t]
        first = {k: await hello_worker(lb.url, k) for k in order}
        on_w0 = [k for k in own if first[k] == "w0"]

        def counted() -> dict[str, int]:
            return {b["id"]: b["sessions"] + b["held"] for b in lb.admin("/backends")}

        await wait_for(lambda: sum(counted().values()) == 30, what="sessions held")
        assert len(on_w0) == 13 == counted()["w0"], counted()
        w3 = workers[3]
        lb.admin_post("/backends", {"id": w3.id, "url": f"ws://127.0.0.1:{w3.port}"})
        await wait_for(lambda: lb.admin("/backends/w3")["state"] == "active", what="w3 active")
        again = {k: await hello_worker(lb.url, k) for k in on_w0}
        moved = [k for k in on_w0 if again[k] != "w0"]
        if ceiling is None:
            assert moved == [], again
            assert counted()["w0"] == 13  # above its bound of ceil(1.25 x 30 / 4) = 10
            fresh = [k for k in (f"new-{i}" for i in range(1000)) if four.owner(k) == "w0"][:3]
            assert "w0" not in [await hello_worker(lb.url, k) for k in fresh]
        else:
            assert len(moved) >= 3, again  # w0's places gave way down to its bound
    finally:
        lb.stop()
        for w in workers:
            w.stop()


class Toggle:
    """A websockets worker whose /healthz answers 200 or 503 on demand."""

    def __init__(self, wid: str) -> None:
        self.id = wid
        self.port = free_port()
        self.healthy = True
        self.sessions = 0

    def process_request(self, conn: ServerConnection, req: Request) -> Response | None:
        if req.path == "/healthz":
            status = HTTPStatus.OK if self.healthy else HTTPStatus.SERVICE_UNAVAILABLE
            return conn.respond(status, "ok\n" if self.healthy else "sick\n")
        if req.path == "/metrics":
            return conn.respond(HTTPStatus.NOT_FOUND, "")
        return None

    async def handler(self, ws: ServerConnection) -> None:
        self.sessions += 1
        await ws.send(json.dumps({"type": "hello", "worker": self.id}))
        async for _ in ws:
            pass


@pytest.fixture
async def toggles() -> AsyncIterator[list[Toggle]]:
    ts = [Toggle(f"t{i}") for i in range(3)]
    servers = [
        await serve(t.handler, "127.0.0.1", t.port, process_request=t.process_request) for t in ts
    ]
    yield ts
    for s in servers:
        s.close()
        await s.wait_closed()


async def hello(url: str, key: str) -> str:
    async with connect(f"{url}/ws?session={key}") as ws:
        return str(json.loads(await ws.recv())["worker"])


async def test_health_fall_and_rise_keep_affinity(toggles: list[Toggle], tmp_path: Path) -> None:
    cfg = pool_config(
        [{"id": t.id, "url": f"ws://127.0.0.1:{t.port}/ws"} for t in toggles],
        health={"interval": "0.1s", "timeout": "0.5s", "rise": 2, "fall": 3, "path": "/healthz"},
        # Ring order only: the 30 keys' held places would otherwise bring the bound (and the
        # placement's lighter candidate) in.
        hash_balance_factor=100,
        placement={"choices": 1},
    )
    cfg["timeouts"] = FAST
    lb = Wslb(cfg, tmp_path).start()
    try:
        keys = [f"h{i}" for i in range(30)]
        before = {k: await hello(lb.url, k) for k in keys}
        assert len(set(before.values())) == 3
        sick = toggles[0]
        sick.healthy = False
        await wait_for(lambda: lb.admin(f"/backends/{sick.id}")["state"] == "down", 5, "down")
        failures = lb.admin(f"/backends/{sick.id}")
        assert not failures["healthy"]
        during = {k: await hello(lb.url, k) for k in keys}
        assert sick.id not in during.values()
        # Keys of the healthy workers did not move.
        assert all(during[k] == w for k, w in before.items() if w != sick.id)
        sick.healthy = True
        await wait_for(lambda: lb.admin(f"/backends/{sick.id}")["state"] == "active", 5, "up")
        after = {k: await hello(lb.url, k) for k in keys}
        assert after == before  # its keys came back (ring points were skipped, not removed)
        assert 'wslb_health_check_failures_total{backend="t0",pool="chat"}' in lb.admin("/metrics")
    finally:
        lb.stop()


async def test_repeated_connect_failures_eject_and_ejection_grows(
    toggles: list[Toggle], tmp_path: Path
) -> None:
    dead = free_port()
    cfg = pool_config(
        [{"id": "dead", "url": f"ws://127.0.0.1:{dead}/ws"}]
        + [{"id": t.id, "url": f"ws://127.0.0.1:{t.port}/ws"} for t in toggles],
        health={"enabled": False},
        outlier={"consecutive_failures": 2, "base_ejection_time": "1s", "max_ejection_time": "10s"},
    )
    cfg["timeouts"] = FAST
    lb = Wslb(cfg, tmp_path).start()
    try:
        i = 0

        async def eject(limit: int) -> tuple[dict[str, Any], float]:
            """Connect until "dead" is ejected; its view, and the most time since the ejection.

            ``ejected_for`` is what is left of the ejection: the time the last connect and the
            admin read took (long on a loaded machine) is added back before comparing.
            """
            nonlocal i
            while i < limit:
                t0 = time.monotonic()
                await hello(lb.url, f"e{i}")  # keys owned by "dead" walk on to the next worker
                i += 1
                view = lb.admin("/backends/dead")
                if view["state"] == "ejected":
                    return view, time.monotonic() - t0
            raise AssertionError(f"dead not ejected after {limit} connects")

        first, _ = await eject(200)
        assert 0 < first["ejected_for"] <= 1.0
        assert first["ejections"] == 1
        await wait_for(lambda: lb.admin("/backends/dead")["state"] == "active", 3, "return")
        second, since = await eject(400)
        assert second["ejections"] == 2
        assert second["ejected_for"] + since > 1.0 and second["ejected_for"] <= 2.0
        ejections = 'wslb_backend_ejections_total{backend="dead",pool="chat"} 2.0'
        assert ejections in lb.admin("/metrics")
    finally:
        lb.stop()


async def test_a_probe_that_times_out_while_wslb_lags_counts_neither_way() -> None:
    """Health probes share the relay's loop: a saturated wslb must not mark workers down."""
    import aiohttp

    from balancer.aio.health import HealthChecker
    from balancer.aio.loops import LagMeter
    from balancer.config import BackendCfg, HealthCfg, PoolCfg
    from balancer.pool import Pool

    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await done.wait()  # accepts, never answers
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = PoolCfg(
        name="p",
        health=HealthCfg(timeout=0.3, path="/healthz"),
        backends=(BackendCfg(id="w", url=f"ws://127.0.0.1:{port}/ws"),),
    )
    pool = Pool(cfg)
    lag = LagMeter(asyncio.get_running_loop())
    lag.start()
    async with aiohttp.ClientSession() as http:
        checker = HealthChecker(http, lambda b, ok, d: None, lag)
        backend = pool.backends["w"]
        real = await checker.check(pool, backend)  # a real timeout
        assert real is not None and (real.ok, real.draining) == (False, False)
        assert (real.reason, real.kind) == ("GET /healthz: timeout after 0.3s", "timeout")

        async def busy() -> None:
            await asyncio.sleep(0.05)
            time.sleep(0.4)  # noqa: ASYNC251 (wslb saturated: the loop runs nothing else)

        hog = asyncio.ensure_future(busy())
        assert await checker.check(pool, backend) is None  # inconclusive, not a failure
        await hog
        assert checker.inconclusive == 1
    lag.stop()
    done.set()
    await asyncio.sleep(0.05)  # the handlers close their connections
    server.close()
    await server.wait_closed()
