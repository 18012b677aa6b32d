#!/usr/bin/env python3
"""A burst of ``wss://`` connects at once, through nginx, HAProxy and wslb in the same run.

Every client of an instance reconnecting at once (a rollout) is a burst of TLS handshakes. For
each burst size in ``--bursts``, ``--repeat`` times, for each proxy in turn (the order rotated
every round): ``--procs`` client processes (default one: a single asyncio process is where a
handshake convoy shows) dial their share of the burst at once, each session then streams
``--rate`` tokens/s for ``--stream`` seconds after the burst's last answer. Per proxy: how many
were upgraded (``101``), refused (by status), timed out (the client's ``--timeout`` for the
connect, the TLS handshake and the 101), reset or closed, and the time from the go to the last
``101``; medians and spreads over the rounds. For wslb also its own count of handshakes it
aborted at its handshake timeout (``wslb_tls_handshake_failures_total{reason="timeout"}``), and
how many streaming sessions were lost after their 101.

The proxies are ``bench/lib/proxies.py``'s; their configs (TLS termination with one
certificate, ``--tls-key``), the raw workers and the raw uvloop clients are
``bench/proxies.py``'s (``--wslb-variant NAME=PATH`` runs another wslb source tree beside,
e.g. the code before a change). nginx and HAProxy come
from Debian. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.launch import Procs, free_port, wait_port  # noqa: E402
from bench.lib.load import ClientProc  # noqa: E402
from bench.lib.machine import loadavg, machine_line  # noqa: E402
from bench.lib.proxies import (  # noqa: E402
    TARGETS,
    Proxy,
    Wslb,
    ensure_installed,
    outcome,
    wslb_variant,
)
from bench.lib.rawws import (  # noqa: E402
    ClientConn,
    ClientStats,
    client_context,
    dial,
    make_tls,
    run_uvloop,
    upgrade_request,
)
from bench.lib.script import log, raise_nofile, require_modules, sigterm_as_interrupt  # noqa: E402

# -- the client (its own process) ----------------------------------------------------------------


async def _client(spec: dict[str, Any]) -> None:
    """At its parent's ``go``: ``n`` TLS sessions dialled at once, each asking its worker for
    ``rate`` tokens/s as soon as it has its 101; once every dial has ended, ``stream`` s more,
    then one JSON line (outcomes, ms from the go to each 101, frames, sessions lost after
    their 101); then it holds on until its parent closes stdin."""
    loop = asyncio.get_running_loop()
    host, port, path = spec["target"]
    n, n_src, timeout = int(spec["n"]), int(spec["sources"]), float(spec["timeout"])
    tls = client_context(spec["ca"])
    st = ClientStats()
    keep: list[ClientConn] = []
    outcomes: dict[str, int] = {}
    errors: list[str] = []
    lat: list[float] = []

    async def one(i: int, t0: float) -> None:
        src = f"127.0.0.{2 + i % n_src}" if n_src else "127.0.0.1"
        request = upgrade_request(host, port, f"{path}?session=tb-{spec['prefix']}-{i}")
        try:
            proto = await dial(
                loop,
                src,
                (host, port),
                lambda: ClientConn(st, request, float(spec["rate"])),
                (timeout, timeout),
                tls,
            )
        except (OSError, TimeoutError, ConnectionError) as exc:
            kind = outcome(exc)
            if kind == "http":  # "HTTP/1.1 503 Service Unavailable": refused, with its status
                kind = "refused " + str(exc).split()[1] if len(str(exc).split()) > 1 else kind
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if len(errors) < 5:
                errors.append(f"{i}: {exc!r}"[:160])
            return
        lat.append((time.monotonic() - t0) * 1000)
        outcomes["101"] = outcomes.get("101", 0) + 1
        keep.append(proto)
        st.open += 1
        proto.go()

    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    print("ready", flush=True)
    await stdin.readline()
    t0 = time.monotonic()
    await asyncio.gather(*(one(i, t0) for i in range(n)))
    recv0 = st.recv
    await asyncio.sleep(float(spec["stream"]))
    out = {
        "outcomes": outcomes,
        "lat_ms": [round(x, 1) for x in lat],
        "frames": st.recv - recv0,
        "lost": st.closed,
        "errors": errors + st.errors[:3],
    }
    print(json.dumps(out), flush=True)
    await stdin.read()
    os._exit(0)


# -- the parent ------------------------------------------------------------------------------------


@dataclass
class Round:
    """One burst through one proxy."""

    n: int
    outcomes: dict[str, int]
    last_101_ms: float
    p50_101_ms: float
    frames_per_s: float  # over the stream seconds after the burst
    lost: int  # sessions lost after their 101
    server_timeouts: float  # wslb's handshake timeouts in this burst; nan for the others
    errors: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(v for k, v in self.outcomes.items() if k.startswith(kind))


def wslb_handshake_timeouts(proxy: Proxy) -> float:
    """wslb's ``wslb_tls_handshake_failures_total{reason="timeout"}`` from its admin API (its
    address and token from the config the launcher wrote); nan for another proxy."""
    if not isinstance(proxy, Wslb) or proxy.logdir is None:
        return float("nan")
    cfg = yaml.safe_load((proxy.logdir / f"{proxy.kind}.yaml").read_text())
    req = urllib.request.Request(
        f"http://{cfg['admin']['listen']}/metrics",
        headers={"Authorization": f"Bearer {cfg['admin']['token']}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith('wslb_tls_handshake_failures_total{reason="timeout"}'):
            return float(line.split()[-1])
    return 0.0


def burst(procs: Procs, proxy: Proxy, n: int, args: argparse.Namespace, tag: str) -> Round:
    assert proxy.tls is not None
    k = args.procs
    before = wslb_handshake_timeouts(proxy)
    clients = []
    for c in range(k):
        spec = {
            "target": ["127.0.0.1", proxy.port, "/ws"],
            "n": n // k + (1 if c < n % k else 0),
            "sources": args.sources,
            "timeout": args.timeout,
            "rate": args.rate,
            "stream": args.stream,
            "ca": str(proxy.tls.ca),
            "prefix": f"{tag}-{c}",
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--client-spec", json.dumps(spec)]
        proc = procs.spawn(f"{tag}-{c}", cmd, pipes=True, term_timeout=0)
        clients.append(ClientProc(proc, 0))
    for client in clients:
        if (line := client.readline(30)) != "ready":
            raise RuntimeError(f"{tag} client said {line!r}")
    for client in clients:
        client.send("go")
    wait = 3 * args.timeout + args.stream + 60
    outs = [json.loads(client.readline(wait)) for client in clients]
    outcomes: dict[str, int] = {}
    for o in outs:
        for key, v in o["outcomes"].items():
            outcomes[key] = outcomes.get(key, 0) + v
    lat = sorted(x for o in outs for x in o["lat_ms"])
    for client in clients:  # end of input ends the process, and its sessions with it
        if client.proc.stdin is not None:
            with contextlib.suppress(OSError):
                client.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            client.proc.wait(30)
    after = wslb_handshake_timeouts(proxy)  # once the streams are gone: its loop answers
    return Round(
        n=n,
        outcomes=outcomes,
        last_101_ms=lat[-1] if lat else float("nan"),
        p50_101_ms=lat[len(lat) // 2] if lat else float("nan"),
        frames_per_s=sum(o["frames"] for o in outs) / args.stream,
        lost=sum(o["lost"] for o in outs),
        server_timeouts=after - before,
        errors=[e for o in outs for e in o["errors"]][:4],
    )


def med(xs: Sequence[float]) -> str:
    """Median, and the range when the rounds differ: ``500 (480-500)``."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    m, lo, hi = statistics.median(xs), min(xs), max(xs)
    return f"{m:,.0f}" if lo == hi else f"{m:,.0f} ({lo:,.0f}-{hi:,.0f})"


