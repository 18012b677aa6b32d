"""``workers: N``: the board, metric merging, and N real serving processes acting as one."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from websockets.asyncio.client import connect

from balancer.aio.fanout import merge_metrics
from balancer.board import Board
from balancer.config import BackendCfg, PoolCfg
from balancer.pool import Pool
from tests.procs import Worker, Wslb, pool_config
from tests.test_drain import (
    chat_session,
    self_draining_pair,
    spawned_worker,
    states_until_back,
    wait_state,
)
from tests.waits import until
from tests.wsraw import RawClient

# -- the board -----------------------------------------------------------------------------


def test_board_rows_are_shared_between_handles(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    sup = Board(path, 2, None, create=True)
    a, b = Board(path, 2, 0), Board(path, 2, 1)
    try:
        a.publish("w2", 3)  # a claims w2 first: every handle agrees on its slot anyway
        b.publish("w1", 4)
        b.publish("w2", 5)
        assert a.slot("w2") == b.slot("w2") == sup.slot("w2")
        assert a.remote("w2") == 5 and b.remote("w2") == 3 and sup.remote("w2") == 8
        assert a.remote("w1") == 4 and b.remote("w1") == 0 and a.total("w1") == 4
        sup.clear_row(1)  # serving process 1 died: its sessions died with it
        assert a.remote("w2") == 0 and sup.remote("w2") == 3
        with pytest.raises(ValueError, match="supervisor"):
            sup.publish("w1", 1)
    finally:
        for h in (a, b, sup):
            h.close()


def test_board_info_round_trips_and_rejects_a_foreign_file(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    sup = Board(path, 3, None, create=True)
    child = Board(path, 3, 2)
    try:
        assert child.read_info("w1") is None  # nothing known before the first write
        sup.write_info("w1", healthy=False, signals=(0.5, None, 3.0, 0.0, 0.03), scraped_at=12.5)
        info = child.read_info("w1")
        assert info is not None and info.seq == 2
        assert (info.healthy, info.gpu_util, info.kv_cache_usage) == (False, 0.5, None)
        assert (info.running, info.waiting, info.tpot, info.scraped_at) == (3.0, 0.0, 0.03, 12.5)
        sup.write_info("w1", healthy=True, signals=None, scraped_at=None)
        again = child.read_info("w1")
        assert again is not None and again.seq == 4 and again.healthy
        assert again.gpu_util is None and again.scraped_at is None
        with pytest.raises(ValueError):
            Board(path, 2, 0)  # sized for another process count
        with pytest.raises(ValueError, match="does not fit"):
            child.slot("x" * 200)
    finally:
        child.close()
        sup.close()


def test_board_affinity_is_shared_and_never_answers_for_another_key(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    a, b = Board(path, 2, 0, create=True), Board(path, 2, 1)
    try:
        assert b.recall("alice", 600) is None
        a.remember("alice", "w2", "w1")  # placed past its first ready backend w1
        got = b.recall("alice", 600)
        assert got is not None and got[:2] == ("w2", "w1")
        assert b.recall("alice", -1.0) is None  # older than the TTL
        b.touch("alice", "w3")  # not placed there: nothing changes
        assert a.recall("alice", 600) == got
        b.remember("alice", "w3", None)
        again = a.recall("alice", 600)
        assert again is not None and again[:2] == ("w3", None)
        # Keys that share an entry evict each other; neither ever reads the other's placement.
        from balancer.board import AFFINITY_ENTRIES

        target = Board._hash("alice") % AFFINITY_ENTRIES
        other = next(
            f"k{i}" for i in range(10**7) if Board._hash(f"k{i}") % AFFINITY_ENTRIES == target
        )
        a.remember(other, "w1", "w1")
        assert b.recall("alice", 600) is None
        hit = b.recall(other, 600)
        assert hit is not None and hit[0] == "w1"
    finally:
        a.close()
        b.close()


def test_merged_metrics_sum_counters_and_counts_but_keep_the_supervisors_gauges() -> None:
    own = (
        "# HELP wslb_connections Client connections accepted\n"
        "# TYPE wslb_connections counter\nwslb_connections_total 0.0\n"
        "# HELP wslb_backend_effective_weight Weight\n"
        "# TYPE wslb_backend_effective_weight gauge\n"
        'wslb_backend_effective_weight{backend="w1",pool="chat"} 0.75\n'
        "# HELP wslb_connections_active Open\n# TYPE wslb_connections_active gauge\n"
        "wslb_connections_active 0.0\n"
    )
    child = (
        "# HELP wslb_connections Client connections accepted\n"
        "# TYPE wslb_connections counter\nwslb_connections_total 5.0\n"
        "# HELP wslb_backend_effective_weight Weight\n"
        "# TYPE wslb_backend_effective_weight gauge\n"
        'wslb_backend_effective_weight{backend="w1",pool="chat"} 1.0\n'
        "# HELP wslb_connections_active Open\n# TYPE wslb_connections_active gauge\n"
        "wslb_connections_active 2.0\n"
        "# HELP wslb_pause_seconds P\n# TYPE wslb_pause_seconds histogram\n"
        'wslb_pause_seconds_bucket{le="0.1"} 1.0\nwslb_pause_seconds_bucket{le="+Inf"} 2.0\n'
        "wslb_pause_seconds_sum 0.3\nwslb_pause_seconds_count 2.0\n"
    )
    text = merge_metrics([child, child], own)
    from prometheus_client.parser import text_string_to_metric_families

    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert got[("wslb_connections_total", ())] == 10.0
    assert got[("wslb_connections_active", ())] == 4.0
    assert got[("wslb_backend_effective_weight", (("backend", "w1"), ("pool", "chat")))] == 0.75
    assert got[("wslb_pause_seconds_bucket", (("le", "+Inf"),))] == 4.0
    assert math.isclose(got[("wslb_pause_seconds_sum", ())], 0.6)


# -- N serving processes -------------------------------------------------------------------


def _serving(lb: Wslb) -> dict[int, psutil.Process]:
    assert lb.proc is not None
    out = {}
    for p in psutil.Process(lb.proc.pid).children():
        try:
            cmd = p.cmdline()
        except psutil.Error:  # a killed one not reaped yet (zombie), or gone
            continue
        if "balancer.aio.serving" in cmd:
            out[int(cmd[cmd.index("--index") + 1])] = p
    return out


async def _hello(url: str, key: str) -> str:
    async with connect(f"{url}/ws?session={key}") as ws:
        return str(json.loads(await ws.recv())["worker"])


async def test_two_processes_place_sessions_as_one_balancer_would(tmp_path: Path) -> None:
    workers = [Worker(f"n{i}").start() for i in range(3)]
    backends = [{"id": w.id, "url": w.url} for w in workers]
    # Static weights: the model below has no scraped signals to follow.
    still = {"gpu": 0, "kv_cache": 0, "queue": 0}
    cfg = pool_config(backends, hash_balance_factor=1.25, weights={"coefficients": still})
    cfg["workers"] = 2
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        assert lb.admin("/readyz") == {"status": "ready", "processes": 2}
        # One key, many connections: the kernel spreads them over both processes, and the
        # bounded-load rule spills them exactly as one process counting every session would.
        conns = []
        for _ in range(30):
            ws = await connect(f"{lb.url}/ws?session=hot")
            conns.append((ws, json.loads(await ws.recv())["worker"]))
        placed = Counter(w for _, w in conns)
        model = Pool(
            PoolCfg(
                name="chat",
                hash_balance_factor=1.25,
                backends=tuple(BackendCfg(id=w.id, url=w.url) for w in workers),
            )
        )
        expected: Counter[str] = Counter()
        for _ in range(30):
            b = model.select("hot")
            assert b is not None
            model.attach("hot", b)
            expected[b.id] += 1
        assert placed == expected
        by_process = Counter(s["process"] for s in lb.admin("/sessions"))
        assert set(by_process) == {0, 1}, by_process  # both processes took connections
        assert {b["id"]: b["sessions"] for b in lb.admin("/backends")} == {
            w.id: placed[w.id] for w in workers
        }
        metrics = lb.admin("/metrics")
        assert "wslb_connections_active 30.0" in metrics
        for ws, _ in conns:
            await ws.close()
    finally:
        lb.stop()
        for w in workers:
            w.stop()


async def test_reconnects_find_their_worker_from_either_process(tmp_path: Path) -> None:
    workers = [Worker(f"r{i}").start() for i in range(3)]
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers], hash_balance_factor=3.0)
    cfg["workers"] = 2
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    cfg["limits"] = {"max_connections": 6}
    lb = Wslb(cfg, tmp_path).start()
    try:
        first = {f"k{i}": await _hello(lb.url, f"k{i}") for i in range(20)}
        assert len(set(first.values())) == 3
        for _ in range(2):
            for key, worker in first.items():
                assert await _hello(lb.url, key) == worker
        # max_connections is the balancer's, not each process's.
        # The kernel's SO_REUSEPORT hash puts all six on one process one time in 32; then
        # the cap would be tested within a process only, so close them and draw again.
        for _ in range(10):
            held = [await connect(f"{lb.url}/ws?session=cap-{i}") for i in range(6)]
            if len({s["process"] for s in lb.admin("/sessions")}) == 2:
                break
            for ws in held:
                await ws.close()
            for _ in range(100):  # the closes reach both processes' counts
                if not lb.admin("/sessions"):
                    break
                await asyncio.sleep(0.05)
        assert len({s["process"] for s in lb.admin("/sessions")}) == 2
        for _ in range(4):  # whichever process the kernel picks
            extra = await RawClient.connect(lb.port)
            assert extra.status == 503
        for ws in held:
            await ws.close()
    finally:
        lb.stop()
        for w in workers:
            w.stop()


def test_a_key_spilled_by_one_process_is_found_by_the_other(tmp_path: Path) -> None:
    """The affinity table lives on the board: a reconnect that lands on another process finds
    the worker its key was spilled to, not the ring owner the bound kept it from."""
    path = str(tmp_path / "board")
    cfg = PoolCfg(
        name="chat",
        hash_balance_factor=1.25,
        backends=tuple(BackendCfg(id=f"s{i}", url=f"ws://127.0.0.1:{9000 + i}/") for i in range(3)),
    )
    sup = Board(path, 2, None, create=True)
    a, b = Pool(cfg), Pool(cfg)
    a.shared, b.shared = Board(path, 2, 0), Board(path, 2, 1)
    owner = a.ring.owner("spill")
    for i in range(6):  # load the owner through the other process
        b.attach(f"filler-{i}", b.backends[owner if i < 4 else "s0" if owner != "s0" else "s1"])
    spilled = a.select("spill", (), 1.0)
    assert spilled is not None and spilled.id != owner  # a sees b's sessions in the bound
    a.attach("spill", spilled, 1.0)
    a.detach(spilled, "spill", 2.0)
    for i in range(4):
        b.detach(b.backends[owner], f"filler-{i}", 3.0)  # the owner has room again
    again = b.select("spill", (), 4.0)
    assert again is spilled or (again is not None and again.id == spilled.id)
    for h in (a.shared, b.shared, sup):
        h.close()


async def test_a_drain_reaches_every_process_and_survives_a_restart(tmp_path: Path) -> None:
    workers = [Worker(f"d{i}", ["--tokens-per-s", "80"]).start() for i in range(3)]
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers], hash_balance_factor=1.5)
    cfg["workers"] = 2
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        seen: dict[str, int] = {}
        clients = [
            asyncio.ensure_future(chat_session(lb.url, f"mp-{i}", 2, seen)) for i in range(24)
        ]
        await until(lambda: len(seen) == 24, 30, "everyone mid-answer")
        live = {b["id"]: b["sessions"] for b in lb.admin("/backends")}
        holders = {b: {s["process"] for s in lb.admin(f"/sessions?backend={b}")} for b in live}
        # The drain must have sessions to move in both processes. The kernel's SO_REUSEPORT
        # hash may put all of one worker's ~8 in one process (1 in 128), hardly all three's.
        both = [b for b in live if holders[b] == {0, 1}]
        assert both, holders
        victim = max(both, key=lambda k: live[k])
        lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "20s"})
        view = await wait_state(lb, victim, "drained")
        assert view["sessions"] == 0
        assert view["drain"]["migrated"] == view["drain"]["sessions_at_start"] == live[victim]
        results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        # Every token of every answer arrived once, in order, with no reconnect (chat_session
        # checks that); sessions that began on the victim ended elsewhere.
        moved = [r for r in results if r["first"] == victim]
        assert moved and all(r["workers"][-1] != victim for r in moved)

        # A serving process that dies is restarted and learns the drain it missed.
        old = _serving(lb)[0]
        old.kill()
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "serving process 0 not restarted"
            procs = _serving(lb)
            if 0 in procs and procs[0].pid != old.pid and lb.admin("/readyz")["processes"] == 2:
                break
            await asyncio.sleep(0.1)
        for i in range(30):
            assert await _hello(lb.url, f"after-{i}") != victim
        undrained = lb.admin_post(f"/backends/{victim}/undrain", {})
        assert undrained["state"] == "active"
        pids = [p.pid for p in _serving(lb).values()]
    finally:
        assert lb.stop() == 0
        for w in workers:
            w.stop()
    assert not any(psutil.pid_exists(pid) for pid in pids)  # no serving process outlives it


async def test_a_worker_that_drains_itself_is_drained_in_every_process(tmp_path: Path) -> None:
    cfg, ports = self_draining_pair("sd")
    cfg["workers"] = 2
    lb = Wslb(cfg, tmp_path).start()
    try:
        # Sessions on sd0 in both serving processes (all kept open: the bound spreads them).
        kept = []
        for i in range(40):
            kept.append(await connect(f"{lb.url}/ws?session=self-{i}"))
            await kept[-1].recv()
        on_sd0 = lb.admin("/sessions?backend=sd0")
        assert {s["process"] for s in on_sd0} == {0, 1}, on_sd0
        spawned_worker(lb, ports[0]).terminate()  # reports "draining", exits, is restarted
        seen = await states_until_back(lb, "sd0")
        assert "drained" in seen and seen[-1] == "active", seen
        for ws in kept:  # every moved session lives on
            await ws.send(json.dumps({"type": "prompt", "text": "still", "max_tokens": 2}))
            reply = json.loads(await ws.recv())
            assert reply["type"] == "token", reply
            await ws.close()
    finally:
        lb.stop()


def test_held_places_count_in_every_process(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    cfg = PoolCfg(
        name="chat",
        backends=tuple(BackendCfg(id=f"h{i}", url=f"ws://127.0.0.1:{9000 + i}/") for i in range(2)),
    )
    sup = Board(path, 2, None, create=True)
    a, b = Pool(cfg, hold_s=30.0), Pool(cfg, hold_s=30.0)
    a.shared, b.shared = Board(path, 2, 0), Board(path, 2, 1)
    a.attach("k", a.backends["h0"], 1.0)
    a.detach(a.backends["h0"], "k", 2.0)  # k's conversation keeps its place on h0 ...
    b.refresh(3.0)
    assert b.backends["h0"].remote_sessions == 1  # ... which the other process counts
    a.refresh(40.0)  # the hold expired
    b.refresh(40.0)
    assert b.backends["h0"].remote_sessions == 0
    for h in (a.shared, b.shared, sup):
        h.close()
