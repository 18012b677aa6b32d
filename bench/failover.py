#!/usr/bin/env python3
"""Crash-failover benchmark: the pause a killed worker's sessions see, what the journal costs in
CPU per frame, and how big it grows.

Three parts, all on 127.0.0.1, every process through ``bench.lib.launch`` (``--parts`` picks them):

- **pause** (for each N of ``--sessions``, fresh processes each): wslb (failover on) starts with
  one worker, the victim, so all N chat sessions land on it without depending on the hash; then
  ``--spares`` more workers join through the admin API (``POST /backends``), every session is
  streaming one long answer at ``--rate`` tokens/s, and the victim gets SIGKILL. Per session, the
  client's clock gives the **gap**: from the last message before the loss to the first from the
  new worker (the first received after wslb's log line ``session S: ... resumed on X in N ms``,
  whose wall-clock time maps onto the client's clock), and **kill->next**: from the kill to that
  first message. Beside them, wslb's own pauses (loss -> resumed leg): each from that log line,
  and the ``wslb_failover_pause_seconds`` histogram (bucket bounds only). Checks: every answer
  completes on a new worker with every token exactly once and in order
  (``backends.model.token_text``), no close. The model's share: a resumed answer prefills its
  context again on the new worker (a thawed transcript carries no KV cache), then its next token
  is due at once; ``model`` is that prefill, ``kill->next - model`` what is left for the loss
  to be seen and the failover.
- **cpu**: wslb's CPU microseconds per forwarded frame at a steady token-stream load, failover
  off and on, in the same run: two wslb processes (one per setting) in front of the same workers;
  the load (``--cpu-sessions`` at ``--rate``, ``bench.lib.load``'s load-generator processes)
  goes to one, then the other, alternating off/on ``--cpu-windows`` times each; each window
  measures wslb's user+sys CPU (psutil) over ``wslb_frames_total``. The alternation is so that
  other jobs on the machine hit both settings alike; the ratio of medians, and the median of the
  ratios of each off/on pair, are printed.
- **journal**: one session, ``--turns`` turns of a ``--prompt-words``-word prompt and a
  ``--answer-tokens``-token answer; ``GET /sessions/{sid}``'s ``failover.journal_bytes`` when each
  prompt has been relayed (the journal then folds what came before, so this is the conversation
  plus the pending prompt) and when each answer is done (plus the answer's frames, not folded
  yet), next to the bytes wslb relayed each way (``wslb_bytes_total``: frames as on the wire).

Prints figures; never a pass/fail test (exit status 0 unless a part could not run). Not collected
by pytest. Run ``python bench/failover.py --help``; ``--quick`` is a ~2 minute smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.model import token_text  # noqa: E402
from bench.lib.chat import LagMonitor, Stream  # noqa: E402
from bench.lib.cpu import cpu_sample, cpu_window  # noqa: E402
from bench.lib.launch import Procs, Worker, Wslb  # noqa: E402
from bench.lib.load import (  # noqa: E402
    ClientProc,
    Window,
    WslbTarget,
    make_window,
    spawn_client,
    start_workers,
    take_sample,
)
from bench.lib.machine import machine, machine_line, tree_state  # noqa: E402
from bench.lib.script import parse_sizes, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import pct, summary  # noqa: E402
from bench.lib.wslb import (  # noqa: E402
    Admin,
    log_problems,
    log_time,
    prom_by_label,
    prom_histogram,
    wait_active,
)

CONNECT_PARALLEL = 32  # WebSocket handshakes in flight while opening the sessions
RESUMED_RE = re.compile(
    r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d{3}(?:[+-]\d\d:\d\d|Z)?) INFO \S+: "
    r"session (\S+): worker (\S+) lost; resumed on (\S+) in ([\d.]+) ms"
)
SEARCH_S = 5.0  # without a log line for a session: its largest gap this long after the kill
PAUSE_METRIC = "wslb_failover_pause_seconds"
C2W, W2C = "client_to_worker", "worker_to_client"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def f1(x: float) -> str:
    return "-" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.1f}")


def ppm(values: Sequence[float]) -> str:
    """p50/p99/max of ``values``."""
    d = summary(values)
    return f"{f1(d['p50'])}/{f1(d['p99'])}/{f1(d['max'])}"


def failover_cfg(limit: str) -> dict[str, Any]:
    return {"enabled": True, "journal_limit": limit}


def start_wslb(
    procs: Procs, name: str, backends: list[dict[str, Any]], failover: dict[str, Any] | None
) -> Wslb:
    """wslb in front of ``backends`` (log level info: its per-failover lines are the figures)."""
    pool: dict[str, Any] = {"name": "chat", "balance": "consistent", "backends": backends}
    if failover is not None:
        pool["failover"] = failover
    config = {"pools": [pool], "timeouts": {"ping_interval": "20s", "close": "2s"}}
    wslb = Wslb(config, procs.logdir, procs=procs, name=name, token=secrets.token_urlsafe(32))
    try:
        return wslb.start(wait_ready=False, timeout=20.0)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"wslb did not start: {exc}\n{wslb.log_tail()}") from None


# -- part 1: the pause -----------------------------------------------------------------------


class OneAnswer(Stream):
    """A ``bench.lib.chat.Stream`` that asks once: the answer the kill cuts, then nothing until
    the end (a close meanwhile counts)."""

    async def prompt(self) -> None:
        if self.turn == 0:
            await super().prompt()

    def failover_gap(self, t_kill: float, t_resumed: float | None) -> tuple[float, float] | None:
        """(the gap before the first message from the new worker, its end - ``t_kill``).

        That message is the first one received after ``t_resumed`` (when wslb logged the
        resumed leg: the old leg was gone before, so nothing later came from it). Without it,
        the largest gap ending in the ``SEARCH_S`` after the kill (a guess: at ~50 ms a fast
        failover's gap is close to the decode jitter)."""
        t = self.times
        best: tuple[float, float] | None = None
        for k in range(1, len(t)):
            gap = t[k] - t[k - 1]
            if t_resumed is not None:
                if t[k] >= t_resumed:
                    return gap, t[k] - t_kill
            elif t_kill <= t[k] <= t_kill + SEARCH_S and (best is None or gap > best[0]):
                best = (gap, t[k] - t_kill)
        return best


@dataclass
class PauseResult:
    sessions: int
    on_victim: int
    mid_answer_at_kill: int
    gaps_ms: list[float]
    since_kill_ms: list[float]
    model_ms: list[float]  # per session: the re-prefill of its context on the new worker
    wslb_pauses_ms: list[float]  # from wslb's log, one per resumed session
    from_log: int  # sessions whose new worker's first message was found by wslb's log line
    histogram: dict[str, float]
    failovers: dict[str, int]
    errors: dict[str, int]
    targets: dict[str, int]
    all_resumed_s: float  # kill -> the last session's first token from a new worker
    cpu: dict[str, float]  # % of one core by role, kill -> every failover over
    client_lag_ms: dict[str, float]
    log_problems: dict[str, int]


def worker_args(args: argparse.Namespace, rate: float) -> list[str]:
    return [
        "--tokens-per-s", f"{rate:g}",
        "--max-batch", "1000000",  # no stream slows down for the batch size
        "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}",
        "--kv-capacity-tokens", str(10**9),
        "--log-level", "warning",
    ]  # fmt: skip


async def pause_run(args: argparse.Namespace, n: int, logdir: Path) -> PauseResult:
    with Procs(logdir) as procs:
        wargs = worker_args(args, args.rate)
        victim = Worker("victim", wargs, procs=procs, name="victim").start(timeout=20.0)
        wslb = start_wslb(
            procs, "wslb", [{"id": victim.id, "url": victim.url}], failover_cfg(args.journal_limit)
        )
        spares = [
            Worker(f"s{k + 1}", wargs, procs=procs, name=f"spare{k + 1}").start(wait=False)
            for k in range(args.spares)
        ]
        return await _pause(args, n, wslb, victim, spares)


async def _pause(
    args: argparse.Namespace, n: int, wslb: Wslb, victim: Worker, spares: list[Worker]
) -> PauseResult:
    # Long enough that each answer is still streaming well after the kill.
    answer = math.ceil(args.rate * (args.warmup + args.after + 10.0))
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
        aiohttp.ClientSession() as admin_http,
    ):
        admin = Admin(admin_http, wslb)
        await wait_active(admin)
        streams = [OneAnswer(f"fo{n}-{i}", answer) for i in range(n)]
        gate = asyncio.Semaphore(CONNECT_PARALLEL)
        tasks = [asyncio.ensure_future(s.run(http, wslb.url, gate)) for s in streams]
        lag = LagMonitor()
        lag.start()
        try:
            await until(
                lambda: all(s.connected or t.done() for s, t in zip(streams, tasks, strict=True)),
                30,
            )
            for sp in spares:
                sp.wait(20.0)
                status, body = await admin.post("/backends", {"id": sp.id, "url": sp.url})
                if status != 201:
                    raise RuntimeError(f"POST /backends answered {status}: {body}")
            await wait_active(admin)
            await until(
                lambda: all(s.expect >= 5 or t.done() for s, t in zip(streams, tasks, strict=True)),
                30,
            )
            await asyncio.sleep(args.warmup)
            on_victim = [s for s in streams if s.first_worker == victim.id]
            mid = sum(1 for s in on_victim if s.in_answer())
            at_kill = {s.sid: s.expect for s in streams}
            pids = {"wslb": [wslb.pid], "workers": [w.pid for w in spares], "client": [os.getpid()]}
            log(f"N={n}: {len(on_victim)} sessions on the victim, {mid} mid-answer; SIGKILL")
            c0 = cpu_sample(pids)
            t_kill = time.monotonic()
            wall_offset = time.time() - t_kill  # wslb's log has wall-clock times
            victim.kill()
            # Every failover over (wslb's count), then every answer's end.
            while time.monotonic() - t_kill < args.after + 60:
                ended = prom_by_label(await admin.get("/metrics"), "wslb_failovers_total", "result")
                if sum(ended.values()) >= len(on_victim):
                    break
                await asyncio.sleep(0.1)
            c1 = cpu_sample(pids)
            t_over = time.monotonic()
            await until(
                lambda: all(
                    s.workers or s.closes or t.done() for s, t in zip(streams, tasks, strict=True)
                ),
                answer / args.rate + 60,
                strict=False,
            )
            await asyncio.sleep(0.5)  # a close right after the last done still counts
            metrics = await admin.get("/metrics")
        finally:
            for s in streams:
                s.stopping = True
            closing = [s.ws.close() for s in streams if s.ws is not None and not s.ws.closed]
            if closing:
                await asyncio.wait([asyncio.ensure_future(x) for x in closing], timeout=10)
            for t in tasks:
                t.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            await lag.stop()
            for s in streams:
                s.finish()

    text = wslb.output()
    resumed = {m[2]: log_time(m[1]) - wall_offset for m in RESUMED_RE.finditer(text)}
    gaps, since, model = [], [], []
    for s in on_victim:
        g = s.failover_gap(t_kill, resumed.get(s.sid))
        if g is not None:
            gaps.append(g[0] * 1e3)
            since.append(g[1] * 1e3)
            model.append((s.prompt_words + at_kill[s.sid]) * args.prefill_ms_per_token)
    hist = prom_histogram(metrics, PAUSE_METRIC)
    errors = {
        "connect_failed": sum(1 for s in streams if not s.connected),
        "lost": sum(s.lost for s in streams),
        "duplicated": sum(s.duplicated for s in streams),
        "out_of_order": sum(s.out_of_order for s in streams),
        "bad_text": sum(s.bad_text for s in streams),
        "unexpected": sum(s.unexpected for s in streams),
        "closes": sum(s.closes for s in streams),
        "not_done": sum(1 for s in streams if not s.workers),
        "done_on_victim": sum(1 for s in streams if victim.id in s.workers),
        "client_exceptions": sum(
            1 for o in outcomes if isinstance(o, BaseException) and not _cancelled(o)
        ),
    }
    for s in streams:
        if s.closes:
            log(f"session {s.sid} closed: {s.close_info}")
    return PauseResult(
        sessions=n,
        on_victim=len(on_victim),
        mid_answer_at_kill=mid,
        gaps_ms=gaps,
        since_kill_ms=since,
        model_ms=model,
        wslb_pauses_ms=[float(m[5]) for m in RESUMED_RE.finditer(text)],
        from_log=sum(1 for s in on_victim if s.sid in resumed),
        histogram={
            "count": hist.count,
            "mean_ms": hist.mean * 1e3,
            "p50_le_ms": hist.quantile(50) * 1e3,
            "p99_le_ms": hist.quantile(99) * 1e3,
        },
        failovers=dict(prom_by_label(metrics, "wslb_failovers_total", "result")),
        errors=errors,
        targets=dict(Counter(s.workers[-1] for s in streams if s.workers)),
        all_resumed_s=max(since, default=math.nan) / 1e3,
        cpu=cpu_window(c0, c1),
        client_lag_ms={
            "p99": pct(lag.window(t_kill, t_over), 99) * 1e3,
            "max": max(lag.window(t_kill, t_over), default=math.nan) * 1e3,
        },
        log_problems=dict(log_problems(text)),
    )


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError)


