"""bench/lib: the helpers the benchmark scripts share (percentiles, wslb log and metrics), and the
rule that keeps them shared: no script imports another, nor anything of tests/ but its engines."""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path

import pytest

from bench.lib.cpu import cpu_sample, cpu_window
from bench.lib.machine import dist_version, machine, machine_line
from bench.lib.script import parse_sizes
from bench.lib.stats import hist_pct, pct, summary
from bench.lib.wslb import log_problems, prom_by_label, prom_histogram

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_pct_interpolates_between_ranks() -> None:
    assert math.isnan(pct([], 50))
    assert pct([7.0], 99) == 7.0
    assert pct([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert pct(list(range(101)), 99) == 99.0
    assert pct([1.0, 2.0], 0) == 1.0 and pct([1.0, 2.0], 100) == 2.0


def test_log_problems_folds_addresses_and_counts_tracebacks() -> None:
    text = "\n".join(
        [
            "2026-11-30 10:00:00,001 WARNING wslb.health: backend w1 at 127.0.0.1:9001 is down",
            "2026-11-30 10:00:01,001 WARNING wslb.health: backend w1 at 127.0.0.1:9002 is down",
            "2026-11-30 10:00:02,001 INFO wslb: listening",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "ValueError: session abc at 0x7f00",
        ]
    )
    problems = log_problems(text)
    assert problems["WARNING wslb.health: backend w1 at _ is down"] == 2
    assert problems["  raised ValueError: _ at _"] == 1
    assert sum(problems.values()) == 3


def test_cpu_window_counts_this_process() -> None:
    import os

    a = cpu_sample({"me": [os.getpid()]})
    sum(i * i for i in range(300_000))  # some CPU
    b = cpu_sample({"me": [os.getpid()]})
    w = cpu_window(a, b)
    assert w["me"] >= 0 and w["seconds"] > 0 and 0 <= w["machine"] <= 100


EXPOSITION = """\
# HELP wslb_failovers_total Sessions whose worker was lost, by outcome
# TYPE wslb_failovers_total counter
wslb_failovers_total{result="resumed"} 198.0
wslb_failovers_total{result="journal_over_limit"} 2.0
wslb_failovers_total_created 1.7e9
# TYPE wslb_failover_pause_seconds histogram
wslb_failover_pause_seconds_bucket{le="0.01"} 0.0
wslb_failover_pause_seconds_bucket{le="0.1"} 150.0
wslb_failover_pause_seconds_bucket{le="1.0"} 197.0
wslb_failover_pause_seconds_bucket{le="+Inf"} 198.0
wslb_failover_pause_seconds_count 198.0
wslb_failover_pause_seconds_sum 19.8
"""


def test_prom_by_label_and_histogram() -> None:
    assert prom_by_label(EXPOSITION, "wslb_failovers_total", "result") == {
        "resumed": 198,
        "journal_over_limit": 2,
    }
    h = prom_histogram(EXPOSITION, "wslb_failover_pause_seconds")
    assert h.count == 198 and math.isclose(h.mean, 0.1)
    assert h.quantile(50) == 0.1 and h.quantile(99) == 1.0 and h.quantile(100) == math.inf
    empty = prom_histogram(EXPOSITION, "wslb_migration_pause_seconds")
    assert empty.count == 0 and math.isnan(empty.quantile(50))


def test_parse_sizes_takes_a_list_and_names_what_is_wrong() -> None:
    assert parse_sizes("50") == [50] and parse_sizes("50, 100,200,") == [50, 100, 200]
    with pytest.raises(argparse.ArgumentTypeError, match="expected N or N,N"):
        parse_sizes("50,lots")
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        parse_sizes("0,5")
    assert dist_version("uvloop")[0].isdigit() and dist_version("no-such-dist-x") == "absent"


def test_hist_pct_and_summary_read_a_histogram_as_a_list() -> None:
    hist = {0: 50, 9: 49, 100: 1}  # bins: the middle of each is the value
    assert hist_pct(hist, 50) == 0.5 and hist_pct(hist, 99) == 9.5 and hist_pct(hist, 100) == 100.5
    assert math.isnan(hist_pct({}, 50))
    assert summary(hist, (50, 99, 99.9), unit="_us") == {
        "n": 100,
        "p50_us": 0.5,
        "p99_us": 9.5,
        "p999_us": 100.5,
        "max_us": 100.5,
    }
    values = [4.0, 1.0, 3.0, 2.0]
    assert summary(values, (50, 90, 99)) == {
        "n": 4,
        "p50": 2.5,
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": 4.0,
    }
    assert summary(values, peak=False) == {"n": 4, "p50": 2.5, "p99": pct(values, 99)}
    empty = summary([])
    assert empty["n"] == 0 and math.isnan(empty["p50"]) and math.isnan(empty["max"])


def test_one_machine_line_from_one_record() -> None:
    info = machine()
    line = machine_line(info)
    assert f"{info['nproc']} CPUs ({info['cpu']})" in line
    assert f"Python {info['python']}" in line and f"uvloop {info['uvloop']}" in line
    assert "\n" not in line and machine_line() == line


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, anywhere in it (a function's lazy import too); ``from
    bench import x`` counts as ``bench.x``, a relative import as its dots."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module in ("bench", "tests"):
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _allowed(mod: str, in_lib: bool) -> bool:
    top = mod.split(".")[0]
    if mod.startswith("."):
        return False
    if top == "bench":
        return mod == "bench.lib" or mod.startswith("bench.lib.")
    if top == "tests":
        return not in_lib and mod in ("tests.engines", "tests.tier")
    return True


def test_no_bench_script_imports_another_nor_the_tests() -> None:
    """What the scripts share lives in bench/lib, so that a script can change without breaking
    another and the launcher has one home (tests/procs.py re-exports it). Of tests/ a script
    may use only the llama-server build cache (tests.engines) and the etcd-and-HAProxy tier
    (tests.tier); bench/lib nothing at all."""
    scripts = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")
    lib = sorted((BENCH / "lib").glob("*.py"))
    assert len(scripts) >= 9 and lib
    wrong = [
        f"{path.relative_to(BENCH)} imports {mod}"
        for path in scripts + lib
        for mod in sorted(_imports(path))
        if not _allowed(mod, path.parent.name == "lib")
    ]
    assert not wrong, "\n".join(wrong)
