#!/usr/bin/env python3
"""Routing benchmark: KV-cache locality, TTFT and balance of wslb's balancing modes.

A multi-turn chat workload runs against reference workers (``backends.worker``) with a finite
KV cache, through wslb, once per balancing mode and run:

- ``--workload reconnect`` (the default): 90 sessions of 5 turns, one WebSocket per
  turn, three identical workers; ``burst``: every first turn within 0.3 s,
  6 turns, think 0.6 s, ``--max-batch 10 --kv-capacity-tokens 26000``, seed 22: the ring
  favours w3 with 38 of the 90 keys; ``mixed`` is the benchmark's earlier one (300 sessions
  of 4-6 turns, half of them reconnecting per turn, four workers). Sessions arrive as a Poisson
  process over ``--arrival-s`` seconds, with an exponential think time (``--think-s`` mean)
  between turns. Every session starts with the same ``--system-words`` system prompt; user
  prompts and answers are ``--prompt-words`` words / ``--answer-tokens`` tokens, so the context
  grows turn by turn. Every prompt carries the whole conversation (``messages``), as
  chat-completions clients send it, so a session that lands on a new worker still has its
  context (and pays its prefill).
- Modes (``--modes``): ``default`` is ``consistent`` with wslb's defaults (load-aware weights,
  placement for the whole conversation, moves only when they pay: ``balancer.selection``),
  with ``placement.bytes_per_token`` set to ``--bytes-per-token`` (the reference worker's
  words); ``ring-first`` the same with ``placement.choices: 1`` (plain bounded-load
  placement); ``strict-bound`` with ``affinity_ceiling`` = c (every placement within c x its
  share); ``static-bound`` that with static weights; ``static-sticky`` static weights and
  c = ``--sticky-factor`` (100: nothing ever moves); ``round_robin`` (and ``least_conn``) with
  the load-aware weights (or static ones with ``--baseline-weights static``); ``haproxy``
  HAProxy itself (Debian's package) with ``balance url_param session``, ``hash-type
  consistent`` and ``hash-balance-factor`` c x 100. The session plan (arrivals, prompts,
  think times) is the same for every mode; every run starts fresh workers and a fresh
  balancer.
- Runs (``--runs``): ``even`` (identical workers); ``hetero`` (the last worker has
  ``--hot-background-util`` of its GPU taken by something else: prefill and decode run
  1/(1-U) slower and its GPU utilisation reads at least U); ``hot`` (the worker the ring gives
  the most sessions gets far more load mid-run: ``--side-streams`` connections straight to it,
  bypassing wslb, answering ``--side-tokens``-token prompts back to back during
  ``--side-window``, so it decodes more streams than ``--max-batch``: every stream slows,
  requests queue, its utilisation reads 1).

Measured in the client: TTFT (prompt sent -> first token) for first and follow-up turns apart,
cached tokens per turn (``done.cached_tokens``), the worker of every turn, tokens, failures.
wslb's admin API is polled every ``--poll-s`` for live sessions, held places and effective
weights per worker (the bounded-load check uses what wslb counts: live + held); the polls'
weights also tell when a worker is overloaded by wslb's rule (``selection.overloaded``).
Prints one set of tables per run and its targets (MET / MISSED: on identical workers no
returning key moves, KV hit >= 97% of the ideal, follow-up p99 <= 0.5 x round robin's; with a
slowed or busy worker, follow-up p99 <= HAProxy's), writes
``docs/routing.md`` (tables, command, machine, parameters, definitions; text after an
``<!-- analysis -->`` line of an existing file is kept) and a plot ``docs/routing.png`` (if
matplotlib is importable).

The machine may be shared: each run records the CPU cores this benchmark and everything else
used meanwhile (``--wait-idle-s`` waits for the others to go quiet first). ``--modes`` also
takes weight variants (``NAME=BALANCE:GPU,KV_CACHE,QUEUE[,TPOT]``), ``--code`` runs another
checkout's wslb.

``--sweep N`` (seeded by ``--seed``) runs N random configurations instead (``sweep_cases``:
identical, slowed and mixed workers, 3 to 8 of them, bursts and spread arrivals, conversation
lengths, growth and think times, KV sizes the balanced share fits in) with ``--sweep-modes``
(wslb's default, round robin, HAProxy) and prints a table and the targets per case; ten cases
take about 11 minutes on a 2-core machine.

``--workload keyless`` is another benchmark (``bench/lib/keyless.py``, its own options): chats
with no session key over plain HTTP, through wslb, SGLang's gateway and vLLM's router, on
llama-servers or reference workers, measured by the tokens the engines prefilled.

Not a test: ``pytest`` only collects ``tests/``. ``python bench/routing.py --help``;
``--quick`` for a small version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import random
import secrets
import shlex
import shutil
import signal
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from balancer.config import PlacementCfg, PoolCfg  # noqa: E402
from balancer.pool import HOLD_S  # noqa: E402
from balancer.ring import Ring, load_bound  # noqa: E402
from balancer.selection import overloaded as selection_overloaded  # noqa: E402
from balancer.weights import Coefficients  # noqa: E402
from bench.lib.launch import WORKER_TOKEN, Procs, Worker, Wslb, free_port, wait_port  # noqa: E402
from bench.lib.machine import machine_line  # noqa: E402
from bench.lib.stats import pct  # noqa: E402

ANALYSIS_MARK = "<!-- analysis -->"
DEFAULT_OVERLOAD_RATIO = PoolCfg("").overload_ratio
DEFAULT_CEILING = PoolCfg("").affinity_ceiling
LOAD_AWARE = {"gpu": 0.5, "kv_cache": 0.5, "queue": 0.25, "tpot": 1.0, "min_factor": 0.05}
STATIC = {"gpu": 0.0, "kv_cache": 0.0, "queue": 0.0, "tpot": 0.0, "min_factor": 0.05}
NEW = "default"  # consistent with wslb's defaults: the mode the targets are about
KNOWN_MODES = (
    NEW,
    "ring-first",
    "strict-bound",
    "static-bound",
    "static-sticky",
    "least_conn",
    "round_robin",
    "haproxy",
)
DEFAULT_MODES = (NEW, "ring-first", "round_robin", "haproxy")
SWEEP_MODES = (NEW, "round_robin", "haproxy")
WORKLOADS: dict[str, dict[str, Any]] = {
    # 90 sessions, 5 turns, one WebSocket per turn, three identical workers.
    "reconnect": {
        "sessions": 90,
        "turns": (5, 5),
        "arrival_s": 20.0,
        "think_s": 1.5,
        "reconnect_share": 1.0,
        "workers": 3,
    },
    # A burst (every first turn at once) of 90 conversations of 6 turns, one
    # WebSocket per turn, three identical workers decoding at most 10 streams each, with a
    # KV cache the balanced share fits in. The ring gives w3 38 of the 90 keys (seed 22).
    "burst": {
        "sessions": 90,
        "turns": (6, 6),
        "arrival_s": 0.3,
        "think_s": 0.6,
        "reconnect_share": 1.0,
        "workers": 3,
        "seed": 22,
        "max_batch": 10,
        "kv_capacity_tokens": 26_000,
    },
    # The benchmark's earlier workload.
    "mixed": {
        "sessions": 300,
        "turns": (4, 6),
        "arrival_s": 24.0,
        "think_s": 1.5,
        "reconnect_share": 0.5,
        "workers": 4,
    },
}


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: tuple[int, int]
    think_s: float
    arrival_s: float
    system_words: int
    prompt_words: tuple[int, int]
    answer_tokens: tuple[int, int]
    reconnect_share: float
    turn_timeout_s: float
    seed: int


@dataclass(frozen=True)
class WorkerParams:
    count: int
    tokens_per_s: float
    prefill_ms_per_token: float
    kv_capacity_tokens: int
    max_batch: int
    session_ttl: float
    hot_background_util: float
    # Mixed workers (the sweep): per worker, factors on tokens_per_s and kv_capacity_tokens
    # and a background utilisation of its own (0: none); empty: identical workers.
    mixed: tuple[tuple[float, float, float], ...] = ()

    def args(self, i: int, hot: bool) -> list[str]:
        speed, kv, background = self.mixed[i] if i < len(self.mixed) else (1.0, 1.0, 0.0)
        a = [
            "--tokens-per-s",
            f"{self.tokens_per_s * speed:g}",
            "--prefill-ms-per-token",
            f"{self.prefill_ms_per_token:g}",
            "--kv-capacity-tokens",
            str(round(self.kv_capacity_tokens * kv)),
            "--max-batch",
            str(self.max_batch),
            "--session-ttl",
            f"{self.session_ttl:g}",
            "--simulate-gpu",
            "--log-level",
            "warning",
        ]
        if hot:
            background = self.hot_background_util
        if background > 0:
            a += ["--background-util", f"{background:g}"]
        return a

    def describe(self) -> str:
        """One line for the tables: what the workers are."""
        base = (
            f"{self.count} x `--tokens-per-s {self.tokens_per_s:g} --prefill-ms-per-token "
            f"{self.prefill_ms_per_token:g} --kv-capacity-tokens {self.kv_capacity_tokens} "
            f"--max-batch {self.max_batch}`"
        )
        if not self.mixed:
            return base
        each = ", ".join(
            f"w{i + 1}: speed x{sp:.2f} KV x{kv:.2f}" + (f" bg {bg:.2f}" if bg else "")
            for i, (sp, kv, bg) in enumerate(self.mixed)
        )
        return f"{base}; {each}"


@dataclass(frozen=True)
class Mode:
    name: str
    balance: str
    coefficients: dict[str, float]
    factor: float | None = None  # hash_balance_factor; None: --factor
    pool: dict[str, Any] = field(default_factory=dict)  # more pool keys (affinity_ceiling, ...)
    proxy: str = "wslb"  # or "haproxy": HAProxy's bounded-load hash, c = factor


@dataclass(frozen=True)
class LbParams:
    factor: float
    scrape_s: float
    poll_s: float
    smoothing_s: float | None = None  # weights.smoothing; None: the balancer's default


@dataclass(frozen=True)
class SideLoad:
    """The ``hot`` run's load sent straight to one worker, bypassing wslb (another tenant, a
    batch job): ``streams`` connections answering ``tokens``-token prompts back to back from
    ``start_s`` to ``end_s`` of the run."""

    worker: str
    streams: int
    tokens: int
    start_s: float
    end_s: float


# -- the session plan --------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnPlan:
    think_s: float  # before this turn (0 for the first)
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class SessionPlan:
    sid: str
    start_s: float
    reconnect: bool
    turns: tuple[TurnPlan, ...]


def make_plan(w: Workload) -> tuple[str, list[SessionPlan]]:
    """The shared system prompt and every session's turns, deterministic in ``w.seed``."""
    rng = random.Random(w.seed)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(100_000)}" for _ in range(n))

    system = text(w.system_words)
    starts = sorted(rng.uniform(0.0, w.arrival_s) for _ in range(w.sessions))
    n_reconnect = round(w.sessions * w.reconnect_share)
    reconnect = [True] * n_reconnect + [False] * (w.sessions - n_reconnect)
    rng.shuffle(reconnect)
    plans = []
    for i, (start, rec) in enumerate(zip(starts, reconnect, strict=True)):
        turns = []
        for k in range(rng.randint(*w.turns)):
            think = 0.0 if k == 0 else min(rng.expovariate(1.0 / w.think_s), 5 * w.think_s)
            turns.append(
                TurnPlan(think, text(rng.randint(*w.prompt_words)), rng.randint(*w.answer_tokens))
            )
        plans.append(SessionPlan(f"s{w.seed}-{i:04d}", start, rec, tuple(turns)))
    return system, plans


