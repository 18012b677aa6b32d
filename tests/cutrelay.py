"""A TCP relay a test controls: the network between a client and wslb, cut on demand.

A client library's resume is only as good as what it does when the network fails the way
networks do. ``cut`` ends every connection through the relay at once, in one of two ways:

- ``rst``: both sides get a TCP reset (``SO_LINGER`` 0), as when a NAT or a load balancer
  forgets the flow; the client sees an error at once.
- ``silent``: the relay stops forwarding in both directions and keeps both sockets open, never
  closing them (a phone changing networks, a dead Wi-Fi): nothing tells the client; only a
  liveness check finds it. The sockets are reset when the relay closes.

For ``down`` seconds after a cut, a new connection is reset as soon as it is accepted (the
network is still down); after that, connections go through again. The relay's state is a
value (``down_until``) and the connections it has; no thread, one event loop.

In a test (same loop)::

    relay = CutRelay("127.0.0.1", wslb_port)
    await relay.start()            # relay.port
    relay.cut("rst", down=1.5)
    await relay.close()

As a process, for a client in another language (Node)::

    python -m tests.cutrelay --to 127.0.0.1:8080 --listen 9000 --control 9001
    curl -X POST 'http://127.0.0.1:9001/cut?how=silent&down=2'   # -> "cut 1"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
from typing import Literal

from aiohttp import web

__all__ = ["CutRelay"]

How = Literal["rst", "silent"]
_LINGER_RST = struct.pack("ii", 1, 0)
_CHUNK = 65536


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, whatever is unsent."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


class _Conn:
    """One client connection and its leg to the target, with the two pumps between them."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.pumps: list[asyncio.Task[None]] = []
        self.ended = 0  # pumps that reached their end (EOF or error)

    def stop_pumps(self) -> None:
        for t in self.pumps:
            t.cancel()

    def reset(self) -> None:
        self.stop_pumps()
        _reset(self.client)
        _reset(self.upstream)


class CutRelay:
    """Relays ``127.0.0.1:port`` to ``host:target_port`` until told to cut."""

    def __init__(self, host: str, target_port: int, port: int = 0) -> None:
        self.host = host
        self.target_port = target_port
        self.port = port
        self.down_until = 0.0
        self.cuts = 0
        self._live: set[_Conn] = set()
        self._silent: list[_Conn] = []  # blackholed: held open until close()
        self._server: asyncio.Server | None = None

    @property
    def connections(self) -> int:
        """Connections relaying now (blackholed ones are not)."""
        return len(self._live)

    async def start(self) -> CutRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self, how: How = "rst", down: float = 0.0) -> int:
        """Cut every live connection (``how``); refuse new ones for ``down`` seconds. The
        number cut."""
        if how not in ("rst", "silent"):
            raise ValueError(f"how is 'rst' or 'silent', not {how!r}")
        loop = asyncio.get_running_loop()
        self.down_until = loop.time() + down
        live, self._live = self._live, set()
        for conn in live:
            if how == "rst":
                conn.reset()
            else:
                conn.stop_pumps()
                self._silent.append(conn)
        self.cuts += 1
        return len(live)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in [*self._live, *self._silent]:
            conn.reset()
        self._live.clear()
        self._silent.clear()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self.down_until:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            _reset(writer)
            return
        if loop.time() < self.down_until:  # cut while connecting
            _reset(up_writer)
            _reset(writer)
            return
        conn = _Conn(writer, up_writer)
        self._live.add(conn)
        conn.pumps = [
            loop.create_task(self._pump(conn, reader, up_writer)),
            loop.create_task(self._pump(conn, up_reader, writer)),
        ]

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        """One direction, until EOF (passed on as a half close) or an error (both reset)."""
        try:
            while data := await src.read(_CHUNK):
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:
            if conn in self._live:
                self._live.discard(conn)
                conn.reset()
            return
        conn.ended += 1
        if conn.ended == 2:  # both directions half closed: the connection is over
            self._live.discard(conn)
            conn.client.close()
            conn.upstream.close()


async def _serve(target: str, listen: int, control: int) -> None:
    host, _, port = target.rpartition(":")
    relay = await CutRelay(host, int(port), listen).start()

    async def cut(request: web.Request) -> web.Response:
        how = request.query.get("how", "rst")
        try:
            down = float(request.query.get("down", "0"))
            n = relay.cut(how, down)  # type: ignore[arg-type]
        except ValueError as e:
            return web.Response(status=400, text=f"{e}\n")
        return web.Response(text=f"cut {n}\n")

    async def state(_: web.Request) -> web.Response:
        return web.json_response({"connections": relay.connections, "cuts": relay.cuts})

    app = web.Application()
    app.router.add_post("/cut", cut)
    app.router.add_get("/", state)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control).start()
    print(f"relay 127.0.0.1:{relay.port} -> {target}, control 127.0.0.1:{control}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await relay.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--to", required=True, help="HOST:PORT to relay to")
    ap.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    ap.add_argument("--control", type=int, required=True, help="control port on 127.0.0.1")
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.to, args.listen, args.control))
    return 0


if __name__ == "__main__":
    sys.exit(main())
