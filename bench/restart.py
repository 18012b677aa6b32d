#!/usr/bin/env python3
"""Hot-restart benchmark: what live sessions see when wslb's code is replaced under them
(``POST /restart``, ``balancer/aio/restart.py``), beside nginx and HAProxy reloading.

For each ``--sessions`` count N the script starts wslb with ``--workers`` reference workers it
spawns itself (``spawn: reference``, resume on, an explicit admin token; ``--wslb-workers`` sets
its ``workers:``, the serving processes under one supervisor), opens N sessions
through it from this process (aiohttp, uvloop when installed): ``--streaming-fraction`` of them
stream long answers (``--rate`` tokens/s, asking again when done; every token checked once, in
order, with the text ``backends.model.token_text`` gives it), the rest are idle (half send a
WebSocket ping every ``--idle-ping`` s, half just stay open). After ``--warmup`` s it restarts
wslb ``--restarts`` times, ``--gap`` s apart, and records:

- **pause, client view**: per streaming session and restart, the largest gap between two
  messages from the ``POST /restart`` to its answer (plus ``STALL_SLACK``) minus that session's
  median gap;
- **pause, wslb view**: the answer's ``pause_ms`` (p50/p99/max of the sessions it moved);
- the answer's ``seconds``; the time from the answer until the old code is gone (its pid gone;
  the first restart's old pid stays as the keeper, so there: until it has ``exec``ed the
  keeper; with ``workers: N`` every old serving pid in the answer's ``old`` list gone, the
  supervisor stays and there is no keeper); the RSS of wslb's processes (keeper or supervisor
  + every serving process, not the workers) before the first restart and after the last;
- **sessions lost**: any session closed or failed on the client side, or with a token missing,
  duplicated, out of order or with the wrong text. Must be 0.
- moved / not moved, from the answers.

Then the peers, with the same sessions in front of the same reference workers (started by
``bench.lib.launch.Worker``): nginx reloaded with ``nginx -s reload`` and HAProxy in
master-worker mode reloaded with ``kill -USR2``, as many times and as far apart: how many
sessions the reloads close, how long the old worker processes live on (watched for
``--peer-watch`` s at most) and their RSS. A peer that is not installed is skipped, and the
report says so.

SIGTERM stops the script as Ctrl-C does: every process it started is stopped (in the event
loop through ``loop.add_signal_handler``, which cancels the run; a handler that raises
``KeyboardInterrupt`` is swallowed there when it fires inside a transport's callback, as uvloop
calls those, and the loop resets SIGTERM to the default when it closes).

Not a test: pytest collects only ``tests/``. Run ``python bench/restart.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.chat import LagMonitor, Stream, open_session  # noqa: E402
from bench.lib.launch import WORKER_TOKEN, Procs, Worker, Wslb, free_port, wait_port  # noqa: E402
from bench.lib.machine import command_output, machine, machine_line, tree_state  # noqa: E402
from bench.lib.script import log, parse_sizes, raise_nofile, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import summary  # noqa: E402
from bench.lib.wslb import Admin, log_problems, start_ready  # noqa: E402

HOST = "127.0.0.1"
CONNECT_PARALLEL = 64  # WebSocket handshakes in flight while opening the sessions
STALL_SLACK = 0.3  # seconds after a restart's answer still searched for its gap
RESTART_TIMEOUT = 180.0  # seconds for one POST /restart to answer
GONE_TIMEOUT = 30.0  # seconds the old code is watched for after an answer
CLOSE_TIMEOUT = 15.0  # seconds for the client to close its sessions at the end
NOFILE = 20000  # the open-files limit the issue names (the hard limit here)

TARGET_PAUSE_MS = 100.0  # client-view pause p99 at 1000 sessions
TARGET_GONE_S = 5.0  # old code gone
TARGET_LOST = 0


# -- the sessions -------------------------------------------------------------------------------


@dataclass
class Idle:
    """An idle session: the hello, then nothing (or a ping every ``ping`` s) until the end."""

    sid: str
    ping: float | None
    connected: bool = False
    closes: int = 0
    close_info: str = ""
    stopping: bool = False
    ws: aiohttp.ClientWebSocketResponse | None = None

    async def run(self, http: aiohttp.ClientSession, url: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            self.ws, _ = await open_session(http, url, self.sid)
            self.connected = True
        pinger = asyncio.ensure_future(self._pings()) if self.ping else None
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is aiohttp.WSMsgType.TEXT:
                    continue  # nothing is expected; not an error either
                if not self.stopping:
                    self.closes += 1
                    self.close_info = f"{msg.type.name} {self.ws.close_code} {msg.extra!r}"
                return
        finally:
            if pinger is not None:
                pinger.cancel()

    async def _pings(self) -> None:
        assert self.ws is not None and self.ping is not None
        await asyncio.sleep(self.ping * (hash(self.sid) % 1000) / 1000)  # spread them
        while not self.ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.ping()
            await asyncio.sleep(self.ping)


@dataclass
class Fleet:
    """N sessions through one proxy: streams and idle ones, and their tasks."""

    streams: list[Stream]
    idles: list[Idle]
    tasks: list[asyncio.Future[None]] = field(default_factory=list)

    @property
    def all(self) -> list[Stream | Idle]:
        return [*self.streams, *self.idles]

    def failed(self) -> list[str]:
        return [s.sid for s in self.all if not s.connected]

    def lost(self) -> dict[str, int]:
        """Sessions lost (each counted once), and the problems behind them."""
        out: Counter[str] = Counter()
        bad = 0
        for s in self.streams:
            kinds = {
                "not_connected": not s.connected,
                "closed": s.closes > 0,
                "tokens_lost": s.lost > 0,
                "duplicated": s.duplicated > 0,
                "out_of_order": s.out_of_order > 0,
                "bad_text": s.bad_text > 0,
                "unexpected": s.unexpected > 0,
            }
            out.update(k for k, v in kinds.items() if v)
            bad += any(kinds.values())
        for i in self.idles:
            kinds = {"not_connected": not i.connected, "closed": i.closes > 0}
            out.update(k for k, v in kinds.items() if v)
            bad += any(kinds.values())
        return {"sessions": bad, **dict(out)}

    def closed(self) -> int:
        return sum(1 for s in self.all if s.closes > 0)


def make_fleet(tag: str, n: int, fraction: float, answer: int, ping: float) -> Fleet:
    k = min(n, max(0, round(n * fraction)))
    streams = [Stream(f"{tag}-s{i}", answer) for i in range(k)]
    idles = [Idle(f"{tag}-i{i}", ping if i % 2 == 0 else None) for i in range(n - k)]
    return Fleet(streams, idles)


async def open_fleet(fleet: Fleet, http: aiohttp.ClientSession, url: str, n: int) -> None:
    """Open every session (bounded: 30 s + 20 ms per session)."""
    gate = asyncio.Semaphore(CONNECT_PARALLEL)
    fleet.tasks = [asyncio.ensure_future(s.run(http, url, gate)) for s in fleet.all]
    deadline = time.monotonic() + 30.0 + 0.02 * n
    pairs = list(zip(fleet.all, fleet.tasks, strict=True))
    while not all(s.connected or t.done() for s, t in pairs):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    errors = Counter(
        repr(t.exception())[:120] for s, t in pairs if t.done() and not s.connected and
        not t.cancelled() and t.exception() is not None
    )  # fmt: skip
    for e, k in errors.most_common(3):
        log(f"  {k} session(s) failed to connect: {e}")
    if len(fleet.failed()) == len(fleet.all):
        raise RuntimeError("no session could connect")


async def close_fleet(fleet: Fleet) -> None:
    for s in fleet.all:
        s.stopping = True
    closing = [
        asyncio.ensure_future(s.ws.close()) for s in fleet.all if s.ws is not None and
        not s.ws.closed
    ]  # fmt: skip
    if closing:
        await asyncio.wait(closing, timeout=CLOSE_TIMEOUT)
    for t in fleet.tasks:
        t.cancel()
    await asyncio.gather(*fleet.tasks, return_exceptions=True)
    for s in fleet.streams:
        s.finish()


def client_pauses(fleet: Fleet, windows: Sequence[tuple[float, float]]) -> list[float]:
    """Per streaming session and window: largest gap ending in it minus the median gap (ms)."""
    out: list[float] = []
    for s in fleet.streams:
        t = s.times
        if len(t) < 5:
            continue
        median = statistics.median(t[k] - t[k - 1] for k in range(1, len(t)))
        for t0, t1 in windows:
            window = [t[k] - t[k - 1] for k in range(1, len(t)) if t0 <= t[k] <= t1]
            if window:
                out.append(max(0.0, max(window) - median) * 1e3)
    return out


# -- wslb ---------------------------------------------------------------------------------------


def wslb_config(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """As the repo's balancer.yaml: ``spawn: reference`` backends, resume on."""
    backends = [
        {
            "id": f"w{i + 1}",
            "url": f"ws://{HOST}:{free_port()}",
            "spawn": "reference",
            "args": ["--tokens-per-s", f"{args.rate:g}", "--max-batch", "100000"],
        }
        for i in range(args.workers)
    ]
    return {
        "workers": args.wslb_workers,
        "pools": [
            {
                "name": "chat",
                "match": {"path_prefix": "/"},
                "session_key": ["query:session"],
                "balance": "consistent",
                "hash_balance_factor": 1.25,
                "health": {"interval": "2s", "timeout": "1s", "rise": 2, "fall": 3,
                           "path": "/healthz"},
                "resume": {"enabled": True, "grace": "30s", "buffer": "1MiB"},
                "backends": backends,
            }
        ],
        "timeouts": {"handshake": "10s", "connect": "5s", "idle": "1h",
                     "ping_interval": "20s", "ping_timeout": "20s", "close": "5s"},
        "limits": {"max_connections": n + 1000, "max_connections_per_client": n + 1000},
    }  # fmt: skip


