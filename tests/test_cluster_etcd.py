"""Cluster mode end to end: a real etcd, real wslb instances, real workers and clients.

The figures (routing agreement, convergence after an admin write, behaviour while etcd is down
and after it returns) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from tests.etcd import Etcd
from tests.procs import ROOT, Worker, Wslb, pool_config
from tests.test_drain import chat_session

PREFIX = "/wslb-test/"


def cluster_config(etcd: Etcd, workers: list[Worker], **pool: Any) -> dict[str, Any]:
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers], **pool)
    cfg["cluster"] = {"etcd": etcd.url, "prefix": PREFIX}
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    return cfg


def status(lb: Wslb, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{lb.admin_port}{path}", data=data, method=method
    )
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if lb.token:
        req.add_header("Authorization", f"Bearer {lb.token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ctl(lb: Wslb, *args: str) -> subprocess.CompletedProcess[str]:
    admin = f"http://127.0.0.1:{lb.admin_port}"
    cmd = [sys.executable, "-m", "balancer", "ctl", "--admin", admin, *args]
    # No --token: ctl finds the token this wslb generated, as a user's does.
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30, env=lb.env)


async def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` every 10 ms; seconds it took (AssertionError after ``timeout``)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def worker_for(lb: Wslb, key: str) -> str:
    async with connect(f"{lb.url}/ws?session={key}", open_timeout=5) as ws:
        return str(json.loads(await ws.recv())["worker"])


async def routes(lbs: list[Wslb], keys: list[str]) -> list[list[str]]:
    """Each instance's worker for each key: one short session at a time, so no load builds up."""
    out: list[list[str]] = [[] for _ in lbs]
    for key in keys:
        for i, lb in enumerate(lbs):
            out[i].append(await worker_for(lb, key))
    return out


def states(lbs: list[Wslb], bid: str) -> list[str]:
    return [lb.admin(f"/backends/{bid}")["state"] for lb in lbs]


