"""Parking (``backends.park``): a session whose wslb leg dropped stays on the reference worker,
and a reattach from the client's message count continues it, with the test as wslb.

The test opens the worker's WebSocket as wslb does (its credential, ``X-WSLB-Park``), drops the
leg without a close frame (``transport.abort()``), waits until the worker reports the session
parked, and reattaches (``X-WSLB-Reattach``): the client must see every message exactly once, in
order. The parameters' parser, the window and the state rules are tested sans-I/O first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from backends.model import token_text
from backends.park import Park, ParkError, ParkParams, ParkState, Window, parse_count, parse_park
from balancer.contract import proxied_credential
from tests.procs import WORKER_AUTH, WORKER_TOKEN
from tests.test_worker import TIMEOUT, WorkerProc, start_worker

DIGEST = hashlib.sha256(b"the client's resume token").hexdigest()
OTHER = hashlib.sha256(b"someone else's").hexdigest()
RATE = 200  # tokens/s: a 200-token answer streams for a second


# -- sans-I/O ----------------------------------------------------------------------------------


def test_parse_park() -> None:
    p = parse_park(f"base=3; grace=2.5; window=2048; token={DIGEST}")
    assert p == ParkParams(3, 2.5, 2048, DIGEST)
    assert parse_park(f"token={DIGEST};window=1024;grace=3600;base=0").grace == 3600.0
    bad = {
        "": "malformed",
        "base=1; grace=1; window=2048": "missing token",
        f"base=1; grace=1; window=2048; token={DIGEST}; x=1": "unknown",
        f"base=1; base=2; grace=1; window=2048; token={DIGEST}": "twice",
        f"base=-1; grace=1; window=2048; token={DIGEST}": "base",
        f"base=1; grace=0; window=2048; token={DIGEST}": "grace",
        f"base=1; grace=3600.5; window=2048; token={DIGEST}": "grace",
        f"base=1; grace=1e3; window=2048; token={DIGEST}": "grace",
        f"base=1; grace=1; window=1023; token={DIGEST}": "window",
        f"base=1; grace=1; window=67108865; token={DIGEST}": "window",
        f"base=1; grace=1; window=2048; token={DIGEST.upper()}": "token",
        "base=1; grace=1; window=2048; token=abc": "token",
        f"base 1; grace=1; window=2048; token={DIGEST}": "malformed",
    }
    for value, word in bad.items():
        with pytest.raises(ParkError, match=word):
            parse_park(value)
    assert parse_count("0") == 0 and parse_count(" 1234567890123456 ") == 1234567890123456
    for value in ("", "-1", "12345678901234567", "1.0", chr(0x661)):
        with pytest.raises(ParkError, match="digits"):
            parse_count(value)


def test_window_keeps_the_newest_within_its_bound() -> None:
    w = Window(5)
    assert (w.first, w.next, w.refusal(5), w.refusal(6)) == (5, 5, None, "count_ahead")
    texts = [f"m{i:03d}" + "x" * 96 for i in range(30)]  # 100 bytes each
    for t in texts:
        w.append(t)
        w.trim(1024)
    assert w.size <= 1024 and (w.first, w.next) == (25, 35)
    assert w.get(25) is texts[20] and list(w.since(33)) == texts[28:]
    assert (w.refusal(24), w.refusal(25), w.refusal(35), w.refusal(36)) == (
        "expired",
        None,
        None,
        "count_ahead",
    )
    w.append("y" * 5000)  # bigger than the bound: kept alone
    w.trim(1024)
    assert (len(w), w.first) == (1, 35)


def test_park_states() -> None:
    park = Park(ParkParams(0, 1.0, 1024, DIGEST))
    for i in range(20):
        park.record("t" * 99 + str(i % 10))
    assert park.attached and park.window.size == 1000 and not park.must_wait()
    park.lost()
    park.record("z" * 100)  # parked: nothing trimmed, the sender now waits
    assert park.parked and park.window.size == 1100 and park.must_wait()
    assert park.judge(OTHER, 10) == "unknown"
    assert park.judge(DIGEST, -1) == "expired" and park.judge(DIGEST, 22) == "count_ahead"
    assert park.parked  # a refusal changes nothing
    park.reattach(ParkParams(21, 5.0, 4096, DIGEST))
    assert park.state is ParkState.REPLAYING and not park.must_wait()
    park.caught_up()
    assert park.attached and park.window.size == 1100
    park.end()
    assert park.judge(DIGEST, 21) == "unknown"


class Server(Protocol):
    """A worker or a bridge a test started: its port and its HTTP base URL."""

    @property
    def port(self) -> int: ...
    @property
    def http(self) -> str: ...


# -- on a real worker --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    w = start_worker("--id", "park", "--tokens-per-s", str(RATE), credential=True)
    try:
        yield w
        log = w.stderr()
        assert "Traceback" not in log and "Task exception" not in log, log
    finally:
        assert w.stop() == 0


def park_header(
    base: int = 0, grace: float = 10.0, window: int = 1 << 20, token: str = DIGEST
) -> str:
    return f"base={base}; grace={grace}; window={window}; token={token}"


async def open_parked(w: Server, sid: str, path: str = "/ws", **park: Any) -> ClientConnection:
    headers = {**WORKER_AUTH, "X-Session-Id": sid, "X-WSLB-Park": park_header(**park)}
    ws = await connect(
        f"ws://127.0.0.1:{w.port}{path}", additional_headers=headers, open_timeout=TIMEOUT
    )
    assert ws.response is not None and ws.response.headers["X-WSLB-Park"] == "ok"
    return ws


async def reattach(
    w: Server,
    sid: str,
    n: int,
    token: str = DIGEST,
    path: str = "/ws",
    auth: str = WORKER_TOKEN,
    **park: Any,
) -> ClientConnection:
    headers = {
        "X-WSLB-Worker-Token": auth,
        "X-WSLB-Reattach": sid,
        "X-WSLB-Reattach-From": str(n),
        "X-WSLB-Park": park_header(base=n, token=token, **park),
    }
    ws = await connect(
        f"ws://127.0.0.1:{w.port}{path}", additional_headers=headers, open_timeout=TIMEOUT
    )
    assert ws.response is not None
    assert ws.response.headers["X-WSLB-Resumed"] == str(n)
    assert ws.response.headers["X-WSLB-Park"] == "ok"
    return ws


async def refused(w: Server, headers: dict[str, str]) -> tuple[int, Any]:
    """An upgrade the worker must refuse: its status and JSON body."""
    with pytest.raises(InvalidStatus) as exc:
        await connect(
            f"ws://127.0.0.1:{w.port}/ws", additional_headers=headers, open_timeout=TIMEOUT
        )
    response = exc.value.response
    return response.status_code, json.loads(response.body or b"null")


def reattach_headers(sid: str, n: int, token: str = DIGEST) -> dict[str, str]:
    return {
        **WORKER_AUTH,
        "X-WSLB-Reattach": sid,
        "X-WSLB-Reattach-From": str(n),
        "X-WSLB-Park": park_header(base=n, token=token),
    }


async def recv(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        msg = await ws.recv()
    assert isinstance(msg, str)
    obj: dict[str, Any] = json.loads(msg)
    return obj


async def metrics(w: Server) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{w.http}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = s.labels.get("result")
            out[s.name if label is None else f"{s.name}:{label}"] = s.value
    return out


async def until(w: Server, name: str, check: Any, timeout: float = TIMEOUT) -> None:
    """Wait, bounded, until the worker's metric ``name`` passes ``check``."""
    deadline = time.monotonic() + timeout
    while True:
        value = (await metrics(w)).get(name)
        if check(value):
            return
        assert time.monotonic() < deadline, f"{name} = {value}"
        await asyncio.sleep(0.02)


