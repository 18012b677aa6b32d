"""Hot restart (SPEC section 14): the code installed now takes over the listeners and every
live session of the code running now, and the old code goes.

The rules, in order (the old code is the *giver*, the new one the *taker*):

1. **Proof first.** The giver runs ``wslb check --deep`` with the new code on the config file as
   it is now (every module imported, the config built). If that fails, nothing else happens:
   the giver keeps serving and the answer and the log carry the check's own words.
2. **The taker starts beside the giver** (``wslb --take-over SOCKET``): it builds all its parts
   but binds nothing, connects to the giver's Unix socket (in a private 0700 directory) and says
   who it is. A taker that exits first is a failed restart; the giver serves on.
3. **Finish first.** The giver stops starting migrations (a drain is handed on, with the time it
   has left) and lets those in flight and every failover finish; a session in one of those
   modes is moved once it is out of it.
4. **Listeners.** The giver passes the taker its listening sockets (client, admin, metrics:
   ``SCM_RIGHTS``, not rebound, so no connect is refused or reset), with the backends' health
   and states, the drains, the spawned workers' pids and the admin token. Once the taker is
   accepting, the giver stops accepting on all of them, the admin API's too (it keeps a copy of
   each until the end, to listen again if the taker dies): a request after one the new code
   answered never reaches the old. A restart asked of the taker before its last session came
   waits for it.
5. **Sessions, one at a time.** Each is quiesced (the relay thread's sessions are taken back
   first), its write buffers flushed to the kernel, described as data (``Session.snapshot``) and
   passed with both its sockets; the taker adopts it and says so; only then does the giver let
   go. A TLS leg (crypto state that cannot move) is closed with 1012, and the client resumes
   (Rule 8 of ``session_core.py``). A detached session moves with its worker's socket only.
6. **The end.** Plain HTTP requests in flight finish in the giver; then the giver answers the
   restart with what moved and what did not (and why), and exits. The process a supervisor
   (systemd, Kubernetes) tracks must stay: if the giver is that process it becomes the keeper
   (``balancer/keeper.py``, by ``exec``: same pid, 14 MB) and the taker serves under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from balancer.aio.control import backend_body
from balancer.aio.drain import Drainer
from balancer.aio.fdpass import LEN, Truncated, read_exact, read_line, recv_head, send_head
from balancer.aio.monitors import Monitors
from balancer.aio.offload import plain_socket
from balancer.aio.session import Gone, Mode, Parked, Session
from balancer.aio.spawn import KEEPER_ENV, KEEPER_PID_ENV, child_env, python_module
from balancer.aio.state import ServerState
from balancer.frames import CloseCode
from balancer.logs import count
from balancer.version import started_iso, version

__all__ = [
    "UNCHANGED",
    "Handed",
    "Host",
    "RestartError",
    "Restarter",
    "TakeOver",
    "check_new_code",
    "keeper_command",
]

log = logging.getLogger("wslb.restart")

CHECK_TIMEOUT = 60.0  # the new code's check (imports and config)
TAKER_TIMEOUT = 60.0  # the new code's start, up to its hello
STEP_TIMEOUT = 10.0  # each answer of the taker
FINISH_TIMEOUT = 15.0  # migrations and failovers in flight
FLUSH_TIMEOUT = 1.0  # a session's write buffers reaching the kernel
MOVE_TIMEOUT = 30.0  # every session moved, or the rest closed with 1012
LATE = 0.5  # how long sessions still in their handshake at the hand-over have to appear
_BUSY = (Mode.MIGRATING, Mode.HELD, Mode.FAILING_OVER)
_MAX_LINE = 1 << 16


class RestartError(Exception):
    """The new code did not take over; the old code serves on. ``reason``: a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class Handed:
    """What a process handed on, from the listeners and sessions to the keeper's command."""

    listeners: list[int]  # client listeners' descriptors, in the config's order
    admin: socket.socket | None
    metrics: socket.socket | None
    token: str | None
    generated: bool


