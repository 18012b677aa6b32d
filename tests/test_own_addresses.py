"""wslb's own addresses: a backend may not be one of them, and a taken one is named by its key.

A backend URL that reaches wslb's own listener makes wslb proxy to itself, every request and
scrape coming back in as a new one; ``wslb check`` and the start refuse it, naming the backend's
YAML path. A port that another process holds stops the start with the config key
(``listen``, ``admin.listen``, ``metrics.listen``), the address, whether the file set it at
all, and a hint that another wslb may be running. The clashes are real: the test binds the
port first, then starts wslb and reads its error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import ROOT, Worker, Wslb, free_port, pool_config


def write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "wslb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wslb(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSLB_")}
    env["WSLB_STATE_DIR"] = str(tmp_path / "state")
    return subprocess.run(
        [sys.executable, "-m", "balancer", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def config(listen: int, backend: str, **extra: Any) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{listen}",
        "pools": [{"name": "chat", "backends": [{"id": "a", "url": backend}]}],
        **extra,
    }


@pytest.mark.parametrize(
    ("listen_host", "backend_host", "what"),
    [
        ("127.0.0.1", "127.0.0.1", "listen"),
        ("127.0.0.1", "localhost", "listen"),
        ("0.0.0.0", "127.0.0.1", "listen"),
        ("0.0.0.0", "localhost", "listen"),
        ("0.0.0.0", "0.0.0.0", "listen"),
        ("[::]", "[::1]", "listen"),
    ],
)
def test_check_refuses_a_backend_that_is_wslb_itself(
    tmp_path: Path, listen_host: str, backend_host: str, what: str
) -> None:
    port = free_port()
    cfg = config(port, f"ws://{backend_host}:{port}")
    cfg["listen"] = f"{listen_host}:{port}"
    cfg["pools"][0]["backends"].insert(0, {"id": "ok", "url": f"ws://127.0.0.1:{free_port()}"})
    done = wslb(tmp_path, "check", "--config", str(write(tmp_path, cfg)))
    assert done.returncode == 2, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "pools[0].backends[1].url:" in out, out
    assert f"wslb's own {what} address" in out and "proxy to itself" in out, out
    assert "backends[0]" not in out, out  # the other backend is fine


def test_check_refuses_the_admin_and_metrics_addresses_too(tmp_path: Path) -> None:
    port, admin, metrics = free_port(), free_port(), free_port()
    cfg = config(port, f"ws://127.0.0.1:{admin}", admin={"listen": f"127.0.0.1:{admin}"})
    cfg["metrics"] = {"listen": f"0.0.0.0:{metrics}"}
    cfg["pools"][0]["backends"].append({"id": "b", "url": f"ws://localhost:{metrics}"})
    done = wslb(tmp_path, "check", "--config", str(write(tmp_path, cfg)))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"pools[0].backends[0].url: 'ws://127.0.0.1:{admin}' is wslb's own admin.listen" in out
    assert f"pools[0].backends[1].url: 'ws://localhost:{metrics}' is wslb's own metrics.listen" in (
        out
    )


@pytest.mark.parametrize("backend_host", ["127.0.0.2", "10.0.0.5", "worker.internal"])
def test_the_same_port_elsewhere_is_another_server(tmp_path: Path, backend_host: str) -> None:
    """wslb in front of another wslb (or anything) on the same port of another address."""
    port = free_port()
    done = wslb(
        tmp_path,
        "check",
        "--config",
        str(write(tmp_path, config(port, f"ws://{backend_host}:{port}"))),
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_start_refuses_it_too(tmp_path: Path) -> None:
    port = free_port()
    cfg = config(port, f"ws://localhost:{port}", admin={"listen": f"127.0.0.1:{free_port()}"})
    done = wslb(tmp_path, "--config", str(write(tmp_path, cfg)))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "pools[0].backends[0].url:" in out and "proxy to itself" in out, out
    assert "Traceback" not in out, out


@contextlib.contextmanager
def held(port: int, host: str = "127.0.0.1") -> Iterator[None]:
    """Another process's listener on ``host:port`` (if something else holds it already, it is
    taken all the same)."""
    s = socket.socket()
    try:
        try:
            s.bind((host, port))
            s.listen()
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
        yield
    finally:
        s.close()


def start_error(tmp_path: Path, cfg: dict[str, Any]) -> str:
    done = wslb(tmp_path, "--config", str(write(tmp_path, cfg)))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "cannot start" in line]
    assert len(lines) == 1, out
    return lines[0]


def test_a_taken_listen_port_is_named_by_its_key(tmp_path: Path) -> None:
    port = free_port()
    cfg = config(
        port, f"ws://127.0.0.1:{free_port()}", admin={"listen": f"127.0.0.1:{free_port()}"}
    )
    with held(port):
        line = start_error(tmp_path, cfg)
    assert f"cannot start: listen 127.0.0.1:{port}: address already in use" in line, line
    assert "another wslb" in line and f"sport = :{port}" in line, line
    assert "the default" not in line, line


def test_a_taken_default_admin_port_says_it_is_the_default(tmp_path: Path) -> None:
    """The file names no admin.listen: the operator never chose 8081 and should learn so."""
    port = free_port()
    with held(8081):
        line = start_error(tmp_path, config(port, f"ws://127.0.0.1:{free_port()}"))
    assert "cannot start: admin.listen 127.0.0.1:8081 (the default: the config sets no " in line
    assert "address already in use" in line and "another wslb" in line, line


def test_a_taken_admin_or_metrics_port_the_file_names(tmp_path: Path) -> None:
    port, admin, metrics = free_port(), free_port(), free_port()
    cfg = config(
        port,
        f"ws://127.0.0.1:{free_port()}",
        admin={"listen": f"127.0.0.1:{admin}"},
        metrics={"listen": f"127.0.0.1:{metrics}"},
    )
    with held(admin):
        line = start_error(tmp_path, cfg)
    assert f"cannot start: admin.listen 127.0.0.1:{admin}: address already in use" in line, line
    with held(metrics):
        line = start_error(tmp_path, cfg)
    assert f"cannot start: metrics.listen 127.0.0.1:{metrics}: address already in use" in line


def test_workers_n_names_the_key_too(tmp_path: Path) -> None:
    port = free_port()
    cfg = config(
        port, f"ws://127.0.0.1:{free_port()}", admin={"listen": f"127.0.0.1:{free_port()}"}
    )
    cfg["workers"] = 2
    with held(port):
        line = start_error(tmp_path, cfg)
    assert f"cannot start: listen 127.0.0.1:{port}: address already in use" in line, line


def test_a_backend_added_at_run_time_cannot_be_wslb_itself(tmp_path: Path) -> None:
    """``POST /backends`` (``wslb ctl add``) is checked as the file is: 400 naming the key."""
    w = Worker("w1").start()
    lb = Wslb(pool_config([{"id": "w1", "url": w.url}]), tmp_path).start()
    try:
        for url, key in (
            (f"ws://localhost:{lb.port}", "listen"),
            (f"ws://127.0.0.1:{lb.admin_port}", "admin.listen"),
        ):
            with pytest.raises(urllib.error.HTTPError) as err:
                lb.admin_post("/backends", {"id": "loop", "url": url})
            assert err.value.code == 400
            assert f"wslb's own {key} address" in err.value.read().decode()
        assert [b["id"] for b in lb.admin("/backends")] == ["w1"]
    finally:
        lb.stop()
        w.stop()