def remember(seen: dict[int, psutil.Process], pid: int) -> None:
    """``pid`` and its descendants (spawned workers), to kill at the end if they outlive wslb
    (a keeper that died leaves the serving process and workers to init)."""
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        for q in [p, *p.children(recursive=True)]:
            seen[q.pid] = q


def kill_left(wslb: Wslb, seen: dict[int, psutil.Process]) -> None:
    """Stop wslb (SIGTERM to the keeper), then SIGKILL whatever of it is left."""
    for pid in list(seen):
        remember(seen, pid)
    if wslb.proc is not None:
        wslb.stop(10.0)
    for q in seen.values():
        with contextlib.suppress(psutil.Error):
            q.kill()  # psutil checks first that the pid is still that process
            q.wait(5)


SERVING_MODULE = "balancer.aio.serving"  # a serving process of workers: N (balancer/aio/multi.py)


def serving_children(supervisor: int) -> list[int]:
    """The serving processes of a ``workers: N`` supervisor (its children running
    ``SERVING_MODULE``; not the spawned workers, nor a zombie)."""
    out: list[int] = []
    with contextlib.suppress(psutil.Error):
        for q in psutil.Process(supervisor).children():
            with contextlib.suppress(psutil.Error):
                if q.status() != psutil.STATUS_ZOMBIE and SERVING_MODULE in " ".join(q.cmdline()):
                    out.append(q.pid)
    return sorted(out)


