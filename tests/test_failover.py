"""Crash failover end to end: a worker killed with SIGKILL mid-answer, and the answer goes on.

The system is the repo's own ``balancer.yaml`` (three spawned reference workers, failover on),
on free ports; the clients are plain ``websockets`` connections that check every token's text
(``backends.model.token_text``), index and turn, and that their connection never closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backends.model import token_text
from balancer.aio import offload
from tests.procs import ROOT, Wslb, free_port

TOKENS = 150  # at the workers' 50 tokens/s: 3 s per answer


class Chat:
    """One client session: one connection, answers checked token by token."""

    def __init__(self, url: str, sid: str) -> None:
        self.url = url
        self.sid = sid
        self.ws: ClientConnection | None = None
        self.seen = 0  # tokens of the current answer so far
        self.workers: list[str] = []

    async def open(self) -> None:
        self.ws = await connect(f"{self.url}/ws?session={self.sid}")
        hello = json.loads(await self.ws.recv())
        assert hello["type"] == "hello"

    async def turn(self, turn: int, tokens: int = TOKENS, text: str | None = None) -> None:
        assert self.ws is not None
        prompt = {"type": "prompt", "text": text or f"question {turn}", "max_tokens": tokens}
        await self.ws.send(json.dumps(prompt))
        self.seen = 0
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 20))
            assert msg["type"] in ("token", "done"), (self.sid, msg)
            assert msg["turn"] == turn, (self.sid, msg)
            if msg["type"] == "done":
                assert msg["tokens"] == tokens == self.seen, (self.sid, msg, self.seen)
                self.workers.append(msg["worker"])
                return
            assert msg["i"] == self.seen, (self.sid, msg, self.seen)
            assert msg["text"] == token_text(self.sid, turn, self.seen), (self.sid, msg)
            self.seen += 1

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


def default_system(
    tmp: Path, timeouts: dict[str, str] | None = None, **pool: Any
) -> tuple[Wslb, list[int]]:
    """The repo's ``balancer.yaml`` as a user runs it (timeouts and pool settings can be
    overridden)."""
    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    del cfg["listen"], cfg["admin"]  # Wslb puts both on free ports
    cfg["pools"][0].update(pool)
    cfg["timeouts"].update(timeouts or {})
    ports = [free_port() for _ in range(3)]
    env = {f"WSLB_WORKER_PORT{n + 1}": str(p) for n, p in enumerate(ports)}
    lb = Wslb(cfg, tmp, extra_env=env)
    lb.start()
    lb.wait_ready(timeout=30)
    return lb, ports


@pytest.fixture
def system(tmp_path: Path) -> Iterator[tuple[Wslb, list[int]]]:
    lb, ports = default_system(tmp_path)
    yield lb, ports
    lb.stop()


def worker_proc(lb: Wslb, backend_id: str) -> psutil.Process:
    """The spawned worker process behind ``backend_id`` (found by its port)."""
    url = lb.admin(f"/backends/{backend_id}")["url"]
    port = url.rsplit(":", 1)[1].split("/")[0]
    for child in psutil.Process(lb.pid).children(recursive=True):
        cmd = child.cmdline()
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == port:
            return child
    raise AssertionError(f"no spawned process for {backend_id} (port {port})")


def busiest(lb: Wslb, exclude: tuple[str, ...] = ()) -> tuple[str, int]:
    counts = {b["id"]: b["sessions"] for b in lb.admin("/backends") if b["id"] not in exclude}
    bid = max(counts, key=lambda b: counts[b])
    return bid, counts[bid]


def failovers(lb: Wslb) -> Counter[str]:
    text = lb.admin("/metrics")
    out: Counter[str] = Counter()
    for m in re.finditer(r'^wslb_failovers_total\{result="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] += int(float(m.group(2)))
    return out


def relay_thread(lb: Wslb) -> Counter[str]:
    """``wslb_relay_thread_handovers_total`` by event (aio/offload.py)."""
    text = lb.admin("/metrics")
    out: Counter[str] = Counter()
    for m in re.finditer(
        r'^wslb_relay_thread_handovers_total\{event="([\w ]+)"\} (\S+)$', text, re.M
    ):
        out[m.group(1)] += int(float(m.group(2)))
    return out


async def until(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def streaming(chats: list[Chat], turn: int, tokens: int = TOKENS) -> list[asyncio.Task[None]]:
    """Start a turn on every chat; return once each has seen a few tokens."""
    tasks = [asyncio.create_task(c.turn(turn, tokens)) for c in chats]
    await until(lambda: all(c.seen >= 5 for c in chats), what="every answer streaming")
    return tasks


async def test_kill_busiest_worker_mid_answer(system: tuple[Wslb, list[int]]) -> None:
    lb, _ = system
    chats = [Chat(lb.url, f"fo-{n}") for n in range(30)]
    await asyncio.gather(*(c.open() for c in chats))
    tasks = await streaming(chats, 1)
    victim, on_victim = busiest(lb)
    assert on_victim > 0
    placed = {s["id"]: s["backend"] for s in lb.admin("/sessions")}
    worker_proc(lb, victim).send_signal(signal.SIGKILL)
    await asyncio.gather(*tasks)  # every answer completes, every token once and in order
    moved = [c for c in chats if c.workers[-1] != victim]
    assert len(moved) == 30
    assert failovers(lb)["resumed"] == on_victim, lb.log_tail()
    # The conversation goes on where it is now.
    await asyncio.gather(*(c.turn(2, 20) for c in chats))
    for c in chats:
        view = lb.admin(f"/sessions/{c.sid}")["failover"]
        assert view["failovers"] == (placed[c.sid] == victim), (c.sid, view)
        assert view["protected"] and view["journal_bytes"] > 0
        assert c.ws is not None and c.ws.close_code is None  # no close, no reconnect
        await c.close()
    assert f"backend {victim} is down" in lb.output()  # at once, not after failed checks
    if offload.AVAILABLE:
        # The answers streamed through the relay thread, which saw the worker go (Rule 7):
        # the journal's record came from the thread.
        handovers = relay_thread(lb)
        assert handovers["taken"] > 0 and handovers["eof"] + handovers["read error"] > 0, handovers


async def test_two_workers_killed_one_after_the_other(system: tuple[Wslb, list[int]]) -> None:
    lb, _ = system
    chats = [Chat(lb.url, f"two-{n}") for n in range(12)]
    await asyncio.gather(*(c.open() for c in chats))
    tasks = await streaming(chats, 1, 250)
    first, _ = busiest(lb)
    worker_proc(lb, first).send_signal(signal.SIGKILL)
    await until(lambda: failovers(lb)["resumed"] > 0, what="the first failover")
    await until(
        lambda: all(s["backend"] != first for s in lb.admin("/sessions")),
        what="every session off the first victim",
    )
    second, _ = busiest(lb, exclude=(first,))
    worker_proc(lb, second).send_signal(signal.SIGKILL)
    await asyncio.gather(*tasks)
    survivors = {c.workers[-1] for c in chats}
    assert second not in survivors
    for c in chats:
        assert c.ws is not None and c.ws.close_code is None
        await c.close()


async def test_kill_during_a_drains_migration(system: tuple[Wslb, list[int]]) -> None:
    lb, _ = system
    chats = [Chat(lb.url, f"dr-{n}") for n in range(24)]
    await asyncio.gather(*(c.open() for c in chats))
    tasks = await streaming(chats, 1)
    victim, _ = busiest(lb)
    proc = worker_proc(lb, victim)
    lb.admin_post(f"/backends/{victim}/drain", {"migrate": True})
    proc.send_signal(signal.SIGKILL)  # some moved, some moving, some not started yet
    await asyncio.gather(*tasks)
    for c in chats:
        assert c.workers[-1] != victim
        assert c.ws is not None and c.ws.close_code is None
        await c.close()


async def test_kill_of_the_failover_target_during_its_thaw(
    system: tuple[Wslb, list[int]],
) -> None:
    """The target of a failover dies while it thaws: the session goes to the next worker."""
    lb, _ = system
    chats = [Chat(lb.url, f"tt-{n}") for n in range(18)]
    await asyncio.gather(*(c.open() for c in chats))
    tasks = await streaming(chats, 1, 250)
    victim, _ = busiest(lb)
    others = [b["id"] for b in lb.admin("/backends") if b["id"] != victim]
    placed_on = {s["id"]: s["backend"] for s in lb.admin("/sessions")}
    placed = Counter(placed_on.values())
    target = worker_proc(lb, others[0])
    target.send_signal(signal.SIGSTOP)  # its thaws hang until it is killed
    try:
        worker_proc(lb, victim).send_signal(signal.SIGKILL)

        def failing_over() -> bool:
            """Every session of the victim is failing over (some hang on the stopped target)
            or has resumed on the other one."""
            on_victim = [s for s in lb.admin("/sessions") if placed_on[s["id"]] == victim]
            return all(s["mode"] == "failing_over" or s["backend"] == others[1] for s in on_victim)

        await until(failing_over, what="the victim's sessions failing over")
    finally:
        target.send_signal(signal.SIGKILL)
    await asyncio.gather(*tasks)
    for c in chats:
        assert c.workers[-1] == others[1], (c.sid, c.workers)
        assert c.ws is not None and c.ws.close_code is None
        await c.close()
    # Each session of the two dead workers resumed once, some at their second attempt.
    assert failovers(lb)["resumed"] == placed[victim] + placed[others[0]], failovers(lb)


async def test_session_over_its_journal_limit_gets_1011(tmp_path: Path) -> None:
    lb, _ = default_system(tmp_path, failover={"enabled": True, "journal_limit": "2KiB"})
    try:
        small, big = Chat(lb.url, "small"), Chat(lb.url, "big")
        await asyncio.gather(small.open(), big.open())
        await big.turn(1, 5, text="word " * 600)  # 3 KB of prompt: past the limit
        await small.turn(1, 5)
        view = lb.admin("/sessions/big")["failover"]
        assert view["protected"] is False and "journal_limit" in view["why_not"], view
        assert lb.admin("/sessions/small")["failover"]["protected"] is True
        ctl = [sys.executable, "-m", "balancer", "ctl", "--admin",
               f"http://127.0.0.1:{lb.admin_port}", "sessions"]  # fmt: skip
        listing = (
            await asyncio.to_thread(
                subprocess.run, ctl, env=lb.env, capture_output=True, text=True, check=True
            )
        ).stdout
        rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
        assert "JOURNAL" in listing.splitlines()[0]
        assert "unprotected" in rows["big"] and "unprotected" not in rows["small"], listing
        sessions = {s["id"]: s["backend"] for s in lb.admin("/sessions")}
        assert big.ws is not None
        if sessions["small"] != sessions["big"]:
            # Put both on one worker, so one kill shows both outcomes.
            lb.admin_post("/sessions/small/migrate", {"to": sessions["big"]})
        worker_proc(lb, sessions["big"]).send_signal(signal.SIGKILL)
        with pytest.raises(ConnectionClosed):
            await big.ws.recv()
        assert big.ws.close_code == 1011
        await small.turn(2, 5)  # the small one was saved
        assert small.ws is not None and small.ws.close_code is None
        await small.close()
        log = lb.output()
        assert "no failover" in log and "journal_limit" in log
        assert failovers(lb)["journal_over_limit"] == 1
    finally:
        lb.stop()


async def test_worker_ping_timeout_fails_over(tmp_path: Path) -> None:
    """A worker that stops answering (SIGSTOP: a hung GPU) is lost at its ping timeout."""
    lb, _ = default_system(tmp_path, {"ping_interval": "0.5s", "ping_timeout": "0.5s"})
    stopped: psutil.Process | None = None
    try:
        chat = Chat(lb.url, "hung")
        await chat.open()
        task = asyncio.create_task(chat.turn(1, 200))
        await until(lambda: chat.seen >= 5)
        bid = lb.admin("/sessions/hung")["backend"]
        stopped = worker_proc(lb, bid)
        stopped.send_signal(signal.SIGSTOP)
        await task
        assert chat.workers[-1] != bid
        await chat.close()
    finally:
        if stopped is not None:
            stopped.send_signal(signal.SIGCONT)
        lb.stop()


def test_default_config_enables_failover() -> None:
    from balancer.config import load

    os.environ.setdefault("WSLB_ADMIN_TOKEN", "")
    cfg = load(str(ROOT / "balancer.yaml"))
    assert cfg.pools[0].failover.enabled


async def test_realtime_sdk_session_survives_a_kill(system: tuple[Wslb, list[int]]) -> None:
    """The official ``openai`` SDK as the client: one unbroken response, one response.done."""
    from tests.test_realtime import MODEL, answer, client, next_event, say

    lb, _ = system
    reconnects: list[int] = []
    started = [asyncio.Event() for _ in range(4)]

    async def one(n: int) -> Any:
        async with client(lb.port).realtime.connect(
            model=MODEL,
            extra_query={"session": f"rt-fo-{n}"},
            on_reconnecting=lambda e: reconnects.append(e.close_code) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await next_event(conn, "session.created")
            await say(conn, "first question")
            await conn.response.create()
            first = await answer(conn)
            await say(conn, "a longer second question")
            await conn.response.create(response={"max_output_tokens": 150})
            second = await answer(conn, timeout=60, streaming=started[n])
            await say(conn, "third")
            await conn.response.create(response={"max_output_tokens": 5})
            third = await answer(conn)
            return first, second, third

    tasks = [asyncio.ensure_future(one(n)) for n in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    await asyncio.sleep(0.3)
    victim = lb.admin("/sessions/rt-fo-0")["backend"]
    on_victim = [s["id"] for s in lb.admin("/sessions") if s["backend"] == victim]
    worker_proc(lb, victim).send_signal(signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    for first, second, third in results:
        for got in (first, second, third):
            assert not got.errors, got.errors
            assert got.types.count("response.done") == 1
            assert got.types.count("session.created") == 0
            assert "".join(got.deltas) == got.text
        assert second.status == "incomplete" and len(second.deltas) == 150
        assert second.done.response.id == first.done.response.id.rsplit("_", 1)[0] + "_2"
        assert third.status == "incomplete" and len(third.deltas) == 5
    assert not reconnects  # the SDK never saw a close
    assert failovers(lb)["resumed"] == len(on_victim), lb.log_tail()


async def test_failover_in_each_serving_process_of_workers_n(tmp_path: Path) -> None:
    """``workers: 2``: each serving process fails over the sessions it holds."""
    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    del cfg["listen"], cfg["admin"]
    cfg["workers"] = 2
    ports = [free_port() for _ in range(3)]
    env = {f"WSLB_WORKER_PORT{n + 1}": str(p) for n, p in enumerate(ports)}
    lb = Wslb(cfg, tmp_path, extra_env=env).start()
    try:
        lb.wait_ready(timeout=30)
        chats = [Chat(lb.url, f"mp-{n}") for n in range(12)]
        await asyncio.gather(*(c.open() for c in chats))
        tasks = await streaming(chats, 1)
        victim, on_victim = busiest(lb)
        worker_proc(lb, victim).send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
        assert all(c.workers[-1] != victim for c in chats)
        assert failovers(lb)["resumed"] == on_victim, lb.log_tail()
        for c in chats:
            assert c.ws is not None and c.ws.close_code is None
            await c.close()
    finally:
        lb.stop()
