"""The OpenAI Realtime protocol module (``backends.protocol.realtime``), without a network.

Every server event the module emits is validated strictly against the installed SDK's own
``openai.types.realtime.RealtimeServerEvent`` (and must carry no field the SDK does not know),
so what the official client parses is what the module means.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.realtime import RealtimeServerEvent
from pydantic import BaseModel, TypeAdapter

from backends.handoff import StateError
from backends.model import Prompt, token_text, words
from backends.protocol.realtime import (
    Cancel,
    Output,
    RealtimeSession,
    RealtimeStateError,
    Respond,
    Send,
)

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
SID = "sess-realtime-1"

START = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]
END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


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
        else:
            assert isinstance(out, Respond | Cancel)
    return list(outputs)


def sends(outputs: Sequence[Output]) -> list[dict[str, Any]]:
    return [o.event for o in valid(outputs) if isinstance(o, Send)]


def types(outputs: Sequence[Output]) -> list[str]:
    return [e["type"] for e in sends(outputs)]


def actions(outputs: Sequence[Output]) -> list[Respond | Cancel]:
    return [o for o in outputs if isinstance(o, Respond | Cancel)]


def msg(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def user(text: str, previous: str | None = None, **item: Any) -> str:
    fields: dict[str, Any] = {} if previous is None else {"previous_item_id": previous}
    return msg(
        "conversation.item.create",
        item={
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
            **item,
        },
        **fields,
    )


def new_session(**kw: Any) -> RealtimeSession:
    s = RealtimeSession(SID, model="sim-1", **kw)
    assert types(s.opened()) == ["session.created"]
    return s


def idle(s: RealtimeSession) -> bool:
    """No response running (a call, so mypy does not keep an earlier narrowing)."""
    return s.response_id is None


def start(s: RealtimeSession, **response: Any) -> tuple[list[dict[str, Any]], Respond]:
    out = s.receive(msg("response.create", **({"response": response} if response else {})))
    acts = actions(out)
    assert types(out) == START
    assert len(acts) == 1 and isinstance(acts[0], Respond)
    assert isinstance(out[-1], Respond)  # the action comes after the events announcing it
    return sends(out), acts[0]


def tokens(turn: int, n: int, first: int = 0) -> list[str]:
    """Delta texts as a worker sends them: the model's tokens, space-separated."""
    return [("" if i == 0 else " ") + token_text(SID, turn, i) for i in range(first, first + n)]


