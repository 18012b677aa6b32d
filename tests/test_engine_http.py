"""The engine bridge's OpenAI HTTP API (SPEC section 16): ``GET /v1/models`` and ``POST
/v1/chat/completions`` proxied to the engine as they stream, ``POST /v1/responses`` the
bridge's own Responses session over the engine's chat completions (the WebSocket mode's events,
``previous_response_id`` and cached tokens on every engine).

Against two real ``llama-server``s (Gemma 3 270M on the CPU, ``tests/engines.py``) with a bridge
before each and wslb before both (``test_engine_failover.bridged_stack``), with the official
``openai`` SDK as the client: each bridge directly, then through wslb's listener (the same
session key twice reaches the same engine, whose prefix cache answers the follow-up). Against a
fake engine (``test_bridge.FakeEngine``) for what a real one does not do on demand: a slow
stream, an HTTP error, a cut mid-body, a port nobody listens on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from bench.lib.wslb import prom_by_label
from tests.procs import WORKER_AUTH, free_port
from tests.test_bridge import FAST, FLOOD, abridges, fake_engine, metrics, until
from tests.test_engine_failover import Stack, bridged_stack

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
TIMEOUT = 60.0  # one answer from a CPU engine, at most
STORY = "Write two sentences about a lighthouse keeper who finds a message in a bottle."
HTTPPROXY = importlib.util.find_spec("balancer.aio.httpproxy") is not None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the module: nothing here kills a process."""
    with bridged_stack(tmp_path_factory.mktemp("engine-http"), parallel=2) as s:
        yield s


def sdk(base: str, headers: dict[str, str] | None = None) -> AsyncOpenAI:
    """The official client on ``base``; ``headers``: wslb's credential, for a test that talks
    to a bridge itself (the test processes have one, as in production)."""
    return AsyncOpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers=headers,
    )


def new_sid() -> str:
    return f"eh-{uuid.uuid4().hex[:12]}"


async def chat_stream(
    client: AsyncOpenAI, model: str, sid: str, messages: list[Any], tokens: int
) -> tuple[str, Any]:
    """One streamed chat completion with the usage chunk: its text and usage."""
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=tokens,
        temperature=0,
        extra_headers={"X-Session-Id": sid},
    )
    text, usage = "", None
    async with asyncio.timeout(TIMEOUT):
        async for chunk in stream:
            ChatCompletionChunk.model_validate(chunk.model_dump())
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
    assert text and usage is not None, (text, usage)
    return text, usage


async def response_stream(client: AsyncOpenAI, sid: str, **kw: Any) -> Any:
    """One streamed response: its terminal event, after checking the response is whole."""
    stream = await client.responses.create(
        model="gemma", stream=True, temperature=0, extra_headers={"X-Session-Id": sid}, **kw
    )
    async with asyncio.timeout(TIMEOUT):
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in TERMINAL, types
    assert types[-1] != "response.failed", events[-1]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1]


async def conversation(
    base: str, headers: dict[str, str] | None = None
) -> tuple[Any, Any, Any, Any]:
    """What a client of ``base`` sees: a chat and its follow-up on one key, a response and
    the one continuing it on another; the four usages."""
    async with sdk(base, headers) as client:
        page = await client.models.list()
        model = page.data[0].id
        sid = new_sid()
        prompt = [{"role": "user", "content": STORY}]
        text, first = await chat_stream(client, model, sid, prompt, 24)
        follow = [*prompt, {"role": "assistant", "content": text}]
        follow.append({"role": "user", "content": "Give the keeper a name."})
        _, second = await chat_stream(client, model, sid, follow, 8)

        rid = new_sid()
        r1 = await response_stream(client, rid, input=STORY, max_output_tokens=16)
        r2 = await response_stream(
            client,
            rid,
            input="Give the keeper a name.",
            previous_response_id=r1.response.id,
            max_output_tokens=8,
        )
        assert r2.response.previous_response_id == r1.response.id
        return first, second, r1.response.usage, r2.response.usage


