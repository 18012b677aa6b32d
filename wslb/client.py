"""A WebSocket session through wslb that resumes by itself after a network loss.

wslb keeps a session whose client vanished without a close frame for the pool's
``resume.grace`` (docs/resume.md): a reconnect with the session's secret token and the number
of data messages the client has gets the rest of the stream from exactly there, nothing lost or
repeated. This module is that client, on the ``websockets`` asyncio client::

    import wslb.client

    async with wslb.client.connect("ws://127.0.0.1:8080/ws", key="alice") as session:
        await session.send('{"type": "prompt", "text": "hi", "max_tokens": 8}')
        async for message in session:  # a cut network is resumed underneath
            ...

It speaks the header form of the protocol: its own token in ``X-WSLB-Resume-Token`` on every
upgrade, ``X-WSLB-Resume-From: N`` on a reconnect, and reads ``X-WSLB-Resumed`` or the ``409`` /
``429`` off the handshake. It also understands the answers wslb gives the query form (an open
closed at once with ``4404``/``4409``/``4400``/``4429``), so either form ends the same way.

A session's state (``Session.state``)::

    CONNECTING --101--> OPEN --loss--> RECONNECTING --101 X-WSLB-Resumed: N--> OPEN
                         |                  |--409, 4404/4409/4400, a 101 not resumed--> GONE
                         |                  '--no resume within grace--> GAVE_UP
                         '--a close frame (not a resume), close()--> CLOSED
    GONE, GAVE_UP, CLOSED --restart()--> CONNECTING (a new session: a new token, count 0)

Rule 1 (the session): the library names the token (24 random bytes, 32 characters base64url)
and counts every data message taken off any of the session's connections (``count``); the
count is the session's, so it survives reconnects and starts again at 0 only with a new session
(``restart``). A message is counted when the library reads it, before the application does:
what is counted is delivered, in order, by ``recv`` and the iterator.

Rule 2 (loss or ending): a connection that ends without a close frame (a reset, an abort, the
idle check's own abort), or with ``1012`` whose reason ends in ``": resume"`` (an instance
handing its sessions over), is a loss: RECONNECTING. Any other close frame is an ending (CLOSED,
``close`` event; ``4404``, ``4409``, ``4400``: GONE; ``4429``: a failed try, wait its
``retry_after``). If wslb did not confirm the token in the first ``101`` (resume off, or not
wslb), a loss is GONE: there is nothing to resume.

Rule 3 (reconnecting): tries go out at once (0-100 ms jitter), then after 1, 2, 4, 8, 8 ... s,
each delay jittered by x0.5-1.5, each try bounded by ``connect_timeout``, and all within
``grace`` of the loss; a try that cannot start and finish inside it is not made: GAVE_UP. A
``101`` with ``X-WSLB-Resumed`` equal to the count is OPEN again (``resumed`` event); a ``409``
(or ``400``: the library's own mistake) is GONE; a ``429`` waits ``Retry-After``; any other
status or a connect error is a failed try. A ``101`` resumed from another count, or not
resumed, is closed and the session is GONE (never a stream from the wrong message).

Rule 4 (liveness): the library sends nothing of its own: no pings (``ping_interval=None``), no
messages. It notes every frame it hears, wslb's heartbeat pings included; no frame for
``idle_timeout`` seconds (while the application is not the one holding the stream up) means a
dead path that never closed, and the connection is aborted (no close frame: a close would end
the session at wslb) and resumed. wslb pings a client every ``timeouts.ping_interval`` (or
``ping_timeout``, if that is longer): keep ``idle_timeout`` well above it (45 s against 20 s).

Rule 5 (sends): a message sent while the connection is known lost (or closing) waits for the
resume and goes out on the new connection, in the order sent. Client messages are not replayed
by wslb: one written into a connection that turns out dead may be lost, and ``send`` returns as
for any message written (an application that sent just before a loss and gets no answer asks
again).

Rule 6 (the application decides): GONE and GAVE_UP are reported (``gone`` / ``giveup`` events;
``recv`` and the iterator raise ``SessionGone`` / ``GaveUp`` once the messages before are
delivered); the library does not start a new session by itself: the application calls
``restart()`` (and asks again). CLOSED ends the iterator; ``recv`` raises ``SessionClosed``.

Events (``Session.events``, and ``on_event`` as they happen): ``open`` {key, resumable},
``reconnecting`` {attempt, delay, why}, ``resumed`` {from, gap, attempts}, ``gone`` {code,
reason}, ``giveup`` {why}, ``close`` {code, reason}. ``why`` is what ended the last connection
or try: ``lost`` (no close frame), ``idle``, ``dropped`` (``drop()``), ``1012``, a status
(``503``, ``429``) or an exception's name; ``gap`` is seconds from the loss to the resumed
``101``.

The rules that decide are plain functions (``classify_close``, ``classify_status``,
``backoff``); ``Session`` is the asyncio shell that carries them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.frames import Close
from websockets.protocol import Event as WsEvent
from websockets.protocol import State as WsState
from websockets.typing import Data

__all__ = [
    "Event",
    "GaveUp",
    "Session",
    "SessionClosed",
    "SessionError",
    "SessionGone",
    "State",
    "backoff",
    "classify_close",
    "classify_status",
    "connect",
    "new_token",
]

log = logging.getLogger("wslb.client")

TOKEN_HEADER: Final = "X-WSLB-Resume-Token"
FROM_HEADER: Final = "X-WSLB-Resume-From"
RESUMED_HEADER: Final = "X-WSLB-Resumed"
SESSION_HEADER: Final = "X-Session-Id"
MAX_DELAY: Final = 8.0
GONE_CODES: Final = frozenset({4400, 4404, 4409})
THROTTLED_CODE: Final = 4429
_OURS: Final = frozenset({"ping_interval", "create_connection", "open_timeout"})
INBOX: Final = 64  # messages read ahead of the application before the reader waits


class State(enum.Enum):
    CONNECTING = "connecting"
    OPEN = "open"
    RECONNECTING = "reconnecting"
    GONE = "gone"
    GAVE_UP = "gave_up"
    CLOSED = "closed"


@dataclass(frozen=True)
class Event:
    """Something that happened to the session: ``kind``, its ``detail``, ``at`` (time.time())."""

    kind: str
    detail: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0


class SessionError(Exception):
    """The session cannot go on by itself."""


class SessionGone(SessionError):
    """wslb no longer has the session (or refused this token or count): ``restart()``."""

    def __init__(self, code: int, reason: dict[str, Any]) -> None:
        super().__init__(f"session gone ({code}): {reason}")
        self.code = code
        self.reason = reason


class GaveUp(SessionError):
    """No resume within ``grace`` of the loss: the network (or wslb) is still unreachable."""

    def __init__(self, why: str) -> None:
        super().__init__(f"gave up resuming: {why}")
        self.why = why


class SessionClosed(SessionError):
    """The session ended with a close frame (from the server, or ``close()``)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"session closed ({code} {reason})".rstrip())
        self.code = code
        self.reason = reason


