"""The Responses API's WebSocket mode through wslb, with the official ``openai`` SDK as the client.

``AsyncOpenAI(base_url="http://WSLB/v1").responses.connect(extra_query={"session": SID})`` opens
``ws://WSLB/v1/responses?session=SID``. The system is the repo's own ``balancer.yaml`` (three
spawned reference workers, failover on) on free ports: its path-less backend URLs forward
``/v1/responses`` to the workers, which serve the protocol there. Each turn is a
``response.create`` with only the new input and the ``previous_response_id`` it continues.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.resources.responses.responses import AsyncResponsesConnection
from websockets.exceptions import InvalidStatus

from tests.procs import ROOT, Worker, Wslb
from tests.test_failover import default_system, failovers, worker_proc

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class Got:
    """What a client saw of one response."""

    deltas: list[str] = field(default_factory=list)
    text: str | None = None  # response.output_text.done
    end: Any = None  # the terminal event
    errors: list[Any] = field(default_factory=list)
    types: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.end.response.status)

    @property
    def id(self) -> str:
        return str(self.end.response.id)

    @property
    def cached(self) -> int:
        return int(self.end.response.usage.input_tokens_details.cached_tokens)


def client(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")


async def answer(
    conn: AsyncResponsesConnection, timeout: float = 30.0, streaming: asyncio.Event | None = None
) -> Got:
    """Events until the response's terminal event; ``streaming`` is set at the first delta."""
    got = Got()

    async def read() -> None:
        async for event in conn:
            got.types.append(event.type)
            if event.type == "response.output_text.delta":
                got.deltas.append(event.delta)
                if streaming is not None:
                    streaming.set()
            elif event.type == "response.output_text.done":
                got.text = event.text
            elif event.type == "error":
                got.errors.append(event.error)
            elif event.type in TERMINAL:
                got.end = event
                return

    await asyncio.wait_for(read(), timeout)
    return got


async def next_event(conn: AsyncResponsesConnection, timeout: float = 10.0) -> Any:
    async def read() -> Any:
        async for event in conn:
            return event
        return None

    return await asyncio.wait_for(read(), timeout)


def whole(got: Got) -> None:
    """One response, unbroken: no error, one terminal event, the deltas joined are its text."""
    assert not got.errors, got.errors
    assert sum(got.types.count(t) for t in TERMINAL) == 1, got.types
    assert got.types.count("response.created") == 1, got.types
    assert got.deltas and "".join(got.deltas) == got.text, (got.deltas, got.text)
    assert got.end.response.output[0].content[0].text == got.text
    assert got.status in ("completed", "incomplete"), got.end


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Wslb]:
    lb, _ = default_system(tmp_path, timeouts={"shutdown_grace": "0.1s"})
    yield lb
    lb.stop()


async def test_two_turns_chained_by_previous_response_id(system: Wslb) -> None:
    async with client(system.port).responses.connect(extra_query={"session": "r-two"}) as conn:
        await conn.response.create(model="wslb-reference", input="hello there", store=False)
        first = await answer(conn)
        await conn.response.create(
            input=[{"role": "user", "content": [{"type": "input_text", "text": "tell me more"}]}],
            previous_response_id=first.id,
            max_output_tokens=5,
        )
        second = await answer(conn)
    for got in (first, second):
        whole(got)
    assert first.status == "completed" and first.end.response.model == "wslb-reference"
    assert second.status == "incomplete" and len(second.deltas) == 5
    assert second.end.response.incomplete_details.reason == "max_output_tokens"
    assert second.end.response.previous_response_id == first.id != second.id
    # The second turn's context began with the first turn's: the worker's KV cache held it.
    assert first.cached == 0 and second.cached > 0, second.end.response.usage


