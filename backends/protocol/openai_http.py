"""The OpenAI HTTP API beside the WebSocket routes (``GET /v1/models``, ``POST
/v1/chat/completions``, ``POST /v1/responses``), sans-I/O.

Why: one ``base_url`` must serve an SDK's HTTP and WebSocket calls (SPEC section 16), so the
workers answer the HTTP routes an SDK calls first (``models.list()``, ``chat.completions``) and
the Responses API over HTTP too. What a request means and what the answer looks like live here,
without sockets, so both workers answer alike and the shapes are tested against the SDK's own
types without a network:

- ``ChatRequest.parse(body, ...)``: a Chat Completions body checked (``ApiError`` 400 naming the
  field). Text only: ``messages`` of role ``system``/``developer`` (read as ``system``), ``user``
  or ``assistant`` with string content or text parts; ``max_completion_tokens`` (or the older
  ``max_tokens``), ``temperature``, ``stream``, ``stream_options.include_usage``; ``n`` only 1;
  tools, images, audio and JSON-schema output are refused (``unsupported_feature``); the
  sampling and bookkeeping fields a simulated model cannot honour are accepted and change
  nothing; any other field is ``unknown_parameter``.
- ``ChatAnswer``: one completion's objects: the streamed ``chat.completion.chunk``s (the role,
  each text delta, the end with its ``finish_reason``, the usage chunk when asked for) or the
  whole ``chat.completion``. ``finish_reason`` is ``length`` when the client's own limit was
  reached, else ``stop``; ``usage.prompt_tokens_details.cached_tokens`` is what the KV cache held.
- ``responses_event(body)``: a ``POST /v1/responses`` body as the WebSocket mode's
  ``response.create`` event, so ``ResponsesSession`` checks and answers both the same way;
  ``responses_error(event)`` turns its ``error`` event into the HTTP error.
- ``ApiError``: OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, and
  its status.
- ``sse(data, event)``: one server-sent event; ``SSE_DONE`` ends a chat stream.
- ``models_list(names)``: ``GET /v1/models``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_MODEL",
    "SSE_DONE",
    "SSE_HEADERS",
    "ApiError",
    "ChatAnswer",
    "ChatRequest",
    "models_list",
    "read_json",
    "responses_error",
    "responses_event",
    "sse",
    "usage",
]

DEFAULT_MODEL = "wslb-reference"
"""The model the reference worker lists (any name a request gives is served and echoed)."""
MAX_TEMPERATURE = 2.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx in front: pass each event on at once
}
SSE_DONE = b"data: [DONE]\n\n"
_CLIP = 64

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_IGNORED = frozenset(
    {"model", "stream", "stream_options", "temperature", "max_tokens", "max_completion_tokens"}
    | {"n", "messages", "top_p", "stop", "seed", "frequency_penalty", "presence_penalty"}
    | {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
    | {"parallel_tool_calls", "logit_bias", "reasoning_effort", "verbosity", "logprobs"}
    | {"top_logprobs", "prompt_cache_retention", "tools", "tool_choice", "response_format"}
)
"""Every field read below, or accepted as changing nothing; others are ``unknown_parameter``."""
_UNSUPPORTED = {
    "functions": "Functions are not supported.",
    "function_call": "Functions are not supported.",
    "audio": "Audio output is not supported; this server is text only.",
    "modalities": "Only the text modality is supported.",
    "prediction": "Predicted outputs ('prediction') are not supported.",
    "web_search_options": "Web search is not supported.",
}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "refusal"})
_PART_KEYS = frozenset({"type", "text"})


class ApiError(Exception):
    """A request the worker refuses, in OpenAI's error shape (``body()``) with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _clip(value: object) -> str:
    """A client value quoted in a message: scalars only, clipped."""
    if value is not None and not isinstance(value, str | int | float):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    shown = repr(value)
    return shown if len(shown) <= _CLIP else shown[: _CLIP - 3] + "..."


def read_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object.

    Raises:
        ApiError: 400 when it is not JSON or not an object.
    """
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested 100k deep
        raise _bad(f"The body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise _bad("The body must be a JSON object.", None, "invalid_json")
    return obj


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body (the module docstring's rules)."""

    model: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    limited: bool
    """The client gave the limit: reaching it is ``finish_reason: "length"``."""
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None

    @classmethod
    def parse(cls, body: dict[str, Any], *, default_max_tokens: int, limit: int) -> ChatRequest:
        """Raises ``ApiError`` (400) naming the first bad field."""
        for key in body:
            if key in _UNSUPPORTED and body[key] is not None:
                raise _bad(_UNSUPPORTED[key], key, "unsupported_feature")
            if key not in _IGNORED and key not in _UNSUPPORTED:
                raise _bad(
                    f"Unrecognized request argument supplied: {_clip(key)}.",
                    key,
                    "unknown_parameter",
                )
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise _bad("'model' must be a non-empty string.", "model", "invalid_type")
        _no_tools(body.get("tools"), body.get("tool_choice"))
        _text_only(body.get("response_format"))
        n = body.get("n")
        if n is not None and n != 1:
            raise _bad("Only 'n': 1 is supported.", "n", "unsupported_feature")
        if body.get("logprobs") not in (None, False):
            raise _bad("Log probabilities are not supported.", "logprobs", "unsupported_feature")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _bad("'stream' must be a boolean.", "stream", "invalid_type")
        include_usage = _stream_options(body.get("stream_options"), bool(stream))
        max_tokens, limited = default_max_tokens, False
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise _bad(f"'{key}' must be an integer in 1..{limit}, not {_clip(value)}.", key)
            max_tokens, limited = value, True
            break
        return cls(
            model=model or DEFAULT_MODEL,
            messages=tuple(_messages(body.get("messages"))),
            max_tokens=min(max_tokens, limit),
            limited=limited,
            stream=bool(stream),
            include_usage=include_usage,
            temperature=_temperature(body.get("temperature")),
        )