async def until(cond: Callable[[], bool], timeout: float, strict: bool = True) -> None:
    """Poll ``cond`` every 20 ms; after ``timeout`` s raise (``strict``) or return."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            if strict:
                raise TimeoutError(f"condition not met in {timeout:g}s")
            log(f"gave up waiting after {timeout:g}s")
            return
        await asyncio.sleep(0.02)


def pause_report(rs: list[PauseResult], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    interval = 1e3 / args.rate
    w(
        f"(a) failover pause: 1 victim + {args.spares} spare workers at {args.rate:g} tokens/s "
        f"(decode interval {interval:.0f} ms, re-prefill {args.prefill_ms_per_token:g} ms per "
        f"context token), SIGKILL after {args.warmup:g} s of streaming; ms, p50/p99/max"
    )
    w("")
    w(
        "| N | resumed | client gap | kill->next token | model | kill->next - model | "
        "wslb pause (log) | wslb histogram: mean, p50<=, p99<= | all resumed s | token errors | "
        "closes |"
    )
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rs:
        over = [a - b for a, b in zip(r.since_kill_ms, r.model_ms, strict=True)]
        h = r.histogram
        token_errors = sum(v for k, v in r.errors.items() if k != "closes")
        w(
            f"| {r.sessions} | {r.failovers.get('resumed', 0)}/{r.on_victim} | "
            f"{ppm(r.gaps_ms)} | {ppm(r.since_kill_ms)} | {ppm(r.model_ms)} | "
            f"{ppm(over)} | {ppm(r.wslb_pauses_ms)} | {f1(h['mean_ms'])}, "
            f"{f1(h['p50_le_ms'])}, {f1(h['p99_le_ms'])} (n={int(h['count'])}) | "
            f"{r.all_resumed_s:.2f} | {token_errors} | {r.errors['closes']} |"
        )
    w("")
    for r in rs:
        c = r.cpu
        w(
            f"- N={r.sessions}: {r.mid_answer_at_kill}/{r.on_victim} mid-answer at the kill; "
            f"answers finished on {dict(sorted(r.targets.items()))}; failovers "
            f"{dict(sorted(r.failovers.items()))}; CPU % of a core, kill -> failovers over: wslb "
            f"{c['wslb']:.0f}, spare workers {c['workers']:.0f}, client {c['client']:.0f}, "
            f"other jobs {c['others']:.0f} (machine {c['machine']:.0f}% busy); client loop lag "
            f"p99/max {f1(r.client_lag_ms['p99'])}/{f1(r.client_lag_ms['max'])} ms"
        )
        bad = {k: v for k, v in r.errors.items() if v}
        w(f"  checks: {bad or 'every answer complete, every token once and in order, no close'}")
        if r.from_log < r.on_victim:
            w(
                f"  {r.on_victim - r.from_log} sessions without a 'resumed' log line: their gap "
                f"is their largest in the {SEARCH_S:g} s after the kill"
            )
        for msg, k in sorted(r.log_problems.items(), key=lambda kv: -kv[1])[:5]:
            w(f"  wslb log: {k} x {msg}")
    w(
        "gap: the client's wait from the last message before the loss to the first from the new "
        "worker (the first after wslb logged the resumed leg); kill->next: from the kill to that "
        "message; all resumed: the largest kill->next; model: the context's re-prefill on the "
        "new worker (the reference worker sends a resumed answer's next token at once after "
        "it); wslb pause: loss -> resumed leg, from wslb's log (1 per resumed session) and its "
        "histogram (bucket bounds)."
    )
    return out


# -- part 2: CPU per frame, failover off and on ------------------------------------------------


class SettingWslb(WslbTarget):
    """token_stream's wslb target with failover off or on, and a log of its own."""

    def __init__(self, failover: dict[str, Any] | None, label: str) -> None:
        super().__init__()
        self.failover = failover
        self.label = label

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        bs = [{"id": f"w{i + 1}", "url": u} for i, u in enumerate(backends)]
        self._wslb = wslb = start_wslb(procs, f"wslb-{self.label}", bs, self.failover)
        self.port, self.admin_port = wslb.port, wslb.admin_port
        wslb.wait_ready(20.0)

    @property
    def wslb(self) -> Wslb:
        assert self._wslb is not None
        return self._wslb


