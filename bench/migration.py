#!/usr/bin/env python3
"""Migration benchmark: the pause live sessions see when their worker is drained; drain time.

For each ``--sessions`` count N (a list sweeps), the script starts ``--workers`` reference workers
(``backends.worker``) and wslb in front of them, all on 127.0.0.1, and opens N chat sessions
through wslb from this process (aiohttp, uvloop when installed). Every session asks for a long
answer (``--answer`` tokens at ``--rate`` tokens/s) and asks again when it is done, checking that
every token arrives exactly once, in order, with the text ``backends.model.token_text`` gives it.
After ``--warmup`` seconds it drains the worker holding the most sessions
(``POST /backends/{id}/drain {"migrate": true}``), waits for the state ``drained`` and records:

- **pause** (wslb's measure, from ``GET /sessions``: ``migration_pauses_ms``): from the freeze
  request to the first message on the new worker leg, one per migration.
- **stall** (the client's measure): for each moved session, the largest gap between two messages
  around the drain minus that session's median gap, i.e. the extra wait the user sees. The same
  measure over sessions that did not move (**control**) shows the jitter the load alone causes.
- **drain**: wslb's ``drain.finished - drain.started``, and the client's view (from the drain
  request to ``state == drained``, polled every 20 ms).
- **token errors**: lost, duplicated, out-of-order or wrong tokens, unexpected messages and
  closes, sessions that failed to connect. All must be 0.

It then explains the pause from the processes' logs (wslb logs ``session X moved A -> B in N ms``,
the workers log ``froze session X`` and ``thawed session X (kv ..., T ms)``, all at 1 ms
resolution): request -> freeze handled, freeze handled -> thaw handled, thaw handled -> first
message on the new leg, of which the simulated model accounts for at most the KV transfer and
the prefill (the transfer starts at the thaw and overlaps wslb's resume connect). Finally
``--probe`` sessions connected straight to two loaded workers are handed off one at a time with
the step timed from outside (freeze POST, thaw POST, resume handshake, first token), which is the
floor of the protocol on this machine under the same load.

Not a test: pytest collects only ``tests/``. Run ``python bench/migration.py --help``.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.chat import LagMonitor, Stream  # noqa: E402
from bench.lib.cpu import cpu_sample, cpu_window  # noqa: E402
from bench.lib.launch import WORKER_AUTH, Procs, Worker, Wslb  # noqa: E402
from bench.lib.machine import machine, machine_line, tree_state  # noqa: E402
from bench.lib.script import parse_sizes, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import pct, summary  # noqa: E402
from bench.lib.wslb import Admin, log_time, wait_active  # noqa: E402

CONNECT_PARALLEL = 32  # WebSocket handshakes in flight while opening the sessions
CONNECT_TIMEOUT = 30.0  # seconds to open every session
DRAIN_POLL = 0.02  # seconds between admin polls while waiting for "drained"
STALL_SLACK = 0.3  # seconds after "drained" still searched for the migration gap
HASH_BALANCE_FACTOR = 1.5


# -- wslb's admin API, logs and metrics -------------------------------------------------------


def prom_samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


_TS = r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d{3}(?:[+-]\d\d:\d\d|Z)?)"
MOVED_RE = re.compile(_TS + r" INFO \S+: session (\S+) moved (\S+) -> (\S+) in ([\d.]+) ms")
# Every other line of wslb's migration logger is about a failure (retried, restored, closed).
FAILED_RE = re.compile(_TS + r" (?:INFO|WARNING) wslb\.migrate: session (\S+): (.*)")
FROZE_RE = re.compile(_TS + r" INFO \S+: froze session (\S+): sent=(\d+) received=(\d+)")
THAWED_RE = re.compile(_TS + r" INFO \S+: thawed session (\S+) \(kv (\w+), ([\d.]+) ms\)")


@dataclass
class Steps:
    """Where one migration's pause went, from the logs (ms; the logs have 1 ms resolution)."""

    sid: str
    pause: float  # wslb's measure
    to_freeze: float  # wslb froze the client (start of the pause) -> old worker handled freeze
    to_thaw: float  # old worker handled freeze -> new worker handled thaw
    to_first: float  # new worker handled thaw -> first message on the new leg (end of pause)
    model: float  # of ``to_first``, at most: the simulated KV transfer and prefill
    transfer: float  # the KV transfer alone
    prefill: float  # the prefill of the context not in the new worker's KV cache