def wslb_pids(wslb: Wslb, workers: int) -> tuple[int | None, list[int]]:
    """(keeper or supervisor, serving pids). Standalone, from ``GET /version`` (before any
    restart the keeper is None); with ``workers: N`` the supervisor is the pid that started
    wslb (it stays) and the serving processes are its children."""
    if workers > 1:
        return wslb.pid, serving_children(wslb.pid)
    v = wslb.admin("/version")
    keeper = v.get("keeper")
    return (int(keeper) if keeper else None), [int(v["pid"])]


def wslb_rss_mb(wslb: Wslb, workers: int) -> tuple[float, int]:
    """RSS of the keeper or supervisor plus every serving process, and how many serving."""
    top, serving = wslb_pids(wslb, workers)
    return rss_mb([top, *serving]), len(serving)


def pids_of(side: Any) -> list[int]:
    """The pids in an answer's ``old`` or ``new``: one {pid, ...} standalone, a list of them
    with ``workers: N``."""
    return [int(x["pid"]) for x in (side if isinstance(side, list) else [side])]


def per_process(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The standalone-shaped answers in ``answer``: its ``processes`` (``workers: N``), or
    itself."""
    procs = answer.get("processes")
    return list(procs) if isinstance(procs, list) and procs else [answer]


def rss_mb(pids: Sequence[int | None]) -> float:
    total = 0
    for pid in pids:
        if pid is None:
            continue
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def is_keeper(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return "balancer.keeper" in " ".join(psutil.Process(pid).cmdline())
    return False


def old_code_alive(pid: int, keeper: int) -> bool:
    """The old code still runs in ``pid``: it exists (and is no zombie); or, for the keeper's
    pid, it has not yet ``exec``ed the keeper."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    return not (pid == keeper and is_keeper(pid))


async def wait_gone(pids: Sequence[int], keeper: int, since: float) -> float:
    """Seconds from ``since`` until the old code is gone from every one of ``pids``; NaN past
    ``GONE_TIMEOUT``."""
    while time.monotonic() - since < GONE_TIMEOUT:
        if not any(old_code_alive(pid, keeper) for pid in pids):
            return time.monotonic() - since
        await asyncio.sleep(0.01)
    return math.nan


@dataclass
class RestartOne:
    answer: dict[str, Any]
    status: int
    client_s: float  # POST to answer, client's clock
    gone_s: float  # answer to old code gone
    window: tuple[float, float]
    old_rss_mb: float  # the old serving processes' RSS just after the answer (0: gone)


@dataclass
class WslbResult:
    sessions: int
    streaming: int
    restarts: list[RestartOne]
    client_pause_ms: dict[str, float]
    wslb_pause_ms: dict[str, float]  # over the answers' p50s/p99s/maxes: the worst of each
    rss_before_mb: float
    rss_after_mb: float
    serving: tuple[int, int]  # serving processes counted in the RSS, before and after
    lost: dict[str, int]
    moved: int
    not_moved: dict[str, int]
    connect_failed: int
    client_lag_ms: dict[str, float]
    log_problems: dict[str, int]
    started_pid: int  # the pid that started wslb (keeper or supervisor, it must stay)
    keeper_exit: int | None  # the pid that started wslb exited during the run: its status


async def wslb_run(args: argparse.Namespace, n: int, logdir: Path) -> WslbResult:
    with Procs(logdir) as procs:
        wslb = Wslb(
            wslb_config(args, n), logdir, procs=procs, name="wslb", token=secrets.token_urlsafe(32)
        )
        start_ready(wslb, timeout=60.0)
        seen: dict[int, psutil.Process] = {}
        remember(seen, wslb.pid)
        procs.on_close(lambda: kill_left(wslb, seen))
        fleet = make_fleet(f"r{n}", n, args.streaming_fraction, answer_tokens(args), args.idle_ping)
        restarts: list[RestartOne] = []
        lag = LagMonitor()
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            aiohttp.ClientSession() as admin_http,
        ):
            admin = Admin(admin_http, wslb)
            try:
                lag.start()
                await open_fleet(fleet, http, wslb.url, n)
                log(f"wslb N={n}: {n - len(fleet.failed())} sessions open "
                    f"({len(fleet.streams)} streaming); warmup {args.warmup:g}s")  # fmt: skip
                await asyncio.sleep(args.warmup)
                rss_before, serving_before = wslb_rss_mb(wslb, args.wslb_workers)
                gone_tasks: list[asyncio.Task[float]] = []
                for r in range(args.restarts):
                    if r:
                        await asyncio.sleep(args.gap)
                    t0 = time.monotonic()
                    async with admin_http.post(
                        admin.base + "/restart",
                        json={},
                        headers=admin.headers,
                        timeout=aiohttp.ClientTimeout(RESTART_TIMEOUT),
                    ) as resp:
                        status, body = resp.status, await resp.json(content_type=None)
                    t1 = time.monotonic()
                    if status != 200 or not body.get("ok"):
                        raise RuntimeError(f"restart {r + 1} answered {status}: {body}")
                    olds = pids_of(body["old"])
                    old_rss = rss_mb([p for p in olds if old_code_alive(p, wslb.pid)])
                    gone_tasks.append(asyncio.create_task(wait_gone(olds, wslb.pid, t1)))
                    restarts.append(RestartOne(body, status, t1 - t0, math.nan, (t0, t1), old_rss))
                    for pid in pids_of(body["new"]):
                        remember(seen, pid)  # killed at the end if left over
                    log(f"  restart {r + 1}: {body['seconds']}s, sessions {body['sessions']}, "
                        f"pause_ms {body['pause_ms']}")  # fmt: skip
                for one, task in zip(restarts, gone_tasks, strict=True):
                    one.gone_s = await task
                await asyncio.sleep(args.after)
                rss_after, serving_after = wslb_rss_mb(wslb, args.wslb_workers)
            finally:
                await close_fleet(fleet)
                await lag.stop()
        wslb.children()
        assert wslb.proc is not None
        keeper_exit = wslb.proc.poll()  # it must outlive every restart (it is the keeper)
        problems = log_problems(wslb.output())
    windows = [(x.window[0], x.window[1] + STALL_SLACK) for x in restarts]
    pauses = client_pauses(fleet, windows)
    t_first, t_last = windows[0][0], windows[-1][1]
    lags = lag.window(t_first, t_last)
    not_moved: Counter[str] = Counter()
    for x in restarts:
        not_moved.update(x.answer["sessions"].get("not_moved") or {})

    def worst(key: str) -> float:
        vals = [a["pause_ms"].get(key) for x in restarts for a in per_process(x.answer)]
        nums = [float(v) for v in vals if v is not None]
        return max(nums) if nums else math.nan

    return WslbResult(
        sessions=n,
        streaming=len(fleet.streams),
        restarts=restarts,
        client_pause_ms=summary(pauses, (50, 99)),
        wslb_pause_ms={"p50": worst("p50"), "p99": worst("p99"), "max": worst("max")},
        rss_before_mb=rss_before,
        rss_after_mb=rss_after,
        serving=(serving_before, serving_after),
        lost=fleet.lost(),
        moved=sum(int(x.answer["sessions"].get("moved") or 0) for x in restarts),
        not_moved=dict(not_moved),
        connect_failed=len(fleet.failed()),
        client_lag_ms={
            "p99": summary(lags, (99,))["p99"] * 1e3,
            "max": max(lags, default=math.nan) * 1e3,
        },
        log_problems=dict(problems.most_common(8)),
        started_pid=wslb.pid,
        keeper_exit=keeper_exit,
    )


