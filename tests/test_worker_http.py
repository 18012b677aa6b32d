"""The reference worker's OpenAI HTTP API beside its WebSocket routes (SPEC section 16).

Clients nobody wrote for wslb: the official ``openai`` SDK (``models.list()``,
``chat.completions.create(stream=True)``, ``responses.create(stream=True)``), and raw HTTP
whose every streamed object is validated strictly against the SDK's own types. A session key
(``X-Session-Id``) gives the next request the cached tokens of the session's KV cache, on the
conversation store its WebSockets use. Then the same through wslb with the repo's
``balancer.yaml``, once wslb proxies plain HTTP (``balancer/aio/httpproxy.py``).

Real sockets on loopback; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from websockets.asyncio.client import connect

from backends.model import ModelConfig, token_text
from backends.worker import Worker, WorkerConfig
from tests.procs import WORKER_TOKEN, Wslb
from tests.test_worker import WORKER_ARGS, WorkerProc, start_worker

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
TIMEOUT = 10.0
HTTPPROXY = importlib.util.find_spec("balancer.aio.httpproxy") is not None


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    w = start_worker(*WORKER_ARGS)
    yield w
    assert w.stop() == 0, w.stderr()


def sdk(base: str) -> AsyncOpenAI:
    """The official client on ``base`` (``http://HOST:PORT``); no retries, so a refusal is
    seen as it came."""
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def new_sid() -> str:
    return f"http-{uuid.uuid4().hex[:12]}"


def tokens(sid: str, turn: int, n: int) -> str:
    """The simulated model's answer: ``n`` token texts of ``turn``, joined by spaces."""
    return " ".join(token_text(sid, turn, i) for i in range(n))


async def sse(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, str]]:
    """Each server-sent event's name (None without one) and data, as it arrives."""
    name: str | None = None
    data: list[str] = []
    async with asyncio.timeout(TIMEOUT):
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    yield name, "\n".join(data)
                name, data = None, []
            elif line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").strip())


async def post_sse(
    base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[aiohttp.ClientResponse, list[tuple[str | None, str]]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(base + path, json=body, headers=headers) as resp,
    ):
        events = [e async for e in sse(resp)]
        return resp, events


async def chat_stream(client: AsyncOpenAI, sid: str | None, **kw: Any) -> tuple[str, Any]:
    """One streamed chat completion through the SDK: its text and usage."""
    headers = {"X-Session-Id": sid} if sid is not None else {}
    stream = await client.chat.completions.create(
        model="wslb-reference",
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
        **kw,
    )
    text, usage = "", None
    async with asyncio.timeout(TIMEOUT):
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
    return text, usage


async def response_stream(client: AsyncOpenAI, sid: str | None, **kw: Any) -> list[Any]:
    """One streamed response through the SDK: its events, in order."""
    headers = {"X-Session-Id": sid} if sid is not None else {}
    stream = await client.responses.create(
        model="wslb-reference", stream=True, extra_headers=headers, **kw
    )
    async with asyncio.timeout(TIMEOUT):
        return [event async for event in stream]


def whole(events: list[Any]) -> Any:
    """One response, unbroken: created first, one terminal event last, the deltas joined are
    its text; the terminal event."""
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in TERMINAL, types
    assert sum(types.count(t) for t in TERMINAL) == 1, types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == events[-1].response.output_text, (deltas, done.text)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1]


# -- the SDK against the worker --------------------------------------------------------


async def test_models_list(worker: WorkerProc) -> None:
    async with sdk(worker.http) as client:
        page = await client.models.list()
    assert [m.id for m in page.data] == ["wslb-reference"]
    assert page.data[0].object == "model"


