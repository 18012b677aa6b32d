"""Prefix placement (``balancer.prefix`` and ``Pool.select(prompt=...)``): prompts cut at
message boundaries, the table's longest match and LRU bound, the two-sided margin, the ring
anchor. Sans-I/O: bodies and pools built by hand, no sockets."""

from __future__ import annotations

import json
from pathlib import Path

from balancer import prefix
from balancer.config import BackendCfg, PoolCfg, PrefixCfg
from balancer.pool import Pool
from balancer.prefix import Rules, Table, choose, cut, imbalanced, prompt_of, segments

R = Rules()
SYSTEM = "You are a careful assistant. " * 40  # about 1.2 kB: several blocks


def chat(*turns: str, system: str | None = SYSTEM) -> bytes:
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return json.dumps({"model": "m", "messages": msgs, "stream": True}).encode()


def make_pool(n: int = 3, **pp: object) -> Pool:
    cfg = PoolCfg(
        name="p",
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in range(n)),
        prefix_placement=PrefixCfg(enabled=True, **pp),  # type: ignore[arg-type]
    )
    return Pool(cfg, seed=1)


def place(pool: Pool, body: bytes, key: str = "k") -> str:
    p = prompt_of(body, pool.prefix_rules)
    b = pool.select(key, prompt=p)
    assert b is not None
    pool.cancel(key)
    pool.attach_request(b)
    sent = pool.learn(p, b, answer=True)
    pool.detach_request(b)
    if sent is not None and p is not None:
        pool.settle(sent, p, None)
    return b.id


# -- the prompt ----------------------------------------------------------------------------------


def test_segments_of_chat_responses_and_completions() -> None:
    assert segments({"messages": [{"role": "user", "content": "hi"}]}) == ["user\x1fhi"]
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert segments({"messages": [parts]}) == ["user\x1fa\nb"]
    assert segments({"instructions": "be brief", "input": "hi"}) == [
        "system\x1fbe brief",
        "user\x1fhi",
    ]
    assert segments({"prompt": "once upon"}) == ["once upon"]
    assert segments({"prompt": ["once upon"]}) == ["once upon"]
    tools = segments(
        {"tools": [{"type": "function"}], "messages": [{"role": "user", "content": "x"}]}
    )
    assert tools is not None and tools[0].startswith("tools\x1f")
    none: object
    for none in ({}, {"messages": []}, {"prompt": [1, 2]}, [1], "x", {"input": None}):
        assert segments(none) is None


def test_no_prompt_from_a_body_that_is_not_json() -> None:
    assert prompt_of(b"\xff\x00", R) is None
    assert prompt_of(b"[" * 100_000, R) is None  # too deep: no prompt, no traceback
    assert prompt_of(b'{"model": "m"}', R) is None


def test_a_later_turn_repeats_the_earlier_blocks_however_short_the_first_turn() -> None:
    one = prompt_of(chat("hi", system=None), R)
    two = prompt_of(chat("hi", "hello! " * 100, "and then?", system=None), R)
    assert one is not None and two is not None
    assert len(one.hashes) == 1 and two.hashes[:1] == one.hashes
    long1 = prompt_of(chat("x" * 700), R)
    long2 = prompt_of(chat("x" * 700, "ok", "more"), R)
    assert long1 is not None and long2 is not None
    assert long2.hashes[: len(long1.hashes)] == long1.hashes
    assert all(b - a <= R.block for a, b in zip((0, *long1.ends), long1.ends, strict=False))


def test_blocks_chain_the_bytes_before_them() -> None:
    a = cut(["system\x1fA", "user\x1fsame"], R)
    b = cut(["system\x1fB", "user\x1fsame"], R)
    assert a is not None and b is not None
    assert a.hashes[1] != b.hashes[1]  # same block, different prefix


def test_the_anchor_is_the_first_boundary_past_anchor_bytes() -> None:
    # A long shared system prompt: every conversation has the same anchor.
    a, b = prompt_of(chat("question one"), R), prompt_of(chat("something else"), R)
    assert a is not None and b is not None and a.anchor == b.anchor
    # A short one: the anchor takes in the first user message, so conversations spread.
    c = prompt_of(chat("question one " * 30, system="be brief"), R)
    d = prompt_of(chat("something else " * 30, system="be brief"), R)
    assert c is not None and d is not None and c.anchor != d.anchor


# -- the table --------------------------------------------------------------------------------


