"""Prefix placement through real processes: keyless chats over the ``openai`` SDK's plain HTTP
through ``wslb`` in front of three reference workers (``balancer.prefix``, httpproxy rule 9).

Which worker answered a request is read from wslb's access log (``backend=``), found by the
request's own ``User-Agent``."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.lib.wslb import prom_by_label
from tests.procs import ROOT, Worker, Wslb, free_ports, pool_config, running

TIMEOUT = 20.0
SYSTEM = "You are the assistant of a shop that sells bicycles and their parts. " * 20
_tags = itertools.count()


def config(workers: list[Worker], **prefix: Any) -> dict[str, Any]:
    cfg = pool_config(
        [{"id": w.id, "url": f"http://127.0.0.1:{w.port}"} for w in workers],
        health={"path": "/healthz", "interval": "0.2s", "rise": 1},
        # The spreads these tests count were worked out at the keys' factor: the rule is the
        # same at the default (1.5), its numbers are not.
        prefix_placement={"enabled": True, "balance_factor": 1.25, **prefix},
    )
    cfg["log"] = {"access": True}
    return cfg


def start(workers: list[Worker], lb: Wslb) -> None:
    lb.start(wait_ready=False)
    lb.wait_ready(
        until=lambda bs: len(bs) == len(workers) and all(b["state"] == "active" for b in bs)
    )


def sdk(lb: Wslb, tag: str) -> AsyncOpenAI:
    """The ``openai`` SDK's client through ``lb``, its requests tagged ``User-Agent: tag``."""
    return AsyncOpenAI(
        base_url=f"http://127.0.0.1:{lb.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers={"User-Agent": tag},
    )


async def backend_of(lb: Wslb, tag: str) -> str:
    """The worker that answered the request sent with ``User-Agent: tag`` (its access line)."""
    pattern = re.compile(rf"backend=(\S+) .*ua={re.escape(tag)}$", re.M)
    deadline = time.monotonic() + TIMEOUT
    while (m := pattern.search(lb.output())) is None:
        assert time.monotonic() < deadline, lb.log_tail()
        await asyncio.sleep(0.05)
    return m.group(1)


async def turn(
    lb: Wslb, messages: list[Any], max_tokens: int = 8, key: str | None = None
) -> tuple[str, str]:
    """One streamed chat completion through ``lb`` (keyless unless ``key`` names its
    ``X-Session-Id``): its worker and its text."""
    tag = f"prefix-test-{next(_tags)}"
    headers = {"User-Agent": tag} | ({"X-Session-Id": key} if key is not None else {})
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{lb.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers=headers,
    )
    async with client:
        stream = await client.chat.completions.create(
            model="wslb-reference",
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
        )
        text = ""
        async with asyncio.timeout(TIMEOUT):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
    return await backend_of(lb, tag), text


async def conversation(
    lbs: list[Wslb], first: str, turns: int = 3, system: str | None = None, key: str | None = None
) -> list[str]:
    """A multi-turn chat (keyless unless ``key``), each turn the whole history, turn ``i``
    through ``lbs[i % len(lbs)]``; the worker of each turn."""
    messages: list[Any] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": first})
    where = []
    for i in range(turns):
        backend, text = await turn(lbs[i % len(lbs)], messages, key=key)
        where.append(backend)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"and then, after step {i}?"},
        ]
    return where


