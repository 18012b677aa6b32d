"""Reference model worker (``wslb-worker``): the simulated model behind HTTP and WebSocket.

One aiohttp server on one port (docs/protocol.md):

- ``GET /healthz``: 200 ``{"status":"ok"}``, 503 ``{"status":"draining"}`` once shutting down.
- ``GET /metrics``: Prometheus text from the worker's own registry (see ``METRIC_NAMES``).
- The OpenAI Realtime protocol (GA events, text) over WebSocket on ``/v1/realtime``
  (``backends.protocol.realtime``; the official ``openai`` SDK is a client), on the same
  sessions, turns and handoff as the chat protocol: ``response.create`` is a ``messages``
  prompt of the conversation so far, each token a ``response.output_text.delta``.
- The OpenAI Responses API's WebSocket mode on ``/v1/responses``
  (``backends.protocol.responses``; ``client.responses.connect()``), on the same machinery:
  each ``response.create`` is a ``messages`` prompt of the response's conversation (the one
  ``previous_response_id`` continues, plus the new input), each token a delta.
- The OpenAI HTTP API (``backends.protocol.openai_http``; docs/protocol.md section 3c):
  ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/responses``, server-sent
  events when ``stream``, on the WebSockets' sessions: the ``X-Session-Id`` header (else
  ``?session=``) names the session whose conversation and last response a request continues; a
  request without one holds no session after it. A ``POST /v1/responses`` whose
  ``previous_response_id`` is another live session's last response made over HTTP continues
  that session's conversation, as vLLM's and SGLang's servers find a stored response by its id
  alone (so a balancer's key per keyless request does not break the chain); the response must
  have been made here. Errors in OpenAI's shape.
- One prefix KV cache for everything (``backends.model``): blocks of ``--kv-block-tokens``
  keyed by a chained hash, shared by all sessions and keyless requests, at most
  ``--kv-capacity-tokens``, least recently used evicted. ``cached_tokens`` (``done``, and the
  OpenAI APIs' usage) is the leading part of a turn's context found there, whoever cached it.
- The chat protocol over WebSocket on ``/`` and ``/ws`` (and, leniently, any other path).
  The session id is the ``X-Session-Id`` request header, else the ``session`` query
  parameter, else a generated one; it is returned in the 101's ``X-Session-Id`` header and in
  ``hello``.
- Who may call what (``backends.auth``): with a credential (``--worker-token-file`` or
  ``$WSLB_WORKER_TOKEN``), every upgrade and handoff request needs it in
  ``X-WSLB-Worker-Token`` (401); without one, plain upgrades are accepted and the handoff API
  and resumed upgrades refused (401) unless ``--insecure-handoff``. The handoff routes refuse
  an ``Origin`` (403) and a body that is not ``application/json`` (415).
- Handoff API (live migration; 404 on every route with ``--no-handoff``):

  - ``POST /wslb/sessions/{sid}/freeze`` (body ignored): at a message boundary, the session's
    newest connection stops sending and stops acting on client messages (later ones are
    dropped unread: the balancer replays them to the new worker), the answer pauses between
    tokens and the session is forgotten here. 200 ``{"state":STATE,"sent":S,"received":R}``:
    S data messages sent on that connection (``hello``, tokens, ``done``, errors), R client
    data messages acted on (a prompt queued behind an answer counts, and is in STATE). The
    socket stays open and silent until the balancer closes it. Synchronous: the answer comes
    as soon as the handler runs. 404 unknown session or no open connection; 409 already frozen.
  - ``POST /wslb/sessions/{sid}/thaw`` with ``{"state":STATE}`` (format: ``backends.handoff``):
    holds the session here (within ``--session-ttl`` until resumed). ``--handoff-kv transfer``
    copies the old worker's cached prefix into this KV cache at ``--kv-transfer-ms-per-token``;
    ``prefill`` leaves it cold, so the context is prefilled again. STATE is this worker's own
    version 1 or the open transcript form, version 2 (what the engine bridge writes and the
    balancer builds for crash failover; it carries no cache, so its context is prefilled
    again). 200 ``{"ok":true}``; 400 malformed state; 409 the session has an open connection
    here; 503 while draining.
  - A WebSocket upgrade with ``X-WSLB-Resume: SID`` continues a thawed session: no ``hello``;
    the transfer time passes, then the unfinished answer goes on from its next token (same turn,
    ``done`` counting the tokens of both workers), then the queued prompts (a Realtime
    transcript's queued client events are acted on after the old worker's unsent events). 409
    if SID was not thawed here; 400 if ``X-Session-Id`` names another session.

- Parking (``backends.park``; docs/protocol.md section 4a): an upgrade with ``X-WSLB-Park``
  keeps a bounded window of what it sent; its leg lost without a close frame, the session is
  parked (the answer goes on into the window, pausing when it is full) for the grace, and an
  upgrade with ``X-WSLB-Reattach: SID`` and ``X-WSLB-Reattach-From: N`` (the handoff secret
  only) continues it: the window from message N, then the live stream. 409 ``unknown``,
  ``expired`` or ``count_ahead`` otherwise.

Chat protocol, JSON text messages, one WebSocket message each:

- worker on connect: ``{"type":"hello","worker":ID,"session":SID}``
- client: ``{"type":"prompt","text":STR,"max_tokens":N}`` (continue the held conversation) or
  ``{"type":"prompt","messages":[{"role":R,"content":STR},...],"max_tokens":N}`` (replace it);
  ``max_tokens`` defaults to ``--max-tokens-default``.
- worker: ``{"type":"token","turn":K,"i":I,"text":STR}`` for I = 0..N-1, after the simulated
  prefill and each at the current decode rate, then
  ``{"type":"done","turn":K,"tokens":N,"cached_tokens":C,"prefill_ms":F,"worker":ID}``.
  K starts at 1 per session and continues across reconnects while the session is held;
  token texts are ``backends.model.token_text(SID, K, I)``.
- client: ``{"type":"cancel"}`` stops the current answer, which then ends with ``done`` carrying
  the tokens produced. ``{"type":"cancel","turn":K}`` only stops turn K (no race with a queued
  prompt starting). A cancel with no matching answer is ignored.
- A prompt that arrives while an answer streams is queued (up to ``MAX_QUEUED_PROMPTS`` per
  connection) and answered after it, in order.
- Bad JSON, an unknown type, a malformed prompt, a full queue or a binary message get
  ``{"type":"error","error":"..."}``; the connection stays open.

Subprotocols: a requested subprotocol is echoed only if listed in ``--subprotocols`` (default:
none, so the 101 carries no ``Sec-WebSocket-Protocol``). Compression is never negotiated: the
balancer scans raw frames and a deflate context could not migrate.

The process prints ``wslb-worker ready id=ID port=PORT url=ws://HOST:PORT/ws`` on stdout once
listening (useful with ``--port 0``). SIGTERM/SIGINT: health turns 503 and new connections get
503, while the live sessions go on being served so a balancer can migrate them away; the process
exits 0 once no WebSocket is left open (a frozen one counts until the balancer closes it), or
after ``--drain-grace`` seconds, closing what is left with 1001. A second signal skips the wait.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, cast

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.auth import WorkerAuth
from backends.gpu import NvmlGpu, open_gpu
from backends.handoff import Transcript, parse_prompt, read_state, snapshot_to_json
from backends.model import (
    Model,
    ModelConfig,
    ModelStats,
    Prompt,
    QueuedPrompt,
    SessionSnapshot,
    Token,
    Turn,
    TurnResult,
)
from backends.protocol.openai_http import (
    DEFAULT_MODEL,
    ApiError,
    ChatAnswer,
    ChatRequest,
    models_list,
    responses_error,
    responses_event,
)
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

__all__ = [
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
    "Histogram",
    "Worker",
    "WorkerConfig",
    "build_parser",
    "config_from_args",
    "main",
    "serve",
]

log = logging.getLogger("wslb.worker")

METRIC_NAMES = (
    "wslb_worker_gpu_utilization",
    "wslb_worker_kv_cache_usage",
    "wslb_worker_active_sessions",
    "wslb_worker_queue_depth",
    "wslb_worker_kv_hit_tokens_total",
    "wslb_worker_prefill_tokens_total",
    "wslb_worker_prefill_seconds_total",
    "wslb_worker_kv_capacity_tokens",
    "wslb_worker_kv_cached_tokens",
    "wslb_worker_connections_total",
    "wslb_worker_handoffs_total",
    "wslb_worker_parked_sessions",
    "wslb_worker_reattaches_total",
    "wslb_worker_kv_transfer_tokens_total",
    "wslb_worker_inter_token_latency_seconds_sum",  # a histogram: also _count and _bucket
    "wslb_worker_inter_token_latency_seconds_count",
)
MADE_MAX = 4096  # responses made over HTTP whose session is remembered (a stored response)
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_YIELD_EVERY = 64  # tokens sent back to back (no decode delay) before yielding to the loop


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything the worker's options set."""

    host: str = "127.0.0.1"
    port: int = 9001
    worker_id: str | None = None
    """None: ``worker-PORT`` with the port actually bound."""
    model: ModelConfig = field(default_factory=ModelConfig)
    subprotocols: tuple[str, ...] = ()
    handoff: bool = True
    """False with ``--no-handoff``: the ``/wslb/`` routes answer 404, resumes 409."""
    handoff_kv: Literal["transfer", "prefill"] = "transfer"
    """How a thawed session's KV cache arrives: copied, or prefilled again."""
    max_tokens_default: int = 64
    max_tokens_limit: int = 1_000_000
    use_nvml: bool = True
    close_timeout: float = 5.0
    drain_grace: float = 30.0
    """Seconds after SIGTERM that live sessions keep being served (to be migrated away)."""
    worker_auth: WorkerAuth = field(default_factory=WorkerAuth)
    """The credential wslb shows (``backends.auth``); none: the handoff API is closed."""


