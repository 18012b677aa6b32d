"""The real engine of ``tests/engines.py``: llama-server with Gemma 3 270M on the CPU.

One server for the module (2 slots sharing 4096 tokens of context, 1 thread). The first run
on a machine builds llama-server (about 6 minutes on 2 cores) and assembles the model; later
runs find both in the cache and start the server in about a second. What is checked is what
wslb relies on in front of an engine: streamed tokens at temperature 0, an assistant message
continued where it stops (the bridge's partial answer), ``llamacpp:`` metrics that the
``llamacpp`` preset reads, busy slots and a queue while the server is full, and a repeated
prefix served from the cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from balancer.weights import PRESETS, parse_signals
from tests.engines import LlamaServer, chat, content, http_post

pytestmark = pytest.mark.engine  # the real llama-server: -m 'not engine' skips

QUESTION = "Recite the English alphabet in capital letters, separated by spaces."
PREFIX = "A B C D E F G"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(tmp_path_factory.mktemp("llama") / "llama-server.log") as s:
        yield s


def greedy(server: LlamaServer, **body: Any) -> list[dict[str, Any]]:
    """A streamed completion at temperature 0 (32 tokens at most unless told): its events."""
    return list(chat(server.url, {"temperature": 0, "max_tokens": 32, **body}))


def final(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The last event: llama-server puts ``usage`` (when asked) and ``timings`` there."""
    assert events, "no events"
    return events[-1]


def test_streams_tokens_at_temperature_zero(server: LlamaServer) -> None:
    n = 64
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": n,
        "ignore_eos": True,  # always n tokens, for the rate
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    events: list[dict[str, Any]] = []
    start = time.monotonic()
    for ev in chat(server.url, {"temperature": 0, **body}):
        events.append(ev)
        if content([ev]):
            arrivals.append(time.monotonic())
    pieces = content(events)
    assert len(pieces) >= n // 2, pieces  # a delta per token, give or take merged pieces
    last = final(events)
    assert last["usage"]["completion_tokens"] == n
    timings = last["timings"]
    assert timings["predicted_n"] == n
    wall = (n - 1) / (arrivals[-1] - arrivals[0])
    print(
        f"\nllama-server Gemma 3 270M, one stream: {timings['predicted_per_second']:.1f} tokens/s "
        f"(server), {wall:.1f} tokens/s (deltas as received), first token after "
        f"{arrivals[0] - start:.2f}s"
    )
    assert timings["predicted_per_second"] > 1  # about 50 on this 2-core machine
    # Temperature 0 and the same batch (a prompt taken from the cache is evaluated in other
    # batches, which may change the last digits and so the answer): the same answer.
    once, twice = (content(greedy(server, **body, cache_prompt=False)) for _ in range(2))
    assert once == twice


def test_apply_template_leaves_a_continued_message_open(server: LlamaServer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": PREFIX},
    ]
    status, body = http_post(f"{server.url}/apply-template", {"messages": messages[:2]})
    assert status == 200, body
    opened = body["prompt"]
    assert opened.endswith(
        f"<start_of_turn>user\nBe brief.\n\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    ), opened
    cont = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    status, body = http_post(f"{server.url}/apply-template", cont)
    assert status == 200, body
    assert body["prompt"] == opened + PREFIX  # no <end_of_turn>: the model goes on from here
    both = {**cont, "add_generation_prompt": True}
    status, body = http_post(f"{server.url}/apply-template", both)
    assert status == 400, body


def test_continues_a_trailing_assistant_message(server: LlamaServer) -> None:
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": PREFIX},
    ]
    events = greedy(
        server, messages=messages, continue_final_message=True, add_generation_prompt=False
    )
    pieces = content(events)
    assert pieces, events
    text = "".join(pieces)
    assert not text.lstrip().startswith("A B"), text  # the prefix is not said again
    assert text.lstrip().startswith("H"), text  # ...G, then H
    # llama-server prefills by default: a trailing assistant message is continued unasked, but
    # then the stream's first delta repeats it (only the request's continue_final_message
    # tells the stream to start after it); a whole answer has it either way.
    explicit, default = (
        content(greedy(server, messages=messages, cache_prompt=False, **flags))
        for flags in ({"continue_final_message": True, "add_generation_prompt": False}, {})
    )
    assert default[0].startswith(PREFIX) and explicit[0] == default[0].removeprefix(PREFIX)
    assert default[1:] == explicit[1:]
    req = {"messages": messages, "temperature": 0, "max_tokens": 8, "cache_prompt": False}
    status, whole = http_post(f"{server.url}/v1/chat/completions", req)
    assert status == 200, whole
    assert whole["choices"][0]["message"]["content"].startswith(PREFIX + " H"), whole
    # A fresh answer starts elsewhere.
    fresh = "".join(content(greedy(server, messages=messages[:1])))
    assert fresh != text


