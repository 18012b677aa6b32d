"""nginx as a WebSocket reverse proxy for the benchmarks (``proxies.py``, ``rollout.py``): the
one config they run it from, in the foreground from a run's own directory (Debian's package; its
system service is never started)."""

from __future__ import annotations

import resource
import shutil
from collections.abc import Sequence
from pathlib import Path

from bench.lib.rawws import TlsFiles

__all__ = ["nginx_binary", "nginx_config"]


def nginx_binary() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


def _nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def nginx_config(
    d: Path,
    logdir: Path,
    port: int,
    servers: Sequence[tuple[str, int]],
    *,
    cores: int = 1,
    tls: TlsFiles | None = None,
    plain_port: int = 0,
) -> str:
    """nginx.conf: upgrades on ``port`` proxied to ``servers``, hashing ``?session=``
    consistently. With TLS, as nginx's "Configuring HTTPS servers" has it: ``listen ... ssl``,
    the certificate and key, a shared session cache (its "HTTPS server optimization"); TLS 1.2
    and 1.3, session tickets on (the defaults), and ``plain_port`` plain beside it."""
    upstream = "".join(f"    server {h}:{p};\n" for h, p in servers)
    temp = "".join(
        f"  {k}_temp_path {d}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    listen = f"    listen 127.0.0.1:{port} backlog=4096;\n"
    if tls is not None:
        listen = (
            f"    listen 127.0.0.1:{port} ssl backlog=4096;\n"
            f"    listen 127.0.0.1:{plain_port} backlog=4096;\n"
            f"    ssl_certificate {tls.cert};\n"
            f"    ssl_certificate_key {tls.key};\n"
            "    ssl_protocols TLSv1.2 TLSv1.3;\n"
            "    ssl_session_cache shared:SSL:10m;\n"
            "    ssl_session_timeout 10m;\n"
        )
    return f"""\
daemon off;
master_process on;
worker_processes {cores};
worker_rlimit_nofile {_nofile()};
pid {d}/nginx.pid;
error_log {logdir}/nginx-error.log warn;
events {{
  worker_connections {_nofile() - 100};
  use epoll;
}}
http {{
  access_log off;
{temp}
  map $http_upgrade $connection_upgrade {{
    default upgrade;
    ''      close;
  }}
  upstream workers {{
    hash $arg_session consistent;
{upstream}  }}
  server {{
{listen}    location / {{
      proxy_pass http://workers;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_connect_timeout 5s;
      proxy_read_timeout 1h;
      proxy_send_timeout 1h;
      proxy_buffering off;
    }}
  }}
}}
"""
