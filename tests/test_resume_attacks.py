"""Client resume under attack (docs/resume.md, docs/hardening.md): the requests as an attacker,
a careless client or a user's second tab sends them, against a real wslb and real workers.

- A plain upgrade on a key never takes that key's detached session from its owner: the resume
  finds its session by token (JWT on and off).
- A count that is not the session's (a client that never reset it) is refused with a reason,
  never served from the wrong message.
- A malformed count or a short client-named token is a 400 naming the rule, no traceback.
- No ``X-WSLB-*`` header from a client reaches a worker, on an upgrade or a plain request.
- Failed resumes are throttled per address: 429 with ``Retry-After``, counted, logged once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus
from websockets.http11 import Request, Response

from balancer.config import ConfigError, parse
from balancer.resume import FailureThrottle, token_digest
from balancer.session_core import Mode, ResumeRefused, SessionCore
from tests.procs import Worker, Wslb, free_port, pool_config
from tests.test_auth import SECRET, token
from tests.test_lanes import Recorder, exchanges, needs_lanes, recorded, served
from tests.test_resume import Client, metric
from tests.test_session_core import resumable, written

__all__ = ["recorded"]  # the fixture, imported for its name

RESUME = {"enabled": True, "grace": "20s", "buffer": "256KiB"}


async def until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def detached(lb: Wslb) -> float:
    return metric(lb, "wslb_detached_sessions").get("", 0.0)


@pytest.fixture
def chat(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Wslb]:
    """A reference worker at 50 tokens/s behind wslb with resume on; JWT with ``jwt``."""
    w = Worker("rw").start()
    cfg = pool_config([{"id": "rw", "url": w.url}], resume=RESUME)
    if getattr(request, "param", False):
        cfg["auth"] = {"jwt": {"secret": SECRET, "algorithms": ["HS256"], "audience": "chat"}}
    lb = Wslb(cfg, tmp_path).start()
    try:
        yield lb
    finally:
        lb.stop()
        w.stop()


async def refused(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any], Response]:
    with pytest.raises(InvalidStatus) as err:
        await connect(url, additional_headers=headers, open_timeout=10)
    r = err.value.response
    body = json.loads(r.body) if r.headers.get("Content-Type") == "application/json" else {}
    return r.status_code, body, r


async def tokens_until_done(c: Client) -> list[int]:
    seen = []
    while True:
        msg = await c.recv()
        if msg["type"] == "done":
            return seen
        assert msg["type"] == "token"
        seen.append(msg["i"])


@pytest.mark.parametrize("chat", [False, True], ids=["no-auth", "jwt"], indirect=True)
async def test_a_plain_upgrade_on_the_key_does_not_take_the_detached_session(
    chat: Wslb, request: pytest.FixtureRequest
) -> None:
    """Alice is cut mid-answer; a plain upgrade on her key (anyone who knows it, without JWT; her
    own second tab, with it) starts a new session. Her resume still finds hers, by token, and
    gets every token; both sessions show in GET /sessions meanwhile, one detached."""
    lb = chat
    jwt_on = request.node.callspec.params["chat"]
    auth = {"Authorization": f"Bearer {token({'sub': 'alice'})}"} if jwt_on else {}
    c = Client(lb.url, "alice-key")
    c.ws = await connect(c.url, additional_headers=auth, open_timeout=10)
    assert c.ws.response is not None
    c.token = c.ws.response.headers["X-WSLB-Resume-Token"]
    assert (await c.recv())["type"] == "hello"
    await c.ws.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": 40}))
    seen = [(await c.recv())["i"] for _ in range(5)]
    c.cut()
    await until(lambda: detached(lb) == 1, what="alice's session detached")

    tab = await connect(c.url, additional_headers=auth, open_timeout=10)  # no token, no count
    assert json.loads(await asyncio.wait_for(tab.recv(), 10))["type"] == "hello"
    listed = lb.admin("/sessions")
    assert len(listed) == 2 and sum(bool(s["resume"]["detached"]) for s in listed) == 1
    assert detached(lb) == 1

    resume = {"X-WSLB-Resume-Token": c.token, "X-WSLB-Resume-From": str(c.count)}
    c.ws = await connect(c.url, additional_headers={**auth, **resume}, open_timeout=10)
    assert c.ws.response is not None
    assert c.ws.response.headers["X-WSLB-Resumed"] == str(c.count)
    seen += await tokens_until_done(c)
    assert seen == list(range(40))  # every token once, in order
    assert detached(lb) == 0
    assert metric(lb, "wslb_resumes_total").get("resumed") == 1
    # The tab's session is untouched: it goes on.
    await tab.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 2}))
    kinds = [json.loads(await asyncio.wait_for(tab.recv(), 10))["type"] for _ in range(3)]
    assert kinds == ["token", "token", "done"]
    await tab.close()
    await c.ws.close()


async def test_a_token_in_use_is_not_shared_with_another_key(chat: Wslb) -> None:
    """A client-named token already bound to a session of another key is refused (409
    ``taken``), not shared: its owner's resume still lands on its own session."""
    lb = chat
    t = "own-token-" + "x" * 20
    a = Client(lb.url, "key-a")
    a.token = t
    await a.open()
    await a.recv()
    status, body, _ = await refused(f"{lb.url}/ws?session=key-b", {"X-WSLB-Resume-Token": t})
    assert status == 409 and body["resume"] == "taken"
    a.cut()
    await until(lambda: detached(lb) == 1, what="detached")
    await a.open(resume=True)
    assert a.resumed == "1"
    assert a.ws is not None
    await a.ws.close()


