"""Real processes on loopback for the benchmarks and the integration tests: wslb, reference
workers, and any other child a benchmark starts (its load generators, another proxy).

The one place this repository starts them (``tests/procs.py`` re-exports it for the tests): the
tests use ``Worker`` and ``Wslb`` as they are (output to a temp file or nowhere, stopped by
``stop``); the scripts in ``bench/`` group theirs in a ``Procs``: logs in one directory, each
child the leader of its own session and SIGKILLed if the script dies, all stopped, newest first,
on ``close``. ``src`` runs wslb or a worker from another checkout (a ``git worktree`` of the
commit under test).

Every child gets ``WORKER_TOKEN`` as ``$WSLB_WORKER_TOKEN``: workers require it (SPEC section
12) and wslb shows it to every pool without ``worker_auth``, so the tests run with the
credential on and need not name it; a test that talks to a worker itself, as wslb would, sends
``WORKER_AUTH``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import yaml

from balancer import admintoken

ROOT = Path(__file__).resolve().parents[2]
WORKER_TOKEN = secrets.token_urlsafe(32)
"""The credential between the test's wslb and workers (one per test process)."""
WORKER_AUTH = {"X-WSLB-Worker-Token": WORKER_TOKEN}
"""The header a test that plays wslb's part sends a worker."""

Backends = list[dict[str, Any]]  # GET /backends


