"""Late binding (``balancer/late.py``): a new WebSocket session answered by wslb, placed by its
first message, then connected to its worker with that message replayed.

Through real processes: ``wslb`` in front of three reference workers (whose prefix cache is
shared across sessions and reports ``cached_tokens``), and in front of a stock ``websockets``
server (the library's ``serve``, no wslb in mind) for what a worker that was not written for
wslb sees: the first message replayed, the subprotocol, its own refusals as closes, and what a
hostile client's bytes do before any worker is chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import jwt
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Request, Response

from tests.procs import Worker, Wslb, free_port, pool_config, running
from tests.test_failover import default_system
from tests.test_resume import Client as ResumingClient
from tests.test_resume import away

TIMEOUT = 20.0
SYSTEM = "You are the assistant of a shop that sells bicycles and their parts. " * 12
PROMPT_ARGS = ["--tokens-per-s", "0", "--kv-block-tokens", "4"]


def late_config(backends: list[dict[str, Any]], **prefix: Any) -> dict[str, Any]:
    return pool_config(
        backends,
        prefix_placement={"websocket": True, "balance_factor": 1.25, **prefix},  # as counted
    )


def bindings(lb: Wslb) -> dict[str, float]:
    """``wslb_late_bindings_total`` by ``how``."""
    text = lb.admin("/metrics")
    return {
        s.labels["how"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "wslb_late_bindings_total"
    }


async def recv(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        msg: dict[str, Any] = json.loads(await ws.recv())
    return msg


async def chat(lb: Wslb, key: str, question: str) -> tuple[str, int]:
    """One session whose first message is a prompt with the shared system prompt: the worker
    that answered and the tokens it found cached."""
    url = f"ws://127.0.0.1:{lb.port}/"
    async with connect(url, open_timeout=TIMEOUT, additional_headers={"X-Session-Id": key}) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "prompt",
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 3,
                }
            )
        )
        assert (await recv(ws))["type"] == "hello"  # the worker's, after the replayed prompt
        while (msg := await recv(ws))["type"] != "done":
            assert msg["type"] == "token", msg
        return str(msg["worker"]), int(msg["cached_tokens"])


async def test_a_late_bound_session_lands_where_its_system_prompt_is_cached(
    tmp_path: Path,
) -> None:
    """Six sessions, each with its own new key, whose first message starts with one system
    prompt: bound late, all reach the worker the first was sent to and find the prompt cached
    there; bound at the handshake (the setting off), the same keys spread over the workers and
    find nothing cached."""
    seen: dict[bool, list[tuple[str, int]]] = {}
    for on in (True, False):  # each round with its own workers: cold caches
        workers = [Worker(f"l{on:d}{i}", PROMPT_ARGS).start() for i in range(3)]
        backends = [
            {"id": f"w{i}", "url": f"ws://127.0.0.1:{w.port}"} for i, w in enumerate(workers)
        ]
        cfg = late_config(backends, websocket=on)
        # Six new sessions in a row on one holder: at the default factor its bound on the
        # recent ones would spread the sixth (tests/test_prefix.py has that rule).
        cfg["pools"][0]["hash_balance_factor"] = 4.0
        cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
        lb = Wslb(cfg, tmp_path, name=f"wslb-{on}")
        with running(*workers, lb):
            await asyncio.to_thread(lb.start)
            seen[on] = [await chat(lb, f"late-{n}", f"question {n}?") for n in range(6)]
            counts = await asyncio.to_thread(bindings, lb)
        if on:
            assert counts.get("ring", 0) == 1 and counts.get("prefix", 0) == 5, counts
        else:
            assert counts == {}, counts
    assert len({w for w, _ in seen[True]}) == 1, seen
    assert seen[True][0][1] == 0 and all(c > 0 for _, c in seen[True][1:]), seen
    spread = {w for w, _ in seen[False]}
    assert len(spread) > 1, seen  # the same keys, placed at the handshake, spread
    hits = sum(1 for _, c in seen[False] if c > 0)
    assert hits == len(seen[False]) - len(spread) < 5, seen  # each worker's first: cold


async def test_two_instances_bind_sessions_on_one_system_prompt_to_one_worker(
    tmp_path: Path,
) -> None:
    """Two wslb instances with the same config and nothing shared, sessions taking turns
    between them: each instance places a system prompt it has never seen by its anchor on the
    ring, so both send it to the same worker, and every session after the first finds it
    cached there."""
    workers = [Worker(f"lt{i}", PROMPT_ARGS).start() for i in range(3)]
    backends = [{"id": f"w{i}", "url": f"ws://127.0.0.1:{w.port}"} for i, w in enumerate(workers)]
    cfg = late_config(backends)
    cfg["pools"][0]["hash_balance_factor"] = 4.0  # as in the test above
    cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
    a, b = Wslb(cfg, tmp_path, name="wslb-a"), Wslb(cfg, tmp_path, name="wslb-b")
    with running(*workers, a, b):
        await asyncio.to_thread(a.start)
        await asyncio.to_thread(b.start)
        seen = [await chat((a, b)[n % 2], f"tier-{n}", f"question {n}?") for n in range(6)]
        counts = [await asyncio.to_thread(bindings, lb) for lb in (a, b)]
    assert len({w for w, _ in seen}) == 1, seen
    assert seen[0][1] == 0 and all(c > 0 for _, c in seen[1:]), seen
    assert [c.get("ring", 0) for c in counts] == [1, 1], counts  # each: its first by the ring


async def test_a_known_key_goes_home_without_waiting(tmp_path: Path) -> None:
    """A key wslb has placed already is not bound late: its reconnect reaches its worker at
    the handshake (the worker's hello comes first, before the client says anything)."""
    workers = [Worker(f"lk{i}", PROMPT_ARGS).start() for i in range(2)]
    backends = [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers]
    lb = Wslb(late_config(backends, first_message_wait="30s"), tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(lb.start)
        first, _ = await chat(lb, "known", "hello?")
        url = f"ws://127.0.0.1:{lb.port}/"
        headers = {"X-Session-Id": "known"}
        async with connect(url, open_timeout=TIMEOUT, additional_headers=headers) as ws:
            hello = await recv(ws)  # no first message sent: only a bound session speaks
            assert hello["type"] == "hello" and hello["worker"] == first, hello


async def test_the_openai_sdks_realtime_sessions_meet_their_instructions_cached(
    tmp_path: Path,
) -> None:
    """The ``openai`` SDK's Realtime client sends ``session.update`` with the instructions
    first, without waiting for ``session.created``: bound late by it, three sessions with the
    same instructions share a worker, and the later ones find the instructions cached."""
    workers = [Worker(f"lr{i}", PROMPT_ARGS).start() for i in range(3)]
    backends = [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers]
    cfg = late_config(backends)
    cfg["pools"][0]["hash_balance_factor"] = 4.0  # as in the test above
    cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
    lb = Wslb(cfg, tmp_path)
    sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{lb.port}/v1", api_key="not-needed")
    cached = []
    with running(*workers, lb):
        await asyncio.to_thread(lb.start)
        for n in range(3):
            async with sdk.realtime.connect(
                model="wslb-reference", extra_query={"session": f"rt-late-{n}"}
            ) as conn:
                await conn.session.update(
                    session={
                        "type": "realtime",
                        "instructions": SYSTEM,
                        "output_modalities": ["text"],
                    }
                )
                await conn.conversation.item.create(
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": f"question {n}"}],
                    }
                )
                await conn.response.create(response={"max_output_tokens": 3})
                async with asyncio.timeout(TIMEOUT):
                    async for event in conn:
                        assert event.type != "error", event
                        if event.type == "response.done":
                            usage = event.response.usage
                            assert usage is not None and usage.input_token_details is not None
                            cached.append(usage.input_token_details.cached_tokens or 0)
                            break
        counts = await asyncio.to_thread(bindings, lb)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
    assert counts.get("ring") == 1 and counts.get("prefix") == 2, counts


async def test_a_late_bound_session_resumes_after_a_cut(tmp_path: Path) -> None:
    """The repo's ``balancer.yaml`` (resume on) with late binding: the token comes with wslb's
    own 101, and a client cut mid-answer resumes from its count, every token once."""
    lb, _ = default_system(tmp_path, prefix_placement={"websocket": True})
    try:
        c = ResumingClient(lb.url, "late-resume")
        await c.open()
        assert c.ws is not None and c.token
        await c.ws.send(json.dumps({"type": "prompt", "text": "tell me", "max_tokens": 40}))
        assert (await c.recv())["type"] == "hello"
        seen: list[int] = []
        while len(seen) < 10:
            seen.append((await c.recv())["i"])
        c.cut()
        await away(lb, "late-resume")
        await c.open(resume=True)
        assert c.resumed == str(c.count)
        while (msg := await c.recv())["type"] != "done":
            seen.append(msg["i"])
        assert seen == list(range(40))
        assert (await asyncio.to_thread(bindings, lb)) == {"ring": 1.0}
    finally:
        lb.stop()


# -- a worker nobody wrote for wslb ---------------------------------------------------------------


@dataclass
class Stock:
    """A stock ``websockets`` echo server: what it accepted, in order."""

    subprotocols: list[str] | None = None
    refuse: int | None = None
    port: int = field(default_factory=free_port)
    connections: int = 0
    received: list[str | bytes] = field(default_factory=list)
    chosen: list[str | None] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)  # each session's X-Session-Id

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.chosen.append(ws.subprotocol)
        assert ws.request is not None
        self.keys.append(ws.request.headers.get("X-Session-Id"))
        async for msg in ws:
            self.received.append(msg)
            await ws.send(msg)

    def process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        if self.refuse is None:
            return None
        if request.headers.get("Upgrade", "").lower() == "websocket":  # not wslb's scrapes
            self.connections += 1
        return ws.respond(HTTPStatus(self.refuse), "not for you\n")


