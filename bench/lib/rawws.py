"""The raw WebSocket peers of ``proxies.py`` and ``scale.py``: a worker and a client that speak
just enough RFC 6455 to stream fixed 64-byte token frames, each stamped with its send time, so
that what is measured is the proxy in between and not a WebSocket library.

The worker (``WorkerConn``) paces one token every 1/R s or writes as fast as the socket takes;
the client (``ClientConn``) counts frames and their latency in 1 us bins, answers a proxy's
pings, and dials from many loopback source addresses (``dial``) so that one machine holds many
sessions. Each runs in a process of its own under ``run_uvloop``; a client process obeys its
parent's lines (``serve_parent``). ``--tls``'s certificate is made here too (``make_tls``).
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import random
import socket
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
KEY = base64.b64encode(b"wslb-bench-nonce")  # one fixed client key: the accept is checked once
ACCEPT = base64.b64encode(hashlib.sha1(KEY + GUID).digest())
TS_PREFIX = b'{"type":"token","ts":'
TS_DIGITS = 19
PAYLOAD_LEN = 64
_SUFFIX_HEAD = b',"text":"'
SUFFIX = _SUFFIX_HEAD + b"x" * (PAYLOAD_LEN - len(TS_PREFIX) - TS_DIGITS - len(_SUFFIX_HEAD) - 2)
SUFFIX += b'"}'
FRAME_HEAD = bytes([0x81, PAYLOAD_LEN])  # FIN + text, unmasked, 64-byte payload
FRAME_LEN = len(FRAME_HEAD) + PAYLOAD_LEN
TS_OFF = len(FRAME_HEAD) + len(TS_PREFIX)
BLOCK = (FRAME_HEAD + TS_PREFIX + b"0" * TS_DIGITS + SUFFIX) * 32  # unpaced: 32 frames per write
assert len(BLOCK) == 32 * FRAME_LEN
_H0 = b"\x81" * 65536
_H1 = bytes([PAYLOAD_LEN]) * 65536
LAT_BINS = 200_000  # latency histogram: 1 us bins up to 200 ms, the last bin holds the rest
IP_BIND_ADDRESS_NO_PORT = 24  # Linux: pick the source port at connect, not at bind

# --tls: one certificate for every proxy's client listener.
SNI = "localhost"  # the name the clients ask for and check; the leaf also names 127.0.0.1


@dataclass(frozen=True)
class TlsFiles:
    """``--tls``'s files: a throwaway CA and a leaf signed by it (``key_type``: ecdsa is P-256)."""

    ca: Path
    cert: Path  # the leaf's chain (nginx ``ssl_certificate``, wslb ``tls.cert``)
    key: Path
    combined: Path  # key and chain in one file: HAProxy's ``crt``
    key_type: str = "ecdsa"


def make_tls(d: Path, key_type: str = "ecdsa") -> TlsFiles:
    """A CA and a leaf for ``localhost`` and 127.0.0.1, written under ``d`` (trustme)."""
    import trustme

    kt = trustme.KeyType.ECDSA if key_type == "ecdsa" else trustme.KeyType.RSA
    ca = trustme.CA(key_type=kt)
    leaf = ca.issue_cert(SNI, "127.0.0.1", key_type=kt)
    d.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(d / "ca.pem", d / "cert.pem", d / "key.pem", d / "combined.pem", key_type)
    ca.cert_pem.write_to_path(str(files.ca))
    files.cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(files.key))
    leaf.private_key_and_cert_chain_pem.write_to_path(str(files.combined))
    return files


def client_context(ca: str | Path) -> ssl.SSLContext:
    """What the clients use: the platform's defaults (TLS 1.2-1.3), trusting ``ca`` only."""
    return ssl.create_default_context(cafile=str(ca))


def token_frame(ns: int) -> bytes:
    return FRAME_HEAD + TS_PREFIX + b"%019d" % ns + SUFFIX


def server_frame(opcode: int, payload: bytes) -> bytes:
    """An unmasked frame (worker to client), payload under 126 bytes."""
    return bytes([0x80 | opcode, len(payload)]) + payload


_MASK = b"\x37\xfa\x21\x3d"


