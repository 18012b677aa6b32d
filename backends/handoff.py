"""The handoff state: a ``SessionSnapshot`` as versioned JSON, validated on the way in.

Sans-I/O like ``backends.model``: the worker reads and writes HTTP bodies, this module only maps
plain JSON values to snapshots and back, so the format can be tested (and reused by another
worker implementation) without a network. The state travels through the balancer, which treats
it as opaque, so every field is checked on ``thaw``: a bad state must give 400, never a broken
session.

Format, version 1 (docs/protocol.md)::

    {
      "v": 1,
      "session": SID,
      "context": [TOKEN, ...],        # the whole conversation, incl. the answer's sent tokens
      "turns": K,                     # turns started so far
      "kv_cached": N,                 # leading context tokens the old worker's KV cache held
      "answer": null | {              # the answer the freeze interrupted
        "turn": K, "i": I,            # its turn (== turns) and next token index
        "max_tokens": M,              # as requested: done reports the total over all workers
        "cached_tokens": C, "prefill_ms": F,   # measured at the turn's start, for done
        "cancelled": false            # the client cancelled it, the end was not sent yet
      },
      "queued": [{"words": [TOKEN, ...], "replace": false, "max_tokens": M}, ...]
    }

A token is a non-empty string without whitespace (a word, see ``backends.model.words``).
Unknown keys are ignored, so a version 1 reader accepts additions that do not change meaning.

Version 2, the open transcript form (docs/protocol.md section 5a), is read too
(``transcript_from_json``; ``read_state`` dispatches on ``v``): the engine bridge writes it and
the balancer builds it from its journal for crash failover, so every worker must continue a
session from the conversation alone. The simulated model is deterministic, so the context is
rebuilt from the messages' words plus the unfinished answer's ``token_text``s; nothing of the
KV cache travels (``kv_cached`` 0: the new worker prefills again). The reference worker still
freezes to version 1, which keeps the exact context and the cached prefix.

The chat protocol's prompt rules and a transcript's shared fields are ``balancer.contract``'s
(the engine bridge and wslb's journal decide with the same functions); this module maps them to
the simulated model (``parse_prompt``, ``transcript_from_json``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

from backends.model import (
    PendingAnswer,
    Prompt,
    QueuedPrompt,
    SessionSnapshot,
    token_text,
    words,
)
from balancer.contract import (
    EVENT_PROTOCOLS,
    PROTOCOLS,
    TRANSCRIPT_VERSION,
    ChatPrompt,
    Protocol,
    ProtocolError,
    StateError,
    chat_messages,
    read_prompt,
    read_transcript,
    shown,
)

__all__ = [
    "EVENT_PROTOCOLS",
    "PROTOCOLS",
    "STATE_VERSION",
    "TRANSCRIPT_VERSION",
    "ProtocolError",
    "StateError",
    "StateFields",
    "Transcript",
    "TranscriptAnswer",
    "chat_messages",
    "model_prompt",
    "parse_prompt",
    "read_state",
    "snapshot_from_json",
    "snapshot_to_json",
    "transcript_from_json",
]

STATE_VERSION = 1
# The chat protocol's token texts (backends.model.token_text); the balancer joins a turn's
# texts with nothing between them, so one assistant "word" can hold a run of them.
_TOKEN_RUN = re.compile(r"(?:t\d+\.\d+-[0-9a-f]{8})+")
_TOKEN = re.compile(r"t\d+\.\d+-[0-9a-f]{8}")


class StateFields:
    """The field checks a protocol's snapshot restore shares (Realtime's, Responses'), each
    raising that protocol's own ``StateError`` subclass naming the bad field."""

    def __init__(self, error: type[StateError]) -> None:
        self.error = error

    def mapping(self, value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(f"{where} must be an object")
        return value

    def count(self, value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(f"{where} must be a non-negative integer")
        return value

    def string(self, value: object, where: str, *, empty: bool = True) -> str:
        if not isinstance(value, str) or (not empty and not value):
            raise self.error(f"{where} must be a {'' if empty else 'non-empty '}string")
        return value


@dataclass(frozen=True, slots=True)
class TranscriptAnswer:
    """A transcript's unfinished answer, as far as a Realtime session rebuilt from it needs.

    ``i`` chunks (the reference worker: tokens) of it were sent; their text is ``text``.
    """

    turn: int
    i: int
    text: str
    max_tokens: int
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Transcript:
    """A validated version 2 state: the model's snapshot plus what the protocol layer needs.

    ``events`` (openai-realtime, openai-responses): client events to act on after the resume,
    in order. ``realtime`` / ``responses``: the state's ``realtime`` / ``responses`` value
    unchecked (None when absent), for ``restore_transcript`` of
    ``backends.protocol.realtime`` / ``.responses``, which check it against ``answer``.
    """

    snapshot: SessionSnapshot
    protocol: Protocol
    messages: tuple[dict[str, str], ...]
    """The conversation up to the answer's prompt, ``{"role", "content"}`` with string content."""
    answer: TranscriptAnswer | None
    events: tuple[dict[str, Any], ...] = ()
    realtime: object = None
    responses: object = None


def parse_prompt(obj: dict[str, Any], default_max: int, limit: int) -> tuple[Prompt, int]:
    """Validate a chat-protocol ``prompt`` message (``balancer.contract.read_prompt``) into a
    model prompt and its ``max_tokens`` (``default_max`` when it names none).

    Raises:
        ProtocolError: the message does not follow the chat protocol (docs/protocol.md).
    """
    prompt = read_prompt(obj, limit)
    return model_prompt(prompt), default_max if prompt.max_tokens is None else prompt.max_tokens


def model_prompt(prompt: ChatPrompt) -> Prompt:
    """What the simulated model reads of a prompt: its words (a ``messages`` prompt's
    contents in order, replacing the context)."""
    if prompt.text is not None:
        return Prompt.from_text(prompt.text)
    return Prompt.from_messages(m["content"] for m in prompt.messages or ())


def snapshot_to_json(snapshot: SessionSnapshot) -> dict[str, Any]:
    """The JSON value of ``snapshot`` (lists, dicts, strings and numbers only)."""
    answer = snapshot.answer
    return {
        "v": STATE_VERSION,
        "session": snapshot.session,
        "context": list(snapshot.context),
        "turns": snapshot.turns,
        "kv_cached": snapshot.kv_cached,
        "answer": None
        if answer is None
        else {
            "turn": answer.turn,
            "i": answer.produced,
            "max_tokens": answer.max_tokens,
            "cached_tokens": answer.cached_tokens,
            "prefill_ms": answer.prefill_ms,
            "cancelled": answer.cancelled,
        },
        "queued": [
            {"words": list(q.prompt.words), "replace": q.prompt.replace, "max_tokens": q.max_tokens}
            for q in snapshot.queued
        ],
    }


def snapshot_from_json(
    value: object,
    *,
    session: str | None = None,
    max_queued: int | None = None,
    max_tokens_limit: int | None = None,
) -> SessionSnapshot:
    """Validate a state (as parsed from JSON) into a snapshot.

    Args:
        value: the ``state`` member of a thaw request.
        session: the session id the state must carry (the one in the thaw URL).
        max_queued: most queued prompts the receiving worker accepts.
        max_tokens_limit: largest ``max_tokens`` the receiving worker accepts.

    Raises:
        StateError: the state is malformed, of another version, or for another session.
    """
    obj = _object(value, "state")
    if obj.get("v") != STATE_VERSION:
        raise StateError(f"state.v must be {STATE_VERSION}, got {obj.get('v')!r}")
    sid = obj.get("session")
    if not isinstance(sid, str) or not sid:
        raise StateError("state.session must be a non-empty string")
    if session is not None and sid != session:
        raise StateError(f"state.session is {sid!r}, not {session!r}")
    context = _tokens(obj.get("context"), "state.context")
    turns = _count(obj.get("turns"), "state.turns")
    kv_cached = _count(obj.get("kv_cached"), "state.kv_cached")
    if kv_cached > len(context):
        raise StateError("state.kv_cached exceeds the context")
    answer = None
    if obj.get("answer") is not None:
        answer = _answer(obj["answer"], turns, len(context), max_tokens_limit)
    raw_queued = obj.get("queued", [])
    if not isinstance(raw_queued, list):
        raise StateError("state.queued must be a list")
    if max_queued is not None and len(raw_queued) > max_queued:
        raise StateError(f"state.queued holds more than {max_queued} prompts")
    queued = []
    for n, item in enumerate(raw_queued):
        where = f"state.queued[{n}]"
        q = _object(item, where)
        replace = q.get("replace", False)
        if not isinstance(replace, bool):
            raise StateError(f"{where}.replace must be a boolean")
        prompt = Prompt(tuple(_tokens(q.get("words"), f"{where}.words")), replace)
        queued.append(
            QueuedPrompt(prompt, _max_tokens(q.get("max_tokens"), where, max_tokens_limit))
        )
    return SessionSnapshot(
        session=sid,
        context=tuple(context),
        turns=turns,
        kv_cached=kv_cached,
        answer=answer,
        queued=tuple(queued),
    )


def read_state(
    value: object,
    *,
    session: str | None = None,
    max_queued: int | None = None,
    max_tokens_limit: int | None = None,
    default_max_tokens: int = 64,
) -> SessionSnapshot | Transcript:
    """Validate a thaw's state of either version: a snapshot (v1) or a transcript (v2).

    The arguments are ``snapshot_from_json``'s and ``transcript_from_json``'s.

    Raises:
        StateError: the state is malformed, of an unknown version, or for another session.
    """
    obj = _object(value, "state")
    version = obj.get("v")
    if version == STATE_VERSION:
        return snapshot_from_json(
            obj, session=session, max_queued=max_queued, max_tokens_limit=max_tokens_limit
        )
    if version == TRANSCRIPT_VERSION:
        return transcript_from_json(
            obj,
            session=session,
            max_queued=max_queued,
            max_tokens_limit=max_tokens_limit,
            default_max_tokens=default_max_tokens,
        )
    raise StateError(
        f"state.v must be {STATE_VERSION} or {TRANSCRIPT_VERSION}, got {shown(version)}"
    )


def transcript_from_json(
    value: object,
    *,
    session: str | None = None,
    max_queued: int | None = None,
    max_tokens_limit: int | None = None,
    default_max_tokens: int = 64,
) -> Transcript:
    """Validate a version 2 state (the open transcript form) for the simulated model.

    The snapshot's context is the words of every message, in order, an assistant word that is
    a run of chat token texts (the balancer joins a turn's texts with nothing between) split
    into them, then the unfinished answer's ``token_text(session, turn, j)`` for j < ``i``:
    the model is deterministic, so ``answer.text`` must be those texts joined (by "" as the
    chat protocol's balancer joins them, or by " " as the Realtime deltas carry them).
    ``kv_cached`` is 0: a transcript carries no cache.

    Args:
        value: the ``state`` member of a thaw request.
        session: the session id the state must carry (the one in the thaw URL).
        max_queued: most queued prompts (or Realtime events) the receiving worker accepts.
        max_tokens_limit: largest ``max_tokens`` the receiving worker accepts.
        default_max_tokens: ``max_tokens`` of a queued chat prompt that gives none.

    Raises:
        StateError: the state is malformed, of another version, or for another session.
    """
    head = read_transcript(
        value,
        session=session,
        max_queued=max_queued,
        max_tokens_limit=2**63 if max_tokens_limit is None else max_tokens_limit,
    )
    sid, messages = head.session, head.messages
    answer = None
    if head.answer is not None:
        answer = _transcript_answer(head.answer, sid, max_tokens_limit, default_max_tokens)
    turns = head.turns(None if answer is None else answer.turn)
    queued = [
        QueuedPrompt(model_prompt(q), default_max_tokens if q.max_tokens is None else q.max_tokens)
        for q in head.queued
    ]

    context = [w for m in messages for w in _message_tokens(m)]
    pending = None
    if answer is not None:
        context += [token_text(sid, answer.turn, j) for j in range(answer.i)]
        a = cast(dict[str, Any], head.answer)
        pending = PendingAnswer(
            turn=answer.turn,
            produced=answer.i,
            max_tokens=answer.max_tokens,
            cached_tokens=_count(_or(a.get("cached_tokens"), 0), "state.answer.cached_tokens"),
            prefill_ms=_milliseconds(_or(a.get("prefill_ms"), 0.0), "state.answer.prefill_ms"),
            cancelled=answer.cancelled,
        )
    snapshot = SessionSnapshot(
        session=sid,
        context=tuple(context),
        turns=turns,
        kv_cached=0,
        answer=pending,
        queued=tuple(queued),
    )
    return Transcript(
        snapshot,
        head.protocol,
        tuple(messages),
        answer,
        head.events,
        head.realtime,
        head.responses,
    )


def _message_tokens(message: dict[str, str]) -> list[str]:
    """A message's context tokens: its words; an assistant's run of token texts split up."""
    tokens = words(message["content"])
    if message["role"] != "assistant":
        return tokens
    out: list[str] = []
    for word in tokens:
        if _TOKEN_RUN.fullmatch(word):
            out.extend(_TOKEN.findall(word))
        else:
            out.append(word)
    return out


def _transcript_answer(
    value: object, session: str, limit: int | None, default_max_tokens: int
) -> TranscriptAnswer:
    a = _object(value, "state.answer")
    turn = _count(a.get("turn"), "state.answer.turn")
    if turn < 1:
        raise StateError("state.answer.turn must be at least 1")
    i = _count(a.get("i"), "state.answer.i")
    # null: the prompt named none, so the worker's default applies (as it would have there)
    raw_max = a.get("max_tokens")
    max_tokens = (
        default_max_tokens if raw_max is None else _max_tokens(raw_max, "state.answer", limit)
    )
    if i > max_tokens:
        raise StateError("state.answer.i exceeds state.answer.max_tokens")
    text = a.get("text")
    if not isinstance(text, str):
        raise StateError("state.answer.text must be a string")
    sent = [token_text(session, turn, j) for j in range(i)]
    if text not in ("".join(sent), " ".join(sent)):
        raise StateError(
            f"state.answer.text must be the first {i} token texts of turn {turn} joined "
            "(by '' or ' '): this worker's model continues only its own answers"
        )
    cancelled = a.get("cancelled", False)
    if not isinstance(cancelled, bool):
        raise StateError("state.answer.cancelled must be a boolean")
    return TranscriptAnswer(turn, i, text, max_tokens, cancelled)


def _or(value: object, default: object) -> object:
    """An optional field: null reads as absent (the bridge writes null for unknown stats)."""
    return default if value is None else value


def _milliseconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise StateError(f"{where} must be a non-negative number")
    return float(value)


def _answer(value: object, turns: int, context_len: int, limit: int | None) -> PendingAnswer:
    a = _object(value, "state.answer")
    turn = _count(a.get("turn"), "state.answer.turn")
    if turn < 1 or turn != turns:
        raise StateError("state.answer.turn must be the last turn started (state.turns)")
    produced = _count(a.get("i"), "state.answer.i")
    max_tokens = _max_tokens(a.get("max_tokens"), "state.answer", limit)
    if produced > max_tokens:
        raise StateError("state.answer.i exceeds state.answer.max_tokens")
    if produced > context_len:
        raise StateError("state.answer.i exceeds the context")
    prefill_ms = _milliseconds(a.get("prefill_ms", 0.0), "state.answer.prefill_ms")
    cancelled = a.get("cancelled", False)
    if not isinstance(cancelled, bool):
        raise StateError("state.answer.cancelled must be a boolean")
    return PendingAnswer(
        turn=turn,
        produced=produced,
        max_tokens=max_tokens,
        cached_tokens=_count(a.get("cached_tokens", 0), "state.answer.cached_tokens"),
        prefill_ms=prefill_ms,
        cancelled=cancelled,
    )


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StateError(f"{where} must be an object")
    return value


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateError(f"{where} must be a non-negative integer")
    return value


def _max_tokens(value: object, where: str, limit: int | None) -> int:
    n = _count(value, f"{where}.max_tokens")
    if limit is not None and n > limit:
        raise StateError(f"{where}.max_tokens must be at most {limit}")
    return n


def _tokens(value: object, where: str) -> list[str]:
    # A token with whitespace would split differently on the next worker and shift the context.
    if not isinstance(value, list):
        raise StateError(f"{where} must be a list of tokens")
    for n, token in enumerate(value):
        if not isinstance(token, str) or not token or token.split() != [token]:
            raise StateError(f"{where}[{n}] must be a non-empty string without whitespace")
    return value
