"""Unit tests of the simulated model (backends.model): no I/O, no sleeping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.model import (
    KVCache,
    Model,
    ModelConfig,
    PendingAnswer,
    Prompt,
    QueuedPrompt,
    SessionSnapshot,
    TurnPhase,
    TurnResult,
    token_text,
)


def run_turn(
    model: Model, sid: str, prompt: Prompt, max_tokens: int, now: float = 0.0
) -> TurnResult:
    """Drive one turn to completion, as the worker does but without waiting."""
    turn = model.start_turn(sid, prompt, max_tokens, now)
    model.begin_decode(turn)
    while turn.remaining:
        model.emit(turn)
    return model.finish(turn)


def text(s: str) -> Prompt:
    return Prompt.from_text(s)


# -- token_text ---------------------------------------------------------------------------


def test_token_text_is_documented_format() -> None:
    t = token_text("alice", 3, 7)
    assert t.startswith("t3.7-")
    assert len(t.split("-")[1]) == 8
    assert t == token_text("alice", 3, 7)


@given(st.text(), st.integers(1, 10**6), st.integers(0, 10**6))
def test_token_text_is_pure_and_one_word(session: str, turn: int, i: int) -> None:
    t = token_text(session, turn, i)
    assert t == token_text(session, turn, i)
    assert t.split() == [t]
    assert t.startswith(f"t{turn}.{i}-")


def test_token_text_depends_on_session() -> None:
    assert token_text("a", 1, 0) != token_text("b", 1, 0)


def test_emitted_tokens_follow_token_text() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("hi"), 3, 0.0)
    model.begin_decode(turn)
    toks = [model.emit(turn) for _ in range(3)]
    assert [(t.turn, t.i, t.text) for t in toks] == [
        (1, i, token_text("s", 1, i)) for i in range(3)
    ]
    with pytest.raises(RuntimeError):
        model.emit(turn)


# -- context and KV hits --------------------------------------------------------------------


def test_second_turn_hits_cache_for_whole_conversation() -> None:
    model = Model(ModelConfig(prefill_ms_per_token=1.0))
    model.attach("s", 0.0)
    first = run_turn(model, "s", text("one two three"), 4)
    assert (first.turn, first.tokens, first.cached_tokens, first.prefill_ms) == (1, 4, 0, 3.0)
    second = run_turn(model, "s", text("four five"), 2)
    assert second.turn == 2
    assert second.cached_tokens == 3 + 4  # prompt 1 + answer 1
    assert second.prefill_ms == pytest.approx(2.0)
    state = model.session("s")
    assert state is not None
    assert state.context[:3] == ["one", "two", "three"]
    assert state.context[3:7] == [token_text("s", 1, i) for i in range(4)]
    assert len(state.context) == 3 + 4 + 2 + 2
    stats = model.stats()
    assert stats.kv_hit_tokens_total == 7
    assert stats.prefill_tokens_total == 3 + 2
    assert stats.decode_tokens_total == 6


def test_messages_replace_context_and_hit_common_prefix() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    run_turn(model, "s", text("a b c"), 2)
    answer = [token_text("s", 1, 0), token_text("s", 1, 1)]
    # The whole conversation resent, as chat-completions clients do: all of it is cached.
    msgs = Prompt.from_messages(["a b c", " ".join(answer), "d e"])
    assert msgs.replace
    turn = model.start_turn("s", msgs, 0, 0.0)
    assert turn.cached_tokens == 5
    assert turn.prefill_tokens == 2
    model.finish(turn)
    state = model.session("s")
    assert state is not None
    assert state.context == ["a", "b", "c", *answer, "d", "e"]
    # A different history shares only its leading tokens.
    turn = model.start_turn("s", Prompt.from_messages(["a b x y"]), 0, 0.0)
    assert turn.cached_tokens == 2
    model.finish(turn)
    assert state.context == ["a", "b", "x", "y"]


def test_cache_is_shared_by_sessions_up_to_where_they_differ() -> None:
    model = Model(ModelConfig())
    model.attach("a", 0.0)
    model.attach("b", 0.0)
    run_turn(model, "a", text("same words here"), 1)
    result = run_turn(model, "b", text("same words here"), 1)
    assert result.cached_tokens == 3  # a's prompt; its answer's tokens are a's own
    after = run_turn(model, "b", text("more"), 0)
    assert after.cached_tokens == 3 + 1


def test_cancel_keeps_produced_tokens_only() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("x y"), 10, 0.0)
    model.begin_decode(turn)
    model.emit(turn)
    model.emit(turn)
    result = model.finish(turn)
    assert result.tokens == 2
    assert model.finish(turn) == result  # idempotent
    state = model.session("s")
    assert state is not None
    assert state.context == ["x", "y", token_text("s", 1, 0), token_text("s", 1, 1)]
    nxt = run_turn(model, "s", text("z"), 0)
    assert nxt.cached_tokens == 4


def test_cancel_during_prefill_caches_nothing_new() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("x y"), 10, 0.0)
    assert model.stats().prefilling == 1
    assert model.finish(turn).tokens == 0
    assert model.stats().prefilling == 0
    assert model.cached("s") == 0
    assert model.stats().kv_used_tokens == 0


def test_negative_max_tokens_rejected_and_unknown_session() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    with pytest.raises(ValueError):
        model.start_turn("s", text("x"), -1, 0.0)
    with pytest.raises(KeyError):
        model.start_turn("nobody", text("x"), 1, 0.0)


# -- KV cache LRU -----------------------------------------------------------------------------


def filled(kv: KVCache, tokens: list[str]) -> int:
    """Cache ``tokens`` as a finished answer leaves them: inserted, then released."""
    held: list[int] = []
    n = kv.insert(kv.chain(tokens), held)
    kv.release(held)
    return n


def test_kv_blocks_are_shared_by_prefix_and_evicted_lru_tail_first() -> None:
    kv = KVCache(10, block_tokens=2)
    assert kv.max_blocks == 5
    a = ["s", "y", "s", "a", "a", "a"]  # blocks (s y) (s a) (a a)
    b = ["s", "y", "s", "b", "b"]  # (s y) (s b), and a partial block never cached
    assert filled(kv, a) == 3
    assert filled(kv, b) == 2
    assert kv.used == 8  # (s y) once
    assert kv.peek(kv.chain(b)) == 2
    assert kv.peek(kv.chain(["s", "y", "x", "x"])) == 1  # the shared leading block only
    assert kv.peek(kv.chain(["y", "s", "s", "a"])) == 0  # same tokens, another prefix
    c = ["c"] * 4
    assert filled(kv, c) == 2  # 6 blocks > 5: the least recent evicts, a's deepest, (a a)
    assert kv.used == 10
    assert kv.peek(kv.chain(a)) == 2
    assert filled(kv, ["d"] * 2) == 1  # then (s a): a's tail before the (s y) b shares
    assert kv.peek(kv.chain(a)) == 1
    assert kv.peek(kv.chain(b)) == 2


def test_kv_held_blocks_are_not_evicted_and_over_capacity_is_capped() -> None:
    kv = KVCache(4)
    held: list[int] = []
    assert kv.insert(kv.chain(list("abcdefgh")), held) == 4  # the rest does not fit
    assert (kv.used, kv.held) == (4, 4)
    assert filled(kv, ["x"]) == 0  # all held: nothing evictable, not cached
    kv.release(held)
    assert (kv.used, kv.held) == (4, 0)
    assert kv.peek(kv.chain(list("abcdefgh"))) == 4
    assert filled(kv, ["x"]) == 1  # now d, the deepest, goes
    assert kv.peek(kv.chain(list("abcd"))) == 3
    zero = KVCache(0)
    assert filled(zero, ["x"]) == 0
    assert zero.used == 0
    with pytest.raises(ValueError):
        KVCache(10, block_tokens=0)


def test_kv_chain_extends_as_its_list_grows() -> None:
    kv = KVCache(100, block_tokens=2)
    toks = ["a", "b", "c"]
    chain = kv.chain(toks)
    assert len(chain.hashes) == 1
    toks.append("d")
    assert chain.update() == 2
    assert chain.hashes == kv.chain(["a", "b", "c", "d"]).hashes


def test_sessions_share_a_prefix_and_only_full_blocks_count() -> None:
    model = Model(ModelConfig(prefill_ms_per_token=1.0, kv_block_tokens=4))
    system = "you are a helpful assistant who answers briefly"  # 8 words: 2 blocks
    for sid in ("a", "b"):
        model.attach(sid, 0.0)
    first = run_turn(model, "a", Prompt.from_messages([system, "hi"]), 3)
    assert first.cached_tokens == 0
    second = run_turn(model, "b", Prompt.from_messages([system, "hello there"]), 1)
    assert (second.cached_tokens, second.prefill_ms) == (8, pytest.approx(2.0))
    # a's own follow-up: its prompt, answer and the new words, in whole blocks (12 of 14).
    again = run_turn(model, "a", text("and more"), 1)
    assert again.cached_tokens == 12


def test_model_eviction_lowers_later_hits() -> None:
    model = Model(ModelConfig(kv_capacity_tokens=10))
    for sid in ("a", "b"):
        model.attach(sid, 0.0)
    run_turn(model, "a", text("1 2 3 4"), 2)  # a caches 6
    run_turn(model, "b", text("5 6 7 8"), 2)  # b caches 6 -> a cut to 4
    assert model.cached("a") == 4
    assert model.stats().kv_used_tokens == 10
    result = run_turn(model, "a", text("9"), 0)
    assert result.cached_tokens == 4


# -- ttl ----------------------------------------------------------------------------------------


def test_session_kept_within_ttl_and_swept_after() -> None:
    model = Model(ModelConfig(session_ttl=10.0))
    model.attach("s", 0.0)
    run_turn(model, "s", text("hello"), 2)
    model.detach("s", 100.0)
    assert model.stats(105.0).active_sessions == 0
    assert model.stats(105.0).held_sessions == 1
    state = model.attach("s", 109.0)  # reconnect within ttl: same conversation
    assert state.turns == 1
    assert run_turn(model, "s", text("again"), 1, now=109.0).turn == 2
    model.detach("s", 110.0)
    assert model.sweep(119.9) == 0
    assert model.sweep(120.0) == 1
    assert model.session("s") is None
    assert model.cached("s") == 0
    assert model.stats().kv_used_tokens == 1 + 2 + 1 + 1  # its blocks stay, evictable
    fresh = model.attach("s", 121.0)
    assert fresh.turns == 0
    assert fresh.context == []


def test_ttl_counts_from_last_connection() -> None:
    model = Model(ModelConfig(session_ttl=5.0))
    model.attach("s", 0.0)
    model.attach("s", 0.0)
    model.detach("s", 1.0)
    assert model.stats(100.0).active_sessions == 1
    assert model.session("s") is not None
    model.detach("s", 100.0)
    assert model.stats(104.0).held_sessions == 1
    assert model.stats(105.0).held_sessions == 0


def test_sweep_keeps_session_with_running_turn() -> None:
    model = Model(ModelConfig(session_ttl=0.0))
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("x"), 5, 0.0)
    model.detach("s", 1.0)
    assert model.sweep(2.0) == 0
    model.finish(turn)
    assert model.sweep(3.0) == 1


# -- timing and load ----------------------------------------------------------------------------


def start_decoding(model: Model, n: int) -> None:
    for k in range(n):
        sid = f"s{k}"
        model.attach(sid, 0.0)
        model.begin_decode(model.start_turn(sid, text("x"), 100, 0.0))


def test_decode_rate_full_speed_up_to_max_batch_then_proportional() -> None:
    model = Model(ModelConfig(tokens_per_s=100.0, max_batch=4))
    assert model.token_delay() == pytest.approx(0.01)
    start_decoding(model, 4)
    assert model.token_delay() == pytest.approx(0.01)
    assert model.stats().gpu_utilization == pytest.approx(1.0)
    assert model.stats().queue_depth == 0
    start_decoding(model, 4)  # 8 streams over a batch of 4: each at half speed
    assert model.decoding == 8
    assert model.token_delay() == pytest.approx(0.02)
    assert model.stats().queue_depth == 4
    assert model.stats().gpu_utilization == pytest.approx(1.0)


def test_gpu_utilization_scales_with_streams() -> None:
    model = Model(ModelConfig(max_batch=4))
    assert model.stats().gpu_utilization == 0.0
    start_decoding(model, 1)
    assert model.stats().gpu_utilization == pytest.approx(0.25)


def test_background_util_slows_everything_and_floors_utilization() -> None:
    base = Model(ModelConfig(tokens_per_s=100.0, prefill_ms_per_token=1.0))
    busy = Model(ModelConfig(tokens_per_s=100.0, prefill_ms_per_token=1.0, background_util=0.5))
    for model in (base, busy):
        model.attach("s", 0.0)
    t_base = base.start_turn("s", text("a b c d"), 1, 0.0)
    t_busy = busy.start_turn("s", text("a b c d"), 1, 0.0)
    assert t_busy.prefill_ms == pytest.approx(2 * t_base.prefill_ms) == pytest.approx(8.0)
    assert busy.token_delay() == pytest.approx(2 * base.token_delay())
    assert busy.stats().gpu_utilization == pytest.approx(0.5)
    assert base.stats().gpu_utilization == 0.0


@pytest.mark.parametrize("tps", [0.0, 1e6, 5e6])
def test_unlimited_decode_has_no_delay(tps: float) -> None:
    model = Model(ModelConfig(tokens_per_s=tps))
    start_decoding(model, 100)
    assert model.token_delay() == 0.0


def test_active_sessions_and_phases() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("x"), 1, 0.0)
    phases = [turn.phase]
    assert model.stats().prefilling == 1
    model.begin_decode(turn)
    phases.append(turn.phase)
    assert (model.stats().prefilling, model.stats().decoding) == (0, 1)
    model.finish(turn)
    phases.append(turn.phase)
    assert phases == [TurnPhase.PREFILL, TurnPhase.DECODE, TurnPhase.DONE]
    stats = model.stats()
    assert (stats.active_sessions, stats.decoding, stats.queue_depth) == (1, 0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokens_per_s": -1.0},
        {"prefill_ms_per_token": -0.1},
        {"kv_capacity_tokens": -1},
        {"session_ttl": -1.0},
        {"max_batch": 0},
        {"background_util": 1.0},
        {"background_util": -0.1},
        {"kv_transfer_ms_per_token": -0.1},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


# -- handoff: freeze, thaw, resume ---------------------------------------------------------


def mid_answer(model: Model, sid: str = "s", produced: int = 3) -> SessionSnapshot:
    """One finished turn, then freeze the second after ``produced`` of its 10 tokens."""
    model.attach(sid, 0.0)
    run_turn(model, sid, text("a b c"), 2)
    turn = model.start_turn(sid, text("d e"), 10, 0.0)
    model.begin_decode(turn)
    for _ in range(produced):
        model.emit(turn)
    queued = [QueuedPrompt(text("next one"), 4)]
    return model.freeze(sid, turn, queued)


def test_freeze_exports_position_and_forgets_session() -> None:
    model = Model(ModelConfig(prefill_ms_per_token=1.0))
    snap = mid_answer(model)
    context = ["a", "b", "c", token_text("s", 1, 0), token_text("s", 1, 1), "d", "e"]
    context += [token_text("s", 2, i) for i in range(3)]
    assert snap == SessionSnapshot(
        session="s",
        context=tuple(context),
        turns=2,
        kv_cached=len(context),
        answer=PendingAnswer(2, 3, 10, cached_tokens=5, prefill_ms=2.0),
        queued=(QueuedPrompt(text("next one"), 4),),
    )
    stats = model.stats()
    assert (stats.active_sessions, stats.held_sessions, stats.decoding) == (0, 0, 0)
    assert stats.kv_used_tokens == len(context)  # its blocks stay here, evictable
    assert stats.kv_cache_usage == 0.0
    model.detach("s", 1.0)  # the frozen connection closing later changes nothing
    assert model.stats().active_sessions == 0
    with pytest.raises(KeyError):
        model.freeze("s")


def test_thaw_with_kv_transfer_resumes_at_next_token() -> None:
    a = Model(ModelConfig(prefill_ms_per_token=1.0))
    snap = mid_answer(a)
    b = Model(ModelConfig(prefill_ms_per_token=1.0, kv_transfer_ms_per_token=0.1))
    transfer_s = b.thaw(snap, 0.0, transfer_kv=True)
    assert transfer_s == pytest.approx(len(snap.context) * 0.1 / 1000)
    assert b.cached("s") == len(snap.context)
    assert b.stats().kv_transfer_tokens_total == len(snap.context)
    assert not b.connected("s")
    b.attach("s", 0.0)
    assert snap.answer is not None
    turn = b.resume_turn("s", snap.answer, transfer_s)
    assert (turn.turn, turn.produced, turn.remaining) == (2, 3, 7)
    assert turn.delay_s == pytest.approx(transfer_s)  # nothing to prefill again
    b.begin_decode(turn)
    toks = [b.emit(turn) for _ in range(turn.remaining)]
    assert [(t.i, t.text) for t in toks] == [(i, token_text("s", 2, i)) for i in range(3, 10)]
    result = b.finish(turn)
    assert (result.turn, result.tokens, result.cached_tokens) == (2, 10, 5)
    assert result.prefill_ms == pytest.approx(2.0)  # as measured when the turn started on A
    nxt = b.start_turn("s", snap.queued[0].prompt, 4, 0.0)
    assert (nxt.turn, nxt.cached_tokens) == (3, 3 + 2 + 2 + 10)


def test_thaw_with_prefill_prefills_context_again() -> None:
    a = Model(ModelConfig(prefill_ms_per_token=1.0))
    snap = mid_answer(a)
    b = Model(ModelConfig(prefill_ms_per_token=1.0))
    assert b.thaw(snap, 0.0, transfer_kv=False) == 0.0
    assert b.cached("s") == 0
    b.attach("s", 0.0)
    assert snap.answer is not None
    turn = b.resume_turn("s", snap.answer)
    assert turn.delay_s == pytest.approx(len(snap.context) / 1000)
    assert b.stats().prefill_tokens_total == len(snap.context)
    assert b.stats().kv_transfer_tokens_total == 0


def test_freeze_during_prefill_transfers_only_old_prefix() -> None:
    a = Model(ModelConfig(prefill_ms_per_token=1.0))
    a.attach("s", 0.0)
    run_turn(a, "s", text("a b"), 1)
    turn = a.start_turn("s", text("c d e"), 5, 0.0)  # still prefilling
    snap = a.freeze("s", turn)
    assert a.stats().prefilling == 0
    assert snap.answer == PendingAnswer(2, 0, 5, cached_tokens=3, prefill_ms=3.0)
    assert (len(snap.context), snap.kv_cached) == (6, 3)
    b = Model(ModelConfig(prefill_ms_per_token=1.0))
    b.thaw(snap, 0.0)
    b.attach("s", 0.0)
    resumed = b.resume_turn("s", snap.answer)
    assert resumed.delay_s == pytest.approx(3 / 1000)  # the new prompt, not yet cached on A


def test_freeze_keeps_cancel_and_idle_session_has_no_answer() -> None:
    model = Model(ModelConfig())
    model.attach("s", 0.0)
    turn = model.start_turn("s", text("x"), 5, 0.0)
    model.begin_decode(turn)
    model.emit(turn)
    snap = model.freeze("s", turn, cancelled=True)
    assert snap.answer is not None
    assert snap.answer.cancelled
    model.attach("t", 0.0)
    run_turn(model, "t", text("y"), 1)
    assert model.freeze("t").answer is None


def test_thaw_refuses_connected_and_replaces_disconnected_copy() -> None:
    model = Model(ModelConfig(session_ttl=10.0))
    snap = mid_answer(Model(ModelConfig()))
    model.attach("s", 0.0)
    run_turn(model, "s", text("stale"), 1)
    with pytest.raises(ValueError):
        model.thaw(snap, 0.0)
    model.detach("s", 1.0)
    model.thaw(snap, 1.0)
    state = model.session("s")
    assert state is not None
    assert (tuple(state.context), state.turns) == (snap.context, 2)
    # Never resumed: it goes after the ttl like any disconnected session.
    assert model.stats(12.0).held_sessions == 0
    assert model.cached("s") == 0


def test_signals_count_running_work_as_vllm_does() -> None:
    """kv_cache_usage: the contexts of answers in progress (idle sessions' cached prefixes are
    evictable, so free); queue_depth: streams beyond the batch (a prefill is running work)."""
    model = Model(ModelConfig(kv_capacity_tokens=100, max_batch=1))
    for sid in ("idle", "a", "b"):
        model.attach(sid, 0.0)
    run_turn(model, "idle", text("1 2 3 4 5 6 7 8"), 2)  # 10 tokens cached, nothing running
    stats = model.stats()
    assert (stats.kv_used_tokens, stats.kv_cache_usage, stats.queue_depth) == (10, 0.0, 0)
    turn_a = model.start_turn("a", text("x y z"), 5, 0.0)  # prefilling: running, not waiting
    stats = model.stats()
    assert stats.kv_cache_usage == pytest.approx(0.03)
    assert stats.queue_depth == 0
    model.begin_decode(turn_a)
    model.begin_decode(model.start_turn("b", text("p q"), 5, 0.0))  # over a batch of 1
    stats = model.stats()
    assert stats.kv_cache_usage == pytest.approx(0.05)
    assert stats.queue_depth == 1
    model.finish(turn_a)
    assert model.stats().kv_cache_usage == pytest.approx(0.02)
