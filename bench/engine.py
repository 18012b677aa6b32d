#!/usr/bin/env python3
"""A real engine behind wslb: the overhead of the bridge + wslb, and the migration pause.

Starts two ``llama-server`` processes (llama.cpp, Gemma 3 270M Q4_K_M on the CPU, one thread
each; ``tests/engines.py`` builds or fetches them once into ``~/.cache/wslb``), the engine bridge
(``python -m backends.worker --engine openai``) in front of each, and wslb in front of both
bridges, all on 127.0.0.1. Then:

1. **Overhead**: ``--requests`` requests, one at a time, alternating *direct* (``POST
   /v1/chat/completions`` with ``stream: true`` to llama-server) and *through* (a chat session
   via wslb and a bridge, WebSocket), the same prompt at temperature 0. TTFT: to the first
   content chunk (direct) or the first ``token`` message (through); tokens/s: chunks after the
   first over the time from the first to the last. Medians of each, and through/direct.
2. **Migration**: ``--sessions`` sessions through wslb, all on bridge ``b1``, each mid-answer
   (``--answer`` tokens); ``b1`` is drained (``POST /backends/b1/drain {"migrate": true}``) and
   each moved answer goes on on ``b2``. Per moved session:

   - **pause** (measured, client side): the largest gap between two ``token`` messages ending
     after the drain request (the last token from b1 to the first from b2);
   - **wslb pause** (measured by wslb: ``GET /sessions`` ``migration_pauses_ms``, freeze request
     to the first message from the new worker);
   - **re-prefill** (measured by the engine): ``prompt eval time`` of each continuation request
     in b2's llama-server log (the requests it finished after the drain), not paired with
     sessions;
   - **freeze** (measured, a separate run): ``--probes`` sessions straight to b1, each frozen
     mid-answer with the ``POST /wslb/sessions/{sid}/freeze`` call timed from here;
   - **first chunk** (derived): pause - freeze - re-prefill, at each percentile.

Figures only, no pass/fail. ``--quick`` for a smoke run; ``--json FILE`` writes the figures.
Not a test: pytest collects only ``tests/``. Run ``python bench/engine.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.launch import WORKER_AUTH, Procs, Worker, Wslb  # noqa: E402
from bench.lib.machine import machine_line  # noqa: E402
from bench.lib.script import sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import summary  # noqa: E402
from tests.engines import LlamaServer  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to fly. Make it at least ten sentences."
TIMEOUT = 120.0  # seconds for one message from a CPU engine, at most
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms")


def log(msg: str) -> None:
    print(f"[engine] {msg}", file=sys.stderr, flush=True)


async def recv(ws: ClientConnection, timeout: float = TIMEOUT) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        raw = await ws.recv()
    obj = json.loads(raw)
    assert isinstance(obj, dict)
    return obj


def rates(times: list[float], start: float) -> tuple[float, float]:
    """TTFT (ms) and tokens/s after the first, from chunk arrival times."""
    ttft = (times[0] - start) * 1e3
    span = times[-1] - times[0]
    tps = (len(times) - 1) / span if len(times) > 1 and span > 0 else float("nan")
    return ttft, tps


async def direct_once(http: aiohttp.ClientSession, url: str, max_tokens: int) -> list[float]:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    times: list[float] = []
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            for choice in json.loads(data).get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    return [start, *times]


async def through_once(lb: Wslb, max_tokens: int) -> list[float]:
    sid = uuid.uuid4().hex
    async with connect(f"{lb.url}/ws?session={sid}", open_timeout=10) as ws:
        hello = await recv(ws)
        assert hello["type"] == "hello", hello
        prompt = {"type": "prompt", "text": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        start = time.perf_counter()
        await ws.send(json.dumps(prompt))
        times: list[float] = []
        while True:
            msg = await recv(ws)
            if msg["type"] == "done":
                break
            assert msg["type"] == "token", msg
            times.append(time.perf_counter())
    return [start, *times]


async def overhead(lb: Wslb, engine: LlamaServer, n: int, max_tokens: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"direct_ttft_ms": [], "direct_tps": []}
    out |= {"through_ttft_ms": [], "through_tps": []}
    async with aiohttp.ClientSession() as http:
        for url in (engine.url,):  # warm-up (prompt cache, first-request costs)
            await direct_once(http, url, max_tokens)
        await through_once(lb, max_tokens)
        await through_once(lb, max_tokens)
        for k in range(n):
            if k % 2 == 0:
                t = await direct_once(http, engine.url, max_tokens)
                kind = "direct"
            else:
                t = await through_once(lb, max_tokens)
                kind = "through"
            ttft, tps = rates(t[1:], t[0])
            out[f"{kind}_ttft_ms"].append(ttft)
            out[f"{kind}_tps"].append(tps)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "median": med,
        "ratio_ttft": med["through_ttft_ms"] / med["direct_ttft_ms"],
        "ratio_tps": med["through_tps"] / med["direct_tps"],
        "samples": out,
    }


async def open_on(lb: Wslb, wid: str) -> tuple[str, ClientConnection]:
    """A session through wslb that lands on worker ``wid`` (others are closed and retried)."""
    for _ in range(200):
        sid = uuid.uuid4().hex
        ws = await connect(f"{lb.url}/ws?session={sid}", open_timeout=10)
        hello = await recv(ws)
        if hello.get("worker") == wid:
            return sid, ws
        await ws.close()
    raise RuntimeError(f"no session landed on {wid}")


async def one_migrating(
    ws: ClientConnection, max_tokens: int, started: asyncio.Event, min_tokens: int
) -> dict[str, Any]:
    prompt = {"type": "prompt", "text": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    await ws.send(json.dumps(prompt))
    times: list[float] = []
    done: dict[str, Any] = {}
    while True:
        msg = await recv(ws)
        if msg["type"] == "done":
            done = msg
            break
        assert msg["type"] == "token", msg
        times.append(time.perf_counter())
        if len(times) == min_tokens:
            started.set()
    return {"times": times, "done": done}


async def migration(
    lb: Wslb, target: LlamaServer, m: int, max_tokens: int, min_tokens: int
) -> tuple[dict[str, Any], list[float], list[float]]:
    """The moved sessions' client-side pauses; wslb's pauses; the continuations' prompt_ms."""
    opened = [await open_on(lb, "b1") for _ in range(m)]
    events = [asyncio.Event() for _ in opened]
    tasks = [
        asyncio.create_task(one_migrating(ws, max_tokens, ev, min_tokens))
        for (_, ws), ev in zip(opened, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), TIMEOUT)
    log_offset = target.log.stat().st_size
    drained_at = time.perf_counter()
    await asyncio.to_thread(
        lb.admin_post, "/backends/b1/drain", {"migrate": True, "timeout": "60s"}
    )
    results = await asyncio.gather(*tasks)
    sessions = {s["id"]: s for s in await asyncio.to_thread(lb.admin, "/sessions")}
    for _, ws in opened:
        await ws.close()
    pauses: list[float] = []
    wslb_pauses: list[float] = []
    for (sid, _), r in zip(opened, results, strict=True):
        if r["done"].get("worker") != "b2":
            continue  # finished before its freeze
        t = r["times"]
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(t) if b > drained_at]
        if gaps:
            pauses.append(max(gaps))
        wslb_pauses += sessions.get(sid, {}).get("migration_pauses_ms", [])
    await asyncio.sleep(0.5)  # llama-server prints timings as each request ends
    with target.log.open("rb") as f:
        f.seek(log_offset)
        tail = f.read().decode(errors="replace")
    prefill = [float(x) for x in PROMPT_EVAL.findall(tail)]
    return {"sessions": m, "moved": len(pauses), "pause_ms": pauses}, wslb_pauses, prefill