# -- records -----------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    index: int  # 0-based turn of the session
    reconnect: bool
    context: int  # context tokens of the turn (conversation before it + the new prompt)
    ideal_cached: int  # context - new prompt tokens for follow-ups, 0 for first turns
    cached: int
    ttft: float
    tokens: int
    decode_s: float  # first token -> done
    worker: str
    sent_at: float
    done_at: float
    connect_s: float | None  # connection + hello, when this turn opened one


@dataclass
class SessionRecord:
    sid: str
    reconnect: bool
    turns: list[TurnRecord] = field(default_factory=list)
    failed: str | None = None


@dataclass
class Poll:
    t: float
    sessions: dict[str, int]
    weights: dict[str, float]
    kv: dict[str, float]
    held: dict[str, int] = field(default_factory=dict)  # places held between sessions
    stale: dict[str, bool] = field(default_factory=dict)  # signals_stale
    # wslb's placement counters per worker (refused_*, moved_*) and KV headroom
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    headroom: dict[str, float | None] = field(default_factory=dict)


class SessionError(Exception):
    pass


# -- processes ---------------------------------------------------------------------------------


class Fleet:
    """Reference workers plus one wslb, started from ``code`` (a checkout), stopped on exit.

    Children get SIGKILL if this script dies without cleaning up; Ctrl-C reaches them too
    (same process group) and the script stops what is left.
    """

    def __init__(self, tmp: Path, code: Path) -> None:
        self.procs = Procs(tmp, session=False, term_timeout=10.0)
        self.code = code
        self.workers: list[Worker] = []
        self.pids: list[int] = []

    def start_workers(self, params: WorkerParams, hot: set[str]) -> None:
        for i in range(params.count):
            wid, port = f"w{i + 1}", free_port()
            args = params.args(i, wid in hot)
            w = Worker(wid, args, port, procs=self.procs, name=f"{wid}-{port}", src=self.code)
            self.workers.append(w.start(wait=False))
            self.pids.append(w.pid)
        for w in self.workers:
            w.wait(30.0)

    def start_lb(self, mode: Mode, lbp: LbParams) -> Wslb | Haproxy:
        if mode.proxy == "haproxy":
            return self.start_haproxy(mode.factor or lbp.factor)
        cfg: dict[str, Any] = {
            "pools": [
                {
                    "name": "chat",
                    "balance": mode.balance,
                    "hash_balance_factor": mode.factor or lbp.factor,
                    **mode.pool,
                    "session_key": ["query:session"],
                    "weights": {
                        "scrape_interval": f"{lbp.scrape_s:g}s",
                        "metrics": "reference",
                        "coefficients": mode.coefficients,
                        **(
                            {"smoothing": f"{lbp.smoothing_s:g}s"}
                            if lbp.smoothing_s is not None
                            else {}
                        ),
                    },
                    "backends": [{"id": w.id, "url": w.url} for w in self.workers],
                }
            ],
            "timeouts": {"ping_interval": "20s"},
        }
        tmp, token = self.procs.logdir, secrets.token_urlsafe(32)
        lb = Wslb(cfg, tmp, procs=self.procs, token=token, src=self.code)
        lb.start(wait_ready=False, timeout=30.0)
        self.pids.append(lb.pid)
        try:  # every backend active and scraped once
            lb.wait_ready(20.0, until=scraped)
        except TimeoutError:
            raise TimeoutError(f"wslb backends not ready:\n{lb.log_tail(20)}") from None
        return lb

    def start_haproxy(self, factor: float) -> Haproxy:
        """HAProxy in front of the workers: ``balance url_param session``, ``hash-type
        consistent``, ``hash-balance-factor`` = c x 100 (its bounded load, counting active
        connections), an HTTP health check. It shows the workers the credential wslb would."""
        port = free_port()
        token = WORKER_TOKEN
        header = f"  http-request set-header X-WSLB-Worker-Token {token}\n" if token else ""
        servers = "".join(
            f"  server {w.id} 127.0.0.1:{w.port} check inter 2s\n" for w in self.workers
        )
        path = self.procs.logdir / f"haproxy-{port}.cfg"
        path.write_text(
            "global\n  nbthread 1\n"
            "defaults\n  mode http\n  timeout connect 5s\n  timeout client 1h\n"
            "  timeout server 1h\n  timeout tunnel 1h\n  timeout http-request 10s\n"
            f"frontend fe\n  bind 127.0.0.1:{port}\n  default_backend workers\n"
            "backend workers\n  balance url_param session\n  hash-type consistent\n"
            f"  hash-balance-factor {round(factor * 100)}\n  option httpchk GET /healthz\n"
            f"{header}{servers}"
        )
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        proc = self.procs.spawn(f"haproxy-{port}", [binary, "-db", "-f", str(path)])
        self.pids.append(proc.pid)
        wait_port(port, 10.0, proc)
        time.sleep(2.5)  # its first health checks: servers start down until one passes
        return Haproxy(f"ws://127.0.0.1:{port}", proc.pid)

    def close(self) -> None:
        self.procs.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Haproxy:
    """A running HAProxy: where clients connect (it has no admin API to poll)."""

    url: str
    pid: int


def scraped(backends: list[dict[str, Any]]) -> bool:
    return all(b["state"] == "active" and not b.get("signals_stale") for b in backends)


class CpuMeter:
    """CPU cores used, from now until ``read``: by these processes (and this one), and by the rest.

    The machine is shared; a run while something else keeps a core busy is not comparable.
    """

    def __init__(self, pids: Sequence[int]) -> None:
        self.procs = [psutil.Process()]
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.procs.append(psutil.Process(pid))
        self.t0 = time.monotonic()
        self.busy0 = self._busy()
        self.ours0 = self._ours()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(sum(t)) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)

    def _ours(self) -> float:
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                total += c.user + c.system
        return total

    def read(self) -> tuple[float, float]:
        dt_s = max(1e-6, time.monotonic() - self.t0)
        ours = (self._ours() - self.ours0) / dt_s
        busy = (self._busy() - self.busy0) / dt_s
        return ours, max(0.0, busy - ours)


def wait_idle(limit_s: float, threshold: float = 0.3, quiet_s: float = 5.0) -> None:
    """Wait (at most ``limit_s``) until other processes use under ``threshold`` cores for
    ``quiet_s`` seconds in a row."""
    if limit_s <= 0:
        return
    deadline = time.monotonic() + limit_s
    quiet = 0.0
    while time.monotonic() < deadline:
        meter = CpuMeter([])
        time.sleep(1.0)
        _, other = meter.read()
        quiet = quiet + 1.0 if other < threshold else 0.0
        if quiet >= quiet_s:
            return
    print(f"warning: the machine did not go idle within {limit_s:g} s", file=sys.stderr)


# -- load generator ----------------------------------------------------------------------------