def new_token() -> str:
    """A resume token: 24 random bytes, 32 characters of base64url."""
    return secrets.token_urlsafe(24)


def _reason_object(text: str | bytes) -> dict[str, Any]:
    """wslb's JSON reason (a close reason or a 409 body); ``{"error": text}`` otherwise."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return {"error": text}


# -- the rules as functions (Rules 2 and 3) ---------------------------------------------------


def classify_close(rcvd: Close | None, sent: Close | None) -> tuple[str, Any]:
    """What a connection's end means (Rule 2): ``("loss", why)``, ``("gone", (code,
    reason))``, ``("throttled", seconds)`` or ``("closed", (code, reason))``."""
    if rcvd is None:
        if sent is not None:  # websockets failed the connection itself (1009, 1002)
            return "closed", (sent.code, sent.reason)
        return "loss", "lost"
    if rcvd.code == 1012 and rcvd.reason.endswith(": resume"):
        return "loss", "1012"
    if rcvd.code in GONE_CODES:
        return "gone", (rcvd.code, _reason_object(rcvd.reason))
    if rcvd.code == THROTTLED_CODE:
        after = _reason_object(rcvd.reason).get("retry_after", 1)
        return "throttled", float(after) if isinstance(after, int | float) else 1.0
    return "closed", (rcvd.code, rcvd.reason)


def classify_status(status: int, headers: Mapping[str, str], body: bytes) -> tuple[str, Any]:
    """A refused reconnect (Rule 3): ``("gone", reason)`` (409, 400), ``("throttled",
    seconds)`` (429) or ``("retry", None)``."""
    if status in (400, 409):
        return "gone", _reason_object(body)
    if status == 429:
        try:
            return "throttled", max(float(headers.get("Retry-After", "1")), 0.0)
        except ValueError:
            return "throttled", 1.0
    return "retry", None


def backoff(attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Seconds before try ``attempt`` (1-based): 0-100 ms, then 1, 2, 4, 8, 8 ... s x0.5-1.5."""
    if attempt <= 1:
        return 0.1 * rand()
    return min(2.0 ** (attempt - 2), MAX_DELAY) * (0.5 + rand())


