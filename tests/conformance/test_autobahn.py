"""Autobahn fuzzingclient cases 1-7 and 10 through wslb: none may end worse than direct.

The echo worker alone is the baseline, so a case the worker itself fails does not count against
wslb; what does is any case whose verdict drops once wslb stands in between (autobahn.py ranks
the verdicts). Needs Python 2.7 for the testsuite: skipped where there is none, but a failed
install (no network) fails, so CI cannot pass without running the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance import autobahn

pytestmark = pytest.mark.conformance


def test_no_case_worse_through_wslb(tmp_path: Path) -> None:
    if not autobahn.python2_available():
        pytest.skip(
            f"{autobahn.PYTHON2} (PYENV_VERSION={autobahn.PYENV_VERSION}) is not available; "
            "the Autobahn testsuite only runs on Python 2.7"
        )
    autobahn.install()
    results = autobahn.run_comparison(tmp_path, autobahn.DEFAULT_CASES)
    table = autobahn.summary(results)
    assert set(results) == {"direct", "wslb"}, table
    assert len(results["direct"]) > 200, f"too few cases ran:\n{table}"

    details = f"{table}\nwire logs per case: {tmp_path / 'report' / 'index.html'}"
    worse = [str(d) for d in autobahn.compare(results) if d.worse]
    if worse:
        pytest.fail(
            f"{len(worse)} case(s) end worse through wslb:\n" + "\n".join(worse) + f"\n\n{details}",
            pytrace=False,
        )
    direct, wslb = autobahn.passing(results, "direct"), autobahn.passing(results, "wslb")
    assert wslb >= direct, f"OK+INFORMATIONAL: wslb {wslb} < direct {direct}\n{details}"
