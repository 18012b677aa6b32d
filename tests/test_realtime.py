"""The OpenAI Realtime protocol through wslb, with the official ``openai`` SDK as the client.

``AsyncOpenAI(base_url="http://WSLB/v1").realtime.connect(model=M, extra_query={"session": SID})``
opens ``ws://WSLB/v1/realtime?model=M&session=SID``; the backend URLs have no path, so wslb
forwards ``/v1/realtime`` to the reference workers, which serve the protocol there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from websockets.exceptions import InvalidStatus

from balancer import admintoken
from tests.procs import ROOT, Worker, Wslb, all_active, free_port, pool_config, wait_port

MODEL = "wslb-reference"


@dataclass
class Answer:
    deltas: list[str] = field(default_factory=list)
    text: str | None = None  # response.output_text.done
    done: Any = None  # the response.done event
    errors: list[Any] = field(default_factory=list)
    types: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.done.response.status)


def client(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed")


async def say(conn: AsyncRealtimeConnection, text: str) -> None:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )


async def answer(
    conn: AsyncRealtimeConnection, timeout: float = 30.0, streaming: asyncio.Event | None = None
) -> Answer:
    """Events until ``response.done``; ``streaming`` is set at the first delta."""
    got = Answer()

    async def read() -> None:
        async for event in conn:
            got.types.append(event.type)
            if event.type == "response.output_text.delta":
                got.deltas.append(event.delta)
                if streaming is not None:
                    streaming.set()
            elif event.type == "response.output_text.done":
                got.text = event.text
            elif event.type == "error":
                got.errors.append(event.error)
            elif event.type == "response.done":
                got.done = event
                return

    await asyncio.wait_for(read(), timeout)
    return got


async def next_event(conn: AsyncRealtimeConnection, kind: str, timeout: float = 10.0) -> Any:
    async def read() -> Any:
        async for event in conn:
            if event.type == kind:
                return event
        return None

    return await asyncio.wait_for(read(), timeout)


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Wslb]:
    workers = [Worker(f"r{i}", ["--tokens-per-s", "60"]).start() for i in range(2)]
    backends = [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers]
    cfg = pool_config(backends, health={"path": "/healthz", "interval": "0.2s"})
    cfg["timeouts"] = {"shutdown_grace": "0.1s"}
    proc = Wslb(cfg, tmp_path).start()
    yield proc
    proc.stop()
    for w in workers:
        w.stop()


def balancer_yaml(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """``wslb --config balancer.yaml`` (the repo's own) on free ports."""
    ports = [free_port() for _ in range(5)]
    env = dict(
        os.environ,
        WSLB_LISTEN=f"127.0.0.1:{ports[0]}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{ports[1]}",
        WSLB_WORKER_PORT1=str(ports[2]),
        WSLB_WORKER_PORT2=str(ports[3]),
        WSLB_WORKER_PORT3=str(ports[4]),
        WSLB_STATE_DIR=str(tmp_path / "state"),
    )
    log = tmp_path / "wslb.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "balancer", "--config", "balancer.yaml"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    for port in (ports[0], *ports[2:]):
        wait_port(port, timeout=30, proc=proc)
    deadline = time.monotonic() + 30  # the spawned workers' first health checks passed
    while not all_active(listing := _backends(ports[1], env)):
        assert proc.poll() is None and time.monotonic() < deadline, (listing, log.read_text())
        time.sleep(0.05)
    return proc, ports[0], log


def _backends(admin_port: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """The admin API's backends (its generated token), or none while it cannot say."""
    token = admintoken.read(admin_port, env)
    req = urllib.request.Request(
        f"http://127.0.0.1:{admin_port}/backends", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            listing: list[dict[str, Any]] = json.loads(r.read())
    except (OSError, ValueError):
        return [{"state": "unknown"}]
    return listing or [{"state": "none yet"}]


async def test_two_turns_through_the_repos_balancer_yaml(tmp_path: Path) -> None:
    proc, port, log = balancer_yaml(tmp_path)
    try:
        async with client(port).realtime.connect(
            model=MODEL, extra_query={"session": "rt-two"}
        ) as conn:
            created = await next_event(conn, "session.created")
            assert created.session.type == "realtime"
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            assert (await next_event(conn, "session.updated")).session.output_modalities == ["text"]
            await say(conn, "hello there")
            await conn.response.create()
            first = await answer(conn)
            await say(conn, "tell me more")
            await conn.response.create(response={"max_output_tokens": 5})
            second = await answer(conn)
        for a in (first, second):
            assert not a.errors and a.deltas and "".join(a.deltas) == a.text
            assert a.types.count("response.done") == 1
        assert first.status == "completed"
        assert second.status == "incomplete" and len(second.deltas) == 5
        assert second.done.response.status_details.reason == "max_output_tokens"
        # The second turn's context held the first: the worker's KV cache had it.
        usage = second.done.response.usage
        assert usage.input_token_details.cached_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()


async def test_cancel_and_the_error_cases(lb: Wslb) -> None:
    async with client(lb.port).realtime.connect(
        model=MODEL, extra_query={"session": "rt-errors"}
    ) as conn:
        await next_event(conn, "session.created")
        await say(conn, "a long answer please")
        await conn.response.create(response={"max_output_tokens": 200})
        await next_event(conn, "response.output_text.delta")
        # A second response while one runs: an error, as OpenAI answers; the first goes on.
        await conn.response.create()
        err = await next_event(conn, "error")
        assert err.error.code == "conversation_already_has_active_response"
        await conn.response.cancel()
        cancelled = await answer(conn)
        assert cancelled.status == "cancelled" and len(cancelled.deltas) < 200
        bad: list[dict[str, Any] | str] = [
            {
                "type": "session.update",
                "session": {"type": "realtime", "output_modalities": ["audio"]},
            },
            {"type": "input_audio_buffer.append", "audio": "AAAA"},
            {"type": "no.such.event"},
            {"type": "response.cancel"},
            "{not json",
        ]
        for event in bad:
            await conn.send_raw(event if isinstance(event, str) else json.dumps(event))
            err = await next_event(conn, "error")
            assert err.error.message, event
        # Still usable.
        await say(conn, "still there?")
        await conn.response.create()
        again = await answer(conn)
        assert again.status == "completed" and "".join(again.deltas) == again.text


async def test_a_drain_mid_response_keeps_every_response_whole(lb: Wslb) -> None:
    """8 concurrent sessions, their worker drained while they stream: each client sees one
    unbroken response."""

    reconnects: list[int] = []

    async def one(i: int, started: asyncio.Event) -> Answer:
        async with client(lb.port).realtime.connect(
            model=MODEL,
            extra_query={"session": f"rt-drain-{i}"},
            on_reconnecting=lambda e: reconnects.append(e.close_code) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await next_event(conn, "session.created")
            await say(conn, f"question number {i}")
            await conn.response.create()
            return await answer(conn, timeout=60, streaming=started)

    events = [asyncio.Event() for _ in range(8)]
    tasks = [asyncio.ensure_future(one(i, e)) for i, e in enumerate(events)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
    sessions = lb.admin("/sessions")
    victim = max(
        {s["backend"] for s in sessions}, key=lambda b: sum(s["backend"] == b for s in sessions)
    )
    lb.admin_post(f"/backends/{victim}/drain", {})
    results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    for got in results:
        assert not got.errors and got.status == "completed", got.types
        assert got.types.count("response.done") == 1
        assert got.types.count("session.created") == 0  # no new connection: no close
        assert "".join(got.deltas) == got.text
    assert not reconnects  # the SDK never saw a close
    expected = {len(got.deltas) for got in results}
    assert len(expected) == 1  # the requested (default) number of deltas, everywhere
    drain = lb.admin(f"/backends/{victim}")["drain"]
    assert drain["migrated"] >= 1 and drain["migration_failures"] == 0, drain


async def test_wslb_restarted_between_turns_the_sdk_reconnects_and_continues(
    tmp_path: Path,
) -> None:
    workers = [Worker(f"k{i}").start() for i in range(2)]
    backends = [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in workers]
    cfg = pool_config(backends)
    cfg["timeouts"] = {"shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path).start()
    reconnects: list[int] = []
    try:
        async with client(lb.port).realtime.connect(
            model=MODEL,
            extra_query={"session": "rt-restart"},
            on_reconnecting=lambda e: reconnects.append(e.close_code) or None,  # type: ignore[func-returns-value]
        ) as conn:
            await next_event(conn, "session.created")
            await say(conn, "remember the number seven")
            await conn.response.create()
            first = await answer(conn)
            assert first.status == "completed"
            lb.stop()  # 1001 to the client: the SDK reconnects by itself
            restarted = Wslb(cfg, tmp_path)
            restarted.port, restarted.admin_port = lb.port, lb.admin_port
            restarted.path.write_text(lb.path.read_text())
            restarted.start()
            lb = restarted
            await next_event(conn, "session.created", timeout=30)  # the new connection's
            await say(conn, "which number was it")
            await conn.response.create()
            second = await answer(conn)
        assert reconnects and reconnects[0] in (1001, 1006, 1012)
        assert second.status == "completed" and not second.errors
        # The same worker held the conversation: the first turn's context was in its KV cache.
        assert second.done.response.usage.input_token_details.cached_tokens > 0
    finally:
        lb.stop()
        for w in workers:
            w.stop()


def test_the_example_client(lb: Wslb) -> None:
    base = f"http://127.0.0.1:{lb.port}/v1"
    out = subprocess.run(
        [sys.executable, "examples/realtime_client.py", "--base-url", base,
         "--session", "rt-example", "hello there", "tell me more"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[completed; cached input tokens:") == 2, out.stdout
    assert "> tell me more" in out.stdout


async def test_two_pools_matched_by_model(tmp_path: Path) -> None:
    g, q = Worker("gemma-w").start(), Worker("qwen-w").start()
    pools = [
        {
            "name": name,
            "match": {"path_prefix": "/v1/realtime", "model": name},
            "backends": [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"}],
        }
        for name, w in (("gemma", g), ("qwen", q))
    ]
    lb = Wslb({"pools": pools}, tmp_path).start()
    try:
        for model, worker in (("gemma", g.id), ("qwen", q.id)):
            async with client(lb.port).realtime.connect(
                model=model, extra_query={"session": f"rt-{model}"}
            ) as conn:
                created = await next_event(conn, "session.created")
                assert created.session.model == model
                (s,) = lb.admin("/sessions")
                assert s["backend"] == worker
                await say(conn, "which worker are you")
                await conn.response.create()
                assert (await answer(conn)).status == "completed"
        with pytest.raises(InvalidStatus) as refused:  # the SDK lets websockets' error through
            async with client(lb.port).realtime.connect(model="llama") as conn:
                await conn.recv()
        response = refused.value.response
        assert response.status_code == 404
        assert json.loads(response.body)["models"] == ["gemma", "qwen"]
    finally:
        lb.stop()
        g.stop()
        q.stop()