@dataclass(frozen=True)
class ModelCost:
    """The reference worker's simulated times, to take out of the pause (see ``resume_turn``):
    a resumed answer waits what is left of the KV transfer (it starts at the thaw, so wslb's
    resume connect overlaps it: the figure is an upper bound) and the prefill of the context
    not transferred; its next token is then due at once (``run_turn``: no decode interval)."""

    prefill_ms_per_token: float
    kv_transfer_ms_per_token: float

    def __call__(self, transfer_ms: float, context: int) -> tuple[float, float]:
        """(the whole model time, of which prefill) in ms."""
        cached = round(transfer_ms / self.kv_transfer_ms_per_token)
        prefill = max(0, context - cached) * self.prefill_ms_per_token
        return transfer_ms + prefill, prefill


def log_steps(
    wslb_log: str,
    worker_logs: Sequence[str],
    cost: ModelCost,
    context_at: Callable[[str, int], int | None],
) -> tuple[list[Steps], list[str]]:
    """Per migrated session, the pause split at the workers' log lines; and failure lines.

    ``context_at(sid, sent)``: context tokens of the session when its old worker had sent
    ``sent`` messages (None: unknown session)."""
    froze: dict[str, tuple[float, int]] = {}
    thawed: dict[str, tuple[float, float]] = {}
    for text in worker_logs:
        for m in FROZE_RE.finditer(text):
            froze[m[2]] = (log_time(m[1]), int(m[3]))
        for m in THAWED_RE.finditer(text):
            thawed[m[2]] = (log_time(m[1]), float(m[4]))
    steps: list[Steps] = []
    for m in MOVED_RE.finditer(wslb_log):
        sid, pause = m[2], float(m[5])
        if sid not in froze or sid not in thawed:
            continue
        (t_froze, sent), (t_thawed, transfer) = froze[sid], thawed[sid]
        context = context_at(sid, sent)
        if context is None:
            continue
        model, prefill = cost(transfer, context)
        end = log_time(m[1])
        start = end - pause / 1e3
        steps.append(
            Steps(
                sid=sid,
                pause=pause,
                to_freeze=(t_froze - start) * 1e3,
                to_thaw=(t_thawed - t_froze) * 1e3,
                to_first=(end - t_thawed) * 1e3,
                model=model,
                transfer=transfer,
                prefill=prefill,
            )
        )
    failures = [m[0] for m in FAILED_RE.finditer(wslb_log)]
    return steps, failures


# -- the handoff probe: the protocol's steps timed from outside ------------------------------


async def probe_handoffs(
    http: aiohttp.ClientSession, a_port: int, b_port: int, count: int, tag: str
) -> dict[str, list[float]]:
    """Hand ``count`` sessions, one at a time, from worker A to worker B the way wslb does."""
    steps: dict[str, list[float]] = {"freeze": [], "thaw": [], "resume": [], "first": []}
    timeout = aiohttp.ClientTimeout(5)
    for j in range(count):
        sid = f"probe-{tag}-{j}"
        old = await http.ws_connect(
            f"ws://127.0.0.1:{a_port}/ws?session={sid}", headers=WORKER_AUTH
        )
        new: aiohttp.ClientWebSocketResponse | None = None
        try:
            await old.receive_json(timeout=5)  # hello
            await old.send_str(json.dumps({"type": "prompt", "text": "probe", "max_tokens": 10**5}))
            for _ in range(3):
                await old.receive(timeout=5)
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{a_port}/wslb/sessions/{sid}/freeze"
            async with http.post(url, json={}, headers=WORKER_AUTH, timeout=timeout) as r:
                frozen = await r.json()
            t1 = time.perf_counter()
            url = f"http://127.0.0.1:{b_port}/wslb/sessions/{sid}/thaw"
            body = {"state": frozen["state"]}
            async with http.post(url, json=body, headers=WORKER_AUTH, timeout=timeout) as r:
                if r.status != 200:
                    raise RuntimeError(f"probe thaw answered {r.status}: {await r.text()}")
            t2 = time.perf_counter()
            new = await http.ws_connect(
                f"ws://127.0.0.1:{b_port}/ws", headers={**WORKER_AUTH, "X-WSLB-Resume": sid}
            )
            t3 = time.perf_counter()
            first = await new.receive(timeout=5)
            t4 = time.perf_counter()
            if first.type is not aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"probe: no token after resume: {first!r}")
        finally:
            await old.close()
            if new is not None:
                await new.close()
        for name, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[name].append(v * 1e3)
    return steps


