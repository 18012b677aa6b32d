"""wslb's metrics after Prometheus' naming guide (https://prometheus.io/docs/practices/naming/).

The rules are checked on what running wslbs serve with every feature that adds families (cluster
mode, ``metrics.listen``, failover, ``workers: 2``; ``tests/metrics_stack.py``) and on a
collector whose every family has samples (a family without samples shows no labels):

- ``promtool check metrics`` passes (Debian's prometheus package, installed when missing);
- one label set per family, and every family about a backend labels it ``pool, backend``;
- one unit per family, named at the end (``_seconds``, ``_bytes``, ``_ratio``, ``_tokens``,
  ``_requests``); no label that says which quantity a sample is (the old ``signal``);
- points in time as ``_timestamp_seconds`` (Unix time), never ages;
- ``wslb_build_info`` and ``process_*``, which the supervisor of ``workers: N`` takes from
  itself, never summed over its serving processes.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from prometheus_client import ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from balancer import config as c
from balancer.aio.fanout import merge_metrics
from balancer.metrics import SIGNAL_FAMILIES, BackendView, BalancerCollector, Stats
from balancer.selection import MOVED, REFUSED
from balancer.version import version
from balancer.weights import SIGNALS
from tests import installs
from tests.metrics_stack import Exposition, every_feature, family_names
from tests.procs import Wslb

Stack = tuple[Exposition, Wslb, int]
UNITS = ("_seconds", "_bytes", "_ratio", "_tokens", "_requests", "_per_token")
# Labels that would say which quantity (and so which unit) a sample is.
QUANTITY_LABELS = frozenset({"signal", "unit", "metric", "quantity"})
HISTOGRAM_LABELS = frozenset({"le", "quantile"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with every_feature(tmp_path_factory.mktemp("metrics")) as s:
        yield s


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        # The package starts a Prometheus server where it can: the tests need its promtool only.
        return installs.apt_binary(
            "prometheus", "promtool", args=("--version",), after=("service", "prometheus", "stop")
        )
    except installs.CannotInstall as e:
        pytest.skip(str(e))


def full_exposition() -> str:
    """A collector's exposition with a sample in every family (every counter and label)."""
    st = Stats()
    for by_backend in (
        st.connect_failures,
        st.handshake_failures,
        st.ejections,
        st.scrape_failures,
        st.probe_failures,
    ):
        by_backend["w1"] += 1
    st.tls_failures["timeout"] += 1
    st.migrations["migrated"] += 1
    st.failovers["resumed"] += 1
    st.relay_thread["taken"] += 1
    st.rejections[503] += 1
    st.closes[("client", 1001)] += 1
    st.upstream_connect.observe("w1", 0.002)
    st.session_duration.observe("chat", 30.0)
    st.handshake_duration.observe(0.004)
    signals: dict[str, float | None] = dict.fromkeys(SIGNALS, 0.5)
    view = BackendView(
        pool="chat",
        id="w1",
        sessions=1,
        sessions_total=2,
        ready=True,
        state="active",
        weight=1.0,
        effective_weight=1.0,
        healthy=False,
        health_kind="refused",
        signals=signals,
        scrape_age=0.5,
        ejected_for=3.0,
        kv_headroom=0.25,
        refused=dict.fromkeys(REFUSED, 1),
        moved=dict.fromkeys(MOVED, 1),
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BalancerCollector(st, list, lambda: [view], lambda: 0))
    ProcessCollector(registry=registry)
    return generate_latest(registry).decode()


def problems(text: str) -> list[str]:
    """Where ``text`` breaks the naming rules of the module docstring."""
    out: list[str] = []
    for fam in text_string_to_metric_families(text):
        name, doc = fam.name, fam.documentation
        label_sets = {frozenset(s.labels) - HISTOGRAM_LABELS for s in fam.samples}
        if len(label_sets) > 1:
            out.append(f"{name}: several label sets {sorted(map(sorted, label_sets))}")
        labels = set().union(*label_sets) if label_sets else set()
        if "backend" in labels and "pool" not in labels:
            out.append(f"{name}: labelled backend without pool")
        if labels & QUANTITY_LABELS:
            out.append(f"{name}: a label names the quantity: {sorted(labels & QUANTITY_LABELS)}")
        if "_age" in name or name.endswith(("_ms", "_milliseconds", "_minutes", "_percent")):
            out.append(f"{name}: an age or a unit that is not a base unit")
        if fam.type == "histogram" and not name.endswith(UNITS):
            out.append(f"{name}: a histogram without its unit")
        if ("Unix time" in doc) != name.endswith("_timestamp_seconds"):
            out.append(f"{name}: a point in time is _timestamp_seconds (Unix time), and only it")
        if ("0..1" in doc or doc.startswith("Share")) and not name.endswith("_ratio"):
            out.append(f"{name}: a share is a _ratio")
        timed = name.startswith("wslb_") and fam.type == "gauge" and "seconds" in doc.lower()
        if timed and not name.endswith("_seconds"):
            out.append(f"{name}: seconds, not in its name")
    return out


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def promtool_check(promtool: str, text: str) -> None:
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- the rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["cluster", "plain", "workers"])
def test_promtool_check_metrics_on_running_wslbs(stack: Stack, promtool: str, which: str) -> None:
    promtool_check(promtool, getattr(stack[0], which))