def stream(s: RealtimeSession, texts: Sequence[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in texts:
        events = sends(s.delta(t))
        assert [e["type"] for e in events] == ["response.output_text.delta"]
        out += events
    return out


def one_error(out: Sequence[Output], code: str | None = None) -> dict[str, Any]:
    events = sends(out)
    assert [e["type"] for e in events] == ["error"], events
    assert not actions(out)
    err = events[0]["error"]
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


def full_turn(s: RealtimeSession, text: str, n: int, turn: int) -> list[dict[str, Any]]:
    """A user item then a whole response (model turn ``turn``, ``n`` tokens): every event."""
    events = sends(s.receive(user(text)))
    begun, _ = start(s)
    return events + begun + stream(s, tokens(turn, n)) + sends(s.finish())


# -- the happy path -----------------------------------------------------------------------


def test_session_created_is_the_default_text_session() -> None:
    s = RealtimeSession(SID, model="sim-1")
    (event,) = sends(s.opened())
    assert event["type"] == "session.created"
    assert event["session"] == {
        "type": "realtime",
        "model": "sim-1",
        "output_modalities": ["text"],
        "instructions": "",
        "max_output_tokens": "inf",
    }
    assert "model" not in sends(RealtimeSession(SID).opened())[0]["session"]


def test_two_turns_map_onto_the_chat_conversation() -> None:
    s = new_session()
    added = sends(s.receive(user("hello there", id="u1")))
    assert [e["type"] for e in added] == ["conversation.item.added", "conversation.item.done"]
    assert added[0]["item"] == {
        "id": "u1",
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello there"}],
    }
    assert added[0]["previous_item_id"] is None

    begun, respond = start(s)
    rid, item_id = respond.response_id, begun[1]["item"]["id"]
    assert respond.messages == [{"role": "user", "content": "hello there"}]
    assert respond.max_tokens == 64  # "inf": the worker's default
    assert begun[0]["response"]["status"] == "in_progress"
    assert begun[0]["response"]["id"] == rid and begun[0]["response"]["output"] == []
    assert begun[2]["previous_item_id"] == "u1" and begun[2]["item"]["status"] == "in_progress"
    assert begun[3]["part"] == {"type": "text", "text": ""}
    assert s.response_id == rid

    texts = tokens(1, 5)
    deltas = stream(s, texts)
    assert [d["delta"] for d in deltas] == texts
    assert all(d["response_id"] == rid and d["item_id"] == item_id for d in deltas)
    assert all(d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)

    end = sends(s.finish(input_tokens=2, cached_tokens=0))
    assert [e["type"] for e in end] == END
    joined = "".join(texts)
    assert end[0]["text"] == joined and end[1]["part"] == {"type": "text", "text": joined}
    for e in (end[2], end[3]):
        assert e["item"]["status"] == "completed"
        assert e["item"]["content"] == [{"type": "output_text", "text": joined}]
    response = end[4]["response"]
    assert response["status"] == "completed" and response["status_details"] is None
    assert response["output"] == [end[2]["item"]]
    assert response["usage"]["output_tokens"] == 5 and response["usage"]["total_tokens"] == 7
    assert idle(s)

    sends(s.receive(user("and then?")))
    _, second = start(s)
    assert second.response_id != rid
    assert second.messages == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": joined},
        {"role": "user", "content": "and then?"},
    ]
    # The chat protocol's messages prompt of turn 2 extends turn 1's context, so the KV
    # cache's prefix still matches: the answer's words are the model's tokens.
    turn1 = [*words("hello there"), *(token_text(SID, 1, i) for i in range(5))]
    prompt = Prompt.from_messages(m["content"] for m in second.messages)
    assert list(prompt.words[: len(turn1)]) == turn1
    stream(s, tokens(2, 3))
    sends(s.finish())


def test_ids_and_event_ids_are_unique_and_deterministic() -> None:
    def run() -> list[dict[str, Any]]:
        s = new_session()
        return full_turn(s, "a b", 3, 1) + full_turn(s, "c", 2, 2)

    first, again = run(), run()
    assert first == again
    ids = [e["event_id"] for e in first]
    assert len(set(ids)) == len(ids)
    other = RealtimeSession("another-session")
    assert sends(other.opened())[0]["event_id"] not in ids


def test_session_update_instructions_and_max_output_tokens() -> None:
    s = new_session()
    (updated,) = sends(
        s.receive(
            msg(
                "session.update",
                event_id="c1",
                session={
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "instructions": "be brief",
                    "max_output_tokens": 7,
                    "tools": [],
                    "tool_choice": "auto",
                    "audio": {"output": {"voice": "marin"}},
                },
            )
        )
    )
    assert updated["type"] == "session.updated"
    assert updated["session"]["instructions"] == "be brief"
    assert updated["session"]["max_output_tokens"] == 7
    sends(s.receive(user("hi")))
    _, respond = start(s)
    assert respond.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert respond.max_tokens == 7
    sends(s.finish())
    # Per response: instructions and max_output_tokens override the session's.
    _, respond = start(s, instructions="other", max_output_tokens=2, metadata={"k": "v"})
    assert respond.messages[0] == {"role": "system", "content": "other"}
    assert respond.max_tokens == 2
    assert sends(s.finish())[-1]["response"]["metadata"] == {"k": "v"}


def test_item_positions_roles_and_ids() -> None:
    s = new_session()
    sends(s.receive(user("second", id="b")))
    (root, _) = sends(s.receive(user("first", "root", id="a")))
    assert root["previous_item_id"] is None
    system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]}
    (mid, _) = sends(s.receive(msg("conversation.item.create", item=system, previous_item_id="a")))
    assert mid["previous_item_id"] == "a" and mid["item"]["id"].startswith("item_")
    prior = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "earlier answer"}],
    }
    (said, _) = sends(s.receive(msg("conversation.item.create", item=prior)))
    assert said["previous_item_id"] == "b"
    assert said["item"]["content"] == [{"type": "output_text", "text": "earlier answer"}]
    assert s.messages() == [
        {"role": "user", "content": "first"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "earlier answer"},
    ]
    err = one_error(s.receive(user("dup", id="a")), "invalid_value")
    assert err["param"] == "item.id"
    err = one_error(s.receive(user("x", id="y" * 33)), "invalid_value")
    err = one_error(s.receive(user("x", "nope")), "invalid_value")
    assert err["param"] == "previous_item_id"
    assert len(s.messages()) == 4


