"""A journal as data (``Journal.snapshot`` / ``Journal.restore``): hot restart moves a live
session, its journal included, to a new process, so a journal rebuilt from its snapshot must go
on exactly as the one it describes.

The streams are each protocol's as the workers write them: the chat protocol from a small
worker model below (its queue, turns, cancels, engine errors and refusals as ``backends/``
sends them), Realtime and Responses from the real server-side protocols
(``backends.protocol``). A client's events reach the worker some time after wslb relayed them
(``deliver``), so the journal sees the two directions interleaved as in a real session. The
bytes are cut at arbitrary positions, partial frames, fragmented messages and pings included;
at any cut the journal is described, the description goes through JSON, and both journals are
fed the rest.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.model import token_text
from backends.protocol.realtime import RealtimeSession
from backends.protocol.realtime import Send as RtSend
from backends.protocol.responses import ResponsesSession
from backends.protocol.responses import Send as RsSend
from balancer.contract import (
    MAX_QUEUED_PROMPTS,
    ProtocolError,
    queue_full,
    read_prompt,
)
from balancer.frames import OP_BINARY, OP_CONT, OP_PING, OP_PONG, OP_TEXT, build_frame
from balancer.journal import COMPACT_AT, Journal, JournalError, _RealtimeFold

Trace = list[tuple[str, bytes]]  # ("w" worker to client | "c" client to worker, one frame)


def dumps(obj: object) -> bytes:
    """Compact, as the workers write (so chat tokens take the journal's fast path)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def fragments(payload: bytes, n: int, mask: bool) -> list[bytes]:
    """One text message as ``n`` frames (a first, continuations, the last with FIN)."""
    step = max(1, len(payload) // n)
    cuts = [payload[k : k + step] for k in range(0, len(payload), step)] or [b""]
    return [
        build_frame(OP_TEXT if k == 0 else OP_CONT, part, mask=mask, fin=k == len(cuts) - 1)
        for k, part in enumerate(cuts)
    ]


class Recorder:
    """The frames of a session in the order wslb relays them."""

    def __init__(self) -> None:
        self.trace: Trace = []

    def worker(self, payload: bytes, split: int = 1) -> None:
        """One message, as ``split`` fragments when more than 1."""
        frames = (
            fragments(payload, split, mask=False) if split > 1 else [build_frame(OP_TEXT, payload)]
        )
        self.trace.extend(("w", frame) for frame in frames)

    def client(self, payload: bytes, opcode: int = OP_TEXT) -> None:
        self.trace.append(("c", build_frame(opcode, payload, mask=True)))

    def control(self, side: str) -> None:
        """A ping from the worker or a pong from the client: relayed, not the conversation's."""
        if side == "w":
            self.trace.append(("w", build_frame(OP_PING, b"hb")))
        else:
            self.trace.append(("c", build_frame(OP_PONG, b"hb", mask=True)))


# -- a chat worker -------------------------------------------------------------------------


class ChatWorker:
    """The chat protocol as backends/worker.py speaks it: ``hello``; a prompt queue of
    ``MAX_QUEUED_PROMPTS`` behind the running answer, refused with ``queue_full`` past it;
    ``token`` and ``done`` per turn; ``cancel``; an engine ``error`` with its turn."""

    def __init__(self, sid: str, rec: Recorder) -> None:
        self.sid, self.rec = sid, rec
        self.inbox: deque[bytes] = deque()  # relayed, not read by the worker yet
        self.queue: deque[int] = deque()  # the queued prompts' max_tokens
        self.turns = 0
        self.running: list[int] | None = None  # [turn, produced, max_tokens]
        self.cancelled = False
        rec.worker(dumps({"type": "hello", "worker": "w1", "session": sid}))

    def send(self, obj: dict[str, Any] | bytes) -> None:
        payload = obj if isinstance(obj, bytes) else dumps(obj)
        self.rec.client(payload)
        self.inbox.append(payload)

    def deliver(self) -> None:
        if not self.inbox:
            return
        payload = self.inbox.popleft()
        try:
            obj = json.loads(payload)
        except ValueError:
            self.out({"type": "error", "error": "bad json"})
            return
        if not isinstance(obj, dict):
            self.out({"type": "error", "error": "not an object"})
        elif obj.get("type") == "prompt":
            try:
                prompt = read_prompt(obj)
            except ProtocolError as e:
                self.out({"type": "error", "error": str(e)})
                return
            if len(self.queue) >= MAX_QUEUED_PROMPTS:
                self.out(queue_full(self.turns + len(self.queue)))
                return
            self.queue.append(prompt.max_tokens if prompt.max_tokens is not None else 8)
        elif obj.get("type") == "cancel":
            turn = obj.get("turn")
            if self.running is not None and turn in (None, self.running[0]):
                self.cancelled = True
        else:
            self.out({"type": "error", "error": "unknown type"})

    def out(self, obj: dict[str, Any], split: int = 1) -> None:
        self.rec.worker(dumps(obj), split)

    def start(self) -> bool:
        if self.running is None and self.queue:
            self.turns += 1
            self.running = [self.turns, 0, self.queue.popleft()]
            self.cancelled = False
        return self.running is not None

    def tokens(self, n: int, split: int) -> None:
        if not self.start():
            return
        r = self.running
        assert r is not None
        for _ in range(n):
            if r[1] >= r[2] or self.cancelled:
                break
            text = token_text(self.sid, r[0], r[1])
            if r[1] % 7 == 3:
                text += ' "q"\n'  # an escape: off the fast path
            self.out({"type": "token", "turn": r[0], "i": r[1], "text": text}, split)
            r[1] += 1

    def done(self) -> None:
        if self.start():
            assert self.running is not None
            turn, produced, _ = self.running
            self.out({"type": "done", "turn": turn, "tokens": produced, "worker": "w1"})
            self.running = None

    def fail(self) -> None:
        if self.start():
            assert self.running is not None
            self.out({"type": "error", "error": "engine: down", "turn": self.running[0]})
            self.running = None


_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
_SPLIT = st.sampled_from([1, 1, 1, 3])  # frames per message: 3 is a fragmented one
_TOKENS = st.integers(0, 40)
# Each protocol has a ``turn`` step (a request the worker reads and answers with ``n`` tokens,
# then ``end``s: ``open`` is not yet), so a described journal is often in the middle of one;
# the steps a turn is made of also come alone, in any order.
_END = st.sampled_from(["finish", "fail", "cancel", "open"])


def step_kinds(turn: Any, *steps: Any) -> Any:
    """A protocol's steps, its turn three times as likely as each other step."""
    return st.one_of(turn, turn, turn, *steps)


# -- the chat protocol's stream ------------------------------------------------------------


_CHAT_PROMPT = st.one_of(
    st.builds(
        lambda text, n: {"type": "prompt", "text": text, "max_tokens": n},
        _TEXT,
        st.integers(0, 50),
    ),
    st.builds(
        lambda texts, t: {
            "type": "prompt",
            "messages": [{"role": "user", "content": x} for x in texts],
            **({"temperature": t} if t is not None else {}),
        },
        st.lists(_TEXT, min_size=1, max_size=3),
        st.sampled_from([None, 0.5, 1]),
    ),
    st.just({"type": "prompt", "text": "no limit"}),
    st.sampled_from(
        [
            {"type": "prompt", "max_tokens": -1, "text": "bad"},
            {"type": "prompt", "text": "a", "messages": []},
            {"type": "prompt"},
        ]
    ),
)
_CHAT_STEP = step_kinds(
    st.tuples(st.just("turn"), st.tuples(_CHAT_PROMPT, _TOKENS, _SPLIT, _END)),
    st.tuples(st.just("prompt"), _CHAT_PROMPT),
    st.tuples(st.just("burst"), st.integers(2, MAX_QUEUED_PROMPTS + 3)),  # a full queue
    st.tuples(st.just("deliver"), st.integers(1, 4)),
    st.tuples(st.just("tokens"), st.tuples(st.integers(1, 12), _SPLIT)),
    st.tuples(st.just("finish"), st.none()),
    st.tuples(st.just("fail"), st.none()),
    st.tuples(st.just("cancel"), st.sampled_from([None, 1, 2])),
    st.tuples(st.just("junk"), st.sampled_from([b"{not json", b"[]", b"\x00\x01"])),
    st.tuples(st.just("ping"), st.sampled_from(["w", "c"])),
)


def chat_trace(steps: list[tuple[str, Any]], early: bool) -> Trace:
    rec = Recorder()
    if early:  # a client that wrote before the worker's hello reached wslb
        rec.client(dumps({"type": "prompt", "text": "early", "max_tokens": 3}))
    w = ChatWorker("chat-s", rec)
    if early:
        w.inbox.append(dumps({"type": "prompt", "text": "early", "max_tokens": 3}))

    def step(kind: str, arg: Any) -> None:
        if kind == "turn":
            prompt, n, split, end = arg
            step("prompt", prompt)
            step("deliver", len(w.inbox))
            step("tokens", (n, split))
            if end == "cancel":
                step("cancel", None)
                step("deliver", len(w.inbox))
                step("finish", None)
            elif end != "open":
                step(end, None)
        elif kind == "prompt":
            w.send(arg)
        elif kind == "burst":
            for n in range(arg):
                w.send({"type": "prompt", "text": f"b{n}", "max_tokens": 2})
        elif kind == "deliver":
            for _ in range(arg):
                w.deliver()
        elif kind == "tokens":
            w.tokens(*arg)
        elif kind == "finish":
            w.done()
        elif kind == "fail":
            w.fail()
        elif kind == "cancel":
            w.send({"type": "cancel"} if arg is None else {"type": "cancel", "turn": arg})
        elif kind == "junk":
            if arg == b"\x00\x01":
                rec.client(arg, OP_BINARY)
            else:
                w.send(arg)
        else:
            rec.control(arg)

    for kind, arg in steps:
        step(kind, arg)
    return rec.trace


# -- Realtime ------------------------------------------------------------------------------


def user_item(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        },
    }


_RT_CREATE = st.sampled_from(
    [
        {"type": "response.create"},
        {"type": "response.create", "response": {"max_output_tokens": 3}},
        {"type": "response.create", "response": {"metadata": {"k": "v"}}},
    ]
)
_RT_CLIENT = st.one_of(
    st.builds(user_item, _TEXT),
    st.builds(
        lambda text: {
            "type": "session.update",
            "session": {"type": "realtime", "instructions": text},
        },
        _TEXT,
    ),
    _RT_CREATE,
    st.sampled_from(
        [
            {"type": "response.cancel"},
            {"type": "response.cancel", "response_id": "resp_other"},
            {"type": "input_audio_buffer.append", "audio": ""},
            {"type": "no.such.event"},
        ]
    ),
)
_RT_STEP = step_kinds(
    st.tuples(st.just("turn"), st.tuples(_TEXT, _RT_CREATE, _TOKENS, _SPLIT, _END)),
    st.tuples(st.just("client"), _RT_CLIENT),
    st.tuples(st.just("deliver"), st.integers(1, 4)),
    st.tuples(st.just("delta"), st.tuples(_TEXT, _SPLIT)),
    st.tuples(st.just("finish"), st.none()),
    st.tuples(st.just("fail"), st.none()),
    st.tuples(st.just("error"), st.sampled_from(["engine_error", None])),
    st.tuples(st.just("ping"), st.sampled_from(["w", "c"])),
)


def realtime_trace(steps: list[tuple[str, Any]]) -> Trace:
    rec = Recorder()
    rt = RealtimeSession("rt-s", model="m", default_max_tokens=16)
    inbox: deque[str] = deque()

    def out(events: list[Any], split: int = 1) -> None:
        for e in events:
            if isinstance(e, RtSend):
                rec.worker(dumps(e.event), split)

    def step(kind: str, arg: Any) -> None:
        if kind == "turn":
            text, create, n, split, end = arg
            step("client", user_item(text))
            step("client", create)
            step("deliver", len(inbox))
            for k in range(n):
                step("delta", (f" w{k}", split))
            if end == "cancel":
                step("client", {"type": "response.cancel"})
                step("deliver", len(inbox))
            if end != "open":
                step("fail" if end == "fail" else "finish", None)
        elif kind == "client":
            text = json.dumps(arg)
            rec.client(text.encode())
            inbox.append(text)
        elif kind == "deliver":
            for _ in range(min(arg, len(inbox))):
                out(rt.receive(inbox.popleft()))
        elif kind == "ping":
            rec.control(arg)
        elif kind == "error":
            out(rt.error("engine: down", code=arg))
        elif rt.response_id is None:
            return
        elif kind == "delta":
            out(rt.delta(arg[0]), arg[1])
        elif kind == "fail":  # as the engine bridge ends a response its engine failed
            out(rt.error("engine: down", code="engine_error"))
            out(rt.finish("incomplete"))
        else:
            out(rt.finish())

    out(rt.opened())
    for kind, arg in steps:
        step(kind, arg)
    return rec.trace


# -- Responses -----------------------------------------------------------------------------


def create(text: str, chain: bool, limit: int | None) -> dict[str, Any]:
    """A ``response.create``; ``chain``: continuing the last response, with instructions."""
    obj: dict[str, Any] = {"type": "response.create", "input": text}
    if chain:
        obj |= {"previous_response_id": "<<last>>", "instructions": "short"}
    if limit is not None:
        obj["max_output_tokens"] = limit
    return obj


_RS_CREATE = st.builds(create, _TEXT, st.booleans(), st.sampled_from([None, 2, 16]))
_RS_CLIENT = st.one_of(
    _RS_CREATE,
    st.sampled_from(
        [
            {"type": "response.create", "input": "x", "previous_response_id": "resp_nope"},
            {"type": "response.create", "input": "x", "tools": [{"type": "function"}]},
            {"type": "what.ever"},
            "{",
            "[]",
        ]
    ),
)
_RS_STEP = step_kinds(
    st.tuples(st.just("turn"), st.tuples(_RS_CREATE, _TOKENS, _SPLIT, _END)),
    st.tuples(st.just("client"), _RS_CLIENT),
    st.tuples(st.just("deliver"), st.integers(1, 4)),
    st.tuples(st.just("delta"), st.tuples(_TEXT, _SPLIT)),
    st.tuples(st.just("finish"), st.none()),
    st.tuples(st.just("fail"), st.none()),
    st.tuples(st.just("ping"), st.sampled_from(["w", "c"])),
)


def responses_trace(steps: list[tuple[str, Any]]) -> Trace:
    rec = Recorder()
    rs = ResponsesSession("rs-s", model="m", default_max_tokens=16)
    inbox: deque[str] = deque()

    def out(events: list[Any], split: int = 1) -> None:
        for e in events:
            if isinstance(e, RsSend):
                rec.worker(dumps(e.event), split)

    def step(kind: str, arg: Any) -> None:
        if kind == "turn":
            request, n, split, end = arg
            step("client", request)
            step("deliver", len(inbox))
            for k in range(n):
                step("delta", (f" w{k}", split))
            if end != "open":
                step("fail" if end == "fail" else "finish", None)
        elif kind == "client":
            text = arg if isinstance(arg, str) else json.dumps(arg)
            text = text.replace("<<last>>", rs.last_response_id or "resp_none")
            rec.client(text.encode())
            inbox.append(text)
        elif kind == "deliver":
            for _ in range(min(arg, len(inbox))):
                out(rs.receive(inbox.popleft(), now=7.0))
        elif kind == "ping":
            rec.control(arg)
        elif rs.response_id is None:
            return
        elif kind == "delta":
            out(rs.delta(arg[0]), arg[1])
        elif kind == "finish":
            out(rs.finish(now=8.0))
        else:
            out(rs.fail("engine: down"))

    for kind, arg in steps:
        step(kind, arg)
    return rec.trace


# -- the property ----------------------------------------------------------------------------


def reads(trace: Trace, cuts: list[int]) -> list[tuple[str, bytes]]:
    """The trace as the relay hands it on: each direction's consecutive frames as one byte
    run, cut into reads of the sizes ``cuts`` gives in turn (none: a run is one read), so a
    read ends mid-header, mid-payload or between frames."""
    runs: list[tuple[str, bytearray]] = []
    for side, frame in trace:
        if runs and runs[-1][0] == side:
            runs[-1][1].extend(frame)
        else:
            runs.append((side, bytearray(frame)))
    out: list[tuple[str, bytes]] = []
    k = 0
    for side, run in runs:
        pos = 0
        while pos < len(run):
            n = 1 + cuts[k % len(cuts)] % max(1, len(run) - pos) if cuts else len(run)
            k += 1
            out.append((side, bytes(run[pos : pos + n])))
            pos += n
    return out


def feed(j: Journal, chunks: list[tuple[str, bytes]]) -> None:
    for side, data in chunks:
        if side == "w":
            j.worker(data)
        else:
            j.client(data)


def outcome(j: Journal) -> Any:
    """The transcript failover would build, or why it cannot."""
    try:
        return j.transcript(j.sid)
    except JournalError as e:
        return ("error", e.reason, e.detail)


def trouble(j: Journal) -> Any:
    return None if j.trouble is None else (j.trouble.reason, j.trouble.detail)


def round_trip(j: Journal) -> tuple[Journal, dict[str, Any], str]:
    """Snapshot, through JSON text (as it crosses processes), restored."""
    snap = j.snapshot()
    text = json.dumps(snap)
    data = json.loads(text)
    assert data == snap
    restored = Journal.restore(data)
    assert restored.snapshot() == data
    assert restored.size == j.size and restored.protocol == j.protocol
    assert trouble(restored) == trouble(j) and restored.over == j.over
    return restored, snap, text


def check_moves(trace: Trace, cuts: list[int], at: tuple[int, bool], limit: int, sid: str) -> None:
    """``at``: where in the reads the journal is described (a percentage of them), and whether
    it folded what it holds first (else the worker's latest frames are still raw bytes)."""
    chunks = reads(trace, cuts)
    k = at[0] * len(chunks) // 100
    j = Journal(limit, sid)
    feed(j, chunks[:k])
    if at[1]:
        j.fold()
    restored, snap, text = round_trip(j)
    feed(j, chunks[k:])
    feed(restored, chunks[k:])
    # Neither shares anything with the snapshot: both went on, it did not.
    assert snap == json.loads(text)
    assert restored.snapshot() == j.snapshot()
    for jj in (j, restored):
        jj.fold()
    assert restored.size == j.size and restored.protocol == j.protocol
    assert trouble(restored) == trouble(j) and restored.folded == j.folded
    assert outcome(restored) == outcome(j)
    if limit > len(b"".join(d for _, d in chunks)):
        # And the stream in whole runs, never described, gives the same. (Near
        # its limit a journal's giving up depends on when reads come, so not there.)
        whole = Journal(limit, sid)
        feed(whole, reads(trace, []))
        assert outcome(whole) == outcome(j)


_CUTS = st.lists(st.integers(0, 400), min_size=1, max_size=40)  # read sizes, in turn
_AT = st.tuples(st.integers(0, 100), st.booleans())  # where: a percentage of the reads
_LIMIT = st.sampled_from([1 << 22, 1 << 22, 1 << 22, 600, 3000])
_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(st.lists(_CHAT_STEP, min_size=3, max_size=40), st.booleans(), _CUTS, _AT, _LIMIT)
def test_chat_journal_moves_at_any_byte(
    steps: list[tuple[str, Any]], early: bool, cuts: list[int], at: tuple[int, bool], limit: int
) -> None:
    check_moves(chat_trace(steps, early), cuts, at, limit, "chat-s")


@_SETTINGS
@given(st.lists(_RT_STEP, min_size=3, max_size=40), _CUTS, _AT, _LIMIT)
def test_realtime_journal_moves_at_any_byte(
    steps: list[tuple[str, Any]], cuts: list[int], at: tuple[int, bool], limit: int
) -> None:
    check_moves(realtime_trace(steps), cuts, at, limit, "rt-s")


@_SETTINGS
@given(st.lists(_RS_STEP, min_size=3, max_size=40), _CUTS, _AT, _LIMIT)
def test_responses_journal_moves_at_any_byte(
    steps: list[tuple[str, Any]], cuts: list[int], at: tuple[int, bool], limit: int
) -> None:
    check_moves(responses_trace(steps), cuts, at, limit, "rs-s")


# -- the streams reach the states the snapshot must hold --------------------------------------


def test_a_long_chat_answer_mid_frame_and_mid_message() -> None:
    """Past ``COMPACT_AT`` (folded along the way), described inside a fragmented token."""
    rec = Recorder()
    w = ChatWorker("long", rec)
    w.send({"type": "prompt", "text": "go", "max_tokens": 600})
    w.send({"type": "prompt", "text": "next", "max_tokens": 2})
    w.deliver()
    w.deliver()
    w.tokens(500, 1)
    w.tokens(2, 3)
    chunks = reads(rec.trace, [])
    data = b"".join(d for side, d in chunks if side == "w")
    assert len(data) > 2 * COMPACT_AT
    j = Journal(1 << 22, "long")
    feed(j, [c for c in chunks if c[0] == "c"])
    j.worker(data[:-7])  # the last fragment's frame, cut
    j.fold()
    snap = j.snapshot()
    assert snap["w"]["parts"] and snap["w"]["buf"]  # a message's parts, a frame's start
    fold = snap["fold"]
    assert fold["answer"]["i"] == 501 and fold["answer"]["rollback"] is None
    assert [p["text"] for p in fold["pending"]] == ["next"]
    restored = Journal.restore(json.loads(json.dumps(snap)))
    for jj in (j, restored):
        jj.worker(data[-7:])
    assert outcome(restored) == outcome(j)
    assert outcome(j)["answer"]["i"] == 502


def test_realtime_snapshot_holds_items_response_and_waiting_events() -> None:
    steps: list[tuple[str, Any]] = [
        (
            "client",
            {"type": "session.update", "session": {"type": "realtime", "instructions": "brief"}},
        ),
        ("client", user_item("q")),
        ("client", {"type": "response.create", "response": {"metadata": {"k": "v"}}}),
        ("deliver", 3),
        ("delta", ("a", 1)),
        ("client", {"type": "response.cancel"}),
        ("client", {"type": "response.create"}),
    ]
    j = Journal(1 << 22, "rt-s")
    feed(j, reads(realtime_trace(steps), []))
    fold = j.snapshot()["fold"]
    assert fold["instructions"] == "brief" and fold["chunks"] == ["a"]
    assert fold["response"]["cancelling"] is True and fold["response"]["metadata"] == {"k": "v"}
    assert [e["type"] for e in fold["pending"]] == ["response.create"]
    assert [i["role"] for i in fold["items"]] == ["user", "assistant"]
    restored = Journal.restore(json.loads(json.dumps(j.snapshot())))
    assert outcome(restored) == outcome(j)
    # by_id is rebuilt: the index of items, so an item updated by id is updated in items.
    rt = restored._fold
    assert isinstance(rt, _RealtimeFold)
    assert rt.by_id and all(rt.by_id[i["id"]] is i for i in rt.items)


# -- the journals that cannot give a transcript, and the empty one ---------------------------


def test_an_empty_journal() -> None:
    j = Journal(1234, "e")
    restored, snap, _ = round_trip(j)
    assert snap["fold"] is None and snap["protocol"] is None and snap["trouble"] is None
    assert restored.limit == 1234 and restored.sid == "e" and restored.size == 0
    assert (
        outcome(restored)
        == outcome(j)
        == ("error", "unknown_protocol", "the worker sent nothing yet")
    )


def test_a_journal_over_its_limit_stays_over() -> None:
    j = Journal(300, "o")
    j.worker(build_frame(OP_TEXT, dumps({"type": "hello"})))
    j.client(build_frame(OP_TEXT, dumps({"type": "prompt", "text": "x" * 400}), mask=True))
    assert j.over
    restored, snap, _ = round_trip(j)
    assert snap["over"] is True and snap["fold"] is None
    assert snap["protocol"] == "wslb-chat" and snap["trouble"]["reason"] == "journal_over_limit"
    for jj in (j, restored):
        jj.worker(build_frame(OP_TEXT, dumps({"type": "token", "turn": 1, "i": 0, "text": "a"})))
        jj.fold()
        assert jj.size == 0
    assert outcome(restored) == outcome(j) and outcome(j)[1] == "journal_over_limit"


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        ([dumps({"type": "greeting"})], "unknown_protocol"),
        (
            [dumps({"type": "hello"}), dumps({"type": "token", "turn": 1, "i": 0, "text": "x"})],
            "lost_track",
        ),
    ],
)
def test_a_journal_with_trouble_keeps_it(stream: list[bytes], reason: str) -> None:
    j = Journal(1 << 20, "t")
    for payload in stream:
        j.worker(build_frame(OP_TEXT, payload))
    j.client(build_frame(OP_TEXT, dumps({"type": "prompt", "text": "a"}), mask=True))
    assert j.trouble is not None and j.trouble.reason == reason
    restored, snap, _ = round_trip(j)
    assert snap["trouble"] == {"reason": reason, "detail": j.trouble.detail}
    assert isinstance(restored.trouble, JournalError) and str(restored.trouble) == str(j.trouble)
    assert outcome(restored) == outcome(j)


