"""Client resume's boundaries (SPEC sections 12-13), tested as an attacker would: another
owner's key and token, a forged token, parameters a worker must never see; and the rules of
``balancer/resume.py`` themselves."""

from __future__ import annotations

import json
from pathlib import Path

import h11
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus
from websockets.http11 import Request

from balancer.handshake import ClientRequest, HandshakeReject, check_client_request
from balancer.resume import NO_RESUME, read_resume, same_token, without_wslb_params
from tests.procs import Worker, Wslb, free_port, pool_config
from tests.test_auth import SECRET, token
from tests.test_resume import Client, away, metric
from tests.waits import until


def request(target: str, **headers: str) -> ClientRequest:
    base = {
        "host": "h",
        "upgrade": "websocket",
        "connection": "Upgrade",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version": "13",
        **headers,
    }
    return check_client_request(
        h11.Request(method="GET", target=target, headers=list(base.items()))
    )


def test_token_and_count_from_headers_or_the_query() -> None:
    t = "A" * 22
    assert read_resume(request("/ws")) == NO_RESUME
    got = read_resume(request("/ws", **{"x-wslb-resume-token": t, "x-wslb-resume-from": "7"}))
    assert (got.token, got.count) == (t, 7)
    got = read_resume(request(f"/ws?a=1&wslb_resume={t}&wslb_from=3"))
    assert (got.token, got.count) == (t, 3)


@pytest.mark.parametrize(
    ("target", "headers", "why"),
    [
        ("/ws", {"x-wslb-resume-token": "short"}, "22-128 characters"),
        ("/ws", {"x-wslb-resume-token": "A" * 129}, "22-128 characters"),
        ("/ws", {"x-wslb-resume-token": "A" * 21 + "/"}, "22-128 characters"),
        ("/ws", {"x-wslb-resume-token": "a" * 16}, "22-128 characters"),
        ("/ws", {"x-wslb-resume-from": "3"}, "needs the session's resume token"),
        ("/ws?wslb_resume=" + "A" * 22 + "&wslb_from=-1", {}, "ASCII digits"),
        ("/ws?wslb_resume=" + "A" * 22 + "&wslb_from=1e3", {}, "ASCII digits"),
    ],
)
def test_a_malformed_token_or_count_is_400_naming_the_rule(
    target: str, headers: dict[str, str], why: str
) -> None:
    with pytest.raises(HandshakeReject) as err:
        read_resume(request(target, **headers))
    assert err.value.status == 400 and why in str(err.value)


def test_wslb_parameters_are_stripped_and_the_rest_kept() -> None:
    req = request("/ws?session=a&wslb_resume=" + "A" * 22 + "&model=m&wslb_from=2")
    out = without_wslb_params(req)
    assert out.query == "session=a&model=m" and out.target == "/ws?session=a&model=m"
    plain = request("/ws?session=a")
    assert without_wslb_params(plain) is plain


def test_tokens_compare_in_constant_time_and_none_never_matches() -> None:
    assert same_token("A" * 22, "A" * 22) and not same_token("A" * 22, "B" * 22)
    assert not same_token(None, "A" * 22)


async def test_a_worker_never_sees_the_wslb_parameters(tmp_path: Path) -> None:
    """A stock ``websockets`` server records the request it got: no ``wslb_`` parameter, no
    resume header reaches it, on the first upgrade or the resume."""
    seen: list[Request] = []

    def record(conn: ServerConnection, req: Request) -> None:
        if "upgrade" in {k.lower() for k in req.headers}:  # not wslb's scrapes and probes
            seen.append(req)

    async def echo(ws: ServerConnection) -> None:
        async for m in ws:
            await ws.send(m)

    port = free_port()
    async with serve(echo, "127.0.0.1", port, process_request=record):
        cfg = pool_config([{"id": "s", "url": f"ws://127.0.0.1:{port}"}], resume={"enabled": True})
        lb = Wslb(cfg, tmp_path).start()
        try:
            t = "T" * 24
            ws = await connect(f"{lb.url}/chat?session=k&wslb_resume={t}")
            await ws.send("1")
            assert await ws.recv() == "1"
            ws.transport.abort()
            await away(lb, "k")
            ws2 = await connect(f"{lb.url}/chat?session=k&wslb_resume={t}&wslb_from=1")
            assert ws2.response is not None and ws2.response.headers["X-WSLB-Resumed"] == "1"
            await ws2.send("2")
            assert await ws2.recv() == "2"
            await ws2.close()
        finally:
            lb.stop()
    assert len(seen) == 1  # the resume went to the same server connection
    assert "wslb_" not in seen[0].path and seen[0].path == "/chat?session=k"
    assert not any(k.lower().startswith("x-wslb-resume") for k in seen[0].headers)


async def test_another_owner_with_the_key_and_token_gets_409(tmp_path: Path) -> None:
    """With JWT the key is scoped to its owner: bob, who learnt alice's key and token, finds
    nothing to resume; alice does."""
    w = Worker("jw").start()
    cfg = pool_config([{"id": "jw", "url": w.url}], resume={"enabled": True})
    cfg["auth"] = {"jwt": {"secret": SECRET, "algorithms": ["HS256"], "audience": "chat"}}
    lb = Wslb(cfg, tmp_path).start()
    try:
        alice = {"Authorization": f"Bearer {token({'sub': 'alice'})}"}
        bob = {"Authorization": f"Bearer {token({'sub': 'bob'})}"}
        c = Client(lb.url, "shared-key")
        c.ws = await connect(c.url, additional_headers=alice)
        assert c.ws.response is not None
        tok = c.ws.response.headers["X-WSLB-Resume-Token"]
        await c.recv()
        c.cut()
        # The owner's session (its id is not the bare key): detached once wslb saw the cut.
        await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 1}, 10, "detached")
        resume = {"X-WSLB-Resume-Token": tok, "X-WSLB-Resume-From": "1"}
        with pytest.raises(InvalidStatus) as err:
            await connect(c.url, additional_headers={**bob, **resume})
        assert err.value.response.status_code == 409
        assert json.loads(err.value.response.body)["resume"] == "unknown"
        ws = await connect(c.url, additional_headers={**alice, **resume})
        assert ws.response is not None and ws.response.headers["X-WSLB-Resumed"] == "1"
        await ws.close()
    finally:
        lb.stop()
        w.stop()