@dataclass
class CpuWindow:
    setting: str
    round: int
    window: Window
    others_pct: float  # other jobs on the machine, % of one core
    machine_pct: float
    bad: int
    failed: int
    closed: int
    journal_bytes: dict[str, float] | None  # over the live sessions at the window's end


def spawn_clients(
    procs: Procs, url: str, sessions: int, n: int, max_tokens: int, ramp: float, prefix: str
) -> list[ClientProc]:
    """``bench.lib.load``'s load generators (each session re-prompts, one prompt queued)."""
    clients = []
    for c in range(n):
        share = sessions // n + (1 if c < sessions % n else 0)
        spec = {
            "url": url,
            "sessions": share,
            "prefix": f"{prefix}-c{c}",
            "max_tokens": max_tokens,
            "jitter": False,
            "ramp_s": ramp,
        }
        clients.append(spawn_client(procs, f"{prefix}-c{c}", spec))
    return clients


def cpu_run(args: argparse.Namespace, logdir: Path) -> list[CpuWindow]:
    out: list[CpuWindow] = []
    with Procs(logdir) as procs:
        log(f"cpu: {args.cpu_workers} workers, wslb with failover off and on")
        worker_pids, urls = start_workers(procs, args.cpu_workers, args.rate)
        targets = {
            "off": SettingWslb(None, "off"),
            "on": SettingWslb(failover_cfg(args.journal_limit), "on"),
        }
        for t in targets.values():
            t.start(procs, urls)
        max_tokens = math.ceil(args.rate * (args.cpu_warmup + args.cpu_duration + 30))
        ramp = max(1.0, args.cpu_sessions / 200)
        for r in range(args.cpu_windows):
            for setting in ("off", "on"):
                t, idle = targets[setting], targets["on" if setting == "off" else "off"]
                clients = spawn_clients(
                    procs, t.url, args.cpu_sessions, args.clients, max_tokens, ramp,
                    f"cpu{r}{setting}",
                )  # fmt: skip
                for c in clients:
                    line = c.readline(ramp + 90)
                    if not line.startswith("ready "):
                        raise RuntimeError(f"client said {line!r}")
                time.sleep(args.cpu_warmup)
                pids = {
                    "target": [t.pid],
                    "workers": worker_pids,
                    "clients": [c.proc.pid for c in clients],
                }
                roles = {**pids, "idle wslb": [idle.pid]}
                m0 = cpu_sample(roles)
                a = take_sample(t, clients, pids)
                time.sleep(args.cpu_duration)
                b = take_sample(t, clients, pids)
                m1 = cpu_sample(roles)
                win = make_window(a, b, t)
                journal = None
                if setting == "on":
                    sizes = [
                        float(s["failover"]["journal_bytes"]) for s in t.wslb.admin("/sessions")
                    ]
                    journal = {"median": pct(sizes, 50), "max": max(sizes, default=math.nan)}
                m = cpu_window(m0, m1)
                cw = CpuWindow(
                    setting=setting,
                    round=r,
                    window=win,
                    others_pct=m["others"],
                    machine_pct=m["machine"],
                    bad=b.client_sum("bad"),
                    failed=b.client_sum("failed"),
                    closed=b.client_sum("closed"),
                    journal_bytes=journal,
                )
                out.append(cw)
                log(
                    f"cpu {r + 1}/{args.cpu_windows} failover {setting}: "
                    f"{win.frames_per_s:,.0f} frames/s, {win.us_per_frame:.2f} us/frame, "
                    f"wslb {win.cpu_pct('target'):.1f}% cpu, other jobs {m['others']:.0f}%"
                )
                for c in clients:
                    if c.proc.stdin is not None:
                        with contextlib.suppress(OSError):
                            c.proc.stdin.close()  # the client exits at the end of its input
                for c in clients:
                    with contextlib.suppress(Exception):
                        c.proc.wait(10)
                time.sleep(1.0)  # wslb closes those sessions before the other one is loaded
        problems = {k: t.problems()[:5] for k, t in targets.items()}
    for k, lines in problems.items():
        for line in lines:
            log(f"wslb-{k} log: {line}")
    return out


