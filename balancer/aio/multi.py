"""``workers: N``: one balancer in N serving processes on one port, run by a supervisor.

The kernel spreads new connections over the N serving processes' listening sockets
(SO_REUSEPORT), so the hot path stays one process's: no lock, no message per frame. What must be
one balancer is kept so by the supervisor, this process:

- **Routing agrees.** Every serving process builds the same ring from the same config. Health and
  scraped signals come from the supervisor alone (it probes and scrapes once, not N times) through
  the board (``balancer/board.py``), and every process publishes its live session counts there,
  so the bounded-load rule sees the balancer's total load, not a 1/N share of it.
- **One admin API.** The supervisor serves ``admin.listen`` and fans requests out to each serving
  process's admin API on a Unix socket: backends and sessions are merged (session counts summed,
  drain progress added up), metrics are summed (counters, histograms and the session/connection
  gauges; per-backend gauges such as weights and health are the supervisor's own), and every
  write (drain, undrain, add/remove backend, reload) reaches every process, so a drain migrates
  the worker's sessions wherever they live. ``wslb ctl`` sees one balancer.
- **Lifecycle.** Spawned reference workers belong to the supervisor, so a serving process that
  crashes takes only its own sessions with it; it is restarted with backoff, its board row is
  cleared, and admin changes made since start (added backends, drains) are replayed into it.
  SIGTERM/SIGINT stop every serving process gracefully (a second signal hurries them), SIGHUP
  reloads all.

Passive outlier ejection stays per process: each ejects on the failures it sees itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from balancer import logs
from balancer.aio.admin import Admin, _error
from balancer.aio.app import Balancer, ProcessLink
from balancer.aio.spawn import Backoff, _die_with_parent, child_env, python_module
from balancer.board import Board
from balancer.config import Config, ConfigError, Listener
from balancer.config import load as load_config
from balancer.pool import ACTIVE, DRAINED, DRAINING, Backend

__all__ = ["Supervisor", "merge_metrics"]

log = logging.getLogger("wslb.multi")

PUBLISH_EVERY = 0.1  # seconds between board updates of health and signals
CHILD_READY_TIMEOUT = 30.0
# Gauges that count things each process holds: summed. Other gauges are the supervisor's own.
ADDITIVE_GAUGES = frozenset({"wslb_sessions_active", "wslb_connections_active"})
# Numeric drain-progress fields that add up over processes.
_DRAIN_SUMS = (
    "sessions_at_start",
    "migrated",
    "migration_failures",
    "closed_after_answer",
    "closed_at_timeout",
    "left",
)


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def merge_metrics(texts: Iterable[str], own: str) -> str:
    """One exposition from the supervisor's (``own``) and its serving processes' metrics.

    Counters and histograms add up over processes, as do ``ADDITIVE_GAUGES``; any other gauge
    (a backend's weight, health, state) is taken from ``own`` only.
    """
    order: list[str] = []
    families: dict[str, tuple[str, str]] = {}  # name -> (type, documentation)
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}

    def add(text: str, is_own: bool) -> None:
        for fam in text_string_to_metric_families(text):
            if fam.name not in families:
                families[fam.name] = (fam.type, fam.documentation)
                order.append(fam.name)
                samples[fam.name] = {}
            summed = fam.type != "gauge" or fam.name in ADDITIVE_GAUGES
            if not (summed or is_own):
                continue
            into = samples[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                into[key] = into.get(key, 0.0) + s.value if summed else s.value

    add(own, True)
    for text in texts:
        add(text, False)
    out: list[str] = []
    for name in order:
        kind, doc = families[name]
        out.append(f"# HELP {name} {_escape(doc)}\n# TYPE {name} {kind}\n")
        for (sname, labels), value in samples[name].items():
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sname}{{{lab}}}" if lab else sname)
            out.append(f" {_number(value)}\n")
    return "".join(out)


class ServingProcess:
    """One serving process: started, watched and restarted by the supervisor."""

    def __init__(self, sup: Supervisor, index: int) -> None:
        self.sup = sup
        self.index = index
        self.socket = os.path.join(sup.run_dir, f"admin-{index}.sock")
        self.proc: asyncio.subprocess.Process | None = None
        self.http: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()
        self.restarts = 0
        self.task: asyncio.Task[None] | None = None

    def command(self) -> list[str]:
        sup = self.sup
        assert sup.config_path is not None
        return python_module(
            "balancer.aio.multi",
            "--config", sup.config_path, "--index", str(self.index),
            "--processes", str(sup.processes), "--run-dir", sup.run_dir,
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        )  # fmt: skip

    async def supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket), base_url="http://wslb"
        )
        while True:
            self.sup.shared_board.clear_row(self.index)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
            started = loop.time()
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), preexec_fn=_die_with_parent, env=child_env()
            )
            log.info("serving process %d started (pid %d)", self.index, self.proc.pid)
            waiter = loop.create_task(self.proc.wait())
            while not waiter.done() and loop.time() - started < CHILD_READY_TIMEOUT:
                if await self._answers():
                    if self.restarts:
                        await self.sup.replay(self)
                    self.ready.set()
                    break
                await asyncio.wait({waiter}, timeout=0.05)
            code = await waiter
            self.ready.clear()
            if self.sup.closing:
                return
            self.restarts += 1
            delay = backoff.next(loop.time() - started)
            log.warning(
                "serving process %d exited with %s; restarting in %.1fs", self.index, code, delay
            )
            await asyncio.sleep(delay)

    async def _answers(self) -> bool:
        try:
            status, _ = await self.call("GET", "/readyz", timeout=1.0)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 200

    async def call(
        self, method: str, path: str, body: Any = None, *, timeout: float = 30.0
    ) -> tuple[int, Any]:
        """One admin request to this process: (status, JSON or text)."""
        assert self.http is not None
        async with self.http.request(
            method, path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, await resp.text()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, timeout: float) -> None:
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.http is not None:
            await self.http.close()


class Supervisor(Balancer):
    """The control process of ``workers: N``: workers, probes, scrapes, the public admin API."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        if config_path is None:
            raise ConfigError(["workers: a multi-process balancer needs a config file"])
        super().__init__(config, config_path)
        self.processes = config.workers
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.run_dir = tempfile.mkdtemp(prefix="wslb-", dir=base)  # mode 0700
        self.shared_board = Board(
            os.path.join(self.run_dir, "board"), self.processes, None, create=True
        )
        self.board = self.shared_board  # closed by Balancer.shutdown
        for pool in self.pools:
            pool.shared = self.shared_board  # Backend.load: the serving processes' sessions
        self.children = [ServingProcess(self, i) for i in range(self.processes)]
        self.admin = FanoutAdmin(self)

    def listeners(self) -> tuple[Listener, ...]:
        return ()  # the serving processes listen

    async def start(self) -> None:
        # Fail fast, as a single process would, if a listen address is taken.
        for lst in self.config.listen:
            with socket.create_server(
                (lst.host, lst.port), reuse_port=True, family=_family(lst.host)
            ):
                pass
        await self.start_serving()
        self._spawn_background(self._publish())
        for child in self.children:
            child.task = self.loop.create_task(child.supervise(), name=f"serve-{child.index}")
        await asyncio.wait_for(
            asyncio.gather(*(c.ready.wait() for c in self.children)), CHILD_READY_TIMEOUT
        )
        log.info("%d serving processes ready", self.processes)
        await self.admin.start()

    async def _publish(self) -> None:
        """Write each backend's health and signals to the board for the serving processes."""
        written: dict[str, tuple[object, ...]] = {}
        while not self.closing:
            now = self.loop.time()
            mono = time.monotonic()  # the board's clock: the same in every process
            for pool in self.pools:
                for b in pool.backends.values():
                    sig = b.signals
                    state = (b.healthy, sig)
                    if written.get(b.id) == state:
                        continue
                    written[b.id] = state
                    self.shared_board.write_info(
                        b.id,
                        healthy=b.healthy,
                        signals=None
                        if sig is None
                        else (
                            sig.gpu_util,
                            sig.kv_cache_usage,
                            sig.running,
                            sig.waiting,
                            sig.tpot,
                        ),
                        scraped_at=None if sig is None else mono - (now - sig.at),
                    )
            await asyncio.sleep(PUBLISH_EVERY)

    def _probe_result(self, b: Backend, ok: bool, draining: bool) -> None:
        was_active, was_self_drained = b.admin_state == ACTIVE, b.id in self.self_drained
        super()._probe_result(b, ok, draining)
        # The worker drains itself, or is back after that: the supervisor's drain is a mirror,
        # the serving processes hold the sessions.
        if was_active and b.admin_state != ACTIVE:
            self._spawn_background(self.fan_out("POST", f"/backends/{b.id}/drain", {}))
        elif was_self_drained and b.id not in self.self_drained:
            self._spawn_background(self.fan_out("POST", f"/backends/{b.id}/undrain", None))

    async def fan_out(self, method: str, path: str, body: Any = None) -> list[tuple[int, Any]]:
        """The same admin request to every serving process, in parallel."""

        async def one(child: ServingProcess) -> tuple[int, Any]:
            try:
                return await child.call(method, path, body)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                return 503, {"error": f"serving process {child.index}: {exc or type(exc)}"}

        return list(await asyncio.gather(*(one(c) for c in self.children)))

    async def replay(self, child: ServingProcess) -> None:
        """Bring a restarted serving process up to the admin changes made since start."""
        status, views = await child.call("GET", "/backends")
        have = {v["id"] for v in views} if status == 200 else set()
        for pool in self.pools:
            for b in pool.backends.values():
                if b.id not in have:
                    body = _backend_body(b)
                    body["pool"] = pool.name
                    await child.call("POST", "/backends", body)
                if b.admin_state != ACTIVE:
                    await child.call("POST", f"/backends/{b.id}/drain", {})

    async def reload(self) -> dict[str, Any]:
        report = await super().reload()
        for status, child_report in await self.fan_out("POST", "/reload", {}):
            if status != 200:
                report.setdefault("errors", []).append(child_report)
        return report

    async def shutdown(self) -> None:
        if self.closing:
            return
        self.closing = True
        t = self.config.timeouts
        limit = t.shutdown_grace + t.close + 5.0

        async def hurry() -> None:
            await self.hurry.wait()
            for c in self.children:
                c.signal(signal.SIGTERM)  # their second signal: skip the grace period

        hurrying = self.loop.create_task(hurry())
        await asyncio.gather(*(c.stop(limit) for c in self.children))
        hurrying.cancel()
        self.closing = False
        await super().shutdown()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _backend_body(b: Backend) -> dict[str, Any]:
    cfg = b.cfg
    body: dict[str, Any] = {"id": cfg.id, "url": cfg.url, "weight": cfg.weight}
    if cfg.spawn:
        body["spawn"] = cfg.spawn
    if cfg.args:
        body["args"] = list(cfg.args)
    if cfg.metrics_url:
        body["metrics_url"] = cfg.metrics_url
    return body


def _combine_state(states: list[str]) -> str:
    """One backend state from the serving processes' states."""
    if len(set(states)) == 1:
        return states[0]
    if DRAINING in states or DRAINED in states:
        return DRAINING  # drained somewhere, still draining elsewhere
    for s in ("down", "ejected"):
        if s in states:
            return s
    return states[0]


class FanoutAdmin(Admin):
    """The supervisor's admin API: one balancer's view over N serving processes."""

    app: Supervisor

    def __init__(self, app: Supervisor) -> None:
        super().__init__(app)
        self.app = app

    async def readyz(self, request: web.Request) -> web.Response:
        if self.app.closing:
            return web.json_response({"status": "shutting down"}, status=503)
        ready = sum(1 for c in self.app.children if c.ready.is_set())
        body = {"status": "ready" if ready else "no serving process ready", "processes": ready}
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        own = generate_latest(self.registry).decode()
        texts = [t for status, t in await self.app.fan_out("GET", "/metrics") if status == 200]
        body = merge_metrics(texts, own).encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _merged_backends(self) -> list[dict[str, Any]]:
        views = [v for status, v in await self.app.fan_out("GET", "/backends") if status == 200]
        out = []
        for own in (self._backend_json(v) for v in self.app.backend_views()):
            theirs = [b for v in views for b in v if b["id"] == own["id"]]
            if theirs:
                own["sessions"] = sum(b["sessions"] for b in theirs)
                own["sessions_total"] = sum(b["sessions_total"] for b in theirs)
                own["state"] = _combine_state([b["state"] for b in theirs])
                own["ejected_for"] = max(b["ejected_for"] for b in theirs)
                own["ejections"] = max(b["ejections"] for b in theirs)
                drains = [b["drain"] for b in theirs if b["drain"]]
                own["drain"] = _merge_drains(drains) if drains else None
            out.append(own)
        return out

    async def backends(self, request: web.Request) -> web.Response:
        return web.json_response(await self._merged_backends())

    async def _merged(self, bid: str) -> dict[str, Any]:
        """One backend's merged view (404 if the supervisor does not know it)."""
        for b in await self._merged_backends():
            if b["id"] == bid:
                return b
        raise web.HTTPNotFound(reason=f"no backend {bid!r}")

    async def backend(self, request: web.Request) -> web.Response:
        return web.json_response(await self._merged(request.match_info["id"]))

    async def sessions(self, request: web.Request) -> web.Response:
        out: list[Any] = []
        path = request.path_qs
        for i, (status, items) in enumerate(await self.app.fan_out("GET", path)):
            if status == 200:
                out.extend({**s, "process": i} for s in items)
        return web.json_response(out)

    async def _holder(self, sid: str) -> tuple[int, Any]:
        for i, (status, item) in enumerate(await self.app.fan_out("GET", f"/sessions/{sid}")):
            if status == 200:
                return i, item
        raise web.HTTPNotFound(reason=f"no live session {sid!r}")

    async def session(self, request: web.Request) -> web.Response:
        i, item = await self._holder(request.match_info["sid"])
        return web.json_response({**item, "process": i})

    async def migrate(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        body = await self._body(request)
        i, _ = await self._holder(sid)
        status, out = await self.app.children[i].call("POST", f"/sessions/{sid}/migrate", body)
        return web.json_response(out, status=status)

    async def _one_answer(
        self, answers: list[tuple[int, Any]], ok: Iterable[int]
    ) -> web.Response | None:
        """The first error any serving process gave, as the supervisor's answer."""
        good = set(ok)
        for status, body in answers:
            if status not in good:
                return web.json_response(body, status=status)
        return None

    async def add_backend(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        pool, cfg = self._new_backend(dict(body))  # the serving processes get the body as is
        if self.app.find_backend(cfg.id) is not None:
            return _error(409, f"backend {cfg.id!r} exists")
        b = self.app.add_backend(pool, cfg)
        failed = await self._one_answer(await self.app.fan_out("POST", "/backends", body), {201})
        if failed is not None:
            return failed
        return web.json_response({"id": b.id, "pool": pool.name, "state": b.state}, status=201)

    async def delete_backend(self, request: web.Request) -> web.Response:
        pool, b = self._find(request)
        merged = await self._merged(b.id)
        if merged["state"] != DRAINED or merged["sessions"]:
            return _error(409, f"backend {b.id!r} is {merged['state']}; drain it first")
        answers = await self.app.fan_out("DELETE", f"/backends/{b.id}")
        failed = await self._one_answer(answers, {200, 404})
        if failed is not None:
            return failed
        await self.app.remove_backend(pool, b)
        return web.json_response({"id": b.id, "removed": True})

    async def drain(self, request: web.Request) -> web.Response:
        pool, b = self._find(request)
        body = await self._body(request)
        answers = await self.app.fan_out("POST", f"/backends/{b.id}/drain", body)
        failed = await self._one_answer(answers, {200, 202})
        if failed is not None:
            return failed
        self.app.self_drained.discard(b.id)
        if b.admin_state == ACTIVE:  # the supervisor's mirror (for probes and replay)
            self.app.drainer.start(pool, b, False, math.inf)
        merged = await self._merged(b.id)
        return web.json_response(merged, status=200 if merged["state"] == DRAINED else 202)

    async def undrain(self, request: web.Request) -> web.Response:
        _, b = self._find(request)
        failed = await self._one_answer(
            await self.app.fan_out("POST", f"/backends/{b.id}/undrain"), {200}
        )
        if failed is not None:
            return failed
        await self.app.drainer.undrain(b)
        return web.json_response(await self._merged(b.id))

    async def debug_stats(self, request: web.Request) -> web.Response:
        own = await super().debug_stats(request)
        assert isinstance(own.text, str)
        procs = [
            {**body, "process": i} if status == 200 else {"process": i, "error": body}
            for i, (status, body) in enumerate(await self.app.fan_out("GET", "/debug/stats"))
        ]
        total = {
            k: sum(p.get(k, 0) for p in procs) for k in ("sessions", "connections", "rss", "fds")
        }
        return web.json_response({"supervisor": json.loads(own.text), "processes": procs, **total})


def _merge_drains(drains: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(drains[0])
    for k in _DRAIN_SUMS:
        out[k] = sum(d.get(k) or 0 for d in drains)
    out["started"] = min(d["started"] for d in drains)
    finished = [d.get("finished") for d in drains]
    out["finished"] = None if None in finished else max(f for f in finished if f is not None)
    return out


# -- a serving process ---------------------------------------------------------------------


async def _serve(config: Config, path: str, link: ProcessLink) -> int:
    from balancer.aio.app import serve

    return await serve(config, path, link=link)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a serving process (started by the supervisor, not by hand)."""
    p = argparse.ArgumentParser(prog="wslb-serve", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log-level", default="info")
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[{ns.index}]: %(message)s",
    )
    try:
        config = load_config(ns.config)
    except ConfigError as exc:
        print(f"wslb: invalid configuration {ns.config}:\n{exc}", file=sys.stderr)
        return 2
    logs.setup(logging.getLogger().level, config.log.format, process=str(ns.index))
    link = ProcessLink(
        ns.index,
        ns.processes,
        os.path.join(ns.run_dir, "board"),
        os.path.join(ns.run_dir, f"admin-{ns.index}.sock"),
    )
    from balancer.aio.app import run_loop

    return run_loop(_serve(config, ns.config, link))


if __name__ == "__main__":
    sys.exit(main())