def with_query(url: str, name: str, value: str) -> str:
    """``url`` with ``name=value`` in its query, unless it already names ``name``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(k == name for k, _ in query):
        return url
    query.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(query)))


def query_value(url: str, name: str) -> str | None:
    for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if k == name:
            return v
    return None


# -- the asyncio shell ------------------------------------------------------------------------


class _Connection(ClientConnection):
    """websockets' client connection that notes when it last heard a frame (pings included)."""

    heard: float = 0.0
    aborted: str | None = None  # why the library aborted it ("idle", "dropped")

    def process_event(self, event: WsEvent) -> None:
        self.heard = self.loop.time()
        super().process_event(event)


class _End:
    """The inbox's last item: the session's ending, raised once the messages before it are read."""


_END: Final = _End()


class Session:
    """One resumable session; made by ``connect``. ``count``, ``token``, ``key``, ``events``
    and ``state`` are the session's; ``url`` (without the key) may be changed, and later
    connections go there."""

    def __init__(
        self,
        url: str,
        *,
        key: str | None = None,
        key_param: str | None = "session",
        token: str | None = None,
        grace: float = 30.0,
        idle_timeout: float | None = 45.0,
        connect_timeout: float = 10.0,
        on_event: Callable[[Event], None] | None = None,
        **websockets_kwargs: Any,
    ) -> None:
        bad = _OURS & websockets_kwargs.keys()
        if bad:
            raise TypeError(f"wslb.client sets {', '.join(sorted(bad))} itself")
        if key is None and key_param is not None:
            key = query_value(url, key_param)
        self.url = url
        self.key = key
        self.key_param = key_param
        self.token = token or new_token()
        self.grace = grace
        self.idle_timeout = idle_timeout or None
        self.connect_timeout = connect_timeout
        self.on_event = on_event
        self.count = 0
        self.events: list[Event] = []
        self.state = State.CONNECTING
        self.resumable = False  # wslb confirmed the token in the first 101
        self._headers: dict[str, str] = dict(websockets_kwargs.pop("additional_headers", {}) or {})
        self._kwargs = websockets_kwargs
        self._ws: _Connection | None = None
        self._inbox: asyncio.Queue[Data | _End] = asyncio.Queue()
        self._room = asyncio.Event()  # set when the application took from a full inbox
        self._end: SessionError | None = None
        self._ready = asyncio.Event()  # set while OPEN and once ended: senders go on
        self._pump: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    # -- the application's side ---------------------------------------------------------------

    async def send(self, message: Data) -> None:
        """Send ``message`` (text if ``str``); while reconnecting, after the resume (Rule 5).
        Raises the session's ending (``SessionGone``, ``GaveUp``, ``SessionClosed``)."""
        while True:
            await self._ready.wait()
            if self._end is not None:
                raise self._end
            ws = self._ws
            assert ws is not None
            written = ws.protocol.state is WsState.OPEN  # else send raises before writing
            try:
                await ws.send(message)
                return
            except ConnectionClosed:
                if written:
                    return  # into a connection that died meanwhile: it may be lost (Rule 5)
                if ws is self._ws and self.state is State.OPEN:
                    self._ready.clear()  # the reader has not seen it yet; it will set this

    async def recv(self) -> Data:
        """The session's next message, across reconnects. Raises the session's ending once
        every message before it was read."""
        item = await self._inbox.get()
        self._room.set()
        if isinstance(item, _End):
            self._inbox.put_nowait(item)  # every later call raises it too
            assert self._end is not None
            raise self._end
        return item

    def __aiter__(self) -> Session:
        return self

    async def __anext__(self) -> Data:
        try:
            return await self.recv()
        except SessionClosed:
            raise StopAsyncIteration from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """End the session: a close frame to wslb (the session is over there too)."""
        if self._end is None:
            self._finish(
                SessionClosed(code, reason), State.CLOSED, "close", code=code, reason=reason
            )
        await self._stop(code, reason)

    async def restart(self) -> None:
        """A new session on the same key: a new token, count 0 (after ``gone`` or ``giveup``,
        or to drop the current one: it is closed first). A connect that fails raises as
        ``connect`` does and leaves the session GAVE_UP (``restart`` may be called again)."""
        if self._end is None:
            self._finish(
                SessionClosed(1000, "restart"), State.CLOSED, "close", code=1000, reason="restart"
            )
        await self._stop(1000, "restart")
        self.token = new_token()
        self.count = 0
        self.resumable = False
        self._inbox = asyncio.Queue()
        self._end = None
        self._ready.clear()
        self.state = State.CONNECTING
        try:
            await self._start()
        except BaseException as exc:  # the session has no connection: say so, then raise
            self._finish(GaveUp(type(exc).__name__), State.GAVE_UP, "giveup", why=repr(exc))
            raise

    def drop(self) -> None:
        """For tests and demos: cut the connection as a network would (abort, no close frame);
        the session resumes as after any loss."""
        ws = self._ws
        if ws is not None and self.state is State.OPEN:
            ws.aborted = "dropped"
            ws.transport.abort()

    @property
    def connection(self) -> ClientConnection | None:
        """The current ``websockets`` connection (``response``, ``subprotocol``); do not
        close it: a close ends the session at wslb."""
        return self._ws

    # -- connecting ---------------------------------------------------------------------------

    def _target(self) -> str:
        if self.key is None or self.key_param is None:
            return self.url
        return with_query(self.url, self.key_param, self.key)

    async def _connect(self, resume: bool, timeout: float) -> _Connection:
        headers = {**self._headers, TOKEN_HEADER: self.token}
        if resume:
            headers[FROM_HEADER] = str(self.count)
        ws = await ws_connect(
            self._target(),
            additional_headers=headers,
            open_timeout=timeout,
            ping_interval=None,  # Rule 4: nothing of our own
            create_connection=_Connection,
            **self._kwargs,
        )
        assert isinstance(ws, _Connection)
        ws.heard = ws.loop.time()
        return ws

    async def _start(self) -> None:
        """The first connection of a session (errors go to the caller: nothing to resume)."""
        ws = await self._connect(False, self.connect_timeout)
        assert ws.response is not None
        got = ws.response.headers
        if self.key is None and got.get(SESSION_HEADER):
            self.key = got[SESSION_HEADER]  # the key wslb made: reconnects must name it
        if got.get(TOKEN_HEADER):
            self.token = got[TOKEN_HEADER]
            self.resumable = True
        self._ws = ws
        self.state = State.OPEN
        self._ready.set()
        self._emit("open", key=self.key, resumable=self.resumable)
        self._pump = asyncio.ensure_future(self._read())
        if self.idle_timeout is not None and self._watch is None:
            self._watch = asyncio.ensure_future(self._liveness())

    async def _read(self) -> None:
        try:
            await self._relay()
        except Exception as exc:  # a bug here must not leave the application waiting
            log.exception("wslb.client: the session's reader failed")
            if self._end is None:
                reason = f"wslb.client: {exc!r}"[:120]
                self._finish(
                    SessionClosed(1006, reason), State.CLOSED, "close", code=1006, reason=reason
                )

    async def _relay(self) -> None:
        """Take messages off the current connection into the inbox; on its end, Rule 2."""
        while True:
            ws = self._ws
            assert ws is not None
            try:
                data = await ws.recv()
            except ConnectionClosed as exc:
                if self._end is not None:
                    return
                kind, what = classify_close(exc.rcvd, exc.sent)
                if kind == "loss" and not self.resumable:
                    kind, what = "gone", (1006, {"resume": "unavailable"})
                if kind == "closed":
                    code, reason = what
                    self._finish(SessionClosed(code, reason), State.CLOSED, "close", **_cr(what))
                    return
                if kind == "gone":
                    self._gone(*what)
                    return
                lost_at = time.monotonic()
                why = ws.aborted or (what if kind == "loss" else "4429")
                wait = what if kind == "throttled" else 0.0
                try:
                    await self._reconnect(why, lost_at, wait)
                except SessionError:
                    return
                continue
            self.count += 1
            self._inbox.put_nowait(data)
            while self._inbox.qsize() >= INBOX:  # backpressure: websockets stops reading
                self._room.clear()
                await self._room.wait()

    async def _reconnect(self, why: str, lost_at: float, wait: float) -> None:
        """Rule 3; back OPEN, or the session ended (``_finish``) and ``SessionError`` raised."""
        self.state = State.RECONNECTING
        self._ready.clear()
        attempt = 0
        while True:
            attempt += 1
            delay = max(backoff(attempt), wait)
            wait = 0.0
            left = lost_at + self.grace - time.monotonic()
            if delay >= left:
                raise self._giveup(why)
            self._emit("reconnecting", attempt=attempt, delay=round(delay, 3), why=why)
            await asyncio.sleep(delay)
            left = lost_at + self.grace - time.monotonic()
            if left <= 0:
                raise self._giveup(why)
            try:
                ws = await self._connect(True, min(self.connect_timeout, left))
            except InvalidStatus as exc:
                r = exc.response
                kind, what = classify_status(r.status_code, r.headers, bytes(r.body or b""))
                if kind == "gone":
                    raise self._gone(r.status_code, what) from None
                if kind == "throttled":
                    wait = what
                why = str(r.status_code)
                continue
            except (OSError, TimeoutError, WebSocketException) as exc:
                why = type(exc).__name__
                continue
            assert ws.response is not None
            resumed = ws.response.headers.get(RESUMED_HEADER)
            if resumed != str(self.count):
                await ws.close(1000, "not resumed")  # a new session we did not ask for
                raise self._gone(
                    101, {"resume": "not resumed", "resumed": resumed, "count": self.count}
                )
            self._ws = ws
            self.state = State.OPEN
            self._ready.set()
            self._emit(
                "resumed",
                **{"from": self.count, "gap": time.monotonic() - lost_at, "attempts": attempt},
            )
            return

    async def _liveness(self) -> None:
        """Rule 4: abort a connection that heard nothing for ``idle_timeout``."""
        assert self.idle_timeout is not None
        idle = self.idle_timeout
        while self._end is None:
            ws = self._ws
            wait = idle
            if ws is not None and self.state is State.OPEN:
                now = ws.loop.time()
                if (
                    self._inbox.qsize() >= INBOX
                ):  # the application holds the stream up, not the network
                    ws.heard = now
                silent = now - ws.heard
                if silent >= idle:
                    ws.aborted = "idle"
                    ws.transport.abort()
                else:
                    wait = idle - silent
            await asyncio.sleep(max(wait, 0.05))

    # -- endings ------------------------------------------------------------------------------

    def _gone(self, code: int, reason: dict[str, Any]) -> SessionGone:
        end = SessionGone(code, reason)
        self._finish(end, State.GONE, "gone", code=code, reason=reason)
        return end

    def _giveup(self, why: str) -> GaveUp:
        end = GaveUp(why)
        self._finish(end, State.GAVE_UP, "giveup", why=why)
        return end

    def _finish(self, end: SessionError, state: State, kind: str, **detail: Any) -> None:
        """The session ends: the event, then the ending after the messages already read."""
        self._end = end
        self.state = state
        self._emit(kind, **detail)
        self._ready.set()
        self._inbox.put_nowait(_END)

    async def _stop(self, code: int, reason: str) -> None:
        """Stop the tasks; close the connection if it is open."""
        current = asyncio.current_task()
        for task in (self._pump, self._watch):
            if task is not None and task is not current and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._pump = self._watch = None
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close(code, reason)

    def _emit(self, kind: str, **detail: Any) -> None:
        event = Event(kind, detail, time.time())
        self.events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("on_event raised on %s", kind)


