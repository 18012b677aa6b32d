"""The token-stream load of ``token_stream.py`` (and of the benchmarks built on it): reference
workers that stream paced tokens, load-generator processes of aiohttp clients that keep every
session streaming and count frames without decoding them, the proxy under test as a ``Target``,
and a measured ``Window`` between two samples of all of them.

A load generator is this module run as a script (``client_command``); it talks to its parent
one line at a time on stdin and stdout (``_client``).
"""

from __future__ import annotations

import abc
import array
import asyncio
import contextlib
import json
import math
import os
import secrets
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from bench.lib.cpu import cpu_seconds, rss_bytes
from bench.lib.launch import Procs, Worker, Wslb
from bench.lib.stats import hist_pct

__all__ = [
    "GAP_BIN_S",
    "ClientProc",
    "FrameCounts",
    "Sample",
    "Target",
    "Window",
    "WslbTarget",
    "client_command",
    "client_main",
    "make_window",
    "spawn_client",
    "start_clients",
    "start_workers",
    "take_sample",
]

GAP_BIN_S = 1e-4  # inter-token gaps are histogrammed in 0.1 ms bins


@dataclass(frozen=True)
class FrameCounts:
    """Frames a proxy forwarded, from its own counters."""

    to_client: int
    to_worker: int

    @property
    def total(self) -> int:
        return self.to_client + self.to_worker