def count_words(s: str) -> int:
    return len(s.split())


async def run_session(
    plan: SessionPlan, system: str, url: str, t0: float, timeout: float
) -> SessionRecord:
    loop = asyncio.get_running_loop()
    rec = SessionRecord(plan.sid, plan.reconnect)
    await asyncio.sleep(max(0.0, t0 + plan.start_s - loop.time()))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    context = count_words(system)
    ws: ClientConnection | None = None
    try:
        for k, turn in enumerate(plan.turns):
            if turn.think_s:
                await asyncio.sleep(turn.think_s)
            async with asyncio.timeout(timeout):
                connect_s = None
                if ws is None:
                    tc = loop.time()
                    ws = await connect(
                        f"{url}/ws?session={plan.sid}",
                        compression=None,
                        ping_interval=None,
                        max_size=None,
                        open_timeout=timeout,
                        close_timeout=2,
                    )
                    hello = json.loads(await ws.recv())
                    if hello.get("type") != "hello":
                        raise SessionError(f"expected hello, got {hello!r}")
                    connect_s = loop.time() - tc
                prompt_tokens = count_words(turn.prompt)
                messages.append({"role": "user", "content": turn.prompt})
                context += prompt_tokens
                msg = {"type": "prompt", "messages": messages, "max_tokens": turn.max_tokens}
                sent = loop.time()
                await ws.send(json.dumps(msg, separators=(",", ":")))
                first: float | None = None
                texts: list[str] = []
                while True:
                    m = json.loads(await ws.recv())
                    kind = m.get("type")
                    if kind == "token":
                        if first is None:
                            first = loop.time()
                        if m.get("i") != len(texts):
                            raise SessionError(f"token {m.get('i')} out of order")
                        texts.append(m["text"])
                    elif kind == "done":
                        break
                    else:
                        raise SessionError(f"unexpected message {m!r}")
                done = loop.time()
                if m["tokens"] != turn.max_tokens or len(texts) != turn.max_tokens:
                    raise SessionError(f"{len(texts)} tokens for max_tokens={turn.max_tokens}")
                rec.turns.append(
                    TurnRecord(
                        index=k,
                        reconnect=plan.reconnect,
                        context=context,
                        ideal_cached=context - prompt_tokens if k else 0,
                        cached=int(m["cached_tokens"]),
                        ttft=(first if first is not None else done) - sent,
                        tokens=len(texts),
                        decode_s=done - (first if first is not None else done),
                        worker=str(m["worker"]),
                        sent_at=sent - t0,
                        done_at=done - t0,
                        connect_s=connect_s,
                    )
                )
                answer = " ".join(texts)
                messages.append({"role": "assistant", "content": answer})
                context += len(texts)
                if plan.reconnect:
                    await ws.close()
                    ws = None
    except Exception as exc:  # any error, timeout or close fails the session
        rec.failed = f"turn {len(rec.turns) + 1}: {type(exc).__name__}: {exc}"[:300]
    finally:
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()
    return rec


async def poll_admin(lb: Wslb, period: float, out: list[Poll], t0: float) -> None:
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout, headers=lb.auth) as http:
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{lb.admin_port}/backends") as r:
                    r.raise_for_status()
                    data = await r.json()
                out.append(
                    Poll(
                        loop.time() - t0,
                        {b["id"]: int(b["sessions"]) for b in data},
                        {b["id"]: float(b["effective_weight"]) for b in data},
                        {b["id"]: float(b["signals"].get("kv_cache_usage") or 0.0) for b in data},
                        {b["id"]: int(b.get("held") or 0) for b in data},
                        {b["id"]: bool(b.get("signals_stale")) for b in data},
                        {
                            b["id"]: {
                                k: int(v)
                                for k, v in (b.get("counters") or {}).items()
                                if k.startswith(("refused_", "moved_"))
                            }
                            for b in data
                        },
                        {b["id"]: b.get("kv_headroom") for b in data},
                    )
                )
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                pass
            await asyncio.sleep(period)


