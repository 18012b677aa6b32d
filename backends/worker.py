"""Reference model worker (``wslb-worker``): the simulated model behind HTTP and WebSocket.

One aiohttp server on one port (docs/protocol.md):

- ``GET /healthz``: 200 ``{"status":"ok"}``, 503 ``{"status":"draining"}`` once shutting down.
- ``GET /metrics``: Prometheus text from the worker's own registry (see ``METRIC_NAMES``).
- The OpenAI Realtime protocol (GA events, text) over WebSocket on ``/v1/realtime``
  (``backends.protocol.realtime``; the official ``openai`` SDK is a client), on the same
  sessions, turns and handoff as the chat protocol: ``response.create`` is a ``messages``
  prompt of the conversation so far, each token a ``response.output_text.delta``.
- The chat protocol over WebSocket on ``/`` and ``/ws`` (and, leniently, any other path).
  The session id is the ``X-Session-Id`` request header, else the ``session`` query
  parameter, else a generated one; it is returned in the 101's ``X-Session-Id`` header and in
  ``hello``.
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

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from aiohttp import WSMsgType, web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backends.gpu import NvmlGpu, open_gpu
from backends.handoff import (
    ProtocolError,
    StateError,
    Transcript,
    parse_prompt,
    read_state,
    snapshot_to_json,
)
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
from backends.protocol.realtime import Cancel, RealtimeSession, Respond, Send, restore_transcript
from backends.wire import (
    ITL_BUCKETS,
    MAX_QUEUED_PROMPTS,
    MAX_SESSION_ID_LEN,
    MAX_STATE_BYTES,
    METRICS_CONTENT_TYPE,
    READY_PREFIX,
    REALTIME_PATH,
    RESUME_HEADER,
    Histogram,
    Outbox,
)

__all__ = [
    "MAX_QUEUED_PROMPTS",
    "METRIC_NAMES",
    "READY_PREFIX",
    "RESUME_HEADER",
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
    "wslb_worker_connections_total",
    "wslb_worker_handoffs_total",
    "wslb_worker_kv_transfer_tokens_total",
    "wslb_worker_inter_token_latency_seconds_sum",  # a histogram: also _count and _bucket
    "wslb_worker_inter_token_latency_seconds_count",
)
# vLLM's inter-token latency buckets, cut at 10 s (a token slower than that is a stall).
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


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


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


class _Connection:
    """One WebSocket connection: reads client messages, answers prompts one at a time.

    ``sent`` and ``received`` count data messages as the handoff API reports them. A frozen
    connection sends nothing more and drops client messages unread; it stays open until the
    peer closes it. ``attached`` is False once the model no longer counts this connection
    (after a freeze), so closing it cannot touch a session that lives on elsewhere.
    """

    def __init__(self, worker: Worker, ws: web.WebSocketResponse, session: str) -> None:
        self.worker = worker
        self.ws = ws
        self.session = session
        self.turn_words = 0  # prompt tokens of the current turn (Realtime usage)
        self.queue: asyncio.Queue[tuple[Prompt, int]] = asyncio.Queue(MAX_QUEUED_PROMPTS)
        self.current: Turn | None = None
        self.cancelled = False
        self.waker = _Waker()
        self.answers: asyncio.Task[None] | None = None
        self.sent = 0
        self.received = 0
        self.frozen = False
        self.attached = True
        self.resumed: Turn | None = None  # a thawed answer, finished before the queue
        self.resume_delay = 0.0  # KV transfer time before the first turn, if none was thawed

    async def send(self, obj: dict[str, Any]) -> None:
        # Counted before the write, which aiohttp does synchronously (no compression) before
        # any await: a freeze can only run before the frame is written or after it was.
        if self.frozen:
            raise ConnectionResetError("session frozen")
        self.sent += 1
        await self.ws.send_str(_dumps(obj))

    async def error(self, message: str) -> None:
        with contextlib.suppress(ConnectionError):
            await self.send({"type": "error", "error": message})

    async def greet(self) -> None:
        """The first message of a new (not resumed) connection."""
        await self.send({"type": "hello", "worker": self.worker.worker_id, "session": self.session})

    async def on_binary(self) -> None:
        await self.error("binary messages are not supported; send JSON text")

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

    def abandon(self) -> None:
        """The connection ended without a freeze (the session stays for a reconnect)."""

    async def on_text(self, data: str) -> None:
        try:
            obj = json.loads(data)
        except ValueError as exc:
            await self.error(f"invalid JSON: {exc}")
            return
        if not isinstance(obj, dict):
            await self.error("a message must be a JSON object")
            return
        kind = obj.get("type")
        if kind == "prompt":
            cfg = self.worker.config
            try:
                request = parse_prompt(obj, cfg.max_tokens_default, cfg.max_tokens_limit)
            except ProtocolError as exc:
                await self.error(str(exc))
                return
            try:
                self.queue.put_nowait(request)
            except asyncio.QueueFull:
                await self.error(f"too many queued prompts (at most {MAX_QUEUED_PROMPTS})")
                return
        elif kind == "cancel":
            self.cancel(obj.get("turn"))
        else:
            await self.error(f"unknown message type: {kind!r}")

    def stopped(self) -> bool:
        """True once the current answer was cancelled (a call, so mypy does not narrow it)."""
        return self.cancelled or self.frozen

    def cancel(self, turn: object) -> None:
        current = self.current
        if current is None or (turn is not None and turn != current.turn):
            return
        self.cancelled = True
        self.waker.interrupt()

    def freeze(self) -> SessionSnapshot:
        """Stop at a message boundary and export the session (see the module docstring).

        Synchronous, so no message can be sent or acted on between the decision and the
        snapshot: the answer task is suspended at an await, where cancelling it stops it.
        """
        self.frozen = True
        self.attached = False
        if self.answers is not None:
            self.answers.cancel()
        queued: list[QueuedPrompt] = []
        while not self.queue.empty():
            prompt, max_tokens = self.queue.get_nowait()
            queued.append(QueuedPrompt(prompt, max_tokens))
        turn, self.current = self.current, None
        return self.worker.model.freeze(self.session, turn, queued, self.cancelled)

    def retire(self) -> None:
        """Another connection of the session was frozen: stop this one and close it (1012)."""
        self.frozen = True
        self.attached = False
        if self.answers is not None:
            self.answers.cancel()
        task = asyncio.create_task(self.ws.close(code=1012, message=b"session moved"))
        self.worker.background(task)

    async def answer_loop(self) -> None:
        """Answer a thawed answer if any, then queued prompts in order, until the end."""
        try:
            resumed, self.resumed = self.resumed, None
            if resumed is not None:
                await self.run_turn(resumed, resumed=True)
            elif self.resume_delay > 0:
                await self.waker.sleep(self.resume_delay)
            model = self.worker.model
            while True:
                prompt, max_tokens = await self.queue.get()
                self.turn_words = len(prompt.words)
                turn = model.start_turn(self.session, prompt, max_tokens, time.monotonic())
                self.current, self.cancelled = turn, False
                await self.run_turn(turn)
        except ConnectionError:
            pass  # the client left; the reader notices and cleans up
        except Exception:
            # A bug must not leave a connection that silently never answers again.
            log.exception("answer failed on session %s", self.session)
            with contextlib.suppress(Exception):
                await self.ws.close(code=1011, message=b"internal error")

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


class _RealtimeConnection(_Connection):
    """A connection speaking the OpenAI Realtime protocol (``backends.protocol.realtime``).

    The protocol session (``rt``) turns client events into server events and actions; this
    shell runs the actions on the same turn machinery as the chat protocol: a ``Respond`` is
    queued as a ``messages`` prompt at once (before any await, so a freeze finds it in the
    queue), each token becomes a ``response.output_text.delta``, the end ``finish``. Server
    events go through ``outbox``, written in order by whoever flushes; a freeze exports what is
    still in it with the session, and the new worker writes it first.
    """

    def __init__(
        self, worker: Worker, ws: web.WebSocketResponse, session: str, rt: RealtimeSession
    ) -> None:
        super().__init__(worker, ws, session)
        self.rt = rt
        self.outbox = Outbox(self.send)

    async def greet(self) -> None:
        await self.outbox.push(self.rt.opened())

    async def error(self, message: str) -> None:
        await self.outbox.push(self.rt.error(message))

    async def on_binary(self) -> None:
        await self.outbox.push(self.rt.binary())

    async def on_text(self, data: str) -> None:
        for out in self.rt.receive(data):
            if isinstance(out, Send):
                self.outbox.append(out)
            elif isinstance(out, Respond):
                contents = [m["content"] for m in out.messages]
                try:
                    self.queue.put_nowait((Prompt.from_messages(contents), out.max_tokens))
                except asyncio.QueueFull:  # one response at a time: the protocol forbids more
                    self.outbox.extend(self.rt.finish("incomplete"))
            elif isinstance(out, Cancel):
                self.cancel(None)
        await self.outbox.flush(quiet=True)

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
        state = snapshot_to_json(snapshot)
        state["realtime"] = self.rt.snapshot(unsent=self.outbox)
        self.outbox.clear()
        return state

    def abandon(self) -> None:
        if self.rt.response_id is not None:
            self.rt.finish()  # the answer died with the connection; the next one starts fresh


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
            "Share of the KV cache token capacity in use, 0..1",
            value=stats.kv_cache_usage,
        )
        yield GaugeMetricFamily(
            "wslb_worker_active_sessions",
            "Sessions with at least one open WebSocket connection",
            value=stats.active_sessions,
        )
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
            "wslb_worker_connections",
            "WebSocket connections accepted",
            value=worker.connections_total,
        )
        handoffs = CounterMetricFamily(
            "wslb_worker_handoffs",
            "Sessions frozen here (moved away) and thawed here (moved in)",
            labels=["direction"],
        )
        for direction, count in worker.handoffs.items():
            handoffs.add_metric([direction], count)
        yield handoffs
        yield CounterMetricFamily(
            "wslb_worker_kv_transfer_tokens",
            "KV cache tokens copied in from another worker by a thaw",
            value=stats.kv_transfer_tokens_total,
        )
        itl = worker.itl
        yield HistogramMetricFamily(
            "wslb_worker_inter_token_latency_seconds",
            "Time between a stream's successive tokens (vLLM: inter-token latency, TPOT)",
            buckets=itl.cumulative(),
            sum_value=itl.sum,
        )


@dataclass(frozen=True, slots=True)
class _Thawed:
    """A session installed by ``thaw``, waiting for its resumed connection."""

    snapshot: SessionSnapshot
    transfer_s: float
    realtime: RealtimeSession | None = None
    events: tuple[dict[str, Any], ...] = ()
    """Realtime client events of a transcript's ``queued``, acted on after the resume."""