async def stock_server(stock: Stock) -> AsyncIterator[Stock]:
    async with serve(
        stock.handler,
        "127.0.0.1",
        stock.port,
        subprotocols=stock.subprotocols,  # type: ignore[arg-type]
        process_request=stock.process_request,
    ):
        yield stock


@pytest.fixture
async def echo(request: pytest.FixtureRequest) -> AsyncIterator[Stock]:
    params: dict[str, Any] = getattr(request, "param", {})
    async for s in stock_server(Stock(**params)):
        yield s


@pytest.fixture
async def lb(echo: Stock, tmp_path: Path) -> AsyncIterator[Wslb]:
    cfg = late_config(
        [{"id": "stock", "url": f"ws://127.0.0.1:{echo.port}"}],
        first_message_wait="1s",
        max_body="2KiB",
    )
    async with started(cfg, tmp_path) as wslb:
        yield wslb


@contextlib.asynccontextmanager
async def started(cfg: dict[str, Any], tmp_path: Path) -> AsyncIterator[Wslb]:
    """wslb with ``cfg``, started and stopped off the event loop (its waits block)."""
    wslb = Wslb(cfg, tmp_path)
    try:
        await asyncio.to_thread(wslb.start)
        yield wslb
    finally:
        await asyncio.to_thread(wslb.stop)


