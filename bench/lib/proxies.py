"""The proxies the benchmarks put side by side (direct, nginx, HAProxy, wslb), as processes
with a label and the addresses to dial; what became of a connect that got no 101; nginx and
HAProxy installed from Debian when missing. ``bench/proxies.py`` and ``bench/tlsburst.py``
run them."""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import ssl
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from bench.lib.cpu import tree
from bench.lib.launch import Procs, free_port, wait_port
from bench.lib.launch import Wslb as WslbProcess
from bench.lib.load import Target
from bench.lib.nginx import nginx_binary, nginx_config
from bench.lib.rawws import TlsFiles, client_context, ws_probe
from bench.lib.script import log

ROOT = Path(__file__).resolve().parent.parent.parent


def outcome(exc: BaseException) -> str:
    """What became of a connect that got no 101: ``reset``, ``timeout``, ``refused``,
    ``closed`` (the proxy closed it cleanly), ``tls`` (a TLS alert), ``http`` (another
    status), ``error``."""
    text = repr(exc)
    if isinstance(exc, ConnectionResetError) or "ConnectionResetError" in text or "reset" in text:
        return "reset"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if "lost before upgrade: None" in text or isinstance(exc, ssl.SSLEOFError):
        return "closed"
    if isinstance(exc, ssl.SSLError):
        return "tls"
    if isinstance(exc, ConnectionError) and "HTTP/" in text:
        return "http"
    return "error"


# -- proxies under test ------------------------------------------------------------------------


class Proxy(Target):
    """A proxy under test (token_stream's ``Target``), with a label and the addresses to dial."""

    kind: ClassVar[str]

    def __init__(self, cores: int = 1, tls: TlsFiles | None = None) -> None:
        self.cores = cores
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.logdir: Path | None = None
        # --tls: ``port`` speaks TLS (the same certificate for every proxy), and ``plain_port``
        # plain, the same proxy otherwise: the handshake phase's baseline without TLS.
        self.tls = tls
        self.plain_port = 0

    @property
    def label(self) -> str:
        return self.kind if self.cores == 1 else f"{self.kind} x{self.cores}"

    @property
    def url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}/ws"

    def _ports(self) -> None:
        self.port = free_port()
        if self.tls is not None:
            self.plain_port = free_port()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        return [self.pid]

    def addresses(self, backends: Sequence[tuple[str, int]]) -> list[tuple[str, int, str]]:
        return [("127.0.0.1", self.port, "/ws")]

    def _launch(self, procs: Procs, cmd: Sequence[str]) -> None:
        self.logdir = procs.logdir
        self.proc = proc = procs.spawn(self.kind, cmd, term_timeout=5.0)
        self._ready(procs, lambda: wait_port(self.port, 20.0, proc))

    def _ready(self, procs: Procs, listening: Callable[[], object]) -> None:
        """Until ``listening()`` returns and a WebSocket upgrade through the proxy gets a 101."""
        try:
            listening()
            tls = client_context(self.tls.ca) if self.tls is not None else None
            ws_probe("127.0.0.1", self.port, "/ws", tls=tls)
        except (RuntimeError, TimeoutError, OSError) as exc:
            tail = procs.log_tail(self.kind)
            raise RuntimeError(f"{self.label} did not start: {exc}\n{tail}") from None

    def problems(self) -> list[str]:
        if self.logdir is None:
            return []
        words = ("error", "alert", "crit", "emerg", "warning", "traceback")
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            for line in f.read_text(errors="replace").splitlines():
                if any(w in line.lower() for w in words):
                    out.append(f"{f.name}: {line[:200]}")
        return out


class Direct(Proxy):
    """No proxy: clients dial the workers themselves (the latency baseline)."""

    kind = "direct"

    def __init__(self, cores: int = 1, tls: TlsFiles | None = None) -> None:
        super().__init__(cores)  # plain whatever --tls says: the workers are

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def addresses(self, backends: Sequence[tuple[str, int]]) -> list[tuple[str, int, str]]:
        return [(h, p, "/ws") for h, p in backends]