async def test_chat_stream_and_a_follow_up_with_cached_tokens(worker: WorkerProc) -> None:
    """The second request of a session finds the first's context in the KV cache: the first
    prompt and its answer, every token of them (the answer's texts split back into the same
    tokens); without the key it finds nothing."""
    async with sdk(worker.http) as client:
        sid = new_sid()
        prompt = [{"role": "user", "content": f"{sid} hello my friend"}]  # cached nowhere yet
        text, usage = await chat_stream(client, sid, messages=prompt, max_tokens=5)
        assert text == tokens(sid, 1, 5)
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 5, 9)
        assert usage.prompt_tokens_details.cached_tokens == 0

        history = [*prompt, {"role": "assistant", "content": text}]
        follow = [*history, {"role": "user", "content": "tell me more"}]
        text2, usage2 = await chat_stream(client, sid, messages=follow, max_completion_tokens=3)
        assert text2 == tokens(sid, 2, 3)  # the session's second turn
        assert usage2.prompt_tokens == 4 + 5 + 3
        assert usage2.prompt_tokens_details.cached_tokens == 4 + 5

        # Without the key: no session, but the worker's one prefix cache has it all.
        _, cold = await chat_stream(client, None, messages=follow, max_tokens=3)
        assert cold.prompt_tokens_details.cached_tokens == 4 + 5 + 3


async def test_chat_not_streamed(worker: WorkerProc) -> None:
    async with sdk(worker.http) as client:
        sid = new_sid()
        raw = await client.chat.completions.with_raw_response.create(
            model="any-name",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"X-Session-Id": sid},
        )
        assert raw.headers["x-session-id"] == sid
        done = raw.parse()
        ChatCompletion.model_validate(done.model_dump(), strict=True)
        assert done.model == "any-name"  # any model is served, and echoed
        assert done.choices[0].message.content == tokens(sid, 1, 4)
        assert done.choices[0].finish_reason == "length"  # the client's limit was reached
        assert done.usage is not None and done.usage.prompt_tokens == 3


