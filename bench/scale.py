#!/usr/bin/env python3
"""Scale: ``--sessions`` (100,000) concurrent WebSocket sessions held through one wslb.

Issue 17, part 3. One process of this machine may open 20,000 files (the hard
``RLIMIT_NOFILE``, not raisable without ``CAP_SYS_RESOURCE``) and a proxied session costs wslb
two sockets, so one serving process holds at most ~9,900 sessions. This script runs wslb with
``workers: N`` (N serving processes on one SO_REUSEPORT port under a supervisor; N chosen so each
holds under ``--per-process`` sessions) in front of several raw uvloop workers
(``bench/proxies.py``'s, each on its own 127.0.1.x address, each under the same file limit),
and opens the sessions from several client processes spread over many 127.0.2.x source
addresses (the kernel picks an ephemeral port per (source, destination) pair: ~28,000 each).

What it measures, on 127.0.0.0/8 only:

- **opening**: how long opening every session took (client upgrade request to 101, through
  wslb's own worker handshake), sessions per second, and how many failed;
- **holding**: all sessions stay open through an idle window (``--idle-window``) and a
  streaming window (``--stream-window``): wslb's heartbeat is on (``timeouts.ping_interval``,
  20 s by default, on both legs), so every session is pinged several times; the clients and
  workers count the pings they answer. At the end every session must still be open (clients,
  workers and wslb's ``wslb_sessions_active`` say so);
- **memory**: RSS of every wslb process before and after opening, per session; the kernel's
  share (slab growth from ``/proc/meminfo``, TCP buffer pages from ``/proc/net/sockstat``,
  the largest slab caches from ``/proc/slabinfo``), machine-wide, for the four sockets a
  session has on this machine (client, wslb's two, worker's);
- **file descriptors**: per wslb process (the limit that sets N);
- **CPU**: wslb's (all processes) in the idle window, which is the heartbeat's cost (pings and
  pongs, plus health checks and scrapes, which are the supervisor's and small), so CPU per
  ping; and in the streaming window, where ``--stream-share`` (1%) of the sessions stream
  ``--rate`` tokens/s (one frame per token, stamped with ``time.monotonic_ns()`` by the worker
  as in ``bench/proxies.py``);
- **latency** of the streaming sessions, worker write to client read: p50/p99 per sub-window
  and over the window, next to a small group of direct sessions (client to worker, no proxy)
  streaming at the same time from the same processes.

The workers and clients run at ``--nice`` 10, also as their scheduling group's nice (every
child leads its own session, and with ``kernel.sched_autogroup_enabled`` the CPUs are shared
between sessions first: without it, all of wslb's processes, one group, got what one client
process got on a saturated machine). CPU starvation is reported too: seconds each role's threads
waited on a run queue per second they ran (``/proc/PID/task/*/schedstat``).

Before starting it checks its imports and the system's limits (``ulimit -n``, ``fs.file-max``,
``net.ipv4.ip_local_port_range``, ``somaxconn``, memory, the loopback addresses) against what the
run needs and says what is missing (exit 2; ``--force`` runs anyway). Every process it starts is
stopped at the end, on Ctrl-C and on SIGTERM. ``--quick`` is a smoke run (2,000 sessions, 2 s
heartbeat, seconds-long windows); ``--json F`` writes the report as JSON. Not a test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REQUIRED = ("uvloop", "psutil", "yaml", "h11", "wsproto", "aiohttp", "prometheus_client")
MISSING = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
if MISSING:  # before the imports below fail on the first of them
    raise SystemExit(
        f"bench/scale.py: missing Python packages: {', '.join(MISSING)} "
        "(pip install -e '.[dev]' in the repository installs them)"
    )

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import secrets  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, cast  # noqa: E402

import psutil  # noqa: E402

from bench.lib.cpu import cpu_split, tree  # noqa: E402
from bench.lib.launch import Procs, free_port  # noqa: E402
from bench.lib.launch import Wslb as WslbProcess  # noqa: E402
from bench.lib.machine import loadavg, lscpu, machine, machine_line, source_state  # noqa: E402
from bench.lib.rawws import (  # noqa: E402
    FRAME_HEAD,
    ClientConn,
    ClientStats,
    WorkerConn,
    next_frame,
    open_session,
    run_uvloop,
    serve_parent,
    upgrade_request,
    ws_probe,
)
from bench.lib.script import log, raise_nofile, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import hist_pct, summary  # noqa: E402
from bench.lib.wslb import log_problems, prom_by_label  # noqa: E402

WSLB_HOST = "127.0.0.1"
WORKER_NET = "127.0.1."  # raw workers on 127.0.1.1, .2, ...
SOURCE_NET = "127.0.2."  # client source addresses 127.0.2.1, .2, ...
FD_SPARE = 200  # a wslb process's own files: listeners, admin socket, board, epoll, logs
# The slab caches an open TCP socket in an epoll set allocates from (Linux 6.x): the socket,
# its inode, dentry and file, the epoll item, LSM blobs.
SOCKET_CACHES = frozenset(
    {"TCP", "sock_inode_cache", "dentry", "filp", "eventpoll_epi", "eventpoll_pwq"}
    | {"lsm_inode_cache", "lsm_file_cache"}
)
DEFAULT_PING_INTERVAL = 20.0  # wslb's default timeouts.ping_interval (SPEC section 4)


# -- raw worker (its own process): bench/proxies.py's, on one address, counting pings ---------

WSTATS: dict[str, int] = {"open": 0, "lost": 0, "pings": 0, "upgrades": 0}


class ScaleWorkerConn(WorkerConn):
    """``bench/proxies.py``'s worker connection, counting open WebSockets and wslb's pings;
    ``GET /bench-stats`` answers the counters as JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = False

    def _request(self, head: bytes) -> None:
        if head.startswith(b"GET /bench-stats"):
            assert self.transport is not None
            body = json.dumps(WSTATS).encode()
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            self.transport.close()
            return
        super()._request(head)
        if self.ws and not self.counted:
            self.counted = True
            WSTATS["open"] += 1
            WSTATS["upgrades"] += 1

    def _frame(self, opcode: int, payload: bytes) -> None:
        if opcode == 0x9:
            WSTATS["pings"] += 1
        super()._frame(opcode, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.counted = False
            WSTATS["open"] -= 1
            WSTATS["lost"] += 1
        super().connection_lost(exc)


async def _worker(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(ScaleWorkerConn, spec["host"], spec["port"], backlog=4096)
    async with server:
        await server.serve_forever()


# -- raw client (its own process): opens sessions on command, counts pings too ----------------


class ScaleStats(ClientStats):
    def __init__(self) -> None:
        super().__init__()
        self.pings = 0  # pings answered (wslb's heartbeat on the client leg)

    def snapshot(self) -> dict[str, Any]:
        return super().snapshot() | {"pings": self.pings}


class ScaleClientConn(ClientConn):
    """``bench/proxies.py``'s client session, counting the pings it answers."""

    def _other(self) -> None:
        buf, pos = self.buf, 0
        while buf[pos : pos + 2] != FRAME_HEAD and (fr := next_frame(buf, pos)) is not None:
            if fr[0] == 0x9:
                cast(ScaleStats, self.st).pings += 1
            pos = fr[2]
        super()._other()


async def _client(spec: dict[str, Any]) -> None:
    """``serve_parent`` for this benchmark: ``open`` to group G (0: wslb, 1: the workers
    directly) writes ``progress {...}`` every 2 s, then answers ``done {...}``."""
    loop = asyncio.get_running_loop()
    groups: list[list[tuple[str, int, str]]] = [[tuple(t) for t in g] for g in spec["groups"]]
    sources: list[str] = spec["sources"]
    stats = [ScaleStats() for _ in groups]
    keep: list[ScaleClientConn] = []
    sem = asyncio.Semaphore(spec["concurrency"])
    counter: int = spec["first"]  # this process's first session index (sources spread evenly)
    out = sys.stdout

    async def open_one(i: int, rate: float | None, group: int) -> None:
        st = stats[group]
        host, port, path = groups[group][i % len(groups[group])]
        request = upgrade_request(host, port, f"{path}?session=scale-{i}")
        await open_session(
            keep,
            st,
            sem,
            i,
            sources[i % len(sources)],
            (host, port),
            lambda: ScaleClientConn(st, request, rate),
            (15.0, 30.0),
        )

    async def progress(group: int, failed0: int) -> None:
        while True:
            await asyncio.sleep(2.0)
            st = stats[group]
            out.write(f"progress {json.dumps({'open': st.open, 'failed': st.failed - failed0})}\n")
            out.flush()

    async def open_batch(n: int, rate: float | None, group: int) -> str:
        nonlocal counter
        st = stats[group]
        failed0, t0 = st.failed, time.monotonic()
        ticker = loop.create_task(progress(group, failed0))
        await asyncio.gather(*(open_one(counter + i, rate, group) for i in range(n)))
        ticker.cancel()
        counter += n
        done = {
            "open": st.open,
            "failed": st.failed - failed0,
            "seconds": time.monotonic() - t0,
            "errors": st.errors[:4],
        }
        return "done " + json.dumps(done)

    await serve_parent(stats, keep, open_batch)


class Child:
    """The parent's end of one client process's line protocol."""

    def __init__(self, proc: subprocess.Popen[bytes], index: int) -> None:
        self.proc = proc
        self.index = index
        self.buf = b""

    @property
    def fd(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def has_line(self) -> bool:
        return b"\n" in self.buf

    def fill(self) -> None:
        """Read what is there (call when ``fd`` is readable)."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            raise RuntimeError(f"client {self.index} exited ({self.proc.poll()})")
        self.buf += chunk

    def line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.has_line():
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError(f"client {self.index} did not answer in {timeout:g}s")
            self.fill()
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def wait_all(children: Sequence[Child], word: str, timeout: float) -> list[dict[str, Any]]:
    """Each child's next ``word {...}`` line, logging the sum of their ``progress`` lines."""
    deadline = time.monotonic() + timeout
    done: dict[int, dict[str, Any]] = {}
    progress: dict[int, dict[str, int]] = {}
    last_log = time.monotonic()
    while len(done) < len(children):
        pending = [c for c in children if c.index not in done]
        for c in pending:
            while c.has_line() and c.index not in done:
                line = c.line(0)
                kind, _, body = line.partition(" ")
                if kind == "progress":
                    progress[c.index] = json.loads(body)
                elif kind == word:
                    done[c.index] = json.loads(body)
                    progress.pop(c.index, None)
                else:
                    raise RuntimeError(f"client {c.index} said {line!r}")
        if len(done) == len(children):
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"clients {sorted(set(range(len(children))) - set(done))} late")
        pending = [c for c in children if c.index not in done]
        for fd in select.select([c.fd for c in pending], [], [], min(left, 1.0))[0]:
            next(c for c in pending if c.fd == fd).fill()
        if time.monotonic() - last_log >= 10 and progress:
            last_log = time.monotonic()
            n_open = sum(p["open"] for p in progress.values()) + sum(
                d["open"] for d in done.values()
            )
            n_failed = sum(p["failed"] for p in progress.values())
            log(f"    ... {n_open:,} open, {n_failed:,} failed")
    return [done[c.index] for c in children]


# -- system: limits, memory, kernel -------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def sysctl(name: str) -> str:
    return _read("/proc/sys/" + name.replace(".", "/")).strip()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        if words:
            out[key] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return out


def sockstat() -> dict[str, int]:
    """The TCP line of /proc/net/sockstat (``mem`` in pages) and the sockets in use."""
    out: dict[str, int] = {}
    for line in _read("/proc/net/sockstat").splitlines():
        head, _, rest = line.partition(":")
        words = rest.split()
        if head in ("TCP", "sockets"):
            for k, v in zip(words[::2], words[1::2], strict=False):
                out[f"{head.lower()}_{k}"] = int(v)
    return out


def slabinfo() -> dict[str, int]:
    """Bytes per slab cache (num_objs x objsize); empty if /proc/slabinfo is unreadable."""
    out = {}
    for line in _read("/proc/slabinfo").splitlines()[2:]:
        w = line.split()
        if len(w) > 3:
            out[w[0]] = int(w[2]) * int(w[3])
    return out


@dataclass
class KernelSample:
    slab: int  # bytes (/proc/meminfo Slab)
    unreclaimable: int  # bytes (SUnreclaim)
    tcp_mem_pages: int  # /proc/net/sockstat TCP mem
    tcp_inuse: int
    sockets_used: int
    available: int  # MemAvailable
    caches: dict[str, int]


def kernel_sample() -> KernelSample:
    m, s = meminfo(), sockstat()
    return KernelSample(
        slab=m.get("Slab", 0),
        unreclaimable=m.get("SUnreclaim", 0),
        tcp_mem_pages=s.get("tcp_mem", 0),
        tcp_inuse=s.get("tcp_inuse", 0),
        sockets_used=s.get("sockets_used", 0),
        available=m.get("MemAvailable", 0),
        caches=slabinfo(),
    )


@dataclass
class Plan:
    """What the run needs: how many of each process, sessions, addresses."""

    sessions: int
    streaming: int
    control: int
    processes: int  # wslb serving processes (workers: N)
    backends: int  # raw worker processes
    clients: int  # client processes
    sources: list[str]
    concurrency: int

    @property
    def per_process(self) -> int:
        return math.ceil(self.sessions / self.processes)

    def fds_needed(self) -> dict[str, int]:
        """Open files per process of each kind, with margins for the uneven spread: the
        kernel's SO_REUSEPORT hash (binomial, a few percent) and bounded-load hashing (each
        worker at most ~1.25 x its share)."""
        share = self.sessions / self.processes
        wslb = math.ceil(2 * (share + 4 * math.sqrt(share) + 50)) + FD_SPARE
        worker = math.ceil(1.3 * (self.sessions + self.control) / self.backends) + 100
        client = math.ceil(self.sessions / self.clients) + self.control + 100
        return {"wslb": wslb, "worker": worker, "client": client}

    def pairs(self) -> dict[str, int]:
        """The most connections of one (source address, destination) pair: ephemeral ports."""
        return {
            "client->wslb": math.ceil(self.sessions / len(self.sources)),
            "wslb->worker": math.ceil(1.3 * self.sessions / self.backends),
        }


def check_system(plan: Plan) -> tuple[list[str], list[str]]:
    """(problems, notes): what would make the run fail, and what the run relies on."""
    problems: list[str] = []
    notes: list[str] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = plan.fds_needed()
    notes.append(
        f"RLIMIT_NOFILE soft {soft} hard {hard} (per process); needs about {need} "
        f"({plan.per_process:,} sessions per wslb process, 2 sockets each)"
    )
    for kind, n in need.items():
        if n > soft:
            fix = {
                "wslb": "more wslb processes (--processes) or `ulimit -n`",
                "worker": "more workers (--backends)",
                "client": "more client processes (--clients)",
            }[kind]
            problems.append(f"a {kind} process needs ~{n} open files, ulimit -n is {soft}: {fix}")
    total_fds = 4 * (plan.sessions + plan.control) + 5000
    file_max = int(sysctl("fs.file-max") or 0)
    file_nr = (sysctl("fs.file-nr").split() or ["0"])[0]
    notes.append(f"fs.file-max {file_max:,} (in use {file_nr}); needs ~{total_fds:,}")
    if file_max and total_fds + int(file_nr) > file_max:
        problems.append(f"fs.file-max {file_max:,} is under the ~{total_fds:,} files needed")
    ports = sysctl("net.ipv4.ip_local_port_range").split()
    if len(ports) == 2:
        span = int(ports[1]) - int(ports[0]) + 1
        pairs = plan.pairs()
        notes.append(
            f"ip_local_port_range {ports[0]}-{ports[1]} ({span:,} ports per source/destination "
            f"pair); the busiest pairs need {pairs}"
        )
        for pair, n in pairs.items():
            if n > 0.9 * span:
                fix = "--sources" if pair.startswith("client") else "--backends"
                problems.append(f"{pair}: {n:,} connections per pair, {span:,} ports: more {fix}")
    autogroup = sysctl("kernel.sched_autogroup_enabled")
    if autogroup == "1":
        notes.append(
            "kernel.sched_autogroup_enabled 1: CPU is shared between sessions first; the load "
            "generator's sessions get --nice as their group's nice (/proc/PID/autogroup)"
        )
    somax = int(sysctl("net.core.somaxconn") or 0)
    notes.append(
        f"net.core.somaxconn {somax} (wslb listens with backlog 4096, capped by it), "
        f"tcp_max_syn_backlog {sysctl('net.ipv4.tcp_max_syn_backlog')}"
    )
    if somax and somax < 1024:
        problems.append(f"net.core.somaxconn is {somax}: bursts of handshakes would be dropped")
    mem = meminfo()
    est = plan.sessions * 30 * 1024 + plan.processes * 80 * 2**20 + 2**30
    notes.append(
        f"memory available {mem.get('MemAvailable', 0) / 2**30:.1f} GiB of "
        f"{mem.get('MemTotal', 0) / 2**30:.1f}; the run needs roughly {est / 2**30:.1f} GiB "
        f"(every process and the kernel's sockets); cpus {os.cpu_count()}"
    )
    if mem.get("MemAvailable", 0) and est > mem["MemAvailable"]:
        problems.append(f"not enough free memory: ~{est / 2**30:.1f} GiB needed")
    tcp_mem = sysctl("net.ipv4.tcp_mem").split()
    if len(tcp_mem) == 3:
        notes.append(f"net.ipv4.tcp_mem {' '.join(tcp_mem)} pages")
    bad = []
    for addr in [WSLB_HOST, *worker_hosts(plan.backends), *plan.sources]:
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
        except OSError as exc:
            bad.append(f"{addr} ({exc.strerror})")
    if bad:
        problems.append(f"cannot bind loopback addresses: {', '.join(bad[:5])}")
    if not Path("/proc/slabinfo").exists() or not slabinfo():
        notes.append("/proc/slabinfo unreadable: kernel memory from /proc/meminfo only")
    return problems, notes


def worker_hosts(n: int) -> list[str]:
    return [f"{WORKER_NET}{i + 1}" for i in range(n)]


# -- wslb and its workers ---------------------------------------------------------------------


def renice(pid: int, nice: int) -> None:
    """Lower a load generator's priority, so that wslb gets the CPU it asks for first.

    Every child of ``Procs`` leads its own session, and with ``kernel.sched_autogroup_enabled``
    (on here) each session is a scheduling group of its own: the scheduler shares the CPUs
    between groups first, and a process's nice only counts inside its group. wslb's supervisor
    and its serving processes are one group; each client and worker process would be another,
    so on a saturated machine all of wslb got what one client got (measured: its threads waited
    21 s on the run queue per second they ran). The group's own nice (``/proc/PID/autogroup``)
    is what lowers a load generator against wslb.
    """
    if nice:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).nice(nice)
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def start_workers(procs: Procs, n: int, nice: int = 0) -> tuple[list[tuple[str, int]], list[int]]:
    addrs, pids = [], []
    for i, host in enumerate(worker_hosts(n)):
        port = free_port(host)
        spec = json.dumps({"host": host, "port": port})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-spec", spec]
        proc = procs.spawn(f"worker-{i + 1}", cmd)
        renice(proc.pid, nice)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {host}:{port} did not start: {procs.log_tail(f'worker-{i + 1}')}"
                )
            time.sleep(0.05)
        addrs.append((host, port))
        pids.append(proc.pid)
    return addrs, pids