# -- one run ---------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class RunResult:
    sessions: int
    repeat: int
    drained: str
    moved: int
    mid_answer_at_drain: int
    migrated: int
    fallback: int
    failed: int
    pauses_ms: list[float]
    stalls_ms: list[float]
    control_stalls_ms: list[float]
    gaps_ms: list[float]  # the moved sessions' raw migration gaps
    median_gap_ms: float
    drain_s: float
    drain_client_s: float
    errors: dict[str, int]
    metrics: dict[str, float]
    cpu_steady: dict[str, float]
    cpu_drain: dict[str, float]
    client_lag_ms: dict[str, float]
    steps: list[dict[str, float | str]]
    failure_lines: list[str]
    targets: dict[str, int]  # migrations per new worker
    sessions_before: dict[str, int]  # live sessions per worker before the drain, and after
    sessions_after: dict[str, int]
    bound_after: dict[str, int]  # hash_balance_factor x weighted share of the sessions left
    probe_ms: dict[str, list[float]]
    loadavg: tuple[float, float, float]


def load_bounds(after: dict[str, int], weights: dict[str, float], drained: str) -> dict[str, int]:
    """Each remaining worker's bounded-load cap (SPEC 4, ``balancer.ring.load_bound``) for the
    sessions left, with the effective weights read before the drain."""
    ready = {b: w for b, w in weights.items() if b != drained}
    total, wsum = sum(after.values()), sum(ready.values())
    if wsum <= 0:
        return {}
    return {b: math.ceil(HASH_BALANCE_FACTOR * total * w / wsum - 1e-9) for b, w in ready.items()}


def start_system(procs: Procs, args: argparse.Namespace) -> tuple[list[Worker], Wslb]:
    """The workers (each listening before the next starts), then wslb (both its ports)."""
    workers = []
    for k in range(args.workers):
        wid = f"w{k + 1}"
        wargs = [
            "--tokens-per-s", f"{args.rate:g}", "--max-batch", str(args.max_batch),
            "--handoff-kv", args.handoff_kv,
            "--prefill-ms-per-token", f"{args.prefill_ms_per_token:g}",
            "--kv-transfer-ms-per-token", f"{args.kv_transfer_ms_per_token:g}",
        ]  # fmt: skip
        workers.append(Worker(wid, wargs, procs=procs, name=wid).start(timeout=20.0))
    config = {
        "pools": [
            {
                "name": "chat",
                "hash_balance_factor": HASH_BALANCE_FACTOR,
                "drain": {"timeout": f"{args.drain_timeout:g}s", "migrate": True},
                "backends": [{"id": w.id, "url": w.url} for w in workers],
            }
        ],
        "timeouts": {"ping_interval": "20s", "close": "2s"},
    }
    command = shlex.split(args.wslb_cmd) if args.wslb_cmd else None
    wslb = Wslb(
        config,
        procs.logdir,
        procs=procs,
        name="wslb",
        token=secrets.token_urlsafe(32),
        command=command,
    )
    return workers, wslb.start(wait_ready=False, timeout=20.0)


def wait_idle(limit: float, busy_max: float = 15.0) -> float:
    """Wait up to ``limit`` seconds for a 2 s window with the machine under ``busy_max`` % busy
    (other jobs sharing it); returns the last window's busy %."""
    deadline = time.monotonic() + limit
    while True:
        a = cpu_sample({})
        time.sleep(2.0)
        busy = cpu_window(a, cpu_sample({}))["machine"]
        if busy < busy_max or time.monotonic() > deadline:
            return busy
        log(f"machine {busy:.0f}% busy with other jobs; waiting for it to settle")


async def run_once(args: argparse.Namespace, n: int, rep: int, logdir: Path) -> RunResult:
    with Procs(logdir) as procs:
        workers, wslb = start_system(procs, args)
        return await _measure(args, n, rep, procs, workers, wslb)


