#!/usr/bin/env python3
"""Rollout benchmark: a tier of wslb instances replaced one by one under streaming sessions
whose clients resume, what they see and what it costs; and how many resumes per second one
serving process takes, beside plain upgrades through nginx.

All on 127.0.0.1, every process through ``bench.lib.launch`` and ``tests.tier`` (``--parts``
picks the parts):

- **sigterm** (a rollout): ``tests.tier.Tier``, three wslb instances in cluster mode over a real
  etcd behind HAProxy (TCP, round robin), resume and failover on, in front of ``--workers``
  reference workers. ``--sessions`` clients (``wslb.client``, the resume protocol of
  docs/resume.md) each ask for one answer long enough to outlast the run, streaming at
  ``--rate`` tokens/s, so every session is mid-answer throughout. After ``--steady`` seconds of
  steady state, each of the three original instances is replaced in turn as a rollout with a
  surge of one does: a new instance starts and joins HAProxy (a graceful reload), then the old
  one gets SIGTERM and the script waits for its exit (its sessions go to their workers, their
  clients are told ``1012 ...: resume`` and come back through HAProxy, maybe to an instance that
  is itself replaced next). The window ends when every session has had a token after the last
  exit; ``--steady`` more seconds on the new instances follow.
- **kill** (the same, with ``kill -9``): a new instance joins, then the old instance holding
  the most sessions gets SIGKILL; its clients see a drop without a close and resume through the
  others, which reattach the sessions at the workers that parked them.

Per run: every token is checked (each index once, in order, with the reference worker's text,
``backends.model.token_text``): **lost** (indices skipped) and **repeated**; **closed**: sessions
that ended without a resume (``wslb.client.SessionError``); per client the **longest gap**
between two tokens in the window (p50/p99/max over the clients; a token is due every 1/rate s)
and each reconnect's wait (loss -> resumed 101). Cost: CPU of all the wslb instances (psutil,
sampled every 0.25 s; a dead instance counts to its last sample) over the window, less what the
steady state would have used in as long (**extra CPU s**), of which the new processes' own start;
their RSS in steady state and its peak in the window; the workers' RSS, whose growth is the
parked windows.

- **storm** (resumes per second): one wslb (resume on, no cluster: a single serving process)
  in front of ``--storm-workers`` reference workers, and nginx (``bench.lib.nginx``) in front of
  the same workers. Per round, three bursts of ``--storm`` connects at once from this process:
  **resume**: ``--storm`` idle sessions are opened through wslb, their TCP cut (no close frame),
  and once wslb holds them all detached, all reconnect at once with token and count;
  **wslb plain** and **nginx plain**: as many new sessions upgrade at once. Per burst: completed
  upgrades per second (first connect to last 101), the proxy's CPU microseconds per upgrade, the
  workers' and this client's CPU beside (one client process: at these sizes it, not the proxy,
  sets the pace, so the proxy's CPU per upgrade is the figure to compare, and 1e6 / it the
  upgrades one core could take). ``--storm-rounds`` rounds; medians and [min-max].

Prints figures (``--json FILE`` also writes them); never a pass/fail test. Not collected by
pytest (``tests/test_bench_rollout.py`` runs ``--quick``). ``python bench/rollout.py --help``.
"""

# ruff: noqa: E402 (the sys.path set-up comes before the project imports)
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import secrets
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.model import token_text
from bench.lib.chat import LagMonitor
from bench.lib.cpu import cpu_seconds, process_cpu_seconds, rss_bytes
from bench.lib.launch import WORKER_AUTH, Procs, Worker, Wslb, free_port, wait_port
from bench.lib.machine import machine, machine_line, tree_state
from bench.lib.nginx import nginx_binary, nginx_config
from bench.lib.resumer import Cut, gaps, outcomes, reconnects, retries
from bench.lib.script import log, parse_args_quick, raise_nofile, sigterm_as_interrupt
from bench.lib.stats import summary
from tests.tier import Tier, haproxy_binary
from wslb.client import Session, SessionError
from wslb.client import connect as resuming

PARTS = ("sigterm", "kill", "storm")
OPEN_PARALLEL = 32  # handshakes in flight while the sessions open
SAMPLE_S = 0.25  # the CPU/RSS sampler's period
BACK_TIMEOUT = 60.0  # every session streams again within this after the last exit


