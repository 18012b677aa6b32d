"""A stock ``websockets`` server that streams: a text message ``N`` (an integer) gets N
messages back, ``0`` .. ``N-1``, at ``--rate`` per second, then ``end``. Nothing of wslb in it:
a server a tier must keep whole only while the instance holding its session lives::

    python -m tests.servers.websockets_counter --port 9001 --rate 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed


def handler(rate: float) -> object:
    async def count(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                try:
                    n = int(message)
                except ValueError:
                    await ws.send("error: send a number")
                    continue
                for i in range(n):
                    await ws.send(str(i))
                    await asyncio.sleep(1 / rate)
                await ws.send("end")

    return count


async def main(host: str, port: int, rate: float) -> None:
    async with serve(handler(rate), host, port) as server:  # type: ignore[arg-type]
        await server.serve_forever()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=50.0)
    args = parser.parse_args()
    asyncio.run(main(args.host, args.port, args.rate))


if __name__ == "__main__":
    cli()
