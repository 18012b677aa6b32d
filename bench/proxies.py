#!/usr/bin/env python3
"""Side by side: direct, nginx, HAProxy and wslb in front of the same token-streaming workers.

One run measures, for each proxy, on 127.0.0.0/8 only:

- **idle KB/session**: the proxy's RSS growth (all its processes) per idle proxied session, over
  three steps of ``--idle-step`` sessions (median of the three slopes);
- **stream**: ``--sessions`` sessions, each paced by its worker at ``--rate`` tokens/s (one
  WebSocket frame per token, one frame per TCP segment): CPU microseconds of the proxy per
  forwarded frame, and the latency each frame gets from the worker's write to the client's read.
  The worker stamps ``time.monotonic_ns()`` (CLOCK_MONOTONIC is system-wide) into every frame;
  added latency is a proxy's p50/p99 minus direct's;
- **saturate**: ``--sat-sessions`` unpaced sessions: frames/s and CPU per frame when the proxy
  gets many frames per read;
- **10k**: ``--hold`` sessions held by one wslb process, each streaming at ``--hold-rate``;
- **multi-core**: saturation frames/s of wslb ``workers: N`` and of nginx ``worker_processes N`` /
  HAProxy ``nbthread N`` for N in ``--cores``.

The workers and clients here are raw uvloop protocols (no aiohttp, no JSON decoding) so that
the proxy, not the load generator, spends the CPU: each frame is a fixed 66-byte text frame
(``{"type":"token","ts":...}``), clients count frames by their 2-byte headers. The same worker
processes serve every proxy and every phase; the client's first message says the pace.

nginx and HAProxy come from Debian (``apt-get install -y nginx haproxy`` if missing); they run
in the foreground from config files in a temp dir, their system services stay stopped. Not a
test: it prints figures (medians over ``--repeat`` windows) and ratios. ``--quick`` is a short
smoke run. CPU comes from /proc (utime + stime of the proxy and its children, 10 ms ticks).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import random
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import require_modules, sigterm_as_interrupt  # noqa: E402
from bench.token_stream import (  # noqa: E402
    ClientProc,
    Target,
    cpu_seconds,
    cpu_split,
    log,
    rss_bytes,
    tree,
)
from tests.procs import Procs, free_port, wait_port  # noqa: E402
from tests.procs import Wslb as WslbProcess  # noqa: E402

# -- wire format: the few bits of RFC 6455 the raw worker and client need ----------------------

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


# -- raw worker (its own process): the same backend for every proxy ---------------------------

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


async def _worker(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(WorkerConn, "127.0.0.1", spec["port"], backlog=4096)
    async with server:
        await server.serve_forever()


# -- raw client (its own process): opens sessions on command, counts frames and latency --------


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
) -> Conn:
    """A client connection from ``src``, upgraded: each loopback source address has its own
    ephemeral ports per destination, so many sources hold many sessions. ``timeouts``: for the
    connect and for the 101. Raises OSError, TimeoutError or ConnectionError (socket closed)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((src, 0))
        await asyncio.wait_for(loop.sock_connect(sock, dest), timeouts[0])
        _, proto = await loop.create_connection(factory, sock=sock)
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
) -> None:
    """Session ``i`` (``dial``, at most ``sem`` at once): kept in ``keep`` and counted in ``st``
    as open, or counted as failed with why."""
    async with sem:
        try:
            proto = await dial(asyncio.get_running_loop(), src, dest, factory, timeouts)
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


async def _client(spec: dict[str, Any]) -> None:
    """``serve_parent`` for this benchmark: ``open`` answers ``ready {...}``. Group 1, when
    there is one, is the direct control group for latency."""
    groups: list[list[tuple[str, int, str]]] = [[tuple(t) for t in g] for g in spec["groups"]]
    n_src: int = spec["sources"]
    stats = [ClientStats() for _ in groups]
    keep: list[ClientConn] = []
    sem = asyncio.Semaphore(spec["concurrency"])
    counter = 0

    async def open_one(i: int, rate: float | None, group: int) -> None:
        st = stats[group]
        host, port, path = groups[group][i % len(groups[group])]
        src = f"127.0.0.{2 + i % n_src}" if n_src else "127.0.0.1"
        request = upgrade_request(host, port, f"{path}?session=bench-{spec['prefix']}-{i}")
        await open_session(
            keep, st, sem, i, src, (host, port), lambda: ClientConn(st, request, rate)
        )

    async def open_batch(n: int, rate: float | None, group: int) -> str:
        nonlocal counter
        failed0 = stats[group].failed
        await asyncio.gather(*(open_one(counter + i, rate, group) for i in range(n)))
        counter += n
        ready = {"open": stats[group].open, "failed": stats[group].failed - failed0}
        return "ready " + json.dumps(ready)

    await serve_parent(stats, keep, open_batch)


def _run_uvloop(main: Callable[[dict[str, Any]], Any], spec_json: str) -> int:
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main(json.loads(spec_json)))
    return 0


# -- proxies under test ------------------------------------------------------------------------


