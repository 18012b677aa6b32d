"""A tier as users deploy one: several wslb instances in cluster mode over a real etcd, behind
HAProxy in TCP mode picking an instance per connection (round robin), in front of the workers.
The tier tests and ``bench/rollout.py`` build theirs with ``Tier``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests import installs
from tests.etcd import Etcd
from tests.procs import Worker, Wslb, free_port, pool_config, stop, wait_port
from tests.test_http_proxy import metric

__all__ = ["Etcd", "Tier", "haproxy_binary", "metric", "until"]

PREFIX = "/wslb-tier/"


def haproxy_binary() -> str:
    """HAProxy from Debian's package (installed and proven here if missing)."""
    return installs.apt_binary(
        "haproxy", "haproxy", args=("-v",), after=("service", "haproxy", "stop")
    )


async def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` every 20 ms; seconds it took (AssertionError after ``timeout``)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


class Tier:
    """``instances`` wslb instances over one etcd behind one HAProxy (``url``)."""

    def __init__(
        self,
        tmp: Path,
        backends: Sequence[dict[str, Any]],
        instances: int = 3,
        pool: dict[str, Any] | None = None,
        timeouts: dict[str, Any] | None = None,
    ) -> None:
        self.tmp = tmp
        self.etcd = Etcd(tmp / "etcd")
        pool = {
            "resume": {"enabled": True, "grace": "30s"},
            "failover": {"enabled": True},
            **(pool or {}),
        }
        self.config = pool_config(list(backends), **pool)
        self.config["cluster"] = {"etcd": self.etcd.url, "prefix": PREFIX}
        self.config["timeouts"] = {"close": "2s", "shutdown_grace": "10s", **(timeouts or {})}
        self.lbs: list[Wslb] = [self._new() for _ in range(instances)]
        self.port = free_port()
        self.proxy: subprocess.Popen[bytes] | None = None
        self.old_proxies: list[subprocess.Popen[bytes]] = []  # reloaded, finishing their own
        self.conf = tmp / "haproxy.cfg"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _new(self) -> Wslb:
        return Wslb(self.config, self.tmp)

    def _haproxy_conf(self) -> str:
        servers = "".join(
            f"  server i{i} 127.0.0.1:{lb.port} check inter 100ms fall 1 rise 1\n"
            for i, lb in enumerate(self.lbs)
            if lb.proc is not None and lb.proc.poll() is None
        )
        return (
            "global\n  maxconn 8000\n"
            "defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 120s\n"
            "  timeout server 120s\n  retries 3\n  option redispatch\n"
            f"frontend fe\n  bind 127.0.0.1:{self.port}\n  default_backend be\n"
            f"backend be\n  balance roundrobin\n{servers}"
        )

    def start(self) -> Tier:
        """etcd, the instances one after the other (the first seeds etcd), HAProxy; what
        started is stopped again when a part fails to (no process outlives a failed test)."""
        try:
            self.etcd.start()
            for lb in self.lbs:
                lb.start()
            self._proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _proxy(self) -> None:
        """(Re)start HAProxy on the live instances (a rollout's new pod joins the Service)."""
        self.conf.write_text(self._haproxy_conf())
        old = self.proxy
        # A reload, as HAProxy's own: the new process binds beside the old (SO_REUSEPORT) and
        # ``-sf`` soft-stops the old one, which serves its connections until they close; a
        # hard stop would cut every client at once.
        soft = ["-sf", str(old.pid)] if old is not None and old.poll() is None else []
        with (self.tmp / "haproxy.log").open("ab") as log:
            self.proxy = subprocess.Popen(
                [haproxy_binary(), "-db", "-f", str(self.conf), *soft],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        if old is not None:
            self.old_proxies.append(old)
        wait_port(self.port, proc=self.proxy)

    def add(self) -> Wslb:
        """A new instance (a rollout's new pod), in HAProxy once it listens."""
        lb = self._new().start()
        self.lbs.append(lb)
        self._proxy()
        return lb

    def terminate(self, lb: Wslb, timeout: float = 30.0) -> int:
        """SIGTERM, as Kubernetes stops a pod, and wait for its exit."""
        assert lb.proc is not None
        lb.proc.send_signal(signal.SIGTERM)
        return lb.proc.wait(timeout)

    def holding(self) -> list[int]:
        """Sessions each live instance holds now."""
        out = []
        for lb in self.lbs:
            if lb.proc is None or lb.proc.poll() is not None:
                out.append(0)
                continue
            out.append(len(lb.admin("/sessions")))
        return out

    def total(self, name: str, **labels: str) -> float:
        """A metric summed over the live instances."""
        return sum(
            metric(lb, name, **labels)
            for lb in self.lbs
            if lb.proc is not None and lb.proc.poll() is None
        )

    def stop(self) -> None:
        for proxy in [*self.old_proxies, self.proxy]:
            if proxy is not None:
                stop(proxy, 5)
        for lb in self.lbs:
            if lb.proc is not None:
                lb.stop()
        self.etcd.stop()


def workers(n: int, args: Sequence[str] = ("--tokens-per-s", "40")) -> list[Worker]:
    return [Worker(f"w{i}", list(args)).start() for i in range(n)]


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj)
