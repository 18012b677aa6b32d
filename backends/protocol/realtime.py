"""The OpenAI Realtime protocol (GA event names, text modality), server side, sans-I/O.

One ``RealtimeSession`` per conversation (per session id, kept across reconnects like the
model's ``SessionState``). The I/O shell feeds it what arrives and writes what it returns; the
session never touches a socket, a clock or a task, so a migrated session continues exactly:

- ``opened()`` on a new connection: the ``session.created`` event.
- ``receive(text)`` for each client text message: ``Send`` (a server event to write as one JSON
  text message), ``Respond`` (start generating an answer for ``messages``, at most
  ``max_tokens`` tokens) and ``Cancel`` (stop the answer of that response) outputs, in order.
- ``binary()`` / ``too_large(size, limit)`` for a message the shell did not parse: an ``error``.
- ``delta(text)`` for each generated token (one ``response.output_text.delta``), then
  ``finish(...)`` when the answer ends: the done events and ``response.done``.
- ``snapshot(unsent)`` / ``RealtimeSession.restore(state)`` for live migration, ``resumed()``
  on the new worker (the events the old one had computed but not written, sent first).

State machine (each call returns all of its events at once, so no two calls' events ever
interleave; at most one response runs)::

    idle --response.create--> responding --finish()--> idle
                              responding --response.cancel--> cancelling --finish()--> idle

Rules, per client event and state:

- ``session.update`` (any state): ``session.type`` must be ``realtime``. ``output_modalities``
  may only be ``["text"]`` (``audio`` gets an ``error`` naming it); ``instructions`` (a string,
  sent to the model as a leading system message) and ``max_output_tokens`` (1..limit or
  ``"inf"``) apply from the next response on; ``tools`` must be empty; ``audio``, ``include``,
  ``tracing``, ``truncation``, ``tool_choice``, ``parallel_tool_calls``, ``reasoning`` and
  ``model`` are accepted and ignored (they change nothing for text); ``prompt`` (a stored
  template) gets an ``error``. Answer: ``session.updated`` with the effective configuration.
  The update is all or nothing.
- ``conversation.item.create`` (any state): a ``message`` item, role ``user`` or ``system``
  with ``input_text`` parts, or ``assistant`` with ``output_text`` parts. Its ``id`` (at most
  32 characters, unused) is kept, else one is generated. ``previous_item_id``: absent appends,
  ``root`` prepends, an existing id inserts after that item. Answer:
  ``conversation.item.added`` then ``conversation.item.done`` (status ``completed``). An item
  created while a response runs lands after the response's assistant item.
- ``response.create``: idle -> responding. Events ``response.created``,
  ``response.output_item.added``, ``conversation.item.added`` (the assistant item,
  ``in_progress``), ``response.content_part.added``, then the action ``Respond(id, messages,
  max_tokens)``. ``messages`` is the conversation before the new item (``messages()``), with
  ``response.instructions`` overriding the session's for this response; ``max_tokens`` is the
  response's or the session's ``max_output_tokens``, ``"inf"`` meaning the worker's default.
  Responding or cancelling: an ``error`` ``conversation_already_has_active_response``.
  Out-of-band responses (``conversation: "none"``, ``input``), tools and audio get an ``error``.
- ``response.cancel``: responding -> cancelling with the action ``Cancel(id)`` (nothing is sent
  yet: ``finish`` sends ``response.done`` with status ``cancelled``). A ``response_id`` naming
  another response, or idle: an ``error`` ``response_cancel_not_active``. Cancelling: nothing
  (the cancel is already on its way).
- ``input_audio_buffer.*``, ``output_audio_buffer.*``: an ``error`` (audio is unsupported).
  ``conversation.item.delete`` / ``retrieve`` / ``truncate``: an ``error`` (unsupported).
- Not JSON, not an object, no or an unknown ``type``, a missing, mistyped or unknown field, a
  binary or oversized message: one ``error`` event; the session goes on unchanged. Errors carry
  the client's ``event_id`` when it gave one (as a string).
- ``delta(text)`` (responding or cancelling): ``response.output_text.delta``; the texts of a
  response's deltas, joined, are its text. ``finish(status)`` (responding or cancelling) ->
  idle: ``response.output_text.done`` (the joined text), ``response.content_part.done``,
  ``response.output_item.done``, ``conversation.item.done`` (item status ``completed``, else
  ``incomplete``) and ``response.done``. Without a status it is ``cancelled`` once a cancel was
  requested, ``incomplete`` (reason ``max_output_tokens``) when a client-given
  ``max_output_tokens`` was reached, else ``completed``. Calling either while idle is a bug of
  the caller: ``RuntimeError``.
- The assistant item keeps its text, partial when cancelled, so ``messages()`` gives the
  conversation as the chat protocol's ``messages`` prompt: ``[{"role","content"}]``, the
  instructions first (as ``system``) when not empty, then every item in conversation order
  (an item's text parts joined as they are).

Handoff: ``snapshot`` holds the configuration, the items with their ids, the running response
(ids, limit, the text of its deltas and how many, whether a cancel is on its way), the id
counters and the events given but not yet written; ``restore`` checks every field. The worker
moves its model state beside it: the running response's answer (its next token is number
``deltas_sent``) goes on, then ``finish`` ends the same response, so the client sees every delta
once and in order and one ``response.done``.

A transcript (the open handoff state, version 2: docs/protocol.md section 5a) carries the
session's ``snapshot()`` as its ``realtime`` field, or only the conversation:
``snapshot_from_transcript`` rebuilds a state from that (new ids), ``restore_transcript`` does
either and checks it against the transcript's answer. The engine bridge and the reference
worker both read transcripts through these, so they rebuild the same session.

Ids are deterministic: ``event_``, ``item_`` and ``resp_`` followed by a tag of the session id
and a per-kind counter, ``conv_`` with the tag, so a restored session continues them. Every
server event validates against ``openai.types.realtime.RealtimeServerEvent`` (openai >= 1.107).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

from backends.handoff import StateError, StateFields, TranscriptAnswer

__all__ = [
    "MAX_ITEM_ID_LEN",
    "STATE_VERSION",
    "Cancel",
    "FinishStatus",
    "Output",
    "RealtimeSession",
    "RealtimeStateError",
    "Respond",
    "Send",
    "restore_transcript",
    "snapshot_from_transcript",
]

STATE_VERSION = 1
MAX_ITEM_ID_LEN = 32
MAX_METADATA_KEYS = 16
_CLIP = 64  # characters of a client value quoted in an error message

FinishStatus: TypeAlias = Literal["completed", "cancelled", "incomplete"]
Role: TypeAlias = Literal["user", "system", "assistant"]
ItemStatus: TypeAlias = Literal["completed", "incomplete", "in_progress"]
MaxOutput: TypeAlias = int | Literal["inf"]

_ROLES: tuple[Role, ...] = ("user", "system", "assistant")
_ITEM_STATUSES: tuple[ItemStatus, ...] = ("completed", "incomplete", "in_progress")
_FINISH_STATUSES: tuple[FinishStatus, ...] = ("completed", "cancelled", "incomplete")
_SESSION_KEYS = frozenset(
    {"type", "output_modalities", "instructions", "max_output_tokens", "tools"}
    | {"audio", "include", "tracing", "truncation", "tool_choice", "parallel_tool_calls"}
    | {"reasoning", "model", "prompt"}
)
_RESPONSE_KEYS = frozenset(
    {"conversation", "input", "instructions", "max_output_tokens", "metadata", "tools"}
    | {"output_modalities", "audio", "tool_choice", "parallel_tool_calls", "reasoning", "prompt"}
)
_ITEM_KEYS = frozenset({"id", "type", "role", "content", "status", "object"})
_UNSUPPORTED_EVENTS = frozenset(
    {"conversation.item.delete", "conversation.item.retrieve", "conversation.item.truncate"}
)


@dataclass(frozen=True, slots=True)
class Send:
    """A server event to write to the client as one JSON text message."""

    event: dict[str, Any]

    @property
    def type(self) -> str:
        """The event's ``type``."""
        return cast(str, self.event["type"])

    def text(self) -> str:
        """The event as compact JSON (ASCII, so a client's lone surrogate cannot break UTF-8)."""
        return json.dumps(self.event, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Respond:
    """Action: generate the answer of ``response_id`` for ``messages``, at most ``max_tokens``.

    Each token goes to ``RealtimeSession.delta``, the end to ``RealtimeSession.finish``.
    """

    response_id: str
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Action: stop the answer of ``response_id``, then call ``RealtimeSession.finish``."""

    response_id: str


Output: TypeAlias = Send | Respond | Cancel


class RealtimeStateError(StateError):
    """A Realtime handoff state that cannot be restored; the message names the bad field."""


class _ClientError(Exception):
    """A client event the session cannot act on: one ``error`` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(slots=True)
class _Item:
    id: str
    role: Role
    content: list[str]
    """The texts of the item's content parts (empty for the running response's item)."""
    status: ItemStatus


@dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    max_output_tokens: MaxOutput
    max_tokens: int
    limited: bool
    """``max_tokens`` is the client's ``max_output_tokens``: reaching it is ``incomplete``."""
    metadata: dict[str, str] | None
    chunks: list[str]
    deltas: int
    cancelling: bool = False

    @property
    def text(self) -> str:
        return "".join(self.chunks)


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


def _where(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


class RealtimeSession:
    """The Realtime protocol state of one session (see the module docstring for the rules).

    Args:
        session: the session id (the ``session`` query parameter): the ids derive from it.
        model: the model name shown in the session object (the ``model`` query parameter).
        default_max_tokens: tokens of a response whose ``max_output_tokens`` is ``"inf"``.
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
        self.instructions = ""
        self.max_output_tokens: MaxOutput = "inf"
        self._tag = _tag(session)
        self._events = 0
        self._items_made = 0
        self._responses = 0
        self._items: list[_Item] = []
        self._by_id: dict[str, _Item] = {}
        self._response: _Response | None = None
        self._unsent: list[dict[str, Any]] = []

    # -- state ------------------------------------------------------------------------------

    @property
    def response_id(self) -> str | None:
        """The running response's id (responding or cancelling), or None when idle."""
        return self._response.id if self._response is not None else None

    @property
    def cancel_requested(self) -> bool:
        """True between a ``Cancel`` and the ``finish`` that ends its response."""
        return self._response is not None and self._response.cancelling

    @property
    def deltas_sent(self) -> int:
        """``delta`` calls of the running response so far (over every worker), else 0."""
        return self._response.deltas if self._response is not None else 0

    @property
    def response_max_tokens(self) -> int | None:
        """The running response's ``max_tokens`` (as in its ``Respond``), else None."""
        return self._response.max_tokens if self._response is not None else None

    @property
    def conversation_id(self) -> str:
        """The id of the session's (only) conversation."""
        return f"conv_{self._tag}"

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages: the instructions (if any), then every item."""
        return self._messages(self.instructions)

    # -- input ------------------------------------------------------------------------------

    def opened(self) -> list[Send]:
        """A new connection (not a resumed one): the ``session.created`` event."""
        return [self._send("session.created", session=self._session_object())]

    def receive(self, text: str) -> list[Output]:
        """Act on one client text message; never raises for anything a client can send."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return [self._error("invalid_json", f"The message is not valid JSON: {exc}")]
        if not isinstance(obj, dict):
            return [self._error("invalid_json", "A client event must be a JSON object.")]
        raw_id = obj.get("event_id")
        client_id = raw_id if isinstance(raw_id, str) else None
        try:
            if raw_id is not None and client_id is None:
                raise _ClientError("invalid_type", "'event_id' must be a string.", "event_id")
            return self._dispatch(obj)
        except _ClientError as exc:
            return [self._error(exc.code, exc.message, exc.param, client_id)]

    def binary(self) -> list[Send]:
        """A binary message arrived: the protocol is JSON text, so an ``error``."""
        return [
            self._error(
                "invalid_message", "Binary messages are not supported; send JSON text events."
            )
        ]

    def too_large(self, size: int, limit: int) -> list[Send]:
        """A message of ``size`` bytes exceeded the shell's ``limit``: an ``error``."""
        return [
            self._error(
                "message_too_large",
                f"The message is {size} bytes, more than the limit of {limit} bytes.",
            )
        ]

    def error(
        self,
        message: str,
        *,
        code: str | None = None,
        kind: str = "server_error",
        param: str | None = None,
    ) -> list[Send]:
        """An ``error`` event of the shell's own (``kind`` is the error's ``type``)."""
        return [self._error(code, message, param, kind=kind)]

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
            self._send(
                "response.output_text.delta",
                response_id=r.id,
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                delta=text,
            )
        ]

    def finish(
        self,
        status: FinishStatus | None = None,
        *,
        input_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int | None = None,
    ) -> list[Send]:
        """End the running response: its done events and ``response.done``; back to idle.

        ``status`` None picks it (module docstring). ``input_tokens`` / ``cached_tokens`` are
        the prompt's tokens and those the KV cache held; ``output_tokens`` defaults to the
        number of deltas.

        Raises:
            RuntimeError: no response is running.
            ValueError: an unknown status or a negative count.
        """
        r = self._running("finish")
        if status is not None and status not in _FINISH_STATUSES:
            raise ValueError(f"status must be one of {_FINISH_STATUSES}, got {status!r}")
        produced = r.deltas if output_tokens is None else output_tokens
        if min(input_tokens, cached_tokens, produced) < 0:
            raise ValueError("token counts must be >= 0")
        if status is None:
            if r.cancelling:
                status = "cancelled"
            elif r.limited and produced >= r.max_tokens:
                status = "incomplete"
            else:
                status = "completed"
        text = r.text
        item = self._by_id[r.item_id]
        item.content = [text]
        item.status = "completed" if status == "completed" else "incomplete"
        self._response = None
        ids: dict[str, Any] = {"response_id": r.id, "item_id": r.item_id, "output_index": 0}
        done_item = self._item_object(item)
        details: dict[str, Any] | None = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        elif status == "incomplete":
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        usage = {
            "total_tokens": input_tokens + produced,
            "input_tokens": input_tokens,
            "output_tokens": produced,
            "input_token_details": {
                "text_tokens": input_tokens,
                "audio_tokens": 0,
                "image_tokens": 0,
                "cached_tokens": cached_tokens,
                "cached_tokens_details": {
                    "text_tokens": cached_tokens,
                    "audio_tokens": 0,
                    "image_tokens": 0,
                },
            },
            "output_token_details": {"text_tokens": produced, "audio_tokens": 0},
        }
        return [
            self._send("response.output_text.done", **ids, content_index=0, text=text),
            self._send(
                "response.content_part.done",
                **ids,
                content_index=0,
                part={"type": "text", "text": text},
            ),
            self._send(
                "response.output_item.done", response_id=r.id, output_index=0, item=done_item
            ),
            self._send(
                "conversation.item.done",
                previous_item_id=self._previous_id(item),
                item=done_item,
            ),
            self._send(
                "response.done",
                response=self._response_object(r, status, details, [done_item], usage),
            ),
        ]

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
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "counters": {
                "events": self._events,
                "items": self._items_made,
                "responses": self._responses,
            },
            "items": [
                {"id": i.id, "role": i.role, "content": list(i.content), "status": i.status}
                for i in self._items
            ],
            "response": None
            if r is None
            else {
                "id": r.id,
                "item_id": r.item_id,
                "max_output_tokens": r.max_output_tokens,
                "max_tokens": r.max_tokens,
                "limited": r.limited,
                "metadata": None if r.metadata is None else dict(r.metadata),
                "text": r.text,
                "deltas": r.deltas,
                "cancelling": r.cancelling,
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
    ) -> RealtimeSession:
        """Rebuild a session from ``snapshot()``'s value (``session``: the id it must carry).

        Raises:
            RealtimeStateError: the state is malformed, of another version or session.
        """
        return _restore(cls, state, session, default_max_tokens, max_tokens_limit)

    def resumed(self) -> list[Send]:
        """On the connection that resumes a restored session: the old worker's unsent events
        (send them before anything else; ``opened`` is not called on a resume). Once."""
        out = [Send(e) for e in self._unsent]
        self._unsent = []
        return out

    # -- client events ----------------------------------------------------------------------

    def _dispatch(self, obj: dict[str, Any]) -> list[Output]:
        kind = obj.get("type")
        if kind is None:
            raise _ClientError("missing_required_parameter", "Missing 'type'.", "type")
        if not isinstance(kind, str):
            raise _ClientError("invalid_type", "'type' must be a string.", "type")
        handler = _HANDLERS.get(kind)
        if handler is not None:
            return handler(self, obj)
        if kind.startswith(("input_audio_buffer.", "output_audio_buffer.")):
            raise _audio(_clip(kind), "type")
        if kind in _UNSUPPORTED_EVENTS:
            raise _ClientError("unsupported_feature", f"'{kind}' is not supported.", "type")
        raise _ClientError(
            "invalid_value",
            f"Unknown event type {_clip(kind)}; supported: {', '.join(sorted(_HANDLERS))}.",
            "type",
        )

    def _session_update(self, obj: dict[str, Any]) -> list[Output]:
        _known(obj, {"type", "event_id", "session"}, "")
        s = _object(_required(obj, "session", "session"), "session")
        kind = _required(s, "type", "session.type")
        if kind == "transcription":
            raise _ClientError(
                "unsupported_feature", "Transcription sessions are not supported.", "session.type"
            )
        if kind != "realtime":
            raise _ClientError(
                "invalid_value",
                f"'session.type' must be 'realtime', not {_clip(kind)}.",
                "session.type",
            )
        _known(s, _SESSION_KEYS, "session")
        _text_only(s.get("output_modalities"), "session.output_modalities")
        _no_tools(s.get("tools"), "session.tools")
        _no_prompt(s.get("prompt"), "session.prompt")
        instructions = _optional_str(s.get("instructions"), "session.instructions")
        max_output = s.get("max_output_tokens")
        if max_output is not None:
            self._max_output(max_output, "session.max_output_tokens")
        if instructions is not None:
            self.instructions = instructions
        if max_output is not None:
            self.max_output_tokens = max_output
        return [self._send("session.updated", session=self._session_object())]

    def _item_create(self, obj: dict[str, Any]) -> list[Output]:
        _known(obj, {"type", "event_id", "item", "previous_item_id"}, "")
        item = self._parse_item(_object(_required(obj, "item", "item"), "item"))
        previous = obj.get("previous_item_id")
        if previous is None:
            at = len(self._items)
        elif not isinstance(previous, str):
            raise _ClientError(
                "invalid_type", "'previous_item_id' must be a string.", "previous_item_id"
            )
        elif previous == "root":
            at = 0
        elif previous in self._by_id:
            at = self._items.index(self._by_id[previous]) + 1
        else:
            raise _ClientError(
                "invalid_value",
                f"Previous item {_clip(previous)} does not exist.",
                "previous_item_id",
            )
        if not item.id:
            item.id = self._new_item_id()
        self._items.insert(at, item)
        self._by_id[item.id] = item
        shown = self._item_object(item)
        prev = self._previous_id(item)
        return [
            self._send("conversation.item.added", previous_item_id=prev, item=shown),
            self._send("conversation.item.done", previous_item_id=prev, item=shown),
        ]

    def _response_create(self, obj: dict[str, Any]) -> list[Output]:
        _known(obj, {"type", "event_id", "response"}, "")
        params = obj.get("response")
        p = {} if params is None else _object(params, "response")
        _known(p, _RESPONSE_KEYS, "response")
        conversation = p.get("conversation")
        if conversation is not None and conversation != "auto":
            raise _ClientError(
                "unsupported_feature",
                "Only the default conversation is supported ('response.conversation': 'auto').",
                "response.conversation",
            )
        if p.get("input") is not None:
            raise _ClientError(
                "unsupported_feature",
                "Out-of-band responses ('response.input') are not supported.",
                "response.input",
            )
        _text_only(p.get("output_modalities"), "response.output_modalities")
        _no_tools(p.get("tools"), "response.tools")
        _no_prompt(p.get("prompt"), "response.prompt")
        instructions = _optional_str(p.get("instructions"), "response.instructions")
        metadata = _metadata(p.get("metadata"))
        raw_max = p.get("max_output_tokens")
        max_output = self.max_output_tokens if raw_max is None else raw_max
        max_tokens, limited = self._max_output(max_output, "response.max_output_tokens")
        if self._response is not None:
            raise _ClientError(
                "conversation_already_has_active_response",
                "Conversation already has an active response in progress: "
                f"{self._response.id}. Wait until the response is finished before creating "
                "a new one.",
            )

        self._responses += 1
        rid = f"resp_{self._tag}_{self._responses}"
        messages = self._messages(self.instructions if instructions is None else instructions)
        item = _Item(self._new_item_id(), "assistant", [], "in_progress")
        self._items.append(item)
        self._by_id[item.id] = item
        r = _Response(rid, item.id, max_output, max_tokens, limited, metadata, [], 0)
        self._response = r
        shown = self._item_object(item)
        return [
            self._send(
                "response.created", response=self._response_object(r, "in_progress", None, [])
            ),
            self._send("response.output_item.added", response_id=rid, output_index=0, item=shown),
            self._send(
                "conversation.item.added", previous_item_id=self._previous_id(item), item=shown
            ),
            self._send(
                "response.content_part.added",
                response_id=rid,
                item_id=item.id,
                output_index=0,
                content_index=0,
                part={"type": "text", "text": ""},
            ),
            Respond(rid, messages, max_tokens),
        ]

    def _response_cancel(self, obj: dict[str, Any]) -> list[Output]:
        _known(obj, {"type", "event_id", "response_id"}, "")
        wanted = _optional_str(obj.get("response_id"), "response_id")
        r = self._response
        if r is None:
            raise _ClientError(
                "response_cancel_not_active", "Cancellation failed: no active response found."
            )
        if wanted is not None and wanted != r.id:
            raise _ClientError(
                "response_cancel_not_active",
                f"Cancellation failed: response {_clip(wanted)} is not the active response.",
                "response_id",
            )
        if r.cancelling:
            return []
        r.cancelling = True
        return [Cancel(r.id)]

    def _parse_item(self, item: dict[str, Any]) -> _Item:
        _known(item, _ITEM_KEYS, "item")
        kind = _required(item, "type", "item.type")
        if kind != "message":
            raise _ClientError(
                "unsupported_feature",
                f"Item type {_clip(kind)} is not supported; only 'message' items are.",
                "item.type",
            )
        role = _required(item, "role", "item.role")
        if role not in _ROLES:
            raise _ClientError(
                "invalid_value",
                f"'item.role' must be one of {_ROLES}, not {_clip(role)}.",
                "item.role",
            )
        obj = item.get("object")
        if obj is not None and obj != "realtime.item":
            raise _ClientError(
                "invalid_value", "'item.object' must be 'realtime.item'.", "item.object"
            )
        status = item.get("status")
        if status is not None and status not in _ITEM_STATUSES:
            raise _ClientError(
                "invalid_value", f"'item.status' must be one of {_ITEM_STATUSES}.", "item.status"
            )
        parts = _required(item, "content", "item.content")
        if not isinstance(parts, list):
            raise _ClientError("invalid_type", "'item.content' must be a list.", "item.content")
        content = [
            _part_text(cast(Role, role), part, f"item.content[{n}]") for n, part in enumerate(parts)
        ]
        item_id = item.get("id")
        if item_id is None:
            item_id = ""
        elif not isinstance(item_id, str):
            raise _ClientError("invalid_type", "'item.id' must be a string.", "item.id")
        elif not item_id or len(item_id) > MAX_ITEM_ID_LEN:
            raise _ClientError(
                "invalid_value",
                f"'item.id' must have 1 to {MAX_ITEM_ID_LEN} characters.",
                "item.id",
            )
        elif item_id in self._by_id:
            raise _ClientError("invalid_value", f"Item {_clip(item_id)} already exists.", "item.id")
        return _Item(item_id, cast(Role, role), content, "completed")

    def _max_output(self, value: object, param: str) -> tuple[int, bool]:
        """Validate ``max_output_tokens``: the ``max_tokens`` it means and whether it limits."""
        if value == "inf":
            return self.default_max_tokens, False
        if isinstance(value, bool) or not isinstance(value, int):
            raise _ClientError("invalid_type", f"'{param}' must be an integer or 'inf'.", param)
        if not 1 <= value <= self.max_tokens_limit:
            raise _ClientError(
                "invalid_value",
                f"'{param}' must be between 1 and {self.max_tokens_limit}, not {value}.",
                param,
            )
        return value, True

    # -- server events ----------------------------------------------------------------------

    def _send(self, kind: str, **fields: Any) -> Send:
        self._events += 1
        return Send({"type": kind, "event_id": f"event_{self._tag}_{self._events}", **fields})

    def _error(
        self,
        code: str | None,
        message: str,
        param: str | None = None,
        client_id: str | None = None,
        *,
        kind: str = "invalid_request_error",
    ) -> Send:
        return self._send(
            "error",
            error={
                "type": kind,
                "code": code,
                "message": message,
                "param": param,
                "event_id": client_id,
            },
        )

    def _new_item_id(self) -> str:
        while True:
            self._items_made += 1
            item_id = f"item_{self._tag}_{self._items_made}"
            if item_id not in self._by_id:
                return item_id

    def _running(self, what: str) -> _Response:
        if self._response is None:
            raise RuntimeError(f"{what}() with no response running")
        return self._response

    def _previous_id(self, item: _Item) -> str | None:
        at = self._items.index(item)
        return self._items[at - 1].id if at else None

    def _text(self, item: _Item) -> str:
        r = self._response
        if r is not None and r.item_id == item.id:
            return r.text
        return "".join(item.content)

    def _messages(self, instructions: str) -> list[dict[str, str]]:
        out = [{"role": "system", "content": instructions}] if instructions else []
        out.extend({"role": i.role, "content": self._text(i)} for i in self._items)
        return out

    def _session_object(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"type": "realtime"}
        if self.model is not None:
            obj["model"] = self.model
        obj["output_modalities"] = ["text"]
        obj["instructions"] = self.instructions
        obj["max_output_tokens"] = self.max_output_tokens
        return obj

    @staticmethod
    def _item_object(item: _Item) -> dict[str, Any]:
        part = "output_text" if item.role == "assistant" else "input_text"
        return {
            "id": item.id,
            "object": "realtime.item",
            "type": "message",
            "status": item.status,
            "role": item.role,
            "content": [{"type": part, "text": text} for text in item.content],
        }

    def _response_object(
        self,
        r: _Response,
        status: str,
        details: dict[str, Any] | None,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.conversation_id,
            "output_modalities": ["text"],
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata,
            "usage": usage,
        }


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], list[Output]]] = {
    "session.update": RealtimeSession._session_update,
    "conversation.item.create": RealtimeSession._item_create,
    "response.create": RealtimeSession._response_create,
    "response.cancel": RealtimeSession._response_cancel,
}


