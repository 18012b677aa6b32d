"""Session keys (SPEC section 12): checked at the handshake, percent-encoded wherever they enter a
URL, scoped to their owner with JWT; and what else of a client's request the worker must not see
(the JWT in the query, forged ``Forwarded`` / ``X-Real-IP``).

The clients and the attacker here know nothing of wslb: ``websockets``, raw sockets, ``aiohttp``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import h11
import jwt
import pytest
from aiohttp import web
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus

from backends.model import token_text
from backends.wire import MAX_SESSION_ID_LEN
from balancer.aio.handoff import handoff_url
from balancer.auth import Authenticator, scoped_key
from balancer.backend import Backend
from balancer.config import AuthCfg, BackendCfg, JwtCfg
from balancer.config import KeySource as K
from balancer.contract import proxied_credential
from balancer.handshake import (
    SESSION_KEY_RULE,
    HandshakeReject,
    check_client_request,
    quote_key,
    session_key,
    valid_key,
)
from tests.procs import WORKER_TOKEN, Worker, Wslb, free_port, pool_config
from tests.waits import until
from tests.wsraw import RawClient

SECRET = "a-long-shared-secret-for-hs256-tests-" + "x" * 40
SOURCES = (K("query", "session"), K("header", "X-Session-Id"), K("cookie", "s"), K("path", "2"))
# Keys that break out of a URL path segment, or of a header line, or that are not text.
HOSTILE = [
    "bob/freeze?1",
    "a#b",
    "../../metrics",
    "a\r\nX-Evil: 1",
    "a\x00b",
    "ключ",
    "x" * 257,
    "a b",
    "<img src=x>",
]
# Keys the rule allows that a careless URL builder still gets wrong.
TRICKY = ["..", ".", "a:b@c~d.e", "team:7@chat~v1.2", "-_~", "A.B"]


def request(target: str = "/ws", **headers: str) -> Any:
    base = {
        "host": "x",
        "upgrade": "websocket",
        "connection": "Upgrade",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version": "13",
    }
    base.update({k.replace("_", "-"): v for k, v in headers.items()})
    raw = [(k.encode(), v.encode("latin-1")) for k, v in base.items()]  # bytes, as on the wire
    return check_client_request(h11.Request(method="GET", target=target, headers=raw))


def token(sub: str | None, **claims: Any) -> str:
    body: dict[str, Any] = {"exp": int(time.time()) + 120, **claims}
    if sub is not None:
        body["sub"] = sub
    return jwt.encode(body, SECRET, algorithm="HS256")


# -- the rule, sans-I/O ------------------------------------------------------------------------


def test_the_key_rule() -> None:
    for good in ["a", "x" * 256, "A-Z_a.z~0:9@", "..", *TRICKY]:
        assert valid_key(good), good
    for bad in ["", *HOSTILE]:
        assert not valid_key(bad), bad
    assert "1-256 characters of A-Z a-z 0-9 . _ ~ : @ -" in SESSION_KEY_RULE


@pytest.mark.parametrize("bad", HOSTILE)
def test_a_bad_key_from_any_source_is_a_400_naming_the_rule(bad: str) -> None:
    """Never truncated or cleaned (two keys would become one): refused, saying why."""
    raw = bad.encode("utf-8").decode("latin-1")  # what a header or cookie carries
    cases = [
        (request(f"/ws?session={quote(bad, safe='')}"), "query:session"),
        (request(f"/ws/{quote(bad, safe='')}"), "path:2"),
    ]
    if not any(c in bad for c in "\r\n\x00"):  # else h11 refuses the header line itself
        cases.append((request("/ws", x_session_id=raw), "header:X-Session-Id"))
        if bad.isascii() and not any(c in bad for c in " ;"):  # else there is no cookie
            cases.append((request("/ws", cookie=f"s={raw}"), "cookie:s"))
    for req, where in cases:
        sources = (K("path", "2"),) if where == "path:2" else SOURCES
        with pytest.raises(HandshakeReject) as exc:
            session_key(sources, req)
        assert exc.value.status == 400, where
        assert SESSION_KEY_RULE in exc.value.message and where in exc.value.message


def test_a_claim_key_follows_the_rule_too() -> None:
    auth = Authenticator(AuthCfg(jwt=JwtCfg(secret=SECRET, session_claim="sid")))
    assert auth.session_key({"sid": "ok-1"}) == "ok-1"
    with pytest.raises(HandshakeReject) as exc:
        auth.session_key({"sid": "a/b"})
    assert exc.value.status == 400 and "claim 'sid'" in exc.value.message


def test_handoff_urls_carry_any_key_as_one_segment() -> None:
    """The URL builder of migrate.py and failover.py: no key can end the segment (``/``, ``?``,
    ``#``) or be taken for a dot-segment (``.``, ``..``), even keys the rule refuses."""
    b = Backend(BackendCfg("w", "ws://127.0.0.1:9001"))
    for key in [*HOSTILE, *TRICKY, "%2e%2e", "x/../y"]:
        url = handoff_url(b, key, "freeze")
        assert url.raw_path == f"/wslb/sessions/{quote_key(key)}/freeze", key
        assert url.raw_path.count("/") == 4 and not url.raw_query_string and not url.fragment
    assert str(handoff_url(b, "bob/freeze?1", "thaw")).endswith("/bob%2Ffreeze%3F1/thaw")
    assert handoff_url(Backend(BackendCfg("t", "wss://h:1/x")), "k", "thaw").scheme == "https"


async def test_each_key_reaches_the_worker_as_itself() -> None:
    """Through aiohttp's client and server (what wslb and the workers run): the worker's route
    sees exactly the key, and the step, for every key."""
    seen: list[tuple[str, str]] = []

    async def step(request: web.Request) -> web.Response:
        seen.append((request.match_info["sid"], request.match_info["step"]))
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/wslb/sessions/{sid}/{step}", step)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    keys = [*HOSTILE, *TRICKY, "x/../y"]
    try:
        b = Backend(BackendCfg("w", f"ws://127.0.0.1:{port}"))
        async with aiohttp.ClientSession() as http:
            for key in keys:
                async with http.post(handoff_url(b, key, "freeze"), json={}) as resp:
                    assert resp.status == 200, key
    finally:
        await runner.cleanup()
    assert seen == [(k, "freeze") for k in keys]


def test_scoped_keys_are_unambiguous_and_fit_the_worker() -> None:
    a, b = scoped_key("alice", "k"), scoped_key("mallory", "k")
    assert a != b and a.endswith("~k") and b.endswith("~k")
    assert scoped_key("a~b", "c") != scoped_key("a", "b~c")
    assert scoped_key("ünïcode", "k") != scoped_key("unicode", "k")
    longest = scoped_key("o" * 1000, "x" * 256)
    assert len(longest) <= MAX_SESSION_ID_LEN and valid_key(longest[:256])
    assert scoped_key("alice", "k") == a  # stable: a reconnect finds its session


def test_owner_claim_and_a_token_without_one() -> None:
    auth = Authenticator(AuthCfg(jwt=JwtCfg(secret=SECRET, owner_claim="email")))
    assert auth.owner({"email": "a@example.com", "sub": "1"}) == "a@example.com"
    for claims in ({"sub": "1"}, {"email": ""}, {"email": {"x": 1}}):
        with pytest.raises(HandshakeReject) as exc:
            auth.owner(claims)
        assert exc.value.status == 401 and "'email'" in exc.value.message
    assert Authenticator(AuthCfg()).owner({}) is None  # no JWT: keys are bearer secrets


def test_the_jwt_query_parameter_is_stripped() -> None:
    auth = Authenticator(AuthCfg(jwt=JwtCfg(secret=SECRET, query_param="access_token")))
    req = auth.strip(request("/v1/realtime?model=m&access_token=T&session=s&access%5Ftoken=U"))
    assert req.query == "model=m&session=s" and req.target == "/v1/realtime?model=m&session=s"
    assert auth.strip(request("/ws?access_token=T")).query == ""
    plain = request("/ws?a=1")
    assert auth.strip(plain) is plain


def test_forwarded_and_x_real_ip_are_wslbs() -> None:
    forged = request("/ws", forwarded="for=6.6.6.6", x_real_ip="6.6.6.6", x_forwarded_for="1.1.1.1")
    untrusted = forged.forwarded_for("203.0.113.7", trusted=False)
    assert untrusted.header(b"forwarded") == b"for=203.0.113.7"
    assert untrusted.header(b"x-real-ip") == b"203.0.113.7"
    assert untrusted.header(b"x-forwarded-for") == b"1.1.1.1, 203.0.113.7"  # as nginx appends
    proxied = forged.forwarded_for("10.0.0.2", trusted=True, client="198.51.100.4")
    assert proxied.header(b"forwarded") == b"for=6.6.6.6, for=10.0.0.2"
    assert proxied.header(b"x-real-ip") == b"198.51.100.4"
    v6 = request("/ws").forwarded_for("2001:db8::1", trusted=False)
    assert v6.header(b"forwarded") == b'for="[2001:db8::1]"'
    kept = proxied.for_resume()  # a migration's new leg carries the same
    assert [kept.header(h) for h in (b"forwarded", b"x-real-ip")] == [
        b"for=6.6.6.6, for=10.0.0.2",
        b"198.51.100.4",
    ]


# -- through wslb --------------------------------------------------------------------------------


async def recv(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    obj = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    assert isinstance(obj, dict)
    return obj


async def ask(ws: ClientConnection, text: str, tokens: int = 3) -> dict[str, Any]:
    """One turn; every token checked against the worker's own session id (hello's)."""
    await ws.send(json.dumps({"type": "prompt", "text": text, "max_tokens": tokens}))
    i = 0
    while True:
        msg = await recv(ws)
        if msg["type"] == "done":
            assert msg["tokens"] == i == tokens, msg
            return msg
        assert msg["type"] == "token" and msg["i"] == i, msg
        i += 1


def _connections(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("wslb_worker_connections_total"):
            return float(line.split()[-1])
    raise AssertionError("wslb_worker_connections_total missing")


async def test_bad_keys_get_400_before_any_worker_and_no_traceback(tmp_path: Path) -> None:
    """``?session=a%0d%0a...``, ``%00``, non-Latin-1: 400 naming the rule (they were 500s with
    a traceback each); the worker is never contacted."""
    w = Worker("k1").start()
    lb = Wslb(pool_config([{"id": w.id, "url": w.url}]), tmp_path).start()
    try:
        before = _connections(w.metrics())
        for raw in ["a%0d%0aX-Evil:%201", "a%00b", "%D0%BA%D0%BB%D1%8E%D1%87", "x" * 300]:
            c = await RawClient.connect(lb.port, path=f"/ws?session={raw}")
            assert c.status == 400, raw
            c.close()
        c = await RawClient.connect(lb.port, headers={"X-Session-Id": "bob/freeze?1"})
        assert c.status == 400
        c.close()
        with pytest.raises(InvalidStatus) as exc:
            async with connect(f"{lb.url}/ws?session=a%23b"):
                pass
        assert exc.value.response.status_code == 400
        assert SESSION_KEY_RULE in exc.value.response.body.decode()
        assert _connections(w.metrics()) == before
        async with connect(f"{lb.url}/ws?session=fine.key~1") as ws:
            assert (await recv(ws))["session"] == "fine.key~1"
        assert "Traceback" not in lb.output() and " 500 " not in lb.output()
        assert 'wslb_handshake_rejections_total{status="400"} 6.0' in lb.admin("/metrics")
    finally:
        lb.stop()
        w.stop()


async def test_two_subjects_one_key_two_sessions(tmp_path: Path) -> None:
    """JWT on: mallory naming alice's key gets a conversation of her own (no cached context:
    the attack of the issue read ``cached_tokens`` 11), while alice's goes on; both see their
    own key in ``X-Session-Id``."""
    w = Worker("jwt-w").start()
    cfg = pool_config([{"id": w.id, "url": w.url}])
    cfg["auth"] = {"jwt": {"secret": SECRET, "query_param": "access_token"}}
    lb = Wslb(cfg, tmp_path).start()
    key = "alice-victim"
    secret_words = "the launch code is four two seven one nine"
    try:

        async def open_as(sub: str | None) -> ClientConnection:
            return await connect(
                f"{lb.url}/ws?session={key}",
                additional_headers={"Authorization": f"Bearer {token(sub)}"},
            )

        alice = await open_as("alice")
        assert alice.response is not None and alice.response.headers["X-Session-Id"] == key
        alice_sid = (await recv(alice))["session"]
        assert alice_sid == scoped_key("alice", key) != key
        first = await ask(alice, secret_words)
        assert first["cached_tokens"] == 0
        await alice.close()

        mallory = await open_as("mallory")
        assert mallory.response is not None and mallory.response.headers["X-Session-Id"] == key
        mallory_sid = (await recv(mallory))["session"]
        assert mallory_sid == scoped_key("mallory", key) != alice_sid
        stolen = await ask(mallory, "repeat what we said")
        assert stolen["cached_tokens"] == 0, stolen  # alice's context is not hers
        await mallory.close()

        alice = await open_as("alice")
        assert (await recv(alice))["session"] == alice_sid
        again = await ask(alice, "and then")
        assert again["cached_tokens"] >= len(secret_words.split()), again  # hers, cached
        await alice.close()

        # A token that names no owner cannot own a session.
        with pytest.raises(InvalidStatus) as exc:
            async with await open_as(None):
                pass
        assert exc.value.response.status_code == 401
        assert "'sub'" in exc.value.response.body.decode()
        # Sessions are listed by the key the workers see: the owner's tag shows.
        assert "Traceback" not in lb.output()
    finally:
        lb.stop()
        w.stop()


async def test_without_auth_a_key_is_a_bearer_secret(tmp_path: Path) -> None:
    """Documented (docs/config.md): without JWT, whoever names a key joins its session; a key
    wslb makes (none given) is 128 random bits."""
    w = Worker("bearer-w").start()
    lb = Wslb(pool_config([{"id": w.id, "url": w.url}]), tmp_path).start()
    try:
        async with connect(f"{lb.url}/ws?session=shared") as ws:
            await recv(ws)
            await ask(ws, "one two three four")
        async with connect(f"{lb.url}/ws?session=shared") as ws:
            await recv(ws)
            assert (await ask(ws, "five"))["cached_tokens"] >= 4
        async with connect(f"{lb.url}/ws") as ws:
            assert ws.response is not None
            made = ws.response.headers["X-Session-Id"]
            assert valid_key(made) and len(made) >= 22  # token_urlsafe(16)
    finally:
        lb.stop()
        w.stop()


class Recorder:
    """A stock ``websockets`` server that records each request's target and headers."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[tuple[str, dict[str, list[str]]]] = []

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        headers: dict[str, list[str]] = {}
        for k, v in ws.request.headers.raw_items():
            headers.setdefault(k.lower(), []).append(v)
        self.requests.append((ws.request.path, headers))
        async for msg in ws:
            await ws.send(msg)


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    async with serve(rec.handler, "127.0.0.1", rec.port):
        yield rec


async def test_what_the_worker_sees_of_a_client(recorder: Recorder, tmp_path: Path) -> None:
    """Behind JWT: no ``access_token`` in the worker's request target (the rest of the query
    kept), the scoped key, wslb's ``Forwarded``/``X-Real-IP`` instead of the client's, wslb's
    credential and not the one a client sends."""
    cfg = pool_config([{"id": "rec", "url": f"ws://127.0.0.1:{recorder.port}"}])
    cfg["auth"] = {"jwt": {"secret": SECRET, "query_param": "access_token"}}
    lb = Wslb(cfg, tmp_path).start(wait_ready=False)
    try:
        url = f"{lb.url}/v1/realtime?model=m&access_token={token('carol')}&session=s1"
        forged = {
            "Forwarded": "for=6.6.6.6;by=evil",
            "X-Real-IP": "6.6.6.6",
            "X-WSLB-Worker-Token": "a-guess-of-the-credential",
        }
        async with connect(url, additional_headers=forged) as ws:
            await ws.send("hi")
            assert await ws.recv() == "hi"
        ((target, headers),) = recorder.requests
        assert target == "/v1/realtime?model=m&session=s1", target
        assert headers["x-session-id"] == [scoped_key("carol", "s1")]
        assert headers["forwarded"] == ["for=127.0.0.1"]
        assert headers["x-real-ip"] == ["127.0.0.1"]
        # $WSLB_WORKER_TOKEN's proxied form: the secret itself goes with handoffs only
        assert headers["x-wslb-worker-token"] == [proxied_credential(WORKER_TOKEN)]
        assert headers["x-forwarded-for"] == ["127.0.0.1"]
    finally:
        lb.stop()


# -- keys with the rule's odd characters, migrated and failed over ---------------------------


async def read_turn(ws: ClientConnection, sid: str, turn: int, tokens: int) -> list[str]:
    """One answer, token by token (order, count, text); the workers it came from."""
    i, workers = 0, []
    while True:
        msg = await recv(ws, 20)
        if msg["type"] == "done":
            assert msg["tokens"] == i == tokens, (sid, msg, i)
            workers.append(msg["worker"])
            return workers
        assert msg["type"] == "token" and msg["turn"] == turn and msg["i"] == i, (sid, msg)
        assert msg["text"] == token_text(sid, turn, i)
        i += 1


async def test_odd_keys_migrate_and_fail_over_without_touching_another(tmp_path: Path) -> None:
    """Keys with ``:``, ``@``, ``~``, ``.`` and the key ``..`` itself are moved by the admin
    API and by crash failover; a neighbour whose key is a prefix of theirs (``team``) is never
    frozen, moved or failed over."""
    workers = [Worker(f"o{i}", ["--tokens-per-s", "60"]).start() for i in range(4)]
    cfg = pool_config(
        [{"id": w.id, "url": w.url} for w in workers],
        failover={"enabled": True},
        health={"interval": "0.2s", "timeout": "0.2s", "path": "/healthz", "fall": 1},
    )
    lb = Wslb(cfg, tmp_path).start()
    odd, neighbour = ["team:7@chat~v1.2", ".."], "team"
    try:
        conns = {}
        for key in [*odd, neighbour]:
            conns[key] = await connect(f"{lb.url}/ws?session={quote(key, safe='')}")
            assert (await recv(conns[key]))["session"] == key

        def where(key: str) -> str:
            return str(lb.admin(f"/sessions/{quote_key(key)}")["backend"])

        home = {key: where(key) for key in conns}
        target = next(w.id for w in workers if w.id not in home.values())

        def sent(key: str) -> int:
            return int(lb.admin(f"/sessions/{quote_key(key)}")["messages"]["worker_to_client"])

        async def streaming(before: dict[str, int]) -> None:
            """Every session has had a message of the new answer."""
            await until(lambda: all(sent(k) > n for k, n in before.items()), 10, "answers")

        # Turn 1 streams; the odd keys move to the target mid-answer.
        before = {k: sent(k) for k in conns}
        for ws in conns.values():
            await ws.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": 40}))
        turns = {k: asyncio.ensure_future(read_turn(ws, k, 1, 40)) for k, ws in conns.items()}
        await streaming(before)
        for key in odd:
            moved = await asyncio.to_thread(
                lb.admin_post, f"/sessions/{quote_key(key)}/migrate", {"to": target}
            )
            assert moved["migrated"] and moved["backend"] == target, moved
        done = {k: await asyncio.wait_for(t, 30) for k, t in turns.items()}
        for key in odd:
            assert done[key][-1] == target and where(key) == target
        assert where(neighbour) == home[neighbour] and done[neighbour] == [home[neighbour]]
        # Turn 2: the target is killed mid-answer; the odd keys fail over, the neighbour not.
        before = {k: sent(k) for k in conns}
        for ws in conns.values():
            await ws.send(json.dumps({"type": "prompt", "text": "more", "max_tokens": 40}))
        turns = {k: asyncio.ensure_future(read_turn(ws, k, 2, 40)) for k, ws in conns.items()}
        await streaming(before)
        next(w for w in workers if w.id == target).kill()
        done = {k: await asyncio.wait_for(t, 30) for k, t in turns.items()}
        for key in odd:
            assert where(key) not in (target,), key
        assert where(neighbour) == home[neighbour] and done[neighbour] == [home[neighbour]]
        sessions = {s["id"]: s for s in lb.admin("/sessions")}
        assert sessions[neighbour]["migrations"] == 0, sessions[neighbour]
        metrics = lb.admin("/metrics")
        assert 'wslb_failovers_total{result="resumed"} 2.0' in metrics, metrics
        for ws in conns.values():
            await ws.close()
        assert "Traceback" not in lb.output()
    finally:
        lb.stop()
        for w in workers:
            w.stop()
