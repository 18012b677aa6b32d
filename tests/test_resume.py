"""Client resume (SPEC section 13, Rule 8 of ``balancer/session_core.py``): a client whose TCP
drops mid-answer without a close reconnects with its token and count and gets the rest of the
answer, nothing lost or repeated, in front of servers nobody wrote for wslb. ``websockets``
clients are cut with ``transport.abort()`` (an RST, no close frame), as a phone changing
network or a middlebox would cut them."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from backends.model import token_text
from tests.procs import Procs, Wslb, free_port, pool_config, wait_port
from tests.servers import WORDS
from tests.test_failover import default_system
from tests.waits import until

TOKENS = 80


class Client:
    """One resumable client: counts the data messages it received over all its connections,
    as SPEC section 13 asks a client to."""

    def __init__(self, url: str, sid: str, path: str = "/ws") -> None:
        self.url = f"{url}{path}?session={sid}"
        self.sid = sid
        self.count = 0
        self.token: str | None = None
        self.ws: ClientConnection | None = None
        self.resumed: str | None = None

    async def open(self, resume: bool = False, count: int | None = None) -> None:
        headers: dict[str, str] = {}
        if self.token is not None:
            headers["X-WSLB-Resume-Token"] = self.token
        if resume:
            headers["X-WSLB-Resume-From"] = str(self.count if count is None else count)
        self.ws = await connect(self.url, additional_headers=headers, open_timeout=10)
        assert self.ws.response is not None
        self.token = self.ws.response.headers["X-WSLB-Resume-Token"]
        self.resumed = self.ws.response.headers.get("X-WSLB-Resumed")

    async def recv(self) -> Any:
        assert self.ws is not None
        msg = json.loads(await asyncio.wait_for(self.ws.recv(), 20))
        self.count += 1
        return msg

    def cut(self) -> None:
        """The TCP connection dies: no close frame, an RST."""
        assert self.ws is not None
        self.ws.transport.abort()


def metric(lb: Wslb, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}(?:\{{result=\"(\w+)\"\}})? (\S+)$", lb.admin("/metrics"), re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


async def away(lb: Wslb, sid: str) -> None:
    """Until wslb has seen the client's cut: the session is detached (bounded)."""

    def detached() -> bool:
        view = lb.admin(f"/sessions/{sid}")["resume"]
        return view is not None and bool(view["detached"])

    await until(detached, 10, f"session {sid} detached")


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Wslb]:
    lb, _ = default_system(tmp_path)
    yield lb
    lb.stop()


async def chat_cut_and_resumed(lb: Wslb, sid: str, cut_after: int) -> None:
    c = Client(lb.url, sid)
    await c.open()
    assert (await c.recv())["type"] == "hello"
    assert c.ws is not None
    await c.ws.send(json.dumps({"type": "prompt", "text": "tell me", "max_tokens": TOKENS}))
    seen: list[int] = []
    while len(seen) < cut_after:
        msg = await c.recv()
        assert msg["type"] == "token"
        seen.append(msg["i"])
    c.cut()
    await away(lb, sid)
    await c.open(resume=True)
    assert c.resumed == str(c.count)
    done = None
    while done is None:
        msg = await c.recv()
        if msg["type"] == "done":
            done = msg
        else:
            assert msg["type"] == "token" and msg["text"] == token_text(sid, 1, msg["i"])
            seen.append(msg["i"])
    assert seen == list(range(TOKENS)), f"{sid}: {seen}"  # every token once, in order
    assert done["tokens"] == TOKENS
    # The session goes on on the new connection: the next turn streams as usual.
    await c.ws.send(json.dumps({"type": "prompt", "text": "more", "max_tokens": 3}))
    kinds = [(await c.recv())["type"] for _ in range(4)]
    assert kinds == ["token", "token", "token", "done"]
    await c.ws.close()