def test_a_lone_surrogate_survives() -> None:
    """A client's ``\\ud800`` escape decodes to a lone surrogate, which JSON text (ASCII) keeps."""
    j = Journal(1 << 20, "u")
    j.worker(build_frame(OP_TEXT, dumps({"type": "hello"})))
    j.client(build_frame(OP_TEXT, b'{"type":"prompt","text":"\\ud800"}', mask=True))
    restored, snap, _ = round_trip(j)
    assert snap["fold"]["pending"][0]["text"] == "\ud800"
    assert outcome(restored) == outcome(j)


# -- a snapshot it cannot read ------------------------------------------------------------------


def _good() -> dict[str, Any]:
    """A snapshot with every part filled: a chat answer running, a prompt queued."""
    j = Journal(1 << 20, "g")
    j.worker(build_frame(OP_TEXT, dumps({"type": "hello"})))
    j.client(
        build_frame(OP_TEXT, dumps({"type": "prompt", "text": "a", "max_tokens": 5}), mask=True)
    )
    j.client(build_frame(OP_TEXT, dumps({"type": "prompt", "text": "b"}), mask=True))
    j.worker(build_frame(OP_TEXT, dumps({"type": "token", "turn": 1, "i": 0, "text": "x"})))
    j.fold()
    j.worker(build_frame(OP_TEXT, b'{"type":"tok', fin=False)[:-2])
    return j.snapshot()


