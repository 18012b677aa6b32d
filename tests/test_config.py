"""balancer.config: YAML -> frozen dataclasses, every error named by its YAML path."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer import config as c
from balancer.config import ConfigError
from balancer.weights import Coefficients

ROOT = Path(__file__).resolve().parent.parent

BASE: dict[str, Any] = {
    "pools": [
        {
            "name": "chat",
            "backends": [
                {"id": "w1", "url": "ws://127.0.0.1:9001/ws"},
                {"id": "w2", "url": "ws://127.0.0.1:9002/ws"},
            ],
        }
    ]
}

# Every section and key set to something valid: the starting point of the fuzzing below.
FULL: dict[str, Any] = {
    "x-defaults": {"anything": [1, 2]},
    "listen": ["127.0.0.1:8080", {"address": "[::1]:8443"}],
    "admin": {"listen": "127.0.0.1:8081", "token": "t0ken"},
    "pools": [
        {
            "name": "chat",
            "match": {"path_prefix": "/chat"},
            "session_key": ["query:session", "header:X-Session-Id", "cookie:s", "path:-1"],
            "balance": "consistent",
            "hash_balance_factor": 1.5,
            "weights": {
                "scrape_interval": "500ms",
                "metrics": {"gpu_util": "DCGM_FI_DEV_GPU_UTIL", "waiting": "vllm:num_waiting"},
                "stale_after": "3s",
            },
            "health": {"interval": "2s", "timeout": "1s", "rise": 2, "fall": 3, "path": "/h"},
            "outlier": {
                "consecutive_failures": 3,
                "base_ejection_time": "10s",
                "max_ejection_time": "2m",
                "max_ejection_percent": 30,
            },
            "drain": {"timeout": "90s", "migrate": False},
            "backends": [
                {
                    "id": "w1",
                    "url": "ws://127.0.0.1:9001/ws?x=1",
                    "weight": 2,
                    "spawn": "reference",
                    "args": ["--tokens-per-s", "50"],
                    "metrics_url": "http://127.0.0.1:9001/metrics",
                },
                {"id": "w2", "url": "wss://gpu-2.example:8443/ws"},
            ],
        },
        {
            "name": "batch",
            "match": {"path_prefix": "/batch"},
            "balance": "least_conn",
            "backends": [{"id": "b1", "url": "ws://10.0.0.5"}],
        },
    ],
    "timeouts": {
        "handshake": "5s",
        "connect": 2,
        "idle": "30m",
        "ping_interval": 0,
        "ping_timeout": "15s",
        "close": "1.5s",
        "shutdown_grace": "0s",
    },
    "limits": {
        "max_connections": 100,
        "max_frame_size": "64KiB",
        "max_message_size": "1MB",
        "write_buffer_high": 65536,
        "max_header_bytes": "8KiB",
        "max_headers": 50,
    },
    "auth": {
        "jwt": {
            "secret": "s3cret",
            "algorithms": ["HS256", "HS512"],
            "audience": "chat",
            "query_param": "token",
            "session_claim": "sid",
        },
        "origins": ["https://App.Example:443", "http://localhost:3000"],
    },
    "workers": 4,
}


def with_(data: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A deep copy of ``data`` with ``value`` at dotted ``path`` ("pools.0.balance").

    Missing mappings on the way are created, so ``with_(BASE, "timeouts.idle", 5)`` works.
    """
    out = copy.deepcopy(data)
    node: Any = out
    *parents, last = [int(p) if p.lstrip("-").isdigit() else p for p in path.split(".")]
    for p in parents:
        node = node.setdefault(p, {}) if isinstance(node, dict) else node[p]
    node[last] = value
    return out