def drop(ws: ClientConnection) -> None:
    """The leg dies as when a wslb instance is killed: no close frame."""
    ws.transport.abort()


async def parked(w: Server, sid_count: int) -> None:
    await until(w, "wslb_worker_parked_sessions", lambda v: v == sid_count)


async def read_to_done(ws: ClientConnection, got: list[dict[str, Any]]) -> None:
    for _ in range(10_000):
        msg = await recv(ws)
        got.append(msg)
        if msg["type"] == "done":
            return
    raise AssertionError("no done")


def check_answer(sid: str, msgs: list[dict[str, Any]], tokens: int) -> None:
    """``hello``, then turn 1's tokens 0..tokens-1 exactly once, in order, then ``done``."""
    assert msgs[0]["type"] == "hello"
    body = msgs[1:-1]
    assert [m["i"] for m in body] == list(range(tokens)), [m.get("i") for m in body]
    assert all(m["text"] == token_text(sid, 1, m["i"]) for m in body)
    assert msgs[-1]["type"] == "done" and msgs[-1]["tokens"] == tokens


def new_sid() -> str:
    return f"park-{uuid.uuid4().hex[:12]}"


async def test_reattach_continues_a_dropped_leg(worker: WorkerProc) -> None:
    sid = new_sid()
    before = await metrics(worker)
    ws = await open_parked(worker, sid)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 200}))
    got = [await recv(ws) for _ in range(20)]
    drop(ws)
    await parked(worker, 1)
    assert (await metrics(worker))["wslb_worker_active_sessions"] >= 1  # still live
    again = await reattach(worker, sid, len(got))
    await read_to_done(again, got)
    check_answer(sid, got, 200)
    after = await metrics(worker)
    assert after["wslb_worker_parked_sessions"] == 0
    key = "wslb_worker_reattaches_total:resumed"
    assert after[key] == before[key] + 1
    # The reattached leg is live: the session goes on, and can park again.
    await again.send(json.dumps({"type": "prompt", "text": "more", "max_tokens": 5}))
    more = [await recv(again) for _ in range(3)]
    drop(again)
    await parked(worker, 1)
    n = len(got) + len(more)
    last = await reattach(worker, sid, n)
    await read_to_done(last, more)
    assert [m["i"] for m in more[:-1]] == list(range(5)) and more[-1]["turn"] == 2
    await last.close()
    await parked(worker, 0)


