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
"""

from __future__ import annotations

from typing import Any

from backends.model import PendingAnswer, Prompt, QueuedPrompt, SessionSnapshot

__all__ = ["STATE_VERSION", "StateError", "snapshot_from_json", "snapshot_to_json"]

STATE_VERSION = 1


class StateError(ValueError):
    """A handoff state that cannot be installed; the message names the bad field."""


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
    prefill_ms = a.get("prefill_ms", 0.0)
    if isinstance(prefill_ms, bool) or not isinstance(prefill_ms, int | float) or prefill_ms < 0:
        raise StateError("state.answer.prefill_ms must be a non-negative number")
    cancelled = a.get("cancelled", False)
    if not isinstance(cancelled, bool):
        raise StateError("state.answer.cancelled must be a boolean")
    return PendingAnswer(
        turn=turn,
        produced=produced,
        max_tokens=max_tokens,
        cached_tokens=_count(a.get("cached_tokens", 0), "state.answer.cached_tokens"),
        prefill_ms=float(prefill_ms),
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
