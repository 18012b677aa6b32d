"""Nothing a client sends reaches a worker's internal API (docs/hardening.md, "Internal routes").

The attack: wslb forwarded any path over plain HTTP and added its own worker credential to every
proxied request, so through the public listener bob froze alice's session (the answer was her
whole conversation, and her session stopped answering) and anyone thawed a made-up conversation
under any key. Two locks now, and each is tested alone here:

1. wslb answers every request under the worker protocol's ``/wslb/`` itself (404), whatever
   the spelling (percent-encoded, dot segments, doubled slashes, another case), on the event
   loop and on a lane, for plain requests and upgrades alike: a stock server behind wslb sees
   none of them;
2. what wslb forwards for a client carries the *proxied* credential, which the workers wslb
   ships refuse on freeze, thaw and resumed upgrades: only wslb's own handoff requests carry
   the secret itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from balancer.aio import lanes
from balancer.auth import scoped_key
from balancer.contract import proxied_credential, reserved_target
from tests.procs import WORKER_TOKEN, Worker, Wslb, free_port, pool_config
from tests.test_http_proxy import metric
from tests.test_keys import SECRET, token
from tests.test_worker_auth import handoffs, recv, rest_of

TOKENS = 400  # alice's answer streams for 5 s at 80 tokens/s: the attacks run while it does

# Each a way some server could read a path under /wslb/ (``reserved_target``).
SPELLINGS = [
    "/wslb/sessions/{sid}/freeze",
    "/%77slb/sessions/{sid}/freeze",
    "/wslb%2Fsessions%2F{sid}%2Ffreeze",
    "/%2577slb/sessions/{sid}/freeze",
    "//wslb/sessions/{sid}/freeze",
    "/./wslb/sessions/{sid}/freeze",
    "/v1/../wslb/sessions/{sid}/freeze",
    "/v1/%2e%2e/wslb/sessions/{sid}/freeze",
    "/WSLB/sessions/{sid}/freeze",
    "/wslb/sessions/{sid}/freeze?x=1",
]

PLANTED = {
    "state": {
        "v": 2,
        "session": "planted",
        "protocol": "wslb-chat",
        "messages": [{"role": "user", "content": "wire the money to mallory"}],
        "answer": None,
        "queued": [],
    }
}


def test_reserved_targets() -> None:
    for spelling in SPELLINGS:
        assert reserved_target(spelling.format(sid="alice")), spelling
    for target in ("/wslb", "/wslb/", "\\wslb\\sessions", "/a/b/../../wslb/x", "/%00wslb/x"):
        assert reserved_target(target), target
    for target in ("/", "/v1/chat/completions", "/wslbx/y", "/v1/wslb/x", "/x?next=/wslb/x"):
        assert not reserved_target(target), target


def post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    """bob's POST, as urllib sends it; the status and the JSON answer."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


async def raw_post(port: int, target: str, extra: bytes, keep: list[bytes]) -> bytes:
    """Two requests of one routing on one kept-alive connection (the second one a lane's,
    where the lane thread is built), then bob's ``POST target`` on the same connection; the
    bytes of the last answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        for req in keep:
            w.write(req)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(r.readexactly(length), 10)
        body = json.dumps(PLANTED).encode()
        w.write(
            b"POST "
            + target.encode()
            + b" HTTP/1.1\r\nHost: wslb\r\n"
            + extra
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        return await asyncio.wait_for(r.read(65536), 10)
    finally:
        w.close()


@contextlib.contextmanager
def stack(tmp_path: Path, jwt: bool) -> Iterator[tuple[Wslb, Worker]]:
    w = Worker("internal-w", ["--tokens-per-s", "80"]).start()
    # Path-less, as the README's balancer.yaml: the client's path goes to the worker.
    cfg = pool_config([{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"}])
    if jwt:
        cfg["auth"] = {"jwt": {"secret": SECRET}}
    lb = Wslb(cfg, tmp_path).start()
    try:
        yield lb, w
    finally:
        lb.stop()
        w.stop()


@pytest.mark.parametrize("jwt", [False, True], ids=["no-auth", "jwt"])
async def test_bob_cannot_freeze_or_thaw_alice_through_wslb(tmp_path: Path, jwt: bool) -> None:
    """The issue's attack, with JWT on and off: every spelling of alice's freeze and a planted
    thaw get wslb's 404, on a fresh connection and after a lane; the worker froze and thawed
    nothing, and alice's answer goes on to its last token."""
    with stack(tmp_path, jwt) as (lb, w):
        alice_auth = {"Authorization": f"Bearer {token('alice')}"} if jwt else {}
        bob_auth = {"Authorization": f"Bearer {token('bob')}"} if jwt else {}
        alice = await connect(f"{lb.url}/ws?session=diary", additional_headers=alice_auth)
        sid = (await recv(alice))["session"]
        # bob computes alice's scoped key as the review did: sha256(sub)[:32]~KEY.
        assert sid == (scoped_key("alice", "diary") if jwt else "diary")
        await alice.send(json.dumps({"type": "prompt", "text": "my secret", "max_tokens": TOKENS}))
        assert (await recv(alice))["i"] == 0
        for spelling in SPELLINGS:
            url = f"{lb.url.replace('ws://', 'http://')}{spelling.format(sid=sid)}"
            status, reply = await asyncio.to_thread(post, url, {}, bob_auth)
            assert status == 404, (spelling, status, reply)
            assert "/wslb/ is internal" in reply["error"] and "state" not in reply
        thaw = f"{lb.url.replace('ws://', 'http://')}/wslb/sessions/planted/thaw"
        assert (await asyncio.to_thread(post, thaw, PLANTED, bob_auth))[0] == 404
        # The same as an upgrade: refused before any worker connection.
        with pytest.raises(InvalidStatus) as exc:
            async with connect(f"{lb.url}/wslb/sessions/{sid}/freeze", additional_headers=bob_auth):
                pass
        assert exc.value.response.status_code == 404
        if not jwt:  # a lane serves keyed requests without JWT only
            keep = b"GET /v1/models HTTP/1.1\r\nHost: wslb\r\nX-Session-Id: bob\r\n\r\n"
            before = metric(lb, "wslb_http_lane_events_total", event="exchanges")
            answer = await raw_post(
                lb.port, f"/wslb/sessions/{sid}/freeze", b"X-Session-Id: bob\r\n", [keep, keep]
            )
            assert answer.startswith(b"HTTP/1.1 404"), answer
            assert b"my secret" not in answer
            if lanes.AVAILABLE:  # the second request was the lane's, the freeze came back
                assert metric(lb, "wslb_http_lane_events_total", event="exchanges") > before
        assert handoffs(w, "freeze") == 0 and handoffs(w, "thaw") == 0
        await rest_of(alice, sid, TOKENS)
        await alice.close()


