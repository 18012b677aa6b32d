"""The Responses API's WebSocket mode with the real engine: two ``llama-server`` (Gemma 3 270M on
the CPU, ``tests/engines.py``), an engine bridge in front of each, wslb in front of the bridges
(path-less backend URLs: ``/v1/responses`` reaches the bridges; failover on), the official
``openai`` SDK as the client (``client.responses.connect()``).

A drain of the busy bridge moves its responses mid-stream (the bridge's freeze, the other
bridge's continuation of the final assistant message); ``kill -9`` of a session's bridge or of
its llama-server mid-response fails it over from wslb's journal. Either way each client sees one
response: every delta once, the deltas joined are its text, one terminal event, no reconnect,
and the chain (``previous_response_id``) goes on. Each test gets a fresh set of processes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_bridge import STORY
from tests.test_engine_failover import Stack, bridged_stack
from tests.test_responses import Got, answer, client, whole

pytestmark = pytest.mark.engine  # the real llama-server: -m 'not engine' skips

MODEL = "gemma-3-270m"
TIMEOUT = 60.0  # one response from a CPU engine, at most


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    # 4 slots: a drained engine's sessions all fit on the other one.
    with bridged_stack(tmp_path, parallel=4) as s:
        yield s


async def test_a_drain_of_the_busy_bridge_keeps_every_response_whole(stack: Stack) -> None:
    """3 SDK sessions: a first turn, then a chained second one that streams while the bridge
    holding most of them is drained with migration."""
    lb = stack.lb
    reconnects: list[Any] = []
    started = [asyncio.Event() for _ in range(3)]
    second_done: dict[int, float] = {}
    ended_on: dict[int, str] = {}

    async def one(i: int) -> tuple[Got, Got, Got]:
        async with client(lb.port).responses.connect(
            extra_query={"session": f"er-drain-{i}"},
            on_reconnecting=lambda e: reconnects.append(e) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await conn.response.create(
                model=MODEL, input="Name three colours of the rainbow.", max_output_tokens=16
            )
            first = await answer(conn, timeout=TIMEOUT)
            await conn.response.create(
                model=MODEL,
                input=f"Now write a short story about dragon number {i}.",
                previous_response_id=first.id,
                max_output_tokens=64,
            )
            second = await answer(conn, timeout=TIMEOUT, streaming=started[i])
            second_done[i] = time.monotonic()
            await conn.response.create(
                model=MODEL,
                input="Give the dragon a name.",
                previous_response_id=second.id,
                max_output_tokens=8,
            )
            third = await answer(conn, timeout=TIMEOUT)
            view = await asyncio.to_thread(lb.admin, f"/sessions/er-drain-{i}")
            ended_on[i] = view["backend"]
            return first, second, third

    tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 2 * TIMEOUT)
        sessions = [s for s in lb.admin("/sessions") if s["id"].startswith("er-drain-")]
        held = [s["backend"] for s in sessions]
        victim = max(set(held), key=held.count)
        on_victim = [int(s["id"].rsplit("-", 1)[1]) for s in sessions if s["backend"] == victim]
        drained_at = time.monotonic()
        lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "30s"})
        results = await asyncio.wait_for(asyncio.gather(*tasks), 3 * TIMEOUT)
    except Exception as e:
        raise AssertionError(f"{e!r}\n{stack.logs()}") from e
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for i, (first, second, third) in enumerate(results):
        for got in (first, second, third):
            whole(got)
        assert second.end.response.previous_response_id == first.id
        assert third.end.response.previous_response_id == second.id
        # Each prompt began with the turns before it: the engine's prompt cache held them.
        # (A session moved to the other engine finds a cold cache there: no check.)
        if i not in on_victim:
            assert second.cached > 0 and third.cached > 0, (i, second.end, third.end)
    assert not reconnects, reconnects
    drain = lb.admin(f"/backends/{victim}")["drain"]
    assert drain["migrated"] >= 1 and drain["migration_failures"] == 0, drain
    assert all(ended_on[i] != victim for i in on_victim), (ended_on, victim)
    # At least one moved response was still streaming when the drain began.
    assert any(second_done[i] > drained_at for i in on_victim), (second_done, drained_at)


@pytest.mark.parametrize("what", ["bridge", "engine"])
async def test_a_response_survives_a_kill(stack: Stack, what: str) -> None:
    """``kill -9`` of the session's bridge (or of its llama-server: the bridge then drops the
    connection) mid-response: wslb resumes it on the other bridge from its journal."""
    lb = stack.lb
    sid = f"er-kill-{what}"
    reconnects: list[Any] = []
    streaming = asyncio.Event()
    async with client(lb.port).responses.connect(
        extra_query={"session": sid},
        on_reconnecting=lambda e: reconnects.append(e) or None,  # type: ignore[func-returns-value]
    ) as conn:
        await conn.response.create(model=MODEL, input="Say hello.", max_output_tokens=8)
        first = await answer(conn, timeout=TIMEOUT)
        await conn.response.create(
            model=MODEL, input=STORY, previous_response_id=first.id, max_output_tokens=120
        )
        reading = asyncio.ensure_future(answer(conn, timeout=TIMEOUT, streaming=streaming))
        try:
            await asyncio.wait_for(streaming.wait(), TIMEOUT)
            await asyncio.sleep(0.3)  # a few more deltas
            backend = lb.admin(f"/sessions/{sid}")["backend"]
            n = stack.index(backend)
            if what == "engine":
                stack.engines[n].kill()
            else:
                stack.bridges[n].proc.send_signal(signal.SIGKILL)
                stack.bridges[n].proc.wait(10)
            got = await reading
        except Exception as e:
            reading.cancel()
            raise AssertionError(f"{e!r}\n{stack.logs()}") from e
        await conn.response.create(
            model=MODEL, input="Give it a name.", previous_response_id=got.id, max_output_tokens=8
        )
        third = await answer(conn, timeout=TIMEOUT)
        view = lb.admin(f"/sessions/{sid}")
    for g in (first, got, third):
        whole(g)
    # Usage counts the engines' tokens and a delta may carry more than one (llama-server, for
    # one, holds back a token that ends inside a UTF-8 character). Seen once after a kill: 120
    # tokens, 115 deltas, the cause not pinned down. Never fewer tokens than deltas, never more
    # than were allowed.
    assert len(got.deltas) <= got.end.response.usage.output_tokens <= 120, got.end
    assert third.end.response.previous_response_id == got.id
    assert not reconnects, reconnects
    assert view["backend"] != backend and view["failover"]["failovers"] == 1, view
