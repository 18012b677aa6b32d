"""The OpenAI Responses API's WebSocket mode (text), server side, sans-I/O.

Agents that run dozens of tool calls per task keep one socket open to ``/v1/responses`` and send
each turn as a ``response.create`` naming the response it continues (``previous_response_id``)
with only the new input; the server keeps the last response of the connection. One
``ResponsesSession`` per session id holds that (kept across reconnects like the model's
``SessionState``). The I/O shell feeds it what arrives and writes what it returns; it never
touches a socket, a clock or a task, so a migrated session continues exactly:

- ``opened()`` on a new connection: nothing (the protocol has no greeting).
- ``receive(text, now)`` for each client text message (``now``: wall-clock seconds, the new
  response's ``created_at``): ``Send`` (a server event, one JSON text message) and ``Respond``
  (generate the answer for ``messages``, at most ``max_tokens`` tokens) outputs, in order.
- ``binary()`` for a message the shell did not parse: an ``error``.
- ``delta(text)`` for each generated token (one ``response.output_text.delta``), then
  ``finish(...)`` when the answer ends (``response.completed`` or ``response.incomplete``),
  ``fail(message)`` when the engine failed it (``response.failed``), or ``abort()`` when the
  connection died with it (no events: nobody is there to read them).
- ``snapshot(unsent)`` / ``ResponsesSession.restore(state)`` for live migration, ``resumed()``
  on the new worker (the events the old one had computed but not written, sent first).

State machine (each call returns all of its events at once, so no two calls' events
interleave; at most one response runs)::

    idle --response.create--> responding --finish() / fail() / abort()--> idle

Rules, per client event and state:

- ``response.create``, idle: the top-level fields of ``POST /v1/responses``. ``input`` is a
  string (one user message) or a list of ``message`` items (role ``user``, ``system``,
  ``developer`` (read as ``system``) or ``assistant``; content a string or ``input_text`` /
  ``output_text`` parts, their texts joined). ``previous_response_id`` must name the session's
  last response (the latest one that ended ``completed`` or ``incomplete``): the new response
  continues that response's conversation (its input and output); any other id gets an
  ``error`` ``previous_response_not_found``. Without it the response starts a new
  conversation. ``instructions`` (a system message before the conversation) apply to this
  response only, as OpenAI's do. ``max_output_tokens`` (1..limit) makes reaching it
  ``incomplete`` (reason ``max_output_tokens``); without it the worker's default applies and
  the response is ``completed``. ``model`` is echoed (else the session's); ``metadata``,
  ``temperature`` (0..2, passed on) and ``stream_id`` (echoed on every event of the response)
  are kept; ``store``, ``stream``, ``include``, ``user``, ``truncation``, ``top_p``, ``reasoning``
  and the prompt-cache and service fields are accepted and change nothing. Events, numbered
  by ``sequence_number`` from 0 within the response: ``response.created``,
  ``response.in_progress``, ``response.output_item.added`` (the assistant message),
  ``response.content_part.added``, then the action ``Respond(id, messages, max_tokens,
  temperature)``: ``messages`` is the instructions (as ``system``), the continued conversation
  and the new input.
- ``response.create`` while responding: an ``error``
  ``conversation_already_has_active_response``; the running response goes on.
- Tools (``tools`` not empty, a ``tool_choice`` other than ``auto``/``none``, tool-call items in
  ``input``), images and files, ``background``, ``generate: false``, ``conversation``,
  ``prompt`` templates, a ``text.format`` other than ``text`` and the other features text
  generation here cannot honour: an ``error`` ``unsupported_feature`` naming the field.
- ``response.steer`` (beta): an ``error`` ``unsupported_feature``.
- Not JSON, not an object, no or an unknown ``type``, a missing, mistyped or unknown field, a
  binary message: one ``error`` event; the session goes on unchanged.
- So every client message is answered by exactly one first event: ``response.created`` (it
  was accepted) or an ``error`` of type ``invalid_request_error`` (status 400, no
  ``sequence_number``: it was not). wslb's journal pairs them in order (``balancer.journal``);
  the shell's own errors (``error()``) are ``server_error``s and answer nothing.
- ``delta(text)`` (responding): ``response.output_text.delta``; the texts of a response's
  deltas, joined, are its text. ``finish(status)`` -> idle: ``response.output_text.done`` (the
  joined text), ``response.content_part.done``, ``response.output_item.done`` (status
  ``completed``, else ``incomplete``) and the terminal ``response.completed`` /
  ``response.incomplete`` with the usage (``input_tokens_details.cached_tokens``: the input
  tokens the KV cache held). Without a status: ``incomplete`` when a client-given
  ``max_output_tokens`` was reached, else ``completed``. The response becomes the session's
  last: its conversation is the continued one, the input and the assistant's text.
  ``fail(message)`` -> idle: ``response.failed`` (error ``server_error``), the partial message
  in its output; the last response stays what it was. ``abort()`` -> idle, no events, the
  last response unchanged. Calling any of these while idle is a bug of the caller:
  ``RuntimeError``. Every response therefore ends in exactly one terminal event.

Handoff: ``snapshot`` holds the last response (id and conversation), the running response
(ids, model, limits, its prompt, the text of its deltas and how many, the next sequence number),
the id counters and the events given but not yet written; ``restore`` checks every field. The
worker moves its model state beside it: the running answer (its next token is number
``deltas_sent``) goes on, then ``finish`` ends the same response, so the client sees every delta
once and in order, one ``response.output_text.done`` whose text is the deltas joined, and one
terminal event.

A transcript (the open handoff state, version 2: docs/protocol.md section 5a) with protocol
``openai-responses`` carries the session's ``snapshot()`` as its ``responses`` field;
``restore_transcript`` restores it and checks it against the transcript's answer. wslb's
journal builds the same value from what it relayed, for crash failover.

Ids are deterministic: ``resp_`` and ``msg_`` followed by a tag of the session id and a
per-kind counter, so a restored session continues them. Every server event validates against
the SDK's ``openai.types.responses.ResponsesServerEvent`` (openai >= 3.57).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from backends.handoff import StateError, StateFields, TranscriptAnswer
from backends.protocol.realtime import Send

__all__ = [
    "PROTOCOL",
    "STATE_VERSION",
    "FinishStatus",
    "Output",
    "Respond",
    "ResponsesSession",
    "ResponsesStateError",
    "Send",
    "restore_transcript",
]

PROTOCOL = "openai-responses"  # a transcript's ``protocol``
STATE_VERSION = 1
MAX_METADATA_KEYS = 16
MAX_TEMPERATURE = 2.0
_CLIP = 64  # characters of a client value quoted in an error message

FinishStatus: TypeAlias = Literal["completed", "incomplete"]
_FINISH_STATUSES: tuple[FinishStatus, ...] = ("completed", "incomplete")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_IGNORED = frozenset(
    {"store", "stream", "include", "user", "truncation", "top_p", "top_logprobs", "reasoning"}
    | {"parallel_tool_calls", "max_tool_calls", "safety_identifier", "service_tier"}
    | {"prompt_cache_key", "prompt_cache_retention"}
)
_UNSUPPORTED = {
    "conversation": "Conversations ('conversation') are not supported; chain responses with "
    "'previous_response_id'.",
    "prompt": "Prompt templates ('prompt') are not supported.",
    "context_management": "Context management ('context_management') is not supported.",
    "image": "Image options ('image') are not supported; this server is text only.",
    "moderation": "Moderation ('moderation') is not supported.",
    "access_programs": "Access programs ('access_programs') are not supported.",
    "background_options": "Background responses are not supported over WebSocket.",
    "prompt_cache_options": "Prompt cache options ('prompt_cache_options') are not supported.",
}
_CHECKED = frozenset(
    {"type", "model", "input", "instructions", "max_output_tokens", "previous_response_id"}
    | {"metadata", "temperature", "stream_id", "background", "generate", "tools", "tool_choice"}
    | {"text"}
)
_CREATE_KEYS = _CHECKED | _IGNORED | frozenset(_UNSUPPORTED)
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})


@dataclass(frozen=True, slots=True)
class Respond:
    """Action: generate the answer of ``response_id`` for ``messages``, at most ``max_tokens``
    tokens (``temperature``: the client's, or None for the worker's own).

    Each token goes to ``ResponsesSession.delta``, the end to ``finish`` (or ``fail``).
    """

    response_id: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float | None = None


Output: TypeAlias = Send | Respond


class ResponsesStateError(StateError):
    """A Responses handoff state that cannot be restored; the message names the bad field."""


class _ClientError(Exception):
    """A client event the session cannot act on: one ``error`` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    model: str
    created_at: float
    instructions: str | None
    max_output_tokens: int | None
    """The client's limit: reaching it is ``incomplete``; None: the worker's default."""
    max_tokens: int
    metadata: dict[str, str] | None
    temperature: float | None
    previous_response_id: str | None
    stream_id: str | None
    messages: list[dict[str, str]]
    """The conversation this response answers (continued one plus input), no instructions."""
    chunks: list[str] = field(default_factory=list)
    deltas: int = 0
    seq: int = 0
    """The next event's ``sequence_number``."""

    @property
    def text(self) -> str:
        if len(self.chunks) > 1:
            self.chunks[:] = ["".join(self.chunks)]
        return self.chunks[0] if self.chunks else ""

    def prompt(self) -> list[dict[str, str]]:
        """What the engine answers: the instructions (as ``system``), then the conversation."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + [dict(m) for m in self.messages]


def _tag(session: str) -> str:
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()


def _clip(value: object) -> str:
    """A client value quoted in a message: scalars only (a deep list's repr could recurse)."""
    if value is not None and not isinstance(value, str | int | float):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    if isinstance(value, str) and len(value) > _CLIP:
        value = value[: _CLIP - 3] + "..."
    shown = repr(value)
    return shown if len(shown) <= 2 * _CLIP else shown[: 2 * _CLIP - 3] + "..."


class ResponsesSession:
    """The Responses WebSocket protocol state of one session (the module docstring's rules).

    Args:
        session: the session id: the ids derive from it.
        model: the model name of a response whose ``response.create`` names none.
        default_max_tokens: tokens of a response that gives no ``max_output_tokens``.
        max_tokens_limit: the largest ``max_output_tokens`` a client may ask for.
    """

    def __init__(
        self,
        session: str,
        *,
        model: str | None = None,
        default_max_tokens: int = 64,
        max_tokens_limit: int = 4096,
    ) -> None:
        if not session:
            raise ValueError("session must be a non-empty string")
        if default_max_tokens < 0:
            raise ValueError("default_max_tokens must be >= 0")
        if max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")
        self.session = session
        self.model = model
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.max_tokens_limit = max_tokens_limit
        self._tag = _tag(session)
        self._responses = 0
        self._items = 0
        self._last_id: str | None = None
        self._conversation: list[dict[str, str]] = []
        self._response: _Response | None = None
        self._unsent: list[dict[str, Any]] = []

    # -- state ------------------------------------------------------------------------------

    @property
    def response_id(self) -> str | None:
        """The running response's id, or None when idle."""
        return self._response.id if self._response is not None else None

    @property
    def last_response_id(self) -> str | None:
        """The response a ``previous_response_id`` may name (the latest that ended well)."""
        return self._last_id

    @property
    def deltas_sent(self) -> int:
        """``delta`` calls of the running response so far (over every worker), else 0."""
        return self._response.deltas if self._response is not None else 0

    @property
    def response_max_tokens(self) -> int | None:
        """The running response's ``max_tokens`` (as in its ``Respond``), else None."""
        return self._response.max_tokens if self._response is not None else None

    def messages(self) -> list[dict[str, str]]:
        """The running response's prompt, else the last response's conversation."""
        if self._response is not None:
            return self._response.prompt()
        return [dict(m) for m in self._conversation]

    # -- input ------------------------------------------------------------------------------

    def opened(self) -> list[Send]:
        """A new connection (not a resumed one): the protocol sends nothing first."""
        return []

    def receive(self, text: str, now: float = 0.0) -> list[Output]:
        """Act on one client text message; never raises for anything a client can send."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return [self._error("invalid_json", f"The message is not valid JSON: {exc}")]
        if not isinstance(obj, dict):
            return [self._error("invalid_json", "A client event must be a JSON object.")]
        try:
            return self._dispatch(obj, now)
        except _ClientError as exc:
            stream_id = obj.get("stream_id")
            return [
                self._error(
                    exc.code,
                    exc.message,
                    exc.param,
                    stream_id=stream_id if isinstance(stream_id, str) else None,
                )
            ]

    def binary(self) -> list[Send]:
        """A binary message arrived: the protocol is JSON text, so an ``error``."""
        return [
            self._error(
                "invalid_message", "Binary messages are not supported; send JSON text events."
            )
        ]

    def error(
        self, message: str, *, code: str | None = None, kind: str = "server_error"
    ) -> list[Send]:
        """An ``error`` event of the shell's own (``kind`` is the error's ``type``)."""
        return [self._error(code, message, kind=kind, status=500)]

    # -- the answer -------------------------------------------------------------------------

    def delta(self, text: str) -> list[Send]:
        """One generated token (or chunk) of the running response.

        Raises:
            RuntimeError: no response is running.
        """
        r = self._running("delta")
        r.chunks.append(text)
        r.deltas += 1
        return [
            self._event(
                r,
                "response.output_text.delta",
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def finish(
        self,
        status: FinishStatus | None = None,
        *,
        input_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int | None = None,
        now: float | None = None,
    ) -> list[Send]:
        """End the running response: its done events and its terminal event; back to idle.

        ``status`` None picks it (module docstring). ``input_tokens`` / ``cached_tokens`` are
        the prompt's tokens and those the KV cache held; ``output_tokens`` defaults to the
        number of deltas; ``now`` is ``completed_at``.

        Raises:
            RuntimeError: no response is running.
            ValueError: an unknown status or a negative count.
        """
        r = self._running("finish")
        if status is not None and status not in _FINISH_STATUSES:
            raise ValueError(f"status must be one of {_FINISH_STATUSES}, got {status!r}")
        produced = r.deltas if output_tokens is None else output_tokens
        usage = _usage(input_tokens, cached_tokens, produced)
        if status is None:
            limited = r.max_output_tokens is not None and produced >= r.max_output_tokens
            status = "incomplete" if limited else "completed"
        self._response = None
        text = r.text
        item = _message(r.item_id, "completed" if status == "completed" else "incomplete", text)
        at = {"item_id": r.item_id, "output_index": 0, "content_index": 0}
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        response = self._response_object(r, status, [item], usage, incomplete=details)
        if status == "completed" and now is not None:
            response["completed_at"] = now
        self._last_id = r.id
        self._conversation = [*r.messages, {"role": "assistant", "content": text}]
        return [
            self._event(r, "response.output_text.done", **at, text=text, logprobs=[]),
            self._event(r, "response.content_part.done", **at, part=_part(text)),
            self._event(r, "response.output_item.done", output_index=0, item=item),
            self._event(r, f"response.{status}", response=response),
        ]

    def fail(
        self,
        message: str,
        *,
        input_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int | None = None,
    ) -> list[Send]:
        """The engine failed the running response: ``response.failed``; back to idle, the last
        response unchanged (the failed one cannot be continued).

        Raises:
            RuntimeError: no response is running.
        """
        r = self._running("fail")
        self._response = None
        produced = r.deltas if output_tokens is None else output_tokens
        item = _message(r.item_id, "incomplete", r.text)
        response = self._response_object(
            r,
            "failed",
            [item],
            _usage(input_tokens, cached_tokens, produced),
            error={"code": "server_error", "message": message},
        )
        return [self._event(r, "response.failed", response=response)]

    def abort(self) -> None:
        """The connection died with the running response: drop it (no events); the last
        response unchanged. Idle: nothing."""
        self._response = None

    # -- handoff ----------------------------------------------------------------------------

    def snapshot(self, unsent: Iterable[Send] = ()) -> dict[str, Any]:
        """The session as a JSON value, to continue it on another worker.

        ``unsent``: events returned here but not yet written to the client; the restored
        session hands them out first (``resumed``). The running response is kept with the
        text of its deltas so far, so the other worker continues it with the next ``delta``.
        """
        r = self._response
        return {
            "v": STATE_VERSION,
            "session": self.session,
            "model": self.model,
            "counters": {"responses": self._responses, "items": self._items},
            "last": None
            if self._last_id is None
            else {"id": self._last_id, "messages": [dict(m) for m in self._conversation]},
            "response": None
            if r is None
            else {
                "id": r.id,
                "item_id": r.item_id,
                "model": r.model,
                "created_at": r.created_at,
                "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens,
                "max_tokens": r.max_tokens,
                "metadata": None if r.metadata is None else dict(r.metadata),
                "temperature": r.temperature,
                "previous_response_id": r.previous_response_id,
                "stream_id": r.stream_id,
                "messages": [dict(m) for m in r.messages],
                "text": r.text,
                "deltas": r.deltas,
                "seq": r.seq,
            },
            "unsent": [*self._unsent, *(s.event for s in unsent)],
        }

    @classmethod
    def restore(
        cls,
        state: object,
        *,
        session: str | None = None,
        default_max_tokens: int = 64,
        max_tokens_limit: int = 4096,
    ) -> ResponsesSession:
        """Rebuild a session from ``snapshot()``'s value (``session``: the id it must carry).

        Raises:
            ResponsesStateError: the state is malformed, of another version or session.
        """
        return _restore(cls, state, session, default_max_tokens, max_tokens_limit)

    def resumed(self) -> list[Send]:
        """On the connection that resumes a restored session: the old worker's unsent events
        (send them before anything else). Once."""
        out = [Send(e) for e in self._unsent]
        self._unsent = []
        return out

    # -- client events ----------------------------------------------------------------------

    def _dispatch(self, obj: dict[str, Any], now: float) -> list[Output]:
        kind = obj.get("type")
        if kind is None:
            raise _ClientError("missing_required_parameter", "Missing 'type'.", "type")
        if not isinstance(kind, str):
            raise _ClientError("invalid_type", "'type' must be a string.", "type")
        if kind == "response.create":
            return self._create(obj, now)
        if kind == "response.steer":
            raise _ClientError(
                "unsupported_feature",
                "'response.steer' is not supported; send the input with the next "
                "'response.create'.",
                "type",
            )
        raise _ClientError(
            "invalid_value",
            f"Unknown event type {_clip(kind)}; supported: 'response.create'.",
            "type",
        )

    def _create(self, obj: dict[str, Any], now: float) -> list[Output]:
        for key in obj:
            if key not in _CREATE_KEYS:
                raise _ClientError("unknown_parameter", f"Unknown parameter: {_clip(key)}.", key)
        if self._response is not None:
            raise _ClientError(
                "conversation_already_has_active_response",
                f"A response is already in progress: {self._response.id}. Wait until it is "
                "finished before creating a new one.",
            )
        for key, why in _UNSUPPORTED.items():
            if obj.get(key) is not None:
                raise _ClientError("unsupported_feature", why, key)
        if obj.get("background") not in (None, False):
            raise _ClientError(
                "unsupported_feature", "Background responses are not supported.", "background"
            )
        generate = obj.get("generate")
        if generate is not None and not isinstance(generate, bool):
            raise _ClientError("invalid_type", "'generate' must be a boolean.", "generate")
        if generate is False:
            raise _ClientError(
                "unsupported_feature", "Warm-up responses ('generate': false) are not supported."
            )
        _no_tools(obj.get("tools"), obj.get("tool_choice"))
        _text_format(obj.get("text"))
        model = _optional_str(obj.get("model"), "model")
        instructions = _optional_str(obj.get("instructions"), "instructions")
        previous = _optional_str(obj.get("previous_response_id"), "previous_response_id")
        stream_id = _optional_str(obj.get("stream_id"), "stream_id")
        metadata = _metadata(obj.get("metadata"))
        temperature = _temperature(obj.get("temperature"))
        max_output = obj.get("max_output_tokens")
        if max_output is not None and (
            isinstance(max_output, bool)
            or not isinstance(max_output, int)
            or not 1 <= max_output <= self.max_tokens_limit
        ):
            raise _ClientError(
                "invalid_value",
                f"'max_output_tokens' must be an integer in 1..{self.max_tokens_limit}, not "
                f"{_clip(max_output)}.",
                "max_output_tokens",
            )
        new = _input(obj.get("input"))
        if previous is not None and previous != self._last_id:
            raise _ClientError(
                "previous_response_not_found",
                f"Previous response with id {_clip(previous)} not found.",
                "previous_response_id",
            )
        base = [dict(m) for m in self._conversation] if previous is not None else []
        base += new
        if not base:
            raise _ClientError(
                "missing_required_parameter",
                "Missing 'input': a response needs input or a 'previous_response_id'.",
                "input",
            )

        rid = self._new_id("resp")
        r = _Response(
            id=rid,
            item_id=self._new_id("msg"),
            model=model or self.model or "default",
            created_at=float(now),
            instructions=instructions,
            max_output_tokens=max_output,
            max_tokens=self.default_max_tokens if max_output is None else max_output,
            metadata=metadata,
            temperature=temperature,
            previous_response_id=previous,
            stream_id=stream_id,
            messages=base,
        )
        self._response = r
        at = {"item_id": r.item_id, "output_index": 0, "content_index": 0}
        return [
            self._event(r, "response.created", response=self._response_object(r)),
            self._event(r, "response.in_progress", response=self._response_object(r)),
            self._event(
                r,
                "response.output_item.added",
                output_index=0,
                item={
                    "id": r.item_id,
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
            ),
            self._event(r, "response.content_part.added", **at, part=_part("")),
            Respond(rid, r.prompt(), r.max_tokens, temperature),
        ]

    # -- server events ----------------------------------------------------------------------

    def _event(self, r: _Response, kind: str, **fields: Any) -> Send:
        event: dict[str, Any] = {"type": kind, "sequence_number": r.seq, **fields}
        r.seq += 1
        if r.stream_id is not None:
            event["stream_id"] = r.stream_id
        return Send(event)

    def _error(
        self,
        code: str | None,
        message: str,
        param: str | None = None,
        *,
        kind: str = "invalid_request_error",
        status: int = 400,
        stream_id: str | None = None,
    ) -> Send:
        event: dict[str, Any] = {
            "type": "error",
            "status": status,
            "error": {"type": kind, "code": code, "message": message, "param": param},
        }
        if stream_id is not None:
            event["stream_id"] = stream_id
        return Send(event)

    def _response_object(
        self,
        r: _Response,
        status: str = "in_progress",
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        *,
        incomplete: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": r.id,
            "object": "response",
            "created_at": r.created_at,
            "status": status,
            "model": r.model,
            "output": output or [],
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "metadata": None if r.metadata is None else dict(r.metadata),
            "temperature": r.temperature,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "error": error,
            "incomplete_details": incomplete,
            "usage": usage,
        }

    def _new_id(self, kind: Literal["resp", "msg"]) -> str:
        """A fresh id; never the last or the running response's (a restored session whose
        counters came from a journal that saw fewer responses than the worker made)."""
        taken = {self._last_id}
        if self._response is not None:
            taken |= {self._response.id, self._response.item_id}
        while True:
            if kind == "resp":
                self._responses += 1
                n = self._responses
            else:
                self._items += 1
                n = self._items
            new = f"{kind}_{self._tag}_{n}"
            if new not in taken:
                return new

    def _running(self, what: str) -> _Response:
        if self._response is None:
            raise RuntimeError(f"{what}() with no response running")
        return self._response


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message(item_id: str, status: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_part(text)],
    }


def _usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    if min(input_tokens, cached_tokens, output_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


# -- client field checks ------------------------------------------------------------------


def _optional_str(value: object, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _ClientError("invalid_type", f"'{param}' must be a string.", param)
    return value


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _ClientError("invalid_type", "'metadata' must map strings to strings.", "metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise _ClientError(
            "invalid_value", f"'metadata' has more than {MAX_METADATA_KEYS} keys.", "metadata"
        )
    return dict(value)


def _temperature(value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_TEMPERATURE
    ):
        raise _ClientError(
            "invalid_value",
            f"'temperature' must be a number in 0..{MAX_TEMPERATURE:g}.",
            "temperature",
        )
    return float(value)


def _no_tools(tools: object, choice: object) -> None:
    if tools is not None:
        if not isinstance(tools, list):
            raise _ClientError("invalid_type", "'tools' must be a list.", "tools")
        if tools:
            raise _ClientError("unsupported_feature", "Tools are not supported.", "tools")
    if choice not in (None, "auto", "none"):
        raise _ClientError(
            "unsupported_feature",
            "Tools are not supported: 'tool_choice' may only be 'auto' or 'none'.",
            "tool_choice",
        )


def _text_format(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _ClientError("invalid_type", "'text' must be an object.", "text")
    fmt = value.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise _ClientError(
            "unsupported_feature",
            "Only plain text output is supported ('text.format': {'type': 'text'}).",
            "text.format",
        )


def _input(value: object) -> list[dict[str, str]]:
    """``input`` as chat messages (module docstring)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _ClientError("invalid_type", "'input' must be a string or a list of items.", "input")
    return [_input_item(item, f"input[{n}]") for n, item in enumerate(value)]