def url(lb: Wslb) -> str:
    return f"ws://127.0.0.1:{lb.port}/ws/chat"


async def test_the_stock_server_gets_the_first_message_replayed(echo: Stock, lb: Wslb) -> None:
    """Whatever the first message is (a prompt, text that is not JSON, a large binary one past
    ``max_body``), the worker gets it first, whole, then the rest of the session."""
    big = bytes(range(256)) * 40  # 10 KiB: past max_body, placed without a prompt
    firsts: list[str | bytes] = [
        json.dumps({"type": "response.create", "instructions": SYSTEM, "input": "hi"}),
        "not json at all",
        big,
    ]
    for first in firsts:
        async with connect(url(lb), open_timeout=TIMEOUT) as ws:
            await ws.send(first)
            await ws.send("second")
            async with asyncio.timeout(TIMEOUT):
                assert await ws.recv() == first
                assert await ws.recv() == "second"
    assert echo.received == [m for f in firsts for m in (f, "second")]
    counts = await asyncio.to_thread(bindings, lb)
    assert counts.get("ring", 0) == 1 and counts.get("none", 0) == 2, counts


async def test_a_client_waiting_for_the_server_is_placed_after_the_wait(
    echo: Stock, lb: Wslb
) -> None:
    """A client that says nothing first: after ``first_message_wait`` (1 s here) the session
    is placed without a prompt and works as any other."""
    async with connect(url(lb), open_timeout=TIMEOUT) as ws:
        # Placed without a prompt once the wait is over (not the worker's connection count:
        # a health probe may have opened one before).
        deadline = time.monotonic() + TIMEOUT
        while (await asyncio.to_thread(bindings, lb)).get("none") != 1:
            assert time.monotonic() < deadline, "not placed after the wait"
            await asyncio.sleep(0.05)
        await ws.send("late")
        async with asyncio.timeout(TIMEOUT):
            assert await ws.recv() == "late"
    assert await asyncio.to_thread(bindings, lb) == {"none": 1.0}


