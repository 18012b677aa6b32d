"""The open transcript state (version 2) thawed on the reference worker.

The balancer will build transcripts itself for crash failover (from its journal of relayed
messages), so the reference worker must continue a session from one exactly as from its own
version 1 state: the unfinished answer from token ``i`` (same turn), then the queued prompts,
for the chat protocol and the OpenAI Realtime protocol (docs/protocol.md section 5a). The test
plays the balancer: it builds or edits transcripts, thaws them, resumes with ``X-WSLB-Resume``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from backends.handoff import (
    StateError,
    Transcript,
    TranscriptAnswer,
    read_state,
    snapshot_from_json,
    transcript_from_json,
)
from backends.model import PendingAnswer, Prompt, QueuedPrompt, SessionSnapshot, token_text, words
from backends.protocol.realtime import (
    RealtimeSession,
    Respond,
    restore_transcript,
    snapshot_from_transcript,
)
from tests.procs import WORKER_AUTH
from tests.test_handoff import drain_quiet, freeze, prompt, thaw
from tests.test_worker import TIMEOUT, WorkerProc, collect, new_sid, open_chat, recv, start_worker

PREFILL_MS = 0.01
ARGS = ("--tokens-per-s", "2000", "--prefill-ms-per-token", str(PREFILL_MS), "--simulate-gpu")
LONG = 2000  # tokens: 1 s at 2000 tokens/s, so a freeze lands mid-answer
LIMIT = 1_000_000  # the worker's max_tokens limit


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProc]]:
    started: dict[str, WorkerProc] = {}
    try:
        for name in ("a", "b"):
            started[name] = start_worker("--id", f"w{name}", *ARGS, credential=True)
        yield started
    finally:
        for w in started.values():
            assert w.stop() == 0, w.stderr()


def texts(sid: str, turn: int, n: int, first: int = 0) -> list[str]:
    return [token_text(sid, turn, j) for j in range(first, n)]


def chat_transcript(sid: str, i: int = 4, max_tokens: int = 10) -> dict[str, Any]:
    """An answer of turn 1 cut after ``i`` tokens, a prompt queued behind it."""
    return {
        "v": 2,
        "session": sid,
        "protocol": "wslb-chat",
        "messages": [{"role": "user", "content": "hello there world"}],
        "answer": {
            "turn": 1,
            "i": i,
            "text": "".join(texts(sid, 1, i)),
            "max_tokens": max_tokens,
        },
        "queued": [{"type": "prompt", "text": "and then", "max_tokens": 3}],
    }


def realtime_snapshot(sid: str, i: int, max_output: int) -> tuple[dict[str, Any], Respond]:
    """A Realtime session run through ``i`` deltas of a response, as a worker would have."""
    rt = RealtimeSession(sid, default_max_tokens=64, max_tokens_limit=LIMIT)
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello there"}],
    }
    rt.receive(json.dumps({"type": "conversation.item.create", "item": item}))
    out = rt.receive(
        json.dumps({"type": "response.create", "response": {"max_output_tokens": max_output}})
    )
    respond = next(o for o in out if isinstance(o, Respond))
    for j in range(i):
        rt.delta(("" if j == 0 else " ") + token_text(sid, 1, j))
    value: dict[str, Any] = json.loads(json.dumps(rt.snapshot()))
    return value, respond


def realtime_transcript(sid: str, i: int = 3, max_output: int = 8) -> dict[str, Any]:
    snap, respond = realtime_snapshot(sid, i, max_output)
    return {
        "v": 2,
        "session": sid,
        "protocol": "openai-realtime",
        "messages": respond.messages,
        "answer": {"turn": 1, "i": i, "text": snap["response"]["text"], "max_tokens": max_output},
        "queued": [],
        "realtime": snap,
    }


async def resume_at(w: WorkerProc, sid: str, path: str = "/ws") -> ClientConnection:
    headers = {**WORKER_AUTH, "X-WSLB-Resume": sid, "X-Session-Id": sid}
    url = f"ws://127.0.0.1:{w.port}{path}"
    return await connect(url, additional_headers=headers, open_timeout=TIMEOUT)


async def until_done(ws: ClientConnection) -> list[dict[str, Any]]:
    """Realtime events up to and including ``response.done``."""
    events: list[dict[str, Any]] = []
    for _ in range(100_000):
        ev = await recv(ws)
        events.append(ev)
        if ev["type"] == "response.done":
            return events
    raise AssertionError("no response.done")


# -- the format (backends.handoff), no network ---------------------------------------------


def test_a_chat_transcript_is_the_snapshot_of_its_conversation() -> None:
    sid = "s"
    answer: dict[str, Any] = {
        "turn": 2,
        "i": 2,
        "text": "".join(texts(sid, 2, 2)),
        "max_tokens": 5,
    }
    state = {
        "v": 2,
        "session": sid,
        "protocol": "wslb-chat",
        "messages": [
            {"role": "user", "content": "hello  there"},
            {"role": "assistant", "content": "".join(texts(sid, 1, 3))},  # as relayed: no spaces
            {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        ],
        "answer": answer,
        "queued": [{"type": "prompt", "text": "x y", "max_tokens": 2}],
    }
    got = read_state(state, session=sid, max_queued=16, max_tokens_limit=LIMIT)
    assert isinstance(got, Transcript) and got.protocol == "wslb-chat" and got.events == ()
    assert got.snapshot == SessionSnapshot(
        session=sid,
        context=("hello", "there", *texts(sid, 1, 3), "go", "on", *texts(sid, 2, 2)),
        turns=2,
        kv_cached=0,
        answer=PendingAnswer(2, 2, 5, 0, 0.0),
        queued=(QueuedPrompt(Prompt(("x", "y")), 2),),
    )
    assert got.answer == TranscriptAnswer(2, 2, "".join(texts(sid, 2, 2)), 5)
    # The Realtime deltas' join (" ") is the same answer; the bridge's nulls read as absent.
    spaced = {**answer, "text": " ".join(texts(sid, 2, 2)), "cached_tokens": None}
    assert transcript_from_json({**state, "answer": spaced}).snapshot == got.snapshot
    # A user's words are never split, even when they look like token texts.
    user = {"role": "user", "content": "".join(texts(sid, 1, 2))}
    assert transcript_from_json({**state, "messages": [user], "answer": None}).snapshot.context == (
        user["content"],
    )


def test_turns_default_and_the_realtime_queue() -> None:
    sid = "s"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " ".join(texts(sid, 1, 3))},
    ]
    events = [{"type": "response.create"}]
    state = {"v": 2, "session": sid, "protocol": "openai-realtime", "messages": messages}
    got = transcript_from_json({**state, "answer": None, "queued": events})
    assert got.snapshot.turns == 1  # the assistant messages
    assert got.snapshot.context == ("hi", *texts(sid, 1, 3))
    assert got.events == tuple(events) and got.snapshot.queued == ()
    rt = restore_transcript(None, session=sid, messages=got.messages, answer=None)
    assert rt.messages() == messages and rt.response_id is None


def test_read_state_dispatches_on_the_version() -> None:
    v1 = {"v": 1, "session": "s", "context": ["a"], "turns": 0, "kv_cached": 1}
    assert read_state(v1) == snapshot_from_json(v1)
    for bad in (3, None, "2"):
        with pytest.raises(StateError, match=r"state\.v must be 1 or 2, got"):
            read_state({**v1, "v": bad})
    with pytest.raises(StateError, match="state must be an object"):
        read_state([])


def test_the_bridge_and_the_worker_rebuild_the_same_realtime_session() -> None:
    sid = "s"
    answer = TranscriptAnswer(turn=2, i=1, text="Hel", max_tokens=10, cancelled=True)
    messages = [{"role": "tool", "content": "x"}]
    snap = snapshot_from_transcript(sid, messages, answer, 4)
    assert snap["items"][0]["role"] == "user"  # an unknown role reads as user
    assert snap["response"]["max_tokens"] == 4 and snap["response"]["cancelling"]
    rt = restore_transcript(None, session=sid, messages=messages, answer=answer, max_tokens_limit=4)
    assert rt.snapshot() == RealtimeSession.restore(snap).snapshot()
    assert rt.deltas_sent == 1 and rt.cancel_requested


# -- the chat protocol ---------------------------------------------------------------------


async def test_unfinished_answer_then_the_queued_prompt(workers: dict[str, WorkerProc]) -> None:
    a = workers["a"]
    sid = new_sid()
    assert await thaw(a, sid, chat_transcript(sid)) == (200, {"ok": True})
    async with await resume_at(a, sid) as ws:
        first = await recv(ws)  # no hello: the answer goes on at token i, same turn
        assert (first["type"], first["turn"], first["i"]) == ("token", 1, 4)
        seen = [{"turn": 1, "i": j, "text": t} for j, t in enumerate(texts(sid, 1, 4))]
        _, done = await collect(ws, sid, [*seen, first])  # checks every text
        assert (done["turn"], done["tokens"], done["worker"]) == (1, 10, "wa")
        assert (done["cached_tokens"], done["prefill_ms"]) == (0, 0.0)  # the answer's own
        # The queued prompt is turn 2; the context was the messages' 3 words and the 10 tokens.
        _, done2 = await collect(ws, sid)
        assert (done2["turn"], done2["tokens"]) == (2, 3)
        assert done2["cached_tokens"] == 3 + 10
        assert done2["prefill_ms"] == pytest.approx(2 * PREFILL_MS)


async def test_no_answer_and_queued_prompts(workers: dict[str, WorkerProc]) -> None:
    a = workers["a"]
    sid = new_sid()
    state = {
        "v": 2,
        "session": sid,
        "protocol": "wslb-chat",
        "messages": [
            {"role": "user", "content": "a b c"},
            {"role": "assistant", "content": "".join(texts(sid, 1, 3))},
        ],
        "answer": None,
        "queued": [
            {"type": "prompt", "text": "d e", "max_tokens": 2},
            {"type": "prompt", "text": "f", "max_tokens": 1},
        ],
    }
    assert (await thaw(a, sid, state))[0] == 200
    async with await resume_at(a, sid) as ws:
        _, done2 = await collect(ws, sid)
        # Turn 2 (one assistant message before); a cold cache: the whole context prefilled,
        # the assistant's run of token texts split back into its 3 tokens.
        assert (done2["turn"], done2["tokens"], done2["cached_tokens"]) == (2, 2, 0)
        assert done2["prefill_ms"] == pytest.approx((3 + 3 + 2) * PREFILL_MS)
        _, done3 = await collect(ws, sid)
        assert (done3["turn"], done3["tokens"]) == (3, 1)
        assert done3["cached_tokens"] == 3 + 3 + 2 + 2
        assert await drain_quiet(ws, 0.2) == []


async def test_a_cancelled_answer_ends_at_once(workers: dict[str, WorkerProc]) -> None:
    a = workers["a"]
    sid = new_sid()
    state = chat_transcript(sid, i=3, max_tokens=500)
    state["answer"] |= {"cancelled": True, "cached_tokens": 7, "prefill_ms": 1.5}
    assert (await thaw(a, sid, state))[0] == 200
    async with await resume_at(a, sid) as ws:
        done = await recv(ws)
        assert done == {
            "type": "done",
            "turn": 1,
            "tokens": 3,
            "cached_tokens": 7,
            "prefill_ms": 1.5,
            "worker": "wa",
        }
        _, done2 = await collect(ws, sid)
        assert (done2["turn"], done2["tokens"]) == (2, 3)


async def test_failover_from_what_the_client_saw(workers: dict[str, WorkerProc]) -> None:
    """The balancer's case: a transcript built from the relayed messages (chat token texts
    joined by "") continues on another worker as the version 1 state would, and rebuilds
    exactly the context that state holds. The freeze itself still gives version 1."""
    a, b = workers["a"], workers["b"]
    sid = new_sid()
    async with await open_chat(a, sid) as old:
        assert (await recv(old))["type"] == "hello"
        await prompt(old, "hello there", 3)
        turn1, _ = await collect(old, sid)
        await prompt(old, "tell me more", LONG)
        seen = [await recv(old) for _ in range(5)]
        status, frozen = await freeze(a, sid)
        assert status == 200
        seen += await drain_quiet(old, 0.2)
        assert 1 + 3 + 1 + len(seen) == frozen["sent"]
    v1 = frozen["state"]
    assert v1["v"] == 1 and "protocol" not in v1 and v1["answer"]["i"] == len(seen)
    transcript = {
        "v": 2,
        "session": sid,
        "protocol": "wslb-chat",
        "messages": [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "".join(t["text"] for t in turn1)},
            {"role": "user", "content": "tell me more"},
        ],
        "answer": {
            "turn": 2,
            "i": len(seen),
            "text": "".join(t["text"] for t in seen),
            "max_tokens": LONG,
        },
        "queued": [],
    }
    rebuilt = transcript_from_json(transcript, session=sid).snapshot
    assert list(rebuilt.context) == v1["context"] and rebuilt.turns == v1["turns"]
    assert (await thaw(b, sid, transcript))[0] == 200
    async with await resume_at(b, sid) as new:
        _, done2 = await collect(new, sid, seen)
        assert (done2["turn"], done2["tokens"], done2["worker"]) == (2, LONG, "wb")
        await prompt(new, "after", 2)
        _, done3 = await collect(new, sid)
        assert done3["turn"] == 3
        assert done3["cached_tokens"] == len(words("hello there tell me more")) + 3 + LONG


# -- the Realtime protocol -----------------------------------------------------------------


@pytest.mark.parametrize("carried", [True, False], ids=["with-realtime", "rebuilt"])
async def test_realtime_response_goes_on(workers: dict[str, WorkerProc], carried: bool) -> None:
    a = workers["a"]
    sid = new_sid()
    i, m = 3, 8
    state = realtime_transcript(sid, i, m)
    if carried:
        rid, item_id = state["realtime"]["response"]["id"], state["realtime"]["response"]["item_id"]
    else:
        del state["realtime"]
        answer = TranscriptAnswer(1, i, state["answer"]["text"], m)
        made = snapshot_from_transcript(sid, state["messages"], answer, LIMIT)["response"]
        rid, item_id = made["id"], made["item_id"]
    assert (await thaw(a, sid, state))[0] == 200
    async with await resume_at(a, sid, f"/v1/realtime?session={sid}") as ws:
        events = await until_done(ws)
        assert await drain_quiet(ws, 0.2) == []  # one response.done, nothing after
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert events[0] is deltas[0]  # no session.created on a resume: the next delta first
    assert {(e["response_id"], e["item_id"]) for e in deltas} == {(rid, item_id)}
    assert [e["delta"] for e in deltas] == [" " + t for t in texts(sid, 1, m, first=i)]
    (text_done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert text_done["text"] == state["answer"]["text"] + "".join(e["delta"] for e in deltas)
    assert text_done["text"] == " ".join(texts(sid, 1, m))
    response = events[-1]["response"]
    assert response["id"] == rid and response["output"][0]["id"] == item_id
    assert response["status"] == ("incomplete" if carried else "completed")  # limited: reached
    assert response["usage"]["output_tokens"] == m


async def test_realtime_queued_events_after_the_resume(workers: dict[str, WorkerProc]) -> None:
    a = workers["a"]
    sid = new_sid()
    user = {"type": "message", "role": "user"}
    state = {
        "v": 2,
        "session": sid,
        "protocol": "openai-realtime",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": " ".join(texts(sid, 1, 3))},
        ],
        "answer": None,
        "queued": [
            {
                "type": "conversation.item.create",
                "item": {**user, "content": [{"type": "input_text", "text": "more words"}]},
            },
            {"type": "response.create", "response": {"max_output_tokens": 2}},
        ],
    }
    assert (await thaw(a, sid, state))[0] == 200
    async with await resume_at(a, sid, f"/v1/realtime?session={sid}") as ws:
        events = await until_done(ws)
        kinds = [e["type"] for e in events]
        assert kinds[:3] == [
            "conversation.item.added",
            "conversation.item.done",
            "response.created",
        ]
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert deltas == [token_text(sid, 2, 0), " " + token_text(sid, 2, 1)]  # turn 2
        usage = events[-1]["response"]["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (1 + 3 + 2, 2)
        # The client goes on: the conversation holds the transcript's and the new turn.
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 1}}))
        more = await until_done(ws)
        assert [e["delta"] for e in more if e["type"] == "response.output_text.delta"] == [
            token_text(sid, 3, 0)
        ]
        assert more[-1]["response"]["usage"]["input_tokens"] == 1 + 3 + 2 + 2


# -- refusals ------------------------------------------------------------------------------

Spoil = Callable[[dict[str, Any]], None]
# (the error names, the transcript spoiled: chat or realtime, how)
BAD: list[tuple[str, str, Spoil]] = [
    ("state.v must be 1 or 2, got 3", "chat", lambda s: s.update(v=3)),
    ("state.session is 'other'", "chat", lambda s: s.update(session="other")),
    ("state.protocol must be one of", "chat", lambda s: s.update(protocol="wslb-chat-v9")),
    ("state.messages must be a list", "chat", lambda s: s.update(messages={"role": "user"})),
    ("state.messages[0].content must be", "chat", lambda s: s["messages"][0].update(content=4)),
    ("state.answer.i must be a non-negative integer", "chat", lambda s: s["answer"].update(i=-1)),
    ("state.answer.i exceeds state.answer.max_tokens", "chat", lambda s: s["answer"].update(i=11)),
    (
        "state.answer.max_tokens must be at most",
        "chat",
        lambda s: s["answer"].update(max_tokens=LIMIT + 1),
    ),
    ("state.answer.turn must be the last turn", "chat", lambda s: s.update(turns=2)),
    ("state.answer.text must be the first 4", "chat", lambda s: s["answer"].update(text="Hi!")),
    (
        "state.queued[0]: a prompt needs",
        "chat",
        lambda s: s["queued"].__setitem__(0, {"max_tokens": 3}),
    ),
    ("state.queued holds more than 16", "chat", lambda s: s.update(queued=[{"text": "x"}] * 17)),
    ("state.answer and state.realtime.response", "realtime", lambda s: s.update(answer=None)),
    (
        "state.answer.text differs from state.realtime.response.text",
        "realtime",
        lambda s: s["answer"].update(i=2, text=" ".join(s["answer"]["text"].split()[:2])),
    ),
    ("state.realtime.counters", "realtime", lambda s: s["realtime"].update(counters=[])),
]


@pytest.mark.parametrize(("why", "kind", "spoil"), BAD, ids=[why for why, _, _ in BAD])
async def test_a_bad_transcript_is_400_naming_the_field(
    workers: dict[str, WorkerProc], why: str, kind: str, spoil: Spoil
) -> None:
    b = workers["b"]
    sid = new_sid()
    state = realtime_transcript(sid) if kind == "realtime" else chat_transcript(sid)
    spoil(state)
    status, body = await thaw(b, sid, state)
    assert status == 400, body
    assert why in body["error"], body
