#!/usr/bin/env python3
"""Slowloris run: normal clients' handshake latency while many connections trickle headers.

Starts wslb (``python -m balancer``) with ``--workers`` reference workers it spawns itself and a
short ``timeouts.handshake`` (``--handshake-timeout``, 5 s), all on 127.0.0.1. Then:

1. **unloaded**: normal clients open WebSockets through wslb at ``--rate`` handshakes/s (at most
   ``--concurrency`` in flight) for ``--measure`` seconds. Each handshake is timed from the TCP
   connect to the end of wslb's ``101`` (raw asyncio sockets, nothing else on the path), then
   the client sends a close frame and leaves.
2. **loaded**: an attacker process (this script with ``--attacker``, so its work does not delay
   the measuring event loop) keeps ``--slow`` connections open, each sending the request head
   ``--chunk`` byte(s) every ``--interval-min``..``--interval-max`` seconds and never finishing
   it. A connection that wslb cuts is replaced at once, as a real slowloris does. The attackers
   ramp up over one handshake timeout, so wslb's cuts are spread; the same normal-client
   measurement then runs while they trickle.
3. **recovered**: the attacker stops replacing connections; after one handshake timeout plus
   ``--margin`` it counts the trickling connections still open (should be 0: wslb cuts them at
   ``timeouts.handshake`` with ``408``) and how each was ended (``408`` response, other status,
   EOF without a response, reset) with their lifetimes. The normal-client measurement runs once
   more.

Prints p50/p90/p99/max of each measurement, the ratio p99 loaded / unloaded against the target
(<= ``--target`` x, default 2), wslb's RSS, open FDs, asyncio tasks (``GET /debug/stats`` when
the admin listener has it) and live connections before, under and after the attack, and its
``408`` count. Exit status 0 when the target holds and no trickling connection outlived the
timeout plus margin, 1 otherwise.

The script raises its own ``RLIMIT_NOFILE`` soft limit to the hard limit; wslb and the attacker
inherit it (wslb needs about one FD per trickling connection, plus two per live session).

Not a test: pytest collects only ``tests/``. Run ``python bench/slowloris.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.cpu import process_cpu_seconds  # noqa: E402
from bench.lib.launch import Procs, Wslb, die_with_parent  # noqa: E402
from bench.lib.machine import machine_line  # noqa: E402
from bench.lib.script import raise_nofile, sigterm_as_interrupt  # noqa: E402
from bench.lib.stats import pct, summary  # noqa: E402
from bench.lib.wslb import (  # noqa: E402
    HTTP_POOL_PER_WORKER,
    ProcStats,
    fd_diff,
    fd_table,
    fds_settled,
    log_problems,
    metric,
    port_names,
    proc_stats,
    spawning_wslb,
    start_ready,
)

HOST = "127.0.0.1"
HANDSHAKE_IO_TIMEOUT = 10.0


# -- statistics ------------------------------------------------------------------------------


@dataclass
class Latency:
    """Handshake latencies of one measurement (milliseconds) and its failures by kind."""

    name: str
    samples_ms: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    wslb_cpu_pct: float = 0.0

    def figures(self) -> dict[str, float]:
        return summary(self.samples_ms, (50, 90, 99))

    def line(self) -> str:
        f = self.figures()
        fails = ", ".join(f"{k} x{v}" for k, v in sorted(self.failures.items())) or "none"
        return (
            f"{self.name:<10} n={int(f['n']):<4} p50 {f['p50']:6.2f}  p90 {f['p90']:6.2f}  "
            f"p99 {f['p99']:6.2f}  max {f['max']:7.2f} ms   failures: {fails}   "
            f"wslb cpu {self.wslb_cpu_pct:.0f}%"
        )


# -- normal clients --------------------------------------------------------------------------


def ws_key() -> str:
    return base64.b64encode(os.urandom(16)).decode()


def upgrade_request(path: str, port: int) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {ws_key()}\r\n"
        "Sec-WebSocket-Version: 13\r\n"
        "\r\n"
    ).encode()


def close_frame(code: int = 1000) -> bytes:
    """A masked client close frame."""
    mask = os.urandom(4)
    payload = code.to_bytes(2, "big")
    return (
        bytes([0x88, 0x80 | len(payload)])
        + mask
        + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    )


async def handshake(port: int, sid: str) -> float:
    """One WebSocket handshake through wslb: seconds from connect to the end of the 101.

    Raises ``HandshakeFailed`` (with a kind) for anything but a 101.
    """
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        raise HandshakeFailed(f"connect: {type(exc).__name__}") from None
    try:
        writer.write(upgrade_request(f"/?session={sid}", port))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise HandshakeFailed("closed before response") from None
        except OSError as exc:
            raise HandshakeFailed(f"read: {type(exc).__name__}") from None
        elapsed = time.perf_counter() - t0
        status = head.split(b" ", 2)[1].decode(errors="replace") if b" " in head else "?"
        if status != "101":
            raise HandshakeFailed(f"http {status}")
        with contextlib.suppress(OSError):
            writer.write(close_frame())
        return elapsed
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class HandshakeFailed(Exception):
    pass


async def measure(name: str, wslb: Wslb, rate: float, seconds: float, concurrency: int) -> Latency:
    """Handshakes at ``rate``/s for ``seconds`` (at most ``concurrency`` in flight)."""
    out = Latency(name)
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    prefix = f"{name}-{os.getpid()}-{random.randrange(1 << 30):x}"

    async def one(i: int) -> None:
        async with sem:
            try:
                latency = await asyncio.wait_for(
                    handshake(wslb.port, f"{prefix}-{i}"), HANDSHAKE_IO_TIMEOUT
                )
            except HandshakeFailed as exc:
                out.failures[str(exc)] += 1
            except TimeoutError:
                out.failures["timeout"] += 1
            else:
                out.samples_ms.append(latency * 1e3)

    n = max(1, round(rate * seconds))
    cpu0, t0 = process_cpu_seconds(wslb.pid), loop.time()
    tasks: list[asyncio.Task[None]] = []
    for i in range(n):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    out.seconds = loop.time() - t0
    out.wslb_cpu_pct = 100.0 * (process_cpu_seconds(wslb.pid) - cpu0) / max(out.seconds, 1e-9)
    return out


# -- the attacker (a child process: ``--attacker``) ------------------------------------------


@dataclass
class AttackReport:
    """What the attacker saw; printed as one JSON line when it ends."""

    target: int = 0
    opened: int = 0
    connect_failures: Counter[str] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)  # how wslb ended each connection
    lifetimes_s: list[float] = field(default_factory=list)  # connect -> end, ended ones only
    bytes_sent_max: int = 0
    min_open_while_held: int = 0
    still_open_at_check: int = 0  # after the stop, one handshake timeout + margin later
    check_after_s: float = 0.0

    def summary(self, timeout: float, margin: float) -> dict[str, Any]:
        lt = self.lifetimes_s
        return {
            "target": self.target,
            "opened": self.opened,
            "connect_failures": dict(self.connect_failures),
            "ended": dict(self.ended),
            "lifetime_s": {
                "min": min(lt) if lt else math.nan,
                "p50": pct(lt, 50),
                "p99": pct(lt, 99),
                "max": max(lt) if lt else math.nan,
            },
            "outlived_timeout_plus_margin": sum(1 for x in lt if x > timeout + margin),
            "bytes_sent_max": self.bytes_sent_max,
            "min_open_while_held": self.min_open_while_held,
            "still_open_at_check": self.still_open_at_check,
            "check_after_s": self.check_after_s,
        }


class Attacker:
    """``target`` trickling connections, each replaced when wslb ends it, until ``stop``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report = AttackReport(target=args.slow)
        self.open = 0
        self.replace = True
        self.live: set[asyncio.Task[None]] = set()
        self.opened_at: dict[asyncio.Task[None], float] = {}
        self.seq = 0
        self.held = False

    def head(self, idx: int) -> bytes:
        """A request head that never ends (headers without the final blank line)."""
        first = upgrade_request(f"/?session=slow-{idx}", self.args.port)[:-2]
        return first + b"".join(f"X-Slow-{i}: {'a' * 40}\r\n".encode() for i in range(400))

    async def one(self, idx: int) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        sources = args.source_addrs.split(",") if args.source_addrs else [""]
        source = sources[idx % len(sources)]
        try:
            reader, writer = await asyncio.open_connection(
                HOST, args.port, local_addr=(source, 0) if source else None
            )
        except OSError as exc:
            self.report.connect_failures[type(exc).__name__] += 1
            await asyncio.sleep(0.2)
            return
        task = asyncio.current_task()
        assert task is not None
        t0 = loop.time()
        self.opened_at[task] = t0
        self.open += 1
        self.report.opened += 1
        head = self.head(idx)
        sent = 0
        outcome = "open"
        read = asyncio.ensure_future(reader.read(4096))
        try:
            # The first byte at a random point of the first interval, so writes are spread.
            wait = random.uniform(0, args.interval_max)
            while True:
                done, _ = await asyncio.wait({read}, timeout=wait)
                if done:
                    break
                if sent < len(head):
                    with contextlib.suppress(OSError, RuntimeError):
                        writer.write(head[sent : sent + args.chunk])
                    sent += args.chunk
                wait = random.uniform(args.interval_min, args.interval_max)
            try:
                data = read.result()
            except OSError:
                outcome = "reset"
            else:
                if not data:
                    outcome = "eof (no response)"
                elif data.startswith(b"HTTP/1.1 "):
                    outcome = f"http {data[9:12].decode(errors='replace')}"
                else:
                    outcome = "other bytes"
            self.report.ended[outcome] += 1
            self.report.lifetimes_s.append(loop.time() - t0)
        finally:
            self.open -= 1
            self.opened_at.pop(task, None)
            self.report.bytes_sent_max = max(self.report.bytes_sent_max, sent)
            if not read.done():
                read.cancel()
            writer.transport.abort()

    async def slot(self) -> None:
        while self.replace:
            self.seq += 1
            task = asyncio.ensure_future(self.one(self.seq))
            self.live.add(task)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                self.live.discard(task)

    async def status(self) -> None:
        while True:
            if self.held:
                self.report.min_open_while_held = min(self.report.min_open_while_held, self.open)
            line = {"open": self.open, "opened": self.report.opened}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        status = asyncio.create_task(self.status())
        slots: list[asyncio.Task[None]] = []
        # Ramp up over ``ramp`` seconds so wslb's cuts (one timeout later) are spread.
        ramp = max(args.ramp, 0.0)
        t0 = loop.time()
        for i in range(args.slow):
            delay = t0 + ramp * i / args.slow - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            slots.append(asyncio.create_task(self.slot()))
        # Commands on stdin: "hold" (start counting the minimum open), "stop" (no replacements).
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = (await reader.readline()).decode().strip()
            if line == "hold":
                self.held = True
                self.report.min_open_while_held = self.open
            elif line in ("stop", ""):
                break
        self.held = False
        self.replace = False
        stop_at = loop.time()
        check_at = stop_at + args.handshake_timeout + args.margin
        # Connections opened before the stop have existed >= timeout + margin by check_at.
        await asyncio.sleep(max(0.0, check_at - loop.time()))
        self.report.still_open_at_check = sum(
            1 for t, at in self.opened_at.items() if at <= stop_at and not t.done()
        )
        self.report.check_after_s = loop.time() - stop_at
        for t in slots:
            t.cancel()
        for t in list(self.live):
            t.cancel()
        await asyncio.gather(*slots, *self.live, return_exceptions=True)
        status.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await status
        out = {"report": self.report.summary(args.handshake_timeout, args.margin)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def attacker_main(args: argparse.Namespace) -> int:
    raise_nofile()
    _set_loop_policy()
    asyncio.run(Attacker(args).run())
    return 0


# -- the run ---------------------------------------------------------------------------------


def _set_loop_policy() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def attack_sources(n: int) -> list[str]:
    """Loopback source addresses of the attacker: 127.0.0.2 .. 127.0.0.(n+1); none for 0."""
    return [f"127.0.0.{2 + i}" for i in range(n)]


class AttackerProc:
    """The attacker child, driven through its stdin; its status lines read from stdout."""

    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--attacker",
            "--port", str(port),
            "--slow", str(args.slow),
            "--chunk", str(args.chunk),
            "--interval-min", str(args.interval_min),
            "--interval-max", str(args.interval_max),
            "--handshake-timeout", str(args.handshake_timeout),
            "--margin", str(args.margin),
            "--ramp", str(args.handshake_timeout),
            "--source-addrs", ",".join(attack_sources(args.sources)),
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None
        self.open = 0
        self.report: dict[str, Any] | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            if "report" in msg:
                self.report = msg["report"]
            else:
                self.open = int(msg["open"])

    async def send(self, command: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()

    async def wait_open(self, n: int, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while self.open < n:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def finish(self, timeout: float) -> dict[str, Any] | None:
        await self.send("stop")
        assert self.proc is not None and self._reader is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
            await asyncio.wait_for(self.proc.wait(), 5)
        return self.report

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._reader is not None:
            self._reader.cancel()


def fmt_stats(s: ProcStats) -> str:
    tasks = f"tasks {s.tasks}" if s.tasks is not None else f"threads {s.threads} (no /debug/stats)"
    return f"rss {s.rss_mb:.1f} MB, fds {s.fds}, {tasks}, connections {s.connections}"


async def run(args: argparse.Namespace, wslb: Wslb) -> dict[str, Any]:
    res: dict[str, Any] = {}
    say = print
    # Warm up (imports, first upstream connections, the admin's HTTP pool to the workers), let
    # it settle, then the baseline and the unloaded figure.
    await measure("warmup", wslb, args.rate, 5.0, args.concurrency)
    await asyncio.sleep(2.0)
    before = proc_stats(wslb)
    fds_before = fd_table(wslb.pid, port_names(wslb))
    say(f"wslb before:       {fmt_stats(before)}")
    unloaded = await measure("unloaded", wslb, args.rate, args.measure, args.concurrency)
    say(unloaded.line())

    attacker = AttackerProc(args, wslb.port)
    await attacker.start()
    try:
        ok = await attacker.wait_open(int(args.slow * 0.98), args.handshake_timeout + 20)
        if not ok:
            say(f"warning: only {attacker.open} of {args.slow} trickling connections open")
        await attacker.send("hold")
        during = proc_stats(wslb)
        say(f"attack: {attacker.open} trickling connections open")
        say(f"wslb under attack: {fmt_stats(during)}")
        loaded = await measure("loaded", wslb, args.rate, args.measure, args.concurrency)
        say(loaded.line())
        during2 = proc_stats(wslb)
        say(f"wslb under attack: {fmt_stats(during2)}")
        report = await attacker.finish(args.handshake_timeout + args.margin + 30)
    finally:
        attacker.kill()
    if report is None:
        raise RuntimeError("the attacker gave no report")

    await asyncio.sleep(1.0)  # closes in flight
    recovered = await measure("recovered", wslb, args.rate, args.measure / 2, args.concurrency)
    say(recovered.line())
    await asyncio.sleep(1.0)
    after = proc_stats(wslb)
    fds_after = fd_table(wslb.pid, port_names(wslb))
    say(f"wslb after:        {fmt_stats(after)}")

    u99 = unloaded.figures()["p99"]
    l99 = loaded.figures()["p99"]
    r99 = recovered.figures()["p99"]
    ratio = l99 / u99 if u99 > 0 else math.inf
    strict = l99 / min(u99, r99) if min(u99, r99) > 0 else math.inf
    target_ok = ratio <= args.target and not loaded.failures
    say("")
    say(
        f"handshake p99: unloaded {u99:.2f} ms, loaded {l99:.2f} ms -> {ratio:.2f}x "
        f"(target <= {args.target:g}x{'' if not loaded.failures else ', no failures'}): "
        f"{'OK' if target_ok else 'MISSED'}; against the lower of unloaded and recovered "
        f"({min(u99, r99):.2f} ms): {strict:.2f}x"
    )
    lt = report["lifetime_s"]
    ended = ", ".join(f"{k} x{v}" for k, v in sorted(report["ended"].items()))
    say(
        f"trickling connections: {report['opened']} opened (target {report['target']} at once; "
        f"min {report['min_open_while_held']} open during the loaded measurement), "
        f"connect failures {report['connect_failures'] or 0}"
    )
    say(f"  ended by wslb: {ended}")
    say(
        f"  lifetime s: min {lt['min']:.2f} p50 {lt['p50']:.2f} p99 {lt['p99']:.2f} "
        f"max {lt['max']:.2f}; most bytes sent by one: {report['bytes_sent_max']}"
    )
    cut_ok = report["still_open_at_check"] == 0 and report["outlived_timeout_plus_margin"] == 0
    say(
        f"  outlived handshake timeout ({args.handshake_timeout:g} s) + {args.margin:g} s: "
        f"{report['outlived_timeout_plus_margin']}; still open {report['check_after_s']:.1f} s "
        f"after the last was opened: {report['still_open_at_check']}: "
        f"{'OK' if cut_ok else 'MISSED'}"
    )
    rej408 = metric(wslb, "wslb_handshake_rejections_total", '{status="408"}')
    say(f'  wslb_handshake_rejections_total{{status="408"}}: {rej408}')
    fd_ok = fds_settled(fds_before, fds_after, args.workers) and (after.connections or 0) == 0
    say(
        f"wslb FDs before {before.fds}, under attack {during.fds}, after {after.fds}; "
        f"connections after {after.connections}: {'OK' if fd_ok else 'CHECK'}"
    )
    if after.fds != before.fds:
        say(f"  FD change by kind: {fd_diff(fds_before, fds_after)}")
        say(
            f"  (idle sockets to a worker are wslb's pooled HTTP connections for scrapes and "
            f"health checks, at most {HTTP_POOL_PER_WORKER} per worker)"
        )
    res.update(
        {
            "fds_before": dict(fds_before),
            "fds_after": dict(fds_after),
            "unloaded": unloaded.figures() | {"failures": dict(unloaded.failures)},
            "loaded": loaded.figures() | {"failures": dict(loaded.failures)},
            "recovered": recovered.figures() | {"failures": dict(recovered.failures)},
            "wslb_cpu_pct": {
                "unloaded": unloaded.wslb_cpu_pct,
                "loaded": loaded.wslb_cpu_pct,
            },
            "ratio_p99": ratio,
            "ratio_p99_strict": strict,
            "target": args.target,
            "target_ok": target_ok,
            "attack": report,
            "cut_ok": cut_ok,
            "rejections_408": rej408,
            "wslb": {
                "before": asdict(before),
                "during": asdict(during),
                "during_end": asdict(during2),
                "after": asdict(after),
            },
            "fd_ok": fd_ok,
        }
    )
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Slowloris run against wslb: normal clients' handshake latency while "
        "--slow connections trickle their request heads (see the module docstring)."
    )
    add = p.add_argument
    add("--slow", type=int, default=1000, help="trickling connections (default: %(default)s)")
    add("--chunk", type=int, default=1, help="bytes per trickle write (default: %(default)s)")
    add("--interval-min", type=float, default=1.0, help="seconds between writes, min (1.0)")
    add("--interval-max", type=float, default=2.0, help="seconds between writes, max (2.0)")
    add(
        "--handshake-timeout",
        type=float,
        default=5.0,
        help="wslb's timeouts.handshake in seconds (default: %(default)s)",
    )
    add("--margin", type=float, default=1.0, help="grace after the timeout (default: 1.0 s)")
    add("--workers", type=int, default=3, help="reference workers (default: %(default)s)")
    add("--rate", type=float, default=40.0, help="normal handshakes/s (default: %(default)s)")
    add("--measure", type=float, default=12.0, help="seconds per measurement (default: 12)")
    add("--concurrency", type=int, default=8, help="normal handshakes in flight, at most (8)")
    add("--target", type=float, default=2.0, help="p99 loaded/unloaded target (default: 2)")
    add("--json", action="store_true", help="print the result as JSON at the end")
    add("--logdir", default="", help="keep wslb's config and log here (default: a temp dir)")
    add(
        "--sources",
        type=int,
        default=4,
        help="loopback source addresses the trickling connections come from, 127.0.0.2 and "
        "up, so wslb's per-address limit (limits.max_connections_per_client) does not cap "
        "them and normal clients (127.0.0.1) are not refused with 429; 0: all from 127.0.0.1 "
        "(default: %(default)s)",
    )
    add(
        "--per-client",
        type=int,
        default=None,
        help="set wslb's limits.max_connections_per_client (default: wslb's own default)",
    )
    add("--attacker", action="store_true", help=argparse.SUPPRESS)
    add("--port", type=int, default=0, help=argparse.SUPPRESS)
    add("--source-addrs", default="", help=argparse.SUPPRESS)
    add("--ramp", type=float, default=5.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attacker:
        return attacker_main(args)

    soft, hard = raise_nofile()
    print(f"slowloris run, {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}: {machine_line()}")
    print(
        f"wslb + {args.workers} spawned reference workers on {HOST}; timeouts.handshake "
        f"{args.handshake_timeout:g}s; RLIMIT_NOFILE {soft}/{hard} (inherited by wslb); "
        f"{args.slow} trickling connections, {args.chunk} B every "
        f"{args.interval_min:g}-{args.interval_max:g} s; normal clients {args.rate:g}/s for "
        f"{args.measure:g} s, <= {args.concurrency} in flight"
    )
    need = args.slow + 2 * args.concurrency + 200
    if soft < need:
        print(f"warning: RLIMIT_NOFILE {soft} < {need}: wslb or the attacker may run out of FDs")

    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    _set_loop_policy()
    with contextlib.ExitStack() as stack:
        if args.logdir:
            tmp = args.logdir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="wslb-slowloris-"))
        procs = stack.enter_context(Procs(Path(tmp), term_timeout=15.0))
        wslb = spawning_wslb(procs, args.workers, args.handshake_timeout, 50, args.per_client)
        try:
            start_ready(wslb)
            print(f"wslb pid {wslb.pid}, workers {sorted(p.pid for p in wslb.children())}")
            result = asyncio.run(run(args, wslb))
            problems = log_problems(wslb.output())
            for msg, n in problems.most_common(8):
                print(f"wslb log: {n} x {msg}")
            result["wslb_log_problems"] = dict(problems)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0 if result["target_ok"] and result["cut_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