async def test_every_error_is_one_error_event_and_the_socket_stays_usable(system: Wslb) -> None:
    async with client(system.port).responses.connect(extra_query={"session": "r-err"}) as conn:
        await conn.response.create(input="a long answer please", max_output_tokens=100)
        # A second response while one runs: an error; the first goes on, whole.
        await conn.response.create(input="and another")
        running = await answer(conn, timeout=30)
        assert [e.code for e in running.errors] == ["conversation_already_has_active_response"]
        running.errors.clear()
        whole(running)
        bad: list[tuple[dict[str, Any] | str, str]] = [
            ({"type": "response.create", "input": "x", "previous_response_id": "resp_nope"},
             "previous_response_not_found"),
            ({"type": "response.create", "input": "x",
              "tools": [{"type": "function", "name": "f", "parameters": {}}]},
             "unsupported_feature"),
            ({"type": "response.create", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
             "unsupported_feature"),
            ({"type": "response.create",
              "input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]},
             "unsupported_feature"),
            ({"type": "response.steer", "previous_response_id": running.id, "input": "faster"},
             "unsupported_feature"),
            ({"type": "response.create", "input": "x", "max_output_tokens": 0}, "invalid_value"),
            ({"type": "response.cancel"}, "invalid_value"),
            ("{not json", "invalid_json"),
        ]  # fmt: skip
        for event, code in bad:
            await conn.send_raw(event if isinstance(event, str) else json.dumps(event))
            err = await next_event(conn)
            assert err.type == "error" and err.error.code == code, (event, err)
            assert err.status == 400 and err.error.message
        await conn.send_raw(b"\x00binary")
        assert (await next_event(conn)).type == "error"
        # Still usable, and the conversation is where it was: the last response continues.
        await conn.response.create(input="still there?", previous_response_id=running.id)
        again = await answer(conn)
    whole(again)
    assert again.status == "completed" and again.cached > 0


async def test_a_reconnect_continues_the_held_conversation(system: Wslb) -> None:
    """A new connection with the same session key lands on the worker that holds the last
    response, so ``previous_response_id`` still resolves (as the SDK's own reconnect does)."""
    async with client(system.port).responses.connect(extra_query={"session": "r-back"}) as conn:
        await conn.response.create(input="remember the number seven")
        first = await answer(conn)
    async with client(system.port).responses.connect(extra_query={"session": "r-back"}) as conn:
        await conn.response.create(input="which number was it", previous_response_id=first.id)
        second = await answer(conn)
    whole(first)
    whole(second)
    assert second.cached > 0


async def test_a_drain_under_six_streaming_sessions_keeps_every_response_whole(
    system: Wslb,
) -> None:
    lb = system
    reconnects: list[int] = []
    started = [asyncio.Event() for _ in range(6)]

    async def one(i: int) -> tuple[Got, Got]:
        async with client(lb.port).responses.connect(
            extra_query={"session": f"r-drain-{i}"},
            on_reconnecting=lambda e: reconnects.append(e.close_code) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await conn.response.create(input=f"question number {i}", max_output_tokens=120)
            got = await answer(conn, timeout=60, streaming=started[i])
            # The chain goes on from the worker the session moved to.
            await conn.response.create(input="and then?", previous_response_id=got.id)
            return got, await answer(conn, timeout=30)

    tasks = [asyncio.ensure_future(one(i)) for i in range(6)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    sessions = [s for s in lb.admin("/sessions") if s["id"].startswith("r-drain-")]
    held = [s["backend"] for s in sessions]
    victim = max(set(held), key=held.count)
    lb.admin_post(f"/backends/{victim}/drain", {})
    results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    for got, then in results:
        whole(got)
        whole(then)
        assert got.status == "incomplete" and len(got.deltas) == 120
        assert then.cached > 0  # the moved conversation's KV prefix came along
    assert not reconnects  # the SDK never saw a close
    drain = lb.admin(f"/backends/{victim}")["drain"]
    assert drain["migrated"] >= 1 and drain["migration_failures"] == 0, drain
    lb.admin_post(f"/backends/{victim}/undrain", {})


async def test_kill_9_mid_response_fails_over_from_the_journal(system: Wslb) -> None:
    lb = system
    reconnects: list[int] = []
    started = [asyncio.Event() for _ in range(4)]

    async def one(n: int) -> tuple[Got, Got, Got]:
        async with client(lb.port).responses.connect(
            extra_query={"session": f"r-fo-{n}"},
            on_reconnecting=lambda e: reconnects.append(e.close_code) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await conn.response.create(input="first question", instructions="Be brief.")
            first = await answer(conn)
            await conn.response.create(
                input="a longer second question",
                previous_response_id=first.id,
                max_output_tokens=150,
            )
            second = await answer(conn, timeout=60, streaming=started[n])
            await conn.response.create(
                input="third", previous_response_id=second.id, max_output_tokens=5
            )
            third = await answer(conn)
            return first, second, third

    tasks = [asyncio.ensure_future(one(n)) for n in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    await asyncio.sleep(0.3)
    victim = lb.admin("/sessions/r-fo-0")["backend"]
    on_victim = [s["id"] for s in lb.admin("/sessions") if s["backend"] == victim]
    worker_proc(lb, victim).send_signal(signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    for first, second, third in results:
        for got in (first, second, third):
            whole(got)
        assert second.status == "incomplete" and len(second.deltas) == 150
        assert second.end.response.previous_response_id == first.id
        assert third.status == "incomplete" and len(third.deltas) == 5
        assert third.end.response.previous_response_id == second.id
    assert not reconnects  # the SDK never saw a close
    assert failovers(lb)["resumed"] == len(on_victim), lb.log_tail()


async def test_pools_match_the_model_query_parameter(tmp_path: Path) -> None:
    """The SDK sends no ``?model=`` for the Responses API (the model is in each event);
    ``extra_query`` adds it, and pools match it as for Realtime."""
    g, q = Worker("gemma-w").start(), Worker("qwen-w").start()
    pools = [
        {
            "name": name,
            "match": {"path_prefix": "/v1/responses", "model": name},
            "backends": [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"}],
        }
        for name, w in (("gemma", g), ("qwen", q))
    ]
    lb = Wslb({"pools": pools}, tmp_path).start()
    try:
        for model, worker in (("gemma", g.id), ("qwen", q.id)):
            async with client(lb.port).responses.connect(
                extra_query={"model": model, "session": f"r-{model}"}
            ) as conn:
                await conn.response.create(input="which worker are you")
                got = await answer(conn)
                (s,) = lb.admin("/sessions")
                assert s["backend"] == worker
            whole(got)
            assert got.end.response.model == model  # the ?model= is the session's default
        with pytest.raises(InvalidStatus) as refused:
            async with client(lb.port).responses.connect(extra_query={"model": "llama"}) as conn:
                await conn.recv()
        assert refused.value.response.status_code == 404
        assert json.loads(refused.value.response.body)["models"] == ["gemma", "qwen"]
    finally:
        lb.stop()
        g.stop()
        q.stop()


def test_the_example_client(system: Wslb) -> None:
    base = f"http://127.0.0.1:{system.port}/v1"
    out = subprocess.run(
        [sys.executable, "examples/responses_client.py", "--base-url", base,
         "--session", "r-example", "hello there", "tell me more"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[completed; cached input tokens:") == 2, out.stdout
    assert "> tell me more" in out.stdout
    cached = [
        int(line.rsplit(" ", 1)[1].rstrip("]"))
        for line in out.stdout.splitlines()
        if "[completed" in line
    ]
    assert cached[0] == 0 and cached[1] > 0, out.stdout


async def test_the_bridge_maps_responses_onto_chat_completions() -> None:
    """The engine bridge in front of a fake OpenAI-compatible engine: the engine gets the
    response's conversation (instructions first, the continued turns, the new input) and its
    options; an engine failure is ``response.failed``, and the last good response can still be
    continued."""
    from tests.procs import WORKER_AUTH
    from tests.test_bridge import abridges, fake_engine

    async with fake_engine() as fake, abridges(fake.url, "bridge-r") as (b,):
        await b.health(200)
        async with client(b.port).responses.connect(
            extra_query={"session": "r-bridge"}, extra_headers=WORKER_AUTH
        ) as conn:
            await conn.response.create(input="one", instructions="Be brief.", temperature=0.5)
            first = await answer(conn)
            assert fake.requests[-1]["messages"] == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "one"},
            ]
            assert fake.requests[-1]["temperature"] == 0.5
            fake.mode = "500"
            await conn.response.create(input="two", previous_response_id=first.id)
            failed = await answer(conn)
            fake.mode = "ok"
            await conn.response.create(
                input="two again", previous_response_id=first.id, max_output_tokens=3
            )
            third = await answer(conn)
    whole(first)
    assert first.text == "Hello there!" and first.end.response.model == "fake"
    assert first.end.response.usage.input_tokens == 5
    assert failed.status == "failed" and not failed.errors
    assert failed.end.response.error.message == "engine: HTTP 500: out of memory"
    assert fake.requests[-1]["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "two again"},
    ]
    assert fake.requests[-1]["max_tokens"] == 3
    assert third.types.count("response.created") == 1 and third.text
