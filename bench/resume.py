#!/usr/bin/env python3
"""Client-resume benchmark (SPEC section 13): network blips under a streaming load, what a
detached session costs in memory, and what keeping the replay window costs in CPU per frame.

Two parts, all on 127.0.0.1, every process through ``bench.lib.launch`` (``--parts`` picks them):

- **blips**: wslb with ``resume: {enabled: true, grace: 30s, buffer: 1MiB}`` in front of
  ``--workers`` reference workers it spawns itself (``spawn: reference``, as the repo's
  ``balancer.yaml``), ``--sessions`` chat sessions each streaming long answers at ``--rate``
  tokens/s and asking again at each ``done``. Every ``--blip-every`` seconds for ``--duration``
  seconds, ``--blip-share`` of the sessions, drawn among those in the middle of an answer, blip:
  their TCP is cut with ``transport.abort()`` (an RST, no close frame) at a random moment in the
  next ``--blip-spread`` seconds, and ``--blip-delay`` seconds later each reconnects with the
  same key, its token from the first ``101`` and its count of data messages received so far
  (``X-WSLB-Resume-Token``, ``X-WSLB-Resume-From``). Every token is checked (each once, in
  order, with the reference worker's text: ``backends.model.token_text``): **lost** and
  **repeated** must be 0. The **resume pause** is the client's wait from the reconnect's start
  (its TCP connect) to the first message on the new connection, which is a replayed one for
  every resume wslb's ``resumed`` event says replayed bytes (the worker went on streaming
  meanwhile); beside it the 101 alone, the outage (cut -> first message, the delay included),
  wslb's ``wslb_resume_pause_seconds`` histogram (accept -> 101, bucket bounds) and the
  client's event-loop lag, which inflates every client-side time.
- **memory** (with blips, after them): ``--mem-share`` of the sessions are cut at once and kept
  away ``--mem-hold`` seconds. wslb's RSS before and while they are detached, over the
  ``wslb_detached_sessions`` gauge, is the memory per detached session; ``GET /sessions``'s
  ``resume.window_bytes`` says how much of that is the replay window (the worker kept streaming
  into it), next to the window of an attached session. Then they all resume and are checked.
- **cpu**: wslb's CPU microseconds per forwarded frame, resume off against on, in the same run:
  two wslb processes (one per setting) in front of the same reference workers; the load
  (``--cpu-sessions`` at ``--rate``, ``bench.lib.load``'s load-generator processes) goes to one,
  then the other, alternating ``--cpu-windows`` times each, new sessions each window; the
  median per setting, the ratio of medians and the median of the pairs' ratios, against the
  target on <= 1.05 x off. No blips here: this is the steady cost of keeping the window.

Prints figures (``--json FILE`` also writes them all); never a pass/fail test. Not collected by
pytest (``tests/test_bench_resume.py`` runs ``--quick``). ``python bench/resume.py --help``.
"""

# ruff: noqa: E402 (the sys.path set-up comes before the project imports)
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.chat import LagMonitor, Stream
from bench.lib.cpu import cpu_sample, cpu_window
from bench.lib.launch import Procs, Wslb, free_port
from bench.lib.load import (
    ClientProc,
    Window,
    WslbTarget,
    make_window,
    spawn_client,
    start_workers,
    take_sample,
)
from bench.lib.machine import machine, machine_line, tree_state
from bench.lib.script import log, parse_args_quick, raise_nofile, sigterm_as_interrupt
from bench.lib.stats import summary
from bench.lib.wslb import (
    Admin,
    log_problems,
    prom_by_label,
    prom_histogram,
    wait_active,
)

TOKEN_HEADER = "X-WSLB-Resume-Token"
FROM_HEADER = "X-WSLB-Resume-From"
RESUMED_HEADER = "X-WSLB-Resumed"
CONNECT_PARALLEL = 32  # WebSocket handshakes in flight while opening the sessions
CPU_TARGET = 1.05
STALL_S = 5.0  # a live session that received nothing this long before the end is stalled
PARTS = ("blips", "cpu")


def f1(x: float) -> str:
    return "-" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.1f}")


def ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p99/max of ``values`` (seconds) in ms."""
    return summary([v * 1e3 for v in values], (50, 99), unit="_ms")


def ppm(d: dict[str, float]) -> str:
    return f"{f1(d['p50_ms'])}/{f1(d['p99_ms'])}/{f1(d['max_ms'])}"


def worker_args(rate: float) -> list[str]:
    return [
        "--tokens-per-s", f"{rate:g}",
        "--max-batch", "1000000",  # no stream slows down for the batch size
        "--prefill-ms-per-token", "0",  # the growing conversation costs no prefill time
        "--kv-capacity-tokens", str(10**9),  # no eviction work
        "--log-level", "warning",
    ]  # fmt: skip


def resume_cfg(args: argparse.Namespace, grace: str | None = None) -> dict[str, Any]:
    return {"enabled": True, "grace": grace or args.grace, "buffer": args.buffer}


def wslb_config(backends: list[dict[str, Any]], resume: dict[str, Any] | None) -> dict[str, Any]:
    """A pool like the repo's balancer.yaml: consistent hashing on ``?session=``, HTTP health
    checks, resume as given (failover off: this measures resume alone)."""
    pool: dict[str, Any] = {
        "name": "chat",
        "match": {"path_prefix": "/"},
        "session_key": ["query:session"],
        "balance": "consistent",
        "hash_balance_factor": 1.25,
        "health": {"interval": "1s", "timeout": "1s", "rise": 2, "fall": 3, "path": "/healthz"},
        "backends": backends,
    }
    if resume is not None:
        pool["resume"] = resume
    return {
        "pools": [pool],
        "timeouts": {"ping_interval": "20s", "ping_timeout": "20s", "idle": "1h", "close": "2s"},
        "limits": {"max_connections": 20000},
    }


def new_wslb(procs: Procs, name: str, config: dict[str, Any], level: str = "warning") -> Wslb:
    return Wslb(
        config,
        procs.logdir,
        procs=procs,
        name=name,
        token=secrets.token_urlsafe(32),
        args=["--log-level", level],
        term_timeout=10.0,
    )


def start(wslb: Wslb, timeout: float = 40.0) -> None:
    """Start ``wslb`` and wait until every backend (its spawned workers) is active."""
    t0 = time.monotonic()
    try:
        wslb.start(wait_ready=False, timeout=timeout)
        wslb.wait_ready(timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise RuntimeError(f"{wslb.name} did not start: {exc}\n{wslb.log_tail()}") from None
    wslb.children()  # its workers: stop() kills any left behind
    log(f"{wslb.name} ready in {time.monotonic() - t0:.1f}s")


def rss_of(pid: int) -> int:
    """RSS of the one process (not its spawned workers)."""
    with contextlib.suppress(psutil.Error):
        return int(psutil.Process(pid).memory_info().rss)
    return 0


# -- the resumable client --------------------------------------------------------------------


@dataclass
class Resumable(Stream):
    """A ``bench.lib.chat.Stream`` over ``websockets`` that resumes: it keeps the token of its
    first 101, counts every data message it receives over all its connections, and after a cut
    reconnects with both (SPEC section 13)."""

    url: str = ""
    count: int = 0  # data messages received, all connections
    token: str | None = None
    conn: ClientConnection | None = None
    away: bool = False  # cut, not back yet
    gate: asyncio.Event | None = None  # reconnect when set (else after ``delay``)
    delay: float = 0.0
    cut_at: float = 0.0
    reconnect_at: float = 0.0
    waiting_first: bool = False
    cuts: int = 0
    resumes: int = 0
    refused: list[str] = field(default_factory=list)
    bad_resumed_header: int = 0
    pauses: list[float] = field(default_factory=list)  # reconnect -> first message
    handshakes: list[float] = field(default_factory=list)  # reconnect -> 101
    outages: list[float] = field(default_factory=list)  # cut -> first message
    dead: bool = False

    def blippable(self) -> bool:
        """Connected, in the middle of an answer (its prompt long since delivered: the
        client-to-worker direction has nothing in flight that a cut could lose)."""
        return (
            self.connected
            and not (self.stopping or self.away or self.dead)
            and self.conn is not None
            and 0 < self.expect < self.answer - 1
        )

    def cut(self, delay: float = 0.0, gate: asyncio.Event | None = None) -> bool:
        """The TCP connection dies (an RST, no close frame); back after ``delay`` or ``gate``."""
        if not self.blippable():
            return False
        assert self.conn is not None
        self.away, self.delay, self.gate = True, delay, gate
        self.cut_at = time.monotonic()
        self.cuts += 1
        self.conn.transport.abort()
        return True

    async def prompt(self) -> None:
        assert self.conn is not None
        self.turn += 1
        self.expect = 0
        self.missing.clear()
        text = f"turn {self.turn} of {self.sid}: please keep talking"
        self.prompt_words += len(text.split())
        await self.conn.send(
            json.dumps({"type": "prompt", "text": text, "max_tokens": self.answer})
        )

    async def open(self, resume: bool) -> None:
        headers: dict[str, str] = {}
        if self.token is not None:
            headers[TOKEN_HEADER] = self.token
        if resume:
            headers[FROM_HEADER] = str(self.count)
        self.conn = await connect(
            f"{self.url}/ws?session={self.sid}",
            additional_headers=headers,
            open_timeout=20,
            ping_interval=None,  # wslb pings; the library answers
            compression=None,
            max_queue=None,
        )
        response = self.conn.response
        assert response is not None
        token = response.headers.get(TOKEN_HEADER)
        if token is None:
            raise RuntimeError(f"{self.sid}: no {TOKEN_HEADER} in the 101: is resume on?")
        self.token = token
        if resume and response.headers.get(RESUMED_HEADER) != str(self.count):
            self.bad_resumed_header += 1

    async def _reconnect(self) -> bool:
        if self.gate is not None:
            await self.gate.wait()
        else:
            await asyncio.sleep(self.delay)
        self.reconnect_at = t0 = time.monotonic()
        try:
            await self.open(resume=True)
        except InvalidStatus as exc:
            body = exc.response.body.decode(errors="replace")[:160] if exc.response.body else ""
            self.refused.append(f"{exc.response.status_code} {body}")
            return False
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            self.refused.append(f"reconnect: {exc!r}"[:160])
            return False
        self.handshakes.append(time.monotonic() - t0)
        self.resumes += 1
        self.away = False
        self.waiting_first = True
        return True

    async def run_resumable(self, gate: asyncio.Semaphore) -> None:
        async with gate:
            await self.open(resume=False)
            assert self.conn is not None
            hello = json.loads(await asyncio.wait_for(self.conn.recv(), 20))
            self.count += 1
            if hello.get("type") != "hello" or hello.get("session") != self.sid:
                raise RuntimeError(f"{self.sid}: expected hello, got {hello!r}")
            self.first_worker = str(hello["worker"])
            self.connected = True
        await self.prompt()
        now, times = time.monotonic, self.times
        while True:
            assert self.conn is not None
            try:
                data = await self.conn.recv()
            except ConnectionClosed as exc:
                if self.stopping:
                    return
                if not self.away:  # not our cut: wslb or the worker closed it
                    self.closes += 1
                    self.close_info = f"{exc!r}"[:200]
                    self.dead = True
                    return
                if not await self._reconnect():
                    self.dead = True
                    return
                continue
            t = now()
            times.append(t)
            self.count += 1
            if self.waiting_first:
                self.waiting_first = False
                self.pauses.append(t - self.reconnect_at)
                self.outages.append(t - self.cut_at)
            obj = json.loads(data)
            kind = obj.get("type")
            if kind == "token":
                self.on_token(obj)
            elif kind == "done":
                self.on_done(obj)
                if not self.stopping:
                    await self.prompt()
            else:
                self.unexpected += 1


class EventTail:
    """wslb's ``resumed`` and ``detached`` events, read as they come (the log keeps 1,000)."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.last = 0
        self.kinds: Counter[str] = Counter()
        self.replayed: list[int] = []  # bytes replayed, per resume
        self.counts: dict[str, list[int]] = {}  # session -> the counts it resumed from

    async def poll(self) -> None:
        got = await self.admin.get(f"/events?since={self.last}")
        for e in got["events"]:
            self.last = max(self.last, int(e["seq"]))
            kind = str(e["kind"])
            self.kinds[kind] += 1
            if kind == "resumed":
                self.replayed.append(int(e.get("replayed_bytes", 0)))
                self.counts.setdefault(str(e["session"]), []).append(int(e.get("count", -1)))

    async def follow(self, every: float) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                await self.poll()
            await asyncio.sleep(every)