async def test_a_full_window_pauses_the_answer_until_the_reattach(worker: WorkerProc) -> None:
    """2 KiB hold about 30 tokens: the answer stops there while parked, so after a park longer
    than the whole answer, nothing was dropped and the rest still streams at the decode rate."""
    sid = new_sid()
    tokens = 300
    ws = await open_parked(worker, sid, window=2048, grace=30.0)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": tokens}))
    got = [await recv(ws) for _ in range(5)]
    drop(ws)
    await parked(worker, 1)
    # Longer than the answer takes unpaused (1.5 s): it would be complete in the window.
    await asyncio.sleep(tokens / RATE + 0.5)
    start = time.monotonic()
    again = await reattach(worker, sid, len(got))
    await read_to_done(again, got)
    took = time.monotonic() - start
    check_answer(sid, got, tokens)
    # At most ~35 messages were waiting: the rest came at the decode rate after the reattach.
    assert took >= (tokens - 40) / RATE * 0.8, took
    await again.close()


async def test_the_grace_ends_a_parked_session(worker: WorkerProc) -> None:
    sid = new_sid()
    ws = await open_parked(worker, sid, grace=0.3)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 1000}))
    got = [await recv(ws) for _ in range(3)]
    drop(ws)
    await parked(worker, 1)
    await parked(worker, 0)  # the grace is over
    status, body = await refused(worker, reattach_headers(sid, len(got)))
    assert status == 409 and body["resume"] == "unknown"


