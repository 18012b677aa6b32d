"""A real single-node etcd on loopback for the cluster-mode tests (Debian's etcd-server package).

When ``etcd`` is missing and the tests run as root with apt (a fresh CI machine), the package is
installed first; no system service is used: each test starts its own etcd in a temporary data
directory on free ports, and can stop and restart it on the same directory and ports.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests import installs
from tests.procs import free_port, stop

_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def etcd_binary() -> str:
    """Path of ``etcd``, proven to run; installs Debian's etcd-server when it is missing and we
    may (a failed install is an error naming the step; a machine without apt skips)."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    os.environ.setdefault("ETCD_UNSUPPORTED_ARCH", arch)  # etcd 3.4 on arm64
    try:
        return installs.apt_binary("etcd-server", "etcd", after=("service", "etcd", "stop"))
    except installs.CannotInstall as e:
        pytest.skip(str(e))


class Etcd:
    """One etcd member on loopback; ``stop()`` and ``start()`` again keep its data and ports."""

    def __init__(self, data_dir: Path) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.log = data_dir.parent / f"etcd-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name", "wslb-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"wslb-test={peer}",
        ]  # fmt: skip
        # etcd 3.4 refuses to start on arm64 unless told it may.
        arch = _ARCH.get(platform.machine(), platform.machine())
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=arch)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.output()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {timeout}s: {self.output()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def call(self, path: str, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            data: dict[str, object] = json.loads(r.read())
            return data

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
