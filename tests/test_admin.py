"""Admin API and `wslb ctl` against a real wslb process: auth, errors, backends, reload."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from websockets.asyncio.client import connect

from balancer import frames
from tests.procs import ROOT, Worker, Wslb, free_port, pool_config

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    ws = [Worker(f"a{i}").start() for i in range(3)]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture
def lb(workers: list[Worker], tmp_path: Path) -> Iterator[Wslb]:
    cfg = pool_config([{"id": w.id, "url": w.url} for w in workers[:2]])
    port = free_port()
    cfg["admin"] = {"listen": f"127.0.0.1:{port}", "token": TOKEN}
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    proc = Wslb(cfg, tmp_path)
    proc.admin_port = port
    proc.start(wait_ready=False)
    yield proc
    proc.stop()


def call(lb: Wslb, method: str, path: str, body: Any = None, token: str | None = TOKEN) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{lb.admin_port}{path}", data=data, method=method
    )
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            return r.status, json.loads(raw) if path != "/metrics" else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ctl(lb: Wslb, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "balancer",
            "ctl",
            "--admin",
            f"http://127.0.0.1:{lb.admin_port}",
            "--token",
            TOKEN,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_token_required_except_health(lb: Wslb) -> None:
    assert call(lb, "GET", "/healthz", token=None)[0] == 200
    assert call(lb, "GET", "/readyz", token=None)[0] == 200
    for path in ("/backends", "/sessions", "/metrics", "/openapi.json"):
        status, body = call(lb, "GET", path, token=None)
        assert status == 401 and "error" in body
        assert call(lb, "GET", path, token="wrong")[0] == 401
    assert call(lb, "GET", "/backends")[0] == 200


def test_json_errors_and_openapi(lb: Wslb) -> None:
    assert call(lb, "GET", "/backends/nope") == (404, {"error": "no backend 'nope'"})
    assert call(lb, "GET", "/sessions/nope")[0] == 404
    assert call(lb, "POST", "/sessions/nope/migrate", {})[0] == 404
    status, body = call(lb, "POST", "/backends", {"id": "x", "url": "ftp://bad"})
    assert status == 400 and "url" in body["error"]
    status, body = call(lb, "POST", "/backends/a0/drain", {"timeout": "soon"})
    assert status == 400 and "timeout" in body["error"]
    status, spec = call(lb, "GET", "/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    for path in ("/backends/{id}/drain", "/sessions/{sid}/migrate", "/reload", "/readyz"):
        assert path in spec["paths"]
    status, stats = call(lb, "GET", "/debug/stats")
    assert status == 200 and stats["scanner"] == ("c" if frames.ACCELERATED else "python")


async def test_add_drain_undrain_delete(lb: Wslb, workers: list[Worker]) -> None:
    new = workers[2]
    status, body = call(lb, "POST", "/backends", {"id": new.id, "url": new.url, "weight": 2})
    assert status == 201 and body["id"] == new.id
    assert call(lb, "POST", "/backends", {"id": new.id, "url": new.url})[0] == 409
    status, b = call(lb, "GET", f"/backends/{new.id}")
    assert b["weight"] == 2.0 and b["url"] == new.url
    # New sessions reach it.
    seen = set()
    for i in range(30):
        async with connect(f"{lb.url}/ws?session=add-{i}") as ws:
            seen.add(json.loads(await ws.recv())["worker"])
    assert new.id in seen
    # Deleting an active backend is refused; drained, it goes.
    assert call(lb, "DELETE", f"/backends/{new.id}")[0] == 409
    status, b = call(lb, "POST", f"/backends/{new.id}/drain", {"migrate": False, "timeout": "5s"})
    assert status == 202 and b["state"] in ("draining", "drained")
    result = ctl(lb, "drain", new.id, "--wait")
    assert result.returncode == 0, result.stderr
    assert "drained" in result.stdout
    for i in range(30):
        async with connect(f"{lb.url}/ws?session=add-{i}") as ws:
            assert json.loads(await ws.recv())["worker"] != new.id
    assert call(lb, "POST", f"/backends/{new.id}/undrain", {})[1]["state"] == "active"
    call(lb, "POST", f"/backends/{new.id}/drain", {"migrate": False})
    assert ctl(lb, "drain", new.id, "--wait").returncode == 0
    assert call(lb, "DELETE", f"/backends/{new.id}")[0] == 200
    assert call(lb, "GET", f"/backends/{new.id}")[0] == 404


def test_ctl_tables_and_json(lb: Wslb) -> None:
    out = ctl(lb, "backends")
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].split()[:3] == ["ID", "STATE", "SESSIONS"]
    assert "a0" in out.stdout and "a1" in out.stdout
    data = json.loads(ctl(lb, "--json", "backends").stdout)
    assert {b["id"] for b in data} == {"a0", "a1"}
    assert ctl(lb, "sessions").stdout.startswith("SESSION")
    bad = ctl(lb, "drain", "nope")
    assert bad.returncode == 1 and "no backend" in bad.stderr
    unreachable = subprocess.run(
        [
            sys.executable,
            "-m",
            "balancer",
            "ctl",
            "--admin",
            f"http://127.0.0.1:{free_port()}",
            "backends",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert unreachable.returncode == 3


async def test_reload_applies_backends_and_weights(lb: Wslb, workers: list[Worker]) -> None:
    cfg = yaml.safe_load(lb.path.read_text())
    cfg["pools"][0]["backends"] = [
        {"id": "a0", "url": workers[0].url, "weight": 3},
        {"id": "a2", "url": workers[2].url},
    ]
    async with connect(f"{lb.url}/ws?session=live") as ws:
        before = json.loads(await ws.recv())["worker"]
        lb.path.write_text(yaml.safe_dump(cfg))
        status, report = call(lb, "POST", "/reload", {})
        assert status == 200
        assert report["added"] == ["a2"] and report["removed"] == ["a1"]
        assert report["updated"] == ["a0"]
        status, a0 = call(lb, "GET", "/backends/a0")
        assert a0["weight"] == 3.0
        # The live session is untouched, whatever worker it is on.
        await ws.send(json.dumps({"type": "prompt", "text": "still here", "max_tokens": 2}))
        msgs = [json.loads(await ws.recv()) for _ in range(3)]
        assert msgs[-1]["type"] == "done" and msgs[-1]["worker"] == before
    # A bad file is refused and nothing changes.
    lb.path.write_text("pools: [{name: chat, backends: [{id: z, url: 'nope'}]}]")
    status, body = call(lb, "POST", "/reload", {})
    assert status == 400 and "url" in body["error"]
    assert call(lb, "GET", "/backends/a2")[0] == 200


def test_reload_lists_what_it_did_not_apply(lb: Wslb) -> None:
    """A setting a reload cannot apply is named, with its pool, in ``ignored`` and in the log."""
    cfg = yaml.safe_load(lb.path.read_text())
    cfg["pools"][0]["hash_balance_factor"] = 2.0
    cfg["pools"][0]["health"] = {"interval": "7s"}
    cfg["pools"].append({"name": "new", "match": {"path_prefix": "/new"}, "backends": []})
    cfg["timeouts"]["idle"] = "5m"
    cfg["log"] = {"format": "json"}
    lb.path.write_text(yaml.safe_dump(cfg))
    status, report = call(lb, "POST", "/reload", {})
    assert status == 200
    assert report["ignored"] == [
        "pool chat: hash_balance_factor, health (restart to apply)",
        "new pool new (restart to add pools)",
        "timeouts, log (restart to apply)",
    ]
    assert report["added"] == report["removed"] == report["updated"] == []
    assert "did not apply: timeouts, log (restart to apply)" in lb.output()


async def test_sighup_reloads(lb: Wslb, workers: list[Worker]) -> None:
    import asyncio
    import signal

    cfg = yaml.safe_load(lb.path.read_text())
    cfg["pools"][0]["backends"].append({"id": "a2", "url": workers[2].url})
    lb.path.write_text(yaml.safe_dump(cfg))
    assert lb.proc is not None
    lb.proc.send_signal(signal.SIGHUP)
    for _ in range(100):
        if call(lb, "GET", "/backends/a2")[0] == 200:
            break
        await asyncio.sleep(0.05)
    assert call(lb, "GET", "/backends/a2")[0] == 200
    assert lb.proc.poll() is None
