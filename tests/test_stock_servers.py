"""wslb in front of WebSocket servers nobody wrote for wslb, with the config a new user writes.

The servers (``tests/servers``: FastAPI under uvicorn, aiohttp, a stock ``websockets`` echo)
have no health route, no ``/metrics`` and no handoff API, and the config has no ``health``
section and path-less backend URLs. That is the first thing a new user tries, so wslb's defaults
must carry it: backends stay up past the time an HTTP check would need to mark them down, the
client's path reaches the server, a drain falls back to 1012 after the current answer, and a
missing ``/metrics`` is noted once rather than logged every scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from balancer.config import HealthCfg
from tests.procs import Wslb
from tests.servers import DELAY, KINDS, WORDS, Server
from tests.test_http_proxy import metric
from tests.waits import until

# Default health checks (fall 3 x interval 2 s): a server failing them would be down by then.
FALL_TIMES_INTERVAL = HealthCfg().fall * HealthCfg().interval
STREAM_FOR = FALL_TIMES_INTERVAL + 1.0
PATH = "/ws/chat"
IDS = ("a", "b")


def new_user_config(servers: dict[str, Server]) -> dict[str, Any]:
    """One pool, path-less backend URLs, nothing else: no health, weights or limits section."""
    backends = [{"id": bid, "url": s.url} for bid, s in servers.items()]
    return {"pools": [{"name": "chat", "backends": backends}]}


def stop_wslb(lb: Wslb) -> None:
    if lb.proc is not None:
        lb.stop()


@dataclass
class Stack:
    """Two copies of one server kind behind one wslb."""

    kind: str
    servers: dict[str, Server]
    lb: Wslb

    @property
    def echo(self) -> bool:
        return self.kind == "websockets"

    def url(self, key: str) -> str:
        return f"{self.lb.url}{PATH}?session={key}"

    async def admin(self, path: str) -> Any:
        return await asyncio.to_thread(self.lb.admin, path)

    async def admin_post(self, path: str, body: dict[str, Any]) -> Any:
        return await asyncio.to_thread(self.lb.admin_post, path, body)

    async def placements(self) -> dict[str, str]:
        """Session key -> backend id of every live session, as wslb reports them."""
        return {s["id"]: s["backend"] for s in await self.admin("/sessions")}

    async def turn(self, ws: ClientConnection) -> str | None:
        """One exchange, about a second of streaming: a prompt and its whole answer (checked
        word for word), or for the echo server each word sent and echoed back in turn.
        Returns the backend id that answered (chat servers name their pid), None for echo."""
        async with asyncio.timeout(10):
            if self.echo:
                for word in WORDS:
                    await ws.send(word)
                    assert await ws.recv() == word
                    await asyncio.sleep(DELAY)
                return None
            await ws.send("tell me about websockets")
            words, pid = await read_answer(ws)
        assert words == list(WORDS)
        return self.backend_of(pid)

    def backend_of(self, pid: int) -> str:
        return next(bid for bid, s in self.servers.items() if s.pid == pid)


async def read_answer(ws: ClientConnection) -> tuple[list[str], int]:
    """The words of one streamed answer and the pid in its ``done`` message."""
    words: list[str] = []
    async with asyncio.timeout(10):
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "done":
                return words, int(msg["pid"])
            assert msg["type"] == "token", msg
            words.append(msg["text"])


async def expect_close(ws: ClientConnection, timeout: float = 4.0) -> int | None:
    """The close code the client receives next (data messages before it fail the test).

    The client library reports a close once the TCP connection ends, which the server side
    (wslb) does right after the close handshake; waiting for ``timeouts.close`` (5 s) instead
    would show here as a timeout.
    """
    try:
        async with asyncio.timeout(timeout):
            msg = await ws.recv()
    except ConnectionClosed as exc:
        return None if exc.rcvd is None else exc.rcvd.code
    except TimeoutError:
        frame = ws.protocol.close_rcvd  # set when a close frame came but the TCP stayed open
        raise AssertionError(
            f"no close within {timeout}s (close frame received: {frame})"
        ) from None
    raise AssertionError(f"expected a close, got a message: {msg!r}")


async def wait_for(
    stack: Stack, bid: str, pred: Any, what: str, timeout: float = 15.0
) -> dict[str, Any]:
    """Poll ``GET /backends/{bid}`` until ``pred(view)``; fail with the last view."""
    deadline = time.monotonic() + timeout
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = await stack.admin(f"/backends/{bid}")
        if pred(view):
            return view
        await asyncio.sleep(0.1)
    raise AssertionError(f"{bid} not {what} after {timeout}s: {view}")


@contextlib.contextmanager
def running_stack(kind: str, tmp: Path, **pool: Any) -> Iterator[Stack]:
    """Two servers of ``kind`` behind a wslb with the new user's config (plus ``pool``'s keys)."""
    with contextlib.ExitStack() as es:
        servers = {bid: es.enter_context(Server(kind, tmp)) for bid in IDS}
        cfg = new_user_config(servers)
        cfg["pools"][0].update(pool)
        lb = Wslb(cfg, tmp)
        es.callback(stop_wslb, lb)
        lb.start()
        yield Stack(kind, servers, lb)


@pytest.fixture(scope="module", params=KINDS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    kind: str = request.param
    with running_stack(kind, tmp_path_factory.mktemp(kind)) as s:
        yield s


def metrics_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "/metrics" in line]


# The tests of one server kind share its stack and run in this order; the drain comes last.


async def test_long_session_outlives_fall_times_interval(stack: Stack) -> None:
    """A session streams for longer than default fall x interval while both backends stay
    active and healthy; a session opened after that is still placed and answered."""
    snapshots: list[list[dict[str, Any]]] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            snapshots.append(await stack.admin("/backends"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)

    watcher = asyncio.create_task(watch())
    turns = 0
    try:
        async with asyncio.timeout(STREAM_FOR + 20), connect(stack.url("long")) as ws:
            t0 = time.monotonic()
            while time.monotonic() - t0 < STREAM_FOR:
                await stack.turn(ws)
                turns += 1
    finally:
        done.set()
        await asyncio.wait_for(watcher, 10)
    assert turns >= STREAM_FOR / 1.5, turns
    assert len(snapshots) >= STREAM_FOR / 0.5 / 2, len(snapshots)
    for views in snapshots:
        assert {v["id"] for v in views} == set(IDS), views
        for v in views:
            assert v["state"] == "active", v
            assert v["healthy"] is True and v["health"]["ok"] is True, v
    async with asyncio.timeout(15), connect(stack.url("after-long")) as ws:
        await stack.turn(ws)


async def test_sessions_with_different_keys_spread_over_both(stack: Stack) -> None:
    """Eight concurrent sessions with their own keys use both servers, each answered by the
    server wslb says holds it."""
    keys = [f"k{i}" for i in range(8)]
    async with contextlib.AsyncExitStack() as es:
        async with asyncio.timeout(15):
            conns = {k: await es.enter_async_context(connect(stack.url(k))) for k in keys}
        placed = await stack.placements()
        assert set(keys) <= set(placed), placed
        assert {placed[k] for k in keys} == set(IDS), placed
        answered = await asyncio.gather(*(stack.turn(ws) for ws in conns.values()))
    if not stack.echo:
        assert dict(zip(keys, answered, strict=True)) == {k: placed[k] for k in keys}


async def scrapes_failed(stack: Stack, n: int = 3) -> None:
    """Until every backend has failed ``n`` scrapes (no ``/metrics``): a line per failure
    would be there by now."""

    def failed() -> bool:
        count = "wslb_scrape_failures_total"
        return all(metric(stack.lb, count, backend=bid) >= n for bid in IDS)

    await until(failed, 20, f"{n} failed scrapes of each backend")


async def test_missing_metrics_is_logged_once_per_backend(stack: Stack) -> None:
    """The servers have no ``/metrics``; scrapes every second must not log every time."""
    await scrapes_failed(stack)
    lines = metrics_lines(stack.lb.output())
    assert len(lines) <= len(IDS), "\n".join(lines)


async def session_on(stack: Stack, bid: str, es: contextlib.AsyncExitStack) -> tuple[str, Any]:
    """A live session that wslb placed on ``bid``: open keyed sessions until one lands there
    (the bounded load spreads concurrent ones, so a few suffice); the others are closed."""
    opened: dict[str, ClientConnection] = {}
    async with asyncio.timeout(20):
        for i in range(16):
            key = f"drain-{i}"
            opened[key] = await connect(stack.url(key))
            placed = await stack.placements()
            if placed.get(key) == bid:
                ws = opened.pop(key)
                es.push_async_callback(ws.close)
                for other in opened.values():
                    await other.close()
                return key, ws
    for other in opened.values():
        await other.close()
    raise AssertionError(f"no session landed on {bid}")


async def test_drain_closes_with_1012_after_the_answer_and_reconnect_lands_on_b(
    stack: Stack,
) -> None:
    """Draining a server without the handoff API: the session on it mid-answer receives the
    rest of that answer, then 1012; its reconnect with the same key is answered by b."""
    async with contextlib.AsyncExitStack() as es:
        key, ws = await session_on(stack, "a", es)
        if stack.echo:
            # Echo until a while after the drain (still open: traffic means no answer is over),
            # then stop sending: 0.5 s of quiet later the close comes.
            for i in range(30):
                if i == 5:
                    await stack.admin_post("/backends/a/drain", {})
                await ws.send(f"m{i}")
                assert await asyncio.wait_for(ws.recv(), 5) == f"m{i}"
                await asyncio.sleep(DELAY)
        else:
            await ws.send("tell me about websockets")
            first = [json.loads(await asyncio.wait_for(ws.recv(), 5)) for _ in range(4)]
            await stack.admin_post("/backends/a/drain", {})
            rest, pid = await read_answer(ws)
            assert [m["text"] for m in first] + rest == list(WORDS)
            assert stack.backend_of(pid) == "a"
        quiet_from = time.monotonic()
        assert await expect_close(ws) == 1012
        assert time.monotonic() - quiet_from >= 0.3  # after the answer, not in the middle
    view = await wait_for(stack, "a", lambda v: v["state"] == "drained", "drained")
    assert view["drain"]["closed_after_answer"] == 1, view
    try:
        async with asyncio.timeout(15), connect(stack.url(key)) as again:
            assert (await stack.placements())[key] == "b"
            answered = await stack.turn(again)
            assert stack.echo or answered == "b"
    finally:
        await stack.admin_post("/backends/a/undrain", {})
    await wait_for(stack, "a", lambda v: v["state"] == "active", "active again")


async def test_killed_server_goes_down_with_its_reason(tmp_path: Path) -> None:
    """``GET /backends`` shows each backend's health; a killed server goes down with the reason
    (the TCP probe is refused) in ``/backends`` and in wslb's log; new sessions avoid it."""
    with running_stack("fastapi", tmp_path) as stack:
        views = await stack.admin("/backends")
        for v in views:
            assert {"ok", "reason", "since", "last_check"} <= set(v["health"]), v
            assert v["health"]["ok"] is True and v["state"] == "active", v
            assert v["overloaded"] is False, v  # no /metrics: no signals, never overloaded
        await scrapes_failed(stack)
        lines = metrics_lines(stack.lb.output())
        assert len(lines) <= len(IDS), "\n".join(lines)

        stack.servers["b"].kill()
        view = await wait_for(stack, "b", lambda v: v["state"] == "down", "down")
        assert view["healthy"] is False and view["health"]["ok"] is False, view
        assert "refused" in str(view["health"]["reason"]).lower(), view
        logged = [
            line
            for line in stack.lb.output().splitlines()
            if re.search(r"\bb\b", line) and "refused" in line.lower()
        ]
        assert logged, stack.lb.output()[-3000:]
        assert (await stack.admin("/backends/a"))["state"] == "active"

        async def new_session(key: str) -> str | None:
            async with asyncio.timeout(15), connect(stack.url(key)) as ws:
                return await stack.turn(ws)

        keys = [f"after-kill-{i}" for i in range(4)]
        assert await asyncio.gather(*map(new_session, keys)) == ["a"] * len(keys)