async def test_chat_chunks_validate_strictly(worker: WorkerProc) -> None:
    """Raw SSE: every chunk is the SDK's ``ChatCompletionChunk`` (strict), the role first, the
    usage alone in the last (null before), then ``[DONE]``; ``stop`` when the worker's own
    length ended the answer."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp, events = await post_sse(worker.http, "/v1/chat/completions", body)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert events[-1] == (None, "[DONE]")
    chunks = [ChatCompletionChunk.model_validate_json(d, strict=True) for _, d in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == chunks[-1].usage.completion_tokens == 64  # --max-tokens-default


async def test_responses_stream_and_previous_response_id(worker: WorkerProc) -> None:
    async with sdk(worker.http) as client:
        sid = new_sid()
        first = whole(await response_stream(client, sid, input=f"{sid} hello", max_output_tokens=4))
        assert first.response.status == "incomplete"  # its max_output_tokens reached
        assert first.response.output_text == tokens(sid, 1, 4)
        assert first.response.usage.input_tokens_details.cached_tokens == 0

        second = whole(
            await response_stream(
                client, sid, input="and more", previous_response_id=first.response.id
            )
        )
        usage = second.response.usage
        assert second.response.status == "completed"
        assert second.response.previous_response_id == first.response.id
        assert usage.input_tokens == 2 + 4 + 2
        assert usage.input_tokens_details.cached_tokens == 2 + 4

        done = await client.responses.create(
            model="wslb-reference",
            input="three",
            previous_response_id=second.response.id,
            max_output_tokens=2,
            extra_headers={"X-Session-Id": sid},
        )
        Response.model_validate(done.model_dump(), strict=True)
        assert done.output_text == tokens(sid, 3, 2)
        assert done.usage is not None and done.usage.input_tokens_details.cached_tokens > 0


async def test_responses_events_validate_strictly(worker: WorkerProc) -> None:
    """Raw SSE: each event named by its type, its data the SDK's ``ResponseStreamEvent``
    (strict); the same events as the WebSocket mode, in its order."""
    body = {"model": "m", "input": "x y", "stream": True, "max_output_tokens": 3}
    resp, events = await post_sse(worker.http, "/v1/responses", body)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    parsed = [STREAM_EVENT.validate_python(json.loads(d), strict=True) for _, d in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]


async def test_http_and_websockets_share_the_conversation(worker: WorkerProc) -> None:
    """One store: a response made over HTTP is continued over the Responses WebSocket, and a
    chat completion's conversation by the chat protocol's ``text`` prompt."""
    async with sdk(worker.http) as client:
        sid = new_sid()
        first = whole(await response_stream(client, sid, input="hello", max_output_tokens=3))
        async with client.responses.connect(extra_query={"session": sid}) as conn:
            await conn.response.create(
                input="more", previous_response_id=first.response.id, max_output_tokens=2
            )
            async with asyncio.timeout(TIMEOUT):
                async for event in conn:
                    if event.type in TERMINAL:
                        break
        assert event.type == "response.incomplete", event
        assert event.response.usage is not None
        assert event.response.usage.input_tokens_details.cached_tokens == 1 + 3

        chat = new_sid()
        text, _ = await chat_stream(client, chat, messages=[{"role": "user", "content": "a b"}])
        async with connect(f"{worker.ws}?session={chat}", open_timeout=TIMEOUT) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            await ws.send(json.dumps({"type": "prompt", "text": "c", "max_tokens": 1}))
            async with asyncio.timeout(TIMEOUT):
                while (msg := json.loads(await ws.recv()))["type"] != "done":
                    pass
        assert msg["turn"] == 2 and msg["cached_tokens"] == 2 + len(text.split()), msg


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"[1]", 400, "invalid_json"),
        ("/v1/chat/completions", {"model": "m"}, 400, "missing_required_parameter"),
        ("/v1/chat/completions", {"messages": []}, 400, "invalid_type"),
        ("/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
            400,
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
            400,
            "unsupported_feature",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "stream_options": {}},
            400,
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "bogus": 1},
            400,
            "unknown_parameter",
        ),
        ("/v1/responses", b"nope", 400, "invalid_json"),
        ("/v1/responses", {"input": "a", "stream": "yes"}, 400, "invalid_type"),
        ("/v1/responses", {"input": "a", "tools": [{"type": "x"}]}, 400, "unsupported_feature"),
        ("/v1/responses", {"input": "a", "previous_response_id": "r"}, 400, None),
        ("/v1/responses", {}, 400, "missing_required_parameter"),
    ],
)
async def test_bad_requests_get_openais_error_shape(
    worker: WorkerProc, path: str, body: bytes | dict[str, Any], status: int, code: str | None
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as http,
        http.post(worker.http + path, data=data, headers={"Content-Type": "application/json"}) as r,
    ):
        answer = await r.json()
    assert r.status == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["message"], error
    if code is not None:
        assert error["code"] == code, error


async def test_the_sdk_raises_its_own_errors(worker: WorkerProc) -> None:
    async with sdk(worker.http) as client:
        with pytest.raises(BadRequestError) as bad:
            await client.chat.completions.create(model="m", messages=[])
        assert bad.value.status_code == 400 and "messages" in bad.value.message
        with pytest.raises(BadRequestError) as missing:
            await client.responses.create(model="m", input="x", previous_response_id="resp_nope")
        assert missing.value.code == "previous_response_not_found"


def test_a_worker_with_a_credential_asks_it_on_http_too() -> None:
    """As its WebSocket chat routes: once the worker has wslb's credential, every request but
    health and metrics needs it."""
    w = start_worker(*WORKER_ARGS, credential=True)
    try:

        async def check() -> tuple[int, int, int]:
            async with aiohttp.ClientSession() as http:
                async with http.get(w.http + "/v1/models") as r:
                    plain = r.status
                header = {"X-WSLB-Worker-Token": WORKER_TOKEN}
                async with http.get(w.http + "/v1/models", headers=header) as r:
                    shown = r.status
                async with http.get(w.http + "/healthz") as r:
                    health = r.status
                return plain, shown, health

        assert asyncio.run(check()) == (401, 200, 200)
    finally:
        assert w.stop() == 0, w.stderr()


# -- a worker in this process (its model and drain read directly) ---------------------------


@contextlib.asynccontextmanager
async def local_worker(**model: Any) -> AsyncIterator[Worker]:
    config = WorkerConfig(
        port=0,
        model=ModelConfig(prefill_ms_per_token=0.01, **model),
        use_nvml=False,
        drain_grace=5.0,
    )
    w = Worker(config)
    await w.start()
    try:
        yield w
    finally:
        await w.close(timeout=0.5)


def base(w: Worker) -> str:
    return f"http://127.0.0.1:{w.port}"


async def until(check: Any, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_sessions_are_held_only_when_named() -> None:
    """A named session stays for ``--session-ttl`` (what the next request's cache needs); a
    request without a key is one turn, and leaves nothing behind."""
    async with local_worker(tokens_per_s=0) as w, sdk(base(w)) as client:
        msgs = [{"role": "user", "content": "a b c"}]
        await chat_stream(client, None, messages=msgs, max_tokens=2)
        await response_stream(client, None, input="x", max_output_tokens=2)
        stats = w.model.stats(time.monotonic())
        assert (stats.held_sessions, len(w._responses)) == (0, 0)
        assert w.model.kv.used == 3 + 2 + 1 + 2  # their blocks stay in the shared cache
        await chat_stream(client, "kept", messages=msgs, max_tokens=2)
        stats = w.model.stats(time.monotonic())
        assert (stats.held_sessions, stats.active_sessions) == (1, 0)
        assert w.model.cached("kept") == 3 + 2


async def test_drain_waits_for_requests_in_flight_and_refuses_new_ones() -> None:
    async with local_worker(tokens_per_s=100) as w, aiohttp.ClientSession() as http:
        body = {
            "messages": [{"role": "user", "content": "go"}],
            "stream": True,
            "max_tokens": 30,  # 0.3 s
        }
        async with http.post(base(w) + "/v1/chat/completions", json=body) as resp:
            stream = sse(resp)
            await anext(stream)  # the answer has started
            draining = asyncio.ensure_future(w.drain(5.0))
            await until(lambda: w.draining)
            async with http.post(base(w) + "/v1/chat/completions", json=body) as refused:
                assert refused.status == 503
                assert (await refused.json())["error"]["code"] == "draining"
            assert not draining.done()
            rest = [data async for _, data in stream]
        assert rest[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in map(json.loads, rest[:-1])
            if c["choices"]
        )
        assert len(text.split()) == 30
        assert await asyncio.wait_for(draining, TIMEOUT) is True


async def test_a_client_that_leaves_ends_its_turn() -> None:
    async with local_worker(tokens_per_s=200) as w, aiohttp.ClientSession() as http:
        body = {"input": "go", "stream": True, "max_output_tokens": 5000}
        headers = {"X-Session-Id": "leaver"}
        async with http.post(base(w) + "/v1/responses", json=body, headers=headers) as resp:
            stream = sse(resp)
            for _ in range(8):
                await anext(stream)
            assert w.model.decoding == 1
        await until(lambda: w.model.decoding == 0 and w.requests == 0)
        rs = w._responses["leaver"]
        assert rs.response_id is None  # aborted: the next response starts fresh
        assert not w.model.connected("leaver")


async def test_a_slow_client_slows_the_answer() -> None:
    """Backpressure: a client that stops reading stops the decode (bounded buffers all the
    way), and the turn ends once it leaves."""
    total = 400_000  # ~25 MB of events: more than the sockets' buffers hold
    async with local_worker(tokens_per_s=0) as w, aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        body["max_tokens"] = total
        async with http.post(base(w) + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            produced = -1
            for _ in range(50):
                if w.model.decode_tokens_total == produced:
                    break
                produced = w.model.decode_tokens_total
                await asyncio.sleep(0.1)
            print(f"\nthe worker stalled after {produced} of {total} tokens")
            assert 0 < produced < total // 4, produced
        await until(lambda: w.model.decoding == 0 and w.requests == 0)


# -- through wslb ---------------------------------------------------------------------------


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Wslb]:
    from tests.test_failover import default_system

    lb, _ = default_system(tmp_path, timeouts={"shutdown_grace": "0.1s"})
    yield lb
    lb.stop()


@pytest.mark.skipif(not HTTPPROXY, reason="wslb does not proxy plain HTTP yet (aio/httpproxy)")
async def test_the_sdk_through_wslb(system: Wslb) -> None:
    """``base_url`` = wslb's listener + ``/v1``: the HTTP calls reach a worker chosen by the
    session key, the same one each time (its cache answers the follow-up)."""
    async with sdk(f"http://127.0.0.1:{system.port}") as client:
        page = await client.models.list()
        assert [m.id for m in page.data] == ["wslb-reference"]

        sid = new_sid()
        prompt = [{"role": "user", "content": "through the balancer"}]
        text, usage = await chat_stream(client, sid, messages=prompt, max_tokens=4)
        assert text == tokens(sid, 1, 4) and usage.prompt_tokens_details.cached_tokens == 0
        follow = [
            *prompt,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "ok"},
        ]
        text2, usage2 = await chat_stream(client, sid, messages=follow, max_tokens=2)
        assert text2 == tokens(sid, 2, 2)
        assert usage2.prompt_tokens_details.cached_tokens == 3 + 4

        rid = new_sid()
        first = whole(await response_stream(client, rid, input="hello", max_output_tokens=3))
        second = whole(
            await response_stream(
                client, rid, input="again", previous_response_id=first.response.id
            )
        )
        assert second.response.usage.input_tokens_details.cached_tokens == 1 + 3


async def test_through_wslb_a_key_is_its_owners_and_a_caller_needs_a_token(
    tmp_path: Path,
) -> None:
    """Plain HTTP crosses wslb's auth as an upgrade does (SPEC section 12), tested as an
    attacker would: the SDK without a valid JWT gets 401 and no worker is asked; bob, who
    names alice's session key, gets a conversation of his own, not alice's cached one."""
    from openai import AuthenticationError

    from tests.procs import Worker as WorkerProcess
    from tests.procs import pool_config
    from tests.test_auth import SECRET
    from tests.test_auth import token as jwt_for

    w = WorkerProcess("jw").start()
    # A path-less backend URL: the client's paths (/v1/..., /ws) reach the worker as sent.
    cfg = pool_config([{"id": "jw", "url": f"ws://127.0.0.1:{w.port}"}])
    cfg["auth"] = {"jwt": {"secret": SECRET, "algorithms": ["HS256"], "audience": "chat"}}
    lb = Wslb(cfg, tmp_path).start()
    base_url = f"http://127.0.0.1:{lb.port}"
    try:
        async with sdk(base_url) as anonymous:  # api_key "unused": not a JWT
            with pytest.raises(AuthenticationError):
                await anonymous.models.list()
        sid = new_sid()
        prompt = [{"role": "user", "content": "mine alone"}]
        alice = AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=jwt_for({"sub": "alice"}), max_retries=0
        )
        bob = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=jwt_for({"sub": "bob"}), max_retries=0)
        async with alice, bob:
            text, _ = await chat_stream(alice, sid, messages=prompt, max_tokens=3)
            follow = [
                *prompt,
                {"role": "assistant", "content": text},
                {"role": "user", "content": "go"},
            ]
            _, mine = await chat_stream(alice, sid, messages=follow, max_tokens=1)
            theirs, _ = await chat_stream(bob, sid, messages=follow, max_tokens=1)
        assert mine.prompt_tokens_details.cached_tokens == 2 + 3  # her prompt and answer
        # bob's key is another session: its first turn (the worker's prefix cache is shared by
        # every session, as an engine's is, so cached_tokens tells nothing here).
        assert theirs.startswith("t1.0-"), theirs
    finally:
        lb.stop()
        w.stop()