async def test_a_count_never_reset_is_refused_not_served_from_the_wrong_place(
    chat: Wslb,
) -> None:
    """docs/resume.md's old advice: one token, a count never reset. Session 1: 12 messages, cut,
    resumed, closed. Session 2 on the same key and token: 12 messages received of a longer
    answer, cut. Its resume with the old count (24) is a 409 saying the count is not this
    session's; with the count of this session (12) every token comes, once."""
    lb = chat
    c = Client(lb.url, "reuser")
    c.token = "reused-token-" + "r" * 20
    await c.open()
    assert (await c.recv())["type"] == "hello"
    assert c.ws is not None
    await c.ws.send(json.dumps({"type": "prompt", "text": "one", "max_tokens": 10}))
    while (await c.recv())["type"] != "done":
        pass
    assert c.count == 12
    c.cut()
    await until(lambda: detached(lb) == 1, what="session 1 detached")
    await c.open(resume=True)
    assert c.resumed == "12"
    assert c.ws is not None
    await c.ws.close()
    await until(lambda: lb.admin("/sessions") == [], what="session 1 ended")

    # Session 2: the same token, the count carried on (24 after 12 more).
    await c.open()
    assert c.resumed is None  # a new session: it counts from 0 again
    assert (await c.recv())["type"] == "hello"
    await c.ws.send(json.dumps({"type": "prompt", "text": "two", "max_tokens": 60}))
    for _ in range(11):
        assert (await c.recv())["type"] == "token"
    assert c.count == 24
    c.cut()
    await until(lambda: detached(lb) == 1, what="session 2 detached")

    def streamed() -> int:
        return int(lb.admin("/sessions")[0]["messages"]["worker_to_client"])

    # The answer goes on while the client is away: message 24 exists, just not for this count.
    await until(lambda: streamed() > 30, what="the answer streamed past message 24")
    url = c.url
    status, body, _ = await refused(
        url, {"X-WSLB-Resume-Token": c.token, "X-WSLB-Resume-From": "24"}
    )
    assert status == 409 and body["resume"] == "refused" and body["reason"] == "count_ahead"
    assert "counts from 0" in body["error"]
    c.count = 12  # what this session sent
    await c.open(resume=True)
    assert c.resumed == "12"
    seen = await tokens_until_done(c)
    assert seen == list(range(11, 60))
    await c.ws.close()