def f1(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def f0(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}"


def ms3(d: dict[str, float]) -> str:
    """p50/p99/max (seconds) in ms."""
    return f"{f0(d['p50'] * 1e3)}/{f0(d['p99'] * 1e3)}/{f0(d['max'] * 1e3)}"


def worker_args(rate: float) -> list[str]:
    return [
        "--tokens-per-s", f"{rate:g}",
        "--max-batch", "1000000",  # no stream slows down for the batch size
        "--prefill-ms-per-token", "0",
        "--kv-capacity-tokens", str(10**9),
        "--log-level", "warning",
    ]  # fmt: skip


def resumes_by_result(text: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "wslb_resumes_total":
                out[s.labels.get("result", "?")] += int(s.value)
    return out


def live(lb: Wslb) -> bool:
    return lb.proc is not None and lb.proc.poll() is None


# -- the streaming clients -------------------------------------------------------------------


@dataclass
class Window:
    """Whether the clients are inside the measured window (their longest gap counts)."""

    on: bool = False


@dataclass
class Stream:
    """One session streaming one long answer through ``wslb.client``, checked token by token."""

    c: Session
    sid: str = ""
    next_i: int = 0
    tokens: int = 0
    lost: int = 0
    repeated: int = 0
    bad_text: int = 0
    last_at: float = 0.0
    max_gap: float = 0.0  # inside the window
    closed: str | None = None

    async def run(self, max_tokens: int, window: Window, started: asyncio.Event) -> None:
        try:
            await self.c.send(
                json.dumps({"type": "prompt", "text": "go", "max_tokens": max_tokens})
            )
            started.set()
            while True:
                m = json.loads(await self.c.recv())
                now = time.monotonic()
                if m.get("type") != "token":
                    self.closed = f"unexpected {m.get('type')}"
                    return
                if window.on and self.last_at:
                    self.max_gap = max(self.max_gap, now - self.last_at)
                self.last_at = now
                self.tokens += 1
                i = int(m["i"])
                if m.get("text") != token_text(self.sid, int(m["turn"]), i):
                    self.bad_text += 1
                if i == self.next_i:
                    self.next_i += 1
                elif i < self.next_i:
                    self.repeated += 1
                else:
                    self.lost += i - self.next_i
                    self.next_i = i + 1
        except SessionError as exc:
            self.closed = str(exc)[:200]


async def open_stream(url: str, key: str, sem: asyncio.Semaphore) -> Stream:
    async with sem:
        c = await resuming(url, key=key, grace=BACK_TIMEOUT, max_size=None)
        hello = json.loads(await c.recv())
        if hello.get("type") != "hello":
            raise RuntimeError(f"{key}: {hello}")
        return Stream(c, sid=str(hello["session"]))


# -- CPU and memory over time -----------------------------------------------------------------


@dataclass
class Sample:
    at: float
    lb_cpu: float  # CPU seconds so far of every wslb instance seen, dead ones to their last sample
    lb_rss: int  # RSS of the live instances
    w_cpu: float
    w_rss: int
    lbs: int


@dataclass
class Sampler:
    tier: Tier
    workers: list[int]
    samples: list[Sample] = field(default_factory=list)
    _cum: dict[int, float] = field(default_factory=dict)

    def take(self) -> Sample:
        rss = 0
        n = 0
        for lb in list(self.tier.lbs):
            if not live(lb):
                continue
            assert lb.proc is not None
            pid = lb.proc.pid
            cpu = process_cpu_seconds(pid)
            if cpu:
                self._cum[pid] = cpu
                rss += rss_bytes([pid])
                n += 1
        s = Sample(
            time.monotonic(),
            sum(self._cum.values()),
            rss,
            cpu_seconds(self.workers),
            rss_bytes(self.workers),
            n,
        )
        self.samples.append(s)
        return s

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.take)
            await asyncio.sleep(SAMPLE_S)

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.at <= t1]


def rate(ss: list[Sample], attr: str) -> float:
    """CPU % of one core of ``attr`` over the samples."""
    if len(ss) < 2:
        return math.nan
    a, b = ss[0], ss[-1]
    return 100.0 * float(getattr(b, attr) - getattr(a, attr)) / max(b.at - a.at, 1e-9)


def mb(x: float) -> float:
    return x / 2**20


# -- the rollout and the kill -----------------------------------------------------------------


