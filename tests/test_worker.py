"""The reference worker as a real process on loopback: HTTP, metrics and the chat protocol."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backends.gpu import open_gpu
from backends.model import ModelConfig, token_text
from backends.worker import METRIC_NAMES, READY_PREFIX, Worker, WorkerConfig
from tests.procs import WORKER_AUTH, WORKER_TOKEN
from tests.waits import until

ROOT = Path(__file__).resolve().parent.parent
PREFILL_MS = 0.01
WORKER_ARGS = (
    "--id",
    "wtest",
    "--tokens-per-s",
    "2000",
    "--prefill-ms-per-token",
    str(PREFILL_MS),
    "--subprotocols",
    "wslb.chat.v1",
    "--simulate-gpu",
)
TIMEOUT = 5.0


@dataclass
class WorkerProc:
    proc: subprocess.Popen[str]
    port: int
    log: IO[str]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(TIMEOUT)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.log.close()
        return code

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()


def start_worker(
    *args: str, module: str = "backends.worker", credential: bool = False
) -> WorkerProc:
    """Start a worker on a free loopback port (``--port 0``) and wait until it is healthy;
    ``credential``: with wslb's (``tests.procs.WORKER_TOKEN``), as a handoff test needs."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by WorkerProc.stop)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WSLB_WORKER_TOKEN", None)
    if credential:
        env["WSLB_WORKER_TOKEN"] = WORKER_TOKEN
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=ROOT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    worker = WorkerProc(proc, 0, log)
    deadline = time.monotonic() + 15
    line = ""
    while time.monotonic() < deadline and not line:
        if proc.poll() is not None:
            break
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
    if not line.startswith(READY_PREFIX):
        worker.stop()
        pytest.fail(f"worker did not start: {line!r}\n{worker.stderr()}")
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    worker.port = int(fields["port"])
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(worker.http + "/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return worker
        except OSError:
            time.sleep(0.05)
    worker.stop()
    pytest.fail("worker never became healthy")


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    w = start_worker(*WORKER_ARGS)
    yield w
    assert w.stop() == 0, w.stderr()


def new_sid() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


async def recv(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        msg = await ws.recv()
    assert isinstance(msg, str)
    obj = json.loads(msg)
    assert isinstance(obj, dict)
    return obj


async def open_chat(worker: WorkerProc, sid: str | None, **kwargs: Any) -> ClientConnection:
    """A chat connection as wslb opens one (its credential: ignored by a worker without one)."""
    headers = {**WORKER_AUTH, **({"X-Session-Id": sid} if sid else {})}
    return await connect(worker.ws, additional_headers=headers, open_timeout=TIMEOUT, **kwargs)


async def ask(
    ws: ClientConnection, sid: str, max_tokens: int, **prompt: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send a prompt, collect its tokens and ``done``; checks the tokens are exactly right."""
    await ws.send(json.dumps({"type": "prompt", "max_tokens": max_tokens, **prompt}))
    return await collect(ws, sid)


async def collect(
    ws: ClientConnection, sid: str, tokens: list[dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Read to ``done``, appending to ``tokens`` (those already read), and check them all."""
    tokens = [] if tokens is None else tokens
    for _ in range(100_000):
        msg = await recv(ws)
        if msg["type"] == "done":
            assert msg["tokens"] == len(tokens)
            for n, tok in enumerate(tokens):
                assert (tok["turn"], tok["i"]) == (msg["turn"], n)
                assert tok["text"] == token_text(sid, msg["turn"], n)
            return tokens, msg
        assert msg["type"] == "token", msg
        tokens.append(msg)
    raise AssertionError("no done")


async def metrics(worker: WorkerProc) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(worker.http + "/metrics") as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = await resp.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


# -- HTTP -----------------------------------------------------------------------------------


async def test_healthz(worker: WorkerProc) -> None:
    async with aiohttp.ClientSession() as http, http.get(worker.http + "/healthz") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_plain_get_on_ws_path_is_426(worker: WorkerProc) -> None:
    async with aiohttp.ClientSession() as http, http.get(worker.ws.replace("ws:", "http:")) as r:
        assert r.status == 426


async def test_metrics_names_and_counters(worker: WorkerProc) -> None:
    before = await metrics(worker)
    assert set(METRIC_NAMES) <= set(before)
    assert 0.0 <= before["wslb_worker_gpu_utilization"] <= 1.0
    assert 0.0 <= before["wslb_worker_kv_cache_usage"] <= 1.0
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        during = await metrics(worker)
        assert during["wslb_worker_active_sessions"] >= 1
        await ask(ws, sid, 3, text="a b c d")
        await ask(ws, sid, 3, text="e f")
    after = await metrics(worker)
    assert after["wslb_worker_connections_total"] == before["wslb_worker_connections_total"] + 1
    assert (
        after["wslb_worker_prefill_tokens_total"] >= before["wslb_worker_prefill_tokens_total"] + 6
    )
    assert after["wslb_worker_kv_hit_tokens_total"] >= before["wslb_worker_kv_hit_tokens_total"] + 7
    # Running answers' contexts only (vLLM's notion): nothing runs now.
    assert after["wslb_worker_kv_cache_usage"] == 0.0


async def test_inter_token_latency_histogram_follows_the_decode_speed() -> None:
    """The histogram wslb's ``tpot`` signal reads: one observation per gap between a stream's
    tokens (none before its first), at the speed the worker decodes."""
    w = start_worker("--tokens-per-s", "50", "--prefill-ms-per-token", "0", "--simulate-gpu")
    try:
        name = "wslb_worker_inter_token_latency_seconds"
        before = await metrics(w)
        assert before[f"{name}_count"] == 0.0 and before[f"{name}_sum"] == 0.0
        sid = new_sid()
        async with await open_chat(w, sid) as ws:
            await recv(ws)
            await ask(ws, sid, 11, text="x")
            await ask(ws, sid, 1, text="y")  # a one-token answer has no gap
        after = await metrics(w)
        assert after[f"{name}_count"] == 10.0
        assert 0.018 < after[f"{name}_sum"] / 10 < 0.06  # 1/50 s, plus a loaded machine's lag
        async with (
            aiohttp.ClientSession() as http,
            http.get(w.http + "/metrics") as resp,
        ):
            family = next(
                f for f in text_string_to_metric_families(await resp.text()) if f.name == name
            )
        buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
        assert buckets[-1] == ("+Inf", 10.0)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert [b for b, _ in buckets][:3] == ["0.01", "0.025", "0.05"]  # vLLM's buckets
    finally:
        w.stop()


# -- chat protocol ----------------------------------------------------------------------------


async def test_hello_stream_and_cached_second_turn(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        assert await recv(ws) == {"type": "hello", "worker": "wtest", "session": sid}
        tokens, done = await ask(ws, sid, 5, text="hello there world")
        assert len(tokens) == 5
        assert done == {
            "type": "done",
            "turn": 1,
            "tokens": 5,
            "cached_tokens": 0,
            "prefill_ms": pytest.approx(3 * PREFILL_MS),
            "worker": "wtest",
        }
        _, done = await ask(ws, sid, 4, text="and more")
        assert done["turn"] == 2
        assert done["cached_tokens"] == 3 + 5
        assert done["prefill_ms"] == pytest.approx(2 * PREFILL_MS)


async def test_reconnect_continues_session(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ask(ws, sid, 2, text="first")
    async with await open_chat(worker, sid) as ws:
        assert (await recv(ws))["session"] == sid
        _, done = await ask(ws, sid, 2, text="second")
        assert done["turn"] == 2
        assert done["cached_tokens"] == 1 + 2


async def test_session_from_query_and_header_precedence(worker: WorkerProc) -> None:
    sid = new_sid()
    async with connect(f"{worker.ws}?session={sid}", open_timeout=TIMEOUT) as ws:
        assert (await recv(ws))["session"] == sid
    other = new_sid()
    async with connect(
        f"{worker.ws}?session={sid}", additional_headers={"X-Session-Id": other}
    ) as ws:
        assert (await recv(ws))["session"] == other


async def test_generated_session_id(worker: WorkerProc) -> None:
    async with await open_chat(worker, None) as ws:
        hello = await recv(ws)
        sid = hello["session"]
        assert sid
        assert ws.response is not None
        assert ws.response.headers["X-Session-Id"] == sid
        await ask(ws, sid, 2, text="hi")


async def test_any_path_is_accepted(worker: WorkerProc) -> None:
    sid = new_sid()
    async with connect(
        f"ws://127.0.0.1:{worker.port}/v1/chat", additional_headers={"X-Session-Id": sid}
    ) as ws:
        assert (await recv(ws))["type"] == "hello"
        await ask(ws, sid, 1, text="x")


async def test_messages_form_replaces_conversation(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        tokens, _ = await ask(ws, sid, 3, text="what is up")
        answer = " ".join(t["text"] for t in tokens)
        history = [
            {"role": "user", "content": "what is up"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "tell me more"},
        ]
        _, done = await ask(ws, sid, 2, messages=history)
        assert (done["turn"], done["cached_tokens"]) == (2, 6)
        assert done["prefill_ms"] == pytest.approx(3 * PREFILL_MS)
        # A different conversation: only the shared leading words are cached.
        _, done = await ask(ws, sid, 1, messages=[{"role": "user", "content": "what is new"}])
        assert (done["turn"], done["cached_tokens"]) == (3, 2)


async def test_cancel_stops_answer(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "prompt", "text": "go on", "max_tokens": 100_000}))
        first = [await recv(ws) for _ in range(3)]
        await ws.send(json.dumps({"type": "cancel"}))
        started = time.monotonic()
        tokens, done = await collect(ws, sid, first)
        assert time.monotonic() - started < 2.0
        assert done["tokens"] == len(tokens) < 100_000
        # The connection goes on; the next turn continues after the cancelled answer.
        _, done2 = await ask(ws, sid, 1, text="next")
        assert done2["turn"] == 2
        assert done2["cached_tokens"] == 2 + done["tokens"]


async def test_cancel_with_other_turn_is_ignored(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "prompt", "text": "x", "max_tokens": 20}))
        await ws.send(json.dumps({"type": "cancel", "turn": 7}))
        _, done = await collect(ws, sid)
        assert done["tokens"] == 20


async def test_prompt_while_streaming_is_queued(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "prompt", "text": "one", "max_tokens": 10}))
        await ws.send(json.dumps({"type": "prompt", "text": "two", "max_tokens": 4}))
        _, first = await collect(ws, sid)
        _, second = await collect(ws, sid)
        assert (first["turn"], first["tokens"]) == (1, 10)
        assert (second["turn"], second["tokens"]) == (2, 4)
        assert second["cached_tokens"] == 1 + 10