def ws_probe(host: str, port: int, path: str, timeout: float = 30.0) -> None:
    """Wait until a WebSocket upgrade through ``host:port`` gets a 101 (workers healthy)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), 2) as s:
                s.sendall(upgrade_request(host, port, f"{path}?session=probe"))
                head = s.recv(4096)
                if head.startswith(b"HTTP/1.1 101"):
                    return
                last = head.split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"no 101 from {host}:{port} in {timeout:g}s (last: {last})")


class Proxy(Target):
    """A proxy under test (token_stream's ``Target``), with a label and the addresses to dial."""

    kind: ClassVar[str]

    def __init__(self, cores: int = 1) -> None:
        self.cores = cores
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.logdir: Path | None = None

    @property
    def label(self) -> str:
        return self.kind if self.cores == 1 else f"{self.kind} x{self.cores}"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        return [self.pid]

    def addresses(self, backends: Sequence[tuple[str, int]]) -> list[tuple[str, int, str]]:
        return [("127.0.0.1", self.port, "/ws")]

    def _launch(self, procs: Procs, cmd: Sequence[str]) -> None:
        self.logdir = procs.logdir
        self.proc = proc = procs.spawn(self.kind, cmd, term_timeout=5.0)
        self._ready(procs, lambda: wait_port(self.port, 20.0, proc))

    def _ready(self, procs: Procs, listening: Callable[[], object]) -> None:
        """Until ``listening()`` returns and a WebSocket upgrade through the proxy gets a 101."""
        try:
            listening()
            ws_probe("127.0.0.1", self.port, "/ws")
        except (RuntimeError, TimeoutError, OSError) as exc:
            tail = procs.log_tail(self.kind)
            raise RuntimeError(f"{self.label} did not start: {exc}\n{tail}") from None

    def problems(self) -> list[str]:
        if self.logdir is None:
            return []
        words = ("error", "alert", "crit", "emerg", "warning", "traceback")
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if any(w in line.lower() for w in words):
                    out.append(f"{f.name}: {line[:200]}")
        return out


class Direct(Proxy):
    """No proxy: clients dial the workers themselves (the latency baseline)."""

    kind = "direct"

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def addresses(self, backends: Sequence[tuple[str, int]]) -> list[tuple[str, int, str]]:
        return [(h, p, "/ws") for h, p in backends]


def _host_ports(backends: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for u in backends:
        hostport = u.split("//", 1)[1].split("/", 1)[0]
        host, port = hostport.rsplit(":", 1)
        out.append((host, int(port)))
    return out


class Nginx(Proxy):
    """nginx as a WebSocket reverse proxy, hashing ``?session=`` consistently over the workers."""

    kind = "nginx"

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        self.port = free_port()
        d = procs.logdir / "nginx"
        d.mkdir(exist_ok=True)
        servers = "".join(f"    server {h}:{p};\n" for h, p in _host_ports(backends))
        temp = "".join(
            f"  {k}_temp_path {d}/{k};\n"
            for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (d / "nginx.conf").write_text(f"""\
daemon off;
master_process on;
worker_processes {self.cores};
worker_rlimit_nofile {nofile()};
pid {d}/nginx.pid;
error_log {procs.logdir}/nginx-error.log warn;
events {{
  worker_connections {nofile() - 100};
  use epoll;
}}
http {{
  access_log off;
{temp}
  map $http_upgrade $connection_upgrade {{
    default upgrade;
    ''      close;
  }}
  upstream workers {{
    hash $arg_session consistent;
{servers}  }}
  server {{
    listen 127.0.0.1:{self.port} backlog=4096;
    location / {{
      proxy_pass http://workers;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_connect_timeout 5s;
      proxy_read_timeout 1h;
      proxy_send_timeout 1h;
      proxy_buffering off;
    }}
  }}
}}
""")
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self._launch(procs, [nginx, "-p", f"{d}/", "-c", f"{d}/nginx.conf", "-e", f"{d}/e.log"])


class Haproxy(Proxy):
    """HAProxy in ``mode http`` (WebSocket upgrades tunnelled), ``balance url_param session``."""

    kind = "haproxy"

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        self.port = free_port()
        path = procs.logdir / "haproxy.cfg"
        servers = "".join(
            f"  server w{i + 1} {h}:{p} check inter 2s\n"
            for i, (h, p) in enumerate(_host_ports(backends))
        )
        path.write_text(f"""\
global
  nbthread {self.cores}
  maxconn {(nofile() - 200) // 2}
defaults
  mode http
  timeout connect 5s
  timeout client 1h
  timeout server 1h
  timeout tunnel 1h
  timeout http-request 10s
  maxconn {(nofile() - 200) // 2}
frontend fe
  bind 127.0.0.1:{self.port}
  default_backend workers
backend workers
  balance url_param session
  hash-type consistent
  option httpchk GET /healthz
{servers}""")
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        self._launch(procs, [haproxy, "-db", "-f", str(path)])


class Wslb(Proxy):
    """wslb, one pool (consistent hashing on ``?session=``), health checks and scraping on."""

    kind = "wslb"
    relay_thread = True  # the default: streaming sessions' frames forwarded by the C thread

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        config = {
            "pools": [
                {
                    "name": "chat",
                    "balance": "consistent",
                    # The HTTP probe HAProxy also runs (option httpchk), as in earlier runs.
                    "health": {"path": "/healthz"},
                    "backends": [{"id": f"w{i + 1}", "url": u} for i, u in enumerate(backends)],
                }
            ],
            "limits": {"max_connections": 60000, "max_connections_per_client": 60000},
            "workers": self.cores,
            "relay": {"thread": self.relay_thread},
        }
        # A token of its own: with none, wslb writes a generated one to $WSLB_STATE_DIR and logs
        # a warning, which problems() would report. Nothing here calls the admin API. From the
        # source tree under test (--wslb-src), as its working directory.
        wslb = WslbProcess(
            config,
            procs.logdir,
            procs=procs,
            name=self.kind,
            token=secrets.token_urlsafe(32),
            args=["--log-level", "warning"],
            src=WSLB_SRC[0],
        )
        self.logdir, self.port = procs.logdir, wslb.port
        self._ready(procs, lambda: wslb.start(wait_ready=False, timeout=20.0))
        self.proc = wslb.proc

    def processes(self) -> int:
        return len(tree(self.pid))


WSLB_SRC = [ROOT]  # the source tree wslb runs from (--wslb-src)


def source_state(src: Path) -> str:
    """The commit wslb ran from, and whether its balancer/ had uncommitted changes."""
    head = _cmd_out(["git", "-C", str(src), "log", "-1", "--format=%h %s"])[:80]
    dirty = _cmd_out(["git", "-C", str(src), "status", "--porcelain", "--", "balancer"])
    n = len([ln for ln in dirty.splitlines() if ln.strip()])
    loop = _cmd_out(
        [
            "env",
            "-C",
            str(src),
            sys.executable,
            "-c",
            "import balancer.frames as f; "
            "print('C' if f.ACCELERATED else 'Python (balancer._scan not built there)')",
        ]
    )
    return (
        f"{src} at {head}"
        + (f" + uncommitted changes in {n} balancer/ file(s)" if n else "")
        + f"; frame scanner's fast loop: {loop.strip() or 'unknown'}"
    )


class WslbEventLoop(Wslb):
    """wslb with ``relay: {thread: false}``: every frame through the event loop (Python), the
    relay as it was before the thread, for the before/after in the same run."""

    kind = "wslb-loop"
    relay_thread = False


TARGETS: dict[str, type[Proxy]] = {"direct": Direct, "nginx": Nginx, "haproxy": Haproxy}
TARGETS["wslb"] = Wslb
TARGETS["wslb-loop"] = WslbEventLoop


# -- measurement -------------------------------------------------------------------------------


def percentile(hist: dict[int, int], q: float) -> float:
    n = sum(hist.values())
    if not n:
        return math.nan
    rank, seen = q * n, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return b + 0.5
    return math.nan


@dataclass
class Window:
    seconds: float
    frames: int  # data frames both ways, as the clients counted them
    proxy_cpu_s: float
    proxy_sys_s: float  # of which in the kernel (stime)
    workers_cpu_s: float
    clients_cpu_s: float
    rss_mb: float
    lat_n: int = 0
    lat_p50_us: float = math.nan
    lat_p99_us: float = math.nan
    ctl_n: int = 0  # the direct control group, measured at the same time
    ctl_p50_us: float = math.nan
    ctl_p99_us: float = math.nan
    machine_s: float = math.nan  # CPU s the whole machine was busy (other agents' too)

    @property
    def add_p50_us(self) -> float:
        return self.lat_p50_us - self.ctl_p50_us

    @property
    def add_p99_us(self) -> float:
        return self.lat_p99_us - self.ctl_p99_us

    @property
    def fps(self) -> float:
        return self.frames / self.seconds

    @property
    def us_per_frame(self) -> float:
        return self.proxy_cpu_s * 1e6 / self.frames if self.frames else math.nan

    @property
    def sys_us_per_frame(self) -> float:
        return self.proxy_sys_s * 1e6 / self.frames if self.frames else math.nan


@dataclass
class Phase:
    """One load on one proxy: its windows and what went wrong."""

    name: str
    sessions: int
    opened: int = 0
    windows: list[Window] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    processes: int = 1

    def med(self, attr: str) -> float:
        vals = [getattr(w, attr) for w in self.windows]
        vals = [v for v in vals if not math.isnan(v)]
        return statistics.median(vals) if vals else math.nan

    def spread(self, attr: str) -> tuple[float, float]:
        vals = [getattr(w, attr) for w in self.windows if not math.isnan(getattr(w, attr))]
        return (min(vals), max(vals)) if vals else (math.nan, math.nan)


@dataclass
class Result:
    label: str
    idle_kb: float = math.nan
    idle_steps_kb: list[float] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class Load:
    """One client process and the proxy/worker pids it is measured against."""

    def __init__(
        self,
        procs: Procs,
        name: str,
        groups: list[list[tuple[str, int, str]]],
        pids: dict[str, list[int]],
        sources: int,
    ) -> None:
        spec = {"groups": groups, "sources": sources, "concurrency": 200, "prefix": name}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--client-spec", json.dumps(spec)]
        self.client = ClientProc(procs.spawn(f"client-{name}", cmd, pipes=True, term_timeout=0), 0)
        self.pids = dict(pids, clients=[self.client.proc.pid])

    def open(self, n: int, rate: float, group: int = 0) -> dict[str, int]:
        self.client.send(f"open {n} {rate:g} {group}")
        line = self.client.readline(60 + n / 100)
        if not line.startswith("ready "):
            raise RuntimeError(f"client said {line!r}")
        return cast(dict[str, int], json.loads(line[6:]))

    def go(self) -> None:
        self.client.send("go")
        self.client.readline(30)

    def sample(self) -> tuple[float, list[dict[str, Any]], dict[str, float]]:
        self.client.send("snap")
        snap = json.loads(self.client.readline(30))
        cpu = {role: cpu_seconds(p) for role, p in self.pids.items() if role != "proxy"}
        user, system = cpu_split(self.pids["proxy"])  # one reading for the total and its part
        cpu["proxy"] = user + system
        cpu["proxy_sys"] = system
        t = psutil.cpu_times()
        cpu["machine"] = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
        return time.monotonic(), snap, cpu

    def close(self) -> None:
        proc = self.client.proc
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(
    load: Load,
    phase: Phase,
    proxy_pids: list[int],
    warmup: float,
    repeat: int,
    duration: float,
) -> None:
    """``repeat`` windows of ``duration`` s after ``warmup`` s, appended to ``phase``."""
    time.sleep(warmup)
    t0, s0, c0 = load.sample()
    for _ in range(repeat):
        time.sleep(max(0.0, t0 + duration - time.monotonic()))
        t1, s1, c1 = load.sample()
        frames = s1[0]["recv"] + s1[0]["sent"] - s0[0]["recv"] - s0[0]["sent"]
        hist = {int(k): v for k, v in s1[0]["lat"].items()}
        ctl = {int(k): v for k, v in s1[1]["lat"].items()} if len(s1) > 1 else {}
        w = Window(
            seconds=t1 - t0,
            frames=frames,
            proxy_cpu_s=c1["proxy"] - c0["proxy"],
            proxy_sys_s=c1["proxy_sys"] - c0["proxy_sys"],
            machine_s=c1["machine"] - c0["machine"],
            workers_cpu_s=c1["workers"] - c0["workers"],
            clients_cpu_s=c1["clients"] - c0["clients"],
            rss_mb=rss_bytes(proxy_pids) / 2**20,
            lat_n=sum(hist.values()),
            lat_p50_us=percentile(hist, 0.50),
            lat_p99_us=percentile(hist, 0.99),
            ctl_n=sum(ctl.values()),
            ctl_p50_us=percentile(ctl, 0.50),
            ctl_p99_us=percentile(ctl, 0.99),
        )
        phase.windows.append(w)
        lat = f", latency p50/p99 {w.lat_p50_us:.0f}/{w.lat_p99_us:.0f} us" if w.lat_n else ""
        if w.ctl_n:
            lat += f" (direct {w.ctl_p50_us:.0f}/{w.ctl_p99_us:.0f})"
        log(
            f"    {w.fps:,.0f} frames/s, {w.us_per_frame:.2f} us/frame, "
            f"proxy cpu {100 * w.proxy_cpu_s / w.seconds:.0f}%{lat}"
        )
        t0, s0, c0 = t1, s1, c1
    for g in s0:
        if g["bad"]:
            phase.warnings.append(f"{g['bad']} frames of unexpected size")
        if g["closed"]:
            phase.warnings.append(f"{g['closed']} sessions ended during a window: {g['errors']}")


def check_phase(phase: Phase, proxy_pids: list[int]) -> None:
    """Warnings that make a phase's figures suspect."""
    if proxy_pids and min(w.proxy_cpu_s for w in phase.windows) < 1.0:
        phase.warnings.append("proxy used under 1 CPU s in a window (10 ms ticks): lengthen it")
    n_cpu = os.cpu_count() or 1
    for w in phase.windows:
        busy = (w.proxy_cpu_s + w.workers_cpu_s + w.clients_cpu_s) / w.seconds
        if busy > 0.9 * n_cpu and phase.name == "stream":
            phase.warnings.append(f"this benchmark alone used {busy:.0%} of {n_cpu} CPUs")
            break


@dataclass
class Running:
    """A started proxy, the processes it was started through, and its figures so far."""

    proxy: Proxy
    procs: Procs
    res: Result


class Bench:
    """The shared workers and the steps of a run, each on one running proxy."""

    def __init__(
        self, args: argparse.Namespace, backends: list[str], worker_pids: list[int], root: Path
    ) -> None:
        self.args = args
        self.backends = backends
        self.hp = _host_ports(backends)
        self.worker_pids = worker_pids
        self.root = root

    def start(self, stack: contextlib.ExitStack, proxy: Proxy) -> Running:
        logdir = self.root / proxy.label.replace(" ", "")
        logdir.mkdir(parents=True, exist_ok=True)
        procs = stack.enter_context(Procs(logdir))
        log(f"[{proxy.label}] starting")
        proxy.start(procs, self.backends)
        run = Running(proxy, procs, Result(proxy.label))
        if isinstance(proxy, Wslb) and proxy.cores > 1 and proxy.processes() < proxy.cores:
            n = proxy.processes()
            run.res.warnings.append(f"wslb asked for workers: {proxy.cores}, runs {n} process(es)")
        return run

    def pids(self, run: Running) -> dict[str, list[int]]:
        return {"proxy": run.proxy.pids(), "workers": self.worker_pids}

    def idle(self, run: Running) -> None:
        """RSS growth per idle session: three steps after a base, median of the slopes."""
        args, res, ppids = self.args, run.res, run.proxy.pids()
        log(f"[idle] {run.proxy.label}")
        load = Load(
            run.procs, "idle", [run.proxy.addresses(self.hp)], self.pids(run), self.args.sources
        )
        load.open(args.idle_base, -1)
        time.sleep(1.0)
        rss = [rss_bytes(ppids)]
        for _ in range(3):
            got = load.open(args.idle_step, -1)
            time.sleep(1.5)
            rss.append(rss_bytes(ppids))
            if got["failed"]:
                res.warnings.append(f"idle: {got['failed']} sessions failed")
        res.idle_steps_kb = [(b - a) / 1024 / args.idle_step for a, b in itertools.pairwise(rss)]
        res.idle_kb = statistics.median(res.idle_steps_kb)
        log(f"    {', '.join(f'{x:.2f}' for x in res.idle_steps_kb)} KB/session")
        load.close()
        time.sleep(0.5)

    def window(self, run: Running, name: str) -> None:
        """Fresh sessions, warmup, one measured window of the ``stream`` or ``saturate`` load.

        Stream windows of a proxy also run direct control sessions (a fifth as many, at least
        50) at the same time: added latency is measured against them, so the machine's
        momentary load, which moves both, cancels out.
        """
        args, proxy = self.args, run.proxy
        stream = name == "stream"
        sessions = args.sessions if stream else args.sat_sessions
        ppids = proxy.pids()
        if name not in run.res.phases:
            nproc = sum(len(tree(p)) for p in ppids)
            run.res.phases[name] = Phase(name, sessions, opened=sessions, processes=nproc)
        phase = run.res.phases[name]
        control = stream and not isinstance(proxy, Direct)
        groups = [proxy.addresses(self.hp)]
        if control:
            groups.append([(h, p, "/ws") for h, p in self.hp])
        tag = f"{name}{len(phase.windows)}"
        load = Load(run.procs, tag, groups, self.pids(run), args.sources)
        rate = args.rate if stream else 0.0
        opened = load.open(sessions, rate)["open"]
        for _ in range(3):  # refused (wslb 503s while its health checks recover): again
            if opened >= sessions:
                break
            phase.warnings.append(f"{sessions - opened} of {sessions} sessions refused; retried")
            time.sleep(3.0)
            opened = load.open(sessions - opened, rate)["open"]
        if opened < sessions:
            phase.warnings.append(f"only {opened} of {sessions} sessions connected")
        phase.opened = min(phase.opened, opened)
        if control:
            load.open(max(50, sessions // 5), rate, 1)
        load.go()
        duration = args.duration if stream else args.sat_duration
        measure(load, phase, ppids, args.warmup, 1, duration)
        load.close()
        time.sleep(0.5)

    def rounds(self, runs: list[Running], name: str) -> None:
        """``--repeat`` rounds of one window per proxy, the order rotated every round, so that
        every proxy sees the same share of whatever else the machine is doing."""
        for r in range(self.args.repeat):
            k = r % len(runs)
            for run in runs[k:] + runs[:k]:
                log(f"[{name} {r + 1}/{self.args.repeat}] {run.proxy.label}")
                self.window(run, name)

    def finish(self, runs: list[Running]) -> None:
        for run in runs:
            for phase in run.res.phases.values():
                check_phase(phase, run.proxy.pids())
            run.res.warnings += [f"log: {p}" for p in run.proxy.problems()[:5]]


def run_hold(
    backends: list[str], worker_pids: list[int], args: argparse.Namespace, logroot: Path
) -> tuple[Phase, float]:
    """``--hold`` sessions through one wslb process, streaming at ``--hold-rate`` each."""
    proxy = Wslb()
    logdir = logroot / "hold"
    logdir.mkdir(parents=True, exist_ok=True)
    with Procs(logdir) as procs:
        n = min(args.hold, (nofile() - 150) // 2)  # two sockets per session, and some spare
        log(f"[wslb hold] {n} sessions at {args.hold_rate:g} tokens/s")
        proxy.start(procs, backends)
        time.sleep(0.5)
        rss0 = rss_bytes(proxy.pids())
        load = Load(
            procs,
            "hold",
            [proxy.addresses(_host_ports(backends)), Direct().addresses(_host_ports(backends))],
            {"proxy": proxy.pids(), "workers": worker_pids},
            args.sources,
        )
        phase = Phase("hold", args.hold)
        if n < args.hold:
            phase.warnings.append(
                f"RLIMIT_NOFILE is {nofile()} (hard limit; raising it needs CAP_SYS_RESOURCE): "
                f"one process can hold {n} sessions of 2 sockets each, not {args.hold}"
            )
        t = time.monotonic()
        phase.opened = load.open(n, args.hold_rate)["open"]
        load.open(500, args.hold_rate, 1)  # direct control group: the load generator's share
        load.go()
        log(f"  {phase.opened} sessions open in {time.monotonic() - t:.1f}s")
        if phase.opened < n:
            phase.warnings.append(f"only {phase.opened} of {n} sessions connected")
        measure(load, phase, proxy.pids(), args.warmup + 2, 2, args.duration)
        check_phase(phase, proxy.pids())
        kb = (statistics.median(w.rss_mb for w in phase.windows) * 2**20 - rss0) / 1024
        load.close()
        phase.warnings += proxy.problems()[:5]
    return phase, kb / max(1, phase.opened)


# -- environment -------------------------------------------------------------------------------


def ensure_installed() -> None:
    """``apt-get install -y nginx haproxy`` if missing; stop the services the packages start."""
    missing = [p for p in ("nginx", "haproxy") if shutil.which(p) is None]
    if not missing:
        return
    log(f"installing {' '.join(missing)} from Debian packages")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=False, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env)
    for svc in missing:
        # Package scripts may have started the system service; this benchmark runs its own.
        if shutil.which("systemctl") and Path("/run/systemd/system").exists():
            subprocess.run(["systemctl", "disable", "--now", svc], check=False)
        else:
            subprocess.run(["service", svc, "stop"], check=False, capture_output=True)


def raise_nofile(n: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, n)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _cmd_out(cmd: Sequence[str]) -> str:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    return (r.stdout + r.stderr).strip()


def machine() -> dict[str, str]:
    from importlib import metadata

    lscpu = _cmd_out(["lscpu"])
    keep = {"Architecture", "CPU(s)", "Model name", "Thread(s) per core", "Core(s) per socket"}
    keep |= {"Socket(s)", "CPU max MHz", "L2 cache", "L3 cache", "Hypervisor vendor"}
    lines = [ln for ln in lscpu.splitlines() if ln.split(":")[0].strip() in keep]
    nginx = _cmd_out(["nginx", "-v"]).replace("nginx version: ", "")
    return {
        "lscpu": "; ".join(" ".join(ln.split()) for ln in lines),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "uvloop": metadata.version("uvloop"),
        "nginx": nginx,
        "haproxy": _cmd_out(["haproxy", "-v"]).splitlines()[0] if shutil.which("haproxy") else "",
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


# -- report --------------------------------------------------------------------------------------


def _f(x: float, fmt: str) -> str:
    return "-" if math.isnan(x) else format(x, fmt)


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b <= 0 else f"{a / b:.2f}x"


def rows(results: dict[str, Result]) -> list[tuple[str, dict[str, float]]]:
    """(metric, label -> value) for the table and the plot.

    Added latency is per window: the proxied sessions' percentile minus that of the direct
    control sessions streaming at the same time from the same workers and client process (so
    the machine's momentary load cancels out); the median over windows.
    """

    def col(fn: Callable[[Result], float]) -> dict[str, float]:
        return {k: fn(r) for k, r in results.items()}

    def ph(r: Result, name: str, attr: str) -> float:
        return r.phases[name].med(attr) if name in r.phases else math.nan

    def per_core(r: Result) -> float:
        """Throughput if the proxy had a whole core: on a shared machine it gets less."""
        us = ph(r, "saturate", "us_per_frame")
        return 1e6 / us if us > 0 else math.nan

    return [
        ("cpu us/frame, stream", col(lambda r: ph(r, "stream", "us_per_frame"))),
        ("  of which kernel (stime)", col(lambda r: ph(r, "stream", "sys_us_per_frame"))),
        ("cpu us/frame, saturation", col(lambda r: ph(r, "saturate", "us_per_frame"))),
        ("frames/s, saturation", col(lambda r: ph(r, "saturate", "fps"))),
        ("frames per proxy CPU-second, saturation", col(lambda r: per_core(r))),
        ("frames/s, stream (offered)", col(lambda r: ph(r, "stream", "fps"))),
        ("latency p50 us (worker to client)", col(lambda r: ph(r, "stream", "lat_p50_us"))),
        ("latency p99 us", col(lambda r: ph(r, "stream", "lat_p99_us"))),
        ("added latency p50 us", col(lambda r: ph(r, "stream", "add_p50_us"))),
        ("added latency p99 us", col(lambda r: ph(r, "stream", "add_p99_us"))),
        ("idle KB/session", col(lambda r: r.idle_kb)),
    ]


def table(results: dict[str, Result]) -> str:
    labels: list[str] = [
        k for k in ("direct", "nginx", "haproxy", "wslb-loop", "wslb") if k in results
    ]
    labels += [k for k in results if k not in labels]
    head = ["metric (median of windows)", *labels, "wslb/nginx", "wslb/haproxy"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for metric, vals in rows(results):
        fmt = ",.0f" if "frames" in metric else ".1f" if "latency" in metric else ".2f"
        cells = [_f(vals.get(k, math.nan), fmt) for k in labels]
        w = vals.get("wslb", math.nan)
        cells += [_ratio(w, vals.get("nginx", math.nan)), _ratio(w, vals.get("haproxy", math.nan))]
        out.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets_report(results: dict[str, Result]) -> list[str]:
    """Issue 6 and 17's targets for wslb, each against nginx and HAProxy in this run."""
    r = dict(rows(results))
    out = []

    def check(name: str, metric: str, factor: float, against: Sequence[str]) -> None:
        vals = r[metric]
        w = vals.get("wslb", math.nan)
        others = {k: vals[k] for k in against if k in vals and not math.isnan(vals[k])}
        if math.isnan(w) or not others:
            out.append(f"{name}: not measured")
            return
        best_k = min(others, key=lambda k: others[k])
        limit = factor * others[best_k]
        verdict = "MET" if w <= limit else "MISSED"
        out.append(
            f"{name}: wslb {w:.2f} vs limit {limit:.2f} ({factor:g} x {best_k} "
            f"{others[best_k]:.2f}): {verdict} ({w / limit:.2f}x the limit)"
            if limit > 0
            else f"{name}: wslb {w:.2f} vs limit {limit:.2f}: {verdict}"
        )

    both = ("nginx", "haproxy")
    check("cpu/frame stream <= 0.9x best", "cpu us/frame, stream", 0.9, both)
    check("cpu/frame saturation <= 0.9x best", "cpu us/frame, saturation", 0.9, both)
    check("idle memory/session <= haproxy", "idle KB/session", 1.0, ("haproxy",))
    check("added p99 latency <= nginx", "added latency p99 us", 1.0, ("nginx",))
    check("latency p99 <= nginx", "latency p99 us", 1.0, ("nginx",))
    lat = r["latency p50 us (worker to client)"]
    if "wslb" in lat and "nginx" in lat:
        w, n = lat["wslb"], lat["nginx"]
        verdict = "MET" if w <= n + 50 else "MISSED"
        out.append(f"latency p50 within 50 us of nginx: wslb {w:.1f} vs nginx {n:.1f}: {verdict}")
    return out


def plot(results: dict[str, Result], multi: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = dict(rows(results))
    labels = [k for k in ("nginx", "haproxy", "wslb-loop", "wslb") if k in results]
    colors = {
        "direct": "#999999",
        "nginx": "#009639",
        "haproxy": "#1f6fb2",
        "wslb-loop": "#fdb863",
        "wslb": "#d95f02",
    }
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    panels = [  # metric, title, per-window points (phase, attribute)
        ("cpu us/frame, stream", "CPU us per frame, stream", ("stream", "us_per_frame")),
        ("cpu us/frame, saturation", "CPU us per frame, saturation", ("saturate", "us_per_frame")),
        ("idle KB/session", "idle KB per session (3 steps)", None),
        ("added latency p50 us", "added latency p50 (us)", ("stream", "add_p50_us")),
        ("added latency p99 us", "added latency p99 (us), log", ("stream", "add_p99_us")),
    ]
    for ax, (metric, title, points) in zip(axes.flat, panels, strict=False):
        vals = [r[metric].get(k, math.nan) for k in labels]
        ax.bar(labels, vals, color=[colors[k] for k in labels])
        for i, k in enumerate(labels):  # every window (or idle step) as a dot: the spread
            res = results[k]
            if points is None:
                ys = res.idle_steps_kb
            elif points[0] in res.phases:
                ys = [getattr(w, points[1]) for w in res.phases[points[0]].windows]
            else:
                ys = []
            ax.plot([i] * len(ys), ys, "k.", alpha=0.6)
        if "p99" in metric:
            ax.set_yscale("log")
        for i, v in enumerate(vals):
            if not math.isnan(v):
                text = f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
                ax.annotate(text, (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_title(title)
    ax = axes.flat[5]
    names = list(multi)
    ax.bar(names, [multi[n] / 1000 for n in names], color=[colors[n.split()[0]] for n in names])
    ax.set_title("saturation kframes/s (x2: 2 processes or threads)")
    ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("WebSocket proxies in front of the same token-streaming workers (loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(
    info: dict[str, str],
    results: dict[str, Result],
    extra: dict[str, Result],
    multi: dict[str, float],
    multi_cpu: dict[str, float],
    hold: tuple[Phase, float] | None,
    args: argparse.Namespace,
) -> None:
    print(f"machine: {info['lscpu']}")
    print(
        f"{info['kernel']}, {info['memory']}, Python {info['python']}, uvloop {info['uvloop']}, "
        f"{info['nginx']}, {info['haproxy']}; load average at start {info['loadavg']}"
    )
    print(f"wslb: {info['wslb']}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"stream: {args.sessions} sessions x {args.rate:g} tokens/s, saturation: "
        f"{args.sat_sessions} unpaced sessions, {args.workers} raw workers, {args.repeat} windows "
        f"({args.duration:g}s stream, {args.sat_duration:g}s saturation) after {args.warmup:g}s; "
        f"idle: 3 x {args.idle_step} sessions"
    )
    print()
    print(table(results))
    print()
    if multi:
        print("saturation frames/s by processes/threads (proxy CPU % in parentheses):")
        for k, v in multi.items():
            print(f"  {k:<12} {v:>10,.0f}  ({multi_cpu.get(k, math.nan):.0f}%)")
    if hold is not None:
        ph, kb = hold
        w = ph.windows
        print(
            f"hold: {ph.opened:,} of {ph.sessions:,} sessions open through one wslb process, "
            f"{ph.med('fps'):,.0f} frames/s (offered {ph.opened * args.hold_rate:,.0f}), "
            f"cpu {100 * statistics.median(x.proxy_cpu_s / x.seconds for x in w):.0f}%, "
            f"{ph.med('us_per_frame'):.2f} us/frame, rss {ph.med('rss_mb'):.0f} MB "
            f"({kb:.1f} KB/session), latency p50/p99 {ph.med('lat_p50_us'):.0f}/"
            f"{ph.med('lat_p99_us'):.0f} us (500 direct sessions at the same time: "
            f"{ph.med('ctl_p50_us'):.0f}/{ph.med('ctl_p99_us'):.0f} us)"
        )
        for x in ph.warnings:
            print(f"  hold: WARNING: {x}")
    print()
    for line in targets_report(results):
        print(f"target {line}")
    print()
    for k, res in {**results, **extra}.items():
        for name, ph in res.phases.items():
            lo, hi = ph.spread("us_per_frame")
            flo, fhi = ph.spread("fps")
            cpu = statistics.median(w.proxy_cpu_s / w.seconds for w in ph.windows) * 100
            wk = statistics.median(w.workers_cpu_s / w.seconds for w in ph.windows) * 100
            cl = statistics.median(w.clients_cpu_s / w.seconds for w in ph.windows) * 100
            others = statistics.median(
                (w.machine_s - w.proxy_cpu_s - w.workers_cpu_s - w.clients_cpu_s) / w.seconds
                for w in ph.windows
            )
            n = sum(w.lat_n for w in ph.windows)
            print(
                f"  {k} {name}: {ph.opened} sessions, {ph.processes} process(es), us/frame "
                f"[{_f(lo, '.2f')}-{_f(hi, '.2f')}], frames/s [{flo:,.0f}-{fhi:,.0f}], "
                f"cpu proxy {cpu:.0f}% workers {wk:.0f}% clients {cl:.0f}% "
                f"other processes {100 * others:.0f}%, rss "
                f"{ph.med('rss_mb'):.1f} MB" + (f", {n:,} latency samples" if n else "")
            )
            for x in dict.fromkeys(ph.warnings):
                print(f"  {k} {name}: WARNING: {x}")
        if res.idle_steps_kb:
            steps = ", ".join(f"{x:.2f}" for x in res.idle_steps_kb)
            print(f"  {k} idle: KB/session per step of {args.idle_step}: {steps}")
        for x in res.warnings:
            print(f"  {k}: WARNING: {x}")


# -- main ----------------------------------------------------------------------------------------


def _result(d: dict[str, Any]) -> Result:
    phases = {
        k: Phase(**(p | {"windows": [Window(**w) for w in p["windows"]]}))
        for k, p in d["phases"].items()
    }
    return Result(**(d | {"phases": phases}))


def replay(path: Path, args: argparse.Namespace) -> int:
    """The table, targets and plot of an earlier run, from its ``--json`` file."""
    d = json.loads(path.read_text())
    results = {k: _result(v) for k, v in d["results"].items()}
    print(f"from {path}: {' '.join(d['command'])}")
    print(f"wslb: {d['machine'].get('wslb', '?')}\n")
    print(table(results))
    print()
    for line in targets_report(results):
        print(f"target {line}")
    if args.plot:
        plot(results, d["multi_fps"], Path(args.plot))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="direct / nginx / HAProxy / wslb side by side: CPU per frame, frames/s, "
        "added latency, idle memory per session, 10k sessions, multi-core throughput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (figures are rough)")
    p.add_argument(
        "--targets", default="direct,nginx,haproxy,wslb-loop,wslb", help="comma-separated"
    )
    p.add_argument("--sessions", type=int, default=500, help="stream sessions")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream session")
    p.add_argument("--sat-sessions", type=int, default=32, help="unpaced sessions")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per stream window")
    p.add_argument("--sat-duration", type=float, default=6.0, help="seconds per saturation window")
    p.add_argument("--repeat", type=int, default=3, help="windows per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before the first window")
    p.add_argument("--workers", type=int, default=2, help="raw worker processes")
    p.add_argument("--idle-base", type=int, default=200, help="idle sessions before the steps")
    p.add_argument("--idle-step", type=int, default=1000, help="idle sessions per step (3 steps)")
    p.add_argument("--hold", type=int, default=10000, help="sessions held by one wslb (0: skip)")
    p.add_argument("--hold-rate", type=float, default=1.0, help="tokens/s per held session")
    p.add_argument("--cores", default="1,2", help="N for the multi-core saturation rows")
    p.add_argument("--sources", type=int, default=50, help="client source addresses 127.0.0.x")
    p.add_argument("--plot", default=None, help="write the PNG here (e.g. docs/benchmarks.png)")
    p.add_argument("--json", default=None, help="write every window as JSON here")
    p.add_argument("--logs", default=None, help="keep the processes' logs and configs here")
    p.add_argument(
        "--from-json", default=None, help="no run: print the table (and --plot) of a --json file"
    )
    p.add_argument(
        "--wslb-src",
        default=str(ROOT),
        help="run wslb from this source tree (e.g. a `git worktree` of a commit)",
    )
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client_spec is not None:
        return _run_uvloop(_client, args.client_spec)
    if args.worker_spec is not None:
        return _run_uvloop(_worker, args.worker_spec)
    if args.quick:
        args.sessions, args.duration, args.sat_duration = 200, 3.0, 2.0
        args.warmup, args.idle_step, args.idle_base = 1.0, 300, 50
        args.hold = min(args.hold, 2000)
    if args.from_json:
        return replay(Path(args.from_json), args)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    WSLB_SRC[0] = Path(args.wslb_src).resolve()
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    if unknown := [n for n in names if n not in TARGETS]:
        raise SystemExit(f"unknown targets {unknown}; choose from {sorted(TARGETS)}")
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    if args.plot:  # before the run, not after it (pip install -e '.[bench]')
        require_modules(["matplotlib"], "--plot")
    ensure_installed()
    nofile = raise_nofile(4 * max(args.hold, args.idle_base + 3 * args.idle_step) + 10000)
    log(f"RLIMIT_NOFILE {nofile}")
    info = machine()
    info["wslb"] = source_state(WSLB_SRC[0])
    results: dict[str, Result] = {}
    multi: dict[str, float] = {}
    multi_cpu: dict[str, float] = {}
    hold: tuple[Phase, float] | None = None
    extra: dict[str, Result] = {}
    with contextlib.ExitStack() as stack:
        root = Path(args.logs) if args.logs else None
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wslb-proxies-")))
        root.mkdir(parents=True, exist_ok=True)
        procs = stack.enter_context(Procs(root))
        try:
            worker_pids, backends = [], []
            for i in range(args.workers):
                port = free_port()
                spec = json.dumps({"port": port})
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-spec", spec]
                proc = procs.spawn(f"worker-{i + 1}", cmd)
                wait_port(port, 20.0, proc)
                worker_pids.append(proc.pid)
                backends.append(f"ws://127.0.0.1:{port}/ws")
            bench = Bench(args, backends, worker_pids, root)
            with contextlib.ExitStack() as one:
                runs = [bench.start(one, TARGETS[name]()) for name in names]
                for run in runs:
                    if run.proxy.pids():
                        bench.idle(run)
                bench.rounds(runs, "stream")
                bench.rounds(runs, "saturate")
                bench.finish(runs)
            for run in runs:
                results[run.proxy.label] = run.res
                if 1 in cores and run.proxy.pids():
                    sat = run.res.phases["saturate"]
                    multi[run.proxy.label] = sat.med("fps")
                    multi_cpu[run.proxy.label] = 100 * sat.med("proxy_cpu_s") / sat.med("seconds")
            for n in (c for c in cores if c != 1):
                with contextlib.ExitStack() as more:
                    runs = [bench.start(more, TARGETS[x](cores=n)) for x in names if x != "direct"]
                    bench.rounds(runs, "saturate")
                    bench.finish(runs)
                for run in runs:
                    sat = run.res.phases["saturate"]
                    multi[run.proxy.label] = sat.med("fps")
                    multi_cpu[run.proxy.label] = 100 * sat.med("proxy_cpu_s") / sat.med("seconds")
                    extra[run.proxy.label] = run.res
            if args.hold and "wslb" in names:
                hold = run_hold(backends, worker_pids, args, root)
        except KeyboardInterrupt:
            log("interrupted")
            return 130
    print_report(info, results, extra, multi, multi_cpu, hold, args)
    if args.plot:
        plot(results, multi, Path(args.plot))
        log(f"plot written to {args.plot}")
    if args.json:
        out = {
            "machine": info,
            "command": sys.argv,
            "results": {k: asdict(v) for k, v in results.items()},
            "multi_fps": multi,
            "multi": {k: asdict(v) for k, v in extra.items()},
            "hold": asdict(hold[0]) | {"kb_per_session": hold[1]} if hold else None,
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
