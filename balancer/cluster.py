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

:class:`Snapshot` is the instance's copy of the prefix (a full read, then watch events applied in
order). :func:`plan` compares what it says with the local pools and returns the actions that
make them agree; it is a pure diff, so applying it after every event, after a re-read, or twice
is harmless (idempotent). The ``_op``/``compare_*`` helpers build etcd v3 JSON-gateway bodies
(keys and values base64).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from balancer.backend import AdminState
from balancer.config import BackendCfg, Config, ConfigError, parse_backend

__all__ = [
    "ACTIVE",
    "DRAINED",
    "DRAINING",
    "Add",
    "BackendRecord",
    "DrainReport",
    "Local",
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


class Snapshot:
    """The instance's copy of the prefix: a full read, then watch events in revision order."""

    def __init__(self, prefix: str) -> None:
        self.prefix = normalize_prefix(prefix)
        self.kv: dict[str, tuple[bytes, int]] = {}  # relative key -> (value, mod_revision)
        self.revision = 0
        self.bad: dict[str, str] = {}  # relative key -> why its value was ignored
        # Decoded backend records by key, valid for one mod_revision: the diff runs often and
        # a record's validation (the config file's rules) is not free.
        self._records: dict[str, tuple[int, BackendRecord | str]] = {}

    def _rel(self, key: bytes) -> str | None:
        text = key.decode(errors="replace")
        return text[len(self.prefix) :] if text.startswith(self.prefix) else None

    def reset(self, kvs: Iterable[Mapping[str, Any]], revision: int) -> None:
        """Replace everything with a full range read (gateway ``kvs`` entries)."""
        self.kv.clear()
        for kv in kvs:
            self.put(kv)
        self.revision = revision

    def put(self, kv: Mapping[str, Any]) -> None:
        rel = self._rel(unb64(kv["key"]))
        if rel is not None:
            self.kv[rel] = (unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))

    def delete(self, kv: Mapping[str, Any]) -> None:
        rel = self._rel(unb64(kv["key"]))
        if rel is not None:
            self.kv.pop(rel, None)

    def event(self, ev: Mapping[str, Any]) -> None:
        """One watch event (``type`` absent means PUT: the gateway omits zero values)."""
        kv = ev.get("kv", {})
        if ev.get("type") == "DELETE":
            self.delete(kv)
        else:
            self.put(kv)
        self.revision = max(self.revision, int(kv.get("mod_revision", 0)))

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
