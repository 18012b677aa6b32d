#!/usr/bin/env python3
"""Plain HTTP through wslb beside nginx and HAProxy in the same run (SPEC section 16).

One worker process serves every proxy: a raw uvloop HTTP/1.1 server (no framework, so the proxy,
not the worker, spends the CPU) with two routes, ``GET /json`` (a 60-byte JSON answer,
``Content-Length``) and ``GET /sse?n=N&gap=MS`` (``N`` server-sent events ``MS`` ms apart,
chunked, each stamped with the worker's ``time.monotonic_ns()``; CLOCK_MONOTONIC is system-wide).
For each of direct, nginx (``proxy_http_version 1.1``, upstream ``keepalive``,
``proxy_buffering off``), HAProxy (``mode http``, ``http-reuse safe``) and wslb (defaults, access
log on), each single-process, on 127.0.0.0/8 only:

- **json**: ``--conns`` kept-alive client connections, each sending its next request when the
  answer is in (closed loop), for ``--duration`` s: requests/s, p50/p99 latency, and the
  proxy's CPU microseconds per request (utime + stime of its processes, /proc);
- **sse**: ``--streams`` concurrent SSE requests of ``--events`` events ``--gap`` ms apart:
  p50/p99 of each event's latency (the client's read minus the worker's stamp), direct's
  subtracted for the added latency, and the proxy's CPU per event.

Medians over ``--repeat`` windows; the machine line and its load go with the figures. The load
generator runs in one process of its own (uvloop, raw sockets, answers parsed by
``Content-Length``/chunk size). Not a test: it prints figures. ``--quick``: a short smoke run.
"""

# ruff: noqa: E402 (the sys.path set-up comes before the project imports)
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.cpu import cpu_seconds
from bench.lib.launch import Procs, free_port, wait_port
from bench.lib.launch import Wslb as WslbProcess
from bench.lib.machine import loadavg, machine_line
from bench.lib.stats import summary

JSON_BODY = b'{"id":"cmpl-1","object":"model","owned_by":"bench","ok":true}'


# -- the worker ----------------------------------------------------------------------------------


class _WorkerConn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            target = head.split(b" ", 2)[1]
            if target.startswith(b"/sse"):
                asyncio.get_running_loop().create_task(self._sse(target))
            elif target.startswith(b"/json"):
                assert self.t is not None
                self.t.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(JSON_BODY)).encode()
                    + b"\r\n\r\n"
                    + JSON_BODY
                )
            else:
                assert self.t is not None
                self.t.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")

    async def _sse(self, target: bytes) -> None:
        q = dict(p.split(b"=") for p in target.partition(b"?")[2].split(b"&") if b"=" in p)
        n, gap = int(q.get(b"n", b"10")), int(q.get(b"gap", b"20")) / 1000
        t = self.t
        assert t is not None
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(n):
            await asyncio.sleep(gap)
            ev = b"data: %d\n\n" % time.monotonic_ns()
            t.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        t.write(b"0\r\n\r\n")


def worker_main(port: int) -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            _WorkerConn, "127.0.0.1", port, backlog=4096
        )
        await server.serve_forever()

    uvloop.run(main())


# -- the proxies ---------------------------------------------------------------------------------


def nginx_conf(d: Path, port: int, worker: int) -> str:
    return f"""
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log {d}/access.log;
  upstream w {{ server 127.0.0.1:{worker}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 100000;
    location / {{
      proxy_pass http://w;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_buffering off;
    }}
  }}
}}
"""


def haproxy_conf(port: int, worker: int) -> str:
    return f"""
global
  maxconn 8000
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  option http-keep-alive
  option http-no-delay
  http-reuse safe
frontend f
  bind 127.0.0.1:{port}
  option forwardfor
  default_backend b
backend b
  server w 127.0.0.1:{worker}
"""


def proxy_exe(kind: str) -> str:
    """nginx's or HAProxy's binary: on PATH, else where Debian puts it."""
    return shutil.which(kind) or f"/usr/sbin/{kind}"


