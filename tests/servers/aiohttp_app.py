"""A plain aiohttp chat server (``web.WebSocketResponse``), written without wslb in mind.

``/ws/chat`` streams the canned answer one word per message for each text message, then
``{"type": "done", "pid": PID}``, like ``article_app``. No health route, no ``/metrics``::

    python -m tests.servers.aiohttp_app --port 9001
"""

from __future__ import annotations

import argparse
import asyncio
import os

from aiohttp import WSMsgType, web

from tests.servers import DELAY, WORDS


async def chat(request: web.Request) -> web.WebSocketResponse:
    """Stream an answer for every text message until the client closes."""
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    async for msg in ws:
        if msg.type != WSMsgType.TEXT:
            continue
        for word in WORDS:
            await ws.send_json({"type": "token", "text": word})
            await asyncio.sleep(DELAY)
        await ws.send_json({"type": "done", "pid": os.getpid()})
    return ws


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/ws/chat", chat)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