@pytest.mark.parametrize("kind", ["fastapi", "websockets"])
async def test_failover_enabled_in_front_of_a_stock_server_ends_a_lost_session_with_1011(
    tmp_path: Path, kind: str
) -> None:
    """The repo's ``balancer.yaml`` turns failover on; a new user keeps it in front of servers
    that have no thaw (the FastAPI app's token stream is not wslb's chat protocol). A server
    killed mid-answer: its session gets 1011 at once (not a hang, not another server's words),
    the metric names why, and a reconnect is answered by b."""
    with running_stack(kind, tmp_path, failover={"enabled": True}) as stack:
        async with contextlib.AsyncExitStack() as aes:
            key, ws = await session_on(stack, "a", aes)
            if stack.echo:
                for i in range(3):
                    await ws.send(f"m{i}")
                    assert await asyncio.wait_for(ws.recv(), 5) == f"m{i}"
            else:
                await ws.send("tell me about websockets")
                for _ in range(4):
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
                    assert msg["type"] == "token", msg
            stack.servers["a"].kill()
            t0 = time.monotonic()
            assert await expect_close(ws, timeout=10) == 1011
            assert time.monotonic() - t0 < 5
        metrics = await stack.admin("/metrics")
        counted = re.findall(r'wslb_failovers_total\{result="(\w+)"\} ([0-9.]+)', metrics)
        results = {r for r, n in counted if float(n) > 0}
        # Neither speaks the chat or the Realtime protocol: nothing wslb could hand on.
        assert results == {"unknown_protocol"}, counted
        async with asyncio.timeout(15), connect(stack.url(key)) as again:
            answered = await stack.turn(again)
            assert stack.echo or answered == "b"
        assert stack.lb.proc is not None and stack.lb.proc.poll() is None


