"""Crash failover with the real engine: two ``llama-server`` (Gemma 3 270M on the CPU,
``tests/engines.py``), an engine bridge in front of each, wslb in front of the bridges with
``failover: {enabled: true}``, configured as a user would (path-less backend URLs, the bridges'
``/healthz`` as the health check).

Mid-answer, ``kill -9`` of the session's llama-server (its bridge then drops the session's
connection without a close: ``--engine-lost drop``, the default) or of the session's bridge:
wslb resumes the answer on the other bridge from its journal, and the client sees one answer,
every chunk once and in order, one ``done``, no close and no error. Each test gets a fresh set
of processes (it kills one of them); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tests.engines import EngineSetupError, LlamaServer, gemma_gguf, llama_server
from tests.procs import Wslb, pool_config
from tests.test_bridge import STORY, BridgeProc, read_answer, recv
from tests.test_realtime import answer, client, next_event, say

pytestmark = pytest.mark.engine  # the real llama-server: -m 'not engine' skips

MODEL = "gemma-3-270m"
TOKENS = 120  # the answer asked for: ~3 s at one CPU thread's ~50 tokens/s
KILL_AFTER = 10  # chunks the client has when the kill comes
TIMEOUT = 60.0


@dataclass
class Stack:
    engines: list[LlamaServer]
    bridges: list[BridgeProc]
    lb: Wslb

    def engine_of(self, backend: str) -> LlamaServer:
        return self.engines[self.index(backend)]

    def bridge_of(self, backend: str) -> BridgeProc:
        return self.bridges[self.index(backend)]

    def index(self, backend: str) -> int:
        return [b.id for b in self.bridges].index(backend)

    def logs(self) -> str:
        parts = [f"--- wslb\n{self.lb.log_tail(40)}"]
        parts += [f"--- {b.id}\n{b.output()[-3000:]}" for b in self.bridges]
        return "\n".join(parts)


@contextlib.contextmanager
def bridged_stack(tmp_path: Path, parallel: int) -> Iterator[Stack]:
    """Two llama-servers (``parallel`` slots each), a bridge before each, and wslb before
    both with failover on: what a user of the engine bridge runs on one host."""
    try:
        llama_server(), gemma_gguf()  # built and cached once per machine
    except EngineSetupError as e:
        pytest.skip(f"the engine cannot be made here: {e}")
    with contextlib.ExitStack() as stop:
        engines: list[LlamaServer] = []
        for i in range(2):
            engine = LlamaServer(tmp_path / f"llama-{i}.log", parallel=parallel, threads=1)
            engines.append(engine.start())
            stop.callback(engine.stop)
        bridges: list[BridgeProc] = []
        for i, engine in enumerate(engines):
            bridge = BridgeProc(engine.url, f"llama-{i}", "--temperature", "0")
            stop.callback(bridge.stop)
            bridges.append(bridge)
        for bridge in bridges:
            bridge.wait_health(200, timeout=30)
        # What a user writes: path-less URLs (/ws and /v1/realtime both reach the bridge).
        backends = [{"id": b.id, "url": f"ws://127.0.0.1:{b.port}"} for b in bridges]
        cfg = pool_config(
            backends,
            health={"path": "/healthz", "interval": "0.2s", "timeout": "1s"},
            failover={"enabled": True},
        )
        cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
        lb = Wslb(cfg, tmp_path, name="wslb")
        stop.callback(lb.stop)
        lb.start(wait_ready=False)
        lb.wait_ready(timeout=20)
        yield Stack(engines, bridges, lb)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with bridged_stack(tmp_path, parallel=2) as s:
        yield s


def kill(stack: Stack, backend: str, what: str) -> None:
    """``kill -9`` of the engine or the bridge behind ``backend``."""
    if what == "engine":
        stack.engine_of(backend).kill()
    else:
        bridge = stack.bridge_of(backend)
        bridge.proc.send_signal(signal.SIGKILL)
        bridge.proc.wait(10)


def logs(stack: Stack) -> str:
    parts = [f"--- wslb\n{stack.lb.log_tail(40)}"]
    parts += [f"--- {b.id}\n{b.output()[-3000:]}" for b in stack.bridges]
    return "\n".join(parts)


@pytest.mark.parametrize("what", ["engine", "bridge"])
async def test_chat_answer_continues_after_a_kill(stack: Stack, what: str) -> None:
    """A: the session's llama-server killed mid-answer; B: its bridge killed."""
    lb = stack.lb
    sid = f"efo-{what}"
    async with connect(f"{lb.url}/ws?session={sid}", open_timeout=10) as ws:
        hello = await recv(ws, 10)
        assert hello["type"] == "hello" and hello["session"] == sid, hello
        first = hello["worker"]
        prompt = {"type": "prompt", "text": STORY, "max_tokens": TOKENS, "temperature": 0}
        await ws.send(json.dumps(prompt))
        tokens: list[dict[str, Any]] = []
        while len(tokens) < KILL_AFTER:
            msg = await recv(ws)
            assert msg["type"] == "token" and msg["i"] == len(tokens), msg
            tokens.append(msg)
        backend = lb.admin(f"/sessions/{sid}")["backend"]
        assert backend == first
        killed_at = time.monotonic()
        kill(stack, backend, what)
        try:
            # Every chunk once and in order (read_answer checks i), only tokens, then one done.
            tokens, done = await read_answer(ws, 1, tokens)
        except Exception as e:
            raise AssertionError(f"{e!r}\n{logs(stack)}") from e
        pause = time.monotonic() - killed_at
        other = next(b.id for b in stack.bridges if b.id != backend)
        assert done["worker"] == other, done
        assert len(tokens) > KILL_AFTER, "nothing after the failover"
        assert done["tokens"] == len(tokens) <= TOKENS, (done, len(tokens))
        with contextlib.suppress(TimeoutError):
            extra = await asyncio.wait_for(ws.recv(), 0.3)
            raise AssertionError(f"after done: {extra!r}")
        view = lb.admin(f"/sessions/{sid}")
        assert view["backend"] == other, view
        assert view["failover"]["failovers"] == 1, (view, logs(stack))
        # The conversation goes on where it is now, with the first answer in it.
        await ws.send(json.dumps({"type": "prompt", "text": "Give it a name.", "max_tokens": 8}))
        more, done2 = await read_answer(ws, 2)
        assert more and done2["worker"] == other, done2
        assert ws.close_code is None  # no close, no reconnect
    print(f"\n{what} killed after {KILL_AFTER} chunks: answer of {len(tokens)} in {pause:.2f} s")
    output = lb.output()
    assert f"session {sid}: worker {backend} lost; resumed on {other}" in output, output
    if what == "engine":
        dead = stack.bridge_of(backend)
        assert f"engine lost mid-answer on session {sid}" in dead.output(), dead.output()
        assert dead.wait_health(503, timeout=5)["status"] == "engine down"
    # wslb takes the dead one out of service either way (health checks, or the probe).
    listing = {b["id"]: b for b in lb.admin("/backends")}
    deadline = time.monotonic() + 5
    while listing[backend]["healthy"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        listing = {b["id"]: b for b in lb.admin("/backends")}
    assert not listing[backend]["healthy"], listing[backend]


@pytest.mark.parametrize("what", ["bridge", "engine"])
async def test_realtime_sdk_response_survives_a_kill(stack: Stack, what: str) -> None:
    """C: the official ``openai`` SDK's Realtime session; the bridge (or its engine) killed
    mid-response: one ``response.done``, the deltas joined are the done text, no reconnect."""
    lb = stack.lb
    sid = f"efo-rt-{what}"
    reconnects: list[Any] = []
    streaming = asyncio.Event()

    def on_reconnecting(event: Any) -> None:
        reconnects.append(event)

    async with client(lb.port).realtime.connect(
        model=MODEL, extra_query={"session": sid}, on_reconnecting=on_reconnecting
    ) as conn:
        await next_event(conn, "session.created", timeout=10)
        await say(conn, STORY)
        await conn.response.create(response={"max_output_tokens": TOKENS})
        reading = asyncio.ensure_future(answer(conn, timeout=TIMEOUT, streaming=streaming))
        try:
            await asyncio.wait_for(streaming.wait(), TIMEOUT)
            await asyncio.sleep(0.2)  # a few more deltas
            backend = lb.admin(f"/sessions/{sid}")["backend"]
            kill(stack, backend, what)
            got = await reading
        except Exception as e:
            reading.cancel()
            raise AssertionError(f"{e!r}\n{logs(stack)}") from e
        await say(conn, "Give it a name.")
        await conn.response.create(response={"max_output_tokens": 8})
        second = await answer(conn, timeout=TIMEOUT)
        view = lb.admin(f"/sessions/{sid}")
    assert not got.errors, (got.errors, logs(stack))
    assert got.types.count("response.done") == 1, got.types
    assert got.types.count("session.created") == 0, got.types
    assert got.deltas and "".join(got.deltas) == got.text, (got.deltas, got.text)
    assert got.status in ("completed", "incomplete"), got.done
    # Usage counts the engines' tokens and a delta may carry more than one (as in
    # test_engine_responses' kill test, where 120 tokens came in 115 deltas once).
    assert len(got.deltas) <= got.done.response.usage.output_tokens <= TOKENS, got.done
    assert not reconnects, reconnects
    assert not second.errors and second.types.count("response.done") == 1, second.types
    assert view["backend"] != backend and view["failover"]["failovers"] == 1, view