async def test_chat_sessions_cut_mid_answer_get_the_rest(system: Wslb) -> None:
    """8 sessions through the repo's balancer.yaml, each cut mid-answer and back 0.3 s later:
    every token once and in order, one ``done``."""
    lb = system
    await asyncio.gather(*(chat_cut_and_resumed(lb, f"cut-{i}", 5 + 3 * i) for i in range(8)))
    assert metric(lb, "wslb_resumes_total").get("resumed") == 8
    assert metric(lb, "wslb_detached_sessions") == {"": 0}
    events = [e["kind"] for e in lb.admin("/events?since=0")["events"]]
    assert events.count("detached") == 8 and events.count("resumed") == 8


async def test_a_wrong_token_key_or_count_gets_409(system: Wslb) -> None:
    lb = system
    c = Client(lb.url, "victim")
    await c.open()
    await c.recv()  # hello
    c.cut()
    await away(lb, "victim")
    token = c.token
    assert token is not None
    attempts = [
        ("victim", "x" * 24, "1"),  # another token
        ("other", token, "1"),  # another key
        ("victim", token, "5"),  # more messages than were sent
    ]
    for sid, tok, count in attempts:
        with pytest.raises(InvalidStatus) as err:
            await connect(
                f"{lb.url}/ws?session={sid}",
                additional_headers={"X-WSLB-Resume-Token": tok, "X-WSLB-Resume-From": count},
            )
        assert err.value.response.status_code == 409, (sid, count)
        assert "error" in json.loads(err.value.response.body)
    with pytest.raises(InvalidStatus) as bad:
        await connect(f"{lb.url}/ws?session=victim", additional_headers={"X-WSLB-Resume-From": "1"})
    assert bad.value.response.status_code == 400  # a count without a token
    await c.open(resume=True)  # the right one still resumes after all of that
    assert c.resumed == "1"
    assert c.ws is not None
    await c.ws.close()


async def test_the_grace_expiring_gives_the_worker_1001(tmp_path: Path) -> None:
    lb, _ = default_system(tmp_path, resume={"enabled": True, "grace": "1s", "buffer": "64KiB"})
    try:
        c = Client(lb.url, "late")
        await c.open()
        await c.recv()
        c.cut()
        await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 1}, 10, "detached")
        await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 0}, 20, "grace over")
        assert lb.admin("/sessions") == []
        closes = [e for e in lb.admin("/events?since=0")["events"] if e["kind"] == "detached"]
        assert len(closes) == 1
        with pytest.raises(InvalidStatus) as err:
            await c.open(resume=True)
        assert err.value.response.status_code == 409
        assert "session late: client left without a close" in lb.log.read_text()
    finally:
        lb.stop()


async def test_a_half_open_connection_is_taken_over(system: Wslb) -> None:
    """The old connection still looks open (its TCP has not noticed the network change): the
    reconnect takes the session over, and the old one hears nothing more."""
    lb = system
    c = Client(lb.url, "halfopen")
    await c.open()
    await c.recv()
    old = c.ws
    assert old is not None
    await old.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": 30}))
    for _ in range(5):
        await c.recv()
    old.transport.pause_reading()  # the old connection goes silent, its TCP still up
    await c.open(resume=True)
    seen = []
    while True:
        msg = await c.recv()
        if msg["type"] == "done":
            break
        seen.append(msg["i"])
    assert seen == list(range(5, 30))
    assert c.ws is not None
    await c.ws.close()
    old.transport.abort()


def stock_system(tmp: Path, procs: Procs, module: str, path: str) -> Wslb:
    """wslb with resume, in front of one stock server (uvicorn's CLI or websockets')."""
    port = free_port()
    if module == "article":
        cmd = [sys.executable, "-m", "uvicorn", "tests.servers.article_app:app"]
        cmd += ["--port", str(port), "--log-level", "warning"]
    else:
        cmd = [sys.executable, "-m", "tests.servers.websockets_echo", "--port", str(port)]
    procs.spawn("stock", cmd)
    wait_port(port)
    cfg = pool_config(
        [{"id": "s", "url": f"ws://127.0.0.1:{port}"}],
        resume={"enabled": True, "grace": "10s"},
        match={"path_prefix": path},
    )
    lb = Wslb(cfg, tmp, procs=procs).start()
    lb.wait_ready(timeout=20)
    return lb