class Target(abc.ABC):
    """A proxy under test: a process to measure (with its children) and a URL clients dial.

    To benchmark another proxy (nginx, HAProxy), subclass this, start it in ``start`` through
    ``procs`` (so it is cleaned up) with the given worker URLs as its upstreams, route by the
    ``session`` query parameter if it can, and add the class to ``TARGETS``. A proxy without
    frame counters returns None from ``frames``; the clients' counts are used instead.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        """Start the proxy in front of ``backends`` (``ws://`` URLs) and wait until it is ready."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """``ws://`` URL the clients connect to (``?session=ID`` is appended)."""

    @property
    @abc.abstractmethod
    def pid(self) -> int:
        """The process whose CPU and RSS (with its descendants') are measured."""

    def frames(self) -> FrameCounts | None:
        """Frames forwarded so far, per the proxy itself; None if it does not count them."""
        return None

    def problems(self) -> list[str]:
        """Warnings or errors the proxy logged during the run."""
        return []


class WslbTarget(Target):
    """wslb (``python -m balancer``), one pool with consistent hashing over the workers."""

    name = "wslb"

    def __init__(self) -> None:
        self.port = 0
        self.admin_port = 0
        self.admin_token = secrets.token_urlsafe(32)
        self._wslb: Wslb | None = None

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        config = {
            "pools": [
                {
                    "name": "chat",
                    "balance": "consistent",
                    "backends": [{"id": f"w{i + 1}", "url": u} for i, u in enumerate(backends)],
                }
            ],
            "timeouts": {"ping_interval": "20s"},
        }
        self._wslb = wslb = Wslb(
            config,
            procs.logdir,
            procs=procs,
            name="wslb",
            token=self.admin_token,
            args=["--log-level", "warning"],
            term_timeout=10.0,
        )
        self.port, self.admin_port = wslb.port, wslb.admin_port
        try:
            wslb.start(wait_ready=False, timeout=20.0)
            wslb.wait_ready(20.0)
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise RuntimeError(f"wslb did not start: {exc}\n{procs.log_tail('wslb')}") from None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        assert self._wslb is not None
        return self._wslb.pid

    def frames(self) -> FrameCounts:
        assert self._wslb is not None
        counts = {"worker_to_client": 0.0, "client_to_worker": 0.0}
        for line in self._wslb.admin("/metrics").splitlines():
            if line.startswith("wslb_frames_total{"):
                labels, value = line.rsplit(" ", 1)
                for direction in counts:
                    if f'direction="{direction}"' in labels:
                        counts[direction] = float(value)
        return FrameCounts(int(counts["worker_to_client"]), int(counts["client_to_worker"]))

    def problems(self) -> list[str]:
        if self._wslb is None:
            return []
        text = self._wslb.log_tail(lines=10_000)
        keys = ("WARNING", "ERROR", "CRITICAL", "Traceback")
        return [line for line in text.splitlines() if any(k in line for k in keys)]


def start_workers(procs: Procs, n: int, tokens_per_s: float) -> tuple[list[int], list[str]]:
    """Start ``n`` reference workers; return their pids and ``ws://`` URLs."""
    started: list[Worker] = []
    for i in range(n):
        args = [
            "--tokens-per-s", repr(float(tokens_per_s)),
            "--max-batch", "1000000",  # never slow a stream down for batch size
            "--prefill-ms-per-token", "0",  # re-prompts start decoding at once
            "--kv-capacity-tokens", str(10**9),  # no eviction work
            "--log-level", "warning",
        ]  # fmt: skip
        # No credential: nginx, HAProxy and the bare relay in front of them cannot show one.
        none = {"WSLB_WORKER_TOKEN": ""}
        started.append(Worker(f"w{i + 1}", args, procs=procs, extra_env=none).start(wait=False))
    for w in started:
        try:
            w.wait(20.0)
        except (RuntimeError, TimeoutError) as exc:
            tail = procs.log_tail(w.name)
            raise RuntimeError(f"worker {w.id} did not start: {exc}\n{tail}") from None
    return [w.pid for w in started], [w.url for w in started]


class _ClientStats:
    __slots__ = ("bad", "closed", "errors", "failed", "gaps", "open", "recv", "sent", "stopping")

    def __init__(self) -> None:
        self.recv = 0  # data frames received
        self.sent = 0  # data frames sent (prompts)
        self.open = 0
        self.failed = 0  # sessions that could not connect
        self.closed = 0  # sessions that ended while the benchmark ran
        self.bad = 0  # unexpected messages: a frame lost, duplicated or out of place
        self.errors: list[str] = []
        self.gaps = array.array("d")  # inter-token gaps (s) since the last snapshot
        self.stopping = False

    def note(self, what: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(what)

    def snapshot(self) -> dict[str, Any]:
        gaps = self.gaps
        hist = Counter(int(g / GAP_BIN_S) for g in gaps)
        snap = {
            "recv": self.recv,
            "sent": self.sent,
            "open": self.open,
            "failed": self.failed,
            "closed": self.closed,
            "bad": self.bad,
            "errors": self.errors,
            "gap_hist": {str(k): v for k, v in hist.items()},
            "gap_max": max(gaps) if gaps else 0.0,
        }
        del gaps[:]  # in place: the sessions hold its bound append
        return snap


async def _client(spec: dict[str, Any]) -> None:
    """Open ``spec["sessions"]`` sessions to ``spec["url"]`` and keep them streaming.

    Protocol with the parent over stdin/stdout, one line each: prints ``ready {...}`` once every
    session has connected (or failed); answers each ``snap`` line with the counters as JSON;
    exits at end of input.
    """
    import aiohttp  # only the client processes need it

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    url: str = spec["url"]
    n: int = spec["sessions"]
    max_tokens: int = spec["max_tokens"]
    jitter: bool = spec["jitter"]
    ramp: float = spec["ramp_s"]
    prefix: str = spec["prefix"]
    prompt = json.dumps(
        {
            "type": "prompt",
            "messages": [{"role": "user", "content": "benchmark"}],  # replaces the context
            "max_tokens": max_tokens,
        },
        separators=(",", ":"),
    )
    st = _ClientStats()
    settled = asyncio.Event()
    sem = asyncio.Semaphore(64)
    text = aiohttp.WSMsgType.TEXT
    ws_timeout = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=1.0)

    def settle() -> None:
        if st.open + st.failed + st.closed >= n:
            settled.set()

    async def session(http: aiohttp.ClientSession, i: int) -> None:
        # Even start times over the ramp: streams get spread phases, as real ones would.
        await asyncio.sleep(ramp * i / n)
        try:
            async with sem:
                ws = await http.ws_connect(
                    url,
                    params={"session": f"{prefix}-{i}"},
                    autoping=True,
                    compress=0,
                    max_msg_size=0,
                    decode_text=False,  # bytes: no UTF-8 decoding per frame
                    timeout=ws_timeout,
                )
                hello = await asyncio.wait_for(ws.receive(), 10)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            st.failed += 1
            st.note(f"connect: {exc!r}")
            settle()
            return
        if hello.type is not text or not hello.data.startswith(b'{"type":"hello"'):
            st.bad += 1
            st.note(f"first message: {hello!r}"[:200])
        st.open += 1
        settle()
        receive, send = ws.receive, ws.send_str
        clock, record = loop.time, st.gaps.append
        try:
            await send(prompt)
            await send(prompt)  # one always queued behind the current answer: no pause
            st.sent += 2
            count, last = 0, 0.0
            while True:
                msg = await receive()
                if msg.type is not text:
                    if not st.stopping:
                        st.note(f"session {i} ended: {msg.type!r} {msg.data!r} {msg.extra!r}")
                    break
                st.recv += 1
                count += 1
                if count > max_tokens:  # must be the answer's done
                    if not msg.data.startswith(b'{"type":"done"'):
                        st.bad += 1
                        st.note(f"session {i}: expected done, got {msg.data[:80]!r}")
                    count, last = 0, 0.0  # the next gap includes a prefill: not recorded
                    await send(prompt)
                    st.sent += 1
                elif jitter:
                    now = clock()
                    if last:
                        record(now - last)
                    last = now
        except (aiohttp.ClientError, OSError) as exc:
            st.note(f"session {i}: {exc!r}")
        finally:
            st.open -= 1
            if not st.stopping:
                st.closed += 1

    out = sys.stdout
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.create_task(session(http, i)) for i in range(n)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled.wait(), ramp + 60)
        out.write("ready " + json.dumps({"open": st.open, "failed": st.failed}) + "\n")
        out.flush()
        while line := await stdin.readline():
            if line.strip() == b"snap":
                out.write(json.dumps(st.snapshot()) + "\n")
                out.flush()
        st.stopping = True
        for t in tasks:
            t.cancel()
    os._exit(0)  # skip closing hundreds of WebSockets one by one