async def freeze_probe(bridge: Worker, n: int, max_tokens: int, after: int) -> list[float]:
    """``n`` sessions straight to the bridge, each frozen after ``after`` tokens: the freeze
    POST's round trip (ms), timed from here."""
    out: list[float] = []
    base = f"http://127.0.0.1:{bridge.port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            sid = uuid.uuid4().hex
            url = f"{base.replace('http', 'ws')}/ws?session={sid}"
            async with connect(url, additional_headers=WORKER_AUTH) as ws:
                await recv(ws)  # hello
                prompt = {"type": "prompt", "text": PROMPT, "max_tokens": max_tokens}
                await ws.send(json.dumps({**prompt, "temperature": 0}))
                for _ in range(after):
                    await recv(ws)
                t0 = time.perf_counter()
                freeze = f"{base}/wslb/sessions/{sid}/freeze"
                async with http.post(freeze, json={}, headers=WORKER_AUTH) as resp:
                    await resp.read()
                    resp.raise_for_status()
                out.append((time.perf_counter() - t0) * 1e3)
    return out


async def run(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    parallel = max(4, args.sessions)
    engines = [
        LlamaServer(procs=procs, name=f"llama-{k}", parallel=parallel, ctx=512 * parallel)
        for k in (1, 2)
    ]
    for e in engines:
        e.start(timeout=120)
    bridges = []
    for k, e in enumerate(engines, 1):
        wargs = ["--engine", "openai", "--engine-url", e.url, "--health-interval", "0.25"]
        bridges.append(Worker(f"b{k}", wargs, procs=procs, name=f"bridge-{k}").start(timeout=30))
    config = {
        "pools": [
            {
                "name": "chat",
                "health": {"interval": "0.2s", "timeout": "1s", "path": "/healthz"},
                "drain": {"timeout": "60s", "migrate": True},
                "backends": [{"id": b.id, "url": f"ws://127.0.0.1:{b.port}"} for b in bridges],
            }
        ],
        "timeouts": {"close": "2s", "shutdown_grace": "0.1s"},
    }
    lb = Wslb(config, procs.logdir, procs=procs, name="wslb", token=secrets.token_urlsafe(32))
    lb.start(wait_ready=False, timeout=20)
    lb.wait_ready(30)
    log(f"overhead: {args.requests} requests")
    over = await overhead(lb, engines[0], args.requests, args.max_tokens)
    log("freeze probe")
    freeze = await freeze_probe(bridges[0], args.probes, args.answer, args.after)
    log(f"migration: {args.sessions} sessions on b1, drain")
    mig, wslb_pauses, prefill = await migration(
        lb, engines[1], args.sessions, args.answer, args.after
    )
    pause = summary(mig["pause_ms"], peak=False)
    fz, pf = summary(freeze, peak=False), summary(prefill, peak=False)
    rest = {q: pause[q] - fz[q] - pf[q] for q in ("p50", "p99")}
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{machine_line()}; llama-server threads=1",
        "args": vars(args),
        "overhead": over,
        "migration": {
            **mig,
            "pause": pause,
            "wslb_pause": summary(wslb_pauses, peak=False),
            "freeze": fz,
            "re_prefill": pf,
            "first_chunk_derived": rest,
            "freeze_ms": freeze,
            "re_prefill_ms": prefill,
            "wslb_pause_ms": wslb_pauses,
        },
    }