def errors(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        c.parse(data)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def only_error(data: object) -> str:
    errs = errors(data)
    assert len(errs) == 1, errs
    return errs[0]


# --------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    cfg = c.parse(BASE)
    assert cfg.listen == (c.Listener("127.0.0.1", 8080),)
    assert cfg.admin == c.Admin("127.0.0.1", 8081, None)
    assert cfg.timeouts == c.Timeouts(10, 5, 3600, 20, 20, 5, 5)
    assert cfg.limits == c.Limits(10000, 1 << 20, 16 << 20, 256 << 10, 16 << 10, 100, 0)
    assert cfg.trusted_proxies == ()
    assert cfg.log == c.LogCfg("text", True)
    assert cfg.auth == c.AuthCfg(None, ())
    assert cfg.workers == 1
    assert cfg.cluster is None
    assert cfg.source == "<config>"
    (pool,) = cfg.pools
    assert pool.path_prefix == "/"
    assert [str(k) for k in pool.session_key] == [
        "query:session",
        "header:X-Session-Id",
        "cookie:wslb_session",
    ]
    assert pool.balance == "consistent"
    assert pool.hash_balance_factor == 1.25
    assert pool.weights == c.WeightsCfg(1.0, "reference", 5.0)
    # No health route is assumed: a TCP connect, so any WebSocket server stays up.
    assert pool.health == c.HealthCfg(2.0, 1.0, 2, 3, None)
    assert pool.outlier == c.OutlierCfg(5, 30.0, 300.0, 50)
    assert pool.drain == c.DrainCfg(60.0, True)
    assert pool.backends[0] == c.BackendCfg("w1", "ws://127.0.0.1:9001/ws", 1.0, None, (), None)
    # Constructing by hand gives the same defaults as parsing.
    assert c.PoolCfg("chat", backends=pool.backends) == pool
    assert c.Config(pools=cfg.pools) == cfg


def test_everything_set() -> None:
    cfg = c.parse(FULL, source="full.yaml")
    assert cfg.source == "full.yaml"
    assert cfg.listen == (c.Listener("127.0.0.1", 8080), c.Listener("::1", 8443))
    assert str(cfg.listen[1]) == "[::1]:8443"
    assert cfg.admin.token == "t0ken"
    chat, batch = cfg.pools
    assert chat.path_prefix == "/chat"
    assert chat.session_key[3] == c.KeySource("path", "-1")
    assert chat.weights == c.WeightsCfg(
        0.5, (("gpu_util", "DCGM_FI_DEV_GPU_UTIL"), ("waiting", "vllm:num_waiting")), 3.0
    )
    assert chat.outlier == c.OutlierCfg(3, 10.0, 120.0, 30)
    assert chat.drain == c.DrainCfg(90.0, False)
    w1 = chat.backends[0]
    assert (w1.weight, w1.spawn, w1.args) == (2.0, "reference", ("--tokens-per-s", "50"))
    assert (w1.host, w1.port, w1.resource, w1.secure) == ("127.0.0.1", 9001, "/ws?x=1", False)
    w2 = chat.backends[1]
    assert (w2.host, w2.port, w2.resource, w2.secure) == ("gpu-2.example", 8443, "/ws", True)
    b1 = batch.backends[0]
    assert (b1.port, b1.resource) == (80, "/")
    assert batch.balance == "least_conn"
    assert cfg.timeouts == c.Timeouts(5, 2, 1800, 0, 15, 1.5, 0)
    assert cfg.limits == c.Limits(100, 65536, 1_000_000, 65536, 8192, 50)
    assert cfg.auth.jwt == c.JwtCfg("s3cret", None, ("HS256", "HS512"), "chat", "token", "sid")
    assert cfg.auth.origins == ("https://app.example", "http://localhost:3000")
    assert cfg.workers == 4
    assert cfg.backend_ids() == ("w1", "w2", "b1")
    assert cfg.backend("b1") == b1
    assert cfg.backend("nope") is None
    assert cfg.pool("batch") == batch


def test_frozen_and_hashable() -> None:
    cfg = c.parse(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 2  # type: ignore[misc]
    assert hash(cfg) == hash(c.parse(FULL))
    assert not hasattr(cfg, "__dict__")  # slots


def test_listen_shapes(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("y")
    tls = {"cert": str(cert), "key": str(key)}
    assert c.parse({**BASE, "listen": ":8080"}).listen == (c.Listener("0.0.0.0", 8080),)
    assert c.parse({**BASE, "listen": "localhost:80"}).listen == (c.Listener("localhost", 80),)
    assert c.parse({**BASE, "listen": ["[::]:1", "10.0.0.1:1"]}).listen == (
        c.Listener("::", 1),
        c.Listener("10.0.0.1", 1),
    )
    assert c.parse({**BASE, "listen": {"address": ":443", "tls": tls}}).listen == (
        c.Listener("0.0.0.0", 443, c.Tls(str(cert), str(key))),
    )
    mixed = c.parse({**BASE, "listen": ["127.0.0.1:80", {"address": "127.0.0.1:443", "tls": tls}]})
    assert [lst.tls is not None for lst in mixed.listen] == [False, True]


def test_schema_defaults_match_dataclasses() -> None:
    """The defaults users see in their editor are the ones wslb applies."""
    schema = json.loads(
        resources.files("balancer").joinpath("schema/balancer.schema.json").read_text()
    )
    pool = schema["$defs"]["pool"]["properties"]
    sections = {
        "timeouts": (schema["properties"]["timeouts"], c.Timeouts()),
        "limits": (schema["properties"]["limits"], c.Limits()),
        "health": (pool["health"], c.HealthCfg()),
        "outlier": (pool["outlier"], c.OutlierCfg()),
        "drain": (pool["drain"], c.DrainCfg()),
        "weights": (pool["weights"], c.WeightsCfg()),
    }
    checked = 0
    for section, instance in sections.values():
        for key, prop in section["properties"].items():
            default = prop["default"]
            ref = prop.get("$ref", "")
            if ref.endswith("/duration"):
                default = c.parse_duration(default)
            elif ref.endswith("/size"):
                default = c.parse_size(default)
            elif key == "coefficients":
                default = Coefficients(**default)
            assert getattr(instance, key) == default, key
            checked += 1
    assert checked == 32
    assert schema["properties"]["workers"]["default"] == c.Config().workers
    assert pool["hash_balance_factor"]["default"] == c.PoolCfg("p").hash_balance_factor
    assert c.parse_duration(pool["affinity_hold"]["default"]) == c.PoolCfg("p").affinity_hold
    assert pool["session_key"]["default"] == [str(k) for k in c.DEFAULT_SESSION_KEY]


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("a ${X} b", {"X": "1"}, "a 1 b"),
        ("${X}", {}, ""),
        ("${X:-dflt}", {}, "dflt"),
        ("${X:-dflt}", {"X": ""}, "dflt"),
        ("${X:-dflt}", {"X": "v"}, "v"),
        ("${X-dflt}", {"X": ""}, ""),
        ("${X-dflt}", {}, "dflt"),
        ("${X:-}", {}, ""),
        ("${X:-${Y:-inner}}", {}, "inner"),
        ("${X:-a:b/c}", {}, "a:b/c"),
        ("$${X}", {"X": "1"}, "${X}"),
        ("cost: $$5 and $5 and a$b", {}, "cost: $5 and $5 and a$b"),
        ("${X}", {"X": "${Y} $$"}, "${Y} $$"),  # values are not expanded again
        ("${X:?needed}", {"X": "ok"}, "ok"),
        ("tail $", {}, "tail $"),
    ],
)
def test_expand_env(text: str, env: dict[str, str], expected: str) -> None:
    assert c.expand_env(text, env) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: 1\nb: ${X:?set X to the port}\n", "line 2 column 4: X is not set: set X to the port"),
        ("b: ${X?}", "line 1 column 4: X is not set"),
        ("x: ${1BAD}", "line 1 column 4: invalid substitution '${1BAD}'"),
        ("x: ${}", "line 1 column 4: invalid substitution '${}'"),
        ("\n\nx: ${X", "line 3 column 4: '${' without a closing '}'"),
    ],
)
def test_expand_env_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        c.expand_env(text, {})
    assert info.value.errors[0].startswith(message), info.value.errors


