"""Drain and live migration end to end: no lost or repeated token, no close, no reconnect."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backends.model import token_text
from tests.procs import Worker, Wslb, pool_config
from tests.waits import until

TOKENS = 120


async def read_answer(
    ws: ClientConnection,
    sid: str,
    turn: int,
    workers: list[str],
    tokens: int = TOKENS,
    seen: dict[str, int] | None = None,
) -> None:
    """One answer: every token once, in order, with its deterministic text. ``seen`` counts the
    tokens read per session (a test waits on it for "mid-answer")."""
    i = 0
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert msg["type"] in ("token", "done"), msg
        assert msg["turn"] == turn, (sid, msg)
        if msg["type"] == "done":
            assert msg["tokens"] == tokens == i, (sid, msg, i)
            workers.append(msg["worker"])
            return
        assert msg["i"] == i, (sid, turn, msg["i"], i)
        assert msg["text"] == token_text(sid, turn, i)
        i += 1
        if seen is not None:
            seen[sid] = seen.get(sid, 0) + 1


async def chat_session(
    url: str, sid: str, turns: int, seen: dict[str, int] | None = None
) -> dict[str, Any]:
    async with connect(f"{url}/ws?session={sid}") as ws:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello"
        workers: list[str] = []
        for turn in range(1, turns + 1):
            await ws.send(json.dumps({"type": "prompt", "text": f"q{turn}", "max_tokens": TOKENS}))
            await read_answer(ws, sid, turn, workers, seen=seen)
        return {"first": hello["worker"], "workers": workers}


async def wait_state(lb: Wslb, bid: str, state: str, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = lb.admin(f"/backends/{bid}")
        if b["state"] == state:
            return dict(b)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{bid} not {state}: {lb.admin(f'/backends/{bid}')}")


async def test_two_drains_migrate_every_session_exactly_once(tmp_path: Path) -> None:
    workers = [Worker(f"m{i}", ["--tokens-per-s", "80"]).start() for i in range(4)]
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers], hash_balance_factor=1.5)
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        seen: dict[str, int] = {}
        clients = [
            asyncio.ensure_future(chat_session(lb.url, f"mig-{i}", 3, seen)) for i in range(30)
        ]
        await until(lambda: len(seen) == 30, 30, "everyone mid-answer")
        live = {b["id"]: b["sessions"] for b in lb.admin("/backends")}
        first, second = sorted(live, key=lambda k: -live[k])[:2]
        assert live[first] > 0 and live[second] > 0, live
        lb.admin_post(f"/backends/{first}/drain", {"migrate": True, "timeout": "20s"})
        b1 = await wait_state(lb, first, "drained")
        lb.admin_post(f"/backends/{second}/drain", {"migrate": True, "timeout": "20s"})
        b2 = await wait_state(lb, second, "drained")
        results = await asyncio.wait_for(asyncio.gather(*clients), 60)
        for b in (b1, b2):
            assert b["sessions"] == 0
            assert b["drain"]["migrated"] == b["drain"]["sessions_at_start"] > 0, b
            assert b["drain"]["closed_at_timeout"] == 0 and b["drain"]["closed_after_answer"] == 0
        # Sessions that were on the drained workers finished their answers elsewhere.
        moved = [r for r in results if r["first"] in (first, second)]
        assert moved and all(r["workers"][-1] not in (first, second) for r in results)
        metrics = lb.admin("/metrics")
        assert 'wslb_migrations_total{result="migrated"}' in metrics
        assert "wslb_migration_pause_seconds_bucket" in metrics
        assert "wslb_drain_duration_seconds_count 2.0" in metrics
    finally:
        lb.stop()
        for w in workers:
            w.stop()


async def test_worker_without_handoff_gets_graceful_1012_after_its_answer(tmp_path: Path) -> None:
    old = Worker("plain", ["--no-handoff", "--tokens-per-s", "100"]).start()
    other = Worker("other").start()
    cfg = pool_config([{"id": "plain", "url": old.url}])
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        sids = [f"fb-{i}" for i in range(6)]
        conns = []
        for sid in sids:
            ws = await connect(f"{lb.url}/ws?session={sid}")
            assert json.loads(await ws.recv())["worker"] == "plain"
            conns.append(ws)
        lb.admin_post("/backends", {"id": "other", "url": other.url})
        await wait_state(lb, "other", "active")
        seen: dict[str, int] = {}
        for ws in conns:
            await ws.send(json.dumps({"type": "prompt", "text": "x", "max_tokens": 60}))
        readers = [
            asyncio.ensure_future(read_answer(ws, sid, 1, [], tokens=60, seen=seen))
            for sid, ws in zip(sids, conns, strict=True)
        ]
        await until(lambda: len(seen) == len(sids), 20, "every answer under way")
        lb.admin_post("/backends/plain/drain", {"migrate": True, "timeout": "10s"})
        # The answers in progress complete, then the close comes.
        await asyncio.wait_for(asyncio.gather(*readers), 20)
        for ws in conns:
            try:
                await asyncio.wait_for(ws.recv(), 5)
                raise AssertionError("expected a close after the answer")
            except ConnectionClosed as exc:
                assert exc.rcvd is not None and exc.rcvd.code == 1012
        b = await wait_state(lb, "plain", "drained")
        assert b["drain"]["closed_after_answer"] == len(sids)
        assert 'wslb_migrations_total{result="no_api"}' in lb.admin("/metrics")
        # Reconnects with the same key land elsewhere and carry on.
        where: Counter[str] = Counter()
        for sid in sids:
            async with connect(f"{lb.url}/ws?session={sid}") as ws:
                where[json.loads(await ws.recv())["worker"]] += 1
        assert where == {"other": len(sids)}
    finally:
        lb.stop()
        old.stop()
        other.stop()


async def test_worker_sigterm_is_drained_automatically(tmp_path: Path) -> None:
    a = Worker("quit", ["--tokens-per-s", "80", "--drain-grace", "20"]).start()
    b = Worker("stay", ["--tokens-per-s", "80"]).start()
    cfg = pool_config(
        [{"id": "quit", "url": a.url}, {"id": "stay", "url": b.url}],
        health={"interval": "0.1s", "timeout": "0.5s", "path": "/healthz"},
    )
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        sids: list[str] = []
        i = 0
        while len(sids) < 4 and i < 100:
            async with connect(f"{lb.url}/ws?session=term-{i}") as ws:
                if json.loads(await ws.recv())["worker"] == "quit":
                    sids.append(f"term-{i}")
            i += 1
        seen: dict[str, int] = {}
        clients = [asyncio.ensure_future(chat_session(lb.url, sid, 2, seen)) for sid in sids]
        await until(lambda: len(seen) == len(sids), 20, "every answer under way")
        assert a.proc is not None
        a.proc.terminate()  # pod termination: the worker drains itself
        results = await asyncio.wait_for(asyncio.gather(*clients), 30)
        assert all(r["first"] == "quit" and r["workers"][-1] == "stay" for r in results)
        drained = await wait_state(lb, "quit", "drained")
        assert drained["drain"]["migrated"] == len(sids)
        assert await asyncio.to_thread(a.proc.wait, 10) == 0  # it exits once its legs are closed
    finally:
        lb.stop()
        a.stop()
        b.stop()


async def test_migrate_one_session_on_request_and_roll_back_on_refusal(tmp_path: Path) -> None:
    a = Worker("src", ["--tokens-per-s", "100"]).start()
    b = Worker("dst", ["--tokens-per-s", "100"]).start()
    c = Worker("old-school", ["--no-handoff"]).start()
    cfg = pool_config([{"id": "src", "url": a.url}])
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        lb.admin_post("/backends", {"id": "dst", "url": b.url})
        lb.admin_post("/backends", {"id": "old-school", "url": c.url})
        await wait_state(lb, "dst", "active")
        async with connect(f"{lb.url}/ws?session=one") as ws:
            assert json.loads(await ws.recv())["worker"] == "src"
            await ws.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": TOKENS}))
            workers: list[str] = []
            seen: dict[str, int] = {}
            reader = asyncio.ensure_future(read_answer(ws, "one", 1, workers, seen=seen))
            await until(lambda: seen.get("one", 0) > 0, 20, "the answer under way")
            # Its own worker, or none of the pool's: refused before the freeze (no pause).
            for to in ("src", "nope"):
                status, body = await asyncio.to_thread(
                    _post_status, lb, "/sessions/one/migrate", {"to": to}
                )
                assert status == 409 and body["result"] == "target" and body["pause_ms"] is None
            # A target without the handoff API refuses the thaw: the session goes back.
            status, body = await asyncio.to_thread(
                _post_status, lb, "/sessions/one/migrate", {"to": "old-school"}
            )
            assert status == 409 and body["result"] == "thaw" and body["backend"] == "src"
            back = seen["one"]
            await until(lambda: seen["one"] > back, 20, "the answer streams on from src")
            result = await asyncio.to_thread(lb.admin_post, "/sessions/one/migrate", {"to": "dst"})
            assert result["migrated"] and result["backend"] == "dst"
            assert result["pause_ms"] is not None and result["pause_ms"] < 1000
            await asyncio.wait_for(reader, 10)
            assert workers == ["dst"]
            s = lb.admin("/sessions/one")
            # Moved back, then moved; the refused targets above never froze it.
            assert s["migrations"] == 2 and s["backend"] == "dst"
    finally:
        lb.stop()
        for w in (a, b, c):
            w.stop()


def _post_status(lb: Wslb, path: str, body: Any) -> tuple[int, Any]:
    import urllib.error

    try:
        return 200, lb.admin_post(path, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def self_draining_pair(prefix: str) -> tuple[dict[str, Any], list[int]]:
    """Config of two spawned workers that drain themselves on SIGTERM, probed every 0.1 s."""
    from tests.procs import free_port

    ports = [free_port(), free_port()]
    cfg = pool_config(
        [
            {
                "id": f"{prefix}{i}",
                "url": f"ws://127.0.0.1:{p}/ws",
                "spawn": "reference",
                "args": ["--drain-grace", "0.5"],
            }
            for i, p in enumerate(ports)
        ],
        health={"interval": "0.1s", "timeout": "0.5s", "rise": 1, "path": "/healthz"},
    )
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    return cfg, ports


def spawned_worker(lb: Wslb, port: int) -> Any:
    """The psutil process of the worker wslb spawned on ``port``."""
    import psutil

    assert lb.proc is not None
    return next(p for p in psutil.Process(lb.proc.pid).children() if str(port) in p.cmdline())


async def states_until_back(lb: Wslb, bid: str, timeout: float = 20) -> list[str]:
    """The backend's states, each once, until it has been drained and is active again."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = lb.admin(f"/backends/{bid}")["state"]
        if not seen or seen[-1] != state:
            seen.append(state)
        if "drained" in seen and state == "active":
            break
        await asyncio.sleep(0.05)
    return seen


async def test_spawned_worker_that_drained_itself_is_undrained_when_back(tmp_path: Path) -> None:
    cfg, ports = self_draining_pair("sp")
    lb = Wslb(cfg, tmp_path).start()
    try:
        victim = spawned_worker(lb, ports[0])
        # A live session keeps the worker draining (not exiting) until wslb has moved it.
        ws, i = None, 0
        while ws is None and i < 100:
            conn = await connect(f"{lb.url}/ws?session=self-{i}")
            if json.loads(await conn.recv())["worker"] == "sp0":
                ws = conn
            else:
                await conn.close()
            i += 1
        assert ws is not None
        victim.terminate()  # the worker drains itself, exits, and wslb restarts it
        seen = await states_until_back(lb, "sp0")
        assert "drained" in seen and seen[-1] == "active", seen
        await ws.send(json.dumps({"type": "prompt", "text": "still", "max_tokens": 2}))
        assert json.loads(await ws.recv())["type"] == "token"  # the moved session lives on
        await ws.close()
    finally:
        lb.stop()
