"""``wslb.client`` under the cuts a network makes: a relay the test controls (``tests/cutrelay.py``)
between the library and a real wslb, resume on, in front of reference workers, a stock
``websockets`` server and the engine bridge on llama-server.

- an RST mid-answer, the network back after 0.5-3 s: the whole answer once and in order, the
  events ``reconnecting`` then ``resumed``;
- a silent drop (packets stop, nothing closes): the idle check finds it (wslb's pings stop
  coming) and the session resumes the same way; pings alone keep an idle session open;
- a cut longer than the pool's grace: ``SessionGone`` (409), ``restart()`` opens a new session
  (a new hello); a network down longer than the library's grace: ``GaveUp``;
- the rules as functions (close codes, refusals, backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import WebSocketException
from websockets.frames import Close

import wslb.client
from tests.cutrelay import CutRelay
from tests.engines import EngineSetupError, LlamaServer, gemma_gguf, llama_server
from tests.procs import Procs, Worker, Wslb, free_port, pool_config, wait_port
from tests.test_bridge import STORY, BridgeProc
from tests.tier import until
from wslb.client import GaveUp, Session, SessionClosed, SessionGone

IDLE = 1.5  # the library's idle_timeout in these tests
PINGS = {"ping_interval": "0.5s", "ping_timeout": "0.4s"}  # wslb pings every 0.5 s
# A silent cut stops both the data and wslb's pings: whichever side notices first (wslb's
# missing pong detaches the session; the library's idle check resumes it), nothing is lost.


def wslb_for(
    backends: list[dict[str, Any]], tmp: Path, grace: str, timeouts: dict[str, str]
) -> Wslb:
    cfg = pool_config(backends, resume={"enabled": True, "grace": grace})
    cfg["timeouts"] = timeouts
    return Wslb(cfg, tmp).start()


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Wslb]]:
    """One reference worker (20 tokens/s) behind three wslb: ``main`` (grace 10 s, pings every
    0.5 s) and ``short`` (grace 2 s)."""
    tmp = tmp_path_factory.mktemp("ref")
    w = Worker("r1", ["--tokens-per-s", "20"]).start()
    lbs: dict[str, Wslb] = {}
    try:
        backends = [{"id": w.id, "url": w.url}]
        lbs["main"] = wslb_for(backends, tmp, "10s", PINGS)
        lbs["short"] = wslb_for(backends, tmp, "2s", PINGS)
        yield lbs
    finally:
        for lb in lbs.values():
            lb.stop()
        w.kill()


@contextlib.asynccontextmanager
async def relayed(lb: Wslb) -> AsyncIterator[CutRelay]:
    relay = await CutRelay("127.0.0.1", lb.port).start()
    try:
        yield relay
    finally:
        await relay.close()


def url(relay: CutRelay) -> str:
    return f"ws://127.0.0.1:{relay.port}/ws"


@contextlib.asynccontextmanager
async def through(lb: Wslb, key: str, **kw: Any) -> AsyncIterator[tuple[CutRelay, Session]]:
    """A session with ``key`` through a relay in front of ``lb``."""
    async with relayed(lb) as relay, wslb.client.connect(url(relay), key=key, **kw) as s:
        yield relay, s


async def hello(s: Session) -> dict[str, Any]:
    m = json.loads(await s.recv())
    assert m["type"] == "hello", m
    return dict(m)


async def answer(
    s: Session, turn: int, n: int, at: int | None = None, cut: Callable[[], Any] | None = None
) -> list[int]:
    """Ask for ``n`` tokens; the indices received in order (``cut()`` after ``at`` of them)."""
    await s.send(json.dumps({"type": "prompt", "text": f"q{turn}", "max_tokens": n}))
    got: list[int] = []
    async for raw in s:
        m = json.loads(raw)
        if m["type"] == "token":
            assert m["turn"] == turn, m
            got.append(m["i"])
            if cut is not None and len(got) == at:
                cut()
        elif m["type"] == "done":
            assert m["turn"] == turn and m["tokens"] == n, m
            return got
        else:
            raise AssertionError(f"unexpected {m}")
    raise AssertionError("the session ended")


def kinds(s: Session) -> list[str]:
    return [e.kind for e in s.events]


# -- reference workers -------------------------------------------------------------------------


@pytest.mark.parametrize("down", [0.5, 3.0])
async def test_an_rst_mid_answer_is_resumed(ref: dict[str, Wslb], down: float) -> None:
    async with through(ref["main"], f"rst-{down}", idle_timeout=IDLE) as (relay, s):
        await hello(s)
        got = await asyncio.wait_for(
            answer(s, 1, 40, at=8, cut=lambda: relay.cut("rst", down=down)), 30
        )
        assert got == list(range(40))
        assert kinds(s)[0] == "open" and kinds(s)[-1] == "resumed", s.events
        first = next(e for e in s.events if e.kind == "reconnecting")
        assert first.detail["why"] == "lost", s.events
        resumed = s.events[-1].detail
        assert 1 + 8 <= resumed["from"] < 1 + 40  # the library may have read ahead of the app
        assert resumed["gap"] >= down * 0.9
        # The session goes on: the next turn, on the new connection.
        assert await asyncio.wait_for(answer(s, 2, 5), 15) == list(range(5))
        assert s.count == 1 + 41 + 6
    assert kinds(s)[-1] == "close"


async def test_a_silent_drop_is_found_by_the_idle_check(ref: dict[str, Wslb]) -> None:
    async with through(ref["main"], "silent", idle_timeout=IDLE) as (relay, s):
        await hello(s)
        got = await asyncio.wait_for(
            answer(s, 1, 40, at=8, cut=lambda: relay.cut("silent", down=1.0)), 30
        )
        assert got == list(range(40))
        whys = [e.detail["why"] for e in s.events if e.kind == "reconnecting"]
        assert whys[0] == "idle", s.events
        assert kinds(s)[-1] == "resumed"


async def test_pings_keep_an_idle_session_open(ref: dict[str, Wslb]) -> None:
    """No data for three idle timeouts: wslb's pings alone say the path is alive (the library
    sends nothing: the relay carried no frame of its own from it but the prompt)."""
    async with through(ref["main"], "quiet", idle_timeout=IDLE) as (_, s):
        await hello(s)
        # Negative check: the condition is that nothing happens meanwhile.
        await asyncio.sleep(3 * IDLE)
        assert kinds(s) == ["open"], s.events
        assert await asyncio.wait_for(answer(s, 1, 3), 10) == [0, 1, 2]


async def test_a_silent_drop_of_an_idle_session_is_resumed(ref: dict[str, Wslb]) -> None:
    """Only wslb's pings flow: they stop, the idle check resumes the session."""
    async with through(ref["main"], "idle-silent", idle_timeout=IDLE) as (relay, s):
        await hello(s)
        relay.cut("silent", down=0.5)
        await until(lambda: "resumed" in kinds(s) or "gone" in kinds(s), 10, "resumed or gone")
        assert kinds(s)[-1] == "resumed", s.events
        assert await asyncio.wait_for(answer(s, 1, 3), 10) == [0, 1, 2]