def test_longest_match_and_its_ready_holders() -> None:
    t = Table(1000)
    p1 = prompt_of(chat("q1"), R)
    p2 = prompt_of(chat("q1", "a1", "q2"), R)
    assert p1 is not None and p2 is not None
    t.learn(p1, "w1")
    m = t.match(p2, {"w1", "w2"})
    # p1's blocks, and the answer w1 wrote after them ("a1"), not the new question
    assert m.holders == ("w1",)
    assert m.covered == p1.size + len("assistant\x1fa1\x1e") < p2.size
    t.learn(p2, "w2")
    assert t.match(p2, {"w1", "w2"}) == prefix.Match(p2.size, ("w2",))
    assert t.match(p1, {"w1", "w2"}).holders == ("w2", "w1")  # most recent first
    assert t.match(p1, {"w1"}).holders == ("w1",)  # only the ready ones
    assert t.match(p1, set()).covered == 0


def test_the_table_is_bounded_and_keeps_the_start_of_live_chains() -> None:
    t = Table(20)
    prompts = [prompt_of(chat(f"conversation {i} " * 50, system=None), R) for i in range(10)]
    for i, p in enumerate(prompts):
        assert p is not None
        t.learn(p, f"w{i % 3}")
        assert len(t) <= 20
    last = prompts[-1]
    assert last is not None
    assert t.match(last, {"w0", "w1", "w2"}).covered == last.size
    first = prompts[0]
    assert first is not None and t.match(first, {"w0"}).covered == 0  # evicted
    # A prompt longer than the table: what is kept is its start.
    big = prompt_of(chat("y" * 256 * 40, system=None), R)
    assert big is not None
    t.learn(big, "w1")
    m = t.match(big, {"w1"})
    assert 0 < m.covered < big.size


def test_forget_drops_a_removed_backend() -> None:
    t = Table(100)
    p = prompt_of(chat("q"), R)
    assert p is not None
    t.learn(p, "w1")
    t.learn(p, "w2")
    t.forget("w2")
    assert t.match(p, {"w1", "w2"}).holders == ("w1",)
    t.forget("w1")
    assert len(t) == 0


# -- reports (rule 6) -------------------------------------------------------------------------


def _long(tag: str) -> prefix.Prompt:
    p = prompt_of(chat(f"{tag} " * 400, system=None), R)
    assert p is not None and len(p.hashes) > 4
    return p


def test_a_report_of_an_eviction_takes_what_extends_the_lost_block_as_gone() -> None:
    """Three conversations on one long shared prefix and one apart, all on w1: a report that
    w1 had only the start of the prefix takes the conversations through the rest of it as
    gone from w1; the one apart, and other workers' entries, stay."""
    t = Table(1000)
    shared = "the shared prefix " * 100
    x = prompt_of(chat("x?", system=shared), R)
    y = prompt_of(chat("y?", system=shared), R)
    z = prompt_of(chat("z?", system=shared), R)
    apart = _long("apart")
    assert x is not None and y is not None and z is not None
    for p in (x, y, apart):
        t.settle(t.learn(p, "w1", answer=True), p, (0, 100))  # first sends: nothing cached
    t.learn(y, "w2")
    assert t.match(y, {"w1", "w2"}).holders == ("w2", "w1")
    # z: the engine had a tenth of it (a slice of the shared prefix): the prefix past that is
    # lost on w1, and with it x and y, which extend it there.
    sent = t.learn(z, "w1", answer=True)
    assert t.settle(sent, z, (10, 100)) == "evicted"
    assert t.match(z, {"w1"}).covered == z.size  # sent again just now: there again
    shared_end = t.match(x, {"w1"}).covered  # the prefix z brought back, not x's question
    assert 0 < shared_end < x.size and not t.match(x, {"w1"}).answered
    assert t.match(x, {"w1"}).covered == t.match(y, {"w1"}).covered == shared_end
    assert t.match(y, {"w1", "w2"}) == prefix.Match(y.size, ("w2",))  # w2's own: kept
    assert t.match(apart, {"w1"}).covered == apart.size  # not through the lost block
    # x sent to w1 again after the report: there again.
    t.learn(x, "w1")
    assert t.match(x, {"w1"}).covered == x.size


