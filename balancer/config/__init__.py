"""balancer.yaml -> validated, frozen dataclasses; every error named by its YAML path.

Why it works this way:

- The config is read at start, on SIGHUP and on ``POST /reload`` while traffic flows, and
  ``wslb check`` must list *every* problem in one run (exit 2). So nothing here stops at the first
  error: the JSON Schema pass collects all of its errors, the semantic pass still runs on the parts
  the schema accepted, and one :class:`ConfigError` carries them all, sorted in file order.
- The JSON Schema (``balancer/schema/balancer.schema.json``, copied to the repository's
  ``config/`` for editors) is the one description of the file's shape; this package adds only
  what a schema cannot say (uniqueness across pools, address parsing, files that must exist,
  relations between fields).
- The result is frozen (``slots=True``, tuples): the proxy shares one instance between
  connections and swaps it whole on reload, never mutating it.

Pipeline: :func:`load` reads the file and expands ``${VAR}`` (:func:`expand_env`), YAML is parsed
with ``safe_load`` semantics plus duplicate-key detection, then :func:`parse` validates and builds.
Besides reading the file, the only I/O is checking that TLS and JWT key files exist.

Where things live (each imports only those above it; import from here, not from them):

- ``errors``: :class:`ConfigError`, YAML paths in messages, and the schema pass that turns
  jsonschema errors into messages at the path of the mistake.
- ``units``: ``${VAR}`` expansion, durations and sizes (:func:`parse_duration`,
  :func:`parse_size`, and the patterns the schema repeats).
- ``model``: the frozen dataclasses and their defaults (:class:`Config`, :class:`PoolCfg`, ...).
- ``build``: :func:`load`, :func:`parse`, :func:`parse_backend`, the YAML loader and the semantic
  pass (``_Builder``).
"""

from __future__ import annotations

from balancer.config.build import is_loopback as is_loopback
from balancer.config.build import load, parse
from balancer.config.build import own_address as own_address
from balancer.config.build import parse_backend as parse_backend
from balancer.config.errors import ConfigError, ListenError
from balancer.config.model import (
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
    WeightsCfg,
)
from balancer.config.model import IPNetwork as IPNetwork
from balancer.config.model import UpstreamTls as UpstreamTls
from balancer.config.model import WorkerAuthCfg as WorkerAuthCfg
from balancer.config.model import uses_tls as uses_tls
from balancer.config.units import DURATION_PATTERN as DURATION_PATTERN
from balancer.config.units import SIZE_PATTERN as SIZE_PATTERN
from balancer.config.units import expand_env, parse_duration, parse_size

__all__ = [
    "DEFAULT_SESSION_KEY",
    "Admin",
    "AuthCfg",
    "BackendCfg",
    "ClusterCfg",
    "Config",
    "ConfigError",
    "DrainCfg",
    "FailoverCfg",
    "HealthCfg",
    "HttpCfg",
    "JwtCfg",
    "KeySource",
    "Limits",
    "ListenError",
    "Listener",
    "LogCfg",
    "MetricsCfg",
    "OutlierCfg",
    "PlacementCfg",
    "PoolCfg",
    "PrefixCfg",
    "RelayCfg",
    "ResumeCfg",
    "Timeouts",
    "Tls",
    "WeightsCfg",
    "expand_env",
    "load",
    "parse",
    "parse_duration",
    "parse_size",
]
