"""WebSocket servers written without wslb in mind, and a helper that runs them as processes.

Each server is what a user would already have before putting wslb in front of it: a FastAPI app
under uvicorn's own CLI, a plain aiohttp handler, a stock ``websockets`` echo server. None has a
health route, a ``/metrics`` endpoint or the handoff API, so the tests that use them check wslb's
defaults rather than anything the reference worker provides.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.procs import free_port, spawn, stop, wait_port

# The canned answer the chat servers stream, one word per message, DELAY seconds apart:
# 18 words, so one answer takes about a second.
ANSWER = (
    "WebSockets keep connections open so the model can stream its answer word by word "
    "as each is ready"
)
WORDS = tuple(ANSWER.split())
DELAY = 0.05

KINDS = ("fastapi", "aiohttp", "websockets")


def command(kind: str, port: int) -> list[str]:
    """How a user starts each server: uvicorn's CLI for the FastAPI app, ``python -m`` else."""
    if kind == "fastapi":
        app = "tests.servers.article_app:app"
        return [sys.executable, "-m", "uvicorn", app, "--port", str(port), "--no-access-log"]
    if kind == "aiohttp":
        return [sys.executable, "-m", "tests.servers.aiohttp_app", "--port", str(port)]
    if kind == "websockets":
        return [sys.executable, "-m", "tests.servers.websockets_echo", "--port", str(port)]
    raise ValueError(f"unknown server kind {kind!r}")


class Server:
    """One server process on a free loopback port; its output goes to ``logdir``.

    A context manager, so a failing test never leaves a server behind.
    """

    def __init__(self, kind: str, logdir: Path, port: int | None = None) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.log = logdir / f"{kind}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The backend URL a new user writes: host and port, no path."""
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, extra: Sequence[str] = ()) -> Server:
        self.proc = spawn([*command(self.kind, self.port), *extra], log=self.log)
        try:
            wait_port(self.port, proc=self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would: no close frames, the port refuses at once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> Server:
        return self if self.proc is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
