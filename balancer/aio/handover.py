"""``workers: N``: a live session moves to the serving process its client reconnected to.

The kernel spreads connections over the serving processes (SO_REUSEPORT), so a client that
reconnects to resume (Rule 8 of ``balancer/session_core.py``) lands on any of them. The one it
lands on asks the others, over a Unix socket each serves in the run directory, for the session
(its key and token); the one that has it describes it as data (``Session.snapshot``) and passes
the worker leg's socket with it (``SCM_RIGHTS``); the asking process adopts it
(``Session.adopt``) and resumes it on the client's new connection. Moving the session, not the
client's connection, keeps a TLS client working: its new TLS connection stays where it was made.

The exchange, one connection per request::

    asker -> owner   {"sid": KEY, "token": T}\\n
    owner -> asker   b"N"                              (not here, or it cannot move)
                     b"Y" + 8-byte length (the worker's socket attached), then the JSON
    asker -> owner   b"K"                              (adopted: the owner lets go)

A session whose worker leg is TLS (``upstream_tls``) cannot move (its crypto state stays in the
owner's memory): the owner answers "N" and the client gets 409, as it would from another
instance in cluster mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from typing import Any

from balancer.aio.fdpass import LEN, read_exact, read_line, recv_head, send_head
from balancer.aio.offload import plain_socket
from balancer.aio.session import Mode, Parked, Session
from balancer.aio.state import ServerState
from balancer.resume import same_token

__all__ = ["Handover", "handover_path"]

log = logging.getLogger("wslb.multi")

TIMEOUT = 5.0
_LEN = LEN
_MAX_REQUEST = 4096


def handover_path(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"hand-{index}.sock")


class Handover:
    """This serving process's end of the exchange (module docstring)."""

    def __init__(self, state: ServerState, run_dir: str, index: int, processes: int) -> None:
        self.state = state
        self.path = handover_path(run_dir, index)
        self.peers = [handover_path(run_dir, j) for j in range(processes) if j != index]
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._served: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        sock.setblocking(False)
        self._sock = sock
        self._task = self.state.loop.create_task(self._accept())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._served):
            t.cancel()
        if self._sock is not None:
            # Unlinked only while the path is still this socket's: after a restart it is the
            # new code's (aio/restart.py), bound again at the same path.
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == os.fstat(self._sock.fileno()).st_ino:
                    os.unlink(self.path)
            self._sock.close()

    # -- the owner's side ------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = self.state.loop
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._served.add(task)
            task.add_done_callback(self._served.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = self.state.loop
        try:
            line = await asyncio.wait_for(read_line(loop, conn, _MAX_REQUEST), TIMEOUT)
            ask = json.loads(line)
            s = self._movable(str(ask["sid"]), str(ask["token"]))
            if s is None:
                await loop.sock_sendall(conn, b"N")
                return
            wsock = plain_socket(s.wt)
            assert wsock is not None
            data = json.dumps(s.snapshot()).encode()
            await send_head(conn, b"Y" + _LEN.pack(len(data)), [wsock.fileno()])
            await loop.sock_sendall(conn, data)
            ack = await asyncio.wait_for(loop.sock_recv(conn, 1), TIMEOUT)
            if ack == b"K":
                s.handed_off()
                log.info("session %s handed to another serving process", s.sid)
            else:  # the asker could not adopt it: it stays here, read again
                s.resume_reading()
        except (OSError, ValueError, KeyError, TimeoutError) as exc:
            log.info("session handover request failed: %r", exc)
        finally:
            conn.close()

    def _movable(self, sid: str, token: str) -> Session | None:
        """The session with ``sid`` if the token is its own and it can move now."""
        s = self.state.find_resumable(token)  # by token: a newer session may have the key
        if s is None or s.sid != sid or not same_token(s.resume_token, token) or s.closing:
            return None
        if plain_socket(s.wt) is None:  # a TLS worker leg: its crypto state cannot move
            return None
        if not s.core.detached_at:
            if s.mode is not Mode.RELAYING and s.mode is not Mode.OFFLOADED:
                return None
            s.take_over()  # half-open here: the client is back elsewhere
        if s.mode is not Mode.DETACHED:
            return None
        return s

    # -- the asker's side ------------------------------------------------------------------

    async def fetch(self, sid: str, token: str, ct: asyncio.Transport) -> Session | None:
        """The session ``sid`` from whichever serving process has it, adopted here around the
        client's new connection ``ct`` (still detached: the caller resumes it)."""
        for path in self.peers:
            try:
                got = await asyncio.wait_for(self._ask(path, sid, token), TIMEOUT)
            except (OSError, ValueError, TimeoutError) as exc:
                log.debug("handover from %s: %r", path, exc)
                continue
            if got is None:
                continue
            data, wsock, conn = got
            try:
                s = await self._adopt(data, wsock, ct)
            except Exception:
                log.exception("session %s: could not adopt it from another process", sid)
                with contextlib.suppress(OSError):
                    await self.state.loop.sock_sendall(conn, b"F")
                conn.close()
                wsock.close()
                return None
            with contextlib.suppress(OSError):
                await self.state.loop.sock_sendall(conn, b"K")
            conn.close()
            return s
        return None

    async def _ask(
        self, path: str, sid: str, token: str
    ) -> tuple[dict[str, Any], socket.socket, socket.socket] | None:
        loop = self.state.loop
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            await loop.sock_connect(conn, path)
            await loop.sock_sendall(conn, json.dumps({"sid": sid, "token": token}).encode() + b"\n")
            head, fds = await recv_head(loop, conn, 1 + _LEN.size)
            if head[:1] != b"Y" or not fds:
                for fd in fds:
                    os.close(fd)
                conn.close()
                return None
            (size,) = _LEN.unpack(head[1 : 1 + _LEN.size])
            body = await read_exact(loop, conn, size)
            return json.loads(body), socket.socket(fileno=fds[0]), conn
        except BaseException:
            conn.close()
            raise

    async def _adopt(
        self, data: dict[str, Any], wsock: socket.socket, ct: asyncio.Transport
    ) -> Session:
        st = self.state
        pool = st.pool(data["pool"])
        if pool is None:
            raise ValueError(f"no pool {data['pool']!r} here")
        wsock.setblocking(False)
        wt, _ = await st.loop.connect_accepted_socket(Parked, wsock)
        s = Session.adopt(st, st.settings(pool), pool, data, ct, wt)
        log.info("session %s adopted from another serving process", s.sid)
        return s
