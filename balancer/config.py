"""balancer.yaml -> validated, frozen dataclasses; every error named by its YAML path.

Why it works this way:

- The config is read at start, on SIGHUP and on ``POST /reload`` while traffic flows, and
  ``wslb check`` must list *every* problem in one run (exit 2). So nothing here stops at the first
  error: the JSON Schema pass collects all of its errors, the semantic pass still runs on the parts
  the schema accepted, and one :class:`ConfigError` carries them all, sorted in file order.
- The JSON Schema (``schema/balancer.schema.json``, copied to ``config/`` for editors) is the one
  description of the file's shape; this module adds only what a schema cannot say (uniqueness
  across pools, address parsing, files that must exist, relations between fields).
- The result is frozen (``slots=True``, tuples): the proxy shares one instance between
  connections and swaps it whole on reload, never mutating it.

Pipeline: :func:`load` reads the file and expands ``${VAR}`` (:func:`expand_env`), YAML is parsed
with ``safe_load`` semantics plus duplicate-key detection, then :func:`parse` validates and builds.
Besides reading the file, the only I/O is checking that TLS and JWT key files exist.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from importlib import resources
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit

import jsonschema
import yaml

from balancer.weights import Coefficients

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

__all__ = [
    "DEFAULT_SESSION_KEY",
    "Admin",
    "AuthCfg",
    "BackendCfg",
    "ClusterCfg",
    "Config",
    "ConfigError",
    "DrainCfg",
    "HealthCfg",
    "JwtCfg",
    "KeySource",
    "Limits",
    "Listener",
    "LogCfg",
    "OutlierCfg",
    "PoolCfg",
    "Timeouts",
    "Tls",
    "WeightsCfg",
    "expand_env",
    "load",
    "parse",
    "parse_duration",
    "parse_size",
]


class ConfigError(Exception):
    """Every problem found in a config, each ``"PATH: message"`` (``pools[0].backends[1].url``).

    All problems travel together so an operator fixes a file in one pass; ``str()`` is one
    problem per line, ready for ``wslb check`` to print.
    """

    errors: list[str]
    source: str

    def __init__(self, errors: Iterable[str] | str, source: str = "<config>") -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[str], str]]:
        # The default would rebuild from the joined message and split it into characters.
        return (type(self), (self.errors, self.source))


# --------------------------------------------------------------------------- environment

_ENV_EXPR: Final = re.compile(
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?", re.DOTALL
)


def expand_env(text: str, env: Mapping[str, str]) -> str:
    """Expand ``${VAR}`` references the way docker compose does, so secrets stay out of the file.

    ``${VAR}`` is the value or "" when unset; ``${VAR:-default}`` uses the default when VAR is
    unset or empty (``${VAR-default}``: only when unset); ``${VAR:?message}`` is an error when VAR
    is unset or empty (``${VAR?message}``: only when unset). Defaults may contain further
    ``${...}``. ``$$`` is a literal ``$``; any other ``$`` is kept as is. Values are inserted
    verbatim, before YAML parsing: quote a substitution whose value may contain YAML syntax.

    Raises:
        ConfigError: for malformed or required-but-unset substitutions, each named
            ``line L column C``.
    """
    errors: list[str] = []
    out = _expand(text, 0, text, env, errors)
    if errors:
        raise ConfigError(errors)
    return out


def _expand(s: str, base: int, whole: str, env: Mapping[str, str], errors: list[str]) -> str:
    parts: list[str] = []
    i = 0
    while (j := s.find("$", i)) >= 0:
        parts.append(s[i:j])
        if s.startswith("$$", j):
            parts.append("$")
            i = j + 2
        elif s.startswith("${", j):
            end = _closing_brace(s, j + 2)
            if end < 0:
                errors.append(f"{_line_col(whole, base + j)}: '${{' without a closing '}}'")
                parts.append(s[j:])
                return "".join(parts)
            parts.append(_substitute(s[j + 2 : end], base + j, whole, env, errors))
            i = end + 1
        else:
            parts.append("$")
            i = j + 1
    parts.append(s[i:])
    return "".join(parts)


def _closing_brace(s: str, start: int) -> int:
    depth = 0
    k = start
    while k < len(s):
        if s.startswith("$$", k):
            k += 2
            continue
        if s.startswith("${", k):
            depth += 1
            k += 2
            continue
        if s[k] == "}":
            if depth == 0:
                return k
            depth -= 1
        k += 1
    return -1


def _substitute(body: str, at: int, whole: str, env: Mapping[str, str], errors: list[str]) -> str:
    m = _ENV_EXPR.fullmatch(body)
    if m is None:
        errors.append(
            f"{_line_col(whole, at)}: invalid substitution '${{{body}}}' "
            "(expected ${NAME}, ${NAME:-default} or ${NAME:?message})"
        )
        return ""
    name, op, arg = m["name"], m["op"], m["arg"]
    value = env.get(name)
    if op is None:
        return value or ""
    unset = value is None if op in ("-", "?") else not value
    if op in (":-", "-"):
        if unset or value is None:
            return _expand(arg, at + 2 + m.start("arg"), whole, env, errors)
        return value
    if unset or value is None:
        errors.append(f"{_line_col(whole, at)}: {name} is not set" + (f": {arg}" if arg else ""))
        return ""
    return value


def _line_col(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line} column {column}"


# --------------------------------------------------------------------------- units

# The JSON Schema's duration and size patterns are these, anchored (a test keeps them equal).
DURATION_PATTERN: Final = r"\s*([0-9]+(\.[0-9]+)?)\s*(ms|s|m|h)?\s*"
SIZE_PATTERN: Final = r"\s*([0-9]+(\.[0-9]+)?)\s*(B|KB|kB|MB|GB|KiB|MiB|GiB)?\s*"
_DURATION_RE: Final = re.compile(DURATION_PATTERN)
_SIZE_RE: Final = re.compile(SIZE_PATTERN)
_SECONDS: Final = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_BYTES: Final = {
    "B": 1,
    "KB": 1000,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}
_DURATION_HINT: Final = "a number of seconds, or 250ms, 1.5s, 2m, 1h"
_SIZE_HINT: Final = "a number of bytes, or 256KiB, 16MiB, 1GiB, 1KB, 1MB"


def parse_duration(v: str | int | float) -> float:
    """Seconds from ``"250ms"``, ``"1.5s"``, ``"2m"``, ``"1h"`` or a plain number of seconds.

    Units keep configs readable (``idle: 1h``); plain numbers keep them scriptable. Also used for
    durations in admin API requests.

    Raises:
        ValueError: not a duration, negative, or not finite.
    """
    if isinstance(v, str):
        m = _DURATION_RE.fullmatch(v)
        if m is None:
            raise ValueError(f"{v!r} is not a duration ({_DURATION_HINT})")
        seconds = float(Decimal(m[1]) * _SECONDS[m[3] or "s"])
    elif isinstance(v, int | float) and not isinstance(v, bool):
        try:
            seconds = float(v)
        except OverflowError:
            raise ValueError(f"{v!r} is too large for a duration") from None
    else:
        raise ValueError(f"{v!r} is not a duration ({_DURATION_HINT})")
    if not math.isfinite(seconds):
        raise ValueError(f"{v!r} is too large for a duration")
    if seconds < 0:
        raise ValueError(f"{v!r} is negative")
    return seconds


def parse_size(v: str | int | float) -> int:
    """Bytes from ``"256KiB"``, ``"16MiB"``, ``"1GiB"``, ``"1KB"`` (1000), ``"10B"`` or an int.

    Binary (KiB) and decimal (KB) units are both accepted because operators copy limits from both
    worlds; anything vaguer ("10k", "1M") is refused rather than guessed.

    Raises:
        ValueError: not a size, negative, or not a whole number of bytes.
    """
    if isinstance(v, str):
        m = _SIZE_RE.fullmatch(v)
        if m is None:
            raise ValueError(f"{v!r} is not a size ({_SIZE_HINT})")
        exact = Decimal(m[1]) * _BYTES[m[3] or "B"]
        if exact != exact.to_integral_value():
            raise ValueError(f"{v!r} is not a whole number of bytes")
        return int(exact)
    # JSON Schema counts 1024.0 as an integer, so YAML/JSON floats with no fraction are accepted.
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise ValueError(f"{v!r} is negative")
        return v
    raise ValueError(f"{v!r} is not a size ({_SIZE_HINT})")


# --------------------------------------------------------------------------- the config


@dataclass(frozen=True, slots=True)
class Tls:
    """PEM files of a wss listener."""

    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class Listener:
    """One address clients connect to; ``host`` has no brackets (``::1``)."""

    host: str
    port: int
    tls: Tls | None = None
    proxy_protocol: bool = False  # a PROXY v1/v2 header precedes each connection's request

    def __str__(self) -> str:
        return _join_host_port(self.host, self.port)


@dataclass(frozen=True, slots=True)
class Admin:
    """The admin API's address and bearer token (None: wslb generates one at start)."""

    host: str = "127.0.0.1"
    port: int = 8081
    token: str | None = None