def _without(path: str) -> dict[str, Any]:
    data = _good()
    *head, last = path.split(".")
    at: Any = data
    for key in head:
        at = at[int(key)] if isinstance(at, list) else at[key]
    del at[last]
    return data


def _with(path: str, value: Any) -> dict[str, Any]:
    data = _good()
    *head, last = path.split(".")
    at: Any = data
    for key in head:
        at = at[int(key)] if isinstance(at, list) else at[key]
    at[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "journal snapshot must be an object, not a JSON array"),
        ({}, "version None is not the one this wslb reads"),
        (_with("v", 2), "version 2 is not the one this wslb reads"),
        (_with("v", True), "version True"),
        (_without("limit"), "journal snapshot: limit is missing"),
        (_without("fold.answer.parts"), "fold.answer.parts is missing"),
        (_without("fold.pending.0.text"), r"fold.pending\[0\].text is missing"),
        (_without("w"), "w is missing"),
        (_without("c.buf"), "c.buf is missing"),
        (_with("w.buf", "not base64!"), "w.buf must be base64"),
        (_with("w.masked", True), "w.masked must be false"),
        (_with("w.opcode", 8), "w.opcode must be 0, 1 or 2"),
        (_with("folded", -1), "folded must be a non-negative integer, not -1"),
        (_with("protocol", "smtp"), "protocol must be wslb-chat or"),
        (_with("trouble", "lost"), "trouble must be an object or null"),
        (_with("fold.messages", [{"role": 1}]), "fold.messages must be a list of messages"),
        (_with("fold.answer.cancelled", "no"), "fold.answer.cancelled must be true or false"),
        (_with("fold.pending.0.messages", []), r"fold.pending\[0\] must have a text or messages"),
        (_with("early", [1]), "early must be a list of objects and nulls"),
    ],
)
def test_a_snapshot_it_cannot_read(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Journal.restore(data)


def test_an_event_fold_snapshot_it_cannot_read() -> None:
    steps: list[tuple[str, Any]] = [
        ("client", {"type": "response.create", "input": "q"}),
        ("deliver", 1),
        ("delta", ("a", 1)),
    ]
    j = Journal(1 << 22, "rs-s")
    feed(j, reads(responses_trace(steps), []))
    j.fold()
    data = j.snapshot()
    assert Journal.restore(data).snapshot() == data
    data["fold"]["response"]["surprise"] = 1
    with pytest.raises(ValueError, match=r"fold\.response\.surprise is not a known field"):
        Journal.restore(data)
    del data["fold"]["response"]["surprise"]
    del data["fold"]["response"]["seq"]
    with pytest.raises(ValueError, match=r"fold\.response\.seq is missing"):
        Journal.restore(data)
    data = j.snapshot()
    data["protocol"] = None
    with pytest.raises(ValueError, match="a fold without a protocol"):
        Journal.restore(data)