async def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"not within {timeout:g}s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def tier_run(args: argparse.Namespace, how: str, run: int, tmp: Path) -> dict[str, Any]:
    """One rollout (``how`` ``sigterm``) or one ``kill -9`` on a fresh tier."""
    with Procs(tmp) as procs:
        ws = [
            Worker(f"w{i}", worker_args(args.rate), procs=procs).start()
            for i in range(args.workers)
        ]
        tier = Tier(tmp, [{"id": w.id, "url": w.url} for w in ws])
        try:
            await asyncio.to_thread(tier.start)
            return await _tier_measure(args, how, run, tier, [w.pid for w in ws])
        finally:
            await asyncio.to_thread(tier.stop)


async def _tier_measure(
    args: argparse.Namespace, how: str, run: int, tier: Tier, worker_pids: list[int]
) -> dict[str, Any]:
    sem = asyncio.Semaphore(OPEN_PARALLEL)
    t_open = time.monotonic()
    streams = await asyncio.gather(
        *(open_stream(tier.url, f"{how}{run}-{i}", sem) for i in range(args.sessions))
    )
    log(f"{how} {run + 1}: {len(streams)} sessions open in {time.monotonic() - t_open:.1f}s")
    window = Window()
    max_tokens = math.ceil(args.rate * 3600)
    starts = [asyncio.Event() for _ in streams]
    tasks = [
        asyncio.ensure_future(s.run(max_tokens, window, e))
        for s, e in zip(streams, starts, strict=True)
    ]
    sampler = Sampler(tier, worker_pids)
    lag = LagMonitor()
    lag.start()
    sampling = asyncio.ensure_future(sampler.run())
    try:
        await until(lambda: all(s.tokens >= 3 for s in streams), 60, "every session streaming")
        holding = await asyncio.to_thread(tier.holding)
        t_steady = time.monotonic()
        await asyncio.sleep(args.steady)
        window.on = True
        t_ev = time.monotonic()
        resumes: Counter[str] = Counter()
        started_cpu = 0.0
        started_rss: list[int] = []
        steps: list[dict[str, float]] = []
        olds = list(tier.lbs)
        if how == "kill":
            olds = [olds[holding.index(max(holding))]]
        for old in olds:
            t0 = time.monotonic()
            new = await asyncio.to_thread(tier.add)
            t_added = time.monotonic()
            started_cpu += process_cpu_seconds(new.pid)
            started_rss.append(rss_bytes([new.pid]))
            resumes += resumes_by_result(await asyncio.to_thread(old.admin, "/metrics"))
            if how == "kill":
                old.kill()
                code = -9
            else:
                code = await asyncio.to_thread(tier.terminate, old, 60.0)
            t_gone = time.monotonic()
            steps.append({"start_s": t_added - t0, "stop_s": t_gone - t_added, "exit": float(code)})
            log(
                f"{how} {run + 1}: new instance in {t_added - t0:.1f}s, old one "
                f"{'killed' if how == 'kill' else f'exited {code}'} in {t_gone - t_added:.1f}s; "
                f"holding {await asyncio.to_thread(tier.holding)}"
            )
        t_last = time.monotonic()
        back = await until(
            lambda: all(s.closed is not None or s.last_at > t_last for s in streams),
            BACK_TIMEOUT,
            "every session streaming again",
        )
        await asyncio.sleep(1.0)  # a late gap still counts
        t_end = time.monotonic()
        window.on = False
        await asyncio.sleep(args.steady)
        t_post = time.monotonic()
        for lb in tier.lbs:
            if live(lb):
                resumes += resumes_by_result(await asyncio.to_thread(lb.admin, "/metrics"))
    finally:
        sampling.cancel()
        await lag.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(s.c.close() for s in streams), return_exceptions=True)

    steady = sampler.between(t_steady, t_ev)
    during = sampler.between(t_ev, t_end)
    post = sampler.between(t_end, t_post)
    steady_pct = rate(steady, "lb_cpu")
    ev_s = t_end - t_ev
    ev_cpu = during[-1].lb_cpu - during[0].lb_cpu if len(during) > 1 else math.nan
    rss_steady = statistics.mean(s.lb_rss for s in steady) if steady else math.nan
    w_steady = statistics.mean(s.w_rss for s in steady) if steady else math.nan
    moved = [s for s in streams if reconnects(s.c)]
    reconnect_gaps = [g for s in streams for g in gaps(s.c)]
    causes = Counter(o for s in streams for o in outcomes(s.c))
    lags = lag.window(t_ev, t_end)
    return {
        "how": how,
        "run": run,
        "sessions": len(streams),
        "held_before": holding,
        "steps": steps,
        "window_s": ev_s,
        "back_s": back,
        "moved": len(moved),
        "reconnects": sum(reconnects(s.c) for s in streams),
        "reconnect_outcomes": dict(causes),
        "retries": dict(Counter(x for s in streams for x in retries(s.c))),
        "resumes_total": dict(resumes),
        "n_retries": sum(len(retries(s.c)) for s in streams),
        "tokens": sum(s.tokens for s in streams),
        "lost": sum(s.lost for s in streams),
        "repeated": sum(s.repeated for s in streams),
        "bad_text": sum(s.bad_text for s in streams),
        "closed": sum(s.closed is not None for s in streams),
        "close_reasons": dict(Counter(s.closed for s in streams if s.closed)),
        "max_gap_s": summary([s.max_gap for s in streams], (50, 99)),
        "max_gap_moved_s": summary([s.max_gap for s in moved], (50, 99)),
        "reconnect_s": summary(reconnect_gaps, (50, 99)),
        "client_lag_s": summary(lags, (50, 99)),
        "cpu": {
            "steady_pct": steady_pct,
            "window_pct": 100.0 * ev_cpu / ev_s,
            "post_pct": rate(post, "lb_cpu"),
            "window_cpu_s": ev_cpu,
            "extra_cpu_s": ev_cpu - steady_pct / 100.0 * ev_s,
            "starts_cpu_s": started_cpu,
            "per_reconnect_ms": 1e3
            * (ev_cpu - steady_pct / 100.0 * ev_s - started_cpu)
            / max(sum(reconnects(s.c) for s in streams), 1),
            "workers_steady_pct": rate(steady, "w_cpu"),
            "workers_window_pct": rate(during, "w_cpu"),
        },
        "rss_mb": {
            "steady": mb(rss_steady),
            "peak": mb(max((s.lb_rss for s in during), default=0)),
            "post": mb(statistics.mean(s.lb_rss for s in post)) if post else math.nan,
            "workers_steady": mb(w_steady),
            "workers_peak": mb(max((s.w_rss for s in during), default=0)),
            "new_instance": mb(statistics.mean(started_rss)),
        },
    }