async def test_default_max_tokens(worker: WorkerProc) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ws.send(json.dumps({"type": "prompt", "text": "hi"}))
        _, done = await collect(ws, sid)
        assert done["tokens"] == 64


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        "[1, 2]",
        '{"type": "nonsense"}',
        '{"type": "prompt"}',
        '{"type": "prompt", "text": "x", "max_tokens": -1}',
        '{"type": "prompt", "text": "x", "max_tokens": "5"}',
        '{"type": "prompt", "text": 5}',
        '{"type": "prompt", "messages": "hi"}',
        b"\x00binary",
    ],
)
async def test_bad_messages_get_error_and_keep_connection(
    worker: WorkerProc, payload: str | bytes
) -> None:
    sid = new_sid()
    async with await open_chat(worker, sid) as ws:
        await recv(ws)
        await ws.send(payload)
        msg = await recv(ws)
        assert msg["type"] == "error"
        assert isinstance(msg["error"], str)
        assert msg["error"]
        _, done = await ask(ws, sid, 2, text="still here")
        assert done["turn"] == 1


async def test_subprotocol_echoed_only_when_listed(worker: WorkerProc) -> None:
    async with await open_chat(worker, new_sid(), subprotocols=["wslb.chat.v1"]) as ws:
        assert ws.subprotocol == "wslb.chat.v1"
        await recv(ws)
    async with await open_chat(worker, new_sid(), subprotocols=["other.v1"]) as ws:
        assert ws.subprotocol is None
        await recv(ws)