class Host(Protocol):
    """What a restart uses of the process's parts (``app.Runtime``)."""

    state: ServerState
    drainer: Drainer
    monitors: Monitors
    config_path: str | None

    def handed(self) -> Handed: ...

    def cluster_instance(self) -> str | None:
        """Cluster mode: this instance's id in etcd (the new code keeps it)."""
        ...

    async def stop_accepting(self) -> None: ...

    async def accept_again(self) -> None: ...

    def done(self, then_exec: list[str] | None, successor: int) -> None:
        """The sessions are handed on to ``successor``: stop without closing them, then
        ``exec`` that; a signal meanwhile is the successor's."""
        ...


def keeper_command(read_fd: int, serving: int) -> list[str]:
    return python_module("balancer.keeper", "--pipe", str(read_fd), "--serving", str(serving))


@dataclass
class Outcome:
    moved: int = 0
    sent_away: int = 0  # TLS client legs closed with 1012, their sessions moved detached
    not_moved: Counter[str] = field(default_factory=Counter)
    pauses: list[float] = field(default_factory=list)


class Restarter:
    """The giver's side (module docstring): ``restart()`` is ``POST /restart``, SIGUSR2 and
    ``wslb ctl restart``."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.running = False
        self.taker: Any = None  # the last new process started (a Popen: kept, not collected)

    async def restart(self, socket_path: str | None = None) -> dict[str, Any]:
        """Restart this process; ``socket_path``: a serving process of ``workers: N``, whose
        supervisor checked the new code and starts it (``multi.ServingProcess.replace``) to
        connect there."""
        arriving = self.host.state.arriving
        if arriving is not None:
            # This code is still taking over from the last restart (the old code no longer
            # answers): this restart follows once the last session is here.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arriving.wait(), MOVE_TIMEOUT + STEP_TIMEOUT)
        if self.running or self.host.state.arriving is not None:
            raise RestartError("busy", "a restart is running already")
        if self.host.config_path is None:
            raise RestartError("no_config", "a restart rereads the config file: none was given")
        self.running = True
        st = self.host.state
        st.emit("restart", phase="started", pid=os.getpid())
        t0 = time.monotonic()
        try:
            if socket_path is None:
                answer = await self._restart(t0)
            else:
                answer = await self._give_at(socket_path, t0)
        except RestartError as exc:
            st.stats.restarts[exc.reason] += 1
            st.emit("restart", phase="failed", reason=exc.reason, error=exc.detail)
            log.error("restart failed (%s), this code serves on: %s", exc.reason, exc.detail)
            raise
        finally:
            self.running = False
        st.stats.restarts["ok"] += 1
        st.emit("restart", phase="finished", **{k: v for k, v in answer.items() if k != "ok"})
        return answer

    async def _restart(self, t0: float) -> dict[str, Any]:
        host = self.host
        assert host.config_path is not None
        await check_new_code(host.config_path)
        run_dir = tempfile.mkdtemp(prefix="wslb-restart-", dir=_shm())
        path = os.path.join(run_dir, "take.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        keeper_r: int | None = None
        proc = None
        try:
            lsock.bind(path)
            lsock.listen(1)
            lsock.setblocking(False)
            env = child_env()
            pass_fds: tuple[int, ...] = ()
            keeper_w = os.environ.get(KEEPER_ENV)
            if keeper_w is None:  # the process a supervisor tracks: it becomes the keeper
                keeper_r, w = os.pipe()
                env[KEEPER_ENV] = str(w)
                env[KEEPER_PID_ENV] = str(os.getpid())
                pass_fds = (w,)
            else:
                pass_fds = (int(keeper_w),)
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
            cmd = python_module(
                "balancer", "--config", host.config_path, "--log-level", level, "--take-over", path
            )  # fmt: skip
            proc = self.taker = _spawn(cmd, env, pass_fds)
            if keeper_r is not None:
                os.close(pass_fds[0])
            conn = await _accept_taker(lsock, proc)
            try:
                answer = await self._give(conn, proc.pid, t0)
            finally:
                conn.close()
        except BaseException:
            if keeper_r is not None:
                os.close(keeper_r)
            raise
        finally:
            lsock.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        then = None
        if keeper_r is not None:
            os.set_inheritable(keeper_r, True)
            then = keeper_command(keeper_r, proc.pid)
        host.done(then, proc.pid)
        return answer

    async def _give_at(self, path: str, t0: float) -> dict[str, Any]:
        """The supervisor's restart of this serving process: the taker it starts connects to
        ``path``; its pid comes in the hello."""
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            lsock.bind(path)
            lsock.listen(1)
            lsock.setblocking(False)
            loop = asyncio.get_running_loop()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(lsock), TAKER_TIMEOUT)
            except TimeoutError:
                raise RestartError("start", "the new code did not connect") from None
            conn.setblocking(False)
            try:
                answer = await self._give(conn, 0, t0)
            finally:
                conn.close()
        finally:
            lsock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.host.done(None, int(answer["new"]["pid"]))
        return answer

    async def _give(self, conn: socket.socket, taker_pid: int, t0: float) -> dict[str, Any]:
        host, st = self.host, self.host.state
        loop = st.loop
        hello = json.loads(await _step(read_line(loop, conn, _MAX_LINE), "hello"))
        taker_pid = taker_pid or int(hello["pid"])
        log.info(
            "restart: new code %s (pid %d) is ready; finishing migrations and failovers",
            hello.get("version"),
            taker_pid,
        )
        drains = host.drainer.suspend()
        try:
            await _settle(st)
            handed = host.handed()
            fds = list(handed.listeners)
            for extra in (handed.admin, handed.metrics):
                if extra is not None:
                    fds.append(extra.fileno())
            body = {
                "listen": len(handed.listeners),
                "admin": handed.admin is not None,
                "metrics": handed.metrics is not None,
                "token": handed.token,
                "generated": handed.generated,
                "backends": _backend_states(st),
                "drains": drains,
                "spawned": host.monitors.spawned(),
                "cluster_instance": host.cluster_instance(),
                "from": {"pid": os.getpid(), "version": version(), "started": started_iso()},
            }
            await _send(conn, b"L", body, fds)
            ack = await _step(loop.sock_recv(conn, 1), "listeners")
            if ack != b"k":
                raise RestartError("taker", "the new code could not take the listeners")
        except BaseException:
            host.drainer.resume()
            raise
        await host.stop_accepting()
        try:
            outcome = await self._sessions(conn)
            await _requests_done(st)
            await _send(conn, b"E", {}, [])
            summary = json.loads(await _step(read_line(loop, conn, _MAX_LINE), "end"))
        except (OSError, ValueError, TimeoutError, RestartError) as exc:
            # The taker failed with the listeners: listen again, keep what was not handed on
            # (what it adopted goes with it: it is stopped).
            with contextlib.suppress(ProcessLookupError):
                os.kill(taker_pid, signal.SIGTERM)
            await host.accept_again()
            host.drainer.resume()
            detail = exc.detail if isinstance(exc, RestartError) else repr(exc)
            raise RestartError("taker", f"the new code failed mid-restart: {detail}") from None
        pauses = sorted(outcome.pauses)
        for reason, n in outcome.not_moved.items():
            st.stats.restart_sessions[reason] += n
        st.stats.restart_sessions["moved"] += outcome.moved
        return {
            "ok": True,
            "old": {"pid": os.getpid(), "version": version(), "started": started_iso()},
            "new": {
                "pid": taker_pid,
                "version": hello.get("version"),
                "started": hello.get("started"),
            },
            "sessions": {
                "moved": outcome.moved,
                "resume_asked": outcome.sent_away,
                "not_moved": dict(outcome.not_moved),
                "adopted": summary.get("adopted"),
            },
            "pause_ms": {
                "p50": _pct(pauses, 0.50),
                "p99": _pct(pauses, 0.99),
                "max": round(pauses[-1] * 1e3, 3) if pauses else None,
            },
            "seconds": round(time.monotonic() - t0, 3),
            "unchanged": UNCHANGED,
        }

    async def _sessions(self, conn: socket.socket) -> Outcome:
        """Rule 5 until no session is left here, or ``MOVE_TIMEOUT``."""
        st = self.host.state
        loop = st.loop
        out = Outcome()
        start = loop.time()
        deadline = start + MOVE_TIMEOUT
        while True:
            # A connection accepted here just before the taker took the listeners becomes a
            # session a little later (its handshake, its worker's connect): rounds go on for
            # ``LATE`` after the listeners were handed.
            waiting = loop.time() - start < LATE
            for s in list(st.sessions):
                if s.closing or s.finished:
                    continue
                if s.mode in _BUSY:
                    waiting = True
                    continue
                why = _unmovable(s)
                if why == "tls_client" and s.core.window is not None:
                    # Resumable: detached with a 1012 to its client, then moved without it.
                    if not s.ct.is_closing() and s.send_away(
                        CloseCode.SERVICE_RESTART, "wslb restarting: resume"
                    ):
                        out.sent_away += 1
                        await _drained(s.ct)
                        s.drop_client()
                    waiting = True
                    continue
                if why is not None:
                    s.close(CloseCode.SERVICE_RESTART, "wslb restarting: reconnect to resume")
                    out.not_moved[why] += 1
                    continue
                if not await _flushed(s):
                    if loop.time() < deadline:
                        waiting = True
                        continue
                    s.close(CloseCode.SERVICE_RESTART, "wslb restarting: reconnect to resume")
                    out.not_moved["not_flushed"] += 1
                    continue
                try:
                    await self._move(conn, s, out)
                except (OSError, ValueError, TimeoutError, RestartError):
                    raise  # the taker is gone: the caller listens again
                except Exception:  # this session only: the others still move
                    log.exception("restart: session %s", s.sid)
                    out.not_moved["error"] += 1
            if not waiting or loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        for s in list(st.sessions):
            if not s.closing and not s.finished:
                s.close(CloseCode.SERVICE_RESTART, "wslb restarting: reconnect to resume")
                out.not_moved["busy_at_timeout"] += 1
        return out

    async def _move(self, conn: socket.socket, s: Session, out: Outcome) -> None:
        st = self.host.state
        t = time.perf_counter()
        data = s.snapshot()
        st.wheel.cancel(s)  # its timer goes with it; no ping from here meanwhile
        detached = bool(s.core.detached_at)
        fds = [plain_socket(s.wt).fileno()]
        if not detached:
            fds.insert(0, plain_socket(s.ct).fileno())
        await _send(conn, b"S", data, fds)
        ack = await _step(st.loop.sock_recv(conn, 1), f"session {s.sid}")
        if ack == b"K":
            s.handed_off()
            out.moved += 1
            out.pauses.append(time.perf_counter() - t)
            return
        if not ack:
            raise RestartError("taker", "the new code closed the connection")
        # The taker could not adopt it: it stays here, read again.
        s.resume_reading()
        if data["timer"] is not None:
            st.wheel.schedule(s, data["timer"] or 0.001)
        out.not_moved["adopt_failed"] += 1


UNCHANGED = (
    "the keeper process (the pid a supervisor tracks) keeps its own small code",
    "TLS client legs get 1012 and resume (their crypto state cannot move): their sessions "
    "move detached, so a client with its resume token loses nothing",
    "sessions with a TLS worker leg (upstream_tls) are closed with 1012 likewise",
    "counters and histograms of /metrics start again in the new code",
    "the admin API's generated token and the listen addresses stay as they were",
)


def _unmovable(s: Session) -> str | None:
    if plain_socket(s.wt) is None:
        return "tls_worker"
    if not s.core.detached_at and plain_socket(s.ct) is None:
        return "tls_client"
    return None


async def _flushed(s: Session) -> bool:
    """Both legs' write buffers in the kernel (the socket's queue moves with it), after the
    session stopped reading; False if one stays full for ``FLUSH_TIMEOUT``."""
    s.quiesce()
    legs = [s.wt] if s.core.detached_at else [s.ct, s.wt]
    if all(t.get_write_buffer_size() == 0 for t in legs):
        return True
    loop = asyncio.get_running_loop()
    until = loop.time() + FLUSH_TIMEOUT
    while loop.time() < until:
        await asyncio.sleep(0.001)
        if s.closing or s.finished:
            return False
        if all(t.get_write_buffer_size() == 0 for t in legs):
            return True
    s.resume_reading()
    return False


async def _drained(t: Any) -> None:
    """Until ``t``'s write buffer is in the kernel (bounded by ``FLUSH_TIMEOUT``)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + FLUSH_TIMEOUT
    while t.get_write_buffer_size() and loop.time() < until:  # noqa: ASYNC110
        await asyncio.sleep(0.001)


