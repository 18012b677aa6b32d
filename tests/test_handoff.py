"""Live-migration handoff between two real workers on loopback, with the test as the balancer.

The test plays the balancer's part of the handoff (docs/protocol.md): freeze on A, forward A's
messages up to ``sent``, thaw on B, open B's WebSocket with ``X-WSLB-Resume``, replay the client
messages after ``received``, and checks that the client would see one unbroken conversation.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from backends.handoff import StateError, snapshot_from_json, snapshot_to_json
from backends.model import PendingAnswer, Prompt, QueuedPrompt, SessionSnapshot, token_text, words
from tests.procs import WORKER_AUTH
from tests.test_worker import (
    TIMEOUT,
    WorkerProc,
    collect,
    new_sid,
    open_chat,
    recv,
    start_worker,
)

PREFILL_MS = 0.01
ARGS = ("--tokens-per-s", "400", "--prefill-ms-per-token", str(PREFILL_MS), "--simulate-gpu")
LONG = 400  # tokens: 1 s at 400 tokens/s, so a freeze lands mid-answer


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProc]]:
    """A and B (KV transfer), P (KV prefill), N (no handoff API)."""
    started: dict[str, WorkerProc] = {}
    try:
        for name, extra in [
            ("a", ()),
            ("b", ()),
            ("p", ("--handoff-kv", "prefill")),
            ("n", ("--no-handoff",)),
        ]:
            started[name] = start_worker("--id", f"w{name}", *ARGS, *extra, credential=True)
        yield started
    finally:
        for w in started.values():
            assert w.stop() == 0, w.stderr()


async def post(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """A handoff request as wslb sends one: JSON, with its credential."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    headers = {**WORKER_AUTH, "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http, http.post(url, data=data, headers=headers) as r:
        return r.status, await r.json()


async def freeze(w: WorkerProc, sid: str) -> tuple[int, Any]:
    return await post(f"{w.http}/wslb/sessions/{sid}/freeze")


async def thaw(w: WorkerProc, sid: str, state: Any) -> tuple[int, Any]:
    return await post(f"{w.http}/wslb/sessions/{sid}/thaw", {"state": state})


async def resume(w: WorkerProc, sid: str) -> ClientConnection:
    headers = {**WORKER_AUTH, "X-WSLB-Resume": sid, "X-Session-Id": sid}
    return await connect(w.ws, additional_headers=headers, open_timeout=TIMEOUT)


