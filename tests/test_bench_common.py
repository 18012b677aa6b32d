"""bench/common.py: the helpers the benchmark scripts share (percentiles, wslb log and metrics)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.common import (
    cpu_sample,
    cpu_window,
    dist_version,
    log_problems,
    parse_sizes,
    pct,
    prom_by_label,
    prom_histogram,
)


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
