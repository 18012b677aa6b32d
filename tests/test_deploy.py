"""What an operator deploys wslb with: the Dockerfile, the systemd unit, Prometheus' scrape
config and alert rules, the Grafana dashboard, and the one-host vLLM recipe (issue 25).

There is no Docker engine here, so the image is "run" as its steps would run it: its build
stage's ``RUN`` in a copy of what it ``COPY``s (the wheels of wslb and its dependencies, the C
scanner in wslb's), its runtime stage's ``pip install`` into a fresh virtualenv, then its
``ENTRYPOINT`` + ``CMD`` with its ``ENV`` and the config file it bakes in; only the listen ports
are moved to free loopback ones (what ``docker run -p`` would map). The unit goes through
``systemd-analyze verify`` and its ``ExecStart``/``ExecReload`` lines run for real. The rules pass
``promtool check rules`` and ``promtool test rules`` with series that make each alert fire; the
dashboard loads as JSON, each panel with targets, each expression valid PromQL; both name only
metrics a running wslb exports (``tests/metrics_stack.py``), but Prometheus' ``up`` and the
pending ``wslb_resumes_total``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from balancer import admintoken
from balancer import config as c
from tests import installs
from tests.metrics_stack import every_feature, exported_names
from tests.procs import ROOT, free_ports, wait_port

DOCKERFILE = ROOT / "examples" / "Dockerfile"
UNIT = ROOT / "examples" / "systemd" / "wslb.service"
ALERTS = ROOT / "examples" / "prometheus" / "wslb-alerts.yml"
PROMETHEUS = ROOT / "examples" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "examples" / "grafana" / "wslb.json"
PROMETHEUS_OWN = frozenset({"up"})  # what Prometheus adds to every target
PENDING = frozenset({"wslb_resumes_total"})  # client resume (SPEC section 13): a later issue


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    with every_feature(tmp_path_factory.mktemp("deploy")) as (expo, _, _):
        return exported_names(expo)


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        # The package starts a Prometheus server where it can: the tests need its promtool only.
        return installs.apt_binary(
            "prometheus", "promtool", args=("--version",), after=("service", "prometheus", "stop")
        )
    except installs.CannotInstall as e:
        pytest.skip(str(e))


# -- the Dockerfile ------------------------------------------------------------------------


def instructions(text: str) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuations joined."""
    stages: list[list[tuple[str, str]]] = []
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    for line in logical:
        op, _, args = line.strip().partition(" ")
        if op.upper() == "FROM":
            stages.append([])
        stages[-1].append((op.upper(), args.strip()))
    return stages


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in stage:
        if op == "ENV":
            for item in shlex.split(args):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def command_of(stage: list[tuple[str, str]]) -> list[str]:
    """``ENTRYPOINT`` + ``CMD``, both in exec (JSON) form."""
    entry = [json.loads(a) for op, a in stage if op == "ENTRYPOINT"][-1]
    cmd = [json.loads(a) for op, a in stage if op == "CMD"][-1]
    return [*entry, *cmd]


