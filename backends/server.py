"""The server shell both workers share: the reference worker (``backends.worker``, a simulated
model) and the engine bridge (``backends.bridge``, a real engine) are one aiohttp server towards
wslb, with one contract (docs/protocol.md) and different things behind it that answer prompts.

Why one module: wslb cannot tell the two apart, and must not be able to. The routes, the
session id and resume rules of an upgrade, the statuses and error texts, the handoff API's
preamble, the OpenAI HTTP routes' preamble (auth, drain, session key, error shape, SSE),
health during a drain, the metrics both export, the CLI options both take and the
process lifecycle (signals, drain, ready line) are written once here, so they cannot drift
apart; ``backends.wire`` does the same for the constants. What answers a prompt, what a session
holds and how a handoff state is read stay in each worker, behind the hooks of ``Server`` and
``Connection`` (each documented where it is declared).

Below both workers, as ``wire``: it imports neither of them, and the bridge still imports
nothing of ``backends.worker``.

A connection's states; every subclass keeps these rules:

- Live: client data messages are acted on, each counted in ``received``; every data message
  sent (a greeting, tokens, the end of an answer, errors) is counted in ``sent`` before its
  frame is written, which aiohttp does synchronously (no compression), so a freeze always
  finds a frame either written or not started. Those two counts are what ``freeze`` reports.
- Frozen (``freeze``, the handoff API): the answer task is cancelled at its await, nothing more
  is sent, and later client messages are dropped unread (the balancer replays them to the new
  worker). The socket stays open and silent until the peer closes it.
- Retired: another connection of the same session was frozen: this one is frozen too and
  closed with 1012.
- Dropped (the bridge only, an engine lost mid-answer): nothing more is sent; the transport is
  aborted, so wslb takes it for a crashed worker.
- Parked (``backends.park``, only with wslb's ``X-WSLB-Park``): the leg ended without a close
  frame from wslb and none of the above happened; the answer goes on into the connection's
  window (a full window pauses it), the grace timer runs, and an ``X-WSLB-Reattach`` upgrade
  moves the same ``Connection`` to its new WebSocket (``ws`` and ``transport`` replaced, the
  counts restarted for the new leg), written the window from the client's count first. A
  handler whose ``ws`` is no longer its connection's leaves the connection be. A freeze never
  takes a connection off its leg (409).
- ``attached`` turns False with a freeze or a retirement and never back: the server no longer
  counts the connection for its session, so closing it cannot touch a session that lives on
  elsewhere. An attached connection that closes is ``abandon``-ed (its session stays for a
  reconnect) and detached by ``Server._detach``.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from aiohttp import WSMsgType, web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from backends.auth import ENV as WORKER_TOKEN_ENV
from backends.auth import HEADER as WORKER_TOKEN_HEADER
from backends.auth import WorkerAuth
from backends.handoff import ProtocolError, StateError
from backends.park import Park, ParkError, ParkParams, ParkState, parse_count, parse_park
from backends.protocol.openai_http import SSE_DONE, SSE_HEADERS, ApiError, read_json, sse
from backends.protocol.realtime import Cancel, RealtimeSession, Respond, Send
from backends.protocol.responses import Respond as ResponsesRespond
from backends.protocol.responses import ResponsesSession
from backends.wire import (
    ITL_BUCKETS,
    MAX_QUEUED_PROMPTS,
    MAX_SESSION_ID_LEN,
    MAX_STATE_BYTES,
    METRICS_CONTENT_TYPE,
    PARK_HEADER,
    READY_PREFIX,
    REATTACH_FROM_HEADER,
    REATTACH_HEADER,
    RESUME_HEADER,
    RESUMED_HEADER,
    Histogram,
    Outbox,
)
from balancer.contract import queue_full

__all__ = [
    "ApiCall",
    "Config",
    "Connection",
    "EventStream",
    "Owner",
    "RealtimeConnection",
    "ResponsesConnection",
    "Server",
    "active_sessions_metric",
    "add_listen_options",
    "add_log_level",
    "add_max_tokens_default",
    "add_session_ttl",
    "add_subprotocols",
    "add_worker_auth",
    "announce",
    "api_error",
    "check_listen_options",
    "connections_metric",
    "dumps",
    "handoffs_metric",
    "inter_token_latency_metric",
    "json_error",
    "parked_sessions_metric",
    "reattaches_metric",
    "run_process",
    "serve_until_signal",
    "subprotocols",
    "worker_auth_from_args",
]

_ATTACHED = ParkState.ATTACHED  # one global read per message, not an enum lookup

REATTACH_RESULTS = ("resumed", "unknown", "expired", "count_ahead", "taken_over")
"""``wslb_worker_reattaches_total``'s results."""

Event: TypeAlias = dict[str, Any]
"""A Realtime client event, as a thaw's transcript carries it."""


def dumps(obj: dict[str, Any]) -> str:
    """One message's JSON text, compact."""
    return json.dumps(obj, separators=(",", ":"))


def json_error(status: int, message: str) -> web.Response:
    """``{"error": MESSAGE}`` with ``status``."""
    return web.json_response({"error": message}, status=status)