def raw_upgrade(port: int, target: str, extra: bytes) -> bytes:
    """An upgrade as a raw socket sends it; the answer's head and body."""
    req = (
        (
            f"GET {target} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        ).encode()
        + extra
        + b"\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    ("header", "query"),
    [
        ("X-WSLB-Resume-From: \xb2\r\n".encode("latin-1"), ""),  # '²': isdigit() says yes
        (b"X-WSLB-Resume-From: " + b"9" * 5000 + b"\r\n", ""),
        (b"", "&wslb_from=%C2%B2"),
        (b"", "&wslb_from=" + "1" * 5000),
        (b"X-WSLB-Resume-From: 12345678901234567\r\n", ""),  # 17 digits
    ],
    ids=["superscript-header", "5000-digits-header", "superscript-query", "5000-query", "17"],
)
def test_a_count_that_is_not_ascii_digits_is_400_without_a_traceback(
    chat: Wslb, header: bytes, query: str
) -> None:
    lb = chat
    tok = "t" * 24
    # The token in a header: a 400 naming the rule.
    answer = raw_upgrade(
        lb.port, f"/ws?session=k{query}", f"X-WSLB-Resume-Token: {tok}\r\n".encode() + header
    )
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"1-16 ASCII digits" in answer
    # In the query (a browser, which sees no status): a 101 and a close saying the same.
    answer = raw_upgrade(lb.port, f"/ws?session=k&wslb_resume={tok}{query}", header)
    assert in_band(answer) == (4400, {"resume": "invalid", "reason": "count"}), answer[:200]
    log = lb.output()
    assert "Traceback" not in log and " 500 " not in log


@pytest.mark.parametrize("tok", ["a" * 16, "a" * 21, "a" * 21 + "!"])
def test_a_short_client_named_token_is_400_naming_the_rule(chat: Wslb, tok: str) -> None:
    """A client-named token carries 128 bits at least: 22 characters of base64url."""
    lb = chat
    answer = raw_upgrade(lb.port, "/ws?session=k", f"X-WSLB-Resume-Token: {tok}\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"22-128 characters" in answer
    answer = raw_upgrade(lb.port, f"/ws?session=k&wslb_resume={tok}", b"")
    assert in_band(answer) == (4400, {"resume": "invalid", "reason": "token"}), answer[:200]


def in_band(answer: bytes) -> tuple[int, Any]:
    """The close code and JSON reason of a refusal in the browser form (a 101, then a close)."""
    head, _, frame = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ") and frame[0] == 0x88, answer[:200]
    payload = frame[2 : 2 + frame[1]]
    return int.from_bytes(payload[:2], "big"), json.loads(payload[2:])


async def test_no_x_wslb_header_from_a_client_reaches_a_websocket_worker(tmp_path: Path) -> None:
    """A stock ``websockets`` server records what it is sent: the resume headers, a forged
    credential and any other ``X-WSLB-*`` a client sends never reach it, on the first
    upgrade, on the resume, or on a plain request."""
    seen: list[Request] = []

    def record(conn: ServerConnection, req: Request) -> Response | None:
        if req.path.startswith(("/healthz", "/metrics")):
            return None
        seen.append(req)
        if "upgrade" not in {k.lower() for k in req.headers}:
            return conn.respond(200, "plain\n")
        return None

    async def echo(ws: ServerConnection) -> None:
        async for m in ws:
            await ws.send(m)

    port = free_port()
    async with serve(echo, "127.0.0.1", port, process_request=record):
        cfg = pool_config(
            [{"id": "s", "url": f"ws://127.0.0.1:{port}"}],
            resume=RESUME,
            health={"enabled": False},
        )
        lb = Wslb(cfg, tmp_path).start()
        try:
            t = "H" * 24
            forged = {"X-WSLB-Worker-Token": "forged-" + "f" * 20, "X-WSLB-Anything": "1"}
            ws = await connect(
                f"{lb.url}/chat?session=k",
                additional_headers={"X-WSLB-Resume-Token": t, **forged},
            )
            await ws.send("1")
            assert await ws.recv() == "1"
            ws.transport.abort()
            await until(lambda: detached(lb) == 1, what="detached")
            ws2 = await connect(
                f"{lb.url}/chat?session=k",
                additional_headers={"X-WSLB-Resume-Token": t, "X-WSLB-Resume-From": "1", **forged},
            )
            assert ws2.response is not None and ws2.response.headers["X-WSLB-Resumed"] == "1"
            await ws2.send("2")
            assert await ws2.recv() == "2"
            await ws2.close()
            plain = urllib.request.Request(
                f"http://127.0.0.1:{lb.port}/chat/plain?session=p",
                headers={"X-WSLB-Resume-Token": t, "X-WSLB-Resume-From": "3", **forged},
            )
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(plain, timeout=10).read())
            assert body == b"plain\n"
        finally:
            lb.stop()
    assert len(seen) == 2  # the upgrade (the resume went to the same connection), the request
    for req in seen:  # wslb's own headers only, never the client's forgery
        wslb_headers = [(k.lower(), v) for k, v in req.headers.raw_items()]
        wslb_headers = [(k, v) for k, v in wslb_headers if k.startswith("x-wslb-")]
        names = [k for k, _ in wslb_headers]
        assert set(names) <= {"x-wslb-worker-token", "x-wslb-park"}, (req.path, wslb_headers)
        assert all("forged" not in v for _, v in wslb_headers) and len(set(names)) == len(names)
        # The park parameters of an upgrade are wslb's: the session's count, its token's digest.
        for k, v in wslb_headers:
            if k == "x-wslb-park":
                assert v.startswith("base=0;") and v.endswith(token_digest(t).hex()), v


@needs_lanes
async def test_no_x_wslb_header_reaches_a_worker_through_the_lane_thread(
    recorded: tuple[Wslb, Recorder],
) -> None:
    """Kept-alive requests after the first are written by the lane thread in C: the
    ``X-WSLB-*`` headers a client sends are dropped there too."""
    lb, rec = recorded
    req = (
        b"GET /v1/x HTTP/1.1\r\nHost: api.example\r\nX-Session-Id: lane-k\r\n"
        b"X-WSLB-Resume-Token: " + b"L" * 24 + b"\r\nx-wslb-resume-from: 3\r\n"
        b"X-Wslb-Worker-Token: forged-ffffffffffffffffff\r\nX-WSLB-Other: 1\r\n\r\n"
    )
    before = exchanges(lb)
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    try:
        for _ in range(4):
            w.write(req)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await r.readexactly(n)
    finally:
        w.close()
    assert await served(lb, before + 3) - before == 3  # the thread wrote three of them
    heads = [h for h in rec.heads if h.startswith(b"GET /v1/x")]
    assert len(heads) == 4
    for h in heads:  # wslb's own credential only, never the client's forgery
        lines = [x for x in h.lower().split(b"\r\n") if x.startswith(b"x-wslb-")]
        assert all(x.startswith(b"x-wslb-worker-token: ") for x in lines), h
        assert b"forged" not in h and len(lines) <= 1, h


def test_failed_resumes_are_throttled_per_address(chat: Wslb) -> None:
    """Guessing tokens from one address (raw sockets): after 10 failures in 10 s, 429 with
    Retry-After, counted as ``throttled`` and logged once, not once per request."""
    lb = chat
    statuses = []
    for i in range(30):
        guess = f"X-WSLB-Resume-Token: guess-{i:04d}-{'g' * 20}\r\nX-WSLB-Resume-From: 1\r\n"
        answer = raw_upgrade(lb.port, "/ws?session=victim", guess.encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        statuses.append(status)
        if status == 429:
            assert b"\r\nretry-after: " in head.lower()
            assert json.loads(body)["resume"] == "throttled"
    # The bucket refills one failure a second: a slow loop may earn one more 409 later on.
    assert statuses[:11] == [409] * 10 + [429] and statuses.count(429) >= 15, statuses
    results = metric(lb, "wslb_resumes_total")
    assert results.get("unknown") == statuses.count(409)
    assert results.get("throttled") == statuses.count(429)
    assert lb.output().count("too many failed resumes from 127.0.0.1") == 1


def test_the_throttle_is_a_bucket_per_address_refilled_over_its_window() -> None:
    """``FailureThrottle`` without I/O: 3 failures per 3 s; another address is not held; one
    try comes back each second; one log line per address and window."""
    t = FailureThrottle(3, 3.0)
    for _ in range(3):
        assert t.retry_after("a", 0.0) == 0.0
        t.failed("a", 0.0)
    assert t.retry_after("a", 0.0) == pytest.approx(1.0)
    assert t.retry_after("b", 0.0) == 0.0
    assert t.retry_after("a", 1.0) == 0.0  # one back
    t.failed("a", 1.0)
    assert t.retry_after("a", 1.5) == pytest.approx(0.5)
    assert t.first_refusal("a", 1.5) and not t.first_refusal("a", 4.0)
    assert t.first_refusal("a", 4.6)
    off = FailureThrottle(0, 3.0)
    off.failed("a", 0.0)
    assert off.retry_after("a", 0.0) == 0.0


def test_the_throttle_is_configured_per_pool() -> None:
    cfg = parse(
        pool_config(
            [{"id": "w", "url": "ws://127.0.0.1:1"}],
            resume={"enabled": True, "max_failures": 3, "failure_window": "1m"},
        )
    )
    assert (cfg.pools[0].resume.max_failures, cfg.pools[0].resume.failure_window) == (3, 60.0)
    for bad in ({"max_failures": -1}, {"failure_window": "0s"}):
        with pytest.raises(ConfigError):
            parse(pool_config([{"id": "w", "url": "ws://127.0.0.1:1"}], resume=bad))


def test_the_core_checks_a_count_against_what_the_lost_connection_was_given() -> None:
    """Sans I/O: 3 messages before the loss, 5 more while detached. A count of 4 (or 8) is
    not this session's: refused, nothing changed; 3 gets the 5, and the next loss checks
    against all 8; a snapshot keeps the bound."""
    c = resumable()
    written(c, b"a", b"b", b"c")
    c.client_lost(now=1.0)
    later = written(c, *(b"%d" % i for i in range(5)))
    for n in (4, 8):
        with pytest.raises(ResumeRefused) as err:
            c.attach(n)
        assert err.value.why == "count_ahead" and "(3)" in err.value.reason
    assert c.mode is Mode.DETACHED
    restored = SessionCore.restore(c.snapshot())
    with pytest.raises(ResumeRefused):
        restored.attach(4)
    assert c.attach(3) == later
    c.client_lost(now=2.0)
    assert c.attach(8) == b""