def cpu_summary(ws: list[CpuWindow]) -> dict[str, Any]:
    by = {s: [w for w in ws if w.setting == s] for s in ("off", "on")}
    med = {s: statistics.median(w.window.us_per_frame for w in v) for s, v in by.items() if v}
    pairs = [
        on.window.us_per_frame / off.window.us_per_frame
        for off, on in zip(by["off"], by["on"], strict=False)
    ]
    return {
        "us_per_frame_median": med,
        "ratio_of_medians": med["on"] / med["off"] if len(med) == 2 else math.nan,
        "pair_ratios": pairs,
        "pair_ratio_median": statistics.median(pairs) if pairs else math.nan,
    }


def cpu_report(ws: list[CpuWindow], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"(b) wslb CPU per forwarded frame, {args.cpu_sessions} sessions at {args.rate:g} "
        f"tokens/s ({args.cpu_sessions * args.rate:,.0f} frames/s offered), {args.cpu_workers} "
        f"workers, {args.clients} client process(es); windows of {args.cpu_duration:g} s after "
        f"{args.cpu_warmup:g} s, alternating off/on"
    )
    w("")
    w(
        "| window | failover | frames/s | wslb us/frame | wslb cpu% | other jobs cpu% | "
        "journal bytes/session median/max | bad/failed/ended |"
    )
    w("|---:|:---:|---:|---:|---:|---:|---:|---:|")
    for k, cw in enumerate(ws):
        win = cw.window
        j = cw.journal_bytes
        jtxt = f"{j['median']:,.0f}/{j['max']:,.0f}" if j else "-"
        w(
            f"| {k + 1} | {cw.setting} | {win.frames_per_s:,.0f} | {win.us_per_frame:.2f} | "
            f"{win.cpu_pct('target'):.1f} | {cw.others_pct:.0f} | {jtxt} | "
            f"{cw.bad}/{cw.failed}/{cw.closed} |"
        )
    s = cpu_summary(ws)
    med = s["us_per_frame_median"]
    w("")
    if len(med) == 2:
        ratio = s["ratio_of_medians"]
        w(
            f"median us/frame: off {med['off']:.2f}, on {med['on']:.2f}; on/off "
            f"{ratio:.3f} (ratio of medians), {s['pair_ratio_median']:.3f} (median of the "
            f"pairs' ratios: {', '.join(f'{x:.3f}' for x in s['pair_ratios'])}); target <= 1.15: "
            f"{'met' if ratio <= 1.15 else 'NOT met'}"
        )
    least = min((cw.window.cpu_s["target"] for cw in ws), default=0.0)
    if least < 1.0:
        w(
            f"note: wslb used only {least:.2f} CPU s in a window; CPU time comes in 10 ms ticks "
            "(use a longer --cpu-duration)"
        )
    return out


