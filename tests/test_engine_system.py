"""The whole stack with the real engine: two ``llama-server`` (Gemma 3 270M on the CPU,
``tests/engines.py``), an engine bridge in front of each, wslb in front of the bridges.

The clients are the official ``openai`` SDK speaking the OpenAI Realtime protocol through wslb
(path-less backend URLs: ``/v1/realtime`` reaches the bridges). wslb checks the bridges'
``/healthz`` and scrapes each engine's own ``/metrics`` (``metrics_url``, the ``llamacpp``
preset). One set of processes serves the module; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.engines import LlamaServer
from tests.procs import Wslb, pool_config
from tests.test_bridge import BridgeProc
from tests.test_realtime import Answer, answer, client, next_event, say

pytestmark = pytest.mark.engine  # the real llama-server: -m 'not engine' skips

MODEL = "gemma-3-270m"
TIMEOUT = 60.0  # one response from a CPU engine, at most


@dataclass
class Stack:
    engines: list[LlamaServer]
    bridges: list[BridgeProc]
    lb: Wslb

    def engine_of(self, backend: str) -> LlamaServer:
        return self.engines[[b.id for b in self.bridges].index(backend)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("engine-system")
    with contextlib.ExitStack() as stop:
        engines: list[LlamaServer] = []
        for i in range(2):
            # 4 slots: a drained engine's sessions all fit on the other one.
            engine = LlamaServer(parallel=4, ctx=4096, threads=1, name=f"llama-{i}")
            engines.append(engine.start())
            stop.callback(engine.stop)
        bridges: list[BridgeProc] = []
        for i, engine in enumerate(engines):
            bridge = BridgeProc(engine.url, f"llama-{i}", "--temperature", "0")
            stop.callback(bridge.stop)
            bridges.append(bridge)
        for bridge in bridges:
            bridge.wait_health(200, timeout=30)
        backends = [
            {"id": b.id, "url": f"ws://127.0.0.1:{b.port}", "metrics_url": f"{e.url}/metrics"}
            for b, e in zip(bridges, engines, strict=True)
        ]
        cfg = pool_config(
            backends,
            health={"path": "/healthz", "interval": "0.2s", "timeout": "1s"},
            weights={"metrics": "llamacpp", "scrape_interval": "0.5s"},
        )
        cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
        lb = Wslb(cfg, tmp, name="wslb")
        stop.callback(lb.stop)
        lb.start(wait_ready=False)
        lb.wait_ready(timeout=20)
        yield Stack(engines, bridges, lb)


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check()`` every 0.1 s until it is truthy (returned); ``AssertionError`` naming
    ``what`` and the last value after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:g}s (last {last!r})")
        time.sleep(0.1)


def whole(got: Answer) -> None:
    """One response, unbroken: no error, one ``response.done``, the deltas joined the text."""
    assert not got.errors, got.errors
    assert got.types.count("response.done") == 1, got.types
    assert got.deltas and "".join(got.deltas) == got.text, (got.deltas, got.text)
    assert got.status in ("completed", "incomplete"), got.done


async def test_two_turns_with_the_openai_sdk_reuse_the_engines_prompt_cache(stack: Stack) -> None:
    lb = stack.lb
    sid = "es-two-turns"
    async with client(lb.port).realtime.connect(model=MODEL, extra_query={"session": sid}) as conn:
        created = await next_event(conn, "session.created", timeout=10)
        assert created.session.type == "realtime"
        await say(conn, "Name three colours of the rainbow.")
        await conn.response.create(response={"max_output_tokens": 24})
        first = await answer(conn, timeout=TIMEOUT)
        (s1,) = [s for s in lb.admin("/sessions") if s["id"] == sid]
        await say(conn, "And one more colour?")
        await conn.response.create(response={"max_output_tokens": 16})
        second = await answer(conn, timeout=TIMEOUT)
        (s2,) = [s for s in lb.admin("/sessions") if s["id"] == sid]
    for got in (first, second):
        whole(got)
        if got.status == "incomplete":
            assert got.done.response.status_details.reason == "max_output_tokens"
    assert s1["backend"] == s2["backend"]
    # The second prompt began with the first turn's: the engine's prompt cache held it.
    assert second.done.response.usage.input_token_details.cached_tokens > 0, second.done


async def test_a_drain_of_the_busy_bridge_keeps_every_response_whole(stack: Stack) -> None:
    """3 SDK sessions stream; the bridge holding most of them is drained with migration: each
    client sees one unbroken response, and the SDK never reconnects."""
    lb = stack.lb
    reconnects: list[Any] = []
    started = [asyncio.Event() for _ in range(3)]
    release = asyncio.Event()  # the connections stay open until the drain is over
    done_at: dict[int, float] = {}

    def on_reconnecting(event: Any) -> None:
        reconnects.append(event)

    async def one(i: int) -> Answer:
        async with client(lb.port).realtime.connect(
            model=MODEL,
            extra_query={"session": f"es-drain-{i}"},
            on_reconnecting=on_reconnecting,
        ) as conn:
            await next_event(conn, "session.created", timeout=10)
            await say(conn, f"Write a short story about dragon number {i}.")
            await conn.response.create(response={"max_output_tokens": 48})
            got = await answer(conn, timeout=TIMEOUT, streaming=started[i])
            done_at[i] = time.monotonic()
            await asyncio.wait_for(release.wait(), TIMEOUT)
            return got

    tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT)
        sessions = [s for s in lb.admin("/sessions") if s["id"].startswith("es-drain-")]
        assert len(sessions) == 3, sessions
        held = [s["backend"] for s in sessions]
        victim = max(set(held), key=held.count)
        on_victim = [int(s["id"].rsplit("-", 1)[1]) for s in sessions if s["backend"] == victim]
        drained_at = time.monotonic()
        lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "30s"})

        def finished() -> Any:
            drain = lb.admin(f"/backends/{victim}")["drain"]
            return drain if drain and drain["finished"] is not None else None

        drain = await asyncio.to_thread(until, finished, TIMEOUT, f"the drain of {victim}")
        after = {s["id"]: s["backend"] for s in lb.admin("/sessions")}
        release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    finally:
        release.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for b in stack.bridges:  # back to active for any later test
            with contextlib.suppress(Exception):
                lb.admin_post(f"/backends/{b.id}/undrain", {})
    for got in results:
        whole(got)
        assert got.types.count("session.created") == 0  # no new connection: no close
    assert not reconnects, reconnects
    assert drain["migrated"] >= 1 and drain["migration_failures"] == 0, drain
    assert drain["left"] == 0, drain
    # The victim's sessions live on the other bridge now, and one of them at least was still
    # answering when the drain began: its response moved mid-stream.
    assert all(after[f"es-drain-{i}"] != victim for i in on_victim), (after, victim)
    assert any(done_at[i] > drained_at for i in on_victim), (done_at, drained_at, on_victim)


def test_wslb_scrapes_the_engines_load_signals(stack: Stack) -> None:
    lb = stack.lb

    def scraped() -> Any:
        listing = lb.admin("/backends")
        ok = len(listing) == 2 and all(
            not b["signals_stale"] and {"running", "waiting"} <= set(b["signals"]) for b in listing
        )
        return listing if ok else None

    listing = until(scraped, 10, "llamacpp signals for both backends")
    for b in listing:
        assert b["signals"]["running"] >= 0 and b["signals"]["waiting"] >= 0, b
        assert b["signals_age"] is not None and b["signals_age"] < 5, b
    # What wslb read is the engine's own gauge, not the bridge's.
    for engine in stack.engines:
        assert "llamacpp:requests_processing" in engine.metrics()
