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
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from balancer.auth import scoped_key
from balancer.config import BackendCfg, PoolCfg
from balancer.pool import Pool
from tests.procs import Wslb
from tests.test_http_proxy import App, Stack

ATTACKER = "127.0.0.1"
VICTIM = "127.0.0.2"  # loopback answers the whole 127/8: a second client address


def two_backend_pool(per_client: int = 64, owners: bool = False) -> Pool:
    cfg = PoolCfg(
        name="p",
        backends=tuple(BackendCfg(id=f"w{i}", url=f"ws://127.0.0.1:{9100 + i}") for i in (0, 1)),
        affinity_hold_per_client=per_client,
    )
    return Pool(cfg, seed=1, owners=owners)


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
    tmp = tmp_path_factory.mktemp("anon")
    apps = [App(tmp), App(tmp)]
    cfg: dict[str, Any] = {
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
    lb = Wslb(cfg, tmp)
    try:
        lb.start(wait_ready=False)
        lb.wait_ready(until=lambda bs: all(b["state"] == "active" for b in bs))
        yield Stack(lb, apps)
    finally:
        if lb.proc is not None:
            lb.stop()
        for a in apps:
            a.stop()


def counted_held(lb: Wslb) -> int:
    return sum(int(b["held"]) for b in lb.admin("/backends"))


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
    assert counted_held(stack.lb) == 1
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
    assert counted_held(stack.lb) <= 64 + 1
    assert await victim_worker(stack) == home
