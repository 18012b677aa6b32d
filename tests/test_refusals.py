"""A worker's own refusal of the upgrade reaches the client as the worker sent it; wslb's own
refusals name no backend; every refused handshake leaves a log line.

The worker is a stock ``websockets`` server that authenticates the upgrade itself (its
``process_request`` answers 401 with ``WWW-Authenticate`` for a missing token, 403 for a bad
one), as an application behind nginx or HAProxy does; the client is ``websockets``'s, which
raises ``InvalidStatus`` with the response it got.
"""

from __future__ import annotations

import http
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus
from websockets.http11 import Request, Response

from tests.procs import Wslb, free_port, pool_config


def check_token(conn: ServerConnection, request: Request) -> Response | None:
    token = request.headers.get("X-App-Token")
    if token is None:
        resp = conn.respond(http.HTTPStatus.UNAUTHORIZED, "app says: no token\n")
        resp.headers["WWW-Authenticate"] = 'Bearer realm="app"'
        return resp
    if token != "good":
        return conn.respond(http.HTTPStatus.FORBIDDEN, "app says: bad token\n")
    return None


async def echo(ws: ServerConnection) -> None:
    async for msg in ws:
        await ws.send(msg)


async def refused(url: str, headers: dict[str, str] | None = None) -> Response:
    with pytest.raises(InvalidStatus) as exc:
        async with connect(url, additional_headers=headers or {}):
            pass
    return exc.value.response


async def test_the_workers_own_refusal_reaches_the_client(tmp_path: Path) -> None:
    wport = free_port()
    lb = Wslb(pool_config([{"id": "e", "url": f"ws://127.0.0.1:{wport}"}]), tmp_path)
    async with serve(echo, "127.0.0.1", wport, process_request=check_token):
        lb.start()
        try:
            url = f"{lb.url}/ws?session=s"
            no_token = await refused(url)
            assert no_token.status_code == 401
            assert no_token.headers["WWW-Authenticate"] == 'Bearer realm="app"'
            assert no_token.body == b"app says: no token\n"
            for _ in range(8):  # more than outlier.consecutive_failures' default
                bad = await refused(url, {"X-App-Token": "stolen"})
                assert bad.status_code == 403 and bad.body == b"app says: bad token\n"
            # The client refreshes its token and gets in: the worker was not ejected for
            # answering its own clients.
            async with connect(url, additional_headers={"X-App-Token": "good"}) as ws:
                await ws.send("in")
                assert await ws.recv() == "in"
            (backend,) = lb.admin("/backends")
            assert backend["state"] == "active" and not backend.get("ejected_for"), backend
            log = lb.output()
            assert "refused GET /ws from 127.0.0.1: 403 refused by worker e" in log, log
            assert "refused GET /ws from 127.0.0.1: 401 refused by worker e" in log, log
        finally:
            lb.stop()


async def test_wslbs_own_refusals_name_no_backend_and_are_logged(tmp_path: Path) -> None:
    dead = free_port()
    cfg = pool_config([{"id": "secret-backend-7", "url": f"ws://127.0.0.1:{dead}"}])
    cfg["pools"][0]["match"] = {"path_prefix": "/chat"}
    lb = Wslb(cfg, tmp_path).start(wait_ready=False)
    try:
        gone = await refused(f"{lb.url}/chat?session=s")
        assert gone.status_code == 502
        assert b"secret-backend-7" not in gone.body, gone.body
        nowhere = await refused(f"{lb.url}/elsewhere")
        assert nowhere.status_code == 404
        bad_key = await refused(f"{lb.url}/chat?session=a%00b")
        assert bad_key.status_code == 400
        log = lb.output()
        assert "refused GET /chat from 127.0.0.1: 502" in log, log
        assert "refused GET /elsewhere from 127.0.0.1: 404 no pool serves /elsewhere" in log
        assert "refused GET /chat from 127.0.0.1: 400" in log
        # The operator's log says which worker failed.
        assert "secret-backend-7" in log
    finally:
        lb.stop()


def test_relayed_answer_keeps_end_to_end_headers_only() -> None:
    from balancer.handshake import WORKER_BODY_LIMIT, UpstreamReject

    rej = UpstreamReject(
        "worker answered 429, not 101",
        429,
        [
            (b"retry-after", b"3"),
            (b"content-type", b"application/json"),
            (b"connection", b"keep-alive"),
            (b"transfer-encoding", b"chunked"),
            (b"server", b"app/1.0"),
        ],
        b"x" * (WORKER_BODY_LIMIT + 10),
    )
    raw = rej.relayed()
    assert raw is not None
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
    assert b"retry-after: 3" in head and b"content-type: application/json" in head
    assert b"keep-alive" not in head and b"chunked" not in head and b"app/1.0" not in head
    assert f"content-length: {WORKER_BODY_LIMIT}".encode() in head
    assert len(body) == WORKER_BODY_LIMIT
    for status in (None, 200, 502, 503, 504):
        assert UpstreamReject("x", status).relayed() is None