async def test_three_instances_one_balancer(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(f"w{i}", ["--tokens-per-s", "80"]).start() for i in range(3)]
    # This test is about shared state and the ring: scrapes are slow (every instance keeps the
    # same idle view of the workers) and the bound is loose enough not to bind on a handful of
    # sessions. Cluster-wide bounds are the next test's subject.
    weights = {"scrape_interval": "30s"}
    full = cluster_config(etcd, workers, hash_balance_factor=3.0, weights=weights)
    empty = cluster_config(etcd, [], hash_balance_factor=3.0, weights=weights)
    # Two instances list the backends, one lists none: it learns them from etcd.
    lbs = [Wslb(full, tmp_path), Wslb(full, tmp_path), Wslb(empty, tmp_path)]
    figures: dict[str, Any] = {}
    try:
        await asyncio.gather(*(asyncio.to_thread(lb.start) for lb in lbs))  # together: one seed
        for lb in lbs:

            def three(lb: Wslb = lb) -> bool:
                return len(lb.admin("/backends")) == 3

            await until(three, 5, "backends from etcd")
        seed = etcd.call("/v3/kv/range", {"key": _b64(PREFIX + "seed")})
        assert seed.get("count") == "1", seed

        # 1. Same key, same worker, on every instance.
        keys = [f"user-{i}" for i in range(200)]
        table = await routes(lbs, keys)
        agree = sum(1 for a, b, c in zip(*table, strict=True) if a == b == c)
        figures["agreement"] = f"{agree}/200"
        figures["spread"] = dict(sorted(Counter(table[0]).items()))
        assert agree == 200, [
            (k, *w) for k, *w in zip(keys, *table, strict=True) if len(set(w)) > 1
        ]
        assert len(figures["spread"]) == 3

        # 2. A drain issued to one instance is seen by all within 1 s; every instance migrates
        # its own sessions on that worker, and the clients see unbroken streams.
        victim = Counter(table[0]).most_common(1)[0][0]
        on_victim = [k for k, w in zip(keys, table[0], strict=True) if w == victim]
        others = [k for k, w in zip(keys, table[0], strict=True) if w != victim]
        clients = []
        seen: dict[str, int] = {}
        for i, lb in enumerate(lbs):
            mine = on_victim[4 * i : 4 * i + 4] + others[2 * i : 2 * i + 2]
            clients += [asyncio.ensure_future(chat_session(lb.url, k, 3, seen)) for k in mine]
        await until(lambda: len(seen) == len(clients), 30, "everyone mid-answer")
        assert all(lb.admin(f"/backends/{victim}")["sessions"] == 4 for lb in lbs)
        t0 = time.monotonic()
        code, body = status(lbs[0], "POST", f"/backends/{victim}/drain", {"timeout": "20s"})
        assert code == 202, body
        seen = await until(lambda: "active" not in states(lbs, victim), 1.0, "drain everywhere")
        figures["drain_seen_by_all_s"] = round(time.monotonic() - t0, 3)
        figures["drain_write_to_last_instance_s"] = round(seen, 3)
        results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        assert all(r["workers"][-1] != victim for r in results)
        for lb in lbs:
            b = await _wait_backend(lb, victim, lambda b: b["cluster"]["state"] == "drained", 20)
            assert b["state"] == "drained" and b["sessions"] == 0
            assert b["drain"]["migrated"] == b["drain"]["sessions_at_start"] == 4, b["drain"]
            assert b["cluster"]["drained_everywhere"] and len(b["cluster"]["instances"]) == 3
        # While drained, the victim's keys land elsewhere, identically everywhere.
        moved = await routes(lbs, on_victim[:20])
        assert moved[0] == moved[1] == moved[2] and victim not in moved[0]

        # 3. etcd goes away: routing continues on the last known state; readiness says so.
        etcd.stop()
        t0 = time.monotonic()
        await until(
            lambda: all(not lb.admin("/readyz")["cluster"]["connected"] for lb in lbs),
            5,
            "instances notice etcd is gone",
        )
        figures["outage_noticed_s"] = round(time.monotonic() - t0, 3)
        for lb in lbs:
            code, ready = status(lb, "GET", "/readyz")
            assert code == 200 and ready["degraded"] and ready["cluster"]["disconnected_since"]
            assert "wslb_cluster_connected 0.0" in lb.admin("/metrics")
        down = await routes(lbs, keys[:60])
        assert down[0] == down[1] == down[2], "routing diverged while etcd was down"
        assert victim not in down[0]
        assert all(d == t for d, t in zip(down[0], table[0], strict=False) if t != victim)
        code, body = status(lbs[1], "POST", f"/backends/{victim}/undrain", {})
        assert code == 503 and "unreachable" in body["error"], (code, body)

        # 4. etcd returns: every instance catches up, and writes flow again.
        etcd.start()
        t0 = time.monotonic()
        await until(
            lambda: all(lb.admin("/readyz")["cluster"]["connected"] for lb in lbs),
            10,
            "instances reconnect",
        )
        figures["reconnect_after_restart_s"] = round(time.monotonic() - t0, 3)
        assert all("wslb_cluster_connected 1.0" in lb.admin("/metrics") for lb in lbs)
        t0 = time.monotonic()
        code, body = status(lbs[1], "POST", f"/backends/{victim}/undrain", {})
        assert code == 200, body
        await until(lambda: states(lbs, victim) == ["active"] * 3, 1.0, "undrain everywhere")
        figures["undrain_seen_by_all_s"] = round(time.monotonic() - t0, 3)
        again = await routes(lbs, keys)
        agree = sum(1 for a, b, c in zip(*again, strict=True) if a == b == c)
        figures["agreement_after_restart"] = f"{agree}/200"
        assert agree == 200 and again[0] == table[0]  # the victim's keys came back to it

        # 5. etcd comes back empty (its data lost): the first instance to notice writes back
        # what it knew; nobody drops its backends.
        etcd.stop()
        shutil.rmtree(etcd.data_dir)
        etcd.start()
        t0 = time.monotonic()
        await until(
            lambda: all(lb.admin("/readyz")["cluster"]["connected"] for lb in lbs),
            10,
            "instances reconnect to the empty etcd",
        )
        figures["restored_after_data_loss_s"] = round(time.monotonic() - t0, 3)
        restored = etcd.call("/v3/kv/range", {"key": _b64(PREFIX + "backends/"),
                                              "range_end": _b64(PREFIX + "backends0")})  # fmt: skip
        assert restored.get("count") == "3", restored
        assert all(states(lbs, w.id) == ["active"] * 3 for w in workers)
        after = await routes(lbs, keys[:30])
        assert after[0] == after[1] == after[2] == table[0][:30]
    finally:
        print("\ncluster figures:", json.dumps(figures))
        for lb in lbs:
            if lb.proc is not None:
                lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()