def test_load_expands_env(tmp_path: Path) -> None:
    f = tmp_path / "b.yaml"
    f.write_text(
        'listen: ${LISTEN:-127.0.0.1:9999}\nadmin: {token: "${TOKEN}"}\n'
        "pools: [{name: p, backends: [{id: w, url: 'ws://${HOST}:1'}]}]\n"
    )
    cfg = c.load(f, env={"HOST": "gpu1"})
    assert cfg.listen[0].port == 9999
    assert cfg.admin.token is None  # unset -> "" -> no token
    assert cfg.pools[0].backends[0].url == "ws://gpu1:1"
    assert cfg.source == str(f)
    cfg = c.load(str(f), env={"HOST": "h", "TOKEN": "abc", "LISTEN": ":1"})
    assert (cfg.admin.token, cfg.listen[0].host) == ("abc", "0.0.0.0")


def test_load_uses_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "b.yaml"
    f.write_text("admin: {token: '${WSLB_TEST_TOKEN}'}\npools: [{name: p, backends: []}]\n")
    monkeypatch.setenv("WSLB_TEST_TOKEN", "from-env")
    assert c.load(f).admin.token == "from-env"


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("250ms", 0.25),
        ("1s", 1.0),
        ("1.5s", 1.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("0", 0.0),
        ("10", 10.0),
        (" 3 s ", 3.0),
        (0, 0.0),
        (7, 7.0),
        (0.5, 0.5),
        ("0.001ms", 0.000001),
    ],
)
def test_parse_duration(value: str | float, seconds: float) -> None:
    assert c.parse_duration(value) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "s",
        "1 hour",
        "1d",
        "-1s",
        "1e3s",
        ".5s",
        "1.s",
        "1sec",
        "1S",
        "5x",
        -1,
        float("inf"),
        float("nan"),
        True,
        None,
        [1],
        "\u0661s",
    ],
)
def test_parse_duration_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match=r"duration|negative|too large"):
        c.parse_duration(value)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("256KiB", 256 * 1024),
        ("1MiB", 1 << 20),
        ("16MiB", 16 << 20),
        ("1GiB", 1 << 30),
        ("1KB", 1000),
        ("1kB", 1000),
        ("2MB", 2_000_000),
        ("1GB", 10**9),
        ("10B", 10),
        ("10", 10),
        ("1.5MiB", 1572864),
        (" 4 KiB ", 4096),
        (0, 0),
        (1024, 1024),
        (1024.0, 1024),
    ],
)
def test_parse_size(value: str | int, size: int) -> None:
    assert c.parse_size(value) == size


@pytest.mark.parametrize(
    "value",
    ["", "10k", "1M", "1mib", "1 MiBs", "-1", "1.3B", "0.1KiB", "1e6", -5, 1.5, True, None, "KiB"],
)
def test_parse_size_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match=r"size|negative|whole"):
        c.parse_size(value)


def test_schema_patterns_are_the_parsers() -> None:
    defs = json.loads((ROOT / "balancer/schema/balancer.schema.json").read_text())["$defs"]
    assert defs["duration"]["pattern"] == f"^{c.DURATION_PATTERN}$"
    assert defs["size"]["pattern"] == f"^{c.SIZE_PATTERN}$"


