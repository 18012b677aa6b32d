"""Smoke test of bench/proxies.py's raw worker and client: the benchmark's figures rest on them.

The benchmark itself is a script (nginx, HAProxy, minutes of load); this only checks that the
worker streams paced and unpaced frames, that the client counts them and their latency, and
that it answers a proxy's ping in the middle of a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from bench.proxies import (
    BLOCK,
    FRAME_LEN,
    TS_DIGITS,
    TS_OFF,
    ClientConn,
    ClientStats,
    WorkerConn,
    client_frame,
    next_frame,
    server_frame,
    token_frame,
    upgrade_request,
)


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
        for st, rate in ((paced, 200.0), (unpaced, 0.0)):
            conn = ClientConn(st, upgrade_request("127.0.0.1", port, "/ws?session=s"), rate)
            t, proto = await loop.create_connection(_returns(conn), "127.0.0.1", port)
            transports.append(t)
            await asyncio.wait_for(proto.upgraded, 5)
            proto.go()
        await asyncio.sleep(0.3)
        assert 10 <= paced.recv <= 100
        assert sum(paced.lat) == paced.recv  # every paced frame's latency was recorded
        assert unpaced.recv > 1000
        assert paced.bad == unpaced.bad == 0
    finally:
        for t in transports:
            t.close()
        server.close()
        await server.wait_closed()
