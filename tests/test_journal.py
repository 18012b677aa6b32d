"""The journal (balancer/journal.py): relayed frames folded into a transcript a worker accepts.

The Realtime cases drive the real server-side protocol (``backends.protocol.realtime``): its
events go through the journal as frames, and the transcript's ``realtime`` snapshot must be one
``RealtimeSession.restore`` accepts and continues with the same ids.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.handoff import TranscriptAnswer
from backends.model import token_text
from backends.protocol.realtime import RealtimeSession, Respond, Send
from balancer.frames import OP_PING, OP_TEXT, build_frame
from balancer.journal import COMPACT_AT, Journal, JournalError


def wframe(obj: dict[str, Any]) -> bytes:
    return build_frame(OP_TEXT, json.dumps(obj).encode())


def cframe(obj: dict[str, Any]) -> bytes:
    return build_frame(OP_TEXT, json.dumps(obj).encode(), mask=True)


def feed_worker(j: Journal, data: bytes, rng: random.Random | None = None) -> None:
    """Feed in random cuts, as reads arrive."""
    if rng is None:
        j.worker(data)
        return
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 200)
        j.worker(data[pos : pos + n])
        pos += n


def tokens(sid: str, turn: int, n: int, start: int = 0) -> bytes:
    return b"".join(
        wframe({"type": "token", "turn": turn, "i": i, "text": token_text(sid, turn, i)})
        for i in range(start, n)
    )


def test_chat_unfinished_answer_and_queue() -> None:
    j = Journal(1 << 20)
    sid = "alice"
    j.worker(wframe({"type": "hello", "worker": "w1", "session": sid}))
    j.client(cframe({"type": "prompt", "text": "hello there", "max_tokens": 5}))
    j.worker(tokens(sid, 1, 5))
    j.worker(wframe({"type": "done", "turn": 1, "tokens": 5, "worker": "w1"}))
    j.client(cframe({"type": "prompt", "text": "and then?", "max_tokens": 8}))
    j.worker(tokens(sid, 2, 3))
    j.client(cframe({"type": "prompt", "text": "third", "max_tokens": 2}))
    j.client(cframe({"type": "prompt", "max_tokens": -1, "text": "bad"}))  # the worker errs
    t = j.transcript(sid)
    first = "".join(token_text(sid, 1, i) for i in range(5))
    assert t == {
        "v": 2,
        "session": sid,
        "protocol": "wslb-chat",
        "messages": [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ],
        "answer": {
            "turn": 2,
            "i": 3,
            "text": "".join(token_text(sid, 2, i) for i in range(3)),
            "max_tokens": 8,
            "cancelled": False,
        },
        "queued": [{"text": "third", "max_tokens": 2}],
        "turns": 2,
    }


def test_chat_fold_does_not_depend_on_how_reads_are_cut() -> None:
    sid = "s"
    stream = wframe({"type": "hello", "worker": "w", "session": sid})
    stream += build_frame(OP_PING, b"x")  # an endpoint's ping passes through, not journalled
    body = tokens(sid, 1, 400)  # > COMPACT_AT: folds happen along the way
    assert len(body) > 2 * COMPACT_AT
    whole = Journal(1 << 20)
    whole.worker(stream)
    whole.client(cframe({"type": "prompt", "text": "go", "max_tokens": 500}))
    whole.worker(body)
    for seed in range(5):
        cut = Journal(1 << 20)
        rng = random.Random(seed)
        feed_worker(cut, stream, rng)
        cut.client(cframe({"type": "prompt", "text": "go", "max_tokens": 500}))
        feed_worker(cut, body, rng)
        assert cut.transcript(sid) == whole.transcript(sid)
    assert whole.transcript(sid)["answer"]["i"] == 400


def test_chat_messages_prompt_replaces_and_cancel_marks() -> None:
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello", "worker": "w", "session": "s"}))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    j.client(cframe({"type": "prompt", "messages": msgs}))
    j.worker(tokens("s", 1, 2))
    j.client(cframe({"type": "cancel"}))
    t = j.transcript("s")
    assert t["messages"] == msgs
    assert t["answer"]["cancelled"] is True
    assert t["answer"]["max_tokens"] is None  # the worker's default
    j.worker(wframe({"type": "done", "turn": 1, "tokens": 2}))
    t = j.transcript("s")
    assert t["answer"] is None and t["turns"] == 1
    joined = token_text("s", 1, 0) + token_text("s", 1, 1)
    assert t["messages"] == [*msgs, {"role": "assistant", "content": joined}]


def test_chat_engine_error_rolls_back() -> None:
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello", "worker": "w", "session": "s"}))
    j.client(cframe({"type": "prompt", "text": "a", "max_tokens": 4}))
    j.worker(tokens("s", 1, 1))
    j.worker(wframe({"type": "error", "error": "engine: down", "turn": 1}))
    t = j.transcript("s")
    assert t["messages"] == [] and t["answer"] is None and t["turns"] == 1


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (wframe({"type": "greeting"}), "unknown_protocol"),
        (
            wframe({"type": "hello"}) + wframe({"type": "token", "turn": 1, "i": 0, "text": "x"}),
            "lost_track",  # a turn no relayed prompt asked for
        ),
        (wframe({"type": "hello"}) + wframe({"type": "token"})[:-3], "mid_message"),
    ],
)
def test_chat_cannot_build(stream: bytes, reason: str) -> None:
    j = Journal(1 << 20)
    j.worker(stream)
    with pytest.raises(JournalError) as info:
        j.transcript("s")
    assert info.value.reason == reason


def test_out_of_order_token_loses_track() -> None:
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello"}))
    j.client(cframe({"type": "prompt", "text": "a", "max_tokens": 9}))
    j.worker(wframe({"type": "token", "turn": 1, "i": 0, "text": "a"}))
    j.worker(wframe({"type": "token", "turn": 1, "i": 2, "text": "c"}))
    with pytest.raises(JournalError, match="token 2 after 0"):
        j.transcript("s")


def test_over_limit_gives_up_and_frees() -> None:
    j = Journal(4096)
    j.worker(wframe({"type": "hello"}))
    j.client(cframe({"type": "prompt", "text": "x " * 1000, "max_tokens": 9}))
    assert j.size <= 4096
    j.client(cframe({"type": "prompt", "text": "y " * 1500, "max_tokens": 9}))
    assert j.over
    assert j.size == 0
    with pytest.raises(JournalError) as info:
        j.transcript("s")
    assert info.value.reason == "journal_over_limit"
    j.worker(tokens("s", 1, 100))  # nothing is kept any more
    j.fold()
    assert j.size == 0


def test_ten_turn_chat_stays_small() -> None:
    """A folded journal holds text, not frames: about the conversation's characters."""
    j = Journal(256 * 1024)
    sid = "s"
    j.worker(wframe({"type": "hello"}))
    raw = 0
    for turn in range(1, 11):
        prompt = cframe({"type": "prompt", "text": f"question {turn} " * 5, "max_tokens": 50})
        j.client(prompt)
        body = tokens(sid, turn, 50) + wframe({"type": "done", "turn": turn, "tokens": 50})
        j.worker(body)
        raw += len(prompt) + len(body)
    j.fold()
    assert j.size < raw / 2
    assert len(j.transcript(sid)["messages"]) == 20


