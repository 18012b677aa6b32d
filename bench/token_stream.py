#!/usr/bin/env python3
"""Token-stream benchmark: CPU microseconds per forwarded frame, and frames/s, of a WebSocket proxy.

Starts reference workers (``backends.worker``), the proxy under test (a ``Target``; wslb by
default) in front of them, and load-generator client processes, all on 127.0.0.1. Each client
session says ``prompt`` with a large ``max_tokens`` and re-prompts when the answer is done (one
prompt is always queued, so a stream never pauses); the worker sends one WebSocket frame per
token.

- ``stream``: ``--sessions`` sessions, the workers pace each stream at ``--rate`` tokens/s, so
  the offered load is sessions x rate frames/s, one frame per TCP segment (the DESIGN.md load).
- ``saturate``: ``--sat-sessions`` sessions against unpaced workers: as many frames as the
  machine can push through.

After ``--warmup`` seconds, ``--repeat`` consecutive windows of ``--duration`` seconds are
measured. Per window: frames forwarded (the proxy's own counters when it has them, wslb's
``wslb_frames_total``; otherwise what the clients sent and received), the proxy's CPU seconds
(user + system of its process and children), hence CPU microseconds per frame, frames/s, CPU
utilisation and RSS. Clients count frames without decoding JSON and check, at each expected
``done``, that exactly ``max_tokens`` tokens came before it (a lost or duplicated frame shows as a
"bad" count). In stream mode they also record client-observed inter-token gaps (jitter).

Not a test: ``pytest`` only collects ``tests/``. Run ``python bench/token_stream.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.cpu import rss_bytes  # noqa: E402
from bench.lib.launch import Procs, free_port, wait_port  # noqa: E402
from bench.lib.load import (  # noqa: E402
    Sample,
    Target,
    Window,
    WslbTarget,
    client_main,
    make_window,
    start_clients,
    start_workers,
    take_sample,
)
from bench.lib.machine import machine, machine_line  # noqa: E402
from bench.lib.script import log, sigterm_as_interrupt  # noqa: E402

# -- targets: the proxy under test -----------------------------------------------------------


class RelayTarget(Target):
    """Baseline: a bare uvloop TCP byte relay (this script with ``--relay-spec``).

    It knows nothing of WebSocket: the upgrade and every frame pass through as bytes, and each
    connection goes to the next worker in turn. What the DESIGN.md calls "a bare uvloop byte
    relay in Python": the floor for a Python proxy's CPU per frame on this machine.
    """

    name = "relay"

    def __init__(self) -> None:
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        self.port = free_port()
        ups = []
        for u in backends:
            parts = urllib.parse.urlsplit(u)
            ups.append([parts.hostname or "127.0.0.1", parts.port or 80])
        spec = json.dumps({"port": self.port, "upstreams": ups})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--relay-spec", spec]
        self._proc = proc = procs.spawn("relay", cmd)
        try:
            wait_port(self.port, 20.0, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"relay did not start: {exc}\n{procs.log_tail('relay')}") from None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid


class _Pipe(asyncio.Protocol):
    """One leg of the bare relay: writes what it receives to the other leg's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.gone = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if self.peer is not None:
            self.peer.close()

    def pause_writing(self) -> None:
        if self.peer is not None and not self.peer.is_closing():
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and not self.peer.is_closing():
            self.peer.resume_reading()


async def _relay(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    upstreams = [tuple(u) for u in spec["upstreams"]]
    turn = 0
    linking: set[asyncio.Task[None]] = set()  # strong references until each link is made

    async def link(down: _Pipe, host: str, port: int) -> None:
        try:
            up_t, up = await loop.create_connection(_Pipe, host, port)
        except OSError:
            if down.transport is not None:
                down.transport.close()
            return
        if down.gone or down.transport is None:
            up_t.close()
            return
        up.peer, down.peer = down.transport, up_t
        for chunk in down.pending:
            up_t.write(chunk)
        down.pending.clear()

    def accept() -> _Pipe:
        nonlocal turn
        down = _Pipe()
        host, port = upstreams[turn % len(upstreams)]
        turn += 1
        task = loop.create_task(link(down, host, port))
        linking.add(task)
        task.add_done_callback(linking.discard)
        return down

    server = await loop.create_server(accept, "127.0.0.1", spec["port"], backlog=4096)
    async with server:
        await server.serve_forever()


def relay_main(spec_json: str) -> int:
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_relay(json.loads(spec_json)))
    return 0