async def test_a_cut_longer_than_grace_is_gone_then_restart(
    ref: dict[str, Wslb], caplog: pytest.LogCaptureFixture
) -> None:
    # the pool's grace: 2 s
    async with through(ref["short"], "gone", idle_timeout=IDLE) as (relay, s):
        await hello(s)
        token = s.token
        with pytest.raises(SessionGone) as info:
            await asyncio.wait_for(
                answer(s, 1, 60, at=5, cut=lambda: relay.cut("rst", down=3.5)), 30
            )
        assert info.value.code == 409 and info.value.reason["resume"] == "unknown"
        assert kinds(s)[-1] == "gone" and s.state is wslb.client.State.GONE
        with pytest.raises(SessionGone):  # it stays gone until the application restarts
            await s.recv()
        with pytest.raises(SessionGone):
            await s.send("{}")
        await s.restart()
        assert s.token != token and s.count == 0 and kinds(s)[-1] == "open"
        await hello(s)  # a new session: the worker greets it
        assert await asyncio.wait_for(answer(s, 2, 4), 15) == list(range(4))
    assert not [r for r in caplog.records if r.name == "wslb.client"], caplog.text


async def test_a_network_down_past_the_librarys_grace_gives_up(ref: dict[str, Wslb]) -> None:
    async with through(ref["main"], "giveup", grace=1.5) as (relay, s):
        await hello(s)
        relay.cut("rst", down=5)
        with pytest.raises(GaveUp):
            await asyncio.wait_for(s.recv(), 10)
        assert kinds(s)[-1] == "giveup" and "reconnecting" in kinds(s)
        # The application starts again: refused while the network is down, then a new session.
        with pytest.raises((OSError, WebSocketException)):
            await s.restart()
        assert s.state is wslb.client.State.GAVE_UP

        async def restarted() -> None:
            while True:
                try:
                    return await s.restart()
                except (OSError, WebSocketException):
                    await asyncio.sleep(0.2)

        await asyncio.wait_for(restarted(), 15)
        await hello(s)


async def test_close_ends_the_iteration(ref: dict[str, Wslb]) -> None:
    events: list[wslb.client.Event] = []
    s = await wslb.client.connect(f"{ref['main'].url}/ws", on_event=events.append)
    await hello(s)
    assert s.key  # the key wslb made, kept for reconnects
    await s.close()
    assert [e.kind for e in events] == ["open", "close"]
    assert [m async for m in s] == []
    with pytest.raises(SessionClosed):
        await s.recv()


# -- a stock websockets server -------------------------------------------------------------