async def test_keyless_turns_follow_their_first_and_a_shared_system_prompt_stays_together(
    tmp_path: Path,
) -> None:
    workers = [Worker(f"p{i}").start() for i in range(3)]
    lb = Wslb(config(workers), tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        spread = set()
        for n in range(6):  # short first turns, no system prompt: each keeps its worker
            where = await conversation([lb], f"hello number {n}, how are you?")
            assert len(set(where)) == 1, where
            spread.add(where[0])
        assert len(spread) > 1  # and different conversations are spread
        shared = [await conversation([lb], f"question {n}", system=SYSTEM) for n in range(3)]
        assert len({w for where in shared for w in where}) == 1, shared
        text = await asyncio.to_thread(lb.admin, "/metrics")
        placed = {
            s.labels["how"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "wslb_http_prefix_placements_total" and s.labels["pool"] == "chat"
        }
        # 9 turns of 3 chats, 6 short ones: every first turn on the ring, every later one by
        # its prefix (the shared prompt's first turn included, after the first chat)
        assert placed.get("ring", 0) >= 7 and placed.get("prefix", 0) >= 14, placed
        assert placed.get("ring", 0) + placed.get("prefix", 0) == 27, placed


async def test_a_keyed_conversation_is_placed_by_its_prompt_then_stays_by_its_key(
    tmp_path: Path,
) -> None:
    """``X-Session-Id`` per conversation: a new key's first request goes where its prompt's
    prefix is (a shared system prompt: one worker for all), its later ones follow the key;
    with ``prefix_placement`` off the same keys spread by the ring."""
    workers = [Worker(f"k{i}").start() for i in range(3)]
    with running(*workers):
        for enabled in (True, False):
            cfg = config(workers, enabled=enabled)
            # Six new conversations in a row on one holder: at 1.25 its bound on the recent
            # ones would spread them after four (tests/test_prefix.py has that rule).
            cfg["pools"][0]["hash_balance_factor"] = 4.0
            cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
            lb = Wslb(cfg, tmp_path, name=f"wslb-{enabled}")
            with running(lb):
                await asyncio.to_thread(start, workers, lb)
                where = [
                    await conversation([lb], f"question {n}", system=SYSTEM, key=f"k{n}-{enabled}")
                    for n in range(6)
                ]
            assert all(len(set(w)) == 1 for w in where), where  # a key keeps its worker
            firsts = {w[0] for w in where}
            if enabled:
                assert len(firsts) == 1, where  # the shared prompt drew every new key
            else:
                assert len(firsts) > 1, where  # the keys alone spread


async def test_two_instances_choose_the_same_worker(tmp_path: Path) -> None:
    """Two separate wslb processes with the same config and no shared state: a conversation
    whose turns alternate between them stays on one worker, and a shared system prompt goes to
    the same worker from either."""
    workers = [Worker(f"q{i}").start() for i in range(3)]
    cfg = config(workers)
    # Each instance's share of recent new conversations would spread the shared prompt's
    # later ones (tests/test_prefix.py; its own view of the traffic): lifted, what is left
    # is what both derive from the prompt alone.
    cfg["pools"][0]["hash_balance_factor"] = 4.0
    cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
    a, b = Wslb(cfg, tmp_path, name="wslb-a"), Wslb(cfg, tmp_path, name="wslb-b")
    with running(*workers, a, b):
        await asyncio.to_thread(start, workers, a)
        await asyncio.to_thread(start, workers, b)
        for n in range(4):  # a first message past the anchor's 256 bytes
            first = f"conversation {n}: " + "tell me about wheels and gears. " * 10
            where = await conversation([a, b], first, turns=4)
            assert len(set(where)) == 1, where
        here = {(await turn(lb, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"q{n}"}]))[0]
                for n in range(3) for lb in (a, b)}  # fmt: skip
        assert len(here) == 1, here