def test_a_report_that_agrees_changes_nothing() -> None:
    t = Table(1000)
    a = _long("alpha")
    t.settle(t.learn(a, "w1", answer=True), a, (0, 100))
    sent = t.learn(a, "w1", answer=True)
    assert t.settle(sent, a, (99, 100)) == "agreed"
    # within the slack of two blocks short of the prompt: still agreement
    short = -(-100 * (2 * a.size - 3 * R.block) // (2 * a.size))  # 1.5 blocks short
    assert t.settle(t.learn(a, "w1", answer=True), a, (short, 100)) == "agreed"
    assert t.match(a, {"w1"}).covered == a.size
    assert t.settle(t.learn(a, "w1", answer=True), a, None) is None  # nothing said
    assert t.settle(t.learn(a, "w1", answer=True), a, (5, 0)) is None  # nonsense


def test_a_send_still_unanswered_proves_nothing() -> None:
    """Two requests with one prompt in flight at once: the second finds nothing cached, as
    the engine is still reading the first; that is no eviction."""
    t = Table(1000)
    a = _long("alpha")
    first = t.learn(a, "w1", answer=True)
    second = t.learn(a, "w1", answer=True)
    assert second.settled < first.seq
    assert t.settle(second, a, (0, 100)) == "agreed"
    t.settle(first, a, (0, 100))
    assert t.match(a, {"w1"}).covered == a.size
    # Once the first has ended, the same report proves the eviction.
    third = t.learn(a, "w1", answer=True)
    assert t.settle(third, a, (0, 100)) == "evicted"


def test_forget_clears_what_was_known_gone() -> None:
    t = Table(1000)
    a = _long("alpha")
    b = prompt_of(chat("alpha " * 400 + "and more", system=None), R)
    assert b is not None
    t.settle(t.learn(b, "w1", answer=True), b, (0, 100))
    t.settle(t.learn(a, "w1", answer=True), a, (0, 100))
    t.settle(t.learn(a, "w1", answer=True), a, (0, 100))  # b's blocks past a's start: gone
    t.forget("w1")
    t.learn(b, "w1")
    assert t.match(b, {"w1"}).covered == b.size


def test_what_engines_report_of_their_cache() -> None:
    def read(*parts: bytes) -> tuple[int, int] | None:
        r = prefix.Report()
        for part in parts:
            r.feed(part)
        return r.result()

    chat_json = {"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}
    assert read(json.dumps(chat_json).encode()) == (64, 90)
    # llama-server: timings win over its usage
    llama = chat_json | {"timings": {"cache_n": 80, "prompt_n": 10}}
    assert read(json.dumps(llama).encode()) == (80, 90)
    # SSE: the last event that says it, whatever follows ([DONE]), across reads
    sse = (
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        + b"data: "
        + json.dumps(llama).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    assert read(sse[:30], sse[30:]) == (80, 90)
    responses = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 7}}},
    }
    event = b"event: response.completed\ndata: " + json.dumps(responses).encode() + b"\n\n"
    assert read(event) == (7, 50)
    # a long stream: only its tail is kept, and read
    filler = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' * 2000
    assert read(filler, sse) == (80, 90)
    # no usage details (vLLM without include_usage), not JSON, hostile shapes: nothing
    assert read(b'{"usage": {"prompt_tokens": 9}}') is None
    assert read(b"\xff\xfe not json") is None
    assert read(b'data: {"timings": {"cache_n": "80", "prompt_n": 1}}\n\n') is None
    assert read(b"[" * 100_000) is None


# -- the choice -------------------------------------------------------------------------------


def test_imbalance_needs_abs_and_rel() -> None:
    assert imbalanced([40, 5], 32, 1.5)
    assert not imbalanced([40, 30], 5, 1.5)  # rel 1.33 only
    assert not imbalanced([3, 1], 5, 1.5)  # abs 2 only
    assert not imbalanced([7], 0, 1.0)


def test_a_follow_up_goes_where_its_first_turn_went() -> None:
    pool = make_pool()
    for i in range(12):
        first = place(pool, chat(f"conversation {i}", system=None), f"a{i}")
        second = place(
            pool, chat(f"conversation {i}", "answer " * 80, "next", system=None), f"b{i}"
        )
        third = place(
            pool,
            chat(f"conversation {i}", "answer " * 80, "next", "more " * 60, "last", system=None),
            f"c{i}",
        )
        assert first == second == third
    assert pool.prefix_placed["prefix"] == 24 and pool.prefix_placed["ring"] == 12


def test_without_a_table_every_pool_places_a_shared_system_prompt_alike() -> None:
    """Two "instances" that share nothing, the same requests: the same worker for each (one
    for the shared prompt while its margin is not a whole request), then the same spread."""
    pools = [make_pool(), make_pool()]
    where = [[place(p, chat(f"question {i}"), f"k{i}") for i in range(20)] for p in pools]
    assert where[0] == where[1]
    assert len(set(where[0][:2])) == 1 and len(set(where[0])) > 1, where


