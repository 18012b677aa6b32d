"""The browser library (``clients/js``) under Node's own test runner, against a real wslb.

``clients/js/test/wslb.test.js`` runs with ``node --test``; this starts what it runs against:
two reference workers, a wslb with resume's grace at 30 s and one at 1 s in front of them, and
a cut relay (``tests/cutrelay.py``, a process with a control port) in front of each wslb, so
the Node test cuts its own connections mid-answer (RST, or a silent blackhole) and brings the
network back. The library loads the ``ws`` package as its WebSocket class in Node; ``tsc``
checks the declarations against a file that uses them. Both come from npm into the per-user
cache when missing (``~/.cache/wslb/npm``, outside the checkout), proven to work before they
are trusted (``tests/installs.py``'s rule); node and npm come from Debian's packages when
missing. A machine that cannot install them (no apt, not root) skips; a failed install is an
error. Also: ``npm pack`` makes the package a registry would get.
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
NPM_PACKAGES = ("ws@8", "typescript@5", "@types/node@20")
"""What the tests take from npm: the WebSocket class for Node, and the compiler that checks
the declarations (with Node's types, for a check without the DOM's)."""


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


def _works(node: str, modules: Path) -> bool:
    """ws loads, tsc runs and Node's types are there, in ``modules``."""
    env = dict(os.environ, NODE_PATH=str(modules))
    checks = [
        [node, "-e", "new (require('ws').WebSocketServer)({noServer: true})"],
        [node, str(modules / "typescript" / "bin" / "tsc"), "--version"],
    ]
    for cmd in checks:
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=60, check=False)
        if done.returncode != 0:
            return False
    return (modules / "@types" / "node" / "package.json").is_file()


def ensure_npm(node: str, npm: str) -> Path:
    """The ``node_modules`` folder that holds ``NPM_PACKAGES``, proven to work; npm installs
    them into a scratch folder beside the cache's, moved into place whole, when the cache has
    none that works."""
    home = installs.cache_dir() / "npm"
    modules = home / "node_modules"
    if _works(node, modules):
        return modules
    home.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="npm-", dir=home.parent))
    what = " ".join(NPM_PACKAGES)
    try:
        cmd = [npm, "install", "--prefix", str(scratch), "--no-audit", "--no-fund", *NPM_PACKAGES]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise installs.InstallError(f"npm install {what} failed: {e}") from e
        if done.returncode != 0:
            out = (done.stderr or done.stdout).strip().splitlines()[-8:]
            raise installs.InstallError(
                f"npm install {what} exited {done.returncode}:\n" + "\n".join(out)
            )
        if not _works(node, scratch / "node_modules"):
            raise installs.InstallError(f"npm installed {what} but they do not work")
        shutil.rmtree(home, ignore_errors=True)
        os.replace(scratch, home)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not _works(node, modules):
        raise installs.InstallError(f"{modules}: {what} do not work after the install")
    return modules


@pytest.fixture
def node_npm() -> tuple[str, Path]:
    """node, and the ``node_modules`` of ``NPM_PACKAGES`` (before any process starts)."""
    node, npm = _tools()
    return node, ensure_npm(node, npm)


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


def test_node_runs_the_librarys_own_tests_against_wslb(
    node_npm: tuple[str, Path], system: dict[str, str]
) -> None:
    node, modules = node_npm
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


@pytest.mark.parametrize("types", ["dom", "node"])
def test_the_declarations_type_check(
    node_npm: tuple[str, Path], tmp_path: Path, types: str
) -> None:
    """``typecheck/usage.ts`` (every export used, wrong uses marked ``@ts-expect-error``)
    compiles with ``tsc --strict``, importing the package by name as an app would, with the
    DOM's types (a browser app) or Node's only."""
    node, modules = node_npm
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "wslb").symlink_to(JS)
    shutil.copy(JS / "typecheck" / "usage.ts", tmp_path / "usage.ts")
    options = {
        "strict": True,
        "noEmit": True,
        "module": "nodenext",
        "moduleResolution": "nodenext",
        "target": "es2022",
        "lib": ["es2022", "dom"] if types == "dom" else ["es2022"],
        "typeRoots": [str(modules / "@types")],
        "types": [] if types == "dom" else ["node"],
    }
    config = {"compilerOptions": options, "files": ["usage.ts"]}
    (tmp_path / "tsconfig.json").write_text(json.dumps(config))
    tsc = str(modules / "typescript" / "bin" / "tsc")
    done = subprocess.run(
        [node, tsc, "-p", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
