"""The Responses API WebSocket mode module (``backends.protocol.responses``), without a network.

Every server event the module emits is validated strictly against the installed SDK's own
``openai.types.responses.ResponsesServerEvent`` (the union ``client.responses.connect()``
parses), the stream events also against ``ResponseStreamEvent``, and must carry no field the
SDK does not know, so what the official client parses is what the module means.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import ResponsesServerEvent, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from backends.handoff import StateError, TranscriptAnswer
from backends.protocol.responses import (
    Output,
    Respond,
    ResponsesSession,
    ResponsesStateError,
    Send,
    restore_transcript,
)

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(ResponsesServerEvent)
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SID = "sess-responses-1"
START = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _extras(model: object, where: str = "event") -> list[str]:
    """Fields the SDK's models kept as extras (unknown to them), anywhere in ``model``."""
    found: list[str] = []
    if isinstance(model, BaseModel):
        found += [f"{where}.{k}" for k in model.model_extra or {}]
        for name in type(model).model_fields:
            found += _extras(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for n, value in enumerate(model):
            found += _extras(value, f"{where}[{n}]")
    return found


def valid(outputs: Sequence[Output]) -> list[Output]:
    """Check every ``Send`` against the SDK (strictly, through its JSON text); return them."""
    for out in outputs:
        if isinstance(out, Send):
            wire = json.loads(out.text())
            assert wire == out.event
            model = SERVER_EVENT.validate_python(wire, strict=True)
            assert model.type == out.type
            assert not _extras(model), (out.event, _extras(model))
            if out.type != "error":
                assert STREAM_EVENT.validate_python(wire, strict=True).type == out.type
        else:
            assert isinstance(out, Respond)
    return list(outputs)


def sends(outputs: Sequence[Output]) -> list[dict[str, Any]]:
    return [o.event for o in valid(outputs) if isinstance(o, Send)]


def types(outputs: Sequence[Output]) -> list[str]:
    return [e["type"] for e in sends(outputs)]


def create(**fields: Any) -> str:
    return json.dumps({"type": "response.create", **fields})


def start(
    s: ResponsesSession, now: float = 0.0, **fields: Any
) -> tuple[list[dict[str, Any]], Respond]:
    out = s.receive(create(**fields), now=now)
    assert types(out) == START, out
    assert isinstance(out[-1], Respond)  # the action comes after the events announcing it
    return sends(out), out[-1]


def stream(s: ResponsesSession, texts: Sequence[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in texts:
        events = sends(s.delta(t))
        assert [e["type"] for e in events] == ["response.output_text.delta"]
        out += events
    return out


def roundtrip(state: dict[str, Any]) -> Any:
    return json.loads(json.dumps(state))


def test_two_turns_chained_by_previous_response_id() -> None:
    s = ResponsesSession(SID, model="sim-1", default_max_tokens=8)
    assert s.opened() == []  # no greeting: the first event answers the first response.create
    events, act = start(s, now=100.0, input="hello there", instructions="Be brief.")
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["created_at"] == 100.0
    assert created["model"] == "sim-1" and created["instructions"] == "Be brief."
    assert act.response_id == created["id"] and act.max_tokens == 8
    assert act.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    stream(s, ["Hi", " you"])
    end = sends(s.finish(input_tokens=4, cached_tokens=0, now=101.0))
    assert [e["type"] for e in end] == [*END, "response.completed"]
    assert end[0]["text"] == "Hi you"
    done = end[-1]["response"]
    assert done["status"] == "completed" and done["completed_at"] == 101.0
    assert done["output"][0]["content"][0]["text"] == "Hi you"
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 0
    first = done["id"]
    assert s.last_response_id == first and s.response_id is None

    # The next turn sends only the new input: the conversation continues, instructions do not.
    events, act = start(
        s, input=[{"role": "user", "content": "and then?"}], previous_response_id=first
    )
    assert events[0]["response"]["previous_response_id"] == first
    assert act.messages == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "Hi you"},
        {"role": "user", "content": "and then?"},
    ]
    assert act.response_id != first
    stream(s, ["More"])
    done = sends(s.finish(input_tokens=9, cached_tokens=6))[-1]["response"]
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 6
    assert done["usage"]["total_tokens"] == 10 and done["usage"]["output_tokens"] == 1


def test_without_previous_response_id_a_new_conversation_starts() -> None:
    s = ResponsesSession(SID)
    start(s, input="one")
    s.finish()
    _, act = start(s, input="two")
    assert act.messages == [{"role": "user", "content": "two"}]


def test_sequence_numbers_count_within_each_response_and_stream_id_is_echoed() -> None:
    s = ResponsesSession(SID)
    events, _ = start(s, input="x", stream_id="lane-7")
    events += stream(s, ["a", "b"]) + sends(s.finish())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["stream_id"] == "lane-7" for e in events)
    events, _ = start(s, input="y")
    assert events[0]["sequence_number"] == 0 and "stream_id" not in events[0]