class Worker:
    """The worker's HTTP/WebSocket shell around one ``Model``."""

    def __init__(self, config: WorkerConfig, gpu: NvmlGpu | None = None) -> None:
        self.config = config
        self.model = Model(config.model)
        self.gpu = gpu
        self.worker_id = config.worker_id or f"worker-{config.port}"
        self.connections_total = 0
        self.handoffs = {"freeze": 0, "thaw": 0}
        self.itl = Histogram(ITL_BUCKETS)
        self.draining = False
        self.port = config.port
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(self))
        self._connections: set[_Connection] = set()
        # Per session, its open connections, oldest first: a freeze takes the newest live one.
        self._by_session: dict[str, list[_Connection]] = {}
        self._thawed: dict[str, _Thawed] = {}
        # Realtime protocol sessions by session id, kept like the model's (--session-ttl).
        self._realtime: dict[str, RealtimeSession] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None

    def gpu_utilization(self, stats: ModelStats) -> float:
        """NVML's reading when there is one, else the simulated one; at least the background."""
        if self.gpu is not None:
            real = self.gpu.utilization()
            if real is not None:
                return max(real, self.config.model.background_util)
        return stats.gpu_utilization

    def queued_prompts(self) -> int:
        """Prompts waiting behind another answer on their connection."""
        return sum(conn.queue.qsize() for conn in self._connections)

    def background(self, task: asyncio.Task[Any]) -> None:
        """Keep a reference to a fire-and-forget task until it ends (asyncio holds weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_STATE_BYTES)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/wslb/sessions/{sid}/freeze", self._freeze)
        app.router.add_post("/wslb/sessions/{sid}/thaw", self._thaw)
        app.router.add_get("/{tail:.*}", self._websocket)
        return app

    async def start(self) -> None:
        """Bind and listen; ``self.port`` is the bound port afterwards (for ``--port 0``)."""
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, cfg.port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        if cfg.worker_id is None:
            self.worker_id = f"worker-{self.port}"
        runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def drain(self, grace: float, hurry: asyncio.Event | None = None) -> bool:
        """Turn health 503 and wait until no WebSocket is open, at most ``grace`` seconds.

        Live sessions go on being served meanwhile, so a balancer that sees the 503 can
        migrate them away (or let them finish). ``hurry`` being set ends the wait early.
        Returns True if every connection was gone.
        """
        self.draining = True
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, grace), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()

    async def close(self, timeout: float | None = None) -> None:
        """Stop: health 503, close every WebSocket with 1001, then stop the server."""
        self.draining = True
        limit = self.config.close_timeout if timeout is None else timeout
        if self._connections:
            await asyncio.gather(
                *(self._close_ws(conn.ws, limit) for conn in list(self._connections)),
                return_exceptions=True,
            )
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None

    @staticmethod
    async def _close_ws(ws: web.WebSocketResponse, limit: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(
                ws.close(code=1001, message=b"worker shutting down"), timeout=limit
            )

    async def _healthz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry),
            headers={"Content-Type": METRICS_CONTENT_TYPE},
        )

    # -- handoff ----------------------------------------------------------------------------

    async def _freeze(self, request: web.Request) -> web.Response:
        # No await before the snapshot: the freeze is one step of the event loop.
        if not self.config.handoff:
            return _error(404, "this worker has no handoff API")
        sid = request.match_info["sid"]
        conns = self._by_session.get(sid, [])
        live = [c for c in conns if not c.frozen]
        if not live:
            if conns:
                return _error(409, f"session {sid!r} is already frozen")
            return _error(404, f"no open connection for session {sid!r}")
        conn = live[-1]
        snapshot = conn.freeze()
        for other in live[:-1]:
            other.retire()
        self._thawed.pop(sid, None)
        state = conn.export(snapshot)
        self._realtime.pop(sid, None)  # the conversation lives on where it is thawed
        self.handoffs["freeze"] += 1
        log.info("froze session %s: sent=%d received=%d", sid, conn.sent, conn.received)
        return web.json_response({"state": state, "sent": conn.sent, "received": conn.received})

    async def _thaw(self, request: web.Request) -> web.Response:
        if not self.config.handoff:
            return _error(404, "this worker has no handoff API")
        if self.draining:
            return _error(503, "worker shutting down")
        sid = request.match_info["sid"]
        if len(sid) > MAX_SESSION_ID_LEN:
            return _error(400, "session id too long")
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"invalid JSON: {exc}")
        if not isinstance(body, dict) or "state" not in body:
            return _error(400, "expected an object with 'state'")
        try:
            snapshot, realtime, events = self._read_state(body["state"], sid)
        except StateError as exc:
            return _error(400, str(exc))
        if self.model.connected(sid):
            return _error(409, f"session {sid!r} has an open connection here")
        transfer = self.config.handoff_kv == "transfer"
        transfer_s = self.model.thaw(snapshot, time.monotonic(), transfer_kv=transfer)
        self._thawed[sid] = _Thawed(snapshot, transfer_s, realtime, events)
        # Thaws never resumed would pile up: keep only those the model still holds (ttl).
        for stale in [s for s in self._thawed if self.model.session(s) is None]:
            del self._thawed[stale]
        self.handoffs["thaw"] += 1
        log.info(
            "thawed session %s (kv %s, %.3f ms)", sid, self.config.handoff_kv, transfer_s * 1e3
        )
        return web.json_response({"ok": True})

    def _read_state(
        self, value: object, sid: str
    ) -> tuple[SessionSnapshot, RealtimeSession | None, tuple[dict[str, Any], ...]]:
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
            if state.protocol != "openai-realtime":
                return state.snapshot, None, state.events
            realtime = restore_transcript(
                state.realtime,
                session=sid,
                messages=state.messages,
                answer=state.answer,
                default_max_tokens=cfg.max_tokens_default,
                max_tokens_limit=cfg.max_tokens_limit,
            )
            return state.snapshot, realtime, state.events
        raw = cast(dict[str, Any], value).get("realtime")  # version 1: beside its fields
        if raw is None:
            return state, None, ()
        realtime = RealtimeSession.restore(
            raw,
            session=sid,
            default_max_tokens=cfg.max_tokens_default,
            max_tokens_limit=cfg.max_tokens_limit,
        )
        return state, realtime, ()

    def _take_thawed(self, session: str) -> _Thawed | None:
        thawed = self._thawed.pop(session, None)
        if thawed is None or self.model.session(session) is None:
            return None
        return thawed

    # -- WebSocket --------------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return web.json_response({"error": "worker shutting down"}, status=503)
        named = (
            request.headers.get("X-Session-Id", "").strip()
            or request.query.get("session", "").strip()
        )
        resume = request.headers.get(RESUME_HEADER)
        if resume is not None:
            session = resume.strip()
            if named and named != session:
                return _error(400, f"{RESUME_HEADER} and X-Session-Id name different sessions")
        else:
            session = named or uuid.uuid4().hex
        if not session or len(session) > MAX_SESSION_ID_LEN:
            return _error(400, "session id empty or too long")
        ws = web.WebSocketResponse(
            protocols=self.config.subprotocols,
            compress=False,
            timeout=self.config.close_timeout,
        )
        if not ws.can_prepare(request).ok:
            return web.json_response(
                {"error": "expected a WebSocket upgrade"},
                status=426,
                headers={"Upgrade": "websocket", "Connection": "Upgrade"},
            )
        # A plain connection drops a pending handoff's answer and queue (the context stays).
        thawed = self._take_thawed(session)
        if resume is not None and thawed is None:
            return _error(409, f"session {session!r} was not thawed here")
        ws.headers["X-Session-Id"] = session
        await ws.prepare(request)
        self.connections_total += 1
        conn: _Connection
        if request.path == REALTIME_PATH:
            conn = _RealtimeConnection(
                self, ws, session, self._realtime_session(request, session, thawed)
            )
        else:
            conn = _Connection(self, ws, session)
        self._connections.add(conn)
        self._idle.clear()
        self._by_session.setdefault(session, []).append(conn)
        self.model.attach(session, time.monotonic())
        if resume is not None and thawed is not None:
            self._resume(conn, thawed)
        try:
            conn.answers = asyncio.create_task(conn.answer_loop())
            if resume is None:
                await conn.greet()
            elif isinstance(conn, _RealtimeConnection):
                await conn.outbox.push(conn.rt.resumed())
                for event in thawed.events if thawed is not None else ():
                    await conn.on_text(_dumps(event))
            async for msg in ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break
                if conn.frozen:
                    continue  # the balancer replays it to the session's new worker
                conn.received += 1
                if msg.type == WSMsgType.TEXT:
                    await conn.on_text(msg.data)
                else:
                    await conn.on_binary()
        except ConnectionError:
            pass
        finally:
            if conn.answers is not None:
                conn.answers.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.answers
            if conn.attached:
                self.model.detach(session, time.monotonic())
                conn.abandon()
            self._forget(conn)
        return ws

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
            rt = RealtimeSession(
                session,
                model=request.query.get("model") or None,
                default_max_tokens=self.config.max_tokens_default,
                max_tokens_limit=self.config.max_tokens_limit,
            )
        self._realtime[session] = rt
        return rt

    def _resume(self, conn: _Connection, thawed: _Thawed) -> None:
        """Set a resumed connection up to continue exactly where the old worker stopped."""
        snapshot = thawed.snapshot
        if snapshot.answer is not None:
            turn = self.model.resume_turn(conn.session, snapshot.answer, thawed.transfer_s)
            cancelled = snapshot.answer.cancelled
            if isinstance(conn, _RealtimeConnection):
                cancelled = cancelled or conn.rt.cancel_requested  # a transcript's realtime
            conn.current, conn.cancelled = turn, cancelled
            conn.resumed = turn
        else:
            conn.resume_delay = thawed.transfer_s
        for queued in snapshot.queued:
            conn.queue.put_nowait((queued.prompt, queued.max_tokens))

    def _forget(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        siblings = self._by_session.get(conn.session)
        if siblings is not None:
            with contextlib.suppress(ValueError):
                siblings.remove(conn)
            if not siblings:
                del self._by_session[conn.session]
        if not self._connections:
            self._idle.set()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wslb-worker",
        description="Reference model worker for wslb: a simulated LLM that streams tokens "
        "over WebSocket, with a per-session KV cache and Prometheus metrics.",
        epilog="With --engine openai --engine-url URL: the engine bridge in front of a real "
        "OpenAI-compatible server (wslb-worker --engine openai --help).",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=9001, help="port; 0 picks a free one (default: %(default)s)")
    add("--id", dest="worker_id", default=None, help="worker id (default: worker-PORT)")
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
        "--session-ttl",
        type=float,
        default=300.0,
        help="seconds a session is kept after its last connection closes (default: %(default)s)",
    )
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
    add(
        "--max-tokens-default",
        type=int,
        default=64,
        help="max_tokens of a prompt that gives none (default: %(default)s)",
    )
    add("--subprotocols", default="", help="comma-separated subprotocols to accept (default: none)")
    add(
        "--no-handoff",
        action="store_true",
        help="act as a worker without the handoff API (no live migration)",
    )
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
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
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
            session_ttl=args.session_ttl,
            max_batch=args.max_batch,
            background_util=args.background_util,
            kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.max_tokens_default < 0:
        parser.error("--max-tokens-default must be >= 0")
    if args.drain_grace < 0:
        parser.error("--drain-grace must be >= 0")
    config = WorkerConfig(
        host=args.host,
        port=args.port,
        worker_id=args.worker_id,
        model=model,
        subprotocols=tuple(p.strip() for p in args.subprotocols.split(",") if p.strip()),
        handoff=not args.no_handoff,
        handoff_kv=args.handoff_kv,
        max_tokens_default=args.max_tokens_default,
        use_nvml=not args.simulate_gpu,
        drain_grace=args.drain_grace,
    )
    return config, args.log_level


async def serve(config: WorkerConfig, ready: Callable[[Worker], None] | None = None) -> None:
    """Run a worker until SIGTERM or SIGINT, drain it, then close it; a second signal hurries."""
    gpu = open_gpu() if config.use_nvml else None
    worker = Worker(config, gpu=gpu)
    await worker.start()
    log.info(
        "worker %s on %s:%d (GPU utilisation: %s)",
        worker.worker_id,
        config.host,
        worker.port,
        f"NVML, {gpu.devices} device(s)" if gpu is not None else "simulated",
    )
    if ready is not None:
        ready(worker)
    stop = asyncio.Event()
    hurry = asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        log.info(
            "worker %s draining (up to %gs, a second signal exits at once)",
            worker.worker_id,
            config.drain_grace,
        )
        await worker.drain(config.drain_grace, hurry)
        log.info("worker %s shutting down", worker.worker_id)
    finally:
        await worker.close(timeout=0.1 if hurry.is_set() else None)


def _announce(worker: Worker) -> None:
    host = worker.config.host
    shown = f"[{host}]" if ":" in host else host
    print(
        f"{READY_PREFIX} id={worker.worker_id} port={worker.port} url=ws://{shown}:{worker.port}/ws",
        flush=True,
    )


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
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, ready=_announce))
    except OSError as exc:
        print(f"wslb-worker: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