@given(st.text(alphabet="0123456789.msKMGiBkh -\t", max_size=8))
def test_duration_and_size_agree_with_schema(text: str) -> None:
    """A string passes the schema's pattern exactly when the parser accepts it."""
    for pattern, parser in ((c.DURATION_PATTERN, c.parse_duration), (c.SIZE_PATTERN, c.parse_size)):
        matches = re.search(f"^{pattern}$", text) is not None
        try:
            parser(text)
            parsed = True
        except ValueError as exc:
            parsed = "whole number" in str(exc)  # sizes: the pattern allows 1.3B, the parser not
        assert matches == parsed, (pattern, text)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("timeouts.idle", "1 hour", "timeouts.idle: '1 hour' is not a duration"),
        ("timeouts.connect", "-1s", "timeouts.connect: '-1s' is not a duration"),
        ("timeouts.connect", -1, "timeouts.connect: must not be negative, got -1"),
        ("timeouts.close", [1], "timeouts.close: expected a duration"),
        ("pools.0.health.interval", "2 s ec", "pools[0].health.interval: '2 s ec' is not a dur"),
        ("limits.max_frame_size", "10k", "limits.max_frame_size: '10k' is not a size"),
        ("limits.write_buffer_high", "1.3B", "limits.write_buffer_high: '1.3B' is not a whole"),
        ("limits.max_header_bytes", 1.5, "limits.max_header_bytes: expected a size"),
        ("limits.max_message_size", "0B", "limits.max_message_size: must be greater than 0"),
    ],
)
def test_bad_duration_or_size_names_path_and_value(path: str, value: object, message: str) -> None:
    assert only_error(with_(BASE, path, value)).startswith(message)


# --------------------------------------------------------------------------- semantic checks

