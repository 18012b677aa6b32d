"""One chat/transcript contract (balancer/contract.py), shared by both workers and the journal.

The journal pairs each turn a worker starts with the prompt it answers and hands the prompts
still waiting to the next worker on a crash, so it must accept exactly the prompts the workers
accept, and learn which valid prompt a worker refused (a full queue). The first tests drive the
three deciders (the reference worker's, the engine bridge's, the journal's) over the same
prompts; the last ones refuse a 17th queued prompt on a real worker and fail its session over
from the journal's transcript, as wslb does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import bridge
from backends.handoff import ProtocolError, parse_prompt, transcript_from_json
from balancer.contract import MAX_QUEUED_PROMPTS, MAX_TOKENS_LIMIT, queue_full
from balancer.frames import OP_TEXT, build_frame
from balancer.journal import Journal, JournalError
from tests.test_handoff import resume, thaw
from tests.test_worker import WorkerProc, new_sid, open_chat, recv, start_worker

DEFAULT = 64


def wframe(obj: dict[str, Any]) -> bytes:
    return build_frame(OP_TEXT, json.dumps(obj).encode())


def cframe(obj: dict[str, Any]) -> bytes:
    return build_frame(OP_TEXT, json.dumps(obj).encode(), mask=True)


def reference(obj: dict[str, Any]) -> str | None:
    """The reference worker's verdict: None (queued) or the ``error`` it sends."""
    try:
        parse_prompt(obj, DEFAULT, MAX_TOKENS_LIMIT)
    except ProtocolError as exc:
        return str(exc)
    return None


def engine_bridge(obj: dict[str, Any]) -> str | None:
    try:
        bridge.parse_prompt(obj, DEFAULT, MAX_TOKENS_LIMIT)
    except ProtocolError as exc:
        return str(exc)
    return None


def journal_queue(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """What a journal that relayed ``obj`` to a busy worker hands on as queued."""
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello", "worker": "w", "session": "s"}))
    j.client(cframe(obj))
    queued: list[dict[str, Any]] = j.transcript("s")["queued"]
    return queued


def check_one_contract(obj: dict[str, Any]) -> None:
    ref, eng = reference(obj), engine_bridge(obj)
    assert ref == eng, (obj, ref, eng)  # the same verdict, with the same message
    queued = journal_queue(obj)
    assert len(queued) == (ref is None), (obj, ref, queued)
    if ref is None:
        # The journal's queued prompt is read back by each worker as the prompt itself.
        (q,) = queued
        state = {"v": 2, "session": "s", "protocol": "wslb-chat", "messages": [], "queued": [q]}
        got = transcript_from_json(state, session="s", default_max_tokens=DEFAULT)
        want, max_tokens = parse_prompt(obj, DEFAULT, MAX_TOKENS_LIMIT)
        assert (got.snapshot.queued[0].prompt, got.snapshot.queued[0].max_tokens) == (
            want,
            max_tokens,
        )
        assert bridge.parse_prompt(q, DEFAULT, MAX_TOKENS_LIMIT) == bridge.parse_prompt(
            obj, DEFAULT, MAX_TOKENS_LIMIT
        )


TABLE: list[dict[str, Any]] = [
    {"text": "hi"},
    {"text": "hi", "max_tokens": 0},
    {"text": "hi", "max_tokens": None},
    {"text": "hi", "max_tokens": MAX_TOKENS_LIMIT},
    {"text": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1},
    {"text": "hi", "max_tokens": -1},
    {"text": "hi", "max_tokens": True},
    {"text": "hi", "max_tokens": 2.0},
    {"text": 3},
    {"text": "a", "messages": []},
    {},
    {"messages": []},
    {"messages": None},
    {"messages": "hi"},
    {"messages": [1]},
    {"messages": [{"content": "no role: user"}]},
    {"messages": [{"role": "system", "content": None}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "junk", {}]}]},
    {"messages": [{"role": "user", "content": 4}]},
    {"messages": [{"role": 5, "content": "a bad role"}]},  # the reference worker took it
    {"messages": [{"role": "", "content": "x"}]},
    {"text": "hi", "temperature": 0.7},
    {"text": "hi", "temperature": 0},
    {"text": "hi", "temperature": 2},
    {"text": "hi", "temperature": 2.5},  # the journal took it, the bridge did not
    {"text": "hi", "temperature": "hot"},  # the journal did not, the reference worker did
    {"text": "hi", "temperature": None},
    {"text": "hi", "temperature": False},
    {"text": "hi", "unknown": [1, 2]},
]