async def rest_of_words(c: Client, words: list[str]) -> None:
    """The article app's answer from here to its ``done``, word by word, into ``words``."""
    while (msg := await c.recv())["type"] != "done":
        words.append(msg["text"])


async def test_the_articles_fastapi_app_answer_survives_a_cut(tmp_path: Path) -> None:
    with Procs(tmp_path) as procs:
        lb = stock_system(tmp_path, procs, "article", "/ws/chat")
        c = Client(lb.url, "fa", path="/ws/chat")
        await c.open()
        assert c.ws is not None
        await c.ws.send("hello")
        words = [(await c.recv())["text"] for _ in range(4)]
        c.cut()
        await away(lb, c.sid)
        await c.open(resume=True)
        await rest_of_words(c, words)
        assert words == list(WORDS)
        await c.ws.close()


async def test_a_stock_websockets_server_sees_nothing_of_a_cut(tmp_path: Path) -> None:
    """An echo server: the messages sent before the cut are all echoed once, those after the
    resume go to the same server connection (it never saw the client leave)."""
    with Procs(tmp_path) as procs:
        lb = stock_system(tmp_path, procs, "echo", "/")
        c = Client(lb.url, "echo")
        await c.open()
        assert c.ws is not None
        for i in range(20):
            await c.ws.send(json.dumps({"n": i}))
        got = [(await c.recv())["n"] for _ in range(7)]
        c.cut()
        await away(lb, c.sid)
        await c.open(resume=True)
        while len(got) < 20:
            got.append((await c.recv())["n"])
        await c.ws.send(json.dumps({"n": 20}))
        got.append((await c.recv())["n"])
        assert got == list(range(21))
        await c.ws.close()


async def test_workers_n_a_reconnect_to_another_process_finds_its_session(
    tmp_path: Path,
) -> None:
    """``workers: 2``: the kernel spreads the reconnects over both serving processes; one that
    lands on the other process gets the session handed over (``handover.py``)."""
    import yaml

    from tests.procs import ROOT

    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    del cfg["listen"], cfg["admin"]
    cfg["workers"] = 2
    ports = [free_port() for _ in range(3)]
    env = {f"WSLB_WORKER_PORT{n + 1}": str(p) for n, p in enumerate(ports)}
    lb = Wslb(cfg, tmp_path, extra_env=env)
    lb.start()
    try:
        lb.wait_ready(timeout=30)
        await asyncio.gather(*(chat_cut_and_resumed(lb, f"n-{i}", 4 + i) for i in range(12)))
        log_text = lb.log.read_text()
        # 12 reconnects over 2 processes: all but a 2**-12 chance that one crossed over
        assert "adopted from another serving process" in log_text
        assert metric(lb, "wslb_resumes_total").get("resumed") == 12
        # The sibling's handover socket gives a session to its token only: a wrong one, asked
        # of whichever process the kernel picks, is 409 every time, the right one resumes.
        c = Client(lb.url, "guarded")
        await c.open()
        await c.recv()
        c.cut()
        await away(lb, "guarded")
        for _ in range(6):
            with pytest.raises(InvalidStatus) as err:
                await connect(
                    c.url,
                    additional_headers={
                        "X-WSLB-Resume-Token": "W" * 24,
                        "X-WSLB-Resume-From": "1",
                    },
                )
            assert err.value.response.status_code == 409
        await c.open(resume=True)
        assert c.resumed == "1" and c.ws is not None
        await c.ws.close()
    finally:
        lb.stop()