TWO_POOLS = with_(
    BASE,
    "pools",
    [*BASE["pools"], {"name": "b", "match": {"path_prefix": "/b"}, "backends": []}],
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            with_(TWO_POOLS, "pools.1.backends", [{"id": "w1", "url": "ws://h:1"}]),
            "pools[1].backends[0].id: duplicate backend id 'w1' (also pools[0].backends[0].id)",
        ),
        (
            with_(BASE, "pools.0.backends.1.id", "w1"),
            "pools[0].backends[1].id: duplicate backend id 'w1'",
        ),
        (
            with_(BASE, "listen", ["127.0.0.1:80", "127.0.0.1:80"]),
            "listen[1]: '127.0.0.1:80' is the same address as listen[0]",
        ),
        (
            with_(BASE, "listen", ["127.0.0.1:80", ":80"]),
            "listen[1]: ':80' overlaps",
        ),
        (with_(BASE, "listen", "localhost"), "listen: 'localhost' is not host:port"),
        (with_(BASE, "listen", "::1:80"), "listen: '::1:80' is not host:port"),
        (with_(BASE, "listen", "[::g]:80"), "listen: '::g' is not an IPv6 address"),
        (with_(BASE, "listen", "300.1.1.1:80"), "listen: '300.1.1.1' is not a valid host"),
        (with_(BASE, "listen", ["a:1", "h:0"]), "listen[1]: port 0 is out of range 1..65535"),
        (with_(BASE, "listen", [{"address": "h:65536"}]), "listen[0].address: port 65536 is out"),
        (with_(BASE, "admin", {"listen": "127.0.0.1:8080"}), "admin.listen: '127.0.0.1:8080' is"),
        (with_(BASE, "admin", {"listen": "h:99999"}), "admin.listen: port 99999 is out of range"),
        (with_(BASE, "listen", "127.0.0.1:8081"), "admin: '127.0.0.1:8081' is the same address"),
        (with_(BASE, "listen", ":8081"), "admin: '127.0.0.1:8081' overlaps"),
        (
            with_(with_(BASE, "listen", "127.0.0.1:9001"), "pools.0.backends.0.spawn", "reference"),
            "pools[0].backends[0].url: the spawned worker's address 127.0.0.1:9001 is the same "
            "address as the listen address 127.0.0.1:9001",
        ),
        (
            with_(
                with_(BASE, "pools.0.backends.1.url", "ws://localhost:8081"),
                "pools.0.backends.1.spawn",
                "reference",
            ),
            "pools[0].backends[1].url: the spawned worker's address localhost:8081 is the same "
            "address as the admin address 127.0.0.1:8081",
        ),
        (
            with_(TWO_POOLS, "pools.1.match.path_prefix", "/"),
            "pools[1].match.path_prefix: duplicate path_prefix '/' (also pools[0])",
        ),
        (
            with_(TWO_POOLS, "pools.1.match", {}),
            "pools[1]: duplicate path_prefix '/' (the default; also pools[0])",
        ),
        (with_(TWO_POOLS, "pools.1.name", "chat"), "pools[1].name: duplicate pool name 'chat'"),
        (with_(BASE, "timeouts.ping_timeout", 0), "timeouts.ping_timeout: must be longer"),
        (with_(BASE, "timeouts.handshake", "0ms"), "timeouts.handshake: must be longer"),
        (
            with_(BASE, "limits", {"max_frame_size": "2MiB", "max_message_size": "1MiB"}),
            "limits.max_frame_size: 2MiB is larger than max_message_size (1MiB)",
        ),
        (with_(BASE, "limits", {"max_frame_size": 100}), "limits.max_frame_size: must be at least"),
        (with_(BASE, "auth", {"jwt": {}}), "auth.jwt: needs exactly one of secret or public_key"),
        (
            with_(BASE, "auth", {"jwt": {"secret": ""}}),
            "auth.jwt.secret: is empty (is its environment variable set?)",
        ),
        (
            with_(BASE, "auth", {"jwt": {"secret": "s", "public_key_file": __file__}}),
            "auth.jwt: set only one of secret or public_key_file",
        ),
        (
            with_(BASE, "auth", {"jwt": {"secret": "s", "algorithms": ["HS256", "none"]}}),
            "auth.jwt.algorithms[1]: 'none' is not allowed",
        ),
        (
            with_(BASE, "auth", {"jwt": {"secret": "s", "algorithms": ["RS256"]}}),
            "auth.jwt.algorithms[0]: RS256 needs public_key_file",
        ),
        (
            with_(BASE, "auth", {"jwt": {"public_key_file": __file__}}),
            "auth.jwt.algorithms: HS256 (the default) needs a secret",
        ),
        (
            with_(
                BASE, "auth", {"jwt": {"public_key_file": "/no/such.pem", "algorithms": ["ES256"]}}
            ),
            "auth.jwt.public_key_file: file not found: '/no/such.pem'",
        ),
        (
            with_(BASE, "listen", {"address": ":1", "tls": {"cert": "/no/c.pem", "key": __file__}}),
            "listen.tls.cert: file not found: '/no/c.pem'",
        ),
        (
            with_(
                BASE, "listen", [{"address": ":1", "tls": {"cert": __file__, "key": "nokey.pem"}}]
            ),
            "listen[0].tls.key: file not found: 'nokey.pem' (relative to the working directory)",
        ),
        (
            with_(BASE, "listen", {"address": ":1", "tls": {"cert": __file__, "key": "/tmp"}}),
            "listen.tls.key: is a directory: '/tmp'",
        ),
        (with_(BASE, "workers", 0), "workers: must be at least 1, got 0"),
        (with_(BASE, "workers", 1.5), "workers: expected an integer, got 1.5"),
        (
            with_(BASE, "pools.0.backends.1.url", "ftp://x"),
            "pools[0].backends[1].url: 'ftp://x' is not a ws://, wss://, http:// or https:// URL",
        ),
        (
            with_(BASE, "pools.0.backends.1.url", "ws:///x"),
            "pools[0].backends[1].url: 'ws:///x' has no",
        ),
        (
            with_(BASE, "pools.0.backends.1.url", "ws://h:99999"),
            "pools[0].backends[1].url: 'ws://h:99",
        ),
        (
            with_(BASE, "pools.0.backends.1.url", "ws://h/#f"),
            "pools[0].backends[1].url: 'ws://h/#f' m",
        ),
        (
            with_(BASE, "pools.0.backends.1.url", "ws://u:p@h"),
            "pools[0].backends[1].url: 'ws://u:p@h",
        ),
        (
            with_(BASE, "pools.0.backends.0.weight", 0),
            "pools[0].backends[0].weight: must be greater",
        ),
        (
            with_(BASE, "pools.0.backends.0.weight", float("inf")),
            "pools[0].backends[0].weight: must be a finite",
        ),
        (
            with_(BASE, "pools.0.backends.0.spawn", "docker"),
            "pools[0].backends[0].spawn: 'docker' is not one of",
        ),
        (
            with_(
                with_(BASE, "pools.0.backends.0.spawn", "reference"),
                "pools.0.backends.0.url",
                "ws://10.1.1.1:9",
            ),
            "pools[0].backends[0].url: spawn needs a loopback URL",
        ),
        (
            with_(
                with_(BASE, "pools.0.backends.0.spawn", "reference"),
                "pools.0.backends.0.url",
                "ws://127.0.0.1/",
            ),
            "pools[0].backends[0].url: spawn needs an explicit port",
        ),
        (
            with_(
                BASE,
                "pools.0.backends",
                [
                    {"id": "a", "url": "ws://127.0.0.1:5", "spawn": "reference"},
                    {"id": "b", "url": "ws://localhost:5/x", "spawn": "reference"},
                ],
            ),
            "pools[0].backends[1].url: duplicate port of a spawned worker 5",
        ),
        (
            with_(BASE, "pools.0.backends.0.args", ["-v"]),
            "pools[0].backends[0].args: only used with spawn",
        ),
        (
            with_(BASE, "pools.0.backends.0.id", "w/1"),
            "pools[0].backends[0].id: 'w/1' is not a valid name",
        ),
        (
            with_(BASE, "pools.0.backends.0.metrics_url", "ftp://x"),
            "pools[0].backends[0].metrics_url: 'ftp://x' is not an http",
        ),
        (
            with_(BASE, "pools.0.hash_balance_factor", 1.0),
            "pools[0].hash_balance_factor: must be greater than 1, got 1.0",
        ),
        (
            with_(BASE, "pools.0.balance", "roundrobin"),
            "pools[0].balance: 'roundrobin' is not one of 'consistent', 'least_conn', "
            "'round_robin', 'random' (did you mean 'round_robin'?)",
        ),
        (
            with_(BASE, "pools.0.session_key", ["query:s", "bogus"]),
            "pools[0].session_key[1]: 'bogus' is not a session key source",
        ),
        (
            with_(BASE, "pools.0.session_key", "path:0"),
            "pools[0].session_key: 'path:0' is not a session key source",
        ),
        (
            with_(BASE, "pools.0.session_key", ["query:s", "query:s"]),
            "pools[0].session_key: lists 'query:s' more than once",
        ),
        (with_(BASE, "pools.0.session_key", []), "pools[0].session_key: must not be empty"),
        (
            with_(BASE, "pools.0.match", {"path_prefix": "chat"}),
            "pools[0].match.path_prefix: 'chat' must start with '/'",
        ),
        (
            with_(BASE, "pools.0.weights", {"metrics": "vlm"}),
            "pools[0].weights.metrics: 'vlm' is not a metrics preset (reference, vllm, sglang, "
            "llamacpp, dcgm) "
            "(did you mean 'vllm'?)",
        ),
        (
            with_(BASE, "pools.0.weights", {"metrics": {"gpu": "x"}}),
            "pools[0].weights.metrics.gpu: unknown key (did you mean 'gpu_util'?)",
        ),
        (
            with_(BASE, "pools.0.weights", {"metrics": {"running": "a-b"}}),
            "pools[0].weights.metrics.running: 'a-b' is not a Prometheus metric name",
        ),
        (
            with_(BASE, "pools.0.weights", {"scrape_interval": "5s", "stale_after": "5s"}),
            "pools[0].weights.stale_after: must be longer than scrape_interval (5s)",
        ),
        (
            with_(
                BASE, "pools.0.outlier", {"base_ejection_time": "1m", "max_ejection_time": "30s"}
            ),
            "pools[0].outlier.max_ejection_time: must not be shorter",
        ),
        (
            with_(BASE, "pools.0.outlier", {"max_ejection_percent": 101}),
            "pools[0].outlier.max_ejection_percent: must be at most 100",
        ),
        (with_(BASE, "pools.0.health", {"rise": 0}), "pools[0].health.rise: must be at least 1"),
        (
            with_(BASE, "auth", {"origins": ["https://a.example/"]}),
            "auth.origins[0]: 'https://a.example/' is not an origin",
        ),
        (
            with_(BASE, "cluster", {"etcd": "etcd:2379"}),
            "cluster.etcd: 'etcd:2379' is not an http:// or https:// URL",
        ),
        (with_(BASE, "cluster", {}), "cluster.etcd: required key is missing"),
        (with_(BASE, "pools", []), "pools: must not be empty"),
        ({}, "pools: required key is missing"),
        (None, "pools: required key is missing"),
        ([1], "<config>: expected a mapping, got a list"),
        (
            with_(BASE, "pools.0.backends.0", "w1"),
            "pools[0].backends[0]: expected a mapping, got 'w1'",
        ),
        (
            with_(BASE, "pools.0.drain", {"migrate": "yes"}),
            "pools[0].drain.migrate: expected true or false, got 'yes'",
        ),
        (with_(BASE, "admin", None), "admin: expected a mapping, got null"),
    ],
)
def test_semantic_checks(data: object, expected: str) -> None:
    assert only_error(data).startswith(expected)