def test_input_items_roles_and_parts() -> None:
    s = ResponsesSession(SID)
    _, act = start(
        s,
        input=[
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "system", "content": [{"type": "input_text", "text": "more rules"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "type": "message",
                "id": "msg_old",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "prior answer", "annotations": []}],
            },
        ],
    )
    assert act.messages == [
        {"role": "system", "content": "rules"},
        {"role": "system", "content": "more rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "prior answer"},
    ]


def test_max_output_tokens_reached_is_incomplete() -> None:
    s = ResponsesSession(SID, default_max_tokens=64)
    _, act = start(s, input="x", max_output_tokens=2)
    assert act.max_tokens == 2
    stream(s, ["a", "b"])
    end = sends(s.finish())
    assert end[-1]["type"] == "response.incomplete"
    resp = end[-1]["response"]
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["status"] == "incomplete" and resp["max_output_tokens"] == 2
    # An incomplete response can be continued.
    _, act = start(s, input="go on", previous_response_id=resp["id"])
    assert act.messages[1] == {"role": "assistant", "content": "ab"}
    # Without a client limit, the worker's default ends a response completed.
    s.finish(output_tokens=64)
    _, act = start(s, input="y")
    assert act.max_tokens == 64
    assert sends(s.finish(output_tokens=64))[-1]["type"] == "response.completed"


def test_previous_response_not_found() -> None:
    s = ResponsesSession(SID)
    (err,) = sends(s.receive(create(input="x", previous_response_id="resp_nope")))
    assert err["type"] == "error" and err["status"] == 400
    assert err["error"]["code"] == "previous_response_not_found"
    assert err["error"]["param"] == "previous_response_id"
    start(s, input="one")
    first = sends(s.finish())[-1]["response"]["id"]
    start(s, input="two", previous_response_id=first)
    second = sends(s.finish())[-1]["response"]["id"]
    # Only the last response is held (as OpenAI's connection-local cache): the older one is gone.
    (err,) = sends(s.receive(create(input="three", previous_response_id=first)))
    assert err["error"]["code"] == "previous_response_not_found"
    # A failed response cannot be continued; the one before it still can.
    start(s, input="three", previous_response_id=second)
    failed = sends(s.fail("engine: boom"))
    assert [e["type"] for e in failed] == ["response.failed"]
    f = failed[0]["response"]
    assert f["status"] == "failed" and f["error"] == {
        "code": "server_error",
        "message": "engine: boom",
    }
    (err,) = sends(s.receive(create(input="x", previous_response_id=f["id"])))
    assert err["error"]["code"] == "previous_response_not_found"
    assert s.last_response_id == second
    start(s, input="retry", previous_response_id=second)


def test_second_create_while_one_runs_is_an_error_and_the_first_goes_on() -> None:
    s = ResponsesSession(SID)
    _, act = start(s, input="x")
    stream(s, ["a"])
    (err,) = sends(s.receive(create(input="y")))
    assert err["error"]["code"] == "conversation_already_has_active_response"
    assert s.response_id == act.response_id
    assert sends(s.delta("b"))[0]["sequence_number"] == 5  # the response's numbering goes on
    assert sends(s.finish())[0]["text"] == "ab"


BAD: list[tuple[str, str]] = [
    ("{not json", "invalid_json"),
    ("[]", "invalid_json"),
    (json.dumps({"input": "x"}), "missing_required_parameter"),
    (json.dumps({"type": 7}), "invalid_type"),
    (json.dumps({"type": "response.cancel"}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {}}), "invalid_value"),
    (
        json.dumps({"type": "response.steer", "previous_response_id": "r", "input": "x"}),
        "unsupported_feature",
    ),
    (
        create(input="x", tools=[{"type": "function", "name": "f", "parameters": {}}]),
        "unsupported_feature",
    ),
    (create(input="x", tool_choice="required"), "unsupported_feature"),
    (
        create(input=[{"type": "function_call_output", "call_id": "c", "output": "1"}]),
        "unsupported_feature",
    ),
    (create(input=[{"type": "item_reference", "id": "msg_1"}]), "unsupported_feature"),
    (
        create(
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
        ),
        "unsupported_feature",
    ),
    (
        create(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
        "unsupported_feature",
    ),
    (create(input="x", background=True), "unsupported_feature"),
    (create(input="x", generate=False), "unsupported_feature"),
    (create(input="x", conversation="conv_1"), "unsupported_feature"),
    (create(input="x", prompt={"id": "p"}), "unsupported_feature"),
    (create(input="x", text={"format": {"type": "json_object"}}), "unsupported_feature"),
    (create(input="x", max_output_tokens=0), "invalid_value"),
    (create(input="x", max_output_tokens="inf"), "invalid_value"),
    (create(input="x", max_output_tokens=10**9), "invalid_value"),
    (create(input="x", temperature=3), "invalid_value"),
    (create(input="x", metadata={"a": 1}), "invalid_type"),
    (create(input="x", model=5), "invalid_type"),
    (create(input="x", nonsense=1), "unknown_parameter"),
    (create(input=5), "invalid_type"),
    (create(input=[{"role": "robot", "content": "x"}]), "invalid_value"),
    (create(input=[{"content": "x"}]), "missing_required_parameter"),
    (create(input=[{"role": "user"}]), "missing_required_parameter"),
    (create(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "invalid_type"),
    (create(input=[{"role": "user", "content": "x", "extra": 1}]), "unknown_parameter"),
    (create(), "missing_required_parameter"),
    (create(input=[]), "missing_required_parameter"),
]


@pytest.mark.parametrize(("text", "code"), BAD)
def test_each_bad_message_gets_one_error_and_the_session_goes_on(text: str, code: str) -> None:
    s = ResponsesSession(SID)
    start(s, input="first")
    s.finish()
    before = s.snapshot()
    (err,) = sends(s.receive(text))
    assert err["type"] == "error" and err["status"] == 400 and "sequence_number" not in err
    assert err["error"]["code"] == code and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"]
    assert s.snapshot() == before
    start(s, input="still there?", previous_response_id=s.last_response_id)


def test_accepted_fields_change_nothing() -> None:
    s = ResponsesSession(SID)
    events, act = start(
        s,
        input="x",
        model="gpt-5.5",
        store=False,
        stream=True,
        tools=[],
        tool_choice="none",
        text={"format": {"type": "text"}},
        metadata={"k": "v"},
        temperature=0.5,
        user="u",
        truncation="auto",
        include=[],
        prompt_cache_key="pk",
        generate=True,
        background=False,
    )
    resp = events[0]["response"]
    assert resp["model"] == "gpt-5.5" and resp["metadata"] == {"k": "v"}
    assert resp["temperature"] == 0.5 and act.temperature == 0.5


def test_errors_during_a_response_leave_it_running_and_binary() -> None:
    s = ResponsesSession(SID)
    start(s, input="x")
    stream(s, ["a"])
    for text in ("{", json.dumps({"type": "nope"})):
        assert types(s.receive(text)) == ["error"]
    assert types(s.binary()) == ["error"]
    stream(s, ["b"])
    assert sends(s.finish())[0]["text"] == "ab"


def test_shell_errors_are_server_errors() -> None:
    s = ResponsesSession(SID)
    (err,) = sends(s.error("boom", code="x"))
    assert err["status"] == 500 and err["error"]["type"] == "server_error"


def test_abort_drops_the_running_response() -> None:
    s = ResponsesSession(SID)
    start(s, input="one")
    first = sends(s.finish())[-1]["response"]["id"]
    start(s, input="two", previous_response_id=first)
    stream(s, ["partial"])
    s.abort()
    assert s.response_id is None and s.last_response_id == first
    s.abort()  # idle: nothing
    start(s, input="two again", previous_response_id=first)


def test_delta_finish_or_fail_while_idle_is_a_caller_bug() -> None:
    s = ResponsesSession(SID)
    with pytest.raises(RuntimeError):
        s.delta("x")
    with pytest.raises(RuntimeError):
        s.finish()
    with pytest.raises(RuntimeError):
        s.fail("x")
    start(s, input="x")
    with pytest.raises(ValueError):
        s.finish("cancelled")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.finish(input_tokens=-1)


def test_migration_mid_response_is_one_unbroken_response() -> None:
    """Snapshot after two deltas, restore elsewhere: the same events as without the move."""
    a = ResponsesSession(SID, model="m")
    b = ResponsesSession(SID, model="m")
    for s in (a, b):
        start(s, input="one")
        s.finish()
        start(s, now=5.0, input="two", previous_response_id=s.last_response_id, max_output_tokens=4)
        stream(s, ["x", "y"])
    moved = ResponsesSession.restore(roundtrip(a.snapshot()), session=SID)
    assert moved.deltas_sent == 2 and moved.response_max_tokens == 4
    assert moved.response_id == b.response_id
    assert moved.messages() == b.messages()
    rest_a = stream(moved, ["z", "w"]) + sends(moved.finish())
    rest_b = stream(b, ["z", "w"]) + sends(b.finish())
    assert rest_a == rest_b
    assert rest_a[-1]["type"] == "response.incomplete"
    assert rest_a[-4]["text"] == "xyzw"
    # And the chain goes on from the restored session.
    _, act = start(moved, input="three", previous_response_id=moved.last_response_id)
    assert act.messages[-2] == {"role": "assistant", "content": "xyzw"}


def test_unsent_events_travel_with_the_state() -> None:
    s = ResponsesSession(SID)
    out = s.receive(create(input="x"))
    events = [o for o in out if isinstance(o, Send)]
    moved = ResponsesSession.restore(roundtrip(s.snapshot(unsent=events[2:])))
    assert [e.event for e in moved.resumed()] == [e.event for e in events[2:]]
    assert moved.resumed() == []
    assert sends(moved.delta("a"))[0]["sequence_number"] == 4


def test_idle_state_roundtrips() -> None:
    s = ResponsesSession(SID, model="m")
    start(s, input="x", instructions="sys")
    s.finish()
    state = s.snapshot()
    assert ResponsesSession.restore(roundtrip(state)).snapshot() == state
    fresh = ResponsesSession(SID).snapshot()
    assert ResponsesSession.restore(fresh).snapshot() == fresh


def _running_state() -> dict[str, Any]:
    s = ResponsesSession(SID)
    start(s, input="x")
    stream(s, ["a"])
    state: dict[str, Any] = roundtrip(s.snapshot())
    return state


@pytest.mark.parametrize(
    ("where", "spoil"),
    [
        ("state.v", lambda s: s.update(v=2)),
        ("state.session", lambda s: s.update(session="other")),
        ("state.counters", lambda s: s.update(counters=None)),
        ("state.counters.responses", lambda s: s["counters"].update(responses=-1)),
        ("state.last", lambda s: s.update(last=[])),
        ("state.last.id", lambda s: s.update(last={"id": "", "messages": []})),
        (
            "state.last.messages[0].role",
            lambda s: s.update(last={"id": "r", "messages": [{"role": "x", "content": ""}]}),
        ),
        ("state.response.id", lambda s: s["response"].update(id=3)),
        ("state.response.created_at", lambda s: s["response"].update(created_at="now")),
        ("state.response.max_output_tokens", lambda s: s["response"].update(max_output_tokens=0)),
        ("state.response.max_tokens", lambda s: s["response"].update(max_tokens=10**9)),
        ("state.response.metadata", lambda s: s["response"].update(metadata={"a": 1})),
        ("state.response.temperature", lambda s: s["response"].update(temperature=9)),
        ("state.response.text", lambda s: s["response"].update(deltas=0)),
        ("state.response.seq", lambda s: s["response"].update(seq=None)),
        ("state.response.messages", lambda s: s["response"].update(messages={})),
        ("state.response.stream_id", lambda s: s["response"].update(stream_id=1)),
        ("state.unsent[0].type", lambda s: s.update(unsent=[{}])),
    ],
)
def test_restore_rejects_a_bad_state_naming_the_field(where: str, spoil: Any) -> None:
    state = _running_state()
    spoil(state)
    with pytest.raises(ResponsesStateError) as e:
        ResponsesSession.restore(state, session=SID)
    assert where in str(e.value), str(e.value)
    assert isinstance(e.value, StateError)  # a thaw answers 400


def test_restore_transcript_checks_the_answer() -> None:
    state = _running_state()
    answer = TranscriptAnswer(1, 1, "a", 64)
    rs = restore_transcript(copy.deepcopy(state), session=SID, answer=answer)
    assert rs.deltas_sent == 1
    with pytest.raises(ResponsesStateError, match=r"state\.responses is required"):
        restore_transcript(None, session=SID, answer=answer)
    with pytest.raises(ResponsesStateError, match="both be set or null"):
        restore_transcript(copy.deepcopy(state), session=SID, answer=None)
    with pytest.raises(ResponsesStateError, match="differs"):
        restore_transcript(
            copy.deepcopy(state), session=SID, answer=TranscriptAnswer(1, 1, "b", 64)
        )
    state["response"]["seq"] = -1
    with pytest.raises(ResponsesStateError, match=r"state\.responses\.response\.seq"):
        restore_transcript(state, session=SID, answer=answer)


def test_restored_counters_never_repeat_the_held_ids() -> None:
    """A journal may have seen fewer responses than the worker made (an earlier connection):
    the next ids skip those the state holds."""
    s = ResponsesSession(SID)
    start(s, input="x")
    state = roundtrip(s.snapshot())
    state["counters"] = {"responses": 0, "items": 0}
    moved = ResponsesSession.restore(state)
    moved.finish()
    _, act = start(moved, input="y")
    assert act.response_id != state["response"]["id"]


# -- any sequence of client events and engine outcomes ------------------------------------

_TEXT = st.text(max_size=12)
_ITEM = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _TEXT),
    st.builds(
        lambda t: {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": t}],
        },
        _TEXT,
    ),
    st.just({"type": "function_call_output", "call_id": "c", "output": "1"}),
    st.just({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}),
    st.just({"role": "nobody", "content": "x"}),
)
PREVIOUS = "<<last>>"
_CLIENT = st.one_of(
    st.builds(
        lambda inp, prev, m, ins: create(
            **{
                k: v
                for k, v in {
                    "input": inp,
                    "previous_response_id": prev,
                    "max_output_tokens": m,
                    "instructions": ins,
                }.items()
                if v is not None
            }
        ),
        st.one_of(st.none(), _TEXT, st.lists(_ITEM, max_size=3)),
        st.sampled_from([None, PREVIOUS, PREVIOUS, "resp_nope"]),
        st.sampled_from([None, None, 1, 3, 0, "inf"]),
        st.one_of(st.none(), _TEXT),
    ),
    st.sampled_from(
        [
            create(input="x", tools=[{"type": "function", "name": "f"}]),
            json.dumps({"type": "response.steer", "input": "x", "previous_response_id": "r"}),
            json.dumps({"type": "what.ever"}),
            "[]",
            "{",
            "null",
        ]
    ),
    st.text(max_size=30),
)
_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "client": _CLIENT,
    "delta": _TEXT,
    "finish": st.sampled_from([None, None, "completed", "incomplete"]),
    "fail": st.just("engine: gone"),
    "abort": st.just(None),
    "migrate": st.just(None),
    "binary": st.just(None),
}
_KINDS = ["client"] * 4 + ["delta"] * 4 + ["finish", "fail", "abort", "migrate", "binary"]
_STEP = st.sampled_from(_KINDS).flatmap(lambda kind: st.tuples(st.just(kind), _ARGS[kind]))


