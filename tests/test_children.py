"""Child processes run the code their parent runs, whatever the working directory.

``python -m`` puts the working directory first on ``sys.path``: a serving process of
``workers: N`` or a spawned reference worker started from a directory that holds another
``balancer/`` or ``backends/`` (a checkout beside an installed wslb) would import that one.
Here the working directory holds decoys that fail loudly when imported.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from websockets.asyncio.client import connect

from balancer import admintoken
from tests.procs import free_port, wait_port

DECOY = "raise SystemExit('imported the decoy package in the working directory')\n"


def wslb_command() -> list[str]:
    """The console script, as a user runs it (its own directory, not the cwd, is on sys.path)."""
    script = shutil.which("wslb") or str(Path(sys.executable).with_name("wslb"))
    return [script]


def start(cwd: Path, config: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with (cwd / "wslb.log").open("wb") as log:
        return subprocess.Popen(
            [*wslb_command(), "--config", str(config)],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def test_serving_processes_and_spawned_workers_ignore_the_cwd(tmp_path: Path) -> None:
    for pkg in ("balancer", "backends"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(DECOY)
    port, admin, worker = free_port(), free_port(), free_port()
    config = tmp_path / "balancer.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "admin": {"listen": f"127.0.0.1:{admin}"},
                "workers": 2,
                "timeouts": {"shutdown_grace": "0.1s"},
                "pools": [
                    {
                        "name": "chat",
                        "backends": [
                            {"id": "w1", "url": f"ws://127.0.0.1:{worker}", "spawn": "reference"}
                        ],
                    }
                ],
            }
        )
    )
    env = dict(os.environ, WSLB_STATE_DIR=str(tmp_path / "state"), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    proc = start(tmp_path, config, env)
    try:
        wait_port(admin, timeout=30, proc=proc)
        wait_port(worker, timeout=30, proc=proc)
        # The admin port accepts (its socket listens) a moment before the generated token's
        # file is written: wait for the file, bounded.
        deadline = time.monotonic() + 30
        while (token := admintoken.read(admin, env)) is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert token
        for i in range(20):  # both serving processes take sessions
            async with connect(f"ws://127.0.0.1:{port}/ws?session=c{i}") as ws:
                assert json.loads(await ws.recv())["worker"] == "w1"
        await asyncio.sleep(0)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    out = (tmp_path / "wslb.log").read_text()
    assert "decoy" not in out, out
    assert code == 0, out
    assert "2 serving processes ready" in out