async def test_refusals_leave_the_parked_session_alone(worker: WorkerProc) -> None:
    sid = new_sid()
    ws = await open_parked(worker, sid, window=1024)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 200}))
    got = [await recv(ws) for _ in range(40)]  # ~2.5 KiB sent: message 0 rolled out
    drop(ws)
    await parked(worker, 1)
    before = await metrics(worker)

    status, body = await refused(worker, reattach_headers(sid, len(got), token=OTHER))
    assert (status, body["resume"]) == (409, "unknown")
    status, body = await refused(worker, reattach_headers("nobody-" + sid, len(got)))
    assert (status, body["resume"]) == (409, "unknown")
    status, body = await refused(worker, reattach_headers(sid, 0))
    assert (status, body["resume"], body["reason"]) == (409, "refused", "expired")
    status, body = await refused(worker, reattach_headers(sid, 10_000))
    assert (status, body["resume"], body["reason"]) == (409, "refused", "count_ahead")
    # The proxied credential (what wslb forwards client traffic with) cannot reattach.
    proxied = {
        **reattach_headers(sid, len(got)),
        "X-WSLB-Worker-Token": proxied_credential(WORKER_TOKEN),
    }
    status, body = await refused(worker, proxied)
    assert status == 401
    for name, value in (
        ("X-WSLB-Park", "base=1; grace=1"),
        ("X-WSLB-Reattach-From", "-3"),
        ("X-Session-Id", "another"),
    ):
        status, body = await refused(worker, {**reattach_headers(sid, len(got)), name: value})
        assert status == 400 and "Traceback" not in body["error"], body
    mismatch = {**reattach_headers(sid, len(got)), "X-WSLB-Reattach-From": str(len(got) + 1)}
    status, body = await refused(worker, mismatch)
    assert status == 400 and "base" in body["error"]

    after = await metrics(worker)
    for result, more in (("unknown", 2), ("expired", 1), ("count_ahead", 1)):
        key = f"wslb_worker_reattaches_total:{result}"
        assert after[key] == before[key] + more, result
    assert after["wslb_worker_parked_sessions"] == 1
    again = await reattach(worker, sid, len(got))
    await read_to_done(again, got)
    check_answer(sid, got, 200)
    await again.close()


async def test_park_header_on_a_plain_upgrade(worker: WorkerProc) -> None:
    sid = new_sid()
    status, body = await refused(
        worker, {**WORKER_AUTH, "X-Session-Id": sid, "X-WSLB-Park": park_header(window=10)}
    )
    assert status == 400 and "X-WSLB-Park" in body["error"] and "window" in body["error"]
    # The proxied credential opens a plain upgrade with park parameters, as it opens any.
    headers = {
        "X-WSLB-Worker-Token": proxied_credential(WORKER_TOKEN),
        "X-Session-Id": sid,
        "X-WSLB-Park": park_header(),
    }
    ws = await connect(worker.ws, additional_headers=headers, open_timeout=TIMEOUT)
    assert ws.response is not None and ws.response.headers["X-WSLB-Park"] == "ok"
    await ws.close()
    # Without the header: no park, and a dropped leg ends the session as before.
    ws = await connect(
        worker.ws, additional_headers={**WORKER_AUTH, "X-Session-Id": sid}, open_timeout=TIMEOUT
    )
    assert ws.response is not None and "X-WSLB-Park" not in ws.response.headers
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 100}))
    got = [await recv(ws) for _ in range(3)]
    drop(ws)
    status, body = await refused(worker, reattach_headers(sid, len(got)))
    assert (status, body["resume"]) == (409, "unknown")
    assert (await metrics(worker))["wslb_worker_parked_sessions"] == 0


async def test_a_close_frame_is_an_ending(worker: WorkerProc) -> None:
    sid = new_sid()
    ws = await open_parked(worker, sid)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 100}))
    got = [await recv(ws) for _ in range(3)]
    await ws.close(code=4000)
    status, body = await refused(worker, reattach_headers(sid, len(got)))
    assert (status, body["resume"]) == (409, "unknown")


async def test_take_over_a_leg_the_worker_still_holds(worker: WorkerProc) -> None:
    """wslb lost a node without a reset: the worker's leg looks alive; a reattach takes it."""
    sid = new_sid()
    before = await metrics(worker)
    old = await open_parked(worker, sid)
    await old.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 200}))
    got = [await recv(old) for _ in range(15)]
    again = await reattach(worker, sid, len(got))
    # The old leg gets nothing more than what it had in flight, and no close frame.
    with pytest.raises(ConnectionClosed) as closed:
        for _ in range(1000):
            await recv(old)
    assert closed.value.rcvd is None
    await read_to_done(again, got)
    check_answer(sid, got, 200)
    after = await metrics(worker)
    key = "wslb_worker_reattaches_total:taken_over"
    assert after[key] == before[key] + 1
    await again.close()