async def test_cluster_wide_bounds_and_membership_through_any_instance(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(f"b{i}").start() for i in range(3)]
    cfg = cluster_config(etcd, workers[:2], weights={"scrape_interval": "0.2s"})
    a, b = Wslb(cfg, tmp_path), Wslb(cfg, tmp_path)
    # A third instance serves another pool only: it runs none of these backends, and must not
    # hold up "drained on every instance" below.
    other = cluster_config(etcd, [])
    other["pools"][0]["name"] = "other"
    c = Wslb(other, tmp_path)
    try:
        await asyncio.gather(*(asyncio.to_thread(lb.start) for lb in (a, b, c)))
        await until(lambda: len(a.admin("/readyz")["cluster"]["instances"]) == 3, 5, "3 live")
        assert c.admin("/backends") == []
        # Sessions held through A count in B's bounds (scraped worker totals minus B's own).
        held = [await connect(f"{a.url}/ws?session=held-{i}") for i in range(10)]
        for ws in held:
            await ws.recv()
        local = {x["id"]: x["sessions"] for x in a.admin("/backends")}
        took = await until(
            lambda: {x["id"]: x["sessions_remote"] for x in b.admin("/backends")} == local,
            3,
            "B sees A's sessions",
        )
        print(f"\nremote sessions seen by the other instance after {took:.2f}s: {local}")
        # A counts none of its own as remote once a scrape follows them: one taken while they
        # were opening saw the worker count a session A had not counted yet (until the next, 0.2 s).
        await until(
            lambda: all(x["sessions_remote"] == 0 for x in a.admin("/backends")),
            3,
            "A's own sessions not remote",
        )
        for ws in held:
            await ws.close()

        # Membership with wslb ctl, as the sidecar's hooks do: add through B, drain (and wait
        # for every instance) through A, remove through B; both instances follow.
        assert ctl(b, "--wait-admin", "5", "add", "b2", workers[2].url).returncode == 0
        # ctl returns once B has applied the write (from its own watch); A follows at once.
        add_s = await until(lambda: len(a.admin("/backends")) == 3, 1.0, "A has the new backend")
        again = ctl(a, "add", "b2", workers[2].url)
        assert again.returncode == 1 and "exists" in again.stderr, again
        assert ctl(a, "add", "b2", workers[2].url, "--exist-ok").returncode == 0
        early = ctl(b, "remove", "b2")
        assert early.returncode == 1 and "drain it first" in early.stderr, early
        drained = ctl(a, "--json", "drain", "b2", "--wait")
        assert drained.returncode == 0, drained
        assert json.loads(drained.stdout)["cluster"]["state"] == "drained"
        assert ctl(b, "remove", "b2").returncode == 0
        remove_s = await until(lambda: len(a.admin("/backends")) == 2, 1.0, "A dropped it")
        print(f"after ctl returned, the other instance had the add in {add_s:.3f}s, "
              f"the remove in {remove_s:.3f}s")  # fmt: skip
    finally:
        for lb in (a, b, c):
            if lb.proc is not None:
                lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()


async def _wait_backend(
    lb: Wslb, bid: str, ok: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        b: dict[str, Any] = lb.admin(f"/backends/{bid}")
        if ok(b):
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"{bid} on {lb.url}: {b}")
        await asyncio.sleep(0.05)


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


async def test_watch_after_compaction_asks_for_a_full_read(tmp_path: Path) -> None:
    """A watch from a compacted revision fails with Compacted (the loop then re-reads all)."""
    import aiohttp

    from balancer.aio.cluster import Compacted
    from balancer.aio.cluster import Etcd as Client

    etcd = Etcd(tmp_path / "etcd").start()
    try:
        async with aiohttp.ClientSession() as http:
            client = Client(etcd.url, http)
            for i in range(3):
                await client.put(f"{PREFIX}k", str(i))
            revision, kvs = await client.range(PREFIX)
            assert len(kvs) == 1 and revision >= 4
            await client.call("/v3/kv/compaction", {"revision": str(revision)})
            stream = client.watch(PREFIX, 2)
            try:
                for _ in range(2):  # "created" comes first, then the cancellation
                    assert await asyncio.wait_for(anext(stream), 5) == []
                raise AssertionError("expected Compacted")
            except Compacted:
                pass
            # From the revision after a fresh read, the watch works and sees new events.
            stream = client.watch(PREFIX, revision + 1)
            assert await asyncio.wait_for(anext(stream), 5) == []  # created
            await client.put(f"{PREFIX}k", "new")
            events = await asyncio.wait_for(anext(stream), 5)
            assert [_unb64(e["kv"]["value"]) for e in events] == ["new"]
            await stream.aclose()  # type: ignore[attr-defined]
    finally:
        etcd.stop()


def _unb64(text: str) -> str:
    import base64

    return base64.b64decode(text).decode()


async def test_instance_started_without_etcd_routes_on_its_file_and_joins_later(
    tmp_path: Path,
) -> None:
    etcd = Etcd(tmp_path / "etcd")  # ports chosen, not started yet
    w = Worker("solo").start()
    lb = Wslb(cluster_config(etcd, [w]), tmp_path)
    try:
        t0 = time.monotonic()
        lb.start()
        assert time.monotonic() - t0 < 10  # waits a little for etcd, then serves anyway
        ready = lb.admin("/readyz")
        assert ready["degraded"] and not ready["cluster"]["connected"]
        assert "wslb_cluster_connected 0.0" in lb.admin("/metrics")
        assert await worker_for(lb, "early") == "solo"  # the file's backends
        etcd.start()
        took = await until(lambda: lb.admin("/readyz")["cluster"]["connected"], 10, "joins")
        print(f"\njoined etcd {took:.2f}s after it came up")
        assert not lb.admin("/readyz")["degraded"]
        seeded = etcd.call("/v3/kv/range", {"key": _b64(PREFIX + "backends/solo")})
        assert seeded.get("count") == "1", seeded
        assert await worker_for(lb, "late") == "solo"
    finally:
        lb.stop()
        w.stop()
        etcd.stop()