def _input_item(item: object, param: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise _ClientError("invalid_type", f"'{param}' must be an object.", param)
    kind = item.get("type", "message")
    if kind != "message":
        if not isinstance(kind, str):
            raise _ClientError("invalid_type", f"'{param}.type' must be a string.", f"{param}.type")
        what = (
            "Tool calls and their outputs are" if "call" in kind else f"Items of type {kind!r} are"
        )
        raise _ClientError(
            "unsupported_feature",
            f"{what} not supported; only 'message' items are.",
            f"{param}.type",
        )
    for key in item:
        if key not in _MESSAGE_KEYS:
            where = f"{param}.{key}"
            raise _ClientError("unknown_parameter", f"Unknown parameter: {_clip(where)}.", where)
    role = item.get("role")
    if role is None:
        raise _ClientError(
            "missing_required_parameter", f"Missing '{param}.role'.", f"{param}.role"
        )
    if role not in _ROLES:
        raise _ClientError(
            "invalid_value",
            f"'{param}.role' must be one of {sorted(_ROLES)}, not {_clip(role)}.",
            f"{param}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(p, f"{param}.content[{n}]") for n, p in enumerate(content))
    elif content is None:
        raise _ClientError(
            "missing_required_parameter", f"Missing '{param}.content'.", f"{param}.content"
        )
    else:
        raise _ClientError(
            "invalid_type",
            f"'{param}.content' must be a string or a list of parts.",
            f"{param}.content",
        )
    return {"role": _ROLES[role], "content": text}


def _part_text(part: object, param: str) -> str:
    if not isinstance(part, dict):
        raise _ClientError("invalid_type", f"'{param}' must be an object.", param)
    kind = part.get("type")
    if kind == "input_image":
        raise _ClientError("unsupported_feature", "Image input is not supported.", f"{param}.type")
    if kind == "input_file":
        raise _ClientError("unsupported_feature", "File input is not supported.", f"{param}.type")
    if kind not in _TEXT_PARTS:
        raise _ClientError(
            "invalid_value",
            f"'{param}.type' must be 'input_text' or 'output_text', not {_clip(kind)}.",
            f"{param}.type",
        )
    for key in part:
        if key not in _PART_KEYS:
            where = f"{param}.{key}"
            raise _ClientError("unknown_parameter", f"Unknown parameter: {_clip(where)}.", where)
    text = part.get("text")
    if not isinstance(text, str):
        raise _ClientError("invalid_type", f"'{param}.text' must be a string.", f"{param}.text")
    return text


# -- transcripts ---------------------------------------------------------------------------


def restore_transcript(
    state: object,
    *,
    session: str,
    answer: TranscriptAnswer | None,
    model: str | None = None,
    default_max_tokens: int = 64,
    max_tokens_limit: int = 4096,
) -> ResponsesSession:
    """The Responses session of an ``openai-responses`` transcript: its ``responses`` value
    (``snapshot()``'s), which must be there, checked against the transcript's answer (both
    there or both absent, the same text). ``model``: the session's default model when the
    state names none (a journal that saw no response cannot know it).

    Raises:
        ResponsesStateError: a bad ``state``, named ``state.responses...``, or a mismatch.
    """
    if state is None:
        raise _bad("state.responses is required for an openai-responses transcript")
    try:
        rs = ResponsesSession.restore(
            state,
            session=session,
            default_max_tokens=default_max_tokens,
            max_tokens_limit=max_tokens_limit,
        )
    except ResponsesStateError as exc:  # restore names the fields of its own state
        text = str(exc)
        if text.startswith("state"):
            text = "state.responses" + text[len("state") :]
        raise _bad(text) from None
    if rs.model is None:
        rs.model = model
    r = rs._response
    if (r is None) != (answer is None):
        raise _bad("state.answer and state.responses.response must both be set or null")
    if answer is not None and r is not None and r.text != answer.text:
        raise _bad("state.answer.text differs from state.responses.response.text")
    return rs


# -- restore -------------------------------------------------------------------------------


def _bad(message: str) -> ResponsesStateError:
    return ResponsesStateError(message)


_FIELDS = StateFields(ResponsesStateError)
_s_object = _FIELDS.mapping
_s_count = _FIELDS.count
_s_str = _FIELDS.string


def _s_optional_str(value: object, where: str) -> str | None:
    return None if value is None else _s_str(value, where)


def _s_messages(value: object, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _bad(f"{where} must be a list")
    out = []
    for n, m in enumerate(value):
        obj = _s_object(m, f"{where}[{n}]")
        role = obj.get("role")
        if role not in ("user", "system", "assistant"):
            raise _bad(f"{where}[{n}].role must be user, system or assistant")
        out.append({"role": role, "content": _s_str(obj.get("content"), f"{where}[{n}].content")})
    return out


def _restore(
    cls: type[ResponsesSession],
    state: object,
    session: str | None,
    default_max_tokens: int,
    limit: int,
) -> ResponsesSession:
    obj = _s_object(state, "state")
    if obj.get("v") != STATE_VERSION:
        raise _bad(f"state.v must be {STATE_VERSION}, got {_clip(obj.get('v'))}")
    sid = _s_str(obj.get("session"), "state.session", empty=False)
    if session is not None and sid != session:
        raise _bad(f"state.session is {_clip(sid)}, not {_clip(session)}")
    model = _s_optional_str(obj.get("model"), "state.model")
    s = cls(sid, model=model, default_max_tokens=default_max_tokens, max_tokens_limit=limit)
    counters = _s_object(obj.get("counters"), "state.counters")
    s._responses = _s_count(counters.get("responses"), "state.counters.responses")
    s._items = _s_count(counters.get("items"), "state.counters.items")
    last = obj.get("last")
    if last is not None:
        lo = _s_object(last, "state.last")
        s._last_id = _s_str(lo.get("id"), "state.last.id", empty=False)
        s._conversation = _s_messages(lo.get("messages"), "state.last.messages")
    if obj.get("response") is not None:
        s._response = _restore_response(obj["response"], s, limit)
    unsent = obj.get("unsent", [])
    if not isinstance(unsent, list):
        raise _bad("state.unsent must be a list")
    for n, event in enumerate(unsent):
        e = _s_object(event, f"state.unsent[{n}]")
        _s_str(e.get("type"), f"state.unsent[{n}].type", empty=False)
    s._unsent = list(unsent)
    return s


def _restore_response(value: object, s: ResponsesSession, limit: int) -> _Response:
    r = _s_object(value, "state.response")
    where = "state.response"
    rid = _s_str(r.get("id"), f"{where}.id", empty=False)
    if rid == s._last_id:
        raise _bad(f"{where}.id must differ from state.last.id")
    created = r.get("created_at")
    if isinstance(created, bool) or not isinstance(created, int | float) or created < 0:
        raise _bad(f"{where}.created_at must be a non-negative number")
    raw_output = r.get("max_output_tokens")
    max_output = None
    if raw_output is not None:
        max_output = _s_count(raw_output, f"{where}.max_output_tokens")
        if not 1 <= max_output <= limit:
            raise _bad(f"{where}.max_output_tokens must be null or in 1..{limit}")
    raw_max = r.get("max_tokens")  # null: no limit of the client's, so this worker's default
    max_tokens = (
        (max_output if max_output is not None else s.default_max_tokens)
        if raw_max is None
        else _s_count(raw_max, f"{where}.max_tokens")
    )
    if max_tokens > limit:
        raise _bad(f"{where}.max_tokens must be at most {limit}")
    metadata = r.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad(f"{where}.metadata must be null or map strings to strings")
    temperature = r.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise _bad(f"{where}.temperature must be null or a number in 0..{MAX_TEMPERATURE:g}")
    text = _s_str(r.get("text"), f"{where}.text")
    deltas = _s_count(r.get("deltas"), f"{where}.deltas")
    if deltas == 0 and text:
        raise _bad(f"{where}.text must be empty before any delta")
    seq = _s_count(r.get("seq"), f"{where}.seq")
    return _Response(
        id=rid,
        item_id=_s_str(r.get("item_id"), f"{where}.item_id", empty=False),
        model=_s_str(r.get("model"), f"{where}.model"),
        created_at=float(created),
        instructions=_s_optional_str(r.get("instructions"), f"{where}.instructions"),
        max_output_tokens=max_output,
        max_tokens=max_tokens,
        metadata=None if metadata is None else dict(metadata),
        temperature=None if temperature is None else float(temperature),
        previous_response_id=_s_optional_str(
            r.get("previous_response_id"), f"{where}.previous_response_id"
        ),
        stream_id=_s_optional_str(r.get("stream_id"), f"{where}.stream_id"),
        messages=_s_messages(r.get("messages"), f"{where}.messages"),
        chunks=[text] if text else [],
        deltas=deltas,
        seq=seq,
    )