@dataclass(frozen=True, slots=True)
class KeySource:
    """Where a session key is read: ``query``, ``header``, ``cookie`` or ``path``.

    For ``path``, ``name`` is a 1-based segment index as a string; negative counts from the end.
    """

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


DEFAULT_SESSION_KEY: Final = (
    KeySource("query", "session"),
    KeySource("header", "X-Session-Id"),
    KeySource("cookie", "wslb_session"),
)


@dataclass(frozen=True, slots=True)
class HealthCfg:
    """Active health checks; ``rise``/``fall`` consecutive results flip the state.

    ``path`` None (the default) probes with a TCP connect, as HAProxy's plain ``check`` does:
    a WebSocket server nobody wrote for wslb has no health route to ask.
    """

    interval: float = 2.0
    timeout: float = 1.0
    rise: int = 2
    fall: int = 3
    path: str | None = None
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class OutlierCfg:
    """Passive ejection after consecutive connect/handshake failures."""

    consecutive_failures: int = 5
    base_ejection_time: float = 30.0
    max_ejection_time: float = 300.0
    max_ejection_percent: int = 50


@dataclass(frozen=True, slots=True)
class DrainCfg:
    """Defaults for draining a worker."""

    timeout: float = 60.0
    migrate: bool = True


@dataclass(frozen=True, slots=True)
class WeightsCfg:
    """Live-weight scraping. ``metrics`` is a preset name or ``((signal, metric), ...)``.

    Signals: ``gpu_util``, ``kv_cache_usage``, ``running``, ``waiting``, ``tpot``.
    """

    scrape_interval: float = 1.0
    metrics: str | tuple[tuple[str, str], ...] = "reference"
    stale_after: float = 5.0
    coefficients: Coefficients = Coefficients()  # noqa: RUF009 (frozen, shared safely)
    smoothing: float = 20.0