async def side_stream(url: str, sid: str, side: SideLoad, t0: float) -> int:
    """One of the side load's connections: prompts back to back until ``side.end_s``; returns
    the tokens it received. Errors end it quietly (the side load is not measured)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + side.start_s - loop.time()))
    tokens = 0
    with contextlib.suppress(Exception):
        async with connect(
            f"{url}?session={sid}", compression=None, ping_interval=None, max_size=None
        ) as ws:
            await ws.recv()  # hello
            while loop.time() < t0 + side.end_s:
                prompt = {"type": "prompt", "text": "more", "max_tokens": side.tokens}
                await ws.send(json.dumps(prompt))
                deadline = t0 + side.end_s
                while True:
                    left = deadline - loop.time()
                    if left <= 0:
                        await ws.send(json.dumps({"type": "cancel"}))
                        return tokens
                    m = json.loads(await asyncio.wait_for(ws.recv(), left))
                    if m.get("type") == "token":
                        tokens += 1
                    elif m.get("type") == "done":
                        break
    return tokens


async def drive(
    plans: list[SessionPlan],
    system: str,
    lb: Wslb | Haproxy,
    poll_s: float,
    timeout: float,
    side: tuple[str, SideLoad] | None = None,
) -> tuple[list[SessionRecord], list[Poll], float]:
    """Run every session through wslb (and the side load straight to its worker, if any)."""
    loop = asyncio.get_running_loop()
    polls: list[Poll] = []
    t0 = loop.time() + 0.2
    poller = asyncio.create_task(
        poll_admin(lb, poll_s, polls, t0) if isinstance(lb, Wslb) else asyncio.sleep(0)
    )
    extra = []
    if side is not None:
        url, load = side
        extra = [
            asyncio.create_task(side_stream(url, f"side-{i}", load, t0))
            for i in range(load.streams)
        ]
    try:
        records = await asyncio.gather(
            *(run_session(p, system, lb.url, t0, timeout) for p in plans)
        )
        await asyncio.gather(*extra)
    finally:
        for task in [poller, *extra]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(poller, *extra, return_exceptions=True)
    return list(records), polls, loop.time() - t0


# -- analysis ----------------------------------------------------------------------------------


@dataclass
class Result:
    run: str
    mode: str
    sessions: int
    turns: int
    hit: float
    ideal: float
    ttft_first_p50: float
    ttft_first_p99: float
    ttft_follow_p50: float
    ttft_follow_p99: float
    follow_turns: int
    follow_missed: int  # follow-up turns that found less than their previous context cached
    follow_moved: int  # ... of which answered by another worker than the turn before
    ttft_follow_p99_persistent: float
    ttft_follow_p99_reconnect: float
    hit_reconnect: float
    ideal_reconnect: float
    connect_p99: float
    tokens_per_s: float
    stream_tokens_per_s: float
    peak_sessions: int
    mean_sessions: float
    imbalance: float  # mean over loaded polls of max/mean live sessions per worker
    weight_spread: float  # median over loaded polls of max/min effective weight
    bound_ratio_max: float
    bound_over_polls: float  # share of loaded polls with some worker above its bound
    changed: int
    failed: int
    failures: list[str]
    worker_turn_share: dict[str, float]
    mean_weight: dict[str, float]
    mean_kv_usage: dict[str, float]
    duration_s: float
    turn_follow_p99: float = math.nan  # follow-up prompt sent -> done
    overload_polls: float = 0.0  # share of polls with some worker measured overloaded
    overloaded_workers: list[str] = field(default_factory=list)
    overload_ratio_max: float = math.nan  # max counted / bound of an overloaded worker
    overload_ratio_settled: float = math.nan  # ... from GRACE s after it became overloaded
    overload_over_settled: float = math.nan  # share of those polls with it above its bound
    cpu_ours: float = math.nan  # cores used by this script, its workers and wslb
    cpu_other: float = math.nan  # cores used by everything else on the machine meanwhile
    first_max: int = 0  # most conversations one worker answered the first turn of
    # wslb's placement counters at the last poll, summed over workers (refused_*, moved_*)
    placement: dict[str, int] = field(default_factory=dict)


def overload_seen(
    polls: list[Poll], factor: float, ratio: float, grace: float
) -> tuple[float, list[str], float, float, float]:
    """What the polls show while a worker is overloaded, by ``selection.overloaded``'s rule
    applied to the effective weights wslb reported (static weights 1, as this benchmark
    configures them; wslb's own state is refreshed more often, so this is its replica):
    (share of polls with one, which, max counted / bound of an overloaded worker, the same
    from ``grace`` s after it became so, share of those later polls where it was above)."""
    was: set[str] = set()
    since: dict[str, float] = {}
    with_any = 0
    seen: set[str] = set()
    ratios: list[float] = []
    settled: list[float] = []
    for p in polls:
        fresh = {b: w for b, w in p.weights.items() if not p.stale.get(b, False)}
        now = selection_overloaded(fresh, was, ratio)
        for b in now - was:
            since[b] = p.t
        was = now
        if not now:
            continue
        with_any += 1
        seen |= now
        counted = {b: n + p.held.get(b, 0) for b, n in p.sessions.items()}
        total = sum(counted.values())
        wsum = sum(p.weights.values())
        for b in now:
            bound = load_bound(total, factor, p.weights[b], wsum)
            r = counted[b] / bound if bound else (math.inf if counted[b] else 0.0)
            ratios.append(r)
            if p.t - since[b] >= grace:
                settled.append(r)
    n = len(polls) or 1
    return (
        with_any / n,
        sorted(seen),
        max(ratios, default=math.nan),
        max(settled, default=math.nan),
        sum(r > 1.0 for r in settled) / len(settled) if settled else math.nan,
    )


def analyse(
    run: str,
    mode: str,
    records: list[SessionRecord],
    polls: list[Poll],
    duration: float,
    factor: float,
    overload_ratio: float = DEFAULT_OVERLOAD_RATIO,
    grace: float = 5.0,
) -> Result:
    turns = [t for r in records for t in r.turns]
    first = [t.ttft for t in turns if t.index == 0]
    follow = [t for t in turns if t.index > 0]
    ctx = sum(t.context for t in turns) or 1
    rec_turns = [t for t in turns if t.reconnect]
    rec_ctx = sum(t.context for t in rec_turns) or 1
    tokens = sum(t.tokens for t in turns)
    span = (max(t.done_at for t in turns) - min(t.sent_at for t in turns)) if turns else 1.0
    streams = [t.tokens / t.decode_s for t in turns if t.decode_s > 0 and t.tokens > 1]
    connects = [t.connect_s for t in turns if t.connect_s is not None]
    by_worker: dict[str, int] = {}
    for t in turns:
        by_worker[t.worker] = by_worker.get(t.worker, 0) + 1
    firsts: dict[str, int] = {}
    for t in turns:
        if t.index == 0:
            firsts[t.worker] = firsts.get(t.worker, 0) + 1

    totals = [sum(p.sessions.values()) for p in polls]
    peak_total = max(totals, default=0)
    loaded = [p for p, n in zip(polls, totals, strict=True) if n > 0 and n >= 0.5 * peak_total]
    ratios: list[float] = []
    over = 0
    imbalance: list[float] = []
    spread: list[float] = []
    for p in loaded:
        spread.append(max(p.weights.values()) / max(1e-9, min(p.weights.values())))
        total = sum(p.sessions.values())
        wsum = sum(p.weights.values())
        mean = total / len(p.sessions)
        imbalance.append(max(p.sessions.values()) / mean)
        any_over = False
        # The rule's count (balancer.pool): live sessions plus places held between sessions,
        # shares from the effective weights the balancer reports at this poll.
        counted = {b: n + p.held.get(b, 0) for b, n in p.sessions.items()}
        counted_total = sum(counted.values())
        for b, n in counted.items():
            bound = load_bound(counted_total, factor, p.weights[b], wsum)
            ratios.append(n / bound if bound else math.inf)
            any_over |= n > bound
        over += any_over
    ids = sorted({b for p in polls for b in p.sessions})
    ov_share, ov_workers, ov_max, ov_settled, ov_over = overload_seen(
        polls, factor, overload_ratio, grace
    )
    return Result(
        run=run,
        mode=mode,
        sessions=len(records),
        turns=len(turns),
        hit=sum(t.cached for t in turns) / ctx,
        ideal=sum(t.ideal_cached for t in turns) / ctx,
        ttft_first_p50=pct(first, 50),
        ttft_first_p99=pct(first, 99),
        ttft_follow_p50=pct([t.ttft for t in follow], 50),
        ttft_follow_p99=pct([t.ttft for t in follow], 99),
        follow_turns=len(follow),
        follow_missed=sum(1 for t in follow if t.cached < t.ideal_cached),
        follow_moved=sum(
            1
            for r in records
            for a, b in zip(r.turns, r.turns[1:], strict=False)
            if b.cached < b.ideal_cached and a.worker != b.worker
        ),
        ttft_follow_p99_persistent=pct([t.ttft for t in follow if not t.reconnect], 99),
        ttft_follow_p99_reconnect=pct([t.ttft for t in follow if t.reconnect], 99),
        hit_reconnect=sum(t.cached for t in rec_turns) / rec_ctx,
        ideal_reconnect=sum(t.ideal_cached for t in rec_turns) / rec_ctx,
        connect_p99=pct(connects, 99),
        tokens_per_s=tokens / span if span > 0 else 0.0,
        stream_tokens_per_s=pct(streams, 50),
        peak_sessions=max((max(p.sessions.values()) for p in polls if p.sessions), default=0),
        mean_sessions=(
            sum(sum(p.sessions.values()) / len(p.sessions) for p in loaded) / len(loaded)
            if loaded
            else 0.0
        ),
        imbalance=sum(imbalance) / len(imbalance) if imbalance else math.nan,
        weight_spread=pct(spread, 50),
        bound_ratio_max=max(ratios, default=math.nan),
        bound_over_polls=over / len(loaded) if loaded else math.nan,
        changed=sum(1 for r in records if len({t.worker for t in r.turns}) > 1),
        failed=sum(1 for r in records if r.failed),
        failures=[f"{r.sid}: {r.failed}" for r in records if r.failed][:5],
        worker_turn_share={w: n / max(1, len(turns)) for w, n in sorted(by_worker.items())},
        mean_weight={
            b: sum(p.weights.get(b, 0.0) for p in loaded) / max(1, len(loaded)) for b in ids
        },
        mean_kv_usage={b: sum(p.kv.get(b, 0.0) for p in loaded) / max(1, len(loaded)) for b in ids},
        duration_s=duration,
        turn_follow_p99=pct([t.done_at - t.sent_at for t in follow], 99),
        overload_polls=ov_share,
        overloaded_workers=ov_workers,
        overload_ratio_max=ov_max,
        overload_ratio_settled=ov_settled,
        overload_over_settled=ov_over,
        first_max=max(firsts.values(), default=0),
        placement=dict(
            sum((Counter(c) for c in polls[-1].counters.values()), Counter()) if polls else {}
        ),
    )


# -- output ------------------------------------------------------------------------------------


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def table(results: list[Result]) -> str:
    head = (
        "| mode | KV hit (ideal) | hit/ideal | TTFT first p50 / p99 ms "
        "| TTFT follow-up p50 / p99 ms | follow-ups not fully cached | tok/s "
        "| sessions/worker max / mean | imbalance | max sessions / bound "
        "| sessions changed worker | failed sessions |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.hit:.1%} ({r.ideal:.1%}) | {r.hit / r.ideal:.2f} "
            f"| {ms(r.ttft_first_p50)} / {ms(r.ttft_first_p99)} "
            f"| {ms(r.ttft_follow_p50)} / {ms(r.ttft_follow_p99)} "
            f"| {r.follow_missed} / {r.follow_turns} "
            f"({r.follow_missed / max(1, r.follow_turns):.1%}; {r.follow_moved} moved) "
            f"| {r.tokens_per_s:.0f} | {balance_cells(r)} "
            f"| {r.changed} / {r.sessions} | {r.failed} |"
        )
    return "\n".join(lines)


def balance_cells(r: Result) -> str:
    """The admin polls' columns (none for HAProxy, which has no admin API to poll)."""
    if math.isnan(r.imbalance):
        return f"first turns max {r.first_max} | - | -"
    return (
        f"{r.peak_sessions} / {r.mean_sessions:.1f} | {r.imbalance:.2f} "
        f"| {r.bound_ratio_max:.2f} ({r.bound_over_polls:.0%})"
    )


def detail_table(results: list[Result]) -> str:
    head = (
        "| mode | follow-up p99 ms persistent / reconnect | KV hit reconnect (ideal) "
        "| connect p99 ms | stream tok/s p50 | turns per worker | mean effective weight "
        "| weight spread | mean KV usage | CPU cores ours / others |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in results:
        share = " ".join(f"{w}:{s:.0%}" for w, s in r.worker_turn_share.items())
        weight = " ".join(f"{w}:{v:.2f}" for w, v in r.mean_weight.items())
        kv = " ".join(f"{w}:{v:.2f}" for w, v in r.mean_kv_usage.items())
        lines.append(
            f"| {r.mode} | {ms(r.ttft_follow_p99_persistent)} / {ms(r.ttft_follow_p99_reconnect)} "
            f"| {r.hit_reconnect:.1%} ({r.ideal_reconnect:.1%}) | {ms(r.connect_p99)} "
            f"| {r.stream_tokens_per_s:.1f} | {share} | {weight} | {r.weight_spread:.2f} | {kv} "
            f"| {r.cpu_ours:.2f} / {r.cpu_other:.2f} |"
        )
    return "\n".join(lines)


def overload_table(results: list[Result], grace: float) -> str:
    head = (
        "| mode | polls with a worker overloaded | overloaded | max load / bound while "
        f"overloaded | ... from {grace:g} s after it became so (polls above) "
        "| follow-up turn p99 s |"
    )
    lines = [head, "|" + " --- |" * 6]
    for r in results:
        settled = (
            "-"
            if math.isnan(r.overload_ratio_settled)
            else f"{r.overload_ratio_settled:.2f} ({r.overload_over_settled:.0%})"
        )
        lines.append(
            f"| {r.mode} | {r.overload_polls:.0%} | {', '.join(r.overloaded_workers) or '-'} "
            f"| {'-' if math.isnan(r.overload_ratio_max) else f'{r.overload_ratio_max:.2f}'} "
            f"| {settled} | {r.turn_follow_p99:.2f} |"
        )
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def targets(results: list[Result], runs: list[str], factor: float, grace: float) -> list[str]:
    """The targets for wslb's default (``NEW``), each against modes of the same run:
    identical workers (``even``): no returning key moves, KV hit >= 97% of the ideal,
    follow-up p99 <= 0.5 x round robin's; a slowed or busy worker: p99 <= HAProxy's."""
    out = []
    for run in runs:
        rs = {r.mode: r for r in results if r.run == run}
        new = rs.get(NEW)
        if new is None:
            continue
        order = ", ".join(
            f"{r.mode} {ms(r.ttft_follow_p99)}"
            for r in sorted(rs.values(), key=lambda r: r.ttft_follow_p99)
        )
        out.append(f"- {run}: " + "; ".join(verdicts(new, rs, identical=run == "even")))
        out.append(f"  (follow-up p99: {order} ms)")
    return out


def verdicts(new: Result, rs: dict[str, Result], identical: bool) -> list[str]:
    """The targets of one run (``targets``) for the ``NEW`` mode's result."""
    out = []
    if identical:
        out.append(
            f"no returning key moves: {verdict(new.changed == 0)} ({new.changed} of "
            f"{new.sessions} sessions changed worker)"
        )
        ok = new.hit >= 0.97 * new.ideal
        out.append(
            f"KV hit >= 97% of the ideal: {verdict(ok)} ({new.hit:.1%} of {new.ideal:.1%} = "
            f"{new.hit / new.ideal:.1%})"
        )
        rr = rs.get("round_robin")
        if rr is not None:
            ok = new.ttft_follow_p99 <= 0.5 * rr.ttft_follow_p99
            out.append(
                f"follow-up p99 <= 0.5 x round robin's: {verdict(ok)} "
                f"({ms(new.ttft_follow_p99)} vs 0.5 x {ms(rr.ttft_follow_p99)} ms)"
            )
    hp = rs.get("haproxy")
    if not identical and hp is not None:
        ok = new.ttft_follow_p99 <= hp.ttft_follow_p99
        out.append(
            f"follow-up p99 <= HAProxy's: {verdict(ok)} ({ms(new.ttft_follow_p99)} vs "
            f"{ms(hp.ttft_follow_p99)} ms)"
        )
    return out


def _value(v: object) -> str:
    """A config value as the docs show it."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return f"{v:g}" if isinstance(v, float | int) and not isinstance(v, bool) else str(v)


def haproxy_version() -> str:
    """HAProxy's version, as ``haproxy -v`` prints it."""
    import subprocess

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, timeout=5).stdout
        return out.split()[2] if len(out.split()) > 2 else "?"
    return "?"


def write_doc(
    path: Path,
    command: str,
    results: list[Result],
    runs: list[str],
    w: Workload,
    wp: WorkerParams,
    lb: LbParams,
    baseline: str,
    elapsed: float,
    modes: list[Mode],
    hot: dict[str, str],
    side: SideLoad | None,
    grace: float,
) -> None:
    kept = ""
    if path.exists():
        old = path.read_text()
        if ANALYSIS_MARK in old:
            kept = old[old.index(ANALYSIS_MARK) :]
    run_names = {
        "even": f"even: {wp.count} identical workers",
        "hetero": (
            f"hetero: {hot.get('hetero', '-')} hot from the start (--background-util "
            f"{wp.hot_background_util:g}: prefill and decode "
            f"{1 / (1 - wp.hot_background_util):.1f}x slower)"
        ),
        "hot": (
            f"hot: {side.worker} gets far more load mid-run ({side.streams} streams of "
            f"{side.tokens}-token answers sent straight to it, t = {side.start_s:g}-"
            f"{side.end_s:g} s; it decodes more than --max-batch {wp.max_batch}, so every "
            "stream slows and requests queue)"
            if side is not None
            else "hot"
        ),
    }
    parts = [
        "# Routing benchmark",
        "",
        "Multi-turn chat through wslb against reference workers with a finite KV cache, "
        "once per balancing mode; produced by `bench/routing.py` (its docstring has the details).",
        "",
        "```",
        command,
        "```",
        "",
        f"- date: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}; "
        f"wall time {elapsed:.0f} s",
        f"- machine: {machine_line()}; load generator, wslb and workers all on 127.0.0.1",
        f"- CPU during the runs: this benchmark {min(r.cpu_ours for r in results):.2f}-"
        f"{max(r.cpu_ours for r in results):.2f} cores, other processes on the machine "
        f"{min(r.cpu_other for r in results):.2f}-{max(r.cpu_other for r in results):.2f} "
        "cores (per run: last column of the second tables)",
        f"- workload: {w.sessions} sessions arriving (Poisson) over {w.arrival_s:g} s, "
        f"{w.turns[0]}-{w.turns[1]} turns each, think time exponential mean {w.think_s:g} s "
        f"(capped at {5 * w.think_s:g} s), shared system prompt {w.system_words} words, "
        f"user prompts {w.prompt_words[0]}-{w.prompt_words[1]} words, answers "
        f"{w.answer_tokens[0]}-{w.answer_tokens[1]} tokens; "
        + (
            "every session opens a new WebSocket for every turn"
            if w.reconnect_share >= 1
            else f"{w.reconnect_share:.0%} of the sessions reconnect for every turn, the "
            "others keep one connection"
        )
        + f"; every prompt carries the whole conversation (`messages`); seed {w.seed}",
        f"- workers: {wp.count} x `backends.worker --tokens-per-s {wp.tokens_per_s:g} "
        f"--prefill-ms-per-token {wp.prefill_ms_per_token:g} --kv-capacity-tokens "
        f"{wp.kv_capacity_tokens} --max-batch {wp.max_batch} --session-ttl {wp.session_ttl:g}`",
        f"- wslb: `hash_balance_factor: {lb.factor:g}`, `scrape_interval: {lb.scrape_s:g}s`, "
        + (
            f"`smoothing: {lb.smoothing_s:g}s`, "
            if lb.smoothing_s is not None
            else "`smoothing` its default, "
        )
        + f"held places {HOLD_S:g} s, noise band {Coefficients().noise_band:g}, "
        f"load-aware coefficients `{LOAD_AWARE}`, static `{STATIC}`; `least_conn` and "
        f"`round_robin` use the {baseline} weights; admin polled every {lb.poll_s:g} s",
        "- modes: "
        + "; ".join(
            (
                f"`{m.name}`: HAProxy {haproxy_version()}, `balance url_param session`, "
                f"`hash-type consistent`, `hash-balance-factor {round(lb.factor * 100)}`"
                if m.proxy == "haproxy"
                else f"`{m.name}`: {m.balance}, "
                + ("load-aware" if m.coefficients.get("gpu") else "static")
                + " weights"
                + (f", c = {m.factor:g}" if m.factor else "")
                + "".join(f", `{k}: {_value(v)}`" for k, v in m.pool.items())
            )
            for m in modes
        )
        + f" (`{NEW}`: wslb's defaults, `affinity_ceiling: {DEFAULT_CEILING:g}`, placement "
        f"`{_value(asdict(PlacementCfg()))}`, with the reference worker's bytes per token; "
        "`ring-first`: `choices: 1`, plain bounded-load placement)",
        "",
    ]
    for run in runs:
        rs = [r for r in results if r.run == run]
        if not rs:
            continue
        parts += [f"## {run_names[run]}", "", table(rs), "", detail_table(rs), ""]
        parts += [overload_table(rs, grace), ""]
    grace_text = f"{grace:g}"
    parts += ["## Targets", "", *targets(results, runs, lb.factor, grace), ""]
    parts += [
        "## Definitions",
        "",
        "- **KV hit** = sum of `done.cached_tokens` / sum of the context tokens of every turn "
        "(conversation before the turn + its new prompt, counted as the worker counts them: "
        "whitespace-separated words of all messages). **ideal** = the same ratio if every "
        "follow-up turn found its whole previous context cached (context - new prompt tokens) "
        "and first turns found nothing: each session's reuse of its own context. The reference "
        "worker's cache is shared across sessions, as an engine's, so a first turn may also "
        "find a system prompt another session sent to the same worker: hit/ideal above 1 is "
        "that cross-session sharing.",
        "- **TTFT** = prompt sent -> first token received, in the client (for reconnecting "
        "clients the connection is opened before; its time is `connect p99`). First turns "
        "are cold under any routing; follow-up turns are where routing shows.",
        "- **follow-ups not fully cached**: follow-up turns whose `cached_tokens` was below "
        "the ideal: *moved* when answered by another worker than the turn before, the rest "
        "found their own worker's KV cache had evicted part of the session. With about "
        "1,200 follow-up turns the p99 is the 12th slowest, so once more than 1% of the "
        "follow-ups miss, the p99 is a cache miss's TTFT.",
        "- **tok/s** = all answer tokens / (last `done` - first prompt); **stream tok/s p50** = "
        "median per-answer decode rate (first token -> done), which drops when a worker "
        "decodes more than `--max-batch` streams.",
        "- **sessions/worker max / mean**: from admin polls (`GET /backends`, live sessions): "
        "the most live sessions any worker had at any poll / the mean live sessions per "
        "worker over the loaded polls (total live >= half its peak). **imbalance** = mean "
        "over loaded polls of (most loaded worker / mean).",
        "- **max sessions / bound**: the highest ratio, over loaded polls and workers, of "
        "the worker's counted load to `ceil(c x total counted load x effective weight / sum "
        "of effective weights)`, and in brackets the share of polls where some worker was "
        "above it. This is the bounded-load rule as wslb applies it (`balancer/pool.py`): "
        "the counted load is live sessions plus the places held for keys between sessions "
        "(`held` in `GET /backends`; 30 s after a session ends, so a reconnect-per-turn "
        "conversation keeps its place while its client thinks), and the weights are the "
        "effective weights wslb reports at that poll. wslb enforces the rule when it places "
        "a session, and gives up held places (longest-quiet first) on a worker that is above "
        "it; live sessions alone can leave a worker above it afterwards, when sessions end "
        "elsewhere or its weight drops (wslb does not move live sessions for that), so this is "
        "observed at every poll, a stricter test than the rule. For `least_conn` and `round_robin` "
        "it is the same ratio, for comparison (with their own `held` counts).",
        "- **overloaded**: a worker is overloaded by wslb's rule (`balancer/selection.py`): "
        "the median effective weight of the workers with fresh signals is at least "
        "`overload_ratio` times its own, until it is less than `1 + (overload_ratio - 1) / 2` "
        "times. The benchmark applies the rule to the effective weights of each admin poll "
        "(the test wslb shows as `overloaded` in `GET /backends`), with the default ratio for "
        "every mode; "
        "static weights are never overloaded. **max load / bound while overloaded**: the "
        "overloaded worker's counted load (live + held) over its `c` bound, at those polls; "
        "wslb never moves a live session, so right after a worker becomes overloaded the "
        "sessions it is answering are still there, hence the second figure, from `GRACE` s "
        "later. **follow-up turn p99**: prompt sent -> `done` of follow-up turns (decode "
        "included, which is what a busy worker slows).",
        "- **weight spread**: median over loaded polls of the largest / smallest effective "
        "weight (1.00 with static weights; identical workers should stay near 1).",
        "- **CPU cores ours / others**: cores used during the run by this script, its workers "
        "and wslb / by every other process on the machine (a shared machine: a run with others "
        "well above 0 had less CPU than it expected, and its latencies are suspect).",
        "- **sessions changed worker**: sessions whose turns were answered (`done.worker`) "
        "by more than one worker. **failed**: sessions with any error, unexpected close, "
        "wrong token count or a turn over the timeout.",
        "",
    ]
    text = "\n".join(parts).replace("`GRACE` s", f"{grace_text} s")
    if kept:
        text += "\n" + kept
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def plot(path: Path, results: list[Result], runs: list[str]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not importable; no plot written", file=sys.stderr)
        return False
    modes = list(dict.fromkeys(r.mode for r in results))
    colors = ["tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:red", "tab:orange"]
    fig, grid = plt.subplots(2, 2, figsize=(13, 8.5))
    axes = list(grid.flat)
    width = 0.8 / max(1, len(modes))
    x = list(range(len(runs)))
    get: dict[str, Callable[[Result], float]] = {
        "follow-up TTFT p99 (ms)": lambda r: r.ttft_follow_p99 * 1000,
        "follow-up turns not fully cached (%)": lambda r: (
            100 * r.follow_missed / max(1, r.follow_turns)
        ),
        "KV hit rate / ideal": lambda r: r.hit / r.ideal,
        "max counted load / bound": lambda r: r.bound_ratio_max,
    }
    for ax, (title, f) in zip(axes, get.items(), strict=True):
        for i, m in enumerate(modes):
            ys = []
            for run in runs:
                r = next((r for r in results if r.run == run and r.mode == m), None)
                ys.append(f(r) if r is not None else 0.0)
            xs = [v + (i - (len(modes) - 1) / 2) * width for v in x]
            bars = ax.bar(xs, ys, width, label=m, color=colors[i % len(colors)])
            ax.bar_label(bars, fmt="%.2f" if "/" in title else "%.0f", fontsize=7)
        ax.set_xticks(x, runs)
        ax.set_title(title)
        if "/" in title:
            ax.axhline(1.0 if "bound" in title else 0.95, color="gray", ls="--", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle("wslb routing benchmark (bench/routing.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main --------------------------------------------------------------------------------------


def window(s: str) -> tuple[float, float]:
    a, _, b = s.partition("-")
    lo, hi = float(a), float(b)
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected START-END with 0 <= START < END, got {s!r}")
    return lo, hi


def pair(s: str) -> tuple[int, int]:
    a, _, b = s.partition("-")
    lo, hi = int(a), int(b or a)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 0 < LO <= HI, got {s!r}")
    return lo, hi


def parse_mode(spec: str, known: dict[str, Mode]) -> Mode:
    """A known mode name, or ``NAME=BALANCE:GPU,KV_CACHE,QUEUE[,TPOT]`` (a weights variant;
    TPOT defaults to 0)."""
    if "=" not in spec:
        if spec not in known:
            raise ValueError(f"unknown mode {spec!r} (one of {', '.join(known)}, or NAME=...)")
        return known[spec]
    name, _, rest = spec.partition("=")
    balance, _, coef = rest.partition(":")
    if balance not in ("consistent", "least_conn", "round_robin", "random"):
        raise ValueError(f"unknown balance {balance!r}")
    values = [float(v) for v in coef.split(",")] if coef else [0.0, 0.0, 0.0]
    if len(values) == 3:
        values.append(0.0)
    if len(values) != 4:
        raise ValueError(f"{spec!r}: expected GPU,KV_CACHE,QUEUE[,TPOT]")
    gpu, kv, queue, tpot = values
    coefficients = {"gpu": gpu, "kv_cache": kv, "queue": queue, "tpot": tpot, "min_factor": 0.05}
    return Mode(name, balance, coefficients)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Routing benchmark of wslb's balancing modes (multi-turn chat, finite KV).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a(
        "--workload",
        choices=[*sorted(WORKLOADS), "keyless"],
        default="reconnect",
        help="keyless: chats with no session key over plain HTTP, against SGLang's and vLLM's "
        "routers (its options: --workload keyless --help); reconnect: 90 sessions of 5 turns, "
        "a connection per turn, 3 workers; burst: the "
        "same kind, 6 turns, every first turn at once, seed 22, max batch 10, KV 26000; mixed: "
        "300 sessions of 4-6 turns, half reconnecting, 4 workers (the options below override it)",
    )
    a("--quick", action="store_true", help="small version (~3 min): fewer, shorter sessions")
    a("--sessions", type=int, default=None, help="sessions per run")
    a("--turns", type=pair, default=None, help="turns per session LO-HI")
    a("--arrival-s", type=float, default=None, help="arrival window")
    a("--think-s", type=float, default=None, help="mean think time")
    a("--system-words", type=int, default=200)
    a("--prompt-words", type=pair, default=(20, 60))
    a("--answer-tokens", type=pair, default=(20, 60))
    a("--reconnect-share", type=float, default=None, help="sessions opening a connection per turn")
    a("--turn-timeout-s", type=float, default=30.0)
    a("--seed", type=int, default=None, help="the plan's (the sweep's: its draws'); default: 1")
    a("--workers", type=int, default=None)
    a("--tokens-per-s", type=float, default=40.0)
    a("--prefill-ms-per-token", type=float, default=1.0)
    a("--kv-capacity-tokens", type=int, default=None, help="default: the workload's, or 32000")
    a("--max-batch", type=int, default=None, help="default: the workload's, or 16")
    a(
        "--bytes-per-token",
        type=float,
        default=7.0,
        help="wslb placement.bytes_per_token (the reference worker's words are ~7 bytes); "
        "0: not set",
    )
    a(
        "--sweep",
        type=int,
        default=0,
        metavar="N",
        help="run N random configurations (seeded by --seed) with the modes of --sweep-modes "
        "instead: see sweep()",
    )
    a("--sweep-modes", default=";".join(SWEEP_MODES), help="';'-separated, as --modes")
    a("--session-ttl", type=float, default=300.0)
    a("--hot-background-util", type=float, default=0.6)
    a("--factor", type=float, default=1.25, help="hash_balance_factor c")
    a("--scrape-s", type=float, default=0.5, help="wslb weights.scrape_interval")
    a("--poll-s", type=float, default=0.25, help="admin poll period")
    a("--smoothing-s", type=float, default=20.0, help="wslb weights.smoothing (0: none)")
    a("--sticky-factor", type=float, default=100.0, help="c of the static-sticky mode")
    a("--baseline-weights", choices=["load-aware", "static"], default="load-aware")
    a(
        "--modes",
        default=";".join(DEFAULT_MODES),
        help="';'-separated: known names (" + ", ".join(KNOWN_MODES) + "), or "
        "NAME=BALANCE:GPU,KV_CACHE,QUEUE[,TPOT] for a variant (e.g. "
        "'consistent-gpu=consistent:0.5,0,0')",
    )
    a("--runs", default="even,hetero,hot", help="any of even, hetero, hot")
    a("--side-streams", type=int, default=24, help="hot run: streams sent straight to the worker")
    a("--side-tokens", type=int, default=200, help="hot run: tokens per side-load answer")
    a(
        "--side-window",
        type=window,
        default=(8.0, 24.0),
        help="hot run: START-END seconds of the side load",
    )
    a(
        "--overload-grace-s",
        type=float,
        default=5.0,
        help="load / bound of an overloaded worker is judged from this long after it became so",
    )
    a("--doc", type=Path, default=ROOT / "docs" / "routing.md", help="'-' for none")
    a("--png", type=Path, default=ROOT / "docs" / "routing.png", help="'-' for none")
    a("--json", type=Path, default=None, help="also write raw results here")
    a(
        "--code",
        type=Path,
        default=ROOT,
        help="checkout whose balancer/ and backends/ run (default: this one)",
    )
    a(
        "--wait-idle-s",
        type=float,
        default=0.0,
        help="before each run, wait up to this long for other processes to leave the CPUs",
    )
    a("--keep-logs", action="store_true", help="keep the process logs (printed path)")
    return p


def load_average() -> str:
    """The 1/5/15-minute load averages (the machine is shared)."""
    with contextlib.suppress(OSError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "-"


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@dataclass
class Outcome:
    """What ``run_modes`` measured: a result per (run, mode), its polls and its moves."""

    results: list[Result] = field(default_factory=list)
    polls: dict[tuple[str, str], list[Poll]] = field(default_factory=dict)
    moves: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.new_event_loop
    return None


def run_modes(
    runs: Sequence[str],
    modes: Sequence[Mode],
    w: Workload,
    wp: WorkerParams,
    lbp: LbParams,
    side: SideLoad,
    hot_of: dict[str, str],
    args: argparse.Namespace,
    out: Outcome,
    label: str = "",
) -> None:
    """Every (run, mode) once, each on fresh workers and a fresh balancer, the same plan."""
    system, plans = make_plan(w)
    tmpdir = tempfile.mkdtemp(prefix="wslb-routing-")
    try:
        for run in runs:
            hot = {hot_of["hetero"]} if run == "hetero" else set()
            for mode in modes:
                wait_idle(args.wait_idle_s)
                with Fleet(Path(tmpdir), args.code.resolve()) as fleet:
                    fleet.start_workers(wp, hot)
                    lb = fleet.start_lb(mode, lbp)
                    cpu = CpuMeter(fleet.pids)
                    target = next(x for x in fleet.workers if x.id == side.worker)
                    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                        records, polls, duration = runner.run(
                            drive(
                                plans,
                                system,
                                lb,
                                lbp.poll_s,
                                w.turn_timeout_s,
                                (target.url, side) if run == "hot" else None,
                            )
                        )
                    ours, other = cpu.read()
                res = analyse(
                    run,
                    mode.name,
                    records,
                    polls,
                    duration,
                    lbp.factor,
                    float(mode.pool.get("overload_ratio", DEFAULT_OVERLOAD_RATIO)),
                    args.overload_grace_s,
                )
                res.cpu_ours, res.cpu_other = ours, other
                out.results.append(res)
                out.polls[(run, mode.name)] = polls
                out.moves[(run, mode.name)] = [
                    {
                        "sid": r.sid,
                        "turn": b.index,
                        "from": a.worker,
                        "to": b.worker,
                        "at": b.sent_at,
                    }
                    for r in records
                    for a, b in zip(r.turns, r.turns[1:], strict=False)
                    if a.worker != b.worker
                ]
                print(
                    f"[{label}{run}] {mode.name}: {duration:.1f}s, hit {res.hit:.1%}/"
                    f"{res.ideal:.1%}, follow-up p99 {ms(res.ttft_follow_p99)} ms, moved "
                    f"{res.changed}, first turns per worker max {res.first_max} "
                    f"(share {res.sessions / max(1, wp.count):.1f}), counters "
                    f"{ {k: v for k, v in res.placement.items() if v} }, failed {res.failed}; CPU "
                    f"cores: this benchmark {ours:.2f}, other processes {other:.2f}",
                    flush=True,
                )
                for f in res.failures:
                    print(f"    failed {f}", flush=True)
    finally:
        if args.keep_logs:
            print(f"logs in {tmpdir}")
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)


def all_modes(args: argparse.Namespace) -> dict[str, Mode]:
    """The known modes with this run's settings."""
    baseline = LOAD_AWARE if args.baseline_weights == "load-aware" else STATIC
    strict = {"affinity_ceiling": args.factor}  # the ceiling at c: the strict bound
    # What an operator sets for the reference worker's tokens (words of ~7 bytes), for the
    # placement's KV and move estimates; 0: not set (a --code checkout from before them).
    bpt = {"placement": {"bytes_per_token": args.bytes_per_token}} if args.bytes_per_token else {}
    first = {"placement": {**bpt.get("placement", {}), "choices": 1}} if bpt else {}
    return {
        NEW: Mode(NEW, "consistent", LOAD_AWARE, pool=bpt),
        "ring-first": Mode("ring-first", "consistent", LOAD_AWARE, pool=first),
        "strict-bound": Mode("strict-bound", "consistent", LOAD_AWARE, pool={**strict, **bpt}),
        "static-bound": Mode("static-bound", "consistent", STATIC, pool={**strict, **bpt}),
        "static-sticky": Mode(
            "static-sticky", "consistent", STATIC, factor=args.sticky_factor, pool=bpt
        ),
        "least_conn": Mode("least_conn", "least_conn", baseline),
        "round_robin": Mode("round_robin", "round_robin", baseline),
        "haproxy": Mode("haproxy", "consistent", STATIC, proxy="haproxy"),
    }


def parse_modes(spec: str, known: dict[str, Mode]) -> list[Mode]:
    try:
        modes = [parse_mode(m.strip(), known) for m in spec.split(";") if m.strip()]
    except ValueError as exc:
        raise SystemExit(f"--modes: {exc}") from None
    if any(m.proxy == "haproxy" for m in modes) and shutil.which("haproxy") is None:
        print("warning: haproxy is not installed (apt-get install haproxy): mode skipped")
        modes = [m for m in modes if m.proxy != "haproxy"]
    return modes


# -- the sweep ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepCase:
    """One random configuration of the sweep."""

    name: str
    kind: str  # identical, slowed (one worker with background load) or mixed
    workload: Workload
    workers: WorkerParams
    kv_factor: float  # KV capacity / the balanced share's largest context

    def line(self) -> str:
        w, wp = self.workload, self.workers
        return (
            f"{self.name}: {self.kind}, {wp.count} workers, {w.sessions} conversations of "
            f"{w.turns[0]}-{w.turns[1]} turns, arrivals over {w.arrival_s:g} s, think "
            f"{w.think_s:g} s, system {w.system_words} words, prompts {w.prompt_words[0]}-"
            f"{w.prompt_words[1]}, answers {w.answer_tokens[0]}-{w.answer_tokens[1]}; workers "
            f"{wp.describe()}; KV {self.kv_factor:.2f} x the balanced share's need"
        )


def sweep_cases(n: int, seed: int, timeout: float) -> list[SweepCase]:
    """``n`` configurations drawn from ``seed``: every other one identical workers, the rest a
    slowed worker or mixed speeds and KV sizes; 3 to 8 workers, 8 to 12 conversations each (72
    at most, for a 2-core machine), 2 to 8 turns, think times 0.3-1.5 s, half of them a burst
    (every first turn at once). Each worker's KV cache holds 1.4 to 3 times what its balanced
    share of conversations needs at their longest: enough for a balanced placement never to
    evict, not for a worker given its ``c`` bound of long ones."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = "identical" if i % 2 == 0 else rng.choice(("slowed", "mixed"))
        count = rng.randint(3, 8)
        sessions = min(72, count * rng.randint(8, 12))
        lo = rng.randint(2, 4)
        turns = (lo, rng.randint(lo, min(8, lo + 4)))
        plo, alo = rng.randint(10, 40), rng.randint(10, 30)
        prompt, answer = (plo, plo + rng.randint(0, 30)), (alo, alo + rng.randint(0, 30))
        system = rng.randint(150, 400)
        burst = rng.random() < 0.5
        w = Workload(
            sessions=sessions,
            turns=turns,
            think_s=round(rng.uniform(0.3, 1.5), 2),
            arrival_s=0.3 if burst else round(rng.uniform(2.0, 10.0), 1),
            system_words=system,
            prompt_words=prompt,
            answer_tokens=answer,
            reconnect_share=1.0,
            turn_timeout_s=timeout,
            seed=rng.randrange(1_000_000),
        )
        longest = system + turns[1] * (sum(prompt) + sum(answer)) / 2
        kv_factor = rng.uniform(1.4, 3.0)
        mixed: tuple[tuple[float, float, float], ...] = ()
        if kind == "slowed":
            slow = rng.randrange(count)
            util = round(rng.uniform(0.4, 0.7), 2)
            mixed = tuple((1.0, 1.0, util if j == slow else 0.0) for j in range(count))
        elif kind == "mixed":
            mixed = tuple(
                (round(rng.uniform(0.5, 1.5), 2), round(rng.uniform(0.8, 1.5), 2), 0.0)
                for _ in range(count)
            )
        wp = WorkerParams(
            count=count,
            tokens_per_s=round(rng.uniform(30.0, 80.0)),
            prefill_ms_per_token=round(rng.uniform(1.0, 2.0), 2),
            kv_capacity_tokens=int(kv_factor * sessions / count * longest),
            max_batch=rng.randint(6, 16),
            session_ttl=300.0,
            hot_background_util=0.0,
            mixed=mixed,
        )
        cases.append(SweepCase(f"s{i + 1}", kind, w, wp, kv_factor))
    return cases


def sweep_table(cases: list[SweepCase], out: Outcome) -> list[str]:
    """One row per case: wslb's default against round robin and HAProxy, and its targets."""
    head = (
        "| case | kind | workers | conversations x turns | arrivals s | think s | KV / need "
        "| follow-up p99 ms wslb / RR / HAProxy | sessions moved wslb / HAProxy "
        "| KV hit / ideal wslb / HAProxy | most first turns on a worker wslb / HAProxy (share) "
        "| targets |"
    )
    lines = [head, "|" + " --- |" * 12]
    for c in cases:
        rs = {r.mode: r for r in out.results if r.run == c.name}
        new, rr, hp = rs.get(NEW), rs.get("round_robin"), rs.get("haproxy")
        if new is None:
            continue

        def p99(r: Result | None) -> str:
            return ms(r.ttft_follow_p99) if r is not None else "-"

        w = c.workload
        ok = verdicts(new, rs, identical=c.kind == "identical")
        lines.append(
            f"| {c.name} | {c.kind} | {c.workers.count} | {w.sessions} x {w.turns[0]}-"
            f"{w.turns[1]} | {w.arrival_s:g} | {w.think_s:g} | {c.kv_factor:.2f} "
            f"| {p99(new)} / {p99(rr)} / {p99(hp)} "
            f"| {new.changed} / {hp.changed if hp else '-'} "
            f"| {new.hit / new.ideal:.3f} / {f'{hp.hit / hp.ideal:.3f}' if hp else '-'} "
            f"| {new.first_max} / {hp.first_max if hp else '-'} "
            f"({w.sessions / c.workers.count:.1f}) "
            f"| {', '.join(v.split(':')[1].split('(')[0].strip() for v in ok)} |"
        )
    return lines


def sweep(args: argparse.Namespace, command: str) -> int:
    """``--sweep N``: N random configurations (``sweep_cases``), each with every mode of
    ``--sweep-modes`` on fresh processes; prints each case, a table and the targets met."""
    seed = args.seed if args.seed is not None else 1
    cases = sweep_cases(args.sweep, seed, args.turn_timeout_s)
    modes = parse_modes(args.sweep_modes, all_modes(args))
    lbp = LbParams(
        factor=args.factor, scrape_s=args.scrape_s, poll_s=args.poll_s, smoothing_s=args.smoothing_s
    )
    print(f"# {command}\n# {machine_line()}\n# load average at start {load_average()}")
    for c in cases:
        print(f"# {c.line()}", flush=True)
    out = Outcome()
    started = time.monotonic()
    loads = []
    for c in cases:
        side = SideLoad("w1", 0, 0, 0.0, 1.0)
        run_modes([c.name], modes, c.workload, c.workers, lbp, side, {}, args, out, "")
        loads.append(load_average())
    elapsed = time.monotonic() - started
    lines = sweep_table(cases, out)
    failed = 0
    for c in cases:
        rs = {r.mode: r for r in out.results if r.run == c.name}
        if NEW in rs:
            failed += sum("MISSED" in v for v in verdicts(rs[NEW], rs, c.kind == "identical"))
    cpu = [r.cpu_other for r in out.results]
    print("\n" + "\n".join(lines))
    print(
        f"\nwall time {elapsed:.0f} s for {len(cases)} cases x {len(modes)} modes; load "
        f"average after each case: {'; '.join(loads)}; other processes' CPU during the runs "
        f"{min(cpu, default=0):.2f}-{max(cpu, default=0):.2f} cores; targets missed: {failed}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": command,
                    "cases": [{**asdict(c), "line": c.line()} for c in cases],
                    "results": [asdict(r) for r in out.results],
                    "moves": {f"{k[0]}/{k[1]}": v for k, v in out.moves.items()},
                    "table": lines,
                    "elapsed_s": elapsed,
                }
            )
        )
    return 0


def _llama_starter(parallel: int, ctx: int) -> Callable[[Procs, str], str]:
    """``--workload keyless --engines llama``'s engines: llama-server with Gemma (``--swa-full``:
    its sliding-window layers keep the whole context, so a prefix can be reused)."""
    from tests.engines import LlamaServer

    def start(procs: Procs, name: str) -> str:
        args = ["--swa-full"]
        server = LlamaServer(parallel=parallel, ctx=ctx, args=args, procs=procs, name=name)
        return server.start(timeout=120.0).url

    return start


def _etcd_starter(procs: Procs, data: Path) -> str:
    """``--workload keyless``'s cluster row: one etcd member (the tests' own, Debian's
    etcd-server), stopped with the group; its URL."""
    from tests.tier import Etcd

    etcd = Etcd(data).start()
    procs.on_close(etcd.stop)
    return etcd.url


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload")
    keyless_workload = pre.parse_known_args(argv)[0].workload == "keyless"
    args = None if keyless_workload else build_parser().parse_args(argv)
    # SIGTERM (and SIGINT, also where a non-interactive shell ignores it) end the script
    # through its finally blocks, so every worker and wslb it started is stopped.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    if args is None:  # bench/lib/keyless.py parses its own options
        from bench.lib import keyless

        line = "python bench/routing.py " + " ".join(shlex.quote(x) for x in argv)
        return keyless.main(argv, line, _llama_starter, _etcd_starter)
    command = "python bench/routing.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    if args.sweep:
        return sweep(args, command.strip())
    preset = dict(WORKLOADS[args.workload])
    if args.quick:
        preset.update(sessions=30, turns=(3, 3), arrival_s=6.0, think_s=1.0)
    w = Workload(
        sessions=args.sessions or int(preset["sessions"]),
        turns=args.turns or preset["turns"],
        think_s=args.think_s or float(preset["think_s"]),
        arrival_s=args.arrival_s or float(preset["arrival_s"]),
        system_words=args.system_words,
        prompt_words=args.prompt_words,
        answer_tokens=args.answer_tokens,
        reconnect_share=(
            args.reconnect_share
            if args.reconnect_share is not None
            else float(preset["reconnect_share"])
        ),
        turn_timeout_s=args.turn_timeout_s,
        seed=args.seed if args.seed is not None else int(preset.get("seed", 1)),
    )
    wp = WorkerParams(
        count=args.workers or int(preset["workers"]),
        tokens_per_s=args.tokens_per_s,
        prefill_ms_per_token=args.prefill_ms_per_token,
        kv_capacity_tokens=args.kv_capacity_tokens or int(preset.get("kv_capacity_tokens", 32_000)),
        max_batch=args.max_batch or int(preset.get("max_batch", 16)),
        session_ttl=args.session_ttl,
        hot_background_util=args.hot_background_util,
    )
    lbp = LbParams(
        factor=args.factor, scrape_s=args.scrape_s, poll_s=args.poll_s, smoothing_s=args.smoothing_s
    )
    modes = parse_modes(args.modes, all_modes(args))
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in ("even", "hetero", "hot"):
            raise SystemExit(f"unknown run {r!r} (even, hetero, hot)")
    _, plans = make_plan(w)
    # hetero: the last worker is slow from the start; hot: the worker the ring gives the most
    # sessions (the one a skewed hash loads most anyway) gets the side load.
    ids = [f"w{i + 1}" for i in range(wp.count)]
    ring = Ring(dict.fromkeys(ids, 1.0))
    owned = {i: sum(ring.owner(p.sid) == i for p in plans) for i in ids}
    hot_of = {"hetero": ids[-1], "hot": max(ids, key=lambda i: (owned[i], i))}
    lo, hi = args.side_window
    side = SideLoad(hot_of["hot"], args.side_streams, args.side_tokens, lo, hi)
    print(f"# {command.strip()}\n# {machine_line()}\n# load average {load_average()}", flush=True)

    out = Outcome()
    started = time.monotonic()
    run_modes(runs, modes, w, wp, lbp, side, hot_of, args, out)
    elapsed = time.monotonic() - started
    results = out.results

    for run in runs:
        rs = [r for r in results if r.run == run]
        print(f"\n## {run}\n\n{table(rs)}\n\n{detail_table(rs)}")
        print(f"\n{overload_table(rs, args.overload_grace_s)}")
    grace = args.overload_grace_s
    print("\n## Targets\n\n" + "\n".join(targets(results, runs, lbp.factor, grace)))
    print(f"\nwall time {elapsed:.0f} s")
    if str(args.doc) != "-":
        write_doc(
            args.doc,
            command.strip(),
            results,
            runs,
            w,
            wp,
            lbp,
            args.baseline_weights,
            elapsed,
            modes,
            {r: hot_of[r] for r in runs if r in hot_of},
            side if "hot" in runs else None,
            grace,
        )
        print(f"wrote {args.doc}")
    if str(args.png) != "-" and plot(args.png, results, runs):
        print(f"wrote {args.png}")
    if args.json is not None:
        raw = [
            {
                **asdict(r),
                "polls": [asdict(p) for p in out.polls[(r.run, r.mode)]],
                "moves": out.moves[(r.run, r.mode)],
            }
            for r in results
        ]
        args.json.write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
