"""The reference worker's prefix KV cache, as clients see it: shared by every session and keyless
request of one worker, in whole blocks, evicted least recently used by its capacity, reported as
``cached_tokens`` on the chat protocol and the OpenAI APIs, and in ``/metrics``.

Real worker processes on loopback; the clients are ``websockets`` (chat protocol) and the
official ``openai`` SDK (HTTP chat completions and responses, Realtime).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect

from tests.procs import WORKER_AUTH, Worker, running
from tests.test_realtime import answer, next_event, say

TIMEOUT = 10.0
BLOCK = 16
PREFILL_MS = 0.01
ARGS = (
    "--kv-block-tokens",
    str(BLOCK),
    "--prefill-ms-per-token",
    str(PREFILL_MS),
    "--simulate-gpu",
)


def words(tag: str, n: int) -> str:
    """``n`` words no other test sends: a prompt that is cached nowhere yet."""
    return " ".join(f"{tag}{i}" for i in range(n))


def system_prompt(n: int = 100) -> str:
    return words(f"sys{uuid.uuid4().hex[:6]}-", n)


def http(w: Worker) -> str:
    return f"http://127.0.0.1:{w.port}"


@pytest.fixture
def two_workers() -> Iterator[tuple[Worker, Worker]]:
    a = Worker("pc-a", [*ARGS, "--tokens-per-s", "0"]).start()
    b = Worker("pc-b", [*ARGS, "--tokens-per-s", "0"]).start()
    with running(a, b):
        yield a, b


async def recv(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        msg: dict[str, Any] = json.loads(await ws.recv())
        return msg


async def chat(w: Worker, messages: list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    """One answer on a new chat-protocol session of ``w``: its ``done``."""
    async with connect(w.url, open_timeout=TIMEOUT, additional_headers=WORKER_AUTH) as ws:
        assert (await recv(ws))["type"] == "hello"
        await ws.send(
            json.dumps({"type": "prompt", "messages": messages, "max_tokens": max_tokens})
        )
        while (msg := await recv(ws))["type"] != "done":
            assert msg["type"] == "token", msg
        return msg


def sdk(w: Worker) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"{http(w)}/v1", api_key="unused", max_retries=0, default_headers=WORKER_AUTH
    )


async def http_chat(w: Worker, messages: list[dict[str, str]], max_tokens: int = 1) -> int:
    """A keyless chat completion through the SDK: its ``cached_tokens``."""
    async with sdk(w) as client:
        done = await client.chat.completions.create(
            model="wslb-reference",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            timeout=TIMEOUT,
        )
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    cached = done.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


async def metrics(w: Worker) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{http(w)}/metrics", headers=WORKER_AUTH) as r:
        text = await r.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


async def test_a_shared_system_prompt_is_cached_for_other_sessions_on_that_worker_only(
    two_workers: tuple[Worker, Worker],
) -> None:
    """Two sessions, then keyless requests, with one 100-word system prompt: after the first,
    every one finds its 6 full blocks (96 tokens) on the same worker; the other worker has
    nothing until it answers one itself. The prefill covers only the rest."""
    a, b = two_workers
    sys_text = system_prompt(100)
    first = await chat(a, [system(sys_text), user("hi")])
    assert first["cached_tokens"] == 0
    assert first["prefill_ms"] == pytest.approx(101 * PREFILL_MS)
    second = await chat(a, [system(sys_text), user("another question")])
    assert second["cached_tokens"] == 96
    assert second["prefill_ms"] == pytest.approx((102 - 96) * PREFILL_MS)
    # Plain HTTP without a key: no session, the same cache.
    assert await http_chat(a, [system(sys_text), user("a third one")]) == 96
    assert await http_chat(b, [system(sys_text), user("a third one")]) == 0
    assert await http_chat(b, [system(sys_text), user("and a fourth")]) == 96
    # The Responses API over HTTP, keyless: instructions first, as a system message.
    async with sdk(a) as client:
        resp = await client.responses.create(
            model="wslb-reference",
            instructions=sys_text,
            input="a fifth",
            max_output_tokens=1,
            timeout=TIMEOUT,
        )
    assert resp.usage is not None
    assert resp.usage.input_tokens_details.cached_tokens == 96
    # The Realtime protocol: the session's instructions lead its context.
    async with sdk(a).realtime.connect(model="wslb-reference") as conn:
        await next_event(conn, "session.created")
        await conn.session.update(
            session={"type": "realtime", "output_modalities": ["text"], "instructions": sys_text}
        )
        await next_event(conn, "session.updated")
        await say(conn, "a sixth")
        await conn.response.create(response={"max_output_tokens": 1})
        got = await answer(conn, timeout=TIMEOUT)
    assert not got.errors
    assert got.done.response.usage.input_token_details.cached_tokens == 96
    hits = (await metrics(a))["wslb_worker_kv_hit_tokens_total"]
    assert hits == 4 * 96


async def test_a_conversation_finds_its_own_turns_in_whole_blocks(
    two_workers: tuple[Worker, Worker],
) -> None:
    """A keyless multi-turn chat, as the SDK sends it (the whole conversation each time): each
    turn finds the earlier ones, prompt and answer, up to the last full block."""
    a, _ = two_workers
    history = [user(words(f"c{uuid.uuid4().hex[:6]}-", 30))]
    async with sdk(a) as client:
        for turn in range(3):
            done = await client.chat.completions.create(
                model="wslb-reference",
                messages=history,  # type: ignore[arg-type]
                max_tokens=10,
                timeout=TIMEOUT,
            )
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            prompt = done.usage.prompt_tokens
            cached = done.usage.prompt_tokens_details.cached_tokens
            # Turn 1 finds nothing; then the previous turn's whole context, in full blocks.
            expected = 0 if turn == 0 else (prompt - 3) // BLOCK * BLOCK
            assert cached == expected, (turn, prompt, cached)
            history += [
                {"role": "assistant", "content": done.choices[0].message.content or ""},
                user("go on now"),
            ]


@pytest.fixture
def small_worker() -> Iterator[Worker]:
    """A KV cache of 4 blocks of 16 tokens."""
    w = Worker("pc-small", [*ARGS, "--tokens-per-s", "0", "--kv-capacity-tokens", "64"]).start()
    with running(w):
        yield w


async def test_capacity_evicts_the_least_recently_used_prefix(small_worker: Worker) -> None:
    """Room for 4 blocks: two 2-block prompts fill it; touching the first and adding a third
    evicts the second, the least recently used, which then finds nothing. The cache's size in
    ``/metrics`` never exceeds the capacity."""
    w = small_worker
    p1, p2, p3 = ([user(words(f"{t}{uuid.uuid4().hex[:6]}-", 32))] for t in "xyz")

    async def cached_tokens(prompt: list[dict[str, str]]) -> tuple[int, float]:
        got = await http_chat(w, prompt)
        return got, (await metrics(w))["wslb_worker_kv_cached_tokens"]

    assert (await metrics(w))["wslb_worker_kv_capacity_tokens"] == 64
    assert await cached_tokens(p1) == (0, 32)
    assert await cached_tokens(p1) == (32, 32)
    assert await cached_tokens(p2) == (0, 64)
    assert await cached_tokens(p1) == (32, 64)  # p1 touched: p2 is now least recent
    assert await cached_tokens(p3) == (0, 64)  # evicts p2's two blocks
    assert await cached_tokens(p1) == (32, 64)
    assert await cached_tokens(p2) == (0, 64)  # gone; caching it again evicts p3
    assert await cached_tokens(p3) == (0, 64)
    m = await metrics(w)
    assert m["wslb_worker_kv_hit_tokens_total"] == 3 * 32
    assert m["wslb_worker_kv_cache_usage"] == 0.0  # nothing runs: every block is evictable


@pytest.fixture
def slow_worker() -> Iterator[Worker]:
    w = Worker("pc-slow", [*ARGS, "--tokens-per-s", "20", "--kv-capacity-tokens", "1000"]).start()
    with running(w):
        yield w


async def test_kv_cache_usage_counts_a_shared_prefix_once(slow_worker: Worker) -> None:
    """Two answers running on one 100-word system prompt hold its 6 shared blocks once: the
    in-use gauge is their two contexts less the 96 shared tokens (vLLM's usage, blocks held by
    running requests), and 0 once they end, while their blocks stay cached."""
    w = slow_worker
    sys_text = system_prompt(100)
    await chat(w, [system(sys_text), user("warm")], max_tokens=1)  # caches the 96
    async with (
        connect(w.url, open_timeout=TIMEOUT, additional_headers=WORKER_AUTH) as one,
        connect(w.url, open_timeout=TIMEOUT, additional_headers=WORKER_AUTH) as two,
    ):
        for ws, q in ((one, "first"), (two, "second")):
            assert (await recv(ws))["type"] == "hello"
            prompt = {"type": "prompt", "messages": [system(sys_text), user(q)], "max_tokens": 40}
            await ws.send(json.dumps(prompt))
        for ws in (one, two):
            assert (await recv(ws))["type"] == "token"  # decoding: prefill over
        usage = (await metrics(w))["wslb_worker_kv_cache_usage"] * 1000
        # Each context is 101 tokens plus what it produced so far (at most 40).
        assert 2 * 101 - 96 <= usage <= 2 * (101 + 40) - 96, usage
        for ws in (one, two):
            while (msg := await recv(ws))["type"] != "done":
                pass
            assert msg["cached_tokens"] == 96
    deadline = time.monotonic() + TIMEOUT
    while (m := await metrics(w))["wslb_worker_kv_cache_usage"] != 0.0:
        assert time.monotonic() < deadline, m
        await asyncio.sleep(0.05)
    # Cached: the 6 shared blocks, then each answer's own full blocks (141 tokens: 8 blocks).
    assert m["wslb_worker_kv_cached_tokens"] == (6 + 2 * 2) * BLOCK
