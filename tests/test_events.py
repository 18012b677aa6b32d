"""The event feed (balancer/events.py, GET /events and GET /events/stream on the admin API).

End to end with reference workers and aiohttp as the reader: a drain's start, each migration
with its pause, the backend's state changes and the drain's end arrive on the stream as they
happen, in ``workers: N`` too (the supervisor's merged feed). A worker killed and started again
is one ``state`` event each way, emitted at the health flip itself (no polling).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import connect

from balancer.events import EventLog
from tests.procs import Worker, Wslb, pool_config
from tests.waits import until

TOKEN = "events-test-token"


def test_log_numbers_bounds_and_reads_since() -> None:
    log = EventLog(size=3)
    heard: list[int] = []
    log.listen(lambda e: heard.append(e["seq"]))
    for n in range(5):
        log.emit("state", 100.0 + n, backend=f"b{n}")
    assert heard == [1, 2, 3, 4, 5]
    assert [e["seq"] for e in log.since(0)] == [3, 4, 5]  # the oldest fell off
    assert [e["backend"] for e in log.since(4)] == ["b4"]
    assert log.since(5) == [] and log.since(99) == []
    merged = EventLog()
    e = merged.absorb(log.since(4)[0], process=1)
    assert e == {"seq": 1, "time": 104.0, "kind": "state", "backend": "b4", "process": 1}


async def read_stream(
    url: str, token: str, want: Any, connected: asyncio.Event | None = None, timeout: float = 20.0
) -> list[dict[str, Any]]:
    """SSE events from ``url`` until ``want(events)`` holds; ``connected`` is set once the
    stream's head came (what happens from then on comes live)."""
    events: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        if connected is not None:
            connected.set()
        buf = ""

        async def read() -> None:
            nonlocal buf
            async for chunk in resp.content.iter_any():
                buf += chunk.decode()
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    fields = dict(
                        line.split(": ", 1) for line in block.splitlines() if ": " in line
                    )
                    if "data" in fields:
                        event = json.loads(fields["data"])
                        assert fields["id"] == str(event["seq"])
                        assert fields["event"] == event["kind"]
                        events.append(event)
                if want(events):
                    return

        await asyncio.wait_for(read(), timeout)
    return events


async def streaming_sessions(url: str, n: int, prefix: str) -> list[Any]:
    conns = []
    for i in range(n):
        ws = await connect(f"{url}/ws?session={prefix}{i}")
        await ws.recv()  # hello
        await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 200}))
        conns.append(ws)
    return conns


def drained(events: list[dict[str, Any]], bid: str, processes: int) -> bool:
    """Every serving process has finished its part of the drain (each drains its sessions)."""
    ends = [e for e in events if e["kind"] == "drain" and e["phase"] == "finished"]
    return sum(1 for e in ends if e["backend"] == bid) >= processes


