"""Process lifecycle: spawned workers, restart with backoff, graceful stop, `wslb check`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from tests.procs import ROOT, Wslb, free_port, pool_config
from tests.wsraw import RawClient


def children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


async def test_spawned_workers_restart_and_stop_with_the_balancer(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    cfg = pool_config(
        [
            {
                "id": f"s{i}",
                "url": f"ws://127.0.0.1:{p}/ws",
                "spawn": "reference",
                "args": ["--tokens-per-s", "200"],
            }
            for i, p in enumerate(ports)
        ]
    )
    cfg["timeouts"] = {"shutdown_grace": "0.2s", "close": "1s"}
    lb = Wslb(cfg, tmp_path).start()
    assert lb.proc is not None
    try:
        kids = children(lb.proc.pid)
        assert len(kids) == 2
        async with connect(f"{lb.url}/ws?session=x") as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
        # Kill one worker: it is marked down, then restarted and active again.
        victim = kids[0]
        victim.kill()
        deadline = time.monotonic() + 10
        states: set[str] = set()
        while time.monotonic() < deadline:
            states |= {b["state"] for b in lb.admin("/backends")}
            pids = {p.pid for p in children(lb.proc.pid)}
            if (
                victim.pid not in pids
                and len(pids) == 2
                and all(b["state"] == "active" for b in lb.admin("/backends"))
            ):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"worker not restarted: {lb.output()[-2000:]}")
        assert "down" in states
        for i in range(6):
            async with connect(f"{lb.url}/ws?session=after-{i}") as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
        kids = children(lb.proc.pid)
    finally:
        assert lb.stop() == 0
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive  # spawned workers stopped with the balancer


async def test_max_connections_gives_503(tmp_path: Path) -> None:
    port = free_port()
    cfg = pool_config([{"id": "a", "url": f"ws://127.0.0.1:{port}/ws", "spawn": "reference"}])
    cfg["limits"] = {"max_connections": 2}
    lb = Wslb(cfg, tmp_path).start()
    try:
        held = [await connect(f"{lb.url}/ws?session=m{i}") for i in range(2)]
        c = await RawClient.connect(lb.port)
        assert c.status == 503
        for ws in held:
            await ws.close()
        for _ in range(200):  # until the closes reach wslb's count (slow on a busy machine)
            if not lb.admin("/debug/stats")["connections"]:
                break
            await asyncio.sleep(0.05)
        async with connect(f"{lb.url}/ws?session=m9") as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
        assert 'wslb_handshake_rejections_total{status="503"} 1.0' in lb.admin("/metrics")
    finally:
        lb.stop()


def wslb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "balancer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_accepts_the_repo_config() -> None:
    result = wslb("check", "--config", "balancer.yaml")
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_check_names_every_error_by_yaml_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "p",
                        "balance": "fastest",
                        "backends": [{"id": "a", "url": "ftp://x:1/"}],
                    }
                ],
                "limits": {"max_frame_size": "lots"},
            }
        )
    )
    result = wslb("check", "--config", str(bad))
    assert result.returncode == 2
    for path in ("pools[0].balance", "pools[0].backends[0].url", "limits.max_frame_size"):
        assert path in result.stderr, result.stderr
    # Running with a bad config fails the same way, before listening.
    run = wslb("--config", str(bad))
    assert run.returncode == 2 and "pools[0].balance" in run.stderr


async def test_no_ready_worker_gives_503(tmp_path: Path) -> None:
    # A spawned worker whose arguments make it exit at once never becomes ready.
    port = free_port()
    cfg = pool_config(
        [
            {
                "id": "broken",
                "url": f"ws://127.0.0.1:{port}/ws",
                "spawn": "reference",
                "args": ["--background-util", "2"],
            }
        ]
    )
    lb = Wslb(cfg, tmp_path).start(wait_ready=False)
    try:
        c = await RawClient.connect(lb.port)
        assert c.status == 503
        assert lb.admin("/backends")[0]["state"] == "down"
    finally:
        lb.stop()


def _spawned(proc_pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return children(proc_pid)
    return []


def test_a_failed_start_exits_1_within_a_second_and_stops_its_workers(tmp_path: Path) -> None:
    """The listen port taken, one backend unreachable, one spawned: wslb logs why, stops the
    worker it spawned and exits 1 within a second of the error (it used to hang for good,
    ignoring signals: a health probe's cancellation was lost, and stop waited for it)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cfg = pool_config(
        [
            {"id": "w1", "url": f"ws://127.0.0.1:{free_port()}", "spawn": "reference"},
            {"id": "w9", "url": f"ws://127.0.0.1:{free_port()}"},
        ]
    )
    cfg["listen"] = f"127.0.0.1:{port}"
    lb = Wslb(cfg, tmp_path)
    cmd = [*lb.command, "--config", str(lb.path)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=lb.env, stderr=subprocess.PIPE, text=True)
    kids: list[psutil.Process] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            kids = kids or _spawned(proc.pid)
            if "cannot start" in line:
                errored = time.monotonic()
                break
        else:
            raise AssertionError("no 'cannot start' line")
        assert "address already in use" in line, line
        rc = proc.wait(timeout=10)
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        taken.close()
        if proc.stderr is not None:
            proc.stderr.close()
    assert rc == 1
    assert exited - errored < 1.0, f"exited {exited - errored:.2f}s after the error"
    assert exited - started < 5.0
    _, alive = psutil.wait_procs(kids, timeout=1)
    assert not alive, alive


