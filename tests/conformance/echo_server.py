"""A conformant RFC 6455 echo server, the worker behind wslb in the Autobahn runs.

The ``websockets`` library does the protocol work, so any case that ends worse through wslb than
against this server directly points at wslb. Extensions are off (wslb never negotiates them), the
message limit covers Autobahn's case 9 sizes, and the server never pings, so the only frames on
the wire are the fuzzer's and their echoes. Otherwise it is a stock server: no health route, no
``/metrics``, no request hook, so wslb runs with its defaults in front of it, as in front of any
server written without wslb in mind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import websockets.asyncio.messages
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

MAX_SIZE = 2**25
# Cases 9.3 and 9.4 send 4 MiB in 64-byte fragments (65536 of them); websockets fails a message of
# more than WEBSOCKETS_MAX_FRAGMENTS (4096, read at import time) with 1009, so raise it here.
MAX_FRAGMENTS = 2**17
websockets.asyncio.messages.MAX_FRAGMENTS = max(
    websockets.asyncio.messages.MAX_FRAGMENTS, MAX_FRAGMENTS
)


async def echo(ws: ServerConnection) -> None:
    """Send every message back as it came (text as text, binary as binary)."""
    with contextlib.suppress(ConnectionClosed):
        async for message in ws:
            await ws.send(message)


async def main(host: str, port: int) -> None:
    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set_result, None)
    async with serve(
        echo,
        host,
        port,
        compression=None,
        max_size=MAX_SIZE,
        ping_interval=None,
        close_timeout=2,
    ):
        await stop


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # The fuzzer's protocol violations are expected; the library's tracebacks for them are noise.
    logging.basicConfig(level=logging.CRITICAL)
    asyncio.run(main(args.host, args.port))


if __name__ == "__main__":
    cli()