async def test_load_imbalance_overrides_the_prefix(tmp_path: Path) -> None:
    """Three long answers with the shared prompt run on its worker; with ``balance_abs: 2`` the
    pool is imbalanced (3 against 0, and 3 > 1.5 x 0), so the next request with that prompt goes
    to a least loaded worker; once they end it goes back."""
    workers = [Worker(f"r{i}", ["--tokens-per-s", "20"]).start() for i in range(3)]
    cfg = config(workers, balance_abs=2, balance_rel=1.5)
    # The bounded-load bound out of the way (it would pass the holder over at 2 of 3 running;
    # tests/test_prefix.py has that rule): this is the imbalance rule alone.
    cfg["pools"][0]["hash_balance_factor"] = 4.0
    cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
    lb = Wslb(cfg, tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        home, _ = await turn(lb, prompt)
        body = {"model": "wslb-reference", "messages": prompt, "max_tokens": 400, "stream": True}
        url = f"http://127.0.0.1:{lb.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            streams = []
            try:
                for _ in range(3):  # one at a time: each placed while the others run
                    r = await http.post(url, json=body, timeout=aiohttp.ClientTimeout(TIMEOUT))
                    assert r.status == 200
                    await r.content.readline()
                    streams.append(r)
                listing = {x["id"]: x for x in await asyncio.to_thread(lb.admin, "/backends")}
                assert listing[home]["sessions"] == 3, listing
                other, _ = await turn(lb, prompt)
                assert other != home
            finally:
                for r in streams:
                    r.close()
        deadline = time.monotonic() + TIMEOUT
        while any(x["sessions"] for x in await asyncio.to_thread(lb.admin, "/backends")):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        back, _ = await turn(lb, prompt)
        assert back == home


async def test_a_popular_prefix_is_spread_within_the_bound(tmp_path: Path) -> None:
    """Fifteen long answers to new conversations sharing one system prompt, each placed while
    the others run: the holder takes no more than its bound (``balance_factor``, 1.25 here, x
    its share, plus the square root of that: 1.25 x 5 + 2.5, 9 of 15), the rest go on the
    ring's bound and become holders too."""
    workers = [Worker(f"s{i}", ["--tokens-per-s", "20"]).start() for i in range(3)]
    lb = Wslb(config(workers), tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        url = f"http://127.0.0.1:{lb.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            streams = []
            try:
                for n in range(15):
                    prompt = [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"question {n}"},
                    ]
                    body = {"model": "wslb-reference", "messages": prompt, "max_tokens": 400}
                    r = await http.post(
                        url, json={**body, "stream": True}, timeout=aiohttp.ClientTimeout(TIMEOUT)
                    )
                    assert r.status == 200
                    await r.content.readline()
                    streams.append(r)
                listing = await asyncio.to_thread(lb.admin, "/backends")
                running_on = sorted(x["sessions"] for x in listing)
                assert max(running_on) <= 9 and sum(running_on) == 15, listing
                assert sum(1 for n in running_on if n) >= 2, listing
            finally:
                for r in streams:
                    r.close()
        text = await asyncio.to_thread(lb.admin, "/metrics")
        placed = {
            s.labels["how"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "wslb_http_prefix_placements_total"
        }
        assert placed.get("bound", 0) >= 1 and placed.get("ring", 0) == 1, placed


async def raw(port: int, data: bytes, until: bytes | None = None) -> bytes:
    """Send ``data`` on a new connection; what comes back until ``until`` is read, else until
    the peer closes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        got = b""
        async with asyncio.timeout(TIMEOUT):
            while until is None or until not in got:
                more = await r.read(65536)
                if not more:
                    break
                got += more
        return got
    finally:
        w.close()


def head(length: int | None, *extra: str) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: wslb", "Content-Type: application/json"]
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


async def test_bodies_read_before_placing(tmp_path: Path) -> None:
    """The body wslb reads before choosing the worker (httpproxy rule 9): chunked or with
    ``Expect: 100-continue`` it is placed by its prompt as a sized one; one past
    ``prefix_placement.max_body`` or not JSON still reaches a worker; one that stops coming
    gets 408 after ``timeout_request``."""
    workers = [Worker(f"s{i}").start() for i in range(3)]
    cfg = config(workers, max_body="4KiB")
    cfg["pools"][0]["http"] = {"timeout_request": "1s"}
    # The same prompt three times in a row would be spread by the bound on recent traffic
    # (tests/test_prefix.py): lifted, the worker it reaches shows the body was read.
    cfg["pools"][0]["hash_balance_factor"] = 4.0
    cfg["pools"][0]["prefix_placement"]["balance_factor"] = 4.0
    lb = Wslb(cfg, tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        home, _ = await turn(lb, prompt)
        body = json.dumps({"model": "wslb-reference", "messages": prompt, "max_tokens": 2})
        data = body.encode()
        ua = "User-Agent: prefix-chunked"
        chunked = b"".join(
            b"%x\r\n%s\r\n" % (len(data[i : i + 500]), data[i : i + 500])
            for i in range(0, len(data), 500)
        )
        answer = await raw(lb.port, head(None, ua, "Connection: close") + chunked + b"0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert await backend_of(lb, "prefix-chunked") == home
        # Expect: 100-continue: wslb answers it, then reads the body
        r, w = await asyncio.open_connection("127.0.0.1", lb.port)
        try:
            w.write(head(len(data), "Expect: 100-continue", "User-Agent: prefix-100"))
            async with asyncio.timeout(TIMEOUT):
                assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
                w.write(data)
                assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        finally:
            w.close()
        assert await backend_of(lb, "prefix-100") == home
        big = json.dumps({"model": "wslb-reference", "max_tokens": 2, "messages": [
            {"role": "user", "content": "long " * 2000}]}).encode()  # fmt: skip
        answer = await raw(lb.port, head(len(big), "Connection: close") + big)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        chunked_big = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
        answer = await raw(lb.port, head(None, "Connection: close") + chunked_big)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        answer = await raw(lb.port, head(9, "Connection: close") + b"not json!")
        assert answer.startswith(b"HTTP/1.1 400") and b"wslb" not in answer.lower(), answer
        answer = await raw(lb.port, head(100) + b'{"messages"')
        assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_balancer_yaml_keyless_sdk_chat_finds_its_earlier_turns_cached(
    tmp_path: Path,
) -> None:
    """The repository's ``balancer.yaml`` (its three spawned reference workers, one shared
    prefix cache each): a keyless multi-turn chat over the SDK's plain HTTP finds its whole
    earlier context cached on every follow-up (``usage.prompt_tokens_details.cached_tokens``),
    because every turn reaches the worker that answered the one before."""
    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    for key in ("listen", "admin", "metrics"):
        cfg.pop(key, None)
    ports = free_ports(3)
    env = {f"WSLB_WORKER_PORT{i + 1}": str(p) for i, p in enumerate(ports)}
    lb = Wslb(cfg, tmp_path, extra_env=env)
    with running(lb):
        await asyncio.to_thread(lb.start, False)
        await asyncio.to_thread(
            lb.wait_ready,
            until=lambda bs: len(bs) == 3 and all(b["state"] == "active" for b in bs),
        )
        client = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{lb.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=TIMEOUT,
        )
        async with client:
            for n in range(3):
                messages: list[Any] = [{"role": "user", "content": f"conversation {n}: hello"}]
                before = 0  # the context the worker saw last turn, answer included
                for t in range(4):
                    r = await client.chat.completions.create(
                        model="wslb-reference", messages=messages, max_tokens=12
                    )
                    usage = r.usage
                    assert usage is not None and usage.prompt_tokens_details is not None
                    cached = usage.prompt_tokens_details.cached_tokens or 0
                    if t:  # the worker caches token by token (--kv-block-tokens 1)
                        assert cached >= before, (n, t, cached, before)
                    before = usage.prompt_tokens + usage.completion_tokens
                    messages += [
                        {"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": f"and after step {t}?"},
                    ]
        # wslb read each answer's report, and each agreed with where it had sent the turns.
        text = await settled_metrics(lb, 12)
        assert reports(text) == {"agreed": 12.0}, reports(text)


async def test_keyless_responses_turns_keep_their_worker(tmp_path: Path) -> None:
    """The Responses API over plain HTTP, the client keeping the conversation (``input`` the
    whole history, ``instructions`` a shared prompt): every turn on the first one's worker,
    its earlier context cached there (``input_tokens_details.cached_tokens``)."""
    workers = [Worker(f"t{i}").start() for i in range(3)]
    lb = Wslb(config(workers), tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        for n in range(3):
            tag = f"prefix-responses-{n}"
            client = sdk(lb, tag)
            history: list[Any] = [{"role": "user", "content": f"conversation {n}: hello"}]
            async with client:
                for t in range(3):
                    r = await client.responses.create(
                        model="wslb-reference",
                        instructions="Answer briefly.",
                        input=history,
                        max_output_tokens=10,
                    )
                    assert r.usage is not None
                    if t:
                        assert r.usage.input_tokens_details.cached_tokens > 0, r.usage
                    history += [
                        {"role": "assistant", "content": r.output_text},
                        {"role": "user", "content": f"and after step {t}?"},
                    ]
            pattern = re.compile(rf"backend=(\S+) .*ua={tag}$", re.M)
            deadline = time.monotonic() + TIMEOUT
            while len(found := pattern.findall(lb.output())) < 3:
                assert time.monotonic() < deadline, lb.log_tail()
                await asyncio.sleep(0.05)
            assert len(set(found)) == 1, found


async def responses_chain(lbs: list[Wslb], n: int, turns: int = 3) -> list[str]:
    """A keyless Responses conversation the server keeps: each turn names only the response
    before it (``previous_response_id``) and its new input, turn ``i`` through
    ``lbs[i % len(lbs)]``, streamed on odd turns; the worker of each turn. Every follow-up
    finds the earlier context cached where it lands."""
    where = []
    previous: str | None = None
    for t in range(turns):
        tag = f"prefix-chain-{next(_tags)}"
        client = sdk(lbs[t % len(lbs)], tag)
        # Instructions are not carried over by previous_response_id: each turn names them.
        args: dict[str, Any] = {
            "model": "wslb-reference",
            "max_output_tokens": 8,
            "instructions": "Answer briefly.",
        }
        if previous is None:
            args |= {"input": f"Conversation {n}. {SYSTEM}"}
        else:
            args |= {"previous_response_id": previous, "input": f"and after step {t}?"}
        async with client:
            if t % 2:
                stream = await client.responses.create(**args, stream=True)
                done = None
                async with asyncio.timeout(TIMEOUT):
                    async for event in stream:
                        if event.type in ("response.completed", "response.incomplete"):
                            done = event.response
                assert done is not None
                r = done
            else:
                r = await client.responses.create(**args)
        where.append(await backend_of(lbs[t % len(lbs)], tag))
        assert r.status in ("completed", "incomplete"), r  # incomplete: max_output_tokens
        assert r.usage is not None
        if previous is not None:
            assert r.previous_response_id == previous
            assert r.usage.input_tokens_details.cached_tokens > 0, (n, t, where, r.usage)
        previous = r.id
    return where


async def test_responses_chained_by_id_reach_the_worker_that_made_them(tmp_path: Path) -> None:
    """The ``openai`` SDK's ``previous_response_id`` chain, keyless: a follow-up sends only
    its new input, so its prompt cannot say where the history is, and a worker that keeps
    responses (as vLLM's and SGLang's servers do) can continue it only where it was made.
    wslb remembers which worker made each response and sends the follow-up there."""
    workers = [Worker(f"r{i}").start() for i in range(3)]
    lb = Wslb(config(workers), tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        firsts = set()
        for n in range(6):
            where = await responses_chain([lb], n, turns=4)
            assert len(set(where)) == 1, (n, where)
            firsts.add(where[0])
        assert len(firsts) > 1  # the chains' first turns spread (placed by their prompt)
        placed = prom_by_label(lb.admin("/metrics"), "wslb_http_prefix_placements_total", "how")
        assert placed.get("response") == 18, placed


def reports(text: str) -> dict[str, int]:
    """``wslb_prefix_reports_total`` by ``result``."""
    return dict(prom_by_label(text, "wslb_prefix_reports_total", "result"))


async def settled_metrics(lb: Wslb, done: int) -> str:
    """wslb's metrics once ``done`` reports are counted (a request's report is counted when its
    exchange ends, just after the client has the answer)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        text = await asyncio.to_thread(lb.admin, "/metrics")
        if sum(reports(text).values()) >= done:
            return text
        assert time.monotonic() < deadline, reports(text)
        await asyncio.sleep(0.05)


