"""Cluster mode, sans-I/O: what several wslb instances share in etcd, and how one applies it.

Several instances act as one balancer by sharing, under ``cluster.prefix`` (``P``) in etcd, what an
operator changes: backends, their static weights and their admin state. Everything on the hot
path (sessions, scraped signals, health) stays local to each instance. Keys (values are JSON):

``P seed``
    written once, with the first backends, by the first instance that finds the prefix empty
    (a transaction on ``create_revision == 0``, so instances starting together do not fight);
    once it exists the file's backends are ignored and etcd is the source of truth. Should it
    vanish (an etcd restored empty), the first instance to notice writes back the backends and
    states it last knew (:func:`reseed_txn`) rather than letting every instance drop them.
``P backends/{id}``
    ``{"pool", "id", "url", "weight", "metrics_url"}``: membership and static weight. ``spawn``
    and ``args`` are never shared (each instance would start its own copy of the worker); an
    instance whose own file has the same id and URL keeps its local ``spawn``.
``P state/{id}``
    ``{"state": active|draining|drained, "migrate", "timeout", "by", "at"}``: the operator's
    intent. ``draining`` makes every instance drain the backend locally (migrating its own
    sessions); ``drained`` is written (by whichever instance sees it first, in a transaction on
    the key's ``mod_revision``) once every live instance reports the backend drained.
``P instances/{instance}``
    ``{"admin", "started"}`` under the instance's lease: who is alive.
``P drain/{id}/{instance}``
    ``{"state": draining|drained, "left", "migrated"}`` under the instance's lease: each
    instance's drain progress; a dead instance's reports vanish with its lease.
``P placements/{pool}/{digest}``
    ``{"backend", "first", "at"}``: where a session key was last placed (the affinity table,
    shared by the tier; ``digest`` is a hash of the key, which never leaves the instance), the
    key's first ready backend on the ring then, and when (Unix time). Written in batches off
    the hot path on a lease of the affinity window's length, not the instance's (a key's place
    outlives the instance that placed it, and expires by itself when every instance is gone).

Placements (:class:`Placements`): every instance applies the prefix's placements from its full
read and watch into a bounded table and reads it locally, so a key's reconnect through any
instance finds the worker holding its conversation without a round trip to etcd. An instance
writes a placement when it places a key (:meth:`Placements.remember`: to its own table at once,
to etcd with the next batch) and refreshes it when the key's session ends, at most once per
``REFRESH_S`` per key; a returning key whose placement is unchanged writes nothing. While a write
waits, the instance keeps its own value over what the watch says of that key. Two instances that
place the same *new* key within the watch's latency both write it: the last write wins, and
every instance follows it. Writes wait in a bounded queue while etcd is away; past
``QUEUE_MAX`` the oldest are dropped (and counted): those keys are then placed again by the
ring when they return. A full read merges into the table rather than replacing it: an entry
etcd lost (a restore from empty) is kept until it ages out, and one that expired there has aged
out here too.

:class:`Snapshot` is the instance's copy of the prefix (a full read, then watch events applied in
order). :func:`plan` compares what it says with the local pools and returns the actions that
make them agree; it is a pure diff, so applying it after every event, after a re-read, or twice
is harmless (idempotent). The ``_op``/``compare_*`` helpers build etcd v3 JSON-gateway bodies
(keys and values base64).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from balancer.backend import AdminState
from balancer.config import BackendCfg, Config, ConfigError, parse_backend
from balancer.pool import AFFINITY_TTL

__all__ = [
    "ACTIVE",
    "DRAINED",
    "DRAINING",
    "Add",
    "BackendRecord",
    "DrainReport",
    "Local",
    "Placement",
    "Placements",
    "Remove",
    "SetState",
    "Snapshot",
    "StateRecord",
    "Update",
    "b64",
    "compare_created",
    "compare_mod",
    "delete_op",
    "normalize_prefix",
    "plan",
    "prefix_end",
    "put_op",
    "reseed_txn",
    "seed_txn",
    "unb64",
]

# The admin states are defined once (``balancer.backend.AdminState``); the members are ``str``,
# so the JSON below holds the plain words.
ACTIVE = AdminState.ACTIVE
DRAINING = AdminState.DRAINING
DRAINED = AdminState.DRAINED
STATES = (ACTIVE, DRAINING, DRAINED)

SEED = "seed"
BACKENDS = "backends/"
STATE = "state/"
INSTANCES = "instances/"
DRAIN = "drain/"
PLACEMENTS = "placements/"

REFRESH_S = AFFINITY_TTL / 10  # a placement is written again when older than this
QUEUE_MAX = 10_000  # placements waiting for etcd; past it the oldest are dropped
TABLE_MAX = 100_000  # placements kept per pool (the local affinity table's size)


def normalize_prefix(prefix: str) -> str:
    """``/wslb`` and ``/wslb/`` name the same prefix; keys always follow a ``/``."""
    return prefix if prefix.endswith("/") else prefix + "/"


def prefix_end(key: str) -> bytes:
    """etcd's ``range_end`` for every key starting with ``key`` (last byte + 1)."""
    raw = bytearray(key.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"  # every key
    raw[-1] += 1
    return bytes(raw)


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


# -- records ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackendRecord:
    """``P backends/{id}``: a backend as every instance shares it."""

    pool: str
    cfg: BackendCfg

    def encode(self) -> str:
        c = self.cfg
        out: dict[str, Any] = {"pool": self.pool, "id": c.id, "url": c.url, "weight": c.weight}
        if c.metrics_url:
            out["metrics_url"] = c.metrics_url
        return json.dumps(out, sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes) -> BackendRecord:
        """Raises ValueError for anything the file's rules would refuse."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        pool = data.pop("pool", None)
        if not isinstance(pool, str):
            raise ValueError("pool missing")
        try:
            cfg = parse_backend(data)
        except ConfigError as exc:
            raise ValueError("; ".join(exc.errors)) from None
        return cls(pool, cfg)

    def shared(self) -> tuple[str, float, str | None]:
        """What etcd decides about a backend (the rest is local)."""
        return (self.cfg.url, self.cfg.weight, self.cfg.metrics_url)


@dataclass(frozen=True, slots=True)
class StateRecord:
    """``P state/{id}``: the operator's intent for a backend."""

    state: str = ACTIVE
    migrate: bool = True
    timeout: float = 60.0
    by: str = ""
    at: float = 0.0

    def encode(self) -> str:
        return json.dumps(
            {
                "state": self.state,
                "migrate": self.migrate,
                "timeout": None if self.timeout == float("inf") else self.timeout,
                "by": self.by,
                "at": self.at,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> StateRecord:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("state") not in STATES:
            raise ValueError("state must be one of active, draining, drained")
        timeout = data.get("timeout", 60.0)
        return cls(
            state=str(data["state"]),
            migrate=bool(data.get("migrate", True)),
            timeout=float("inf") if timeout is None else float(timeout),
            by=str(data.get("by", "")),
            at=float(data.get("at", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class DrainReport:
    """``P drain/{id}/{instance}``: one instance's drain of one backend."""

    state: str
    left: int = 0
    migrated: int = 0

    def encode(self) -> str:
        return json.dumps({"state": self.state, "left": self.left, "migrated": self.migrated})

    @classmethod
    def decode(cls, raw: bytes) -> DrainReport:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("state") not in (DRAINING, DRAINED):
            raise ValueError("state must be draining or drained")
        return cls(str(data["state"]), int(data.get("left", 0)), int(data.get("migrated", 0)))


def digest(key: str) -> str:
    """A session key's name in etcd: a stable hash (keys are the clients', never shared)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Placement:
    """``P placements/{pool}/{digest}``: where a key was last placed."""

    backend: str
    first: str | None  # the key's first ready backend on the ring then
    at: float  # Unix time of the placement (or its last refresh)

    def encode(self) -> str:
        return json.dumps({"backend": self.backend, "first": self.first, "at": self.at})

    @classmethod
    def decode(cls, raw: bytes) -> Placement:
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("backend"), str):
            raise ValueError("backend missing")
        first = data.get("first")
        if first is not None and not isinstance(first, str):
            raise ValueError("first must be a backend id or null")
        return cls(data["backend"], first, float(data.get("at", 0.0)))


class Placements:
    """The tier's affinity table as one instance knows it, and its writes to etcd (module
    docstring). ``clock`` is Unix time: the table is shared between machines."""

    def __init__(
        self,
        *,
        size: int = TABLE_MAX,
        queue: int = QUEUE_MAX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.size = size
        self.queue_max = queue
        self.clock = clock
        self._tables: dict[str, OrderedDict[str, Placement]] = {}  # pool -> digest -> placement
        self._queue: OrderedDict[str, Placement] = OrderedDict()  # relative key -> to write
        self.written = 0  # placements written to etcd
        self.dropped = 0  # placements dropped from a full queue (etcd away too long)
        # Called when the queue stops being empty (the shell's writer wakes up).
        self.on_queued: Callable[[], None] | None = None

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    # -- what the watch says ---------------------------------------------------------------

    @staticmethod
    def _split(rel: str) -> tuple[str, str] | None:
        pool, sep, dig = rel[len(PLACEMENTS) :].rpartition("/")
        return (pool, dig) if sep and pool and dig else None

    def put(self, rel: str, raw: bytes) -> None:
        """A placement read or watched (``rel``: its key under the prefix)."""
        where = self._split(rel)
        if where is None or rel in self._queue:  # our own write is due: it supersedes this
            return
        try:
            p = Placement.decode(raw)
        except ValueError:
            return  # not ours to judge: the key is placed by the ring, as if unknown
        self._set(where[0], where[1], p)

    def delete(self, rel: str) -> None:
        """A placement gone from etcd (its lease expired)."""
        where = self._split(rel)
        if where is None or rel in self._queue:
            return
        table = self._tables.get(where[0])
        if table is not None:
            table.pop(where[1], None)

    def _set(self, pool: str, dig: str, p: Placement) -> None:
        table = self._tables.get(pool)
        if table is None:
            table = self._tables[pool] = OrderedDict()
        table[dig] = p
        table.move_to_end(dig)
        while len(table) > self.size:
            table.popitem(last=False)

    # -- the pool's side (``balancer.pool.SharedPlacements``, through ``view``) ------------

    def recall(self, pool: str, key: str, ttl: float) -> Placement | None:
        table = self._tables.get(pool)
        p = table.get(digest(key)) if table is not None else None
        if p is None or self.clock() - p.at > ttl:
            return None
        return p

    def remember(self, pool: str, key: str, backend: str, first: str | None) -> None:
        """The key is placed on ``backend``: known here now, written to etcd unless etcd has
        it already (same placement, younger than ``REFRESH_S``)."""
        dig = digest(key)
        now = self.clock()
        table = self._tables.get(pool)
        cur = table.get(dig) if table is not None else None
        same = cur is not None and (cur.backend, cur.first) == (backend, first)
        if same and cur is not None and now - cur.at < REFRESH_S:
            return
        p = Placement(backend, first, now)
        self._set(pool, dig, p)
        self._write(f"{PLACEMENTS}{pool}/{dig}", p)

    def touch(self, pool: str, key: str, backend: str) -> bool:
        """The key's session on ``backend`` ended: refresh its placement if it is still there
        and due. False when the table does not know the key (the caller remembers it)."""
        table = self._tables.get(pool)
        cur = table.get(digest(key)) if table is not None else None
        if cur is None:
            return False
        if cur.backend == backend:
            self.remember(pool, key, backend, cur.first)
        return True

    def view(self, pool: str) -> PoolPlacements:
        return PoolPlacements(self, pool)

    # -- writes (the shell sends them) -----------------------------------------------------

    def _write(self, rel: str, p: Placement) -> None:
        was_empty = not self._queue
        self._queue[rel] = p
        self._queue.move_to_end(rel)
        while len(self._queue) > self.queue_max:
            self._queue.popitem(last=False)
            self.dropped += 1
        if was_empty and self.on_queued is not None:
            self.on_queued()

    def queued(self) -> int:
        return len(self._queue)

    def take(self, n: int) -> list[tuple[str, Placement]]:
        """Up to ``n`` writes, oldest first (until ``done`` or ``failed`` they stay ours)."""
        out = []
        for rel, p in self._queue.items():
            out.append((rel, p))
            if len(out) >= n:
                break
        return out

    def done(self, batch: Iterable[tuple[str, Placement]]) -> None:
        """The batch is in etcd: its echoes may apply (unless a newer write is queued)."""
        for rel, p in batch:
            if self._queue.get(rel) is p:
                del self._queue[rel]
                self.written += 1


class PoolPlacements:
    """One pool's view of :class:`Placements` (what ``Pool.placements`` calls)."""

    __slots__ = ("pool", "table")

    def __init__(self, table: Placements, pool: str) -> None:
        self.table = table
        self.pool = pool

    def remember(self, key: str, backend_id: str, first: str | None) -> None:
        self.table.remember(self.pool, key, backend_id, first)

    def touch(self, key: str, backend_id: str) -> bool:
        return self.table.touch(self.pool, key, backend_id)

    def recall(self, key: str, ttl: float) -> tuple[str, str | None, float] | None:
        p = self.table.recall(self.pool, key, ttl)
        return None if p is None else (p.backend, p.first, p.at)


class Snapshot:
    """The instance's copy of the prefix: a full read, then watch events in revision order."""

    def __init__(self, prefix: str) -> None:
        self.prefix = normalize_prefix(prefix)
        self.kv: dict[str, tuple[bytes, int]] = {}  # relative key -> (value, mod_revision)
        self.revision = 0
        self.bad: dict[str, str] = {}  # relative key -> why its value was ignored
        # ``P placements/``: kept apart from ``kv`` (many keys; the diff never reads them).
        self.placements = Placements()
        # Decoded backend records by key, valid for one mod_revision: the diff runs often and
        # a record's validation (the config file's rules) is not free.
        self._records: dict[str, tuple[int, BackendRecord | str]] = {}

    def _rel(self, key: bytes) -> str | None:
        text = key.decode(errors="replace")
        return text[len(self.prefix) :] if text.startswith(self.prefix) else None

    def reset(self, kvs: Iterable[Mapping[str, Any]], revision: int) -> None:
        """Replace everything with a full range read (gateway ``kvs`` entries); placements
        are merged (module docstring)."""
        self.kv.clear()
        for kv in kvs:
            self.put(kv)
        self.revision = revision

    def put(self, kv: Mapping[str, Any]) -> bool:
        """Apply a key's value; True unless it is a placement (the diff has nothing to do)."""
        rel = self._rel(unb64(kv["key"]))
        if rel is None:
            return False
        value = unb64(kv.get("value", ""))
        if rel.startswith(PLACEMENTS):
            self.placements.put(rel, value)
            return False
        self.kv[rel] = (value, int(kv.get("mod_revision", 0)))
        return True

    def delete(self, kv: Mapping[str, Any]) -> bool:
        rel = self._rel(unb64(kv["key"]))
        if rel is None:
            return False
        if rel.startswith(PLACEMENTS):
            self.placements.delete(rel)
            return False
        self.kv.pop(rel, None)
        return True

    def event(self, ev: Mapping[str, Any]) -> bool:
        """One watch event (``type`` absent means PUT: the gateway omits zero values); True
        when it changed what the diff reads."""
        kv = ev.get("kv", {})
        changed = self.delete(kv) if ev.get("type") == "DELETE" else self.put(kv)
        self.revision = max(self.revision, int(kv.get("mod_revision", 0)))
        return changed

    def mod_revision(self, rel: str) -> int:
        """0 when the key does not exist (what a ``create``/``mod`` compare expects)."""
        entry = self.kv.get(rel)
        return entry[1] if entry is not None else 0

    @property
    def seeded(self) -> bool:
        return SEED in self.kv

    def backends(self) -> dict[str, BackendRecord]:
        out: dict[str, BackendRecord] = {}
        for rel, (raw, mod) in self.kv.items():
            if not rel.startswith(BACKENDS):
                continue
            cached = self._records.get(rel)
            if cached is not None and cached[0] == mod and mod:
                rec: BackendRecord | str = cached[1]
            else:
                try:
                    rec = BackendRecord.decode(raw)
                    if rec.cfg.id != rel[len(BACKENDS) :]:
                        rec = f"id {rec.cfg.id!r} does not match the key"
                except ValueError as exc:
                    rec = str(exc)
                self._records[rel] = (mod, rec)
            if isinstance(rec, str):
                self.bad[rel] = rec
            else:
                out[rec.cfg.id] = rec
        for rel in [k for k in self._records if k not in self.kv]:
            del self._records[rel]
        return out

    def state(self, backend_id: str) -> StateRecord:
        """The backend's intent; a missing or unreadable state key means active."""
        entry = self.kv.get(STATE + backend_id)
        if entry is None:
            return StateRecord()
        try:
            return StateRecord.decode(entry[0])
        except ValueError as exc:
            self.bad[STATE + backend_id] = str(exc)
            return StateRecord()

    def instances(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for rel, (raw, _) in self.kv.items():
            if rel.startswith(INSTANCES):
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = {}
                out[rel[len(INSTANCES) :]] = data if isinstance(data, dict) else {}
        return out

    def reports(self, backend_id: str) -> dict[str, DrainReport]:
        """Each instance's drain report for the backend."""
        head = f"{DRAIN}{backend_id}/"
        out: dict[str, DrainReport] = {}
        for rel, (raw, _) in self.kv.items():
            if rel.startswith(head):
                try:
                    out[rel[len(head) :]] = DrainReport.decode(raw)
                except ValueError as exc:
                    self.bad[rel] = str(exc)
        return out

    def drained_everywhere(self, backend_id: str) -> bool:
        """Every live instance reports the backend drained (and at least one is alive)."""
        live = self.instances()
        reports = self.reports(backend_id)
        return bool(live) and all(
            (r := reports.get(i)) is not None and r.state == DRAINED for i in live
        )


# -- the diff --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Local:
    """A backend as this instance runs it."""

    pool: str
    cfg: BackendCfg
    admin_state: str
    by_cluster: bool  # drained because the shared state said so (an undrain may undo it)


@dataclass(frozen=True, slots=True)
class Add:
    pool: str
    cfg: BackendCfg


@dataclass(frozen=True, slots=True)
class Remove:
    id: str


@dataclass(frozen=True, slots=True)
class Update:
    id: str
    cfg: BackendCfg


@dataclass(frozen=True, slots=True)
class SetState:
    """Drain (``state`` draining/drained) or undrain (active) the local backend."""

    id: str
    state: StateRecord


Action = Add | Remove | Update | SetState


def plan(
    snap: Snapshot, local: Mapping[str, Local], pools: Iterable[str]
) -> tuple[list[Action], list[str]]:
    """Actions that bring the local pools to what the snapshot says, and warnings.

    Backends of an unknown pool and URL changes (remove, then add) are reported, not applied.
    A local drain the cluster did not ask for (a worker that drains itself on SIGTERM, a reload)
    is left alone: only drains marked ``by_cluster`` are undone by an ``active`` state. A
    ``draining``/``drained`` state takes over a local drain (it becomes ``by_cluster``, so a
    probe no longer undoes it) and restarts one that something undid.
    """
    known = set(pools)
    wanted = snap.backends()
    actions: list[Action] = []
    warnings = [f"{k}: ignored ({why})" for k, why in sorted(snap.bad.items())]
    snap.bad.clear()
    for bid in sorted(local):
        if bid not in wanted:
            actions.append(Remove(bid))
    for bid in sorted(wanted):
        rec = wanted[bid]
        cur = local.get(bid)
        state = snap.state(bid)
        if cur is None:
            if rec.pool not in known:
                warnings.append(f"backend {bid}: no pool {rec.pool!r} in this instance's config")
                continue
            actions.append(Add(rec.pool, rec.cfg))
            if state.state != ACTIVE:
                actions.append(SetState(bid, state))
            continue
        if cur.pool != rec.pool or cur.cfg.url != rec.cfg.url:
            warnings.append(f"backend {bid}: pool/url change ignored (remove it, then add it)")
        elif (cur.cfg.weight, cur.cfg.metrics_url) != (rec.cfg.weight, rec.cfg.metrics_url):
            actions.append(Update(bid, rec.cfg))
        if state.state != ACTIVE:
            # Also when a drain of ours was undone meanwhile (a late undrain, a probe).
            if not cur.by_cluster or cur.admin_state == ACTIVE:
                actions.append(SetState(bid, state))
        elif cur.by_cluster:
            actions.append(SetState(bid, state))
    return actions, warnings


# -- etcd v3 JSON gateway bodies -------------------------------------------------------------


def put_op(key: str, value: str | bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete_op(key: str, prefix: bool = False) -> dict[str, Any]:
    body = {"key": b64(key)}
    if prefix:
        body["range_end"] = b64(prefix_end(key))
    return {"request_delete_range": body}


def compare_created(key: str) -> dict[str, Any]:
    """True while ``key`` does not exist."""
    return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}


def compare_mod(key: str, mod_revision: int) -> dict[str, Any]:
    """True while ``key`` is unchanged since ``mod_revision`` (0: does not exist)."""
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}


def seed_txn(prefix: str, config: Config, by: str, at: float) -> dict[str, Any]:
    """The first instance's transaction: the file's backends, all active, if nobody seeded yet."""
    p = normalize_prefix(prefix)
    ops = [put_op(p + SEED, json.dumps({"by": by, "at": at}))]
    for pool in config.pools:
        for b in pool.backends:
            ops.append(put_op(p + BACKENDS + b.id, BackendRecord(pool.name, b).encode()))
            ops.append(put_op(p + STATE + b.id, StateRecord(ACTIVE, by=by, at=at).encode()))
    return {"compare": [compare_created(p + SEED)], "success": ops, "failure": []}


def reseed_txn(snap: Snapshot, by: str, at: float) -> dict[str, Any]:
    """Put back what an instance last knew (backends and states) if the prefix has no seed.

    For an etcd restored empty: rather than every instance dropping its backends, the first
    to notice rebuilds the shared state from its copy; the others then follow it.
    """
    p = snap.prefix
    ops = [put_op(p + SEED, json.dumps({"by": by, "at": at, "restored": True}))]
    for rel, (raw, _) in sorted(snap.kv.items()):
        if rel.startswith((BACKENDS, STATE)):
            ops.append(put_op(p + rel, raw))
    return {"compare": [compare_created(p + SEED)], "success": ops, "failure": []}
