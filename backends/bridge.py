"""The engine bridge (``wslb-worker --engine openai``): a real inference server as a wslb worker.

``wslb-worker --engine openai --engine-url URL [--model NAME] --port P --id ID`` puts any
OpenAI-compatible server (vLLM, SGLang, llama.cpp's ``llama-server``, TGI) behind wslb with live
migration. The bridge holds each session's conversation, serves the reference worker's chat
protocol and the OpenAI Realtime protocol to wslb, and streams ``POST URL/v1/chat/completions``
(``stream: true``) from the engine: one chat ``token`` message, or one
``response.output_text.delta``, per streamed chunk with non-empty content (``i`` counts chunks).

Routes, on one port (as ``backends.worker``):

- WebSocket ``/v1/realtime``: the OpenAI Realtime protocol (``backends.protocol.realtime``); a
  ``response.create`` is a streamed chat completion of the conversation's messages.
- WebSocket ``/v1/responses``: the OpenAI Responses API's WebSocket mode
  (``backends.protocol.responses``); a ``response.create`` is a streamed chat completion of
  the response's conversation (the one ``previous_response_id`` continues, plus its input);
  an engine failure ends it with ``response.failed``.
- The OpenAI HTTP API (docs/protocol.md section 3c): ``GET /v1/models`` and ``POST
  /v1/chat/completions`` proxied to the engine as they are, streamed back as they come (502
  when the engine cannot be reached; the client's body cut if it is lost mid-answer);
  ``POST /v1/responses`` the bridge's own Responses session (the WebSocket mode's, on the
  ``X-Session-Id`` session) over a streamed chat completion.
- WebSocket ``/``, ``/ws`` (and any other path): the chat protocol (docs/protocol.md section 3).
  The session id: ``X-Session-Id``, else ``?session=``, else a generated one.
- ``GET /healthz``: 200 ``{"status":"ok","flavor":F,"model":M}`` while the engine's own
  ``GET /health`` answers 200 (polled every ``--health-interval`` s), else 503
  ``{"status":"engine down","error":WHY}``; 503 ``{"status":"draining"}`` after SIGTERM.
- ``GET /metrics``: the bridge's gauges and counters (``METRIC_NAMES``).
- ``POST /wslb/sessions/{sid}/freeze`` and ``/thaw``: the handoff API; a WebSocket upgrade with
  ``X-WSLB-Resume: SID`` continues a thawed session (no ``hello``). 404 with ``--no-handoff``.
  Who may call them (and the upgrades) is the reference worker's rule (``backends.auth``).
- Parking (``backends.park``; docs/protocol.md section 4a), as the reference worker: an
  upgrade with ``X-WSLB-Park`` whose leg is lost without a close frame keeps streaming into a
  bounded window (a full window pauses the engine's stream over TCP) until an
  ``X-WSLB-Reattach`` upgrade continues it, or its grace ends. A connection dropped for a lost
  engine is never parked.
- The engine's API key: ``--engine-api-key-file PATH`` or ``$WSLB_ENGINE_API_KEY``; the old
  ``--engine-api-key KEY`` is refused (exit 2), since ``ps`` shows a command line to everyone.

Chat protocol, as the reference worker's, plus:

- a ``prompt`` may carry ``temperature`` (a number in 0..2), passed to the engine; without it
  ``--temperature`` if set, else the engine's default.
- ``token`` messages carry ``ids`` (the chunk's token ids) when the engine returns them.
- ``done``: ``tokens`` is the engine's ``usage.completion_tokens`` (over every bridge the
  answer ran on) when it reports usage, else the number of chunks; ``cached_tokens`` the
  engine's ``usage.prompt_tokens_details.cached_tokens`` or llama-server's ``timings.cache_n``
  (0 when it reports neither); ``prefill_ms`` llama-server's ``timings.prompt_ms``, else the time
  to the first chunk as measured here.
- **An engine failure** (it answers an HTTP error, sends an error event or malformed data,
  ends the stream early, or sends nothing for ``--engine-timeout`` s) ends the turn with
  ``{"type":"error","error":"engine: WHY","turn":K}`` and no ``done``; the tokens sent before it
  stay sent, the conversation is left as it was before that prompt (so the client may send it
  again) and the next queued prompt goes on. On the Realtime protocol: an ``error`` event (type
  ``server_error``, code ``engine_error``, message ``engine: WHY``), then the response ends with
  status ``incomplete``.
- **A lost engine** (the connection to it refused, reset or cut in the middle of the stream, or
  no connection within the connect timeout) is, with ``--engine-lost drop`` (the default), the
  failure of this worker for that answer: the engine is marked down at once (``/healthz`` 503
  until its ``/health`` answers 200 again; a ``thaw`` gets 503 meanwhile), one warning is
  logged per session, and the session's WebSocket is aborted without a close frame (its
  transport dropped once the frames written so far are flushed), which wslb takes for a crashed
  worker: with ``failover`` on it resumes the answer on another worker from its journal.
  ``--engine-lost error`` treats it as an engine failure instead (for clients without wslb).
- A ``cancel`` aborts the engine request at once (its HTTP connection is closed, which vLLM,
  SGLang, llama-server and TGI take as an abort); the answer ends with ``done``.
- Backpressure: each chunk is written to the client (and the write drained) before the next is
  read from the engine, so a slow client slows the engine's stream over TCP: nothing is
  buffered without bound.

Continuation (a thawed answer): the engine is asked for the same messages plus a final
assistant message holding the text sent so far, with ``max_tokens`` lowered by the tokens
already sent (their ids' count when the engine returned ids, else the chunks). Per flavour
(``--engine-flavor``; ``auto`` asks the engine's ``/v1/models``' ``owned_by``, then TGI's
``/info``, then llama-server's ``/props``):

- ``vllm``, ``sglang``: ``continue_final_message: true, add_generation_prompt: false``;
  ``vllm`` also gets ``return_token_ids: true`` (ids carried when the engine sends them).
- ``llamacpp``: the same pair; llama-server also continues a trailing assistant message by
  itself, and where it repeats that prefix at the start of its output the repeat is dropped.
- ``tgi``: nothing added: TGI continues a final assistant message by itself.

Handoff state (``state_version`` 2): the open transcript form of docs/protocol.md (which this
bridge accepts from wslb for crash failover), with additions a reader may ignore::

    {"v": 2, "session": SID, "protocol": "wslb-chat" | "openai-realtime" | "openai-responses",
     "messages": [{"role": R, "content": STR}, ...],   # the conversation before the answer
     "answer": null | {"turn": K, "i": I, "text": SENT, "max_tokens": M,
                       # additions, all optional on thaw:
                       "tokens": N, "ids": [ID, ...], "cached_tokens": C, "prefill_ms": F,
                       "prompt_tokens": P, "cancelled": false, "finished": null | REASON,
                       "temperature": null | T},
     "queued": [PROMPT, ...],      # wslb-chat: prompt messages ({"text"|"messages",
                                   # "max_tokens", "temperature"}); openai-realtime and
                                   # openai-responses: client events to act on after the resume
     "turns": K,                   # optional: turns started (default: answer.turn, else the
                                   # assistant messages)
     "realtime": {...},            # optional: the Realtime session (RealtimeSession.snapshot);
                                   # without it one is rebuilt from the messages (new ids)
     "responses": {...},           # openai-responses: the Responses session
                                   # (ResponsesSession.snapshot), required
     "worker": ID}                 # informative

``messages`` holds the conversation up to the unfinished answer's prompt, never the answer's
partial text (that is ``answer.text``); ``answer.i`` is the index of the next chunk to send.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, cast

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.auth import WorkerAuth
from backends.handoff import ProtocolError, StateError, TranscriptAnswer
from backends.protocol.openai_http import ApiError, responses_error, responses_event
from backends.protocol.realtime import RealtimeSession, Respond, Send, restore_transcript
from backends.protocol.responses import PROTOCOL as RESPONSES
from backends.protocol.responses import Respond as ResponsesRespond
from backends.protocol.responses import ResponsesSession
from backends.protocol.responses import restore_transcript as restore_responses
from backends.server import (
    ApiCall,
    Connection,
    EventStream,
    RealtimeConnection,
    ResponsesConnection,
    Server,
    active_sessions_metric,
    add_listen_options,
    add_log_level,
    add_max_tokens_default,
    add_session_ttl,
    add_subprotocols,
    add_worker_auth,
    announce,
    check_listen_options,
    connections_metric,
    dumps,
    handoffs_metric,
    inter_token_latency_metric,
    json_error,
    parked_sessions_metric,
    reattaches_metric,
    run_process,
    serve_until_signal,
    subprotocols,
    worker_auth_from_args,
)
from backends.wire import (  # all of them re-exported: both workers speak wire's constants
    ITL_BUCKETS,
    MAX_QUEUED_PROMPTS,
    MAX_SESSION_ID_LEN,
    MAX_STATE_BYTES,
    METRICS_CONTENT_TYPE,
    READY_PREFIX,
    REALTIME_PATH,
    RESPONSES_PATH,
    RESUME_HEADER,
    Histogram,
)
from balancer.contract import (  # the prompt's and transcript's rules: wslb's journal's too
    MAX_TEMPERATURE,
    ChatPrompt,
    chat_messages,
    read_prompt,
    read_temperature,
    read_transcript,
)

__all__ = [
    "FLAVORS",
    "ITL_BUCKETS",
    "MAX_QUEUED_PROMPTS",
    "MAX_SESSION_ID_LEN",
    "MAX_STATE_BYTES",
    "METRICS_CONTENT_TYPE",
    "METRIC_NAMES",
    "READY_PREFIX",
    "REALTIME_PATH",
    "RESPONSES_PATH",
    "RESUME_HEADER",
    "STATE_VERSION",
    "Bridge",
    "BridgeConfig",
    "EngineError",
    "EngineLost",
    "Histogram",
    "build_parser",
    "config_from_args",
    "main",
    "serve",
]

log = logging.getLogger("wslb.bridge")


STATE_VERSION = 2
Flavor: TypeAlias = Literal["vllm", "sglang", "llamacpp", "tgi"]
FLAVORS: tuple[Flavor, ...] = ("vllm", "sglang", "llamacpp", "tgi")
METRIC_NAMES = (
    "wslb_worker_active_sessions",
    "wslb_worker_sessions",
    "wslb_worker_streams",
    "wslb_worker_queue_depth",
    "wslb_worker_engine_up",
    "wslb_worker_connections_total",
    "wslb_worker_handoffs_total",
    "wslb_worker_parked_sessions",
    "wslb_worker_reattaches_total",
    "wslb_worker_engine_errors_total",
    "wslb_worker_inter_token_latency_seconds_sum",  # a histogram: also _count and _bucket
    "wslb_worker_inter_token_latency_seconds_count",
)
_ERROR_BODY = 2048  # bytes of an engine's error answer quoted in the message
DROP_FLUSH = 1.0  # seconds a dropped connection's written frames may take to reach the kernel
HEALTH_TIMEOUT = 2.0  # seconds for one probe of the engine's /health
API_KEY_ENV = "WSLB_ENGINE_API_KEY"  # the engine's key, when --engine-api-key-file is not given

Msg: TypeAlias = dict[str, str]


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    """Everything the bridge's options set."""

    engine_url: str
    host: str = "127.0.0.1"
    port: int = 9001
    worker_id: str | None = None
    """None: ``bridge-PORT`` with the port actually bound."""
    model: str | None = None
    """None: the first model the engine's ``/v1/models`` lists."""
    flavor: Flavor | Literal["auto"] = "auto"
    api_key: str | None = None
    subprotocols: tuple[str, ...] = ()
    handoff: bool = True
    max_tokens_default: int = 64
    max_tokens_limit: int = 1_000_000
    temperature: float | None = None
    session_ttl: float = 300.0
    health_interval: float = 1.0
    engine_timeout: float = 60.0
    """Seconds an engine stream may send nothing before the answer fails."""
    connect_timeout: float = 5.0
    close_timeout: float = 5.0
    drain_grace: float = 30.0
    engine_lost: Literal["drop", "error"] = "drop"
    """A lost engine mid-answer: drop the connection (wslb fails it over), or an ``error``."""
    worker_auth: WorkerAuth = field(default_factory=WorkerAuth)
    """The credential wslb shows (``backends.auth``); none: the handoff API is closed."""


