"""bench/routing.py's sweep: its draws are reproducible from the seed and feasible, and its
verdicts are the issue's targets (no processes started)."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

from bench import routing
from bench.lib import keyless


def test_the_sweep_draws_are_seeded_and_cover_the_issue_ranges() -> None:
    cases = routing.sweep_cases(12, 7, 30.0)
    assert cases == routing.sweep_cases(12, 7, 30.0)
    assert cases != routing.sweep_cases(12, 8, 30.0)
    assert [c.kind == "identical" for c in cases] == [i % 2 == 0 for i in range(12)]
    assert {c.kind for c in cases[1::2]} <= {"slowed", "mixed"}
    for c in cases:
        w, wp = c.workload, c.workers
        assert 3 <= wp.count <= 8 and w.sessions <= 72
        assert 2 <= w.turns[0] <= w.turns[1] <= 8
        # Each worker's KV holds its balanced share of the longest conversations, 1.4-3 times.
        longest = w.system_words + w.turns[1] * (sum(w.prompt_words) + sum(w.answer_tokens)) / 2
        need = w.sessions / wp.count * longest
        assert 1.4 <= c.kv_factor <= 3.0
        assert math.isclose(wp.kv_capacity_tokens, c.kv_factor * need, rel_tol=0.01)
        if c.kind == "identical":
            assert wp.mixed == ()
        else:
            assert len(wp.mixed) == wp.count
        if c.kind == "slowed":
            assert sum(bg > 0 for _, _, bg in wp.mixed) == 1


def test_worker_args_apply_the_mixed_factors() -> None:
    wp = routing.WorkerParams(
        count=2,
        tokens_per_s=40.0,
        prefill_ms_per_token=1.0,
        kv_capacity_tokens=10_000,
        max_batch=8,
        session_ttl=300.0,
        hot_background_util=0.6,
        mixed=((0.5, 2.0, 0.0), (1.0, 1.0, 0.4)),
    )
    a0, a1 = wp.args(0, hot=False), wp.args(1, hot=False)
    assert a0[a0.index("--tokens-per-s") + 1] == "20"
    assert a0[a0.index("--kv-capacity-tokens") + 1] == "20000"
    assert "--background-util" not in a0
    assert a1[a1.index("--background-util") + 1] == "0.4"
    hot = wp.args(0, hot=True)
    assert hot[hot.index("--background-util") + 1] == "0.6"


def _result(mode: str, p99: float, changed: int, hit: float) -> routing.Result:
    nan = math.nan
    return routing.Result(
        run="s1",
        mode=mode,
        sessions=10,
        turns=40,
        hit=hit,
        ideal=0.8,
        ttft_first_p50=nan,
        ttft_first_p99=nan,
        ttft_follow_p50=nan,
        ttft_follow_p99=p99,
        follow_turns=30,
        follow_missed=0,
        follow_moved=0,
        ttft_follow_p99_persistent=nan,
        ttft_follow_p99_reconnect=nan,
        hit_reconnect=nan,
        ideal_reconnect=nan,
        connect_p99=nan,
        tokens_per_s=nan,
        stream_tokens_per_s=nan,
        peak_sessions=0,
        mean_sessions=0.0,
        imbalance=nan,
        weight_spread=nan,
        bound_ratio_max=nan,
        bound_over_polls=nan,
        changed=changed,
        failed=0,
        failures=[],
        worker_turn_share={},
        mean_weight={},
        mean_kv_usage={},
        duration_s=1.0,
    )


def test_the_verdicts_are_the_issue_targets() -> None:
    rr, hp = _result("round_robin", 0.6, 9, 0.3), _result("haproxy", 0.5, 5, 0.6)
    good = _result(routing.NEW, 0.1, 0, 0.8)
    rs = {"round_robin": rr, "haproxy": hp, routing.NEW: good}
    assert all("MET" in v for v in routing.verdicts(good, rs, identical=True))
    assert len(routing.verdicts(good, rs, identical=True)) == 3
    moved = _result(routing.NEW, 0.1, 1, 0.8)
    assert "MISSED" in routing.verdicts(moved, rs, identical=True)[0]
    cold = _result(routing.NEW, 0.1, 0, 0.77)  # 96% of the ideal
    assert "MISSED" in routing.verdicts(cold, rs, identical=True)[1]
    slow = _result(routing.NEW, 0.31, 0, 0.8)  # above half of round robin's 0.6
    assert "MISSED" in routing.verdicts(slow, rs, identical=True)[2]
    # A slowed worker: only HAProxy's p99 is the target.
    (only,) = routing.verdicts(_result(routing.NEW, 0.5, 3, 0.7), rs, identical=False)
    assert "HAProxy" in only and "MET" in only
    (only,) = routing.verdicts(_result(routing.NEW, 0.51, 0, 0.8), rs, identical=False)
    assert "MISSED" in only


def test_keyless_quick_run_places_by_prefix_and_writes_only_its_section(tmp_path: Path) -> None:
    """``--workload keyless --quick`` through real wslb processes in front of reference workers
    (the peers need installing, so they are left out): every turn answered and traced to its
    engine, prefix placement keeps each conversation on one engine where round robin moves
    them, and the doc gets the section between its markers and nothing else changes."""
    doc = tmp_path / "routing.md"
    doc.write_text("# Routing\n\nkept\n")
    raw = tmp_path / "keyless.json"
    argv = ["--workload", "keyless", "--quick", "--routers", "wslb-keyless,wslb-round_robin"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert routing.main([*argv, "--doc", str(doc), "--json", str(raw)]) == 0
    finally:  # main() makes both signals exit the script
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    by = {r["router"]: r for r in json.loads(raw.read_text())}
    assert set(by) == {"wslb-keyless", "wslb-round_robin"}
    for r in by.values():
        assert r["failed"] == 0 and sum(r["per_engine"].values()) == 12  # 6 x 2 turns
        assert 0 < r["prefilled"] < r["prompt"]
    prefix, rr = by["wslb-keyless"], by["wslb-round_robin"]
    assert prefix["changed"] == 0 and prefix["reprefilled"] == 0
    assert prefix["prefilled"] <= rr["prefilled"] and prefix["prompt"] == rr["prompt"]
    text = doc.read_text()
    assert text.startswith("# Routing\n\nkept\n") and keyless.TITLE in text
    # A rewrite replaces the measured part and keeps the hand-written analysis after it.
    analysed = text.replace(keyless.ANALYSIS, keyless.ANALYSIS + "\nby hand\n")
    doc.write_text(analysed)
    keyless.write_section(doc, "new figures")
    again = doc.read_text()
    assert again.startswith("# Routing\n\nkept\n") and keyless.TITLE not in again
    assert "new figures" in again and "by hand" in again and again.endswith(keyless.END + "\n")


def _keyless_run(router: str, prefilled: int, per_engine: dict[str, int]) -> keyless.RunResult:
    return keyless.RunResult(
        router, 1, 60000, prefilled, 24, 0, 48, 0, 0.1, 0.2, 0.1, per_engine, 0, {}, 1.0
    )


def test_the_keyless_verdicts_hold_each_row_to_its_own_bound() -> None:
    """The default rows (``prefix_placement.balance_factor`` 1.5) may send an engine 1.5
    shares, not more; the ``-1.25`` rows 1.25; tokens against SGLang's gateway: keyless no
    more, keyed less."""
    piled = {"e1": 36, "e2": 18, "e3": 18}  # 1.5 shares
    rs = [
        _keyless_run("smg", 9000, {"e1": 40, "e2": 16, "e3": 16}),
        _keyless_run("wslb-keyless-1.25", 9500, {"e1": 27, "e2": 23, "e3": 22}),
        _keyless_run("wslb-keyed-1.25", 9000, piled),
        _keyless_run("wslb-keyless", 9000, piled),
        _keyless_run("wslb-keyed", 8000, {"e1": 37, "e2": 18, "e3": 17}),
    ]
    verdicts = {v.split(":")[1].split()[0]: v for v in keyless.targets(rs) if "prefills" in v}
    assert verdicts["wslb-keyless-1.25"].startswith("- MISSED")  # 9,500 > 9,000
    assert verdicts["wslb-keyed-1.25"].startswith("- MISSED")  # not less
    assert verdicts["wslb-keyless"].startswith("- MET")  # equal is enough without a key
    assert verdicts["wslb-keyed"].startswith("- MET")
    bounds = {v.split(":")[1].split()[0]: v for v in keyless.targets(rs) if "sends no" in v}
    assert bounds["wslb-keyless-1.25"].startswith("- MET")  # 27 <= ceil(1.25 x 24) = 30
    assert bounds["wslb-keyed-1.25"].startswith("- MISSED")  # 36 > 30
    assert bounds["wslb-keyed-1.25"].endswith("this size, 36)")  # 30 + sqrt(30), rounded up
    assert bounds["wslb-keyless"].startswith("- MET")  # 36 <= 36
    assert bounds["wslb-keyed"].startswith("- MISSED")  # 37 > 36
