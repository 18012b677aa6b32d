"""wslb seen from outside, as the benchmarks measure it: its log's problems and timestamps, its
Prometheus metrics, its admin API (async, for the clients' event loop), a wslb that spawns its
workers and when it is ready, and its process's FDs and figures.

The FD checks name each socket by port, so that wslb's pooled HTTP connections to its workers
(scrapes, health checks) can be told from a leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import os
import re
import secrets
import socket
import time
import urllib.error
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

from bench.lib.launch import Procs, Wslb, free_port

__all__ = [
    "HTTP_POOL_PER_WORKER",
    "Admin",
    "ProcStats",
    "PromHistogram",
    "fd_diff",
    "fd_table",
    "fds_settled",
    "log_problems",
    "log_time",
    "metric",
    "port_names",
    "proc_stats",
    "prom_by_label",
    "prom_histogram",
    "spawning_wslb",
    "start_ready",
    "wait_active",
    "workers_up",
]

HOST = "127.0.0.1"
# wslb's aiohttp client for scrapes and health checks keeps up to this many keep-alive
# connections per worker (balancer/aio/app.py: limit_per_host=4).
HTTP_POOL_PER_WORKER = 4


# -- its log and metrics -----------------------------------------------------------------------


_ADDR = re.compile(r"0x[0-9a-f]+|\b\d+\.\d+\.\d+\.\d+(:\d+)?\b|session \S+|pid \d+")


def log_problems(text: str) -> Counter[str]:
    """wslb's ERROR and WARNING lines, and the exception ending each traceback, counted by
    message (addresses, session ids and pids folded so repeats count together)."""
    out: Counter[str] = Counter()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\S+(?: \S+)? (ERROR|WARNING|CRITICAL) (\S+): (.*)", line)
        if m:
            out[f"{m[1]} {m[2]}: {_ADDR.sub('_', m[3])[:120]}"] += 1
        elif line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                j += 1
            if j < len(lines):
                out[f"  raised {_ADDR.sub('_', lines[j])[:160]}"] += 1
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` (exactly) in a Prometheus text exposition."""
    out: list[tuple[dict[str, str], float]] = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE.match(line)
        if m is None or m[1] != name:
            continue
        with contextlib.suppress(ValueError):
            out.append((dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return out


def prom_by_label(text: str, name: str, label: str) -> Counter[str]:
    """A labelled counter (``wslb_failovers_total{result=...}``) as label value -> count, summed
    over its other labels."""
    out: Counter[str] = Counter()
    for labels, value in _samples(text, name):
        out[labels.get(label, "")] += int(value)
    return out


@dataclass
class PromHistogram:
    """One unlabelled Prometheus histogram: cumulative counts by upper bound, ``+Inf`` last."""

    buckets: list[tuple[float, int]]
    count: int
    sum: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile ``q`` in [0, 100] (a bound, not an
        estimate: the exposition has nothing finer); ``inf`` past the last finite bound, NaN
        when empty."""
        if not self.count:
            return math.nan
        rank = q / 100.0 * self.count
        for bound, cum in self.buckets:
            if cum >= rank and cum > 0:
                return bound
        return math.inf


def prom_histogram(text: str, name: str) -> PromHistogram:
    """Histogram ``name`` (``_bucket``, ``_count``, ``_sum``) of an exposition; empty if absent."""
    buckets = sorted(
        (float(labels["le"]), int(v))
        for labels, v in _samples(text, f"{name}_bucket")
        if "le" in labels
    )
    count = sum(int(v) for _, v in _samples(text, f"{name}_count"))
    total = sum(v for _, v in _samples(text, f"{name}_sum"))
    return PromHistogram(buckets, count, total)


class Admin:
    """``wslb``'s admin API, every request with its bearer token."""

    def __init__(self, http: aiohttp.ClientSession, wslb: Wslb) -> None:
        self.http = http
        self.base = f"http://127.0.0.1:{wslb.admin_port}"
        self.headers = wslb.auth

    async def get(self, path: str) -> Any:
        async with self.http.get(
            self.base + path, headers=self.headers, timeout=aiohttp.ClientTimeout(10)
        ) as r:
            r.raise_for_status()
            if path == "/metrics":
                return await r.text()
            return await r.json()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        # json= sends Content-Type: application/json, which the admin API requires (else 415).
        async with self.http.post(
            self.base + path, json=body, headers=self.headers, timeout=aiohttp.ClientTimeout(10)
        ) as r:
            return r.status, await r.json(content_type=None)


def log_time(stamp: str) -> float:
    """A log line's time as a Unix time: ISO 8601 with its zone (wslb's and its workers'), or
    an older ``logging`` asctime (local time, ``,`` before the ms)."""
    return dt.datetime.fromisoformat(stamp.replace(",", ".")).timestamp()


async def wait_active(admin: Admin, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        backends = await admin.get("/backends")
        if all(b["state"] == "active" and b.get("healthy", True) for b in backends):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"backends not active after {timeout:g}s: {backends}")


# -- a wslb that spawns its workers; its process from outside ---------------------------------


def spawning_wslb(
    procs: Procs,
    workers: int,
    handshake_timeout: float,
    tokens_per_s: float,
    per_client: int | None = None,
    command: Sequence[str] | None = None,
) -> Wslb:
    """wslb with ``spawn: reference`` workers, its config and log in ``procs.logdir``, not yet
    started; ``command`` replaces ``python -m balancer`` (the soak's --tracemalloc wrapper)."""
    backends = [
        {
            "id": f"w{i + 1}",
            "url": f"ws://{HOST}:{free_port()}/ws",
            "spawn": "reference",
            "args": ["--tokens-per-s", f"{tokens_per_s:g}"],
        }
        for i in range(workers)
    ]
    config: dict[str, Any] = {
        "pools": [
            {
                "name": "chat",
                "balance": "consistent",
                # The HTTP probe, not the default TCP connect: a worker that got SIGTERM
                # (soak's --kill-signal TERM) says "draining" there and wslb moves its
                # sessions away; HTTP_POOL_PER_WORKER counts these checks' connections.
                "health": {"path": "/healthz"},
                "backends": backends,
            }
        ],
        "timeouts": {
            "handshake": f"{handshake_timeout:g}s",
            "ping_interval": "20s",
            "idle": "1h",
        },
        "limits": {"max_connections": 10000},
    }
    if per_client is not None:
        config["limits"]["max_connections_per_client"] = per_client
    token = secrets.token_urlsafe(32)
    return Wslb(config, procs.logdir, procs=procs, name="wslb", token=token, command=command)


def workers_up(backends: list[dict[str, Any]]) -> bool:
    return bool(backends) and all(b["state"] == "active" and b["healthy"] for b in backends)


def start_ready(wslb: Wslb, timeout: float = 30.0) -> None:
    """Start wslb; until its backends are active and healthy (its workers up), ``timeout`` s in
    all at most. Raises with its log's tail."""
    deadline = time.monotonic() + timeout
    try:
        wslb.start(wait_ready=False, timeout=timeout)
        wslb.wait_ready(max(0.1, deadline - time.monotonic()), until=workers_up)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{exc}:\n{wslb.log_tail()}") from None
    wslb.children()  # its workers: stop() kills any left behind, even after wslb is gone


def port_names(wslb: Wslb) -> dict[int, str]:
    """Port -> role (listener, admin, worker id), to name wslb's sockets."""
    names = {wslb.port: "listener", wslb.admin_port: "admin"}
    for b in wslb.config["pools"][0]["backends"]:
        names[int(b["url"].rsplit(":", 1)[1].split("/", 1)[0])] = f"worker {b['id']}"
    return names


@dataclass
class ProcStats:
    """wslb's own figures at one moment."""

    rss_mb: float
    fds: int
    tasks: int | None  # asyncio tasks (GET /debug/stats), None when the hook is missing
    threads: int
    connections: int | None  # live client connections per wslb


def proc_stats(wslb: Wslb) -> ProcStats:
    p = psutil.Process(wslb.pid)
    rss = p.memory_info().rss / 2**20
    fds = p.num_fds()
    threads = p.num_threads()
    tasks: int | None = None
    conns: int | None = None
    try:
        dbg = wslb.admin("/debug/stats")
        tasks, conns = int(dbg["tasks"]), int(dbg["connections"])
    except (OSError, ValueError, KeyError, urllib.error.HTTPError):
        pass
    if conns is None:
        conns = metric(wslb, "wslb_connections_active")
    return ProcStats(round(rss, 1), fds, tasks, threads, conns)


def fd_table(pid: int, names: dict[int, str]) -> Counter[str]:
    """wslb's open FDs by kind: sockets by state and peer (``names``: port -> role, so
    ephemeral ports fold together), other files by their /proc/PID/fd target."""
    out: Counter[str] = Counter()
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="all")
        fds = os.listdir(f"/proc/{pid}/fd")
    except (psutil.Error, OSError):
        return out
    sockets = 0
    for c in conns:
        if c.fd < 0:
            continue
        sockets += 1
        if c.type == socket.SOCK_STREAM and c.laddr:
            lport = c.laddr[1]
            if c.status == psutil.CONN_LISTEN:
                out[f"tcp LISTEN {names.get(lport, lport)}"] += 1
                continue
            rport = c.raddr[1] if c.raddr else None
            if lport in names:
                out[f"tcp {c.status} on {names[lport]} from a client"] += 1
            elif rport in names:
                out[f"tcp {c.status} to {names[rport]}"] += 1
            else:
                out[f"tcp {c.status} other"] += 1
        else:
            out[f"socket {c.family.name} {c.type.name}"] += 1
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                continue
            kind = target.split(":", 1)[0] if ":" in target else target
            out[kind] += 1
    unmatched = sum(1 for fd in fds if _is_socket(pid, fd)) - sockets
    if unmatched > 0:
        out["socket (unix or unlisted)"] += unmatched
    return out


def _is_socket(pid: int, fd: str) -> bool:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return False


def fds_settled(before: Counter[str], after: Counter[str], workers: int) -> bool:
    """FDs back to the baseline, except wslb's pooled HTTP connections to the workers (scrapes
    and health checks, keep-alive), which may differ within their bound."""
    pooled = "tcp ESTABLISHED to worker"
    rest_ok = all(after[k] <= before[k] for k in after if not k.startswith(pooled))
    return rest_ok and sum(after[k] for k in after if k.startswith(pooled)) <= (
        HTTP_POOL_PER_WORKER * workers
    )


def fd_diff(before: Counter[str], after: Counter[str]) -> str:
    keys = sorted(set(before) | set(after))
    parts = [f"{k}: {before[k]} -> {after[k]}" for k in keys if before[k] != after[k]]
    return "; ".join(parts) or "none"


def metric(wslb: Wslb, name: str, labels: str = "") -> int | None:
    """A sample of wslb's Prometheus metrics, e.g. ``wslb_handshake_rejections_total``,
    ``{status="408"}``; None when absent."""
    try:
        text = wslb.admin("/metrics")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if key == name + labels or (not labels and key == name):
                return int(float(value))
    return None