async def test_a_stock_server_behind_wslb(tmp_path: Path) -> None:
    with Procs(tmp_path) as procs:
        port = free_port()
        cmd = [sys.executable, "-m", "tests.servers.websockets_counter", "--port", str(port)]
        procs.spawn("stock", [*cmd, "--rate", "20"])
        wait_port(port)
        lb = wslb_for([{"id": "s", "url": f"ws://127.0.0.1:{port}"}], tmp_path, "10s", PINGS)
        try:
            async with through(lb, "stock", idle_timeout=IDLE) as (relay, s):

                async def count(n: int, cut: str | None) -> list[str]:
                    await s.send(str(n))
                    out: list[str] = []
                    async for raw in s:
                        if raw == "end":
                            return out
                        out.append(str(raw))
                        if cut is not None and len(out) == 10:
                            relay.cut(cut, down=1.0)  # type: ignore[arg-type]
                    raise AssertionError("ended")

                assert await asyncio.wait_for(count(40, "rst"), 30) == [str(i) for i in range(40)]
                assert await asyncio.wait_for(count(40, "silent"), 30) == [
                    str(i) for i in range(40)
                ]
                assert kinds(s).count("resumed") == 2, s.events
        finally:
            lb.stop()


# -- the engine bridge on llama-server -------------------------------------------------------


@pytest.mark.engine
async def test_the_engine_bridge_answer_is_whole_across_cuts(tmp_path: Path) -> None:
    try:
        llama_server(), gemma_gguf()  # built and cached once per machine
    except EngineSetupError as e:
        pytest.skip(f"the engine cannot be made here: {e}")
    with contextlib.ExitStack() as stack:
        engine = LlamaServer(tmp_path / "llama.log", parallel=1, threads=1).start()
        stack.callback(engine.stop)
        bridge = BridgeProc(engine.url, "llama-c", "--temperature", "0")
        stack.callback(bridge.stop)
        bridge.wait_health(200, timeout=30)
        lb = wslb_for([{"id": bridge.id, "url": bridge.ws}], tmp_path, "10s", PINGS)
        stack.callback(lb.stop)
        prompt = {"type": "prompt", "text": STORY, "max_tokens": 80, "temperature": 0}

        async def story(s: Session, relay: CutRelay, turn: int, how: str) -> int:
            """The answer's tokens, each index once and in order, cut after the 10th."""
            await s.send(json.dumps(prompt))
            i = 0
            async for raw in s:
                m = json.loads(raw)
                if m["type"] == "done":
                    assert m["tokens"] == i, (m, i)
                    return i
                assert m["type"] == "token" and m["turn"] == turn and m["i"] == i, m
                i += 1
                if i == 10:
                    relay.cut(how, down=1.0)  # type: ignore[arg-type]
            raise AssertionError("ended")

        async with through(lb, "engine", idle_timeout=IDLE) as (relay, s):
            await hello(s)
            assert await asyncio.wait_for(story(s, relay, 1, "rst"), 120) > 10
            assert await asyncio.wait_for(story(s, relay, 2, "silent"), 120) > 10
            assert kinds(s).count("resumed") == 2, s.events
            whys = [e.detail["why"] for e in s.events if e.kind == "reconnecting"]
            assert "lost" in whys and "idle" in whys, s.events


# -- the rules as functions --------------------------------------------------------------------


def test_what_a_close_means() -> None:
    cc = wslb.client.classify_close
    assert cc(None, None) == ("loss", "lost")
    assert cc(Close(1012, "wslb stopping: resume"), None) == ("loss", "1012")
    assert cc(Close(1012, "restarting"), None) == ("closed", (1012, "restarting"))
    assert cc(Close(1000, ""), None) == ("closed", (1000, ""))
    assert cc(Close(4404, '{"resume":"unknown"}'), None) == ("gone", (4404, {"resume": "unknown"}))
    reason = '{"resume":"refused","reason":"count_ahead"}'
    assert cc(Close(4409, reason), None)[0] == "gone"
    assert cc(Close(4429, '{"resume":"throttled","retry_after":3}'), None) == ("throttled", 3.0)
    assert cc(None, Close(1009, "too big")) == ("closed", (1009, "too big"))


def test_what_a_refused_reconnect_means() -> None:
    cs = wslb.client.classify_status
    assert cs(409, {}, b'{"error":"x","resume":"closed"}') == (
        "gone",
        {"error": "x", "resume": "closed"},
    )
    assert cs(400, {}, b"bad token") == ("gone", {"error": "bad token"})
    assert cs(429, {"Retry-After": "2"}, b"") == ("throttled", 2.0)
    assert cs(503, {}, b"") == ("retry", None)


def test_backoff() -> None:
    b = wslb.client.backoff
    assert [b(k, lambda: 0.5) for k in range(1, 8)] == [0.05, 1, 2, 4, 8, 8, 8]
    assert b(1, lambda: 0.999) < 0.1 and b(3, lambda: 0.0) == 1.0
    assert len(wslb.client.new_token()) == 32