async def until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def gauge_of(metrics: str) -> int:
    """``wslb_detached_sessions`` of an exposition (-1: absent)."""
    for line in metrics.splitlines():
        if line.startswith("wslb_detached_sessions "):
            return int(float(line.split()[1]))
    return -1


async def detached_gauge(admin: Admin) -> int:
    return gauge_of(await admin.get("/metrics"))


def window_bytes(sessions: list[dict[str, Any]], detached: bool) -> list[int]:
    out = []
    for s in sessions:
        r = s.get("resume")
        if isinstance(r, dict) and bool(r.get("detached")) is detached:
            out.append(int(r.get("window_bytes", 0)))
    return out


# -- part 1: blips, then memory ----------------------------------------------------------------


async def blips_run(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    with Procs(logdir) as procs:
        backends = [
            {
                "id": f"w{i + 1}",
                "url": f"ws://127.0.0.1:{free_port()}",
                "spawn": "reference",
                "args": worker_args(args.rate),
            }
            for i in range(args.workers)
        ]
        # INFO: its line per resume and per ping timeout (--keep-logs keeps them).
        wslb = new_wslb(procs, "wslb", wslb_config(backends, resume_cfg(args)), "info")
        start(wslb)
        return await _blips(args, wslb)


async def _blips(args: argparse.Namespace, wslb: Wslb) -> dict[str, Any]:
    rng = random.Random(args.seed)
    answer = args.answer_tokens
    streams = [Resumable(sid=f"rs-{i}", answer=answer, url=wslb.url) for i in range(args.sessions)]
    async with aiohttp.ClientSession() as http:
        admin = Admin(http, wslb)
        await wait_active(admin, 30)
        tail = EventTail(admin)
        follower = asyncio.ensure_future(tail.follow(0.5))
        gate = asyncio.Semaphore(CONNECT_PARALLEL)
        lag = LagMonitor()
        lag.start()
        t_open = time.monotonic()
        tasks = [asyncio.ensure_future(s.run_resumable(gate)) for s in streams]
        rounds: list[dict[str, Any]] = []
        mem: dict[str, Any] = {}
        try:
            ok = await until(
                lambda: all(s.connected or t.done() for s, t in zip(streams, tasks, strict=True)),
                60 + args.sessions / 20,
            )
            opened = sum(s.connected for s in streams)
            log(f"blips: {opened}/{len(streams)} sessions open in {time.monotonic() - t_open:.1f}s")
            if not ok or opened < len(streams):
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                why = repr(failed[0].exception()) if failed else "timeout"
                raise RuntimeError(f"only {opened}/{len(streams)} sessions opened: {why}")
            await asyncio.sleep(args.warmup)
            pids = {"wslb": [wslb.pid], "client": [os.getpid()]}
            m0 = await admin.get("/metrics")
            c0 = cpu_sample(pids)
            t0 = time.monotonic()
            k = round(args.blip_share * len(streams))
            tick = 1
            while tick * args.blip_every <= args.duration:
                await asyncio.sleep(max(0.0, t0 + tick * args.blip_every - time.monotonic()))
                eligible = [s for s in streams if s.blippable()]
                chosen = rng.sample(eligible, min(k, len(eligible)))
                loop = asyncio.get_running_loop()
                for s in chosen:
                    loop.call_later(rng.uniform(0, args.blip_spread), s.cut, args.blip_delay)
                rounds.append(
                    {
                        "at_s": round(time.monotonic() - t0, 2),
                        "eligible": len(eligible),
                        "chosen": len(chosen),
                    }
                )
                log(
                    f"blip {tick}: {len(chosen)} of {len(eligible)} mid-answer sessions cut, "
                    f"resumes so far {sum(s.resumes for s in streams)}, "
                    f"refused {sum(len(s.refused) for s in streams)}"
                )
                tick += 1
            await asyncio.sleep(max(0.0, t0 + args.duration - time.monotonic()))
            await asyncio.sleep(args.blip_spread + args.blip_delay)  # the last cuts fire
            await until(lambda: not any(s.away and not s.dead for s in streams), 30)
            c1 = cpu_sample(pids)
            t1 = time.monotonic()
            m1 = await admin.get("/metrics")
            cuts_in_blips = sum(s.cuts for s in streams)
            blipped = sum(1 for s in streams if s.cuts)
            resumes_in_blips = sum(s.resumes for s in streams)
            if args.mem_share > 0:
                mem = await _memory(args, streams, admin, wslb, rng)
            await until(lambda: not any(s.away and not s.dead for s in streams), 30)
            await asyncio.sleep(0.6)
            await tail.poll()
            metrics = await admin.get("/metrics")
            quiet = time.monotonic() - STALL_S
            stalled = [
                s.sid for s in streams if not s.dead and (not s.times or s.times[-1] < quiet)
            ]
        finally:
            for s in streams:
                s.stopping = True
            follower.cancel()
            for t in tasks:
                t.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            # Closed with a close frame: a client that leaves so is gone, not detached (an
            # abort here would leave wslb holding every session for its grace at shutdown).
            closing = [
                asyncio.ensure_future(s.conn.close())
                for s in streams
                if s.conn is not None and s.conn.state.name == "OPEN"
            ]
            if closing:
                await asyncio.wait(closing, timeout=10)
            for s in streams:
                if s.conn is not None:
                    s.conn.transport.abort()
            await lag.stop()
            for s in streams:
                s.finish()

    frames0 = prom_by_label(m0, "wslb_frames_total", "direction")
    frames1 = prom_by_label(m1, "wslb_frames_total", "direction")
    frames = sum(frames1.values()) - sum(frames0.values())
    cpu = cpu_window(c0, c1)
    hist = prom_histogram(metrics, "wslb_resume_pause_seconds")
    replayed_pauses = [p for s in streams for p in s.pauses]
    lags = lag.window(t0, t1)
    errors = {
        "lost": sum(s.lost for s in streams),
        "repeated": sum(s.duplicated for s in streams),
        "out_of_order": sum(s.out_of_order for s in streams),
        "bad_text": sum(s.bad_text for s in streams),
        "unexpected": sum(s.unexpected for s in streams),
        "closes": sum(s.closes for s in streams),
        "refused": sum(len(s.refused) for s in streams),
        "stalled": len(stalled),  # open, but nothing received in the last STALL_S
        "bad_resumed_header": sum(s.bad_resumed_header for s in streams),
        "client_exceptions": sum(
            1
            for o in outcomes
            if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)
        ),
    }
    refusals = Counter(r for s in streams for r in s.refused)
    for s in streams:
        if s.closes:
            log(f"session {s.sid} closed: {s.close_info}")
    return {
        "sessions": len(streams),
        "rate": args.rate,
        "answer_tokens": answer,
        "rounds": rounds,
        "cuts": sum(s.cuts for s in streams),
        "cuts_in_blips": cuts_in_blips,
        "resumes_in_blips": resumes_in_blips,
        "resumes": sum(s.resumes for s in streams),
        "sessions_blipped": blipped,
        "tokens": sum(s.tokens for s in streams),
        "answers_done": sum(len(s.workers) for s in streams),
        "errors": errors,
        "refusals": dict(refusals.most_common(5)),
        "close_reasons": dict(Counter(s.close_info for s in streams if s.closes).most_common(5)),
        "pause_ms": ms(replayed_pauses),
        "handshake_ms": ms([h for s in streams for h in s.handshakes]),
        "outage_ms": ms([o for s in streams for o in s.outages]),
        "replayed": {
            "resumes": len(tail.replayed),
            "with_bytes": sum(1 for b in tail.replayed if b > 0),
            "bytes": summary([float(b) for b in tail.replayed], (50, 99)),
        },
        "events": dict(tail.kinds),
        "resumes_total": dict(prom_by_label(metrics, "wslb_resumes_total", "result")),
        "detached_at_end": gauge_of(metrics),
        "wslb_histogram": {
            "count": hist.count,
            "mean_ms": hist.mean * 1e3,
            "p50_le_ms": hist.quantile(50) * 1e3,
            "p99_le_ms": hist.quantile(99) * 1e3,
        },
        "cpu": {
            "wslb_pct": cpu["wslb"],
            "client_pct": cpu["client"],
            "others_pct": cpu["others"],
            "machine_pct": cpu["machine"],
            "frames": frames,
            "wslb_us_per_frame": (c1.roles["wslb"] - c0.roles["wslb"]) * 1e6 / frames
            if frames
            else math.nan,
        },
        "client_lag_ms": {
            "p99": summary(lags)["p99"] * 1e3,
            "max": max(lags, default=math.nan) * 1e3,
        },
        "memory": mem,
        "log_problems": dict(log_problems(wslb.output())),
    }


