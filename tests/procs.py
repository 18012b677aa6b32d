"""Real processes on loopback for integration tests and benchmarks: wslb and reference workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from balancer import admintoken

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening after {timeout}s")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Worker:
    """A ``wslb-worker`` process."""

    def __init__(self, wid: str, args: Sequence[str] = (), port: int | None = None) -> None:
        self.id = wid
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self) -> Worker:
        cmd = [sys.executable, "-m", "backends.worker", "--port", str(self.port), "--id", self.id]
        self.proc = subprocess.Popen([*cmd, *self.args], cwd=ROOT, stdout=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())


class Wslb:
    """A ``wslb`` process started from a config dict written to a temporary file.

    Its generated admin token (no ``admin.token`` configured) goes to its own state directory;
    ``admin``/``admin_post`` send it, and ``env`` lets ``wslb ctl`` find it as a user's does.
    """

    def __init__(self, config: dict[str, Any], tmp: Path) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        cfg = dict(config)
        cfg.setdefault("listen", f"127.0.0.1:{self.port}")
        cfg.setdefault("admin", {"listen": f"127.0.0.1:{self.admin_port}"})
        self.config = cfg
        self.path = tmp / f"wslb-{self.port}.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / f"wslb-{self.port}.log"
        self.state_dir = tmp / f"wslb-{self.port}-state"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", WSLB_STATE_DIR=str(self.state_dir))
        self.env.pop("WSLB_ADMIN_TOKEN", None)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def token(self) -> str | None:
        """The admin token: the configured one, else the one wslb generated at start."""
        admin = self.config.get("admin")
        configured = admin.get("token") if isinstance(admin, dict) else None
        return configured or admintoken.read(self.admin_port, self.env)

    def start(self, wait_ready: bool = True) -> Wslb:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "balancer", "--config", str(self.path)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        wait_port(self.port, proc=self.proc)
        wait_port(self.admin_port, proc=self.proc)
        deadline = time.monotonic() + 5
        while self.token is None and time.monotonic() < deadline:
            time.sleep(0.02)  # written between the admin port's bind and its first answer
        if wait_ready:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if all(b["state"] == "active" for b in self.admin("/backends")):
                    break
                time.sleep(0.05)
        return self

    def admin(self, path: str, token: str | None = None) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}")
        token = token or self.token
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=5) as r:
            body = r.read().decode()
        return json.loads(body) if path != "/metrics" else body

    def admin_post(self, path: str, body: Any) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        return stop(self.proc, timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def pool_config(backends: Sequence[dict[str, Any]], **pool: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"name": "chat", "backends": list(backends)}
    p.update(pool)
    return {"pools": [p]}


@contextlib.contextmanager
def running(*procs: Worker | Wslb) -> Iterator[None]:
    try:
        yield
    finally:
        for p in reversed(procs):
            p.stop()