def test_items_created_while_a_response_runs_follow_its_item() -> None:
    s = new_session()
    sends(s.receive(user("q")))
    start(s)
    stream(s, ["x"])
    (added, _) = sends(s.receive(user("meanwhile")))
    assert added["previous_item_id"] is not None
    stream(s, [" y"])
    sends(s.finish())
    assert s.messages() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "x y"},
        {"role": "user", "content": "meanwhile"},
    ]


# -- cancel and limits --------------------------------------------------------------------


def test_cancel_ends_the_response_cancelled_with_its_partial_text() -> None:
    s = new_session()
    sends(s.receive(user("q")))
    _, respond = start(s)
    stream(s, tokens(1, 2))
    out = s.receive(msg("response.cancel", event_id="c9"))
    assert out == [Cancel(respond.response_id)]
    assert s.cancel_requested
    assert s.receive(msg("response.cancel")) == []  # already on its way
    one_error(s.receive(msg("response.create")), "conversation_already_has_active_response")
    stream(s, tokens(1, 1, first=2))  # a token already under way still arrives
    end = sends(s.finish())
    assert [e["type"] for e in end] == END
    done = end[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert end[2]["item"]["status"] == "incomplete"
    assert s.messages()[-1] == {"role": "assistant", "content": "".join(tokens(1, 3))}
    assert idle(s) and s.snapshot()["response"] is None
    full_turn(s, "again", 2, 2)


def test_cancel_by_response_id() -> None:
    s = new_session()
    _, respond = start(s)
    err = one_error(s.receive(msg("response.cancel", response_id="resp_other")))
    assert err["code"] == "response_cancel_not_active" and err["param"] == "response_id"
    assert s.receive(msg("response.cancel", response_id=respond.response_id)) == [
        Cancel(respond.response_id)
    ]
    assert sends(s.finish())[-1]["response"]["status"] == "cancelled"


def test_cancel_with_nothing_running_is_an_error() -> None:
    s = new_session()
    err = one_error(s.receive(msg("response.cancel", event_id="evt-1")))
    assert err["code"] == "response_cancel_not_active" and err["event_id"] == "evt-1"


def test_max_output_tokens_reached_is_incomplete() -> None:
    s = new_session()
    sends(s.receive(user("q")))
    begun, respond = start(s, max_output_tokens=3)
    assert respond.max_tokens == 3 and begun[0]["response"]["max_output_tokens"] == 3
    stream(s, tokens(1, 3))
    end = sends(s.finish())
    assert end[-1]["response"]["status"] == "incomplete"
    assert end[-1]["response"]["status_details"] == {
        "type": "incomplete",
        "reason": "max_output_tokens",
    }
    assert end[2]["item"]["status"] == "incomplete"
    # The worker's default ("inf") ends the answer naturally: completed.
    _, respond = start(s)
    stream(s, ["z"] * respond.max_tokens)
    assert sends(s.finish())[-1]["response"]["status"] == "completed"
    # An engine's own stop reason wins.
    start(s, max_output_tokens=3)
    stream(s, ["a"])
    assert sends(s.finish("incomplete"))[-1]["response"]["status"] == "incomplete"


@pytest.mark.parametrize("value", [0, -1, 4097, "lots", True, 1.5])
def test_bad_max_output_tokens(value: object) -> None:
    s = new_session()
    one_error(s.receive(msg("response.create", response={"max_output_tokens": value})))
    assert s.response_id is None
    session = {"type": "realtime", "max_output_tokens": value}
    one_error(s.receive(msg("session.update", session=session)))
    assert sends(s.opened())[0]["session"]["max_output_tokens"] == "inf"


def test_second_response_create_gets_openais_error() -> None:
    s = new_session()
    _, respond = start(s)
    err = one_error(s.receive(msg("response.create", event_id="again")))
    assert err == {
        "type": "invalid_request_error",
        "code": "conversation_already_has_active_response",
        "message": "Conversation already has an active response in progress: "
        f"{respond.response_id}. Wait until the response is finished before creating a new one.",
        "param": None,
        "event_id": "again",
    }
    assert s.response_id == respond.response_id
    stream(s, ["still"])
    assert sends(s.finish())[0]["text"] == "still"


def test_delta_or_finish_while_idle_is_a_caller_bug() -> None:
    s = new_session()
    with pytest.raises(RuntimeError):
        s.delta("x")
    with pytest.raises(RuntimeError):
        s.finish()
    start(s)
    with pytest.raises(ValueError):
        s.finish("failed")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.finish(input_tokens=-1)
    assert s.response_id is not None


# -- errors: one error event, the session goes on -----------------------------------------

AUDIO_PART = {"type": "input_audio", "audio": "AAAA"}
ERRORS: list[tuple[str, str]] = [
    ("not json", "invalid_json"),
    ("", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    ("null", "invalid_json"),
    ('"response.create"', "invalid_json"),
    ("[" * 100_000, "invalid_json"),
    ('{"type": "response.create", "x": ' + "9" * 5000 + "}", "invalid_json"),
    (
        '{"type": "session.update", "session": {"type": ' + "[" * 900 + "]" * 900 + "}}",
        "invalid_value",
    ),
    ("{}", "missing_required_parameter"),
    ('{"type": 5}', "invalid_type"),
    (msg("response.create", event_id=7), "invalid_type"),
    (msg("no.such.event"), "invalid_value"),
    (msg("response.create", surprise=1), "unknown_parameter"),
    (msg("response.create", response=[]), "invalid_type"),
    (msg("response.create", response={"output_modalities": ["audio"]}), "unsupported_modality"),
    (msg("response.create", response={"conversation": "none"}), "unsupported_feature"),
    (msg("response.create", response={"input": []}), "unsupported_feature"),
    (msg("response.create", response={"tools": [{"type": "function"}]}), "unsupported_feature"),
    (msg("response.create", response={"metadata": {"k": 1}}), "invalid_type"),
    (msg("input_audio_buffer.append", audio="AAAA"), "unsupported_modality"),
    (msg("input_audio_buffer.commit"), "unsupported_modality"),
    (msg("input_audio_buffer.clear"), "unsupported_modality"),
    (msg("output_audio_buffer.clear"), "unsupported_modality"),
    (msg("conversation.item.delete", item_id="x"), "unsupported_feature"),
    (msg("conversation.item.truncate"), "unsupported_feature"),
    (msg("session.update"), "missing_required_parameter"),
    (msg("session.update", session={}), "missing_required_parameter"),
    (msg("session.update", session={"type": "transcription"}), "unsupported_feature"),
    (msg("session.update", session={"type": "voice"}), "invalid_value"),
    (msg("session.update", session={"type": "realtime", "bogus": 1}), "unknown_parameter"),
    (
        msg("session.update", session={"type": "realtime", "output_modalities": ["audio"]}),
        "unsupported_modality",
    ),
    (
        msg("session.update", session={"type": "realtime", "output_modalities": ["video"]}),
        "invalid_value",
    ),
    (msg("session.update", session={"type": "realtime", "instructions": 3}), "invalid_type"),
    (msg("conversation.item.create"), "missing_required_parameter"),
    (msg("conversation.item.create", item="hi"), "invalid_type"),
    (msg("conversation.item.create", item={"type": "function_call"}), "unsupported_feature"),
    (
        msg("conversation.item.create", item={"type": "message", "role": "tool", "content": []}),
        "invalid_value",
    ),
    (
        msg("conversation.item.create", item={"type": "message", "role": "user"}),
        "missing_required_parameter",
    ),
    (
        msg(
            "conversation.item.create",
            item={"type": "message", "role": "user", "content": [AUDIO_PART]},
        ),
        "unsupported_modality",
    ),
    (
        msg(
            "conversation.item.create",
            item={"type": "message", "role": "user", "content": [{"type": "input_image"}]},
        ),
        "unsupported_feature",
    ),
    (
        msg(
            "conversation.item.create",
            item={"type": "message", "role": "user", "content": [{"type": "input_text"}]},
        ),
        "missing_required_parameter",
    ),
    (
        msg(
            "conversation.item.create",
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": 1}],
            },
        ),
        "invalid_type",
    ),
    (
        msg(
            "conversation.item.create",
            item={
                "type": "message",
                "role": "assistant",
                "content": [{"type": "input_text", "text": "x"}],
            },
        ),
        "invalid_value",
    ),
    (msg("response.cancel"), "response_cancel_not_active"),
]


@pytest.mark.parametrize(("text", "code"), ERRORS, ids=[f"{n}" for n in range(len(ERRORS))])
def test_each_bad_message_gets_one_error_and_the_session_goes_on(text: str, code: str) -> None:
    s = new_session()
    sends(s.receive(user("before")))
    before = s.snapshot()
    err = one_error(s.receive(text), code)
    assert err["type"] == "invalid_request_error" and err["message"]
    after = s.snapshot()
    assert after["items"] == before["items"] and after["response"] is None
    assert after["instructions"] == before["instructions"]
    full_turn(s, "after", 2, 1)
    assert s.messages()[-1]["content"] == "".join(tokens(1, 2))


def test_audio_errors_name_the_audio_modality_and_echo_the_event_id() -> None:
    s = new_session()
    err = one_error(s.receive(msg("input_audio_buffer.append", audio="AA", event_id="e1")))
    assert "audio" in err["message"] and err["event_id"] == "e1"
    session = {"type": "realtime", "output_modalities": ["audio"]}
    err = one_error(s.receive(msg("session.update", session=session, event_id="e2")))
    assert "audio" in err["message"] and err["param"] == "session.output_modalities"
    assert err["event_id"] == "e2"


def test_errors_during_a_response_leave_it_running() -> None:
    s = new_session()
    _, respond = start(s)
    stream(s, ["a"])
    for text, code in ERRORS:
        if code != "response_cancel_not_active":  # a cancel would be fine now
            one_error(s.receive(text), code)
    stream(s, [" b"])
    end = sends(s.finish())
    assert end[0]["text"] == "a b" and end[-1]["response"]["id"] == respond.response_id


def test_binary_and_oversized_messages() -> None:
    s = new_session()
    assert one_error(s.binary(), "invalid_message")["message"]
    err = one_error(s.too_large(2_000_000, 1_048_576), "message_too_large")
    assert "2000000" in err["message"] and "1048576" in err["message"]
    full_turn(s, "fine", 1, 1)


def test_shell_errors() -> None:
    s = new_session()
    err = one_error(s.error("worker shutting down", code="shutting_down"), "shutting_down")
    assert err["type"] == "server_error"


# -- handoff ------------------------------------------------------------------------------


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(json.dumps(state))
    return value


def test_migration_mid_response_is_one_unbroken_response() -> None:
    old = new_session()
    seen = full_turn(old, "first", 2, 1)
    seen += sends(old.receive(user("tell me more")))
    begun, respond = start(old, max_output_tokens=6)
    seen += begun + stream(old, tokens(2, 4))

    state = roundtrip(old.snapshot())
    new = RealtimeSession.restore(state, session=SID)
    assert new.response_id == respond.response_id and new.deltas_sent == 4
    assert new.response_max_tokens == 6 and new.messages() == old.messages()
    assert new.resumed() == []
    seen += stream(new, tokens(2, 2, first=4))
    end = sends(new.finish())
    seen += end

    ids = [e["event_id"] for e in seen]
    assert len(set(ids)) == len(ids)
    mine = [e for e in seen if e.get("response_id") == respond.response_id]
    deltas = [e["delta"] for e in mine if e["type"] == "response.output_text.delta"]
    assert deltas == tokens(2, 6)
    done = [e for e in seen if e["type"] == "response.done"]
    assert [d["response"]["id"] for d in done][-1] == respond.response_id and len(done) == 2
    assert end[0]["text"] == "".join(deltas)
    assert end[-1]["response"]["status"] == "incomplete"  # 6 of max_output_tokens 6
    assert end[2]["item"]["id"] == begun[1]["item"]["id"]
    # Identical to a session that never moved.
    still = new_session()
    same = full_turn(still, "first", 2, 1) + sends(still.receive(user("tell me more")))
    more, _ = start(still, max_output_tokens=6)
    same += more + stream(still, tokens(2, 6)) + sends(still.finish())
    assert same == seen


def test_unsent_events_travel_with_the_state() -> None:
    old = new_session()
    sends(old.receive(user("q")))
    out = old.receive(msg("response.create"))
    batch = [o for o in out if isinstance(o, Send)]
    written, unsent = batch[:2], batch[2:]  # the freeze came between two writes
    new = RealtimeSession.restore(roundtrip(old.snapshot(unsent)))
    assert [o.event for o in new.resumed()] == [o.event for o in unsent]
    assert new.resumed() == []
    assert [o.type for o in written + unsent] == START
    stream(new, ["a"])
    assert sends(new.finish())[0]["text"] == "a"
    # Events not handed out yet are carried again by the next snapshot.
    again = RealtimeSession.restore(roundtrip(old.snapshot(unsent)))
    twice = RealtimeSession.restore(roundtrip(again.snapshot()))
    assert [o.event for o in twice.resumed()] == [o.event for o in unsent]


def test_a_cancel_in_flight_survives_migration() -> None:
    old = new_session()
    start(old)
    stream(old, ["a"])
    old.receive(msg("response.cancel"))
    new = RealtimeSession.restore(roundtrip(old.snapshot()))
    assert new.cancel_requested
    assert new.receive(msg("response.cancel")) == []
    assert sends(new.finish())[-1]["response"]["status"] == "cancelled"


def test_idle_state_roundtrips() -> None:
    s = new_session()
    sends(s.receive(msg("session.update", session={"type": "realtime", "instructions": "hi"})))
    full_turn(s, "q", 3, 1)
    state = roundtrip(s.snapshot())
    back = RealtimeSession.restore(state, default_max_tokens=64, max_tokens_limit=4096)
    assert back.snapshot() == state
    assert sends(back.opened()) == sends(s.opened())  # same ids, same session object


def _mid_response_state() -> dict[str, Any]:
    s = new_session()
    sends(s.receive(user("q")))
    start(s, max_output_tokens=5, metadata={"a": "b"})
    stream(s, ["x"])
    return roundtrip(s.snapshot())


BAD_STATES: list[tuple[str, Any]] = [
    ("state must be an object", lambda d: []),
    ("state.v", lambda d: d.update(v=2)),
    ("state.session", lambda d: d.update(session="")),
    ("state.session is", lambda d: d.update(session="someone-else")),
    ("state.model", lambda d: d.update(model=1)),
    ("state.instructions", lambda d: d.update(instructions=None)),
    ("state.max_output_tokens", lambda d: d.update(max_output_tokens=0)),
    ("state.max_output_tokens", lambda d: d.update(max_output_tokens=10**9)),
    ("state.counters", lambda d: d.update(counters=[])),
    ("state.counters.events", lambda d: d["counters"].update(events=-1)),
    ("state.counters.responses", lambda d: d["counters"].update(responses=0)),
    ("state.items", lambda d: d.update(items={})),
    ("state.items[0]", lambda d: d["items"].__setitem__(0, "x")),
    ("state.items[0].id", lambda d: d["items"][0].update(id="")),
    ("state.items[1].id", lambda d: d["items"][1].update(id=d["items"][0]["id"])),
    ("state.items[0].role", lambda d: d["items"][0].update(role="tool")),
    ("state.items[0].status", lambda d: d["items"][0].update(status="done")),
    ("state.items[0].content", lambda d: d["items"][0].update(content=[1])),
    ("in_progress with no response", lambda d: d.update(response=None)),
    ("state.response must", lambda d: d.update(response=[])),
    ("state.response.id", lambda d: d["response"].update(id=None)),
    ("state.response.item_id", lambda d: d["response"].update(item_id=d["items"][0]["id"])),
    ("no content yet", lambda d: d["items"][1].update(content=["x"])),
    ("state.response.max_output_tokens", lambda d: d["response"].update(max_output_tokens="x")),
    ("state.response.max_tokens", lambda d: d["response"].update(max_tokens=-3)),
    ("state.response.max_tokens", lambda d: d["response"].update(max_tokens=5000)),
    ("state.response.limited", lambda d: d["response"].update(limited=1)),
    ("state.response.metadata", lambda d: d["response"].update(metadata={"a": 1})),
    ("state.response.text", lambda d: d["response"].update(text=None)),
    ("state.response.deltas", lambda d: d["response"].update(deltas="1")),
    ("before any delta", lambda d: d["response"].update(deltas=0)),
    ("state.response.cancelling", lambda d: d["response"].update(cancelling=None)),
    ("state.unsent must", lambda d: d.update(unsent={})),
    ("state.unsent[0]", lambda d: d.update(unsent=[5])),
    ("state.unsent[0].event_id", lambda d: d.update(unsent=[{"type": "error"}])),
]


@pytest.mark.parametrize(("field", "spoil"), BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_restore_rejects_a_bad_state_naming_the_field(field: str, spoil: Any) -> None:
    state = _mid_response_state()
    assert RealtimeSession.restore(copy.deepcopy(state), session=SID).response_id
    changed = spoil(state)
    bad = changed if isinstance(changed, list) else state
    with pytest.raises(RealtimeStateError, match=field.replace("[", r"\[").replace("]", r"\]")):
        RealtimeSession.restore(bad, session=SID)
    assert issubclass(RealtimeStateError, StateError) and issubclass(StateError, ValueError)


# -- any sequence: never an exception, always valid events, one response at a time --------

_TEXT = st.text(max_size=12)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("input_text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("output_text"), "text": _TEXT}),
    st.just(AUDIO_PART),
    st.dictionaries(st.sampled_from(["type", "text", "x"]), _TEXT, max_size=3),
)
_ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["message", "message", "function_call"]),
        "role": st.sampled_from(["user", "user", "system", "assistant", "tool"]),
        "content": st.lists(_PART, max_size=3),
    },
    optional={"id": st.sampled_from(["a", "b", "", "x" * 40]), "status": st.just("completed")},
)
RUNNING = "<the running response>"  # replaced by its id when the step runs
_IDS = st.sampled_from([None, None, "e1", "evt", 5])
_MAX = st.sampled_from([None, "inf", 1, 2, 3, 0, 99999, "x"])