def _spread(runs: list[dict[str, Any]], path: str, scale: float = 1.0) -> str:
    """Median [min-max] over ``runs`` of the figure at ``path`` (``cpu.steady_pct``)."""
    xs = []
    for r in runs:
        v: Any = r
        for k in path.split("."):
            v = v[k]
        if not math.isnan(float(v)):
            xs.append(float(v) * scale)
    if not xs:
        return "-"
    med = statistics.median(xs)
    if len(xs) == 1:
        return fmt(med)
    return f"{fmt(med)} [{fmt(min(xs))}-{fmt(max(xs))}]"


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def tier_report(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"(a) tier of 3 wslb instances (etcd, HAProxy round robin), {args.sessions} sessions "
        f"streaming at {args.rate:g} tokens/s ({args.sessions * args.rate:,.0f} tokens/s), "
        f"{args.workers} reference workers; sigterm: each instance replaced in turn (start the "
        "new one, SIGTERM the old one); kill: a new one, then kill -9 of the busiest old one"
    )
    w("")
    w(
        "| run | sessions moved / reconnects | lost | repeated | closed | longest gap per "
        "client p50/p99/max ms (moved ones) | reconnect ms p50/p99/max | window s | "
        "wslb cpu% steady -> window | extra CPU s (starts) | wslb RSS MB steady -> peak | "
        "workers RSS MB steady -> peak |"
    )
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        c, m = r["cpu"], r["rss_mb"]
        w(
            f"| {r['how']} {r['run'] + 1} | {r['moved']} / {r['reconnects']} | {r['lost']} | "
            f"{r['repeated']} | {r['closed']} | {ms3(r['max_gap_s'])} "
            f"({ms3(r['max_gap_moved_s'])}) | {ms3(r['reconnect_s'])} | {r['window_s']:.1f} | "
            f"{f0(c['steady_pct'])} -> {f0(c['window_pct'])} | {f1(c['extra_cpu_s'])} "
            f"({f1(c['starts_cpu_s'])}) | "
            f"{f0(m['steady'])} -> {f0(m['peak'])} | {f0(m['workers_steady'])} -> "
            f"{f0(m['workers_peak'])} |"
        )
    for how in ("sigterm", "kill"):
        rs = [r for r in runs if r["how"] == how]
        if not rs:
            continue
        w("")
        w(f"{how}: median [min-max] over {len(rs)} run(s)")
        w(f"- lost / repeated / closed (all runs): {sum(r['lost'] for r in rs)} / "
          f"{sum(r['repeated'] for r in rs)} / {sum(r['closed'] for r in rs)}; bad text "
          f"{sum(r['bad_text'] for r in rs)}")  # fmt: skip
        w(f"- sessions moved: {_spread(rs, 'moved')}, reconnects {_spread(rs, 'reconnects')}")
        for k in ("p50", "p99", "max"):
            gap = _spread(rs, f"max_gap_s.{k}", 1e3)
            rec = _spread(rs, f"reconnect_s.{k}", 1e3)
            w(f"- longest gap per client, {k}: {gap} ms (reconnect drop -> 101 {k}: {rec} ms)")
        w(
            f"- wslb CPU % of a core, all instances: steady {_spread(rs, 'cpu.steady_pct')}, "
            f"window {_spread(rs, 'cpu.window_pct')}, after {_spread(rs, 'cpu.post_pct')}"
        )
        w(
            f"- extra CPU s in the window: {_spread(rs, 'cpu.extra_cpu_s')}, of which the new "
            f"processes' start {_spread(rs, 'cpu.starts_cpu_s')}; the rest per reconnect "
            f"{_spread(rs, 'cpu.per_reconnect_ms')} ms"
        )
        w(
            f"- wslb RSS MB, all live instances: steady {_spread(rs, 'rss_mb.steady')}, peak "
            f"{_spread(rs, 'rss_mb.peak')}, after {_spread(rs, 'rss_mb.post')}; workers steady "
            f"{_spread(rs, 'rss_mb.workers_steady')}, peak {_spread(rs, 'rss_mb.workers_peak')}"
        )
        w(f"- a new instance's RSS once ready: {_spread(rs, 'rss_mb.new_instance')} MB")
        retries = Counter[str]()
        for r in rs:
            retries.update(r["retries"])
        w(
            f"- failed reconnect attempts before the resume (all runs): {dict(retries)}; "
            f"per run {_spread(rs, 'n_retries')}"
        )
        w(
            f"- client event-loop lag in the window p99: {_spread(rs, 'client_lag_s.p99', 1e3)}"
            " ms (inflates every gap)"
        )
        results = Counter[str]()
        for r in rs:
            results.update(r["resumes_total"])
        w(f"- wslb_resumes_total by result (all runs): {dict(results)}")
        reasons = Counter[str]()
        for r in rs:
            reasons.update(r["close_reasons"])
        if reasons:
            w(f"- closes: {dict(reasons)}")
    return out