async def _measure(
    args: argparse.Namespace,
    n: int,
    rep: int,
    procs: Procs,
    workers: list[Worker],
    wslb: Wslb,
) -> RunResult:
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        aiohttp.ClientSession() as admin_http,
    ):
        admin = Admin(admin_http, wslb)
        await wait_active(admin)
        pids = {
            "wslb": [wslb.pid],
            "workers": [w.pid for w in workers],
            "client": [os.getpid()],
        }
        lag = LagMonitor()
        lag.start()
        streams = [Stream(f"mig{n}r{rep}s{i}", args.answer) for i in range(n)]
        gate = asyncio.Semaphore(CONNECT_PARALLEL)
        url = wslb.url
        tasks = [asyncio.ensure_future(s.run(http, url, gate)) for s in streams]
        try:
            deadline = time.monotonic() + CONNECT_TIMEOUT
            while not all(s.connected or t.done() for s, t in zip(streams, tasks, strict=True)):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            failed = [s.sid for s, t in zip(streams, tasks, strict=True) if not s.connected]
            for s, t in zip(streams, tasks, strict=True):
                if t.done() and not s.connected and t.exception() is not None:
                    log(f"session {s.sid} failed to connect: {t.exception()!r}")
            log(f"N={n} rep {rep + 1}: {n - len(failed)} sessions open; warmup {args.warmup:g}s")
            if len(failed) == n:
                raise RuntimeError(f"no session could connect; see {procs.logdir}/wslb.log")
            a = cpu_sample(pids)
            await asyncio.sleep(args.warmup)
            listing = await admin.get("/backends")
            backends = {b["id"]: b["sessions"] for b in listing}
            weights = {b["id"]: float(b["effective_weight"]) for b in listing}
            target = max(sorted(backends), key=lambda b: backends[b])
            on_target = [s for s in streams if s.first_worker == target]
            mid = sum(1 for s in on_target if s.in_answer())
            log(f"draining {target} ({backends[target]} sessions, {mid} mid-answer): {backends}")
            b = cpu_sample(pids)
            t0 = time.monotonic()
            status, body = await admin.post(
                f"/backends/{target}/drain",
                {"migrate": True, "timeout": f"{args.drain_timeout:g}s"},
            )
            if status != 202:
                raise RuntimeError(f"drain answered {status}: {body}")
            view: dict[str, Any] = {}
            drain_deadline = t0 + args.drain_timeout + 15.0
            while time.monotonic() < drain_deadline:
                view = await admin.get(f"/backends/{target}")
                if view["state"] == "drained":
                    break
                await asyncio.sleep(DRAIN_POLL)
            t1 = time.monotonic()
            c = cpu_sample(pids)
            if view.get("state") != "drained":
                raise RuntimeError(f"{target} not drained after {t1 - t0:.1f}s: {view}")
            log(f"{target} drained in {t1 - t0:.3f}s (client view): {view['drain']}")
            await asyncio.sleep(args.after)
            live = await admin.get("/sessions")
            after = {b["id"]: b["sessions"] for b in await admin.get("/backends")}
            metrics = prom_samples(await admin.get("/metrics"))
            probe: dict[str, list[float]] = {}
            if args.probe > 0:
                others = [w.port for w in workers if w.id != target]
                if len(others) >= 2:
                    probe = await probe_handoffs(
                        http, others[0], others[1], args.probe, f"{n}r{rep}"
                    )
        finally:
            for s in streams:
                s.stopping = True
            closing = [s.ws.close() for s in streams if s.ws is not None and not s.ws.closed]
            if closing:
                await asyncio.wait([asyncio.ensure_future(x) for x in closing], timeout=10)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await lag.stop()
            for s in streams:
                s.finish()

    drain = view["drain"]
    by_sid = {s["id"]: s for s in live}
    moved = [s for s in streams if by_sid.get(s.sid, {}).get("migrations", 0) > 0]
    pauses = [p for s in moved for p in by_sid[s.sid]["migration_pauses_ms"]]
    stalls, gaps, controls, medians = [], [], [], []
    moved_ids = {s.sid for s in moved}
    for s in streams:
        st = s.stall(t0, t1 + STALL_SLACK)
        if st is None:
            continue
        gap, median = st
        medians.append(median)
        if s.sid in moved_ids:
            stalls.append((gap - median) * 1e3)
            gaps.append(gap * 1e3)
        elif s.first_worker != target:
            controls.append((gap - median) * 1e3)
    errors = {
        "connect_failed": len(failed),
        "lost": sum(s.lost for s in streams),
        "duplicated": sum(s.duplicated for s in streams),
        "out_of_order": sum(s.out_of_order for s in streams),
        "bad_text": sum(s.bad_text for s in streams),
        "unexpected": sum(s.unexpected for s in streams),
        "closes": sum(s.closes for s in streams),
        # a session of the drained worker that wslb did not move and that is still open
        "not_moved": sum(1 for s in on_target if s.sid not in moved_ids and s.closes == 0),
    }
    for s in streams:
        if s.closes:
            log(f"session {s.sid} closed: {s.close_info}")
    by_stream = {s.sid: s for s in streams}

    def context_at(sid: str, sent: int) -> int | None:
        s = by_stream.get(sid)
        return None if s is None else s.context_at(sent)

    cost = ModelCost(args.prefill_ms_per_token, args.kv_transfer_ms_per_token)
    steps, failure_lines = log_steps(
        wslb.output(), [procs.log(w.name) for w in workers], cost, context_at
    )
    moved_steps = [st for st in steps if st.sid in moved_ids]
    return RunResult(
        sessions=n,
        repeat=rep,
        drained=target,
        moved=int(drain["sessions_at_start"]),
        mid_answer_at_drain=mid,
        migrated=int(drain["migrated"]),
        fallback=int(drain["closed_after_answer"]) + int(drain["closed_at_timeout"]),
        failed=int(drain["migration_failures"]),
        pauses_ms=pauses,
        stalls_ms=stalls,
        control_stalls_ms=controls,
        gaps_ms=gaps,
        median_gap_ms=statistics.median(medians) * 1e3 if medians else math.nan,
        drain_s=float(drain["finished"]) - float(drain["started"]),
        drain_client_s=t1 - t0,
        errors=errors,
        metrics={
            k: v
            for k, v in metrics.items()
            if k.startswith(("wslb_migrations_total", "wslb_migration_pause_seconds_"))
            or k.startswith("wslb_drain_duration_seconds_")
        },
        cpu_steady=cpu_window(a, b),
        cpu_drain=cpu_window(b, c),
        client_lag_ms={
            "p99": pct(lag.window(t0, t1), 99) * 1e3,
            "max": max(lag.window(t0, t1), default=math.nan) * 1e3,
        },
        steps=[asdict(st) for st in moved_steps],
        failure_lines=failure_lines,
        targets=dict(Counter(by_sid[s.sid]["backend"] for s in moved)),
        sessions_before=backends,
        sessions_after=after,
        bound_after=load_bounds(after, weights, target),
        probe_ms=probe,
        loadavg=os.getloadavg(),
    )