# -- part 3: journal bytes per session -----------------------------------------------------------


@dataclass
class JournalRow:
    turn: int
    at_prompt: int | None  # journal bytes once the prompt was relayed (None: a token raced it)
    at_done: int | None  # journal bytes once the answer is done
    wire_c2w: int  # wslb_bytes_total, cumulative, at done
    wire_w2c: int
    payload_c2w: int  # the client's message bytes, cumulative
    payload_w2c: int


@dataclass
class JournalResult:
    rows: list[JournalRow] = field(default_factory=list)
    protected: bool = False
    limit_bytes: int = 0
    errors: int = 0


async def journal_run(args: argparse.Namespace, logdir: Path) -> JournalResult:
    with Procs(logdir) as procs:
        # A 5 ms per token re-prefill: each prompt waits >= 50 ms for its first token, time
        # enough to read the journal once the prompt is in it and before the answer is.
        wargs = ["--tokens-per-s", "1000", "--prefill-ms-per-token", "5", "--log-level", "warning"]
        wk = Worker("w1", wargs, procs=procs, name="w1").start(timeout=20.0)
        wslb = start_wslb(
            procs, "wslb", [{"id": wk.id, "url": wk.url}], failover_cfg(args.journal_limit)
        )
        async with aiohttp.ClientSession() as http:
            admin = Admin(http, wslb)
            await wait_active(admin)
            return await _journal(args, http, admin, wslb)