TARGETS: dict[str, type[Target]] = {"wslb": WslbTarget, "relay": RelayTarget}


# -- measurement -----------------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    target: str
    sessions: int
    sessions_open: int
    rate: float | None
    offered_fps: float | None
    workers: int
    clients: int
    max_tokens: int
    idle_rss_mb: float
    windows: list[Window] = field(default_factory=list)
    bad_frames: int = 0
    sessions_failed: int = 0
    sessions_closed: int = 0
    proxy_minus_client_frames: int | None = None
    """Frames the proxy sent to clients minus frames clients got, over all windows."""
    warnings: list[str] = field(default_factory=list)

    def stat(self, values: Sequence[float]) -> dict[str, float]:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return {"median": math.nan, "min": math.nan, "max": math.nan}
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    def summary(self) -> dict[str, Any]:
        ws = self.windows
        return {
            "us_per_frame": self.stat([w.us_per_frame for w in ws]),
            "frames_per_s": self.stat([w.frames_per_s for w in ws]),
            "client_recv_per_s": self.stat([w.client_received / w.seconds for w in ws]),
            "target_cpu_pct": self.stat([w.cpu_pct("target") for w in ws]),
            "workers_cpu_pct": self.stat([w.cpu_pct("workers") for w in ws]),
            "clients_cpu_pct": self.stat([w.cpu_pct("clients") for w in ws]),
            "workers_us_per_frame": self.stat([w.role_us_per_frame("workers") for w in ws]),
            "clients_us_per_frame": self.stat([w.role_us_per_frame("clients") for w in ws]),
            "target_rss_mb": self.stat([w.target_rss_mb for w in ws]),
            "gap_p50_ms": self.stat([w.gap_ms["p50"] for w in ws if w.gap_ms]),
            "gap_p99_ms": self.stat([w.gap_ms["p99"] for w in ws if w.gap_ms]),
            "gap_max_ms": self.stat([w.gap_ms["max"] for w in ws if w.gap_ms]),
        }


def run_mode(mode: str, args: argparse.Namespace) -> ModeResult:
    stream = mode == "stream"
    sessions = args.sessions if stream else args.sat_sessions
    rate = args.rate if stream else 0.0
    run_s = args.warmup + args.repeat * args.duration
    if args.max_tokens:
        max_tokens = args.max_tokens
    elif stream:
        max_tokens = min(1_000_000, int(rate * (run_s + 30)))  # one answer outlasts the run
    else:
        max_tokens = 5000  # re-prompt often: bounded context in the workers
    n_clients = max(1, min(args.clients, sessions))
    target = TARGETS[args.target]()
    with contextlib.ExitStack() as stack:
        logdir = Path(args.logs) / mode if args.logs else None
        if logdir is None:
            logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wslb-bench-")))
        logdir.mkdir(parents=True, exist_ok=True)
        procs = stack.enter_context(Procs(logdir))
        rate_txt = f"{rate:g} tokens/s" if stream else "unpaced"
        log(f"[{mode}] starting {args.workers} worker(s) ({rate_txt}) and {target.name}")
        worker_pids, urls = start_workers(procs, args.workers, rate)
        target.start(procs, urls)
        time.sleep(0.5)
        idle_rss = rss_bytes([target.pid]) / 2**20
        ramp = args.ramp if args.ramp is not None else max(1.0, sessions / 200)
        log(f"[{mode}] {sessions} sessions from {n_clients} client process(es), ramp {ramp:g}s")
        clients = start_clients(procs, target.url, sessions, n_clients, max_tokens, stream, ramp)
        opened = failed = 0
        for c in clients:
            line = c.readline(ramp + 90)
            if not line.startswith("ready "):
                raise RuntimeError(f"client said {line!r}")
            ready = json.loads(line[6:])
            opened += ready["open"]
            failed += ready["failed"]
        result = ModeResult(
            mode=mode,
            target=target.name,
            sessions=sessions,
            sessions_open=opened,
            rate=rate if stream else None,
            offered_fps=sessions * rate if stream else None,
            workers=args.workers,
            clients=len(clients),
            max_tokens=max_tokens,
            idle_rss_mb=idle_rss,
        )
        if opened == 0:
            raise RuntimeError(f"no session could connect\n{procs.log_tail('client-0')}")
        log(f"[{mode}] {opened} sessions open ({failed} failed); warmup {args.warmup:g}s")
        pids = {
            "target": [target.pid],
            "workers": worker_pids,
            "clients": [c.proc.pid for c in clients],
        }
        time.sleep(args.warmup)
        first = prev = take_sample(target, clients, pids)
        for r in range(args.repeat):
            time.sleep(max(0.0, prev.t + args.duration - time.monotonic()))
            cur = take_sample(target, clients, pids)
            w = make_window(prev, cur, target)
            result.windows.append(w)
            log(
                f"[{mode}] window {r + 1}/{args.repeat}: {w.frames_per_s:,.0f} frames/s, "
                f"{w.us_per_frame:.2f} us/frame, {target.name} cpu {w.cpu_pct('target'):.1f}%"
            )
            prev = cur
        result.bad_frames = prev.client_sum("bad")
        result.sessions_failed = prev.client_sum("failed")
        result.sessions_closed = prev.client_sum("closed")
        if first.proxy is not None and prev.proxy is not None:
            sent_by_proxy = prev.proxy.to_client - first.proxy.to_client
            got = prev.client_sum("recv") - first.client_sum("recv")
            result.proxy_minus_client_frames = sent_by_proxy - got
        check(result, prev, target, n_cpu=os.cpu_count() or 1)
    return result


