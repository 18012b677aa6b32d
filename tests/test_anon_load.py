"""What one client can make wslb hold for it, as an attacker would try it.

- Keys a client makes up: each keyed request leaves a held place counted as load
  (``pools[].affinity_hold``); one client address (or JWT owner) holds at most
  ``affinity_hold_per_client`` of them, so a flood of made-up keys neither fills the workers'
  counted load nor pushes another client's conversation off its worker.
- A plain-HTTP client that stops reading (an SSE stream it never reads): cut after
  ``timeouts.backpressure``, and the worker sees its request's connection closed, on the event
  loop's path, through the relay thread and on a lane.
- The admin listener: a request head trickled a byte a second is dropped after
  ``timeouts.handshake`` while normal admin requests go on being answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from balancer.aio import lanes, offload
from balancer.auth import key_owner, scoped_key
from balancer.config import BackendCfg, PoolCfg
from balancer.pool import Pool
from tests.procs import Wslb, free_port, spawn, stop, wait_port
from tests.test_http_proxy import App, Stack, metric, serve

ATTACKER = "127.0.0.1"
VICTIM = "127.0.0.2"  # loopback answers the whole 127/8: a second client address


def two_backend_pool(per_client: int = 64, owners: bool = False) -> Pool:
    cfg = PoolCfg(
        name="p",
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in (0, 1)),
        affinity_hold_per_client=per_client,
    )
    return Pool(cfg, seed=1, client_of=key_owner if owners else None)


def turn(pool: Pool, key: str, client: str, now: float) -> str:
    """One request (or session) of ``key`` from ``client``: placed, attached, ended."""
    b = pool.select(key, now=now)
    assert b is not None
    pool.attach(key, b, now)
    pool.detach(b, key, now, client=client)
    return b.id


def held(pool: Pool) -> int:
    return sum(b.held for b in pool.backends.values())


# -- held places per client (sans-I/O) -----------------------------------------------------------


def test_ten_thousand_made_up_keys_hold_at_most_the_bound() -> None:
    pool = two_backend_pool(per_client=64)
    home = turn(pool, "victim", VICTIM, 0.0)
    live = pool.select("live", now=0.0)
    assert live is not None
    pool.attach("live", live, 0.0)  # a session of the attacker's still open
    for i in range(10_000):
        turn(pool, f"made-up-{i}", ATTACKER, 0.001 * i)
    assert pool.held_by(ATTACKER) == 64
    assert held(pool) == 64 + 1  # the victim's place is still counted, the bound's too
    assert pool.held_by(VICTIM) == 1
    assert live.sessions == 1  # live sessions are not given up for the bound
    # The attacker's newest places are the ones kept (its longest-quiet given up first).
    for key, after in (("made-up-0", 65), ("made-up-9999", 64)):
        b = pool.select(key, now=10.0)
        assert b is not None
        pool.attach(key, b, 10.0)  # only a key whose place was kept takes one back
        assert held(pool) == after, key
    # And the victim comes back to its worker.
    assert turn(pool, "victim", VICTIM, 11.0) == home


def test_a_key_taking_back_its_place_frees_its_clients_count() -> None:
    pool = two_backend_pool(per_client=2)
    for key in ("a", "b"):
        turn(pool, key, ATTACKER, 0.0)
    b = pool.select("a", now=1.0)
    assert b is not None
    pool.attach("a", b, 1.0)  # "a" is live again: its place is no longer held
    assert pool.held_by(ATTACKER) == 1
    turn(pool, "c", ATTACKER, 2.0)
    assert pool.held_by(ATTACKER) == 2 and held(pool) == 2  # "b" and "c"; nothing given up
    pool.detach(b, "a", 3.0, client=ATTACKER)  # "a" ends again: "b", the oldest, gives way
    assert pool.held_by(ATTACKER) == 2 and held(pool) == 2
    pool.refresh(3.0 + pool.hold_s + 1)  # all expire: nothing left counted for anyone
    assert pool.held_by(ATTACKER) == 0 and held(pool) == 0


def test_zero_means_no_bound_and_jwt_owners_are_counted_apart() -> None:
    pool = two_backend_pool(per_client=0)
    for i in range(200):
        turn(pool, f"k{i}", ATTACKER, 0.0)
    assert held(pool) == 200
    # With JWT the owner is whom the bound counts, whatever address its requests come from;
    # two owners behind one address (an ingress) each have their own bound.
    pool = two_backend_pool(per_client=3, owners=True)
    for i in range(10):
        turn(pool, scoped_key("alice", f"k{i}"), f"10.0.0.{i}", 0.0)
        turn(pool, scoped_key("bob", f"k{i}"), ATTACKER, 0.0)
    assert held(pool) == 6
    assert pool.held_by(ATTACKER) == 0  # counted by owner, not by this address


# -- the same through wslb, from two client addresses ---------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    def config_of(apps: list[App]) -> dict[str, Any]:
        return {
            "pools": [
                {
                    "name": "p",
                    "backends": [{"id": f"a{i}", "url": a.url} for i, a in enumerate(apps)],
                    "affinity_hold": "10m",  # nothing expires during the test
                    "drain": {"migrate": False},
                }
            ],
            "timeouts": {"backpressure": "2s", "handshake": "2s", "shutdown_grace": "0.5s"},
        }

    with serve(tmp_path_factory.mktemp("anon"), config_of) as st:
        yield st


async def counted_held(lb: Wslb) -> int:
    """The places held over the pool once no request or lane is live any more (a key on a lane
    counts as a session until the thread hands the closed connection back), bounded."""
    deadline = time.monotonic() + 5
    while True:
        backends = await asyncio.to_thread(lb.admin, "/backends")
        if sum(int(b["sessions"]) for b in backends) == 0:
            return sum(int(b["held"]) for b in backends)
        assert time.monotonic() < deadline, backends
        await asyncio.sleep(0.05)


async def victim_worker(stack: Stack) -> int:
    """The victim's keyed request, from its own address: the pid of the worker it reached."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(VICTIM, 0))) as http,
        http.get(f"{stack.base}/json", headers={"X-Session-Id": "victim"}) as r,
    ):
        assert r.status == 200
        return int((await r.json())["pid"])


