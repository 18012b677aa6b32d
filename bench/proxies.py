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

``--tls``: every proxy terminates TLS on its client listener with the same certificate
(``--tls-key`` ecdsa, P-256, or rsa; trustme), the workers stay plain, the clients speak
Python's ``ssl``. Idle, stream and saturation run over TLS; then the **handshake** phase
(``--hs-connects`` whole connections per window from ``--hs-procs`` x ``--hs-threads`` blocking
clients: CPU of the proxy per connection, ``plain`` on a second plain listener of the same
proxy, ``full`` TLS handshakes and ``resumed`` ones) and the **burst** (``--burst`` TLS connects
at once from ``--burst-procs`` processes: how many got 101, were reset, timed out). No
multi-core rows or hold with ``--tls``. ``--wslb-variant NAME=PATH`` runs another wslb source
tree beside (a patched copy), ``--skip`` leaves phases out, ``--perf DIR`` / ``--py-spy DIR``
profile the first window of each phase.

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
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.cpu import cpu_seconds, cpu_split, rss_bytes, tree  # noqa: E402
from bench.lib.launch import Procs, free_port, wait_port  # noqa: E402
from bench.lib.load import ClientProc  # noqa: E402
from bench.lib.machine import command_output, loadavg, lscpu, machine, machine_line, source_state  # noqa: E402
from bench.lib.proxies import (  # noqa: E402
    TARGETS,
    WSLB_SRC,
    Direct,
    Proxy,
    Wslb,
    ensure_installed,
    host_ports,
    nofile,
    outcome,
    wslb_variant,
)
from bench.lib.rawws import (  # noqa: E402
    IP_BIND_ADDRESS_NO_PORT,
    SNI,
    ClientConn,
    ClientStats,
    TlsFiles,
    WorkerConn,
    client_context,
    client_frame,
    dial,
    make_tls,
    open_session,
    run_uvloop,
    serve_parent,
    upgrade_request,
)
from bench.lib.script import log, raise_nofile, require_modules, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import hist_pct  # noqa: E402

# -- raw worker (its own process): the same backend for every proxy ---------------------------


