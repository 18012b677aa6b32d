"""The browser form of resume: every outcome a ``WebSocket`` object can see (docs/resume.md,
"What a browser sees"). A client that names its token in the query reads no header and no
status: an open is its session resumed from the count it named; a resume wslb cannot honour
is a 101 and at once a close with a 4xxx code and a JSON reason. The header form keeps its
statuses. Real wslb, real reference worker, the ``websockets`` client reading only what a
browser could (``ws.recv``, the close code and reason); Chromium itself is in
tests/test_client_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from balancer.resume import CLOSE_GONE, CLOSE_INVALID, CLOSE_REFUSED, CLOSE_THROTTLED
from tests.procs import Worker, Wslb, pool_config
from tests.test_resume import metric
from tests.tier import Tier, workers

RESUME = {"enabled": True, "grace": "20s", "buffer": "256KiB", "max_failures": 4}


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Wslb]:
    w = Worker("rw", ["--tokens-per-s", "50"]).start()
    lb = Wslb(pool_config([{"id": "rw", "url": w.url}], resume=RESUME), tmp_path).start()
    try:
        yield lb
    finally:
        lb.stop()
        w.stop()


def new_token() -> str:
    return secrets.token_urlsafe(24)


def url(lb: Wslb, key: str, token: str, count: int | None = None) -> str:
    out = f"{lb.url}/ws?session={key}&wslb_resume={token}"
    return out if count is None else f"{out}&wslb_from={count}"


async def closed_in_band(target: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    """Open ``target`` (it must open: a browser would see ``open``), then the close wslb
    sends at once: its code and JSON reason."""
    ws = await connect(target, open_timeout=10, **kw)
    with pytest.raises(ConnectionClosed) as err:
        await asyncio.wait_for(ws.recv(), 10)
    rcvd = err.value.rcvd
    assert rcvd is not None, "no close frame: a browser would see 1006"
    return rcvd.code, json.loads(rcvd.reason)


async def recv_json(ws: ClientConnection) -> Any:
    return json.loads(await asyncio.wait_for(ws.recv(), 20))


async def test_an_open_is_the_resume_from_the_count_named(lb: Wslb) -> None:
    token = new_token()
    ws = await connect(url(lb, "alice", token), open_timeout=10)
    got = [await recv_json(ws)]  # hello
    await ws.send(json.dumps({"type": "prompt", "text": "tell me", "max_tokens": 40}))
    while len(got) < 11:
        got.append(await recv_json(ws))
    ws.transport.abort()  # lost without a close
    # The reconnect reads no header: the open says it all; the next message is message 11.
    again = await connect(url(lb, "alice", token, len(got)), open_timeout=10)
    rest = []
    while not rest or rest[-1]["type"] != "done":
        rest.append(await recv_json(again))
    indices = [m["i"] for m in got + rest if m["type"] == "token"]
    assert indices == list(range(40))
    await again.close()


async def test_a_session_gone_is_4404(lb: Wslb) -> None:
    code, reason = await closed_in_band(url(lb, "bob", new_token(), 3))
    assert (code, reason) == (CLOSE_GONE, {"resume": "unknown"})
    assert metric(lb, "wslb_resumes_total").get("unknown") == 1


async def test_a_count_ahead_is_4409_and_the_session_stays(lb: Wslb) -> None:
    token = new_token()
    ws = await connect(url(lb, "carol", token), open_timeout=10)
    assert (await recv_json(ws))["type"] == "hello"
    ws.transport.abort()
    code, reason = await closed_in_band(url(lb, "carol", token, 500))
    assert (code, reason) == (CLOSE_REFUSED, {"resume": "refused", "reason": "count_ahead"})
    # Refused, not lost: the right count still resumes it.
    again = await connect(url(lb, "carol", token, 1), open_timeout=10)
    await again.send(json.dumps({"type": "prompt", "text": "x", "max_tokens": 2}))
    assert (await recv_json(again))["type"] == "token"
    await again.close()


async def test_a_token_of_another_key_is_4409_taken(lb: Wslb) -> None:
    token = new_token()
    ws = await connect(url(lb, "dave", token), open_timeout=10)
    code, reason = await closed_in_band(url(lb, "erin", token))
    assert (code, reason) == (CLOSE_REFUSED, {"resume": "taken"})
    await ws.close()


async def test_a_malformed_count_is_4400(lb: Wslb) -> None:
    code, reason = await closed_in_band(f"{url(lb, 'frank', new_token())}&wslb_from=%C2%B2")
    assert (code, reason) == (CLOSE_INVALID, {"resume": "invalid", "reason": "count"})
    code, reason = await closed_in_band(url(lb, "frank", "short"))
    assert (code, reason) == (CLOSE_INVALID, {"resume": "invalid", "reason": "token"})


async def test_throttled_is_4429_with_the_wait(lb: Wslb) -> None:
    for _ in range(RESUME["max_failures"]):  # type: ignore[arg-type]
        code, _ = await closed_in_band(url(lb, "guess", new_token(), 1))
        assert code == CLOSE_GONE
    code, reason = await closed_in_band(url(lb, "guess", new_token(), 1))
    assert code == CLOSE_THROTTLED
    assert reason["resume"] == "throttled" and reason["retry_after"] >= 1


async def test_the_subprotocol_offered_is_echoed(lb: Wslb) -> None:
    """A browser fails an upgrade that offered subprotocols and got none back, and would show
    the refusal as 1006: the 101 names the first one offered."""
    target = url(lb, "gina", new_token(), 2)
    ws = await connect(target, subprotocols=["chat.v1", "chat.v0"], open_timeout=10)  # type: ignore[list-item]
    assert ws.subprotocol == "chat.v1"
    with pytest.raises(ConnectionClosed) as err:
        await asyncio.wait_for(ws.recv(), 10)
    assert err.value.rcvd is not None and err.value.rcvd.code == CLOSE_GONE


async def test_the_connection_ends_cleanly_after_the_close(lb: Wslb) -> None:
    """Raw bytes: the 101 and the close arrive, the client's close is answered by the end of
    the TCP connection (a FIN, not a reset that could destroy the close before it is read)."""
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    target = f"/ws?session=hal&wslb_resume={new_token()}&wslb_from=1"
    head = (
        f"GET {target} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", lb.port), timeout=10) as s:
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 4:
            chunk = s.recv(4096)
            assert chunk, data
            data += chunk
        status, _, frame = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 101 ")
        assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in status
        assert frame[0] == 0x88 and int.from_bytes(frame[2:4], "big") == CLOSE_GONE
        s.sendall(bytes([0x88, 0x82, 0, 0, 0, 0]) + CLOSE_GONE.to_bytes(2, "big"))
        rest = b""
        while chunk := s.recv(4096):  # a reset would raise here
            rest += chunk
        assert len(frame) + len(rest) == 2 + frame[1]


async def test_the_header_form_keeps_its_statuses(lb: Wslb) -> None:
    headers = {"X-WSLB-Resume-Token": new_token(), "X-WSLB-Resume-From": "3"}
    with pytest.raises(InvalidStatus) as err:
        await connect(f"{lb.url}/ws?session=ivy", additional_headers=headers, open_timeout=10)
    assert err.value.response.status_code == 409
    assert json.loads(err.value.response.body)["resume"] == "unknown"


async def test_through_another_instance_of_a_tier(tmp_path: Path) -> None:
    """Two instances in cluster mode: a browser's resume through the instance that does not
    hold the session opens and goes on (the instances speak statuses among themselves); a
    session no instance holds is a 4404 to the browser, not a 409 it cannot see."""
    ws_ = workers(1, ("--tokens-per-s", "50"))
    t = Tier(tmp_path, [{"id": w.id, "url": w.url} for w in ws_], instances=2)
    try:
        t.start()
        a, b = t.lbs
        token = new_token()
        ws = await connect(url(a, "june", token), open_timeout=10)
        got = [await recv_json(ws)]
        await ws.send(json.dumps({"type": "prompt", "text": "go", "max_tokens": 30}))
        while len(got) < 6:
            got.append(await recv_json(ws))
        ws.transport.abort()
        again = await connect(url(b, "june", token, len(got)), open_timeout=10)
        while got[-1]["type"] != "done":
            got.append(await recv_json(again))
        assert [m["i"] for m in got if m["type"] == "token"] == list(range(30))
        assert t.total("wslb_resumes_total", result="carried") == 1
        await again.close()
        code, reason = await closed_in_band(url(b, "kate", new_token(), 4))
        assert (code, reason) == (CLOSE_GONE, {"resume": "unknown"})
        # The instance asked answered its peer with a 409, not a 101 to be spliced.
        assert t.total("wslb_resumes_total", result="carried") == 1
    finally:
        t.stop()
        for w in ws_:
            w.kill()
