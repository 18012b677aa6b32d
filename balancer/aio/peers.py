"""Carrying a client's resume to the instance that holds its session (cluster mode).

A tier is several instances behind a load balancer that picks one per connection, so a client
whose connection dropped may reconnect through an instance that does not hold its session. That
instance (the *receiver*) carries the reconnect to the one that does (the *holder*):

1. The receiver asks every other live instance at once (their client listeners, from the records
   they keep in etcd: ``Cluster.peers``) by sending the client's upgrade request as it came,
   with ``X-WSLB-Peer`` (``contract.peer_credential`` of the tier's worker secret: only an
   instance holding that secret is believed) and ``X-WSLB-Peer-Client`` (the client's address,
   which the holder logs and counts).
2. An instance that does not hold the session answers ``409`` and does nothing else: a carried
   request is never carried again, never reattached at a worker and never counted as a failed
   resume (the receiver counts the client's outcome once).
3. The holder resumes the session as for any reconnect and answers ``101``: the receiver writes
   that answer to the client as it came, and from then on copies bytes both ways (``Splice``,
   with flow control both ways); the holder keeps relaying the session, the receiver is a TCP
   hop. Either side's end ends the other (a FIN is passed on as a FIN).
4. No holder answers: the caller tries the workers (``proxy.py``: a worker that parks).

The receiver takes the first ``101`` (only the holder gives one); an instance it cannot reach
delays no answer from the others. A
receiver that shuts down ends its carried connections: the client sees its connection drop
without a close and resumes again, the holder sees its client leave and keeps the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import ssl
from collections.abc import Iterable
from typing import Any, cast

import h11

from balancer.contract import peer_credential

__all__ = [
    "PEER_CLIENT_HEADER",
    "PEER_HEADER",
    "Splice",
    "carry",
    "peer_address",
    "peer_request",
    "valid_peer",
]

log = logging.getLogger("wslb.peers")

PEER_HEADER = b"x-wslb-peer"
PEER_CLIENT_HEADER = b"x-wslb-peer-client"
HEAD_LIMIT = 64 * 1024


def valid_peer(given: bytes | None, secret: str | None) -> bool:
    """``given`` is the tier's peer credential (constant time)."""
    if given is None or secret is None:
        return False
    return hmac.compare_digest(given, peer_credential(secret).encode())


def peer_address(value: bytes | None) -> str | None:
    """The client address a peer names, if it is one."""
    if value is None:
        return None
    try:
        return str(ipaddress.ip_address(value.decode("ascii").strip()))
    except (UnicodeDecodeError, ValueError):
        return None