async def test_sigterm_serves_during_grace_then_closes_with_1001() -> None:
    w = start_worker("--tokens-per-s", "20", "--drain-grace", "0.5", module="backends")
    try:
        sid = new_sid()
        async with await open_chat(w, sid) as ws:
            await recv(ws)
            await ws.send(json.dumps({"type": "prompt", "text": "long", "max_tokens": 1000}))
            assert (await recv(ws))["type"] == "token"
            w.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            # Still served during the grace period (so a balancer can migrate it away) ...
            assert (await recv(ws))["type"] == "token"
            assert (await recv(ws))["type"] == "token"
            # ... then closed with 1001.
            with pytest.raises(ConnectionClosed) as info:
                for _ in range(1000):
                    await recv(ws)
            assert info.value.rcvd is not None
            assert info.value.rcvd.code == 1001
            assert 0.4 < time.monotonic() - started < 3.0
        code = await asyncio.to_thread(w.proc.wait, TIMEOUT)
        assert code == 0, w.stderr()
    finally:
        w.stop()


async def test_second_signal_exits_at_once() -> None:
    w = start_worker("--tokens-per-s", "20", "--drain-grace", "60", module="backends")
    try:
        async with await open_chat(w, new_sid()) as ws:
            await recv(ws)
            w.proc.send_signal(signal.SIGTERM)

            async def draining() -> bool:
                async with aiohttp.ClientSession() as http, http.get(w.http + "/healthz") as r:
                    return r.status == 503

            await until(draining, 10, "the first signal taken (draining)")
            assert w.proc.poll() is None
            w.proc.send_signal(signal.SIGINT)
            with pytest.raises(ConnectionClosed) as info:
                await recv(ws)
            assert info.value.rcvd is not None
            assert info.value.rcvd.code == 1001
        code = await asyncio.to_thread(w.proc.wait, TIMEOUT)
        assert code == 0, w.stderr()
    finally:
        w.stop()