class EngineError(Exception):
    """The engine failed an answer; the message says how (sent as ``engine: MESSAGE``)."""


class EngineLost(EngineError):
    """The engine was lost: its connection refused, reset or cut before the answer's end."""


PromptError = ProtocolError
"""A client message the bridge cannot act on (``balancer.contract``'s rules raise it)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt waiting for its answer: a chat-protocol ``prompt`` or a Realtime response.

    ``text``: a user message continuing the held conversation; ``messages``: the whole
    conversation (it replaces the held one; for a Realtime response, its input).
    """

    max_tokens: int
    text: str | None = None
    messages: tuple[Msg, ...] | None = None
    temperature: float | None = None

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        if self.text is not None:
            obj["text"] = self.text
        else:
            obj["messages"] = [dict(m) for m in self.messages or ()]
        obj["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            obj["temperature"] = self.temperature
        return obj


def parse_prompt(obj: dict[str, Any], default_max: int, limit: int) -> Prompt:
    """Validate a ``prompt`` message: ``balancer.contract.read_prompt``, the rules the
    reference worker and wslb's journal apply too.

    Raises:
        ProtocolError: with the chat protocol's messages (docs/protocol.md).
    """
    return bridge_prompt(read_prompt(obj, limit), default_max)


def bridge_prompt(prompt: ChatPrompt, default_max: int) -> Prompt:
    """A valid chat prompt as the bridge queues it (``default_max`` when it names none)."""
    max_tokens = default_max if prompt.max_tokens is None else prompt.max_tokens
    return Prompt(max_tokens, prompt.text, prompt.messages, prompt.temperature)


def parse_messages(messages: object, where: str = "messages") -> list[Msg]:
    """Chat messages as ``{"role", "content"}`` with string content (parts' texts joined)."""
    return chat_messages(messages, where, ProtocolError, quote=True)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(_count(v) is not None for v in value):
        return cast(list[int], value)
    return None


@dataclass(slots=True)
class Answer:
    """One turn's answer: what was sent of it, and what the engine reported."""

    turn: int
    base: list[Msg]
    """The messages the answer continues (its prompt included, its own text not)."""
    max_tokens: int
    temperature: float | None = None
    parts: list[str] = field(default_factory=list)
    """The texts of the chunks sent (over every bridge): ``text`` joined."""
    i: int = 0
    """Chunks sent: the index of the next one."""
    ids: list[int] | None = None
    tokens_before: int = 0
    """Engine tokens of the text a thaw brought (sent by another bridge)."""
    chunks_here: int = 0
    usage_tokens: int | None = None
    """This bridge's segment as the engine counted it (``usage.completion_tokens``)."""
    cached_tokens: int | None = None
    prefill_ms: float | None = None
    prompt_tokens: int | None = None
    keep_stats: bool = False
    """Thawed with the first segment's cached_tokens/prefill_ms: report those."""
    cancelled: bool = False
    finished: str | None = None
    """The engine's finish_reason once it gave one (the answer is complete)."""
    rollback: list[Msg] | None = None
    """The conversation before this turn's prompt (restored if the engine fails it)."""

    @property
    def text(self) -> str:
        """The answer's text sent so far."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def tokens(self) -> int:
        """The answer's tokens over every bridge so far (``done``'s ``tokens``)."""
        here = self.usage_tokens if self.usage_tokens is not None else self.chunks_here
        return self.tokens_before + here

    def sent_tokens(self) -> int:
        """Tokens the sent text holds, as far as known (ids, else chunks)."""
        if self.ids is not None:
            return len(self.ids)
        return self.tokens_before + self.chunks_here

    def remaining(self) -> int:
        return self.max_tokens - self.sent_tokens()

    def advance(self, text: str, ids: list[int] | None) -> int:
        """Account one chunk about to be sent; its index."""
        i = self.i
        self.i += 1
        self.chunks_here += 1
        self.parts.append(text)
        if ids is not None:
            if self.ids is None:
                self.ids = list(ids) if self.i == 1 else None
            else:
                self.ids.extend(ids)
        elif self.ids is not None:
            self.ids = None  # a chunk without ids: the count is no longer known exactly
        return i

    def account(self, obj: dict[str, Any]) -> None:
        """Usage and timings of a streamed chunk (usually the last)."""
        usage = obj.get("usage")
        if isinstance(usage, dict):
            tokens = _count(usage.get("completion_tokens"))
            if tokens is not None:
                self.usage_tokens = tokens
            prompt = _count(usage.get("prompt_tokens"))
            if prompt is not None:
                self.prompt_tokens = prompt
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and not self.keep_stats:
                cached = _count(details.get("cached_tokens"))
                if cached is not None:
                    self.cached_tokens = cached
        timings = obj.get("timings")  # llama-server
        if isinstance(timings, dict) and not self.keep_stats:
            cached = _count(timings.get("cache_n"))
            if cached is not None and self.cached_tokens is None:
                self.cached_tokens = cached
            prompt_ms = _number(timings.get("prompt_ms"))
            if prompt_ms is not None:
                self.prefill_ms = prompt_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "i": self.i,
            "text": self.text,
            "max_tokens": self.max_tokens,
            "tokens": self.sent_tokens(),
            "ids": self.ids,
            "cached_tokens": self.cached_tokens,
            "prefill_ms": self.prefill_ms,
            "prompt_tokens": self.prompt_tokens,
            "cancelled": self.cancelled,
            "finished": self.finished,
            "temperature": self.temperature,
        }


class _Echo:
    """Drops a continuation's repeat of the text it continues (llama-server's prefill echo).

    Chunks are held while their text so far is a prefix of the continued text; once it covers
    all of it, the prefix is cut and the rest goes on, else the held chunks go on unchanged.
    """

    __slots__ = ("done", "held", "prefix")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.held: list[tuple[str, list[int] | None]] = []
        self.done = False

    def feed(self, text: str, ids: list[int] | None) -> list[tuple[str, list[int] | None]]:
        if self.done:
            return [(text, ids)]
        self.held.append((text, ids))
        seen = "".join(t for t, _ in self.held)
        if len(seen) < len(self.prefix) and self.prefix.startswith(seen):
            return []
        self.done = True
        held, self.held = self.held, []
        if seen.startswith(self.prefix):
            rest = seen[len(self.prefix) :]
            log.debug("dropped the engine's repeat of %d continued characters", len(self.prefix))
            return [(rest, None)] if rest else []
        return held

    def flush(self) -> list[tuple[str, list[int] | None]]:
        held, self.held = self.held, []
        self.done = True
        return held


async def _sse(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (lines joined), in order."""
    data: list[str] = []
    while True:
        raw = await content.readline()
        if not raw:
            break
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _error_text(obj: object) -> str:
    """An engine's error body as one line: OpenAI's ``{"error":{"message"}}``, vLLM's
    ``{"message"}``, TGI's ``{"error": STR}``; else the JSON itself."""
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return cast(str, err["message"])
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return cast(str, obj["message"])
        if isinstance(obj.get("detail"), str):
            return cast(str, obj["detail"])
    return json.dumps(obj)[:_ERROR_BODY]


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    raw = await resp.content.read(_ERROR_BODY)
    text = raw.decode("utf-8", "replace").strip()
    try:
        detail = _error_text(json.loads(text))
    except ValueError:
        detail = text or (resp.reason or "")
    return f"HTTP {resp.status}: {detail}" if detail else f"HTTP {resp.status}"


