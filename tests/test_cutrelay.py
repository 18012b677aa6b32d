"""The test relay itself: it relays, and each kind of cut fails the way the network would."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.cutrelay import CutRelay


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.fixture
async def relay() -> AsyncIterator[CutRelay]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    r = await CutRelay("127.0.0.1", server.sockets[0].getsockname()[1]).start()
    yield r
    await r.close()
    server.close()


async def _roundtrip(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    return reader, writer


async def test_rst_resets_both_sides_and_the_network_comes_back(relay: CutRelay) -> None:
    reader, writer = await _roundtrip(relay.port)
    assert relay.cut("rst", down=0.5) == 1
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    writer.close()
    # Down: a new connection is reset at once.
    r2, w2 = await asyncio.open_connection("127.0.0.1", relay.port)
    w2.write(b"x")
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(r2.readexactly(1), 5)
    w2.close()
    # Up again after ``down``: poll until a connection goes through (bounded).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        try:
            _, w = await _roundtrip(relay.port)
            w.close()
            break
        except (ConnectionResetError, asyncio.IncompleteReadError):
            assert loop.time() < deadline, "the relay never came back"
            await asyncio.sleep(0.05)


async def test_silent_drop_delivers_nothing_and_closes_nothing(relay: CutRelay) -> None:
    reader, writer = await _roundtrip(relay.port)
    assert relay.cut("silent") == 1
    writer.write(b"lost")
    # Nothing comes back, not even an EOF: the read is still pending when we give up on it.
    read = asyncio.ensure_future(reader.read(10))
    done, _ = await asyncio.wait({read}, timeout=0.5)
    assert not done
    read.cancel()
    writer.close()
    assert relay.connections == 0
    _, w = await _roundtrip(relay.port)  # no down time: new connections relay
    w.close()
