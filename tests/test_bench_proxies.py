"""Smoke test of the raw worker and client of bench/proxies.py (bench/lib/rawws.py): the
benchmark's figures rest on them.

The benchmark itself is a script (nginx, HAProxy, minutes of load); this only checks that the
worker streams paced and unpaced frames, that the client counts them and their latency, and
that it answers a proxy's ping in the middle of a stream; and that ``--tls`` makes a certificate
every proxy's config uses, and a client that streams over it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from bench.lib.proxies import Haproxy, Nginx, Wslb, outcome
from bench.lib.rawws import (
    BLOCK,
    FRAME_LEN,
    TS_DIGITS,
    TS_OFF,
    ClientConn,
    ClientStats,
    WorkerConn,
    client_context,
    client_frame,
    dial,
    make_tls,
    next_frame,
    server_frame,
    token_frame,
    upgrade_request,
)
from bench.proxies import Burst, build_parser, target_names
from tests.waits import until


def test_frames_round_trip() -> None:
    masked = client_frame(0x1, b'{"rate": 20}')
    assert next_frame(bytearray(masked), 0) == (0x1, b'{"rate": 20}', len(masked))
    token = token_frame(123456789)
    assert len(token) == FRAME_LEN
    assert int(token[TS_OFF : TS_OFF + TS_DIGITS]) == 123456789
    assert next_frame(bytearray(token), 0) == (0x1, token[2:], FRAME_LEN)
    assert next_frame(bytearray(token[:10]), 0) is None


class _Sink:
    """Stands in for a transport: records writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


async def test_client_counts_frames_around_a_ping() -> None:
    for rate in (0.0, 20.0):
        st = ClientStats()
        conn = ClientConn(st, b"", rate)
        sink = _Sink()
        conn.transport = cast(asyncio.Transport, sink)
        conn.ws = True
        data = BLOCK[: 3 * FRAME_LEN] + server_frame(0x9, b"abc") + BLOCK[: 2 * FRAME_LEN]
        conn.data_received(data[:100])  # split mid-frame
        conn.data_received(data[100:])
        assert st.recv == 5
        assert st.bad == 0
        assert sink.written == [client_frame(0xA, b"abc")]


def _returns(conn: ClientConn) -> Callable[[], ClientConn]:
    return lambda: conn


async def test_worker_streams_paced_and_unpaced() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(WorkerConn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    paced, unpaced = ClientStats(), ClientStats()
    transports = []
    try:
        t0 = time.monotonic()
        for st, rate in ((paced, 200.0), (unpaced, 0.0)):
            conn = ClientConn(st, upgrade_request("127.0.0.1", port, "/ws?session=s"), rate)
            t, proto = await loop.create_connection(_returns(conn), "127.0.0.1", port)
            transports.append(t)
            await asyncio.wait_for(proto.upgraded, 5)
            proto.go()
        await until(lambda: paced.recv >= 10 and unpaced.recv > 1000, 10, "both streams flow")
        took = time.monotonic() - t0
        assert paced.recv <= 200 * took + 40, (paced.recv, took)  # its rate, give or take a start
        assert sum(paced.lat) == paced.recv  # every paced frame's latency was recorded
        assert unpaced.recv > 1000
        assert paced.bad == unpaced.bad == 0
    finally:
        for t in transports:
            t.close()
        server.close()
        await server.wait_closed()


def test_tls_option_and_configs(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--tls", "--hs-connects", "100"])
    assert args.tls and args.hs_connects == 100 and args.burst == 500
    _, names = target_names(args)
    assert names == ["direct", "nginx", "haproxy", "wslb"]  # no wslb-loop: same as wslb on TLS
    _, plain_names = target_names(build_parser().parse_args([]))
    assert "wslb-loop" in plain_names
    tls = make_tls(tmp_path / "tls")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_cert_chain(tls.combined)  # HAProxy's one-file form
    backends = ["ws://127.0.0.1:9001/ws"]
    plain, secure = Nginx(), Nginx(tls=tls)
    plain.port, secure.port, secure.plain_port = 8000, 8443, 8001
    text = plain.config(tmp_path, tmp_path, backends)
    assert "listen 127.0.0.1:8000 backlog=4096;" in text and "ssl" not in text
    text = secure.config(tmp_path, tmp_path, backends)
    assert "listen 127.0.0.1:8443 ssl backlog=4096;" in text
    assert "listen 127.0.0.1:8001 backlog=4096;" in text
    assert f"ssl_certificate {tls.cert};" in text and "TLSv1.3" in text
    hp, hps = Haproxy(), Haproxy(tls=tls)
    hp.port, hps.port, hps.plain_port = 8000, 8443, 8001
    assert "  bind 127.0.0.1:8000\n" in hp.config(backends) and "ssl" not in hp.config(backends)
    assert f"bind 127.0.0.1:8443 ssl crt {tls.combined}" in hps.config(backends)
    assert "listen" not in Wslb().config(backends)
    listen = Wslb(tls=tls).config(backends)["listen"]
    assert listen[0]["tls"] == {"cert": str(tls.cert), "key": str(tls.key)}
    assert "tls" not in listen[1]


def test_outcomes() -> None:
    assert outcome(ConnectionResetError()) == "reset"
    assert outcome(ConnectionError("lost before upgrade: ConnectionResetError(104)")) == "reset"
    assert outcome(TimeoutError()) == "timeout"
    assert outcome(ConnectionError("lost before upgrade: None")) == "closed"
    assert outcome(ConnectionError("HTTP/1.1 503 Service Unavailable")) == "http"
    b = Burst(500, 5, {"101": 498, "reset": 1, "http": 1}, 10.0, 20.0, 0.1)
    assert b.summary() == "498/500 101, 1 reset, 0 timed out / 1 http"


async def test_client_streams_over_tls(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls")
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(tls.cert, tls.key)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(WorkerConn, "127.0.0.1", 0, ssl=sctx)
    port = server.sockets[0].getsockname()[1]
    st = ClientStats()
    try:
        request = upgrade_request("127.0.0.1", port, "/ws?session=s")
        factory = lambda: ClientConn(st, request, 200.0)  # noqa: E731
        conn = await dial(
            loop, "127.0.0.1", ("127.0.0.1", port), factory, (5, 5), client_context(tls.ca)
        )
        assert conn.transport is not None and conn.transport.get_extra_info("ssl_object")
        conn.go()
        await until(lambda: st.recv >= 10, 10, "frames over TLS")
        assert st.bad == 0
        conn.transport.close()
    finally:
        server.close()
        await server.wait_closed()