def report(results: dict[tuple[str, int], list[Round]], labels: list[str]) -> str:
    sizes = sorted({n for _, n in results})
    head = "| burst | " + " | ".join(labels) + " |"
    out = [head, "|" + "---|" * (len(labels) + 1)]

    rows: list[tuple[str, Any]] = [
        ("upgraded (101)", lambda r: r.count("101")),
        ("refused (any status)", lambda r: r.count("refused") + r.count("http")),
        ("timed out (client)", lambda r: r.count("timeout")),
        ("reset or closed", lambda r: r.count("reset") + r.count("closed")),
        ("other failures", lambda r: r.count("tls") + r.count("error")),
        ("time to the last 101, ms", lambda r: r.last_101_ms),
        ("time to the median 101, ms", lambda r: r.p50_101_ms),
        ("wslb handshake timeouts", lambda r: r.server_timeouts),
        ("frames/s after the burst", lambda r: r.frames_per_s),
        ("sessions lost after 101", lambda r: r.lost),
    ]
    for n in sizes:
        for name, fn in rows:
            cells = [med([fn(r) for r in results.get((lbl, n), [])]) for lbl in labels]
            out.append(f"| {n:,}: {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="bursts of wss:// connects at once through nginx, HAProxy and wslb",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--bursts", default="500,5000", help="comma-separated burst sizes")
    p.add_argument("--procs", type=int, default=1, help="client processes per burst")
    p.add_argument("--repeat", type=int, default=3, help="rounds per burst size")
    p.add_argument("--targets", default="nginx,haproxy,wslb", help="comma-separated proxies")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per session after its 101")
    p.add_argument("--stream", type=float, default=3.0, help="s of streaming after the burst")
    p.add_argument("--timeout", type=float, default=30.0, help="client s for connect, TLS, 101")
    p.add_argument("--workers", type=int, default=2, help="raw worker processes")
    p.add_argument("--sources", type=int, default=50, help="client source addresses 127.0.0.x")
    p.add_argument("--tls-key", choices=("ecdsa", "rsa"), default="ecdsa", help="P-256 or 2048")
    p.add_argument(
        "--wslb-variant",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run wslb from the source tree PATH, labelled wslb-NAME (e.g. before a fix)",
    )
    p.add_argument("--logs", default=None, help="keep the processes' logs and configs here")
    p.add_argument("--json", default=None, help="write every round as JSON here")
    p.add_argument("--client-spec", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client_spec is not None:
        return run_uvloop(_client, args.client_spec)
    import signal

    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    require_modules(["trustme"], "tlsburst")
    sizes = [int(x) for x in args.bursts.split(",") if x.strip()]
    targets: dict[str, type[Proxy]] = {}
    for name in (x.strip() for x in args.targets.split(",") if x.strip()):
        if name not in TARGETS or name in ("direct", "wslb-loop"):
            raise SystemExit(f"--targets: {name!r} is not one of nginx, haproxy, wslb")
        targets[name] = TARGETS[name]
    for v in args.wslb_variant:
        name, _, src = v.partition("=")
        targets[f"wslb-{name}"] = wslb_variant(name, Path(src).resolve())
    ensure_installed()
    soft = raise_nofile(3 * max(sizes) + 10000)[0]
    log(f"RLIMIT_NOFILE {soft}; {machine_line()}; load {loadavg()}")
    results: dict[tuple[str, int], list[Round]] = {}
    labels: list[str] = []
    with contextlib.ExitStack() as stack:
        root = Path(args.logs) if args.logs else None
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wslb-tlsb-")))
        root.mkdir(parents=True, exist_ok=True)
        procs = stack.enter_context(Procs(root))
        tls = make_tls(root / "tls", args.tls_key)
        try:
            backends = []
            for i in range(args.workers):  # bench/proxies.py's raw worker
                port = free_port()
                spec = json.dumps({"port": port})
                cmd = [sys.executable, str(ROOT / "bench" / "proxies.py"), "--worker-spec", spec]
                proc = procs.spawn(f"worker-{i + 1}", cmd)
                wait_port(port, 20.0, proc)
                backends.append(f"ws://127.0.0.1:{port}/ws")
            proxies = []
            for cls in targets.values():
                proxy = cls(tls=tls)
                proxy.start(procs, backends)
                proxies.append(proxy)
            labels = [p.label for p in proxies]
            for n in sizes:
                for r in range(args.repeat):
                    k = r % len(proxies)
                    for proxy in proxies[k:] + proxies[:k]:
                        tag = f"b{n}-{r}-{proxy.label}"
                        res = burst(procs, proxy, n, args, tag)
                        results.setdefault((proxy.label, n), []).append(res)
                        log(
                            f"[{n} {r + 1}/{args.repeat}] {proxy.label}: {res.outcomes}, last "
                            f"101 {res.last_101_ms:,.0f} ms, wslb timeouts {res.server_timeouts}, "
                            f"{res.frames_per_s:,.0f} frames/s"
                            + (f"; {res.errors[:2]}" if res.errors else "")
                        )
                        time.sleep(2.0)  # the sessions' sockets close before the next burst
        except KeyboardInterrupt:
            log("interrupted")
            return 130
    print(f"{machine_line()}; {args.procs} client process(es), {args.tls_key} certificate, ")
    print(f"{args.rate:g} tokens/s per session, medians (range) of {args.repeat} rounds")
    print()
    print(report(results, labels))
    if args.json:
        rounds = {f"{lbl} {n}": [r.__dict__ for r in rs] for (lbl, n), rs in results.items()}
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