async def test_a_realtime_session_parks_too(worker: WorkerProc) -> None:
    sid = new_sid()
    path = "/v1/realtime?model=m"
    ws = await open_parked(worker, sid, path=path)
    got = [await recv(ws)]
    assert got[0]["type"] == "session.created"
    create = {"type": "response.create", "response": {"max_output_tokens": 100}}
    await ws.send(json.dumps(create))
    for _ in range(12):
        got.append(await recv(ws))
    drop(ws)
    await parked(worker, 1)
    again = await reattach(worker, sid, len(got), path=path)
    for _ in range(10_000):
        got.append(await recv(again))
        if got[-1]["type"] == "response.done":
            break
    ids = [m["event_id"] for m in got]
    assert len(set(ids)) == len(ids)
    deltas = "".join(m["delta"] for m in got if m["type"] == "response.output_text.delta")
    assert deltas == " ".join(token_text(sid, 1, i) for i in range(100))
    assert got[-1]["response"]["status"] == "incomplete"  # max_output_tokens reached
    await again.close()


async def test_a_draining_worker_still_takes_reattaches() -> None:
    """SIGTERM: new plain upgrades get 503, a reattach is served; a parked session holds the
    drain open and ends with the rest at the drain grace."""
    w = start_worker("--tokens-per-s", str(RATE), "--drain-grace", "2", credential=True)
    try:
        sid = new_sid()
        ws = await open_parked(w, sid)
        await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 5000}))
        got = [await recv(ws) for _ in range(5)]
        drop(ws)
        await parked(w, 1)
        w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT
        while True:  # the drain has begun once health says so
            async with aiohttp.ClientSession() as http, http.get(f"{w.http}/healthz") as r:
                if r.status == 503:
                    break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        status, _ = await refused(w, {**WORKER_AUTH, "X-Session-Id": new_sid()})
        assert status == 503
        again = await reattach(w, sid, len(got))
        for _ in range(20):
            got.append(await recv(again))
        assert [m["i"] for m in got[1:]] == list(range(len(got) - 1))
        drop(again)
        await parked(w, 1)
        # Still open: it ends at the drain grace, and the worker exits cleanly.
        assert await asyncio.to_thread(w.proc.wait, TIMEOUT) == 0
        log = w.stderr()
        assert "Traceback" not in log, log
    finally:
        w.stop()


async def test_a_responses_session_parks_too(worker: Server) -> None:
    """The Responses API's WebSocket mode: no greeting, events numbered from the first one."""
    sid = new_sid()
    path = "/v1/responses"
    ws = await open_parked(worker, sid, path=path)
    create = {"type": "response.create", "input": "hi", "max_output_tokens": 100}
    await ws.send(json.dumps(create))
    got = [await recv(ws) for _ in range(12)]
    drop(ws)
    await parked(worker, 1)
    again = await reattach(worker, sid, len(got), path=path)
    for _ in range(10_000):
        got.append(await recv(again))
        if got[-1]["type"] in ("response.completed", "response.incomplete"):
            break
    assert [m["sequence_number"] for m in got] == list(range(len(got)))
    deltas = "".join(m["delta"] for m in got if m["type"] == "response.output_text.delta")
    assert deltas == " ".join(token_text(sid, 1, i) for i in range(100))
    await again.close()


async def test_a_parked_session_is_not_frozen(worker: Server) -> None:
    """A freeze needs the session on its leg: a parked one gets 409 and stays parked."""
    sid = new_sid()
    ws = await open_parked(worker, sid)
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 100}))
    got = [await recv(ws) for _ in range(3)]
    drop(ws)
    await parked(worker, 1)
    headers = {**WORKER_AUTH, "Content-Type": "application/json"}
    url = f"{worker.http}/wslb/sessions/{sid}/freeze"
    async with aiohttp.ClientSession() as http, http.post(url, data=b"{}", headers=headers) as r:
        assert r.status == 409 and "parked" in (await r.json())["error"]
    again = await reattach(worker, sid, len(got))
    await read_to_done(again, got)
    check_answer(sid, got, 100)
    await again.close()