def engine_base(url: str) -> str:
    """The engine's base URL: OpenAI base URLs are usually written with ``/v1``
    (``http://host:8000/v1``), and the bridge appends ``/v1/...`` itself."""
    url = url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url


class EngineMisconfigured(RuntimeError):
    """The engine answered at start in a way that makes every prompt fail."""


class _Engine:
    """The engine's address, flavour and model, found out once it answers."""

    def __init__(self, config: BridgeConfig) -> None:
        self.url = engine_base(config.engine_url)
        self.flavor: Flavor | None = None if config.flavor == "auto" else config.flavor
        self.model = config.model
        self.headers = {"Accept": "text/event-stream"}
        if config.api_key:
            self.headers["Authorization"] = f"Bearer {config.api_key}"
        self.up = False
        self.why = "not checked yet"

    async def _json(self, http: aiohttp.ClientSession, path: str) -> Any:
        timeout = aiohttp.ClientTimeout(total=3)
        async with http.get(self.url + path, headers=self.headers, timeout=timeout) as r:
            if r.status != 200:
                return None
            with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                return await r.json(content_type=None)
        return None

    async def verify(self, http: aiohttp.ClientSession) -> str | None:
        """At start: why the engine at ``url`` cannot be the one meant, or None. An engine
        that answers HTTP must serve ``GET /v1/models`` (404 there is a wrong ``--engine-url``,
        401/403 a wrong key: every prompt would fail). One not reachable yet is not an error:
        a sidecar's bridge often starts before its engine has loaded the model."""
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)
        try:
            async with http.get(
                self.url + "/v1/models", headers=self.headers, timeout=timeout
            ) as r:
                if r.status in (401, 403):
                    return (
                        f"the engine at {self.url} refused GET /v1/models with {r.status}: "
                        f"check the API key ({API_KEY_ENV} or --engine-api-key-file)"
                    )
                if r.status == 404:
                    return (
                        f"the engine at {self.url} has no /v1/models (404): --engine-url must "
                        "be the server's base URL, e.g. http://127.0.0.1:8000 (with or without "
                        "/v1), where GET /v1/models lists the served models"
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "engine %s not reachable yet (%s); the bridge serves errors until it answers",
                self.url,
                _describe(exc) or type(exc).__name__,
            )
        return None

    async def discover(self, http: aiohttp.ClientSession) -> None:
        """Learn the model and, for ``auto``, the flavour (best effort; retried while unknown)."""
        models: Any = None
        if self.model is None or self.flavor is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                models = await self._json(http, "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        if self.model is None and isinstance(first.get("id"), str):
            self.model = first["id"]
            log.info("engine model: %s", self.model)
        if self.flavor is not None:
            return
        owner = str(first.get("owned_by", "")).lower()
        for name in ("vllm", "sglang", "llamacpp"):
            if name in owner.replace(".", "").replace("_", ""):
                self.flavor = name
        if self.flavor is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                info = await self._json(http, "/info")
                if isinstance(info, dict) and "text-generation" in str(info.get("router", "")):
                    self.flavor = "tgi"
        if self.flavor is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                props = await self._json(http, "/props")
                if isinstance(props, dict) and "default_generation_settings" in props:
                    self.flavor = "llamacpp"
        if self.flavor is not None:
            log.info("engine flavour: %s", self.flavor)

    async def check(self, http: aiohttp.ClientSession) -> None:
        """One health probe: ``GET /health``."""
        why: str | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)
            async with http.get(self.url + "/health", headers=self.headers, timeout=timeout) as r:
                if r.status != 200:
                    why = f"GET /health: {await _http_error(r)}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"GET /health: {_describe(exc) or type(exc).__name__}"
        if why is None and (self.flavor is None or self.model is None):
            await self.discover(http)
        self.mark(why)

    def mark(self, why: str | None) -> None:
        if why is None:
            if not self.up:
                log.info("engine %s is up", self.url)
            self.up, self.why = True, ""
        else:
            if self.up or why != self.why:
                log.warning("engine %s is down: %s", self.url, why)
            self.up, self.why = False, why

    def body(self, ans: Answer, default_temperature: float | None) -> dict[str, Any]:
        """The chat completion request that produces the rest of ``ans``."""
        messages: list[Msg] = [dict(m) for m in ans.base]
        body: dict[str, Any] = {
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": ans.remaining(),
        }
        if self.model is not None:
            body["model"] = self.model
        temperature = ans.temperature if ans.temperature is not None else default_temperature
        if temperature is not None:
            body["temperature"] = temperature
        flavor = self.flavor or "vllm"
        if ans.text:  # a continuation: the engine goes on with the final assistant message
            messages.append({"role": "assistant", "content": ans.text})
            if flavor != "tgi":
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
        if flavor == "vllm":
            body["return_token_ids"] = True
        return body


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port}: {exc.os_error.strerror or exc.os_error}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(slots=True)
class _Session:
    """A session's conversation, held while connected and ``--session-ttl`` after."""

    sid: str
    messages: list[Msg] = field(default_factory=list)
    turns: int = 0
    realtime: RealtimeSession | None = None
    responses: ResponsesSession | None = None
    connections: int = 0
    idle_since: float = 0.0