@pytest.mark.parametrize("echo", [{"subprotocols": ["chat.v2", "chat.v1"]}], indirect=True)
async def test_the_subprotocol_is_the_clients_first_and_the_worker_is_asked_for_it(
    echo: Stock, lb: Wslb
) -> None:
    """wslb answers with the client's first offered subprotocol and offers the worker only
    that one, so both ends agree."""
    async with connect(url(lb), open_timeout=TIMEOUT, subprotocols=["chat.v1", "chat.v2"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "chat.v1"
        await ws.send("hello")
        async with asyncio.timeout(TIMEOUT):
            assert await ws.recv() == "hello"
    assert echo.chosen == ["chat.v1"]


@pytest.mark.parametrize("echo", [{"subprotocols": ["chat.v2"]}], indirect=True)
async def test_a_worker_that_cannot_speak_the_subprotocol_closes_the_session(
    echo: Stock, lb: Wslb
) -> None:
    """The client was told ``chat.v1`` before the worker was asked: a worker that does not
    take it ends the session with a close naming why (a handshake answer could not)."""
    async with connect(url(lb), open_timeout=TIMEOUT, subprotocols=["chat.v1", "chat.v2"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "chat.v1"
        await ws.send("hello")
        with pytest.raises(ConnectionClosed) as info:
            async with asyncio.timeout(TIMEOUT):
                await ws.recv()
    rcvd = info.value.rcvd
    assert rcvd is not None and rcvd.code in (1008, 1014), rcvd
    assert json.loads(rcvd.reason)["status"] in (400, 502), rcvd
    assert echo.received == []


@pytest.mark.parametrize("echo", [{"refuse": 403}], indirect=True)
async def test_the_workers_refusal_is_a_close_after_the_101(echo: Stock, lb: Wslb) -> None:
    """The worker refuses the upgrade (403): the client, which has its 101 already, gets a
    1008 close whose reason carries the status; no traceback in wslb's log."""
    async with connect(url(lb), open_timeout=TIMEOUT) as ws:
        await ws.send(json.dumps({"type": "prompt", "text": "let me in"}))
        with pytest.raises(ConnectionClosed) as info:
            async with asyncio.timeout(TIMEOUT):
                await ws.recv()
    rcvd = info.value.rcvd
    assert rcvd is not None and rcvd.code == 1008, rcvd
    assert json.loads(rcvd.reason)["status"] == 403
    assert echo.connections == 1
    assert "Traceback" not in lb.output()


# -- hostile clients: nothing reaches a worker before the session is placed -------------------


async def raw_upgrade(lb: Wslb) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    w.write(
        b"GET /ws/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return r, w


async def close_of(r: asyncio.StreamReader) -> tuple[int, bytes]:
    """The close frame wslb sends (unmasked, short): its code and reason."""
    frame = await asyncio.wait_for(r.readexactly(2), TIMEOUT)
    assert frame[0] == 0x88, frame
    body = await asyncio.wait_for(r.readexactly(frame[1] & 0x7F), TIMEOUT)
    return int.from_bytes(body[:2], "big"), body[2:]


async def test_hostile_first_bytes_are_answered_by_wslb_alone(echo: Stock, lb: Wslb) -> None:
    """An unmasked frame (1002), invalid UTF-8 in a text frame (1007), a close before any
    message (echoed), a client that goes away: each ends with no worker connection made and
    no traceback logged."""
    cases: list[tuple[bytes, int]] = [
        (b"\x81\x05hello", 1002),  # unmasked
        (b"\x81\x81\x00\x00\x00\x00\xff", 1007),  # a masked text frame of one invalid byte
        (b"\x88\x82\x00\x00\x00\x00\x0f\xa0", 4000),  # a masked close 4000
    ]
    for data, code in cases:
        r, w = await raw_upgrade(lb)
        w.write(data)
        got, _ = await close_of(r)
        assert got == code, (data, got)
        w.close()
    r, w = await raw_upgrade(lb)
    w.close()  # gone before any message
    r, w = await raw_upgrade(lb)  # the next session still works
    w.write(b"\x81\x82\x00\x00\x00\x00ok")
    frame = await asyncio.wait_for(r.readexactly(4), TIMEOUT)
    assert frame == b"\x81\x02ok", frame
    w.close()
    assert echo.connections == 1  # only the last one reached the server
    assert (await asyncio.to_thread(bindings, lb)).get("closed") == 3
    assert "Traceback" not in lb.output()


# -- attackers: wslb's own checks come before its 101 ----------------------------------------

SECRET = "a-late-binding-secret-long-enough-for-hs256-" + "y" * 24
APP = "https://app.example"


def token(sub: str, expires_in: int = 60, alg: str = "HS256") -> str:
    claims = {"sub": sub, "exp": int(time.time()) + expires_in, "aud": "chat"}
    key: Any = None if alg == "none" else SECRET
    return jwt.encode(claims, key, algorithm=alg)


@pytest.fixture
async def guarded(echo: Stock, tmp_path: Path) -> AsyncIterator[Wslb]:
    """The stock server behind a late-binding pool with JWT auth and one allowed origin."""
    cfg = late_config([{"id": "stock", "url": f"ws://127.0.0.1:{echo.port}"}])
    cfg["auth"] = {
        "jwt": {"secret": SECRET, "algorithms": ["HS256"], "audience": "chat"},
        "origins": [APP],
    }
    async with started(cfg, tmp_path) as wslb:
        yield wslb


async def test_a_late_bound_pool_refuses_with_a_status_before_its_101(
    echo: Stock, guarded: Wslb
) -> None:
    """wslb answers the upgrade itself in a late-binding pool, but only after its own checks:
    no token, an expired one, an unsigned one (``alg: none``), a page of another origin and a
    client that names no origin each get their HTTP status, never a 101, and no worker hears
    of any of them."""
    cases: list[tuple[dict[str, str], str | None, int]] = [
        ({}, APP, 401),
        ({"Authorization": f"Bearer {token('alice', expires_in=-10)}"}, APP, 401),
        ({"Authorization": f"Bearer {token('alice', alg='none')}"}, APP, 401),
        ({"Authorization": f"Bearer {token('alice')}"}, "https://evil.example", 403),
        ({"Authorization": f"Bearer {token('alice')}"}, None, 403),
    ]
    for headers, origin, status in cases:
        with pytest.raises(InvalidStatus) as info:
            async with connect(
                url(guarded),
                additional_headers=headers,
                origin=origin,  # type: ignore[arg-type]
                open_timeout=TIMEOUT,
            ):
                pass
        assert info.value.response.status_code == status, (headers, origin)
    assert echo.connections == 0
    assert (await asyncio.to_thread(bindings, guarded)) == {}  # none was read, let alone bound
    assert "Traceback" not in guarded.output()


async def test_another_users_key_is_another_late_bound_session(echo: Stock, guarded: Wslb) -> None:
    """Bob names the key Alice's session has: with JWT auth a key is its owner's, so Bob's is
    a new session, bound late by his own first message, under another key at the worker; he
    never joins Alice's. Alice's second tab with her key goes home at once."""
    opened: list[ClientConnection] = []
    try:
        for sub, words in (("alice", "from alice"), ("bob", "from bob"), ("alice", "again")):
            ws = await connect(
                url(guarded),
                additional_headers={
                    "Authorization": f"Bearer {token(sub)}",
                    "X-Session-Id": "shared",
                },
                origin=APP,  # type: ignore[arg-type]
                open_timeout=TIMEOUT,
            )
            opened.append(ws)
            await ws.send(words)
            async with asyncio.timeout(TIMEOUT):
                assert await ws.recv() == words  # its own echo, nobody else's
        alice, bob, alice_again = echo.keys
        assert alice is not None and bob is not None
        assert alice != bob and alice.endswith("shared") and bob.endswith("shared")
        assert alice_again == alice
        # Alice's and Bob's first sessions were read and bound; her second tab was not.
        counts = await asyncio.to_thread(bindings, guarded)
        assert sum(counts.values()) == 2, counts
    finally:
        for ws in opened:
            await ws.close()