def client_main(spec_json: str) -> int:
    import uvloop

    uvloop.run(_client(json.loads(spec_json)))
    return 0


class ClientProc:
    """The parent's handle on one client process: line protocol with timeouts."""

    def __init__(self, proc: subprocess.Popen[bytes], sessions: int) -> None:
        self.proc = proc
        self.sessions = sessions
        self._buf = b""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"client {self.proc.pid} did not answer in {timeout:g}s")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"client {self.proc.pid} exited ({self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()


def client_command(spec: dict[str, Any]) -> list[str]:
    """One load-generator process: this module run with ``spec`` (its cwd the repository root,
    as ``Procs`` starts children)."""
    return [sys.executable, "-m", "bench.lib.load", json.dumps(spec)]


def spawn_client(procs: Procs, name: str, spec: dict[str, Any]) -> ClientProc:
    """Start one load-generator process for ``spec`` (``_client``'s), its stderr in
    ``NAME.log``; killed at once when ``procs`` closes."""
    proc = procs.spawn(name, client_command(spec), pipes=True, term_timeout=0)
    return ClientProc(proc, spec["sessions"])


def start_clients(
    procs: Procs, url: str, sessions: int, n: int, max_tokens: int, jitter: bool, ramp: float
) -> list[ClientProc]:
    clients = []
    for c in range(n):
        share = sessions // n + (1 if c < sessions % n else 0)
        if share == 0:
            continue
        spec = {
            "url": url,
            "sessions": share,
            "prefix": f"bench-c{c}",
            "max_tokens": max_tokens,
            "jitter": jitter,
            "ramp_s": ramp,
        }
        clients.append(spawn_client(procs, f"client-{c}", spec))
    return clients


@dataclass
class Sample:
    t: float
    cpu: dict[str, float]
    proxy: FrameCounts | None
    clients: list[dict[str, Any]]

    def client_sum(self, key: str) -> int:
        return sum(int(c[key]) for c in self.clients)


@dataclass
class Window:
    """One measured window."""

    seconds: float
    frames: int
    """Frames forwarded, both directions (the proxy's counters, else the clients')."""
    frames_source: str
    proxy_to_client: int | None
    client_received: int
    client_sent: int
    cpu_s: dict[str, float]
    """CPU seconds by role: target, workers, clients."""
    target_rss_mb: float
    gap_ms: dict[str, float] | None
    """Client-observed inter-token gap percentiles (stream mode)."""

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.seconds

    @property
    def us_per_frame(self) -> float:
        return self.cpu_s["target"] * 1e6 / self.frames if self.frames else math.nan

    def cpu_pct(self, role: str) -> float:
        return 100.0 * self.cpu_s[role] / self.seconds

    def role_us_per_frame(self, role: str) -> float:
        return self.cpu_s[role] * 1e6 / self.frames if self.frames else math.nan


def take_sample(target: Target, clients: list[ClientProc], pids: dict[str, list[int]]) -> Sample:
    """Proxy counters, client counters, then CPU: the same order at both ends of a window."""
    proxy = target.frames()
    for c in clients:
        c.send("snap")
    snaps = [json.loads(c.readline(30)) for c in clients]
    cpu = {role: cpu_seconds(p) for role, p in pids.items()}
    return Sample(time.monotonic(), cpu, proxy, snaps)


def gap_percentiles(snaps: list[dict[str, Any]]) -> dict[str, float] | None:
    """The clients' inter-token gaps of a window (their histograms merged), in ms."""
    hist: Counter[int] = Counter()
    for s in snaps:
        hist.update({int(k): v for k, v in s["gap_hist"].items()})
    n = sum(hist.values())
    if n == 0:
        return None
    out: dict[str, float] = {"n": float(n)}
    for q in (50, 99):
        out[f"p{q}"] = hist_pct(hist, q) * GAP_BIN_S * 1e3
    out["max"] = max(float(s["gap_max"]) for s in snaps) * 1e3
    return out


def make_window(a: Sample, b: Sample, target: Target) -> Window:
    recv = b.client_sum("recv") - a.client_sum("recv")
    sent = b.client_sum("sent") - a.client_sum("sent")
    if a.proxy is not None and b.proxy is not None:
        frames, source = b.proxy.total - a.proxy.total, target.name
        to_client: int | None = b.proxy.to_client - a.proxy.to_client
    else:
        frames, source, to_client = recv + sent, "clients", None
    return Window(
        seconds=b.t - a.t,
        frames=frames,
        frames_source=source,
        proxy_to_client=to_client,
        client_received=recv,
        client_sent=sent,
        cpu_s={role: b.cpu[role] - a.cpu[role] for role in b.cpu},
        target_rss_mb=rss_bytes([target.pid]) / 2**20,
        gap_ms=gap_percentiles(b.clients),
    )


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1]))