@dataclass(slots=True)
class _Thawed:
    """A session installed by ``thaw``, waiting for its resumed connection."""

    protocol: str
    answer: Answer | None
    queued: list[Prompt]
    events: list[dict[str, Any]]
    """openai-realtime: client events to act on after the resume."""
    since: float


class _Sink(Protocol):
    """What ``Bridge.generate`` streams an answer to: a WebSocket connection, or an HTTP
    request's ``_HttpSink``."""

    @property
    def sid(self) -> str: ...
    @property
    def stop(self) -> asyncio.Event: ...
    async def emit_chunk(self, ans: Answer, text: str, ids: list[int] | None) -> None: ...


class _HttpSink:
    """An HTTP ``POST /v1/responses``'s end of ``generate``: each chunk a Responses delta,
    handed to ``emit``; nothing sets ``stop`` (a client that leaves is noticed at the next
    write, which raises ``ConnectionError``)."""

    def __init__(
        self,
        sid: str,
        rs: ResponsesSession,
        emit: Callable[[Sequence[Send]], Awaitable[None]],
    ) -> None:
        self.sid = sid
        self.stop = asyncio.Event()
        self._rs = rs
        self._emit = emit

    async def emit_chunk(self, ans: Answer, text: str, ids: list[int] | None) -> None:
        ans.advance(text, ids)
        await self._emit(self._rs.delta(text))


class _Connection(Connection[Prompt]):
    """One chat-protocol WebSocket in front of the engine (states: ``backends.server``). A
    dropped one (its engine lost mid-answer, ``drop``) has its transport aborted.
    """

    protocol = "wslb-chat"

    def __init__(self, bridge: Bridge, ws: web.WebSocketResponse, session: _Session) -> None:
        super().__init__(bridge, ws, session.sid)
        self.bridge = bridge
        self.session = session
        self.current: Answer | None = None
        self.stop = asyncio.Event()
        self.resumed: Answer | None = None
        self.last_chunk: float | None = None
        self.transport: asyncio.Transport | None = None
        """The connection's TCP transport (aborted by ``drop``)."""

    def read_prompt(self, obj: dict[str, Any]) -> Prompt:
        cfg = self.bridge.config
        return parse_prompt(obj, cfg.max_tokens_default, cfg.max_tokens_limit)

    def current_turn(self) -> int | None:
        return None if self.current is None else self.current.turn

    def turns_started(self) -> int:
        return self.session.turns

    def interrupt(self) -> None:
        if self.current is not None:
            self.current.cancelled = True
        self.stop.set()

    def begin(self, prompt: Prompt) -> Answer:
        """Start the turn of ``prompt`` (synchronous: the conversation takes its prompt)."""
        s = self.session
        before = list(s.messages)
        if prompt.text is not None:
            base = [*before, {"role": "user", "content": prompt.text}]
        else:
            base = [dict(m) for m in prompt.messages or ()]
        s.turns += 1
        s.messages = base
        return Answer(s.turns, list(base), prompt.max_tokens, prompt.temperature, rollback=before)

    async def emit_chunk(self, ans: Answer, text: str, ids: list[int] | None) -> None:
        msg: dict[str, Any] = {"type": "token", "turn": ans.turn, "i": ans.i, "text": text}
        if ids is not None:
            msg["ids"] = ids
        ans.advance(text, ids)
        await self.send(msg)

    def commit(self, ans: Answer) -> None:
        self.session.messages = [*ans.base, {"role": "assistant", "content": ans.text}]

    async def emit_done(self, ans: Answer) -> None:
        self.commit(ans)
        await self.send(
            {
                "type": "done",
                "turn": ans.turn,
                "tokens": ans.tokens(),
                "cached_tokens": ans.cached_tokens or 0,
                "prefill_ms": round(ans.prefill_ms or 0.0, 3),
                "worker": self.bridge.worker_id,
            }
        )

    async def emit_failure(self, ans: Answer, why: str) -> None:
        if ans.rollback is not None:
            self.session.messages = ans.rollback
        else:  # a thawed answer: keep what the client saw
            self.commit(ans)
        await self.send({"type": "error", "error": f"engine: {why}", "turn": ans.turn})

    def pending(self) -> tuple[Answer | None, list[Prompt]]:
        """The unfinished answer and the queued prompts, taken out of this connection."""
        queued: list[Prompt] = []
        while not self.queue.empty():
            queued.append(self.queue.get_nowait())
        answer, self.current = self.current, None
        return answer, queued

    def export(self) -> dict[str, Any]:
        """Freeze: the session's handoff state (synchronous, see ``Bridge._freeze``)."""
        answer, queued = self.pending()
        s = self.session
        return {
            "v": STATE_VERSION,
            "session": s.sid,
            "protocol": self.protocol,
            "messages": [dict(m) for m in (answer.base if answer is not None else s.messages)],
            "answer": None if answer is None else answer.to_json(),
            "queued": [p.to_json() for p in queued],
            "turns": s.turns,
            "worker": self.bridge.worker_id,
        }

    def abandon(self) -> None:
        """The connection ended without a freeze; the session stays for a reconnect."""
        ans, self.current = self.current, None
        if ans is None:
            return
        if ans.text or ans.rollback is None:
            self.commit(ans)
        else:
            self.session.messages = ans.rollback

    def freeze(self) -> dict[str, Any]:
        self.halt()
        return self.export()

    async def answer(self) -> None:
        resumed, self.resumed = self.resumed, None
        if resumed is not None:
            await self.run(resumed)
        while True:
            prompt = await self.queue.get()
            ans = self.begin(prompt)
            self.current = ans
            await self.run(ans)

    async def run(self, ans: Answer) -> None:
        """Stream the answer from the engine, then end it with done (or the failure); a lost
        engine with ``--engine-lost drop``: drop the connection (raises ``ConnectionError``)."""
        self.current = ans
        failure: EngineError | None = None
        if not (ans.cancelled or ans.finished is not None or ans.remaining() <= 0):
            failure = await self.bridge.generate(self, ans)
        if isinstance(failure, EngineLost) and self.bridge.config.engine_lost == "drop":
            await self.drop(ans, str(failure))  # self.current stays: abandon() settles it
            raise ConnectionResetError("connection dropped: engine lost")
        self.current = None
        if failure is None:
            await self.emit_done(ans)
        else:
            await self.emit_failure(ans, str(failure))

    async def drop(self, ans: Answer, why: str) -> None:
        """Fail as a crashed worker does: no more frames, no close frame, the transport aborted
        once what was written has reached the kernel (so the peer gets whole frames only)."""
        log.warning(
            "engine lost mid-answer on session %s (turn %d, %d chunks sent: %s); dropping the "
            "connection so the balancer can fail it over",
            self.sid,
            ans.turn,
            ans.i,
            why,
        )
        self.dropped = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DROP_FLUSH
        # No event tells when a transport's buffer is empty (only below its low-water mark).
        while transport.get_write_buffer_size() and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        transport.abort()