def answer_tokens(args: argparse.Namespace) -> int:
    """Long enough that a stream is in its first answer for the whole run (restarts included)."""
    seconds: float = args.warmup + args.restarts * (args.gap + 20) + args.after + 30
    rate: float = args.rate
    return math.ceil(rate * seconds)


# -- the peers: nginx and HAProxy reloading ----------------------------------------------------


def nginx_config(d: Path, port: int, workers: Sequence[Worker]) -> str:
    servers = "".join(f"    server {HOST}:{w.port};\n" for w in workers)
    temp = "".join(f"  {k}_temp_path {d}/{k};\n" for k in ("client_body", "proxy", "fastcgi",
                                                          "uwsgi", "scgi"))  # fmt: skip
    return f"""\
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {NOFILE};
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{
  worker_connections {NOFILE - 100};
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
    listen {HOST}:{port} backlog=4096;
    location / {{
      proxy_pass http://workers;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_set_header X-WSLB-Worker-Token "{WORKER_TOKEN}";
      proxy_read_timeout 1h;
      proxy_send_timeout 1h;
      proxy_buffering off;
    }}
  }}
}}
"""


def haproxy_config(port: int, workers: Sequence[Worker]) -> str:
    servers = "".join(f"  server {w.id} {HOST}:{w.port} check inter 2s\n" for w in workers)
    maxconn = (NOFILE - 200) // 2
    return f"""\
global
  maxconn {maxconn}
defaults
  mode http
  timeout connect 5s
  timeout client 1h
  timeout server 1h
  timeout tunnel 1h
  timeout http-request 10s
  maxconn {maxconn}
frontend fe
  bind {HOST}:{port}
  default_backend workers
backend workers
  balance url_param session
  hash-type consistent
  option httpchk GET /healthz
  http-request set-header X-WSLB-Worker-Token {WORKER_TOKEN}
{servers}"""


