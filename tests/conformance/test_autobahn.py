"""Autobahn fuzzingclient cases 1-7 and 10 through wslb (its plain listener, and its TLS
listener in wss://): none may end worse than direct.

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


def _require_python2() -> None:
    if not autobahn.python2_available():
        pytest.skip(
            f"{autobahn.PYTHON2} (PYENV_VERSION={autobahn.PYENV_VERSION}) is not available; "
            "the Autobahn testsuite only runs on Python 2.7"
        )


def _no_case_worse(results: autobahn.Results, agent: str, tmp_path: Path) -> None:
    """No case of ``agent`` ends worse than ``direct``, nor do fewer pass."""
    table = autobahn.summary(results, other=agent)
    assert set(results) == {"direct", agent}, table
    assert len(results["direct"]) > 200, f"too few cases ran:\n{table}"

    details = f"{table}\nwire logs per case: {tmp_path / 'report' / 'index.html'}"
    worse = [str(d) for d in autobahn.compare(results, other=agent) if d.worse]
    if worse:
        pytest.fail(
            f"{len(worse)} case(s) end worse through {agent}:\n"
            + "\n".join(worse)
            + f"\n\n{details}",
            pytrace=False,
        )
    direct, wslb = autobahn.passing(results, "direct"), autobahn.passing(results, agent)
    assert wslb >= direct, f"OK+INFORMATIONAL: {agent} {wslb} < direct {direct}\n{details}"


def test_no_case_worse_through_wslb(tmp_path: Path) -> None:
    _require_python2()
    autobahn.install()
    results = autobahn.run_comparison(tmp_path, autobahn.DEFAULT_CASES)
    _no_case_worse(results, autobahn.WSLB_AGENT, tmp_path)


@pytest.mark.slow  # about 27 s here
def test_no_case_worse_through_the_tls_listener(tmp_path: Path) -> None:
    """The same cases in ``wss://`` to a TLS listener of wslb (a self-signed ECDSA P-256
    certificate), compared with the worker directly: TLS changes no framing verdict."""
    _require_python2()
    autobahn.install()
    results = autobahn.run_comparison(tmp_path, autobahn.DEFAULT_CASES, tls=True)
    _no_case_worse(results, autobahn.TLS_AGENT, tmp_path)