@dataclass(frozen=True, slots=True)
class UpstreamTls:
    """TLS towards ``wss://`` workers: CA bundle (None: system trust) and client certificate."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class BackendCfg:
    """One worker. ``url`` is kept as written; the properties give its parts."""

    id: str
    url: str
    weight: float = 1.0
    spawn: str | None = None
    args: tuple[str, ...] = ()
    metrics_url: str | None = None

    @property
    def secure(self) -> bool:
        """True for wss://."""
        return self.url.startswith("wss:")

    @property
    def host(self) -> str:
        """Host of the URL, without IPv6 brackets."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """Port of the URL, 80/443 when it has none."""
        return urlsplit(self.url).port or (443 if self.secure else 80)

    @property
    def resource(self) -> str:
        """Request target for the worker handshake: path (default ``/``) and query."""
        u = urlsplit(self.url)
        return (u.path or "/") + (f"?{u.query}" if u.query else "")


@dataclass(frozen=True, slots=True)
class PoolCfg:
    """A group of interchangeable workers serving one path prefix."""

    name: str
    path_prefix: str = "/"
    session_key: tuple[KeySource, ...] = DEFAULT_SESSION_KEY
    balance: str = "consistent"
    hash_balance_factor: float = 1.25
    weights: WeightsCfg = WeightsCfg()
    health: HealthCfg = HealthCfg()
    outlier: OutlierCfg = OutlierCfg()
    drain: DrainCfg = DrainCfg()
    backends: tuple[BackendCfg, ...] = ()
    upstream_tls: UpstreamTls | None = None
    affinity_hold: float = 30.0  # seconds a key keeps its place after its session ends


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``idle`` and ``ping_interval`` of 0 disable those timers."""

    handshake: float = 10.0
    connect: float = 5.0
    idle: float = 3600.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    close: float = 5.0
    shutdown_grace: float = 5.0
    backpressure: float = 60.0


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits; sizes in bytes."""

    max_connections: int = 10000
    max_frame_size: int = 1024**2
    max_message_size: int = 16 * 1024**2
    write_buffer_high: int = 256 * 1024
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    # 0: no limit. Behind an ingress, a NAT or in a sidecar every session has one address.
    max_connections_per_client: int = 0


@dataclass(frozen=True, slots=True)
class LogCfg:
    """``format``: text or json (every line); ``access``: one line per ended session."""

    format: str = "text"
    access: bool = True


@dataclass(frozen=True, slots=True)
class JwtCfg:
    """JWT check: exactly one of ``secret`` (HS*) or ``public_key_file`` (RS/PS/ES/EdDSA)."""

    secret: str | None = None
    public_key_file: str | None = None
    algorithms: tuple[str, ...] = ("HS256",)
    audience: str | None = None
    query_param: str | None = None
    session_claim: str | None = None


@dataclass(frozen=True, slots=True)
class AuthCfg:
    """Client auth; ``origins`` are normalised (lowercase, no default port); empty: any."""

    jwt: JwtCfg | None = None
    origins: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterCfg:
    """Shared state of several wslb instances in etcd."""

    etcd: str
    prefix: str = "/wslb/"


@dataclass(frozen=True, slots=True)
class Config:
    """The whole balancer.yaml. ``source`` is the file it came from, for messages."""

    listen: tuple[Listener, ...] = (Listener("127.0.0.1", 8080),)
    admin: Admin = Admin()
    pools: tuple[PoolCfg, ...] = ()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    auth: AuthCfg = AuthCfg()
    workers: int = 1
    cluster: ClusterCfg | None = None
    # Proxies whose X-Forwarded-For / PROXY header names the client (ip_network objects).
    trusted_proxies: tuple[IPNetwork, ...] = ()
    log: LogCfg = LogCfg()
    source: str = "<config>"

    def backend_ids(self) -> tuple[str, ...]:
        """Ids of every backend, in file order."""
        return tuple(b.id for p in self.pools for b in p.backends)

    def backend(self, backend_id: str) -> BackendCfg | None:
        """The backend with this id, in whatever pool."""
        return next((b for p in self.pools for b in p.backends if b.id == backend_id), None)

    def pool(self, name: str) -> PoolCfg | None:
        """The pool with this name."""
        return next((p for p in self.pools if p.name == name), None)


# --------------------------------------------------------------------------- load / parse


def load(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read a YAML config, expand ``${VAR}`` from ``env`` (default ``os.environ``), parse it.

    Raises:
        ConfigError: unreadable file (``PATH: file not found``), bad substitution, YAML syntax
            error (``line L column C: ...``) or any error :func:`parse` reports.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8-sig") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError([f"{name}: file not found"], name) from None
    except IsADirectoryError:
        raise ConfigError([f"{name}: is a directory, not a file"], name) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{name}: not UTF-8 text ({exc.reason})"], name) from None
    except OSError as exc:
        raise ConfigError([f"{name}: {exc.strerror or exc}"], name) from None
    try:
        text = expand_env(text, os.environ if env is None else env)
    except ConfigError as exc:
        raise ConfigError(exc.errors, name) from None
    return parse(_yaml(text, name), name)


def parse(data: object, source: str = "<config>") -> Config:
    """Validate already-loaded YAML/JSON data and build a :class:`Config`.

    Schema errors and semantic errors are reported together; the semantic checks skip whatever the
    schema already rejected, so each mistake is reported once, at the path that holds it.

    Raises:
        ConfigError: with every problem, in file order.
    """
    if data is None:  # an empty file: report what is missing rather than "not a mapping"
        data = {}
    data, fatal, problems = _prepare(data)
    if fatal:
        raise ConfigError([f"{_format_path(p, source)}: {m}" for p, m in fatal], source)
    problems += _schema_problems(data)
    builder = _Builder({p for p, _ in problems})
    config = builder.config(data, source)
    problems += builder.problems
    if problems:
        raise ConfigError(_render(problems, data, source), source)
    return config


def parse_backend(data: object) -> BackendCfg:
    """Validate one backend object (``POST /backends``) with the same rules as the file.

    Errors name the field (``url: ...``), as the object stands alone.
    """
    try:
        cfg = parse({"pools": [{"name": "api", "backends": [data]}]}, "<backend>")
    except ConfigError as exc:
        prefix = "pools[0].backends[0]"
        errors = [
            e.removeprefix("<backend>: ").replace(prefix + ".", "").replace(prefix, "backend")
            for e in exc.errors
        ]
        raise ConfigError(errors, "<backend>") from None
    return cfg.pools[0].backends[0]


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """``safe_load`` semantics, but a key given twice in one mapping is an error.

    PyYAML silently keeps the last duplicate, which hides real mistakes (two ``health:`` blocks).
    Keys brought in by a ``<<`` merge may still be overridden, as YAML intends.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {_show(key)}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "invalid YAML"
        if exc.problem and exc.context:
            at = exc.context_mark
            what += f" ({exc.context}" + (f" at line {at.line + 1})" if at else ")")
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark else source
        raise ConfigError([f"{where}: {what}"], source) from None
    except yaml.reader.ReaderError as exc:
        raise ConfigError(
            [f"{_line_col(text, exc.position)}: {exc.reason} (character {exc.character!r})"],
            source,
        ) from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        # ValueError: e.g. an integer beyond Python's digit limit.
        raise ConfigError([f"{source}: {exc}"], source) from None


# --------------------------------------------------------------------------- error paths

_Path = tuple[object, ...]  # mapping keys and list indexes, outermost first
_Problem = tuple[_Path, str]
_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _format_path(path: _Path, source: str) -> str:
    """``pools[0].backends[1].url``; the empty path (the whole file) is ``source``."""
    if not path:
        return source
    out: list[str] = []
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out.append(f"[{part}]")
        elif isinstance(part, str) and _IDENT.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{_show(part)}]")
    return "".join(out)