def peer_binary(kind: str) -> str | None:
    return shutil.which(kind) or next(
        (p for p in (f"/usr/sbin/{kind}", f"/usr/local/sbin/{kind}") if os.access(p, os.X_OK)),
        None,
    )


@dataclass
class PeerResult:
    kind: str
    sessions: int
    reloads: int
    closed: int  # sessions the reloads closed
    lost: dict[str, int]
    old_alive_s: list[float]  # per reload: how long its old workers lived (NaN: still alive)
    old_rss_mb: list[float]  # per reload: RSS of its old workers just after the reload
    old_alive_at_end: int  # old worker processes still alive at the end of the watch
    watch_s: float
    connect_failed: int


def worker_pids(master: int) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {p.pid for p in psutil.Process(master).children(recursive=True)}
    return set()


async def peer_run(
    kind: str, binary: str, args: argparse.Namespace, n: int, logdir: Path
) -> PeerResult:
    with Procs(logdir) as procs:
        workers = [
            Worker(f"w{k + 1}", ["--tokens-per-s", f"{args.rate:g}", "--max-batch", "100000"],
                   procs=procs, name=f"{kind}-w{k + 1}").start(timeout=20.0)
            for k in range(args.workers)
        ]  # fmt: skip
        port = free_port()
        d = logdir / kind
        d.mkdir(exist_ok=True)
        if kind == "nginx":
            conf = d / "nginx.conf"
            conf.write_text(nginx_config(d, port, workers))
            base = [binary, "-p", f"{d}/", "-c", str(conf), "-e", f"{d}/e.log"]
            proc = procs.spawn(kind, base)

            def reload() -> None:
                subprocess.run([*base, "-s", "reload"], timeout=10, check=True,
                               capture_output=True)  # fmt: skip
        else:
            conf = d / "haproxy.cfg"
            conf.write_text(haproxy_config(port, workers))
            proc = procs.spawn(kind, [binary, "-W", "-db", "-f", str(conf)])

            def reload() -> None:
                os.kill(proc.pid, signal.SIGUSR2)

        wait_port(port, 15.0, proc)
        fleet = make_fleet(f"{kind}{n}", n, args.streaming_fraction, answer_tokens(args),
                           args.idle_ping)  # fmt: skip
        alive_s: list[float] = []
        rss: list[float] = []
        left = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            try:
                await open_fleet(fleet, http, f"ws://{HOST}:{port}", n)
                log(f"{kind} N={n}: {n - len(fleet.failed())} sessions open; "
                    f"warmup {args.warmup:g}s")  # fmt: skip
                await asyncio.sleep(args.warmup)
                olds: list[tuple[set[int], float]] = []
                for r in range(args.restarts):
                    if r:
                        await asyncio.sleep(args.gap)
                    # this reload's old workers: not those an earlier reload left running
                    before = worker_pids(proc.pid).difference(*(pids for pids, _ in olds))
                    t = time.monotonic()
                    reload()
                    await asyncio.sleep(0.5)
                    rss.append(rss_mb(sorted(before)))
                    olds.append((before, t))
                    log(f"  {kind} reload {r + 1}: old workers {sorted(before)}, "
                        f"{rss[-1]:.1f} MB")  # fmt: skip
                alive_s = [math.nan] * len(olds)
                t_watch = time.monotonic()
                while time.monotonic() - t_watch < args.peer_watch:
                    for k, (pids, t) in enumerate(olds):
                        if math.isnan(alive_s[k]) and not any(
                            psutil.pid_exists(p) and not _zombie(p) for p in pids
                        ):
                            alive_s[k] = time.monotonic() - t
                    if not any(math.isnan(x) for x in alive_s):
                        break
                    await asyncio.sleep(0.05)
                left = sum(1 for pids, _ in olds for p in pids if psutil.pid_exists(p) and
                           not _zombie(p))  # fmt: skip
            finally:
                await close_fleet(fleet)
    return PeerResult(
        kind=kind,
        sessions=n,
        reloads=args.restarts,
        closed=fleet.closed(),
        lost=fleet.lost(),
        old_alive_s=alive_s,
        old_rss_mb=rss,
        old_alive_at_end=left,
        watch_s=args.peer_watch,
        connect_failed=len(fleet.failed()),
    )