@pytest.mark.parametrize("fields", TABLE, ids=[json.dumps(t) for t in TABLE])
def test_the_journal_accepts_exactly_what_the_workers_accept(fields: dict[str, Any]) -> None:
    check_one_contract({"type": "prompt", **fields})


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, MAX_TOKENS_LIMIT + 3),
    st.floats(-1, 3),
    st.text(max_size=6),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["text", "role", "x"]), st.text(max_size=3), max_size=2),
)
_PART = st.one_of(_ANY, st.fixed_dictionaries({"type": st.just("text"), "text": _ANY}))
_MESSAGE = st.one_of(
    _ANY,
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(st.sampled_from(["user", "system", "assistant", ""]), _ANY),
            "content": st.one_of(_ANY, st.lists(_PART, max_size=3)),
        },
    ),
)
_PROMPT = st.fixed_dictionaries(
    {"type": st.just("prompt")},
    optional={
        "text": st.one_of(st.text(max_size=12), _ANY),
        "messages": st.one_of(st.lists(_MESSAGE, max_size=3), _ANY),
        "max_tokens": _ANY,
        "temperature": _ANY,
        "stream": _ANY,
    },
)


@settings(max_examples=300, deadline=None)
@given(_PROMPT)
def test_the_same_function_decides_for_every_prompt(obj: dict[str, Any]) -> None:
    check_one_contract(obj)


# -- a refused prompt ------------------------------------------------------------------------


def tokens(sid: str, turn: int, n: int) -> bytes:
    return b"".join(
        wframe({"type": "token", "turn": turn, "i": i, "text": f"t{turn}.{i}"}) for i in range(n)
    )


def prompt(k: int) -> dict[str, Any]:
    """Prompt ``k`` asks for ``k`` tokens: a ``done`` tells which prompt a turn answered."""
    return {"type": "prompt", "text": f"question {k}", "max_tokens": k}


def queued_tokens(j: Journal) -> list[int]:
    return [q["max_tokens"] for q in j.transcript("s")["queued"]]


@pytest.mark.parametrize("begun", [False, True])
def test_a_refused_prompt_leaves_the_journal(begun: bool) -> None:
    """Turn 1 streams, prompts 2..17 fill the worker's queue, 18 is refused. ``begun``: the
    refusal comes after turn 1's ``done`` and the worker already started turn 2 unseen (it
    holds 3..18 then, and refuses 19): the same journal state, another refused prompt."""
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello"}))
    j.client(cframe(prompt(100)))
    j.worker(tokens("s", 1, 3))
    for k in range(2, 20):
        j.client(cframe(prompt(k)))
    if begun:
        j.worker(wframe({"type": "done", "turn": 1, "tokens": 3}))
        j.worker(wframe(queue_full(2 + MAX_QUEUED_PROMPTS)))  # turn 2 runs, 3..18 queued
        assert queued_tokens(j) == list(range(2, 19))
        j.worker(wframe({"type": "done", "turn": 2, "tokens": 2}))
    else:
        j.worker(wframe(queue_full(1 + MAX_QUEUED_PROMPTS)))  # turn 1 runs, 2..17 queued
        j.worker(wframe(queue_full(1 + MAX_QUEUED_PROMPTS)))  # and 19 is refused as well
        assert queued_tokens(j) == list(range(2, 18))
        j.client(cframe(prompt(19)))  # the client sends it again later
        j.worker(wframe({"type": "done", "turn": 1, "tokens": 3}))
        j.worker(wframe({"type": "done", "turn": 2, "tokens": 2}))
    for turn in range(3, 18):
        j.worker(wframe({"type": "done", "turn": turn, "tokens": turn}))
    j.worker(tokens("s", 18, 1))
    t = j.transcript("s")
    # Turn 18 answers prompt 18 when 19 was refused, else the 19 sent again (18 was refused).
    assert t["answer"]["turn"] == 18 and t["queued"] == []
    assert t["answer"]["max_tokens"] == (18 if begun else 19)