async def test_what_a_worker_reports_of_its_cache_corrects_the_table(tmp_path: Path) -> None:
    """A reference worker whose prefix cache holds about one conversation (400 tokens): the
    answers it sends through wslb say what it had cached (the SDK's keyless chat, whole and
    streamed with usage), and wslb reads each. Two conversations share a long system prompt;
    a third, unrelated, pushes most of it out of the cache; the next turn of the first finds
    only the start of it, and wslb counts the eviction (the table's side is
    ``tests/test_prefix.py``)."""
    worker = Worker("r1", ["--kv-block-tokens", "1", "--kv-capacity-tokens", "400"]).start()
    lb = Wslb(config([worker]), tmp_path)
    system = " ".join(f"s{i}" for i in range(250))
    history: dict[str, list[Any]] = {
        "x": [{"role": "system", "content": system}, {"role": "user", "content": "x?"}],
        "y": [{"role": "system", "content": system}, {"role": "user", "content": "y?"}],
        "z": [{"role": "user", "content": " ".join(f"z{i}" for i in range(300))}],
    }
    with running(worker, lb):
        await asyncio.to_thread(start, [worker], lb)
        client = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{lb.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=TIMEOUT,
        )

        async def ask(c: str, stream: bool) -> int:
            """One turn of conversation ``c``: the tokens the worker said it had cached."""
            if stream:
                chunks = await client.chat.completions.create(
                    model="wslb-reference",
                    messages=history[c],
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, cached = "", -1
                async with asyncio.timeout(TIMEOUT):
                    async for chunk in chunks:
                        if chunk.choices and chunk.choices[0].delta.content:
                            text += chunk.choices[0].delta.content
                        if chunk.usage is not None and chunk.usage.prompt_tokens_details:
                            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
            else:
                r = await client.chat.completions.create(
                    model="wslb-reference", messages=history[c], max_tokens=12
                )
                text = r.choices[0].message.content or ""
                assert r.usage is not None and r.usage.prompt_tokens_details is not None
                cached = r.usage.prompt_tokens_details.cached_tokens or 0
            history[c] += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "go on"},
            ]
            return cached

        async with client:
            assert await ask("x", stream=False) == 0
            assert await ask("y", stream=True) >= 250  # the shared system prompt, cached
            assert await ask("z", stream=False) == 0  # and this one pushes most of it out
            text = await settled_metrics(lb, 3)
            assert reports(text) == {"agreed": 3.0}, reports(text)
            # x's next turn: the table sent it for its whole history, the worker had only
            # the start of the system prompt: an eviction, read from the streamed answer.
            assert await ask("x", stream=True) < 150
            text = await settled_metrics(lb, 4)
            assert reports(text) == {"agreed": 3.0, "evicted": 1.0}, reports(text)
            # y's next turn finds the system prompt again (x's turn brought it back).
            assert await ask("y", stream=False) >= 250
            text = await settled_metrics(lb, 5)
            assert sum(reports(text).values()) == 5.0, reports(text)


