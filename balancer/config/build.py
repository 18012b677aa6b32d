"""balancer.yaml -> :class:`Config`: reading the file, YAML, and the semantic pass.

:func:`load` reads the file and expands ``${VAR}``; YAML is parsed with ``safe_load`` semantics
plus duplicate-key detection; :func:`parse` runs the schema pass (``errors``) and then
:class:`_Builder`, which builds the dataclasses and checks what a schema cannot say: uniqueness
across pools, address parsing, files that must exist, relations between fields. Besides reading
the file, the only I/O is checking that TLS and JWT key files exist.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit

import yaml

from balancer.config.errors import (
    _PATTERN_MESSAGES,
    ConfigError,
    _format_path,
    _Path,
    _prepare,
    _Problem,
    _render,
    _schema_problems,
    _show,
)
from balancer.config.model import (
    BACKEND_SCHEMES,
    DEFAULT_SESSION_KEY,
    Admin,
    AuthCfg,
    BackendCfg,
    ClusterCfg,
    Config,
    DrainCfg,
    FailoverCfg,
    HealthCfg,
    HttpCfg,
    IPNetwork,
    JwtCfg,
    KeySource,
    Limits,
    Listener,
    LogCfg,
    MetricsCfg,
    OutlierCfg,
    PlacementCfg,
    PoolCfg,
    PrefixCfg,
    RelayCfg,
    ResumeCfg,
    Timeouts,
    Tls,
    UpstreamTls,
    WeightsCfg,
    WorkerAuthCfg,
    _join_host_port,
)
from balancer.config.units import _BYTES, _line_col, expand_env, parse_duration, parse_size
from balancer.weights import Coefficients

__all__ = ["is_loopback", "load", "own_address", "parse", "parse_backend"]


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


# --------------------------------------------------------------------------- semantic pass

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ADDRESS_RE: Final = re.compile(r"(?:\[(?P<v6>[^\]\s]+)\]|(?P<host>[^:\[\]\s]*)):(?P<port>[0-9]+)")
_HOSTNAME_RE: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})
_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.", "ip6-localhost"})
_HMAC_ALGORITHMS: Final = frozenset({"HS256", "HS384", "HS512"})
# A credential wslb shows its workers (balancer.workerauth.TOKEN_RULE; that module imports this
# package, so the rule is repeated here and a test keeps the two equal).
_WORKER_TOKEN_RE: Final = re.compile(r"[\x21-\x2b\x2d-\x7e]{16,1024}")
# Options of a spawned worker that wslb sets itself: its address (a worker on all interfaces
# would serve anyone) and its credential. argparse also takes a unique prefix (--ho).
_SPAWN_OWNED: Final = ("--host", "--port", "--worker-token-file", "--insecure-handoff")


class _Reader:
    """Typed reads of the YAML data and the problems found, each at its YAML path.

    Absent, null, mistyped or schema-rejected values give the default: a value at or under a
    path the schema rejected is not looked at again (it was reported once, by the schema). Every
    accessor checks types itself, so no input can make it raise.
    """

    def __init__(self, rejected: set[_Path]) -> None:
        self._rejected = rejected
        self.problems: list[_Problem] = []

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

    def at_least_0(self, m: Mapping[object, object], key: str, path: _Path, default: int) -> int:
        """An integer that must be 0 or more (the schema says so too: this catches it where
        the schema pass did not run)."""
        n = self.integer(m, key, path, default)
        if n < 0:
            self.error((*path, key), f"must be 0 or more, got {n}")
            return default
        return n

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


class _Builder(_Reader):
    """Builds the dataclasses, section by section, and records what the schema cannot check
    (uniqueness, address clashes, files, cross-field rules).

    It runs even when the schema found errors, so one pass reports everything.
    """

    def __init__(self, rejected: set[_Path]) -> None:
        super().__init__(rejected)
        self.backend_paths: list[tuple[BackendCfg, _Path]] = []
        self.clustered = False

    def config(self, data: object, source: str) -> Config:
        root: dict[object, object] = data if isinstance(data, dict) else {}
        self.clustered = isinstance(root.get("cluster"), dict)
        listen = self.listeners(root)
        admin = self.admin(root, listen)
        metrics = self.metrics(root, listen, admin)
        pools = self.pools(root)
        self.spawned_clashes(listen, admin, metrics)
        self.own_listeners(listen, admin, metrics)
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
            metrics=metrics,
            pools=pools,
            timeouts=self.timeouts(root),
            limits=self.limits(root),
            auth=self.auth(root),
            workers=self.integer(root, "workers", (), 1),
            cluster=self.cluster(root),
            trusted_proxies=trusted,
            log=self.log(root),
            relay=self.relay(root),
            source=source,
            listen_default=root.get("listen") is None,
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
        return Admin(host, port, self.optional(a, "token", ("admin",)), parsed is None)

    def metrics(
        self, root: dict[object, object], listen: tuple[Listener, ...], admin: Admin
    ) -> MetricsCfg:
        """``metrics.listen``: "" (an unset ``${VAR}``) is no listener; no clash with wslb's
        other addresses."""
        text = self.string(self.section(root, "metrics", ()), "listen", ("metrics",), "")
        at = ("metrics", "listen")
        parsed = self.address(text, at) if text else None
        if parsed is None:
            return MetricsCfg()
        own = Listener(*parsed)
        ours = [(lst, "the listen address") for lst in listen]
        ours.append((Listener(admin.host, admin.port), "the admin address"))
        for lst, what in ours:
            clash = _clash(own, lst)
            if clash:
                self.error(at, f"{_show(text)} {clash} {what} {lst}")
                break
        return MetricsCfg(own)

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
            # Two pools may share a prefix when they serve different models.
            key: object = pool.path_prefix
            what = "path_prefix"
            if pool.model is not None:
                key, what = (pool.path_prefix, pool.model), f"model {pool.model!r} on path_prefix"
            if isinstance(match, dict) and "path_prefix" in match:
                self._unique(
                    prefixes, key, (*p, "match", "path_prefix"), what, shown=pool.path_prefix
                )
            else:
                self._unique(prefixes, key, p, what, "the default; ", shown=pool.path_prefix)
        ids: dict[object, _Path] = {}
        spawn_ports: dict[object, _Path] = {}
        for b, bp in self.backend_paths:
            if b.id:
                self._unique(ids, b.id, (*bp, "id"), "backend id")
            if b.spawn is not None and b.url and _url_problem(b.url) is None:
                self._unique(spawn_ports, b.port, (*bp, "url"), "port of a spawned worker")
        return tuple(out)

    def spawned_clashes(
        self, listen: tuple[Listener, ...], admin: Admin, metrics: MetricsCfg
    ) -> None:
        """A spawned worker would bind wslb's own listen, admin or metrics address (and fail
        to start)."""
        ours = [(lst, "the listen address") for lst in listen]
        ours.append((Listener(admin.host, admin.port), "the admin address"))
        if metrics.listen is not None:
            ours.append((metrics.listen, "the metrics address"))
        for b, bp in self.backend_paths:
            if b.spawn is None or not b.url or _url_problem(b.url) is not None:
                continue
            host = "127.0.0.1" if b.host == "localhost" else b.host
            for lst, what in ours:
                clash = _clash(Listener(host, b.port), lst)
                if clash:
                    addr = _join_host_port(b.host, b.port)
                    self.error(
                        (*bp, "url"),
                        f"the spawned worker's address {addr} {clash} {what} {lst}",
                    )
                    break

    def own_listeners(
        self, listen: tuple[Listener, ...], admin: Admin, metrics: MetricsCfg
    ) -> None:
        """A backend whose URL is one of wslb's own addresses: wslb would proxy to itself, each
        request and scrape coming back in as a new one until connections run out."""
        for b, bp in self.backend_paths:
            if b.spawn is not None or not b.url or _url_problem(b.url) is not None:
                continue  # a spawned worker's address: spawned_clashes
            problem = own_address(b, listen, admin, metrics)
            if problem is not None:
                self.error((*bp, "url"), problem)

    def _unique(
        self,
        seen: dict[object, _Path],
        value: object,
        path: _Path,
        what: str,
        note: str = "",
        *,
        shown: object = None,
    ) -> None:
        if value in seen:
            also = _format_path(seen[value], "")
            text = _show(value if shown is None else shown)
            self.error(path, f"duplicate {what} {text} ({note}also {also})")
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
            model=self.optional(match, "model", (*p, "match")),
            session_key=self.session_key(item, p),
            balance=self.string(item, "balance", p, "consistent"),
            hash_balance_factor=self.number(item, "hash_balance_factor", p, 1.25),
            weights=self.weights(self.section(item, "weights", p), (*p, "weights")),
            health=self.health(self.section(item, "health", p), (*p, "health")),
            outlier=self.outlier(self.section(item, "outlier", p), (*p, "outlier")),
            drain=self.drain(self.section(item, "drain", p), (*p, "drain")),
            failover=self.failover(self.section(item, "failover", p), (*p, "failover")),
            resume=self.resume(self.section(item, "resume", p), (*p, "resume")),
            backends=self.backends(item, p),
            upstream_tls=self.upstream_tls(item, p),
            worker_auth=self.worker_auth(item, p),
            affinity_hold=self.duration(item, "affinity_hold", p, 30.0),
            affinity_hold_per_client=self.at_least_0(item, "affinity_hold_per_client", p, 64),
            affinity_ceiling=self.number(item, "affinity_ceiling", p, 2.0),
            overload_ratio=self.number(item, "overload_ratio", p, 1.5),
            placement=self.placement(self.section(item, "placement", p), (*p, "placement")),
            http=self.http(self.section(item, "http", p), (*p, "http")),
            prefix_placement=self.prefix_placement(
                self.section(item, "prefix_placement", p), (*p, "prefix_placement")
            ),
        )

    def prefix_placement(self, m: dict[object, object], p: _Path) -> PrefixCfg:
        d = PrefixCfg()
        out = PrefixCfg(
            enabled=self.boolean(m, "enabled", p, d.enabled),
            block=self.integer(m, "block", p, d.block),
            anchor=self.integer(m, "anchor", p, d.anchor),
            table_size=self.integer(m, "table_size", p, d.table_size),
            threshold=self.number(m, "threshold", p, d.threshold),
            balance_abs=self.number(m, "balance_abs", p, d.balance_abs),
            balance_rel=self.number(m, "balance_rel", p, d.balance_rel),
            balance_factor=self.number(m, "balance_factor", p, d.balance_factor),
            max_body=self.size(m, "max_body", p, d.max_body),
            websocket=self.boolean(m, "websocket", p, d.websocket),
            first_message_wait=self.duration(
                m, "first_message_wait", p, d.first_message_wait, positive=True
            ),
        )
        for name in ("block", "table_size"):
            if getattr(out, name) < 1:
                self.error((*p, name), f"must be 1 or more, got {getattr(out, name)}")
                out = dataclasses.replace(out, **{name: getattr(d, name)})
        return out

    def http(self, raw: dict[object, object], p: _Path) -> HttpCfg:
        d = HttpCfg()
        pool_size = self.integer(raw, "pool_size", p, d.pool_size)
        if pool_size < 0:
            self.error((*p, "pool_size"), f"must be 0 or more, got {pool_size}")
            pool_size = d.pool_size
        return HttpCfg(
            enabled=self.boolean(raw, "enabled", p, d.enabled),
            max_body=self.size(raw, "max_body", p, d.max_body),
            timeout_request=self.duration(
                raw, "timeout_request", p, d.timeout_request, positive=True
            ),
            timeout_server=self.duration(raw, "timeout_server", p, d.timeout_server, positive=True),
            timeout_keepalive=self.duration(
                raw, "timeout_keepalive", p, d.timeout_keepalive, positive=True
            ),
            pool_size=pool_size,
        )

    def placement(self, m: dict[object, object], p: _Path) -> PlacementCfg:
        d = PlacementCfg()
        # In cluster mode each instance sees only its own load between scrapes, so a choice
        # among candidates by load would place one key differently on each instance: the ring
        # alone decides there unless the operator asks otherwise.
        choices = 1 if self.clustered else d.choices
        return PlacementCfg(
            choices=self.integer(m, "choices", p, choices),
            slack=self.number(m, "slack", p, d.slack),
            kv_limit=self.number(m, "kv_limit", p, d.kv_limit),
            move_cost=self.number(m, "move_cost", p, d.move_cost),
            bytes_per_token=self.number(m, "bytes_per_token", p, d.bytes_per_token),
            prefill_ms_per_token=self.number(m, "prefill_ms_per_token", p, d.prefill_ms_per_token),
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

    def worker_auth(self, item: dict[object, object], path: _Path) -> WorkerAuthCfg | None:
        v = self.get(item, "worker_auth", path)
        if not isinstance(v, dict):
            return None
        p = (*path, "worker_auth")
        token = self.string(v, "token", p, "")
        if not token:
            if "token" in v and not self.is_rejected((*p, "token")):
                self.error((*p, "token"), "is empty (is its environment variable set?)")
            return None
        if not _WORKER_TOKEN_RE.fullmatch(token):
            self.error(
                (*p, "token"),
                f"must be 16-1024 printable ASCII characters, no spaces or commas (got "
                f"{len(token)} characters)",
            )  # never the value: it is a secret
            return None
        return WorkerAuthCfg(token)

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

    def failover(self, raw: dict[object, object], p: _Path) -> FailoverCfg:
        d = FailoverCfg()
        limit = self.size(raw, "journal_limit", p, d.journal_limit)
        if limit < 1024:
            self.error((*p, "journal_limit"), "must be at least 1KiB (a prompt and its answer)")
        attempts = self.integer(raw, "attempts", p, d.attempts)
        if attempts < 1:
            self.error((*p, "attempts"), "must be at least 1")
        return FailoverCfg(
            enabled=self.boolean(raw, "enabled", p, d.enabled),
            journal_limit=limit,
            attempts=attempts,
        )

    def resume(self, raw: dict[object, object], p: _Path) -> ResumeCfg:
        d = ResumeCfg()
        grace = self.duration(raw, "grace", p, d.grace)
        if grace <= 0:
            self.error((*p, "grace"), "must be more than 0 (how long a session waits)")
        buffer = self.size(raw, "buffer", p, d.buffer)
        if buffer < 4096:
            self.error((*p, "buffer"), "must be at least 4KiB (a few messages of an answer)")
        window = self.duration(raw, "failure_window", p, d.failure_window)
        if window <= 0:
            self.error((*p, "failure_window"), "must be more than 0")
        return ResumeCfg(
            enabled=self.boolean(raw, "enabled", p, d.enabled),
            grace=grace,
            buffer=buffer,
            max_failures=self.at_least_0(raw, "max_failures", p, d.max_failures),
            failure_window=window,
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
        for i, arg in enumerate(args):
            owned = _spawn_owned(arg)
            if owned is not None:
                self.error(
                    (*p, "args", i),
                    f"{_show(arg)}: wslb sets {owned} of a spawned worker itself (the address "
                    "comes from url, the credential is generated)",
                )
        if spawn is not None and url_ok:
            u = urlsplit(url)
            if not is_loopback(u.hostname or ""):
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
            owner_claim=self.string(j, "owner_claim", p, "") or JwtCfg().owner_claim,
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

    def relay(self, root: dict[object, object]) -> RelayCfg:
        r, p = self.section(root, "relay", ()), ("relay",)
        return RelayCfg(thread=self.boolean(r, "thread", p, RelayCfg().thread))

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
        advertise = self.string(c, "advertise", p, "") or None
        if advertise is not None and ":" not in advertise and not _valid_host(advertise):
            self.error((*p, "advertise"), "must be a host name or an IP address")
        return ClusterCfg(
            etcd, self.string(c, "prefix", p, ClusterCfg("").prefix), advertise=advertise
        )


def _valid_host(host: str) -> bool:
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOSTNAME_RE.fullmatch(host) is not None


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


def own_address(
    b: BackendCfg, listen: tuple[Listener, ...], admin: Admin, metrics: MetricsCfg
) -> str | None:
    """Why ``b`` (not spawned) points at one of wslb's own listeners, or None: wslb would
    proxy to itself, each request and scrape coming back in as a new one until connections run
    out. For the config check and ``POST /backends`` alike."""
    ours = [(lst, "listen") for lst in listen]
    ours.append((Listener(admin.host, admin.port), "admin.listen"))
    if metrics.listen is not None:
        ours.append((metrics.listen, "metrics.listen"))
    for lst, key in ours:
        if _reaches(b.host, b.port, lst):
            return (
                f"{_show(b.url)} is wslb's own {key} address {lst}: wslb would proxy "
                "to itself (point the backend at a worker)"
            )
    return None


def _reaches(host: str, port: int, lst: Listener) -> bool:
    """Whether connecting to ``host:port`` from this machine lands on the listener ``lst``:
    the same address, a loopback name for a loopback or wildcard listener, or a wildcard
    address (which a connect takes as this machine) of the listener's family. Other addresses
    of this machine's interfaces are not known to a config check."""
    if port != lst.port:
        return False
    if host == lst.host:
        return True
    target = _loopback_family(host)
    if lst.host in _WILDCARDS:
        return bool(target & _families(lst.host))
    both_ips = _is_ip(host) and _is_ip(lst.host)  # two loopback IPs: only the same one
    return bool(target & _loopback_family(lst.host)) and not both_ips