async def _journal(
    args: argparse.Namespace, http: aiohttp.ClientSession, admin: Admin, wslb: Wslb
) -> JournalResult:
    sid = "journal-1"
    res = JournalResult()
    sent = got = 0
    ws = await http.ws_connect(f"{wslb.url}/ws?session={sid}")
    try:
        hello = await ws.receive_str(timeout=10)
        got += len(hello.encode())
        w2c_frames = 1
        for k in range(1, args.turns + 2):
            last = k == args.turns + 1  # only the folded reading of the whole conversation
            words = ["turn", str(k), *(["and", "then", "what", "happened", "next"] * 4)]
            text = " ".join(words[: args.prompt_words])
            n = 1 if last else args.answer_tokens
            msg = json.dumps({"type": "prompt", "text": text, "max_tokens": n})
            await ws.send_str(msg)
            sent += len(msg.encode())
            view = await admin.get(f"/sessions/{sid}")
            raced = view["frames"][W2C] != w2c_frames
            at_prompt = None if raced else int(view["failover"]["journal_bytes"])
            i = 0
            while True:
                data = await ws.receive_str(timeout=30)
                got += len(data.encode())
                w2c_frames += 1
                obj = json.loads(data)
                if obj["type"] == "done":
                    res.errors += int(obj["tokens"] != n or i != n)
                    break
                res.errors += int(obj.get("i") != i or obj.get("text") != token_text(sid, k, i))
                i += 1
            if last:
                res.rows.append(JournalRow(k, at_prompt, None, 0, 0, sent, got))
                break
            view = await admin.get(f"/sessions/{sid}")
            wire = prom_by_label(await admin.get("/metrics"), "wslb_bytes_total", "direction")
            fo = view["failover"]
            res.protected = bool(fo["protected"])
            res.rows.append(
                JournalRow(k, at_prompt, int(fo["journal_bytes"]), wire[C2W], wire[W2C], sent, got)
            )
    finally:
        await ws.close()
    return res


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(|B|KiB|MiB)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected N, NKiB or NMiB: {text!r}")
    return int(m[1]) * {"": 1, "B": 1, "KiB": 1024, "MiB": 1 << 20}[m[2]]