def test_load_imbalance_overrides_the_prefix() -> None:
    pool = make_pool(balance_abs=4, balance_rel=1.5)
    body = chat("q")
    home = place(pool, body)
    hot = pool.backends[home]
    hot.sessions = 6  # six requests running there
    p = prompt_of(body, pool.prefix_rules)
    b = pool.select("x", prompt=p)
    assert b is not None and b.id != home
    assert pool.prefix_placed["balance"] == 1
    pool.cancel("x")
    for other in pool.backends.values():  # 4 against 3 and 3: not imbalanced, within bound
        other.sessions = 3
    hot.sessions = 4
    b = pool.select("y", prompt=p)
    assert b is not None and b.id == home


def test_a_holder_at_its_bound_is_passed_over_unless_the_conversation_goes_on() -> None:
    """A prompt that shares a prefix with earlier ones (a system prompt) goes to its holder
    only within its bound (balance_factor, 1.5, x its share, plus the square root of that); a
    conversation going on (its earlier answer written there) within affinity_ceiling (2.0) x
    its share, as a returning key, or the new conversation's bound where that is looser."""
    pool = make_pool(balance_abs=100)  # the imbalance rule out of the way
    home = place(pool, chat("q"))
    for b in pool.backends.values():  # 21 there, 5 on each other: 32 after one more
        b.sessions = 21 if b.id == home else 5
    # strict bound ceil(1.5 x 32/3 + its square root) = 20 < 22; loose ceil(2.0 x 32/3) = 22
    shared = prompt_of(chat("another question"), pool.prefix_rules)
    assert shared is not None
    b, how = pool.place_prompt("x", shared)
    assert b is not None and b.id != home and how == "bound"
    pool.cancel("x")
    going_on = prompt_of(chat("q", "an answer", "and then?"), pool.prefix_rules)
    assert going_on is not None  # its first turn went home: the answer was written there
    b, how = pool.place_prompt("y", going_on)
    assert b is not None and b.id == home and how == "prefix"


def test_a_conversation_going_on_is_never_bound_tighter_than_a_new_one() -> None:
    """3 running on the holder, none elsewhere: affinity_ceiling's bound (ceil(2.0 x 4/3) = 3)
    is tighter there than a new conversation's (1.5 x 4/3 plus its root: 4), so the
    conversation going on takes the looser and stays."""
    pool = make_pool(balance_abs=100)
    home = place(pool, chat("q"))
    pool.backends[home].sessions = 3
    going_on = prompt_of(chat("q", "an answer", "and then?"), pool.prefix_rules)
    assert going_on is not None
    b, how = pool.place_prompt("y", going_on)
    assert b is not None and b.id == home and how == "prefix"


def test_the_new_conversation_bound_allows_a_random_counts_spread() -> None:
    """factor x share plus its square root: loose for a few, the factor for many."""
    assert prefix.bound(0.5, 1.5) == 2  # never below the share plus one
    assert prefix.bound(1.0, 1.5) == 3  # three arrivals in a row on one of 3 workers fit
    assert prefix.bound(100.0, 1.5) == 163
    assert prefix.bound(10_000.0, 1.5) == 15_123  # within 1% of the factor
    pool = make_pool(balance_abs=100)
    where = [place(pool, chat(f"question {i}"), f"k{i}") for i in range(30)]
    counts = sorted(where.count(b) for b in set(where))
    assert len(set(where[:3])) == 1, where  # three conversations in a row keep their prefix
    assert counts[-1] <= prefix.bound(30 / 3, 1.5) and len(counts) > 1, where


def test_places_held_between_turns_do_not_push_a_new_conversation_off_its_prefix() -> None:
    """Keyed conversations between turns hold their places (they count for keys' bounds), but
    a new conversation's bound counts what runs: the holder of its system prompt that is over
    its bound only by held places takes it; one over by running sessions does not."""
    pool = make_pool(balance_abs=100)
    home = place(pool, chat("q"))
    for b in pool.backends.values():
        b.sessions = 5
    shared = prompt_of(chat("another question"), pool.prefix_rules)
    assert shared is not None
    pool.backends[home].sessions = 21  # 21 running there: bound 20 (the test above)
    b, how = pool.place_prompt("x", shared)
    assert b is not None and b.id != home and how == "bound"
    pool.cancel("x")
    pool.backends[home].held, pool.backends[home].sessions = 15, 6  # the same 21, 15 held
    b, how = pool.place_prompt("y", shared)
    assert b is not None and b.id == home and how == "prefix"


