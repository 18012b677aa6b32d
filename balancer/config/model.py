"""The validated config: frozen dataclasses with their defaults, one per section of the file.

Nothing here validates or reads files (the builder does), so code that only consumes a config
(the pool, the proxy, the tests) depends on these types alone. Frozen, with ``slots=True`` and
tuples: the proxy shares one instance between connections and swaps it whole on reload.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from balancer.weights import Coefficients

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# A backend URL's scheme -> whether wslb speaks TLS to it (with the pool's ``upstream_tls``).
# ``http``/``https`` name the same server as ``ws``/``wss``: a plain request and a WebSocket
# upgrade both go to its host and port, as nginx's ``proxy_pass http://`` carries both. The one
# place that says which schemes mean TLS (``BackendCfg.secure``, ``backend.Upstream``).
BACKEND_SCHEMES: Final = {"ws": False, "http": False, "wss": True, "https": True}


__all__ = [
    "BACKEND_SCHEMES",
    "DEFAULT_SESSION_KEY",
    "Admin",
    "AuthCfg",
    "BackendCfg",
    "ClusterCfg",
    "Config",
    "DrainCfg",
    "FailoverCfg",
    "HealthCfg",
    "HttpCfg",
    "IPNetwork",
    "JwtCfg",
    "KeySource",
    "Limits",
    "Listener",
    "LogCfg",
    "MetricsCfg",
    "OutlierCfg",
    "PlacementCfg",
    "PoolCfg",
    "Timeouts",
    "Tls",
    "UpstreamTls",
    "WeightsCfg",
    "WorkerAuthCfg",
    "uses_tls",
]


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
    # The file set no admin.listen (said when the port is taken); not part of the value.
    listen_default: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class MetricsCfg:
    """A listener of its own serving ``GET /metrics`` without the admin token (None: the
    metrics are on the admin API only, behind its token). Prometheus scrapes it where the admin
    API must stay on loopback (a pod's, a host's)."""

    listen: Listener | None = None


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
class FailoverCfg:
    """Crash failover (docs/failover.md): a session whose worker dies is continued elsewhere."""

    enabled: bool = False
    journal_limit: int = 256 * 1024  # bytes of journal per session; past it: 1011 as before
    attempts: int = 3  # workers tried, one after the other, for one loss


@dataclass(frozen=True, slots=True)
class ResumeCfg:
    """Client resume (SPEC section 13, docs/resume.md): a client whose connection drops
    without a close reconnects within ``grace`` and gets what it missed (up to ``buffer``
    bytes kept per session) and the live stream after it. ``max_failures`` failed resumes per
    client address and ``failure_window`` (each serving process counts its own), then 429 until
    the address's bucket refills; 0 turns the throttle off."""

    enabled: bool = False
    grace: float = 30.0
    buffer: int = 1024**2
    max_failures: int = 10
    failure_window: float = 10.0


@dataclass(frozen=True, slots=True)
class HttpCfg:
    """Plain HTTP requests to the pool (SPEC section 16; ``balancer/aio/httpproxy.py``).

    Timeouts follow HAProxy's: ``timeout_request`` the whole request from the client (its
    body included, from its head), ``timeout_server`` the worker's silence (before its answer
    and between two reads of it), ``timeout_keepalive`` an idle client connection between two
    requests. ``pool_size``: idle kept-alive connections wslb keeps to each worker.
    """

    enabled: bool = True
    max_body: int = 64 * 1024**2
    timeout_request: float = 60.0
    timeout_server: float = 300.0
    timeout_keepalive: float = 60.0
    pool_size: int = 32


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
class PlacementCfg:
    """Where ``consistent`` places new conversations and when a returning one moves
    (``balancer.selection``; docs/routing.md has the formula)."""

    choices: int = 2  # ring candidates a new key may take (1: the first within the bound)
    slack: float = 1.0  # load (conversations per unit of weight) the first may have above
    kv_limit: float = 0.9  # share of a candidate's KV the expected conversations may fill
    move_cost: float = 1.5  # a key moves when staying costs more than this x the move
    bytes_per_token: float = 4.0  # relayed bytes per token, for the context estimates
    prefill_ms_per_token: float = 0.2  # where no worker reports its prefill time


@dataclass(frozen=True, slots=True)
class PrefixCfg:
    """Keyless plain requests placed by their prompt's prefix (``balancer.prefix``;
    docs/routing.md); on by default: LLM clients over HTTP send no session key."""

    enabled: bool = True
    block: int = 256  # bytes of prompt text per block (a block also ends with its message)
    anchor: int = 256  # bytes of the prompt whose hash places it on the ring without a match
    table_size: int = 100_000  # blocks remembered (least recently used out)
    threshold: float = 0.3  # share of the prompt a match must cover to count
    balance_abs: float = 32.0  # load difference (requests per unit of weight) and ...
    balance_rel: float = 1.5  # ... ratio that, both exceeded, place by load instead
    # The bounded-load factor for new conversations placed by prompt (keys: hash_balance_factor):
    # cache-aware routers leave a worker holding a shared prefix this far above its share
    # (plus the square root of that: ``prefix.bound``).
    balance_factor: float = 1.5
    max_body: int = 1024 * 1024  # bodies read before placing; larger ones by load alone
    # Late binding: a new WebSocket session is answered by wslb and placed by its first message.
    websocket: bool = False
    first_message_wait: float = 2.0  # seconds a late-bound session waits for that message