async def test_a_hostile_workers_reports_cost_it_only_its_own_entries(tmp_path: Path) -> None:
    """A worker (a stock aiohttp app) whose answers to keyless chats are a nested-JSON bomb, a
    2 MiB stream of junk events, usage with nonsense numbers, and lies (nothing cached, ever):
    each reaches the client byte for byte, wslb reads at most the answer's tail, logs no
    traceback, and the lies only cost that worker entries of its own (``prefix.Table.settle``)."""
    from aiohttp import web

    bomb = b"[" * 200_000
    junk = b"".join(b'data: {"x": %d, "junk": "' % i + b"z" * 1000 + b'"}\n\n' for i in range(2048))
    lie = json.dumps(
        {"usage": {"prompt_tokens": 10**6, "prompt_tokens_details": {"cached_tokens": 0}}}
    ).encode()
    nonsense = json.dumps(
        {"usage": {"prompt_tokens": -5, "prompt_tokens_details": {"cached_tokens": 10**30}}}
    ).encode()
    answers = [bomb, junk + b"data: " + lie + b"\n\n", nonsense, lie, lie]

    async def chat(request: web.Request) -> web.StreamResponse:
        n = int(request.headers["X-N"])
        await request.read()
        body = answers[n]
        if n != 1:
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 65536):
            await resp.write(body[i : i + 65536])
        await resp.write_eof()
        return resp

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=10 * 2**20)
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/healthz", healthz)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    worker = Worker("h1")  # its id and a port for the config; never started
    cfg = config([worker])
    cfg["pools"][0]["backends"][0]["url"] = f"http://127.0.0.1:{port}"
    lb = Wslb(cfg, tmp_path)
    try:
        with running(lb):
            await asyncio.to_thread(start, [worker], lb)
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "the same long question " * 80}],
            }
            async with aiohttp.ClientSession() as http:
                for n, want in enumerate(answers):
                    async with http.post(
                        f"http://127.0.0.1:{lb.port}/v1/chat/completions",
                        json=body,
                        headers={"X-N": str(n)},
                    ) as resp:
                        assert resp.status == 200
                        assert await asyncio.wait_for(resp.read(), TIMEOUT) == want, n
            # The bomb and the nonsense say nothing; each lie (the junk stream's last event
            # among them) says the prompt sent just before was lost: the table takes it so,
            # for this worker's entries alone.
            text = await settled_metrics(lb, 3)
            assert reports(text) == {"evicted": 3.0}, reports(text)
            assert "Traceback" not in lb.output()
    finally:
        await runner.cleanup()