# -- report ----------------------------------------------------------------------------------


def f1(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def table_row(label: str, rs: Sequence[RunResult]) -> str:
    pauses = [p for r in rs for p in r.pauses_ms]
    stalls = [p for r in rs for p in r.stalls_ms]
    ps, ss = summary(pauses, (50, 90, 99)), summary(stalls, (50, 90, 99))
    errors = sum(v for r in rs for v in r.errors.values())
    drain = "/".join(f"{r.drain_s:.2f}" for r in rs)
    drain_c = "/".join(f"{r.drain_client_s:.2f}" for r in rs)
    return (
        f"| {label} | {sum(r.moved for r in rs)} | {sum(r.migrated for r in rs)}/"
        f"{sum(r.fallback for r in rs)}/{sum(r.failed for r in rs)} | {f1(ps['p50'])} | "
        f"{f1(ps['p90'])} | {f1(ps['p99'])} | {f1(ps['max'])} | {f1(ss['p50'])} | "
        f"{f1(ss['p99'])} | {drain} | {drain_c} | {errors} |"
    )


def report(info: dict[str, Any], results: list[RunResult], args: argparse.Namespace) -> str:
    out: list[str] = []
    w = out.append
    la = info["loadavg_before"]
    w(f"machine: {machine_line(info)}; loadavg before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    w(f"wslb tree: {info['tree']}")
    w(f"command: {info['command']}")
    w(
        f"load: {args.workers} workers at {args.rate:g} tokens/s per stream "
        f"(max-batch {args.max_batch}, handoff-kv {args.handoff_kv}), answers of "
        f"{args.answer} tokens, drain after {args.warmup:g}s; workers, wslb and this client "
        "share the machine"
    )
    w("")
    w(
        "| N | moved | migrated/fallback/failed | pause p50 ms | p90 | p99 | max | "
        "stall p50 ms | p99 | drain s (wslb) | drain s (client) | token errors |"
    )
    w("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sizes = list(dict.fromkeys(r.sessions for r in results))
    for n in sizes:
        rs = [r for r in results if r.sessions == n]
        w(table_row(str(n) if len(rs) == 1 else f"{n} (x{len(rs)})", rs))
    w("")
    w(
        "pause: wslb's measure (freeze request -> first message on the new leg), over every "
        "migration; stall: client's largest inter-message gap during the drain minus its "
        f"median gap (the median gap was ~{f1(statistics.median(r.median_gap_ms for r in results))}"
        " ms). Percentiles interpolate between ranks: with ~N/4 migrations p99 is close to max."
    )
    w("")
    w("where the pause goes (ms, p50 / p99 over migrations; from the logs, 1 ms resolution):")
    w("")
    w(
        "| N | hold -> freeze handled | -> thaw handled | -> first msg on new leg | "
        "of which model, at most (KV transfer + prefill) | rest of that step | pause | "
        "pause - model |"
    )
    w("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        st = [s for r in results if r.sessions == n for s in r.steps]
        if not st:
            continue

        def pp(key: str, st: list[dict[str, Any]] = st) -> str:
            v = [float(s[key]) for s in st]
            return f"{f1(pct(v, 50))} / {f1(pct(v, 99))}"

        rest = [float(s["to_first"]) - float(s["model"]) for s in st]
        over = [float(s["pause"]) - float(s["model"]) for s in st]
        w(
            f"| {n} | {pp('to_freeze')} | {pp('to_thaw')} | {pp('to_first')} | {pp('model')} | "
            f"{f1(pct(rest, 50))} / {f1(pct(rest, 99))} | {pp('pause')} | "
            f"{f1(pct(over, 50))} / {f1(pct(over, 99))} |"
        )
    w("")
    w("machine load and checks per run:")
    w("")
    for r in results:
        cs, cd = r.cpu_steady, r.cpu_drain
        ctl = summary(r.control_stalls_ms, (50, 90, 99))
        w(
            f"- N={r.sessions} rep {r.repeat + 1}: drained {r.drained} ({r.moved} sessions, "
            f"{r.mid_answer_at_drain} mid-answer); CPU % of one core, steady / during drain: "
            f"wslb {cs['wslb']:.0f}/{cd['wslb']:.0f}, workers {cs['workers']:.0f}/"
            f"{cd['workers']:.0f}, client {cs['client']:.0f}/{cd['client']:.0f}, other jobs "
            f"{cs['others']:.0f}/{cd['others']:.0f}; machine busy "
            f"{cs['machine']:.0f}%/{cd['machine']:.0f}% of {info['nproc']} cores; "
            f"loadavg after {r.loadavg[0]:.2f}"
        )
        w(
            f"  control stall (sessions not moved) p50/p99/max {f1(ctl['p50'])}/"
            f"{f1(ctl['p99'])}/{f1(ctl['max'])} ms; client loop lag during drain "
            f"p99/max {f1(r.client_lag_ms['p99'])}/{f1(r.client_lag_ms['max'])} ms"
        )
        before, after = (
            dict(sorted(r.sessions_before.items())),
            dict(sorted(r.sessions_after.items())),
        )
        w(f"  moved to {dict(sorted(r.targets.items()))}; sessions before {before}, after {after}")
        above = {
            b: f"{n} > {r.bound_after[b]}" for b, n in after.items() if n > r.bound_after.get(b, n)
        }
        if above:
            w(f"  over the bounded-load cap after the drain: {above}")
        bad = {k: v for k, v in r.errors.items() if v}
        w(f"  token errors: {bad or 'none'}")
        m = r.metrics
        results_m = {
            k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("wslb_migrations_total")
        }
        w(
            f"  /metrics: migrations {results_m}, pause histogram count "
            f"{int(m.get('wslb_migration_pause_seconds_count', 0))}, drain duration sum "
            f"{m.get('wslb_drain_duration_seconds_sum', math.nan):.3f}s"
        )
        if r.probe_ms:
            parts = ", ".join(
                f"{k} {f1(pct(v, 50))}/{f1(pct(v, 99))}" for k, v in r.probe_ms.items()
            )
            w(
                f"  probe ({len(r.probe_ms['freeze'])} handoffs straight to two loaded workers, "
                f"p50/p99 ms): {parts}"
            )
        for line in r.failure_lines[:5]:
            w(f"  wslb: {line}")
    w("")
    for n in sizes:
        p99 = pct([p for r in results if r.sessions == n for p in r.pauses_ms], 99)
        verdict = "met" if p99 < args.target_ms else "NOT met"
        w(f"N={n}: pause p99 {f1(p99)} ms, target < {args.target_ms:g} ms {verdict}")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Migration pause and drain duration of wslb for N live sessions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add: Callable[..., Any] = p.add_argument
    add("--sessions", type=parse_sizes, default=[100], help="N, or a list N,N,... to sweep")
    add("--workers", type=int, default=4, help="reference workers behind wslb")
    add("--rate", type=float, default=30.0, help="tokens/s of each stream")
    add("--answer", type=int, default=0, help="tokens per answer; 0: long enough for the run")
    add("--max-batch", type=int, default=1024, help="worker --max-batch (streams at full rate)")
    add("--handoff-kv", choices=["transfer", "prefill"], default="transfer")
    add("--prefill-ms-per-token", type=float, default=0.2, help="worker option of that name")
    add("--kv-transfer-ms-per-token", type=float, default=0.02, help="worker option")
    add("--warmup", type=float, default=3.0, help="seconds of streaming before the drain")
    add("--after", type=float, default=2.0, help="seconds of streaming after the drain")
    add("--drain-timeout", type=float, default=60.0, help="drain timeout given to wslb (s)")
    add("--probe", type=int, default=20, help="handoffs timed step by step from outside; 0: off")
    add("--repeat", type=int, default=1, help="runs per N (fresh processes each)")
    add("--target-ms", type=float, default=50.0, help="the pause p99 goal")
    add("--keep-logs", type=Path, default=None, help="copy the processes' logs here")
    add("--wait-idle", type=float, default=0.0, help="before each run, wait up to S s for a "
        "quiet machine (under 15%% busy over 2 s); 0: do not wait")  # fmt: skip
    add("--wslb-cmd", default="", help="command starting wslb; empty: this python -m balancer")
    add("--json", action="store_true", help="print every run as JSON instead of tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 2 or args.repeat < 1 or args.rate <= 0 or args.warmup < 0:
        raise SystemExit("need --workers >= 2, --repeat >= 1, --rate > 0, --warmup >= 0")
    if args.answer <= 0:
        # Every session must still be in its first answer when the drain and the after-window end.
        args.answer = math.ceil(args.rate * (args.warmup + args.after + 20.0))
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    info = machine() | {
        "loadavg_before": os.getloadavg(),
        "tree": tree_state(),
        "command": " ".join(["python", "bench/migration.py", *map(shlex.quote, sys.argv[1:])]),
    }
    results: list[RunResult] = []
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    try:
        with tempfile.TemporaryDirectory(prefix="wslb-migration-") as tmp:
            for n in args.sessions:
                for rep in range(args.repeat):
                    logdir = Path(tmp) / f"n{n}-r{rep}"
                    logdir.mkdir()
                    if args.wait_idle > 0:
                        busy = wait_idle(args.wait_idle)
                        log(f"machine {busy:.0f}% busy before N={n} rep {rep + 1}")
                    try:
                        with asyncio.Runner(loop_factory=loop_factory) as runner:
                            results.append(runner.run(run_once(args, n, rep, logdir)))
                    finally:
                        if args.keep_logs is not None:
                            shutil.copytree(
                                logdir, args.keep_logs / logdir.name, dirs_exist_ok=True
                            )
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json:
        doc = {"machine": info, "args": vars(args), "runs": [asdict(r) for r in results]}
        print(json.dumps(doc, default=str, indent=1))
    else:
        print(report(info, results, args))
    errors = sum(v for r in results for v in r.errors.values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