def api_error(exc: ApiError, sid: str | None = None) -> web.Response:
    """An OpenAI HTTP route's refusal: OpenAI's error shape, which the SDK turns into its
    ``APIStatusError`` subclass of that status."""
    headers = {"X-Session-Id": sid} if sid is not None else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One OpenAI HTTP request's session: the key it named (``X-Session-Id``, else
    ``?session=``), else a fresh one that ends with the request (``ephemeral``)."""

    sid: str
    ephemeral: bool

    @property
    def headers(self) -> dict[str, str]:
        """What the answer carries: the key the client named, as the 101 does."""
        return {} if self.ephemeral else {"X-Session-Id": self.sid}


class EventStream:
    """A streamed answer (``text/event-stream``): each event written as it is made, and the
    write drained past aiohttp's buffer, so a slow client slows the answer instead of it
    piling up here; a client gone raises ``ConnectionError`` at the next write."""

    def __init__(self, request: web.Request, call: ApiCall) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **call.headers})
        self.opened = False

    async def open(self) -> None:
        if not self.opened:
            self.opened = True
            await self.response.prepare(self.request)

    async def send(self, data: dict[str, Any], event: str | None = None) -> None:
        await self.open()
        await self.response.write(sse(data, event))

    async def end(self, done_line: bool = False) -> None:
        """The stream's end (``done_line``: Chat Completions' ``data: [DONE]``)."""
        await self.open()
        if done_line:
            await self.response.write(SSE_DONE)
        await self.response.write_eof()


class Config(Protocol):
    """The options the shared shell reads (``WorkerConfig`` and ``BridgeConfig`` have them)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def worker_id(self) -> str | None: ...
    @property
    def subprotocols(self) -> tuple[str, ...]: ...
    @property
    def handoff(self) -> bool: ...
    @property
    def max_tokens_default(self) -> int: ...
    @property
    def max_tokens_limit(self) -> int: ...
    @property
    def close_timeout(self) -> float: ...
    @property
    def drain_grace(self) -> float: ...
    @property
    def worker_auth(self) -> WorkerAuth: ...


class Owner(Protocol):
    """What a connection uses of its server."""

    @property
    def worker_id(self) -> str: ...
    @property
    def logger(self) -> logging.Logger: ...
    def background(self, task: asyncio.Task[Any]) -> None: ...


Q = TypeVar("Q")
"""What a connection's queue holds: a prompt waiting behind another answer."""


class Connection(abc.ABC, Generic[Q]):
    """One chat-protocol WebSocket: reads client messages, answers prompts one at a time.

    See the module docstring for its states. Hooks: ``read_prompt``, ``current_turn`` and
    ``interrupt`` (what a ``prompt`` and a ``cancel`` do), ``answer`` (the answer loop's body),
    ``freeze``; ``abandon`` and ``on_resume`` do nothing unless overridden.
    """

    def __init__(self, owner: Owner, ws: web.WebSocketResponse, sid: str) -> None:
        self.owner = owner
        self.ws = ws
        self.sid = sid
        self.queue: asyncio.Queue[Q] = asyncio.Queue(MAX_QUEUED_PROMPTS)
        self.answers: asyncio.Task[None] | None = None
        self.sent = 0
        self.received = 0
        self.frozen = False
        self.attached = True
        self.dropped = False
        self.closed_here = False
        """The worker closed this WebSocket itself (an ending, never a park)."""
        self.park: Park | None = None
        """The park parameters and the window (``backends.park``), when wslb sent them."""
        self.transport: asyncio.Transport | None = None
        """The current leg's TCP transport (aborted by a takeover, or the bridge's ``drop``)."""
        self._room = asyncio.Event()
        self.waiting = False
        """A parked ``send`` waits for room (what it sends is not counted yet)."""
        self.grace_timer: asyncio.TimerHandle | None = None
        """While parked: ends the session when the grace is over."""
        """Set when a parked ``send`` may look again (a leg is back, or the park ended)."""

    async def send(self, obj: dict[str, Any]) -> None:
        # Counted before the write, which aiohttp does synchronously (no compression) before
        # any await: a freeze can only run before the frame is written or after it was.
        if self.frozen:
            raise ConnectionResetError("session frozen")
        if self.dropped:
            raise ConnectionResetError("connection dropped")
        park = self.park
        if park is None:
            self.sent += 1
            await self.ws.send_str(dumps(obj))
            return
        while park.state is not _ATTACHED and park.must_wait():
            # No leg and the window full: the answer pauses; a message is never dropped.
            self._room.clear()
            self.waiting = True  # a token may be made and not sent: no freeze meanwhile
            try:
                await self._room.wait()
            finally:
                self.waiting = False
            if self.frozen or self.dropped or park.state is ParkState.ENDED:
                raise ConnectionResetError("session ended")
        text = dumps(obj)
        self.sent += 1
        if park.record(text):
            # A lost leg is no error here: the text is in the window, and the reader parks.
            # (try, not contextlib.suppress: no object per message on the hot path)
            try:  # noqa: SIM105
                await self.ws.send_str(text)
            except ConnectionError:
                pass

    def wake(self) -> None:
        """A parked ``send`` may look again: a leg is back, or the park ended."""
        self._room.set()

    async def error(self, message: str) -> None:
        with contextlib.suppress(ConnectionError):
            await self.send({"type": "error", "error": message})

    async def greet(self) -> None:
        """The first message of a new (not resumed) connection."""
        await self.send({"type": "hello", "worker": self.owner.worker_id, "session": self.sid})

    async def on_resume(self, events: Sequence[Event]) -> None:
        """The first writes of a resumed connection: none on the chat protocol (no ``hello``)."""

    async def on_binary(self) -> None:
        await self.error("binary messages are not supported; send JSON text")

    async def on_text(self, data: str) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested 100k deep
            await self.error(f"invalid JSON: {exc}")
            return
        if not isinstance(obj, dict):
            await self.error("a message must be a JSON object")
            return
        kind = obj.get("type")
        if kind == "prompt":
            try:
                prompt = self.read_prompt(obj)
            except ProtocolError as exc:
                await self.error(str(exc))
                return
            try:
                self.queue.put_nowait(prompt)
            except asyncio.QueueFull:  # which prompt it refuses: after_turn (balancer.contract)
                with contextlib.suppress(ConnectionError):
                    await self.send(queue_full(self.turns_started() + self.queue.qsize()))
        elif kind == "cancel":
            self.cancel(obj.get("turn"))
        else:
            await self.error(f"unknown message type: {kind!r}")

    @abc.abstractmethod
    def read_prompt(self, obj: dict[str, Any]) -> Q:
        """A chat-protocol ``prompt`` message as what the queue holds.

        Raises:
            ProtocolError: the message is malformed (sent back as an ``error``).
        """

    def cancel(self, turn: object) -> None:
        """Stop the current answer (only if it is turn ``turn``, when given); else nothing."""
        current = self.current_turn()
        if current is None or (turn is not None and turn != current):
            return
        self.interrupt()

    @abc.abstractmethod
    def current_turn(self) -> int | None:
        """The turn of the answer being produced, if any."""

    @abc.abstractmethod
    def turns_started(self) -> int:
        """Turns the session has started (the running one included): the next is one more."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Cancel the current answer: it ends at once, with ``done``."""

    def halt(self) -> None:
        """Send and act on nothing more, and stop counting for the session (a freeze)."""
        self.frozen = True
        self.attached = False
        if self.answers is not None:
            self.answers.cancel()

    @abc.abstractmethod
    def freeze(self) -> dict[str, Any]:
        """``halt`` and export the session's handoff state, synchronously, so no message can
        be sent or acted on between the decision and the snapshot."""

    def retire(self) -> None:
        """Another connection of the session was frozen: stop this one and close it (1012)."""
        self.halt()
        self.closed_here = True
        task = asyncio.create_task(self.ws.close(code=1012, message=b"session moved"))
        self.owner.background(task)

    def abandon(self) -> None:
        """The connection ended without a freeze (the session stays for a reconnect)."""

    async def answer_loop(self) -> None:
        """Run ``answer`` until the connection ends; a bug closes the connection with 1011."""
        try:
            await self.answer()
        except ConnectionError:
            pass  # the client left; the reader notices and cleans up
        except Exception:
            # A bug must not leave a connection that silently never answers again.
            self.owner.logger.exception("answer failed on session %s", self.sid)
            self.closed_here = True
            with contextlib.suppress(Exception):
                await self.ws.close(code=1011, message=b"internal error")

    @abc.abstractmethod
    async def answer(self) -> None:
        """Answer a thawed answer if any, then the queued prompts in order, forever."""