def test_promtool_check_metrics_with_every_family_sampled(promtool: str) -> None:
    promtool_check(promtool, full_exposition())


def test_naming_rules_hold_on_running_wslbs(stack: Stack) -> None:
    expo = stack[0]
    for text in (expo.cluster, expo.workers):
        assert problems(text) == []


def test_naming_rules_hold_with_every_family_sampled() -> None:
    assert problems(full_exposition()) == []


def test_the_rules_catch_the_old_names() -> None:
    """The checks would have failed on what wslb exported before (issue 25)."""
    old = (
        "# HELP wslb_backend_signal Last scraped load signal\n# TYPE wslb_backend_signal gauge\n"
        'wslb_backend_signal{backend="w1",pool="chat",signal="tpot"} 0.02\n'
        "# HELP wslb_backend_scrape_age_seconds Age of the last good scrape\n"
        "# TYPE wslb_backend_scrape_age_seconds gauge\n"
        'wslb_backend_scrape_age_seconds{backend="w1",pool="chat"} 0.4\n'
        "# HELP wslb_scrape_failures_total Failed metrics scrapes\n"
        "# TYPE wslb_scrape_failures_total counter\n"
        'wslb_scrape_failures_total{backend="w1"} 1.0\n'
        "# HELP wslb_backend_kv_headroom Share of the KV cache not needed\n"
        "# TYPE wslb_backend_kv_headroom gauge\n"
        'wslb_backend_kv_headroom{backend="w1",pool="chat"} 0.5\n'
    )
    found = "\n".join(problems(old))
    for name in ("wslb_backend_signal", "scrape_age", "wslb_scrape_failures", "kv_headroom"):
        assert name in found, found


def test_every_load_signal_has_a_family_of_its_own() -> None:
    assert set(SIGNAL_FAMILIES) == set(SIGNALS)
    names = [family for family, _ in SIGNAL_FAMILIES.values()]
    assert len(set(names)) == len(names)
    assert all(n.startswith("wslb_backend_") and n.endswith(UNITS) for n in names), names


def test_points_in_time_are_unix_timestamps(stack: Stack) -> None:
    got = samples(stack[0].cluster)
    now = time.time()
    scraped = got["wslb_backend_last_scrape_timestamp_seconds"]
    assert scraped and all(now - 60 < v <= now + 1 for _, v in scraped), scraped
    [(_, synced)] = got["wslb_cluster_last_sync_timestamp_seconds"]
    assert now - 60 < synced <= now + 1
    ejected = got["wslb_backend_ejected_until_timestamp_seconds"]
    assert [v for _, v in ejected] == [0.0, 0.0]  # none ejected


def test_build_info_and_process_metrics(stack: Stack) -> None:
    for text in (stack[0].cluster, stack[0].workers):
        got = samples(text)
        [(labels, value)] = got["wslb_build_info"]
        assert labels == {"version": version(), "python": platform.python_version()}
        assert value == 1.0
        for name in (
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
        ):
            assert len(got[name]) == 1, name


def test_handshake_upstream_connect_and_session_histograms(stack: Stack) -> None:
    for text in (stack[0].cluster, stack[0].workers):
        got = samples(text)
        [(_, handshakes)] = got["wslb_handshake_duration_seconds_count"]
        assert handshakes >= 3
        connects = {
            (lab["pool"], lab["backend"]): v
            for lab, v in got["wslb_upstream_connect_duration_seconds_count"]
        }
        assert set(connects) <= {("chat", "w1"), ("chat", "w2")} and sum(connects.values()) >= 3
        [(labels, ended)] = got["wslb_session_duration_seconds_count"]
        assert labels == {"pool": "chat"} and ended >= 3
        [(_, total)] = got["wslb_session_duration_seconds_sum"]
        assert 0 < total < 60


def test_the_supervisor_keeps_its_own_process_metrics(stack: Stack) -> None:
    """``workers: 2``: a start time or an fd limit summed over processes means nothing."""
    got = samples(stack[0].workers)
    [(_, started)] = got["process_start_time_seconds"]
    assert abs(started - psutil.Process(stack[0].supervisor_pid).create_time()) < 2
    [(_, max_fds)] = got["process_max_fds"]
    assert max_fds == psutil.Process(stack[0].supervisor_pid).rlimit(psutil.RLIMIT_NOFILE)[0]