async def _settle(st: ServerState) -> None:
    """Rule 3: until no session is mid-migration or mid-failover (bounded)."""
    loop = st.loop
    until = loop.time() + FINISH_TIMEOUT
    while any(s.mode in _BUSY for s in st.sessions) and loop.time() < until:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def _requests_done(st: ServerState) -> None:
    loop = st.loop
    if st.lanes is not None:  # back at their next boundary: the event loop ends them there
        st.lanes.stop()
        await st.lanes.wait_empty(st.timeouts.shutdown_grace)
    until = loop.time() + st.timeouts.shutdown_grace
    while st.requests and loop.time() < until:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    st.keepalive.close()


def _backend_states(st: ServerState) -> dict[str, dict[str, Any]]:
    """Each backend as the new code needs it: its health and state, and how to add it (one
    added with ``POST /backends`` is not in the config file)."""
    return {
        b.id: {
            "healthy": b.healthy,
            "reason": b.health_reason,
            "admin": str(b.admin_state),
            "pool": pool.name,
            "spec": backend_body(b),
        }
        for pool, b in st.backends()
    }


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _spawn(cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = (), **kw: Any) -> Any:
    """``subprocess.Popen``, not the loop's spawn: uvloop leaves every inheritable descriptor
    of the parent open in the child, so each restart's new process held a few more (its
    stdio's copies) than the one before; Popen closes all but ``pass_fds``."""
    return subprocess.Popen(cmd, env=env, pass_fds=pass_fds, close_fds=True, **kw)


