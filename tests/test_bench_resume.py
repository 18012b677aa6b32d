"""Smoke test of ``bench/resume.py``: its ``--quick`` path (30 sessions, a blip a second for
4 s, a few sessions detached at once, one CPU window per setting), in seconds.

The script itself runs 1,000 sessions for 2 minutes (``docs/benchmarks.md``); this runs the
same code and checks the report's shape and what must hold at any size: every blip resumed,
no message lost or repeated, the counts wslb returned right. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, child_env


def test_quick_run_resumes_every_blip_losing_nothing(tmp_path: Path) -> None:
    out = tmp_path / "resume.json"
    cmd = [sys.executable, str(ROOT / "bench" / "resume.py"), "--quick", "--json", str(out)]
    done = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert {"machine", "args", "blips", "cpu"} <= r.keys()
    assert "CPUs" in done.stdout.splitlines()[1]  # the machine line

    b = r["blips"]
    assert b["sessions"] == 30 and len(b["rounds"]) >= 3
    assert b["cuts_in_blips"] > 0 and b["resumes_in_blips"] == b["cuts_in_blips"]
    e = b["errors"]
    assert e["lost"] == 0 and e["repeated"] == 0, e
    assert e["out_of_order"] == 0 and e["bad_text"] == 0 and e["bad_resumed_header"] == 0, e
    assert e["refused"] == 0 and e["client_exceptions"] == 0, (e, b["refusals"])
    assert e["closes"] == 0 and e["stalled"] == 0, (e, b["close_reasons"])
    assert b["tokens"] > 0 and b["answers_done"] > 0
    # wslb saw each resume: its counter and its events agree with the clients.
    assert b["resumes_total"].get("resumed") == b["resumes"]
    assert b["events"].get("detached") == b["events"].get("resumed") == b["resumes"]
    assert b["detached_at_end"] == 0
    for key in ("pause_ms", "handshake_ms", "outage_ms"):
        d = b[key]
        assert d["n"] > 0 and d["p50_ms"] <= d["p99_ms"] <= d["max_ms"], (key, d)
    assert b["replayed"]["resumes"] == b["resumes"]
    assert b["wslb_histogram"]["count"] == b["resumes"]

    m = b["memory"]
    assert m["detached"] > 0 and m["gauge"] == m["detached"] and m["all_resumed"] is True
    for key in ("rss_before_mb", "rss_detached_mb", "rss_per_detached_kb"):
        assert isinstance(m[key], float), key
    assert m["window_bytes_detached"]["n"] == m["detached"]
    assert m["window_bytes_detached"]["p50"] > 0  # the worker went on streaming meanwhile

    c = r["cpu"]
    assert [w["setting"] for w in c["windows"]] == ["off", "on"]
    for w in c["windows"]:
        assert w["bad"] == 0 and w["failed"] == 0 and w["us_per_frame"] > 0, w
    s = c["summary"]
    assert set(s["us_per_frame_median"]) == {"off", "on"} and s["ratio_of_medians"] > 0
    assert s["target"] == 1.05