def _zombie(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    return True


# -- report -------------------------------------------------------------------------------------


def f1(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1f}"


def f3(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def report(
    info: dict[str, Any],
    results: list[WslbResult],
    peers: list[PeerResult],
    skipped: dict[str, str],
    args: argparse.Namespace,
) -> str:
    out: list[str] = []
    w = out.append
    w(f"machine: {machine_line(info)}; loadavg before {info['loadavg']}")
    w(f"wslb tree: {info['tree']}")
    w(f"command: {info['command']}")
    w(
        f"load: {args.workers} spawned reference workers at {args.rate:g} tokens/s per stream; "
        f"{args.streaming_fraction:g} of the sessions stream, the rest idle (half ping every "
        f"{args.idle_ping:g}s); {args.restarts} restarts {args.gap:g}s apart after "
        f"{args.warmup:g}s; wslb with workers: {args.wslb_workers} "
        f"({'standalone' if args.wslb_workers == 1 else 'a supervisor and serving processes'})"
        f"; wslb, the workers and this client share the machine"
    )
    w("")
    w("| N | streaming | restarts | client pause p50/p99/max ms | wslb pause_ms p50/p99/max "
      "(worst answer) | answer seconds | old code gone s | RSS keeper/supervisor+serving MB "
      "before -> after | moved | not moved | sessions lost |")  # fmt: skip
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        c, p = r.client_pause_ms, r.wslb_pause_ms
        secs = "/".join(f3(float(x.answer.get("seconds", math.nan))) for x in r.restarts)
        gone = "/".join(f3(x.gone_s) for x in r.restarts)
        w(
            f"| {r.sessions} | {r.streaming} | {len(r.restarts)} | {f1(c['p50'])}/"
            f"{f1(c['p99'])}/{f1(c['max'])} | {f1(p['p50'])}/{f1(p['p99'])}/{f1(p['max'])} | "
            f"{secs} | {gone} | {r.rss_before_mb:.1f} -> {r.rss_after_mb:.1f}"
            f"{'' if args.wslb_workers == 1 else f' ({r.serving[0]}/{r.serving[1]} serving)'} | "
            f"{r.moved} | "
            f"{r.not_moved or 0} | {r.lost['sessions']} |"
        )
    w("")
    w(
        "client pause: per streaming session and restart, the largest gap between two messages "
        "from the POST to the answer (+0.3 s) minus the session's median gap. old code gone: "
        "from the answer until the old pid is gone (the first restart: until it has exec'ed the "
        "keeper, which keeps the pid); with workers: N until every old serving pid of the "
        "answer is gone (the supervisor stays, no keeper). wslb pause_ms: the worst of the "
        "per-process answers."
    )
    for r in results:
        bad = {k: v for k, v in r.lost.items() if v and k != "sessions"}
        w(
            f"- N={r.sessions}: client loop lag during the restarts p99/max "
            f"{f1(r.client_lag_ms['p99'])}/{f1(r.client_lag_ms['max'])} ms; "
            f"problems: {bad or 'none'}; connect failures {r.connect_failed}"
        )
        for x in r.restarts:
            a = x.answer
            w(f"  restart: old pid {'/'.join(map(str, pids_of(a['old'])))} -> new pid "
              f"{'/'.join(map(str, pids_of(a['new'])))}, POST->answer {x.client_s:.3f}s, "
              f"sessions {a['sessions']}, pause_ms {a['pause_ms']}")  # fmt: skip
            if "processes" in a:
                for k, one in enumerate(per_process(a)):
                    w(f"    process {k}: {one['old']['pid']} -> {one['new']['pid']}, "
                      f"{one.get('seconds')}s, sessions {one['sessions']}, pause_ms "
                      f"{one['pause_ms']}")  # fmt: skip
        if r.keeper_exit is not None:
            role = "the keeper after the first restart" if args.wslb_workers == 1 else "supervisor"
            w(
                f"  the pid that started wslb ({r.started_pid}, {role}) EXITED during the run, "
                f"status {r.keeper_exit}"
            )
        for msg, k in r.log_problems.items():
            w(f"  wslb log: {k} x {msg}")
    w("")
    w("peers, the same sessions in front of the same reference workers, reloaded as often:")
    w("")
    w("| peer | N | reloads | sessions closed by the reloads | old workers lived s (per "
      "reload) | old workers RSS MB | old workers alive at the end | sessions lost |")  # fmt: skip
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        w(
            f"| wslb (restart) | {r.sessions} | {len(r.restarts)} | "
            f"{r.lost.get('closed', 0)} | "
            f"{'/'.join(f3(x.gone_s) for x in r.restarts)} | "
            f"{'/'.join(f1(x.old_rss_mb) for x in r.restarts)} | "
            f"{sum(1 for x in r.restarts if math.isnan(x.gone_s))} | {r.lost['sessions']} |"
        )
    for pr in peers:
        lived = "/".join(
            f"> {pr.watch_s:g}" if math.isnan(x) else f"{x:.3f}" for x in pr.old_alive_s
        )
        w(
            f"| {pr.kind} | {pr.sessions} | {pr.reloads} | {pr.closed} | {lived} | "
            f"{'/'.join(f1(x) for x in pr.old_rss_mb)} | {pr.old_alive_at_end} | "
            f"{pr.lost['sessions']} |"
        )
    for kind, why in skipped.items():
        w(f"| {kind} | - | - | skipped: {why} | - | - | - | - |")
    w("")
    for r in results:
        checks = [
            ("old code gone within 5 s",
             all(not math.isnan(x.gone_s) and x.gone_s <= TARGET_GONE_S for x in r.restarts),
             f"max {f3(max((x.gone_s for x in r.restarts), default=math.nan))} s"),
            ("0 sessions lost", r.lost["sessions"] == TARGET_LOST,
             f"{r.lost['sessions']} lost"),
        ]  # fmt: skip
        if r.sessions == 1000:
            p99 = r.client_pause_ms["p99"]
            detail = f"client p99 {f1(p99)} ms, wslb p99 {f1(r.wslb_pause_ms['p99'])} ms"
            ok = not math.isnan(p99) and p99 <= TARGET_PAUSE_MS
            checks.insert(0, ("pause p99 <= 100 ms at 1000 sessions", ok, detail))
        for name, ok, detail in checks:
            w(f"N={r.sessions}: {name}: {'met' if ok else 'MISSED'} ({detail})")
        if r.sessions != 1000:
            w(f"N={r.sessions}: pause p99 target applies at 1000 sessions "
              f"(here client p99 {f1(r.client_pause_ms['p99'])} ms)")  # fmt: skip
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------------

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class Terminated(Exception):
    """SIGTERM arrived during a run: it was cancelled, and its cleanup (every process it
    started stopped) has run."""


def run_loop(coro: Coroutine[Any, Any, T], loop_factory: LoopFactory | None) -> T:
    """``coro`` in a fresh event loop, where SIGTERM cancels it (then ``Terminated``).

    Not ``sigterm_as_interrupt`` there: uvloop runs a Python signal handler inside whatever
    callback it is in, and when that is a transport's (aiohttp's ``data_received``) the
    ``KeyboardInterrupt`` is taken for the transport's error, logged as "Fatal error on
    transport" and swallowed, so the script ran on and its children with it. And a loop's
    signal handler is reset to SIG_DFL when removed (or the loop closes): the script's own
    handler is put back before the next step, under a blocked SIGTERM so none falls between.
    """

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        got: list[float] = []

        def on_term() -> None:
            if not got:
                log("SIGTERM: stopping; every process this script started is stopped first")
                task.cancel()
            got.append(time.monotonic())

        loop.add_signal_handler(signal.SIGTERM, on_term)
        try:
            return await coro
        except asyncio.CancelledError:
            if got:
                raise Terminated from None
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                loop.remove_signal_handler(signal.SIGTERM)
                signal.signal(signal.SIGTERM, sigterm_as_interrupt)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(guarded())
    finally:
        signal.signal(signal.SIGTERM, sigterm_as_interrupt)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="wslb hot restart under live sessions, beside nginx and HAProxy reloads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add: Callable[..., Any] = p.add_argument
    add("--sessions", type=parse_sizes, default=[1000], help="N, or N,N,... (e.g. 1000,10000)")
    add("--streaming-fraction", type=float, default=0.1, help="share of sessions streaming")
    add("--workers", type=int, default=2, help="reference workers")
    add(
        "--wslb-workers",
        type=int,
        default=1,
        help="wslb's workers: N (serving processes under one supervisor; 1: standalone)",
    )
    add("--rate", type=float, default=20.0, help="tokens/s of each stream")
    add("--idle-ping", type=float, default=1.0, help="seconds between an idle session's pings")
    add("--restarts", type=int, default=2, help="restarts (peers: reloads) per run")
    add("--gap", type=float, default=2.0, help="seconds between restarts")
    add("--warmup", type=float, default=3.0, help="seconds of streaming before the first")
    add("--after", type=float, default=2.0, help="seconds of streaming after the last")
    add("--peers", default="nginx,haproxy",
        help="peers to run, comma-separated: nginx, haproxy; 'none' (or '') for none")  # fmt: skip
    add("--peer-watch", type=float, default=10.0, help="seconds old peer workers are watched")
    add("--keep-logs", type=Path, default=None, help="copy the processes' logs here")
    add("--json", type=Path, default=None, help="also write every figure to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.restarts < 1 or not 0 <= args.streaming_fraction <= 1 or args.workers < 1 or
            args.wslb_workers < 1):  # fmt: skip
        raise SystemExit("need --restarts >= 1, --workers >= 1, --wslb-workers >= 1, "
                         "0 <= --streaming-fraction <= 1")  # fmt: skip
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    soft, hard = raise_nofile(NOFILE)
    need = max(args.sessions) + 200
    if soft < need:
        log(f"open-files limit {soft} (hard {hard}) < {need}: the largest N may fail to connect")
    peers = [x.strip() for x in args.peers.split(",") if x.strip() and x.strip() != "none"]
    if set(peers) - {"nginx", "haproxy"}:
        raise SystemExit(f"--peers: nginx, haproxy or none, not {args.peers!r}")
    info = machine() | {
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "tree": tree_state(),
        "nofile": [soft, hard],
        "command": " ".join(["python", "bench/restart.py", *map(shlex.quote, sys.argv[1:])]),
    }
    skipped: dict[str, str] = {}
    binaries: dict[str, str] = {}
    for kind in peers:
        b = peer_binary(kind)
        if b is None:
            skipped[kind] = f"{kind} not installed (not on PATH, nor in /usr/sbin)"
        else:
            binaries[kind] = b
            info[kind] = command_output([b, "-v"]).splitlines()[0][:80]
    for kind, why in skipped.items():
        log(f"{kind}: skipped: {why}")
    loop_factory: LoopFactory | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    results: list[WslbResult] = []
    peer_results: list[PeerResult] = []
    try:
        with tempfile.TemporaryDirectory(prefix="wslb-restart-") as tmp:
            try:
                for n in args.sessions:
                    logdir = Path(tmp) / f"wslb-n{n}"
                    logdir.mkdir()
                    results.append(run_loop(wslb_run(args, n, logdir), loop_factory))
                    for kind, b in binaries.items():
                        pdir = Path(tmp) / f"{kind}-n{n}"
                        pdir.mkdir()
                        try:
                            peer_results.append(
                                run_loop(peer_run(kind, b, args, n, pdir), loop_factory)
                            )
                        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                            skipped[f"{kind} (N={n})"] = f"failed: {exc!r}"[:200]
                            log(f"{kind} N={n} failed: {exc!r}")
            finally:
                if args.keep_logs is not None:
                    shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True)
    except KeyboardInterrupt:
        log("interrupted; every process this script started is stopped")
        return 130
    except Terminated:
        log("terminated (SIGTERM); every process this script started is stopped")
        return 128 + signal.SIGTERM
    print(report(info, results, peer_results, skipped, args), flush=True)
    if args.json is not None:
        doc = {
            "machine": info,
            "args": {k: str(v) for k, v in vars(args).items()},
            "wslb": [asdict(r) for r in results],
            "peers": [asdict(p) for p in peer_results],
            "skipped": skipped,
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    lost = sum(r.lost["sessions"] for r in results)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