async def _memory(
    args: argparse.Namespace,
    streams: list[Resumable],
    admin: Admin,
    wslb: Wslb,
    rng: random.Random,
) -> dict[str, Any]:
    """Cut ``--mem-share`` of the sessions at once, hold them away, measure, let them back."""
    eligible = [s for s in streams if s.blippable()]
    k = min(len(eligible), round(args.mem_share * len(streams)))
    chosen = rng.sample(eligible, k)
    attached = window_bytes(await admin.get("/sessions"), detached=False)
    await asyncio.sleep(0.5)
    rss0 = rss_of(wslb.pid)
    back = asyncio.Event()
    cut = [s for s in chosen if s.cut(gate=back)]
    all_away = False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if await detached_gauge(admin) >= len(cut):
            all_away = True
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.mem_hold)
    rss1 = rss_of(wslb.pid)
    gauge = await detached_gauge(admin)
    views = await admin.get("/sessions")
    detached = window_bytes(views, detached=True)
    back.set()
    log(f"memory: {len(cut)} sessions detached for {args.mem_hold:g}s; resuming them")
    t_back = time.monotonic()
    ok = await until(lambda: not any(s.away and not s.dead for s in cut), 60)
    n = max(gauge, 1)
    return {
        "detached": len(cut),
        "gauge": gauge,
        "all_seen_detached": all_away,
        "hold_s": args.mem_hold,
        "rss_before_mb": rss0 / 2**20,
        "rss_detached_mb": rss1 / 2**20,
        "rss_per_detached_kb": (rss1 - rss0) / n / 1024,
        "window_bytes_detached": summary([float(b) for b in detached], (50, 99)),
        "window_bytes_attached": summary([float(b) for b in attached], (50, 99)),
        "window_bytes_detached_mean": statistics.fmean(detached) if detached else math.nan,
        "all_resumed": ok,
        "resume_all_s": time.monotonic() - t_back,
    }