async def test_a_flood_of_made_up_keys_from_one_address(stack: Stack) -> None:
    """10,000 keyed requests from one address, each with a key of its own: the places held for
    them stop at the bound, and a client at another address keeps its place and its worker."""
    home = await victim_worker(stack)
    assert await counted_held(stack.lb) == 1
    n = 10_000
    sent = iter(range(n))

    async def attacker(http: aiohttp.ClientSession) -> None:
        for i in sent:
            async with http.get(f"{stack.base}/json", headers={"X-Session-Id": f"k{i}"}) as r:
                assert r.status == 200
                await r.read()

    conn = aiohttp.TCPConnector(limit=8, local_addr=(ATTACKER, 0))
    async with aiohttp.ClientSession(connector=conn) as http:
        await asyncio.gather(*(attacker(http) for _ in range(8)))
    assert await counted_held(stack.lb) == 64 + 1  # the attacker's bound, and the victim's
    assert await victim_worker(stack) == home


# -- a plain-HTTP client that stops reading ---------------------------------------------------

STALL_S = 2.0  # timeouts.backpressure of these wslbs


@dataclass
class Stalls:
    app_port: int
    lb: Wslb  # the relay thread and the lanes on (the default)
    loop_lb: Wslb  # relay.thread: false: every byte through the event loop


@pytest.fixture(scope="module")
def stalls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalls]:
    tmp = tmp_path_factory.mktemp("stall")
    port = free_port()
    cmd = [sys.executable, "-m", "tests.servers.stall_app", "--port", str(port)]
    app = spawn(cmd, log=tmp / "stall_app.log")
    lbs: list[Wslb] = []
    try:
        wait_port(port, proc=app)
        for relay in (True, False):
            cfg: dict[str, Any] = {
                "pools": [
                    {
                        "name": "p",
                        "backends": [{"id": "s", "url": f"ws://127.0.0.1:{port}"}],
                        "drain": {"migrate": False},
                    }
                ],
                "timeouts": {"backpressure": f"{STALL_S}s", "shutdown_grace": "0.5s"},
                "relay": {"thread": relay},
            }
            lbs.append(Wslb(cfg, tmp).start())
        yield Stalls(port, lbs[0], lbs[1])
    finally:
        for lb in lbs:
            lb.stop()
        stop(app, 5)


async def stream_ended(port: int, sid: str, deadline: float) -> float | None:
    """When the app's stream ``sid`` failed to write (wall time), polled until ``deadline``."""
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"http://127.0.0.1:{port}/ended", params={"id": sid}) as r:
                ended = (await r.json())["ended"]
            if ended is not None or time.monotonic() > deadline:
                return None if ended is None else float(ended)
            await asyncio.sleep(0.1)


async def never_read(
    lb: Wslb,
    app_port: int,
    sid: str,
    first: bool = False,
    until: Callable[[], Awaitable[None]] | None = None,
) -> float:
    """Ask for an endless stream and read none of it: seconds until the worker's write failed.
    ``first``: a whole short answer of the same request before (the lane's first exchange).
    ``until``: the stream is paced (a token stream's shape) until it returns, then floods; the
    seconds count from the flood."""
    r, w = await asyncio.open_connection("127.0.0.1", lb.port)
    query = f"id={sid}&after={int(first)}&paced={int(until is not None)}"
    head = f"GET /stream?{query} HTTP/1.1\r\nHost: x\r\nX-Session-Id: {sid}"
    try:
        if first:
            w.write(head.encode() + b"\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"0\r\n\r\n"), 5)  # three events and the end
        w.write(head.encode() + b"\r\n\r\n")
        if until is not None:
            await until()
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{app_port}/flood", params={"id": sid}) as resp,
            ):
                assert resp.status == 200
        t0 = time.time()
        ended = await stream_ended(app_port, sid, time.monotonic() + STALL_S + 15)
        assert ended is not None, f"the worker still writes {STALL_S + 15:.0f}s on: {lb.log_tail()}"
        return ended - t0
    finally:
        w.transport.abort()  # and its socket closed before the test's loop is (else a
        with contextlib.suppress(ConnectionError):  # ResourceWarning in a later test's gc)
            await w.wait_closed()


