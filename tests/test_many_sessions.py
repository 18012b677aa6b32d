"""3,000 idle sessions from one address through wslb's default limits.

Behind an ingress, in a sidecar, or in a load test every session comes from one client address,
so the defaults must not cap connections per address: all 3,000 upgrades succeed (no 429), each
session still works afterwards, and all close. The backends are stock ``websockets`` echo
servers (``tests/servers``), so nothing here depends on the reference worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import resource
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from tests.procs import Wslb
from tests.servers import Server

SESSIONS = 3000
SAMPLE = 300
PARALLEL = 200  # upgrades (and closes) in flight at once
BUDGET = 90.0  # seconds for the whole exchange; about 5 s on 2 cores


@contextlib.contextmanager
def nofile_at_hard_limit() -> Iterator[int]:
    """Raise this process's open-file soft limit to the hard one (wslb and the servers started
    inside inherit it: wslb holds two sockets per session); restore it afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def stop_wslb(lb: Wslb) -> None:
    if lb.proc is not None:
        lb.stop()


async def open_all(url: str) -> tuple[list[ClientConnection], Counter[str]]:
    """Open SESSIONS keyed sessions, PARALLEL at a time; failures are counted by cause."""
    gate = asyncio.Semaphore(PARALLEL)
    failures: Counter[str] = Counter()

    async def one(i: int) -> ClientConnection | None:
        async with gate:
            try:
                return await connect(
                    f"{url}/echo?session=s{i}", open_timeout=30, ping_interval=None
                )
            except InvalidStatus as exc:
                failures[f"HTTP {exc.response.status_code}"] += 1
            except (OSError, TimeoutError) as exc:
                failures[type(exc).__name__] += 1
            return None

    opened = await asyncio.gather(*(one(i) for i in range(SESSIONS)))
    return [ws for ws in opened if ws is not None], failures


async def echo_once(ws: ClientConnection, text: str) -> bool:
    await ws.send(text)
    return await asyncio.wait_for(ws.recv(), 20) == text


async def close_all(conns: list[ClientConnection]) -> None:
    gate = asyncio.Semaphore(PARALLEL)

    async def one(ws: ClientConnection) -> None:
        async with gate:
            await ws.close()

    await asyncio.gather(*(one(ws) for ws in conns))


async def test_3000_sessions_from_one_address_with_default_limits(tmp_path: Path) -> None:
    conns: list[ClientConnection] = []
    with nofile_at_hard_limit() as nofile, contextlib.ExitStack() as es:
        assert nofile >= 2 * SESSIONS + 500, f"RLIMIT_NOFILE hard limit {nofile} is too low"
        servers = {bid: es.enter_context(Server("websockets", tmp_path)) for bid in ("a", "b")}
        config: dict[str, Any] = {
            "pools": [
                {"name": "echo", "backends": [{"id": k, "url": s.url} for k, s in servers.items()]}
            ]
        }
        lb = Wslb(config, tmp_path)
        es.callback(stop_wslb, lb)
        lb.start()
        try:
            async with asyncio.timeout(BUDGET):
                t0 = time.monotonic()
                conns, failures = await open_all(lb.url)
                opened_in = time.monotonic() - t0
                assert not failures, f"{sum(failures.values())} upgrades failed: {failures}"
                assert len(conns) == SESSIONS

                views = await asyncio.to_thread(lb.admin, "/backends")
                live = {v["id"]: v["sessions"] for v in views}
                assert sum(live.values()) == SESSIONS and min(live.values()) > 0, live

                sample = random.Random(7).sample(range(SESSIONS), SAMPLE)
                gate = asyncio.Semaphore(PARALLEL)

                async def check(i: int) -> bool:
                    async with gate:
                        return await echo_once(conns[i], f"still there {i}")

                echoed = await asyncio.gather(*(check(i) for i in sample))
                assert all(echoed), f"{echoed.count(False)} of {SAMPLE} sampled sessions failed"
                await close_all(conns)
                conns = []
        finally:
            # On a failure, close what is still open (quickly: the processes stop next).
            await asyncio.gather(
                *(asyncio.wait_for(ws.close(), 2) for ws in conns), return_exceptions=True
            )
    print(f"{SESSIONS} sessions opened in {opened_in:.1f}s")