# -- the storm: resumes per second of one process, beside plain upgrades ----------------------


async def burst(
    makes: Sequence[Callable[[], Awaitable[Any]]],
) -> tuple[list[Any], list[float], list[str]]:
    """Every ``make()`` at once; (results, seconds to each success, errors)."""
    t0 = time.monotonic()
    took: list[float] = []
    errors: list[str] = []

    async def one(make: Callable[[], Awaitable[Any]]) -> Any:
        try:
            r = await make()
        except Exception as exc:  # a failed connect is a figure, not a crash
            errors.append(f"{type(exc).__name__}: {exc}"[:160])
            return None
        took.append(time.monotonic() - t0)
        return r

    got = await asyncio.gather(*(one(m) for m in makes))
    return [g for g in got if g is not None], took, errors


async def storm_run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    n = args.storm
    out: list[dict[str, Any]] = []
    with Procs(tmp) as procs:
        ws = [
            Worker(f"s{i}", worker_args(args.rate), procs=procs).start()
            for i in range(args.storm_workers)
        ]
        wpids = [w.pid for w in ws]
        pool = {
            "name": "chat",
            "backends": [{"id": w.id, "url": w.url} for w in ws],
            "resume": {"enabled": True, "grace": "60s"},
        }
        config = {
            "pools": [pool],
            "timeouts": {"close": "2s", "ping_interval": "60s"},
            "limits": {"max_connections": 20000},
        }
        lb = Wslb(
            config,
            tmp,
            procs=procs,
            name="wslb",
            token=secrets.token_urlsafe(32),
            args=["--log-level", "warning"],
        )
        await asyncio.to_thread(lb.start, True, 30.0)
        nport = free_port()
        d = tmp / "nginx"
        d.mkdir()
        (d / "nginx.conf").write_text(
            nginx_config(d, tmp, nport, [("127.0.0.1", w.port) for w in ws])
        )
        nginx = procs.spawn(
            "nginx",
            [nginx_binary(), "-p", f"{d}/", "-c", f"{d}/nginx.conf", "-e", f"{d}/e.log"],
            term_timeout=5.0,
        )
        await asyncio.to_thread(wait_port, nport, 20.0, nginx)
        wslb_url = f"ws://127.0.0.1:{lb.port}/ws"
        nginx_url = f"ws://127.0.0.1:{nport}/ws"
        me = os.getpid()

        def held() -> int:
            return len(lb.admin("/sessions"))

        def detached() -> int:
            for line in lb.admin("/metrics").splitlines():
                if line.startswith("wslb_detached_sessions "):
                    return int(float(line.split()[1]))
            return -1

        async def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
            """Until ``check()`` (a blocking admin call) holds, ``timeout`` s at most."""
            for _ in range(int(timeout / 0.05)):
                if await asyncio.to_thread(check):
                    return
                await asyncio.sleep(0.05)

        async def measured(
            kind: str, proxy: int, makes: Sequence[Callable[[], Awaitable[Any]]]
        ) -> tuple[list[Any], dict[str, Any]]:
            pids = {"proxy": [proxy], "workers": wpids, "client": [me]}
            c0 = {k: cpu_seconds(v) for k, v in pids.items()}
            t0 = time.monotonic()
            got, took, errors = await burst(makes)
            span = max(took, default=math.nan)
            await asyncio.sleep(0.2)  # what the last ones set off
            c1 = {k: cpu_seconds(v) for k, v in pids.items()}
            ok = len(took)
            row = {
                "kind": kind,
                "n": n,
                "ok": ok,
                "errors": len(errors),
                "error_sample": errors[:3],
                "span_s": span,
                "per_s": ok / span if ok else 0.0,
                "latency_s": summary(took, (50, 99)),
                "us_per_op": {k: 1e6 * (c1[k] - c0[k]) / max(ok, 1) for k in pids},
                "wall_s": time.monotonic() - t0,
            }
            log(
                f"storm {kind}: {ok}/{n} in {span:.2f}s = {row['per_s']:,.0f}/s, proxy "
                f"{row['us_per_op']['proxy']:,.0f} us each"
            )
            return got, row

        async def plain(url: str, prefix: str, extra: dict[str, str]) -> ClientConnection:
            return await connect(
                f"{url}?session={prefix}", additional_headers=extra, open_timeout=30
            )

        for r in range(args.storm_rounds):
            # resume: idle sessions, cut, then all back at once
            sem = asyncio.Semaphore(OPEN_PARALLEL)
            clients = [Cut(wslb_url, f"storm{r}-{i}") for i in range(n)]

            async def opened(c: Cut, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await c.open()

            await asyncio.gather(*(opened(c) for c in clients))
            for c in clients:
                c.cut()
            await wait_for(lambda: detached() >= n)
            got, row = await measured("resume", lb.pid, [c.resume for c in clients])
            row["round"] = r
            out.append(row)
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            await wait_for(lambda: not held())
            for kind, url, pid, extra in (
                ("wslb plain", wslb_url, lb.pid, {}),
                ("nginx plain", nginx_url, nginx.pid, WORKER_AUTH),
            ):
                tag = f"{kind.split()[0]}{r}"
                makes = [functools.partial(plain, url, f"{tag}-{i}", extra) for i in range(n)]
                got, row = await measured(kind, pid, makes)
                row["round"] = r
                out.append(row)
                await asyncio.gather(*(g.close() for g in got), return_exceptions=True)
                await wait_for(lambda: not held())
    return out


def storm_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    w = out.append
    w(
        f"(b) a burst of {args.storm} connects at once from one client process, one wslb process "
        f"(resume on, no cluster) and nginx (1 worker process) in front of {args.storm_workers} "
        "reference workers; resume: idle sessions cut, then all back at once with token and "
        "count; plain: new sessions"
    )
    w("")
    w(
        "| round | burst | ok/n | per second | to 101 ms p50/p99/max | proxy us/upgrade | "
        "workers us/upgrade | client us/upgrade |"
    )
    w("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        u = r["us_per_op"]
        w(
            f"| {r['round'] + 1} | {r['kind']} | {r['ok']}/{r['n']} | {f0(r['per_s'])} | "
            f"{ms3(r['latency_s'])} | {f0(u['proxy'])} | {f0(u['workers'])} | {f0(u['client'])} |"
        )
    w("")
    med: dict[str, dict[str, float]] = {}
    for kind in ("resume", "wslb plain", "nginx plain"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        med[kind] = {
            "per_s": statistics.median(r["per_s"] for r in rs),
            "us": statistics.median(r["us_per_op"]["proxy"] for r in rs),
        }
        w(
            f"- {kind}: {_spread(rs, 'per_s')} per second, proxy CPU "
            f"{_spread(rs, 'us_per_op.proxy')} us each "
            f"(=> {1e6 / max(med[kind]['us'], 1e-9):,.0f}/s of one core's CPU); errors "
            f"{sum(r['errors'] for r in rs)}"
        )
    if "nginx plain" in med:
        for kind in ("resume", "wslb plain"):
            if kind in med:
                w(
                    f"- {kind} / nginx plain: CPU per upgrade x"
                    f"{med[kind]['us'] / max(med['nginx plain']['us'], 1e-9):.1f}, per second x"
                    f"{med[kind]['per_s'] / med['nginx plain']['per_s']:.2f}"
                )
    w(
        "- per second is wall-clock from the first connect to the last 101, with the client, "
        "the workers and the proxy sharing the machine's cores"
    )
    return out


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="wslb rollout: a tier replaced under resuming streams; resumes/s of one "
        "process beside plain upgrades through nginx.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add: Callable[..., Any] = p.add_argument
    add("--quick", action="store_true", help="a smoke run: few sessions, short times, one run")
    add("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    add("--sessions", type=int, default=300, help="streaming sessions through the tier")
    add("--rate", type=float, default=10.0, help="tokens/s per session")
    add("--workers", type=int, default=3, help="reference workers behind the tier")
    add("--repeat", type=int, default=3, help="runs of each tier part, rounds of the storm")
    add("--steady", type=float, default=5.0, help="seconds of steady state before and after")
    add("--storm", type=int, default=300, help="connects at once per burst")
    add("--storm-rounds", type=int, default=5, help="rounds of the three bursts")
    add("--storm-workers", type=int, default=2, help="reference workers in the storm part")
    add("--json", type=Path, default=None, help="also write every figure to this file")
    return p


QUICK = {
    "sessions": 24,
    "rate": 20.0,
    "workers": 2,
    "repeat": 1,
    "steady": 1.0,
    "storm": 40,
    "storm_rounds": 1,
}


def main(argv: Sequence[str] | None = None) -> int:
    args, parts = parse_args_quick(build_parser(), argv, QUICK, PARTS)
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    raise_nofile()
    haproxy_binary()  # installed before anything is timed
    info = {
        **machine(),
        "loadavg": os.getloadavg(),
        "tree": tree_state(),
        "command": " ".join(["python", "bench/rollout.py", *map(shlex.quote, sys.argv[1:])]),
    }
    la = info["loadavg"]
    print(f"command: {info['command']}", flush=True)
    print(f"machine: {machine_line(info)}; loadavg before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print(f"wslb tree: {info['tree']}")
    print(
        "etcd, HAProxy, the wslb instances, nginx, the workers and the clients (one process) "
        "share the machine (and whatever else runs on it)",
        flush=True,
    )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    doc: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="wslb-rollout-") as tmp,
            asyncio.Runner(loop_factory=loop_factory) as runner,
        ):
            runs: list[dict[str, Any]] = []
            for r in range(args.repeat):
                for how in ("sigterm", "kill"):
                    if how in parts:
                        d = Path(tmp) / f"{how}-{r}"
                        d.mkdir()
                        runs.append(runner.run(tier_run(args, how, r, d)))
            if runs:
                doc["tier"] = runs
                print("\n" + "\n".join(tier_report(runs, args)), flush=True)
            if "storm" in parts:
                d = Path(tmp) / "storm"
                d.mkdir()
                rows = runner.run(storm_run(args, d))
                doc["storm"] = rows
                print("\n" + "\n".join(storm_report(rows, args)), flush=True)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
