"""Who the client is: the PROXY protocol and X-Forwarded-For, believed only from trusted proxies.

The per-client limit is off by default (every session behind an ingress has one address); when
an operator sets one it counts the address a trusted proxy names. HAProxy (``send-proxy-v2``)
is the real proxy in front of wslb here; the parser itself is checked byte by byte.
"""

from __future__ import annotations

import ipaddress
import json
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from balancer import proxyproto as pp
from tests import installs
from tests.procs import Worker, Wslb, free_port, pool_config, stop, wait_port
from tests.waits import until
from tests.wsraw import RawClient

V2 = pp.V2_SIGNATURE
TEN = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))


# --------------------------------------------------------------------------- the parser


def v2(cmd: int, fam: int, body: bytes) -> bytes:
    return V2 + bytes([0x20 | cmd, fam]) + struct.pack("!H", len(body)) + body


def test_v1_headers() -> None:
    data = b"PROXY TCP4 203.0.113.7 10.0.0.1 51000 8080\r\nGET / HTTP/1.1\r\n"
    assert pp.parse(data) == (pp.ProxyHeader("203.0.113.7", 51000, 1), 44)
    six = b"PROXY TCP6 2001:db8::1 ::1 443 8080\r\n"
    assert pp.parse(six) == (pp.ProxyHeader("2001:db8::1", 443, 1), len(six))
    assert pp.parse(b"PROXY UNKNOWN\r\n") == (pp.ProxyHeader(None), 15)
    for partial in (b"", b"PRO", b"PROXY TCP4 1.2.3.4 "):
        assert pp.parse(partial) is None
    for bad in (
        b"GET / HTTP/1.1\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n",
        b"PROXY TCP4 ::1 5.6.7.8 1 2\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 99999\r\n",
        b"PROXY TCP4 " + b"1" * 120,
    ):
        with pytest.raises(pp.ProxyHeaderError):
            pp.parse(bad)


def test_v2_headers() -> None:
    four = v2(1, 0x11, bytes([198, 51, 100, 9, 10, 0, 0, 1]) + struct.pack("!HH", 4000, 80))
    assert pp.parse(four + b"GET") == (pp.ProxyHeader("198.51.100.9", 4000, 2), len(four))
    six = ipaddress.IPv6Address("2001:db8::5").packed + bytes(16) + struct.pack("!HH", 7, 8)
    assert pp.parse(v2(1, 0x21, six))[0] == pp.ProxyHeader("2001:db8::5", 7, 2)  # type: ignore[index]
    local = v2(0, 0x00, b"")
    assert pp.parse(local) == (pp.ProxyHeader(None, None, 2), 16)
    with_tlvs = v2(1, 0x11, bytes(12) + b"\x04\x00\x01x")  # TLVs after the addresses: skipped
    assert pp.parse(with_tlvs) == (pp.ProxyHeader("0.0.0.0", 0, 2), len(with_tlvs))
    assert pp.parse(four[:20]) is None and pp.parse(V2[:5]) is None
    with pytest.raises(pp.ProxyHeaderError):
        pp.parse(V2 + bytes([0x31, 0x11, 0, 0]))  # version 3
    with pytest.raises(pp.ProxyHeaderError):
        pp.parse(v2(1, 0x11, bytes(4)))  # too short for IPv4


def test_forwarded_for_is_read_from_the_right() -> None:
    # The right-most address that is not a trusted proxy: the left part is the client's say.
    assert pp.forwarded_client("6.6.6.6, 203.0.113.7, 10.0.0.2", TEN) == "203.0.113.7"
    assert pp.forwarded_client("203.0.113.7", TEN) == "203.0.113.7"
    assert pp.forwarded_client("10.0.0.3, 10.0.0.2", TEN) == "10.0.0.3"
    assert pp.forwarded_client("junk, 10.0.0.2", TEN) is None
    assert pp.forwarded_client("", TEN) is None
    assert pp.is_trusted("::ffff:10.1.2.3", TEN) and pp.is_trusted("::1", TEN)
    assert not pp.is_trusted("127.0.0.1", TEN) and not pp.is_trusted("127.0.0.1", ())


# --------------------------------------------------------------------------- end to end


def proxy_v1(client: str) -> bytes:
    return f"PROXY TCP4 {client} 127.0.0.1 40000 8080\r\n".encode()


def upgrade(path: str = "/ws?session=s", extra: str = "") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


async def status_of(lb: Wslb, data: bytes) -> int:
    return (await RawClient.connect(lb.port, raw_request=data)).status


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker("w1").start()
    yield w
    w.stop()