async def check_new_code(config_path: str) -> None:
    """Rule 1: ``wslb check --deep`` with the code installed now; ``RestartError`` with its
    own words when it fails."""
    proc = _spawn(
        python_module("balancer", "check", "--deep", config_path),
        child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    loop = asyncio.get_running_loop()
    try:
        out, _ = await loop.run_in_executor(None, proc.communicate, None, CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        await loop.run_in_executor(None, proc.communicate)
        raise RestartError(
            "check", f"the new code's check took over {CHECK_TIMEOUT:.0f}s"
        ) from None
    if proc.returncode != 0:
        text = out.decode(errors="replace").strip()
        reason = "config" if proc.returncode == 2 else "code"
        raise RestartError(reason, text[-4000:] or f"the check exited with {proc.returncode}")


async def _exited(proc: Any) -> None:
    while proc.poll() is None:  # noqa: ASYNC110 (a Popen: no loop watcher)
        await asyncio.sleep(0.05)


async def _accept_taker(lsock: socket.socket, proc: Any) -> socket.socket:
    loop = asyncio.get_running_loop()
    accept = loop.create_task(loop.sock_accept(lsock))
    exited = loop.create_task(_exited(proc))
    done, _ = await asyncio.wait(
        {accept, exited}, timeout=TAKER_TIMEOUT, return_when="FIRST_COMPLETED"
    )
    if accept in done:
        exited.cancel()
        conn, _ = accept.result()
        conn.setblocking(False)
        return conn
    accept.cancel()
    if exited in done:
        raise RestartError(
            "start",
            f"the new code exited with {proc.returncode} before taking over (its log says why)",
        )
    exited.cancel()
    proc.kill()
    raise RestartError("start", f"the new code did not connect within {TAKER_TIMEOUT:.0f}s")


async def _step(aw: Any, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, STEP_TIMEOUT)
    except (OSError, ValueError) as exc:
        raise RestartError("taker", f"{what}: {exc!r}") from None
    except TimeoutError:
        raise RestartError("taker", f"{what}: no answer in {STEP_TIMEOUT:.0f}s") from None


async def _send(conn: socket.socket, kind: bytes, body: Any, fds: list[int]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send_head(conn, kind + LEN.pack(len(data)), fds)
    await asyncio.get_running_loop().sock_sendall(conn, data)


# -- the taker's side ------------------------------------------------------------------------


class TakeOver:
    """The taker's side: ``listeners()`` before the process starts serving, ``sessions()``
    once it does (module docstring, rules 2, 4 and 5)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: socket.socket | None = None
        self.body: dict[str, Any] = {}  # the old code's states (rule 4)
        self.adopted = 0
        self.failed = 0

    async def listeners(self) -> tuple[dict[str, Any], list[socket.socket]]:
        """Connect, say hello, and receive the listeners and the process's states."""
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        await loop.sock_connect(conn, self.path)
        self.conn = conn
        hello = {"pid": os.getpid(), "version": version(), "started": started_iso()}
        await loop.sock_sendall(conn, json.dumps(hello).encode() + b"\n")
        kind, body, fds = await self._recv(16)
        if kind != b"L":
            raise ValueError(f"expected the listeners, got {kind!r}")
        self.body = body
        return body, [socket.socket(fileno=fd) for fd in fds]

    async def listening(self) -> None:
        assert self.conn is not None
        await asyncio.get_running_loop().sock_sendall(self.conn, b"k")

    async def sessions(self, st: ServerState, on_end: Callable[[], None]) -> None:
        """Adopt each session the giver passes, until its end; then answer and ``on_end``."""
        loop = st.loop
        conn = self.conn
        assert conn is not None
        try:
            while True:
                try:
                    kind, body, fds = await self._recv(2)
                except Truncated as exc:  # its body still follows: read it, refuse it
                    (size,) = LEN.unpack(exc.data[1 : 1 + LEN.size])
                    await read_exact(loop, conn, size)
                    log.error("restart: a session could not be adopted: %s", exc)
                    self.failed += 1
                    await loop.sock_sendall(conn, b"F")
                    continue
                if kind == b"E":
                    break
                t = time.perf_counter()
                try:
                    await self._adopt(st, body, fds)
                except Exception:
                    log.exception("restart: could not adopt session %s", body.get("sid"))
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                    self.failed += 1
                    await loop.sock_sendall(conn, b"F")
                    continue
                self.adopted += 1
                st.stats.restart_pause.observe(time.perf_counter() - t)
                await loop.sock_sendall(conn, b"K")
            summary = {"adopted": self.adopted, "failed": self.failed}
            await loop.sock_sendall(conn, json.dumps(summary).encode() + b"\n")
        finally:
            conn.close()
            if st.arriving is not None:  # resumes waiting for a session look again
                st.arriving.set()
                st.arriving = None
        st.stats.restarts["taken"] += 1
        log.info(
            "restart: took over %s (%d could not be adopted)",
            count(self.adopted, "session"),
            self.failed,
        )
        on_end()

    async def _adopt(self, st: ServerState, data: dict[str, Any], fds: list[int]) -> None:
        pool = st.pool(data["pool"])
        if pool is None:
            raise ValueError(f"no pool {data['pool']!r} in the new config")
        detached = bool(data["core"].get("detached_at"))
        if len(fds) != (1 if detached else 2):
            raise ValueError(f"{len(fds)} sockets for a session")
        socks = [socket.socket(fileno=fd) for fd in fds]
        transports = []
        for sock in socks:
            sock.setblocking(False)
            t, _ = await st.loop.connect_accepted_socket(Parked, sock)
            transports.append(t)
        wt = transports[-1]
        ct: asyncio.Transport = Gone() if detached else transports[0]
        if not detached:
            st.connection_opened(data["peer"])
        Session.adopt(st, st.settings(pool), pool, data, ct, wt)

    async def _recv(self, maxfds: int) -> tuple[bytes, dict[str, Any], list[int]]:
        assert self.conn is not None
        loop = asyncio.get_running_loop()
        head, fds = await recv_head(loop, self.conn, 1 + LEN.size, maxfds)
        (size,) = LEN.unpack(head[1 : 1 + LEN.size])
        body = json.loads(await read_exact(loop, self.conn, size))
        return head[:1], body, fds


def announce(serving: int) -> None:
    """Tell the keeper (if any) which process serves now."""
    fd = os.environ.get(KEEPER_ENV)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), f"serving {serving}\n".encode())


def exec_now(argv: list[str]) -> None:
    """Become ``argv`` (the keeper), keeping this pid; only the descriptors marked inheritable
    (the keeper's pipe) survive."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked across the exec (the mask is kept): the keeper takes them once its handlers
    # are in place, so a signal in between is passed on, not fatal to the pid that stays.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    os.execve(argv[0], argv, child_env())


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