def _cr(what: tuple[int, str]) -> dict[str, Any]:
    return {"code": what[0], "reason": what[1]}


class connect:
    """``async with connect(url, key=...) as session`` (closed on exit), or ``session = await
    connect(...)``. The first connection's errors are raised as ``websockets`` raises them
    (``InvalidStatus``, ``OSError``, ``TimeoutError``): there is no session to resume yet.

    Args:
        url: wslb's WebSocket URL (``ws://`` or ``wss://``).
        key: the session key, put in the query as ``key_param`` (``?session=alice``); ``None``
            takes the one in the URL, else the one wslb makes (its ``X-Session-Id``).
        key_param: the query parameter of the key; ``None`` leaves the URL alone (a key in a
            header, say).
        token: the resume token (default: a new one; a token belongs to one session).
        grace: seconds after a loss within which to resume (the pool's ``resume.grace``).
        idle_timeout: seconds without a frame (data or ping) before the connection is taken
            for dead and resumed; ``None`` or 0: off.
        connect_timeout: seconds for each connect and handshake.
        on_event: called with each ``Event`` as it happens.
        websockets_kwargs: passed to ``websockets.asyncio.client.connect`` on every
            connection (``ssl``, ``additional_headers``, ``subprotocols``, ``max_size`` ...).
    """

    def __init__(
        self,
        url: str,
        *,
        key: str | None = None,
        key_param: str | None = "session",
        token: str | None = None,
        grace: float = 30.0,
        idle_timeout: float | None = 45.0,
        connect_timeout: float = 10.0,
        on_event: Callable[[Event], None] | None = None,
        **websockets_kwargs: Any,
    ) -> None:
        self.session = Session(
            url,
            key=key,
            key_param=key_param,
            token=token,
            grace=grace,
            idle_timeout=idle_timeout,
            connect_timeout=connect_timeout,
            on_event=on_event,
            **websockets_kwargs,
        )

    def __await__(self) -> Generator[Any, None, Session]:
        return self._open().__await__()

    async def _open(self) -> Session:
        await self.session._start()
        return self.session

    async def __aenter__(self) -> Session:
        return await self._open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.session.close()