def test_merge_sums_what_adds_up_and_keeps_the_rest() -> None:
    def text(pid_start: float, relay: int, headroom: float, connections: int) -> str:
        return (
            "# HELP process_start_time_seconds Start\n# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {pid_start}\n"
            "# HELP process_cpu_seconds_total CPU\n# TYPE process_cpu_seconds_total counter\n"
            "process_cpu_seconds_total 1.5\n"
            "# HELP wslb_relay_thread_sessions R\n# TYPE wslb_relay_thread_sessions gauge\n"
            f"wslb_relay_thread_sessions {relay}\n"
            "# HELP wslb_backend_kv_headroom_ratio H\n"
            "# TYPE wslb_backend_kv_headroom_ratio gauge\n"
            f'wslb_backend_kv_headroom_ratio{{backend="w1",pool="chat"}} {headroom}\n'
            "# HELP wslb_connections_total C\n# TYPE wslb_connections_total counter\n"
            f"wslb_connections_total {connections}\n"
        )

    merged = merge_metrics([text(200.0, 3, 0.75, 5), text(300.0, 4, 0.5, 6)], text(100, 0, 0.9, 1))
    got = {name: [v for _, v in vs] for name, vs in samples(merged).items()}
    assert got["process_start_time_seconds"] == [100.0]
    assert got["process_cpu_seconds_total"] == [1.5]  # the supervisor's own
    assert got["wslb_relay_thread_sessions"] == [7.0]
    assert got["wslb_backend_kv_headroom_ratio"] == [pytest.approx(0.25)]  # 1 - 0.25 - 0.5
    assert got["wslb_connections_total"] == [12.0]
    assert "# HELP wslb_connections_total C\n# TYPE wslb_connections_total counter" in merged


# -- metrics.listen ------------------------------------------------------------------------


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_listener_serves_metrics_without_the_token_and_nothing_else(
    stack: Stack,
) -> None:
    expo, lb, port = stack
    base = f"http://127.0.0.1:{port}"
    status, body = _get(f"{base}/metrics")
    assert status == 200 and "wslb_build_info" in body
    assert family_names(body) == family_names(expo.cluster)
    assert _get(f"{base}/backends")[0] == 404
    assert _get(f"{base}/metrics", {"Origin": "http://evil.example"})[0] == 403
    assert _get(f"{base}/metrics", {"Host": f"evil.example:{port}"})[0] == 403  # rebinding
    status, body = _get(f"http://127.0.0.1:{lb.admin_port}/metrics")
    assert status == 401, body  # the admin API's still wants it
    assert json.loads(body) == {"error": "missing or wrong bearer token"}


BASE = {"pools": [{"name": "p", "backends": [{"id": "a", "url": "ws://127.0.0.1:9001"}]}]}


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"listen": "127.0.0.1:8080"}, "metrics.listen: '127.0.0.1:8080' is the same address as "
         "the listen address 127.0.0.1:8080"),
        ({"listen": ":8081"}, "metrics.listen: ':8081' overlaps (same port, one of them on all "
         "interfaces) the admin address 127.0.0.1:8081"),
        ({"listen": "nope"}, "metrics.listen: 'nope' is not host:port"),
        ({"listen": "h:99999"}, "metrics.listen: port 99999 is out of range"),
        ({"lsten": "x"}, "metrics.lsten: unknown key (did you mean 'listen'?)"),
        ({"listen": 8082}, "metrics.listen: "),
    ],
)  # fmt: skip
def test_metrics_listen_errors_name_their_yaml_path(
    metrics: dict[str, object], message: str
) -> None:
    with pytest.raises(c.ConfigError) as err:
        c.parse({**BASE, "metrics": metrics}, "balancer.yaml")
    assert message in str(err.value)


def test_metrics_listen_clashing_with_a_spawned_worker(tmp_path: Path) -> None:
    cfg = {
        "metrics": {"listen": "127.0.0.1:9001"},
        "pools": [
            {
                "name": "p",
                "backends": [{"id": "a", "url": "ws://127.0.0.1:9001", "spawn": "reference"}],
            }
        ],
    }
    with pytest.raises(c.ConfigError) as err:
        c.parse(cfg, "balancer.yaml")
    assert "the metrics address 127.0.0.1:9001" in str(err.value)


def test_metrics_listen_empty_is_off_and_a_restart_applies_it(tmp_path: Path) -> None:
    assert c.parse({**BASE, "metrics": {"listen": ""}}, "x").metrics.listen is None
    assert c.parse(BASE, "x").metrics == c.MetricsCfg()
    f = tmp_path / "b.yaml"
    f.write_text(yaml.safe_dump({**BASE, "metrics": {"listen": "${M:-0.0.0.0:8082}"}}))
    assert c.load(f, env={}).metrics.listen == c.Listener("0.0.0.0", 8082)