async def test_proxy_protocol_names_the_client_and_the_limit_counts_it(
    worker: Worker, tmp_path: Path
) -> None:
    cfg = pool_config([{"id": "w1", "url": worker.url}])
    cfg["trusted_proxies"] = ["127.0.0.0/8"]
    cfg["limits"] = {"max_connections_per_client": 2}
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "proxy_protocol": True}]
    lb = Wslb(cfg, tmp_path)
    lb.port = port
    lb.start()
    try:
        opened = []
        for _ in range(2):
            c = await RawClient.connect(lb.port, raw_request=proxy_v1("203.0.113.7") + upgrade())
            assert c.status == 101
            opened.append(c)
        assert await status_of(lb, proxy_v1("203.0.113.7") + upgrade()) == 429
        assert await status_of(lb, proxy_v1("198.51.100.1") + upgrade()) == 101
        assert await status_of(lb, upgrade()) == 400  # no header on a proxy_protocol listener
        sessions = lb.admin("/sessions")
        assert {s["client"] for s in sessions} >= {"203.0.113.7", "198.51.100.1"}
        for c in opened:
            c.close()
    finally:
        lb.stop()
    assert 'client="203.0.113.7"' not in lb.output()  # text access log, not JSON
    assert any(line.split(" wslb.access: ")[-1].startswith("203.0.113.7 ")
               for line in lb.output().splitlines())  # fmt: skip


async def test_forwarded_for_counts_only_from_trusted_proxies(
    worker: Worker, tmp_path: Path
) -> None:
    cfg = pool_config([{"id": "w1", "url": worker.url}])
    cfg["limits"] = {"max_connections_per_client": 1}
    cfg["trusted_proxies"] = ["10.0.0.0/8"]  # not loopback: the test client is untrusted
    lb = Wslb(cfg, tmp_path).start()
    try:
        first = await connect(
            f"{lb.url}/ws?session=a", additional_headers={"X-Forwarded-For": "203.0.113.7"}
        )
        # An untrusted peer's header is not believed: both count as 127.0.0.1.
        with pytest.raises(InvalidStatus) as refused:
            await connect(
                f"{lb.url}/ws?session=b", additional_headers={"X-Forwarded-For": "198.51.100.1"}
            )
        assert refused.value.response.status_code == 429
        (s,) = lb.admin("/sessions")
        assert s["client"] == "127.0.0.1"
        await first.close()
    finally:
        lb.stop()
    cfg["trusted_proxies"] = ["127.0.0.1"]
    lb = Wslb(cfg, tmp_path).start()
    try:
        a = await connect(
            f"{lb.url}/ws?session=a", additional_headers={"X-Forwarded-For": "6.6.6.6, 203.0.113.7"}
        )
        b = await connect(
            f"{lb.url}/ws?session=b", additional_headers={"X-Forwarded-For": "198.51.100.1"}
        )
        with pytest.raises(InvalidStatus) as refused:
            await connect(
                f"{lb.url}/ws?session=c", additional_headers={"X-Forwarded-For": "203.0.113.7"}
            )
        assert refused.value.response.status_code == 429
        clients = sorted(s["client"] for s in lb.admin("/sessions"))
        assert clients == ["198.51.100.1", "203.0.113.7"]
        await a.close()
        await b.close()
    finally:
        lb.stop()


def haproxy() -> str:
    """HAProxy from Debian's package (installed and proven here if missing, as
    bench/proxies.py does; its system service stopped)."""
    return installs.apt_binary(
        "haproxy", "haproxy", args=("-v",), after=("service", "haproxy", "stop")
    )


def start_haproxy(binary: str, conf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([binary, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL)


async def test_haproxy_send_proxy_v2_in_front(worker: Worker, tmp_path: Path) -> None:
    """A real layer-4 proxy: HAProxy in TCP mode, ``send-proxy-v2``, from 127.0.0.2."""
    binary = haproxy()
    wport, hport = free_port(), free_port()
    cfg = pool_config([{"id": "w1", "url": worker.url}])
    cfg["trusted_proxies"] = ["127.0.0.2"]
    cfg["listen"] = [{"address": f"127.0.0.1:{wport}", "proxy_protocol": True}]
    cfg["log"] = {"format": "json"}
    lb = Wslb(cfg, tmp_path)
    lb.port = wport
    conf = tmp_path / "haproxy.cfg"
    conf.write_text(
        "global\n  maxconn 100\ndefaults\n  mode tcp\n  timeout connect 5s\n"
        "  timeout client 30s\n  timeout server 30s\n"
        f"frontend fe\n  bind 127.0.0.1:{hport}\n  default_backend be\n"
        f"backend be\n  source 127.0.0.2\n  server lb 127.0.0.1:{wport} send-proxy-v2\n"
    )
    lb.start()
    hp = start_haproxy(binary, conf)
    try:
        wait_port(hport, proc=hp)
        async with connect(f"ws://127.0.0.1:{hport}/ws?session=via-haproxy") as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello"
            await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 2}))
            while json.loads(await ws.recv())["type"] != "done":
                pass
            (s,) = lb.admin("/sessions")
            # HAProxy saw the test client on 127.0.0.1; its own address is 127.0.0.2.
            assert s["client"] == "127.0.0.1"
        await until(lambda: '"wslb.access"' in lb.output(), 10, "the access line")
    finally:
        stop(hp)
        lb.stop()
    lines = [json.loads(x) for x in lb.output().splitlines() if x.startswith("{")]
    (access,) = [x for x in lines if x["logger"] == "wslb.access"]
    assert access["client"] == "127.0.0.1" and access["session"] == "via-haproxy"
    assert access["messages_in"] == 1 and access["messages_out"] >= 4
    assert access["end"] == "client closed" and access["close_to_worker"] == 1000