class RealtimeConnection(Connection[Q]):
    """The OpenAI Realtime protocol's side of a connection (``backends.protocol.realtime``),
    mixed in before a worker's chat connection class.

    The protocol session (``rt``) turns client events into server events and actions; a
    ``Respond`` is queued (``respond``) at once, before any await, so a freeze finds it in the
    queue. Server events go through ``outbox``, written in order by whoever flushes; a freeze
    exports what is still in it with the session (``realtime_state``), and the new worker
    writes it first. Call ``open_realtime`` from ``__init__``.
    """

    rt: RealtimeSession
    outbox: Outbox

    def open_realtime(self, rt: RealtimeSession) -> None:
        self.rt = rt
        self.outbox = Outbox(self.send)

    async def greet(self) -> None:
        await self.outbox.push(self.rt.opened())

    async def on_resume(self, events: Sequence[Event]) -> None:
        await self.outbox.push(self.rt.resumed())
        for event in events:
            await self.on_text(dumps(event))

    async def error(self, message: str) -> None:
        await self.outbox.push(self.rt.error(message))

    async def on_binary(self) -> None:
        await self.outbox.push(self.rt.binary())

    async def on_text(self, data: str) -> None:
        for out in self.rt.receive(data):
            if isinstance(out, Send):
                self.outbox.append(out)
            elif isinstance(out, Respond):
                try:
                    self.queue.put_nowait(self.respond(out))
                except asyncio.QueueFull:  # one response at a time: the protocol forbids more
                    self.outbox.extend(self.rt.finish("incomplete"))
            elif isinstance(out, Cancel):
                self.cancel(None)
        await self.outbox.flush(quiet=True)

    @abc.abstractmethod
    def respond(self, out: Respond) -> Q:
        """A ``response.create`` as what the queue holds."""

    def realtime_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the Realtime session and its unsent events (taken out of the outbox)."""
        state["realtime"] = self.rt.snapshot(unsent=self.outbox)
        self.outbox.clear()
        return state

    def abandon(self) -> None:
        if self.rt.response_id is not None:
            self.rt.finish()  # the answer died with the connection; the next one starts fresh


class ResponsesConnection(Connection[Q]):
    """The OpenAI Responses API's WebSocket mode (``backends.protocol.responses``), mixed in
    before a worker's chat connection class, as ``RealtimeConnection`` is: a ``Respond`` is
    queued (``respond``) before any await, server events go through ``outbox``, and a freeze
    exports the session with what is still in it (``responses_state``). The protocol has no
    greeting. Call ``open_responses`` from ``__init__``.
    """

    rs: ResponsesSession
    outbox: Outbox

    def open_responses(self, rs: ResponsesSession) -> None:
        self.rs = rs
        self.outbox = Outbox(self.send)

    async def greet(self) -> None:
        await self.outbox.push(self.rs.opened())

    async def on_resume(self, events: Sequence[Event]) -> None:
        await self.outbox.push(self.rs.resumed())
        for event in events:
            await self.on_text(dumps(event))

    async def error(self, message: str) -> None:
        await self.outbox.push(self.rs.error(message))

    async def on_binary(self) -> None:
        await self.outbox.push(self.rs.binary())

    async def on_text(self, data: str) -> None:
        for out in self.rs.receive(data, now=time.time()):
            if isinstance(out, ResponsesRespond):
                try:
                    self.queue.put_nowait(self.respond(out))
                except asyncio.QueueFull:  # one response at a time: the protocol forbids more
                    self.outbox.extend(self.rs.fail("too many queued responses"))
            else:
                self.outbox.append(out)
        await self.outbox.flush(quiet=True)

    @abc.abstractmethod
    def respond(self, out: ResponsesRespond) -> Q:
        """A ``response.create`` as what the queue holds."""

    def responses_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the Responses session and its unsent events (out of the outbox)."""
        state["responses"] = self.rs.snapshot(unsent=self.outbox)
        self.outbox.clear()
        return state

    def abandon(self) -> None:
        self.rs.abort()  # the answer died with the connection: it cannot be continued