def test_sigterm_while_starting_stops_at_once(tmp_path: Path) -> None:
    """Start waits for etcd (cluster mode, nothing listening there): SIGTERM during that wait
    ends the process at once with 0 (it used to be ignored until the start gave up)."""
    cfg = pool_config([{"id": "w1", "url": f"ws://127.0.0.1:{free_port()}"}])
    cfg["cluster"] = {"etcd": f"http://127.0.0.1:{free_port()}"}
    lb = Wslb(cfg, tmp_path)
    err = tmp_path / "stderr.log"
    with err.open("wb") as out:
        proc = subprocess.Popen(
            [*lb.command, "--config", str(lb.path)], cwd=ROOT, env=lb.env, stderr=out
        )
    try:
        # Inside the start: its first backend's scrape has failed (the etcd wait is 3 s). A
        # fixed sleep was not enough on a loaded machine: the signal came before its handler.
        deadline = time.monotonic() + 15
        while b"wslb.scraper" not in err.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, err.read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    assert took < 1.0, f"{took:.2f}s after SIGTERM"


async def test_a_second_ctrl_c_is_logged_and_skips_the_grace(tmp_path: Path) -> None:
    """SIGINT starts the graceful stop (the log counts what it waits for, in the right
    number); a second one says so in the log and ends the wait at once."""

    async def echo(ws: ServerConnection) -> None:
        async for message in ws:
            await ws.send(message)

    async with serve(echo, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        cfg = pool_config([{"id": "e", "url": f"ws://127.0.0.1:{port}"}])
        cfg["timeouts"] = {"shutdown_grace": "60s", "close": "1s"}
        lb = Wslb(cfg, tmp_path).start()
        assert lb.proc is not None
        try:
            async with connect(f"{lb.url}/?session=stays") as ws:
                await ws.send("hi")
                assert await ws.recv() == "hi"

                async def logged(text: str, within: float = 10.0) -> None:
                    deadline = time.monotonic() + within
                    while text not in lb.output():
                        assert time.monotonic() < deadline, f"no {text!r} in:\n{lb.log_tail()}"
                        await asyncio.sleep(0.05)

                lb.proc.send_signal(signal.SIGINT)
                await logged("shutdown: waiting up to 60.0s for 1 session and 0 HTTP requests")
                t0 = time.monotonic()
                lb.proc.send_signal(signal.SIGINT)
                await logged(
                    "second SIGINT: skipping the rest of timeouts.shutdown_grace, closing 1 session"
                )
                code = await asyncio.to_thread(lb.proc.wait, 15)
                assert code == 0, lb.log_tail()
                assert time.monotonic() - t0 < 10, lb.log_tail()
        finally:
            lb.stop()
