"""Cluster mode, asyncio side: an etcd v3 JSON-gateway client and the instance's sync loops.

The key layout and the diff are in :mod:`balancer.cluster`. Here:

- **Sync**: seed the prefix if nobody has (transaction), read it whole (``/v3/kv/range``), apply
  the diff, then watch from ``revision + 1`` (``/v3/watch``, one JSON object per line) and apply
  the diff after each batch of events. A broken stream, a failed keepalive or a compaction
  (``compact_revision``: events were lost) ends the watch; the loop reconnects with backoff
  (0.1 s doubling to 2 s) and starts again from a full read, so an instance that was cut off
  catches up with whatever changed meanwhile. A store that comes back empty (its data lost) is
  refilled from the instance's last known state (``reseed_txn``). The diff also runs every
  0.2 s, which repairs a local drain that something else undid.
- **Liveness**: the instance holds a lease (10 s TTL) kept alive every second; that keepalive is
  also the store's health check. ``instances/{instance}`` and its ``drain/{id}/{instance}``
  reports live under it, so a dead instance stops counting for "drained everywhere".
- **etcd unreachable**: nothing on the hot path waits for etcd. The instance keeps routing with
  the last state it applied (or its file's backends, if it never reached etcd), ``/readyz`` stays
  200 with ``"degraded": true`` and a ``cluster`` object saying since when (a store blip must
  not make Kubernetes pull every replica at once), ``wslb_cluster_connected`` drops to 0, and
  admin writes answer 503. When etcd answers again the full read brings it up to date.
- **Admin writes** go to etcd and are applied by the watch, like everyone else's: the handler
  waits up to 1 s for its own instance to apply the change, then answers.
- **Cluster-wide bounds**: after each scrape of a worker, ``remote_sessions = max(0, running -
  sessions)``: the worker's own count of live sessions (signal ``running``, reference preset
  ``wslb_worker_active_sessions``) minus the sessions this instance holds there at that moment.
  Bounds and least_conn then see every instance's load, as of the last scrape. A stale scrape
  counts no remote sessions.
- **Placements** (the shared affinity table, ``balancer.cluster.Placements``): every pool reads
  the instance's copy (``Pool.placements``); a writer task sends the queued placements to etcd
  as transactions of puts (at most ``TXN_OPS`` each, the first at once, the next ``BATCH_S``
  later), on a lease granted every ``PLACEMENT_LEASE_EVERY`` with a TTL of the affinity window
  plus that, so a placement outlives its writer by the window and no longer. A failed write
  stays queued and is tried again; nothing on the hot path waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from balancer.aio.control import ControlError, LocalControl, Reply, drain_args, new_backend
from balancer.aio.loops import cancel_and_wait
from balancer.cluster import (
    ACTIVE,
    BACKENDS,
    DRAIN,
    DRAINED,
    DRAINING,
    INSTANCES,
    STATE,
    Add,
    BackendRecord,
    DrainReport,
    Local,
    Remove,
    SetState,
    Snapshot,
    StateRecord,
    Update,
    b64,
    compare_created,
    compare_mod,
    delete_op,
    normalize_prefix,
    plan,
    prefix_end,
    put_op,
    reseed_txn,
    seed_txn,
)
from balancer.config import BackendCfg, ClusterCfg
from balancer.pool import AFFINITY_TTL, Backend, Pool

__all__ = ["Cluster", "ClusterControl", "Etcd", "EtcdError"]

log = logging.getLogger("wslb.cluster")

_T = TypeVar("_T")

LEASE_TTL = 10  # seconds; an instance that stops for this long stops counting
KEEPALIVE = 1.0  # lease keepalive period, also the store's health check
CALL_TIMEOUT = 2.0
BACKOFF_MIN, BACKOFF_MAX = 0.1, 2.0
TICK = 0.2  # drain reports, the periodic diff, remote session counts
WRITE_WAIT = 1.0  # an admin write waits this long for its own instance to apply it
STARTUP_WAIT = 3.0  # start() waits this long for the first sync before routing on the file
BATCH_S = 0.05  # placements: the least time between two write transactions
TXN_OPS = 128  # placements per transaction (etcd's default --max-txn-ops)
PLACEMENT_LEASE_EVERY = 60.0  # a fresh placements lease this often...
PLACEMENT_LEASE_TTL = int(AFFINITY_TTL + 2 * PLACEMENT_LEASE_EVERY)  # ...lasting the window+


class EtcdError(Exception):
    """etcd did not answer, or refused."""


class Compacted(EtcdError):
    """The watch's start revision was compacted: events were lost, read everything again."""