def copies(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """Each ``COPY`` without ``--from``: its sources and its absolute destination."""
    out, workdir = [], "/"
    for op, args in stage:
        if op == "WORKDIR":
            workdir = args
        elif op == "COPY" and "--from=" not in args:
            *srcs, dest = args.split()
            absolute = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
            out.append((srcs, absolute))
    return out


STAGES = instructions(DOCKERFILE.read_text())
BUILD, IMAGE = STAGES[0], STAGES[-1]


def baked_config() -> tuple[str, Path]:
    """The path the image's CMD reads, and the repository file the image bakes there."""
    argv = command_of(IMAGE)
    path = argv[argv.index("--config") + 1]
    for srcs, dest in copies(IMAGE):
        for src in srcs:
            target = dest if len(srcs) == 1 and not dest.endswith("/") else dest + Path(src).name
            if target == path:
                return path, ROOT / src
    raise AssertionError(f"CMD reads {path}, which no COPY of the image's stage writes")


def test_the_image_cmd_reads_the_config_the_image_copies() -> None:
    path, src = baked_config()
    assert path == "/etc/wslb/balancer.yaml" and src == ROOT / "balancer.yaml"
    assert command_of(IMAGE)[0] == "wslb"


def test_the_baked_config_listens_on_all_interfaces_inside_the_container() -> None:
    env = env_of(IMAGE)
    cfg = c.load(baked_config()[1], env=env)
    assert [(lst.host, lst.port) for lst in cfg.listen] == [("0.0.0.0", 8080)]
    assert cfg.metrics.listen == c.Listener("0.0.0.0", 8082)
    assert c.is_loopback(cfg.admin.host)  # the admin API stays inside unless told otherwise
    exposed = {int(p) for op, a in IMAGE if op == "EXPOSE" for p in a.split()}
    assert {8080, 8082, cfg.admin.port} <= exposed
    assert any(op == "STOPSIGNAL" and a == "SIGTERM" for op, a in IMAGE)


def test_the_image_runs_unprivileged_with_a_writable_state_dir() -> None:
    user = [a for op, a in IMAGE if op == "USER"][-1]
    assert user not in ("root", "0")
    state = env_of(IMAGE)["WSLB_STATE_DIR"]
    runs = " ".join(a for op, a in IMAGE if op == "RUN")
    assert re.search(rf"install -d -o {user} -m 0700 {re.escape(state)}\b", runs), runs


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin"


def _sh(cmd: str, cwd: Path, bindir: Path, timeout: float = 600) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["sh", "-ec", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"$ {cmd}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.mark.slow  # ~1 min: wheels of wslb and its dependencies, two virtualenvs
def test_the_image_builds_and_serves_as_its_steps_say(tmp_path: Path) -> None:
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    src.mkdir()
    for srcs, dest in copies(BUILD):  # relative to WORKDIR /src
        for name in srcs:
            into = src / Path(dest.removeprefix("/src").lstrip("/"))
            target = into / Path(name).name if dest.endswith("/") else into
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.so", "*.egg-info"))  # fmt: skip
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / name, target)
    build_bin = _venv(tmp_path / "build-venv")
    for op, args in BUILD:
        if op == "RUN":
            _sh(args.replace("/wheels", str(wheels)), src, build_bin)
    assert list(wheels.glob("wslb-*.whl"))
    run_bin = _venv(tmp_path / "image-venv")
    for op, args in IMAGE:  # its pip steps (not useradd: this is no container)
        if op == "RUN":
            for step in args.split("&&"):
                if step.strip().startswith("pip install"):
                    _sh(step.replace("/wheels", str(wheels)), tmp_path, run_bin)

    path, source = baked_config()
    etc = tmp_path / path.lstrip("/")
    etc.parent.mkdir(parents=True)
    shutil.copy(source, etc)
    argv = [str(run_bin / a) if i == 0 else a for i, a in enumerate(command_of(IMAGE))]
    argv = [str(etc) if a == path else a for a in argv]
    listen, admin, metrics, *workers = free_ports(6)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "WSLB_"))}
    env.update(env_of(IMAGE))
    env.update(
        PATH=f"{run_bin}{os.pathsep}{os.environ.get('PATH', '')}",  # spawn: wslb-worker
        WSLB_LISTEN=f"127.0.0.1:{listen}",  # docker run -p: the ports mapped
        WSLB_METRICS_LISTEN=f"127.0.0.1:{metrics}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        WSLB_STATE_DIR=str(tmp_path / "state"),
        **{f"WSLB_WORKER_PORT{i}": str(p) for i, p in enumerate(workers, 1)},
    )
    log = (tmp_path / "wslb.log").open("wb")
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for port in (listen, admin, metrics):
            wait_port(port, 30, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert b"wslb_build_info" in r.read()
        token = admintoken.read(admin, env)
        assert token, "no generated admin token in WSLB_STATE_DIR"
        deadline = time.monotonic() + 30
        while True:
            req = urllib.request.Request(
                f"http://127.0.0.1:{admin}/backends", headers={"Authorization": f"Bearer {token}"}
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                states = {b["id"]: b["state"] for b in json.load(r)}
            if set(states.values()) == {"active"}:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
        assert set(states) == {"w1", "w2", "w3"}  # the spawned reference workers
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
    assert code == 0, (tmp_path / "wslb.log").read_text()[-3000:]


# -- systemd -------------------------------------------------------------------------------


def unit() -> dict[str, list[tuple[str, str]]]:
    """The unit's sections, each a list of (key, value) (keys may repeat: ExecReload)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = []
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{UNIT.name}: not key=value: {line!r}"
        out[section].append((key, value))
    return out


def one(section: list[tuple[str, str]], key: str) -> str:
    [value] = [v for k, v in section if k == key]
    return value


def test_systemd_unit_settings() -> None:
    service = unit()["Service"]
    assert one(service, "Type") == "exec"  # wslb does not call sd_notify
    assert one(service, "KillSignal") == "SIGTERM"
    assert one(service, "KillMode") == "mixed"  # wslb stops its own children
    assert one(service, "Restart") == "on-failure"
    reloads = [v for k, v in service if k == "ExecReload"]
    assert reloads[-1] == "/bin/kill -HUP $MAINPID"
    grace = c.Timeouts()
    baked = c.load(ROOT / "balancer.yaml", env={}).timeouts
    for t in (grace, baked):
        assert float(one(service, "TimeoutStopSec")) > t.shutdown_grace + t.close + 10
    state = dict(service)["Environment"].removeprefix("WSLB_STATE_DIR=")
    assert state == "/run/" + one(service, "RuntimeDirectory")
    assert one(unit()["Install"], "WantedBy") == "multi-user.target"


def _wslb_path(command: str) -> tuple[str, list[str]]:
    argv = shlex.split(command)
    return argv[0], argv[1:]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (the settings test parses the unit)")
    wslb = shutil.which("wslb") or sys.executable
    text = UNIT.read_text().replace("/opt/wslb/bin/wslb", wslb)
    copy = tmp_path / "wslb.service"
    copy.write_text(text)
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Unknown" not in out and "ignoring" not in out, out


def test_systemd_exec_lines_run(tmp_path: Path) -> None:
    """ExecStartPre and ExecReload's check pass on the config, ExecStart serves it, and the
    reload's SIGHUP rereads it."""
    service = unit()["Service"]
    listen, admin, *workers = free_ports(5)
    cfg = tmp_path / "balancer.yaml"
    shutil.copy(ROOT / "balancer.yaml", cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSLB_")}
    env.update(
        WSLB_LISTEN=f"127.0.0.1:{listen}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        WSLB_STATE_DIR=str(tmp_path / "state"),
        PYTHONPATH=str(ROOT),
        **{f"WSLB_WORKER_PORT{i}": str(p) for i, p in enumerate(workers, 1)},
    )

    def argv(command: str) -> list[str]:
        binary, args = _wslb_path(command)
        assert binary == "/opt/wslb/bin/wslb", binary
        return [sys.executable, "-m", "balancer"] + [
            str(cfg) if a == "/etc/wslb/balancer.yaml" else a for a in args
        ]

    for key in ("ExecStartPre", "ExecReload"):
        command = next(v for k, v in service if k == key)
        done = subprocess.run(argv(command), env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    log = tmp_path / "wslb.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv(one(service, "ExecStart")), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_port(admin, 30, proc)
        os.kill(proc.pid, signal.SIGHUP)  # /bin/kill -HUP $MAINPID
        deadline = time.monotonic() + 15
        while "reloaded" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-2000:]


# -- PromQL --------------------------------------------------------------------------------

_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels or keywords)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    e = re.sub(r"\$\{?\w+\}?", "", e)  # Grafana's variables
    e = re.sub(r"\{[^}]*\}", " ", e)  # matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    out = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        before = e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":
            continue  # 1e3
        if e[m.end() :].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        out.add(m.group(0))
    return out


def test_metric_names_of_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (pool, le) (rate(wslb_x_bucket{pool=~"$pool"}'
        "[$__rate_interval]))) > 1e3 and on (pool) up == 0 or time() - wslb_y_timestamp_seconds"
    )
    assert metric_names(expr) == {"wslb_x_bucket", "up", "wslb_y_timestamp_seconds"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


# -- the alert rules -----------------------------------------------------------------------


def test_promtool_check_rules_and_config(promtool: str) -> None:
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(PROMETHEUS)]):
        done = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS.parent
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_asked_alerts_exist() -> None:
    exprs = {r["alert"]: r["expr"] for r in rules()}
    assert "up{" in exprs["WslbScrapeFailed"]  # Prometheus cannot scrape wslb
    assert "wslb_backend_down" in exprs["WslbBackendDown"]
    assert 'state="draining"' in exprs["WslbDrainStuck"]
    assert "wslb_failovers_total" in exprs["WslbFailovers"]
    assert "wslb_resumes_total" in exprs["WslbResumeFailures"]
    assert "wslb_scrape_failures_total" in exprs["WslbBackendSignalsStale"]
    for r in rules():
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r
        assert r["annotations"]["summary"], r


def test_alert_rules_fire(promtool: str, tmp_path: Path) -> None:
    """``promtool test rules``: each series below makes its alert fire after its ``for``."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for r in group["rules"]:
            r.pop("annotations")  # exp_alerts would have to repeat them, $value included
    (tmp_path / ALERTS.name).write_text(yaml.safe_dump(doc))
    b = 'pool="chat",backend="w2",instance="wslb:8082",job="wslb"'
    series = [
        ('up{job="wslb",instance="wslb:8082"}', "0x20"),
        (f'wslb_backend_down{{{b},reason="refused"}}', "1x20"),
        (f"wslb_backend_ready{{{b}}}", "0x20"),
        (f'wslb_backend_state{{{b},state="draining"}}', "1x20"),
        ('wslb_failovers_total{result="no_target",instance="wslb:8082",job="wslb"}', "0+1x20"),
        ('wslb_resumes_total{result="expired",instance="wslb:8082",job="wslb"}', "0+1x20"),
    ]
    tests = {
        "rule_files": [ALERTS.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {"eval_time": "16m", "alertname": name, "exp_alerts": [{"exp_labels": labels}]}
                    for name, labels in (
                        ("WslbScrapeFailed", {"severity": "critical", "job": "wslb",
                                              "instance": "wslb:8082"}),
                        ("WslbBackendDown", {"severity": "warning", "pool": "chat",
                                             "backend": "w2", "instance": "wslb:8082",
                                             "reason": "refused"}),
                        ("WslbNoReadyBackend", {"severity": "critical", "pool": "chat",
                                                "instance": "wslb:8082"}),
                        ("WslbDrainStuck", {"severity": "warning", "pool": "chat",
                                            "backend": "w2", "instance": "wslb:8082"}),
                        ("WslbFailovers", {"severity": "info", "instance": "wslb:8082"}),
                        ("WslbFailoversNotResumed", {"severity": "warning", "result": "no_target",
                                                     "instance": "wslb:8082"}),
                        ("WslbResumeFailures", {"severity": "warning", "result": "expired",
                                                "instance": "wslb:8082"}),
                    )
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    done = subprocess.run(
        [promtool, "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_name_only_exported_metrics(exported: set[str]) -> None:
    for r in rules():
        unknown = metric_names(r["expr"]) - exported - PROMETHEUS_OWN - PENDING
        assert not unknown, (r["alert"], unknown)


# -- the Grafana dashboard -----------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels() -> Iterator[dict[str, Any]]:
    for p in dashboard()["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row's


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def test_dashboard_is_a_grafana_dashboard() -> None:
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    graphs = [p for p in panels() if p["type"] != "row"]
    assert len(graphs) >= 20
    for p in panels():
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["title"] and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"] for t in p["targets"]), p["title"]
    used = set(re.findall(r"\$(\w+)", " ".join(exprs()))) - {"__rate_interval"}
    assert used <= set(variables), used - set(variables)


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Each expression, its variables given values, as a recording rule: promtool parses it."""
    values = {"$__rate_interval": "5m", "$instance": ".*", "$pool": ".*"}
    records = []
    for i, expr in enumerate(exprs()):
        for var, value in values.items():
            expr = expr.replace(var, value)
        records.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_names_only_exported_metrics(exported: set[str]) -> None:
    names: set[str] = set()
    for expr in exprs():
        names |= metric_names(expr)
    for v in dashboard()["templating"]["list"]:
        query = v.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        m = re.match(r"label_values\((\w+)", text)
        if m:
            names.add(m.group(1))
    assert names, "no metric found in the dashboard"
    assert not names - exported - PROMETHEUS_OWN, names - exported - PROMETHEUS_OWN
    # The families an operator looks at first are all on it.
    for wanted in (
        "wslb_sessions_active",
        "wslb_handshake_duration_seconds_bucket",
        "wslb_upstream_connect_duration_seconds_bucket",
        "wslb_session_duration_seconds_bucket",
        "wslb_backend_state",
        "wslb_failovers_total",
        "process_cpu_seconds_total",
        "wslb_build_info",
    ):
        assert wanted in names, wanted


# -- the one-host vLLM recipe --------------------------------------------------------------


def test_vllm_recipe_is_one_working_host() -> None:
    """README's commands and config/vllm.yaml agree on ports and ids, and ``wslb check``
    passes."""
    done = subprocess.run(
        [sys.executable, "-m", "balancer", "check", "config/vllm.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## wslb in front of vLLM / SGLang / llama.cpp", 1)[1].split("\n## ")[0]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    loop = re.search(r"for i in ([\d ]+); do", block)
    assert loop, block
    bridges = {}
    for i in loop.group(1).split():
        text = block.replace("$((i + 1))", str(int(i) + 1)).replace("$i", i)
        engine = re.search(r"vllm serve \S+ --host (\S+) --port (\d+)", text)
        bridge = re.search(r"--engine-url http://([\d.]+):(\d+) --port (\d+) --id (\S+)", text)
        assert engine and bridge, text
        assert engine.groups() == bridge.groups()[:2]  # the bridge finds its engine
        bridges[bridge.group(4)] = (int(bridge.group(3)), int(engine.group(2)))
    cfg = c.load(ROOT / "config/vllm.yaml", env={})
    [pool] = cfg.pools
    got = {}
    for b in pool.backends:
        assert b.host == "127.0.0.1" and b.metrics_url
        metrics = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/metrics", b.metrics_url)
        assert metrics, b.metrics_url
        got[b.id] = (b.port, int(metrics.group(1)))
    assert got == bridges
    assert "wslb --config config/vllm.yaml" in block


def test_sidecar_comment_says_what_sigterm_does() -> None:
    """balancer/aio/app.py's shutdown: shutdown_grace, then 1001 (not 1012 after the answer)."""
    text = (ROOT / "config" / "sidecar.yaml").read_text()
    head = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    said = head.split("On SIGTERM", 1)[1].split("To end each", 1)[0]
    assert "shutdown_grace" in said and "1001" in said and "1012" not in said, said
    grace = c.load(ROOT / "config/sidecar.yaml", env={}).timeouts.shutdown_grace
    assert f"({grace:g} s here)" in head


# -- the operating docs --------------------------------------------------------------------


def test_readme_lists_every_doc() -> None:
    section = (ROOT / "README.md").read_text().split("## Documentation", 1)[1].split("\n## ")[0]
    listed = set(re.findall(r"\(docs/([\w-]+\.md)", section))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}


@pytest.mark.parametrize("name", ["operating.md", "cluster.md"])
def test_operating_docs_links_resolve(name: str) -> None:
    doc = ROOT / "docs" / name
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), target