class _RealtimeConnection(RealtimeConnection[Prompt], _Connection):
    """A connection speaking the OpenAI Realtime protocol (``backends.server``): a
    ``Respond`` is queued as a prompt of its messages; each chunk is a ``delta``, the end
    ``finish``.
    """

    protocol = "openai-realtime"

    def __init__(
        self,
        bridge: Bridge,
        ws: web.WebSocketResponse,
        session: _Session,
        rt: RealtimeSession,
    ) -> None:
        super().__init__(bridge, ws, session)
        self.open_realtime(rt)

    def respond(self, out: Respond) -> Prompt:
        return Prompt(
            out.max_tokens,
            messages=tuple(dict(m) for m in out.messages),
            temperature=self.bridge.config.temperature,
        )

    def begin(self, prompt: Prompt) -> Answer:
        s = self.session
        s.turns += 1
        ans = Answer(s.turns, [dict(m) for m in prompt.messages or ()], prompt.max_tokens)
        ans.temperature = prompt.temperature
        ans.cancelled = self.rt.cancel_requested
        return ans

    async def emit_chunk(self, ans: Answer, text: str, ids: list[int] | None) -> None:
        ans.advance(text, ids)
        self.outbox.extend(self.rt.delta(text))
        await self.outbox.flush()

    def commit(self, ans: Answer) -> None:
        pass  # the Realtime session holds the conversation

    def _finish(self, ans: Answer, status: Literal["incomplete"] | None = None) -> None:
        if self.rt.response_id is None:
            return
        self.outbox.extend(
            self.rt.finish(
                status,
                input_tokens=ans.prompt_tokens or 0,
                cached_tokens=min(ans.cached_tokens or 0, ans.prompt_tokens or 0),
                output_tokens=ans.tokens(),
            )
        )

    async def emit_done(self, ans: Answer) -> None:
        self._finish(ans)
        await self.outbox.flush()

    async def emit_failure(self, ans: Answer, why: str) -> None:
        self.outbox.extend(self.rt.error(f"engine: {why}", code="engine_error"))
        self._finish(ans, "incomplete")
        await self.outbox.flush()

    def pending(self) -> tuple[Answer | None, list[Prompt]]:
        answer, queued = super().pending()
        if answer is None and queued:  # a response created but not started yet
            answer, queued = self.begin(queued[0]), queued[1:]
        return answer, queued

    def export(self) -> dict[str, Any]:
        state = super().export()
        state["queued"] = []
        if state["answer"] is None:
            state["messages"] = self.rt.messages()
        return self.realtime_state(state)

    def abandon(self) -> None:
        self.current = None
        super().abandon()


class _ResponsesConnection(ResponsesConnection[Prompt], _Connection):
    """A connection speaking the Responses API's WebSocket mode (``backends.server``): a
    ``Respond`` is queued as a prompt of its messages (the response's conversation), each chunk
    is a ``delta``, the end ``finish``, an engine failure ``response.failed``.
    """

    protocol = RESPONSES

    def __init__(
        self,
        bridge: Bridge,
        ws: web.WebSocketResponse,
        session: _Session,
        rs: ResponsesSession,
    ) -> None:
        super().__init__(bridge, ws, session)
        self.open_responses(rs)

    def respond(self, out: ResponsesRespond) -> Prompt:
        temperature = out.temperature
        return Prompt(
            out.max_tokens,
            messages=tuple(dict(m) for m in out.messages),
            temperature=self.bridge.config.temperature if temperature is None else temperature,
        )

    def begin(self, prompt: Prompt) -> Answer:
        s = self.session
        s.turns += 1
        ans = Answer(s.turns, [dict(m) for m in prompt.messages or ()], prompt.max_tokens)
        ans.temperature = prompt.temperature
        return ans

    async def emit_chunk(self, ans: Answer, text: str, ids: list[int] | None) -> None:
        ans.advance(text, ids)
        self.outbox.extend(self.rs.delta(text))
        await self.outbox.flush()

    def commit(self, ans: Answer) -> None:
        pass  # the Responses session holds the conversation

    async def emit_done(self, ans: Answer) -> None:
        if self.rs.response_id is not None:
            prompt = ans.prompt_tokens or 0
            self.outbox.extend(
                self.rs.finish(
                    input_tokens=prompt,
                    cached_tokens=min(ans.cached_tokens or 0, prompt),
                    output_tokens=ans.tokens(),
                    now=time.time(),
                )
            )
        await self.outbox.flush()

    async def emit_failure(self, ans: Answer, why: str) -> None:
        if self.rs.response_id is not None:
            prompt = ans.prompt_tokens or 0
            self.outbox.extend(
                self.rs.fail(
                    f"engine: {why}",
                    input_tokens=prompt,
                    cached_tokens=min(ans.cached_tokens or 0, prompt),
                    output_tokens=ans.tokens(),
                )
            )
        await self.outbox.flush()

    def pending(self) -> tuple[Answer | None, list[Prompt]]:
        answer, queued = super().pending()
        if answer is None and queued:  # a response created but not started yet
            answer, queued = self.begin(queued[0]), queued[1:]
        return answer, queued

    def export(self) -> dict[str, Any]:
        state = super().export()
        state["queued"] = []
        if state["answer"] is None:
            state["messages"] = self.rs.messages()
        return self.responses_state(state)

    def abandon(self) -> None:
        self.current = None
        super().abandon()


class _BridgeCollector(Collector):
    """Reads the bridge at scrape time."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    def collect(self) -> Iterator[Metric]:
        b = self.bridge
        yield active_sessions_metric(sum(1 for s in b.sessions.values() if s.connections > 0))
        yield GaugeMetricFamily(
            "wslb_worker_sessions",
            "Sessions held (open, or closed within --session-ttl, or thawed)",
            value=len(b.sessions),
        )
        yield GaugeMetricFamily("wslb_worker_streams", "Engine streams in flight", value=b.streams)
        yield GaugeMetricFamily(
            "wslb_worker_queue_depth",
            "Prompts waiting behind another answer on their connection",
            value=b.queued_prompts(),
        )
        yield GaugeMetricFamily(
            "wslb_worker_engine_up",
            "1 while the engine's health route answers 200",
            value=1.0 if b.engine.up else 0.0,
        )
        yield connections_metric(b)
        yield handoffs_metric(b)
        yield parked_sessions_metric(b)
        yield reattaches_metric(b)
        yield CounterMetricFamily(
            "wslb_worker_engine_errors", "Answers the engine failed", value=b.engine_errors
        )
        yield inter_token_latency_metric(b, "Time between a stream's successive chunks")


_State: TypeAlias = tuple[_Session, _Thawed]
"""A thaw's state, read: the session to hold and its pending answer and queue."""
_Claim: TypeAlias = tuple[_Session, _Thawed | None]
"""An upgrade's session and, for a resume, its thawed answer and queue."""