def _messages(value: object) -> list[dict[str, str]]:
    if value is None:
        raise _bad(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list.", "messages", "invalid_type")
    out = []
    for n, message in enumerate(value):
        at = f"messages[{n}]"
        if not isinstance(message, dict):
            raise _bad(f"'{at}' must be an object.", at, "invalid_type")
        role = message.get("role")
        if role in ("tool", "function"):
            raise _bad("Tool messages are not supported.", f"{at}.role", "unsupported_feature")
        if role not in _ROLES:
            raise _bad(
                f"'{at}.role' must be one of {sorted(_ROLES)}, not {_clip(role)}.", f"{at}.role"
            )
        for key in message:
            if key == "tool_calls" and message[key]:
                raise _bad("Tool calls are not supported.", f"{at}.{key}", "unsupported_feature")
            if key not in _MESSAGE_KEYS and key != "tool_calls":
                raise _bad(
                    f"Unrecognized request argument supplied: {_clip(f'{at}.{key}')}.",
                    f"{at}.{key}",
                    "unknown_parameter",
                )
        out.append({"role": _ROLES[role], "content": _content(message.get("content"), at)})
    return out


def _content(value: object, at: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"'{at}.content' must be a string or a list of parts.", f"{at}.content")
    texts = []
    for n, part in enumerate(value):
        where = f"{at}.content[{n}]"
        if not isinstance(part, dict):
            raise _bad(f"'{where}' must be an object.", where, "invalid_type")
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise _bad(
                f"Only text content parts are supported, not {_clip(kind)}.",
                f"{where}.type",
                "unsupported_feature",
            )
        text = part.get("text")
        if not isinstance(text, str) or set(part) - _PART_KEYS:
            raise _bad(f"'{where}' must be {{'type': 'text', 'text': STRING}}.", where)
        texts.append(text)
    return "".join(texts)


def _no_tools(tools: object, choice: object) -> None:
    if tools is not None and tools != []:
        raise _bad("Tools are not supported.", "tools", "unsupported_feature")
    if choice not in (None, "auto", "none"):
        raise _bad("Tools are not supported.", "tool_choice", "unsupported_feature")


def _text_only(fmt: object) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise _bad(
            "Only text output is supported ('response_format': {'type': 'text'}).",
            "response_format",
            "unsupported_feature",
        )


def _stream_options(value: object, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise _bad("'stream_options' is only allowed with 'stream': true.", "stream_options")
    if not isinstance(value, dict):
        raise _bad("'stream_options' must be an object.", "stream_options", "invalid_type")
    usage = value.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad(
            "'stream_options.include_usage' must be a boolean.",
            "stream_options.include_usage",
            "invalid_type",
        )
    return usage


def _temperature(value: object) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_TEMPERATURE
    ):
        raise _bad(f"'temperature' must be a number in 0..{MAX_TEMPERATURE:g}.", "temperature")
    return float(value)


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """Chat Completions' ``usage`` (``cached``: prompt tokens the KV cache held)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt), "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


class ChatAnswer:
    """The objects of one completion of ``request`` (id ``cid``, ``created`` in seconds)."""

    def __init__(self, request: ChatRequest, cid: str, created: int) -> None:
        self.request = request
        self.id = cid
        self.created = created
        self.parts: list[str] = []

    def _chunk(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}],
        }
        if self.request.include_usage:
            chunk["usage"] = None  # as OpenAI's: every chunk but the last carries a null usage
        return chunk

    def opening(self) -> dict[str, Any]:
        """The first chunk: the assistant's role, no text yet."""
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta(self, text: str) -> dict[str, Any]:
        self.parts.append(text)
        return self._chunk({"content": text}, None)

    def reason(self, produced: int) -> str:
        """``length`` when the client's limit was reached, else ``stop``."""
        limited = self.request.limited and produced >= self.request.max_tokens
        return "length" if limited else "stop"

    def ending(self, produced: int) -> dict[str, Any]:
        """The last chunk with a choice: empty delta, the ``finish_reason``."""
        return self._chunk({}, self.reason(produced))

    def usage_chunk(self, prompt: int, cached: int, completion: int) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": [],
            "usage": usage(prompt, cached, completion),
        }

    def whole(self, prompt: int, cached: int, completion: int) -> dict[str, Any]:
        """The non-streamed ``chat.completion``."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(self.parts)},
                    "finish_reason": self.reason(completion),
                    "logprobs": None,
                }
            ],
            "usage": usage(prompt, cached, completion),
        }


def responses_event(body: dict[str, Any]) -> dict[str, Any]:
    """A ``POST /v1/responses`` body as the WebSocket mode's ``response.create`` event
    (``stream`` is transport there: the session ignores it)."""
    return {**body, "type": "response.create"}


def responses_error(event: dict[str, Any]) -> ApiError:
    """A Responses ``error`` event (``ResponsesSession``'s refusal) as the HTTP error: its own
    status, except 409 for a session that already has a response running."""
    err = event.get("error") or {}
    code = err.get("code")
    status = event.get("status", 400)
    if code == "conversation_already_has_active_response":
        status = 409
    return ApiError(
        status if isinstance(status, int) else 400,
        str(err.get("message", "invalid request")),
        param=err.get("param"),
        code=code,
        kind=err.get("type"),
    )


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (``event``: its name line, as the Responses API writes them)."""
    text = json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {text}\n\n".encode()


def models_list(names: list[str], owner: str = "wslb", created: int = 0) -> dict[str, Any]:
    """``GET /v1/models``'s list."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owner} for name in names
        ],
    }