def _show(v: object) -> str:
    """A value as the YAML author would recognise it, kept short."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _render(problems: list[_Problem], data: object, source: str) -> list[str]:
    """Format, de-duplicate and sort problems in the order their paths appear in the file."""
    ordered = sorted(problems, key=lambda p: _file_order(data, p[0]))
    out: dict[str, None] = {}
    for path, message in ordered:
        out.setdefault(f"{_format_path(path, source)}: {message}", None)
    return list(out)


def _file_order(data: object, path: _Path) -> tuple[int, ...]:
    order: list[int] = []
    node = data
    for part in path:
        if isinstance(node, dict):
            keys = list(node)
            order.append(keys.index(part) if part in node else len(keys))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            order.append(part)
            node = node[part]
        else:
            order.append(0)
            node = None
    return tuple(order)


_MAX_DEPTH: Final = 64
_MAX_NODES: Final = 200_000


def _prepare(data: object) -> tuple[object, list[_Problem], list[_Problem]]:
    """Copy ``data`` for validation: returns (copy, fatal problems, key problems).

    Fatal: data no config has and YAML aliases can produce (very deep, self-referencing, huge);
    parsing stops there, before the schema validator could recurse forever or take minutes.
    Keys that are not text (YAML reads ``on:`` as ``true:``) are reported and left out of the
    copy, as jsonschema assumes text keys.
    """
    fatal: list[_Problem] = []
    keys: list[_Problem] = []
    nodes = 0
    on_path: set[int] = set()

    def copy(v: object, path: _Path) -> object:
        nonlocal nodes
        nodes += 1
        if fatal or nodes > _MAX_NODES:
            return None
        if len(path) > _MAX_DEPTH:
            fatal.append((path, f"nested deeper than {_MAX_DEPTH} levels"))
            return None
        if isinstance(v, int) and v.bit_length() > 256:
            fatal.append((path, "number too large"))
        if not isinstance(v, dict | list):
            return v
        if id(v) in on_path:
            fatal.append((path, "refers to itself (recursive YAML alias)"))
            return None
        on_path.add(id(v))
        out: object
        if isinstance(v, list):
            out = [copy(child, (*path, i)) for i, child in enumerate(v)]
        else:
            mapping: dict[str, object] = {}
            for k, child in v.items():
                if isinstance(k, str):
                    mapping[k] = copy(child, (*path, k))
                else:
                    keys.append(((*path, k), "key is not text (quote it in YAML)"))
            out = mapping
        on_path.discard(id(v))
        return out

    result = copy(data, ())
    if nodes > _MAX_NODES and not fatal:
        fatal.append(((), f"more than {_MAX_NODES} values (YAML alias expansion?)"))
    return result, fatal, keys


# --------------------------------------------------------------------------- schema pass

_SCHEMA_RESOURCE: Final = "schema/balancer.schema.json"


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("balancer").joinpath(_SCHEMA_RESOURCE).read_text(encoding="utf-8")
    return jsonschema.Draft202012Validator(json.loads(text))


_JSON_TYPES: Final = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
    "null": "null",
}
_PRESETS: Final = ("reference", "vllm", "dcgm")
# Messages for schema patterns, by the "title" of the schema holding the pattern.
_PATTERN_MESSAGES: Final = {
    "duration": f"is not a duration ({_DURATION_HINT})",
    "size": f"is not a size ({_SIZE_HINT})",
    "address": "is not host:port (e.g. 127.0.0.1:8080, [::1]:8080, :8080)",
    "name": "is not a valid name (letters, digits, '.', '_', '-'; starting with a letter or digit)",
    "url path": "must start with '/'",
    "cidr": "is not an IP address or CIDR block",
    "http url": "is not an http:// or https:// URL",
    "ws url": "is not a ws:// or wss:// URL",
    "session key": "is not a session key source (query:NAME, header:NAME, cookie:NAME or path:N)",
    "metric name": "is not a Prometheus metric name",
    "metrics preset": f"is not a metrics preset ({', '.join(_PRESETS)})",
    "origin": "is not an origin (scheme://host[:port], no path)",
}
_TYPE_HINTS: Final = {"duration": _DURATION_HINT, "size": _SIZE_HINT}


def _schema_problems(data: object) -> list[_Problem]:
    out: list[_Problem] = []
    for error in _validator().iter_errors(data):
        out.extend(_translate(error))
    return out


def _translate(error: jsonschema.ValidationError) -> Iterator[_Problem]:
    """One jsonschema error as problems an operator can act on, at the path of the mistake."""
    path: _Path = tuple(error.absolute_path)
    keyword = error.validator
    expected: Any = error.validator_value
    value: Any = error.instance
    schema: Mapping[str, Any] = error.schema if isinstance(error.schema, Mapping) else {}
    title = schema.get("title")
    if keyword == "additionalProperties" and isinstance(value, dict):
        allowed = list(schema.get("properties", {}))
        patterns = list(schema.get("patternProperties", {}))
        for key in value:
            if key in allowed or (
                isinstance(key, str) and any(re.search(r, key) for r in patterns)
            ):
                continue
            yield (*path, key), _unknown_key(key, allowed)
    elif keyword == "required" and isinstance(value, dict):
        for key in expected:
            if key not in value:
                yield (*path, key), "required key is missing"
    elif keyword == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        wanted = _or([_JSON_TYPES.get(t, t) for t in types])
        if title in _TYPE_HINTS:
            wanted = f"a {title} ({_TYPE_HINTS[title]})"
        yield path, f"expected {wanted}, got {_show(value)}"
    elif keyword == "pattern":
        message = _PATTERN_MESSAGES.get(title or "", f"does not match {expected!r}")
        if title == "metrics preset":
            message += _suggest(value, _PRESETS)
        yield path, f"{_show(value)} {message}"
    elif keyword == "enum":
        if title == "jwt algorithm" and isinstance(value, str) and value.lower() == "none":
            yield path, "'none' is not allowed: tokens must be signed"
        else:
            choices = ", ".join(_show(c) for c in expected)
            yield path, f"{_show(value)} is not one of {choices}{_suggest(value, expected)}"
    elif keyword == "minimum" and expected == 0:
        yield path, f"must not be negative, got {_show(value)}"
    elif keyword in _BOUNDS:
        yield path, f"must be {_BOUNDS[keyword]} {expected}, got {_show(value)}"
    elif keyword in ("minLength", "minItems", "minProperties") and expected == 1:
        yield path, "must not be empty"
    elif keyword == "uniqueItems" and isinstance(value, list):
        seen: list[object] = []
        repeated: object = "an entry"
        for item in value:
            if item in seen:
                repeated = _show(item)
                break
            seen.append(item)
        yield path, f"lists {repeated} more than once"
    elif keyword in ("anyOf", "oneOf") and error.context:
        yield from _translate(jsonschema.exceptions.best_match(error.context))
    else:
        yield path, error.message


_BOUNDS: Final = {
    "minimum": "at least",
    "maximum": "at most",
    "exclusiveMinimum": "greater than",
    "exclusiveMaximum": "less than",
}


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _suggest(value: object, choices: Iterable[object]) -> str:
    if not isinstance(value, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    if not close and len(value) >= 3:  # a prefix: "gpu" for "gpu_util"
        close = [c for c in names if c.lower().startswith(value.lower())][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key(key: object, allowed: list[str]) -> str:
    hint = _suggest(str(key), allowed)
    if hint:
        return "unknown key" + hint
    return "unknown key; expected one of " + ", ".join(allowed) if allowed else "unknown key"


# --------------------------------------------------------------------------- semantic pass

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ADDRESS_RE: Final = re.compile(r"(?:\[(?P<v6>[^\]\s]+)\]|(?P<host>[^:\[\]\s]*)):(?P<port>[0-9]+)")
_HOSTNAME_RE: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})
_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.", "ip6-localhost"})
_HMAC_ALGORITHMS: Final = frozenset({"HS256", "HS384", "HS512"})


class _Builder:
    """Builds the dataclasses and records what the schema cannot check.

    It runs even when the schema found errors, so one pass reports everything: a value at or under
    a path the schema rejected is replaced by its default and not looked at again. Every accessor
    checks types itself, so no input can make it raise.
    """

    def __init__(self, rejected: set[_Path]) -> None:
        self._rejected = rejected
        self.problems: list[_Problem] = []
        self.backend_paths: list[tuple[BackendCfg, _Path]] = []

    # -- accessors: absent, null, mistyped or schema-rejected values give the default

    def is_rejected(self, path: _Path) -> bool:
        return any(path[:i] in self._rejected for i in range(len(path) + 1))

    def is_valid(self, path: _Path) -> bool:
        """No problem at ``path``, so its value is the user's and may be compared to others."""
        return not self.is_rejected(path) and all(p != path for p, _ in self.problems)

    def error(self, path: _Path, message: str) -> None:
        if not self.is_rejected(path):
            self.problems.append((path, message))

    def get(self, m: Mapping[object, object], key: str, path: _Path) -> object:
        if key not in m or self.is_rejected((*path, key)):
            return None
        return m[key]

    def section(self, m: Mapping[object, object], key: str, path: _Path) -> dict[object, object]:
        v = self.get(m, key, path)
        return v if isinstance(v, dict) else {}

    def string(self, m: Mapping[object, object], key: str, path: _Path, default: str) -> str:
        v = self.get(m, key, path)
        return v if isinstance(v, str) else default

    def optional(self, m: Mapping[object, object], key: str, path: _Path) -> str | None:
        """An optional string; "" counts as unset (an unset ``${VAR}`` expands to "")."""
        v = self.get(m, key, path)
        return v if isinstance(v, str) and v else None

    def strings(self, m: Mapping[object, object], key: str, path: _Path) -> tuple[str, ...] | None:
        v = self.get(m, key, path)
        if not isinstance(v, list):
            return None
        return tuple(
            x
            for i, x in enumerate(v)
            if isinstance(x, str) and not self.is_rejected((*path, key, i))
        )

    def integer(self, m: Mapping[object, object], key: str, path: _Path, default: int) -> int:
        v = self.get(m, key, path)
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v if isinstance(v, int) and not isinstance(v, bool) else default

    def number(self, m: Mapping[object, object], key: str, path: _Path, default: float) -> float:
        v = self.get(m, key, path)
        if not isinstance(v, int | float) or isinstance(v, bool):
            return default
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            self.error((*path, key), f"must be a finite number, got {_show(v)}")
            return default
        return f

    def boolean(self, m: Mapping[object, object], key: str, path: _Path, default: bool) -> bool:
        v = self.get(m, key, path)
        return v if isinstance(v, bool) else default

    def duration(
        self,
        m: Mapping[object, object],
        key: str,
        path: _Path,
        default: float,
        *,
        positive: bool = False,
    ) -> float:
        v = self.get(m, key, path)
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            return default
        try:
            seconds = parse_duration(v)
        except ValueError as exc:
            self.error((*path, key), str(exc))
            return default
        if positive and seconds <= 0:
            self.error((*path, key), f"must be longer than 0, got {_show(v)}")
            return default
        return seconds

    def size(self, m: Mapping[object, object], key: str, path: _Path, default: int) -> int:
        v = self.get(m, key, path)
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            return default
        try:
            n = parse_size(v)
        except (ValueError, OverflowError) as exc:
            self.error((*path, key), str(exc))
            return default
        if n <= 0:
            self.error((*path, key), f"must be greater than 0, got {_show(v)}")
            return default
        return n

    def file(self, path: _Path, name: str) -> None:
        """Report a file that cannot be read now, rather than at the first TLS handshake."""
        if os.path.isfile(name):
            if not os.access(name, os.R_OK):
                self.error(path, f"cannot read {name!r} (permission denied)")
            return
        where = "" if os.path.isabs(name) else " (relative to the working directory)"
        what = "is a directory" if os.path.isdir(name) else "file not found"
        self.error(path, f"{what}: {name!r}{where}")

    # -- sections

    def config(self, data: object, source: str) -> Config:
        root: dict[object, object] = data if isinstance(data, dict) else {}
        listen = self.listeners(root)
        admin = self.admin(root, listen)
        pools = self.pools(root)
        trusted = self.networks(root, "trusted_proxies")
        if not root.get("trusted_proxies") and any(lst.proxy_protocol for lst in listen):
            self.error(
                ("trusted_proxies",),
                "is empty, but a listener has proxy_protocol: true (list the proxies that send "
                "the PROXY header)",
            )
        return Config(
            listen=listen,
            admin=admin,
            pools=pools,
            timeouts=self.timeouts(root),
            limits=self.limits(root),
            auth=self.auth(root),
            workers=self.integer(root, "workers", (), 1),
            cluster=self.cluster(root),
            trusted_proxies=trusted,
            log=self.log(root),
            source=source,
        )

    def address(self, text: str, path: _Path) -> tuple[str, int] | None:
        m = _ADDRESS_RE.fullmatch(text)
        if m is None:
            hint = " (IPv6 addresses go in brackets: [::1]:8080)" if text.count(":") > 1 else ""
            self.error(path, f"{_show(text)} {_PATTERN_MESSAGES['address']}{hint}")
            return None
        digits = m["port"].lstrip("0") or "0"
        port = int(digits) if len(digits) <= 5 else 0
        if not 1 <= port <= 65535:
            self.error(path, f"port {m['port']} is out of range 1..65535")
            return None
        if m["v6"] is not None:
            try:
                ipaddress.IPv6Address(m["v6"])
            except ValueError:
                self.error(path, f"{m['v6']!r} is not an IPv6 address")
                return None
            return m["v6"], port
        host = m["host"] or "0.0.0.0"
        if not _valid_host(host):
            self.error(path, f"{host!r} is not a valid host name or IPv4 address")
            return None
        return host, port

    def listeners(self, root: dict[object, object]) -> tuple[Listener, ...]:
        v = self.get(root, "listen", ())
        if v is None:
            return Config().listen
        items = list(enumerate(v)) if isinstance(v, list) else [(None, v)]
        out: list[tuple[Listener, _Path]] = []
        for i, item in items:
            p: _Path = ("listen",) if i is None else ("listen", i)
            if self.is_rejected(p):
                continue
            proxy = False
            if isinstance(item, str):
                text, at, tls = item, p, None
            elif isinstance(item, dict) and isinstance(item.get("address"), str):
                text, at, tls = item["address"], (*p, "address"), self.tls(item, p)
                proxy = self.boolean(item, "proxy_protocol", p, False)
            else:
                continue
            if self.is_rejected(at) or (parsed := self.address(text, at)) is None:
                continue
            listener = Listener(parsed[0], parsed[1], tls, proxy)
            for other, other_at in out:
                clash = _clash(listener, other)
                if clash:
                    self.error(at, f"{_show(text)} {clash} {_format_path(other_at, '')} ({other})")
                    break
            out.append((listener, at))
        return tuple(lst for lst, _ in out) or Config().listen

    def tls(self, item: dict[object, object], path: _Path) -> Tls | None:
        v = self.get(item, "tls", path)
        if not isinstance(v, dict):
            return None
        p = (*path, "tls")
        cert, key = self.string(v, "cert", p, ""), self.string(v, "key", p, "")
        for field, name in (("cert", cert), ("key", key)):
            if name:
                self.file((*p, field), name)
        return Tls(cert, key) if cert and key else None

    def admin(self, root: dict[object, object], listen: tuple[Listener, ...]) -> Admin:
        a = self.section(root, "admin", ())
        text = self.string(a, "listen", ("admin",), "")
        d = Admin()
        host, port = d.host, d.port
        parsed = self.address(text, ("admin", "listen")) if text else None
        if parsed is not None:
            host, port = parsed
        if parsed is not None or "listen" not in a:  # else: reported already
            for lst in listen:
                clash = _clash(Listener(host, port), lst)
                if clash:
                    self.error(
                        ("admin", "listen") if parsed else ("admin",),
                        f"{_show(_join_host_port(host, port))} {clash} the listen address {lst}",
                    )
                    break
        return Admin(host, port, self.optional(a, "token", ("admin",)))

    def pools(self, root: dict[object, object]) -> tuple[PoolCfg, ...]:
        v = self.get(root, "pools", ())
        out: list[PoolCfg] = []
        names: dict[object, _Path] = {}
        prefixes: dict[object, _Path] = {}
        for i, item in enumerate(v if isinstance(v, list) else []):
            p: _Path = ("pools", i)
            if not isinstance(item, dict) or self.is_rejected(p):
                continue
            pool = self.pool(item, p)
            out.append(pool)
            if pool.name:
                self._unique(names, pool.name, (*p, "name"), "pool name")
            match = item.get("match")
            if isinstance(match, dict) and "path_prefix" in match:
                self._unique(
                    prefixes, pool.path_prefix, (*p, "match", "path_prefix"), "path_prefix"
                )
            else:
                self._unique(prefixes, pool.path_prefix, p, "path_prefix", "the default; ")
        ids: dict[object, _Path] = {}
        spawn_ports: dict[object, _Path] = {}
        for b, bp in self.backend_paths:
            if b.id:
                self._unique(ids, b.id, (*bp, "id"), "backend id")
            if b.spawn is not None and b.url and _url_problem(b.url) is None:
                self._unique(spawn_ports, b.port, (*bp, "url"), "port of a spawned worker")
        return tuple(out)

    def _unique(
        self, seen: dict[object, _Path], value: object, path: _Path, what: str, note: str = ""
    ) -> None:
        if value in seen:
            also = _format_path(seen[value], "")
            self.error(path, f"duplicate {what} {_show(value)} ({note}also {also})")
        else:
            seen[value] = path

    def pool(self, item: dict[object, object], p: _Path) -> PoolCfg:
        name = self.string(item, "name", p, "")
        if name and not _NAME_RE.fullmatch(name):
            self.error((*p, "name"), f"{_show(name)} {_PATTERN_MESSAGES['name']}")
        match = self.section(item, "match", p)
        return PoolCfg(
            name=name,
            path_prefix=self.string(match, "path_prefix", (*p, "match"), "/"),
            session_key=self.session_key(item, p),
            balance=self.string(item, "balance", p, "consistent"),
            hash_balance_factor=self.number(item, "hash_balance_factor", p, 1.25),
            weights=self.weights(self.section(item, "weights", p), (*p, "weights")),
            health=self.health(self.section(item, "health", p), (*p, "health")),
            outlier=self.outlier(self.section(item, "outlier", p), (*p, "outlier")),
            drain=self.drain(self.section(item, "drain", p), (*p, "drain")),
            backends=self.backends(item, p),
            upstream_tls=self.upstream_tls(item, p),
            affinity_hold=self.duration(item, "affinity_hold", p, 30.0),
        )

    def upstream_tls(self, item: dict[object, object], path: _Path) -> UpstreamTls | None:
        v = self.get(item, "upstream_tls", path)
        if not isinstance(v, dict):
            return None
        p = (*path, "upstream_tls")
        files = {f: self.optional(v, f, p) for f in ("ca", "cert", "key")}
        for field, name in files.items():
            if name:
                self.file((*p, field), name)
        if (files["cert"] is None) != (files["key"] is None):
            self.error(p, "a client certificate needs both cert and key")
        return UpstreamTls(files["ca"], files["cert"], files["key"])

    def session_key(self, item: dict[object, object], p: _Path) -> tuple[KeySource, ...]:
        v = self.get(item, "session_key", p)
        at: _Path = (*p, "session_key")
        if isinstance(v, str):
            entries: list[tuple[object, _Path]] = [(v, at)]
        elif isinstance(v, list):
            entries = [(x, (*at, i)) for i, x in enumerate(v)]
        else:
            return DEFAULT_SESSION_KEY
        out: list[KeySource] = []
        for x, xp in entries:
            if isinstance(x, str) and not self.is_rejected(xp):
                source = _key_source(x)
                if source is None:
                    self.error(xp, f"{_show(x)} {_PATTERN_MESSAGES['session key']}")
                else:
                    out.append(source)
        return tuple(out) or DEFAULT_SESSION_KEY

    def weights(self, w: dict[object, object], p: _Path) -> WeightsCfg:
        d = WeightsCfg()
        scrape = self.duration(w, "scrape_interval", p, d.scrape_interval, positive=True)
        raw = self.get(w, "metrics", p)
        metrics = d.metrics
        if isinstance(raw, str):
            metrics = raw
        elif isinstance(raw, dict):
            pairs = tuple(
                (k, v) for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)
            )
            metrics = pairs or metrics
        stale = self.duration(w, "stale_after", p, max(d.stale_after, 3 * scrape), positive=True)
        if (
            "stale_after" in w
            and self.is_valid((*p, "stale_after"))
            and self.is_valid((*p, "scrape_interval"))
            and stale <= scrape
        ):
            self.error(
                (*p, "stale_after"),
                f"must be longer than scrape_interval ({scrape:g}s), or every scrape is stale",
            )
        c = self.section(w, "coefficients", p)
        cp = (*p, "coefficients")
        dc = Coefficients()
        coef = Coefficients(
            gpu=self.number(c, "gpu", cp, dc.gpu),
            kv_cache=self.number(c, "kv_cache", cp, dc.kv_cache),
            queue=self.number(c, "queue", cp, dc.queue),
            tpot=self.number(c, "tpot", cp, dc.tpot),
            min_factor=self.number(c, "min_factor", cp, dc.min_factor),
            noise_band=self.number(c, "noise_band", cp, dc.noise_band),
        )
        smoothing = self.duration(w, "smoothing", p, d.smoothing)
        return WeightsCfg(scrape, metrics, stale, coef, smoothing)

    def health(self, h: dict[object, object], p: _Path) -> HealthCfg:
        d = HealthCfg()
        return HealthCfg(
            interval=self.duration(h, "interval", p, d.interval, positive=True),
            timeout=self.duration(h, "timeout", p, d.timeout, positive=True),
            rise=self.integer(h, "rise", p, d.rise),
            fall=self.integer(h, "fall", p, d.fall),
            path=self.optional(h, "path", p),
            enabled=self.boolean(h, "enabled", p, d.enabled),
        )

    def outlier(self, o: dict[object, object], p: _Path) -> OutlierCfg:
        d = OutlierCfg()
        base = self.duration(o, "base_ejection_time", p, d.base_ejection_time, positive=True)
        most = self.duration(o, "max_ejection_time", p, max(d.max_ejection_time, base))
        if most < base and self.is_valid((*p, "base_ejection_time")):
            self.error(
                (*p, "max_ejection_time"),
                f"must not be shorter than base_ejection_time ({base:g}s)",
            )
        return OutlierCfg(
            consecutive_failures=self.integer(o, "consecutive_failures", p, d.consecutive_failures),
            base_ejection_time=base,
            max_ejection_time=most,
            max_ejection_percent=self.integer(o, "max_ejection_percent", p, d.max_ejection_percent),
        )

    def drain(self, raw: dict[object, object], p: _Path) -> DrainCfg:
        d = DrainCfg()
        return DrainCfg(
            timeout=self.duration(raw, "timeout", p, d.timeout),
            migrate=self.boolean(raw, "migrate", p, d.migrate),
        )

    def backends(self, item: dict[object, object], p: _Path) -> tuple[BackendCfg, ...]:
        v = self.get(item, "backends", p)
        out: list[BackendCfg] = []
        for j, b in enumerate(v if isinstance(v, list) else []):
            bp: _Path = (*p, "backends", j)
            if isinstance(b, dict) and not self.is_rejected(bp):
                out.append(self.backend(b, bp))
                self.backend_paths.append((out[-1], bp))
        return tuple(out)

    def backend(self, b: dict[object, object], p: _Path) -> BackendCfg:
        backend_id = self.string(b, "id", p, "")
        if backend_id and not _NAME_RE.fullmatch(backend_id):
            self.error((*p, "id"), f"{_show(backend_id)} {_PATTERN_MESSAGES['name']}")
        url = self.string(b, "url", p, "")
        url_ok = False
        if url:
            problem = _url_problem(url)
            url_ok = problem is None
            if problem:
                self.error((*p, "url"), problem)
        spawn = self.optional(b, "spawn", p)
        args = self.strings(b, "args", p) or ()
        if args and spawn is None:
            self.error((*p, "args"), "only used with spawn (arguments of a spawned worker)")
        if spawn is not None and url_ok:
            u = urlsplit(url)
            if not _is_loopback(u.hostname or ""):
                self.error(
                    (*p, "url"),
                    f"spawn needs a loopback URL (127.0.0.1, [::1], localhost), got {url!r}",
                )
            elif u.port is None:
                self.error((*p, "url"), f"spawn needs an explicit port in the URL, got {url!r}")
        metrics_url = self.optional(b, "metrics_url", p)
        if metrics_url:
            problem = _http_url_problem(metrics_url)
            if problem:
                self.error((*p, "metrics_url"), problem)
        return BackendCfg(
            id=backend_id,
            url=url,
            weight=self.number(b, "weight", p, 1.0),
            spawn=spawn,
            args=args,
            metrics_url=metrics_url,
        )

    def timeouts(self, root: dict[object, object]) -> Timeouts:
        t, p, d = self.section(root, "timeouts", ()), ("timeouts",), Timeouts()
        return Timeouts(
            handshake=self.duration(t, "handshake", p, d.handshake, positive=True),
            connect=self.duration(t, "connect", p, d.connect, positive=True),
            idle=self.duration(t, "idle", p, d.idle),
            ping_interval=self.duration(t, "ping_interval", p, d.ping_interval),
            ping_timeout=self.duration(t, "ping_timeout", p, d.ping_timeout, positive=True),
            close=self.duration(t, "close", p, d.close),
            shutdown_grace=self.duration(t, "shutdown_grace", p, d.shutdown_grace),
            backpressure=self.duration(t, "backpressure", p, d.backpressure),
        )

    def limits(self, root: dict[object, object]) -> Limits:
        lim, p, d = self.section(root, "limits", ()), ("limits",), Limits()
        frame = self.size(lim, "max_frame_size", p, d.max_frame_size)
        message = self.size(lim, "max_message_size", p, d.max_message_size)
        if frame < 125:
            self.error(
                (*p, "max_frame_size"),
                f"must be at least 125 bytes (control frames carry up to 125), got {frame}",
            )
        elif frame > message and self.is_valid((*p, "max_message_size")):
            self.error(
                (*p, "max_frame_size"),
                f"{_show_size(frame)} is larger than max_message_size ({_show_size(message)})",
            )
        return Limits(
            max_connections=self.integer(lim, "max_connections", p, d.max_connections),
            max_frame_size=frame,
            max_message_size=message,
            write_buffer_high=self.size(lim, "write_buffer_high", p, d.write_buffer_high),
            max_header_bytes=self.size(lim, "max_header_bytes", p, d.max_header_bytes),
            max_headers=self.integer(lim, "max_headers", p, d.max_headers),
            max_connections_per_client=self.integer(
                lim, "max_connections_per_client", p, d.max_connections_per_client
            ),
        )

    def auth(self, root: dict[object, object]) -> AuthCfg:
        a, p = self.section(root, "auth", ()), ("auth",)
        raw_jwt = self.get(a, "jwt", p)
        jwt = self.jwt(raw_jwt, (*p, "jwt")) if isinstance(raw_jwt, dict) else None
        origins: list[str] = []
        raw = self.get(a, "origins", p)
        for i, o in enumerate(raw if isinstance(raw, list) else []):
            if not isinstance(o, str) or self.is_rejected((*p, "origins", i)):
                continue
            normal = _origin(o)
            if normal is None:
                self.error((*p, "origins", i), f"{_show(o)} {_PATTERN_MESSAGES['origin']}")
            elif normal not in origins:
                origins.append(normal)
        return AuthCfg(jwt, tuple(origins))

    def jwt(self, j: dict[object, object], p: _Path) -> JwtCfg:
        secret = self.optional(j, "secret", p)
        key_file = self.optional(j, "public_key_file", p)
        algorithms = self.strings(j, "algorithms", p) or JwtCfg().algorithms
        if secret is not None and key_file is not None:
            self.error(p, "set only one of secret or public_key_file")
        elif secret is None and key_file is None:
            if "secret" in j:
                self.error((*p, "secret"), "is empty (is its environment variable set?)")
            else:
                self.error(p, "needs exactly one of secret or public_key_file")
        if key_file is not None:
            self.file((*p, "public_key_file"), key_file)
        explicit = self.get(j, "algorithms", p) is not None
        for i, alg in enumerate(algorithms):
            at: _Path = (*p, "algorithms", i) if explicit else (*p, "algorithms")
            if alg.lower() == "none":
                self.error(at, "'none' is not allowed: tokens must be signed")
            elif secret is not None and key_file is None and alg not in _HMAC_ALGORITHMS:
                self.error(at, f"{alg} needs public_key_file; a secret works with HS256/384/512")
            elif key_file is not None and secret is None and alg in _HMAC_ALGORITHMS:
                default = "" if explicit else " (the default)"
                self.error(
                    at,
                    f"{alg}{default} needs a secret; with public_key_file list RS*, PS*, ES* or "
                    "EdDSA algorithms (an HMAC keyed with a public key can be forged)",
                )
        return JwtCfg(
            secret=secret,
            public_key_file=key_file,
            algorithms=algorithms,
            audience=self.optional(j, "audience", p),
            query_param=self.optional(j, "query_param", p),
            session_claim=self.optional(j, "session_claim", p),
        )

    def networks(self, root: dict[object, object], key: str) -> tuple[IPNetwork, ...]:
        """A list of addresses or CIDR blocks (``10.0.0.0/8``, ``::1``)."""
        out: list[IPNetwork] = []
        raw = self.get(root, key, ())
        for i, item in enumerate(raw if isinstance(raw, list) else []):
            if not isinstance(item, str) or self.is_rejected((key, i)):
                continue
            try:
                net = ipaddress.ip_network(item, strict=False)
            except ValueError:
                self.error((key, i), f"{_show(item)} is not an IP address or CIDR block")
                continue
            if net not in out:
                out.append(net)
        return tuple(out)

    def log(self, root: dict[object, object]) -> LogCfg:
        lg, p = self.section(root, "log", ()), ("log",)
        d = LogCfg()
        return LogCfg(
            format=self.string(lg, "format", p, d.format),
            access=self.boolean(lg, "access", p, d.access),
        )

    def cluster(self, root: dict[object, object]) -> ClusterCfg | None:
        c = self.get(root, "cluster", ())
        if not isinstance(c, dict):
            return None
        p: _Path = ("cluster",)
        etcd = self.string(c, "etcd", p, "")
        if etcd:
            problem = _http_url_problem(etcd)
            if problem:
                self.error((*p, "etcd"), problem)
        workers = root.get("workers")
        if isinstance(workers, int) and not isinstance(workers, bool) and workers > 1:
            # Each instance holds one lease and drains its own sessions: one process per instance.
            self.error(p, f"cluster mode runs one process per instance: set workers: 1 (not "
                       f"{workers}) and run more instances")  # fmt: skip
        return ClusterCfg(etcd, self.string(c, "prefix", p, ClusterCfg("").prefix))


