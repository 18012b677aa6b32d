"""Cluster mode: a key's worker is the same from every instance, whatever each one's load view.

Instances see each other's load only through their scrapes of the workers (as old as the last
scrape) and count their own holds alone, so their bounded-load views differ. The placement of a
key is a fact the tier shares instead (``balancer.cluster.Placements``): a plain reconnect
through any instance reaches the worker that holds the conversation. The figures are printed;
run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from balancer.cluster import PLACEMENTS, Placement, Placements, Snapshot, b64, digest
from balancer.ring import Ring
from tests.etcd import Etcd
from tests.procs import Worker, Wslb
from tests.test_cluster_etcd import PREFIX, cluster_config, until, worker_for
from tests.test_pool import make_pool, peek, place

# -- the table alone (sans-I/O) ------------------------------------------------------------


def keys_first_on(worker: str, n: int, tag: str, ids: list[str] | None = None) -> list[str]:
    """``n`` keys whose first backend on the ring (of ``ids``, the tier's by default) is
    ``worker``."""
    ring = Ring(dict.fromkeys(ids or IDS, 1.0))
    out = [k for i in range(2000) if next(ring.walk(k := f"{tag}-{i}")) == worker]
    return out[:n]


def test_table_reads_its_own_writes_and_follows_etcd() -> None:
    clock = [1000.0]
    t = Placements(clock=lambda: clock[0])
    woken: list[int] = []
    t.on_queued = lambda: woken.append(1)
    t.remember("chat", "k", "w1", "w0")
    assert t.recall("chat", "k", 600) == Placement("w1", "w0", 1000.0)
    assert t.queued() == 1 and woken == [1]
    t.remember("chat", "k", "w1", "w0")  # unchanged and fresh: nothing more to write
    assert t.queued() == 1
    rel = f"{PLACEMENTS}chat/{digest('k')}"
    # What the watch says of a key whose write is due does not override it...
    t.put(rel, Placement("w2", "w2", 999.0).encode().encode())
    assert t.recall("chat", "k", 600) == Placement("w1", "w0", 1000.0)
    batch = t.take(128)
    t.done(batch)
    assert t.queued() == 0 and t.written == 1
    # ... once written, the watch is the truth (another instance's later write wins).
    t.put(rel, Placement("w2", "w2", 1001.0).encode().encode())
    assert t.recall("chat", "k", 600) == Placement("w2", "w2", 1001.0)
    clock[0] = 1001.0 + 601
    assert t.recall("chat", "k", 600) is None  # older than the window
    t.delete(rel)
    assert len(t) == 0 and not t.touch("chat", "k", "w2")
    t.put(rel, b"not json")
    t.put(f"{PLACEMENTS}nodigest", b"{}")
    assert len(t) == 0


def test_queue_is_bounded_and_the_table_too() -> None:
    t = Placements(size=5, queue=3)
    for i in range(10):
        t.remember("chat", f"k{i}", "w0", "w0")
    assert t.queued() == 3 and t.dropped == 7
    assert len(t) == 5 and t.recall("chat", "k9", 600) is not None
    assert t.recall("chat", "k0", 600) is None


def test_snapshot_keeps_placements_out_of_the_diff() -> None:
    snap = Snapshot(PREFIX)
    rel = f"{PLACEMENTS}chat/{digest('k')}"
    kv = {"key": b64(PREFIX + rel), "value": b64(Placement("w1", None, time.time()).encode())}
    assert snap.event({"kv": {**kv, "mod_revision": "7"}}) is False
    assert snap.kv == {} and snap.revision == 7 and len(snap.placements) == 1
    snap.reset([], 8)  # a full read merges: an entry etcd lost ages out rather than vanishing
    assert len(snap.placements) == 1
    state = {"key": b64(PREFIX + "state/w1"), "value": b64('{"state": "active"}')}
    assert snap.event({"kv": state}) is True


def test_pool_sends_a_returning_key_home_whatever_its_own_view() -> None:
    """Two pools, two instances' views of one tier sharing one table: a key placed by one goes
    to the same worker from the other, whose bound and ceiling would have moved it."""
    shared = Placements()
    one, two = make_pool(3), make_pool(3)
    for pool in (one, two):
        pool.placements = shared.view("p")
    key = "k"
    home = place(one, key)
    # The other instance sees the key's worker far above any bound of its own view.
    two.backends[home].remote_sessions = 50
    assert peek(two, key) == home
    # A standalone pool with the same view moves it (the ceiling).
    alone = make_pool(3)
    alone.backends[home].remote_sessions = 50
    assert peek(alone, key) != home
    # Its home not ready: the ring decides, and the new placement is the tier's.
    two.backends[home].set_health(False)
    moved = place(two, key)
    assert moved != home and peek(one, key) == moved


def test_a_backend_going_and_coming_back_leaves_keys_pushed_off_it_home() -> None:
    """A key the bound pushed off its first backend stays on its worker while that first
    backend goes down and comes back (nothing to return to); a key placed while a backend
    ahead of its first was down goes back to it."""
    shared = Placements()
    pool = make_pool(3)
    pool.placements = shared.view("p")
    first = "w0"
    keys = keys_first_on(first, 12, "k", ["w0", "w1", "w2"])
    homes = {k: place(pool, k) for k in keys}
    pushed = [k for k, h in homes.items() if h != first]
    assert pushed
    for k in keys:
        pool.detach(pool.backends[homes[k]], k)
    pool.hold_s = 0.0
    pool.backends[first].set_health(False)
    for k in pushed:
        pool.detach(pool.backends[place(pool, k)], k)  # back home, while w0 is down
    pool.backends[first].set_health(True)
    assert {k: peek(pool, k) for k in pushed} == {k: homes[k] for k in pushed}


# -- a tier of three instances -------------------------------------------------------------

IDS = ["w0", "w1", "w2"]


def placements_known(lb: Wslb) -> float:
    m = re.search(r"^wslb_cluster_placements (\S+)$", lb.admin("/metrics"), re.M)
    return float(m.group(1)) if m else -1.0


def views(lb: Wslb) -> dict[str, tuple[int, int]]:
    """The instance's load view: (its own sessions, the others' as of its last scrape)."""
    return {b["id"]: (b["sessions"], b["sessions_remote"]) for b in lb.admin("/backends")}


async def hold(lb: Wslb, key: str) -> tuple[ClientConnection, str]:
    ws = await connect(f"{lb.url}/ws?session={key}", open_timeout=5)
    return ws, str(json.loads(await ws.recv())["worker"])


def tier(etcd: Etcd, workers: list[Worker], tmp: Path, *scrapes: str) -> list[Wslb]:
    """One instance per scrape interval; a long one is never fresh again within a test (its
    remote counts stay as its first scrape saw them: stale)."""
    lbs = []
    for every in scrapes:
        weights: dict[str, Any] = {"scrape_interval": every}
        if every.endswith("m"):
            weights["stale_after"] = "30m"  # old but not marked stale: it counts as it was
        lbs.append(Wslb(cluster_config(etcd, workers, weights=weights), tmp))
    return lbs


async def start(lbs: list[Wslb]) -> None:
    await asyncio.gather(*(asyncio.to_thread(lb.start) for lb in lbs))
    for lb in lbs:
        await until(lambda lb=lb: len(lb.admin("/backends")) == 3, 5, "backends from etcd")


async def test_reconnect_through_any_instance_reaches_the_same_worker(tmp_path: Path) -> None:
    """Uneven load and stale scrapes: 120 keys placed through random instances, each then
    reconnected through every other instance, reach the worker they were placed on."""
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(w).start() for w in IDS]
    # A and B scrape often; C scraped once, at its start, while A held its sessions.
    a, b, c = lbs = tier(etcd, workers, tmp_path, "0.3s", "0.3s", "10m")
    held: list[ClientConnection] = []
    figures: dict[str, Any] = {}
    try:
        await start([a, b])
        # Uneven load: A holds 14 sessions, all keys that favour w0; its bound pushes some off.
        for key in keys_first_on("w0", 14, "heavy"):
            held.append((await hold(a, key))[0])
        mine = {k: v[0] for k, v in views(a).items()}
        await until(lambda: {k: v[1] for k, v in views(b).items()} == mine, 5, "B sees A's")
        await start([c])
        await until(lambda: {k: v[1] for k, v in views(c).items()} == mine, 5, "C sees A's")
        # Half of A's sessions end: A holds their places, B sees them gone, C does not.
        for ws in held[:7]:
            await ws.close()
        await until(lambda: sum(v[1] for v in views(b).values()) == 7, 5, "B sees 7 left")
        figures["views"] = {"A": views(a), "B": views(b), "C": views(c)}

        rng = random.Random(7)
        keys = [f"user-{i}" for i in range(120)]
        placed: dict[str, tuple[int, str]] = {}
        for key in keys:
            i = rng.randrange(3)
            placed[key] = (i, await worker_for(lbs[i], key))
        figures["spread"] = dict(sorted(Counter(w for _, w in placed.values()).items()))
        t0 = time.monotonic()
        await until(
            lambda: all(placements_known(lb) >= 134 for lb in lbs), 5, "placements everywhere"
        )
        figures["placements_everywhere_s"] = round(time.monotonic() - t0, 3)

        same = 0
        wrong = []
        for key in keys:
            i, w = placed[key]
            for j, lb in enumerate(lbs):
                if j == i:
                    continue
                got = await worker_for(lb, key)
                if got == w:
                    same += 1
                else:
                    wrong.append((key, "ABC"[i], w, "ABC"[j], got))
        figures["same_worker"] = f"{same}/{2 * len(keys)}"
        assert not wrong, wrong[:20]
        writes = [lb.admin("/metrics") for lb in lbs]
        figures["writes"] = [
            float(m.group(1))
            for t in writes
            if (m := re.search(r"^wslb_cluster_placement_writes_total (\S+)$", t, re.M))
        ]

        # The placements outlive the instance that made them: A goes, a new instance D
        # learns them from its full read and sends A's keys where A placed them.
        for ws in held:
            await ws.close()
        held.clear()
        a.stop()
        d = tier(etcd, workers, tmp_path, "0.3s")[0]
        lbs.append(d)
        await start([d])
        await until(lambda: placements_known(d) >= 134, 5, "D read the placements")
        by_a = [k for k in keys if placed[k][0] == 0]
        assert [await worker_for(d, k) for k in by_a] == [placed[k][1] for k in by_a]
        figures["after_instance_loss"] = f"{len(by_a)}/{len(by_a)}"
    finally:
        print("\nplacement figures:", json.dumps(figures))
        for ws in held:
            await ws.close()
        for lb in lbs:
            if lb.proc is not None:
                lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()


async def test_the_reports_two_cases(tmp_path: Path) -> None:
    """A key's own orphan filling its worker's bound in another instance's view, and a stale
    remote count: in both the reconnect reaches the conversation's worker."""
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(w).start() for w in IDS]
    a, b, c = lbs = tier(etcd, workers, tmp_path, "0.2s", "0.2s", "10m")
    held: list[ClientConnection] = []
    try:
        await start(lbs)
        # 1. The orphan: the key's first session, through A, is still open on its worker (the
        # client went away without a close); B's scrape counts it, and in B's view it alone
        # fills the worker's bound (ceil(1.25 x 2/3) = 1).
        key = "orphan"
        ws, home = await hold(a, key)
        held.append(ws)
        await until(lambda: views(b)[home][1] == 1, 5, "B counts the orphan")
        assert await worker_for(b, key) == home
        await ws.close()
        await until(lambda: all(v[1] == 0 for v in views(b).values()), 5, "orphan gone")

        # 2. A stale remote count: A fills w0 up to its bound with sessions C never scraped
        # (C's only scrape was at its start); A pushes the next w0 key off, C's view does not.
        for k in keys_first_on("w0", 6, "fill"):
            held.append((await hold(a, k))[0])
        pushed = ""
        for k in keys_first_on("w0", 40, "late"):
            if await worker_for(a, k) != "w0":
                pushed = k
                break
        assert pushed, views(a)
        assert views(c)["w0"] == (0, 0)  # C's view: w0 idle
        t0 = time.monotonic()
        await until(lambda: placements_known(c) >= placements_known(a), 5, "C knows the placements")
        print(f"\nplacement seen by the stale instance after {time.monotonic() - t0:.3f}s")
        assert await worker_for(c, pushed) == await worker_for(a, pushed) != "w0"
    finally:
        for ws in held:
            await ws.close()
        for lb in lbs:
            if lb.proc is not None:
                lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()


async def test_placements_made_while_etcd_is_away_go_out_when_it_is_back(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(w).start() for w in IDS]
    a, b = lbs = tier(etcd, workers, tmp_path, "0.3s", "0.3s")
    try:
        await start(lbs)
        etcd.stop()
        await until(lambda: not a.admin("/readyz")["cluster"]["connected"], 5, "A notices")
        keys = [f"away-{i}" for i in range(20)]
        homes = [await worker_for(a, k) for k in keys]
        assert [await worker_for(a, k) for k in keys] == homes  # A remembers its own
        assert placements_known(a) == 20 and placements_known(b) == 0
        etcd.start()
        took = await until(lambda: placements_known(b) == 20, 10, "B learns A's placements")
        print(f"\nplacements made while etcd was away reached the other instance {took:.2f}s "
              "after etcd came back")  # fmt: skip
        assert [await worker_for(b, k) for k in keys] == homes
        assert "wslb_cluster_placement_writes_dropped_total 0.0" in a.admin("/metrics")
    finally:
        for lb in lbs:
            if lb.proc is not None:
                lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()