def peer_request(event: h11.Request, secret: str, client: str) -> bytes:
    """The client's upgrade request as it came, with the peer headers (a client's own
    ``X-WSLB-Peer*`` headers are left out)."""
    lines = [b"GET " + bytes(event.target) + b" HTTP/1.1"]
    for name, value in event.headers.raw_items():
        if name.lower().startswith(PEER_HEADER):
            continue
        lines.append(bytes(name) + b": " + bytes(value))
    lines.append(PEER_HEADER + b": " + peer_credential(secret).encode())
    lines.append(PEER_CLIENT_HEADER + b": " + client.encode("ascii", "replace"))
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Answer(asyncio.Protocol):
    """The holder's answer to a carried request: its head (as bytes) and what followed."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[int, bytes, bytes]] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        # h11 is told of the request so that it reads the answer; the bytes go as they are.
        self.h11.send(
            h11.Request(
                method="GET",
                target="/",
                headers=[("host", "peer"), ("connection", "Upgrade"), ("upgrade", "websocket")],
            )
        )
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.buf += data  # after the head: the session's first bytes (kept for the splice)
            return
        self.buf += data
        try:
            self.h11.receive_data(data)
            event = self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            self.done.set_exception(ConnectionError(f"bad answer from the peer: {exc}"))
            return
        if isinstance(event, h11.InformationalResponse | h11.Response):
            rest = bytes(self.h11.trailing_data[0])
            head = bytes(self.buf[: len(self.buf) - len(rest)])
            if event.status_code == 101 and self.transport is not None:
                self.transport.pause_reading()
            self.buf = bytearray(rest)
            self.done.set_result((event.status_code, head, rest))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError("the peer closed before answering"))


class Splice(asyncio.Protocol):
    """One direction's reader of a carried connection: what it reads goes to ``other``. A
    paused writer pauses the reader on the other side (flow control both ways)."""

    def __init__(self, registry: set[Splice]) -> None:
        self.registry = registry
        self.transport: asyncio.Transport | None = None
        self.other: Splice | None = None
        registry.add(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)

    def eof_received(self) -> bool | None:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            if other.can_write_eof():
                other.write_eof()
                return True  # half-closed: the other side may still answer
            other.close()
        return None

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.discard(self)
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            other.close()

    def end(self) -> None:
        """Drop this side now (a shutdown): the client resumes again, the holder keeps it."""
        if self.transport is not None:
            self.transport.abort()


async def _ask(
    loop: asyncio.AbstractEventLoop,
    name: str,
    where: dict[str, Any],
    request: bytes,
    connect_timeout: float,
    answer_timeout: float,
) -> tuple[asyncio.Transport, bytes, bytes] | None:
    """Offer ``request`` to one peer: its transport (reading paused), the 101's head and what
    came after it, or None (unreachable, or not the holder: a 409)."""
    host, port, tls = where.get("host"), where.get("port"), bool(where.get("tls"))
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    ctx: ssl.SSLContext | None = None
    if tls:  # one of the tier: authenticated by the credential it is shown, not its name
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        transport, answer = await asyncio.wait_for(
            loop.create_connection(lambda: _Answer(request), host, port, ssl=ctx),
            connect_timeout,
        )
    except (OSError, TimeoutError) as exc:
        log.debug("peer %s unreachable: %s", name, exc)
        return None
    try:
        status, head, rest = await asyncio.wait_for(answer.done, answer_timeout)
    except (ConnectionError, TimeoutError) as exc:
        log.info("peer %s gave no answer to a carried resume: %s", name, exc)
        transport.abort()
        return None
    except asyncio.CancelledError:
        transport.abort()
        raise
    if status != 101:
        transport.close()
        return None
    return transport, head, rest


async def carry(
    loop: asyncio.AbstractEventLoop,
    client: asyncio.Transport,
    request: bytes,
    peers: Iterable[tuple[str, dict[str, Any]]],
    registry: set[Splice],
    connect_timeout: float,
    answer_timeout: float,
) -> str | None:
    """Offer ``request`` to every peer at once (only the holder can answer ``101``: the others
    answer ``409``, and one that is unreachable costs no one else its timeout); on the first
    ``101`` splice ``client`` to it and return the peer's name; None when no peer holds the
    session (nothing was written to the client)."""
    asks = {
        loop.create_task(_ask(loop, name, where, request, connect_timeout, answer_timeout)): name
        for name, where in peers
    }
    found: tuple[str, tuple[asyncio.Transport, bytes, bytes]] | None = None
    try:
        pending = set(asks)
        while pending and found is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                got = task.result()
                if got is not None and found is None:
                    found = (asks[task], got)
                elif got is not None:  # a second 101 cannot be: the session is one
                    got[0].abort()
    finally:
        for task in asks:
            task.cancel()
    if found is None:
        return None
    name, (transport, head, rest) = found
    if client.is_closing():
        transport.abort()
        return name
    near, far = Splice(registry), Splice(registry)
    near.other, far.other = far, near
    client.set_protocol(near)
    near.connection_made(client)
    transport.set_protocol(far)
    far.connection_made(transport)
    client.write(head)
    if rest:
        client.write(rest)
    with contextlib.suppress(RuntimeError):
        client.resume_reading()
        transport.resume_reading()
    return name