async def metric(w: WorkerProc, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(w.http + "/metrics") as resp:
        body = await resp.text()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")


async def drain_quiet(ws: ClientConnection, quiet: float = 0.3) -> list[dict[str, Any]]:
    """Read until nothing arrives for ``quiet`` seconds."""
    got: list[dict[str, Any]] = []
    while True:
        try:
            async with asyncio.timeout(quiet):
                msg = await ws.recv()
        except TimeoutError:
            return got
        assert isinstance(msg, str)
        got.append(json.loads(msg))


async def prompt(ws: ClientConnection, text: str, max_tokens: int) -> None:
    await ws.send(json.dumps({"type": "prompt", "text": text, "max_tokens": max_tokens}))


# -- the state format (backends.handoff), no network ---------------------------------------

TOKEN = st.text(st.characters(blacklist_categories=["Z", "C"]), min_size=1, max_size=12)


@st.composite
def snapshots(draw: st.DrawFn) -> SessionSnapshot:
    context = draw(st.lists(TOKEN, max_size=30))
    turns = draw(st.integers(0, 50))
    answer = None
    if turns and draw(st.booleans()):
        produced = draw(st.integers(0, len(context)))
        answer = PendingAnswer(
            turn=turns,
            produced=produced,
            max_tokens=draw(st.integers(produced, produced + 100)),
            cached_tokens=draw(st.integers(0, 1000)),
            prefill_ms=draw(st.floats(0, 1e6)),
            cancelled=draw(st.booleans()),
        )
    queued = draw(
        st.lists(
            st.builds(
                QueuedPrompt,
                st.builds(Prompt, st.lists(TOKEN, max_size=5).map(tuple), st.booleans()),
                st.integers(0, 1000),
            ),
            max_size=16,
        )
    )
    return SessionSnapshot(
        session=draw(st.text(min_size=1, max_size=20)),
        context=tuple(context),
        turns=turns,
        kv_cached=draw(st.integers(0, len(context))),
        answer=answer,
        queued=tuple(queued),
    )


@given(snapshots())
def test_state_round_trips_through_json(snap: SessionSnapshot) -> None:
    value = json.loads(json.dumps(snapshot_to_json(snap)))
    assert value["v"] == 1
    assert snapshot_from_json(value, session=snap.session, max_queued=16) == snap


def test_state_validation_names_the_field() -> None:
    good = snapshot_to_json(SessionSnapshot("s", ("a", "b"), 1, 2, PendingAnswer(1, 1, 3, 0, 0.0)))
    assert snapshot_from_json(good).answer == PendingAnswer(1, 1, 3, 0, 0.0)
    answer = good["answer"]
    for bad, field in [
        ({**good, "v": 2}, "state.v"),
        ({**good, "session": ""}, "state.session"),
        ({**good, "context": "a b"}, "state.context"),
        ({**good, "context": ["a", ""]}, "state.context[1]"),
        ({**good, "turns": True}, "state.turns"),
        ({**good, "kv_cached": 3}, "state.kv_cached"),
        ({**good, "answer": {**answer, "i": 4}}, "state.answer.i"),
        ({**good, "answer": {**answer, "turn": 2}}, "state.answer.turn"),
        ({**good, "answer": {**answer, "prefill_ms": -1}}, "state.answer.prefill_ms"),
        ({**good, "queued": [{"words": ["x"], "max_tokens": -1}]}, "state.queued[0].max_tokens"),
        ({**good, "queued": {}}, "state.queued"),
    ]:
        with pytest.raises(StateError, match=field.replace("[", r"\[").replace("]", r"\]")):
            snapshot_from_json(bad)
    with pytest.raises(StateError, match="not 'other'"):
        snapshot_from_json(good, session="other")
    with pytest.raises(StateError, match="at most 2"):
        snapshot_from_json(good, max_tokens_limit=2)


# -- the whole handoff --------------------------------------------------------------------


async def test_freeze_mid_answer_and_resume_elsewhere(workers: dict[str, WorkerProc]) -> None:
    a, b = workers["a"], workers["b"]
    sid = new_sid()
    transfers_before = await metric(b, "wslb_worker_kv_transfer_tokens_total")
    freezes_before = await metric(a, "wslb_worker_handoffs_total", direction="freeze")
    old = await open_chat(a, sid)
    seen = [await recv(old)]  # everything the client got, in order
    assert seen[0]["type"] == "hello"
    await prompt(old, "a b c", 3)
    tokens, done1 = await collect(old, sid)
    seen += [*tokens, done1]
    await prompt(old, "tell me a long story", LONG)
    seen += [await recv(old) for _ in range(5)]

    started = time.monotonic()
    status, frozen = await freeze(a, sid)
    assert time.monotonic() - started < 1.0  # HTTP included; the freeze itself is one step
    assert status == 200, frozen
    assert frozen["received"] == 2
    # The messages in flight: exactly up to S reach the client, then A is silent.
    await prompt(old, "after freeze", 2)  # not processed by A: the balancer replays it
    seen += await drain_quiet(old)
    assert len(seen) == frozen["sent"]
    assert seen[-1]["type"] == "token"
    assert await metric(a, "wslb_worker_active_sessions") == 0
    assert await metric(a, "wslb_worker_handoffs_total", direction="freeze") == freezes_before + 1

    state = frozen["state"]
    sent_turn2 = sum(1 for m in seen if m.get("turn") == 2)
    assert state["v"] == 1
    assert state["session"] == sid
    assert state["turns"] == 2
    assert state["queued"] == []
    assert state["answer"]["turn"] == 2
    assert state["answer"]["i"] == sent_turn2 > 0
    assert state["answer"]["max_tokens"] == LONG
    context = ["a", "b", "c"] + [t["text"] for t in tokens] + words("tell me a long story")
    context += [token_text(sid, 2, i) for i in range(sent_turn2)]
    assert state["context"] == context
    assert state["kv_cached"] == len(context)

    assert await thaw(b, sid, state) == (200, {"ok": True})
    async with await resume(b, sid) as new:
        # No hello: the answer continues at the next token, with the same turn number.
        first = await recv(new)
        assert (first["type"], first["turn"], first["i"]) == ("token", 2, sent_turn2)
        rest, done2 = await collect(new, sid, [m for m in seen if m.get("turn") == 2] + [first])
        assert done2["tokens"] == LONG
        assert done2["worker"] == "wb"
        assert len(rest) == LONG
        # Replay of what A did not process; B holds the whole context in its KV cache.
        await prompt(new, "after freeze", 2)
        _, done3 = await collect(new, sid)
        assert done3["turn"] == 3
        assert done3["cached_tokens"] == 3 + 3 + 5 + LONG
        assert done3["prefill_ms"] == pytest.approx(2 * PREFILL_MS)
    assert await metric(b, "wslb_worker_kv_transfer_tokens_total") == transfers_before + len(
        context
    )
    # The balancer closes the old leg; A, which forgot the session, takes it calmly.
    await old.close()
    async with aiohttp.ClientSession() as http, http.get(a.http + "/healthz") as resp:
        assert resp.status == 200
    assert (await freeze(a, sid))[0] == 404


async def test_queued_prompt_carried_over_and_back(workers: dict[str, WorkerProc]) -> None:
    a, b = workers["a"], workers["b"]
    sid = new_sid()
    async with await open_chat(a, sid) as old:
        await recv(old)
        await prompt(old, "first", LONG)
        await prompt(old, "queued words", 3)
        early = [await recv(old) for _ in range(3)]
        status, frozen = await freeze(a, sid)
        assert status == 200
        assert frozen["received"] == 2  # the queued prompt counts: it is in the state
        early += await drain_quiet(old, 0.1)
        assert 1 + len(early) == frozen["sent"]
        state = frozen["state"]
        assert state["queued"] == [
            {"words": ["queued", "words"], "replace": False, "max_tokens": 3}
        ]
        assert (await freeze(a, sid))[0] == 409  # twice
    assert (await thaw(b, sid, state))[0] == 200
    from_a = len(early)
    async with await resume(b, sid) as new:
        _, done1 = await collect(new, sid, early)
        assert (done1["turn"], done1["tokens"]) == (1, LONG)
        _, done2 = await collect(new, sid)
        assert (done2["turn"], done2["tokens"]) == (2, 3)
        assert done2["cached_tokens"] == 1 + LONG
        # And back to A, mid-answer again: counters restart with the resumed connection.
        await prompt(new, "again", LONG)
        again = [await recv(new) for _ in range(2)]
        status, frozen = await freeze(b, sid)
        assert status == 200
        assert frozen["received"] == 1
        again += await drain_quiet(new, 0.1)
        # No hello on a resumed connection: B sent the rest of turn 1, turn 2, and ``again``.
        assert (LONG - from_a) + 1 + 3 + 1 + len(again) == frozen["sent"]
    assert (await thaw(a, sid, frozen["state"]))[0] == 200
    async with await resume(a, sid) as back:
        _, done3 = await collect(back, sid, again)
        assert (done3["turn"], done3["tokens"], done3["worker"]) == (3, LONG, "wa")


@pytest.mark.parametrize("mode", ["transfer", "prefill"])
async def test_kv_transfer_or_prefill(workers: dict[str, WorkerProc], mode: str) -> None:
    a, b = workers["a"], workers["b" if mode == "transfer" else "p"]
    sid = new_sid()
    async with await open_chat(a, sid) as old:
        await recv(old)
        await prompt(old, "one two three four", 6)
        await collect(old, sid)
        status, frozen = await freeze(a, sid)
        assert status == 200
    state = frozen["state"]
    assert state["answer"] is None
    assert state["kv_cached"] == len(state["context"]) == 10
    transfers = await metric(b, "wslb_worker_kv_transfer_tokens_total")
    prefills = await metric(b, "wslb_worker_prefill_tokens_total")
    thaws = await metric(b, "wslb_worker_handoffs_total", direction="thaw")
    assert (await thaw(b, sid, state))[0] == 200
    async with await resume(b, sid) as new:
        await prompt(new, "five six", 2)
        _, done = await collect(new, sid)
    assert done["turn"] == 2
    assert await metric(b, "wslb_worker_handoffs_total", direction="thaw") == thaws + 1
    if mode == "transfer":
        assert (done["cached_tokens"], done["prefill_ms"]) == (10, pytest.approx(2 * PREFILL_MS))
        assert await metric(b, "wslb_worker_kv_transfer_tokens_total") == transfers + 10
        assert await metric(b, "wslb_worker_prefill_tokens_total") == prefills + 2
    else:
        assert (done["cached_tokens"], done["prefill_ms"]) == (0, pytest.approx(12 * PREFILL_MS))
        assert await metric(b, "wslb_worker_kv_transfer_tokens_total") == transfers
        assert await metric(b, "wslb_worker_prefill_tokens_total") == prefills + 12


# -- refusals -----------------------------------------------------------------------------


async def test_refusals(workers: dict[str, WorkerProc]) -> None:
    a, b, n = workers["a"], workers["b"], workers["n"]
    sid = new_sid()
    status, body = await freeze(a, sid)
    assert status == 404
    assert "error" in body
    for w in (a, n):
        with pytest.raises(InvalidStatus) as info:
            await resume(w, sid)
        assert info.value.response.status_code == 409
    assert (await freeze(n, sid))[0] == 404
    good = {"v": 1, "session": sid, "context": [], "turns": 0, "kv_cached": 0}
    assert (await thaw(n, sid, good))[0] == 404
    url = f"{b.http}/wslb/sessions/{sid}/thaw"
    for raw in [b"not json", b"[1]", b'{"nostate": 1}']:
        assert (await post(url, raw=raw))[0] == 400
    for bad in [
        None,
        {**good, "v": 2},
        {**good, "session": "other"},
        {**good, "context": ["two words"]},
        {**good, "kv_cached": 1},
        {**good, "turns": -1},
        {**good, "answer": {"turn": 1, "i": 0, "max_tokens": 5}},  # turn beyond turns
        {**good, "queued": [{"words": ["x"], "max_tokens": 1}] * 17},
    ]:
        status, body = await thaw(b, sid, bad)
        assert status == 400, bad
        assert body["error"]
    async with await open_chat(b, sid) as live:
        await recv(live)
        assert (await thaw(b, sid, good))[0] == 409


async def test_sigterm_drains_while_sessions_live() -> None:
    w = start_worker("--drain-grace", "10", *ARGS, credential=True)
    try:
        sid = new_sid()
        async with await open_chat(w, sid) as ws:
            await recv(ws)
            w.proc.send_signal(signal.SIGTERM)
            async with aiohttp.ClientSession() as http:
                for _ in range(100):
                    async with http.get(w.http + "/healthz") as resp:
                        if resp.status == 503:
                            assert await resp.json() == {"status": "draining"}
                            break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("healthz never turned 503")
            # The live session is still served, and can still be frozen away.
            await prompt(ws, "still here", 3)
            _, done = await collect(ws, sid)
            assert done["tokens"] == 3
            assert (await freeze(w, sid))[0] == 200
            assert w.proc.poll() is None
        started = time.monotonic()
        code = await asyncio.to_thread(w.proc.wait, TIMEOUT)
        assert code == 0, w.stderr()
        assert time.monotonic() - started < 3.0
    finally:
        w.stop()
