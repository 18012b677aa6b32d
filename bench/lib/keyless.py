"""The keyless routing benchmark (``bench/routing.py --workload keyless``): multi-turn chats that
carry no session key, over plain HTTP, through wslb and through other LLM routers, on the same
engines, measured by what the engines prefilled.

The workload (``make_plan``): ``systems`` distinct system prompts of ``system_words`` words
(about 700 Gemma tokens by default), ``conversations`` conversations, conversation ``i`` on
system prompt ``i mod systems``, each of ``turns`` turns; the conversations start at random
times in ``arrival_s`` seconds and think an exponential ``think_s`` between turns. Every turn
sends the whole conversation so far (``messages``), as the ``openai`` SDK's
``chat.completions.create`` does: streamed, ``stream_options.include_usage``, temperature 0,
``max_tokens``; the engine's answer is appended as the assistant's message. Every user message
starts with its tag ``[cI tK]``. The plan depends on the seed only, so every router gets the
same one.

The routers (``ROUTERS``), each in front of fresh engines (a new process per engine per run, so
no run inherits a cache): wslb with its defaults, keyless (prefix placement) and keyed
(``X-Session-Id: conv-I`` per conversation), and the same two with ``prefix_placement:
{balance_factor: 1.25}`` (``-1.25``: new conversations held to the keys' bound, tighter than the
default 1.5, SGLang's ``balance_rel``); keyless through two wslb
instances with the same config, each request sent to the other one (what a TCP load balancer's
round robin in front of two instances does at worst), sharing nothing (``wslb-keyless-2``) or
in cluster mode over a real etcd (``wslb-keyless-cluster``); wslb with ``balance:
round_robin`` and no prefix placement (the baseline that needs nothing installed); SGLang's
gateway (``smg launch --policy cache_aware``) and vLLM's router (``vllm-router``,
``cache_aware`` and ``round_robin``) when installed (``bench/lib/routers.py``).

Which engine answered a request: each engine sits behind a pass-through *tap*
(``python -m bench.lib.keyless tap``, one process for all engines of a run, aiohttp), which logs
the engine's name and the last ``[cI tK]`` tag of every request body it forwards, before
forwarding it. The routers are pointed at the taps, so the record does not depend on what a
router forwards or rewrites (headers, ``model``, response fields); a request a router retried
elsewhere is counted where it was answered last. Before a reference worker, the tap also maps
``GET /health`` to its ``/healthz`` (SGLang's gateway probes ``/health`` at start) and drops
request fields the client did not send (``KEEP``: vLLM's router adds SGLang's, which the worker
refuses). Every router pays the same extra loopback hop.

What is measured per request, from the answer's last chunk: prompt tokens and tokens prefilled
(llama-server's ``timings.prompt_n``, else ``usage.prompt_tokens`` minus
``usage.prompt_tokens_details.cached_tokens``), and TTFT (request sent -> first content). Per
router and run (``analyse``): tokens prefilled of the prompt tokens; conversations whose turns
were not all answered by one engine; follow-ups (turns 2..) *re-prefilled*: the engine held
less than the previous turn's whole prompt (cached < previous prompt tokens - ``SLACK``): the
history was computed again, on a new engine or after its own eviction; follow-up TTFT p50/p99;
requests per engine against an even share. ``--repeat`` runs give median [min-max].

Targets (``targets``): wslb keyless prefills no more than SGLang's gateway (medians); wslb
keyed prefills less; no wslb row sends any engine more than its share times the
``prefix_placement.balance_factor`` it runs with (rounded up), in any run.

``write_section`` replaces only the text between ``BEGIN`` and ``ANALYSIS`` in
``docs/routing.md`` (appending the section with both markers and ``END`` if absent); the
hand-written analysis between ``ANALYSIS`` and ``END`` is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import random
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from balancer import prefix
from balancer.config import PoolCfg, PrefixCfg
from bench.lib import routers as peers
from bench.lib.launch import ROOT, Procs, Worker, Wslb, free_ports, wait_port
from bench.lib.machine import machine_line, tree_state
from bench.lib.stats import pct
from bench.lib.wslb import prom_by_label

__all__ = [
    "ROUTERS",
    "Params",
    "RunResult",
    "analyse",
    "main",
    "make_plan",
    "targets",
    "write_section",
]

BEGIN = "<!-- keyless:begin (bench/routing.py --workload keyless rewrites up to the analysis) -->"
ANALYSIS = "<!-- keyless:analysis (kept) -->"
END = "<!-- keyless:end -->"
TITLE = "## Keyless traffic: placing by prefix, against SGLang's and vLLM's routers"
SLACK = 4
"""Tokens a follow-up's cached prefix may fall short of the previous prompt and still count as
kept (a chat template may re-tokenise the boundary)."""
TAG = re.compile(rb"\[c(\d+) t(\d+)\]")
WSLB_ROUTERS = (
    "wslb-keyless",
    "wslb-keyless-2",
    "wslb-keyless-cluster",
    "wslb-keyed",
    "wslb-keyless-1.25",
    "wslb-keyed-1.25",
    "wslb-round_robin",
)
ROUTERS = (*WSLB_ROUTERS, *peers.PEERS)
FACTOR = PrefixCfg().balance_factor
TIGHT = PoolCfg("").hash_balance_factor
"""``prefix_placement.balance_factor`` of the ``-1.25`` rows: the keys' bound, and the one new
conversations had before they had their own."""


def factor(router: str) -> float:
    """The bound wslb runs ``router`` under."""
    return TIGHT if router.endswith("-1.25") else FACTOR


WORDS = tuple(
    " ".join(
        (
            "account answer battery bicycle booking brake cable chain change city clear customer",
            "delivery detail engine order frame friendly garden gear handle helmet honest invoice",
            "journey kind light lock manual model morning nearby network note offer option parcel",
            "pedal policy price product quick rain refund repair road saddle season service short",
            "size speed spare stock store support tire tool travel trip tube update valve warranty",
            "weather wheel window winter workshop always before carefully during every never often",
            "politely quickly simply usually where which while with without about against between",
        )
    ).split()
)


# -- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    conversations: int = 24
    turns: int = 3
    systems: int = 4
    system_words: int = 690
    user_words: tuple[int, int] = (25, 45)
    max_tokens: int = 48
    arrival_s: float = 90.0
    think_s: float = 2.0
    seed: int = 1
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str
    start_s: float
    users: tuple[str, ...]
    thinks: tuple[float, ...]


def make_plan(p: Params) -> list[Conversation]:
    """The conversations, from the seed alone."""
    rng = random.Random(p.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [
        f"You are assistant number {k} of shop {k * 7919 % 1000}. " + words(p.system_words)
        for k in range(p.systems)
    ]
    plan = []
    for i in range(p.conversations):
        users = tuple(
            f"[c{i} t{t + 1}] " + words(rng.randint(*p.user_words)) for t in range(p.turns)
        )
        thinks = tuple(rng.expovariate(1 / p.think_s) if p.think_s > 0 else 0.0 for _ in users)
        plan.append(
            Conversation(i, systems[i % p.systems], rng.uniform(0, p.arrival_s), users, thinks)
        )
    return plan


# -- the tap ---------------------------------------------------------------------------------

_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailers", "transfer-encoding", "upgrade", "host"}
    | {"content-length", "proxy-authenticate", "proxy-authorization"}
)


KEEP = frozenset({"model", "messages", "max_tokens", "temperature", "stream", "stream_options"})
"""What the benchmark's client sends; a reference worker refuses a field it does not know, and
vLLM's router adds some of SGLang's (``no_stop_trim``), so its tap drops the rest."""


async def _serve_taps(specs: Sequence[str], log_path: Path, reference: bool) -> None:
    """One site per ``NAME=PORT=UPSTREAM``; forever (the benchmark stops it)."""
    log = log_path.open("a", buffering=1)
    session = aiohttp.ClientSession(
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        # A connection per request: reusing one the engine is closing fails the request (a
        # 502 the router would retry elsewhere), which is the tap's doing, not the router's.
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
    )

    def handler(name: str, upstream: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            tags = TAG.findall(body)
            tag = f"{int(tags[-1][0])} {int(tags[-1][1])}" if tags else ""
            path = request.rel_url.path_qs
            if reference and request.path == "/health":
                path = "/healthz"
            if reference and tags and request.path.endswith("/chat/completions"):
                fields = json.loads(body)
                body = json.dumps({k: v for k, v in fields.items() if k in KEEP}).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            try:
                async with session.request(
                    request.method, upstream + path, data=body or None, headers=headers
                ) as up:
                    if tag:
                        log.write(f"{name} {tag} {up.status} {request.path}\n")
                    out = web.StreamResponse(
                        status=up.status,
                        headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP},
                    )
                    await out.prepare(request)
                    try:
                        async for chunk in up.content.iter_any():
                            await out.write(chunk)
                        await out.write_eof()
                    except (ConnectionError, aiohttp.ClientConnectionResetError):
                        if tag:  # the router left before the answer ended
                            log.write(f"{name} {tag} gone {request.path}\n")
                    return out
            except aiohttp.ClientError as e:
                print(f"tap {name} {request.path}: {e!r}", flush=True)
                if tag:
                    log.write(f"{name} {tag} 502 {request.path}\n")
                return web.Response(status=502, text=f"tap {name}: {e}")

        return handle

    runners = []
    for spec in specs:
        name, port, upstream = spec.split("=", 2)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", handler(name, upstream))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
        runners.append(runner)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        for r in runners:
            await r.cleanup()


def start_taps(
    procs: Procs, engines: Sequence[tuple[str, str]], reference: bool, log: Path
) -> list[str]:
    """A tap per ``(name, url)`` engine; their URLs (the routers' workers)."""
    ports = free_ports(len(engines))
    specs = [f"{name}={port}={url}" for (name, url), port in zip(engines, ports, strict=True)]
    cmd = [sys.executable, "-m", "bench.lib.keyless", "tap", str(log)]
    cmd += [*(["--reference"] if reference else []), *specs]
    proc = procs.spawn("taps", cmd, term_timeout=2.0)
    for port in ports:
        wait_port(port, 15.0, proc)
    return [f"http://127.0.0.1:{port}" for port in ports]


def read_taps(log: Path) -> tuple[dict[tuple[int, int], str], Counter[str]]:
    """(conversation, turn) -> the engine whose ``/chat/completions`` answered it (200; the
    last if several); and every other forward by ``engine:status:path`` (a router's retries,
    vLLM's router's ``/tokenize`` calls, a router that left before the end: ``gone``)."""
    where: dict[tuple[int, int], str] = {}
    other: Counter[str] = Counter()
    if log.exists():
        for line in log.read_text().splitlines():
            name, c, t, status, path = line.split()
            key = (int(c), int(t))
            if status == "200" and path.endswith("/chat/completions"):
                if key in where:
                    other[f"{where[key]}:200:{path}"] += 1
                where[key] = name
            else:
                other[f"{name}:{status}:{path}"] += 1
    return where, other


# -- the client ------------------------------------------------------------------------------


@dataclass
class Turn:
    conv: int
    turn: int
    sent_s: float = math.nan
    ttft_s: float = math.nan
    prompt: int = 0
    cached: int = 0
    prefilled: int = 0
    answer_tokens: int = 0
    engine: str = ""
    error: str = ""


async def _one(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], rec: Turn
) -> str:
    """One streamed completion: its text; fills ``rec``."""
    t0 = time.monotonic()
    text: list[str] = []
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not text:
                        rec.ttft_s = time.monotonic() - t0
                    text.append(piece)
            usage = chunk.get("usage")
            if usage:
                rec.prompt = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                rec.cached = int(details.get("cached_tokens") or 0)
                rec.answer_tokens = int(usage.get("completion_tokens") or 0)
                rec.prefilled = rec.prompt - rec.cached
            timings = chunk.get("timings")
            if timings and "prompt_n" in timings:
                rec.prefilled = int(timings["prompt_n"])
                rec.cached = int(timings.get("cache_n", rec.cached))
    return "".join(text)