def test_a_refusal_the_journal_cannot_place_loses_track() -> None:
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello"}))
    j.client(cframe(prompt(3)))
    j.worker(wframe(queue_full(1 + MAX_QUEUED_PROMPTS)))  # no prompt 18 was relayed
    with pytest.raises(JournalError, match="refused after turn 17"):
        j.transcript("s")


def test_too_many_waiting_client_messages_lose_track() -> None:
    """Past MAX_PENDING the journal gave up silently dropping messages: an answer would then
    be paired with a later message; it gives up instead."""
    j = Journal(1 << 22)
    j.worker(wframe({"type": "hello"}))
    for k in range(1, 80):
        j.client(cframe(prompt(k)))
    with pytest.raises(JournalError, match="more than 64 client messages"):
        j.transcript("s")


# -- end to end: refused on a real worker, failed over from the journal -----------------------

SLOW = ("--tokens-per-s", "100", "--prefill-ms-per-token", "0.01")


@pytest.fixture(scope="module")
def pair() -> Any:
    started: list[WorkerProc] = []
    try:
        for name in ("a", "b"):
            started.append(start_worker("--id", f"w{name}", *SLOW, credential=True))
        yield started
    finally:
        for w in started:
            assert w.stop() == 0, w.stderr()


async def test_a_refused_prompt_is_not_answered_after_a_failover(pair: list[WorkerProc]) -> None:
    """A client queues 17 prompts behind an answer on worker A; A refuses the 17th (its queue
    holds 16). Once turn 2 runs the client sends another, which A queues. The journal (fed as
    wslb's relay feeds it) is taken then, as at a crash, and thawed on B: B answers prompts
    2..17 and then the one sent after the refusal, never the refused one.

    Before the contract's ``after_turn`` the journal kept the refused prompt: its transcript
    queued 17 prompts and B refused it (400 ``state.queued holds more than 16 prompts``); with
    one fewer, turn 18 would have answered the refused prompt.
    """
    a, b = pair
    sid = new_sid()
    j = Journal(1 << 22, sid)
    ws = await open_chat(a, sid)
    try:
        j.worker(wframe(await recv(ws)))  # hello

        async def send(obj: dict[str, Any]) -> None:
            await ws.send(json.dumps(obj))
            j.client(cframe(obj))

        async def until(kind: str) -> dict[str, Any]:
            while True:
                msg = await recv(ws)
                j.worker(wframe(msg))
                if msg["type"] == kind:
                    return msg

        for k in range(1, 19):
            await send(prompt(k + 50 if k == 1 else k))  # turn 1: 51 tokens, 0.5 s
        refused = await until("error")
        assert refused["error"] == f"too many queued prompts (at most {MAX_QUEUED_PROMPTS})"
        assert (await until("done"))["turn"] == 1
        assert (await until("token"))["turn"] == 2
        await send(prompt(19))  # queued: turn 2 took prompt 2 out of the queue
        state = j.transcript(sid)  # the worker is lost here
    finally:
        await ws.close()
    queued = [q["max_tokens"] for q in state["queued"]]
    assert queued[-1] == 19 and 18 not in queued, queued
    status, body = await thaw(b, sid, state)
    assert status == 200, body
    ws = await resume(b, sid)
    try:
        done: dict[int, int] = {}
        while 18 not in done:
            msg = await recv(ws)
            assert msg["type"] in ("token", "done"), msg
            if msg["type"] == "done":
                done[msg["turn"]] = msg["tokens"]
        assert done == {**{k: k for k in range(2, 18)}, 18: 19}
        with pytest.raises(asyncio.TimeoutError):  # nothing more: no turn for the refused one
            await asyncio.wait_for(ws.recv(), 0.5)
    finally:
        await ws.close()