def _valid_host(host: str) -> bool:
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOSTNAME_RE.fullmatch(host) is not None


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _clash(a: Listener, b: Listener) -> str:
    """Why two addresses cannot both be bound, or "" when they can.

    A wildcard covers its own family only: asyncio binds IPv6 sockets with IPV6_V6ONLY.
    Host names may resolve to either family.
    """
    if a.port != b.port:
        return ""
    if a.host == b.host:
        return "is the same address as"
    for wild, other in ((a.host, b.host), (b.host, a.host)):
        if wild in _WILDCARDS and _families(wild) & _families(other):
            return "overlaps (same port, one of them on all interfaces)"
    return ""


def _families(host: str) -> set[int]:
    try:
        return {ipaddress.ip_address(host).version}
    except ValueError:
        return {4, 6}


def _key_source(text: str) -> KeySource | None:
    kind, sep, name = text.partition(":")
    if not sep:
        return None
    if kind == "query":
        ok = bool(name) and not any(c.isspace() for c in name)
    elif kind in ("header", "cookie"):
        ok = _TOKEN_RE.fullmatch(name) is not None
    elif kind == "path":
        ok = re.fullmatch(r"-?[1-9][0-9]{0,5}", name) is not None
    else:
        ok = False
    return KeySource(kind, name) if ok else None