def _with_id(kind: str, event_id: object, **fields: Any) -> str:
    obj: dict[str, Any] = {"type": kind, **fields}
    if event_id is not None:
        obj["event_id"] = event_id
    return json.dumps(obj)


_CLIENT = st.one_of(
    st.builds(lambda i, item: _with_id("conversation.item.create", i, item=item), _IDS, _ITEM),
    st.builds(
        lambda i, prev, t: _with_id(
            "conversation.item.create",
            i,
            previous_item_id=prev,
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": t}],
            },
        ),
        _IDS,
        st.sampled_from(["root", "a", "b", "zz"]),
        _TEXT,
    ),
    st.builds(
        lambda i, m, ins: _with_id(
            "response.create",
            i,
            response={
                k: v
                for k, v in {"max_output_tokens": m, "instructions": ins}.items()
                if v is not None
            },
        ),
        _IDS,
        _MAX,
        st.one_of(st.none(), _TEXT),
    ),
    st.builds(lambda i: _with_id("response.create", i), _IDS),
    st.builds(
        lambda i, r: _with_id("response.cancel", i, **({} if r is None else {"response_id": r})),
        _IDS,
        st.sampled_from([None, RUNNING, "nope"]),
    ),
    st.builds(
        lambda i, mods, m: _with_id(
            "session.update",
            i,
            session={"type": "realtime", "output_modalities": mods, "max_output_tokens": m},
        ),
        _IDS,
        st.sampled_from([["text"], ["audio"], ["text", "audio"], []]),
        _MAX,
    ),
    st.sampled_from(
        [
            msg("input_audio_buffer.append", audio="AA"),
            msg("output_audio_buffer.clear"),
            msg("conversation.item.retrieve", item_id="a"),
            msg("what.ever"),
            "[]",
            "{",
            "null",
        ]
    ),
    st.text(max_size=30),
)
_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "client": _CLIENT,
    "create": st.sampled_from([msg("response.create"), user("hi there")]),
    "delta": _TEXT,
    "finish": st.sampled_from([None, None, "completed", "cancelled", "incomplete"]),
    "migrate": st.just(""),
    "binary": st.just(""),
}
_KINDS = ["client"] * 3 + ["create"] * 2 + ["delta"] * 4 + ["finish", "migrate", "binary"]
_STEP = st.sampled_from(_KINDS).flatmap(lambda kind: st.tuples(st.just(kind), _ARGS[kind]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, max_size=40))
def test_any_sequence_keeps_the_protocol(steps: list[tuple[str, Any]]) -> None:
    s = RealtimeSession(SID, model="m", default_max_tokens=4)
    seen = sends(s.opened())
    running: str | None = None
    text = ""
    responses = 0
    for kind, arg in steps:
        if kind in ("client", "create"):
            out = valid(s.receive(arg.replace(RUNNING, running or "resp_none")))
            for act in actions(out):
                if isinstance(act, Respond):
                    assert running is None, "a second response while one runs"
                    running, text, responses = act.response_id, "", responses + 1
                    assert act.max_tokens >= 0
                    assert all(set(m) == {"role", "content"} for m in act.messages)
                else:
                    assert act.response_id == running
            seen += sends(out)
        elif kind == "binary":
            seen += sends(s.binary())
        elif kind == "migrate":
            s = RealtimeSession.restore(roundtrip(s.snapshot()), default_max_tokens=4)
        elif running is None:
            with pytest.raises(RuntimeError):
                s.delta("x") if kind == "delta" else s.finish()
        elif kind == "delta":
            seen += sends(s.delta(arg))
            text += arg
        else:
            end = sends(s.finish(arg))
            assert end[0]["text"] == text and end[-1]["response"]["id"] == running
            seen += end
            running = None
        assert s.response_id == running
    ids = [e["event_id"] for e in seen]
    assert len(set(ids)) == len(ids)
    created = [e for e in seen if e["type"] == "response.created"]
    done = [e for e in seen if e["type"] == "response.done"]
    assert len(created) == responses and len(done) == responses - (running is not None)