def test_a_match_below_the_threshold_goes_to_the_ring() -> None:
    pool = make_pool(threshold=0.9)
    base = chat("q", system=None)
    place(pool, base)
    p = prompt_of(chat("q", "a", "z" * 2000, system=None), pool.prefix_rules)
    assert p is not None
    pool.select("x", prompt=p)
    assert pool.prefix_placed["ring"] == 2


def test_choose_ties_follow_the_ring_walk() -> None:
    pool = make_pool()
    p = prompt_of(chat("q"), pool.prefix_rules)
    assert p is not None and pool.prefix is not None
    ready = list(pool.backends.values())
    for b in ready:
        pool.prefix.learn(p, b.id)
    walk = list(pool.ring.walk(p.anchor))
    m = pool.prefix.match(p, (b.id for b in ready))
    got, why = choose(p, m, ready, walk, pool.prefix_rules)
    assert why == "prefix" and got is not None and got.id == walk[0]


def test_on_by_default_and_a_pool_that_turns_it_off_ignores_prompts() -> None:
    backends = (BackendCfg(id="w0", url="ws://127.0.0.1:9100"),)
    assert Pool(PoolCfg(name="p", backends=backends)).prefix is not None
    cfg = PoolCfg(name="p", backends=backends, prefix_placement=PrefixCfg(enabled=False))
    pool = Pool(cfg)
    assert pool.prefix is None
    p = prompt_of(chat("q"), pool.prefix_rules)
    assert pool.select("k", prompt=p) is pool.backends["w0"]
    assert not any(pool.prefix_placed.values())


# -- conversations across instances (rule 7) ---------------------------------------------------


def test_a_conversation_has_one_key_for_all_its_turns() -> None:
    one = prompt_of(chat("first question"), R)
    two = prompt_of(chat("first question", "an answer", "second question"), R)
    other = prompt_of(chat("another first question"), R)
    bare = prompt_of(chat("first question", system=None), R)
    completion = prompt_of(json.dumps({"prompt": "once upon a time"}).encode(), R)
    assert one is not None and two is not None and other is not None and bare is not None
    assert one.conversation is not None and one.conversation == two.conversation
    assert other.conversation != one.conversation  # the same system prompt, another talk
    assert bare.conversation not in (None, one.conversation)
    assert completion is not None and completion.conversation is None


def alternate_and_stay(a: Pool, b: Pool) -> None:
    """``b`` has sent the shared system prompt somewhere of its own choosing; then each turn
    of six conversations goes through the other pool, and every turn reaches the worker the
    first went to."""
    for n in range(4):
        place(b, chat(f"b's own conversation {n}"), key=f"b{n}")
    for n in range(6):
        turns = [f"question {n}"]
        where = []
        for t in range(4):
            pool = (a, b)[t % 2]
            where.append(place(pool, chat(*turns), key=f"c{n}.{t}"))
            turns += [f"answer {t}", f"next question {t}"]
        assert len(set(where)) == 1, (n, where)


def test_instances_sharing_the_tier_table_keep_a_conversation_together() -> None:
    """Two instances' pools, each with its own prefix table and bounds, one tier table (as
    cluster mode shares it through etcd): each turn of a conversation goes through the other
    instance, and every turn reaches the worker the first went to."""
    from balancer.cluster import Placements

    tier = Placements()
    a, b = make_pool(3), make_pool(3)
    a.placements, b.placements = tier.view("p"), tier.view("p")
    for pool in (a, b):
        for backend in pool.backends.values():
            backend.ready = True
    alternate_and_stay(a, b)


# -- rule 8: a response's continuation ------------------------------------------------------------


