"""Parking on the engine bridge (``backends.park``), on a real ``llama-server`` (Gemma 3 270M
on the CPU, ``tests/engines.py``), with the test as wslb: the leg dropped without a close frame
mid-answer, the session parks on the bridge while the engine's stream goes on, and a reattach
from the client's count continues the answer, every chunk once and in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tests.engines import EngineSetupError, LlamaServer, gemma_gguf, llama_server
from tests.procs import WORKER_AUTH
from tests.test_bridge import STORY, BridgeProc, read_answer, recv
from tests.test_park import DIGEST, drop, park_header, reattach, until

pytestmark = pytest.mark.engine  # the real llama-server: -m 'not engine' skips

TOKENS = 120
DROP_AFTER = 10  # chunks the client has when the leg drops
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BridgeProc]:
    try:
        llama_server(), gemma_gguf()  # built and cached once per machine
    except EngineSetupError as e:
        pytest.skip(f"the engine cannot be made here: {e}")
    engine = LlamaServer(tmp_path_factory.mktemp("park") / "llama.log", parallel=1, threads=1)
    engine.start()
    try:
        b = BridgeProc(engine.url, "park-bridge", "--temperature", "0")
        try:
            b.wait_health(200, timeout=30)
            yield b
            assert "Traceback" not in b.output(), b.output()
        finally:
            b.stop()
    finally:
        engine.stop()


async def test_bridge_reattach_continues_the_engine_answer(bridge: BridgeProc) -> None:
    sid = "park-bridge-1"
    w = bridge
    headers = {**WORKER_AUTH, "X-Session-Id": sid, "X-WSLB-Park": park_header(token=DIGEST)}
    ws = await connect(bridge.ws, additional_headers=headers, open_timeout=10)
    assert ws.response is not None and ws.response.headers["X-WSLB-Park"] == "ok"
    got: list[dict[str, Any]] = [await recv(ws, 10)]
    assert got[0]["type"] == "hello"
    await ws.send(json.dumps({"type": "prompt", "text": STORY, "max_tokens": TOKENS}))
    tokens: list[dict[str, Any]] = []
    while len(tokens) < DROP_AFTER:
        msg = await recv(ws, TIMEOUT)
        assert msg["type"] == "token" and msg["i"] == len(tokens), msg
        tokens.append(msg)
    drop(ws)
    await until(w, "wslb_worker_parked_sessions", lambda v: v == 1, timeout=10)
    again = await reattach(w, sid, 1 + len(tokens))
    tokens, done = await read_answer(again, 1, tokens)  # every i once and in order
    assert len(tokens) > DROP_AFTER and done["tokens"] <= TOKENS, done
    # The conversation goes on, with the whole first answer in it.
    await again.send(json.dumps({"type": "prompt", "text": "Give it a name.", "max_tokens": 8}))
    more, done2 = await read_answer(again, 2)
    assert more and done2["turn"] == 2
    await again.close()
    await until(w, "wslb_worker_reattaches_total:resumed", lambda v: v == 1)