def journal_report(res: JournalResult, args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"(c) journal of one chat session: {args.turns} turns, prompts of {args.prompt_words} "
        f"words, answers of {args.answer_tokens} tokens; bytes, cumulative"
    )
    w("")
    w(
        "| turn | journal, prompt relayed (folded) | journal, answer done | relayed c->w wire | "
        "w->c wire | both ways | journal / both ways |"
    )
    w("|---:|---:|---:|---:|---:|---:|---:|")
    for r in res.rows:
        if r.at_done is None:
            w(
                f"| {r.turn} (prompt only) | {r.at_prompt if r.at_prompt is not None else '-'} "
                f"| | | | | |"
            )
            continue
        both = r.wire_c2w + r.wire_w2c
        w(
            f"| {r.turn} | {r.at_prompt if r.at_prompt is not None else '-'} | {r.at_done} | "
            f"{r.wire_c2w} | {r.wire_w2c} | {both} | {r.at_done / both:.2f} |"
        )
    done = [r for r in res.rows if r.at_done is not None]
    folded = [r for r in res.rows if r.at_prompt is not None]
    if len(folded) >= 2:
        grown = (folded[-1].at_prompt or 0) - (folded[0].at_prompt or 0)
        per_turn = grown / (folded[-1].turn - folded[0].turn)
        limit = parse_size(args.journal_limit)
        w("")
        w(
            f"folded growth {per_turn:,.0f} bytes per turn (the prompt and the answer's text); "
            f"the {args.journal_limit} journal_limit is reached after ~{limit / per_turn:,.0f} "
            f"such turns; the raw frames of an answer wait unfolded (at most 8 KiB) until the "
            f"next prompt; protected at the end: {res.protected}; token errors {res.errors}"
        )
    if done:
        last = done[-1]
        w(
            f"client payload bytes (JSON text) after turn {last.turn}: c->w {last.payload_c2w}, "
            f"w->c {last.payload_w2c}"
        )
    return out