def blips_report(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    e = r["errors"]
    w(
        f"(a) blips: {r['sessions']} sessions at {args.rate:g} tokens/s ({args.workers} spawned "
        f"reference workers, answers of {r['answer_tokens']} tokens), {args.blip_share:.0%} cut "
        f"every {args.blip_every:g}s for {args.duration:g}s (spread over {args.blip_spread:g}s), "
        f"back after {args.blip_delay:g}s with token + count"
    )
    w("")
    w(
        f"- cuts {r['cuts_in_blips']} (sessions blipped {r['sessions_blipped']}), resumed "
        f"{r['resumes_in_blips']} (with the memory part's: {r['resumes']}), refused "
        f"{e['refused']}; tokens checked {r['tokens']:,}, answers done "
        f"{r['answers_done']:,}"
    )
    verdict = "met" if e["lost"] == 0 and e["repeated"] == 0 else "NOT met"
    w(
        f"- messages lost {e['lost']}, repeated {e['repeated']} (target 0: {verdict}); out of "
        f"order {e['out_of_order']}, bad text {e['bad_text']}, unexpected {e['unexpected']}, "
        f"closes {e['closes']}, stalled {e['stalled']}, wrong X-WSLB-Resumed "
        f"{e['bad_resumed_header']}"
    )
    rp = r["replayed"]
    w(
        f"- resume pause, reconnect -> first replayed message, ms p50/p99/max: "
        f"{ppm(r['pause_ms'])} (n={r['pause_ms']['n']}; {rp['with_bytes']}/{rp['resumes']} "
        f"resumes replayed bytes, median {f1(rp['bytes']['p50'])} B)"
    )
    h = r["wslb_histogram"]
    w(
        f"  of which the 101: {ppm(r['handshake_ms'])}; cut -> first message (the "
        f"{args.blip_delay:g}s delay included): {ppm(r['outage_ms'])}; wslb's "
        f"wslb_resume_pause_seconds (accept -> 101): mean {f1(h['mean_ms'])}, p50<= "
        f"{f1(h['p50_le_ms'])}, p99<= {f1(h['p99_le_ms'])} (n={h['count']})"
    )
    c = r["cpu"]
    w(
        f"- during the blips: wslb {c['wslb_pct']:.0f}% of a core, {c['wslb_us_per_frame']:.2f} "
        f"us/frame; client {c['client_pct']:.0f}%, other jobs {c['others_pct']:.0f}% (machine "
        f"{c['machine_pct']:.0f}% busy); client loop lag p99/max "
        f"{f1(r['client_lag_ms']['p99'])}/{f1(r['client_lag_ms']['max'])} ms"
    )
    w(
        f"- wslb_resumes_total {r['resumes_total']}; events {r['events']}; detached at the end "
        f"{r['detached_at_end']}"
    )
    if r["refusals"]:
        w(f"- refusals: {r['refusals']}")
    if r["close_reasons"]:
        w(f"- closes: {r['close_reasons']}")
    for msg, k in sorted(r["log_problems"].items(), key=lambda kv: -kv[1])[:5]:
        w(f"  wslb log: {k} x {msg}")
    m = r["memory"]
    if m:
        w("")
        w(
            f"(b) memory: {m['detached']} sessions detached at once for {m['hold_s']:g}s "
            f"(gauge {m['gauge']}): wslb RSS {m['rss_before_mb']:.1f} -> "
            f"{m['rss_detached_mb']:.1f} MB, {m['rss_per_detached_kb']:.1f} KiB per detached "
            f"session; replay window per detached session p50/p99 "
            f"{f1(m['window_bytes_detached']['p50'])}/{f1(m['window_bytes_detached']['p99'])} B "
            f"(what the worker streamed meanwhile), per attached session "
            f"{f1(m['window_bytes_attached']['p50'])}/{f1(m['window_bytes_attached']['p99'])} B; "
            f"all resumed: {m['all_resumed']} in {m['resume_all_s']:.2f}s"
        )
    return out


# -- part 2: CPU per frame, resume off and on ----------------------------------------------------


class SettingWslb(WslbTarget):
    """``bench.lib.load``'s wslb target with resume off or on, and a log of its own."""

    def __init__(self, resume: dict[str, Any] | None, label: str) -> None:
        super().__init__()
        self.resume = resume
        self.label = label

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        bs = [{"id": f"w{i + 1}", "url": u} for i, u in enumerate(backends)]
        self._wslb = wslb = new_wslb(procs, f"wslb-{self.label}", wslb_config(bs, self.resume))
        self.port, self.admin_port = wslb.port, wslb.admin_port
        start(wslb)

    @property
    def wslb(self) -> Wslb:
        assert self._wslb is not None
        return self._wslb


@dataclass
class CpuWindow:
    setting: str
    round: int
    window: Window
    others_pct: float
    machine_pct: float
    bad: int
    failed: int
    closed: int
    window_bytes: dict[str, float] | None  # resume on: the attached sessions' replay windows


def cpu_run(args: argparse.Namespace, logdir: Path) -> list[CpuWindow]:
    out: list[CpuWindow] = []
    with Procs(logdir) as procs:
        log(f"cpu: {args.cpu_workers} workers, wslb with resume off and on")
        worker_pids, urls = start_workers(procs, args.cpu_workers, args.rate)
        # A short grace: the load generators leave without a close (they exit), and their
        # sessions must not stay detached, streaming, into the next "on" window.
        on = resume_cfg(args, args.cpu_grace)
        targets = {"off": SettingWslb(None, "off"), "on": SettingWslb(on, "on")}
        for t in targets.values():
            t.start(procs, urls)
        max_tokens = math.ceil(args.rate * (args.cpu_warmup + args.cpu_duration + 30))
        ramp = max(0.5, args.cpu_sessions / 200)
        for r in range(args.cpu_windows):
            for setting in ("off", "on"):
                t, idle = targets[setting], targets["on" if setting == "off" else "off"]
                quiet_by = time.monotonic() + 30
                while time.monotonic() < quiet_by and any(
                    gauge_of(x.wslb.admin("/metrics")) > 0 for x in targets.values()
                ):
                    time.sleep(0.2)  # the last window's sessions are gone, detached ones too
                clients = []
                for c in range(args.clients):
                    share = args.cpu_sessions // args.clients + (
                        c < args.cpu_sessions % args.clients
                    )
                    spec = {
                        "url": t.url,
                        "sessions": share,
                        "prefix": f"cpu{r}{setting}-c{c}",
                        "max_tokens": max_tokens,
                        "jitter": False,
                        "ramp_s": ramp,
                    }
                    clients.append(spawn_client(procs, f"cpu{r}{setting}-c{c}", spec))
                for cp in clients:
                    line = cp.readline(ramp + 90)
                    if not line.startswith("ready "):
                        raise RuntimeError(f"client said {line!r}")
                time.sleep(args.cpu_warmup)
                pids = {
                    "target": [t.pid],
                    "workers": worker_pids,
                    "clients": [cp.proc.pid for cp in clients],
                }
                roles = {**pids, "idle wslb": [idle.pid]}
                m0 = cpu_sample(roles)
                a = take_sample(t, clients, pids)
                time.sleep(args.cpu_duration)
                b = take_sample(t, clients, pids)
                m1 = cpu_sample(roles)
                win = make_window(a, b, t)
                wb = None
                if setting == "on":
                    sizes = [float(x) for x in window_bytes(t.wslb.admin("/sessions"), False)]
                    wb = summary(sizes, (50, 99))
                m = cpu_window(m0, m1)
                out.append(
                    CpuWindow(
                        setting=setting,
                        round=r,
                        window=win,
                        others_pct=m["others"],
                        machine_pct=m["machine"],
                        bad=b.client_sum("bad"),
                        failed=b.client_sum("failed"),
                        closed=b.client_sum("closed"),
                        window_bytes=wb,
                    )
                )
                log(
                    f"cpu {r + 1}/{args.cpu_windows} resume {setting}: "
                    f"{win.frames_per_s:,.0f} frames/s, {win.us_per_frame:.2f} us/frame, "
                    f"wslb {win.cpu_pct('target'):.1f}% cpu, other jobs {m['others']:.0f}%"
                )
                stop_clients(clients)
                time.sleep(1.0)  # wslb closes those sessions before the other one is loaded
        for k, tg in targets.items():
            for line in tg.problems()[:5]:
                log(f"wslb-{k} log: {line}")
    return out