def worker_stats(addrs: Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    out = []
    for host, port in addrs:
        with urllib.request.urlopen(f"http://{host}:{port}/bench-stats", timeout=10) as r:
            out.append(cast(dict[str, int], json.loads(r.read())))
    return out


def wslb_config(
    plan: Plan, backends: Sequence[tuple[str, int]], ping: float | None
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pools": [
            {
                "name": "chat",
                "balance": "consistent",
                "health": {"path": "/healthz"},
                "backends": [
                    {"id": f"w{i + 1}", "url": f"ws://{h}:{p}/ws"}
                    for i, (h, p) in enumerate(backends)
                ],
            }
        ],
        # Over the whole balancer (every serving process together).
        "limits": {"max_connections": 2 * plan.sessions + 10000},
        "workers": plan.processes,
    }
    if ping is not None:
        config["timeouts"] = {"ping_interval": f"{ping:g}s", "ping_timeout": f"{ping:g}s"}
    return config


def wait_serving(wslb: WslbProcess, processes: int, timeout: float = 60.0) -> list[int]:
    """Until the supervisor and every serving process run and each of those listens."""
    deadline = time.monotonic() + timeout
    while True:
        kids = wslb.children()
        listening = 0
        for p in kids:
            with contextlib.suppress(psutil.Error):
                if any(
                    c.status == psutil.CONN_LISTEN and c.laddr and c.laddr[1] == wslb.port
                    for c in p.net_connections(kind="tcp")
                ):
                    listening += 1
        if listening >= processes:
            ws_probe(WSLB_HOST, wslb.port, "/ws")
            return [wslb.pid, *(p.pid for p in kids)]
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{listening} of {processes} wslb serving processes listen after {timeout:g}s\n"
                + wslb.log_tail()
            )
        time.sleep(0.2)