@pytest.mark.parametrize("processes", [1, 2])
async def test_a_drain_on_the_stream(tmp_path: Path, processes: int) -> None:
    workers = [Worker(f"e{i}", ["--tokens-per-s", "100"]).start() for i in range(2)]
    cfg = pool_config(
        [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers],
        health={"path": "/healthz", "interval": "0.2s"},
    )
    cfg["workers"] = processes
    cfg["timeouts"] = {"shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path, token=TOKEN).start()
    try:
        lb.wait_ready()
        conns = await streaming_sessions(lb.url, 6, f"ev{processes}-")

        def streaming() -> list[dict[str, Any]] | None:
            live: list[dict[str, Any]] = lb.admin("/sessions")
            tokens = [s["messages"]["worker_to_client"] > 1 for s in live]  # the hello, a token
            return live if len(live) == len(conns) and all(tokens) else None

        sessions = await until(streaming, 10, "every answer streaming")
        victim = max(
            {s["backend"] for s in sessions},
            key=lambda b: sum(s["backend"] == b for s in sessions),
        )
        moving = sum(s["backend"] == victim for s in sessions)
        connected = asyncio.Event()
        stream = asyncio.ensure_future(
            read_stream(
                f"http://127.0.0.1:{lb.admin_port}/events/stream",
                TOKEN,
                lambda evs: drained(evs, victim, processes),
                connected,
            )
        )
        await asyncio.wait_for(connected.wait(), 10)  # what follows comes live
        lb.admin_post(f"/backends/{victim}/drain", {})
        events = await stream
        kinds = [e["kind"] for e in events]
        started = next(e for e in events if e["kind"] == "drain" and e["phase"] == "started")
        assert started["backend"] == victim
        moves = [e for e in events if e["kind"] == "migration" and e["from"] == victim]
        assert len(moves) == moving, events
        assert all(m["ok"] and m["to"] != victim and m["pause_ms"] > 0 for m in moves)
        finished = next(e for e in events if e["kind"] == "drain" and e["phase"] == "finished")
        assert finished["migrated"] == moving or processes > 1  # per serving process
        assert kinds.index("migration") > events.index(started)
        if processes > 1:
            assert all("process" in m for m in moves)
        # The state change is on the feed too: a long poll finds it (or waits for it).
        base = f"http://127.0.0.1:{lb.admin_port}/events"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        seen: list[dict[str, Any]] = []
        last = 0
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.get(f"{base}?since={last}&wait=5", headers=auth) as resp:
                    body = await resp.json()
                seen += body["events"]
                last = body["last"]
                if any(e["kind"] == "state" and e["to"] == "drained" for e in seen):
                    break
            assert any(
                e["kind"] == "state" and e["backend"] == victim and e["to"] == "drained"
                for e in seen
            ), seen
            async with http.get(f"{base}/stream") as resp:
                assert resp.status == 401  # no token, no events
        for ws in conns:  # read to the end of each answer (unread frames would stall the close)
            while json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] != "done":
                pass
            await ws.close()
    finally:
        lb.stop()
        for w in workers:
            w.stop()


def victim_states(events: list[dict[str, Any]], bid: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "state" and e["backend"] == bid]


async def test_a_killed_worker_is_one_state_event_and_its_return_another(tmp_path: Path) -> None:
    workers = [Worker(f"k{i}").start() for i in range(2)]
    interval = 0.2
    cfg = pool_config(
        [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers],
        health={"interval": f"{interval}s", "fall": 1, "rise": 1},
    )
    lb = Wslb(cfg, tmp_path, token=TOKEN).start()
    victim = workers[0]
    try:
        lb.wait_ready()
        base = f"http://127.0.0.1:{lb.admin_port}/events"
        connected = asyncio.Event()
        stream = asyncio.ensure_future(
            read_stream(
                f"{base}/stream", TOKEN, lambda evs: len(victim_states(evs, "k0")) >= 2, connected
            )
        )
        await asyncio.wait_for(connected.wait(), 10)  # what follows comes live
        killed = time.time()
        victim.kill()
        for _ in range(100):  # its down event, then it comes back
            await asyncio.sleep(0.05)
            if lb.admin("/backends/k0")["state"] == "down":
                break
        down_since = lb.admin("/backends/k0")["health"]["since"]
        victim.start()
        events = await stream
        for _ in range(100):
            await asyncio.sleep(0.05)
            if lb.admin("/backends/k0")["state"] == "active":
                break
        up_since = lb.admin("/backends/k0")["health"]["since"]
        # More probes (three after the one that found it back): no more events.
        await until(
            lambda: lb.admin("/backends/k0")["health"]["last_check"] >= up_since + 3 * interval,
            10 + 4 * interval,
            "three more probes",
        )
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as http, http.get(f"{base}?since=0", headers=auth) as r:
            everything = (await r.json())["events"]
        down, up = victim_states(events, "k0")
        assert victim_states(everything, "k0") == [down, up]
        assert victim_states(everything, "k1") == []
        assert (down["from"], down["to"], down["reason"]) == ("active", "down", "connect refused")
        assert (up["from"], up["to"], up["reason"]) == ("down", "active", None)
        assert down["pool"] == up["pool"] == "chat"
        # Emitted at the flip itself (event times are in ms), not at a watcher's next look (it
        # looked every 0.25 s); the flip at the first probe after the kill.
        assert abs(down["time"] - down_since) < 0.02 and abs(up["time"] - up_since) < 0.02
        assert down["time"] - killed < interval + 0.25, down["time"] - killed
    finally:
        lb.stop()
        for w in workers:
            w.stop()