# -- client field checks ------------------------------------------------------------------


def _audio(what: str, param: str | None = None) -> _ClientError:
    return _ClientError(
        "unsupported_modality",
        f"The audio modality is not supported ({what}); this server is text only.",
        param,
    )


def _known(obj: dict[str, Any], allowed: Iterable[str], prefix: str) -> None:
    allowed = frozenset(allowed)
    for key in obj:
        if key not in allowed:
            where = _where(prefix, key)
            raise _ClientError("unknown_parameter", f"Unknown parameter: {_clip(where)}.", where)


def _required(obj: dict[str, Any], key: str, param: str) -> Any:
    value = obj.get(key)
    if value is None:
        raise _ClientError("missing_required_parameter", f"Missing '{param}'.", param)
    return value


def _object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _ClientError("invalid_type", f"'{param}' must be an object.", param)
    return value


def _optional_str(value: object, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _ClientError("invalid_type", f"'{param}' must be a string.", param)
    return value


def _text_only(value: object, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise _ClientError("invalid_type", f"'{param}' must be a list of strings.", param)
    if "audio" in value:
        raise _audio(f"'{param}' has 'audio'", param)
    if value != ["text"]:
        raise _ClientError("invalid_value", f"'{param}' must be ['text'].", param)


def _no_tools(value: object, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise _ClientError("invalid_type", f"'{param}' must be a list.", param)
    if value:
        raise _ClientError("unsupported_feature", "Tools are not supported.", param)


def _no_prompt(value: object, param: str) -> None:
    if value is not None:
        raise _ClientError("unsupported_feature", "Prompt templates are not supported.", param)


def _metadata(value: object) -> dict[str, str] | None:
    param = "response.metadata"
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _ClientError("invalid_type", f"'{param}' must map strings to strings.", param)
    if len(value) > MAX_METADATA_KEYS:
        raise _ClientError(
            "invalid_value", f"'{param}' has more than {MAX_METADATA_KEYS} keys.", param
        )
    return dict(value)


def _part_text(role: Role, part: object, param: str) -> str:
    p = _object(part, param)
    kind = _required(p, "type", f"{param}.type")
    text_kind = "output_text" if role == "assistant" else "input_text"
    if kind in ("input_audio", "output_audio", "audio"):
        raise _audio(f"'{param}.type' is {_clip(kind)}", f"{param}.type")
    if kind == "input_image" and role == "user":
        raise _ClientError("unsupported_feature", "Image input is not supported.", f"{param}.type")
    if kind != text_kind:
        raise _ClientError(
            "invalid_value",
            f"'{param}.type' must be '{text_kind}' for a {role} message, not {_clip(kind)}.",
            f"{param}.type",
        )
    _known(p, {"type", "text"}, param)
    text = _required(p, "text", f"{param}.text")
    if not isinstance(text, str):
        raise _ClientError("invalid_type", f"'{param}.text' must be a string.", f"{param}.text")
    return text


# -- transcripts ---------------------------------------------------------------------------


def snapshot_from_transcript(
    session: str,
    messages: Sequence[Mapping[str, str]],
    answer: TranscriptAnswer | None,
    max_tokens_limit: int,
) -> dict[str, Any]:
    """A ``snapshot()`` value rebuilt from a transcript that carries no ``realtime`` state.

    One completed item per message (an unknown role reads as ``user``), then, for an
    unfinished ``answer``, the running response with its item, text and delta count. Ids are
    made up here (``item_TAG_tN``, ``resp_TAG_tK``: the ``t`` keeps them apart from the ids the
    session makes next), so they differ from those the client saw before, which a transcript
    does not carry.
    """
    tag = _tag(session)
    items: list[dict[str, Any]] = [
        {
            "id": f"item_{tag}_t{n}",
            "role": m["role"] if m["role"] in _ROLES else "user",
            "content": [m["content"]],
            "status": "completed",
        }
        for n, m in enumerate(messages)
    ]
    response = None
    responses = 0
    if answer is not None:
        responses = 1
        item_id = f"item_{tag}_t{len(items)}"
        items.append({"id": item_id, "role": "assistant", "content": [], "status": "in_progress"})
        response = {
            "id": f"resp_{tag}_t{answer.turn}",
            "item_id": item_id,
            "max_output_tokens": "inf",
            "max_tokens": min(answer.max_tokens, max_tokens_limit),
            "limited": False,
            "metadata": None,
            "text": answer.text,
            "deltas": answer.i,
            "cancelling": answer.cancelled,
        }
    return {
        "v": STATE_VERSION,
        "session": session,
        "model": None,
        "instructions": "",
        "max_output_tokens": "inf",
        "counters": {"events": 0, "items": 0, "responses": responses},
        "items": items,
        "response": response,
        "unsent": [],
    }


def restore_transcript(
    state: object,
    *,
    session: str,
    messages: Sequence[Mapping[str, str]],
    answer: TranscriptAnswer | None,
    default_max_tokens: int = 64,
    max_tokens_limit: int = 4096,
) -> RealtimeSession:
    """The Realtime session of an ``openai-realtime`` transcript.

    ``state`` is the transcript's ``realtime`` value (``snapshot()``'s), restored as it is;
    None rebuilds one from ``messages`` and ``answer`` (``snapshot_from_transcript``). Either
    way its running response must match the answer: both there or both absent, the same text.

    Raises:
        RealtimeStateError: a bad ``state``, named ``state.realtime...``, or a mismatch.
    """
    raw = state
    if raw is None:
        raw = snapshot_from_transcript(session, messages, answer, max_tokens_limit)
    try:
        rt = RealtimeSession.restore(
            raw,
            session=session,
            default_max_tokens=default_max_tokens,
            max_tokens_limit=max_tokens_limit,
        )
    except RealtimeStateError as exc:  # restore names the fields of its own state
        text = str(exc)
        if text.startswith("state"):
            text = "state.realtime" + text[len("state") :]
        raise _bad(text) from None
    if (rt.response_id is None) != (answer is None):
        raise _bad("state.answer and state.realtime.response must both be set or null")
    if answer is not None and rt._response is not None and rt._response.text != answer.text:
        raise _bad("state.answer.text differs from state.realtime.response.text")
    return rt


# -- restore -------------------------------------------------------------------------------


def _bad(message: str) -> RealtimeStateError:
    return RealtimeStateError(message)


_FIELDS = StateFields(RealtimeStateError)
_s_object = _FIELDS.mapping
_s_count = _FIELDS.count
_s_str = _FIELDS.string


def _s_max_output(value: object, where: str, limit: int) -> MaxOutput:
    if value == "inf":
        return "inf"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise _bad(f"{where} must be 'inf' or an integer in 1..{limit}")
    return value


def _restore(
    cls: type[RealtimeSession],
    state: object,
    session: str | None,
    default_max_tokens: int,
    limit: int,
) -> RealtimeSession:
    obj = _s_object(state, "state")
    if obj.get("v") != STATE_VERSION:
        raise _bad(f"state.v must be {STATE_VERSION}, got {_clip(obj.get('v'))}")
    sid = _s_str(obj.get("session"), "state.session", empty=False)
    if session is not None and sid != session:
        raise _bad(f"state.session is {_clip(sid)}, not {_clip(session)}")
    model = obj.get("model")
    if model is not None:
        model = _s_str(model, "state.model")
    s = cls(sid, model=model, default_max_tokens=default_max_tokens, max_tokens_limit=limit)
    s.instructions = _s_str(obj.get("instructions"), "state.instructions")
    s.max_output_tokens = _s_max_output(
        obj.get("max_output_tokens"), "state.max_output_tokens", limit
    )
    counters = _s_object(obj.get("counters"), "state.counters")
    s._events = _s_count(counters.get("events"), "state.counters.events")
    s._items_made = _s_count(counters.get("items"), "state.counters.items")
    s._responses = _s_count(counters.get("responses"), "state.counters.responses")

    raw_items = obj.get("items")
    if not isinstance(raw_items, list):
        raise _bad("state.items must be a list")
    for n, raw in enumerate(raw_items):
        where = f"state.items[{n}]"
        i = _s_object(raw, where)
        item_id = _s_str(i.get("id"), f"{where}.id", empty=False)
        if item_id in s._by_id:
            raise _bad(f"{where}.id {_clip(item_id)} is not unique")
        role = i.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role must be one of {_ROLES}")
        status = i.get("status")
        if status not in _ITEM_STATUSES:
            raise _bad(f"{where}.status must be one of {_ITEM_STATUSES}")
        content = i.get("content")
        if not isinstance(content, list) or not all(isinstance(t, str) for t in content):
            raise _bad(f"{where}.content must be a list of strings")
        item = _Item(item_id, cast(Role, role), list(content), cast(ItemStatus, status))
        s._items.append(item)
        s._by_id[item_id] = item

    raw_response = obj.get("response")
    running = [i.id for i in s._items if i.status == "in_progress"]
    if raw_response is None:
        if running:
            raise _bad(f"state.items: {_clip(running[0])} is in_progress with no response")
    else:
        s._response = _restore_response(raw_response, s, running, limit)

    unsent = obj.get("unsent", [])
    if not isinstance(unsent, list):
        raise _bad("state.unsent must be a list")
    for n, event in enumerate(unsent):
        e = _s_object(event, f"state.unsent[{n}]")
        _s_str(e.get("type"), f"state.unsent[{n}].type", empty=False)
        _s_str(e.get("event_id"), f"state.unsent[{n}].event_id", empty=False)
    s._unsent = list(unsent)
    return s


def _restore_response(
    value: object, s: RealtimeSession, running: list[str], limit: int
) -> _Response:
    r = _s_object(value, "state.response")
    rid = _s_str(r.get("id"), "state.response.id", empty=False)
    item_id = _s_str(r.get("item_id"), "state.response.item_id", empty=False)
    item = s._by_id.get(item_id)
    if item is None or item.role != "assistant" or running != [item_id]:
        raise _bad("state.response.item_id must name the only in_progress item, an assistant one")
    if item.content:
        raise _bad("state.items: the running response's item must have no content yet")
    if s._responses < 1:
        raise _bad("state.counters.responses must count the running response")
    max_output = _s_max_output(
        r.get("max_output_tokens"), "state.response.max_output_tokens", limit
    )
    raw_max = r.get("max_tokens")  # null: "inf" as the receiving worker reads it
    max_tokens = (
        s.default_max_tokens if raw_max is None else _s_count(raw_max, "state.response.max_tokens")
    )
    if max_tokens > limit:
        raise _bad(f"state.response.max_tokens must be at most {limit}")
    limited = r.get("limited")
    if not isinstance(limited, bool):
        raise _bad("state.response.limited must be a boolean")
    metadata = r.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("state.response.metadata must be null or map strings to strings")
    text = _s_str(r.get("text"), "state.response.text")
    deltas = _s_count(r.get("deltas"), "state.response.deltas")
    if deltas == 0 and text:
        raise _bad("state.response.text must be empty before any delta")
    cancelling = r.get("cancelling")
    if not isinstance(cancelling, bool):
        raise _bad("state.response.cancelling must be a boolean")
    return _Response(
        rid,
        item_id,
        max_output,
        max_tokens,
        limited,
        None if metadata is None else dict(metadata),
        [text] if text else [],
        deltas,
        cancelling,
    )