def test_cluster_runs_one_process_per_instance() -> None:
    clustered = with_(BASE, "cluster", {"etcd": "http://127.0.0.1:2379", "prefix": "/wslb/a/"})
    assert c.parse(clustered).cluster == c.ClusterCfg("http://127.0.0.1:2379", "/wslb/a/")
    assert only_error(with_(clustered, "workers", 4)).startswith(
        "cluster: cluster mode runs one process per instance: set workers: 1 (not 4)"
    )


def test_semantic_check_accepts_the_valid_neighbours(tmp_path: Path) -> None:
    """The checks above are not over-eager: close variants of each are fine."""
    key = tmp_path / "k.pem"
    key.write_text("k")
    ok = [
        with_(BASE, "listen", ["127.0.0.1:80", "127.0.0.2:80", "127.0.0.1:81"]),
        with_(
            BASE, "auth", {"jwt": {"public_key_file": str(key), "algorithms": ["RS256", "EdDSA"]}}
        ),
        with_(BASE, "auth", {"jwt": {"secret": "s", "public_key_file": None}}),
        with_(BASE, "admin", {"listen": "127.0.0.1:8080"}) | {"listen": "127.0.0.1:9000"},
        with_(BASE, "pools.0.backends", []),
        with_(BASE, "pools.0.session_key", "header:X-Session-Id"),
        with_(BASE, "pools.0.weights", {"scrape_interval": "10s"}),  # stale_after follows it
        with_(BASE, "limits", {"max_frame_size": "16MiB"}),
        with_(BASE, "cluster", None),
        with_(BASE, "auth", {"jwt": None}),
        with_(BASE, "pools.0.backends.0.spawn", None),
    ]
    for data in ok:
        c.parse(data)
    assert c.parse(ok[6]).pools[0].weights.stale_after == 30.0


def test_many_errors_at_once_in_file_order() -> None:
    data = {
        "listen": "nowhere",
        "pools": [
            {
                "name": "a",
                "helth": {},
                "balance": "fastest",
                "backends": [{"id": "w", "url": "ftp://x"}, {"id": "w", "url": "ws://y"}],
            }
        ],
        "timeouts": {"ping_timeout": "0s", "idle": "soon"},
        "limits": {"max_frame_size": "32MiB"},
        "workers": 0,
    }
    assert errors(data) == [
        "listen: 'nowhere' is not host:port (e.g. 127.0.0.1:8080, [::1]:8080, :8080)",
        "pools[0].helth: unknown key (did you mean 'health'?)",
        "pools[0].balance: 'fastest' is not one of 'consistent', 'least_conn', 'round_robin', "
        "'random'",
        "pools[0].backends[0].url: 'ftp://x' is not a ws://, wss://, http:// or https:// URL",
        "pools[0].backends[1].id: duplicate backend id 'w' (also pools[0].backends[0].id)",
        "timeouts.ping_timeout: must be longer than 0, got '0s'",
        "timeouts.idle: 'soon' is not a duration (a number of seconds, or 250ms, 1.5s, 2m, 1h)",
        "limits.max_frame_size: 32MiB is larger than max_message_size (16MiB)",
        "workers: must be at least 1, got 0",
    ]