# -- Realtime ----------------------------------------------------------------------------


class RealtimePair:
    """A real Realtime server session whose events are relayed through a journal."""

    def __init__(self, sid: str, journal: Journal) -> None:
        self.rt = RealtimeSession(sid, model="m", default_max_tokens=16)
        self.j = journal
        self.respond: Respond | None = None
        self.sent: list[dict[str, Any]] = []
        self.out(self.rt.opened())

    def out(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, Send):
                self.sent.append(e.event)
                self.j.worker(wframe(e.event))
            elif isinstance(e, Respond):
                self.respond = e

    def client(self, event: dict[str, Any]) -> None:
        self.j.client(cframe(event))
        self.out(self.rt.receive(json.dumps(event)))


def user_item(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        },
    }


def test_realtime_transcript_restores_with_the_same_ids() -> None:
    sid = "rt1"
    j = Journal(1 << 20)
    p = RealtimePair(sid, j)
    p.client({"type": "session.update", "session": {"type": "realtime", "instructions": "short"}})
    p.client(user_item("first question"))
    p.client({"type": "response.create"})
    for n in range(4):
        p.out(p.rt.delta(f" w{n}"))
    p.out(p.rt.finish())
    p.client(user_item("second"))
    p.client({"type": "response.create", "response": {"max_output_tokens": 9}})
    for n in range(3):
        p.out(p.rt.delta(f" x{n}"))
    t = j.transcript(sid)
    assert t["protocol"] == "openai-realtime"
    assert t["answer"] == {
        "turn": 2,
        "i": 3,
        "text": " x0 x1 x2",
        "max_tokens": 9,
        "cancelled": False,
    }
    assert t["messages"] == [
        {"role": "system", "content": "short"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": " w0 w1 w2 w3"},
        {"role": "user", "content": "second"},
    ]
    # The snapshot restores, and the restored session continues the same response and ids.
    restored = RealtimeSession.restore(t["realtime"], session=sid, default_max_tokens=16)
    assert restored.response_id == p.rt.response_id
    assert restored.deltas_sent == 3
    assert restored.messages() == p.rt.messages()
    nxt = restored.delta(" x3")[0].event
    want = p.rt.delta(" x3")[0].event
    assert nxt["response_id"] == want["response_id"] and nxt["item_id"] == want["item_id"]
    done = [e.event for e in restored.finish()][-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    ids = {e["event_id"] for e in p.sent}
    assert nxt["event_id"] not in ids  # new event ids never repeat one the client saw


def test_realtime_pending_events_are_queued_and_cancel_marks() -> None:
    sid = "rt2"
    j = Journal(1 << 20)
    p = RealtimePair(sid, j)
    p.client(user_item("q"))
    p.client({"type": "response.create"})
    p.out(p.rt.delta("a"))
    p.client({"type": "response.cancel"})
    t = j.transcript(sid)
    assert t["answer"]["cancelled"] is True and t["realtime"]["response"]["cancelling"] is True
    assert t["answer"]["max_tokens"] is None  # "inf": the worker's default
    # An event the worker answered with an error is not queued.
    p.client({"type": "input_audio_buffer.append", "audio": ""})
    assert j.transcript(sid)["queued"] == []
    # A client event the worker never answered (it died first) waits in queued.
    j.client(cframe(user_item("late")))
    assert [e["type"] for e in j.transcript(sid)["queued"]] == ["conversation.item.create"]


# -- the workers accept what the journal builds -------------------------------------------


def test_reference_worker_reads_the_chat_transcript() -> None:
    from backends.handoff import Transcript, read_state

    sid = "acc"
    j = Journal(1 << 20)
    j.worker(wframe({"type": "hello"}))
    j.client(cframe({"type": "prompt", "text": "one two"}))  # no max_tokens: the default
    j.worker(tokens(sid, 1, 3))
    j.client(cframe({"type": "prompt", "text": "next", "max_tokens": 4}))
    got = read_state(j.transcript(sid), session=sid, max_queued=16, max_tokens_limit=4096)
    assert isinstance(got, Transcript)
    snap = got.snapshot
    assert snap.answer is not None and snap.answer.produced == 3
    assert snap.answer.max_tokens == 64  # the reference worker's default
    assert list(snap.context) == ["one", "two", *(token_text(sid, 1, i) for i in range(3))]
    assert len(snap.queued) == 1 and snap.queued[0].max_tokens == 4


def test_reference_worker_restores_the_realtime_transcript() -> None:
    from backends.handoff import Transcript, read_state
    from backends.protocol.realtime import restore_transcript

    sid = "acc-rt"
    j = Journal(1 << 20)
    p = RealtimePair(sid, j)
    p.client(user_item("q"))
    p.client({"type": "response.create"})
    p.out(p.rt.delta(token_text(sid, 1, 0)))  # as the reference worker's first delta
    t = j.transcript(sid)
    got = read_state(t, session=sid, max_queued=16, max_tokens_limit=4096)
    assert isinstance(got, Transcript)
    rt = restore_transcript(t["realtime"], session=sid, messages=got.messages, answer=got.answer)
    assert rt.response_id == p.rt.response_id and rt.response_max_tokens == 64


def test_token_run_fast_path_agrees_with_the_general_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of plain tokens take the regex path; escapes, other keys, a gap or a new turn stop
    it; either way the transcript is the one JSON decoding gives."""
    from balancer import journal as journal_mod

    sid = "fast"
    body = tokens(sid, 1, 40, start=1)
    body += wframe({"type": "token", "turn": 1, "i": 40, "text": 'q"uote\\n'})  # escapes
    body += wframe({"type": "token", "turn": 1, "i": 41, "text": "ids", "ids": [1, 2]})
    body += tokens(sid, 1, 60, start=42) + wframe({"type": "done", "turn": 1, "tokens": 60})
    body += tokens(sid, 2, 30)  # the next turn, its prompt queued already

    def build() -> dict[str, Any]:
        j = Journal(1 << 20)
        j.worker(wframe({"type": "hello"}))
        j.client(cframe({"type": "prompt", "text": "a", "max_tokens": 60}))
        j.client(cframe({"type": "prompt", "text": "b", "max_tokens": 30}))
        j.worker(tokens(sid, 1, 1))  # the answer runs: the next fold may take the fast path
        rng = random.Random(3)
        feed_worker(j, body, rng)
        return j.transcript(sid)

    fast = build()
    monkeypatch.setattr(journal_mod._ChatFold, "token_run", lambda self, buf: 0)
    slow = build()
    assert fast == slow
    assert fast["answer"]["turn"] == 2 and fast["answer"]["i"] == 30
    assert 'q"uote\\n' in fast["messages"][1]["content"]


# -- the Responses API's WebSocket mode -----------------------------------------------------


class ResponsesPair:
    """The real Responses protocol session on the worker's side, its events relayed as frames
    through the journal, as wslb sees them."""

    def __init__(self, sid: str, journal: Journal) -> None:
        from backends.protocol.responses import ResponsesSession

        self.rs = ResponsesSession(sid, model="m", default_max_tokens=16)
        self.j = journal
        self.respond: Any = None

    def out(self, events: list[Any]) -> None:
        from backends.protocol.responses import Respond as ResponsesRespond

        for e in events:
            if isinstance(e, Send):
                self.j.worker(wframe(e.event))
            elif isinstance(e, ResponsesRespond):
                self.respond = e

    def client(self, event: dict[str, Any] | str) -> None:
        text = event if isinstance(event, str) else json.dumps(event)
        self.j.client(build_frame(OP_TEXT, text.encode(), mask=True))
        self.out(self.rs.receive(text, now=7.0))


def test_responses_transcript_is_the_workers_own_state() -> None:
    """Two chained responses, the second mid-stream, errors between: the transcript's
    ``responses`` is what the worker's own ``snapshot()`` holds, and it restores to a session
    that goes on with the same events."""
    from backends.protocol.responses import ResponsesSession, restore_transcript

    sid = "rs1"
    j = Journal(1 << 20)
    p = ResponsesPair(sid, j)
    p.client({"type": "response.create", "input": "first question", "instructions": "Be brief."})
    for n in range(3):
        p.out(p.rs.delta(f" w{n}"))
    p.out(p.rs.finish(now=8.0))
    first = p.rs.last_response_id
    p.client({"type": "response.create", "input": "x", "previous_response_id": "resp_nope"})
    p.client("{not json")
    p.client(
        {
            "type": "response.create",
            "input": [{"role": "developer", "content": [{"type": "input_text", "text": "d"}]}],
            "previous_response_id": first,
            "max_output_tokens": 9,
            "stream_id": "lane",
        }
    )
    p.client({"type": "response.create", "input": "while it runs"})  # an error: acked
    for n in range(2):
        p.out(p.rs.delta(f" x{n}"))
    t = j.transcript(sid)
    assert t["protocol"] == "openai-responses" and t["queued"] == []
    assert t["answer"] == {"turn": 2, "i": 2, "text": " x0 x1", "max_tokens": 9, "cancelled": False}
    assert t["messages"] == p.rs.messages()
    assert t["responses"] == p.rs.snapshot()
    restored = restore_transcript(
        t["responses"], session=sid, answer=TranscriptAnswer(2, 2, " x0 x1", 9)
    )
    assert [e.event for e in restored.delta(" x2")] == [e.event for e in p.rs.delta(" x2")]
    assert [e.event for e in restored.finish()] == [e.event for e in p.rs.finish()]
    assert isinstance(restored, ResponsesSession)


def test_responses_crash_before_the_first_answer_queues_the_request() -> None:
    """No greeting in this protocol: a worker lost before it answered the first
    ``response.create`` still gives a transcript, the request queued for the next worker."""
    sid = "rs2"
    j = Journal(1 << 20)
    create = {"type": "response.create", "input": "hi"}
    j.client(cframe(create))
    t = j.transcript(sid)
    assert t["protocol"] == "openai-responses" and t["queued"] == [create]
    assert t["answer"] is None and t["responses"]["last"] is None
    # An error as the first worker message is a Responses one too (no event_id).
    j = Journal(1 << 20)
    j.client(build_frame(OP_TEXT, b"{", mask=True))
    j.worker(
        wframe(
            {
                "type": "error",
                "status": 400,
                "error": {"type": "invalid_request_error", "message": "x"},
            }
        )
    )
    j.client(cframe(create))
    assert j.transcript(sid)["queued"] == [create]


def test_responses_continuing_an_unseen_response_loses_track() -> None:
    sid = "rs3"
    j = Journal(1 << 20)
    p = ResponsesPair(sid, j)
    p.client({"type": "response.create", "input": "one"})
    p.out(p.rs.finish())
    j2 = Journal(1 << 20)  # a new wslb session (a reconnect): the worker still holds "one"
    p.j = j2
    p.client(
        {"type": "response.create", "input": "two", "previous_response_id": p.rs.last_response_id}
    )
    with pytest.raises(JournalError) as e:
        j2.transcript(sid)
    assert e.value.reason == "lost_track"


def test_early_client_messages_of_a_chat_are_kept() -> None:
    """A client that writes before the worker's hello reached wslb: its prompt is not lost."""
    sid = "early"
    j = Journal(1 << 20)
    j.client(cframe({"type": "prompt", "text": "quick", "max_tokens": 3}))
    j.worker(wframe({"type": "hello"}))
    t = j.transcript(sid)
    assert t["protocol"] == "wslb-chat" and t["queued"] == [{"text": "quick", "max_tokens": 3}]


_RS_CLIENT = st.one_of(
    st.builds(
        lambda text, chain, limit: {
            k: v
            for k, v in {
                "type": "response.create",
                "input": text,
                "previous_response_id": "<<last>>" if chain else None,
                "max_output_tokens": limit,
            }.items()
            if v is not None
        },
        st.text(max_size=8),
        st.booleans(),
        st.sampled_from([None, 2, 0]),
    ),
    st.sampled_from(
        [
            {"type": "response.create", "input": "x", "previous_response_id": "resp_nope"},
            {"type": "response.create", "input": "x", "tools": [{"type": "function"}]},
            {"type": "response.steer", "input": "x", "previous_response_id": "r"},
            {"type": "what.ever"},
        ]
    ),
    st.sampled_from(["{", "[]"]),
)
_RS_STEP = st.one_of(
    st.tuples(st.just("client"), _RS_CLIENT),
    st.tuples(st.just("delta"), st.text(max_size=6)),
    st.tuples(st.just("finish"), st.none()),
    st.tuples(st.just("fail"), st.none()),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_RS_STEP, max_size=30))
def test_responses_journal_always_rebuilds_the_workers_state(steps: list[tuple[str, Any]]) -> None:
    """Whatever a client sends and however its responses end, the journal's transcript holds
    exactly the worker's Responses state (so a failover continues the same session)."""
    sid = "rs-any"
    j = Journal(1 << 22)
    p = ResponsesPair(sid, j)
    for kind, arg in steps:
        if kind == "client":
            text = arg if isinstance(arg, str) else json.dumps(arg)
            p.client(text.replace("<<last>>", p.rs.last_response_id or "resp_none"))
        elif p.rs.response_id is None:
            continue
        elif kind == "delta":
            p.out(p.rs.delta(arg))
        elif kind == "finish":
            p.out(p.rs.finish(now=9.0))
        else:
            p.out(p.rs.fail("engine: x"))
    if not steps or steps[0][0] != "client":
        return
    try:
        t = j.transcript(sid)
    except JournalError as e:  # only a worker that never answered: nothing to rebuild
        assert e.reason == "unknown_protocol", e
        return
    want = p.rs.snapshot()
    if t["responses"]["model"] is None:  # no response yet: the thawing worker's default
        want["model"] = None
    running = want["response"]
    if running is not None and running["max_output_tokens"] is None:
        running["max_tokens"] = None  # no client limit: the thawing worker's default
    assert t["responses"] == want
    assert t["messages"] == p.rs.messages() and t["queued"] == []


def test_realtime_refused_response_create_is_not_queued_behind_a_silent_cancel() -> None:
    """A cancel sent while its ``response.create`` waits is answered by nothing (the worker
    cancels the response), so the error refusing the next ``response.create`` answers that
    one: it must not stay queued for the next worker to run after a failover."""
    sid = "rt-cancel"
    j = Journal(1 << 20)
    p = RealtimePair(sid, j)
    p.client(user_item("q"))
    create, cancel = {"type": "response.create"}, {"type": "response.cancel"}
    # The three reach the worker before any of its answers reach wslb.
    for event in (create, cancel, create):
        j.client(cframe(event))
    for event in (create, cancel, create):
        p.out(p.rt.receive(json.dumps(event)))
    assert p.sent[-1]["type"] == "error"  # conversation_already_has_active_response
    t = j.transcript(sid)
    assert t["queued"] == [] and t["answer"]["cancelled"] is True
    # A cancel of a response that ended before the worker read it is refused
    # (response_cancel_not_active): that error answers the cancel, not the event behind it.
    p.out(p.rt.finish())
    p.client(create)
    j.client(cframe(cancel))
    j.client(cframe(user_item("late")))  # the worker dies before it reads this one
    p.out(p.rt.finish())
    p.out(p.rt.receive(json.dumps(cancel)))
    assert p.sent[-1]["error"]["code"] == "response_cancel_not_active"
    assert [e["type"] for e in j.transcript(sid)["queued"]] == ["conversation.item.create"]