def stop_clients(clients: list[ClientProc]) -> None:
    for c in clients:
        if c.proc.stdin is not None:
            with contextlib.suppress(OSError):
                c.proc.stdin.close()  # a load generator exits at the end of its input
    for c in clients:
        with contextlib.suppress(Exception):
            c.proc.wait(10)


def cpu_summary(ws: list[CpuWindow]) -> dict[str, Any]:
    by = {s: [w for w in ws if w.setting == s] for s in ("off", "on")}
    med = {s: statistics.median(w.window.us_per_frame for w in v) for s, v in by.items() if v}
    pairs = [
        on.window.us_per_frame / off.window.us_per_frame
        for off, on in zip(by["off"], by["on"], strict=False)
    ]
    ratio = med["on"] / med["off"] if len(med) == 2 else math.nan
    return {
        "us_per_frame_median": med,
        "ratio_of_medians": ratio,
        "pair_ratios": pairs,
        "pair_ratio_median": statistics.median(pairs) if pairs else math.nan,
        "target": CPU_TARGET,
        "met": bool(ratio <= CPU_TARGET),
    }


def cpu_report(ws: list[CpuWindow], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"(c) wslb CPU per forwarded frame, resume off vs on: {args.cpu_sessions} sessions at "
        f"{args.rate:g} tokens/s ({args.cpu_sessions * args.rate:,.0f} frames/s offered), "
        f"{args.cpu_workers} workers, {args.clients} client process(es); windows of "
        f"{args.cpu_duration:g}s after {args.cpu_warmup:g}s, alternating off/on"
    )
    w("")
    w("| window | resume | frames/s | wslb us/frame | wslb cpu% | other jobs cpu% | "
      "window bytes/session p50/p99 | bad/failed/ended |")  # fmt: skip
    w("|---:|:---:|---:|---:|---:|---:|---:|---:|")
    for k, cw in enumerate(ws):
        win = cw.window
        wb = cw.window_bytes
        wtxt = f"{f1(wb['p50'])}/{f1(wb['p99'])}" if wb else "-"
        w(
            f"| {k + 1} | {cw.setting} | {win.frames_per_s:,.0f} | {win.us_per_frame:.2f} | "
            f"{win.cpu_pct('target'):.1f} | {cw.others_pct:.0f} | {wtxt} | "
            f"{cw.bad}/{cw.failed}/{cw.closed} |"
        )
    s = cpu_summary(ws)
    med = s["us_per_frame_median"]
    w("")
    if len(med) == 2:
        w(
            f"median us/frame: off {med['off']:.2f}, on {med['on']:.2f}; on/off "
            f"{s['ratio_of_medians']:.3f} (ratio of medians), {s['pair_ratio_median']:.3f} "
            f"(median of the pairs' ratios: {', '.join(f'{x:.3f}' for x in s['pair_ratios'])}); "
            f"target <= {CPU_TARGET}: {'met' if s['met'] else 'NOT met'}"
        )
    least = min((cw.window.cpu_s["target"] for cw in ws), default=0.0)
    if least < 1.0:
        w(
            f"note: wslb used only {least:.2f} CPU s in a window; CPU time comes in 10 ms ticks "
            "(use a longer --cpu-duration)"
        )
    return out


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="wslb client resume: blips under load, memory per detached session, "
        "CPU per frame off/on.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add: Callable[..., Any] = p.add_argument
    add("--quick", action="store_true", help="a smoke run (seconds): few sessions, short times")
    add("--parts", default="blips,cpu", help="which parts, comma-separated: blips, cpu")
    add("--sessions", type=int, default=1000, help="streaming sessions (blips)")
    add("--workers", type=int, default=3, help="reference workers wslb spawns (blips)")
    add("--rate", type=float, default=10.0, help="tokens/s per stream")
    add("--answer-tokens", type=int, default=300, help="tokens per answer (then asks again)")
    add("--duration", type=float, default=120.0, help="seconds of blips")
    add("--warmup", type=float, default=3.0, help="seconds of streaming before the first blip")
    add("--blip-every", type=float, default=10.0, help="seconds between blips")
    add("--blip-share", type=float, default=0.10, help="share of the sessions cut per blip")
    add("--blip-spread", type=float, default=1.0, help="a blip's cuts spread over these seconds")
    add("--blip-delay", type=float, default=0.5, help="seconds from a cut to the reconnect")
    add("--mem-share", type=float, default=0.5, help="share detached at once for memory; 0: no")
    add("--mem-hold", type=float, default=3.0, help="seconds they stay detached")
    add("--grace", default="30s", help="resume.grace")
    add("--buffer", default="1MiB", help="resume.buffer")
    add("--cpu-sessions", type=int, default=200, help="sessions in the cpu part")
    add("--cpu-grace", default="1s", help="resume.grace of the cpu part's 'on' wslb")
    add("--cpu-workers", type=int, default=2, help="workers in the cpu part")
    add("--clients", type=int, default=1, help="load-generator processes in the cpu part")
    add("--cpu-windows", type=int, default=5, help="measured windows per setting")
    add("--cpu-duration", type=float, default=15.0, help="seconds per cpu window")
    add("--cpu-warmup", type=float, default=3.0, help="seconds of load before each window")
    add("--seed", type=int, default=1, help="which sessions blip")
    add("--json", type=Path, default=None, help="also write every figure to this file")
    add("--keep-logs", type=Path, default=None, help="copy the processes' logs here")
    return p