def check(result: ModeResult, last: Sample, target: Target, n_cpu: int) -> None:
    """Turn anything that makes the figures suspect into a warning."""
    warn = result.warnings.append
    s = result.summary()
    if result.sessions_open < result.sessions:
        warn(f"only {result.sessions_open} of {result.sessions} sessions connected")
    if result.sessions_closed:
        warn(f"{result.sessions_closed} sessions ended during the run")
    if result.bad_frames:
        warn(f"{result.bad_frames} frames out of place (lost, duplicated or unexpected)")
    for c in last.clients:
        for e in c["errors"]:
            warn(f"client: {e}")
    if result.offered_fps:
        achieved = s["client_recv_per_s"]["median"]
        if achieved < 0.95 * result.offered_fps:
            warn(
                f"offered {result.offered_fps:,.0f} frames/s, clients got {achieved:,.0f}/s: "
                "the load was not delivered (a client process near 100% CPU needs --clients N; "
                "a saturated machine, fewer --sessions or a lower --rate)"
            )
    per_client = s["clients_cpu_pct"]["max"] / max(1, result.clients)
    if per_client > 85:
        warn(f"client processes at {per_client:.0f}% CPU each: add --clients")
    busy = sum(s[f"{r}_cpu_pct"]["median"] for r in ("target", "workers", "clients"))
    if result.offered_fps and busy > 90 * n_cpu:
        warn(f"the machine is saturated ({busy:.0f}% CPU of {n_cpu * 100}%)")
    least = min((w.cpu_s["target"] for w in result.windows), default=0.0)
    if least < 1.0:
        warn(
            f"{target.name} used only {least:.2f} CPU s in a window: CPU time comes in 10 ms "
            f"ticks (+-{1.0 / max(least * 100, 1):.0%}); use a longer --duration"
        )
    diff = result.proxy_minus_client_frames
    total = sum(w.proxy_to_client or 0 for w in result.windows)
    if diff is not None and total and abs(diff) > max(10 * result.sessions, 0.01 * total):
        warn(f"{target.name} sent clients {diff:+,} frames more than they counted")
    for line in target.problems()[:10]:
        warn(f"{target.name} log: {line}")


# -- report ----------------------------------------------------------------------------------


def _fmt_stat(st: dict[str, float], fmt: str) -> str:
    return f"{st['median']:{fmt}} [{st['min']:{fmt}}-{st['max']:{fmt}}]"