async def drive(
    urls: Sequence[str], plan: Sequence[Conversation], p: Params, model: str, keyed: bool
) -> list[Turn]:
    """Every conversation of ``plan`` against ``urls``, each request to the next of them in
    turn (one: all to it; two: as a TCP load balancer's round robin over two instances); a
    record per turn sent."""
    out: list[Turn] = []
    sent = itertools.count()
    timeout = aiohttp.ClientTimeout(total=p.timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        t0 = time.monotonic()

        async def conversation(c: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + c.start_s - time.monotonic()))
            messages: list[dict[str, str]] = [{"role": "system", "content": c.system}]
            headers = {"X-Session-Id": f"conv-{c.index}"} if keyed else {}
            for k, (user, think) in enumerate(zip(c.users, c.thinks, strict=True)):
                messages.append({"role": "user", "content": user})
                rec = Turn(c.index, k + 1, sent_s=time.monotonic() - t0)
                out.append(rec)
                body = {
                    "model": model,
                    "messages": messages,
                    "max_tokens": p.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    url = urls[next(sent) % len(urls)]
                    answer = await _one(http, url, body, headers, rec)
                except (aiohttp.ClientError, RuntimeError, TimeoutError, ValueError) as e:
                    rec.error = f"{type(e).__name__}: {e}"[:200]
                    return
                messages.append({"role": "assistant", "content": answer})
                if k + 1 < len(c.users):
                    await asyncio.sleep(think)

        await asyncio.gather(*(conversation(c) for c in plan))
    return out


# -- analysis --------------------------------------------------------------------------------


@dataclass
class RunResult:
    router: str
    run: int
    prompt: int
    prefilled: int
    conversations: int
    changed: int
    followups: int
    reprefilled: int
    ttft_follow_p50: float
    ttft_follow_p99: float
    ttft_first_p50: float
    per_engine: dict[str, int]
    failed: int
    sent_again: dict[str, int]
    duration_s: float
    placements: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def share_ratio(self) -> float:
        """The busiest engine's requests over an even share."""
        total = sum(self.per_engine.values())
        if not total or not self.per_engine:
            return math.nan
        return max(self.per_engine.values()) / (total / len(self.per_engine))


def analyse(
    router: str, run: int, turns: Sequence[Turn], engines: Sequence[str], duration_s: float
) -> RunResult:
    ok = [t for t in turns if not t.error]
    by_conv: dict[int, list[Turn]] = {}
    for t in sorted(ok, key=lambda t: (t.conv, t.turn)):
        by_conv.setdefault(t.conv, []).append(t)
    changed = sum(len({t.engine for t in ts}) > 1 for ts in by_conv.values())
    followups = reprefilled = 0
    for ts in by_conv.values():
        for prev, cur in itertools.pairwise(ts):
            if cur.turn != prev.turn + 1:
                continue
            followups += 1
            reprefilled += cur.cached < prev.prompt - SLACK
    follow = [t.ttft_s for t in ok if t.turn > 1 and not math.isnan(t.ttft_s)]
    first = [t.ttft_s for t in ok if t.turn == 1 and not math.isnan(t.ttft_s)]
    counts = Counter(t.engine for t in ok)
    return RunResult(
        router=router,
        run=run,
        prompt=sum(t.prompt for t in ok),
        prefilled=sum(t.prefilled for t in ok),
        conversations=len(by_conv),
        changed=changed,
        followups=followups,
        reprefilled=reprefilled,
        ttft_follow_p50=pct(follow, 50),
        ttft_follow_p99=pct(follow, 99),
        ttft_first_p50=pct(first, 50),
        per_engine={e: counts.get(e, 0) for e in engines},
        failed=len(turns) - len(ok),
        sent_again={},
        duration_s=duration_s,
        errors=sorted({t.error for t in turns if t.error})[:3],
    )


def _spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    vs = [v for v in values if not math.isnan(v)]
    if not vs:
        return "-"
    med = statistics.median(vs)
    if len(vs) == 1 or min(vs) == max(vs):
        return fmt(med)
    return f"{fmt(med)} [{fmt(min(vs))}-{fmt(max(vs))}]"


def _n(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"  # a median of two may end in .5


def _ms(x: float) -> str:
    return f"{x * 1000:,.0f}"


def _r(x: float) -> str:
    return f"{x:.2f}"


def table(results: Sequence[RunResult], routers: Sequence[str]) -> str:
    head = (
        "| router | tokens prefilled | of prompt tokens | conversations that changed engine "
        "| follow-ups re-prefilled | follow-up TTFT p50 (ms) | follow-up TTFT p99 (ms) "
        "| busiest engine / share | failed |\n" + "| --- " * 9 + "|"
    )
    rows = [head]
    for router in routers:
        rs = [r for r in results if r.router == router]
        if not rs:
            continue
        conv = max(r.conversations for r in rs)
        follow = max(r.followups for r in rs)
        rows.append(
            f"| {LABELS.get(router, router)} | {_spread([r.prefilled for r in rs], _n)} "
            f"| {_spread([r.prompt for r in rs], _n)} "
            f"| {_spread([r.changed for r in rs], _n)} of {conv} "
            f"| {_spread([r.reprefilled for r in rs], _n)} of {follow} "
            f"| {_spread([r.ttft_follow_p50 for r in rs], _ms)} "
            f"| {_spread([r.ttft_follow_p99 for r in rs], _ms)} "
            f"| {_spread([r.share_ratio for r in rs], _r)} "
            f"| {sum(r.failed for r in rs)} |"
        )
    return "\n".join(rows)


LABELS = {
    "wslb-keyless": "wslb, no key (prefix placement)",
    "wslb-keyless-2": "wslb, no key, 2 instances sharing nothing (each request to the other)",
    "wslb-keyless-cluster": "wslb, no key, 2 instances in cluster mode (each request to the other)",
    "wslb-keyed": "wslb, `X-Session-Id` per conversation",
    "wslb-keyless-1.25": "wslb, no key, `balance_factor: 1.25`",
    "wslb-keyed-1.25": "wslb, `X-Session-Id`, `balance_factor: 1.25`",
    "wslb-round_robin": "wslb, `round_robin`, no prefix placement",
    "smg": "SGLang's gateway (`smg`, `cache_aware`)",
    "vllm-cache_aware": "vLLM's router, `cache_aware`",
    "vllm-round_robin": "vLLM's router, `round_robin`",
}


def detail(results: Sequence[RunResult]) -> str:
    """Per run: requests per engine, re-sent requests, wslb's placements by how."""
    lines = []
    for r in results:
        engines = " ".join(f"{e}={n}" for e, n in r.per_engine.items())
        how = " ".join(f"{k}={v}" for k, v in sorted(r.placements.items()))
        extra = f"; placed: {how}" if how else ""
        sent = " ".join(f"{k}={v}" for k, v in sorted(r.sent_again.items()))
        again = f"; other forwards (engine:status:path) {sent}" if sent else ""
        err = f"; errors: {r.errors}" if r.errors else ""
        lines.append(
            f"- run {r.run}, {r.router}: requests per engine {engines}{extra}{again}; "
            f"first-turn TTFT p50 {_ms(r.ttft_first_p50)} ms; {r.duration_s:.0f} s{err}"
        )
    return "\n".join(lines)


def _median(results: Sequence[RunResult], router: str) -> float:
    vs = [r.prefilled for r in results if r.router == router]
    return statistics.median(vs) if vs else math.nan


def targets(results: Sequence[RunResult]) -> list[str]:
    """The verdicts, MET or MISSED, of what was measured (a router not run: none)."""
    out = []
    smg = _median(results, "smg")
    for router, keyed in itertools.product(("", "-1.25"), (False, True)):
        name = ("wslb-keyed" if keyed else "wslb-keyless") + router
        mine = _median(results, name)
        if math.isnan(smg) or math.isnan(mine):
            continue
        met = mine < smg if keyed else mine <= smg
        what = "less than" if keyed else "no more than"
        out.append(
            f"- {'MET' if met else 'MISSED'}: {name} prefills {what} SGLang's gateway "
            f"(median {_n(mine)} vs {_n(smg)} tokens"
            + (f", {100 * (mine / smg - 1):+.0f}%)" if smg else ")")
        )
    for router in WSLB_ROUTERS:
        if router == "wslb-round_robin":
            continue
        rs = [r for r in results if r.router == router]
        if not rs:
            continue
        worst = max(rs, key=lambda r: max(r.per_engine.values(), default=0))
        total = sum(worst.per_engine.values())
        share = total / max(1, len(worst.per_engine))
        bound = math.ceil(factor(router) * share - 1e-9)
        top = max(worst.per_engine.values(), default=0)
        spread = prefix.bound(share, factor(router))
        out.append(
            f"- {'MET' if top <= bound else 'MISSED'}: {router} sends no engine more than its "
            f"share x {factor(router):g} (worst run: {top} of {total} requests, bound {bound}; "
            f"with the spread the rule allows a count this size, {spread})"
        )
    return out


# -- the runs --------------------------------------------------------------------------------

EngineStarter = Callable[[Procs, str], str]
"""Starts one engine named NAME in a benchmark's group; its base URL once it answers."""


def reference_engine(p: Params) -> EngineStarter:
    def start(procs: Procs, name: str) -> str:
        args = [
            *("--tokens-per-s", "40", "--prefill-ms-per-token", "1"),
            *("--kv-capacity-tokens", "6000", "--max-tokens-default", str(p.max_tokens)),
        ]
        w = Worker(name, args, procs=procs, name=name, extra_env={"WSLB_WORKER_TOKEN": ""})
        w.start()
        return f"http://127.0.0.1:{w.port}"

    return start


def _model(url: str, timeout: float = 30.0) -> str:
    """The engine's model id (``GET /v1/models``), asked until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _wslb_config(
    router: str, taps: Sequence[str], names: Sequence[str], llama: bool
) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "chat",
        "backends": [{"id": n, "url": u} for n, u in zip(names, taps, strict=True)],
        "health": {"path": "/health" if llama else "/healthz", "interval": "0.5s", "rise": 1},
        "weights": {"metrics": "llamacpp" if llama else "reference"},
    }
    if router == "wslb-round_robin":
        pool["balance"] = "round_robin"
        pool["prefix_placement"] = {"enabled": False}
    if router.endswith("-1.25"):
        pool["prefix_placement"] = {"balance_factor": TIGHT}
    return {"pools": [pool], "log": {"access": False}}


def run_one(
    router: str,
    run: int,
    plan: Sequence[Conversation],
    p: Params,
    start_engine: EngineStarter,
    n_engines: int,
    llama: bool,
    logdir: Path,
    code: Path = ROOT,
    etcd: EtcdStarter | None = None,
) -> RunResult | str:
    """One router in front of fresh engines: its result, or why it was skipped."""
    d = logdir / f"run{run}-{router}"
    d.mkdir(parents=True)
    names = [f"e{i + 1}" for i in range(n_engines)]
    with Procs(d) as procs:
        # In this thread: a child started from another dies with it (PR_SET_PDEATHSIG).
        urls = [start_engine(procs, n) for n in names]
        model = _model(urls[0])
        log = d / "taps.jsonl"
        taps = start_taps(procs, list(zip(names, urls, strict=True)), not llama, log)
        lbs: list[Wslb] = []
        if router in WSLB_ROUTERS:
            cfg = _wslb_config(router, taps, names, llama)
            token = secrets.token_urlsafe(32)
            if router == "wslb-keyless-cluster":
                if etcd is None:
                    return "no etcd to run a cluster with"
                cfg["cluster"] = {"etcd": etcd(procs, d / "etcd"), "prefix": "/wslb-bench/"}
            two = router in ("wslb-keyless-2", "wslb-keyless-cluster")
            for i in range(2 if two else 1):
                lb = Wslb(cfg, d, procs=procs, token=token, src=code, name=f"wslb-{i + 1}")
                lb.start(wait_ready=False)
                lbs.append(lb)
            for lb in lbs:
                lb.wait_ready(timeout=60.0)
            urls = [f"http://127.0.0.1:{lb.port}" for lb in lbs]
        else:
            try:
                urls = [peers.start(peers.PEERS[router], procs, taps, router)]
            except FileNotFoundError as e:
                return str(e)
        t0 = time.monotonic()
        turns = asyncio.run(drive(urls, plan, p, model, keyed=router.startswith("wslb-keyed")))
        duration = time.monotonic() - t0
        where, again = read_taps(log)
        for t in turns:
            t.engine = where.get((t.conv, t.turn), "?")
        result = analyse(router, run, turns, names, duration)
        result.sent_again = dict(again)
        placed: Counter[str] = Counter()
        for lb in lbs:
            with contextlib.suppress(OSError, ValueError):
                metrics = lb.admin("/metrics")
                placed.update(prom_by_label(metrics, "wslb_http_prefix_placements_total", "how"))
        if lbs:
            result.placements = dict(placed)
        (d / "turns.json").write_text(json.dumps([asdict(t) for t in turns]))
    return result


# -- the doc ---------------------------------------------------------------------------------


def write_section(path: Path, body: str) -> None:
    """``body`` between ``BEGIN`` and ``ANALYSIS`` in ``path``; nothing else changes."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and ANALYSIS in old:
        head, rest = old.split(BEGIN, 1)
        _, tail = rest.split(ANALYSIS, 1)
        new = f"{head}{BEGIN}\n{body.strip()}\n\n{ANALYSIS}{tail}"
    else:
        sep = "" if not old or old.endswith("\n\n") else ("\n" if old.endswith("\n") else "\n\n")
        new = f"{old}{sep}{BEGIN}\n{body.strip()}\n\n{ANALYSIS}\n\n{END}\n"
    path.write_text(new)


def section(
    command: str,
    p: Params,
    engines: str,
    results: Sequence[RunResult],
    routers: Sequence[str],
    skipped: Sequence[str],
    elapsed: float,
    code: Path = ROOT,
) -> str:
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    wslb = tree_state() if code == ROOT else f"a copy at {code}"
    versions = sorted({peers.version(peers.PEERS[r]) for r in routers if r in peers.PEERS})
    also = f"; {', '.join(versions)}" if versions else ""
    skip = "".join(f"\nSkipped: {s}." for s in skipped)
    return f"""{TITLE}

`{command}`, {when}, {machine_line()}; {len({r.run for r in results})} runs, {elapsed / 60:.0f} min;
wslb {wslb}{also}.
Engines: {engines}, each started fresh for every router and run (no run inherits a cache).
Workload: {p.conversations} conversations of {p.turns} turns over {p.systems} shared system
prompts of {p.system_words} words, user messages of {p.user_words[0]}-{p.user_words[1]} words,
answers of at most {p.max_tokens} tokens (temperature 0), conversations starting at random in
{p.arrival_s:g} s, {p.think_s:g} s mean think time; plain HTTP, streamed, no session key unless
said. Each cell is the median [min-max] over the runs. Tokens prefilled: prompt tokens minus
the cached tokens the engine reported. A follow-up is re-prefilled when its engine held less
than the previous turn's whole prompt. TTFT is on a shared 2-core machine (noisy; the token
counts are not).{skip}

{table(results, routers)}

Targets:

{chr(10).join(targets(results))}

Per run:

{detail(results)}"""


# -- the command -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = Params()
    ap = argparse.ArgumentParser(
        prog="bench/routing.py --workload keyless",
        description="Keyless multi-turn chats through wslb, SGLang's gateway and vLLM's router.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = ap.add_argument
    a("--workload", choices=["keyless"], default="keyless")
    a("--engines", choices=["reference", "llama"], default="llama")
    a("--engine-count", type=int, default=3)
    a("--parallel", type=int, default=8, help="llama-server -np (slots)")
    a("--ctx", type=int, default=16384, help="llama-server -c (shared by its slots)")
    a("--routers", default=",".join(ROUTERS), help="comma-separated, of " + ", ".join(ROUTERS))
    a("--repeat", type=int, default=2, help="runs per router, each on fresh engines")
    a("--conversations", type=int, default=d.conversations)
    a("--turns", type=int, default=d.turns)
    a("--systems", type=int, default=d.systems)
    a("--system-words", type=int, default=d.system_words)
    a("--max-tokens", type=int, default=d.max_tokens)
    a("--arrival-s", type=float, default=d.arrival_s)
    a("--think-s", type=float, default=d.think_s)
    a("--seed", type=int, default=d.seed)
    a("--timeout-s", type=float, default=d.timeout_s, help="per request")
    a("--quick", action="store_true", help="reference workers, 6 conversations of 2 turns, 1 run")
    a("--doc", default=str(ROOT / "docs" / "routing.md"), help="'-' for none; its section only")
    a("--code", type=Path, default=ROOT, help="checkout whose wslb runs (default: this one)")
    a("--json", type=Path, default=None, help="also write the per-run results here")
    a("--keep-logs", action="store_true")
    return ap


LlamaFactory = Callable[[int, int], EngineStarter]
EtcdStarter = Callable[[Procs, Path], str]
"""Starts an etcd member with its data in the folder, stopped with the group; its URL
(``bench/routing.py`` owns it: the tests' real etcd)."""
"""(parallel, ctx) -> a llama-server starter (``bench/routing.py`` owns the engine build)."""


def main(
    argv: Sequence[str],
    command: str,
    llama: LlamaFactory | None,
    etcd: EtcdStarter | None = None,
) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.engines = "reference"
        args.conversations, args.turns, args.systems = 6, 2, 2
        args.arrival_s, args.think_s, args.repeat = 1.0, 0.2, 1
        args.system_words = 120
    p = Params(
        conversations=args.conversations,
        turns=args.turns,
        systems=args.systems,
        system_words=args.system_words,
        max_tokens=args.max_tokens,
        arrival_s=args.arrival_s,
        think_s=args.think_s,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown router(s) {unknown}: known {', '.join(ROUTERS)}")
    skipped = []
    for r in list(routers):
        peer = peers.PEERS.get(r)
        if peer is not None and peers.find(peer.command) is None:
            skipped.append(f"{r}: {peer.command} not installed: pip install {peer.package}")
            routers.remove(r)
    for s in skipped:
        print(f"# skipped {s}", flush=True)
    is_llama = args.engines == "llama"
    if is_llama:
        if llama is None:
            raise SystemExit("--engines llama needs bench/routing.py's engine starter")
        start_engine = llama(args.parallel, args.ctx)
        engines = (
            f"{args.engine_count} llama-servers (Gemma 3 270M Q4_K_M, `--swa-full`, "
            f"`-np {args.parallel} -c {args.ctx} -t 1`)"
        )
    else:
        start_engine = reference_engine(p)
        engines = f"{args.engine_count} reference workers (`backends.worker`, KV 6000 tokens)"
    plan = make_plan(p)
    print(f"# {command}\n# {machine_line()}\n# {engines}", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="wslb-keyless-"))
    results: list[RunResult] = []
    started = time.monotonic()
    try:
        for run in range(1, args.repeat + 1):
            for router in routers:
                out = run_one(
                    router,
                    run,
                    plan,
                    p,
                    start_engine,
                    args.engine_count,
                    is_llama,
                    logdir,
                    args.code,
                    etcd,
                )
                if isinstance(out, str):
                    print(f"# skipped {router}: {out}", flush=True)
                    continue
                results.append(out)
                print(
                    f"run {run} {router}: prefilled {out.prefilled} of {out.prompt}, "
                    f"changed {out.changed}/{out.conversations}, re-prefilled "
                    f"{out.reprefilled}/{out.followups}, follow-up TTFT p50 "
                    f"{_ms(out.ttft_follow_p50)} ms, engines {out.per_engine}, failed "
                    f"{out.failed}, {out.duration_s:.0f} s",
                    flush=True,
                )
    finally:
        if args.keep_logs:
            print(f"# logs in {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    elapsed = time.monotonic() - started
    print(f"\n{table(results, routers)}\n\n## Targets\n")
    print("\n".join(targets(results)))
    print(f"\n{detail(results)}\n\nwall time {elapsed:.0f} s")
    if args.doc != "-":
        write_section(
            Path(args.doc),
            section(command, p, engines, results, routers, skipped, elapsed, args.code),
        )
        print(f"wrote {args.doc}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results]))
    return 0 if results and not any(r.failed for r in results) else 1


def _tap_main(argv: Sequence[str]) -> None:
    """``tap LOG [--reference] NAME=PORT=URL...``: the taps of one run, until stopped."""
    log, *rest = argv
    specs = [a for a in rest if a != "--reference"]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_taps(specs, Path(log), "--reference" in rest))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "tap":
        _tap_main(sys.argv[2:])
    else:
        raise SystemExit(
            "usage: python -m bench.lib.keyless tap LOG [--reference] NAME=PORT=URL..."
        )
