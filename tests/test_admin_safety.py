"""The admin API's defaults, as the README's quick start runs it (no token configured).

A page of another origin the operator has open must not drive it; the token wslb generates must
be required, readable only by its user, and found by ``wslb ctl`` without flags.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from balancer import admintoken
from tests.procs import ROOT, Worker, Wslb, pool_config


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Wslb]:
    w = Worker("w1").start()
    cfg = pool_config([{"id": "w1", "url": w.url}])
    cfg["timeouts"] = {"shutdown_grace": "0.1s"}
    proc = Wslb(cfg, tmp_path).start()
    yield proc
    proc.stop()
    w.stop()


def send(
    lb: Wslb,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{lb.admin_port}{path}", data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def state(lb: Wslb, bid: str = "w1") -> str:
    return str(lb.admin(f"/backends/{bid}")["state"])


def test_a_token_is_generated_and_required(lb: Wslb) -> None:
    path = admintoken.token_path(lb.admin_port, lb.env)
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(token) >= 32
    assert str(path) in lb.output()  # the log says where it is
    assert send(lb, "GET", "/backends")[0] == 401
    assert send(lb, "GET", "/backends", headers={"Authorization": "Bearer nope"})[0] == 401
    status, body = send(lb, "GET", "/backends", headers={"Authorization": f"Bearer {token}"})
    assert status == 200 and isinstance(body, list)
    assert send(lb, "GET", "/healthz")[0] == 200  # probes need no token
    assert send(lb, "GET", "/readyz")[0] == 200


def test_ctl_works_without_flags(lb: Wslb) -> None:
    cmd = [sys.executable, "-m", "balancer", "ctl", "--admin", f"http://127.0.0.1:{lb.admin_port}"]
    env = {k: v for k, v in lb.env.items() if k != "WSLB_ADMIN_TOKEN"}
    out = subprocess.run(
        [*cmd, "backends"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ID") and "w1" in out.stdout and "REASON" in out.stdout
    # Without the file (another machine's wslb, say) ctl says what it looked for.
    elsewhere = dict(env, WSLB_STATE_DIR=str(lb.state_dir / "nothing-here"))
    out = subprocess.run(
        [*cmd, "backends"], cwd=ROOT, env=elsewhere, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert "401" in out.stderr and "nothing-here" in out.stderr


def test_ctl_dashboard_prints_the_url_and_the_token_that_signs_in(lb: Wslb) -> None:
    """What a newcomer runs to open the dashboard: its URL and the generated token, with where
    the token came from; the token it prints is the one the API takes."""
    admin = f"http://127.0.0.1:{lb.admin_port}"
    cmd = [sys.executable, "-m", "balancer", "ctl", "--admin", admin, "dashboard"]
    env = {k: v for k, v in lb.env.items() if k != "WSLB_ADMIN_TOKEN"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    path = admintoken.token_path(lb.admin_port, lb.env)
    token = path.read_text().strip()
    lines = out.stdout.splitlines()
    assert lines[0] == f"dashboard: {admin}/ui", out.stdout
    assert lines[1].split()[:2] == ["token:", token] and str(path) in lines[1], out.stdout
    status, _ = send(lb, "GET", "/backends", headers={"Authorization": f"Bearer {token}"})
    assert status == 200
    with urllib.request.urlopen(f"{admin}/ui", timeout=10) as r:  # the page itself is open
        assert r.status == 200 and b"<html" in r.read().lower()
    # --json for scripts; from $WSLB_ADMIN_TOKEN it says so.
    out = subprocess.run(
        [*cmd, "--json"], cwd=ROOT, env=dict(env, WSLB_ADMIN_TOKEN=token),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"url": f"{admin}/ui", "token": token}
    out = subprocess.run(
        cmd, cwd=ROOT, env=dict(env, WSLB_ADMIN_TOKEN=token), capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert "($WSLB_ADMIN_TOKEN)" in out.stdout, out.stdout
    # A wrong token is refused, not printed as if it would work.
    out = subprocess.run(
        [*cmd, "--token", "nope"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1 and "401" in out.stderr, out.stderr


def test_a_cross_origin_drain_is_refused_and_drains_nothing(lb: Wslb) -> None:
    # What a page on http://evil.example can send without a preflight: a "simple" POST.
    status, body = send(
        lb,
        "POST",
        "/backends/w1/drain",
        b'{"migrate": true}',
        {"Content-Type": "text/plain", "Origin": "http://evil.example"},
    )
    assert status == 403, body
    assert state(lb) == "active"
    # Even with the token (a page cannot have it, but the check does not rely on that).
    auth = {"Authorization": f"Bearer {lb.token}"}
    status, _ = send(
        lb,
        "POST",
        "/backends/w1/drain",
        b"{}",
        {**auth, "Content-Type": "application/json", "Origin": "http://evil.example"},
    )
    assert status == 403
    assert state(lb) == "active"


def test_writes_need_json_and_a_host_of_this_machine(lb: Wslb) -> None:
    auth = {"Authorization": f"Bearer {lb.token}"}
    status, body = send(lb, "POST", "/backends/w1/drain", b"{}", {**auth})
    assert status == 415, body
    status, _ = send(
        lb, "POST", "/backends/w1/drain", b"{}", {**auth, "Content-Type": "text/plain"}
    )
    assert status == 415
    assert state(lb) == "active"
    # DNS rebinding: the attacker's name resolves to 127.0.0.1; the Host header gives it away.
    status, body = send(lb, "GET", "/backends", headers={**auth, "Host": "evil.example:8081"})
    assert status == 403, body
    for host in ("localhost", f"localhost:{lb.admin_port}", f"127.0.0.1:{lb.admin_port}", "[::1]"):
        assert send(lb, "GET", "/backends", headers={**auth, "Host": host})[0] == 200, host
    # The admin listener's own origin (a page it serves) may write.
    own = {
        **auth,
        "Content-Type": "application/json",
        "Origin": f"http://127.0.0.1:{lb.admin_port}",
    }
    status, _ = send(lb, "POST", "/backends/w1/drain", b'{"migrate": false}', own)
    assert status == 202
    assert state(lb) in ("draining", "drained")
    assert send(lb, "POST", "/backends/w1/undrain", b"{}", own)[0] == 200


def test_the_token_file_goes_with_the_process(tmp_path: Path) -> None:
    w = Worker("w1").start()
    try:
        lb = Wslb(pool_config([{"id": "w1", "url": w.url}]), tmp_path).start()
        path = admintoken.token_path(lb.admin_port, lb.env)
        assert path.exists()
        assert lb.stop() == 0
        assert not path.exists()
    finally:
        w.stop()
