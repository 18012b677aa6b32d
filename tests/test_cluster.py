"""Cluster mode's sans-I/O core: key layout, records, the snapshot and the diff (no etcd)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from balancer import cluster as cl
from balancer.config import BackendCfg, parse

P = "/wslb/"


def kv(key: str, value: str | dict[str, Any], mod: int = 1) -> dict[str, Any]:
    """An entry as the gateway returns it (base64 key and value, int64 as strings)."""
    raw = value if isinstance(value, str) else json.dumps(value)
    return {
        "key": base64.b64encode(key.encode()).decode(),
        "value": base64.b64encode(raw.encode()).decode(),
        "mod_revision": str(mod),
    }


def backend(bid: str, url: str | None = None, weight: float = 1.0, pool: str = "chat") -> str:
    cfg = BackendCfg(bid, url or f"ws://127.0.0.1:9{bid[-1]}01/ws", weight)
    return cl.BackendRecord(pool, cfg).encode()


def snapshot(*entries: dict[str, Any], revision: int = 10) -> cl.Snapshot:
    snap = cl.Snapshot(P)
    snap.reset(entries, revision)
    return snap


def local(snap: cl.Snapshot, **states: str) -> dict[str, cl.Local]:
    """Local backends exactly as the snapshot says, with the given admin states."""
    return {
        bid: cl.Local(rec.pool, rec.cfg, states.get(bid, cl.ACTIVE), False)
        for bid, rec in snap.backends().items()
    }


def test_prefix_and_range_end() -> None:
    assert cl.normalize_prefix("/wslb") == cl.normalize_prefix("/wslb/") == "/wslb/"
    assert cl.prefix_end("/wslb/") == b"/wslb0"
    assert cl.prefix_end("a\xff") == b"a\xc3\xc0"  # on the UTF-8 bytes: last byte + 1
    assert cl.b64("/wslb/") == base64.b64encode(b"/wslb/").decode()


def test_backend_record_round_trip_keeps_only_what_is_shared() -> None:
    cfg = BackendCfg("w1", "ws://10.0.0.1:9000/ws", 2.5, "reference", ("--x",), "http://m/")
    raw = cl.BackendRecord("chat", cfg).encode()
    assert "spawn" not in json.loads(raw) and "args" not in json.loads(raw)
    back = cl.BackendRecord.decode(raw.encode())
    assert back.pool == "chat" and back.shared() == (cfg.url, 2.5, "http://m/")
    assert back.cfg.spawn is None


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"{}", b'{"pool": "chat", "id": "x"}', b'{"pool": "chat", "id": "x", "url": "h://"}'],
)
def test_bad_backend_records_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        cl.BackendRecord.decode(raw)


def test_state_record_round_trip_and_infinite_timeout() -> None:
    rec = cl.StateRecord(cl.DRAINING, False, float("inf"), "a-1", 5.0)
    assert json.loads(rec.encode())["timeout"] is None  # strict JSON
    assert cl.StateRecord.decode(rec.encode().encode()) == rec
    with pytest.raises(ValueError):
        cl.StateRecord.decode(b'{"state": "paused"}')


def test_snapshot_applies_events_in_order() -> None:
    snap = snapshot(kv(P + "backends/w1", backend("w1"), 3), revision=5)
    assert set(snap.backends()) == {"w1"} and snap.revision == 5
    snap.event({"kv": kv(P + "backends/w2", backend("w2"), 6)})  # PUT: type omitted
    snap.event(
        {"type": "DELETE", "kv": {"key": kv(P + "backends/w1", "")["key"], "mod_revision": "7"}}
    )
    assert set(snap.backends()) == {"w2"} and snap.revision == 7
    assert snap.mod_revision("backends/w2") == 6 and snap.mod_revision("backends/w1") == 0
    snap.event({"kv": kv("/other/backends/w9", backend("w9"), 8)})  # outside the prefix
    assert set(snap.backends()) == {"w2"}


def test_snapshot_skips_bad_values_and_reports_them() -> None:
    snap = snapshot(
        kv(P + "backends/w1", backend("w1")),
        kv(P + "backends/w2", "not json {"),
        kv(P + "backends/w3", backend("other-id")),
        kv(P + "state/w1", {"state": "sleeping"}),
    )
    assert set(snap.backends()) == {"w1"}
    assert snap.state("w1") == cl.StateRecord()  # unreadable state: active
    actions, warnings = cl.plan(snap, {}, ["chat"])
    assert actions == [cl.Add("chat", snap.backends()["w1"].cfg)]
    assert len(warnings) == 3 and all("ignored" in w for w in warnings)


def test_plan_adds_removes_and_updates() -> None:
    snap = snapshot(
        kv(P + "backends/w1", backend("w1", weight=3.0)),
        kv(P + "backends/w2", backend("w2")),
        kv(P + "backends/x", backend("x", url="ws://h/", pool="nope")),
    )
    have = {
        "w1": cl.Local("chat", BackendCfg("w1", "ws://127.0.0.1:9101/ws", 1.0), cl.ACTIVE, False),
        "old": cl.Local("chat", BackendCfg("old", "ws://h/"), cl.ACTIVE, False),
    }
    actions, warnings = cl.plan(snap, have, ["chat"])
    assert actions == [
        cl.Remove("old"),
        cl.Update("w1", snap.backends()["w1"].cfg),
        cl.Add("chat", snap.backends()["w2"].cfg),
    ]
    assert warnings == ["backend x: no pool 'nope' in this instance's config"]


def test_plan_is_idempotent_once_applied() -> None:
    snap = snapshot(kv(P + "backends/w1", backend("w1")), kv(P + "backends/w2", backend("w2")))
    assert cl.plan(snap, local(snap), ["chat"]) == ([], [])
    # A local spawn (never shared) is not a difference.
    mine = local(snap)
    w1 = mine["w1"]
    mine["w1"] = cl.Local(
        w1.pool, BackendCfg(w1.cfg.id, w1.cfg.url, spawn="reference"), "active", False
    )
    assert cl.plan(snap, mine, ["chat"]) == ([], [])


def test_plan_drains_and_undrains_only_what_the_cluster_drained() -> None:
    drain = cl.StateRecord(cl.DRAINING, True, 30.0, "a-1", 1.0)
    snap = snapshot(kv(P + "backends/w1", backend("w1")), kv(P + "state/w1", drain.encode()))
    w1 = snap.backends()["w1"].cfg
    # Active here, draining in etcd: drain it.
    assert cl.plan(snap, local(snap), ["chat"])[0] == [cl.SetState("w1", drain)]
    # Drained by the worker itself (SIGTERM): the cluster takes the drain over, nothing restarts.
    own = {"w1": cl.Local("chat", w1, cl.DRAINING, False)}
    assert cl.plan(snap, own, ["chat"])[0] == [cl.SetState("w1", drain)]
    taken = {"w1": cl.Local("chat", w1, cl.DRAINED, True)}
    assert cl.plan(snap, taken, ["chat"])[0] == []
    # Our drain was undone meanwhile (a late undrain): drain again.
    undone = {"w1": cl.Local("chat", w1, cl.ACTIVE, True)}
    assert cl.plan(snap, undone, ["chat"])[0] == [cl.SetState("w1", drain)]
    # Active in etcd: undo our drain, leave a drain that is not ours.
    active = snapshot(kv(P + "backends/w1", backend("w1")))
    assert cl.plan(active, taken, ["chat"])[0] == [cl.SetState("w1", cl.StateRecord())]
    assert cl.plan(active, own, ["chat"])[0] == []
    # A new backend that is already draining is added, then drained.
    assert cl.plan(snap, {}, ["chat"])[0] == [cl.Add("chat", w1), cl.SetState("w1", drain)]


def test_drained_everywhere_counts_live_instances_only() -> None:
    entries = [
        kv(P + "instances/a", {"admin": "http://a"}),
        kv(P + "instances/b", {"admin": "http://b"}),
        kv(P + "drain/w1/a", cl.DrainReport(cl.DRAINED).encode()),
        kv(P + "drain/w1/b", cl.DrainReport(cl.DRAINING, left=2).encode()),
        kv(P + "drain/w1/gone", cl.DrainReport(cl.DRAINING, left=9).encode()),
    ]
    snap = snapshot(*entries)
    assert not snap.drained_everywhere("w1")
    snap.event({"kv": kv(P + "drain/w1/b", cl.DrainReport(cl.DRAINED).encode(), 11)})
    assert snap.drained_everywhere("w1")  # "gone" has no instance key (its lease expired)
    assert not snapshot().drained_everywhere("w1")  # nobody alive: nothing is known
    assert set(snap.reports("w1")) == {"a", "b", "gone"}


def test_seed_txn_writes_every_backend_once_if_nobody_did() -> None:
    cfg = parse(
        {
            "pools": [
                {"name": "chat", "backends": [{"id": "w1", "url": "ws://h:1/"}]},
                {
                    "name": "batch",
                    "match": {"path_prefix": "/b"},
                    "backends": [{"id": "b1", "url": "ws://h:2/", "weight": 2}],
                },
            ]
        }
    )
    txn = cl.seed_txn("/wslb", cfg, "a-1", 1.0)
    assert txn["compare"] == [cl.compare_created("/wslb/seed")]
    keys = [base64.b64decode(op["request_put"]["key"]).decode() for op in txn["success"]]
    assert keys == ["/wslb/seed", "/wslb/backends/w1", "/wslb/state/w1",
                    "/wslb/backends/b1", "/wslb/state/b1"]  # fmt: skip
    snap = snapshot(*(dict(op["request_put"], mod_revision="2") for op in txn["success"]))
    assert snap.seeded and snap.backends()["b1"].pool == "batch"
    assert snap.backends()["b1"].cfg.weight == 2.0


def test_gateway_bodies() -> None:
    assert cl.put_op("/k", "v", lease=7) == {
        "request_put": {"key": cl.b64("/k"), "value": cl.b64("v"), "lease": "7"}
    }
    assert cl.delete_op("/d/", prefix=True) == {
        "request_delete_range": {"key": cl.b64("/d/"), "range_end": cl.b64(b"/d0")}
    }
    assert cl.compare_mod("/k", 12)["mod_revision"] == "12"


def test_reseed_puts_back_backends_and_states_only() -> None:
    drain = cl.StateRecord(cl.DRAINING, True, 30.0, "a-1", 1.0).encode()
    snap = snapshot(
        kv(P + "seed", {"by": "a-1"}),
        kv(P + "backends/w1", backend("w1")),
        kv(P + "state/w1", drain),
        kv(P + "instances/a-1", {"admin": "http://a"}),
        kv(P + "drain/w1/a-1", cl.DrainReport(cl.DRAINING).encode()),
    )
    txn = cl.reseed_txn(snap, "b-2", 2.0)
    assert txn["compare"] == [cl.compare_created(P + "seed")]
    puts = {
        base64.b64decode(op["request_put"]["key"]).decode(): op["request_put"]["value"]
        for op in txn["success"]
    }
    assert set(puts) == {P + "seed", P + "backends/w1", P + "state/w1"}  # no leased keys
    assert base64.b64decode(puts[P + "state/w1"]).decode() == drain