class Bridge(Server[BridgeConfig, _Connection, _State, _Claim]):
    """The bridge's HTTP/WebSocket server (``backends.server``) in front of one engine."""

    id_prefix = "bridge"
    logger = log

    def __init__(self, config: BridgeConfig) -> None:
        super().__init__(config)
        self.engine = _Engine(config)
        self.sessions: dict[str, _Session] = {}
        self._thawed: dict[str, _Thawed] = {}
        self.streams = 0
        self.engine_errors = 0
        self.registry.register(_BridgeCollector(self))
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._wake_poller = asyncio.Event()

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "Bridge.start() first"
        return self._http

    async def _starting(self) -> None:
        """Start the engine client and poll the engine (its first probe answered)."""
        # No pool limit: each stream holds a connection for its whole answer.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        problem = await self.engine.verify(self.http)
        if problem is not None:
            await self._http.close()
            raise EngineMisconfigured(problem)
        await self.engine.check(self.http)
        self._poller = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_poller.wait(), self.config.health_interval)
            self._wake_poller.clear()
            try:
                await self.engine.check(self.http)
            except Exception:  # the poller must outlive any surprise
                log.exception("engine health check failed")
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        ttl = self.config.session_ttl
        for sid in [
            sid
            for sid, s in self.sessions.items()
            if s.connections == 0 and now - s.idle_since > ttl
        ]:
            del self.sessions[sid]
            self._thawed.pop(sid, None)

    async def _closing(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def _closed(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- the engine -------------------------------------------------------------------------

    async def generate(self, conn: _Sink, ans: Answer) -> EngineError | None:
        """Stream the rest of ``ans`` to ``conn``; None when it ended (or was cancelled), else
        how the engine failed (``EngineLost``: it was lost). A cancel (``conn.stop``) or a
        cancellation of the caller (a freeze, a closed connection) aborts the engine request
        before this returns."""
        if self.engine.flavor is None and ans.text:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self.engine.discover(self.http)
        conn.stop.clear()
        if ans.cancelled:
            return None
        stream = asyncio.create_task(self._stream(conn, ans))
        stopper = asyncio.create_task(conn.stop.wait())
        self.streams += 1
        try:
            await asyncio.wait({stream, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            stream.cancel()
            await asyncio.wait({stream})
            self.streams -= 1
        if stream.cancelled():
            return None  # the client cancelled
        exc = stream.exception()
        if exc is None:
            return None
        if isinstance(exc, EngineError):
            self.engine_errors += 1
            if not isinstance(exc, EngineLost) or self.config.engine_lost == "error":
                log.warning("engine failed turn %d of session %s: %s", ans.turn, conn.sid, exc)
            return exc
        raise exc

    async def _stream(self, conn: _Sink, ans: Answer) -> None:
        engine = self.engine
        cfg = self.config
        body = engine.body(ans, cfg.temperature)
        loop = asyncio.get_running_loop()
        started = loop.time()
        echo = _Echo(ans.text) if ans.text and engine.flavor == "llamacpp" else None
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.engine_timeout
        )
        last: float | None = None
        try:
            async with self.http.post(
                engine.url + "/v1/chat/completions",
                json=body,
                headers=engine.headers,
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    raise EngineError(await _http_error(resp))
                complete = False
                try:
                    async for data in _sse(resp.content):
                        if data.strip() == "[DONE]":
                            complete = True
                            break
                        try:
                            obj = json.loads(data)
                        except ValueError:
                            raise EngineError(
                                f"a stream event is not JSON: {data[:80]!r}"
                            ) from None
                        if not isinstance(obj, dict):
                            raise EngineError(f"a stream event is not an object: {data[:80]!r}")
                        if obj.get("error") is not None:
                            raise EngineError(_error_text(obj))
                        ans.account(obj)
                        choices = obj.get("choices")
                        if not isinstance(choices, list) or not choices:
                            continue
                        choice = choices[0]
                        if not isinstance(choice, dict):
                            continue
                        delta = choice.get("delta")
                        text = delta.get("content") if isinstance(delta, dict) else None
                        if isinstance(text, str) and text:
                            ids = _ids(choice.get("token_ids"))
                            if ans.prefill_ms is None:
                                ans.prefill_ms = (loop.time() - started) * 1e3
                            pieces = echo.feed(text, ids) if echo is not None else [(text, ids)]
                            for piece, piece_ids in pieces:
                                now = loop.time()
                                if last is not None:
                                    self.itl.observe(now - last)
                                last = now
                                await conn.emit_chunk(ans, piece, piece_ids)
                        reason = choice.get("finish_reason")
                        if isinstance(reason, str) and reason:
                            ans.finished = reason
                    if echo is not None:
                        for piece, piece_ids in echo.flush():
                            await conn.emit_chunk(ans, piece, piece_ids)
                    if not complete and ans.finished is None:
                        raise EngineError("the engine's stream ended before the answer did")
                    complete = True
                    ans.finished = ans.finished or "stop"  # a freeze from here on: just done
                finally:
                    if not complete:
                        resp.close()  # drop the connection: the engine aborts the request
        except EngineError:
            raise
        except aiohttp.ConnectionTimeoutError:
            raise self._lost(
                f"cannot connect to {engine.url} within {cfg.connect_timeout:g} s"
            ) from None
        except TimeoutError:
            raise EngineError(f"no data from the engine for {cfg.engine_timeout:g} s") from None
        except aiohttp.ClientConnectionError as exc:  # refused, reset, disconnected
            raise self._lost(_describe(exc)) from None
        except aiohttp.ClientPayloadError as exc:
            if str(exc).startswith("Response payload is not completed"):  # the connection cut
                raise self._lost("the connection was lost mid-stream") from None
            self._wake_poller.set()
            raise EngineError(_describe(exc)) from None
        except aiohttp.ClientError as exc:
            self._wake_poller.set()
            raise EngineError(_describe(exc)) from None

    def _lost(self, why: str) -> EngineLost:
        """The engine is lost: down now (``/healthz`` 503), re-checked at once by the poller."""
        self.engine.mark(why)
        self._wake_poller.set()
        return EngineLost(why)

    # -- HTTP -------------------------------------------------------------------------------

    def _health(self) -> web.Response:
        engine = self.engine
        if not engine.up:
            return web.json_response({"status": "engine down", "error": engine.why}, status=503)
        return web.json_response({"status": "ok", "flavor": engine.flavor, "model": engine.model})

    # -- the OpenAI HTTP API ----------------------------------------------------------------

    async def _list_models(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        return await self._proxy(request, call, "GET", "/v1/models", None)

    async def _chat_completions(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """Proxied as it is: the request carries its whole conversation, so there is nothing
        of the session to keep; the engine's prefix cache (reached again through wslb's
        affinity) is what a session key buys."""
        body = await request.read()
        return await self._proxy(request, call, "POST", "/v1/chat/completions", body)

    async def _proxy(
        self, request: web.Request, call: ApiCall, method: str, path: str, body: bytes | None
    ) -> web.StreamResponse:
        """Forward to the engine and stream its answer back as it comes, each read written
        (and drained) before the next, so a slow client slows the engine over TCP. Before the
        answer starts a failure is a 502 (the engine lost) or 504 (silent for
        ``--engine-timeout``); after it, the client's connection is cut without the body's end,
        so a short answer is never taken for a whole one."""
        engine, cfg = self.engine, self.config
        headers = {"Accept": request.headers.get("Accept", "*/*")}
        if body is not None:
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        if "Authorization" in engine.headers:
            headers["Authorization"] = engine.headers["Authorization"]
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.engine_timeout
        )
        self.streams += 1
        try:
            async with self.http.request(
                method, engine.url + path, data=body, headers=headers, timeout=timeout
            ) as resp:
                kind = resp.headers.get("Content-Type", "application/json")
                out = web.StreamResponse(
                    status=resp.status, headers={"Content-Type": kind, **call.headers}
                )
                if kind.startswith("text/event-stream"):
                    out.headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                await out.prepare(request)
                while True:
                    try:
                        chunk = await resp.content.readany()
                    except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                        why = _describe(exc) or f"no data for {cfg.engine_timeout:g} s"
                        log.warning("engine failed %s %s mid-answer: %s", method, path, why)
                        self.engine_errors += 1
                        if not isinstance(exc, TimeoutError):
                            self._lost(why)
                        if request.transport is not None:
                            request.transport.abort()  # no end of the body: the client sees it
                        return out
                    if not chunk:
                        break
                    try:
                        await out.write(chunk)
                    except ConnectionError:
                        resp.close()  # the client left: the engine aborts the request
                        return out
                await out.write_eof()
                return out
        except aiohttp.ConnectionTimeoutError:
            why = f"cannot connect to {engine.url} within {cfg.connect_timeout:g} s"
            raise ApiError(502, f"engine: {self._lost(why)}", code="engine_unavailable") from None
        except TimeoutError:
            why = f"no answer from the engine for {cfg.engine_timeout:g} s"
            raise ApiError(504, f"engine: {why}", code="engine_timeout") from None
        except aiohttp.ClientError as exc:
            lost = self._lost(_describe(exc))
            raise ApiError(502, f"engine: {lost}", code="engine_unavailable") from None
        finally:
            self.streams -= 1

    async def _create_response(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """The bridge's own Responses session over the engine's chat completions, as its
        WebSocket mode (every engine gets the same events, ``previous_response_id`` and cached
        tokens): the session's, so either transport continues the other's last response."""
        cfg = self.config
        body = await self.read_body(request)
        streamed = body.get("stream", False)
        if not isinstance(streamed, bool):
            raise ApiError(400, "'stream' must be a boolean.", param="stream", code="invalid_type")
        session = _Session(call.sid) if call.ephemeral else self.sessions.get(call.sid)
        if session is None:
            session = self.sessions[call.sid] = _Session(call.sid)
        if session.responses is None:
            session.responses = self._new_responses(call.sid, self.engine.model)
        rs = session.responses
        outs = rs.receive(dumps(responses_event(body)), now=time.time())
        respond = next((o for o in outs if isinstance(o, ResponsesRespond)), None)
        if respond is None:
            raise responses_error(next(o.event for o in outs if isinstance(o, Send)))
        stream = EventStream(request, call) if streamed else None
        final: list[dict[str, Any]] = []

        async def emit(events: Sequence[Send]) -> None:
            for out in events:
                kind = out.event["type"]
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    final.append(out.event["response"])
                if stream is not None:
                    await stream.send(out.event, kind)

        session.turns += 1
        temperature = cfg.temperature if respond.temperature is None else respond.temperature
        ans = Answer(session.turns, [dict(m) for m in respond.messages], respond.max_tokens)
        ans.temperature = temperature
        session.connections += 1  # held while it runs (not expired), as a connection's
        try:
            await emit([o for o in outs if isinstance(o, Send)])
            failure = await self.generate(_HttpSink(call.sid, rs, emit), ans)
            prompt = ans.prompt_tokens or 0
            cached = min(ans.cached_tokens or 0, prompt)
            if failure is None:
                await emit(
                    rs.finish(
                        input_tokens=prompt,
                        cached_tokens=cached,
                        output_tokens=ans.tokens(),
                        now=time.time(),
                    )
                )
            else:
                await emit(
                    rs.fail(
                        f"engine: {failure}",
                        input_tokens=prompt,
                        cached_tokens=cached,
                        output_tokens=ans.tokens(),
                    )
                )
            if stream is not None:
                await stream.end()
        except ConnectionError:  # the client left: the response cannot be continued
            pass
        finally:
            if rs.response_id == respond.response_id:
                rs.abort()
            session.connections -= 1
            if session.connections == 0:
                session.idle_since = time.monotonic()
        if stream is not None:
            return stream.response
        response = final[0]
        if response["status"] == "failed":
            error = response.get("error") or {}
            raise ApiError(502, str(error.get("message", "engine failed")), code="engine_error")
        return web.json_response(response, headers=call.headers)

    # -- handoff ----------------------------------------------------------------------------

    def _moved_away(self, sid: str) -> None:
        self._thawed.pop(sid, None)
        self.sessions.pop(sid, None)  # the conversation lives on where it is thawed

    def _unavailable(self) -> str | None:
        if not self.engine.up and self.config.engine_lost == "drop":
            # It would be dropped at its first answer: let the balancer try the next worker.
            return f"engine down: {self.engine.why}"
        return None

    def _install(self, sid: str, state: _State) -> None:
        session, thawed = state
        now = time.monotonic()
        session.idle_since = now
        thawed.since = now
        self.sessions[sid] = session
        self._thawed[sid] = thawed
        log.info("thawed session %s (%s)", sid, thawed.protocol)

    def _read_state(self, value: object, sid: str) -> _State:
        """Validate a handoff state (the transcript form, or this bridge's superset of it)."""
        cfg = self.config
        head = read_transcript(
            value,
            session=sid,
            max_queued=MAX_QUEUED_PROMPTS,
            max_tokens_limit=cfg.max_tokens_limit,
        )
        protocol, messages = head.protocol, head.messages
        answer = None
        if head.answer is not None:
            answer = _parse_answer(
                head.answer, messages, cfg.max_tokens_limit, cfg.max_tokens_default
            )
        turns = head.turns(None if answer is None else answer.turn)
        queued = [bridge_prompt(q, cfg.max_tokens_default) for q in head.queued]
        events = list(head.events)
        session = _Session(sid, messages=messages, turns=turns)
        if protocol == "openai-realtime":
            session.realtime = self._realtime_state(head.realtime, sid, messages, answer)
        elif protocol == RESPONSES:
            session.responses = restore_responses(
                head.responses,
                session=sid,
                answer=None if answer is None else _transcript_answer(answer),
                model=self.engine.model,
                default_max_tokens=cfg.max_tokens_default,
                max_tokens_limit=cfg.max_tokens_limit,
            )
        return session, _Thawed(protocol, answer, queued, events, 0.0)

    def _realtime_state(
        self, value: object, sid: str, messages: list[Msg], answer: Answer | None
    ) -> RealtimeSession:
        cfg = self.config
        return restore_transcript(
            value,
            session=sid,
            messages=messages,
            answer=None if answer is None else _transcript_answer(answer),
            default_max_tokens=cfg.max_tokens_default,
            max_tokens_limit=cfg.max_tokens_limit,
        )

    # -- WebSocket --------------------------------------------------------------------------

    def _claim(self, sid: str, resume: bool) -> _Claim | web.Response:
        self._expire(time.monotonic())
        thawed = self._thawed.pop(sid, None)
        if resume and thawed is None:
            return json_error(409, f"session {sid!r} was not thawed here")
        session = self.sessions.get(sid)
        if session is None:
            session = self.sessions[sid] = _Session(sid)
        if thawed is not None and not resume:
            _drop_thawed(session, thawed)  # a plain connection: the pending answer is dropped
            thawed = None
        return session, thawed

    def _new_connection(
        self, request: web.Request, ws: web.WebSocketResponse, sid: str, claim: _Claim
    ) -> _Connection:
        session, _ = claim
        conn: _Connection
        if request.path == REALTIME_PATH:
            if session.realtime is None:
                session.realtime = self._new_realtime(request, sid)
            conn = _RealtimeConnection(self, ws, session, session.realtime)
        elif request.path == RESPONSES_PATH:
            if session.responses is None:
                model = request.query.get("model") or self.engine.model
                session.responses = self._new_responses(sid, model)
            conn = _ResponsesConnection(self, ws, session, session.responses)
        else:
            conn = _Connection(self, ws, session)
        conn.transport = request.transport
        return conn

    def _attach(self, conn: _Connection, claim: _Claim, resume: bool) -> Sequence[dict[str, Any]]:
        conn.session.connections += 1
        _, thawed = claim
        if thawed is None:
            return ()
        conn.resumed = thawed.answer
        for prompt in thawed.queued:
            conn.queue.put_nowait(prompt)
        return thawed.events

    def _detach(self, conn: _Connection) -> None:
        conn.abandon()
        session = conn.session
        session.connections -= 1
        if session.connections == 0:
            session.idle_since = time.monotonic()


def _drop_thawed(session: _Session, thawed: _Thawed) -> None:
    """A plain connection to a thawed session: keep the conversation, drop the pending answer
    (its sent text stays as the assistant's reply) and the queue."""
    ans = thawed.answer
    if ans is None:
        return
    if thawed.protocol == RESPONSES and session.responses is not None:
        session.responses.abort()
    elif session.realtime is not None:
        if session.realtime.response_id is not None:
            session.realtime.finish()
    else:
        session.messages = [*ans.base, {"role": "assistant", "content": ans.text}]


def _transcript_answer(ans: Answer) -> TranscriptAnswer:
    return TranscriptAnswer(ans.turn, ans.i, ans.text, ans.max_tokens, ans.cancelled)


def _parse_answer(value: object, messages: list[Msg], limit: int, default_max: int) -> Answer:
    if not isinstance(value, dict):
        raise StateError("state.answer must be an object")

    def count(key: str, default: int | None = None) -> int:
        raw = value.get(key, default)
        n = _count(raw)
        if n is None:
            raise StateError(f"state.answer.{key} must be a non-negative integer")
        return n

    turn = count("turn")
    if turn < 1:
        raise StateError("state.answer.turn must be at least 1")
    i = count("i")
    # null: the prompt named none (a failover's transcript), so this bridge's default applies
    max_tokens = default_max if value.get("max_tokens") is None else count("max_tokens")
    if max_tokens > limit:
        raise StateError(f"state.answer.max_tokens must be at most {limit}")
    text = value.get("text")
    if not isinstance(text, str):
        raise StateError("state.answer.text must be a string")
    if i == 0 and text:
        raise StateError("state.answer.text must be empty before any chunk (state.answer.i 0)")
    raw_ids = value.get("ids")
    ids = None if raw_ids is None else _ids(raw_ids)
    if raw_ids is not None and ids is None and raw_ids != []:
        raise StateError("state.answer.ids must be a list of token ids")
    tokens = count("tokens", len(ids) if ids is not None else i)
    if tokens > max_tokens:
        raise StateError("state.answer.tokens exceeds state.answer.max_tokens")
    ans = Answer(turn, messages, max_tokens, parts=[text] if text else [], i=i, ids=ids or None)
    ans.tokens_before = tokens
    if ans.ids is not None:
        ans.tokens_before = len(ans.ids)
    for key in ("cached_tokens", "prompt_tokens"):
        if value.get(key) is not None:
            setattr(ans, key, count(key))
    if value.get("prefill_ms") is not None:
        prefill = _number(value["prefill_ms"])
        if prefill is None:
            raise StateError("state.answer.prefill_ms must be a non-negative number")
        ans.prefill_ms = prefill
    ans.keep_stats = ans.cached_tokens is not None or ans.prefill_ms is not None
    for key in ("cancelled",):
        flag = value.get(key, False)
        if not isinstance(flag, bool):
            raise StateError(f"state.answer.{key} must be a boolean")
        ans.cancelled = flag
    finished = value.get("finished")
    if finished is not None and not isinstance(finished, str):
        raise StateError("state.answer.finished must be null or a string")
    ans.finished = finished
    ans.temperature = read_temperature(
        value.get("temperature"), lambda why: StateError(f"state.answer.{why}")
    )
    return ans


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wslb-worker --engine openai",
        description="Engine bridge for wslb: an OpenAI-compatible inference server (vLLM, "
        "SGLang, llama-server, TGI) as a wslb worker with the chat and Realtime protocols and "
        "live migration.",
    )
    add = parser.add_argument
    add("--engine", choices=["openai"], required=True, help="the engine's API (openai)")
    add("--engine-url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    add("--model", default=None, help="model name to request (default: the engine's first)")
    add(
        "--engine-flavor",
        choices=["auto", *FLAVORS],
        default="auto",
        help="how the engine continues an answer (default: %(default)s: asked from the engine)",
    )
    add(
        "--engine-api-key-file",
        metavar="PATH",
        default=None,
        help="a file holding the key sent as 'Authorization: Bearer KEY' to the engine "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    add(
        "--engine-api-key",
        metavar="KEY",
        default=None,
        help="refused: the command line is visible to every user (ps); use "
        f"--engine-api-key-file or ${API_KEY_ENV}",
    )
    add_listen_options(parser, "bridge")
    add_session_ttl(parser)
    add_max_tokens_default(parser)
    add(
        "--temperature",
        type=float,
        default=None,
        help="temperature of a prompt that gives none, and of Realtime responses "
        "(default: the engine's)",
    )
    add_subprotocols(parser)
    add("--no-handoff", action="store_true", help="no handoff API (no live migration)")
    add_worker_auth(parser)
    add(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between probes of the engine's /health (default: %(default)s)",
    )
    add(
        "--engine-timeout",
        type=float,
        default=60.0,
        help="seconds an engine stream may send nothing before its answer fails "
        "(default: %(default)s)",
    )
    add(
        "--engine-lost",
        choices=["drop", "error"],
        default="drop",
        help="when the engine is lost mid-answer (connection refused, reset or cut): 'drop' "
        "marks the engine down and aborts the session's connection without a close frame, so "
        "wslb's crash failover resumes the answer on another worker; 'error' ends the turn with "
        "an error message (default: %(default)s)",
    )
    add(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds after SIGTERM that live sessions are still served (default: %(default)s)",
    )
    add_log_level(parser)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> tuple[BridgeConfig, str]:
    """Parse options into a config (exiting with status 2 on bad values) and the log level."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine_url.startswith(("http://", "https://")):
        parser.error("--engine-url must be an http:// or https:// URL")
    check_listen_options(parser, args)
    if args.temperature is not None and not 0 <= args.temperature <= MAX_TEMPERATURE:
        parser.error(f"--temperature must be in 0..{MAX_TEMPERATURE:g}")
    for name in ("session_ttl", "drain_grace"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("health_interval", "engine_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    api_key = _engine_api_key(parser, args, os.environ)
    config = BridgeConfig(
        engine_url=args.engine_url,
        host=args.host,
        port=args.port,
        worker_id=args.worker_id,
        model=args.model,
        flavor=args.engine_flavor,
        api_key=api_key,
        subprotocols=subprotocols(args),
        handoff=not args.no_handoff,
        max_tokens_default=args.max_tokens_default,
        temperature=args.temperature,
        session_ttl=args.session_ttl,
        health_interval=args.health_interval,
        engine_timeout=args.engine_timeout,
        drain_grace=args.drain_grace,
        engine_lost=args.engine_lost,
        worker_auth=worker_auth_from_args(parser, args),
    )
    return config, args.log_level


def _engine_api_key(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: Mapping[str, str]
) -> str | None:
    """The engine's API key from its file or ``$WSLB_ENGINE_API_KEY``; never from the command
    line, which ``ps`` shows to every user of the machine (exit 2 naming the alternatives)."""
    if args.engine_api_key is not None:
        parser.error(
            "--engine-api-key is refused: the command line is visible to every user (ps); put "
            f"the key in a file (--engine-api-key-file PATH) or ${API_KEY_ENV}"
        )
    if args.engine_api_key_file is not None:
        try:
            with open(args.engine_api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"--engine-api-key-file: {exc}")
        if not key:
            parser.error(f"--engine-api-key-file: {args.engine_api_key_file} is empty")
        return key
    return env.get(API_KEY_ENV, "").strip() or None


async def serve(config: BridgeConfig, ready: Callable[[Bridge], None] | None = None) -> None:
    """Run a bridge until SIGTERM or SIGINT, drain it, then close it; a second signal hurries."""
    bridge = Bridge(config)
    await bridge.start()
    log.info(
        "bridge %s on %s:%d in front of %s (%s; %s)",
        bridge.worker_id,
        config.host,
        bridge.port,
        bridge.engine.url,
        "up" if bridge.engine.up else f"down: {bridge.engine.why}",
        config.worker_auth.describe(),
    )
    await serve_until_signal(bridge, ready)


def main(argv: Sequence[str] | None = None) -> None:
    """``wslb-worker --engine openai ...`` (``backends.worker.main`` dispatches here)."""
    config, level = config_from_args(argv)
    try:
        run_process(lambda: serve(config, ready=announce), level)
    except EngineMisconfigured as exc:
        print(f"wslb-worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