async def _worker(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(WorkerConn, "127.0.0.1", spec["port"], backlog=4096)
    async with server:
        await server.serve_forever()


# -- raw client (its own process): opens sessions on command, counts frames and latency --------


async def _client(spec: dict[str, Any]) -> None:
    """``serve_parent`` for this benchmark: ``open`` answers ``ready {...}``. Group 1, when
    there is one, is the direct control group for latency. With ``tls`` (the CA file), group 0
    speaks TLS; the direct group stays plain (the workers are)."""
    groups: list[list[tuple[str, int, str]]] = [[tuple(t) for t in g] for g in spec["groups"]]
    n_src: int = spec["sources"]
    tls = client_context(spec["tls"]) if spec.get("tls") else None
    stats = [ClientStats() for _ in groups]
    keep: list[ClientConn] = []
    sem = asyncio.Semaphore(spec["concurrency"])
    counter = 0

    async def open_one(i: int, rate: float | None, group: int) -> None:
        st = stats[group]
        host, port, path = groups[group][i % len(groups[group])]
        src = f"127.0.0.{2 + i % n_src}" if n_src else "127.0.0.1"
        request = upgrade_request(host, port, f"{path}?session=bench-{spec['prefix']}-{i}")
        factory = lambda: ClientConn(st, request, rate)  # noqa: E731
        ctx = tls if group == 0 else None
        await open_session(keep, st, sem, i, src, (host, port), factory, tls=ctx)

    async def open_batch(n: int, rate: float | None, group: int) -> str:
        nonlocal counter
        failed0 = stats[group].failed
        await asyncio.gather(*(open_one(counter + i, rate, group) for i in range(n)))
        counter += n
        ready = {"open": stats[group].open, "failed": stats[group].failed - failed0}
        return "ready " + json.dumps(ready)

    await serve_parent(stats, keep, open_batch)


def _read_head(s: socket.socket) -> bytes:
    """A response head read from a blocking socket (what follows it is dropped)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {buf[:60]!r}")
        buf += chunk
    return buf.split(b"\r\n\r\n", 1)[0]


CLOSE_1000 = client_frame(0x8, (1000).to_bytes(2, "big"))


def _handshakes(spec: dict[str, Any]) -> int:
    """The handshake phase's client: ``threads`` threads connect one after another until
    ``n`` connects in all were made to ``target``. Each connect is a whole connection's life:
    TCP connect, TLS handshake (``mode`` ``full``: a new session; ``resumed``: the session of
    the thread's previous connection, a ticket; ``plain``: none), upgrade, 101, a close frame,
    then read until the proxy closes. Prints one JSON line: counts, connect-to-101 times, the
    TLS version and cipher. Blocking sockets, as asyncio's TLS cannot resume a session."""
    host, port, path = spec["target"]
    mode: str = spec["mode"]
    n, n_src, timeout = int(spec["n"]), int(spec["sources"]), float(spec["timeout"])
    ctx = client_context(spec["ca"]) if mode != "plain" else None
    counter = itertools.count()  # next() is atomic under the GIL
    lock = threading.Lock()
    out: dict[str, Any] = {"ok": 0, "failed": 0, "resumed": 0, "close_errors": 0}
    out |= {"outcomes": {}, "errors": [], "tls": "", "lat_ms": []}

    def one(i: int, session: ssl.SSLSession | None) -> ssl.SSLSession | None:
        src = f"127.0.0.{2 + i % n_src}" if n_src else "127.0.0.1"
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s: socket.socket = raw
        t0 = time.perf_counter()
        try:
            raw.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            raw.bind((src, 0))
            raw.settimeout(timeout)
            raw.connect((host, port))
            if ctx is not None:
                reuse = session if mode == "resumed" else None
                s = ctx.wrap_socket(raw, server_hostname=SNI, session=reuse)
            s.sendall(upgrade_request(host, port, f"{path}?session=hs-{spec['prefix']}-{i}"))
            head = _read_head(s)
            if not head.startswith(b"HTTP/1.1 101"):
                raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
            ms = (time.perf_counter() - t0) * 1000
            new = None
            if isinstance(s, ssl.SSLSocket):
                new = s.session
                with lock:
                    out["resumed"] += s.session_reused
                    out["tls"] = out["tls"] or f"{s.version()} {(s.cipher() or ('?',))[0]}"
            with lock:
                out["ok"] += 1
                out["lat_ms"].append(round(ms, 3))
            try:
                s.sendall(CLOSE_1000)
                while s.recv(4096):
                    pass
            except OSError:
                with lock:
                    out["close_errors"] += 1
            return new
        except (OSError, ConnectionError) as exc:
            with lock:
                out["failed"] += 1
                kind = outcome(exc)
                out["outcomes"][kind] = out["outcomes"].get(kind, 0) + 1
                if len(out["errors"]) < 5:
                    out["errors"].append(f"{i}: {exc!r}")
            return None
        finally:
            s.close()
            raw.close()

    def loop() -> None:
        session: ssl.SSLSession | None = None
        while (i := next(counter)) < n:
            session = one(i, session) or session

    sys.stdout.write("ready\n")  # then waits for the parent's go (its CPU reading first)
    sys.stdout.flush()
    sys.stdin.readline()
    t0 = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(int(spec["threads"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = time.monotonic() - t0
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


async def _burst(spec: dict[str, Any]) -> None:
    """The burst's client: at its parent's ``go`` (sent to every client process at once) it
    dials ``n`` TLS sessions at once, waits for each one's 101 or failure, prints what became
    of them as one JSON line, then holds the sessions until its parent closes stdin."""
    loop = asyncio.get_running_loop()
    host, port, path = spec["target"]
    n, n_src, timeout = int(spec["n"]), int(spec["sources"]), float(spec["timeout"])
    tls = client_context(spec["ca"]) if spec.get("ca") else None
    st = ClientStats()
    keep: list[ClientConn] = []
    outcomes: dict[str, int] = {}
    errors: list[str] = []
    lat: list[float] = []

    async def one(i: int) -> None:
        src = f"127.0.0.{2 + i % n_src}" if n_src else "127.0.0.1"
        request = upgrade_request(host, port, f"{path}?session=burst-{spec['prefix']}-{i}")
        t0 = time.monotonic()
        try:
            proto = await dial(
                loop,
                src,
                (host, port),
                lambda: ClientConn(st, request, None),
                (timeout, timeout),
                tls,
            )
        except (OSError, TimeoutError, ConnectionError) as exc:
            kind = outcome(exc)
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if len(errors) < 5:
                errors.append(f"{i}: {exc!r}")
            return
        outcomes["101"] = outcomes.get("101", 0) + 1
        lat.append(round((time.monotonic() - t0) * 1000, 3))
        keep.append(proto)

    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await stdin.readline()
    await asyncio.gather(*(one(i) for i in range(n)))
    sys.stdout.write(json.dumps({"outcomes": outcomes, "errors": errors, "lat_ms": lat}) + "\n")
    sys.stdout.flush()
    await stdin.read()
    os._exit(0)


# -- measurement -------------------------------------------------------------------------------


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
    lost: int = 0  # sessions that ended during a window (the most of any window)

    def med(self, attr: str) -> float:
        vals = [getattr(w, attr) for w in self.windows]
        vals = [v for v in vals if not math.isnan(v)]
        return statistics.median(vals) if vals else math.nan

    def spread(self, attr: str) -> tuple[float, float]:
        vals = [getattr(w, attr) for w in self.windows if not math.isnan(getattr(w, attr))]
        return (min(vals), max(vals)) if vals else (math.nan, math.nan)


@dataclass
class HsWindow:
    """One window of the handshake phase (``--tls``): ``connects`` whole connections."""

    mode: str  # plain, full (TLS, a new session each time) or resumed (TLS, a ticket)
    connects: int
    ok: int
    failed: int
    resumed: int
    seconds: float
    proxy_cpu_s: float
    proxy_sys_s: float
    idle_cpu_s: float  # what the proxy uses idle in as long (health checks): subtracted
    lat_p50_ms: float
    lat_p99_ms: float
    tls: str = ""
    close_errors: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def us_per_connect(self) -> float:
        return (self.proxy_cpu_s - self.idle_cpu_s) * 1e6 / self.ok if self.ok else math.nan

    @property
    def sys_us_per_connect(self) -> float:
        return self.proxy_sys_s * 1e6 / self.ok if self.ok else math.nan


@dataclass
class Burst:
    """One burst (``--tls``): ``n`` TLS connects at once from ``procs`` client processes."""

    n: int
    procs: int
    outcomes: dict[str, int]
    lat_p50_ms: float
    lat_max_ms: float
    proxy_cpu_s: float
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        o = self.outcomes
        rest = {k: v for k, v in o.items() if k not in ("101", "reset", "timeout")}
        more = "".join(f" / {v} {k}" for k, v in sorted(rest.items()))
        return (
            f"{o.get('101', 0)}/{self.n} 101, {o.get('reset', 0)} reset, "
            f"{o.get('timeout', 0)} timed out{more}"
        )


@dataclass
class Result:
    label: str
    idle_kb: float = math.nan
    idle_steps_kb: list[float] = field(default_factory=list)
    phases: dict[str, Phase] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    handshakes: list[HsWindow] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)

    def hs(self, mode: str, attr: str) -> float:
        vals = [getattr(w, attr) for w in self.handshakes if w.mode == mode]
        vals = [v for v in vals if not math.isnan(v)]
        return statistics.median(vals) if vals else math.nan


class Load:
    """One client process and the proxy/worker pids it is measured against."""

    def __init__(
        self,
        procs: Procs,
        name: str,
        groups: list[list[tuple[str, int, str]]],
        pids: dict[str, list[int]],
        sources: int,
        tls: Path | None = None,
    ) -> None:
        spec = {"groups": groups, "sources": sources, "concurrency": 200, "prefix": name}
        if tls is not None:
            spec["tls"] = str(tls)  # group 0 over TLS, trusting this CA
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
            lat_p50_us=hist_pct(hist, 50),
            lat_p99_us=hist_pct(hist, 99),
            ctl_n=sum(ctl.values()),
            ctl_p50_us=hist_pct(ctl, 50),
            ctl_p99_us=hist_pct(ctl, 99),
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
    phase.lost = max(phase.lost, s0[0]["closed"])
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
        self,
        args: argparse.Namespace,
        backends: list[str],
        worker_pids: list[int],
        root: Path,
        tls: TlsFiles | None = None,
    ) -> None:
        self.args = args
        self.backends = backends
        self.hp = host_ports(backends)
        self.worker_pids = worker_pids
        self.root = root
        self.tls = tls
        self._idle: dict[str, float] = {}

    @staticmethod
    def ca(proxy: Proxy) -> Path | None:
        """The CA file the clients trust when ``proxy`` speaks TLS to them, else None."""
        return proxy.tls.ca if proxy.tls is not None else None

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
            run.procs,
            "idle",
            [run.proxy.addresses(self.hp)],
            self.pids(run),
            self.args.sources,
            self.ca(run.proxy),
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
        load = Load(run.procs, tag, groups, self.pids(run), args.sources, self.ca(proxy))
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
        with self.profiled(run, name, not phase.windows):
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

    @contextlib.contextmanager
    def profiled(self, run: Running, phase: str, first: bool) -> Iterator[None]:
        """Profiles over the first window of a phase. ``--py-spy DIR``: ``py-spy record
        --native`` of a wslb process to DIR/LABEL-PHASE.txt (collapsed stacks, wall clock;
        ``profile_summary``); py-spy stops the process to sample it, so that window's CPU
        figures are not clean. ``--perf DIR``: ``perf record`` (on-CPU samples, every proxy,
        all its processes) to DIR/LABEL-PHASE.perf (``perf_summary``)."""
        if not first or (self.args.py_spy is None and self.args.perf is None):
            yield
            return
        label = run.proxy.label.replace(" ", "")
        spies: list[tuple[subprocess.Popen[bytes], Path]] = []
        if self.args.py_spy is not None and isinstance(run.proxy, Wslb):
            path = Path(self.args.py_spy) / f"{label}-{phase}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            cmd = ["py-spy", "record", "--native", "--rate", "250", "--format", "raw"]
            cmd += ["-o", str(path), "--pid", str(run.proxy.pid)]
            spies.append((run.procs.spawn(f"py-spy-{phase}", cmd, term_timeout=30), path))
        if self.args.perf is not None and run.proxy.pids():
            path = Path(self.args.perf) / f"{label}-{phase}.perf"
            path.parent.mkdir(parents=True, exist_ok=True)
            pids = ",".join(str(p.pid) for pid in run.proxy.pids() for p in tree(pid))
            cmd = ["perf", "record", "-q", "-F", "999", "-o", str(path), "-p", pids]
            spies.append((run.procs.spawn(f"perf-{phase}", cmd, term_timeout=30), path))
        time.sleep(1.0)  # attached
        try:
            yield
        finally:
            for proc, path in spies:
                proc.send_signal(signal.SIGINT)  # both write what they have on SIGINT
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
                run.res.warnings.append(f"profiled over the first {phase} window: {path}")

    def _clients(
        self, run: Running, tag: str, flag: str, specs: list[dict[str, Any]], timeout: float
    ) -> tuple[list[ClientProc], float, tuple[float, float]]:
        """Client processes (``flag``: --hs-spec or --burst-spec), each told ``go`` once all are
        ready: the handles, and the time and the proxy's CPU (user, system) at the go."""
        clients = []
        for c, spec in enumerate(specs):
            cmd = [sys.executable, str(Path(__file__).resolve()), flag, json.dumps(spec)]
            proc = run.procs.spawn(f"{tag}-{c}", cmd, pipes=True, term_timeout=0)
            clients.append(ClientProc(proc, 0))
        for client in clients:
            if (line := client.readline(timeout)) != "ready":
                raise RuntimeError(f"{tag} client said {line!r}")
        t0, cpu0 = time.monotonic(), cpu_split(run.proxy.pids())
        for client in clients:
            client.send("go")
        return clients, t0, cpu0

    def idle_rate(self, run: Running) -> float:
        """The proxy's CPU s per s while idle (health checks, scrapes), measured once."""
        if run.proxy.label not in self._idle:
            pids = run.proxy.pids()
            c0, t0 = cpu_seconds(pids), time.monotonic()
            time.sleep(3.0)
            self._idle[run.proxy.label] = (cpu_seconds(pids) - c0) / (time.monotonic() - t0)
        return self._idle[run.proxy.label]

    def handshake_window(self, run: Running, mode: str) -> None:
        """``--hs-connects`` whole connections from ``--hs-procs`` processes of
        ``--hs-threads`` threads each (``_handshakes``): the proxy's CPU per connection."""
        args, proxy = self.args, run.proxy
        assert proxy.tls is not None
        port = proxy.plain_port if mode == "plain" else proxy.port
        n, k = args.hs_connects, args.hs_procs
        specs = [
            {
                "target": ["127.0.0.1", port, "/ws"],
                "mode": mode,
                "n": n // k + (1 if c < n % k else 0),
                "threads": args.hs_threads,
                "sources": args.sources,
                "timeout": 15.0,
                "ca": str(proxy.tls.ca),
                "prefix": f"{mode}{len(run.res.handshakes)}-{c}",
            }
            for c in range(k)
        ]
        tag = f"hs-{mode}{len(run.res.handshakes)}"
        idle = self.idle_rate(run)
        first = not any(w.mode == mode for w in run.res.handshakes)
        with self.profiled(run, f"handshake-{mode}", first):
            clients, t0, (u0, s0) = self._clients(run, tag, "--hs-spec", specs, 30.0)
            outs = [json.loads(c.readline(60 + n / 20)) for c in clients]
            t1, (u1, s1) = time.monotonic(), cpu_split(proxy.pids())
        lat = sorted(x for o in outs for x in o["lat_ms"])
        outcomes: dict[str, int] = {}
        for o in outs:
            for key, v in o["outcomes"].items():
                outcomes[key] = outcomes.get(key, 0) + v
        w = HsWindow(
            mode=mode,
            connects=n,
            ok=sum(o["ok"] for o in outs),
            failed=sum(o["failed"] for o in outs),
            resumed=sum(o["resumed"] for o in outs),
            seconds=t1 - t0,
            proxy_cpu_s=(u1 + s1) - (u0 + s0),
            proxy_sys_s=s1 - s0,
            idle_cpu_s=idle * (t1 - t0),
            lat_p50_ms=lat[len(lat) // 2] if lat else math.nan,
            lat_p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else math.nan,
            tls=next((o["tls"] for o in outs if o["tls"]), ""),
            close_errors=sum(o["close_errors"] for o in outs),
            outcomes=outcomes,
            errors=[e for o in outs for e in o["errors"]][:5],
        )
        run.res.handshakes.append(w)
        log(
            f"    {w.ok}/{n} upgraded ({w.resumed} resumed) in {w.seconds:.1f}s, "
            f"{w.us_per_connect:.0f} us CPU per connection (kernel {w.sys_us_per_connect:.0f}), "
            f"connect to 101 p50/p99 {w.lat_p50_ms:.2f}/{w.lat_p99_ms:.2f} ms"
            + (f"; {w.tls}" if w.tls else "")
            + (f"; failed {outcomes}: {w.errors[:2]}" if w.failed else "")
        )
        for c in clients:
            c.proc.wait(10)

    def burst(self, run: Running) -> None:
        """``--burst`` TLS connects at once from ``--burst-procs`` processes (``_burst``)."""
        args, proxy = self.args, run.proxy
        assert proxy.tls is not None
        n, k = args.burst, args.burst_procs
        specs = [
            {
                "target": ["127.0.0.1", proxy.port, "/ws"],
                "n": n // k + (1 if c < n % k else 0),
                "sources": args.sources,
                "timeout": args.burst_timeout,
                "ca": str(proxy.tls.ca),
                "prefix": f"{len(run.res.bursts)}-{c}",
            }
            for c in range(k)
        ]
        tag = f"burst{len(run.res.bursts)}"
        clients, _, (u0, s0) = self._clients(run, tag, "--burst-spec", specs, 30.0)
        outs = [json.loads(c.readline(30 + 3 * args.burst_timeout)) for c in clients]
        u1, s1 = cpu_split(proxy.pids())
        outcomes: dict[str, int] = {}
        for o in outs:
            for key, v in o["outcomes"].items():
                outcomes[key] = outcomes.get(key, 0) + v
        lat = sorted(x for o in outs for x in o["lat_ms"])
        b = Burst(
            n=n,
            procs=k,
            outcomes=outcomes,
            lat_p50_ms=lat[len(lat) // 2] if lat else math.nan,
            lat_max_ms=lat[-1] if lat else math.nan,
            proxy_cpu_s=(u1 + s1) - (u0 + s0),
            errors=[e for o in outs for e in o["errors"]][:6],
        )
        run.res.bursts.append(b)
        log(
            f"    {b.summary()}; connect to 101 p50 {b.lat_p50_ms:.0f} ms, max "
            f"{b.lat_max_ms:.0f} ms" + (f"; {b.errors[:3]}" if b.errors else "")
        )
        for c in clients:  # end of input ends the process, and its sessions with it
            if c.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    c.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(10)
        time.sleep(1.0)

    def tls_phases(self, runs: list[Running]) -> None:
        """--tls: the handshake windows (plain, full, resumed; ``--repeat`` rounds each, the
        order rotated), then ``--repeat`` bursts per proxy, rotated too."""
        tls_runs = [run for run in runs if run.proxy.tls is not None]
        if not tls_runs:
            return
        modes = ("plain", "full", "resumed") if "handshake" not in self.args.skip else ()
        for mode in modes:
            for r in range(self.args.repeat):
                k = r % len(tls_runs)
                for run in tls_runs[k:] + tls_runs[:k]:
                    log(f"[handshake {mode} {r + 1}/{self.args.repeat}] {run.proxy.label}")
                    self.handshake_window(run, mode)
        if self.args.burst and "burst" not in self.args.skip:
            for r in range(self.args.repeat):
                k = r % len(tls_runs)
                for run in tls_runs[k:] + tls_runs[:k]:
                    log(f"[burst {r + 1}/{self.args.repeat}] {run.proxy.label}")
                    self.burst(run)

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
            [proxy.addresses(host_ports(backends)), Direct().addresses(host_ports(backends))],
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
        if all(math.isnan(vals.get(k, math.nan)) for k in labels):
            continue  # a phase not run (--skip)
        fmt = ",.0f" if "frames" in metric else ".1f" if "latency" in metric else ".2f"
        cells = [_f(vals.get(k, math.nan), fmt) for k in labels]
        w = vals.get("wslb", math.nan)
        cells += [_ratio(w, vals.get("nginx", math.nan)), _ratio(w, vals.get("haproxy", math.nan))]
        out.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def _tls_labels(results: dict[str, Result]) -> list[str]:
    labels = [k for k in ("nginx", "haproxy", "wslb-loop", "wslb") if k in results]
    return labels + [k for k in results if k not in labels and k != "direct"]


def tls_rows(results: dict[str, Result]) -> list[tuple[str, dict[str, float]]]:
    """(metric, label -> value) for --tls: the stream over TLS, the handshake phase's CPU per
    connection in its three modes, and what TLS adds to the plain upgrade."""

    def col(fn: Callable[[Result], float]) -> dict[str, float]:
        return {k: fn(r) for k, r in results.items() if k != "direct"}

    def ph(r: Result, name: str, attr: str) -> float:
        return r.phases[name].med(attr) if name in r.phases else math.nan

    def whole(r: Result) -> float:
        p = r.phases.get("stream")
        return float(p.opened - p.lost) if p is not None else math.nan

    def resumed_share(r: Result) -> float:
        ws = [w for w in r.handshakes if w.mode == "resumed" and w.ok]
        return 100 * sum(w.resumed for w in ws) / sum(w.ok for w in ws) if ws else math.nan

    return [
        ("sessions whole, stream", col(whole)),
        ("cpu us/frame, stream", col(lambda r: ph(r, "stream", "us_per_frame"))),
        ("  of which kernel (stime)", col(lambda r: ph(r, "stream", "sys_us_per_frame"))),
        ("latency p50 us (worker to client)", col(lambda r: ph(r, "stream", "lat_p50_us"))),
        ("latency p99 us", col(lambda r: ph(r, "stream", "lat_p99_us"))),
        ("added latency p50 us", col(lambda r: ph(r, "stream", "add_p50_us"))),
        ("added latency p99 us", col(lambda r: ph(r, "stream", "add_p99_us"))),
        (
            "cpu us/connection, plain (upgrade + close)",
            col(lambda r: r.hs("plain", "us_per_connect")),
        ),
        ("cpu us/connection, TLS full handshake", col(lambda r: r.hs("full", "us_per_connect"))),
        ("  of which kernel (stime)", col(lambda r: r.hs("full", "sys_us_per_connect"))),
        (
            "cpu us/connection, TLS resumed (ticket)",
            col(lambda r: r.hs("resumed", "us_per_connect")),
        ),
        (
            "TLS's share us (full - plain)",
            col(lambda r: r.hs("full", "us_per_connect") - r.hs("plain", "us_per_connect")),
        ),
        ("resumed %, resumed mode", col(resumed_share)),
        ("connect to 101 ms p50, TLS full", col(lambda r: r.hs("full", "lat_p50_ms"))),
        ("connect to 101 ms p50, plain", col(lambda r: r.hs("plain", "lat_p50_ms"))),
        ("cpu us/frame, saturation", col(lambda r: ph(r, "saturate", "us_per_frame"))),
        ("frames/s, saturation", col(lambda r: ph(r, "saturate", "fps"))),
        ("idle KB/session", col(lambda r: r.idle_kb)),
    ]


def tls_table(results: dict[str, Result]) -> str:
    """The --tls table: every proxy against nginx, and each burst's outcome."""
    labels = _tls_labels(results)
    others = [k for k in labels if k != "nginx"]
    head = ["metric (median of windows)", *labels, *(f"{k}/nginx" for k in others)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for metric, vals in tls_rows(results):
        if all(math.isnan(vals.get(k, math.nan)) for k in labels):
            continue  # a phase not run (--skip)
        fmt = ".0f" if "whole" in metric or "%" in metric else ",.0f" if "frames" in metric else ""
        fmt = fmt or (
            ".1f" if "latency" in metric or "us/conn" in metric or "share" in metric else ".2f"
        )
        cells = [_f(vals.get(k, math.nan), fmt) for k in labels]
        if "whole" in metric or "%" in metric:
            cells += ["-" for _ in others]
        else:
            cells += [_ratio(vals.get(k, math.nan), vals.get("nginx", math.nan)) for k in others]
        out.append(f"| {metric} | " + " | ".join(cells) + " |")
    n = max((b.n for r in results.values() for b in r.bursts), default=0)
    if n:
        cells = []
        for k in labels:
            bs = results[k].bursts
            cells.append(", ".join(b.summary().split(",")[0].split("/")[0] for b in bs) or "-")
        out.append(
            f"| burst: sessions upgraded of {n} at once, each burst | "
            + " | ".join(cells)
            + " | -" * len(others)
            + " |"
        )
        cells = []
        for k in labels:
            bs = results[k].bursts
            cells.append(
                ", ".join(
                    f"{b.outcomes.get('reset', 0)}/{b.outcomes.get('timeout', 0)}" for b in bs
                )
                or "-"
            )
        out.append(
            "| burst: reset/timed out, each burst | "
            + " | ".join(cells)
            + " | -" * len(others)
            + " |"
        )
        cells = []
        for k in labels:
            bs = results[k].bursts
            med = statistics.median(b.lat_max_ms for b in bs) if bs else math.nan
            cells.append(_f(med, ",.0f"))
        out.append(
            "| burst: last 101 after ms (median) | "
            + " | ".join(cells)
            + " | -" * len(others)
            + " |"
        )
    return "\n".join(out)


def tls_targets(results: dict[str, Result], sessions: int) -> list[str]:
    """Issue 22's targets for each wslb label: sessions whole, CPU per frame <= 1.1x nginx's,
    CPU per TLS handshake + upgrade <= 1.5x nginx's."""
    r = dict(tls_rows(results))
    out = []
    for k in (k for k in _tls_labels(results) if k.startswith("wslb")):
        whole = r["sessions whole, stream"].get(k, math.nan)
        if math.isnan(whole):
            out.append(f"{k}: sessions whole: not measured")
        else:
            verdict = "MET" if whole == sessions else "MISSED"
            out.append(f"{k}: sessions whole {whole:.0f}/{sessions}: {verdict}")
        bursts = results[k].bursts
        if bursts:
            ok = all(b.outcomes.get("101", 0) == b.n for b in bursts)
            worst = min(bursts, key=lambda b: b.outcomes.get("101", 0))
            out.append(
                f"{k}: burst all upgraded: {'MET' if ok else 'MISSED'} (worst: {worst.summary()})"
            )
        for name, metric, factor in (
            ("cpu/frame stream <= 1.1x nginx", "cpu us/frame, stream", 1.1),
            (
                "cpu TLS handshake + upgrade <= 1.5x nginx",
                "cpu us/connection, TLS full handshake",
                1.5,
            ),
        ):
            w, n = r[metric].get(k, math.nan), r[metric].get("nginx", math.nan)
            if math.isnan(w) or math.isnan(n) or n <= 0:
                out.append(f"{k}: {name}: not measured")
                continue
            verdict = "MET" if w <= factor * n else "MISSED"
            out.append(
                f"{k}: {name}: {w:.2f} vs limit {factor * n:.2f} (nginx {n:.2f}): {verdict} "
                f"({w / n:.2f}x nginx)"
            )
    return out


_SYSCALLS = {"write", "read", "writev", "readv", "send", "recv", "sendmsg", "recvmsg", "sendto"}
_SYSCALLS |= {"recvfrom", "connect", "accept4", "close", "shutdown", "setsockopt", "getsockopt"}
_SYSCALLS |= {"epoll_ctl", "syscall", "socket", "getpid", "getsockname", "getpeername", "ioctl"}
_ENTRY: tuple[str, ...] = ("<module> (balancer/", "main (balancer/cli.py", "_run (balancer/cli.py")
_ENTRY += ("run (balancer/aio/app.py", "run_loop (balancer/aio/app.py")


def _owner(frame: str) -> str | None:
    """Which part of the process a py-spy frame belongs to (None: the interpreter, libc's
    memory functions and the like, counted for the caller that owns them)."""
    name = frame.split(" (")[0]
    if name in _SYSCALLS and "(libc" in frame:
        return "the kernel, in system calls (loopback TCP)"
    if "(libssl" in frame or "(libcrypto" in frame:
        return "OpenSSL (libssl, libcrypto)"
    if "(_ssl.c" in frame or "(ssl.py" in frame:
        return "Python's ssl module (_ssl.c, ssl.py)"
    if name.startswith("SSLProtocol_"):
        return "uvloop's SSLProtocol (sslproto.pyx)"
    if "(balancer/_" in frame:
        return "wslb's C (_scan.c)"
    if "(balancer/" in frame and not frame.startswith(_ENTRY):
        return "wslb's Python code"
    if "wsproto/" in frame or "h11/" in frame:
        return "wsproto, h11 (handshakes)"
    if "aiohttp/" in frame or "yarl/" in frame or "multidict" in frame:
        return "aiohttp (health checks, scrapes)"
    if any(k in frame for k in ("(loop.c", "(core.c", "(stream.c", "(linux.c", "(tcp.c")):
        return "uvloop, libuv"
    if ".py:" in frame and "(balancer/" not in frame:
        return "other Python (stdlib)"
    return None


def profile_summary(path: Path, top: int = 12) -> list[str]:
    """A py-spy ``--format raw`` file (collapsed stacks, ``frame;frame;... count``), read as:
    of the samples not idle in ``epoll_pwait``, the share each part of the process spends
    itself (each sample counted for the part of its innermost frame that has an owner:
    ``_owner``), the share that passes through uvloop's SSLProtocol, and the top leaves."""
    stacks: list[tuple[list[str], int]] = []
    idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith(("epoll_pwait", "epoll_wait")):
            idle += int(count)
        else:
            stacks.append((frames, int(count)))
    busy = sum(c for _, c in stacks) or 1
    out = [f"{path.name}: {busy + idle:,} samples, {busy:,} not idle in epoll_pwait (= 100%)"]
    own: dict[str, int] = {}
    for frames, c in stacks:
        who = next((o for f in reversed(frames) if (o := _owner(f))), "other")
        own[who] = own.get(who, 0) + c
    for who, c in sorted(own.items(), key=lambda kv: -kv[1]):
        out.append(f"  {100 * c / busy:5.1f}%  {who}")
    n = sum(c for frames, c in stacks if any(f.startswith("SSLProtocol_") for f in frames))
    out.append(f"  ({100 * n / busy:.1f}% with uvloop's SSLProtocol on the stack)")
    leaves: dict[str, int] = {}
    for frames, c in stacks:
        leaf = frames[-1]
        leaves[leaf[:90]] = leaves.get(leaf[:90], 0) + c
    for leaf, c in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {100 * c / busy:5.1f}%  leaf {leaf}")
    return out


def perf_summary(path: Path, top: int = 12) -> list[str]:
    """A ``perf record`` file read as: the share of on-CPU samples per binary (the kernel,
    OpenSSL's libssl and libcrypto, libpython, uvloop's loop.so, Python's _ssl, nginx...),
    then the top symbols."""
    out = [f"{path.name}: on-CPU samples (perf record -F 999)"]
    for sort, n in (("dso", 10), ("dso,sym", top)):
        rep = command_output(["perf", "report", "-i", str(path), "--sort", sort, "--stdio", "-q"])
        lines = [ln.strip() for ln in rep.splitlines() if ln.strip() and "%" in ln]
        out += [f"  {ln[:110]}" for ln in lines[:n]]
    return out


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
    if "wslb" in lat and "nginx" in lat and not math.isnan(lat["wslb"] + lat["nginx"]):
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
    info: dict[str, Any],
    results: dict[str, Result],
    extra: dict[str, Result],
    multi: dict[str, float],
    multi_cpu: dict[str, float],
    hold: tuple[Phase, float] | None,
    args: argparse.Namespace,
) -> None:
    print(f"machine: {machine_line(info)}")
    print(
        f"{info['lscpu']}; {info['nginx']}, {info['haproxy']}; load average at start "
        f"{info['loadavg']}"
    )
    print(f"wslb: {info['wslb']}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"stream: {args.sessions} sessions x {args.rate:g} tokens/s, saturation: "
        f"{args.sat_sessions} unpaced sessions, {args.workers} raw workers, {args.repeat} windows "
        f"({args.duration:g}s stream, {args.sat_duration:g}s saturation) after {args.warmup:g}s; "
        f"idle: 3 x {args.idle_step} sessions"
    )
    if args.tls:
        print(
            f"TLS: every proxy terminates TLS on its client listener with the same "
            f"{'ECDSA P-256' if args.tls_key == 'ecdsa' else 'RSA 2048'} certificate, the workers "
            f"plain; clients Python ssl {ssl.OPENSSL_VERSION} over uvloop (stream, burst), "
            f"blocking sockets in threads (handshake: {args.hs_connects} connections per window, "
            f"{args.hs_procs} processes x {args.hs_threads} threads); burst: {args.burst} at once "
            f"from {args.burst_procs} processes, {args.burst_timeout:g}s timeouts"
        )
    print()
    if text := table(results):
        print(text)
        print()
    if args.tls:
        print(tls_table(results))
        print()
        for line in tls_targets(results, args.sessions):
            print(f"target {line}")
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
        for hw in res.handshakes:
            print(
                f"  {k} handshake {hw.mode}: {hw.ok}/{hw.connects} upgraded, {hw.resumed} resumed, "
                f"{hw.connects / hw.seconds:,.0f}/s, {_f(hw.us_per_connect, '.0f')} us CPU each "
                f"(idle {hw.idle_cpu_s * 1e3:.0f} ms subtracted), connect to 101 p50/p99 "
                f"{hw.lat_p50_ms:.2f}/{hw.lat_p99_ms:.2f} ms {hw.tls}"
                + (f"; failed {hw.outcomes}: {hw.errors[:2]}" if hw.failed else "")
                + (f"; {hw.close_errors} close errors" if hw.close_errors else "")
            )
        for b in res.bursts:
            print(
                f"  {k} burst: {b.summary()} ({b.procs} processes); connect to 101 p50 "
                f"{b.lat_p50_ms:.0f} ms, last {b.lat_max_ms:.0f} ms; proxy CPU "
                f"{b.proxy_cpu_s * 1e3:.0f} ms" + (f"; {b.errors[:3]}" if b.errors else "")
            )
        for x in res.warnings:
            print(f"  {k}: WARNING: {x}")


# -- main ----------------------------------------------------------------------------------------


def _result(d: dict[str, Any]) -> Result:
    phases = {
        k: Phase(**(p | {"windows": [Window(**w) for w in p["windows"]]}))
        for k, p in d["phases"].items()
    }
    hs = [HsWindow(**w) for w in d.get("handshakes", [])]
    bursts = [Burst(**b) for b in d.get("bursts", [])]
    return Result(**(d | {"phases": phases, "handshakes": hs, "bursts": bursts}))


def replay(path: Path, args: argparse.Namespace) -> int:
    """The table, targets and plot of an earlier run, from its ``--json`` file."""
    d = json.loads(path.read_text())
    results = {k: _result(v) for k, v in d["results"].items()}
    print(f"from {path}: {' '.join(d['command'])}")
    print(f"wslb: {d['machine'].get('wslb', '?')}\n")
    if text := table(results):
        print(text)
        print()
    if any(r.handshakes or r.bursts for r in results.values()):
        print(tls_table(results))
        print()
        sessions = next(
            (r.phases["stream"].sessions for r in results.values() if "stream" in r.phases), 0
        )
        for line in tls_targets(results, sessions):
            print(f"target {line}")
        print()
    for line in targets_report(results):
        print(f"target {line}")
    if args.plot:
        plot(results, d["multi_fps"], Path(args.plot))
    return 0


PHASES = ("idle", "stream", "saturate", "handshake", "burst")  # the last two with --tls only


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="direct / nginx / HAProxy / wslb side by side: CPU per frame, frames/s, "
        "added latency, idle memory per session, 10k sessions, multi-core throughput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (figures are rough)")
    p.add_argument(
        "--targets",
        default=None,
        help="comma-separated (default: direct,nginx,haproxy,wslb-loop,wslb; with --tls "
        "direct,nginx,haproxy,wslb: the relay thread never takes a TLS session)",
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
    p.add_argument(
        "--skip",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=[],
        help=f"comma-separated phases not to run, of {','.join(PHASES)}",
    )
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
    p.add_argument(
        "--wslb-variant",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run wslb from the source tree PATH, labelled wslb-NAME (e.g. a patched copy)",
    )
    tls = p.add_argument_group(
        "TLS (--tls)",
        "every proxy terminates TLS on its client listener (the same certificate), the workers "
        "stay plain; phases: idle, stream and saturation over TLS, then the handshake phase "
        "(plain, full and resumed connections) and the burst. No multi-core rows, no --hold.",
    )
    tls.add_argument("--tls", action="store_true", help="clients speak TLS to every proxy")
    tls.add_argument("--tls-key", choices=("ecdsa", "rsa"), default="ecdsa", help="P-256 or 2048")
    tls.add_argument("--hs-connects", type=int, default=2000, help="connections per window")
    tls.add_argument("--hs-procs", type=int, default=2, help="handshake client processes")
    tls.add_argument("--hs-threads", type=int, default=8, help="threads per handshake client")
    tls.add_argument("--burst", type=int, default=500, help="TLS connects at once (0: skip)")
    tls.add_argument("--burst-procs", type=int, default=5, help="burst client processes")
    tls.add_argument("--burst-timeout", type=float, default=15.0, help="s for connect, for 101")
    tls.add_argument("--py-spy", default=None, metavar="DIR", help="profile wslb (py-spy)")
    tls.add_argument("--perf", default=None, metavar="DIR", help="profile every proxy (perf)")
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hs-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--burst-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    return p


def target_names(args: argparse.Namespace) -> tuple[dict[str, type[Proxy]], list[str]]:
    """The proxies a run measures: ``--targets`` (its default depends on ``--tls``) and each
    ``--wslb-variant``, by name."""
    targets = dict(TARGETS)
    default = "direct,nginx,haproxy,wslb" if args.tls else "direct,nginx,haproxy,wslb-loop,wslb"
    names = [t.strip() for t in (args.targets or default).split(",") if t.strip()]
    for spec in args.wslb_variant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path, "balancer").is_dir():
            raise SystemExit(f"--wslb-variant {spec!r}: want NAME=PATH, PATH a wslb source tree")
        targets[f"wslb-{name}"] = wslb_variant(name, Path(path).resolve())
        if f"wslb-{name}" not in names:
            names.append(f"wslb-{name}")
    if unknown := [n for n in names if n not in targets]:
        raise SystemExit(f"unknown targets {unknown}; choose from {sorted(targets)}")
    return targets, names


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client_spec is not None:
        return run_uvloop(_client, args.client_spec)
    if args.worker_spec is not None:
        return run_uvloop(_worker, args.worker_spec)
    if args.hs_spec is not None:
        return _handshakes(json.loads(args.hs_spec))
    if args.burst_spec is not None:
        return run_uvloop(_burst, args.burst_spec)
    if args.quick:
        args.sessions, args.duration, args.sat_duration = 200, 3.0, 2.0
        args.warmup, args.idle_step, args.idle_base = 1.0, 300, 50
        args.hold = min(args.hold, 2000)
    if args.from_json:
        return replay(Path(args.from_json), args)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    WSLB_SRC[0] = Path(args.wslb_src).resolve()
    targets, names = target_names(args)
    skip = set(args.skip)
    if unknown_phases := skip - set(PHASES):
        raise SystemExit(f"--skip: unknown phases {sorted(unknown_phases)}; choose from {PHASES}")
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    if args.tls:
        cores, args.hold = [1], 0
        require_modules(["trustme"], "--tls")
        if args.py_spy and shutil.which("py-spy") is None:
            raise SystemExit("--py-spy: py-spy is not installed (pip install py-spy)")
        if args.perf and shutil.which("perf") is None:
            raise SystemExit("--perf: perf is not installed (apt-get install linux-perf)")
    if args.plot:  # before the run, not after it (pip install -e '.[bench]')
        require_modules(["matplotlib"], "--plot")
    ensure_installed()
    nofile = raise_nofile(4 * max(args.hold, args.idle_base + 3 * args.idle_step) + 10000)[0]
    log(f"RLIMIT_NOFILE {nofile}")
    info = machine() | {
        "lscpu": lscpu(),
        "nginx": command_output(["nginx", "-v"]).replace("nginx version: ", ""),
        "haproxy": command_output(["haproxy", "-v"]).splitlines()[0]
        if shutil.which("haproxy")
        else "",
        "loadavg": loadavg(),
    }
    info["wslb"] = source_state(WSLB_SRC[0])
    for name in names:
        cls = targets[name]
        if issubclass(cls, Wslb) and cls.src is not None:
            info["wslb"] += f"; {name}: {source_state(cls.src)}"
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
        tls = make_tls(root / "tls", args.tls_key) if args.tls else None
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
            bench = Bench(args, backends, worker_pids, root, tls)
            with contextlib.ExitStack() as one:
                runs = [bench.start(one, targets[name](tls=tls)) for name in names]
                for run in runs:
                    if run.proxy.pids() and "idle" not in skip:
                        bench.idle(run)
                for name in ("stream", "saturate"):
                    if name not in skip:
                        bench.rounds(runs, name)
                bench.tls_phases(runs)
                bench.finish(runs)
            for run in runs:
                results[run.proxy.label] = run.res
                if 1 in cores and run.proxy.pids() and "saturate" in run.res.phases:
                    sat = run.res.phases["saturate"]
                    multi[run.proxy.label] = sat.med("fps")
                    multi_cpu[run.proxy.label] = 100 * sat.med("proxy_cpu_s") / sat.med("seconds")
            for n in (c for c in cores if c != 1 and "saturate" not in skip):
                with contextlib.ExitStack() as more:
                    runs = [bench.start(more, targets[x](cores=n)) for x in names if x != "direct"]
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
    if args.py_spy:
        for f in sorted(Path(args.py_spy).glob("*.txt")):  # raw stacks: py-spy record -f raw
            print()
            print("\n".join(profile_summary(f)))
    if args.perf:
        for f in sorted(Path(args.perf).glob("*.perf")):
            print()
            print("\n".join(perf_summary(f)))
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
