"""The command line as HAProxy's and nginx's operators type it: ``wslb check FILE``, ``wslb -t
-c FILE``, ``--version``, every subcommand in ``--help``, ``wslb ctl`` options before or after
the command and ``--admin HOST:PORT``; ``GET /version`` from a running wslb."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from balancer import ctl
from balancer.version import version
from tests.procs import ROOT, Worker, Wslb, pool_config

WSLB = [sys.executable, "-m", "balancer"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*WSLB, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("pools:\n  - name: chat\n    backends: [{id: a, url: 'ftp://x'}]\n")
    return path


def test_version_flags() -> None:
    for flag in ("--version", "-v"):
        done = run(flag)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"wslb {version()}"
    assert version() != "0+unknown"  # the test install (pip install -e) has a version


def test_check_takes_the_file_as_an_argument(bad: Path) -> None:
    ok = run("check", "balancer.yaml")
    assert ok.returncode == 0 and "balancer.yaml: ok" in ok.stdout, ok.stderr
    refused = run("check", str(bad))
    assert refused.returncode == 2
    assert "pools[0].backends[0].url" in refused.stderr, refused.stderr
    # The older spelling still works.
    assert run("check", "--config", "balancer.yaml").returncode == 0


def test_dash_t_tests_the_config_like_nginx(bad: Path) -> None:
    assert run("-t", "-c", "balancer.yaml").returncode == 0
    done = run("-t", "-c", str(bad))
    assert done.returncode == 2 and "pools[0].backends[0].url" in done.stderr


def test_help_lists_every_subcommand() -> None:
    top = run("--help")
    assert top.returncode == 0
    for word in ("check", "ctl", "--test", "--version"):
        assert word in top.stdout, top.stdout
    sub = run("ctl", "--help")
    assert sub.returncode == 0
    for name, _ in ctl.COMMANDS:
        assert name in sub.stdout, sub.stdout


def test_admin_address_forms() -> None:
    assert ctl.admin_url("127.0.0.1:8081") == "http://127.0.0.1:8081"
    assert ctl.admin_url("http://10.0.0.5:9000/") == "http://10.0.0.5:9000"
    assert ctl.admin_url("[::1]:8081") == "http://[::1]:8081"


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Wslb]:
    worker = Worker("c1").start()
    proc = Wslb(pool_config([{"id": "c1", "url": worker.url}]), tmp_path).start()
    yield proc
    proc.stop()
    worker.stop()


def test_ctl_options_after_the_command_and_host_port(lb: Wslb) -> None:
    env = dict(lb.env)
    env.pop("WSLB_ADMIN_URL", None)
    address = f"127.0.0.1:{lb.admin_port}"
    for argv in (
        ("ctl", "backends", "--json", "--admin", address),
        ("ctl", "--admin", address, "backends", "--json"),
        ("ctl", "--json", "backends", "--admin", f"http://{address}"),
    ):
        done = run(*argv, env=env)
        assert done.returncode == 0, (argv, done.stderr)
        assert [b["id"] for b in json.loads(done.stdout)] == ["c1"], argv
    # A flag given after the command overrides the one before it.
    done = run("ctl", "--admin", "127.0.0.1:1", "backends", "--admin", address, env=env)
    assert done.returncode == 0, done.stderr


def test_version_route(lb: Wslb) -> None:
    v = lb.admin("/version")
    assert v["version"] == version()
    assert v["pid"] == lb.pid
    started = datetime.datetime.fromisoformat(v["started"])
    assert started.tzinfo is not None
    age = datetime.datetime.now(datetime.UTC) - started
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=2)
    assert os.getpid() != v["pid"]
