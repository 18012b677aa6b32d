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
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio.sslproto import SSLProtocol as _AioSSLProtocol
from collections.abc import Callable
from typing import Any

import uvloop.loop

# uvloop's SSLProtocol, what its create_server(ssl=) uses (not in its type stubs).
_UvSSLProtocol: Any = getattr(uvloop.loop, "SSLProtocol", None)

Failure = Callable[[str, BaseException], None]


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
    around ``app()`` at once (no loop turn: the ClientHello must reach TLS, not us)."""

    __slots__ = ("_app", "_ctx", "_on_failure", "_timeout")

    def __init__(
        self,
        ctx: ssl.SSLContext,
        app: Callable[[], asyncio.BaseProtocol],
        timeout: float,
        on_failure: Failure,
    ) -> None:
        self._ctx = ctx
        self._app = app
        self._timeout = timeout
        self._on_failure = on_failure

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        who = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        waiter: asyncio.Future[None] = loop.create_future()
        on_failure = self._on_failure

        def done(f: asyncio.Future[None]) -> None:
            exc = None if f.cancelled() else f.exception()
            if exc is not None:
                on_failure(who, exc)

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

    def data_received(self, data: bytes) -> None:  # pragma: no cover - never: the TLS has it
        raise RuntimeError("TlsGate received data after handing its transport on")


def gate_factory(
    ctx: ssl.SSLContext,
    app: Callable[[], asyncio.BaseProtocol],
    timeout: float,
    on_failure: Failure,
) -> Callable[[], TlsGate]:
    """A protocol factory for ``create_server`` (without ``ssl=``) on a TLS listener."""
    return lambda: TlsGate(ctx, app, timeout, on_failure)
