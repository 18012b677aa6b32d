"""The access log: one line per ended session, text or JSON, with why it ended."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from balancer import logs
from balancer.logs import JsonFormatter, access_text
from tests.procs import Worker, Wslb, free_port, pool_config
from tests.test_http_proxy import metric
from tests.waits import until

FIELDS = {
    "client": "127.0.0.1",
    "session": "alice",
    "pool": "chat",
    "backends": ["w1", "w2"],
    "path": "/ws",
    "status": 101,
    "user_agent": "Python/3.11 websockets/15.0",
    "connect_ms": 0.3,
    "upgrade_ms": 1.2,
    "duration_s": 12.3041,
    "messages_in": 3,
    "messages_out": 120,
    "bytes_in": 310,
    "bytes_out": 9021,
    "close_to_client": 1000,
    "close_to_worker": None,
    "migrations": 1,
    "failovers": 0,
    "end": "client closed",
}


def test_text_line() -> None:
    assert access_text(FIELDS) == (
        "127.0.0.1 session=alice pool=chat backend=w1,w2 path=/ws status=101 connect=0.3ms "
        "upgrade=1.2ms duration=12.304s msgs_in=3 "
        "msgs_out=120 bytes_in=310 bytes_out=9021 close_client=1000 close_worker=- "
        'migrations=1 failovers=0 end="client closed" ua="Python/3.11 websockets/15.0"'
    )
    # A client chooses its session key: quoted and escaped, it cannot forge a second line.
    forged = access_text({**FIELDS, "session": 'x\n127.0.0.1 session="y'})
    assert "\n" not in forged and 'session="x\\n127.0.0.1 session=\\"y"' in forged


def test_long_fields_are_quoted_alike_and_not_kept() -> None:
    """A field past ``QUOTE_CACHED`` (a client's path can be as long as a request head) is
    quoted as a short one is, and the quoting cache does not keep it."""
    logs._quote_short.cache_clear()
    access_text({**FIELDS, "path": "/short"})
    short = logs._quote_short.cache_info().currsize  # every field, the path among them
    logs._quote_short.cache_clear()
    long_path = "/" + "a" * 60_000
    odd = "/" + "\u00e9 " * 40_000
    for _ in range(3):
        assert access_text({**FIELDS, "path": long_path}).count(long_path) == 1
        assert json.dumps(odd) in access_text({**FIELDS, "path": odd})
    assert logs._quote_short.cache_info().currsize == short - 1  # all but the path
    assert len(long_path) > logs.QUOTE_CACHED


def test_json_line() -> None:
    record = logging.LogRecord("wslb.access", logging.INFO, "f", 1, "text", None, None)
    record.fields = FIELDS
    out = json.loads(JsonFormatter().format(record))
    assert out["logger"] == "wslb.access" and out["level"] == "info"
    assert {k: out[k] for k in FIELDS} == FIELDS


def ended(lb: Wslb) -> float:
    """Sessions wslb has finished (counted in the same step that writes their access line)."""
    return metric(lb, "wslb_session_duration_seconds_count")


def access_lines(lb: Wslb) -> list[str]:
    return [
        line.split(" wslb.access: ", 1)[1]
        for line in lb.output().splitlines()
        if " wslb.access: " in line
    ]


async def ask(ws: ClientConnection, text: str = "hi", n: int = 3) -> None:
    await ws.send(json.dumps({"type": "prompt", "text": text, "max_tokens": n}))
    while json.loads(await ws.recv())["type"] != "done":
        pass


async def test_sessions_that_end_each_way(tmp_path: Path) -> None:
    a, b = Worker("w1").start(), Worker("w2").start()
    cfg = pool_config([{"id": "w1", "url": a.url}, {"id": "w2", "url": b.url}])
    cfg["timeouts"] = {"shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        async with connect(f"{lb.url}/ws?session=calm") as ws:
            await ws.recv()
            await ask(ws)
        moved = await connect(f"{lb.url}/ws?session=moved")
        first = json.loads(await moved.recv())["worker"]
        other = "w2" if first == "w1" else "w1"
        lb.admin_post("/sessions/moved/migrate", {"to": other})
        await ask(moved)
        await moved.close()
        victim = await connect(f"{lb.url}/ws?session=victim")
        where = json.loads(await victim.recv())["worker"]
        (a if where == "w1" else b).kill()
        with contextlib.suppress(ConnectionClosed):
            await asyncio.wait_for(victim.recv(), 5)
        assert victim.close_code == 1011
        for _ in range(100):
            if len(access_lines(lb)) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        lb.stop()
        a.stop()
        b.stop()
    lines = {line.split("session=")[1].split(" ")[0]: line for line in access_lines(lb)}
    calm = lines["calm"]
    assert calm.startswith("127.0.0.1 session=calm pool=chat backend=w")
    assert "msgs_in=1 " in calm and "close_client=1000 close_worker=1000" in calm
    assert 'migrations=0 failovers=0 end="client closed" ua="Python/' in calm, calm
    assert " path=/ws status=101 connect=" in calm and "ms upgrade=" in calm, calm
    assert f"backend={first},{other} " in lines["moved"] and "migrations=1" in lines["moved"]
    assert "close_client=1011" in lines["victim"] and 'end="worker lost"' in lines["victim"]


async def test_json_format_and_off(tmp_path: Path) -> None:
    w = Worker("w1").start()
    try:
        cfg = pool_config([{"id": "w1", "url": w.url}])
        cfg["log"] = {"format": "json"}
        lb = Wslb(cfg, tmp_path).start()
        try:
            async with connect(f"{lb.url}/ws?session=j") as ws:
                await ws.recv()
                await ask(ws, n=2)
            await until(lambda: '"wslb.access"' in lb.output(), 10, "the access line")
        finally:
            lb.stop()
        records = [json.loads(x) for x in lb.output().splitlines() if x.startswith("{")]
        assert records and all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
        (access,) = [r for r in records if r["logger"] == "wslb.access"]
        assert access["session"] == "j" and access["backends"] == ["w1"]
        assert access["messages_in"] == 1 and access["messages_out"] == 1 + 2 + 1
        assert access["bytes_in"] > 0 and access["bytes_out"] > access["bytes_in"]
        assert access["close_to_client"] == 1000 and access["end"] == "client closed"
        assert access["path"] == "/ws" and access["status"] == 101
        assert access["user_agent"].startswith("Python/") and "websockets" in access["user_agent"]
        assert 0 < access["connect_ms"] < 5000 and 0 < access["upgrade_ms"] < 5000

        cfg["log"] = {"access": False}
        lb = Wslb(cfg, tmp_path).start()
        try:
            async with connect(f"{lb.url}/ws?session=quiet") as ws:
                await ws.recv()
            # The session's end is counted as it is logged: once counted, no line was written.
            await until(lambda: ended(lb) >= 1, 10, "the session's end")
        finally:
            lb.stop()
        assert "wslb.access" not in lb.output()
    finally:
        w.stop()


async def test_one_format_for_wslb_and_the_workers_it_spawns(tmp_path: Path) -> None:
    """With ``log.format: json`` every line wslb prints, its spawned workers' included, is one
    JSON object; in text, each line starts with an ISO 8601 time carrying its zone."""
    port = free_port()
    cfg = pool_config([{"id": "s1", "url": f"ws://127.0.0.1:{port}", "spawn": "reference"}])
    cfg["log"] = {"format": "json"}
    lb = Wslb(cfg, tmp_path).start()
    try:
        async with connect(f"{lb.url}/ws?session=j") as ws:
            await ws.recv()
            await ask(ws, n=2)
        await until(lambda: '"wslb.access"' in lb.output(), 10, "the access line")
    finally:
        lb.stop()
    lines = [x for x in lb.output().splitlines() if x.strip()]
    records = [json.loads(x) for x in lines]  # every line: not one is text
    loggers = {r["logger"] for r in records}
    assert "wslb.worker" in loggers and "wslb.access" in loggers, loggers
    for r in records:
        assert datetime.datetime.fromisoformat(r["ts"]).tzinfo is not None, r
    cfg["log"] = {"format": "text"}
    lb = Wslb(cfg, tmp_path, name="text").start()
    lb.stop()
    lines = [x for x in lb.output().splitlines() if x.strip()]
    assert any(" wslb.worker: " in x for x in lines), lines
    # Scrapes begin with the spawned worker still starting: not a line about load signals.
    assert not any("no load signals" in x for x in lines), lines
    for x in lines:
        stamp = x.split(" ", 1)[0]
        assert datetime.datetime.fromisoformat(stamp).tzinfo is not None, x


def test_closed_tls_warning_is_not_logged() -> None:
    """uvloop warns ``SSL connection is closed`` when a session writes to a client whose TLS
    just ended (a client leaving): not an operator's concern, so dropped."""
    logs.setup(logging.INFO)
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    handler = Keep()
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(handler)
    try:
        asyncio_log.warning("SSL connection is closed")
        asyncio_log.warning("something else")
    finally:
        asyncio_log.removeHandler(handler)
    assert kept == ["something else"]
