"""Deployment examples (examples/k8s, examples/Dockerfile): no cluster here, so check what can be.

Every YAML document parses and names its kind; every embedded balancer.yaml passes ``wslb check``;
every name a manifest refers to (ConfigMap, Secret, Service, port name, etcd endpoint, backend
host) is defined; ports agree between balancer.yaml, containers, probes and Services; every
command in a hook or container (``wslb``, ``wslb ctl ...``, ``wslb-worker ...``) parses with the
real command line; the Dockerfile copies what exists and exposes the ports the configs use.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from backends.bridge import config_from_args as bridge_config_from_args
from backends.worker import config_from_args
from balancer import config as configmod
from balancer import ctl
from tests.procs import ROOT

K8S = ROOT / "examples" / "k8s"
ENV = {"WSLB_ADMIN_TOKEN": "t0ken", "POD_NAME": "model-abc", "POD_IP": "10.1.2.3"}
IMAGE = "wslb:0.1.0"
ENGINE_IMAGES = ("quay.io/coreos/etcd:", "vllm/vllm-openai:")  # what wslb runs beside


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), path
                doc["__file"] = path.name
                docs.append(doc)
    return docs


DOCS = documents()


def named(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def workloads() -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def balancer_configs() -> list[tuple[str, configmod.Config]]:
    out = []
    for name, cm in named("ConfigMap").items():
        text = cm.get("data", {}).get("balancer.yaml")
        if text is not None:
            cfg = configmod.parse(
                yaml.safe_load(configmod.expand_env(text, ENV)), f"{cm['__file']}:{name}"
            )
            out.append((name, cfg))
    return out


def config_of(workload: dict[str, Any], container: dict[str, Any]) -> configmod.Config:
    """The balancer.yaml a wslb container runs with, through its volume mount."""
    args = container.get("args", [])
    path = args[args.index("--config") + 1]
    spec = workload["spec"]["template"]["spec"]
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            cm = volume["configMap"]["name"]
            assert path.rsplit("/", 1)[1] in named("ConfigMap")[cm]["data"], (cm, path)
            return dict(balancer_configs())[cm]
    raise AssertionError(f"{path} is not on any volume of {workload['metadata']['name']}")


def test_every_document_parses_and_is_named() -> None:
    assert {p.name for p in K8S.glob("*.yaml")} >= {"deployment.yaml", "sidecar.yaml"}
    seen = set()
    for d in DOCS:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
        key = (d["kind"], d["metadata"]["name"])
        assert key not in seen, f"{key} defined twice"
        seen.add(key)


def test_embedded_configs_pass_wslb_check(tmp_path: Path) -> None:
    found = 0
    for name, cm in named("ConfigMap").items():
        text = cm.get("data", {}).get("balancer.yaml")
        if text is None:
            continue
        found += 1
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "balancer", "check", "--config", str(path)],
            cwd=ROOT,
            env={**ENV, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    assert found >= 2


def test_references_resolve() -> None:
    config_maps, secrets, services = named("ConfigMap"), named("Secret"), named("Service")
    for w, c in containers():
        spec = w["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps, v
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secrets[ref["name"]]["stringData"], ref
        assert c["image"] == IMAGE or c["image"].startswith(ENGINE_IMAGES), c["image"]
    labels = {id(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads()}
    for name, svc in services.items():
        selector = svc["spec"]["selector"]
        targets = [(w, c) for w, c in containers() if selector.items() <= labels[id(w)].items()]
        assert targets, f"Service {name} selects no pod"
        port_names = {p["name"] for _, c in targets for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in port_names, (name, p)
    for w in workloads():
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        if w["kind"] == "StatefulSet":
            assert w["spec"]["serviceName"] in services


def service_port(host: str, port: int) -> None:
    """``host`` is a Service (or ``pod.service`` of a StatefulSet) that serves ``port``."""
    services, sets = named("Service"), named("StatefulSet")
    parts = host.split(".")
    if len(parts) == 2:  # model-0.model: a StatefulSet pod behind its headless Service
        pod, svc = parts
        owner = next(s for s in sets.values() if s["spec"]["serviceName"] == svc)
        index = int(pod.rsplit("-", 1)[1])
        assert pod.rsplit("-", 1)[0] == owner["metadata"]["name"]
        assert index < owner["spec"]["replicas"], host
    else:
        svc = host
    assert port in [p["port"] for p in services[svc]["spec"]["ports"]], (host, port)


def test_config_endpoints_and_ports_agree() -> None:
    wslb = [(w, c) for w, c in containers() if c["name"] == "wslb"]
    assert len(wslb) == 3  # its own tier, a sidecar, a sidecar beside an engine
    for w, c in wslb:
        cfg = config_of(w, c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["ws"] == cfg.listen[0].port and cfg.listen[0].host == "0.0.0.0"
        # The kubelet probes the pod IP: the admin API must listen there, with a token.
        assert ports["admin"] == cfg.admin.port and cfg.admin.host == "0.0.0.0"
        assert cfg.admin.token == ENV["WSLB_ADMIN_TOKEN"]
        probe = c["readinessProbe"]["httpGet"]
        assert probe == {"path": "/readyz", "port": "admin"}
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert cfg.cluster is not None
        etcd = urlsplit(cfg.cluster.etcd)
        assert etcd.hostname and etcd.port
        service_port(etcd.hostname, etcd.port)
        for b in (b for p in cfg.pools for b in p.backends):
            service_port(b.host, b.port)
        # Every replica of one balancer uses the same config (one prefix per balancer).
    prefixes = [config_of(w, c).cluster.prefix for w, c in wslb]  # type: ignore[union-attr]
    assert len(set(prefixes)) == len(prefixes)


def _commands(hook: dict[str, Any]) -> list[list[str]]:
    cmd = hook["exec"]["command"]
    if cmd[:2] == ["sh", "-c"]:
        text = cmd[2]
        for var, value in ENV.items():
            text = text.replace(f'"${var}"', value).replace(f"${var}", value)
        return [shlex.split(part) for part in re.split(r"&&|;", text)]
    return [cmd]


def _parse_ctl(argv: list[str]) -> Any:
    assert argv[:2] == ["wslb", "ctl"], argv
    try:
        return ctl.parser().parse_args(argv[2:])
    except SystemExit as exc:
        raise AssertionError(f"wslb ctl refuses {argv}") from exc


def test_hooks_and_commands_parse() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    hooks = 0
    for w, c in containers():
        if c["name"] == "worker":
            assert c["command"] == ["wslb-worker"] and "wslb-worker" in scripts
            args = [a.replace("$(POD_NAME)", ENV["POD_NAME"]) for a in c["args"]]
            cfg, _ = config_from_args(args)
            assert cfg.host == "0.0.0.0" and cfg.drain_grace > 0  # SIGTERM: drain itself
            assert cfg.port in [p["containerPort"] for p in c["ports"]]
            grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace > cfg.drain_grace
        if c["name"] == "bridge":  # the engine bridge in front of the pod's engine
            assert c["command"] == ["wslb-worker"] and "wslb-worker" in scripts
            args = [a.replace("$(POD_NAME)", ENV["POD_NAME"]) for a in c["args"]]
            bcfg, _ = bridge_config_from_args(args)
            assert bcfg.host == "0.0.0.0" and bcfg.drain_grace > 0
            assert bcfg.port in [p["containerPort"] for p in c["ports"]]
            engine_port = urlsplit(bcfg.engine_url).port
            engine = next(x for x in w["spec"]["template"]["spec"]["containers"]
                          if x["name"] == "engine")  # fmt: skip
            assert engine_port in [p["containerPort"] for p in engine["ports"]]
            grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace > bcfg.drain_grace
        if c["name"] == "wslb":
            assert "command" not in c and "wslb" in scripts  # the image's ENTRYPOINT
        for when, hook in c.get("lifecycle", {}).items():
            for argv in _commands(hook):
                hooks += 1
                if argv[0] == "sleep":
                    assert float(argv[1]) < w["spec"]["template"]["spec"].get(
                        "terminationGracePeriodSeconds", 30
                    )
                    continue
                args = _parse_ctl(argv)
                if args.cmd == "drain":
                    assert when == "preStop" and args.wait and args.id == ENV["POD_NAME"]
                    timeout = configmod.parse_duration(args.timeout)
                    grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                    assert timeout < grace
                if args.cmd == "add":
                    assert when == "postStart" and args.exist_ok and args.wait_admin > 0
                    port = urlsplit(args.url).port
                    worker = next(x for x in w["spec"]["template"]["spec"]["containers"]
                                  if x["name"] in ("worker", "bridge"))  # fmt: skip
                    assert port in [p["containerPort"] for p in worker["ports"]]
    assert hooks >= 4


def test_dockerfile_copies_what_exists_and_exposes_the_ports() -> None:
    text = (ROOT / "examples" / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    bases = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    for base in bases:
        assert re.fullmatch(r"python:3\.(1[1-9])(-slim)?", base), base
    copied = set()
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:  # --from: another stage's files
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
                copied.add(src)
    # What pip needs to build the package and its C extension (balancer/_scan.c).
    assert {"pyproject.toml", "setup.py", "balancer", "backends"} <= copied
    exposed = {int(p) for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    for _, cfg in balancer_configs():
        assert {cfg.listen[0].port, cfg.admin.port} <= exposed
    assert 'ENTRYPOINT ["wslb"]' in lines
    assert f"-t {IMAGE}" in text  # the tag the manifests use


@pytest.mark.parametrize("name", ["deployment.yaml", "sidecar.yaml", "sidecar-engine.yaml"])
def test_manifest_readme_commands_use_real_ctl(name: str) -> None:
    """The ``wslb ctl`` lines in a manifest's header comment parse too."""
    found = 0
    for line in (K8S / name).read_text().splitlines():
        m = re.search(r"-- (wslb ctl .*?)(?:\s+#|$)", line)
        if m:
            _parse_ctl(shlex.split(m.group(1)))
            found += 1
    assert found