def rss_of(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            out.append(0)
    return out


def fds_of(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid).num_fds())
        except psutil.Error:
            out.append(0)
    return out


def sched_of(pids: Sequence[int]) -> tuple[float, float]:
    """Seconds the processes' threads (and their descendants') ran, and waited runnable on a
    run queue for a CPU (``/proc/PID/task/TID/schedstat``): waiting is CPU starvation."""
    run = wait = 0
    for pid in pids:
        for p in tree(pid):
            for stat in Path(f"/proc/{p.pid}/task").glob("*/schedstat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    words = stat.read_text().split()
                    run += int(words[0])
                    wait += int(words[1])
    return run / 1e9, wait / 1e9


def machine_busy() -> tuple[float, float]:
    """CPU seconds the machine was busy (everyone's), and of those in softirq."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + t.irq + t.softirq + t.steal), float(t.softirq)


@dataclass
class Sample:
    at: float
    wslb_user: float
    wslb_sys: float
    workers: float
    clients: float
    machine: float
    softirq: float
    sched: dict[str, tuple[float, float]]  # role -> (ran, waited for a CPU) seconds
    snaps: list[list[dict[str, Any]]]  # per client process, per group
    workers_stats: list[dict[str, int]]

    def group(self, g: int, key: str) -> int:
        return sum(s[g][key] for s in self.snaps if len(s) > g)

    def hist(self, g: int) -> dict[int, int]:
        out: Counter[int] = Counter()
        for s in self.snaps:
            if len(s) > g:
                for k, v in s[g]["lat"].items():
                    out[int(k)] += v
        return dict(out)

    @property
    def pings(self) -> int:
        """Pings wslb sent that the far ends answered: clients' (both groups: the direct
        group sees none) plus workers'."""
        return self.group(0, "pings") + sum(w["pings"] for w in self.workers_stats)


