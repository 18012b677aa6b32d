"""A live session as data: described by ``Session.snapshot`` and rebuilt by ``Session.adopt``
around the same connections (duplicated descriptors, as a new process gets them), over real
loopback sockets. The peers see one unbroken stream: nothing lost, repeated or reordered, and
the counters, heartbeat and replay log go on from where they were."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

from balancer.aio.session import ClientLeg, Parked, Session, SessionSettings
from balancer.config import BackendCfg, Config, FailoverCfg, PoolCfg, Timeouts
from balancer.frames import OP_CLOSE, OP_TEXT, FrameScanner, build_frame
from balancer.pool import Pool
from balancer.session_core import Mode
from tests.test_session import REQ, FakeHost


class Peer(asyncio.Protocol):
    """One end nobody wrote for wslb would look like: it reads frames with a stock parser
    (wslb's scanner in the other role) and records the data messages."""

    def __init__(self, masked: bool) -> None:
        self.sc = FrameScanner(masked=masked)
        self.got: list[bytes] = []
        self.raw = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.raw += data
        self.sc.feed(data)

    def messages(self) -> list[bytes]:
        """The data messages received so far (single-frame text, as the test sends)."""
        out, data, pos = [], bytes(self.raw), 0
        while pos + 2 <= len(data):
            n = data[pos + 1] & 0x7F
            at = pos + 2
            if n == 126:
                n, at = int.from_bytes(data[at : at + 2], "big"), at + 2
            masked = bool(data[pos + 1] & 0x80)
            key = data[at : at + 4] if masked else b""
            at += 4 if masked else 0
            if at + n > len(data):
                break
            payload = data[at : at + n]
            if key:
                payload = bytes(c ^ key[i % 4] for i, c in enumerate(payload))
            if data[pos] & 0x0F == OP_TEXT:
                out.append(payload)
            pos = at + n
        return out


async def pair(loop: asyncio.AbstractEventLoop, masked_peer: bool) -> tuple[Any, Peer, Any]:
    """A loopback TCP connection: wslb's transport on one end, a ``Peer`` on the other."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.setblocking(False)
    peer = Peer(masked=not masked_peer)
    conn = loop.create_task(loop.sock_accept(lsock))
    await loop.create_connection(lambda: peer, *lsock.getsockname())
    wslb_sock, _ = await conn
    lsock.close()
    t, _ = await loop.connect_accepted_socket(asyncio.Protocol, wslb_sock)
    return t, peer, wslb_sock


async def until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def shut(client: Peer, worker: Peer, s: Session) -> None:
    for t in (client.transport, worker.transport, s.ct, s.wt):
        if t is not None:
            t.abort()
    await asyncio.sleep(0.01)


def settings_of(failover: bool) -> SessionSettings:
    cfg = Config(timeouts=Timeouts(ping_interval=30, ping_timeout=10, idle=0, backpressure=0))
    return SessionSettings.of(cfg, True, FailoverCfg(enabled=failover))


async def adopted(
    host: FakeHost, pool: Pool, s: Session, settings: SessionSettings
) -> tuple[Session, dict[str, Any]]:
    """What a new process does: the snapshot through JSON, the descriptors duplicated, the old
    transports dropped (the duplicates keep the connections), the session rebuilt."""
    loop = host.loop
    data = json.loads(json.dumps(s.snapshot()))
    socks = []
    for t in (s.ct, s.wt):
        fd = os.dup(t.get_extra_info("socket").fileno())
        socks.append(socket.socket(fileno=fd))
    for t in (s.ct, s.wt):
        t.set_protocol(asyncio.Protocol())  # the old process lets go without an event
        t.abort()
    host.live.remove(s)
    pool.detach(s.backend)
    loop.call_soon(lambda: None)
    ct, _ = await loop.connect_accepted_socket(Parked, socks[0])
    wt, _ = await loop.connect_accepted_socket(Parked, socks[1])
    return Session.adopt(host, settings, pool, data, ct, wt), data


async def test_a_session_rebuilt_from_its_snapshot_goes_on_unbroken() -> None:
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    pool = Pool(PoolCfg("p", backends=(BackendCfg("w", "ws://127.0.0.1:1"),)))
    settings = settings_of(failover=False)
    ct, client, _ = await pair(loop, masked_peer=True)
    wt, worker, _ = await pair(loop, masked_peer=False)
    s = Session(host, settings, pool, pool.backends["w"], "sid", "1.2.3.4", ct, wt, REQ, False)
    ct.set_protocol(ClientLeg(s))
    wt.set_protocol(s)
    assert client.transport is not None and worker.transport is not None
    # Before: a prompt up, three tokens down, the third cut in the middle of its frame.
    client.transport.write(build_frame(OP_TEXT, b"prompt 1", mask=True))
    tokens = [build_frame(OP_TEXT, f"token {i}".encode(), mask=False) for i in range(6)]
    worker.transport.write(tokens[0] + tokens[1] + tokens[2][:5])
    await until(lambda: len(client.messages()) == 2 and worker.messages() == [b"prompt 1"])
    cut = len(tokens[0]) + len(tokens[1]) + 5  # the cut frame's first bytes reach wslb
    await until(lambda: len(client.raw) == cut)  # which relays them as they come
    s2, data = await adopted(host, pool, s, settings)
    assert data["core"]["ws"]["remaining"] > 0  # described in the middle of a frame
    assert s2.core.mode is Mode.RELAYING and s2.totals[:2] == s.totals[:2]
    # After: the rest of the cut frame and more, both ways, on the adopted transports.
    worker.transport.write(tokens[2][5:] + b"".join(tokens[3:]))
    client.transport.write(build_frame(OP_TEXT, b"prompt 2", mask=True))
    want = [f"token {i}".encode() for i in range(6)]
    await until(lambda: client.messages() == want and len(worker.messages()) == 2)
    assert worker.messages() == [b"prompt 1", b"prompt 2"]
    assert s2.totals[:2] == (2, 6)
    # The replay log spans the handover: the second prompt is replayable by count.
    replay = s2.replay_from(1)
    assert replay is not None and len(replay) == len(build_frame(OP_TEXT, b"prompt 2", mask=True))
    # Rule 1 still holds on the adopted session: a close is forwarded and answered.
    client.transport.write(build_frame(OP_CLOSE, b"\x03\xe8", mask=True))
    await until(lambda: worker.sc.close is not None)
    worker.transport.write(build_frame(OP_CLOSE, b"\x03\xe8", mask=False))
    await until(lambda: s2.finished)
    assert host.finished == [s2] and pool.backends["w"].sessions == 0
    assert s2.close_to_worker == 1000 and s2.close_to_client == 1000
    await shut(client, worker, s2)


async def test_the_snapshot_keeps_placement_heartbeat_and_request() -> None:
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    pool = Pool(
        PoolCfg(
            "p",
            backends=(BackendCfg("w", "ws://127.0.0.1:1"), BackendCfg("v", "ws://127.0.0.1:2")),
        )
    )
    settings = settings_of(failover=False)
    ct, _client, _ = await pair(loop, masked_peer=True)
    wt, _worker, _ = await pair(loop, masked_peer=False)
    s = Session(host, settings, pool, pool.backends["v"], "key-1", "10.0.0.9", ct, wt, REQ, True)
    ct.set_protocol(ClientLeg(s))
    wt.set_protocol(s)
    s.timing = (0.002, 0.004)
    s2, data = await adopted(host, pool, s, settings)
    assert (s2.backend.id, s2.sid, s2.peer, s2.secure) == ("v", "key-1", "10.0.0.9", True)
    assert pool.backends["v"].sessions == 1 and pool.backends["w"].sessions == 0
    assert s2.timing == (0.002, 0.004) and s2.started_wall == s.started_wall
    assert s2.req.path == REQ.path and s2.timer is not None
    assert 0 < data["timer"] <= 30 * 17 / 16  # the wheel fires up to 1/16 late
    await shut(_client, _worker, s2)


async def test_the_journal_moves_with_the_session() -> None:
    """A failover pool's session: the journal rebuilt from the snapshot gives the transcript
    the original would have, and goes on journalling on the adopted connections."""
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    pool = Pool(PoolCfg("p", backends=(BackendCfg("w", "ws://127.0.0.1:1"),)))
    settings = settings_of(failover=True)
    ct, client, _ = await pair(loop, masked_peer=True)
    wt, worker, _ = await pair(loop, masked_peer=False)
    s = Session(host, settings, pool, pool.backends["w"], "sid", "1.2.3.4", ct, wt, REQ, False)
    ct.set_protocol(ClientLeg(s))
    wt.set_protocol(s)
    assert client.transport is not None and worker.transport is not None

    def frame(obj: str, mask: bool) -> bytes:
        return build_frame(OP_TEXT, obj.encode(), mask=mask)

    worker.transport.write(frame('{"type":"hello"}', False))
    await until(lambda: len(client.messages()) == 1)
    client.transport.write(frame('{"type":"prompt","text":"hi","max_tokens":4}', True))
    await until(lambda: len(worker.messages()) == 1)
    worker.transport.write(frame('{"type":"token","turn":1,"i":0,"text":"a"}', False))
    await until(lambda: len(client.messages()) == 2)
    assert s.journal is not None
    want = s.journal.transcript("sid")
    s2, data = await adopted(host, pool, s, settings)
    assert data["journal"] is not None and s2.journal is not None
    assert s2.journal.transcript("sid") == want
    worker.transport.write(frame('{"type":"token","turn":1,"i":1,"text":"b"}', False))
    await until(lambda: len(client.messages()) == 3)
    s2.flush_record()
    assert s2.journal.transcript("sid")["answer"]["i"] == 2  # journalled after the move too
    await shut(client, worker, s2)