def cached_follow_up(first_in: int, second_cached: int) -> None:
    """The follow-up found the first request's prompt in the engine's prefix cache: most of it
    (llama-server's cache is per token of its slot; the chat template re-renders the end)."""
    print(f"\nfirst prompt {first_in} tokens; the follow-up's cached: {second_cached}")
    assert second_cached >= first_in // 2, (first_in, second_cached)


@pytest.mark.engine
async def test_the_sdk_against_each_bridge(stack: Stack) -> None:
    for bridge in stack.bridges:
        chat1, chat2, resp1, resp2 = await conversation(bridge.http, WORKER_AUTH)
        assert chat2.prompt_tokens > chat1.prompt_tokens
        cached_follow_up(chat1.prompt_tokens, chat2.prompt_tokens_details.cached_tokens)
        assert resp2.input_tokens > resp1.input_tokens
        cached_follow_up(resp1.input_tokens, resp2.input_tokens_details.cached_tokens)


@pytest.mark.engine
async def test_the_bridges_responses_events_validate_strictly(stack: Stack) -> None:
    """The same events as the WebSocket mode, each the SDK's own type (strict), whatever the
    engine's own ``/v1/responses`` would have written."""
    body = {"input": "Say hello.", "stream": True, "max_output_tokens": 6, "temperature": 0}
    async with (
        aiohttp.ClientSession(headers=WORKER_AUTH) as http,
        http.post(stack.bridges[0].http + "/v1/responses", json=body) as resp,
    ):
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await asyncio.wait_for(resp.read(), TIMEOUT)).decode()
    events = [b for b in raw.split("\n\n") if b.strip()]
    parsed = []
    for block in events:
        name, data = block.split("\n")
        event = STREAM_EVENT.validate_python(json.loads(data.removeprefix("data: ")), strict=True)
        assert name == f"event: {event.type}"
        parsed.append(event)
    assert parsed[0].type == "response.created" and parsed[-1].type in TERMINAL


@pytest.mark.engine
@pytest.mark.skipif(not HTTPPROXY, reason="wslb does not proxy plain HTTP yet (aio/httpproxy)")
async def test_the_sdk_through_wslb_in_front_of_two_bridges(stack: Stack) -> None:
    """``base_url`` = wslb's listener: the same key twice reaches the same bridge and engine
    (its prefix cache answers; the response chain is found)."""
    chat1, chat2, resp1, resp2 = await conversation(f"http://127.0.0.1:{stack.lb.port}")
    cached_follow_up(chat1.prompt_tokens, chat2.prompt_tokens_details.cached_tokens)
    cached_follow_up(resp1.input_tokens, resp2.input_tokens_details.cached_tokens)
    # Each key's first request was placed by its prompt, and wslb read what the engine said of
    # its cache at the answer's end (a new prompt: nothing cached, as its table had it).
    deadline = time.monotonic() + TIMEOUT
    while (said := prefix_reports(await asyncio.to_thread(stack.lb.admin, "/metrics"))) != {
        "agreed": 2.0
    }:
        assert time.monotonic() < deadline, said
        await asyncio.sleep(0.05)


def prefix_reports(text: str) -> dict[str, int]:
    return dict(prom_by_label(text, "wslb_prefix_reports_total", "result"))


# -- a fake engine --------------------------------------------------------------------------


