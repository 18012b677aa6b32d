"""The supervisor's ``Control`` under ``workers: N``: one balancer over N serving processes.

Every call goes to each serving process's admin API (a Unix socket, ``multi.py``) and the answers
are merged into one balancer's: backends (session counts summed, states combined, drain progress
added up), sessions (each with its ``process``), ``/debug/stats`` and metrics (counters,
histograms and the session/connection gauges summed; other gauges, such as a backend's weight
and health, are the supervisor's own: it alone probes and scrapes). Every write reaches every
process; the first error any of them gives is the answer. The supervisor keeps a mirror of the
backends and their drains (``LocalControl`` without sessions) for its probes and to replay admin
changes into a serving process that restarted.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from balancer.aio.control import (
    ControlError,
    LocalControl,
    Reply,
    backend_body,
    new_backend,
    wait_events,
)
from balancer.aio.restart import UNCHANGED, RestartError, check_new_code
from balancer.events import EventLog
from balancer.pool import ACTIVE, DRAINED, DRAINING, Backend
from balancer.version import version

__all__ = ["FanoutControl", "merge_metrics"]

# The feed's events only a serving process sees (module docstring of ``FanoutControl.feed``).
CHILD_EVENTS = frozenset({"migration", "failover", "drain"})
FOLLOW_WAIT = 10.0  # seconds each long poll of a serving process's events waits


class Child(Protocol):
    """A serving process as the fan-out sees it (``multi.ServingProcess``)."""

    index: int

    @property
    def is_ready(self) -> bool: ...

    async def call(
        self, method: str, path: str, body: Any = None, *, timeout: float = 30.0
    ) -> tuple[int, Any]: ...

    async def replace(self, timeout: float = 120.0) -> dict[str, Any]: ...


# Gauges that count things each process holds: summed. Other gauges are the supervisor's own.
ADDITIVE_GAUGES = frozenset(
    {"wslb_sessions_active", "wslb_connections_active", "wslb_relay_thread_sessions"}
)
# Shares each process takes its part of (the KV its conversations need): 1 - sum of (1 - share).
COMPLEMENT_GAUGES = frozenset({"wslb_backend_kv_headroom_ratio"})
# The process the scrape reached (Prometheus' convention for process_*): a start time or an fd
# limit summed over processes means nothing; the serving processes' figures are in /debug/stats.
OWN_PREFIXES = ("process_",)
# Numeric drain-progress fields that add up over processes.
_DRAIN_SUMS = (
    "sessions_at_start",
    "migrated",
    "migration_failures",
    "closed_after_answer",
    "closed_at_timeout",
    "requests_cut",
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

    Counters and histograms add up over processes, as do ``ADDITIVE_GAUGES``; the
    ``COMPLEMENT_GAUGES`` add up what each process takes of a share; ``process_*`` and any other
    gauge (a backend's weight, health, state, ``wslb_build_info``) are taken from ``own`` only.
    """
    order: list[str] = []
    families: dict[str, tuple[str, str]] = {}  # name -> (type, documentation)
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    own_only: set[tuple[str, tuple[tuple[str, str], ...]]] = set()  # taken shares not yet theirs

    def add(text: str, is_own: bool) -> None:
        for fam in text_string_to_metric_families(text):
            if fam.name not in families:
                families[fam.name] = (fam.type, fam.documentation)
                order.append(fam.name)
                samples[fam.name] = {}
            if fam.name.startswith(OWN_PREFIXES):
                summed = False
            else:
                summed = fam.type != "gauge" or fam.name in ADDITIVE_GAUGES
            taken = fam.name in COMPLEMENT_GAUGES
            if not (summed or taken or is_own):
                continue
            into = samples[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if taken:  # kept as the share taken, turned back at the end; the serving
                    # processes' replace the supervisor's own (as in GET /backends)
                    if is_own:
                        own_only.add(key)
                    elif key in own_only:
                        own_only.discard(key)
                        into[key] = 0.0
                    into[key] = into.get(key, 0.0) + (1.0 - s.value)
                else:
                    into[key] = into.get(key, 0.0) + s.value if summed else s.value

    add(own, True)
    for text in texts:
        add(text, False)
    out: list[str] = []
    for name in order:
        kind, doc = families[name]
        # The parser names a counter without its _total; its samples and generate_latest's
        # HELP and TYPE lines have it (promtool finds no help text for the samples otherwise).
        shown = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {shown} {_escape(doc)}\n# TYPE {shown} {kind}\n")
        for (sname, labels), value in samples[name].items():
            if name in COMPLEMENT_GAUGES:
                value = 1.0 - value
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sname}{{{lab}}}" if lab else sname)
            out.append(f" {_number(value)}\n")
    return "".join(out)