def report(r: dict[str, Any]) -> str:
    o, m = r["overhead"], r["migration"]
    med = o["median"]
    lines = [
        f"# {r['date']}  {r['machine']}",
        f"overhead ({o['requests']} requests alternating, max_tokens {o['max_tokens']}, medians)",
        f"  {'':10} {'TTFT ms':>9} {'tokens/s':>9}",
        f"  {'direct':10} {med['direct_ttft_ms']:9.1f} {med['direct_tps']:9.1f}",
        f"  {'through':10} {med['through_ttft_ms']:9.1f} {med['through_tps']:9.1f}",
        f"  {'ratio':10} {o['ratio_ttft']:9.3f} {o['ratio_tps']:9.3f}   (through / direct)",
        f"migration ({m['moved']}/{m['sessions']} sessions moved b1 -> b2)",
        f"  {'':34} {'n':>3} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    rows = [
        ("pause, client gap (measured)", m["pause"]),
        ("pause, wslb's migration_pauses_ms", m["wslb_pause"]),
        ("freeze POST (measured, probe)", m["freeze"]),
        ("re-prefill (engine prompt_ms)", m["re_prefill"]),
    ]
    for name, s in rows:
        lines.append(f"  {name:34} {s['n']:3d} {s['p50']:8.1f} {s['p99']:8.1f}")
    d = m["first_chunk_derived"]
    lines.append(f"  {'first chunk (derived: the rest)':34} {'':3} {d['p50']:8.1f} {d['p99']:8.1f}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="TTFT and tokens/s direct vs through bridge + wslb; migration pause.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=20, help="overhead requests (alternating)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per overhead request")
    p.add_argument("--sessions", type=int, default=10, help="sessions migrated by the drain")
    p.add_argument("--answer", type=int, default=64, help="max_tokens of a migrated answer")
    p.add_argument("--after", type=int, default=8, help="tokens each has before the drain")
    p.add_argument("--probes", type=int, default=10, help="freezes timed straight to a bridge")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 requests, 3 sessions")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep-logs", type=Path, default=None, help="keep the logs in this folder")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.sessions, args.probes = 4, 3, 3
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="wslb-engine-") as tmp:
            logdir = args.keep_logs or Path(tmp)
            logdir.mkdir(parents=True, exist_ok=True)
            with Procs(logdir) as procs:
                result = asyncio.run(run(args, procs))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