class _Waker:
    """An interruptible sleep, so a cancel ends a long prefill or a slow token at once."""

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    async def sleep(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(delay, _resolve, fut)
        self._fut = fut
        try:
            await fut
        finally:
            handle.cancel()
            self._fut = None

    def interrupt(self) -> None:
        if self._fut is not None:
            _resolve(self._fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


QueuedItem: TypeAlias = tuple[Prompt, int]
"""A prompt waiting behind another answer, with its ``max_tokens``."""


class _Answerer(abc.ABC):
    """The turn loop of one answer (prefill, tokens at the simulated rate, the end), shared by a
    WebSocket connection and an HTTP request, so both stream at the same rate and count the
    same; each says what a token and the end become (``emit_token``, ``emit_done``)."""

    worker: Worker
    waker: _Waker
    current: Turn | None

    @abc.abstractmethod
    def stopped(self) -> bool:
        """True once the current answer was cancelled (or the connection frozen)."""

    @abc.abstractmethod
    async def emit_token(self, token: Token) -> None: ...

    @abc.abstractmethod
    async def emit_done(self, result: TurnResult) -> None: ...

    async def run_turn(self, turn: Turn, resumed: bool = False) -> None:
        """Wait out the prefill, stream the tokens at the simulated rate, then send ``done``.

        A ``resumed`` answer (thawed from another worker) was already decoding there: its next
        token is due at once, not a full decode interval later, so a migration adds only the
        handoff itself to the gap the client sees.
        """
        worker = self.worker
        model = worker.model
        loop = asyncio.get_running_loop()
        try:
            if turn.delay_s > 0 and not self.stopped():
                await self.waker.sleep(turn.delay_s)
            if not self.stopped():
                model.begin_decode(turn)
                await self._decode(turn, loop, resumed)
        finally:
            result = model.finish(turn)
            self.current = None
        await self.emit_done(result)

    async def _decode(
        self, turn: Turn, loop: asyncio.AbstractEventLoop, due_now: bool = False
    ) -> None:
        # One timer per token, on a deadline schedule so the average rate holds; a stream
        # that falls more than a token behind (slow reader) restarts its schedule, no burst.
        # Between the stop check, emit and the write there is no await: a freeze never
        # leaves a token produced but unsent.
        model = self.worker.model
        deadline = loop.time()
        if due_now:
            deadline -= model.token_delay()  # the first token is due immediately
        itl = self.worker.itl
        last = None  # when this stream's previous token went out: the gaps, as vLLM times them
        burst = 0
        while turn.remaining > 0 and not self.stopped():
            delay = model.token_delay()
            if delay > 0:
                now = loop.time()
                deadline += delay
                if deadline < now - delay:
                    deadline = now
                if deadline > now:
                    await self.waker.sleep(deadline - now)
                    if self.stopped():
                        break
            else:
                burst += 1
                if burst >= _YIELD_EVERY:
                    burst = 0
                    await asyncio.sleep(0)
                    if self.stopped():
                        break
            token = model.emit(turn)
            now = loop.time()
            if last is not None:
                itl.observe(now - last)
            last = now
            await self.emit_token(token)


class _Connection(Connection[QueuedItem], _Answerer):
    """One chat-protocol WebSocket on the simulated model (states: ``backends.server``).

    ``attached`` is False once the model no longer counts this connection (after a freeze).
    """

    def __init__(self, worker: Worker, ws: web.WebSocketResponse, session: str) -> None:
        super().__init__(worker, ws, session)
        self.worker = worker
        self.turn_words = 0  # prompt tokens of the current turn (Realtime usage)
        self.current: Turn | None = None
        self.cancelled = False
        self.waker = _Waker()
        self.resumed: Turn | None = None  # a thawed answer, finished before the queue
        self.resume_delay = 0.0  # KV transfer time before the first turn, if none was thawed

    async def emit_token(self, token: Token) -> None:
        await self.send({"type": "token", "turn": token.turn, "i": token.i, "text": token.text})

    async def emit_done(self, result: TurnResult) -> None:
        await self.send(
            {
                "type": "done",
                "turn": result.turn,
                "tokens": result.tokens,
                "cached_tokens": result.cached_tokens,
                "prefill_ms": round(result.prefill_ms, 3),
                "worker": self.worker.worker_id,
            }
        )

    def export(self, snapshot: SessionSnapshot) -> dict[str, Any]:
        """The handoff state of a frozen connection's session."""
        return snapshot_to_json(snapshot)

    def read_prompt(self, obj: dict[str, Any]) -> QueuedItem:
        cfg = self.worker.config
        return parse_prompt(obj, cfg.max_tokens_default, cfg.max_tokens_limit)

    def stopped(self) -> bool:
        """True once the current answer was cancelled (a call, so mypy does not narrow it)."""
        return self.cancelled or self.frozen

    def current_turn(self) -> int | None:
        return None if self.current is None else self.current.turn

    def turns_started(self) -> int:
        state = self.worker.model.session(self.sid)
        return 0 if state is None else state.turns

    def interrupt(self) -> None:
        self.cancelled = True
        self.waker.interrupt()

    def freeze(self) -> dict[str, Any]:
        """Stop at a message boundary and export the session (see the module docstring).

        Synchronous, so no message can be sent or acted on between the decision and the
        snapshot: the answer task is suspended at an await, where cancelling it stops it.
        """
        self.halt()
        queued: list[QueuedPrompt] = []
        while not self.queue.empty():
            prompt, max_tokens = self.queue.get_nowait()
            queued.append(QueuedPrompt(prompt, max_tokens))
        turn, self.current = self.current, None
        return self.export(self.worker.model.freeze(self.sid, turn, queued, self.cancelled))

    async def answer(self) -> None:
        resumed, self.resumed = self.resumed, None
        if resumed is not None:
            await self.run_turn(resumed, resumed=True)
        elif self.resume_delay > 0:
            await self.waker.sleep(self.resume_delay)
        model = self.worker.model
        while True:
            prompt, max_tokens = await self.queue.get()
            self.turn_words = len(prompt.words)
            turn = model.start_turn(self.sid, prompt, max_tokens, time.monotonic())
            self.current, self.cancelled = turn, False
            await self.run_turn(turn)


class _RealtimeConnection(RealtimeConnection[QueuedItem], _Connection):
    """A connection speaking the OpenAI Realtime protocol (``backends.server``), on the same
    turn machinery as the chat protocol: a ``Respond`` is queued as a ``messages`` prompt, each
    token becomes a ``response.output_text.delta``, the end ``finish``.
    """

    def __init__(
        self, worker: Worker, ws: web.WebSocketResponse, session: str, rt: RealtimeSession
    ) -> None:
        super().__init__(worker, ws, session)
        self.open_realtime(rt)

    def respond(self, out: Respond) -> QueuedItem:
        return Prompt.from_messages([m["content"] for m in out.messages]), out.max_tokens

    async def emit_token(self, token: Token) -> None:
        # Words joined by spaces: the next turn's messages() split into the same tokens, so the
        # conversation's KV prefix still matches.
        self.outbox.extend(self.rt.delta(("" if token.i == 0 else " ") + token.text))
        await self.outbox.flush()

    async def emit_done(self, result: TurnResult) -> None:
        self.outbox.extend(
            self.rt.finish(
                input_tokens=self.turn_words,
                cached_tokens=result.cached_tokens,
                output_tokens=result.tokens,
            )
        )
        await self.outbox.flush()

    def export(self, snapshot: SessionSnapshot) -> dict[str, Any]:
        return self.realtime_state(snapshot_to_json(snapshot))


class _ResponsesConnection(ResponsesConnection[QueuedItem], _Connection):
    """A connection speaking the Responses API's WebSocket mode (``backends.server``), on the
    same turn machinery as the Realtime one: a ``Respond`` is queued as a ``messages`` prompt
    of the response's conversation, each token a delta, the end ``finish``.
    """

    def __init__(
        self, worker: Worker, ws: web.WebSocketResponse, session: str, rs: ResponsesSession
    ) -> None:
        super().__init__(worker, ws, session)
        self.open_responses(rs)

    def respond(self, out: ResponsesRespond) -> QueuedItem:
        return Prompt.from_messages([m["content"] for m in out.messages]), out.max_tokens

    async def emit_token(self, token: Token) -> None:
        # Words joined by spaces, as the Realtime deltas: the next response's conversation
        # splits into the same tokens, so its KV prefix still matches.
        self.outbox.extend(self.rs.delta(("" if token.i == 0 else " ") + token.text))
        await self.outbox.flush()

    async def emit_done(self, result: TurnResult) -> None:
        self.outbox.extend(
            self.rs.finish(
                input_tokens=self.turn_words,
                cached_tokens=result.cached_tokens,
                output_tokens=result.tokens,
                now=time.time(),
            )
        )
        await self.outbox.flush()

    def export(self, snapshot: SessionSnapshot) -> dict[str, Any]:
        return self.responses_state(snapshot_to_json(snapshot))


class _HttpAnswer(_Answerer):
    """One answer to an OpenAI HTTP request, on the WebSocket's turn loop: each token and the
    end go to the route's callbacks. Nothing cancels it but the client leaving, which the
    next write notices (``ConnectionError``)."""

    def __init__(
        self,
        worker: Worker,
        on_token: Callable[[Token], Awaitable[None]],
        on_done: Callable[[TurnResult], Awaitable[None]],
    ) -> None:
        self.worker = worker
        self.waker = _Waker()
        self.current = None
        self._on_token = on_token
        self._on_done = on_done

    def stopped(self) -> bool:
        return False

    async def emit_token(self, token: Token) -> None:
        await self._on_token(token)

    async def emit_done(self, result: TurnResult) -> None:
        await self._on_done(result)


def _joined(token: Token) -> str:
    """A token's text as a delta: words joined by spaces, so the next request's messages split
    into the same tokens and the conversation's KV prefix still matches."""
    return ("" if token.i == 0 else " ") + token.text


class _WorkerCollector(Collector):
    """Reads the model at scrape time, so the numbers are never stale."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        stats = worker.model.stats(time.monotonic())
        yield GaugeMetricFamily(
            "wslb_worker_gpu_utilization",
            "GPU utilisation 0..1 (NVML when available, else simulated)",
            value=worker.gpu_utilization(stats),
        )
        yield GaugeMetricFamily(
            "wslb_worker_kv_cache_usage",
            "Share of the KV cache capacity running answers hold, 0..1",
            value=stats.kv_cache_usage,
        )
        yield active_sessions_metric(stats.active_sessions)
        yield GaugeMetricFamily(
            "wslb_worker_queue_depth",
            "Answers waiting: in prefill, decoding beyond max_batch, or queued behind another",
            value=stats.queue_depth + worker.queued_prompts(),
        )
        yield CounterMetricFamily(
            "wslb_worker_kv_hit_tokens",
            "Context tokens found in the KV cache",
            value=stats.kv_hit_tokens_total,
        )
        yield CounterMetricFamily(
            "wslb_worker_prefill_tokens",
            "Context tokens prefilled (not found in the KV cache)",
            value=stats.prefill_tokens_total,
        )
        yield CounterMetricFamily(
            "wslb_worker_prefill_seconds",
            "Time spent prefilling those tokens",
            value=stats.prefill_seconds_total,
        )
        yield GaugeMetricFamily(
            "wslb_worker_kv_capacity_tokens",
            "KV cache capacity in tokens",
            value=stats.kv_capacity_tokens,
        )
        yield GaugeMetricFamily(
            "wslb_worker_kv_cached_tokens",
            "Tokens in the prefix cache's blocks, evictable ones included (at most the capacity)",
            value=stats.kv_used_tokens,
        )
        yield connections_metric(worker)
        yield handoffs_metric(worker)
        yield parked_sessions_metric(worker)
        yield reattaches_metric(worker)
        yield CounterMetricFamily(
            "wslb_worker_kv_transfer_tokens",
            "KV cache tokens copied in from another worker by a thaw",
            value=stats.kv_transfer_tokens_total,
        )
        yield inter_token_latency_metric(
            worker, "Time between a stream's successive tokens (vLLM: inter-token latency, TPOT)"
        )


@dataclass(frozen=True, slots=True)
class _Thawed:
    """A session installed by ``thaw``, waiting for its resumed connection."""

    snapshot: SessionSnapshot
    transfer_s: float
    realtime: RealtimeSession | None = None
    events: tuple[dict[str, Any], ...] = ()
    """Realtime client events of a transcript's ``queued``, acted on after the resume."""
    responses: ResponsesSession | None = None
    thawed_at: float = 0.0
    """``time.monotonic()`` of the thaw: the KV transfer starts there (the target pulls the KV
    cache once it knows the session is coming), so a resume waits only for what is left."""

    def transfer_left(self) -> float:
        return max(0.0, self.transfer_s - (time.monotonic() - self.thawed_at))


_State: TypeAlias = tuple[
    SessionSnapshot,
    RealtimeSession | None,
    tuple[dict[str, Any], ...],
    ResponsesSession | None,
]
"""A thaw's state, read: the model's snapshot, its Realtime session, a transcript's events,
its Responses session."""


class Worker(Server[WorkerConfig, _Connection, _State, _Thawed | None]):
    """The worker's HTTP/WebSocket shell (``backends.server``) around one ``Model``."""

    id_prefix = "worker"
    logger = log

    def __init__(self, config: WorkerConfig, gpu: NvmlGpu | None = None) -> None:
        self.model = Model(config.model)
        self.gpu = gpu
        super().__init__(config)
        self.registry.register(_WorkerCollector(self))
        self._thawed: dict[str, _Thawed] = {}
        # Realtime and Responses protocol sessions by session id, kept like the model's
        # (--session-ttl).
        self._realtime: dict[str, RealtimeSession] = {}
        self._responses: dict[str, ResponsesSession] = {}
        # The session each response made over HTTP was made in, the latest MADE_MAX.
        self._made: OrderedDict[str, str] = OrderedDict()

    def gpu_utilization(self, stats: ModelStats) -> float:
        """NVML's reading when there is one, else the simulated one; at least the background."""
        if self.gpu is not None:
            real = self.gpu.utilization()
            if real is not None:
                return max(real, self.config.model.background_util)
        return stats.gpu_utilization

    async def drain_after_signal(self, hurry: asyncio.Event) -> None:
        log.info(
            "worker %s draining (up to %gs, a second signal exits at once)",
            self.worker_id,
            self.config.drain_grace,
        )
        await super().drain_after_signal(hurry)
        log.info("worker %s shutting down", self.worker_id)

    async def _closed(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None

    # -- the OpenAI HTTP API ----------------------------------------------------------------

    async def _list_models(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        return web.json_response(models_list([DEFAULT_MODEL]))

    @contextlib.contextmanager
    def _held(self, call: ApiCall) -> Iterator[None]:
        """The request's session held by the model while it runs, like a connection's: a
        named one stays for ``--session-ttl`` after (its conversation and last response), an
        ephemeral one goes with the request; the KV blocks of either stay in the shared cache."""
        self.model.attach(call.sid, time.monotonic())
        try:
            yield
        finally:
            self.model.detach(call.sid, time.monotonic())
            if call.ephemeral:
                self.model.forget(call.sid)
                self._responses.pop(call.sid, None)

    async def _chat_completions(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """The ``messages`` are the session's whole conversation, as a chat protocol
        ``messages`` prompt: the context is replaced, and its leading part found in the KV
        cache (this session's or any other's) is ``cached_tokens``."""
        cfg = self.config
        req = ChatRequest.parse(
            await self.read_body(request),
            default_max_tokens=cfg.max_tokens_default,
            limit=cfg.max_tokens_limit,
        )
        prompt = Prompt.from_messages(m["content"] for m in req.messages)
        out = ChatAnswer(req, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        stream = EventStream(request, call) if req.stream else None
        results: list[TurnResult] = []

        async def on_token(token: Token) -> None:
            chunk = out.delta(_joined(token))
            if stream is not None:
                await stream.send(chunk)

        async def on_done(result: TurnResult) -> None:
            results.append(result)
            if stream is None:
                return
            await stream.send(out.ending(result.tokens))
            if req.include_usage:
                await stream.send(
                    out.usage_chunk(len(prompt.words), result.cached_tokens, result.tokens)
                )
            await stream.end(done_line=True)

        with self._held(call):
            try:
                if stream is not None:
                    await stream.send(out.opening())
                turn = self.model.start_turn(call.sid, prompt, req.max_tokens, time.monotonic())
                await _HttpAnswer(self, on_token, on_done).run_turn(turn)
            except ConnectionError:  # the client left; its turn ended with run_turn
                pass
        if stream is not None:
            return stream.response
        result = results[0]
        return web.json_response(
            out.whole(len(prompt.words), result.cached_tokens, result.tokens),
            headers=call.headers,
        )

    async def _create_response(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """The session's Responses conversation, the one its WebSocket mode holds: a
        ``previous_response_id`` continues the session's last response, on either."""
        body = await self.read_body(request)
        streamed = body.get("stream", False)
        if not isinstance(streamed, bool):
            raise ApiError(400, "'stream' must be a boolean.", param="stream", code="invalid_type")
        stream = EventStream(request, call) if streamed else None
        final: list[dict[str, Any]] = []

        sid = self._continued(body.get("previous_response_id"), call.sid)

        async def emit(events: Sequence[Send]) -> None:
            for out in events:
                kind = out.event["type"]
                if kind in _TERMINAL:
                    final.append(out.event["response"])
                    self._remember_made(out.event["response"]["id"], sid)
                if stream is not None:
                    await stream.send(out.event, kind)

        # A continued session is held and its turn run as its own (its --session-ttl restarts).
        with self._held(call if sid == call.sid else ApiCall(sid, ephemeral=False)):
            rs = self._responses_session(request, sid, None)
            outs = rs.receive(dumps(responses_event(body)), now=time.time())
            respond = next((o for o in outs if isinstance(o, ResponsesRespond)), None)
            if respond is None:
                raise responses_error(next(o.event for o in outs if isinstance(o, Send)))
            prompt = Prompt.from_messages(m["content"] for m in respond.messages)

            async def on_token(token: Token) -> None:
                await emit(rs.delta(_joined(token)))

            async def on_done(result: TurnResult) -> None:
                await emit(
                    rs.finish(
                        input_tokens=len(prompt.words),
                        cached_tokens=result.cached_tokens,
                        output_tokens=result.tokens,
                        now=time.time(),
                    )
                )
                if stream is not None:
                    await stream.end()

            try:
                await emit([o for o in outs if isinstance(o, Send)])
                turn = self.model.start_turn(sid, prompt, respond.max_tokens, time.monotonic())
                await _HttpAnswer(self, on_token, on_done).run_turn(turn)
            except ConnectionError:  # the client left: the response cannot be continued
                pass
            finally:
                if rs.response_id == respond.response_id:
                    rs.abort()
        if stream is not None:
            return stream.response
        return web.json_response(final[0], headers=call.headers)

    def _continued(self, previous: Any, sid: str) -> str:
        """The session a ``POST /v1/responses`` continues: the one whose last response it
        names, if that is another live session's, else its own."""
        owner = self._made.get(previous) if isinstance(previous, str) else None
        if owner is None or owner not in self._responses or self.model.session(owner) is None:
            return sid
        return owner

    def _remember_made(self, response_id: str, sid: str) -> None:
        made = self._made
        made[response_id] = sid
        made.move_to_end(response_id)
        while len(made) > MADE_MAX:
            made.popitem(last=False)

    # -- handoff ----------------------------------------------------------------------------

    def _moved_away(self, sid: str) -> None:
        self._thawed.pop(sid, None)
        self._realtime.pop(sid, None)  # the conversation lives on where it is thawed
        self._responses.pop(sid, None)

    def _connected(self, sid: str) -> bool:
        return self.model.connected(sid)

    def _install(self, sid: str, state: _State) -> None:
        snapshot, realtime, events, responses = state
        transfer = self.config.handoff_kv == "transfer"
        now = time.monotonic()
        transfer_s = self.model.thaw(snapshot, now, transfer_kv=transfer)
        self._thawed[sid] = _Thawed(snapshot, transfer_s, realtime, events, responses, now)
        # Thaws never resumed would pile up: keep only those the model still holds (ttl).
        for stale in [s for s in self._thawed if self.model.session(s) is None]:
            del self._thawed[stale]
        log.info(
            "thawed session %s (kv %s, %.3f ms)", sid, self.config.handoff_kv, transfer_s * 1e3
        )

    def _read_state(self, value: object, sid: str) -> _State:
        """A thaw's state, either version: the model's snapshot, the Realtime session it
        carries (or a transcript's, rebuilt) and a Realtime transcript's queued events.

        Raises:
            StateError: naming the bad field.
        """
        cfg = self.config
        state = read_state(
            value,
            session=sid,
            max_queued=MAX_QUEUED_PROMPTS,
            max_tokens_limit=cfg.max_tokens_limit,
            default_max_tokens=cfg.max_tokens_default,
        )
        if isinstance(state, Transcript):
            if state.protocol == RESPONSES:
                responses = restore_responses(
                    state.responses,
                    session=sid,
                    answer=state.answer,
                    model="wslb-reference",
                    default_max_tokens=cfg.max_tokens_default,
                    max_tokens_limit=cfg.max_tokens_limit,
                )
                return state.snapshot, None, state.events, responses
            if state.protocol != "openai-realtime":
                return state.snapshot, None, state.events, None
            realtime = restore_transcript(
                state.realtime,
                session=sid,
                messages=state.messages,
                answer=state.answer,
                default_max_tokens=cfg.max_tokens_default,
                max_tokens_limit=cfg.max_tokens_limit,
            )
            return state.snapshot, realtime, state.events, None
        raw_responses = cast(dict[str, Any], value).get("responses")  # version 1: beside it
        if raw_responses is not None:
            responses = ResponsesSession.restore(
                raw_responses,
                session=sid,
                default_max_tokens=cfg.max_tokens_default,
                max_tokens_limit=cfg.max_tokens_limit,
            )
            return state, None, (), responses
        raw = cast(dict[str, Any], value).get("realtime")  # version 1: beside its fields
        if raw is None:
            return state, None, (), None
        realtime = RealtimeSession.restore(
            raw,
            session=sid,
            default_max_tokens=cfg.max_tokens_default,
            max_tokens_limit=cfg.max_tokens_limit,
        )
        return state, realtime, (), None

    def _take_thawed(self, session: str) -> _Thawed | None:
        thawed = self._thawed.pop(session, None)
        if thawed is None or self.model.session(session) is None:
            return None
        return thawed

    # -- WebSocket --------------------------------------------------------------------------

    def _claim(self, sid: str, resume: bool) -> _Thawed | web.Response | None:
        # A plain connection drops a pending handoff's answer and queue (the context stays).
        thawed = self._take_thawed(sid)
        if resume and thawed is None:
            return json_error(409, f"session {sid!r} was not thawed here")
        return thawed

    def _new_connection(
        self, request: web.Request, ws: web.WebSocketResponse, sid: str, claim: _Thawed | None
    ) -> _Connection:
        if request.path == REALTIME_PATH:
            return _RealtimeConnection(self, ws, sid, self._realtime_session(request, sid, claim))
        if request.path == RESPONSES_PATH:
            return _ResponsesConnection(self, ws, sid, self._responses_session(request, sid, claim))
        return _Connection(self, ws, sid)

    def _attach(
        self, conn: _Connection, claim: _Thawed | None, resume: bool
    ) -> Sequence[dict[str, Any]]:
        self.model.attach(conn.sid, time.monotonic())
        if claim is None:
            return ()
        if resume:
            self._resume(conn, claim)
        return claim.events

    def _detach(self, conn: _Connection) -> None:
        self.model.detach(conn.sid, time.monotonic())
        conn.abandon()

    def _realtime_session(
        self, request: web.Request, session: str, thawed: _Thawed | None
    ) -> RealtimeSession:
        """The session's Realtime conversation: thawed here, held since an earlier connection
        (a reconnect continues it), or new."""
        for stale in [s for s in self._realtime if self.model.session(s) is None]:
            del self._realtime[stale]  # expired with the model's session (--session-ttl)
        rt = thawed.realtime if thawed is not None else None
        rt = rt or self._realtime.get(session)
        if rt is None:
            rt = self._new_realtime(request, session)
        self._realtime[session] = rt
        return rt

    def _responses_session(
        self, request: web.Request, session: str, thawed: _Thawed | None
    ) -> ResponsesSession:
        """The session's Responses conversation: thawed here, held since an earlier connection
        (a reconnect continues it: the last response is still there), or new."""
        for stale in [s for s in self._responses if self.model.session(s) is None]:
            del self._responses[stale]  # expired with the model's session (--session-ttl)
        rs = thawed.responses if thawed is not None else None
        rs = rs or self._responses.get(session)
        if rs is None:
            rs = self._new_responses(session, request.query.get("model") or "wslb-reference")
        self._responses[session] = rs
        return rs

    def _resume(self, conn: _Connection, thawed: _Thawed) -> None:
        """Set a resumed connection up to continue exactly where the old worker stopped."""
        snapshot = thawed.snapshot
        if snapshot.answer is not None:
            turn = self.model.resume_turn(conn.sid, snapshot.answer, thawed.transfer_left())
            cancelled = snapshot.answer.cancelled
            if isinstance(conn, _RealtimeConnection):
                cancelled = cancelled or conn.rt.cancel_requested  # a transcript's realtime
            conn.current, conn.cancelled = turn, cancelled
            conn.resumed = turn
        else:
            conn.resume_delay = thawed.transfer_left()
        for queued in snapshot.queued:
            conn.queue.put_nowait((queued.prompt, queued.max_tokens))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wslb-worker",
        description="Reference model worker for wslb: a simulated LLM that streams tokens "
        "over WebSocket, with a prefix KV cache shared by all sessions and Prometheus metrics.",
        epilog="With --engine openai --engine-url URL: the engine bridge in front of a real "
        "OpenAI-compatible server (wslb-worker --engine openai --help).",
    )
    add = parser.add_argument
    add_listen_options(parser, "worker")
    add(
        "--tokens-per-s",
        type=float,
        default=50.0,
        help="decode speed of one stream; 0 or >= 1e6: unlimited (default: %(default)s)",
    )
    add(
        "--prefill-ms-per-token",
        type=float,
        default=0.2,
        help="prefill time per uncached context token (default: %(default)s)",
    )
    add(
        "--kv-capacity-tokens",
        type=int,
        default=200_000,
        help="KV cache capacity shared by all sessions (default: %(default)s)",
    )
    add(
        "--kv-block-tokens",
        type=int,
        default=1,
        help="tokens per KV cache block: cached prefixes are found, shared and evicted in "
        "whole blocks (1: token by token, as llama.cpp; vLLM uses 16) (default: %(default)s)",
    )
    add_session_ttl(parser)
    add(
        "--max-batch",
        type=int,
        default=64,
        help="streams decoded at full speed before each slows down (default: %(default)s)",
    )
    add(
        "--background-util",
        type=float,
        default=0.0,
        metavar="U",
        help="share of the GPU taken by something else, in [0, 1) (default: %(default)s)",
    )
    add_max_tokens_default(parser)
    add_subprotocols(parser)
    add(
        "--no-handoff",
        action="store_true",
        help="act as a worker without the handoff API (no live migration)",
    )
    add_worker_auth(parser)
    add(
        "--handoff-kv",
        choices=["transfer", "prefill"],
        default="transfer",
        help="a thawed session's KV cache is copied from the old worker, or prefilled again "
        "(default: %(default)s)",
    )
    add(
        "--kv-transfer-ms-per-token",
        type=float,
        default=0.02,
        help="time to copy one cached token from another worker (default: %(default)s)",
    )
    add(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds after SIGTERM that live sessions are still served, so they can be "
        "migrated away, before the rest are closed with 1001 (default: %(default)s)",
    )
    add(
        "--simulate-gpu",
        action="store_true",
        help="report the simulated GPU utilisation even when NVML works",
    )
    add_log_level(parser)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, str]:
    """Parse options into a config (exiting with status 2 on bad values) and the log level."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = ModelConfig(
            tokens_per_s=args.tokens_per_s,
            prefill_ms_per_token=args.prefill_ms_per_token,
            kv_capacity_tokens=args.kv_capacity_tokens,
            kv_block_tokens=args.kv_block_tokens,
            session_ttl=args.session_ttl,
            max_batch=args.max_batch,
            background_util=args.background_util,
            kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        )
    except ValueError as exc:
        parser.error(str(exc))
    check_listen_options(parser, args)
    if args.drain_grace < 0:
        parser.error("--drain-grace must be >= 0")
    config = WorkerConfig(
        host=args.host,
        port=args.port,
        worker_id=args.worker_id,
        model=model,
        subprotocols=subprotocols(args),
        handoff=not args.no_handoff,
        handoff_kv=args.handoff_kv,
        max_tokens_default=args.max_tokens_default,
        use_nvml=not args.simulate_gpu,
        drain_grace=args.drain_grace,
        worker_auth=worker_auth_from_args(parser, args),
    )
    return config, args.log_level


async def serve(config: WorkerConfig, ready: Callable[[Worker], None] | None = None) -> None:
    """Run a worker until SIGTERM or SIGINT, drain it, then close it; a second signal hurries."""
    gpu = open_gpu() if config.use_nvml else None
    worker = Worker(config, gpu=gpu)
    await worker.start()
    log.info(
        "worker %s on %s:%d (GPU utilisation: %s; %s)",
        worker.worker_id,
        config.host,
        worker.port,
        f"NVML, {gpu.devices} device(s)" if gpu is not None else "simulated",
        config.worker_auth.describe(),
    )
    await serve_until_signal(worker, ready)


def _wants_bridge(argv: Sequence[str]) -> bool:
    """``--engine`` given: the engine bridge (``backends.bridge``), not the simulated model."""
    return any(arg == "--engine" or arg.startswith("--engine=") for arg in argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``wslb-worker``; ``--engine openai ...`` runs the engine bridge."""
    args = list(sys.argv[1:] if argv is None else argv)
    if _wants_bridge(args):
        from backends import bridge  # imports this module: loaded only when asked for

        bridge.main(args)
        return
    config, level = config_from_args(argv)
    run_process(lambda: serve(config, ready=announce), level)


if __name__ == "__main__":
    main()