@dataclass
class Run:
    plan: Plan
    wslb_pids: list[int]
    worker_pids: list[int]
    worker_addrs: list[tuple[str, int]]
    children: list[Child]
    warnings: list[str] = field(default_factory=list)

    def sample(self) -> Sample:
        for c in self.children:
            c.send("snap")
        snaps = [json.loads(c.line(60)) for c in self.children]
        user, system = cpu_split(self.wslb_pids[:1])  # the supervisor and its tree
        busy, softirq = machine_busy()
        return Sample(
            at=time.monotonic(),
            wslb_user=user,
            wslb_sys=system,
            workers=sum(cpu_split(self.worker_pids)),
            clients=sum(cpu_split([c.proc.pid for c in self.children])),
            machine=busy,
            softirq=softirq,
            sched={
                "wslb": sched_of(self.wslb_pids[:1]),
                "workers": sched_of(self.worker_pids),
                "clients": sched_of([c.proc.pid for c in self.children]),
            },
            snaps=snaps,
            workers_stats=worker_stats(self.worker_addrs),
        )


def window(a: Sample, b: Sample) -> dict[str, float]:
    """CPU in % of one core over the window, pings and frames in it."""
    dt = max(b.at - a.at, 1e-9)
    wslb = b.wslb_user + b.wslb_sys - a.wslb_user - a.wslb_sys
    out = {
        "seconds": dt,
        "wslb_cpu_s": wslb,
        "wslb_pct": 100 * wslb / dt,
        "wslb_sys_pct": 100 * (b.wslb_sys - a.wslb_sys) / dt,
        "workers_pct": 100 * (b.workers - a.workers) / dt,
        "clients_pct": 100 * (b.clients - a.clients) / dt,
        "machine_pct": 100 * (b.machine - a.machine) / dt,
        "softirq_pct": 100 * (b.softirq - a.softirq) / dt,
        "pings": b.pings - a.pings,
        "frames": b.group(0, "recv") - a.group(0, "recv"),
    }
    for role, (ran, waited) in b.sched.items():
        ran0, waited0 = a.sched[role]
        # Per second of the window: ms its threads waited for a CPU while runnable.
        out[f"{role}_runq_wait_ms_per_s"] = 1000 * (waited - waited0) / dt
        out[f"{role}_runq_wait_per_run"] = (waited - waited0) / max(1e-9, ran - ran0)
    out["others_pct"] = max(
        0.0, out["machine_pct"] - out["wslb_pct"] - out["workers_pct"] - out["clients_pct"]
    )
    return out