def test_the_response_an_answer_made_and_the_one_a_request_continues() -> None:
    def made(*parts: bytes) -> str | None:
        r = prefix.Report()
        for part in parts:
            r.feed(part)
        return r.response_id()

    body = {"id": "resp_1", "object": "response", "status": "completed"}
    assert made(json.dumps(body).encode()) == "resp_1"
    completed = {"type": "response.completed", "response": body}
    stream = (
        b"event: response.created\ndata: "
        + json.dumps({"type": "response.created", "response": body | {"id": "resp_1"}}).encode()
        + b"\n\n"
        + b'event: response.output_text.delta\ndata: {"type":"x","delta":"hi"}\n\n' * 3000
        + b"event: response.completed\ndata: "
        + json.dumps(completed).encode()
        + b"\n\n"
    )
    assert made(stream[:100], stream[100:]) == "resp_1"  # the tail, across reads
    # a chat completion, an id that is not a string or far too long, a bomb: none
    assert made(b'{"id": "chatcmpl-1", "object": "chat.completion"}') is None
    assert made(json.dumps(body | {"id": 7}).encode()) is None
    assert made(json.dumps(body | {"id": "r" * 300}).encode()) is None
    assert made(b"[" * 100_000) is None
    assert made(b'data: {"response": {"object": "chat.completion", "id": "x"}}\n\n') is None

    follow = {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}
    p = prompt_of(json.dumps(follow).encode(), R)
    assert p is not None and p.follows == "resp_1"
    assert prompt_of(json.dumps(follow | {"previous_response_id": ["x"]}).encode(), R) == (
        prompt_of(json.dumps({"model": "m", "input": "and then?"}).encode(), R)
    )
    event = json.dumps({"type": "response.create", **follow})
    ws = prefix.message_prompt(event, R)
    assert ws is not None and ws.follows == "resp_1"


def test_a_continuation_goes_where_its_response_was_made_whatever_the_load() -> None:
    """The follow-up names the response; its body is only the new input, so its prompt says
    nothing of where the history is. It goes to the worker that made the response even when
    that worker is far above its bound; the first worker to name an id keeps it."""
    pool = make_pool(balance_abs=1000)
    body = json.dumps({"model": "m", "instructions": SYSTEM, "input": "first"}).encode()
    home = place(pool, body, "k0")
    assert pool.responded("resp_a", pool.backends[home])
    others = [b for b in pool.backends.values() if b.id != home]
    assert not pool.responded("resp_a", others[0])  # a later claim is not believed
    pool.backends[home].sessions = 40  # far above any bound
    for n in range(5):
        follow = {"model": "m", "input": f"then {n}", "previous_response_id": "resp_a"}
        assert place(pool, json.dumps(follow).encode(), f"f{n}") == home
    assert pool.prefix_placed["response"] == 5
    # Not ready: placed by its prompt as any other request.
    pool.backends[home].ready = False
    follow = {"model": "m", "input": "then", "previous_response_id": "resp_a"}
    assert place(pool, json.dumps(follow).encode(), "g") != home
    # Unknown id: by its prompt.
    unknown = {"model": "m", "input": "then", "previous_response_id": "resp_zzz"}
    place(pool, json.dumps(unknown).encode(), "h")
    assert pool.prefix_placed["response"] == 5


def test_processes_sharing_a_board_send_a_continuation_home(tmp_path: Path) -> None:
    """``workers: N``: the response was made through one process, its continuation reaches
    another; the board they share says where it was made. The same board keeps a keyless
    conversation's turns together (prefix rule 7)."""
    from balancer.board import Board

    path = str(tmp_path / "board")
    Board(path, 2, None, create=True)  # the supervisor's
    a, b = make_pool(3), make_pool(3)
    for i, pool in enumerate((a, b)):
        pool.shared = Board(path, 2, i)
        for backend in pool.backends.values():
            backend.ready = True
    home = place(a, json.dumps({"model": "m", "input": "first"}).encode(), "k")
    assert a.responded("resp_b", a.backends[home])
    follow = {"model": "m", "input": "then", "previous_response_id": "resp_b"}
    assert place(b, json.dumps(follow).encode(), "f") == home
    alternate_and_stay(a, b)


def test_a_cache_salt_keeps_tenants_blocks_apart() -> None:
    """vLLM shares no cached blocks between ``cache_salt`` values, so the table does not
    either: the same prompt under two salts has no block in common, and a salted conversation
    still has one key for all its turns."""
    a = json.loads(chat("hello", "answer", "next"))
    salted = [prompt_of(json.dumps(a | {"cache_salt": t}).encode(), R) for t in ("t1", "t2")]
    plain = prompt_of(json.dumps(a).encode(), R)
    assert salted[0] is not None and salted[1] is not None and plain is not None
    assert not set(salted[0].hashes) & set(salted[1].hashes)
    assert not set(salted[0].hashes) & set(plain.hashes)
    first = prompt_of(json.dumps(json.loads(chat("hello")) | {"cache_salt": "t1"}).encode(), R)
    assert first is not None and first.conversation == salted[0].conversation is not None
