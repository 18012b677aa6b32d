"""Local reference workers started by the balancer (``spawn: reference``), for demos and tests.

A spawned worker that exits is restarted with exponential backoff (0.5 s doubling to 30 s, reset
once it has stayed up for 30 s), like a process supervisor. The backend is marked unhealthy while
its process is down and healthy again once its port accepts connections, so no session is sent to
a worker that is not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from balancer import workerauth
from balancer.pool import Backend

__all__ = [
    "KEEPER_ENV",
    "KEEPER_PID_ENV",
    "Backoff",
    "Spawner",
    "child_env",
    "die_with_parent",
    "python_module",
]

log = logging.getLogger("wslb.spawn")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 30.0


class Backoff:
    """Restart delays of a supervised process: 0.5 s doubling to 30 s, reset once it had stayed
    up for 30 s."""

    def __init__(self) -> None:
        self.delay = BACKOFF_MIN

    def next(self, ran_for: float) -> float:
        """The delay before restarting a process that ran for ``ran_for`` seconds."""
        if ran_for > STABLE_AFTER:
            self.delay = BACKOFF_MIN
        delay, self.delay = self.delay, min(self.delay * 2, BACKOFF_MAX)
        return delay


# The directory the running ``balancer`` package was imported from (a checkout or site-packages).
_CODE_ROOT = str(Path(__file__).resolve().parents[2])


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` with this interpreter and the code this process
    runs. ``-P``: the working directory is not put first on ``sys.path``, so a child started
    from a checkout after ``pip install .`` does not import the checkout's copy instead."""
    return [sys.executable, "-P", "-m", module, *args]


def child_env() -> dict[str, str]:
    """The environment of a child: this one, with the parent's code root first on PYTHONPATH
    (it runs the same code whatever its working directory; ``python_module``)."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _CODE_ROOT + (os.pathsep + rest if rest else "")
    return env


KEEPER_ENV = "WSLB_KEEPER_FD"
"""Set in a wslb that a restart's keeper watches (``balancer/keeper.py``): the write end of the
keeper's pipe, where the process serving now says so."""
KEEPER_PID_ENV = "WSLB_KEEPER_PID"  # and the keeper's pid (``GET /version``)