def _apply(s: ResponsesSession, kind: str, arg: Any) -> tuple[ResponsesSession, list[Output]]:
    """One step; a migration returns the restored session (and no events)."""
    if kind == "client":
        return s, valid(
            s.receive(arg.replace(PREVIOUS, s.last_response_id or "resp_none"), now=1.0)
        )
    if kind == "binary":
        return s, valid(s.binary())
    if kind == "migrate":
        return ResponsesSession.restore(roundtrip(s.snapshot()), default_max_tokens=4), []
    if kind == "abort":
        s.abort()  # idle: nothing
        return s, []
    if s.response_id is None:  # a caller's bug, never a client's
        with pytest.raises(RuntimeError):
            if kind == "delta":
                s.delta(arg)
            elif kind == "finish":
                s.finish(arg)
            else:
                s.fail(arg)
        return s, []
    if kind == "delta":
        return s, valid(s.delta(arg))
    if kind == "finish":
        return s, valid(s.finish(arg, now=2.0))
    return s, valid(s.fail(arg))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, max_size=40), st.integers(min_value=0, max_value=40))
def test_any_sequence_keeps_the_protocol(steps: list[tuple[str, Any]], cut: int) -> None:
    """The session never raises for a client's input; every response ends in exactly one
    terminal event (or an abort); a snapshot taken at step ``cut`` and restored gives the same
    remaining events as the session that was not moved."""
    s = ResponsesSession(SID, model="m", default_max_tokens=4)
    seen: list[Output] = []
    twin: ResponsesSession | None = None
    twin_seen: list[Output] = []
    running: str | None = None
    aborted = 0
    for n, (kind, arg) in enumerate(steps):
        if n == cut:
            twin = ResponsesSession.restore(roundtrip(s.snapshot()), default_max_tokens=4)
        was = s.response_id
        s, out = _apply(s, kind, arg)
        seen += out
        if twin is not None:
            twin, twin_out = _apply(twin, kind, arg)
            twin_seen += twin_out
            assert [o.event if isinstance(o, Send) else o for o in twin_out] == [
                o.event if isinstance(o, Send) else o for o in out
            ]
        acts = [o for o in out if isinstance(o, Respond)]
        if acts:
            assert was is None and len(acts) == 1, "a second response while one runs"
            running = acts[0].response_id
            assert all(set(m) == {"role", "content"} for m in acts[0].messages)
        if kind == "abort" and was is not None:
            aborted += 1
            running = None
        if any(isinstance(o, Send) and o.type in TERMINAL for o in out):
            running = None
        assert s.response_id == running
    events = [o.event for o in seen if isinstance(o, Send)]
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    ended = [e["response"]["id"] for e in events if e["type"] in TERMINAL]
    assert len(set(created)) == len(created)
    assert len(set(ended)) == len(ended) and set(ended) <= set(created)
    assert len(created) == len(ended) + aborted + (running is not None)
    for e in events:  # the errors that answer a client message carry no sequence number
        assert (e["type"] == "error") == ("sequence_number" not in e)
