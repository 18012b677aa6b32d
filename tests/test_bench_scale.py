"""Smoke test of ``bench/scale.py``: its quick path, with a few hundred sessions.

The script itself holds 100,000 sessions for minutes (``docs/scale.md``); this runs the same
code with 300 sessions through wslb ``workers: 2`` and a 2 s heartbeat, and checks that the
report has its fields and that every session stayed open. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, child_env

SESSIONS = 300


def test_quick_run_holds_every_session(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick"]
    cmd += ["--sessions", str(SESSIONS), "--json", str(out), "--logs", str(tmp_path / "logs")]
    done = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())

    plan = r["plan"]
    assert plan["sessions"] == SESSIONS
    assert plan["wslb_processes"] >= 2  # workers: N, a supervisor above them
    assert r["wslb"]["processes"] == plan["wslb_processes"] + 1
    assert r["wslb"]["alive_at_end"] == r["wslb"]["processes"]

    assert r["open"]["opened"] == SESSIONS
    assert r["open"]["failed"] == 0
    assert r["open"]["seconds"] > 0
    held = r["held"]
    assert held["all_open"] is True
    assert held["open_at_end"] == SESSIONS
    assert held["closed_during_hold"] == 0
    assert held["worker_websockets_open"] == SESSIONS
    assert held["wslb_sessions_active"] == SESSIONS

    # Heartbeat on (2 s in --quick): both legs of every session were pinged and answered.
    assert r["pings"]["hold_total"] > 0
    assert r["pings"]["per_session_leg"] > 1
    assert r["cpu"]["idle"]["pings"] > 0

    # The streaming sessions delivered frames with a latency; the direct group too.
    assert plan["streaming"] > 0
    assert r["frames"]["received"] > 0
    assert r["latency"]["n"] > 0
    assert r["latency"]["p50_us"] <= r["latency"]["p99_us"]
    assert r["latency_direct"]["n"] > 0
    assert len(r["windows"]) >= 1

    for key in ("before_mb", "after_open_mb", "end_mb", "kb_per_session", "per_process_mb"):
        assert key in r["rss"]
    assert r["rss"]["after_open_mb"] > 0
    assert len(r["fds"]["per_process"]) == r["wslb"]["processes"]
    assert r["fds"]["per_session"] >= 1.5  # two sockets per session in wslb
    for key in ("slab_mb", "tcp_buffers_mb", "kb_per_session", "tcp_inuse"):
        assert key in r["kernel"]["open"]
    for key in ("baseline", "idle", "stream", "us_per_ping", "us_per_frame_stream"):
        assert key in r["cpu"]
    assert "notes" in r["checks"]
    assert r["checks"]["problems"] == []