async def test_a_cluster_keeps_each_keyless_conversation_on_one_worker(tmp_path: Path) -> None:
    """Two instances in cluster mode over a real etcd, default bounds: keyless conversations
    sharing a system prompt, each turn through the other instance (as round robin in front of
    the tier does it). Each instance's own table and bounds spread the shared prompt its own
    way; the tier's table keeps every conversation on the worker its first turn went to."""
    from tests.etcd import Etcd
    from tests.test_cluster_etcd import PREFIX

    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(f"k{i}").start() for i in range(3)]
    cfg = config(workers)
    cfg["cluster"] = {"etcd": etcd.url, "prefix": PREFIX}
    a, b = Wslb(cfg, tmp_path, name="wslb-a"), Wslb(cfg, tmp_path, name="wslb-b")
    try:
        with running(*workers, a, b):
            await asyncio.to_thread(start, workers, a)
            await asyncio.to_thread(start, workers, b)
            # b alone first: first turns it spreads over the workers by its own share of them.
            alone: set[str] = set()
            for n in range(40):  # until its bounds have spread the prompt (at its 6th or so)
                alone.update(await conversation([b], f"b's {n}", turns=1, system=SYSTEM))
                if len(alone) > 1:
                    break
            assert len(alone) > 1, alone
            for n in range(8):
                where = await conversation([a, b], f"question {n}", turns=4, system=SYSTEM)
                assert len(set(where)) == 1, (n, where)
            # A Responses chain by id, each turn through the other instance.
            for n in range(3):
                where = await responses_chain([a, b], n, turns=4)
                assert len(set(where)) == 1, (n, where)
    finally:
        etcd.stop()


async def test_workers_n_keeps_each_keyless_conversation_on_one_worker(tmp_path: Path) -> None:
    """``workers: 2``: the kernel hands each request's connection (a new one per turn here) to
    either serving process, and each process has its own table and bounds, which spread the
    shared system prompt their own way; the board they share keeps every conversation on the
    worker its first turn went to, whichever process its later turns reach."""
    workers = [Worker(f"n{i}").start() for i in range(3)]
    cfg = config(workers)
    cfg["workers"] = 2
    lb = Wslb(cfg, tmp_path)
    with running(*workers, lb):
        await asyncio.to_thread(start, workers, lb)
        firsts: set[str] = set()
        for n in range(40):  # until the bounds have spread the shared prompt (at its 6th or so)
            firsts.update(await conversation([lb], f"first {n}", turns=1, system=SYSTEM))
            if len(firsts) > 1:
                break
        assert len(firsts) > 1, firsts
        for n in range(8):
            where = await conversation([lb], f"question {n}", turns=4, system=SYSTEM)
            assert len(set(where)) == 1, (n, where)
        for n in range(4):  # a Responses chain by id: the board says where each was made
            where = await responses_chain([lb], n, turns=4)
            assert len(set(where)) == 1, (n, where)
