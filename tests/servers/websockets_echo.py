"""A stock ``websockets`` echo server: the library's defaults, no ``process_request`` hook.

Plain HTTP requests (a health check, a metrics scrape) get whatever the library answers to a
non-upgrade request, as they would in front of any such server::

    python -m tests.servers.websockets_echo --port 9001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed


async def echo(ws: ServerConnection) -> None:
    """Send every message back as it came."""
    with contextlib.suppress(ConnectionClosed):
        async for message in ws:
            await ws.send(message)


async def main(host: str, port: int) -> None:
    async with serve(echo, host, port) as server:
        await server.serve_forever()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(main(args.host, args.port))


if __name__ == "__main__":
    cli()