_RECENT: collections.deque[int] = collections.deque(maxlen=2048)
_PICK = random.Random()  # its own: a test that seeds the module's generator must not share ports


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host`` below the kernel's ephemeral range, never one handed out recently.

    A port from ``bind(0)`` comes from the ephemeral range, which every outgoing connection and
    every ``bind(0)`` listener on the machine draws from too: between this call and the child's
    own bind, another connection could take it (seen in CI: "address already in use"). Ports
    below the range are only ever taken by a bind that names them, so a random free one there
    stays free until the test's process binds it. The kernel may also give the same port to two
    ``bind(0)`` calls in a row, and a config with two listeners on one port is rejected: no port
    is handed out twice per process.
    """
    low, high = _free_range()
    for _ in range(10_000):
        port = _PICK.randrange(low, high)
        if port in _RECENT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _RECENT.append(port)
        return port
    raise RuntimeError(f"no free port on {host} in [{low}, {high})")


def _free_range() -> tuple[int, int]:
    """The ports below the ephemeral range (``ip_local_port_range``), above the well-known ones;
    under pytest-xdist, this worker's own slice of them. Each worker only knows a port is free
    now, and another worker may have picked it a moment before and not bound it yet (seen in CI:
    a test's reference worker and another test's wslb on one port, 28 ms apart)."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    low, high = (10_000, first) if first > 20_000 else (first + 28_000, 65_000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        step = (high - low) // int(count)
        low += (int(worker[2:]) % int(count)) * step
        high = low + step
    return low, high


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host``."""
    return [free_port(host) for _ in range(n)]


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until ``port`` on 127.0.0.1 accepts a connection; raises if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process {proc.args!r} exited with {proc.returncode} before listening"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening after {timeout:g}s")


def die_with_parent() -> None:
    """In a child (``preexec_fn``): SIGKILL if the script dies without cleaning up (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_env(src: Path = ROOT, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, unbuffered, with the workers' credential and ``extra``;
    ``src`` (when not this checkout) first on ``PYTHONPATH`` so that ``python -m`` runs its
    code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WSLB_WORKER_TOKEN=WORKER_TOKEN)
    if src != ROOT:
        rest = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(src) + (os.pathsep + rest if rest else "")
    env.update(extra or {})
    return env


def spawn(
    cmd: Sequence[str],
    *,
    log: Path | None = None,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    pipes: bool = False,
    session: bool = False,
    pdeathsig: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in ``cwd`` with ``env`` (default: ``child_env()``).

    Output: stdout and stderr to ``log``; with ``pipes``, stdin and stdout are pipes and ``log``
    gets stderr; with no ``log``, stdout goes nowhere and stderr is this process's.
    ``session``: the child leads its own session (a terminal's Ctrl-C reaches the script only,
    which stops the children itself) and ``stop(group=True)`` signals its whole group.
    ``pdeathsig``: SIGKILL when this process dies.
    """
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("wb")) if log is not None else None
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else (out or subprocess.DEVNULL),
            stderr=out if pipes or out is None else subprocess.STDOUT,
            start_new_session=session,
            preexec_fn=die_with_parent if pdeathsig else None,
            env=dict(env) if env is not None else child_env(),
        )


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop(
    proc: subprocess.Popen[bytes],
    timeout: float = 10.0,
    *,
    group: bool = False,
    extra: Iterable[psutil.Process] = (),
) -> int:
    """SIGTERM ``proc``, SIGKILL if it still runs ``timeout`` s later (at once for 0); its exit
    status. ``group``: the signals go to its process group (a ``session`` child), and whatever
    is left in the group then gets SIGKILL. ``extra`` processes still running get SIGKILL too
    (those it started in sessions of their own, e.g. wslb's ``spawn:`` workers)."""
    if proc.poll() is None:
        if timeout > 0:
            _signal(proc, signal.SIGTERM, group)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL, group)
                proc.wait()
        else:
            _signal(proc, signal.SIGKILL, group)
            proc.wait()
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for p in extra:
        with contextlib.suppress(psutil.Error):
            p.kill()  # psutil checks first that the pid is still that process
            p.wait(5)
    return proc.returncode


class Procs:
    """A benchmark's children: logs in ``logdir/NAME.log``, all stopped on ``close``.

    ``session``/``pdeathsig`` as ``spawn``'s; ``term_timeout``: seconds between SIGTERM and
    SIGKILL at close (0: SIGKILL at once), unless a child was given its own. ``Worker`` and
    ``Wslb`` given ``procs=`` start this way too and are stopped with the rest.
    """

    def __init__(
        self,
        logdir: Path,
        *,
        session: bool = True,
        pdeathsig: bool = True,
        term_timeout: float = 5.0,
    ) -> None:
        self.logdir = logdir
        self.session = session
        self.pdeathsig = pdeathsig
        self.term_timeout = term_timeout
        self._stops: list[Callable[[], object]] = []

    def spawn(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        pipes: bool = False,
        term_timeout: float | None = None,
        cwd: Path = ROOT,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` with its output in ``NAME.log`` (stderr only, with ``pipes``)."""
        proc = self.start(name, cmd, cwd=cwd, env=env, pipes=pipes)
        timeout = self.term_timeout if term_timeout is None else term_timeout

        def close() -> None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            stop(proc, timeout, group=self.session)
            if proc.stdout is not None:
                proc.stdout.close()

        self.on_close(close)
        return proc

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        cwd: Path = ROOT,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        pipes: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` as this group's children start, without stopping it on ``close``."""
        log = log or self.log_path(name)
        return spawn(
            cmd,
            log=log,
            cwd=cwd,
            env=env,
            pipes=pipes,
            session=self.session,
            pdeathsig=self.pdeathsig,
        )

    def on_close(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` on ``close``, before whatever was added earlier."""
        self._stops.append(fn)

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str, lines: int = 20) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def close(self) -> None:
        for fn in reversed(self._stops):
            fn()
        self._stops.clear()

    def __enter__(self) -> Procs:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Worker:
    """A ``wslb-worker`` process (``python -m backends.worker``).

    With ``procs``: started as that group's children are, its output in ``NAME.log`` (``name``,
    default ``worker-ID``), stopped on its ``close`` after ``term_timeout`` (default: the
    group's). ``src``: the checkout it runs from; ``extra_env``: added to its environment.
    """

    def __init__(
        self,
        wid: str,
        args: Sequence[str] = (),
        port: int | None = None,
        *,
        procs: Procs | None = None,
        name: str | None = None,
        src: Path = ROOT,
        extra_env: Mapping[str, str] | None = None,
        term_timeout: float | None = None,
    ) -> None:
        self.id = wid
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = name or f"worker-{wid}"
        self.src = src
        self.env = child_env(src, extra_env)
        self._procs = procs
        self._term_timeout = term_timeout

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, wait: bool = True, timeout: float = 15.0) -> Worker:
        """Start it; with ``wait``, until it listens (``timeout`` s at most, else raises)."""
        cmd = [sys.executable, "-m", "backends.worker", "--port", str(self.port), "--id", self.id]
        cmd += self.args
        procs = self._procs
        if procs is None:
            self.proc = spawn(cmd, cwd=self.src, env=self.env)
        else:
            self.proc = procs.start(self.name, cmd, cwd=self.src, env=self.env)
            term = procs.term_timeout if self._term_timeout is None else self._term_timeout
            procs.on_close(lambda: self.stop(term))
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float = 15.0) -> None:
        """Until it listens; raises ``TimeoutError`` after ``timeout`` s, or if it exits first."""
        assert self.proc is not None
        wait_port(self.port, timeout, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _signal(self.proc, signal.SIGKILL, self._group)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop(self.proc, timeout, group=self._group)

    @property
    def _group(self) -> bool:
        return self._procs is not None and self._procs.session

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())


def all_active(backends: Backends) -> bool:
    """``Wslb.wait_ready``'s default test: every backend in state ``active``."""
    return all(b["state"] == "active" for b in backends)


class Wslb:
    """A ``wslb`` process started from a config dict written to ``tmp/NAME.yaml``, its output in
    ``tmp/NAME.log`` (``name``: default ``wslb-PORT``).

    ``listen`` and ``admin`` default to free ports on 127.0.0.1. With no ``admin.token``
    configured (nor ``token``), its generated admin token goes to its own state directory;
    ``admin``/``admin_post`` send the token, and ``env`` lets ``wslb ctl`` find it as a user's
    does. A benchmark names its ``token`` (it goes into ``admin.token``): a generated one
    would be logged as a warning its log summary counts.

    ``args`` follow ``--config FILE``; ``command`` replaces ``python -m balancer`` (a wrapper);
    ``src`` is the checkout it runs from (its working directory and first on ``PYTHONPATH``:
    ``workers: N`` children and ``spawn:`` workers run that code too); ``extra_env`` is added to
    its environment. With ``procs``: started as that group's children are, stopped on its
    ``close`` after ``term_timeout`` (default: the group's).
    """

    def __init__(
        self,
        config: dict[str, Any],
        tmp: Path,
        *,
        procs: Procs | None = None,
        name: str | None = None,
        token: str | None = None,
        args: Sequence[str] = (),
        command: Sequence[str] | None = None,
        src: Path = ROOT,
        extra_env: Mapping[str, str] | None = None,
        term_timeout: float | None = None,
    ) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        cfg = dict(config)
        cfg.setdefault("listen", f"127.0.0.1:{self.port}")
        cfg.setdefault("admin", {"listen": f"127.0.0.1:{self.admin_port}"})
        if token is not None:
            cfg["admin"] = {**cfg["admin"], "token": token}
        self.config = cfg
        self.name = name or f"wslb-{self.port}"
        self.path = tmp / f"{self.name}.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / f"{self.name}.log"
        self.state_dir = tmp / f"{self.name}-state"
        self.env = child_env(src, {"WSLB_STATE_DIR": str(self.state_dir), **(extra_env or {})})
        self.env.pop("WSLB_ADMIN_TOKEN", None)
        self.command = list(command or [sys.executable, "-m", "balancer"])
        self.args = list(args)
        self.src = src
        self._procs = procs
        self._term_timeout = term_timeout
        self._children: dict[int, psutil.Process] = {}

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def token(self) -> str | None:
        """The admin token: the configured one, else the one wslb generated at start."""
        admin = self.config.get("admin")
        configured = admin.get("token") if isinstance(admin, dict) else None
        return configured or admintoken.read(self.admin_port, self.env)

    @property
    def auth(self) -> dict[str, str]:
        """The header the admin API requires on all but ``GET /healthz`` and ``/readyz``."""
        token = self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def start(self, wait_ready: bool = True, timeout: float = 15.0) -> Wslb:
        """Start it and wait until both its ports listen (``timeout`` s each at most, else
        raises); with ``wait_ready``, also up to 20 s for every backend to be active, then
        return whether or not they are (``wait_ready()`` raises instead)."""
        cmd = [*self.command, "--config", str(self.path), *self.args]
        procs = self._procs
        if procs is None:
            self.proc = spawn(cmd, log=self.log, cwd=self.src, env=self.env)
        else:
            self.proc = procs.start(self.name, cmd, log=self.log, cwd=self.src, env=self.env)
            term = procs.term_timeout if self._term_timeout is None else self._term_timeout
            procs.on_close(lambda: self.stop(term))
        wait_port(self.port, timeout, self.proc)
        wait_port(self.admin_port, timeout, self.proc)
        deadline = time.monotonic() + 5
        while self.token is None and time.monotonic() < deadline:
            time.sleep(0.02)  # written between the admin port's bind and its first answer
        if wait_ready:
            with contextlib.suppress(TimeoutError):
                self.wait_ready()
        return self

    def wait_ready(
        self, timeout: float = 20.0, until: Callable[[Backends], bool] = all_active
    ) -> None:
        """Poll ``GET /backends`` until ``until(listing)``; raises ``TimeoutError`` (with the
        last listing) after ``timeout`` s, ``RuntimeError`` if wslb exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wslb exited with {self.proc.returncode}")
            with contextlib.suppress(OSError, ValueError):
                last = self.admin("/backends")
                if until(last):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"wslb backends not ready after {timeout:g}s: {last}")
            time.sleep(0.05)

    def admin(self, path: str, token: str | None = None, timeout: float = 5.0) -> Any:
        """``GET path`` on the admin API with the token: JSON, or text for ``/metrics``."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}")
        token = token or self.token
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode()
        return json.loads(body) if path != "/metrics" else body

    def admin_post(self, path: str, body: Any) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **self.auth},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def children(self) -> list[psutil.Process]:
        """Its descendants now (``workers: N`` processes, ``spawn:`` workers). ``stop`` also
        kills any of those seen here, or at ``stop``, that outlive it."""
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.pid).children(recursive=True)
            self._children.update((p.pid, p) for p in kids)
            return kids
        return []

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.children()
            _signal(self.proc, signal.SIGKILL, self._group)
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.children()
        return stop(self.proc, timeout, group=self._group, extra=self._children.values())

    @property
    def _group(self) -> bool:
        return self._procs is not None and self._procs.session

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.output().splitlines()[-lines:])