def _xor(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big")


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked frame (client to worker), payload under 126 bytes."""
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + _MASK + _xor(payload, _MASK)


def next_frame(buf: bytearray, pos: int) -> tuple[int, bytes, int] | None:
    """(opcode, unmasked payload, end) of the frame at ``pos``, or None if incomplete."""
    n = len(buf)
    if n - pos < 2:
        return None
    b1 = buf[pos + 1]
    length, p = b1 & 0x7F, pos + 2
    if length == 126:
        if n - p < 2:
            return None
        length, p = int.from_bytes(buf[p : p + 2], "big"), p + 2
    elif length == 127:
        if n - p < 8:
            return None
        length, p = int.from_bytes(buf[p : p + 8], "big"), p + 8
    mask = b""
    if b1 & 0x80:
        if n - p < 4:
            return None
        mask, p = bytes(buf[p : p + 4]), p + 4
    if n - p < length:
        return None
    payload = bytes(buf[p : p + length])
    if mask and length:
        payload = _xor(payload, mask)
    return buf[pos] & 0x0F, payload, p + length


METRICS = (
    b"wslb_worker_gpu_utilization 0\nwslb_worker_kv_cache_usage 0\n"
    b"wslb_worker_active_sessions 0\nwslb_worker_queue_depth 0\n"
)


class WorkerConn(asyncio.Protocol):
    """One connection to the raw worker: HTTP (``/healthz``, ``/metrics``) or a WebSocket.

    The client's first text message is ``{"rate": R}``: R > 0 paces one token frame every 1/R s
    (stamped at the write), R == 0 writes blocks of frames as fast as the socket takes them.
    Pings get pongs (wslb's heartbeat), a close gets a close.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.ws = False
        self.paused = False
        self.unpaced = False
        self.timer: asyncio.TimerHandle | None = None
        self.period = 0.0
        self.due = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = cast(asyncio.Transport, transport)
        t.set_write_buffer_limits(high=256 * 1024)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.ws:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            self._request(head)
            if not self.ws:
                return
        pos = 0
        while (fr := next_frame(self.buf, pos)) is not None:
            opcode, payload, pos = fr
            self._frame(opcode, payload)
        del self.buf[:pos]

    def _request(self, head: bytes) -> None:
        assert self.transport is not None
        key = b""
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"sec-websocket-key":
                key = value.strip()
        if key:
            accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
            self.ws = True
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
            )
            return
        body = METRICS if head.startswith(b"GET /metrics") else b"ok\n"
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        self.transport.close()

    def _frame(self, opcode: int, payload: bytes) -> None:
        assert self.transport is not None
        if opcode == 0x9:
            self.transport.write(server_frame(0xA, payload))
        elif opcode == 0x8:
            self.transport.write(server_frame(0x8, payload[:2]))
            self.transport.close()
        elif opcode == 0x1 and self.timer is None and not self.unpaced:
            rate = float(json.loads(payload)["rate"])
            if rate > 0:
                self.period = 1.0 / rate
                self.due = self.loop.time() + random.random() * self.period  # spread phases
                self.timer = self.loop.call_at(self.due, self._tick)
            elif rate == 0:
                self.unpaced = True
                self._pump()

    def _tick(self) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(token_frame(time.monotonic_ns()))
        self.due += self.period
        self.timer = self.loop.call_at(self.due, self._tick)

    def _pump(self) -> None:
        t = self.transport
        assert t is not None
        while not self.paused and not t.is_closing():
            t.write(BLOCK)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.unpaced:
            self.loop.call_soon(self._pump)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.paused = True


def upgrade_request(host: str, port: int, target: str) -> bytes:
    return (
        f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {KEY.decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


class ClientStats:
    def __init__(self) -> None:
        self.recv = 0  # data frames received
        self.sent = 0  # data frames sent
        self.open = 0
        self.failed = 0
        self.closed = 0  # sessions the far end ended
        self.bad = 0  # frames of an unexpected shape
        self.errors: list[str] = []
        self.lat = array.array("q", bytes(8 * (LAT_BINS + 1)))  # us -> count

    def note(self, what: str) -> None:
        if len(self.errors) < 8:
            self.errors.append(what)

    def snapshot(self) -> dict[str, Any]:
        lat = self.lat
        hist = {i: c for i, c in enumerate(lat) if c}
        for i in hist:
            lat[i] = 0
        return {
            "recv": self.recv,
            "sent": self.sent,
            "open": self.open,
            "failed": self.failed,
            "closed": self.closed,
            "bad": self.bad,
            "errors": self.errors,
            "lat": hist,
        }


class ClientConn(asyncio.Protocol):
    """One client session: upgrade, then ``{"rate": R}`` (none if idle), then count frames.

    Paced sessions read the stamp of every frame; unpaced ones check the frame headers of a
    whole read at once (strided slices compare in C) and only parse frames one by one when
    something other than a token frame is there (a proxy's ping).
    """

    def __init__(self, st: ClientStats, request: bytes, rate: float | None) -> None:
        self.st = st
        self.request = request
        self.rate = rate
        self.transport: asyncio.Transport | None = None
        self.upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.buf = bytearray()
        self.ws = False
        self.gone = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = t = cast(asyncio.Transport, transport)
        t.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.ws:
            if self.rate:
                if not self.buf and len(data) == FRAME_LEN and data[0] == 0x81:
                    ns = time.monotonic_ns()
                    us = (ns - int(data[TS_OFF : TS_OFF + TS_DIGITS])) // 1000
                    self.st.lat[us if us < LAT_BINS else LAT_BINS] += 1
                    self.st.recv += 1
                    return
                self.buf += data
                self._paced()
            else:
                self.buf += data
                self._unpaced()
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        if not head.startswith(b"HTTP/1.1 101") or ACCEPT not in head:
            if not self.upgraded.done():
                self.upgraded.set_exception(ConnectionError(head.split(b"\r\n", 1)[0].decode()))
            assert self.transport is not None
            self.transport.close()
            return
        self.ws = True
        self.upgraded.set_result(None)
        if self.buf:
            self.data_received(b"")

    def _paced(self) -> None:
        buf, st = self.buf, self.st
        n, p, ns = len(buf), 0, time.monotonic_ns()
        while n - p >= FRAME_LEN and buf[p] == 0x81 and buf[p + 1] == PAYLOAD_LEN:
            q = p + TS_OFF
            us = (ns - int(buf[q : q + TS_DIGITS])) // 1000
            st.lat[us if us < LAT_BINS else LAT_BINS] += 1
            st.recv += 1
            p += FRAME_LEN
        del buf[:p]
        if buf and (buf[0] != 0x81 or (len(buf) > 1 and buf[1] != PAYLOAD_LEN)):
            self._other()

    def _unpaced(self) -> None:
        buf, st = self.buf, self.st
        n, p = len(buf), 0
        while n - p >= FRAME_LEN:
            k = (n - p) // FRAME_LEN
            end = p + k * FRAME_LEN
            if buf[p:end:FRAME_LEN] == _H0[:k] and buf[p + 1 : end : FRAME_LEN] == _H1[:k]:
                st.recv += k
                p = end
                continue
            # Something else further on (a proxy's ping): frame by frame up to it.
            while n - p >= FRAME_LEN and buf[p] == 0x81 and buf[p + 1] == PAYLOAD_LEN:
                st.recv += 1
                p += FRAME_LEN
            break
        del buf[:p]
        if buf and (buf[0] != 0x81 or (len(buf) > 1 and buf[1] != PAYLOAD_LEN)):
            self._other()

    def _other(self) -> None:
        """Frames other than token frames at the start of the buffer: answer pings and closes,
        then back to the fast path at the next token frame."""
        assert self.transport is not None
        buf, pos = self.buf, 0
        while buf[pos : pos + 2] != FRAME_HEAD and (fr := next_frame(buf, pos)) is not None:
            opcode, payload, pos = fr
            if opcode == 0x9:
                self.transport.write(client_frame(0xA, payload))
            elif opcode == 0x8:
                self.st.note(f"close {payload[:40]!r}")
                self.transport.write(client_frame(0x8, payload[:2]))
                self.transport.close()
            elif opcode in (0x1, 0x2):
                self.st.recv += 1
                self.st.bad += 1  # a data frame of another size
        del buf[:pos]
        if pos and buf:
            (self._paced if self.rate else self._unpaced)()

    def go(self) -> None:
        """Ask the worker to start streaming (sessions open first, then all start)."""
        if self.rate is not None and self.transport is not None and not self.gone:
            self.transport.write(client_frame(0x1, json.dumps({"rate": self.rate}).encode()))
            self.st.sent += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError(f"lost before upgrade: {exc!r}"))
        elif self.ws:
            self.st.open -= 1
            self.st.closed += 1
            self.st.note(f"session lost: {exc!r}")


Conn = TypeVar("Conn", bound="ClientConn")


async def dial(
    loop: asyncio.AbstractEventLoop,
    src: str,
    dest: tuple[str, int],
    factory: Callable[[], Conn],
    timeouts: tuple[float, float] = (10.0, 15.0),
    tls: ssl.SSLContext | None = None,
) -> Conn:
    """A client connection from ``src``, upgraded: each loopback source address has its own
    ephemeral ports per destination, so many sources hold many sessions. ``timeouts``: for the
    connect and for the 101 (with ``tls``, the TLS handshake has the second one too). Raises
    OSError (ssl.SSLError is one), TimeoutError or ConnectionError (socket closed)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((src, 0))
        await asyncio.wait_for(loop.sock_connect(sock, dest), timeouts[0])
        if tls is None:
            _, proto = await loop.create_connection(factory, sock=sock)
        else:
            _, proto = await loop.create_connection(
                factory, sock=sock, ssl=tls, server_hostname=SNI, ssl_handshake_timeout=timeouts[1]
            )
        await asyncio.wait_for(proto.upgraded, timeouts[1])
    except (OSError, TimeoutError, ConnectionError):
        sock.close()
        raise
    return proto


async def open_session(
    keep: list[Conn],
    st: ClientStats,
    sem: asyncio.Semaphore,
    i: int,
    src: str,
    dest: tuple[str, int],
    factory: Callable[[], Conn],
    timeouts: tuple[float, float] = (10.0, 15.0),
    tls: ssl.SSLContext | None = None,
) -> None:
    """Session ``i`` (``dial``, at most ``sem`` at once): kept in ``keep`` and counted in ``st``
    as open, or counted as failed with why."""
    async with sem:
        try:
            proto = await dial(asyncio.get_running_loop(), src, dest, factory, timeouts, tls)
        except (OSError, TimeoutError, ConnectionError) as exc:
            st.failed += 1
            st.note(f"connect {i}: {exc!r}")
            return
    keep.append(proto)
    st.open += 1


async def serve_parent(
    stats: Sequence[ClientStats],
    keep: list[Conn],
    open_batch: Callable[[int, float | None, int], Awaitable[str]],
) -> None:
    """A client process's line protocol with its parent, on stdin and stdout: ``open N RATE G``
    (RATE -1: idle) writes the line ``open_batch(N, RATE or None, G)`` returns once the
    sessions are up or failed; ``go`` starts the streams of the sessions opened so far; ``snap``
    answers each group's counters as JSON; end of input exits at once (the kernel closes every
    socket)."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    out = sys.stdout
    while line := await stdin.readline():
        words = line.split()
        if words[:1] == [b"open"]:
            n, rate, group = int(words[1]), float(words[2]), int(words[3])
            out.write(await open_batch(n, None if rate < 0 else rate, group) + "\n")
        elif words[:1] == [b"go"]:
            for proto in keep:
                proto.go()
            keep.clear()  # started: the transports keep the protocols alive
            out.write("going\n")
        elif words[:1] == [b"snap"]:
            out.write(json.dumps([st.snapshot() for st in stats]) + "\n")
        out.flush()
    os._exit(0)  # skip closing thousands of sockets one by one


def run_uvloop(main: Callable[[dict[str, Any]], Any], spec_json: str) -> int:
    """A child process's ``main(spec)`` on uvloop; Ctrl-C (its parent's SIGTERM) ends it quietly."""
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main(json.loads(spec_json)))
    return 0


def ws_probe(
    host: str, port: int, path: str, timeout: float = 30.0, tls: ssl.SSLContext | None = None
) -> None:
    """Wait until a WebSocket upgrade through ``host:port`` (over TLS with ``tls``) gets a 101
    (workers healthy)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with contextlib.ExitStack() as stack:
                s = stack.enter_context(socket.create_connection((host, port), 2))
                if tls is not None:
                    s = stack.enter_context(tls.wrap_socket(s, server_hostname=SNI))
                s.sendall(upgrade_request(host, port, f"{path}?session=probe"))
                head = s.recv(4096)
                if head.startswith(b"HTTP/1.1 101"):
                    return
                last = head.split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"no 101 from {host}:{port} in {timeout:g}s (last: {last})")
