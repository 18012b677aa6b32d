"""A wslb with every feature that adds metrics families, for the tests that read its names.

``tests/test_metrics_naming.py`` lints the exposition; ``tests/test_deploy.py`` checks that the
Grafana dashboard and the alert rules name only metrics wslb exports. Both read them from
running processes, not from the collector classes: a family registered in one assembly only
(cluster mode's, ``process_*``) or renamed in the merge of ``workers: N`` is caught too.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from tests.etcd import Etcd
from tests.procs import Worker, Wslb, free_port, pool_config, running


@dataclass
class Exposition:
    """What the test wslbs served on ``GET /metrics``."""

    cluster: str  # one instance of cluster mode, through the admin API (with the token)
    plain: str  # the same instance through ``metrics.listen`` (no token)
    workers: str  # the supervisor of ``workers: 2``: its merge of the serving processes'
    supervisor_pid: int  # that supervisor's pid


def sample_names(text: str) -> set[str]:
    """Every sample name of an exposition (``x_total``, ``x_bucket``, ``x_sum``...)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def family_names(text: str) -> set[str]:
    """Every family named in ``# TYPE`` lines, with or without samples (counters with
    ``_total``, as Prometheus stores them)."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.add(line.split()[2])
    return out


def exported_names(expo: Exposition) -> set[str]:
    """What a PromQL expression may name: the families and all their series' names."""
    names: set[str] = set()
    for text in (expo.cluster, expo.workers):
        names |= family_names(text) | sample_names(text)
    return names


def _session(lb: Wslb, sid: str) -> None:
    """One chat session: a turn answered, then closed (the histograms get a sample each)."""
    with connect(f"{lb.url}/ws?session={sid}", open_timeout=10) as ws:
        ws.recv(timeout=10)  # the worker's hello
        ws.send('{"type": "prompt", "text": "hi", "max_tokens": 2}')
        while '"done"' not in str(ws.recv(timeout=10)):
            pass


def _settled(lb: Wslb) -> bool:
    """Every backend scraped and probed, and the three sessions ended and counted."""
    backends = lb.admin("/backends")
    seen = all(b["signals"] and b["health"]["last_check"] for b in backends)
    count = "wslb_session_duration_seconds_count"
    families = text_string_to_metric_families(lb.admin("/metrics"))
    ended = sum(s.value for f in families for s in f.samples if s.name == count)
    return seen and ended >= 3


def _plain_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


@contextlib.contextmanager
def every_feature(tmp: Path) -> Iterator[tuple[Exposition, Wslb, int]]:
    """Start the stack, open a session on each wslb, and yield what they export, the cluster
    instance and its ``metrics.listen`` port; everything is stopped after."""
    etcd = Etcd(tmp / "etcd").start()
    try:
        w1, w2 = Worker("w1").start(), Worker("w2").start()
        pool = {
            "weights": {"metrics": "reference", "scrape_interval": "200ms"},
            "health": {"path": "/healthz", "interval": "200ms"},
            "failover": {"enabled": True},
            "drain": {"migrate": True},
        }
        backends = [{"id": w.id, "url": w.url} for w in (w1, w2)]
        metrics_port = free_port()
        cfg = pool_config(backends, **pool)
        cfg["cluster"] = {"etcd": etcd.url, "prefix": f"/wslb-metrics-{metrics_port}/"}
        cfg["metrics"] = {"listen": f"127.0.0.1:{metrics_port}"}
        lb = Wslb(cfg, tmp)
        multi = Wslb({**pool_config(backends, **pool), "workers": 2}, tmp)
        with running(w1, w2, lb, multi):
            lb.start()
            multi.start()
            for target in (lb, multi):
                for sid in ("alice", "bob", "carol"):
                    _session(target, sid)
            deadline = time.monotonic() + 20  # a scrape of the workers' signals, a probe, and
            while not all(_settled(target) for target in (lb, multi)):  # the sessions counted
                assert time.monotonic() < deadline, (lb.admin("/backends"), multi.log_tail())
                time.sleep(0.05)
            expo = Exposition(
                cluster=lb.admin("/metrics"),
                plain=_plain_metrics(metrics_port),
                workers=multi.admin("/metrics"),
                supervisor_pid=multi.pid,
            )
            yield expo, lb, metrics_port
    finally:
        etcd.stop()