async def test_chat_is_proxied_as_it_streams() -> None:
    """The first chunk reaches the client while the engine has written only it, and the
    engine's bytes arrive unchanged."""
    async with fake_engine() as fake, abridges(fake.url, "bridge-h") as (b,):
        await b.health(200)
        fake.delay = 0.3
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        started = time.monotonic()
        async with (
            aiohttp.ClientSession(headers=WORKER_AUTH) as http,
            http.post(b.http + "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            first = await asyncio.wait_for(resp.content.readline(), FAST)
            seen_at, written = time.monotonic() - started, fake.written
            rest = await asyncio.wait_for(resp.read(), FAST)
        assert written == 1 and seen_at < 0.3 * 3, (written, seen_at)
        raw = (first + rest).decode()
        assert raw.endswith("data: [DONE]\n\n")
        texts = [
            c["choices"][0]["delta"]["content"]
            for c in (json.loads(line[6:]) for line in raw.split("\n\n") if line[6:7] == "{")
            if c["choices"] and c["choices"][0]["delta"].get("content")
        ]
        assert texts == fake.chunks
        assert fake.requests[-1]["messages"] == body["messages"]  # the body as the client sent it


async def test_a_slow_client_slows_the_engine() -> None:
    """Backpressure through the proxy: a client that stops reading stops the engine's writes
    (each read of the engine is written and drained before the next)."""
    async with fake_engine() as fake:
        fake.mode = "flood"
        fake.chunks = ["x" * 16_000 + f"{n}" for n in range(4)]
        total = 4 * FLOOD  # 80 MB of events: more than the sockets' buffers hold
        async with abridges(fake.url, "bridge-s") as (b,):
            await b.health(200)
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            async with (
                aiohttp.ClientSession(headers=WORKER_AUTH) as http,
                http.post(b.http + "/v1/chat/completions", json=body) as resp,
            ):
                assert resp.status == 200
                stalled = -1
                for _ in range(40):  # not reading, until the engine's writes stop
                    if fake.written == stalled:
                        break
                    stalled = fake.written
                    await asyncio.sleep(0.5)
                print(f"\nthe engine stalled after {stalled} of {total} chunks")
                assert 0 < stalled < total // 2, (stalled, total)
            await until(lambda: fake.running == 0)  # the client left: the request aborted


async def test_engine_errors_reach_the_client() -> None:
    """An engine's HTTP error passes as it came; a cut mid-body cuts the client's body (never
    a short answer taken for a whole one); an engine nobody listens on is a 502."""
    async with fake_engine() as fake, abridges(fake.url, "bridge-e") as (b,):
        await b.health(200)
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession(headers=WORKER_AUTH) as http:
            fake.mode = "500"
            async with http.post(b.http + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 500
                assert (await resp.json())["error"]["message"] == "out of memory"

            fake.mode = "die-after"
            async with http.post(b.http + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(resp.read(), FAST)

            fake.mode, fake.health = "error-after", 200
            await b.health(200)
            async with http.post(
                b.http + "/v1/responses", json={"input": "hi", "stream": True}
            ) as resp:
                raw = (await asyncio.wait_for(resp.read(), FAST)).decode()
            assert "event: response.failed" in raw and "the GPU fell off" in raw
            async with http.post(b.http + "/v1/responses", json={"input": "hi"}) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "engine_error"

    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        abridges(dead, "bridge-d") as (d,),
        aiohttp.ClientSession(headers=WORKER_AUTH) as http,
    ):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            async with http.request(method, d.http + path, json=body) as resp:
                answer = await resp.json()
            assert resp.status == 502, answer
            assert answer["error"]["code"] == "engine_unavailable", answer
            assert answer["error"]["message"].startswith("engine: "), answer


async def test_models_and_the_session_key_pass_through() -> None:
    async with fake_engine() as fake, abridges(fake.url, "bridge-m") as (b,):
        await b.health(200)
        async with (
            aiohttp.ClientSession(headers=WORKER_AUTH) as http,
            http.get(b.http + "/v1/models", headers={"X-Session-Id": "k1"}) as resp,
        ):
            assert resp.status == 200 and resp.headers["X-Session-Id"] == "k1"
            assert (await resp.json())["data"][0]["id"] == "fake"
        await until(lambda: metrics(b.http)["wslb_worker_streams"] == 0)
