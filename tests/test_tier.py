"""Continuity across the instances of a tier: three wslb instances in cluster mode over a real
etcd, behind HAProxy in TCP mode (round robin: each connection may land on another instance),
in front of reference workers. The clients resume as docs/resume.md says (``wslb.client``).

- a client cut mid-answer reconnects through another instance: every token once, in order;
- ``kill -9`` of an instance with answers in flight: every answer whole through the others;
- SIGTERM of an instance (a rollout): the same, idle sessions too;
- a stock ``websockets`` server behind a cut client: whole while the holder lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from balancer.contract import peer_credential
from tests.engines import EngineSetupError, LlamaServer, gemma_gguf, llama_server
from tests.procs import WORKER_TOKEN, Procs, Worker, Wslb, free_port, pool_config, wait_port
from tests.test_bridge import STORY, BridgeProc
from tests.tier import Tier, metric, until, workers
from wslb.client import Session
from wslb.client import connect as resuming

TOKENS = 60


async def answer(c: Session, turn: int, n: int, cut_after: int | None = None) -> list[int]:
    """Ask for ``n`` tokens; the indices received, in order (a cut after ``cut_after``)."""
    await c.send(json.dumps({"type": "prompt", "text": f"q{turn}", "max_tokens": n}))
    got: list[int] = []
    while True:
        m = json.loads(await c.recv())
        if m["type"] == "token":
            assert m["turn"] == turn, m
            got.append(m["i"])
            if cut_after is not None and len(got) == cut_after:
                c.drop()
        elif m["type"] == "done":
            assert m["turn"] == turn and m["tokens"] == n, m
            return got
        else:
            raise AssertionError(f"unexpected {m}")


async def opened(url: str, key: str) -> Session:
    c = await resuming(url, key=key, max_size=None)
    hello = json.loads(await c.recv())
    assert hello["type"] == "hello", hello
    return c


def reconnects(c: Session) -> int:
    """Losses the session came back from."""
    return sum(e.kind == "resumed" for e in c.events)


@pytest.fixture
def tier(tmp_path: Path) -> Any:
    # 20 tokens/s: an answer cut after its 10th token has 2.5 s left to stream, so a client
    # slowed by a loaded machine has not read ahead to its end when the cut comes.
    ws = workers(3, ("--tokens-per-s", "20"))
    try:
        t = Tier(tmp_path, [{"id": w.id, "url": w.url} for w in ws]).start()  # stops on failure
        try:
            yield t
        finally:
            t.stop()
    finally:
        for w in ws:
            w.kill()  # their parked sessions would hold a drain up for their grace


def reconnect_through(clients: list[Session], lb: Wslb) -> None:
    """Send every later reconnect to ``lb`` (a phone's new address hashing to one instance):
    through round robin, the order of the reconnects could bring each back to its own holder."""
    for c in clients:
        c.url = lb.url


async def test_a_cut_client_resumes_through_another_instance(tier: Tier) -> None:
    clients = [await opened(tier.url, f"cut-{i}") for i in range(6)]
    held = tier.holding()
    assert sum(held) == 6 and held[0] < 6, held  # round robin spread them
    reconnect_through(clients, tier.lbs[0])
    got = await asyncio.gather(*(answer(c, 1, TOKENS, cut_after=10) for c in clients))
    for c, indices in zip(clients, got, strict=True):
        assert indices == list(range(TOKENS)), (c.key, indices)
        assert reconnects(c) == 1
    # The next turn continues the conversation on the same session.
    again = await asyncio.gather(*(answer(c, 2, 5) for c in clients))
    assert all(g == list(range(5)) for g in again)
    carried = tier.total("wslb_resumes_total", result="carried")
    resumed = tier.total("wslb_resumes_total", result="resumed")  # each at its holder
    assert (carried, resumed) == (6 - held[0], 6)
    assert tier.total("wslb_resumes_total", result="unknown") == 0
    for c in clients:
        await c.close()


async def test_kill_9_of_an_instance_loses_no_answer(tier: Tier) -> None:
    clients = [await opened(tier.url, f"kill-{i}") for i in range(9)]
    tasks = [asyncio.ensure_future(answer(c, 1, TOKENS)) for c in clients]
    await until(lambda: all(c.count >= 10 for c in clients), 20, "answers under way")
    held = tier.holding()
    victim = tier.lbs[held.index(max(held))]
    victim.kill()
    got = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(g == list(range(TOKENS)) for g in got), got
    moved = [c for c in clients if reconnects(c)]
    assert len(moved) == max(held), (held, [reconnects(c) for c in clients])
    assert tier.total("wslb_resumes_total", result="reattached") == max(held)
    again = await asyncio.gather(*(answer(c, 2, 5) for c in clients))
    assert all(g == list(range(5)) for g in again)
    for c in clients:
        await c.close()


async def test_sigterm_hands_every_session_over(tier: Tier) -> None:
    streaming = [await opened(tier.url, f"term-{i}") for i in range(9)]
    idle = [await opened(tier.url, f"idle-{i}") for i in range(6)]
    tasks = [asyncio.ensure_future(answer(c, 1, TOKENS)) for c in streaming]
    await until(lambda: all(c.count >= 10 for c in streaming), 20, "answers under way")
    held = tier.holding()
    victim = tier.lbs[held.index(max(held))]
    code = await asyncio.to_thread(tier.terminate, victim)
    assert code == 0
    got = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(g == list(range(TOKENS)) for g in got), got
    assert "handed over to their workers" in victim.output()
    # The idle ones were told to resume too: their next turn is turn 2 of the same session.
    for c in idle:
        assert await answer(c, 1, 3) == [0, 1, 2]
    assert sum(reconnects(c) for c in streaming + idle) == max(held)
    for c in streaming + idle:
        await c.close()


async def test_a_stock_server_session_is_whole_while_its_instance_lives(tmp_path: Path) -> None:
    with Procs(tmp_path) as procs:
        port = free_port()
        cmd = [sys.executable, "-m", "tests.servers.websockets_counter", "--port", str(port)]
        procs.spawn("stock", [*cmd, "--rate", "20"])
        wait_port(port)
        t = Tier(tmp_path, [{"id": "s", "url": f"ws://127.0.0.1:{port}"}]).start()
        try:
            clients = [await resuming(t.url, key=f"stock-{i}", max_size=None) for i in range(6)]
            held = t.holding()
            assert sum(held) == 6 and held[0] < 6, held
            reconnect_through(clients, t.lbs[0])

            async def count(c: Session) -> list[str | bytes]:
                await c.send("60")
                out: list[str | bytes] = []
                while True:
                    raw = await c.recv()
                    if raw == "end":
                        return out
                    out.append(raw)
                    if len(out) == 10 and reconnects(c) == 0:
                        c.drop()

            got = await asyncio.gather(*(count(c) for c in clients))
            assert all(g == [str(i) for i in range(60)] for g in got), got
            assert all(reconnects(c) == 1 for c in clients)
            assert t.total("wslb_resumes_total", result="carried") == 6 - held[0]
        finally:
            t.stop()


@pytest.mark.engine
@pytest.mark.parametrize("how", ["kill", "term"])
async def test_engine_bridges_lose_no_answer_to_a_lost_instance(tmp_path: Path, how: str) -> None:
    """Two engine bridges on real llama-servers behind the tier: an instance killed (or
    stopped) mid-answer; every answer goes on through the others, each chunk once, in order."""
    try:
        llama_server(), gemma_gguf()  # built and cached once per machine
    except EngineSetupError as e:
        pytest.skip(f"the engine cannot be made here: {e}")
    with contextlib.ExitStack() as stack:
        bridges = []
        for i in range(2):
            engine = LlamaServer(tmp_path / f"llama-{i}.log", parallel=2, threads=1).start()
            stack.callback(engine.stop)
            bridge = BridgeProc(engine.url, f"llama-{i}", "--temperature", "0")
            stack.callback(bridge.stop)
            bridges.append(bridge)
        for bridge in bridges:
            bridge.wait_health(200, timeout=30)
        backends = [{"id": b.id, "url": f"ws://127.0.0.1:{b.port}"} for b in bridges]
        t = Tier(tmp_path, backends, pool={"health": {"path": "/healthz", "interval": "0.5s"}})
        stack.callback(t.stop)
        t.start()
        clients = [await opened(t.url, f"engine-{how}-{i}") for i in range(4)]
        prompt = {"type": "prompt", "text": STORY, "max_tokens": 120, "temperature": 0}

        async def story(c: Session) -> list[int]:
            await c.send(json.dumps(prompt))
            got: list[int] = []
            while (m := json.loads(await c.recv()))["type"] != "done":
                assert m["type"] == "token" and m["turn"] == 1, m
                got.append(m["i"])
            return got

        tasks = [asyncio.ensure_future(story(c)) for c in clients]
        await until(lambda: all(c.count >= 6 for c in clients), 60, "answers under way")
        held = t.holding()
        victim = t.lbs[held.index(max(held))]
        if how == "kill":
            victim.kill()
        else:
            assert await asyncio.to_thread(t.terminate, victim) == 0
        got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for g in got:
            assert g == list(range(len(g))) and len(g) > 10, g
        assert sum(reconnects(c) for c in clients) == max(held) > 0
        for c in clients:
            await c.close()


# -- the tier's own headers, as an attacker sends them --------------------------------------


@pytest.fixture
def lone(tmp_path: Path) -> Any:
    """One instance (no cluster), resume on, in front of one reference worker."""
    w = Worker("a1", ["--tokens-per-s", "200"]).start()
    cfg = pool_config([{"id": w.id, "url": w.url}], resume={"enabled": True})
    lb = Wslb(cfg, tmp_path).start()
    try:
        yield lb
    finally:
        lb.stop()
        w.kill()


async def _refusal(url: str, headers: dict[str, str]) -> int:
    try:
        async with connect(url, additional_headers=headers, open_timeout=5):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_a_forged_peer_header_buys_no_free_guesses(lone: Wslb) -> None:
    """``X-WSLB-Peer`` without the tier's credential is any client's header: its failed
    resumes are counted and throttled (10 per 10 s), as without it."""
    forged = {"X-WSLB-Peer": "peer-" + "0" * 64, "X-WSLB-Peer-Client": "203.0.113.9"}
    statuses = []
    for i in range(11):
        headers = {**forged, "X-WSLB-Resume-Token": f"guess{i:02d}" + "x" * 20}
        statuses.append(
            await _refusal(f"{lone.url}/ws?session=alice", {**headers, "X-WSLB-Resume-From": "3"})
        )
    assert statuses == [409] * 10 + [429], statuses
    assert metric(lone, "wslb_resumes_total", result="unknown") == 10


async def test_a_carried_miss_is_the_receivers_to_count(lone: Wslb) -> None:
    """With the tier's credential (an instance), a miss is a plain 409, counted and throttled
    by the instance that carried it, not here; nothing is carried on or reattached."""
    peer = {"X-WSLB-Peer": peer_credential(WORKER_TOKEN), "X-WSLB-Peer-Client": "203.0.113.9"}
    statuses = []
    for i in range(12):
        headers = {**peer, "X-WSLB-Resume-Token": f"miss{i:02d}" + "x" * 20}
        headers["X-WSLB-Resume-From"] = "1"
        statuses.append(await _refusal(f"{lone.url}/ws?session=bob", headers))
    assert statuses == [409] * 12, statuses
    assert metric(lone, "wslb_resumes_total", result="unknown") == 0
    assert metric(lone, "wslb_resumes_total", result="reattached") == 0


async def test_a_clients_park_and_reattach_headers_never_reach_the_worker(lone: Wslb) -> None:
    """A client sending the worker's own reattach headers through wslb to take alice's session:
    they are dropped (were they forwarded, the worker would refuse the proxied credential with
    401); the client gets a new session of its own and alice's answer goes on."""
    alice = await opened(lone.url, "alice")
    await alice.send(json.dumps({"type": "prompt", "text": "q", "max_tokens": 3}))
    forged = {
        "X-WSLB-Reattach": "alice",
        "X-WSLB-Reattach-From": "0",
        "X-WSLB-Park": "base=0; grace=30; window=65536; token=" + "0" * 64,
    }
    async with connect(f"{lone.url}/ws?session=mallory", additional_headers=forged) as ws:
        hello = json.loads(await ws.recv())
        assert hello == {"type": "hello", "worker": "a1", "session": "mallory"}, hello
    while json.loads(await alice.recv())["type"] != "done":
        pass
    await alice.close()