def die_with_parent() -> None:
    """In the child: get SIGTERM if the balancer dies, so no worker is orphaned (Linux).

    Not under a keeper: there the serving process that started a worker exits at the next
    restart while the worker lives on (its successor adopts it), and the keeper, the parent
    that stays, stops what is left when it exits."""
    if os.environ.get(KEEPER_ENV):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class Spawner:
    """Runs and supervises one reference worker process per ``spawn: reference`` backend."""

    def __init__(self, on_state: Callable[[Backend, bool], None] | None = None) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._adopted: dict[str, int] = {}  # backend id -> pid of a worker a restart handed on
        self._stopping = False
        self._on_state = on_state
        self.restarts: dict[str, int] = {}
        workerauth.spawn_token()  # before any child starts (serving processes inherit it)

    def command(self, backend: Backend) -> list[str]:
        """The worker's command line: wslb's own options last, so that no ``args`` (checked by
        the config already) can override the address it was given."""
        up = backend.upstream
        return python_module(
            "backends.worker",
            *backend.cfg.args,
            "--host", up.host, "--port", str(up.port), "--id", backend.id,
        )  # fmt: skip

    @staticmethod
    def environment() -> dict[str, str]:
        """The worker's environment: its credential (``balancer.workerauth``; never on the
        command line, which ``ps`` shows to every user), not the one it would otherwise
        inherit for the pools of other workers."""
        env = child_env()
        env[workerauth.ENV] = workerauth.spawn_token()
        env[workerauth.SPAWNED_ENV] = "1"  # so its log does not say the user set it
        env.pop(workerauth.SPAWN_ENV, None)
        return env

    def start(self, backend: Backend, adopt: int | None = None) -> None:
        """Start supervising a backend's worker process; ``adopt``: the pid of the one a
        restart handed on (running already, with its sessions), watched until it exits and
        then restarted as one this process started."""
        if backend.id not in self._tasks:
            if adopt is None:
                backend.set_health(False, "worker process starting", "process", time.time())
            self._tasks[backend.id] = asyncio.get_running_loop().create_task(
                self._supervise(backend, adopt), name=f"spawn-{backend.id}"
            )

    def pid(self, backend_id: str) -> int | None:
        p = self._procs.get(backend_id)
        if p is not None and p.returncode is None:
            return p.pid
        return self._adopted.get(backend_id)

    def pids(self) -> dict[str, int]:
        """The running workers by backend id (what a restart hands on)."""
        out = {}
        for bid in self._tasks:
            pid = self.pid(bid)
            if pid is not None:
                out[bid] = pid
        return out

    async def release(self) -> None:
        """Stop supervising without stopping the workers: a restart's new code has them."""
        self._stopping = True
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._procs.clear()
        self._adopted.clear()

    async def _watch_adopted(self, backend: Backend, pid: int) -> None:
        """Until the adopted worker ``pid`` exits (it is not this process's child)."""
        with _exit_of(pid) as exited:
            if exited is None:
                return
            self._adopted[backend.id] = pid
            log.info("adopted worker %s (pid %d)", backend.id, pid)
            try:
                if not backend.healthy and await self._accepts(backend):
                    self._set(backend, True)
                await exited
            finally:
                self._adopted.pop(backend.id, None)
        self._set(backend, False, "worker process exited")

    def _set(self, backend: Backend, healthy: bool, reason: str | None = None) -> None:
        if backend.set_health(healthy, reason, "process", time.time()):
            if healthy:
                log.info("backend %s is up (its worker process accepts connections)", backend.id)
            else:
                log.warning("backend %s is down: %s", backend.id, reason)
        if self._on_state is not None:
            self._on_state(backend, healthy)

    async def _supervise(self, backend: Backend, adopt: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        if adopt is not None:
            await self._watch_adopted(backend, adopt)
            if self._stopping:
                return
        while True:
            started = loop.time()
            proc = await asyncio.create_subprocess_exec(
                *self.command(backend),
                # Its ready line is for a parent that reads it; wslb connects instead. Its log
                # lines (stderr) join wslb's, in wslb's format (``logs.FORMAT_ENV``).
                stdout=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=self.environment(),
            )
            self._procs[backend.id] = proc
            log.info("started worker %s (pid %d)", backend.id, proc.pid)
            waiter = loop.create_task(proc.wait())
            while not waiter.done():
                if await self._accepts(backend):
                    self._set(backend, True)
                    break
                await asyncio.wait({waiter}, timeout=0.1)
            code = await waiter
            self._set(backend, False, f"worker process exited with {code}")
            if self._stopping:
                return
            self.restarts[backend.id] = self.restarts.get(backend.id, 0) + 1
            delay = backoff.next(loop.time() - started)
            log.warning("worker %s exited with %s; restarting in %.1fs", backend.id, code, delay)
            await asyncio.sleep(delay)

    @staticmethod
    async def _accepts(backend: Backend) -> bool:
        up = backend.upstream
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(up.host, up.port), 1.0)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def stop(self, backend_id: str | None = None, timeout: float = 5.0) -> None:
        """Stop one supervised worker, or all (SIGTERM, then SIGKILL after ``timeout``)."""
        ids = [backend_id] if backend_id is not None else list(self._tasks)
        if backend_id is None:
            self._stopping = True
        for bid in ids:
            task = self._tasks.pop(bid, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            proc = self._procs.pop(bid, None)
            adopted = self._adopted.pop(bid, None)
            if adopted is not None:
                await _stop_pid(adopted, timeout)
            if proc is None or proc.returncode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


@contextlib.contextmanager
def _exit_of(pid: int) -> Iterator[asyncio.Future[None] | None]:
    """A future done when ``pid`` exits (a pidfd: it need not be this process's child), or
    None if it is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: None if done.done() else done.set_result(None))
    try:
        yield done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _stop_pid(pid: int, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout``, to a process that is not this one's child."""
    with _exit_of(pid) as exited:
        if exited is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