async def wait_for_line(lb: Wslb, text: str) -> None:
    deadline = time.monotonic() + 5  # the access line is written as the exchange ends
    while text not in lb.output():
        assert time.monotonic() < deadline, lb.log_tail()
        await asyncio.sleep(0.05)


async def test_a_client_that_never_reads_is_cut_in_the_event_loop(stalls: Stalls) -> None:
    took = await never_read(stalls.loop_lb, stalls.app_port, "loop")
    assert STALL_S <= took < STALL_S + 6, took
    await wait_for_line(stalls.loop_lb, 'end="client not reading"')


@pytest.mark.skipif(not offload.AVAILABLE, reason="balancer._offload is not built")
async def test_a_client_that_never_reads_is_cut_with_the_relay_thread(stalls: Stalls) -> None:
    """The stream goes to the relay thread after its first chunks; the thread gives it back
    when the client stops taking it, and the event loop's clock cuts it.

    The worker paces its first events as a model does, and floods only once the thread has
    the stream: wslb hands an answer over only between chunks, and a worker writing as fast
    as it can, read by a busy wslb, fills each read mid-chunk until the client's socket
    buffers are full - the event loop then relays and cuts it itself (the first test's case),
    and the thread is never tried."""
    lb = stalls.lb
    taken = metric(lb, "wslb_relay_thread_handovers_total", event="taken")
    returned = metric(lb, "wslb_relay_thread_handovers_total", event="frame")

    async def in_the_thread() -> None:
        deadline = time.monotonic() + 10
        while (
            await asyncio.to_thread(metric, lb, "wslb_relay_thread_handovers_total", event="taken")
            <= taken
        ):
            assert time.monotonic() < deadline, lb.log_tail()
            await asyncio.sleep(0.05)

    took = await never_read(lb, stalls.app_port, "relay", until=in_the_thread)
    assert STALL_S <= took < STALL_S + 6, took
    # Given back at the send the client did not take whole (``_offload.c``: a chunked body).
    assert metric(lb, "wslb_relay_thread_handovers_total", event="frame") > returned
    await wait_for_line(lb, 'end="client not reading"')


@pytest.mark.skipif(not lanes.AVAILABLE, reason="balancer._offload is not built")
async def test_a_client_that_never_reads_is_cut_on_a_lane(stalls: Stalls) -> None:
    """The second request of a kept-alive connection, served by the lane thread."""
    served = metric(stalls.lb, "wslb_http_lane_events_total", event="exchanges")
    took = await never_read(stalls.lb, stalls.app_port, "lane", first=True)
    assert STALL_S <= took < STALL_S + 6, took
    deadline = time.monotonic() + 5  # counted in the next batch (0.25 s)
    while metric(stalls.lb, "wslb_http_lane_events_total", event="exchanges") <= served:
        assert time.monotonic() < deadline, stalls.lb.log_tail()
        await asyncio.sleep(0.05)
    await wait_for_line(stalls.lb, "client not reading")


# -- the admin listener and slow heads ----------------------------------------------------------


async def trickle(port: int, first: bytes = b"") -> float:
    """Connect to ``port``, send ``first`` (a whole request, its answer read) and then a request
    head one byte a second: the seconds until wslb closed the connection (bounded)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        if first:
            w.write(first)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(r.readexactly(length), 5)
        t0 = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 100:
            try:
                w.write(bytes([byte]))
                got = await asyncio.wait_for(r.read(1), 1.0)
            except TimeoutError:
                continue  # still open: the next byte
            except ConnectionError:
                got = b""
            assert got == b"", got  # wslb answers nothing to half a head: it closes
            return time.monotonic() - t0
        raise AssertionError("the trickled head was never cut")
    finally:
        w.transport.abort()  # and its socket closed before the test's loop is (else a
        with contextlib.suppress(ConnectionError):  # ResourceWarning in a later test's gc)
            await w.wait_closed()


async def test_the_admin_listener_drops_a_head_trickled_a_byte_a_second(stack: Stack) -> None:
    """``timeouts.handshake`` (2 s here) bounds the first head of a connection and each next
    one; normal admin requests are answered meanwhile."""
    lb = stack.lb
    first = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    slow = [asyncio.create_task(trickle(lb.admin_port)) for _ in range(20)]
    slow.append(asyncio.create_task(trickle(lb.admin_port, first)))
    while not all(t.done() for t in slow):
        backends = await asyncio.to_thread(lb.admin, "/backends")
        assert {b["id"] for b in backends} == {"a0", "a1"}
        await asyncio.sleep(0.2)
    for took in await asyncio.gather(*slow):
        assert 1.5 <= took < 5.0, took
