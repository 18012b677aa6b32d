"""A plain aiohttp app that streams server-sent events for as long as it can write, and says
when its write failed: the referee of a client that stops reading (``tests/test_anon_load.py``).

``GET /stream?id=ID&after=K``: the first K requests of an ID get three events and the end (so a
kept-alive connection can go to a lane first); the next one streams 1 KiB events until a write
fails or the request is cancelled. With ``&paced=1`` it writes one event every ``PACE_S`` (as a
model streams tokens: each read of it ends between chunks, so wslb may hand it to its relay
thread) until ``GET /flood?id=ID``, then as fast as it can. ``GET /ended?id=ID``:
``{"bytes", "ended"}``, ``ended`` the wall time the stream's write failed (None while it goes
on)::

    python -m tests.servers.stall_app --port 9001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

from aiohttp import web

EVENT = b"data: " + b"x" * 1016 + b"\n\n"
PACE_S = 0.01  # between a paced stream's events
calls: Counter[str] = Counter()
streams: dict[str, dict[str, Any]] = {}
floods: dict[str, asyncio.Event] = {}


async def stream(request: web.Request) -> web.StreamResponse:
    sid = request.query["id"]
    calls[sid] += 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if calls[sid] <= int(request.query.get("after", "0")):
        for _ in range(3):
            await resp.write(EVENT)
        await resp.write_eof()
        return resp
    rec = streams[sid] = {"bytes": 0, "ended": None}
    flood = floods.setdefault(sid, asyncio.Event())
    if request.query.get("paced") != "1":
        flood.set()
    try:
        while not flood.is_set():
            await resp.write(EVENT)
            rec["bytes"] += len(EVENT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flood.wait(), PACE_S)
        while True:
            await resp.write(EVENT)
            rec["bytes"] += len(EVENT)
    except (ConnectionError, RuntimeError):
        return resp
    finally:
        rec["ended"] = time.time()


async def flood(request: web.Request) -> web.Response:
    floods.setdefault(request.query["id"], asyncio.Event()).set()
    return web.json_response({})


async def ended(request: web.Request) -> web.Response:
    rec = streams.get(request.query["id"], {"bytes": 0, "ended": None})
    return web.json_response(rec)


def app() -> web.Application:
    a = web.Application()
    a.router.add_get("/stream", stream)
    a.router.add_get("/flood", flood)
    a.router.add_get("/ended", ended)
    return a


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port))


async def serve(port: int) -> None:
    runner = web.AppRunner(app(), handle_signals=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