def start_proxy(kind: str, procs: Procs, worker: int) -> tuple[int, list[int]]:
    """Start ``kind`` in front of the worker; its port and the pids to measure."""
    if kind == "direct":
        return worker, []
    if kind == "wslb":
        cfg = {
            "pools": [
                {
                    "name": "p",
                    "backends": [{"id": "w", "url": f"ws://127.0.0.1:{worker}"}],
                    "weights": {"scrape_interval": "60s"},
                }
            ],
            "limits": {"max_connections": 20000},
        }
        lb = WslbProcess(cfg, procs.logdir, procs=procs, token=secrets.token_urlsafe(24))
        lb.start()
        return lb.port, [lb.pid]
    port = free_port()
    if kind == "nginx":
        d = procs.logdir / "nginx"
        d.mkdir(exist_ok=True)
        (d / "nginx.conf").write_text(nginx_conf(d, port, worker))
        exe = proxy_exe("nginx")
        proc = procs.spawn(
            "nginx", [exe, "-p", f"{d}/", "-c", f"{d}/nginx.conf", "-e", f"{d}/e.log"]
        )
    else:
        path = procs.logdir / "haproxy.cfg"
        path.write_text(haproxy_conf(port, worker))
        exe = proxy_exe("haproxy")
        proc = procs.spawn("haproxy", [exe, "-db", "-f", str(path)])
    wait_port(port, proc=proc)
    return port, [proc.pid]


# -- the load generator (its own process) --------------------------------------------------------


async def _json_conn(port: int, until: float, lat: list[float], key: bool) -> int:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    req = b"GET /json HTTP/1.1\r\nHost: bench"
    if key:  # an SDK's X-Session-Id, one per connection
        req += b"\r\nX-Session-Id: k" + secrets.token_hex(4).encode()
    req += b"\r\n\r\n"
    n = 0
    try:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            w.write(req)
            head = await r.readuntil(b"\r\n\r\n")
            i = head.lower().find(b"content-length:")
            length = int(head[i + 15 : head.index(b"\r\n", i)])
            await r.readexactly(length)
            lat.append(time.perf_counter() - t0)
            n += 1
    finally:
        w.close()
    return n