# -- main ------------------------------------------------------------------------------------


def info_lines(info: dict[str, Any]) -> list[str]:
    la = info["loadavg"]
    return [
        f"command: {info['command']}",
        f"machine: {machine_line(info)}; loadavg before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}",
        f"wslb tree: {info['tree']}",
        "wslb, the workers and the clients share the machine (and whatever else runs on it: "
        "see 'other jobs')",
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="wslb crash failover: the pause, CPU per frame off/on, journal bytes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add: Callable[..., Any] = p.add_argument
    add("--quick", action="store_true", help="a smoke run (~2 min): shorter waits and windows")
    add("--parts", default="pause,cpu,journal", help="which parts, comma-separated")
    add("--sessions", type=parse_sizes, default=[50, 100, 200], help="N on the victim, a list")
    add("--spares", type=int, default=2, help="workers added after the sessions are placed")
    add("--rate", type=float, default=20.0, help="tokens/s per stream (pause and cpu)")
    add("--prefill-ms-per-token", type=float, default=0.2, help="worker option of that name")
    add("--warmup", type=float, default=3.0, help="seconds of streaming before the kill")
    add(
        "--after",
        type=float,
        default=3.0,
        help="seconds the answers stream at least after the kill (their length also allows 10 s "
        "to open the sessions and add the spares)",
    )
    add("--journal-limit", default="256KiB", help="failover.journal_limit")
    add("--cpu-sessions", type=int, default=200, help="sessions in the cpu part")
    add("--cpu-workers", type=int, default=2, help="workers in the cpu part")
    add("--clients", type=int, default=1, help="load-generator processes in the cpu part")
    add("--cpu-windows", type=int, default=5, help="measured windows per setting")
    add("--cpu-duration", type=float, default=20.0, help="seconds per cpu window")
    add("--cpu-warmup", type=float, default=3.0, help="seconds of load before each window")
    add("--turns", type=int, default=10, help="turns of the journal part")
    add("--prompt-words", type=int, default=10, help="words per prompt (journal part)")
    add("--answer-tokens", type=int, default=50, help="tokens per answer (journal part)")
    add("--json", type=Path, default=None, help="also write every figure to this file")
    add("--keep-logs", type=Path, default=None, help="copy the processes' logs here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not set(parts) <= {"pause", "cpu", "journal"}:
        raise SystemExit("--parts: pause, cpu, journal")
    if args.quick:
        args.warmup, args.after = 2.0, 2.0
        args.cpu_windows, args.cpu_duration, args.cpu_warmup = 2, 8.0, 2.0
    parse_size(args.journal_limit)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    info = {
        **machine(),
        "loadavg": os.getloadavg(),
        "tree": tree_state(),
        "command": " ".join(["python", "bench/failover.py", *map(shlex.quote, sys.argv[1:])]),
    }
    for line in info_lines(info):
        print(line, flush=True)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    doc: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with tempfile.TemporaryDirectory(prefix="wslb-failover-") as tmp:
            try:
                if "pause" in parts:
                    pauses = []
                    for n in args.sessions:
                        logdir = Path(tmp) / f"pause-{n}"
                        logdir.mkdir()
                        with asyncio.Runner(loop_factory=loop_factory) as runner:
                            pauses.append(runner.run(pause_run(args, n, logdir)))
                    doc["pause"] = [asdict(r) for r in pauses]
                    print("\n" + "\n".join(pause_report(pauses, args)), flush=True)
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
                if "journal" in parts:
                    logdir = Path(tmp) / "journal"
                    logdir.mkdir()
                    with asyncio.Runner(loop_factory=loop_factory) as runner:
                        jr = runner.run(journal_run(args, logdir))
                    doc["journal"] = asdict(jr)
                    print("\n" + "\n".join(journal_report(jr, args)), flush=True)
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
