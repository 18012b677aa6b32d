"""Client-side TLS for a listener: each accepted connection's handshake, with its outcome known.

``loop.create_server(ssl=ctx)`` runs the handshake itself and drops one that fails without a
word (an ``OSError`` there is only logged in asyncio's debug mode), so a burst of failed
handshakes left no trace. ``loop.start_tls`` on an accepted transport would report it, but
uvloop's stalls server-side (the handshake times out even for one connection). So a listener
with TLS accepts plain TCP and ``TlsGate`` does what ``create_server`` does inside: it wraps the
application protocol in the loop's own ``SSLProtocol`` (uvloop's Cython one, or asyncio's), but
with a waiter, which the protocol resolves when the handshake ends: with nothing, or with the
exception that ended it (``on_failure`` gets the peer and the exception). Past the handshake the
connection is exactly what ``create_server(ssl=)`` gives: the same class, transport and costs.

The descriptor under such a connection carries ciphertext: nothing may read or write it
directly (``offload.plain_socket``).

Admission (``Admission``, the sans-I/O core; ``TlsGate`` its shell). A burst of connects (every
client of an instance reconnecting at once) must not become a convoy: with all of them started,
the process interleaves thousands of handshakes, each gets a thin share of the CPU (and of the
client's, when one process opens them), none finishes, and all wait out the handshake timeout
together. So each serving process runs at most ``HANDSHAKES`` handshakes at once; a connection
accepted beyond that waits in a FIFO queue, not read (its ClientHello stays in the kernel's
buffer), and its handshake, with its timeout, starts when a slot frees: the timeout counts the
handshake, not the wait. A slot frees when its handshake ends (done or failed) or ``HOLD``
seconds after it started, whichever is first: a client that connects and sends nothing (or one
far away) keeps its own timeout but cannot hold a slot for longer: idle connects cannot stop
others' handshakes, and at least ``HANDSHAKES / HOLD`` handshakes start per second. A
queued connection whose client gave up is found out when its turn comes (the handshake reads
its close at once). Nothing is refused here: ``limits.max_connections`` still answers 503 past
the handshake.
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio.sslproto import SSLProtocol as _AioSSLProtocol
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import uvloop.loop

# uvloop's SSLProtocol, what its create_server(ssl=) uses (not in its type stubs).
_UvSSLProtocol: Any = getattr(uvloop.loop, "SSLProtocol", None)

Failure = Callable[[str, BaseException], None]

# Handshakes one serving process runs at once (``Admission``). A handshake and its upgrade cost
# wslb about 1 ms of CPU, so a full set ends within about a second even on a loaded core; and
# enough run at once to keep up when each takes long for other reasons (a loop busy with
# streams, a slow client): 64 capped a loaded process at 64 handshakes per second.
HANDSHAKES = 512
# Seconds a started handshake holds its slot at most (it goes on, with its own timeout).
HOLD = 1.0

T = TypeVar("T")


class Admission(Generic[T]):
    """Which accepted connections may start their handshake now: at most ``limit`` hold a
    slot, the others wait in arrival order (the module docstring has the rules). No I/O: the
    caller starts what ``arrive`` and ``release`` return."""

    __slots__ = ("limit", "running", "waiting")

    def __init__(self, limit: int = HANDSHAKES) -> None:
        self.limit = limit
        self.running = 0
        self.waiting: deque[T] = deque()

    def arrive(self, item: T) -> bool:
        """A connection accepted: True if it takes a slot now, else it waits its turn."""
        if self.running < self.limit and not self.waiting:
            self.running += 1
            return True
        self.waiting.append(item)
        return False

    def release(self) -> T | None:
        """A slot freed (once per slot taken): the waiting connection that takes it, if any."""
        if self.waiting:
            return self.waiting.popleft()
        self.running -= 1
        return None


def _ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> Any:
    """The SSLProtocol that belongs to ``loop`` (uvloop's for a uvloop loop)."""
    if _UvSSLProtocol is not None and type(loop).__module__.startswith("uvloop"):
        return _UvSSLProtocol
    return _AioSSLProtocol


def failure_reason(exc: BaseException) -> str:
    """A short label for a failed handshake (a metric's ``reason``): OpenSSL's reason when it
    gave one (``http_request``: plain HTTP to a TLS port; ``no_shared_cipher``; ``tlsv1_alert_
    unknown_ca``: the client does not trust the certificate), else what ended it."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower()
    if isinstance(exc, ConnectionAbortedError | TimeoutError):
        return "timeout"  # asyncio's handshake timeout aborts with ConnectionAbortedError
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, ConnectionError | OSError):
        return "closed"
    return type(exc).__name__


class TlsGate(asyncio.Protocol):
    """The protocol a TLS listener accepts with: hands the transport to an ``SSLProtocol``
    around ``app()`` at once if ``admission`` has a slot (no loop turn: the ClientHello must
    reach TLS, not us), else pauses reading until its turn."""

    __slots__ = ("_admission", "_app", "_ctx", "_early", "_on_failure", "_timeout", "_transport")

    def __init__(
        self,
        ctx: ssl.SSLContext,
        app: Callable[[], asyncio.BaseProtocol],
        timeout: float,
        on_failure: Failure,
        admission: Admission[TlsGate],
    ) -> None:
        self._ctx = ctx
        self._app = app
        self._timeout = timeout
        self._on_failure = on_failure
        self._admission = admission
        self._transport: asyncio.Transport | None = None
        self._early = b""  # what uvloop read before the pause took: the handshake's first bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._admission.arrive(self):
            self._start()
            return
        # Not read until its turn. uvloop starts reading after connection_made returns
        # (asyncio honours a pause made here): paused again at the first read or the next turn.
        self._pause()
        asyncio.get_running_loop().call_soon(self._pause)

    def data_received(self, data: bytes) -> None:
        """Waiting, read before the pause took (once at most): kept for the handshake."""
        self._early += data
        self._pause()

    def _pause(self) -> None:
        if self._transport is not None:  # still waiting
            self._transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # only while waiting (past the start the SSLProtocol has the transport): see _turn

    def _turn(self) -> bool:
        """A slot is this connection's: start its handshake, unless it was closed meanwhile."""
        t = self._transport
        if t is None or t.is_closing():
            return False
        self._start()
        t.resume_reading()
        return True

    def _start(self) -> None:
        transport = self._transport
        assert transport is not None
        self._transport = None
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        who = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        waiter: asyncio.Future[None] = loop.create_future()
        on_failure = self._on_failure
        release = self._release
        held = [True]

        def free() -> None:
            if held[0]:
                held[0] = False
                hold.cancel()
                release()

        def done(f: asyncio.Future[None]) -> None:
            free()
            exc = None if f.cancelled() else f.exception()
            if exc is not None:
                on_failure(who, exc)

        hold = loop.call_later(HOLD, free)
        waiter.add_done_callback(done)
        proto = _ssl_protocol_class(loop)(
            loop,
            self._app(),
            self._ctx,
            waiter,
            True,  # server_side
            None,  # server_hostname
            ssl_handshake_timeout=self._timeout,
        )
        transport.set_protocol(proto)
        proto.connection_made(transport)
        early, self._early = memoryview(self._early), b""
        while early:  # SSLProtocol is a BufferedProtocol
            buf = proto.get_buffer(len(early))
            n = min(len(buf), len(early))
            buf[:n] = early[:n]
            proto.buffer_updated(n)
            early = early[n:]

    def _release(self) -> None:
        """Pass this connection's slot on to the next waiting one that is still open."""
        while (nxt := self._admission.release()) is not None:
            if nxt._turn():
                return


def gate_factory(
    ctx: ssl.SSLContext,
    app: Callable[[], asyncio.BaseProtocol],
    timeout: float,
    on_failure: Failure,
    admission: Admission[TlsGate] | None = None,
) -> Callable[[], TlsGate]:
    """A protocol factory for ``create_server`` (without ``ssl=``) on a TLS listener; the TLS
    listeners of one process share one ``admission``."""
    adm: Admission[TlsGate] = admission if admission is not None else Admission()
    return lambda: TlsGate(ctx, app, timeout, on_failure, adm)