class FanoutControl:
    """The ``Control`` of the supervisor of ``workers: N`` (module docstring)."""

    def __init__(self, local: LocalControl, children: Sequence[Child]) -> None:
        """``local``: the supervisor's mirror (its pools, probes, drains; no sessions)."""
        self.local = local
        self.children = children
        self._restarting = False
        # The merged feed: the supervisor's own events of what it alone sees, and the serving
        # processes' of what they alone do (their sessions' moves, and their drains, which
        # hold the counts; the supervisor's drain is a mirror without sessions).
        self.feed = EventLog()
        local.state.events.listen(self._own_event)

    def _own_event(self, event: dict[str, Any]) -> None:
        if event["kind"] not in CHILD_EVENTS:
            self.feed.absorb(event)

    async def events(self, since: int, wait: float) -> tuple[list[dict[str, Any]], int]:
        return await wait_events(self.feed, since, wait)

    async def follow(self) -> None:
        """Absorb each serving process's events into the feed, for as long as it runs."""
        await asyncio.gather(*(self._follow(c) for c in self.children))

    async def _follow(self, child: Child) -> None:
        seen = 0  # a restarted child's log starts over: it answers a ``since`` past its end
        while True:
            try:
                status, body = await child.call(
                    "GET", f"/events?since={seen}&wait={FOLLOW_WAIT:g}", timeout=FOLLOW_WAIT + 5
                )
            except (aiohttp.ClientError, OSError, TimeoutError, AssertionError):
                await asyncio.sleep(1.0)  # not started yet, or restarting
                continue
            if status != 200 or not isinstance(body, dict):
                await asyncio.sleep(1.0)
                continue
            for event in body.get("events") or ():
                if event.get("kind") in CHILD_EVENTS:
                    self.feed.absorb(event, process=child.index)
            seen = int(body.get("last") or 0)

    async def fan_out(self, method: str, path: str, body: Any = None) -> list[tuple[int, Any]]:
        """The same admin request to every serving process, in parallel."""

        async def one(child: Child) -> tuple[int, Any]:
            try:
                return await child.call(method, path, body)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                return 503, {"error": f"serving process {child.index}: {exc or type(exc)}"}

        return list(await asyncio.gather(*(one(c) for c in self.children)))

    @staticmethod
    def _first_error(answers: list[tuple[int, Any]], ok: Iterable[int]) -> None:
        """Raise the first error any serving process gave, as the supervisor's answer."""
        good = set(ok)
        for status, body in answers:
            if status not in good:
                message = body.get("error") if isinstance(body, dict) else None
                raise ControlError(status, str(message if message is not None else body))

    # -- the worker's own reports (the supervisor probes) ----------------------------------

    def worker_reports(self, b: Backend, ok: bool, draining: bool) -> None:
        """The worker drains itself, or is back after that: the supervisor's drain is a mirror;
        the serving processes hold the sessions, so they are told."""
        change = self.local.worker_reports(b, ok, draining)
        if change == "drain":
            self.local.spawn(self.fan_out("POST", f"/backends/{b.id}/drain", {}))
        elif change == "undrain":
            self.local.spawn(self.fan_out("POST", f"/backends/{b.id}/undrain", None))

    async def replay(self, child: Child) -> None:
        """Bring a restarted serving process up to the admin changes made since start."""
        status, views = await child.call("GET", "/backends")
        have = {v["id"] for v in views} if status == 200 else set()
        for pool, b in self.local.state.backends():
            if b.id not in have:
                body = backend_body(b)
                body["pool"] = pool.name
                await child.call("POST", "/backends", body)
            if b.admin_state != ACTIVE:
                await child.call("POST", f"/backends/{b.id}/drain", {})

    # -- views -----------------------------------------------------------------------------

    async def ready(self) -> Reply:
        if self.local.state.closing:
            return Reply({"status": "shutting down"}, 503)
        ready = sum(1 for c in self.children if c.is_ready)
        body = {"status": "ready" if ready else "no serving process ready", "processes": ready}
        return Reply(body, 200 if ready else 503)

    async def metrics(self) -> bytes:
        own = (await self.local.metrics()).decode()
        texts = [t for status, t in await self.fan_out("GET", "/metrics") if status == 200]
        return merge_metrics(texts, own).encode()

    async def backends(self) -> list[dict[str, Any]]:
        views = [v for status, v in await self.fan_out("GET", "/backends") if status == 200]
        out = []
        for own in await self.local.backends():
            theirs = [b for v in views for b in v if b["id"] == own["id"]]
            if theirs:
                own["sessions"] = sum(b["sessions"] for b in theirs)
                own["sessions_total"] = sum(b["sessions_total"] for b in theirs)
                own["state"] = _combine_state([b["state"] for b in theirs])
                own["ejected_for"] = max(b["ejected_for"] for b in theirs)
                own["ejections"] = max(b["ejections"] for b in theirs)
                own["overloaded"] = own["overloaded"] or any(b["overloaded"] for b in theirs)
                # Each process counts the KV its own conversations need (the supervisor places
                # none): the backend's headroom is what is left of it after all of them.
                rooms = [b["kv_headroom"] for b in theirs if b.get("kv_headroom") is not None]
                if rooms:
                    own["kv_headroom"] = round(1.0 - sum(1.0 - r for r in rooms), 4)
                drains = [b["drain"] for b in theirs if b["drain"]]
                own["drain"] = _merge_drains(drains) if drains else None
                # Probes count in the supervisor, sessions' moves in the serving processes.
                own["counters"] = {
                    k: n + sum(b.get("counters", {}).get(k, 0) for b in theirs)
                    for k, n in own["counters"].items()
                }
            out.append(own)
        return out

    async def backend(self, backend_id: str) -> dict[str, Any]:
        """One backend's merged view (404 if the supervisor does not know it)."""
        for b in await self.backends():
            if b["id"] == backend_id:
                return b
        raise ControlError(404, f"no backend {backend_id!r}")

    async def sessions(self, backend_id: str | None) -> list[dict[str, Any]]:
        path = "/sessions" if backend_id is None else f"/sessions?backend={backend_id}"
        out: list[dict[str, Any]] = []
        for i, (status, items) in enumerate(await self.fan_out("GET", path)):
            if status == 200:
                out.extend({**s, "process": i} for s in items)
        return out

    async def _holder(self, sid: str) -> tuple[int, Any]:
        for i, (status, item) in enumerate(await self.fan_out("GET", f"/sessions/{sid}")):
            if status == 200:
                return i, item
        raise ControlError(404, f"no live session {sid!r}")

    async def session(self, sid: str) -> dict[str, Any]:
        i, item = await self._holder(sid)
        return {**item, "process": i}

    async def debug_stats(self) -> dict[str, Any]:
        own = await self.local.debug_stats()
        procs = [
            {**body, "process": i} if status == 200 else {"process": i, "error": body}
            for i, (status, body) in enumerate(await self.fan_out("GET", "/debug/stats"))
        ]
        total = {
            k: sum(p.get(k, 0) for p in procs) for k in ("sessions", "connections", "rss", "fds")
        }
        return {"supervisor": own, "processes": procs, **total}

    # -- operator actions ------------------------------------------------------------------

    async def add_backend(self, body: dict[str, Any]) -> Reply:
        pool, cfg = new_backend(self.local.state, body)  # the processes get the body as is
        if self.local.state.find_backend(cfg.id) is not None:
            raise ControlError(409, f"backend {cfg.id!r} exists")
        b = self.local.add(pool, cfg)
        self._first_error(await self.fan_out("POST", "/backends", body), {201})
        return Reply({"id": b.id, "pool": pool.name, "state": b.state}, 201)

    async def remove_backend(self, backend_id: str) -> Reply:
        pool, b = self.local.find(backend_id)
        merged = await self.backend(b.id)
        if merged["state"] != DRAINED or merged["sessions"]:
            raise ControlError(409, f"backend {b.id!r} is {merged['state']}; drain it first")
        self._first_error(await self.fan_out("DELETE", f"/backends/{b.id}"), {200, 404})
        await self.local.remove(pool, b)
        return Reply({"id": b.id, "removed": True})

    async def drain(self, backend_id: str, body: dict[str, Any]) -> Reply:
        pool, b = self.local.find(backend_id)
        answers = await self.fan_out("POST", f"/backends/{b.id}/drain", body)
        self._first_error(answers, {200, 202})
        self.local.drainer.keep_drained(b)
        if b.admin_state == ACTIVE:  # the supervisor's mirror (for probes and replay)
            self.local.drainer.start(pool, b, False, math.inf)
        merged = await self.backend(b.id)
        return Reply(merged, 200 if merged["state"] == DRAINED else 202)

    async def undrain(self, backend_id: str) -> Reply:
        _, b = self.local.find(backend_id)
        self._first_error(await self.fan_out("POST", f"/backends/{b.id}/undrain"), {200})
        await self.local.drainer.undrain(b)
        return Reply(await self.backend(b.id))

    async def migrate(self, sid: str, body: dict[str, Any]) -> Reply:
        i, _ = await self._holder(sid)
        status, out = await self.children[i].call("POST", f"/sessions/{sid}/migrate", body)
        return Reply(out, status)

    async def reload(self) -> Reply:
        report = (await self.local.reload()).body
        for status, child_report in await self.fan_out("POST", "/reload", {}):
            if status != 200:
                report.setdefault("errors", []).append(child_report)
        return Reply(report)

    async def restart(self, body: dict[str, Any] | None = None) -> Reply:
        """Each serving process in turn hands everything to a new one with the code installed
        now (``ServingProcess.replace``); this supervisor stays, with its spawned workers."""
        if self._restarting:
            raise ControlError(409, "restart failed (busy): a restart is running already")
        if self.local.config_path is None:
            raise ControlError(500, "restart failed (no_config): no config file was given")
        self._restarting = True
        t0 = time.monotonic()
        st = self.local.state
        st.emit("restart", phase="started", pid=os.getpid())
        try:
            try:
                await check_new_code(self.local.config_path)
            except RestartError as exc:
                st.stats.restarts[exc.reason] += 1
                st.emit("restart", phase="failed", reason=exc.reason, error=exc.detail)
                raise ControlError(500, f"restart failed ({exc.reason}): {exc.detail}") from None
            answers = []
            for child in self.children:
                try:
                    answers.append(await child.replace())
                except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
                    st.stats.restarts["child"] += 1
                    st.emit("restart", phase="failed", reason="child", error=str(exc))
                    raise ControlError(
                        500,
                        f"restart failed (child): {exc}; {len(answers)} of "
                        f"{len(self.children)} serving processes restarted",
                    ) from None
        finally:
            self._restarting = False
        st.stats.restarts["ok"] += 1
        not_moved: Counter[str] = Counter()
        for a in answers:
            not_moved.update(a["sessions"]["not_moved"])
        p99s = [a["pause_ms"]["p99"] for a in answers if a["pause_ms"]["p99"] is not None]
        out: dict[str, Any] = {
            "ok": True,
            "supervisor": {"pid": os.getpid(), "version": version()},
            "old": [a["old"] for a in answers],
            "new": [a["new"] for a in answers],
            "sessions": {
                "moved": sum(a["sessions"]["moved"] for a in answers),
                "not_moved": dict(not_moved),
                "adopted": sum(a["sessions"]["adopted"] or 0 for a in answers),
                "resume_asked": sum(a["sessions"].get("resume_asked", 0) for a in answers),
            },
            "pause_ms": {"p99": max(p99s) if p99s else None},
            "seconds": round(time.monotonic() - t0, 3),
            "processes": answers,
            "unchanged": [
                *UNCHANGED[1:],
                "the supervisor (spawning, probes, the admin API's fan-out) keeps its code: "
                "stop and start wslb for a new supervisor",
            ],
        }
        st.emit("restart", phase="finished", moved=out["sessions"]["moved"], seconds=out["seconds"])
        return Reply(out)


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


def _merge_drains(drains: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(drains[0])
    for k in _DRAIN_SUMS:
        out[k] = sum(d.get(k) or 0 for d in drains)
    out["started"] = min(d["started"] for d in drains)
    finished = [d.get("finished") for d in drains]
    out["finished"] = None if None in finished else max(f for f in finished if f is not None)
    return out