def print_report(info: dict[str, Any], results: list[ModeResult], args: argparse.Namespace) -> None:
    print(f"machine: {machine_line(info)}")
    print(
        f"target {args.target}, {args.workers} worker(s), windows {args.repeat} x "
        f"{args.duration:g}s after {args.warmup:g}s warmup; median [min-max] over windows"
    )
    name = args.target
    head = (
        f"{'mode':<9}{'sessions':>9}{'offered fr/s':>14}{'frames/s':>10}"
        f"{'cpu us/frame':>24}{f'{name} cpu%':>12}{'rss MB':>8}{'gap p50/p99/max ms':>21}"
    )
    print(head)
    for r in results:
        s = r.summary()
        offered = f"{r.offered_fps:,.0f}" if r.offered_fps else "max"
        gap = (
            f"{s['gap_p50_ms']['median']:.1f}/{s['gap_p99_ms']['median']:.1f}"
            f"/{s['gap_max_ms']['median']:.0f}"
            if not math.isnan(s["gap_p50_ms"]["median"])
            else "-"
        )
        print(
            f"{r.mode:<9}{r.sessions_open:>9}{offered:>14}{s['frames_per_s']['median']:>10,.0f}"
            f"{_fmt_stat(s['us_per_frame'], '.2f'):>24}"
            f"{s['target_cpu_pct']['median']:>12.1f}{s['target_rss_mb']['median']:>8.1f}"
            f"{gap:>21}"
        )
    for r in results:
        s = r.summary()
        per_session = (
            (s["target_rss_mb"]["median"] - r.idle_rss_mb) * 1024 / max(1, r.sessions_open)
        )
        src = r.windows[0].frames_source if r.windows else "-"
        print(
            f"  {r.mode}: frames counted by {src}: {_fmt_stat(s['frames_per_s'], ',.0f')}/s, "
            f"clients received {s['client_recv_per_s']['median']:,.0f}/s; workers "
            f"{s['workers_cpu_pct']['median']:.0f}% cpu "
            f"({s['workers_us_per_frame']['median']:.1f} us/frame), {r.clients} client(s) "
            f"{s['clients_cpu_pct']['median']:.0f}% cpu "
            f"({s['clients_us_per_frame']['median']:.1f} us/frame); {name} rss "
            f"{r.idle_rss_mb:.1f} MB idle, +{per_session:.1f} KB/session"
        )
        checks = (
            f"bad frames {r.bad_frames}, sessions failed {r.sessions_failed}, "
            f"ended early {r.sessions_closed}"
        )
        if r.proxy_minus_client_frames is not None:
            checks += f", {name}-sent minus client-received {r.proxy_minus_client_frames:+,}"
        print(f"  {r.mode}: checks: {checks}")
        for w in r.warnings:
            print(f"  {r.mode}: WARNING: {w}")


def result_json(info: dict[str, Any], results: list[ModeResult], args: argparse.Namespace) -> str:
    out = {
        "machine": info,
        "args": {k: v for k, v in vars(args).items() if k not in ("client_spec", "relay_spec")},
        "modes": [
            {
                **{k: v for k, v in asdict(r).items() if k != "windows"},
                "summary": r.summary(),
                "windows": [
                    {**asdict(w), "frames_per_s": w.frames_per_s, "us_per_frame": w.us_per_frame}
                    for w in r.windows
                ],
            }
            for r in results
        ],
    }
    return json.dumps(out, indent=2, default=str)


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="CPU microseconds per forwarded frame and frames/s of wslb (or another "
        "target) under a token-stream load: many sessions, one WebSocket frame per token.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", choices=sorted(TARGETS), default="wslb", help="proxy under test")
    p.add_argument("--mode", choices=["stream", "saturate", "both"], default="both")
    p.add_argument("--sessions", type=int, default=300, help="sessions in stream mode")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per session (stream)")
    p.add_argument("--sat-sessions", type=int, default=32, help="sessions in saturate mode")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per measured window")
    p.add_argument("--repeat", type=int, default=3, help="measured windows per mode")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the first window")
    p.add_argument("--workers", type=int, default=2, help="reference worker processes")
    p.add_argument("--clients", type=int, default=1, help="load-generator processes")
    p.add_argument(
        "--ramp", type=float, default=None, help="seconds over which sessions start "
        "(default: sessions/200, at least 1)"
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=0, help="tokens per answer (0: stream mode, one "
        "answer lasts the whole run; saturate mode, 5000)"
    )  # fmt: skip
    p.add_argument("--logs", default=None, help="keep process logs in this directory")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)  # internal
    p.add_argument("--relay-spec", default=None, help=argparse.SUPPRESS)  # internal
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client_spec is not None:
        return client_main(args.client_spec)
    if args.relay_spec is not None:
        return relay_main(args.relay_spec)
    for name in ("sessions", "sat_sessions", "repeat", "workers", "clients"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.duration <= 0 or args.warmup < 0 or args.rate <= 0:
        raise SystemExit("--duration and --rate must be positive, --warmup not negative")
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    modes = ["stream", "saturate"] if args.mode == "both" else [args.mode]
    info = machine()
    results: list[ModeResult] = []
    try:
        for mode in modes:
            results.append(run_mode(mode, args))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json:
        print(result_json(info, results, args))
    else:
        print_report(info, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