def latency(hist: dict[int, int]) -> dict[str, float]:
    """A latency histogram (1 us bins) summarised: n, p50_us, p99_us, p999_us, max_us."""
    return summary(hist, (50, 99, 99.9), unit="_us")


def merge(hists: Sequence[dict[int, int]]) -> dict[int, int]:
    out: Counter[int] = Counter()
    for h in hists:
        out.update(h)
    return dict(out)


# -- the run ----------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> Plan:
    n = args.sessions
    streaming = max(1, round(n * args.stream_share)) if args.stream_share > 0 else 0
    control = args.control if args.control >= 0 else max(10, streaming // 5) if streaming else 0
    processes = args.processes or max(2, math.ceil(n / args.per_process))
    backends = args.backends or max(2, math.ceil(1.3 * n / 15000))
    clients = args.clients or max(1, math.ceil(n / 15000))
    sources = [f"{SOURCE_NET}{i + 1}" for i in range(args.sources)]
    return Plan(n, streaming, control, processes, backends, clients, sources, args.concurrency)


def open_sessions(run: Run, rate: float) -> dict[str, Any]:
    """Every client opens its share (streaming ones first): how long it took, failures."""
    plan, children = run.plan, run.children
    idle_total = plan.sessions - plan.streaming
    for c in children:
        k = len(children)
        stream = plan.streaming // k + (1 if c.index < plan.streaming % k else 0)
        idle = idle_total // k + (1 if c.index < idle_total % k else 0)
        c.send(f"open {stream} {rate:g} 0")
        c.send(f"open {idle} -1 0")
    t0 = time.monotonic()
    timeout = 120 + plan.sessions / 100
    first = wait_all(children, "done", timeout)
    second = wait_all(children, "done", timeout)
    seconds = time.monotonic() - t0
    failed = sum(d["failed"] for d in first + second)
    errors = [e for d in first + second for e in d["errors"]][:8]
    opened = sum(d["open"] for d in second)
    return {
        "opened": opened,
        "failed": failed,
        "seconds": seconds,
        "per_s": opened / seconds if seconds else math.nan,
        "errors": errors,
        "per_client_s": [d["seconds"] for d in second],
    }


def wslb_metrics(wslb: WslbProcess) -> dict[str, Any]:
    try:
        text = cast(str, wslb.admin("/metrics", timeout=60))
    except (OSError, ValueError) as exc:
        return {"error": repr(exc)}
    return {
        "sessions_active": sum(prom_by_label(text, "wslb_sessions_active", "backend").values()),
        "connections_active": sum(prom_by_label(text, "wslb_connections_active", "").values()),
        "handshake_rejections": dict(prom_by_label(text, "wslb_handshake_rejections", "status")),
        "upstream_connect_failures": sum(
            prom_by_label(text, "wslb_upstream_connect_failures", "backend").values()
        ),
        "sessions_by_backend": dict(prom_by_label(text, "wslb_sessions_active", "backend")),
    }


def kernel_delta(a: KernelSample, b: KernelSample, sessions: int) -> dict[str, Any]:
    caches = {k: b.caches.get(k, 0) - a.caches.get(k, 0) for k in b.caches}
    top = sorted(caches.items(), key=lambda kv: -kv[1])[:8]
    slab = b.slab - a.slab
    sock = sum(v for k, v in caches.items() if k in SOCKET_CACHES)
    tcp_mem = (b.tcp_mem_pages - a.tcp_mem_pages) * 4096
    n = max(1, sessions)
    return {
        "slab_mb": slab / 2**20,
        "unreclaimable_mb": (b.unreclaimable - a.unreclaimable) / 2**20,
        "tcp_buffers_mb": tcp_mem / 2**20,
        "tcp_inuse": b.tcp_inuse,
        "tcp_inuse_delta": b.tcp_inuse - a.tcp_inuse,
        "kb_per_session": (slab + tcp_mem) / 1024 / n,  # machine-wide: four sockets each
        "kb_per_socket": (slab + tcp_mem) / 1024 / max(1, b.tcp_inuse - a.tcp_inuse),
        # Only the caches a socket allocates from (other slab growth may be anyone's).
        "socket_caches_kb_per_session": (sock + tcp_mem) / 1024 / n,
        "top_caches_kb_per_session": {k: v / 1024 / n for k, v in top if v > 0},
        "mem_available_drop_mb": (a.available - b.available) / 2**20,
    }


def execute(args: argparse.Namespace, plan: Plan, root: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    warnings: list[str] = []
    with Procs(root) as procs:
        log(f"[workers] {plan.backends} raw workers on {WORKER_NET}1-{plan.backends}")
        worker_addrs, worker_pids = start_workers(procs, plan.backends, args.nice)
        config = wslb_config(plan, worker_addrs, args.ping_interval)
        ping = args.ping_interval or DEFAULT_PING_INTERVAL
        wslb = WslbProcess(
            config,
            root,
            procs=procs,
            name="wslb",
            token=secrets.token_urlsafe(32),
            args=["--log-level", "warning"],
            src=Path(args.wslb_src).resolve(),
            term_timeout=30.0,
        )
        log(
            f"[wslb] workers: {plan.processes} (~{plan.per_process:,} sessions each), "
            f"timeouts.ping_interval {ping:g}s"
            + (" (the default)" if args.ping_interval is None else "")
        )
        wslb.start(wait_ready=True, timeout=60.0)
        wslb_pids = wait_serving(wslb, plan.processes)
        time.sleep(1.0)
        children = []
        for i in range(plan.clients):
            spec = {
                "groups": [
                    [(WSLB_HOST, wslb.port, "/ws")],
                    [(h, p, "/ws") for h, p in worker_addrs],
                ],
                "sources": plan.sources,
                "concurrency": max(1, plan.concurrency // plan.clients),
                "first": i * 10_000_000,  # session ids distinct over the processes
            }
            cmd = [sys.executable, str(Path(__file__).resolve()), "--client-spec", json.dumps(spec)]
            proc = procs.spawn(f"client-{i}", cmd, pipes=True, term_timeout=0)
            renice(proc.pid, args.nice)
            children.append(Child(proc, i))
        run = Run(plan, wslb_pids, worker_pids, worker_addrs, children, warnings)
        log(f"[baseline] {args.baseline_window:g}s, no sessions")
        b0 = run.sample()
        time.sleep(args.baseline_window)
        b1 = run.sample()
        base = window(b0, b1)
        log(f"    wslb cpu {base['wslb_pct']:.1f}% of a core (health checks, scrapes, board)")
        k0 = kernel_sample()
        rss0 = rss_of(wslb_pids)
        fds0 = fds_of(wslb_pids)
        log(
            f"[open] {plan.sessions:,} sessions ({plan.streaming:,} to stream) from "
            f"{plan.clients} client processes over {len(plan.sources)} source addresses"
        )
        opened = open_sessions(run, args.rate)
        opening = window(b1, run.sample())
        hs_cpu = opening["wslb_cpu_s"] - base["wslb_cpu_s"] / base["seconds"] * opening["seconds"]
        opened["wslb_cpu"] = opening
        opened["wslb_us_per_handshake"] = hs_cpu * 1e6 / max(1, opened["opened"])
        log(
            f"    {opened['opened']:,} open, {opened['failed']:,} failed, in "
            f"{opened['seconds']:.1f}s ({opened['per_s']:,.0f}/s); wslb cpu "
            f"{opening['wslb_pct']:.0f}%, {opened['wslb_us_per_handshake']:.0f} us/handshake, "
            f"machine {opening['machine_pct']:.0f}%"
        )
        ctl = {"opened": 0, "failed": 0}
        if plan.control:
            children[0].send(f"open {plan.control} {args.rate:g} 1")
            d = wait_all(children[:1], "done", 60)[0]
            ctl = {"opened": d["open"], "failed": d["failed"]}
        time.sleep(2.0)  # let the last handshakes' garbage settle before measuring
        k1 = kernel_sample()
        rss1 = rss_of(wslb_pids)
        fds1 = fds_of(wslb_pids)
        t_open = time.monotonic()
        s0 = run.sample()
        log(f"[idle] {args.idle_window:g}s, every session open, heartbeat only")
        time.sleep(args.idle_window)
        s1 = run.sample()
        idle = window(s0, s1)
        log(
            f"    wslb cpu {idle['wslb_pct']:.1f}% of a core, {idle['pings']:,.0f} pings "
            f"answered ({idle['pings'] / idle['seconds']:,.0f}/s)"
        )
        for c in children:
            c.send("go")
        for c in children:
            if (line := c.line(60)) != "going":
                raise RuntimeError(f"client {c.index} said {line!r}")
        time.sleep(args.warmup)
        log(
            f"[stream] {plan.streaming:,} sessions x {args.rate:g} tokens/s, "
            f"{args.windows} x {args.stream_window / args.windows:g}s"
        )
        windows: list[dict[str, Any]] = []
        prev = run.sample()  # resets the clients' latency histograms
        first = prev
        hists: list[dict[int, int]] = []
        ctl_hists: list[dict[int, int]] = []
        for _ in range(args.windows):
            time.sleep(max(0.0, prev.at + args.stream_window / args.windows - time.monotonic()))
            cur = run.sample()
            w: dict[str, Any] = dict(window(prev, cur))
            h, hc = cur.hist(0), cur.hist(1)
            hists.append(h)
            ctl_hists.append(hc)
            w |= {f"lat_{k}": v for k, v in latency(h).items()}
            w |= {f"direct_{k}": v for k, v in latency(hc).items()}
            # Per client process: a slow client would show here, not in wslb.
            w["lat_p50_us_by_client"] = [
                hist_pct({int(k): v for k, v in snap[0]["lat"].items()}, 50) for snap in cur.snaps
            ]
            windows.append(w)
            log(
                f"    {w['frames'] / w['seconds']:,.0f} frames/s, wslb cpu {w['wslb_pct']:.0f}%, "
                f"p50/p99 {w['lat_p50_us']:.0f}/{w['lat_p99_us']:.0f} us (direct "
                f"{w['direct_p50_us']:.0f}/{w['direct_p99_us']:.0f}), {w['pings']:,.0f} pings, "
                f"machine {w['machine_pct']:.0f}%, run-queue wait per CPU-s: wslb "
                f"{w['wslb_runq_wait_per_run']:.2f} clients {w['clients_runq_wait_per_run']:.2f}"
            )
            prev = cur
        stream = window(first, prev)
        hold_s = prev.at - t_open
        k2 = kernel_sample()  # before listing /proc/PID/fd, which fills the proc inode cache
        end_rss = rss_of(wslb_pids)
        end_fds = fds_of(wslb_pids)
        metrics = wslb_metrics(wslb)
        alive = [psutil.pid_exists(p) for p in wslb_pids]
        held = prev.group(0, "open")
        closed = prev.group(0, "closed")
        wk_open = sum(w["open"] for w in prev.workers_stats)
        errors = [e for s in prev.snaps for e in s[0]["errors"]][:8]
        problems = log_problems(wslb.output())
        restarts = [ln for ln in wslb.output().splitlines() if "exited with" in ln]
        total_pings = prev.pings - s0.pings
        idle_ping_rate = idle["pings"] / idle["seconds"] if idle["seconds"] else 0
        # The heartbeat's share of the idle window: above the no-session baseline.
        base_rate = base["wslb_cpu_s"] / base["seconds"]
        beat_cpu = idle["wslb_cpu_s"] - base_rate * idle["seconds"]
        us_per_ping = beat_cpu * 1e6 / idle["pings"] if idle["pings"] else math.nan
        if idle["pings"]:  # the handshakes alone: less the pings of sessions already open
            net = opening["wslb_cpu_s"] - base_rate * opening["seconds"]
            net -= opening["pings"] * us_per_ping / 1e6
            opened["wslb_us_per_handshake_net"] = net * 1e6 / max(1, opened["opened"])
        idle_cpu_rate = idle["wslb_cpu_s"] / idle["seconds"]
        stream_extra = stream["wslb_cpu_s"] - idle_cpu_rate * stream["seconds"]
        report = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python", "bench/scale.py", *sys.argv[1:]]),
            "machine": machine()
            | {
                "lscpu": lscpu(),
                "loadavg": loadavg(),
                "wslb": source_state(Path(args.wslb_src).resolve()),
            },
            "plan": {
                "sessions": plan.sessions,
                "streaming": plan.streaming,
                "rate": args.rate,
                "control_direct": plan.control,
                "wslb_processes": plan.processes,
                "raw_workers": plan.backends,
                "client_processes": plan.clients,
                "source_addresses": len(plan.sources),
                "ping_interval_s": ping,
                "ping_interval_default": args.ping_interval is None,
                "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "load_generator_nice": args.nice,
            },
            "open": opened | {"control": ctl},
            "held": {
                "open_at_end": held,
                "all_open": held == plan.sessions and closed == 0,
                "closed_during_hold": closed,
                "worker_websockets_open": wk_open - ctl["opened"],
                "wslb_sessions_active": metrics.get("sessions_active"),
                "hold_s": hold_s,
                "errors": errors,
            },
            "wslb": {
                "processes": len(wslb_pids),
                "alive_at_end": sum(alive),
                "restarts_logged": len(restarts),
                "metrics": metrics,
                "log_problems": dict(problems.most_common(8)),
            },
            "rss": {
                "before_mb": sum(rss0) / 2**20,
                "after_open_mb": sum(rss1) / 2**20,
                "end_mb": sum(end_rss) / 2**20,
                "kb_per_session": (sum(rss1) - sum(rss0)) / 1024 / max(1, opened["opened"]),
                "kb_per_session_end": (sum(end_rss) - sum(rss0)) / 1024 / max(1, held),
                "per_process_mb": [x / 2**20 for x in end_rss],
            },
            "fds": {
                "before": sum(fds0),
                "after_open": sum(fds1),
                "end": sum(end_fds),
                "max_per_process": max(end_fds),
                "per_process": end_fds,
                "per_session": (sum(fds1) - sum(fds0)) / max(1, opened["opened"]),
            },
            "kernel": {
                "open": kernel_delta(k0, k1, opened["opened"]),
                "end": kernel_delta(k0, k2, held),
            },
            "cpu": {
                "baseline": base,
                "idle": idle,
                "stream": stream,
                "us_per_ping": us_per_ping,
                "pings_per_s_idle": idle_ping_rate,
                "us_per_frame_stream": stream_extra * 1e6 / stream["frames"]
                if stream["frames"]
                else math.nan,
            },
            "pings": {
                "hold_total": total_pings,
                "per_session_leg": total_pings / max(1, 2 * plan.sessions),
                "expected_per_session_leg": hold_s / ping,
            },
            "latency": latency(merge(hists)),
            "latency_direct": latency(merge(ctl_hists)),
            "windows": windows,
            "frames": {
                "received": stream["frames"],
                "per_s": stream["frames"] / stream["seconds"],
                "offered_per_s": plan.streaming * args.rate,
            },
        }
        if opened["failed"]:
            warnings.append(f"{opened['failed']} sessions failed to open: {opened['errors']}")
        if not all(alive):
            warnings.append("a wslb process exited during the run")
        if restarts:
            warnings.append(f"wslb restarted serving processes: {restarts[:3]}")
        if report["held"]["worker_websockets_open"] != held:
            warnings.append(f"workers hold {wk_open - ctl['opened']} sessions, clients {held}")
        if max(end_fds) > 0.97 * resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
            warnings.append(f"a wslb process is at {max(end_fds)} open files, near the limit")
        report["warnings"] = warnings
        log("[stop] stopping clients, wslb and workers")
    return report


def print_report(r: dict[str, Any]) -> None:
    p, o, h, rss, fds, k, cpu = (
        r["plan"],
        r["open"],
        r["held"],
        r["rss"],
        r["fds"],
        r["kernel"]["open"],
        r["cpu"],
    )
    m = r["machine"]
    print(f"date: {r['date']}; command: {r['command']}")
    print(f"machine: {machine_line(m)}; {m['lscpu']}; load average at end {m['loadavg']}")
    print(f"wslb: {m['wslb']}")
    print(
        f"setup: wslb workers: {p['wslb_processes']} (+ supervisor), {p['raw_workers']} raw "
        f"workers, {p['client_processes']} client processes over {p['source_addresses']} "
        f"source addresses (nice {p['load_generator_nice']}), RLIMIT_NOFILE "
        f"{p['rlimit_nofile']}; heartbeat: "
        f"timeouts.ping_interval {p['ping_interval_s']:g}s"
        + (" (default)" if p["ping_interval_default"] else "")
        + f"; {p['streaming']:,} streaming at {p['rate']:g} tokens/s"
    )
    print(
        f"opened: {o['opened']:,} of {p['sessions']:,} in {o['seconds']:.1f}s "
        f"({o['per_s']:,.0f}/s), {o['failed']} failed; wslb cpu {o['wslb_cpu']['wslb_pct']:.0f}% "
        f"of a core while opening, {o['wslb_us_per_handshake']:.0f} us per handshake (both "
        f"legs; {o.get('wslb_us_per_handshake_net', math.nan):.0f} less the heartbeat of the "
        f"sessions already open); workers {o['wslb_cpu']['workers_pct']:.0f}%, clients "
        f"{o['wslb_cpu']['clients_pct']:.0f}%, machine {o['wslb_cpu']['machine_pct']:.0f}%"
    )
    print(
        f"held: {h['open_at_end']:,} open at the end of a {h['hold_s']:.0f}s hold "
        f"(all open: {h['all_open']}; closed during it: {h['closed_during_hold']}; workers "
        f"hold {h['worker_websockets_open']:,}; wslb_sessions_active "
        f"{h['wslb_sessions_active']})"
    )
    print(
        f"wslb rss: {rss['before_mb']:.0f} MB before, {rss['after_open_mb']:.0f} MB open, "
        f"{rss['end_mb']:.0f} MB at the end: {rss['kb_per_session']:.2f} KB/session "
        f"({rss['kb_per_session_end']:.2f} at the end)"
    )
    print(
        f"kernel (machine-wide, 4 sockets per session): slab +{k['slab_mb']:.0f} MB, TCP "
        f"buffers +{k['tcp_buffers_mb']:.1f} MB: {k['kb_per_session']:.2f} KB/session "
        f"({k['kb_per_socket']:.2f} KB/socket; socket caches only "
        f"{k['socket_caches_kb_per_session']:.2f}); largest caches KB/session "
        + ", ".join(f"{n} {v:.2f}" for n, v in k["top_caches_kb_per_session"].items())
    )
    print(
        f"fds: {fds['after_open']:,} in wslb ({fds['per_session']:.2f}/session), at most "
        f"{fds['max_per_process']:,} in one process: {fds['per_process']}"
    )
    i, s, b = cpu["idle"], cpu["stream"], cpu["baseline"]
    print(f"cpu baseline ({b['seconds']:.0f}s, no sessions): wslb {b['wslb_pct']:.1f}% of a core")
    print(
        f"cpu idle window ({i['seconds']:.0f}s): wslb {i['wslb_pct']:.1f}% of a core "
        f"({i['wslb_sys_pct']:.1f}% kernel), {i['pings']:,.0f} pings answered "
        f"({cpu['pings_per_s_idle']:,.0f}/s): {cpu['us_per_ping']:.1f} us of wslb CPU per ping "
        f"above the baseline; "
        f"workers {i['workers_pct']:.0f}%, clients {i['clients_pct']:.0f}%, others "
        f"{i['others_pct']:.0f}%; machine {i['machine_pct']:.0f}% (softirq {i['softirq_pct']:.0f}%)"
    )
    print(
        f"cpu stream window ({s['seconds']:.0f}s): wslb {s['wslb_pct']:.1f}% "
        f"({s['wslb_sys_pct']:.1f}% kernel), {cpu['us_per_frame_stream']:.1f} us/frame above "
        f"the idle window; workers {s['workers_pct']:.0f}%, clients {s['clients_pct']:.0f}%, "
        f"others {s['others_pct']:.0f}%; machine {s['machine_pct']:.0f}% (softirq "
        f"{s['softirq_pct']:.0f}%); run-queue wait per CPU-second ran: wslb "
        f"{s['wslb_runq_wait_per_run']:.2f}, workers {s['workers_runq_wait_per_run']:.2f}, "
        f"clients {s['clients_runq_wait_per_run']:.2f}; {r['frames']['per_s']:,.0f} frames/s "
        f"(offered {r['frames']['offered_per_s']:,.0f})"
    )
    lat, d = r["latency"], r["latency_direct"]
    print(
        f"latency of the streaming sessions: p50 {lat['p50_us']:.0f} us, p99 "
        f"{lat['p99_us']:.0f} us, p99.9 {lat['p999_us']:.0f} us ({lat['n']:,} frames); direct "
        f"p50/p99 {d['p50_us']:.0f}/{d['p99_us']:.0f} us; per window p99 "
        + ", ".join(f"{w['lat_p99_us']:.0f}" for w in r["windows"])
    )
    print(
        f"pings per session and leg over the hold: {r['pings']['per_session_leg']:.2f} "
        f"(hold / interval = {r['pings']['expected_per_session_leg']:.2f})"
    )
    for x in r["warnings"]:
        print(f"WARNING: {x}")
    for x, n in r["wslb"]["log_problems"].items():
        print(f"wslb log: {n} x {x}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Hold --sessions WebSocket sessions through one wslb (workers: N): open "
        "time, RSS and kernel memory per session, fds, heartbeat CPU, streaming latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2,000 sessions, short hold")
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--stream-share", type=float, default=0.01, help="share of sessions streaming")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per streaming session")
    p.add_argument("--control", type=int, default=-1, help="direct sessions (-1: streaming/5)")
    p.add_argument("--processes", type=int, default=0, help="wslb workers: N (0: from sessions)")
    p.add_argument("--per-process", type=int, default=8500, help="sessions per wslb process")
    p.add_argument("--backends", type=int, default=0, help="raw worker processes (0: auto)")
    p.add_argument("--clients", type=int, default=0, help="client processes (0: auto)")
    p.add_argument("--sources", type=int, default=100, help="client source addresses 127.0.2.x")
    p.add_argument("--concurrency", type=int, default=600, help="handshakes in flight, in all")
    p.add_argument(
        "--ping-interval",
        type=float,
        default=None,
        help="seconds, also ping_timeout (default: wslb's, 20 s)",
    )
    p.add_argument("--baseline-window", type=float, default=10.0, help="s with no sessions")
    p.add_argument("--idle-window", type=float, default=40.0, help="s of heartbeat only")
    p.add_argument("--stream-window", type=float, default=60.0, help="s of 1%% streaming")
    p.add_argument("--windows", type=int, default=3, help="sub-windows of the stream window")
    p.add_argument("--warmup", type=float, default=2.0, help="s between go and the stream window")
    p.add_argument(
        "--wslb-src",
        default=str(ROOT),
        help="run wslb from this source tree (e.g. a `git worktree` of the commit under test)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness of the workers and clients (0: same priority as wslb)",
    )
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--logs", default=None, help="keep the processes' logs and configs here")
    p.add_argument("--force", action="store_true", help="run despite failed system checks")
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.client_spec is not None:
        return run_uvloop(_client, args.client_spec)
    if args.worker_spec is not None:
        return run_uvloop(_worker, args.worker_spec)
    if args.quick:
        given = {a for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        quick = {
            "sessions": 2000,
            "ping_interval": 2.0,
            "idle_window": 5.0,
            "baseline_window": 2.0,
            "stream_window": 6.0,
            "warmup": 1.0,
            "stream_share": 0.05,
        }
        for k, v in quick.items():
            if f"--{k.replace('_', '-')}" not in given:
                setattr(args, k, v)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    nofile = raise_nofile(1 << 20)[0]
    plan = make_plan(args)
    problems, notes = check_system(plan)
    log(f"[check] RLIMIT_NOFILE {nofile}")
    for n in notes:
        log(f"  {n}")
    for x in problems:
        log(f"  MISSING: {x}")
    if problems and not args.force:
        log("system checks failed (--force runs anyway)")
        return 2
    with contextlib.ExitStack() as stack:
        root = Path(args.logs) if args.logs else None
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wslb-scale-")))
        root.mkdir(parents=True, exist_ok=True)
        try:
            report = execute(args, plan, root)
        except KeyboardInterrupt:
            log("interrupted")
            return 130
    report["checks"] = {"problems": problems, "notes": notes}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["held"]["all_open"] else 1


if __name__ == "__main__":
    sys.exit(main())