class Etcd:
    """The few calls of etcd's v3 JSON gateway (``/v3/...``) that cluster mode needs."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base.rstrip("/")
        self.session = session

    async def call(
        self, path: str, body: Mapping[str, Any], timeout: float = CALL_TIMEOUT
    ) -> dict[str, Any]:
        try:
            async with self.session.post(
                self.base + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EtcdError(f"{path}: {exc or type(exc).__name__}") from None
        if not isinstance(data, dict):
            raise EtcdError(f"{path}: unexpected answer {data!r}")
        if status != 200 or "error" in data:
            raise EtcdError(f"{path}: HTTP {status}: {data.get('error') or data.get('message')}")
        return data

    async def range(self, prefix: str) -> tuple[int, list[dict[str, Any]]]:
        """Every key under ``prefix`` and the store's revision at that read."""
        data = await self.call(
            "/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}
        )
        return int(data["header"]["revision"]), list(data.get("kvs", []))

    async def put(self, key: str, value: str, lease: int = 0) -> None:
        await self.call("/v3/kv/put", put_op(key, value, lease)["request_put"])

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", delete_op(key)["request_delete_range"])

    async def txn(self, body: Mapping[str, Any]) -> bool:
        """Run a transaction; True when its compares held (the gateway omits a false one)."""
        data = await self.call("/v3/kv/txn", body)
        return bool(data.get("succeeded", False))

    async def grant(self, ttl: int) -> int:
        return int((await self.call("/v3/lease/grant", {"TTL": ttl}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh a lease; its remaining TTL, 0 when etcd no longer knows it."""
        data = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[dict[str, Any]]]:
        """Batches of events under ``prefix`` from revision ``start``; the first batch is empty
        and confirms the watch. Ends only by raising EtcdError (Compacted: events were lost)."""
        body = {
            "create_request": {
                "key": b64(prefix),
                "range_end": b64(prefix_end(prefix)),
                "start_revision": str(start),
            }
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CALL_TIMEOUT)
        try:
            async with self.session.post(
                self.base + "/v3/watch", json=body, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise EtcdError(f"/v3/watch: HTTP {resp.status}")
                async for line in resp.content:
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise EtcdError(f"/v3/watch: {msg['error']}")
                    result = msg.get("result", {})
                    if result.get("compact_revision"):
                        raise Compacted(f"revision {start} compacted")
                    if result.get("canceled"):
                        raise EtcdError(f"watch canceled: {result.get('cancel_reason', '')}")
                    yield list(result.get("events", []))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EtcdError(f"/v3/watch: {exc or type(exc).__name__}") from None
        raise EtcdError("/v3/watch: stream ended")


def instance_id() -> str:
    """Host name (the pod's name on Kubernetes) and process id: unique among live instances."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Cluster:
    """The etcd side of one instance: sync loops, admin writes, drain reports, status."""

    def __init__(self, local: LocalControl, cfg: ClusterCfg) -> None:
        """``local`` applies what etcd says to this instance's pools."""
        self.local = local
        self.state = local.state
        self.cfg = cfg
        self.prefix = normalize_prefix(cfg.prefix)
        self.instance = instance_id()
        self.snap = Snapshot(self.prefix)
        self.by_cluster: set[str] = set()  # backends this instance drains because etcd says so
        self.removing: set[str] = set()
        self.lease = 0
        self.synced = False  # a full read applied and the watch running
        self.ever_synced = False
        self.down_since: float | None = time.time()  # wall clock; None while connected
        self.last_ok: float | None = None  # loop time of the last answer from etcd
        self.resyncs = 0
        self.last_error = ""
        self._first = asyncio.Event()
        self._lost = asyncio.Event()
        self._reported: dict[str, DrainReport] = {}
        self._warned: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._etcd: Etcd | None = None
        self._share_placements()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the loops; wait a little for the first sync so routing starts from etcd."""
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers={"User-Agent": "wslb"}
        )
        self._etcd = Etcd(self.cfg.etcd, self._http)
        loop = self.state.loop
        for name, coro in (
            ("sync", self._run()),
            ("lease", self._keepalive()),
            ("tick", self._tick()),
            ("placements", self._write_placements()),
        ):
            self._tasks.append(loop.create_task(coro, name=f"cluster-{name}"))
        try:
            await asyncio.wait_for(self._first.wait(), STARTUP_WAIT)
        except TimeoutError:
            log.warning(
                "etcd at %s unreachable (%s); routing with the file's backends until it answers",
                self.cfg.etcd, self.last_error,
            )  # fmt: skip

    async def stop(self) -> None:
        """Stop the loops and revoke the lease: this instance's keys go with it."""
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._etcd is not None and self.lease:
            with contextlib.suppress(EtcdError):
                await self._etcd.revoke(self.lease)
            self.lease = 0
        if self._http is not None:
            await self._http.close()
            self._http = None

    @property
    def etcd(self) -> Etcd:
        if self._etcd is None:
            raise EtcdError("cluster client not started")
        return self._etcd

    # -- sync ------------------------------------------------------------------------------

    def _contact(self) -> None:
        self.last_ok = self.state.loop.time()

    def _lost_contact(self, why: str) -> None:
        self.last_error = why
        if self.synced:
            self.synced = False
            self.down_since = time.time()
            log.warning("lost etcd (%s); routing on the last known state", why)
        self._lost.set()

    async def _sync(self) -> None:
        """Seed if nobody has (or restore what we knew, if the store lost it), read, apply."""
        config, now = self.state.config, time.time()
        if self.snap.seeded:  # a no-op unless the seed is gone: etcd came back empty
            if await self.etcd.txn(reseed_txn(self.snap, self.instance, now)):
                log.warning("%s was empty: restored the state this instance knew", self.prefix)
        elif any(p.backends for p in config.pools) and await self.etcd.txn(
            seed_txn(self.prefix, config, self.instance, now)
        ):
            log.info("seeded %s with the backends of %s", self.prefix, config.source)
        revision, kvs = await self.etcd.range(self.prefix)
        self.snap.reset(kvs, revision)
        self.resyncs += 1
        self._contact()
        self.apply()

    async def _follow(self) -> None:
        async for events in self.etcd.watch(self.prefix, self.snap.revision + 1):
            self._contact()
            if not self.synced:
                self.synced = True
                self.down_since = None
                self.ever_synced = True
                self._first.set()
                log.info("in sync with etcd at revision %d", self.snap.revision)
            changed = False
            for ev in events:
                changed = self.snap.event(ev) or changed
            if changed:  # placements alone change nothing the diff reads
                self.apply()

    async def _run(self) -> None:
        loop = self.state.loop
        delay = BACKOFF_MIN
        while True:
            try:
                self._lost.clear()
                await self._sync()
                delay = BACKOFF_MIN
                follow = loop.create_task(self._follow())
                lost = loop.create_task(self._lost.wait())
                try:
                    await asyncio.wait({follow, lost}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (follow, lost):
                        t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await lost
                    with contextlib.suppress(asyncio.CancelledError, EtcdError):
                        await follow
                failure = follow.exception() if follow.done() and not follow.cancelled() else None
                if failure is not None:
                    raise failure
                raise EtcdError(self.last_error or "store unreachable")
            except Compacted as exc:
                log.info("watch: %s; reading everything again", exc)
                self.synced = False
                continue
            except EtcdError as exc:
                self._lost_contact(str(exc))
            await asyncio.sleep(delay * (1.0 + 0.2 * random.random()))
            delay = min(delay * 2, BACKOFF_MAX)

    async def _keepalive(self) -> None:
        while True:
            try:
                if not self.lease:
                    self.lease = await self.etcd.grant(LEASE_TTL)
                    record = {
                        "admin": self._admin_url(),
                        "started": time.time(),
                        "client": self._client_address(),
                    }
                    await self.etcd.put(
                        self.prefix + INSTANCES + self.instance, json.dumps(record), self.lease
                    )
                    self._reported.clear()  # the reports went with the old lease
                elif await self.etcd.keepalive(self.lease) <= 0:
                    log.info("lease %x expired; registering again", self.lease)
                    self.lease = 0
                    continue
                self._contact()
            except EtcdError as exc:
                if "lease not found" in str(exc):
                    self.lease = 0
                    continue
                self._lost_contact(str(exc))
            await asyncio.sleep(KEEPALIVE)

    def _admin_url(self) -> str:
        a = self.state.config.admin
        return f"http://{a.host}:{a.port}"

    def _client_address(self) -> dict[str, Any]:
        """Where the other instances carry a client's resume to (``aio/peers.py``): this
        instance's first listener, at ``cluster.advertise`` or a host they can reach."""
        first = self.state.config.listen[0]
        host = self.cfg.advertise or first.host
        if host in ("", "0.0.0.0", "::"):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return {"host": host, "port": first.port, "tls": first.tls is not None}

    def peers(self) -> list[tuple[str, dict[str, Any]]]:
        """The other live instances and their client listeners (sorted by id)."""
        out = []
        for name, record in sorted(self.snap.instances().items()):
            client = record.get("client")
            if name != self.instance and isinstance(client, dict):
                out.append((name, client))
        return out

    # -- applying the shared state ---------------------------------------------------------

    def apply(self) -> None:
        """Make the local pools agree with the snapshot (idempotent)."""
        local = {
            b.id: Local(pool.name, b.cfg, b.admin_state, b.id in self.by_cluster)
            for pool in self.state.pools
            for b in pool.backends.values()
            if b.id not in self.removing
        }
        actions, warnings = plan(self.snap, local, [p.name for p in self.state.pools])
        for w in warnings:
            if w not in self._warned:
                self._warned.add(w)
                log.warning("cluster: %s", w)
        for a in actions:
            if isinstance(a, Add):
                pool = self.state.pool(a.pool)
                if pool is not None and self.state.find_backend(a.cfg.id) is None:
                    self.local.add(pool, self._with_local(a.cfg))
            elif isinstance(a, Update):
                found = self.state.find_backend(a.id)
                if found is not None:
                    found[0].update(a.id, self._with_local(a.cfg))
                    log.info("backend %s: weight %s from etcd", a.id, a.cfg.weight)
            elif isinstance(a, Remove):
                self._remove(a.id)
            elif isinstance(a, SetState):
                self._set_state(a.id, a.state)

    def _with_local(self, cfg: BackendCfg) -> BackendCfg:
        """Keep this instance's ``spawn``/``args`` for a backend its own file has at that URL."""
        mine = self.state.config.backend(cfg.id)
        if mine is not None and mine.url == cfg.url:
            return replace(mine, weight=cfg.weight, metrics_url=cfg.metrics_url)
        return cfg

    def _remove(self, bid: str) -> None:
        found = self.state.find_backend(bid)
        if found is None:
            return
        pool, b = found
        self.removing.add(bid)

        async def run() -> None:
            try:
                if b.sessions > 0:
                    if b.admin_state == ACTIVE:
                        self.local.drainer.start(
                            pool, b, pool.cfg.drain.migrate, pool.cfg.drain.timeout
                        )
                    await self.local.remove_when_drained(pool, b)
                elif pool.backends.get(bid) is b:
                    await self.local.drainer.undrain(b)  # stops a drain task, if any
                    await self.local.remove(pool, b)
            finally:
                self.removing.discard(bid)
                self.by_cluster.discard(bid)

        self.local.spawn(run())

    def _set_state(self, bid: str, state: StateRecord) -> None:
        found = self.state.find_backend(bid)
        if found is None:
            return
        pool, b = found
        drainer = self.local.drainer
        if state.state != ACTIVE:
            self.by_cluster.add(bid)
            drainer.keep_drained(b)  # a probe must not undo the operator's drain
            if b.admin_state == ACTIVE:
                log.info("backend %s: %s by %s (etcd)", bid, state.state, state.by)
                drainer.start(pool, b, state.migrate, state.timeout)
        else:
            self.by_cluster.discard(bid)
            if b.admin_state != ACTIVE:
                log.info("backend %s: undrained by %s (etcd)", bid, state.by)
                self.local.spawn(drainer.undrain(b))

    # -- placements (module docstring) -----------------------------------------------------

    def _share_placements(self) -> None:
        """Every pool reads and writes the tier's affinity table."""
        self.placements = self.snap.placements
        self._placements_due = asyncio.Event()
        self.placements.on_queued = self._placements_due.set
        self._placement_lease = 0
        self._placement_lease_at = 0.0
        for pool in self.state.pools:
            pool.placements = self.placements.view(pool.name)

    async def _write_placements(self) -> None:
        table = self.placements
        loop = self.state.loop
        delay = BACKOFF_MIN
        while True:
            await self._placements_due.wait()
            self._placements_due.clear()
            while table.queued():
                try:
                    if not self._placement_lease or (
                        loop.time() - self._placement_lease_at > PLACEMENT_LEASE_EVERY
                    ):
                        self._placement_lease = await self.etcd.grant(PLACEMENT_LEASE_TTL)
                        self._placement_lease_at = loop.time()
                    batch = table.take(TXN_OPS)
                    ops = [
                        put_op(self.prefix + rel, p.encode(), self._placement_lease)
                        for rel, p in batch
                    ]
                    await self.etcd.txn({"compare": [], "success": ops, "failure": []})
                    table.done(batch)
                    delay = BACKOFF_MIN
                except EtcdError as exc:
                    if "lease not found" in str(exc):
                        self._placement_lease = 0  # etcd lost it (restored empty)
                    log.debug("placements: %s", exc)  # the keepalive reports outages
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
                await asyncio.sleep(BATCH_S)

    # -- periodic work ---------------------------------------------------------------------

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            for pool in self.state.pools:
                for b in pool.backends.values():
                    if b.stale:
                        b.remote_sessions = 0
            if not self.synced:
                continue
            self.apply()
            if self.lease:
                try:
                    await self._report()
                except EtcdError as exc:
                    log.debug("drain report: %s", exc)  # the keepalive notices outages

    async def _report(self) -> None:
        """Publish this instance's drain reports; mark a backend drained once it is everywhere."""
        local: dict[str, Backend] = {
            b.id: b for pool in self.state.pools for b in pool.backends.values()
        }
        shared = self.snap.backends()
        for bid in list(self._reported):
            if bid not in local and bid not in shared:
                await self.etcd.delete(f"{self.prefix}{DRAIN}{bid}/{self.instance}")
                self._reported.pop(bid, None)
        for bid in sorted(local.keys() | shared.keys()):
            b = local.get(bid)
            state = self.snap.state(bid)
            want: DrainReport | None = None
            if b is None:
                # Not run here (its pool is not in this instance's config): nothing to drain,
                # so this instance must not hold up "drained everywhere".
                if state.state != ACTIVE:
                    want = DrainReport(DRAINED)
            elif state.state != ACTIVE and bid in self.by_cluster and b.admin_state != ACTIVE:
                progress = self.local.drainer.progress.get(bid)
                want = DrainReport(
                    DRAINED if b.admin_state == DRAINED else DRAINING,
                    b.sessions,
                    progress.migrated if progress is not None else 0,
                )
            if want != self._reported.get(bid):
                key = f"{self.prefix}{DRAIN}{bid}/{self.instance}"
                if want is None:
                    await self.etcd.delete(key)
                    self._reported.pop(bid, None)
                else:
                    await self.etcd.put(key, want.encode(), self.lease)
                    self._reported[bid] = want
            if state.state == DRAINING and self.snap.drained_everywhere(bid):
                key = self.prefix + STATE + bid
                done = replace(state, state=DRAINED, at=time.time())
                body = {
                    "compare": [compare_mod(key, self.snap.mod_revision(STATE + bid))],
                    "success": [put_op(key, done.encode())],
                    "failure": [],
                }
                if await self.etcd.txn(body):
                    log.info("backend %s drained on every instance", bid)

    def scraped(self, b: Backend) -> None:
        """After a scrape: sessions other instances hold on the worker (module docstring)."""
        running = b.signals.running if b.signals is not None else None
        b.remote_sessions = 0 if running is None else max(0, int(running) - b.sessions)

    # -- admin writes ----------------------------------------------------------------------

    async def _until(self, done: Callable[[], bool]) -> bool:
        deadline = self.state.loop.time() + WRITE_WAIT
        while not done():
            if self.state.loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def add_backend(self, pool: Pool, cfg: BackendCfg) -> bool:
        """Write a new backend (active); False when the id exists in etcd."""
        key = self.prefix + BACKENDS + cfg.id
        by, at = self.instance, time.time()
        body = {
            "compare": [compare_created(key)],
            "success": [
                put_op(key, BackendRecord(pool.name, cfg).encode()),
                put_op(self.prefix + STATE + cfg.id, StateRecord(ACTIVE, by=by, at=at).encode()),
            ],
            "failure": [],
        }
        if not await self.etcd.txn(body):
            return False
        await self._until(lambda: self.state.find_backend(cfg.id) is not None)
        return True

    async def remove_backend(self, bid: str) -> str | None:
        """Delete a backend drained on every instance; the reason when it may not be."""
        state = self.snap.state(bid)
        if state.state != DRAINED:
            return f"backend {bid!r} is {state.state} in the cluster; drain it first"
        key = self.prefix + STATE + bid
        body = {
            "compare": [compare_mod(key, self.snap.mod_revision(STATE + bid))],
            "success": [
                delete_op(self.prefix + BACKENDS + bid),
                delete_op(key),
                delete_op(f"{self.prefix}{DRAIN}{bid}/", prefix=True),
            ],
            "failure": [],
        }
        if not await self.etcd.txn(body):
            return f"backend {bid!r} changed meanwhile; try again"
        await self._until(lambda: self.state.find_backend(bid) is None)
        return None

    async def set_state(self, b: Backend, state: str, migrate: bool, timeout: float) -> bool:
        """Write a drain (``draining``) or an undrain (``active``); False if already so."""
        cur = self.snap.state(b.id)
        if (cur.state == ACTIVE) == (state == ACTIVE):
            return False
        rec = StateRecord(state, migrate, timeout, self.instance, time.time())
        await self.etcd.put(self.prefix + STATE + b.id, rec.encode())
        if state == ACTIVE:
            await self._until(lambda: b.admin_state == ACTIVE)
        else:
            await self._until(lambda: b.admin_state != ACTIVE)
        return True

    # -- views -----------------------------------------------------------------------------

    def backend_view(self, bid: str) -> dict[str, Any]:
        """The cluster's side of ``GET /backends/{id}``: shared state, each instance's drain."""
        reports = self.snap.reports(bid)
        return {
            "state": self.snap.state(bid).state,
            "drained_everywhere": self.snap.drained_everywhere(bid),
            "instances": {
                i: {"state": r.state, "left": r.left, "migrated": r.migrated}
                for i, r in sorted(reports.items())
            },
        }

    def status(self) -> dict[str, Any]:
        """What ``/readyz`` says of the store."""
        return {
            "connected": self.synced,
            "instance": self.instance,
            "etcd": self.cfg.etcd,
            "prefix": self.prefix,
            "revision": self.snap.revision,
            "instances": sorted(self.snap.instances()),
            "last_sync_seconds": self.last_sync_age(),
            "disconnected_since": self.down_since,
            "error": None if self.synced else self.last_error,
        }

    def last_sync_age(self) -> float | None:
        if self.last_ok is None:
            return None
        return round(self.state.loop.time() - self.last_ok, 3)

    def collector(self) -> Collector:
        return _Collector(self)


class _Collector(Collector):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        c = self.cluster
        up = GaugeMetricFamily(
            "wslb_cluster_connected", "1 while the instance is in sync with etcd (watch running)"
        )
        up.add_metric([], 1 if c.synced else 0)
        yield up
        synced = GaugeMetricFamily(
            "wslb_cluster_last_sync_timestamp_seconds",
            "When etcd last answered this instance (Unix time; 0 if never)",
        )
        last = c.last_sync_age()
        synced.add_metric([], 0.0 if last is None else time.time() - last)
        yield synced
        rev = GaugeMetricFamily("wslb_cluster_revision", "etcd revision applied")
        rev.add_metric([], c.snap.revision)
        yield rev
        inst = GaugeMetricFamily("wslb_cluster_instances", "Live instances registered in etcd")
        inst.add_metric([], len(c.snap.instances()))
        yield inst
        resync = CounterMetricFamily(
            "wslb_cluster_resyncs", "Full reads of the prefix (start, reconnects, compactions)"
        )
        resync.add_metric([], c.resyncs)
        yield resync
        table = c.placements
        known = GaugeMetricFamily(
            "wslb_cluster_placements", "Key placements this instance knows (the shared table)"
        )
        known.add_metric([], len(table))
        yield known
        writes = CounterMetricFamily(
            "wslb_cluster_placement_writes", "Key placements this instance wrote to etcd"
        )
        writes.add_metric([], table.written)
        yield writes
        dropped = CounterMetricFamily(
            "wslb_cluster_placement_writes_dropped",
            "Key placements never written: the queue was full while etcd was away",
        )
        dropped.add_metric([], table.dropped)
        yield dropped


class ClusterControl:
    """The ``Control`` of an instance in cluster mode (``control.py``).

    Backend writes (add, remove, drain, undrain) go to etcd and reach every instance through
    its watch, this one's included; the answer waits up to ``WRITE_WAIT`` for it. Backend views
    add the shared state; sessions, migrations and reloads stay this instance's.
    """

    def __init__(self, local: LocalControl, cluster: Cluster) -> None:
        self.local = local
        self.cluster = cluster

    async def ready(self) -> Reply:
        if self.local.state.closing:
            return Reply({"status": "shutting down"}, 503)
        # 200 either way: routing goes on with the last known state, and a store blip must not
        # pull every replica out of its Service at once.
        status = self.cluster.status()
        return Reply({"status": "ready", "degraded": not status["connected"], "cluster": status})

    async def metrics(self) -> bytes:
        return await self.local.metrics()  # the cluster's collector is in the registry

    def _with_cluster(self, view: dict[str, Any]) -> dict[str, Any]:
        view["cluster"] = self.cluster.backend_view(view["id"])
        return view

    async def backends(self) -> list[dict[str, Any]]:
        return [self._with_cluster(v) for v in await self.local.backends()]

    async def backend(self, backend_id: str) -> dict[str, Any]:
        return self._with_cluster(await self.local.backend(backend_id))

    async def sessions(self, backend_id: str | None) -> list[dict[str, Any]]:
        return await self.local.sessions(backend_id)

    async def session(self, sid: str) -> dict[str, Any]:
        return await self.local.session(sid)

    async def debug_stats(self) -> dict[str, Any]:
        return await self.local.debug_stats()

    async def add_backend(self, body: dict[str, Any]) -> Reply:
        pool, cfg = new_backend(self.local.state, body)
        if cfg.spawn is not None:
            raise ControlError(
                400, "spawn: not shared in cluster mode (every instance would start it)"
            )
        if not await self._store(self.cluster.add_backend(pool, cfg)):
            raise ControlError(409, f"backend {cfg.id!r} exists")
        found = self.local.state.find_backend(cfg.id)
        state = found[1].state if found is not None else "pending"
        return Reply({"id": cfg.id, "pool": pool.name, "state": state}, 201)

    async def remove_backend(self, backend_id: str) -> Reply:
        _, b = self.local.find(backend_id)  # drained on every instance, then gone everywhere
        why = await self._store(self.cluster.remove_backend(b.id))
        if why is not None:
            raise ControlError(409, why)
        return Reply({"id": b.id, "removed": True})

    async def drain(self, backend_id: str, body: dict[str, Any]) -> Reply:
        pool, b = self.local.find(backend_id)
        migrate_, timeout = drain_args(pool, body)
        # Written to etcd; every instance drains its own sessions.
        written = await self._store(self.cluster.set_state(b, DRAINING, migrate_, timeout))
        return Reply(await self.backend(b.id), 202 if written else 200)

    async def undrain(self, backend_id: str) -> Reply:
        _, b = self.local.find(backend_id)
        await self._store(self.cluster.set_state(b, ACTIVE, True, 0.0))
        return Reply(await self.backend(b.id))

    async def migrate(self, sid: str, body: dict[str, Any]) -> Reply:
        return await self.local.migrate(sid, body)

    async def reload(self) -> Reply:
        return await self.local.reload(backends=False)

    async def restart(self, body: dict[str, Any] | None = None) -> Reply:
        return await self.local.restart()  # the new code keeps this instance's place

    async def events(self, since: int, wait: float) -> tuple[list[dict[str, Any]], int]:
        """This instance's events (the shared drain states show as its ``state`` events)."""
        return await self.local.events(since, wait)

    @staticmethod
    async def _store(write: Awaitable[_T]) -> _T:
        """Await an etcd write; an unreachable store is a 503 (nothing was written)."""
        try:
            return await write
        except EtcdError as exc:
            raise ControlError(503, f"cluster store unreachable: {exc}") from None