ConfigT = TypeVar("ConfigT", bound=Config)
ConnT = TypeVar("ConnT", bound=Connection[Any])
StateT = TypeVar("StateT")
"""A thaw's state, read and checked, before it is installed."""
ClaimT = TypeVar("ClaimT")
"""What an upgrade takes for its session before the 101 (its thawed state, ...)."""


class Server(abc.ABC, Generic[ConfigT, ConnT, StateT, ClaimT]):
    """One aiohttp server on one port: health, metrics, the handoff API and the WebSockets.

    Hooks, by route: ``_starting``, ``_closing``, ``_closed``, ``drain_after_signal`` (the
    lifecycle); ``_health``;
    ``_moved_away`` (after a freeze); ``_unavailable``, ``_read_state``, ``_connected``,
    ``_install`` (a thaw); ``_claim``, ``_new_connection``, ``_attach``, ``_detach`` (an
    upgrade); ``_list_models``, ``_chat_completions``, ``_create_response`` (the OpenAI HTTP
    API, behind the upgrades' auth and drain rules). A subclass sets ``id_prefix`` and
    ``logger`` and registers its metrics collector on ``registry``.
    """

    id_prefix = "worker"
    """The default id is ``PREFIX-PORT``, with the port actually bound."""
    logger: logging.Logger

    def __init__(self, config: ConfigT) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{self.id_prefix}-{config.port}"
        self.port = config.port
        self.connections: set[ConnT] = set()
        # Per session, its open connections, oldest first: a freeze takes the newest live one.
        self._by_session: dict[str, list[ConnT]] = {}
        self.connections_total = 0
        self.requests = 0
        """OpenAI HTTP requests in flight: a drain waits for them as for the WebSockets."""
        self.handoffs = {"freeze": 0, "thaw": 0}
        # Parking (``backends.park``): per session, its parked connection; reattaches by result.
        self._parked: dict[str, ConnT] = {}
        self.reattaches = dict.fromkeys(REATTACH_RESULTS, 0)
        self._shutting = False
        self.itl = Histogram(ITL_BUCKETS)
        self.draining = False
        self.registry = CollectorRegistry()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None

    def queued_prompts(self) -> int:
        """Prompts waiting behind another answer on their connection."""
        return sum(conn.queue.qsize() for conn in self.connections)

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
        app.router.add_get("/v1/models", self._models_route)
        app.router.add_post("/v1/chat/completions", self._chat_route)
        app.router.add_post("/v1/responses", self._responses_route)
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
            self.worker_id = f"{self.id_prefix}-{self.port}"
        await self._starting()
        runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def _starting(self) -> None:
        """Bound, not serving yet: start what the routes need."""

    async def drain(self, grace: float, hurry: asyncio.Event | None = None) -> bool:
        """Turn health 503 and wait until no WebSocket is open and no HTTP request is in
        flight, at most ``grace`` seconds.

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

    async def drain_after_signal(self, hurry: asyncio.Event) -> None:
        """SIGTERM: ``drain`` for ``--drain-grace`` seconds (``hurry``: a second signal)."""
        await self.drain(self.config.drain_grace, hurry)

    @property
    def parked(self) -> int:
        """Sessions parked now (their wslb leg lost, waiting for a reattach)."""
        return len(self._parked)

    async def close(self, timeout: float | None = None) -> None:
        """Stop: health 503, end the parked sessions, close every WebSocket with 1001, then
        stop the server."""
        self.draining = True
        self._shutting = True
        for conn in list(self._parked.values()):
            self._end_parked(conn)
        limit = self.config.close_timeout if timeout is None else timeout
        if self.connections:
            await asyncio.gather(
                *(self._close_ws(conn.ws, limit) for conn in list(self.connections)),
                return_exceptions=True,
            )
        await self._closing()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._closed()

    async def _closing(self) -> None:
        """The WebSockets are closed; the HTTP server is still up."""

    async def _closed(self) -> None:
        """The HTTP server is stopped: release the rest."""

    @staticmethod
    async def _close_ws(ws: web.WebSocketResponse, limit: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(
                ws.close(code=1001, message=b"worker shutting down"), timeout=limit
            )

    # -- HTTP -------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return self._health()

    def _health(self) -> web.Response:
        """``GET /healthz`` while not draining."""
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry),
            headers={"Content-Type": METRICS_CONTENT_TYPE},
        )

    # -- the OpenAI HTTP API ----------------------------------------------------------------

    def _api_refusal(self, request: web.Request) -> web.Response | None:
        """Why an OpenAI HTTP request is refused before it is read: the WebSocket chat routes'
        rules (wslb's credential once the worker has one, 503 while draining)."""
        refused = self._unauthorized(request, handoff=False)
        if refused is not None:
            return refused
        if self.draining:
            return api_error(ApiError(503, "worker shutting down", code="draining"))
        return None

    def _api_call(self, request: web.Request) -> ApiCall:
        """The request's session, as an upgrade's: ``X-Session-Id``, else ``?session=``.

        Raises:
            ApiError: 400 for a key over ``MAX_SESSION_ID_LEN``.
        """
        named = (
            request.headers.get("X-Session-Id", "").strip()
            or request.query.get("session", "").strip()
        )
        if len(named) > MAX_SESSION_ID_LEN:
            raise ApiError(400, "session id too long", param="X-Session-Id")
        if named:
            return ApiCall(named, ephemeral=False)
        return ApiCall(f"http-{uuid.uuid4().hex}", ephemeral=True)

    async def _serve_api(
        self,
        request: web.Request,
        route: Callable[[web.Request, ApiCall], Coroutine[Any, Any, web.StreamResponse]],
    ) -> web.StreamResponse:
        """Run one OpenAI HTTP route, counted in flight (a drain waits for it); an
        ``ApiError`` before the answer started is its error response."""
        refused = self._api_refusal(request)
        if refused is not None:
            return refused
        self.requests += 1
        self._idle.clear()
        call: ApiCall | None = None
        try:
            call = self._api_call(request)
            return await route(request, call)
        except ApiError as exc:
            return api_error(exc, None if call is None else call.headers.get("X-Session-Id"))
        finally:
            self.requests -= 1
            if not self.connections and not self.requests:
                self._idle.set()

    async def _models_route(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_api(request, self._list_models)

    async def _chat_route(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_api(request, self._chat_completions)

    async def _responses_route(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_api(request, self._create_response)

    @staticmethod
    async def read_body(request: web.Request) -> dict[str, Any]:
        """An API request's JSON object.

        Raises:
            ApiError: 400 when it is not one.
        """
        return read_json(await request.read())

    @abc.abstractmethod
    async def _list_models(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """``GET /v1/models``."""

    @abc.abstractmethod
    async def _chat_completions(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """``POST /v1/chat/completions``: a ``chat.completion``, or its chunks as server-sent
        events when ``stream``. May raise ``ApiError`` before the answer starts."""

    @abc.abstractmethod
    async def _create_response(self, request: web.Request, call: ApiCall) -> web.StreamResponse:
        """``POST /v1/responses``: the response, or the Responses streaming events (the
        WebSocket mode's) when ``stream``. May raise ``ApiError`` before the answer starts."""

    # -- handoff ----------------------------------------------------------------------------

    def _refuse_handoff(self, request: web.Request) -> web.Response | None:
        """Why a handoff request is refused, if it is (``backends.auth``): a browser's (403),
        one without wslb's credential (401), a body that is not JSON (415)."""
        origin = request.headers.get("Origin")
        if origin is not None:
            return json_error(403, f"cross-origin request from {origin!r} refused")
        refused = self._unauthorized(request, handoff=True)
        if refused is not None:
            return refused
        if request.content_type != "application/json":
            return json_error(415, "Content-Type must be application/json")
        return None

    def _unauthorized(self, request: web.Request, handoff: bool) -> web.Response | None:
        """A 401 for a request without wslb's credential where one is needed: on every request
        once the worker has one, on the handoff API and resumes always (``--insecure-handoff``
        aside)."""
        auth = self.config.worker_auth
        if auth.configured:
            if auth.accepts(request.headers.get(WORKER_TOKEN_HEADER), handoff=handoff):
                return None
            return json_error(401, f"missing or wrong {WORKER_TOKEN_HEADER}")
        if not handoff or auth.insecure:
            return None
        return json_error(
            401,
            "this worker has no credential configured, so its handoff API is closed: start "
            f"it with --worker-token-file or ${WORKER_TOKEN_ENV} (the one wslb sends)",
        )

    async def _freeze(self, request: web.Request) -> web.Response:
        # No await before the export: the freeze is one step of the event loop.
        if not self.config.handoff:
            return json_error(404, "this worker has no handoff API")
        refused = self._refuse_handoff(request)
        if refused is not None:
            return refused
        sid = request.match_info["sid"]
        conns = self._by_session.get(sid, [])
        live = [c for c in conns if not c.frozen and not c.dropped and _on_leg(c)]
        if not live:
            if any(c.frozen for c in conns):
                return json_error(409, f"session {sid!r} is already frozen")
            if any(not _on_leg(c) for c in conns):
                return json_error(409, f"session {sid!r} is parked or reattaching (try again)")
            return json_error(404, f"no open connection for session {sid!r}")
        conn = live[-1]
        state = conn.freeze()
        for other in live[:-1]:
            other.retire()
        self._moved_away(sid)
        self.handoffs["freeze"] += 1
        self.logger.info("froze session %s: sent=%d received=%d", sid, conn.sent, conn.received)
        return web.json_response({"state": state, "sent": conn.sent, "received": conn.received})

    @abc.abstractmethod
    def _moved_away(self, sid: str) -> None:
        """After a freeze: forget the session here (it lives on where it is thawed)."""

    async def _thaw(self, request: web.Request) -> web.Response:
        if not self.config.handoff:
            return json_error(404, "this worker has no handoff API")
        refused = self._refuse_handoff(request)
        if refused is not None:
            return refused
        if self.draining:
            return json_error(503, "worker shutting down")
        unavailable = self._unavailable()
        if unavailable is not None:
            return json_error(503, unavailable)
        sid = request.match_info["sid"]
        if len(sid) > MAX_SESSION_ID_LEN:
            return json_error(400, "session id too long")
        try:
            body = await request.json()
        except ValueError as exc:
            return json_error(400, f"invalid JSON: {exc}")
        except RecursionError:
            return json_error(400, "invalid JSON: nested too deeply")
        if not isinstance(body, dict) or "state" not in body:
            return json_error(400, "expected an object with 'state'")
        try:
            state = self._read_state(body["state"], sid)
        except StateError as exc:
            return json_error(400, str(exc))
        if self._connected(sid):
            return json_error(409, f"session {sid!r} has an open connection here")
        self._install(sid, state)
        self.handoffs["thaw"] += 1
        return web.json_response({"ok": True})

    def _unavailable(self) -> str | None:
        """Why a thaw gets 503 although not draining, if it does."""
        return None

    @abc.abstractmethod
    def _read_state(self, value: object, sid: str) -> StateT:
        """A thaw's state, checked.

        Raises:
            StateError: naming the bad field (400).
        """

    def _connected(self, sid: str) -> bool:
        """The session has an open connection here (a thaw gets 409)."""
        return bool(self._by_session.get(sid))

    @abc.abstractmethod
    def _install(self, sid: str, state: StateT) -> None:
        """Hold a thawed session here until its resumed connection comes."""

    # -- WebSocket --------------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        reattach = request.headers.get(REATTACH_HEADER)
        if reattach is not None:
            return await self._reattach(request, reattach)
        resume = request.headers.get(RESUME_HEADER)
        refused = self._unauthorized(request, handoff=resume is not None)
        if refused is not None:
            return refused
        if self.draining:
            return web.json_response({"error": "worker shutting down"}, status=503)
        named = (
            request.headers.get("X-Session-Id", "").strip()
            or request.query.get("session", "").strip()
        )
        if resume is not None:
            sid = resume.strip()
            if named and named != sid:
                return json_error(400, f"{RESUME_HEADER} and X-Session-Id name different sessions")
        else:
            sid = named or uuid.uuid4().hex
        if not sid or len(sid) > MAX_SESSION_ID_LEN:
            return json_error(400, "session id empty or too long")
        params: ParkParams | None = None
        raw_park = request.headers.get(PARK_HEADER)
        if raw_park is not None:
            try:
                params = parse_park(raw_park)
            except ParkError as exc:
                return json_error(400, f"{PARK_HEADER}: {exc}")
        ws = self._new_ws()
        if not ws.can_prepare(request).ok:
            return _not_an_upgrade()
        claim = self._claim(sid, resume is not None)
        if isinstance(claim, web.Response):
            return claim
        ws.headers["X-Session-Id"] = sid
        if params is not None:
            ws.headers[PARK_HEADER] = "ok"
        await ws.prepare(request)
        self.connections_total += 1
        conn = self._new_connection(request, ws, sid, claim)
        conn.transport = request.transport
        if params is not None:
            conn.park = Park(params)
        self.connections.add(conn)
        self._idle.clear()
        self._by_session.setdefault(sid, []).append(conn)
        events = self._attach(conn, claim, resume is not None)
        conn.answers = asyncio.create_task(conn.answer_loop())
        opening = conn.greet() if resume is None else conn.on_resume(events)
        await self._serve(conn, ws, opening)
        return ws

    def _new_ws(self) -> web.WebSocketResponse:
        return web.WebSocketResponse(
            protocols=self.config.subprotocols,
            compress=False,
            timeout=self.config.close_timeout,
        )

    async def _serve(
        self, conn: ConnT, ws: web.WebSocketResponse, opening: Coroutine[Any, Any, None]
    ) -> None:
        """Write ``opening``, then read client messages until the leg ends; then end the
        connection, or park it (``backends.park``) when the leg was lost without a close
        frame, or leave it be when a reattach took it to another leg."""
        lost = False
        try:
            await opening
            while True:
                msg = await ws.receive()
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    # CLOSE: wslb's close frame; CLOSING: ours; CLOSED, ERROR: the leg is lost.
                    lost = msg.type in (WSMsgType.CLOSED, WSMsgType.ERROR)
                    break
                if conn.frozen or conn.ws is not ws:
                    continue  # frozen: the balancer replays it to the session's new worker
                conn.received += 1
                if msg.type == WSMsgType.TEXT:
                    await conn.on_text(msg.data)
                else:
                    await conn.on_binary()
        except ConnectionError:
            lost = True
        finally:
            if conn.ws is ws:  # else a reattach took the session to another leg
                if lost and self._may_park(conn):
                    self._park(conn)
                else:
                    await self._end(conn)

    def _may_park(self, conn: ConnT) -> bool:
        return _parkable(conn) and not self._shutting

    def _park(self, conn: ConnT) -> None:
        """The leg was lost: keep the session for ``grace`` seconds (``backends.park``)."""
        park = conn.park
        assert park is not None
        park.lost()
        older = self._parked.get(conn.sid)
        if older is not None and older is not conn:
            self._end_parked(older)  # one parked connection per session: the newest
        self._parked[conn.sid] = conn
        loop = asyncio.get_running_loop()
        handle = loop.call_later(park.params.grace, self._end_parked, conn)
        conn.grace_timer = handle
        self.logger.info(
            "session %s parked: leg lost after message %d, kept %.3gs for a reattach",
            conn.sid,
            park.window.next,
            park.params.grace,
        )

    def _end_parked(self, conn: ConnT) -> None:
        """A parked connection's grace is over (or the worker stops): end it as a client
        leaving ends it."""
        if self._parked.get(conn.sid) is conn:
            del self._parked[conn.sid]
        if conn.grace_timer is not None:
            conn.grace_timer.cancel()
            conn.grace_timer = None
        if conn.park is not None and conn.park.state is ParkState.ENDED:
            return
        self.background(asyncio.create_task(self._end(conn)))

    async def _end(self, conn: ConnT) -> None:
        """The connection is over: its answer cancelled, the session detached (``abandon``)."""
        if conn.park is not None:
            conn.park.end()
            conn.wake()
        if conn.answers is not None:
            conn.answers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await conn.answers
        if conn.attached:
            self._detach(conn)
        self._forget(conn)

    async def _reattach(self, request: web.Request, raw_sid: str) -> web.StreamResponse:
        """``X-WSLB-Reattach``: continue a parked session on this leg (``backends.park``)."""
        refused = self._unauthorized(request, handoff=True)
        if refused is not None:
            return refused
        sid = raw_sid.strip()
        named = request.headers.get("X-Session-Id", "").strip()
        if named and named != sid:
            return json_error(400, f"{REATTACH_HEADER} and X-Session-Id name different sessions")
        if not sid or len(sid) > MAX_SESSION_ID_LEN:
            return json_error(400, "session id empty or too long")
        raw_from = request.headers.get(REATTACH_FROM_HEADER)
        raw_park = request.headers.get(PARK_HEADER)
        if raw_from is None or raw_park is None:
            return json_error(
                400, f"a reattach needs {REATTACH_FROM_HEADER} and {PARK_HEADER} beside it"
            )
        try:
            n = parse_count(raw_from, REATTACH_FROM_HEADER)
        except ParkError as exc:
            return json_error(400, str(exc))
        try:
            params = parse_park(raw_park)
        except ParkError as exc:
            return json_error(400, f"{PARK_HEADER}: {exc}")
        if params.base != n:
            return json_error(400, f"{PARK_HEADER} base must equal {REATTACH_FROM_HEADER}")
        ws = self._new_ws()
        if not ws.can_prepare(request).ok:
            return _not_an_upgrade()
        conn = self._reattachable(sid)
        park = None if conn is None else conn.park
        if conn is None or park is None:
            self.reattaches["unknown"] += 1
            return web.json_response(
                {"error": f"no parked session {sid!r} here", "resume": "unknown"}, status=409
            )
        refusal = park.judge(params.token, n)
        if refusal is not None:
            self.reattaches[refusal] += 1
            if refusal == "unknown":
                return web.json_response(
                    {"error": f"no parked session {sid!r} here", "resume": "unknown"},
                    status=409,
                )
            why = (
                f"message {n} is no longer kept (the window starts at {park.window.first})"
                if refusal == "expired"
                else f"message {n} was never sent ({park.window.next} sent)"
            )
            return web.json_response(
                {"error": why, "resume": "refused", "reason": refusal}, status=409
            )
        # Accepted: taken synchronously, before the 101's await, so nothing else can take it.
        taken_over = not park.parked
        self.reattaches["taken_over" if taken_over else "resumed"] += 1
        if self._parked.get(sid) is conn:
            del self._parked[sid]
        if conn.grace_timer is not None:
            conn.grace_timer.cancel()
            conn.grace_timer = None
        old_transport = conn.transport
        park.reattach(params)
        conn.ws = ws
        conn.transport = request.transport
        conn.sent = park.window.next - n  # this leg's count: the replay, then what follows
        conn.received = 0
        if taken_over and old_transport is not None:
            old_transport.abort()  # nothing more on the old leg: its reader leaves it be
        self.logger.info(
            "session %s reattached from message %d (%s)",
            sid,
            n,
            "taken over" if taken_over else "resumed",
        )
        ws.headers["X-Session-Id"] = sid
        ws.headers[RESUMED_HEADER] = str(n)
        ws.headers[PARK_HEADER] = "ok"
        try:
            await ws.prepare(request)
        except ConnectionError:  # the new leg is gone already: park again (or end)
            if conn.ws is ws:
                if self._may_park(conn):
                    self._park(conn)
                else:
                    await self._end(conn)
            return ws
        self.connections_total += 1
        await self._serve(conn, ws, self._replay(conn, ws, n))
        return ws

    def _reattachable(self, sid: str) -> ConnT | None:
        """The session's parked connection, else its newest one with park parameters still
        on a leg (a takeover)."""
        parked = self._parked.get(sid)
        if parked is not None:
            return parked if _parkable(parked) else None  # its answer task died: let it expire
        conns: list[ConnT] = self._by_session.get(sid, [])
        for conn in conns[::-1]:
            if _parkable(conn):
                return conn
        return None

    async def _replay(self, conn: ConnT, ws: web.WebSocketResponse, n: int) -> None:
        """Write the window from message ``n`` on the new leg, then go live (``caught_up``)."""
        park = conn.park
        assert park is not None
        while conn.ws is ws and park.state is ParkState.REPLAYING:
            if n >= park.window.next:
                park.caught_up()  # no await since the check: nothing can slip in between
                conn.wake()
                return
            await ws.send_str(park.window.get(n))  # kept: nothing trims while replaying
            n += 1

    @abc.abstractmethod
    def _claim(self, sid: str, resume: bool) -> ClaimT | web.Response:
        """Before the 101: take what the session's connection opens with, or refuse it (409
        when ``resume`` asks for a session not thawed here)."""

    @abc.abstractmethod
    def _new_connection(
        self, request: web.Request, ws: web.WebSocketResponse, sid: str, claim: ClaimT
    ) -> ConnT:
        """The connection for the upgraded ``ws``, by path: Realtime or chat protocol."""

    @abc.abstractmethod
    def _attach(self, conn: ConnT, claim: ClaimT, resume: bool) -> Sequence[Event]:
        """Count a registered connection for its session and set a resume up; the Realtime
        client events a resumed connection acts on first."""

    @abc.abstractmethod
    def _detach(self, conn: ConnT) -> None:
        """An attached connection closed: ``abandon`` it and stop counting it."""

    def _new_realtime(self, request: web.Request, sid: str) -> RealtimeSession:
        """A new Realtime conversation (``?model=`` names the model it reports)."""
        return RealtimeSession(
            sid,
            model=request.query.get("model") or None,
            default_max_tokens=self.config.max_tokens_default,
            max_tokens_limit=self.config.max_tokens_limit,
        )

    def _new_responses(self, sid: str, model: str | None = None) -> ResponsesSession:
        """A new Responses conversation (``model``: the one a response naming none reports)."""
        return ResponsesSession(
            sid,
            model=model,
            default_max_tokens=self.config.max_tokens_default,
            max_tokens_limit=self.config.max_tokens_limit,
        )

    def _forget(self, conn: ConnT) -> None:
        self.connections.discard(conn)
        siblings = self._by_session.get(conn.sid)
        if siblings is not None:
            with contextlib.suppress(ValueError):
                siblings.remove(conn)
            if not siblings:
                del self._by_session[conn.sid]
        if not self.connections and not self.requests:
            self._idle.set()


# -- metrics both export (the same names and help texts: wslb reads them) --------------------


def _parkable(conn: Connection[Any]) -> bool:
    """The connection has park parameters and a session that may go on: not ended, frozen,
    retired, dropped or closed by the worker, its answer task running."""
    answers = conn.answers
    return (
        conn.park is not None
        and conn.park.state is not ParkState.ENDED
        and conn.attached
        and not (conn.frozen or conn.dropped or conn.closed_here)
        and answers is not None
        and not answers.done()
    )


def _on_leg(conn: Connection[Any]) -> bool:
    """The connection has its leg (no park, or attached, no send waiting for room): a freeze
    can take it at a message boundary."""
    return conn.park is None or (conn.park.attached and not conn.waiting)


def _not_an_upgrade() -> web.Response:
    return web.json_response(
        {"error": "expected a WebSocket upgrade"},
        status=426,
        headers={"Upgrade": "websocket", "Connection": "Upgrade"},
    )


def active_sessions_metric(count: int) -> Metric:
    return GaugeMetricFamily(
        "wslb_worker_active_sessions",
        "Sessions with at least one open WebSocket connection",
        value=count,
    )


def connections_metric(server: Server[Any, Any, Any, Any]) -> Metric:
    return CounterMetricFamily(
        "wslb_worker_connections", "WebSocket connections accepted", value=server.connections_total
    )


def parked_sessions_metric(server: Server[Any, Any, Any, Any]) -> Metric:
    return GaugeMetricFamily(
        "wslb_worker_parked_sessions",
        "Sessions whose wslb leg dropped, kept for a reattach (also counted as active)",
        value=server.parked,
    )


def reattaches_metric(server: Server[Any, Any, Any, Any]) -> Metric:
    family = CounterMetricFamily(
        "wslb_worker_reattaches",
        "Reattach upgrades of parked sessions, by result",
        labels=["result"],
    )
    for result, count in server.reattaches.items():
        family.add_metric([result], count)
    return family


def handoffs_metric(server: Server[Any, Any, Any, Any]) -> Metric:
    handoffs = CounterMetricFamily(
        "wslb_worker_handoffs",
        "Sessions frozen here (moved away) and thawed here (moved in)",
        labels=["direction"],
    )
    for direction, count in server.handoffs.items():
        handoffs.add_metric([direction], count)
    return handoffs


def inter_token_latency_metric(server: Server[Any, Any, Any, Any], documentation: str) -> Metric:
    itl = server.itl
    return HistogramMetricFamily(
        "wslb_worker_inter_token_latency_seconds",
        documentation,
        buckets=itl.cumulative(),
        sum_value=itl.sum,
    )


# -- the command line ------------------------------------------------------------------------


def add_listen_options(parser: argparse.ArgumentParser, id_prefix: str) -> None:
    """``--host``, ``--port`` and ``--id``."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=9001, help="port; 0 picks a free one (default: %(default)s)")
    add("--id", dest="worker_id", default=None, help=f"worker id (default: {id_prefix}-PORT)")


def add_session_ttl(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--session-ttl",
        type=float,
        default=300.0,
        help="seconds a session is kept after its last connection closes (default: %(default)s)",
    )


def add_max_tokens_default(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=64,
        help="max_tokens of a prompt that gives none (default: %(default)s)",
    )


def add_subprotocols(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--subprotocols", default="", help="comma-separated subprotocols to accept (default: none)"
    )


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def add_worker_auth(parser: argparse.ArgumentParser) -> None:
    """``--worker-token-file`` and ``--insecure-handoff`` (``backends.auth``)."""
    add = parser.add_argument
    add(
        "--worker-token-file",
        metavar="PATH",
        default=None,
        help="the credential wslb sends (X-WSLB-Worker-Token), one per line (two while it "
        f"rotates); re-read when it changes. Default: ${WORKER_TOKEN_ENV} (comma-separated), "
        "else none: plain upgrades accepted, the handoff API and resumed upgrades refused",
    )
    add(
        "--insecure-handoff",
        action="store_true",
        help="serve the handoff API and resumed upgrades with no credential: anyone who can "
        "reach the port can read and take over every session (tests on a machine of one's own)",
    )


def worker_auth_from_args(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
) -> WorkerAuth:
    """The credentials from ``--worker-token-file`` or the environment; exits with status 2
    (naming the problem, never the secret) when they cannot be used."""
    try:
        return WorkerAuth.from_sources(
            args.worker_token_file, os.environ if env is None else env, args.insecure_handoff
        )
    except ValueError as exc:
        parser.error(str(exc))


def check_listen_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--port`` and ``--max-tokens-default`` in range, else exit with status 2."""
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.max_tokens_default < 0:
        parser.error("--max-tokens-default must be >= 0")


def subprotocols(args: argparse.Namespace) -> tuple[str, ...]:
    """``--subprotocols`` as a tuple."""
    return tuple(p.strip() for p in args.subprotocols.split(",") if p.strip())


# -- the process -----------------------------------------------------------------------------

S = TypeVar("S", bound=Server[Any, Any, Any, Any])


async def serve_until_signal(server: S, ready: Callable[[S], None] | None = None) -> None:
    """Serve a started server until SIGTERM or SIGINT, drain it, then close it; a second
    signal hurries."""
    if ready is not None:
        ready(server)
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
        await server.drain_after_signal(hurry)
    finally:
        await server.close(timeout=0.1 if hurry.is_set() else None)


def announce(server: Server[Any, Any, Any, Any]) -> None:
    """The ready line on stdout (``READY_PREFIX``), once listening."""
    host = server.config.host
    shown = f"[{host}]" if ":" in host else host
    print(
        f"{READY_PREFIX} id={server.worker_id} port={server.port} url=ws://{shown}:{server.port}/ws",
        flush=True,
    )


class _LogFormat(logging.Formatter):
    """The lines of the balancer that started this worker (``WSLB_LOG_FORMAT``, which wslb sets
    for the workers it spawns): text with ISO 8601 times and the zone, or one JSON object per
    line with its keys (``ts``, ``level``, ``logger``, ``message``)."""

    def __init__(self, json_lines: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._json = json_lines

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = datetime.datetime.fromtimestamp(record.created).astimezone()
        return t.isoformat(timespec="milliseconds")

    def format(self, record: logging.LogRecord) -> str:
        if not self._json:
            return super().format(record)
        out = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def run_process(main: Callable[[], Coroutine[Any, Any, None]], level: str) -> None:
    """Run ``main()`` as the process (uvloop when installed), logging at ``level``; an
    ``OSError`` (the port taken, ...) exits with status 1."""
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormat(os.environ.get("WSLB_LOG_FORMAT") == "json"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    except OSError as exc:
        print(f"wslb-worker: {exc}", file=sys.stderr)
        sys.exit(1)