async def _sse_conn(port: int, events: int, gap_ms: int, lat: list[float]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /sse?n=%d&gap=%d HTTP/1.1\r\nHost: bench\r\n\r\n" % (events, gap_ms))
    await r.readuntil(b"\r\n\r\n")
    try:
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                break
            chunk = await r.readexactly(size + 2)
            now = time.monotonic_ns()
            for line in chunk.split(b"\n"):
                if line.startswith(b"data: "):
                    lat.append((now - int(line[6:])) / 1e9)
    finally:
        w.close()


def load_main(spec: dict[str, Any], out: Any) -> None:
    import uvloop

    async def main() -> dict[str, Any]:
        lat: list[float] = []
        t0 = time.monotonic()
        if spec["phase"] == "json":
            until = t0 + spec["duration"]
            counts = await asyncio.gather(
                *(_json_conn(spec["port"], until, lat, spec["key"]) for _ in range(spec["conns"]))
            )
            return {"n": sum(counts), "seconds": time.monotonic() - t0, "lat": lat}
        await asyncio.gather(
            *(
                _sse_conn(spec["port"], spec["events"], spec["gap"], lat)
                for _ in range(spec["streams"])
            )
        )
        return {"n": len(lat), "seconds": time.monotonic() - t0, "lat": lat}

    out.send(uvloop.run(main()))


def run_load(spec: dict[str, Any]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=load_main, args=(spec, b))
    p.start()
    result: dict[str, Any] = a.recv()
    p.join()
    return result


def window(spec: dict[str, Any], pids: Sequence[int]) -> dict[str, float]:
    c0 = cpu_seconds(pids)
    res = run_load(spec)
    cpu = cpu_seconds(pids) - c0
    s = summary(res["lat"], unit="_ms")
    return {
        "rate": res["n"] / res["seconds"],
        "p50_ms": s["p50_ms"] * 1000,
        "p99_ms": s["p99_ms"] * 1000,
        "cpu_us": cpu / max(res["n"], 1) * 1e6 if pids else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--proxies", default="direct,nginx,haproxy,wslb")
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--gap", type=int, default=20, help="ms between SSE events")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--no-key",
        dest="key",
        action="store_false",
        help="json requests without X-Session-Id (wslb routes each one anew, in Python)",
    )
    ap.add_argument("--json", dest="json_out", help="write the figures here too")
    ap.add_argument("--py-spy", dest="py_spy", help="record wslb's first json window here (raw)")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.events, args.streams, args.repeat = 1.5, 30, 20, 1
    kinds = [k for k in args.proxies.split(",") if k]
    for kind in [k for k in kinds if k in ("nginx", "haproxy")]:
        if not Path(proxy_exe(kind)).exists():
            print(f"{kind}: not installed (apt-get install {kind}), skipped", file=sys.stderr)
            kinds.remove(kind)
    print(machine_line())
    print(f"load before: {loadavg()}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="wslb-http-") as tmp, Procs(Path(tmp)) as procs:
        wport = free_port()
        ctx = multiprocessing.get_context("spawn")
        worker = ctx.Process(target=worker_main, args=(wport,), daemon=True)
        worker.start()
        procs.on_close(worker.kill)
        wait_port(wport)
        for kind in kinds:
            port, pids = start_proxy(kind, procs, wport)
            json_spec = {"phase": "json", "port": port, "conns": args.conns, "key": args.key}
            run_load({**json_spec, "duration": 0.5})  # warm-up, with the measured requests
            runs: dict[str, list[dict[str, float]]] = {"json": [], "sse": []}
            for i in range(args.repeat):
                spy = None
                if args.py_spy and kind == "wslb" and i == 0:
                    spy = subprocess.Popen(
                        ["py-spy", "record", "-p", str(pids[0]), "-d", str(int(args.duration)),
                         "-r", "1000", "-f", "raw", "-o", args.py_spy],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                runs["json"].append(window({**json_spec, "duration": args.duration}, pids))
                if spy is not None:
                    spy.wait()
                spec = {"phase": "sse", "port": port, "streams": args.streams}
                runs["sse"].append(window({**spec, "events": args.events, "gap": args.gap}, pids))
            results[kind] = {
                phase: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for phase, rs in runs.items()
            }
            print(f"  {kind}: done", file=sys.stderr)
    print(f"load after: {loadavg()}")
    print(
        f"\njson: {args.conns} kept-alive connections, closed loop, {args.duration:g} s x "
        f"{args.repeat} (medians), "
        + ("an X-Session-Id per connection" if args.key else "no session key")
    )
    print(f"{'proxy':8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11}")
    for kind, r in results.items():
        j = r["json"]
        cpu = f"{j['cpu_us']:.1f}" if kind != "direct" else "-"
        print(f"{kind:8} {j['rate']:9.0f} {j['p50_ms']:8.2f} {j['p99_ms']:8.2f} {cpu:>11}")
    print(
        f"\nsse: {args.streams} streams x {args.events} events, {args.gap} ms apart; event "
        "latency worker write -> client read"
    )
    base = results.get("direct", {}).get("sse")
    print(
        f"{'proxy':8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'CPU us/ev':>10}"
    )
    for kind, r in results.items():
        s = r["sse"]
        add50 = s["p50_ms"] - base["p50_ms"] if base else float("nan")
        add99 = s["p99_ms"] - base["p99_ms"] if base else float("nan")
        cpu = f"{s['cpu_us']:.1f}" if kind != "direct" else "-"
        print(f"{kind:8} {s['p50_ms']:8.2f} {s['p99_ms']:8.2f} {add50:8.2f} {add99:8.2f} {cpu:>10}")
    if "nginx" in results and "wslb" in results:
        ratio = results["wslb"]["json"]["cpu_us"] / max(results["nginx"]["json"]["cpu_us"], 1e-9)
        print(f"\nwslb CPU per request / nginx's: {ratio:.2f}x (target <= 1.5x)")
        p99 = results["wslb"]["sse"]["p99_ms"] <= results["nginx"]["sse"]["p99_ms"]
        print(f"wslb SSE event p99 <= nginx's: {'yes' if p99 else 'no'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