def _split(url: str) -> tuple[SplitResult, int | None] | None:
    try:
        u = urlsplit(url)
        return u, u.port
    except ValueError:
        return None


def _url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a worker's WebSocket URL, or None."""
    parts = _split(url)
    if parts is None:
        return f"{_show(url)} is not a valid URL (bad port or IPv6 address)"
    u, port = parts
    if u.scheme not in ("ws", "wss") or not url.lower().startswith(("ws://", "wss://")):
        return f"{_show(url)} {_PATTERN_MESSAGES['ws url']}"
    if not u.hostname:
        return f"{_show(url)} has no host"
    if port == 0:
        return f"{_show(url)} has port 0"
    if u.username is not None or u.password is not None:
        return f"{_show(url)} must not contain user:password@"
    if "#" in url:
        return f"{_show(url)} must not have a #fragment"
    return None


def _http_url_problem(url: str) -> str | None:
    parts = _split(url)
    if parts is None:
        return f"{_show(url)} is not a valid URL (bad port or IPv6 address)"
    u, port = parts
    if u.scheme not in ("http", "https") or not u.hostname or port == 0:
        return f"{_show(url)} {_PATTERN_MESSAGES['http url']} with a host"
    return None


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origin(text: str) -> str | None:
    """``scheme://host[:port]`` as browsers send it (lowercase, no default port), or None."""
    parts = _split(text)
    if parts is None:
        return None
    u, port = parts
    if u.scheme not in ("http", "https") or not u.hostname or u.path or u.query or u.fragment:
        return None
    if u.username is not None or port == 0:
        return None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    default = 443 if u.scheme == "https" else 80
    return f"{u.scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def _show_size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n % _BYTES[unit] == 0:
            return f"{n // _BYTES[unit]}{unit}"
    return f"{n} bytes"