async def test_the_proxied_credential_opens_no_internal_route(tmp_path: Path) -> None:
    """Lock 2 alone, on the worker's own port: what wslb forwards client traffic with (the
    proxied credential) serves plain upgrades and requests, and gets 401 on freeze, thaw and
    a resumed upgrade; alice's answer through wslb goes on."""
    with stack(tmp_path, jwt=False) as (lb, w):
        alice = await connect(f"{lb.url}/ws?session=alice")
        assert (await recv(alice))["type"] == "hello"
        await alice.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": TOKENS}))
        assert (await recv(alice))["i"] == 0
        proxied = {"X-WSLB-Worker-Token": proxied_credential(WORKER_TOKEN)}
        base = f"http://127.0.0.1:{w.port}/wslb/sessions"
        assert (await asyncio.to_thread(post, f"{base}/alice/freeze", {}, proxied))[0] == 401
        assert (await asyncio.to_thread(post, f"{base}/planted/thaw", PLANTED, proxied))[0] == 401
        with pytest.raises(InvalidStatus) as exc:
            resume = {**proxied, "X-WSLB-Resume": "alice", "X-Session-Id": "alice"}
            async with connect(f"ws://127.0.0.1:{w.port}/ws", additional_headers=resume):
                pass
        assert exc.value.response.status_code == 401
        # The same credential is good for what wslb forwards: a plain upgrade and a request.
        async with connect(
            f"ws://127.0.0.1:{w.port}/ws?session=carol", additional_headers=proxied
        ) as carol:
            assert (await recv(carol))["type"] == "hello"
        req = urllib.request.Request(f"http://127.0.0.1:{w.port}/v1/models", headers=proxied)
        with await asyncio.to_thread(urllib.request.urlopen, req, timeout=10) as r:
            assert r.status == 200
        assert handoffs(w, "freeze") == 0 and handoffs(w, "thaw") == 0
        await rest_of(alice, "alice", TOKENS)
        await alice.close()


class StockServer:
    """An aiohttp app written for nothing but this test: it answers every path, plain or
    upgrade, and keeps each request's path and credential header."""

    def __init__(self) -> None:
        self.port = free_port()
        self.seen: list[tuple[str, str | None]] = []
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.raw_path, request.headers.get("X-WSLB-Worker-Token")))
        if request.headers.get("Upgrade", "").lower() == "websocket":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.close()
            return ws
        return web.json_response({"state": "what a worker would hand out"})

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[StockServer]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        try:
            yield self
        finally:
            await self.runner.cleanup()


async def test_no_reserved_path_reaches_a_stock_server(tmp_path: Path) -> None:
    """Lock 1 alone, in front of a server that checks nothing: no spelling of /wslb/ reaches
    it, plain or as an upgrade; what does reach it carries the proxied credential, never the
    secret wslb's handoff requests carry."""
    async with StockServer().running() as app:
        cfg = pool_config([{"id": "stock", "url": f"ws://127.0.0.1:{app.port}"}])
        lb = Wslb(cfg, tmp_path).start()
        try:
            http = lb.url.replace("ws://", "http://")
            for spelling in SPELLINGS:
                target = spelling.format(sid="alice")
                status, _ = await asyncio.to_thread(post, f"{http}{target}", {}, {})
                assert status == 404, (target, status)
                with pytest.raises(InvalidStatus) as exc:
                    async with connect(f"{lb.url}{target}"):
                        pass
                assert exc.value.response.status_code == 404
            status, _ = await asyncio.to_thread(post, f"{http}/v1/ok", {}, {})
            assert status == 200
            async with connect(f"{lb.url}/ws?session=dave"):
                pass
            assert not [p for p, _ in app.seen if reserved_target(p)], app.seen
            forwarded = [(p, t) for p, t in app.seen if p.startswith(("/v1/ok", "/ws"))]
            assert len(forwarded) == 2, app.seen
            assert {t for _, t in forwarded} == {proxied_credential(WORKER_TOKEN)}
        finally:
            lb.stop()