def test_schema_rejection_is_not_reported_twice() -> None:
    """A value the schema rejected is not checked again (one mistake, one message)."""
    data = with_(BASE, "pools.0.backends.1", {"id": "w1 ", "url": "ftp://x", "weight": -1})
    assert errors(data) == [
        "pools[0].backends[1].id: 'w1 ' is not a valid name (letters, digits, '.', '_', '-'; "
        "starting with a letter or digit)",
        "pools[0].backends[1].url: 'ftp://x' is not a ws://, wss://, http:// or https:// URL",
        "pools[0].backends[1].weight: must be greater than 0, got -1",
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({**BASE, "listn": ":80"}, "listn: unknown key (did you mean 'listen'?)"),
        ({**BASE, "timeout": {}}, "timeout: unknown key (did you mean 'timeouts'?)"),
        (
            with_(BASE, "pools.0.backends.0.wieght", 2),
            "pools[0].backends[0].wieght: unknown key (did you mean 'weight'?)",
        ),
        (
            with_(BASE, "limits", {"max_frame": 1}),
            "limits.max_frame: unknown key (did you mean 'max_frame_size'?)",
        ),
        (with_(BASE, "admin", {"Token": "x"}), "admin.Token: unknown key (did you mean 'token'?)"),
        ({**BASE, "zzz": 1}, "zzz: unknown key; expected one of listen, admin, pools, timeouts"),
        (dict([*BASE.items(), (7, 1)]), "[7]: key is not text (quote it in YAML)"),
        (with_(BASE, "pools.0.health", {True: 1}), "pools[0].health[true]: key is not text"),
        ({**BASE, "a b": 1}, "['a b']: unknown key"),
    ],
)
def test_unknown_keys(data: object, expected: str) -> None:
    assert only_error(data).startswith(expected)


def test_x_keys_hold_anchors(tmp_path: Path) -> None:
    f = tmp_path / "b.yaml"
    f.write_text(
        "x-worker: &worker {url: 'ws://127.0.0.1:9001/ws', spawn: reference}\n"
        "pools: [{name: p, backends: [{<<: *worker, id: a}, {<<: *worker, id: b, url: 'ws://127.0.0.1:9002/ws'}]}]\n"
    )
    backends = c.load(f, env={}).pools[0].backends
    assert [(b.id, b.port) for b in backends] == [("a", 9001), ("b", 9002)]


# --------------------------------------------------------------------------- files and YAML


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "balancer.yaml"
    f.write_text(text)
    return f


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pools:\n  - name: a\n   backends: []\n", "line 3 column 4: "),
        ("pools: [\n", "line 2 column 1: expected the node content"),
        ("a: 'x\n", "line 2 column 1: found unexpected end of stream"),
        ("pools:\n\t- a\n", "line 2 column 1: found character '\\t'"),
        ("pools: []\npools: []\n", "line 2 column 1: duplicate key 'pools'"),
        ("a: &x [*x]\n", "a[0]: refers to itself"),
        (
            "--- {}\n--- {}\n",
            "line 2 column 1: but found another document (expected a single document",
        ),
        ("a: \x00\n", "line 1 column 4: special characters are not allowed"),
    ],
)
def test_yaml_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        c.load(write(tmp_path, text), env={})
    assert info.value.errors[0].startswith(expected), info.value.errors


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        c.load(path)
    assert info.value.errors == [f"{path}: file not found"]
    with pytest.raises(ConfigError, match="is a directory"):
        c.load(tmp_path)


def test_load_errors_carry_the_source(tmp_path: Path) -> None:
    f = write(tmp_path, "workers: 0\npools: [{name: p, backends: []}]\n")
    with pytest.raises(ConfigError) as info:
        c.load(f, env={})
    assert info.value.source == str(f)
    assert info.value.errors == ["workers: must be at least 1, got 0"]
    with pytest.raises(ConfigError) as info:
        c.load(write(tmp_path, "x: ${A:?}"), env={})
    assert info.value.source == str(f)


def test_config_error_survives_pickling() -> None:
    err = ConfigError(["a: x", "b: y"], "f.yaml")
    back = pickle.loads(pickle.dumps(err))
    assert (back.errors, back.source, str(back)) == (["a: x", "b: y"], "f.yaml", "a: x\nb: y")
    assert ConfigError("one").errors == ["one"]


