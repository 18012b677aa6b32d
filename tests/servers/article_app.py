"""The FastAPI chat endpoint of the article wslb started from, as its readers would deploy it.

One WebSocket route, ``/ws/chat``: each text message gets the canned answer streamed back one
word per message (``{"type": "token", "text": WORD}``), then ``{"type": "done", "pid": PID}``;
the pid tells tests which server answered. No health route, no ``/metrics``, no handoff API.
Served by uvicorn's own CLI, the real server::

    python -m uvicorn tests.servers.article_app:app --port 9001
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from tests.servers import DELAY, WORDS

app = FastAPI()


@app.websocket("/ws/chat")
async def chat(websocket: WebSocket) -> None:
    """Stream an answer for every prompt until the client goes away."""
    await websocket.accept()
    try:
        while True:
            await websocket.receive_text()
            for word in WORDS:
                await websocket.send_json({"type": "token", "text": word})
                await asyncio.sleep(DELAY)
            await websocket.send_json({"type": "done", "pid": os.getpid()})
    except WebSocketDisconnect:
        pass