def _loopback_family(host: str) -> set[int]:
    """The families in which ``host`` names this machine (loopback or a wildcard)."""
    if host.lower() in _LOOPBACK_NAMES:
        return {4, 6}
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return set()
    return {ip.version} if ip.is_loopback or ip.is_unspecified else set()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _families(host: str) -> set[int]:
    try:
        return {ipaddress.ip_address(host).version}
    except ValueError:
        return {4, 6}


def _spawn_owned(arg: str) -> str | None:
    """The option of ``_SPAWN_OWNED`` that ``arg`` would set in the worker's parser, if any."""
    name = arg.partition("=")[0]
    if len(name) < 4 or not name.startswith("--"):  # "--h" is ambiguous (--help): refused there
        return None
    return next((o for o in _SPAWN_OWNED if o.startswith(name)), None)


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
    """Why ``url`` cannot be a worker's URL, or None. ``ws://`` and ``http://`` (``wss://`` and
    ``https://``) name the same server: its WebSocket upgrades and plain requests alike."""
    parts = _split(url)
    if parts is None:
        return f"{_show(url)} is not a valid URL (bad port or IPv6 address)"
    u, port = parts
    if u.scheme not in BACKEND_SCHEMES or not url.lower().startswith(f"{u.scheme}://"):
        return f"{_show(url)} {_PATTERN_MESSAGES['backend url']}"
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


def is_loopback(host: str) -> bool:
    """``host`` (a name or address) reaches only this machine."""
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