QUICK = {
    "sessions": 30,
    "workers": 2,
    "rate": 40.0,
    "answer_tokens": 120,
    "duration": 4.0,
    "warmup": 0.5,
    "blip_every": 1.0,
    "blip_share": 0.2,
    "blip_spread": 0.3,
    "blip_delay": 0.2,
    "mem_hold": 0.5,
    "cpu_sessions": 30,
    "cpu_workers": 1,
    "cpu_windows": 1,
    "cpu_duration": 2.0,
    "cpu_warmup": 0.5,
}


def main(argv: Sequence[str] | None = None) -> int:
    args, parts = parse_args_quick(build_parser(), argv, QUICK, PARTS)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    raise_nofile()
    info = {
        **machine(),
        "loadavg": os.getloadavg(),
        "tree": tree_state(),
        "command": " ".join(["python", "bench/resume.py", *map(shlex.quote, sys.argv[1:])]),
    }
    la = info["loadavg"]
    print(f"command: {info['command']}", flush=True)
    print(f"machine: {machine_line(info)}; loadavg before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print(f"wslb tree: {info['tree']}")
    print("wslb, the workers and the clients share the machine (and whatever else runs on it)")
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    doc: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with tempfile.TemporaryDirectory(prefix="wslb-resume-") as tmp:
            try:
                if "blips" in parts:
                    logdir = Path(tmp) / "blips"
                    logdir.mkdir()
                    with asyncio.Runner(loop_factory=loop_factory) as runner:
                        res = runner.run(blips_run(args, logdir))
                    doc["blips"] = res
                    print("\n" + "\n".join(blips_report(res, args)), flush=True)
                if "cpu" in parts:
                    logdir = Path(tmp) / "cpu"
                    logdir.mkdir()
                    windows = cpu_run(args, logdir)
                    doc["cpu"] = {
                        "windows": [
                            {**asdict(cw), "us_per_frame": cw.window.us_per_frame} for cw in windows
                        ],
                        "summary": cpu_summary(windows),
                    }
                    print("\n" + "\n".join(cpu_report(windows, args)), flush=True)
            finally:
                if args.keep_logs is not None:
                    shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