async def test_reload_in_front_of_stock_servers_applies_backends_and_names_the_rest(
    tmp_path: Path,
) -> None:
    """The new user's file, edited: a third server added, the bound factor changed, a log
    section added. The reload adds the server (answering sessions), and names what needs a
    restart instead of dropping it silently."""
    with running_stack("fastapi", tmp_path) as stack, Server("fastapi", tmp_path) as third:
        cfg = yaml.safe_load(stack.lb.path.read_text())
        cfg["pools"][0]["backends"].append({"id": "c", "url": third.url})
        cfg["pools"][0]["hash_balance_factor"] = 1.5
        cfg["log"] = {"format": "json"}
        stack.lb.path.write_text(yaml.safe_dump(cfg))
        report = await stack.admin_post("/reload", {})
        assert report["added"] == ["c"] and report["removed"] == report["updated"] == []
        assert report["ignored"] == [
            "pool chat: hash_balance_factor (restart to apply)",
            "log (restart to apply)",
        ]
        view = await wait_for(stack, "c", lambda v: v["state"] == "active", "active")
        assert view["url"] == third.url
        stack.servers["c"] = third
        placed: set[str] = set()
        for i in range(12):
            async with asyncio.timeout(15), connect(stack.url(f"after-reload-{i}")) as ws:
                placed.add(str(await stack.turn(ws)))
        assert "c" in placed, placed