@dataclass(frozen=True, slots=True)
class UpstreamTls:
    """TLS towards ``wss://`` and ``https://`` workers: CA bundle (None: system trust) and client
    certificate."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerAuthCfg:
    """The credential wslb shows the pool's workers (``balancer.workerauth``)."""

    token: str

    def __repr__(self) -> str:
        return "WorkerAuthCfg(token=<hidden>)"  # configs get logged and printed in tests


def uses_tls(url: str) -> bool:
    """Whether a backend URL (``wss://``, ``https://``) means TLS to the worker."""
    return BACKEND_SCHEMES.get(url.partition(":")[0].lower(), False)


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
        """True for ``wss://`` and ``https://``: TLS to the worker (``BACKEND_SCHEMES``)."""
        return uses_tls(self.url)

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
    model: str | None = None  # match: {model: NAME}: only requests with ?model=NAME
    session_key: tuple[KeySource, ...] = DEFAULT_SESSION_KEY
    balance: str = "consistent"
    hash_balance_factor: float = 1.25
    weights: WeightsCfg = WeightsCfg()
    health: HealthCfg = HealthCfg()
    outlier: OutlierCfg = OutlierCfg()
    drain: DrainCfg = DrainCfg()
    failover: FailoverCfg = FailoverCfg()
    resume: ResumeCfg = ResumeCfg()
    backends: tuple[BackendCfg, ...] = ()
    upstream_tls: UpstreamTls | None = None
    worker_auth: WorkerAuthCfg | None = None
    affinity_hold: float = 30.0  # seconds a key keeps its place after its session ends
    # Places one client (address, or JWT owner) may hold at once (``balancer.pool``); 0: no bound.
    affinity_hold_per_client: int = 64
    # A returning key leaves a worker that would go above this many times its weighted share
    # (``balancer.selection``); at or below hash_balance_factor: the strict bound.
    affinity_ceiling: float = 2.0
    # Pressure (the median load factor / the worker's) at which a worker counts as overloaded.
    overload_ratio: float = 1.5
    placement: PlacementCfg = PlacementCfg()
    http: HttpCfg = HttpCfg()
    prefix_placement: PrefixCfg = PrefixCfg()


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
class RelayCfg:
    """``thread``: streaming sessions' worker-to-client frames are forwarded by a thread in C
    (``balancer/aio/offload.py``) where it is built; false keeps every session in Python."""

    thread: bool = True


@dataclass(frozen=True, slots=True)
class JwtCfg:
    """JWT check: exactly one of ``secret`` (HS*) or ``public_key_file`` (RS/PS/ES/EdDSA)."""

    secret: str | None = None
    public_key_file: str | None = None
    algorithms: tuple[str, ...] = ("HS256",)
    audience: str | None = None
    query_param: str | None = None
    session_claim: str | None = None
    owner_claim: str = "sub"
    """The claim naming whom a session belongs to: keys are scoped to it."""


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
    # The host other instances reach this one's first listener at, to carry a client's resume
    # to the instance holding its session (None: the listener's host, or when that is a
    # wildcard, what this host's name resolves to: the pod IP on Kubernetes).
    advertise: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    """The whole balancer.yaml. ``source`` is the file it came from, for messages."""

    listen: tuple[Listener, ...] = (Listener("127.0.0.1", 8080),)
    admin: Admin = Admin()
    metrics: MetricsCfg = MetricsCfg()
    pools: tuple[PoolCfg, ...] = ()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    auth: AuthCfg = AuthCfg()
    workers: int = 1
    cluster: ClusterCfg | None = None
    # Proxies whose X-Forwarded-For / PROXY header names the client (ip_network objects).
    trusted_proxies: tuple[IPNetwork, ...] = ()
    log: LogCfg = LogCfg()
    relay: RelayCfg = RelayCfg()
    source: str = "<config>"
    # The file set no listen (said when the port is taken); not part of the value.
    listen_default: bool = field(default=False, compare=False)

    def backend_ids(self) -> tuple[str, ...]:
        """Ids of every backend, in file order."""
        return tuple(b.id for p in self.pools for b in p.backends)

    def backend(self, backend_id: str) -> BackendCfg | None:
        """The backend with this id, in whatever pool."""
        return next((b for p in self.pools for b in p.backends if b.id == backend_id), None)

    def pool(self, name: str) -> PoolCfg | None:
        """The pool with this name."""
        return next((p for p in self.pools if p.name == name), None)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