def test_the_template_alone_leaves_the_message_open_when_asked(tmp_path: Path) -> None:
    """With prefill off, llama-server hands the trailing assistant message to the template:
    closed as a full turn by default, left open with ``continue_final_message`` in
    ``chat_template_kwargs`` (transformers' switch), its text as sent."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": PREFIX + " "},
    ]
    turn = f"<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    args = ["--no-prefill-assistant"]
    with LlamaServer(tmp_path / "no-prefill.log", parallel=1, ctx=1024, args=args) as s:
        status, body = http_post(f"{s.url}/apply-template", {"messages": messages})
        assert status == 200, body
        assert body["prompt"] == f"{turn}{PREFIX}<end_of_turn>\n<start_of_turn>model\n"
        kwargs = {"continue_final_message": True}
        req = {"messages": messages, "add_generation_prompt": False, "chat_template_kwargs": kwargs}
        status, body = http_post(f"{s.url}/apply-template", req)
        assert status == 200, body
        assert body["prompt"] == f"{turn}{PREFIX} "


def test_metrics_feed_the_llamacpp_preset(server: LlamaServer) -> None:
    text = server.metrics()
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:tokens_predicted_total",
        "llamacpp:prompt_tokens_total",
    ):
        assert f"\n{name} " in text, text
    s = parse_signals(text, PRESETS["llamacpp"], at=0.0)
    assert (s.running, s.waiting) == (0, 0)  # idle between tests
    assert (s.kv_cache_usage, s.tpot_count) == (None, None)  # not exported


def test_a_full_server_reports_busy_slots_and_a_queue(server: LlamaServer) -> None:
    """Three streams on two slots: two run, one waits, and the preset reads both."""
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "temperature": 0,
        "max_tokens": 96,
        "ignore_eos": True,
    }
    done = threading.Event()
    seen: list[tuple[float | None, float | None]] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            s = parse_signals(server.metrics(), PRESETS["llamacpp"], at=0.0)
            seen.append((s.running, s.waiting))
            if (s.running, s.waiting) == (2, 1):
                return
            time.sleep(0.05)

    with ThreadPoolExecutor(4) as pool:
        watcher = pool.submit(watch)
        streams = [pool.submit(lambda: content(list(chat(server.url, body)))) for _ in range(3)]
        answers = [f.result(timeout=120) for f in streams]
        done.set()
        watcher.result(timeout=10)
    assert (2, 1) in seen, seen
    # Greedy, but batched with different neighbours: the answers need not be identical.
    assert all(len(a) >= 48 for a in answers), answers


def test_a_repeated_prefix_comes_from_the_cache(server: LlamaServer) -> None:
    system = "You answer questions about lighthouses. " * 12
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "How tall is the tallest lighthouse?"},
    ]
    opts = {"stream_options": {"include_usage": True}, "max_tokens": 8}
    first = final(greedy(server, messages=messages, **opts))
    second = final(greedy(server, messages=messages, **opts))
    prompt = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt > 100, second
    assert cached == second["timings"]["cache_n"]
    assert cached >= 0.9 * prompt, second  # all but the last few tokens
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached
    print(f"\nsecond request: {cached} of {prompt} prompt tokens from the cache")