def host_ports(backends: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for u in backends:
        hostport = u.split("//", 1)[1].split("/", 1)[0]
        host, port = hostport.rsplit(":", 1)
        out.append((host, int(port)))
    return out


class Nginx(Proxy):
    """nginx as a WebSocket reverse proxy, hashing ``?session=`` consistently over the workers
    (``bench.lib.nginx``'s config)."""

    kind = "nginx"

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        self._ports()
        d = procs.logdir / "nginx"
        d.mkdir(exist_ok=True)
        (d / "nginx.conf").write_text(self.config(d, procs.logdir, backends))
        nginx = nginx_binary()
        self._launch(procs, [nginx, "-p", f"{d}/", "-c", f"{d}/nginx.conf", "-e", f"{d}/e.log"])

    def config(self, d: Path, logdir: Path, backends: Sequence[str]) -> str:
        servers = host_ports(backends)
        return nginx_config(
            d,
            logdir,
            self.port,
            servers,
            cores=self.cores,
            tls=self.tls,
            plain_port=self.plain_port,
        )


class Haproxy(Proxy):
    """HAProxy in ``mode http`` (WebSocket upgrades tunnelled), ``balance url_param session``."""

    kind = "haproxy"

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        self._ports()
        path = procs.logdir / "haproxy.cfg"
        path.write_text(self.config(backends))
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        self._launch(procs, [haproxy, "-db", "-f", str(path)])

    def config(self, backends: Sequence[str]) -> str:
        """haproxy.cfg. With TLS, as HAProxy's configuration manual has it: ``bind ... ssl crt``
        (key and chain in one PEM); its defaults allow TLS 1.2 and 1.3, send session tickets
        and keep a session cache (``tune.ssl.cachesize`` 20,000)."""
        servers = "".join(
            f"  server w{i + 1} {h}:{p} check inter 2s\n"
            for i, (h, p) in enumerate(host_ports(backends))
        )
        bind = f"  bind 127.0.0.1:{self.port}\n"
        if self.tls is not None:
            bind = (
                f"  bind 127.0.0.1:{self.port} ssl crt {self.tls.combined}\n"
                f"  bind 127.0.0.1:{self.plain_port}\n"
            )
        return f"""\
global
  nbthread {self.cores}
  maxconn {(nofile() - 200) // 2}
defaults
  mode http
  timeout connect 5s
  timeout client 1h
  timeout server 1h
  timeout tunnel 1h
  timeout http-request 10s
  maxconn {(nofile() - 200) // 2}
frontend fe
{bind}  default_backend workers
backend workers
  balance url_param session
  hash-type consistent
  option httpchk GET /healthz
{servers}"""


class Wslb(Proxy):
    """wslb, one pool (consistent hashing on ``?session=``), health checks and scraping on."""

    kind = "wslb"
    relay_thread = True  # the default: streaming sessions' frames forwarded by the C thread
    src: ClassVar[Path | None] = None  # the source tree, if not --wslb-src (--wslb-variant)

    def start(self, procs: Procs, backends: Sequence[str]) -> None:
        config = self.config(backends)
        # A token of its own: with none, wslb writes a generated one to $WSLB_STATE_DIR and logs
        # a warning, which problems() would report. Nothing here calls the admin API. From the
        # source tree under test (--wslb-src), as its working directory.
        wslb = WslbProcess(
            config,
            procs.logdir,
            procs=procs,
            name=self.kind,
            token=secrets.token_urlsafe(32),
            args=["--log-level", "warning"],
            src=self.src or WSLB_SRC[0],
        )
        if self.tls is not None:
            wslb.port = self.port  # the TLS listener's, chosen in config()
        self.logdir, self.port = procs.logdir, wslb.port
        self._ready(procs, lambda: wslb.start(wait_ready=False, timeout=20.0))
        self.proc = wslb.proc

    def config(self, backends: Sequence[str]) -> dict[str, Any]:
        """balancer.yaml as a dict. With TLS: a ``wss`` listener with the certificate and a
        plain one (wslb makes the listener's context: ``Listeners.start`` in aio/app.py)."""
        config: dict[str, Any] = {
            "pools": [
                {
                    "name": "chat",
                    "balance": "consistent",
                    # The HTTP probe HAProxy also runs (option httpchk), as in earlier runs.
                    "health": {"path": "/healthz"},
                    "backends": [{"id": f"w{i + 1}", "url": u} for i, u in enumerate(backends)],
                }
            ],
            "limits": {"max_connections": 60000, "max_connections_per_client": 60000},
            "workers": self.cores,
            "relay": {"thread": self.relay_thread},
        }
        if self.tls is not None:
            self._ports()
            tls = {"cert": str(self.tls.cert), "key": str(self.tls.key)}
            config["listen"] = [
                {"address": f"127.0.0.1:{self.port}", "tls": tls},
                {"address": f"127.0.0.1:{self.plain_port}"},
            ]
        return config

    def processes(self) -> int:
        return len(tree(self.pid))


WSLB_SRC = [ROOT]  # the source tree wslb runs from (--wslb-src)


class WslbEventLoop(Wslb):
    """wslb with ``relay: {thread: false}``: every frame through the event loop (Python), the
    relay as it was before the thread, for the before/after in the same run."""

    kind = "wslb-loop"
    relay_thread = False


TARGETS: dict[str, type[Proxy]] = {"direct": Direct, "nginx": Nginx, "haproxy": Haproxy}
TARGETS["wslb"] = Wslb
TARGETS["wslb-loop"] = WslbEventLoop


def wslb_variant(name: str, src: Path) -> type[Proxy]:
    """``--wslb-variant NAME=PATH``: wslb from another source tree (a patched copy), labelled
    ``wslb-NAME``, measured beside the others in the same run."""

    class Variant(Wslb):
        kind = f"wslb-{name}"

    Variant.src = src
    return Variant


def ensure_installed() -> None:
    """``apt-get install -y nginx haproxy`` if missing; stop the services the packages start."""
    missing = [p for p in ("nginx", "haproxy") if shutil.which(p) is None]
    if not missing:
        return
    log(f"installing {' '.join(missing)} from Debian packages")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=False, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env)
    for svc in missing:
        # Package scripts may have started the system service; this benchmark runs its own.
        if shutil.which("systemctl") and Path("/run/systemd/system").exists():
            subprocess.run(["systemctl", "disable", "--now", svc], check=False)
        else:
            subprocess.run(["service", svc, "stop"], check=False, capture_output=True)


def nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