# -- NVML (backends.gpu), with a stand-in pynvml ------------------------------------------------


class FakeNvml(types.ModuleType):
    """Just enough of pynvml: devices with fixed utilisation percentages."""

    def __init__(self, rates: list[int], fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.rates = rates
        self.fail_init = fail_init
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.rates)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=self.rates[handle], memory=0)


def test_gpu_absent_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert open_gpu() is None


def test_gpu_absent_when_init_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([10], fail_init=True))
    assert open_gpu() is None


def test_gpu_absent_without_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert open_gpu() is None
    assert fake.shutdowns == 1


def test_gpu_mean_of_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([30, 50, 100])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = open_gpu()
    assert gpu is not None
    assert gpu.devices == 3
    assert gpu.utilization() == pytest.approx(0.6)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    gpu = open_gpu()
    assert gpu is not None
    assert gpu.utilization() == pytest.approx(0.4)
    # The worker reports the real reading, floored at the simulated background load.
    worker = Worker(WorkerConfig(model=ModelConfig(background_util=0.5)), gpu=gpu)
    assert worker.gpu_utilization(worker.model.stats()) == pytest.approx(0.5)
    fake.rates[:2] = [90, 90]
    assert worker.gpu_utilization(worker.model.stats()) == pytest.approx(0.9)
    gpu.close()
