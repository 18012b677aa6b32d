"""Smoke test of ``bench/rollout.py``: its ``--quick`` path (24 sessions through a tier of three
instances replaced in turn, then one of them killed, and a burst of 40 resumes beside plain
upgrades through wslb and nginx), in well under a minute.

The script itself runs 300 sessions, three runs each; this runs the same code and checks the
report's shape and what must hold at any size: no token lost or repeated, no session closed
without a resume, every session that moved came back. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, child_env


def test_quick_rollout_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, str(ROOT / "bench" / "rollout.py"), "--quick", "--json", str(out)]
    done = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=150, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert {"machine", "args", "tier", "storm"} <= r.keys()
    assert "CPUs" in done.stdout.splitlines()[1]  # the machine line

    assert [t["how"] for t in r["tier"]] == ["sigterm", "kill"]
    for t in r["tier"]:
        assert t["sessions"] == 24 and t["tokens"] > 0
        assert t["lost"] == 0 and t["repeated"] == 0 and t["bad_text"] == 0, t
        assert t["closed"] == 0, t["close_reasons"]
        assert t["moved"] > 0 and t["reconnects"] >= t["moved"]
        assert sum(t["resumes_total"].values()) > 0 and not t["resumes_total"].get("unknown")
        for key in ("max_gap_s", "reconnect_s"):
            d = t[key]
            assert d["n"] > 0 and d["p50"] <= d["p99"] <= d["max"], (key, d)
        assert t["cpu"]["window_cpu_s"] > 0 and t["rss_mb"]["peak"] > 0
    sigterm, kill = r["tier"]
    assert len(sigterm["steps"]) == 3 and all(s["exit"] == 0 for s in sigterm["steps"])
    assert sigterm["moved"] == 24  # every session was on an instance that was replaced
    assert len(kill["steps"]) == 1 and kill["moved"] == max(kill["held_before"])
    # the victim was read before the kill, the others after: each resume was counted once
    assert kill["resumes_total"].get("reattached") == kill["reconnects"], kill["resumes_total"]

    kinds = [s["kind"] for s in r["storm"]]
    assert kinds == ["resume", "wslb plain", "nginx plain"]
    for s in r["storm"]:
        assert s["ok"] == s["n"] == 40 and s["errors"] == 0, s
        assert s["per_s"] > 0 and s["latency_s"]["p50"] <= s["latency_s"]["max"]
    assert "resume / nginx plain" in done.stdout and "| run |" in done.stdout
