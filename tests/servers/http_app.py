"""A stock FastAPI app with plain HTTP routes beside a WebSocket route, as a user would already
have it before putting wslb in front (no health route, no ``/metrics``, no handoff API).
Served by uvicorn's own CLI::

    python -m uvicorn tests.servers.http_app:app --port 9001

Routes: ``GET /json`` (the request as the app saw it: headers, query, pid), ``GET /sse`` (server-
sent events ``gap`` seconds apart, each with the time it was sent), ``POST /echo`` (the body
back), ``GET /flood`` (SSE as fast as the client takes it; ``GET /progress`` says how much was
written), ``GET /sleep`` (an answer after ``s`` seconds), ``GET /die`` (part of a chunked answer,
``parts`` chunks, then the process is killed; ``?early=1``: killed before any answer) and the
WebSocket ``/ws/echo``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse

app = FastAPI()
written = {"bytes": 0, "events": 0}  # what /flood has handed to the server so far


@app.get("/json")
async def json_route(request: Request) -> dict[str, object]:
    return {
        "ok": True,
        "pid": os.getpid(),
        "path": request.url.path,
        "query": request.url.query,
        "headers": dict(request.headers),
        "client": request.client.host if request.client else None,
    }


@app.get("/sse")
async def sse(n: int = 3, gap: float = 1.0) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for i in range(n):
            if i:
                await asyncio.sleep(gap)
            yield f"data: {i} {time.time():.6f}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/echo")
async def echo(request: Request) -> Response:
    # Read whole: Starlette's StreamingResponse listens for a disconnect on the same receive
    # channel, and would eat body chunks of a request it streamed back as they came.
    return Response(await request.body(), media_type="application/octet-stream")


@app.get("/flood")
async def flood(n: int = 100_000, size: int = 1024) -> StreamingResponse:
    event = b"data: " + b"x" * (size - 8) + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        for _ in range(n):
            written["bytes"] += len(event)
            written["events"] += 1
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


@app.get("/progress")
async def progress() -> dict[str, int]:
    return written


@app.get("/sleep")
async def sleep(s: float = 1.0) -> dict[str, float]:
    await asyncio.sleep(s)
    return {"slept": s}


@app.get("/die", response_model=None)
async def die(early: int = 0, parts: int = 1) -> StreamingResponse:
    if early:
        os.kill(os.getpid(), signal.SIGKILL)

    async def body() -> AsyncIterator[bytes]:
        yield b"part one;"
        for i in range(1, parts):
            await asyncio.sleep(0.01)
            yield f"part {i + 1};".encode()
        await asyncio.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
        yield b"never"

    return StreamingResponse(body(), media_type="text/plain")


@app.websocket("/ws/echo")
async def ws_echo(websocket: WebSocket) -> None:
    await websocket.accept()
    try:
        while True:
            await websocket.send_text(f"echo:{await websocket.receive_text()}")
    except WebSocketDisconnect:
        pass