def test_schema_copies_identical_and_valid() -> None:
    packaged = ROOT / "balancer/schema/balancer.schema.json"
    assert packaged.read_bytes() == (ROOT / "config/balancer.schema.json").read_bytes()
    assert packaged.read_text() == (
        resources.files("balancer").joinpath("schema/balancer.schema.json").read_text()
    )
    schema = json.loads(packaged.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


EXAMPLES = sorted((ROOT / "config").glob("*.yaml")) + sorted(
    p for p in [ROOT / "balancer.yaml"] if p.exists()
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_parse(path: Path) -> None:
    cfg = c.load(path, env={})
    assert cfg.pools and all(p.backends for p in cfg.pools)


def test_example_configs_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"vllm.yaml", "sidecar.yaml"} <= names
    vllm = c.load(ROOT / "config/vllm.yaml", env={})
    assert len(vllm.pools[0].backends) == 3
    assert vllm.pools[0].weights.metrics == "vllm"
    assert vllm.pools[0].balance == "consistent"
    sidecar = c.load(ROOT / "config/sidecar.yaml", env={"WSLB_ADMIN_TOKEN": "t"})
    assert sidecar.listen == (c.Listener("0.0.0.0", 8080),)
    assert (sidecar.admin.host, sidecar.admin.token) == ("127.0.0.1", "t")
    assert len(sidecar.pools[0].backends) == 1


# --------------------------------------------------------------------------- fuzzing


def _keys(schema: object, out: set[str]) -> set[str]:
    if isinstance(schema, dict):
        out.update(schema.get("properties", {}))
        for v in schema.values():
            _keys(v, out)
    elif isinstance(schema, list):
        for v in schema:
            _keys(v, out)
    return out


KEYS = sorted(_keys(json.loads((ROOT / "config/balancer.schema.json").read_text()), set()))
WORDS = [
    "",
    "1s",
    "0",
    "-1",
    "16MiB",
    "ws://h:1",
    "ws://127.0.0.1:0",
    "http://h",
    "127.0.0.1:80",
    ":0",
    "[::1]:1",
    "query:s",
    "path:-1",
    "reference",
    "vllm",
    "none",
    "HS256",
    "/",
    "/x",
    "\x00",
    "w1",
    "1e400",
    "${X}",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(WORDS)
)
json_like = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(KEYS) | st.text(max_size=6) | st.integers(), inner, max_size=5
        )
    ),
    max_leaves=25,
)


def _paths(node: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


FULL_PATHS = _paths(FULL)[1:]


def _parse_only_config_errors(data: object) -> None:
    try:
        cfg = c.parse(data)
    except ConfigError as exc:
        assert exc.errors and all(isinstance(e, str) and ": " in e for e in exc.errors)
    else:
        assert isinstance(cfg, c.Config) and cfg.pools


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_like)
def test_parse_arbitrary_data_raises_only_config_error(data: object) -> None:
    _parse_only_config_errors(data)
    _parse_only_config_errors({"pools": [{"name": "p", "backends": [data]}], "limits": data})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FULL_PATHS), json_like), min_size=1, max_size=4))
def test_parse_mutated_config_raises_only_config_error(
    edits: list[tuple[tuple[object, ...], object]],
) -> None:
    data = copy.deepcopy(FULL)
    for path, value in edits:
        node: Any = data
        try:
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced a parent
    _parse_only_config_errors(data)


YAML_BITS = [
    *"ab:-[]{}&*!<>|'\"#$\n \t,?%@`01.",
    "pools",
    "name",
    "${X}",
    "$$",
    "${A:-",
    "!!binary",
    "!!set",
    "!!python/object",
    "<<: *a",
    "&a",
    "2001-01-01",
    ".inf",
    "0x1F",
    "~",
    "on",
    "\x00",
    "\ufeff",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(YAML_BITS), max_size=30).map("".join))
def test_load_arbitrary_text_raises_only_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "b.yaml"
        f.write_text(text, encoding="utf-8")
        try:
            c.load(f, env={"X": "1"})
        except ConfigError as exc:
            assert exc.errors


def test_client_address_and_log_keys() -> None:
    cfg = c.parse(
        {
            **BASE,
            "listen": [{"address": "0.0.0.0:8080", "proxy_protocol": True}, "127.0.0.1:8090"],
            "trusted_proxies": ["10.0.0.0/8", "192.168.1.7", "fd00::/8", "10.0.0.0/8"],
            "log": {"format": "json", "access": False},
        }
    )
    assert [lst.proxy_protocol for lst in cfg.listen] == [True, False]
    assert [str(n) for n in cfg.trusted_proxies] == ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]
    assert cfg.log == c.LogCfg("json", False)
    assert c.parse(with_(BASE, "pools.0.health", {"path": "/ready"})).pools[0].health.path == (
        "/ready"
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (with_(BASE, "trusted_proxies", ["10.0.0.0/33"]), "trusted_proxies[0]: '10.0.0.0/33' is"),
        (with_(BASE, "trusted_proxies", ["proxy.local"]), "trusted_proxies[0]: 'proxy.local' is"),
        (
            {**BASE, "listen": [{"address": "127.0.0.1:80", "proxy_protocol": True}]},
            "trusted_proxies: is empty, but a listener has proxy_protocol: true",
        ),
        (with_(BASE, "log", {"format": "xml"}), "log.format: 'xml' is not one of 'text', 'json'"),
        (with_(BASE, "log", {"acess": True}), "log.acess: unknown key (did you mean 'access'?)"),
        (with_(BASE, "pools.0.health", {"path": "healthz"}), "pools[0].health.path: 'healthz'"),
    ],
)
def test_client_address_and_log_errors(data: object, expected: str) -> None:
    with pytest.raises(c.ConfigError) as exc:
        c.parse(data)
    assert any(e.startswith(expected) for e in exc.value.errors), exc.value.errors
