"""What prefix placement (``balancer.prefix``) costs: memory of its table per thousand
conversations, and CPU per request of reading a body's prompt and choosing its worker.

Sans-I/O, one process: a pool of ``--workers`` reference-like backends, ``--conversations``
keyless chats of ``--turns`` turns over ``--systems`` shared system prompts of
``--system-bytes``; each turn sends the whole history (user messages of ``--user-bytes``,
answers of ``--answer-bytes``) as a chat-completions JSON body, placed with ``Pool.select``
and learnt (``learn``, ``settle``) as the proxy does. Memory is the table's (tracemalloc,
after the run, the bodies gone); CPU is ``time.process_time`` per request for
``prompt_of`` (JSON parse, cut, hash) and for ``select`` + ``learn`` apart, from a
second run of the same plan without tracemalloc.

    python bench/prefix_cost.py --conversations 1000 --turns 6
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc
from collections.abc import Callable

from balancer.config import BackendCfg, PoolCfg, PrefixCfg
from balancer.pool import Pool
from balancer.prefix import prompt_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-bytes", type=int, default=2800)
    ap.add_argument("--user-bytes", type=int, default=300)
    ap.add_argument("--answer-bytes", type=int, default=800)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--table-size", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))

    systems = [text(a.system_bytes) for _ in range(a.systems)]
    cfg = PoolCfg(
        name="p",
        backends=tuple(
            BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9000 + i}") for i in range(a.workers)
        ),
        prefix_placement=PrefixCfg(enabled=True, table_size=a.table_size),
    )
    mem, _, _ = run(a, cfg, systems, text, trace=True)
    rng.seed(a.seed)
    systems = [text(a.system_bytes) for _ in range(a.systems)]
    _, pool, stats = run(a, cfg, systems, text, trace=False)
    assert pool.prefix is not None
    blocks = len(pool.prefix)
    requests = stats["requests"]
    print(
        json.dumps(
            {
                "conversations": a.conversations,
                "turns": a.turns,
                "requests": requests,
                "mean_body_bytes": round(stats["body_bytes"] / requests),
                "table_blocks": blocks,
                "table_bytes": mem,
                "bytes_per_block": round(mem / max(blocks, 1), 1),
                "mb_per_1000_conversations": round(mem / a.conversations * 1000 / 1e6, 2),
                "parse_us_per_request": round(stats["parse_s"] / requests * 1e6, 1),
                "choose_us_per_request": round(stats["choose_s"] / requests * 1e6, 1),
                "placed": pool.prefix_placed,
            },
            indent=1,
        )
    )


def run(
    a: argparse.Namespace, cfg: PoolCfg, systems: list[str], text: Callable[[int], str], trace: bool
) -> tuple[int, Pool, dict[str, float]]:
    """One pass of the plan: the table's memory (with ``trace``), the pool, the timings."""
    if trace:
        tracemalloc.start()
    pool = Pool(cfg, seed=1)
    assert pool.prefix is not None
    base = tracemalloc.get_traced_memory()[0] if trace else 0
    parse_s = choose_s = 0.0
    requests = 0
    body_bytes = 0
    for c in range(a.conversations):
        messages = [{"role": "system", "content": systems[c % a.systems]}]
        for t in range(a.turns):
            messages.append({"role": "user", "content": text(a.user_bytes)})
            body = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
            body_bytes += len(body)
            t0 = time.process_time()
            prompt = prompt_of(body, pool.prefix_rules)
            t1 = time.process_time()
            b = pool.select(f"k{c}.{t}", prompt=prompt)
            assert b is not None
            pool.cancel(f"k{c}.{t}")
            pool.attach_request(b)
            sent = pool.learn(prompt, b, answer=True)
            pool.detach_request(b)
            if sent is not None and prompt is not None:
                pool.settle(sent, prompt, None)
            t2 = time.process_time()
            parse_s += t1 - t0
            choose_s += t2 - t1
            requests += 1
            messages.append({"role": "assistant", "content": text(a.answer_bytes)})
        del body, prompt
    mem = tracemalloc.get_traced_memory()[0] - base if trace else 0
    if trace:
        tracemalloc.stop()
    stats = {
        "requests": requests,
        "body_bytes": body_bytes,
        "parse_s": parse_s,
        "choose_s": choose_s,
    }
    return mem, pool, stats


if __name__ == "__main__":
    main()
