"""The browser library (``clients/js``) under Node's own test runner, against a real wslb.

``clients/js/test/wslb.test.js`` runs with ``node --test``; this starts what it runs against:
two reference workers, a wslb with resume's grace at 30 s and one at 1 s in front of them, and
a cut relay (``tests/cutrelay.py``, a process with a control port) in front of each wslb, so
the Node test cuts its own connections mid-answer (RST, or a silent blackhole) and brings the
network back. The library loads the ``ws`` package as its WebSocket class in Node: installed
with npm into the per-user cache when missing (``~/.cache/wslb/npm``, outside the checkout)
and proven to load before it is trusted (``tests/installs.py``'s rule); node and npm come
from Debian's packages when missing. A machine that cannot install them (no apt, not root)
skips; a failed install is an error. Also: ``npm pack`` makes the package a registry would
get.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import installs
from tests.procs import ROOT, Worker, Wslb, free_port, pool_config, spawn, stop, wait_port

JS = ROOT / "clients" / "js"
WS_SPEC = "ws@8"


def _tools() -> tuple[str, str]:
    """node and npm, proven to run; Debian's packages installed when missing (a machine that
    cannot install them skips)."""
    try:
        node = shutil.which("node") or installs.apt_binary("nodejs", "node")
        npm = shutil.which("npm") or installs.apt_binary("npm", "npm")
    except installs.CannotInstall as e:
        pytest.skip(str(e))
    installs.prove(node)
    installs.prove(npm)
    return node, npm


def _loads_ws(node: str, modules: Path) -> bool:
    env = dict(os.environ, NODE_PATH=str(modules))
    done = subprocess.run(
        [node, "-e", "new (require('ws').WebSocketServer)({noServer: true})"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode == 0


def ensure_ws(node: str, npm: str) -> Path:
    """The ``node_modules`` folder that holds ``ws``, proven to load; npm installs it into a
    scratch folder beside the cache's, moved into place whole, when the cache has none."""
    home = installs.cache_dir() / "npm"
    modules = home / "node_modules"
    if _loads_ws(node, modules):
        return modules
    home.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="npm-", dir=home.parent))
    try:
        cmd = [npm, "install", "--prefix", str(scratch), "--no-audit", "--no-fund", WS_SPEC]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise installs.InstallError(f"npm install {WS_SPEC} failed: {e}") from e
        if done.returncode != 0:
            out = (done.stderr or done.stdout).strip().splitlines()[-8:]
            raise installs.InstallError(
                f"npm install {WS_SPEC} exited {done.returncode}:\n" + "\n".join(out)
            )
        if not _loads_ws(node, scratch / "node_modules"):
            raise installs.InstallError(f"npm installed {WS_SPEC} but node cannot load it")
        shutil.rmtree(home, ignore_errors=True)
        os.replace(scratch, home)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not _loads_ws(node, modules):
        raise installs.InstallError(f"{modules}: ws does not load after the install")
    return modules


class Relay:
    """``python -m tests.cutrelay`` in front of ``target``: ``url`` goes through it."""

    def __init__(self, target: int, log: Path) -> None:
        self.port, self.control = free_port(), free_port()
        cmd = [sys.executable, "-m", "tests.cutrelay", "--to", f"127.0.0.1:{target}"]
        cmd += ["--listen", str(self.port), "--control", str(self.control)]
        self.proc = spawn(cmd, log=log)
        wait_port(self.port, 15, self.proc)
        wait_port(self.control, 15, self.proc)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control}"


@pytest.fixture
def system(tmp_path: Path) -> Iterator[dict[str, str]]:
    """What the Node test reads from its environment."""
    workers = [Worker(f"w{i}").start() for i in (1, 2)]
    backends = [{"id": w.id, "url": w.url} for w in workers]
    started: list[Wslb] = []
    relays: list[Relay] = []
    try:
        for grace in ("30s", "1s"):
            cfg = pool_config(backends, resume={"enabled": True, "grace": grace})
            lb = Wslb(cfg, tmp_path, name=f"wslb-grace-{grace}")
            started.append(lb)
            lb.start()
            lb.wait_ready()
            relays.append(Relay(lb.port, tmp_path / f"relay-{grace}.log"))
        yield {
            "WSLB_URL": relays[0].url,
            "WSLB_RELAY_CONTROL": relays[0].control_url,
            "WSLB_GRACE_URL": relays[1].url,
            "WSLB_GRACE_CONTROL": relays[1].control_url,
        }
    finally:
        for r in relays:
            stop(r.proc, 5)
        for lb in started:
            lb.stop()
        for w in workers:
            w.stop(3)  # parked sessions would hold a drain for 30 s


@pytest.fixture
def node_ws() -> tuple[str, Path]:
    """node, and the ``node_modules`` that holds ``ws`` (before any process starts)."""
    node, npm = _tools()
    return node, ensure_ws(node, npm)


def test_node_runs_the_librarys_own_tests_against_wslb(
    node_ws: tuple[str, Path], system: dict[str, str]
) -> None:
    node, modules = node_ws
    env = dict(os.environ, NODE_PATH=str(modules), **system)
    done = subprocess.run(
        [node, "--test", "--test-reporter=spec", "clients/js/test/"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout + done.stderr
    print(out)  # each case and its time, in the report of a run with -rA
    assert done.returncode == 0, out
    assert "# skipped 0" in out or "skipped 0" in out, out
    assert "fail 0" in out, out


def test_npm_pack_makes_the_package(tmp_path: Path) -> None:
    _, npm = _tools()
    done = subprocess.run(
        [npm, "pack", "--json", "--pack-destination", str(tmp_path)],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (info,) = json.loads(done.stdout)
    tarball = tmp_path / info["filename"]
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
        pkg = json.loads(tar.extractfile("package/package.json").read())  # type: ignore[union-attr]
    assert {"package/wslb.js", "package/wslb.d.ts", "package/package.json"} <= names, names
    assert not any("/test/" in n for n in names), names
    assert pkg["type"] == "module" and pkg["types"] == "./wslb.d.ts"
    assert pkg["exports"]["."]["default"] == "./wslb.js"
    assert "dependencies" not in pkg
