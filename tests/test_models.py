"""Route by model: pools may match the ``?model=`` query parameter OpenAI Realtime clients send.

The reference workers' chat protocol (any path but ``/v1/realtime``) says which worker answered
in its ``hello``; tests/test_realtime.py does the same with the openai SDK.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from balancer.router import requested_model
from tests.procs import Worker, Wslb, running


def test_requested_model() -> None:
    assert requested_model("model=gemma-3-270m&session=a") == "gemma-3-270m"
    assert requested_model("session=a") is None
    assert requested_model("model=") is None
    assert requested_model("model=a%2Fb") == "a/b"


async def test_two_models_behind_one_wslb(tmp_path: Path) -> None:
    g, q = Worker("gemma-1").start(), Worker("qwen-1").start()
    cfg = {
        "pools": [
            {
                "name": "gemma",
                "match": {"path_prefix": "/v1", "model": "gemma"},
                "backends": [{"id": g.id, "url": f"ws://127.0.0.1:{g.port}"}],
            },
            {
                "name": "qwen",
                "match": {"path_prefix": "/v1", "model": "qwen"},
                "backends": [{"id": q.id, "url": f"ws://127.0.0.1:{q.port}"}],
            },
        ]
    }
    lb = Wslb(cfg, tmp_path).start()
    with running(g, q, lb):
        for model, worker in (("gemma", g.id), ("qwen", q.id), ("qwen", q.id)):
            async with connect(f"{lb.url}/v1/chat?model={model}&session=s-{model}") as ws:
                assert json.loads(await ws.recv())["worker"] == worker
        with pytest.raises(InvalidStatus) as refused:
            await connect(f"{lb.url}/v1/chat?model=llama")
        response = refused.value.response
        assert response.status_code == 404
        assert response.headers["Content-Type"] == "application/json"
        assert json.loads(response.body) == {
            "error": "model 'llama' is not served",
            "models": ["gemma", "qwen"],
        }
        with pytest.raises(InvalidStatus) as no_model:
            await connect(f"{lb.url}/v1/chat")
        assert no_model.value.response.status_code == 404
        assert json.loads(no_model.value.response.body) == {
            "error": "no ?model= given",
            "models": ["gemma", "qwen"],
        }
