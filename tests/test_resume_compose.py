"""Client resume composed with the rest of wslb (issue 27, SPEC section 13 "It composes"): a
full resume window pausing the worker, a drain or a ``kill -9`` of the worker while the client
is away, ``wss://``, the relay thread on and off, ``workers: 2``, the official ``openai`` SDK's
own reconnect through a TCP relay that is cut, and the engine bridge in front of llama-server.

Every client is cut without a close (``transport.abort()``, or a relay that resets both of its
sockets) and comes back with its token and its count; each then checks every token once and in
order, and one ``done``. Real processes on loopback; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import ssl
import struct
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from backends.model import token_text
from balancer.aio import offload
from tests.engines import EngineSetupError, LlamaServer, gemma_gguf, llama_server
from tests.procs import Procs, Worker, Wslb, free_port, pool_config
from tests.test_bridge import STORY, BridgeProc
from tests.test_drain import wait_state
from tests.test_failover import default_system, failovers, relay_thread, until, worker_proc
from tests.test_realtime import client, next_event, say
from tests.test_resume import Client, away, metric
from tests.test_tls_stream import make_certs, tls_listener, with_listeners

TOKENS = 150  # at balancer.yaml's workers' 50 tokens/s: 3 s per answer
RESUME = {"enabled": True, "grace": "30s", "buffer": "1MiB"}


class TlsClient(Client):
    """``tests.test_resume.Client`` over ``wss://`` (``ctx``: the CA it trusts)."""

    def __init__(self, url: str, sid: str, ctx: ssl.SSLContext | None) -> None:
        super().__init__(url, sid)
        self.ctx = ctx

    async def open(self, resume: bool = False, count: int | None = None) -> None:
        if self.ctx is None:
            await super().open(resume, count)
            return
        headers: dict[str, str] = {}
        if self.token is not None:
            headers["X-WSLB-Resume-Token"] = self.token
        if resume:
            headers["X-WSLB-Resume-From"] = str(self.count if count is None else count)
        self.ws = await connect(self.url, additional_headers=headers, open_timeout=10, ssl=self.ctx)
        assert self.ws.response is not None
        self.token = self.ws.response.headers["X-WSLB-Resume-Token"]
        self.resumed = self.ws.response.headers.get("X-WSLB-Resumed")


async def start_answer(c: Client, tokens: int, before: int, text: str = "tell me") -> list[int]:
    """Open ``c``, ask for ``tokens`` tokens and read ``before`` of them (their indices)."""
    await c.open()
    assert (await c.recv())["type"] == "hello"
    assert c.ws is not None
    await c.ws.send(json.dumps({"type": "prompt", "text": text, "max_tokens": tokens}))
    seen: list[int] = []
    while len(seen) < before:
        msg = await c.recv()
        assert msg["type"] == "token", msg
        seen.append(msg["i"])
    return seen


async def rest_of_answer(
    c: Client, seen: list[int], turn: int = 1, quiet: bool = True
) -> dict[str, Any]:
    """Tokens (each checked against its deterministic text) into ``seen`` up to the ``done``,
    which is returned; with ``quiet``, nothing after it within 0.3 s (a drain's close after the
    answer may come sooner: the caller that expects one checks it instead)."""
    while True:
        msg = await c.recv()
        if msg["type"] == "done":
            break
        assert msg["type"] == "token" and msg["turn"] == turn, msg
        assert msg["text"] == token_text(c.sid, turn, msg["i"]), msg
        seen.append(msg["i"])
    assert c.ws is not None
    if not quiet:
        return dict(msg)
    with contextlib.suppress(TimeoutError):
        extra = await asyncio.wait_for(c.ws.recv(), 0.3)
        raise AssertionError(f"after done: {extra!r}")
    return dict(msg)


async def cut_and_resume(c: Client, seen: list[int], tokens: int, away: float = 0.3) -> str:
    """Cut ``c`` mid-answer, come back ``away`` s later: every token once, in order, one
    ``done``; the worker that finished the answer."""
    c.cut()
    await asyncio.sleep(away)
    await c.open(resume=True)
    assert c.resumed == str(c.count)
    done = await rest_of_answer(c, seen)
    assert seen == list(range(tokens)), (c.sid, seen)
    assert done["tokens"] == tokens, done
    return str(done["worker"])


# -- 1. a full window pauses the worker ----------------------------------------------------------


def worker_tokens(w: Worker) -> int:
    """Tokens the reference worker has produced, by its own counter (its inter-token gaps:
    one less than the tokens of each stream)."""
    m = re.search(r"^wslb_worker_inter_token_latency_seconds_count (\S+)$", w.metrics(), re.M)
    return int(float(m.group(1))) if m else 0


def tcp_queues(port: int) -> tuple[int, int]:
    """For the established loopback connections to ``port``: the bytes its side has queued and
    not yet had acknowledged (``tx_queue``), and the bytes the other side received and has not
    read (``rx_queue``), from ``/proc/net/tcp``."""
    tx = rx = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] != "01":  # ESTABLISHED
            continue
        local, remote = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)
        t, r = (int(x, 16) for x in f[4].split(":"))
        if local == port:
            tx += t
        elif remote == port:
            rx += r
    return tx, rx


async def test_a_full_window_pauses_the_worker_and_the_resume_drains_it(tmp_path: Path) -> None:
    """``resume.buffer: 8KiB`` and an answer of 90,000 tokens from a worker that decodes as
    fast as it can; the client cut while the worker prefills the answer. wslb keeps 8 KiB,
    then stops reading the worker: the bytes wait unread in wslb's socket, the worker's own
    send queue fills, and its token counter stops well short of the answer. The resume
    drains it all: every token once, in order, one ``done``."""
    big = 90_000
    with Procs(tmp_path) as procs:
        args = ["--tokens-per-s", "0", "--prefill-ms-per-token", "1"]
        w = Worker("big", args, procs=procs).start()
        cfg = pool_config(
            [{"id": "big", "url": f"ws://127.0.0.1:{w.port}"}],
            resume={"enabled": True, "grace": "60s", "buffer": "8KiB"},
        )
        lb = Wslb(cfg, tmp_path, procs=procs).start()
        c = Client(lb.url, "full")
        # A first answer read whole: the count the reconnect names is not 1.
        seen = await start_answer(c, 20, 20, text="hi")
        assert (await c.recv())["type"] == "done"
        assert c.ws is not None
        # The second: a 1,000-word prompt is a second of prefill; the client is cut in it.
        prompt = " ".join(f"w{i}" for i in range(1000))
        await c.ws.send(json.dumps({"type": "prompt", "text": prompt, "max_tokens": big}))
        await asyncio.sleep(0.3)
        c.cut()
        last, stalled_at = -1, 0.0
        deadline = time.monotonic() + 40
        while True:  # the worker's counter stops moving (for a whole second)
            await asyncio.sleep(0.5)
            now = worker_tokens(w)
            if now != last:
                last, stalled_at = now, time.monotonic()
            elif now > 20 and time.monotonic() - stalled_at >= 1.0:
                break
            assert time.monotonic() < deadline, f"the worker never stalled ({now} tokens)"
        produced = worker_tokens(w) - 18  # the second answer's: 19 gaps, then n - 1
        assert 1000 < produced < big - 1000, produced  # stopped mid-answer, not at its end
        view = lb.admin("/sessions/full")["resume"]
        # Past ``buffer`` (and its 25% slack) reading stops; the read that crossed it is kept
        # whole (a read is at most 256 KiB).
        assert view["detached"] and 8 * 1024 <= view["window_bytes"] <= 266 * 1024, view
        worker_unacked, wslb_unread = tcp_queues(w.port)
        assert wslb_unread > 0 and worker_unacked > 0, (worker_unacked, wslb_unread)
        assert worker_tokens(w) - 18 == produced  # still stopped
        print(
            f"\nstalled at {produced} of {big} tokens; window {view['window_bytes']} B;"
            f" unread in wslb's socket {wslb_unread} B; unacked at the worker {worker_unacked} B"
        )
        assert metric(lb, "wslb_detached_sessions") == {"": 1}
        await c.open(resume=True)
        assert c.resumed == "22"  # hello, 20 tokens, done
        seen = []
        done = await asyncio.wait_for(rest_of_answer(c, seen, turn=2), 120)
        assert seen == list(range(big))
        assert done["tokens"] == big
        assert worker_tokens(w) - 18 == big
        assert metric(lb, "wslb_resumes_total").get("resumed") == 1
        await c.ws.close()


async def test_a_full_window_is_not_migrated_by_a_drain_and_closes_after_the_resume(
    tmp_path: Path,
) -> None:
    """A drain (migrate true) meets a detached session whose full window stopped its worker
    mid-answer: it cannot be moved without reading past ``buffer``, so it stays put (the
    migration is refused, nothing is closed) until its client is back for the rest; then
    the drain's rule closes it after its answer (1012)."""
    tokens = 20_000
    with Procs(tmp_path) as procs:
        args = ["--tokens-per-s", "0", "--prefill-ms-per-token", "1"]
        ws = [Worker(f"f{i}", args, procs=procs).start() for i in range(2)]
        cfg = pool_config(
            [{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in ws],
            resume={"enabled": True, "grace": "60s", "buffer": "8KiB"},
        )
        lb = Wslb(cfg, tmp_path, procs=procs).start()
        c = Client(lb.url, "fulldrain")
        await c.open()
        assert (await c.recv())["type"] == "hello"
        assert c.ws is not None
        prompt = " ".join(f"w{i}" for i in range(500))
        await c.ws.send(json.dumps({"type": "prompt", "text": prompt, "max_tokens": tokens}))
        await asyncio.sleep(0.2)
        c.cut()  # in the prefill: all 20,000 tokens are still to come

        def window() -> dict[str, Any]:
            return dict(lb.admin("/sessions/fulldrain")["resume"])

        await until(lambda: window()["window_bytes"] > 10 * 1024, what="the window to fill")
        victim = lb.admin("/sessions/fulldrain")["backend"]
        lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "30s"})
        await until(
            lambda: lb.admin(f"/backends/{victim}")["drain"]["migration_failures"] == 1,
            what="the migration to be refused",
        )
        # Negative check: quiet (its worker is not read), yet not closed: mid-answer.
        await asyncio.sleep(1.0)
        drain = lb.admin(f"/backends/{victim}")["drain"]
        assert drain["closed_after_answer"] == drain["closed_at_timeout"] == 0, drain
        assert window()["detached"], window()
        await c.open(resume=True)
        assert c.resumed == "1"
        seen: list[int] = []
        done = await asyncio.wait_for(rest_of_answer(c, seen, quiet=False), 60)
        assert seen == list(range(tokens)) and done["tokens"] == tokens
        with pytest.raises(ConnectionClosed) as closed:  # then the drain's rule: 1012
            await asyncio.wait_for(c.ws.recv(), 10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        drained = await wait_state(lb, victim, "drained")
        assert drained["drain"]["closed_after_answer"] == 1, drained["drain"]


# -- 2. resume during a drain --------------------------------------------------------------------


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Wslb]:
    lb, _ = default_system(tmp_path)
    yield lb
    lb.stop()


async def test_a_session_detached_during_a_migrating_drain_resumes_on_the_new_worker(
    system: Wslb,
) -> None:
    lb = system
    c = Client(lb.url, "dm")
    seen = await start_answer(c, TOKENS, 10)
    c.cut()
    await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 1}, what="the detach")
    victim = lb.admin("/sessions/dm")["backend"]
    lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "20s"})
    drained = await wait_state(lb, victim, "drained")
    assert drained["drain"]["migrated"] == 1, drained["drain"]
    view = lb.admin("/sessions/dm")
    assert view["backend"] != victim and view["resume"]["detached"], view
    await c.open(resume=True)
    assert c.resumed == str(c.count)
    done = await rest_of_answer(c, seen)
    assert seen == list(range(TOKENS)), seen
    assert done["tokens"] == TOKENS and done["worker"] == view["backend"], done
    assert c.ws is not None
    await c.ws.close()


async def test_clients_cut_while_a_migrating_drain_moves_them_resume_every_token(
    system: Wslb,
) -> None:
    """The clients of the drained worker are cut while the drain's migrations run, so a cut
    lands in a migration (the session MIGRATING or HELD): each detaches all the same, moves,
    and resumes with every token once, in order."""
    lb = system
    clients = [Client(lb.url, f"cm{i}") for i in range(24)]
    seen = await asyncio.gather(*(start_answer(c, TOKENS, 3) for c in clients))
    where = {c.sid: lb.admin(f"/sessions/{c.sid}")["backend"] for c in clients}
    victim = Counter(where.values()).most_common(1)[0][0]
    mine = [(c, s) for c, s in zip(clients, seen, strict=True) if where[c.sid] == victim]
    assert len(mine) >= 4, where
    lb.admin_post(f"/backends/{victim}/drain", {"migrate": True, "timeout": "20s"})
    for c, _ in mine:
        c.cut()
        await asyncio.sleep(0.004)
    drained = await wait_state(lb, victim, "drained")
    assert drained["drain"]["migrated"] == len(mine), drained["drain"]
    assert drained["drain"]["migration_failures"] == 0, drained["drain"]
    for c, s in mine:
        view = lb.admin(f"/sessions/{c.sid}")
        assert view["backend"] != victim and view["resume"]["detached"], view
        await c.open(resume=True)
        done = await rest_of_answer(c, s)
        assert s == list(range(TOKENS)), (c.sid, s)
        assert done["tokens"] == TOKENS
    for c, s in zip(clients, seen, strict=True):
        if where[c.sid] != victim:
            await rest_of_answer(c, s)
            assert s == list(range(TOKENS)), (c.sid, s)
        assert c.ws is not None
        await c.ws.close()


async def test_a_session_detached_during_a_closing_drain_is_closed_after_its_answer(
    system: Wslb,
) -> None:
    lb = system
    c = Client(lb.url, "dc")
    await start_answer(c, 60, 10)
    c.cut()
    await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 1}, what="the detach")
    victim = lb.admin("/sessions/dc")["backend"]
    lb.admin_post(f"/backends/{victim}/drain", {"migrate": False, "timeout": "20s"})
    drained = await wait_state(lb, victim, "drained", timeout=15)
    assert drained["drain"]["closed_after_answer"] == 1, drained["drain"]
    assert drained["drain"]["closed_at_timeout"] == 0, drained["drain"]
    assert metric(lb, "wslb_detached_sessions") == {"": 0}
    with pytest.raises(InvalidStatus) as err:
        await c.open(resume=True)
    assert err.value.response.status_code == 409


# -- 3. kill -9 of the worker while the client is away -------------------------------------------


async def test_a_worker_killed_with_two_orphans_of_a_key_saves_the_client_that_is_there(
    system: Wslb,
) -> None:
    """Two clients of key ``dup`` left without a close and never came back (their sessions
    detached), then a third opened a new session with the same key on the same worker, which
    is killed mid-answer. The worker refuses the thaw of a key it holds a connection for, so
    not all three can move; the one whose client is there moves first and streams on whole."""
    lb = system
    # Others first, so the bounded load leaves room for three of one key on one worker.
    others = [Client(lb.url, f"bg{i}") for i in range(30)]
    for o in others:
        await o.open()
        assert (await o.recv())["type"] == "hello"
    orphans = [Client(lb.url, "dup") for _ in range(2)]
    for o in orphans:
        await start_answer(o, TOKENS, 3)
        o.cut()
    await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 2}, what="two detaches")
    c = Client(lb.url, "dup")
    await c.open()
    assert (await c.recv())["type"] == "hello"
    assert c.ws is not None
    await c.ws.send(json.dumps({"type": "prompt", "text": "tell me", "max_tokens": TOKENS}))
    first = await c.recv()
    turn, seen = first["turn"], [first["i"]]  # the key's conversation: its third turn
    while len(seen) < 5:
        seen.append((await c.recv())["i"])
    victim = lb.admin("/sessions/dup")["backend"]
    assert {s["backend"] for s in lb.admin("/sessions") if s["id"] == "dup"} == {victim}
    worker_proc(lb, victim).send_signal(signal.SIGKILL)
    while (msg := await c.recv())["type"] == "token":
        assert msg["turn"] == turn and msg["text"] == token_text("dup", turn, msg["i"]), msg
        seen.append(msg["i"])
    assert seen == list(range(TOKENS)), seen  # every token once, in order, through the kill
    assert msg["type"] == "done" and msg["tokens"] == TOKENS and msg["worker"] != victim, msg
    for cl in (c, *others):
        assert cl.ws is not None
        await cl.ws.close()


async def test_a_worker_killed_while_its_client_is_away_is_failed_over(system: Wslb) -> None:
    lb = system
    c = Client(lb.url, "fk")
    seen = await start_answer(c, TOKENS, 10)
    c.cut()
    await until(lambda: metric(lb, "wslb_detached_sessions") == {"": 1}, what="the detach")
    kept = lb.admin("/sessions/fk")["resume"]["window_bytes"]
    await until(  # the worker streams on into the window
        lambda: lb.admin("/sessions/fk")["resume"]["window_bytes"] > kept, what="more kept"
    )
    victim = lb.admin("/sessions/fk")["backend"]
    worker_proc(lb, victim).send_signal(signal.SIGKILL)
    await until(lambda: failovers(lb)["resumed"] == 1, what="the failover")
    view = lb.admin("/sessions/fk")
    assert view["backend"] != victim and view["resume"]["detached"], view
    await c.open(resume=True)
    assert c.resumed == str(c.count)
    done = await rest_of_answer(c, seen)
    assert seen == list(range(TOKENS)), seen  # every token once, in order
    assert done["tokens"] == TOKENS and done["worker"] == view["backend"], done
    # The conversation goes on on the new worker.
    assert c.ws is not None
    await c.ws.send(json.dumps({"type": "prompt", "text": "more", "max_tokens": 3}))
    kinds = [(await c.recv())["type"] for _ in range(4)]
    assert kinds == ["token", "token", "token", "done"]
    await c.ws.close()


# -- 4. wss://, the relay thread on and off, workers: 2 ----------------------------------------


def transport_stack(
    tmp: Path, procs: Procs, scheme: str, thread: bool, processes: int = 1
) -> tuple[Wslb, str, ssl.SSLContext | None]:
    """Two reference workers (100 tokens/s) behind a resuming wslb: ``ws`` or ``wss``, the
    relay thread on or off, ``processes`` serving processes."""
    ws = [Worker(f"t{i}", ["--tokens-per-s", "100"], procs=procs).start() for i in range(2)]
    cfg = pool_config([{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in ws], resume=RESUME)
    cfg["relay"] = {"thread": thread}
    cfg["workers"] = processes
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    if scheme == "wss":
        certs = make_certs(tmp)
        port = free_port()
        lb = with_listeners(cfg, tmp, tls_listener(port, certs))
        lb.start()
        lb.wait_ready()
        return lb, f"wss://127.0.0.1:{port}", certs.client_ctx()
    lb = Wslb(cfg, tmp, procs=procs).start()
    lb.wait_ready()
    return lb, lb.url, None


@pytest.mark.parametrize(
    ("scheme", "thread"), [("wss", True), ("wss", False), ("ws", True), ("ws", False)]
)
async def test_resume_over_each_transport(tmp_path: Path, scheme: str, thread: bool) -> None:
    """Four sessions cut mid-answer at different points and resumed. With the relay thread
    on and a plain client leg, the thread was relaying each answer when its client was lost
    (it hands the session back to be detached)."""
    with Procs(tmp_path) as procs:
        lb, url, ctx = transport_stack(tmp_path, procs, scheme, thread)
        try:
            clients = [TlsClient(url, f"{scheme}-{thread}-{i}", ctx) for i in range(4)]
            seens = await asyncio.gather(
                *(start_answer(c, 100, 8 + 6 * i) for i, c in enumerate(clients))
            )
            taken = relay_thread(lb)["taken"] if offload.AVAILABLE else 0
            if thread and scheme == "ws" and offload.AVAILABLE:
                assert taken >= 4, relay_thread(lb)  # streaming in the thread at the cut
            else:
                assert taken == 0, relay_thread(lb)  # TLS client legs stay in Python
            await asyncio.gather(
                *(cut_and_resume(c, seen, 100) for c, seen in zip(clients, seens, strict=True))
            )
            assert metric(lb, "wslb_resumes_total").get("resumed") == 4
            for c in clients:
                assert c.ws is not None
                await c.ws.close()
        finally:
            lb.stop()


async def test_resume_with_two_serving_processes(tmp_path: Path) -> None:
    """12 sessions over two serving processes, cut and resumed: SO_REUSEPORT spreads the
    reconnects too (all 12 landing on their own process is a 1 in 4,096 draw), so most land
    on the other process, which must find the session (``aio/handover.py``), not answer 409."""
    with Procs(tmp_path) as procs:
        lb, url, _ = transport_stack(tmp_path, procs, "ws", True, processes=2)
        try:
            clients = [Client(url, f"two-{i}") for i in range(12)]
            seens = await asyncio.gather(*(start_answer(c, 100, 10) for c in clients))
            before = {s["id"]: s["process"] for s in lb.admin("/sessions")}
            assert set(before.values()) == {0, 1}, before
            results = await asyncio.gather(
                *(cut_and_resume(c, seen, 100) for c, seen in zip(clients, seens, strict=True)),
                return_exceptions=True,
            )
            refused = [
                r for r in results if isinstance(r, InvalidStatus) and r.response.status_code == 409
            ]
            assert not refused, f"{len(refused)} of 12 reconnects got 409: {refused[0]!r}"
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            after = {s["id"]: s["process"] for s in lb.admin("/sessions")}
            assert after.keys() == before.keys()
            assert any(after[k] != before[k] for k in before), (before, after)  # handed over
            for c in clients:
                assert c.ws is not None
                await c.ws.close()
        finally:
            lb.stop()


# -- 5. the openai SDK's own reconnect, through a TCP relay that is cut -------------------------


class CutRelay:
    """A TCP forwarder on loopback between a client and ``target``; ``cut`` resets both sides
    of every connection through it (``SO_LINGER`` 0: an RST each way, no close frame), as a
    middlebox losing its state would. It accepts new connections after a cut."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.server: asyncio.Server | None = None
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0

    async def start(self) -> CutRelay:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.accepted += 1
        ur, uw = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target), 5)
        self.pairs.append((cw, uw))
        for r, w in ((cr, uw), (ur, cw)):
            task = asyncio.ensure_future(self._pump(r, w))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    def cut(self) -> None:
        for a, b in self.pairs:
            for w in (a, b):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                w.transport.abort()
        self.pairs.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_the_openai_sdk_reconnects_by_itself_and_resumes(tmp_path: Path) -> None:
    """``client.realtime.connect(extra_headers={token})`` with an ``on_reconnecting`` hook that
    adds the count: the relay is cut mid-response, the SDK reconnects through it, and the
    response goes on: one ``response.done``, every delta once (they join to the done text),
    no second ``session.created``."""
    with Procs(tmp_path) as procs:
        w = Worker("rt", ["--tokens-per-s", "60"], procs=procs).start()
        cfg = pool_config([{"id": "rt", "url": f"ws://127.0.0.1:{w.port}"}], resume=RESUME)
        lb = Wslb(cfg, tmp_path, procs=procs).start()
        relay = await CutRelay(lb.port).start()
        token = "sdk-resume-token-0123456789"
        headers = {"X-WSLB-Resume-Token": token}
        count = 0  # data messages (events) received over all connections
        reconnects: list[int] = []

        def on_reconnecting(event: Any) -> Any:
            reconnects.append(event.close_code)
            return {"extra_headers": {**headers, "X-WSLB-Resume-From": str(count)}}

        types: list[str] = []
        deltas: list[str] = []
        text: str | None = None
        try:
            async with client(relay.port).realtime.connect(
                model="wslb-reference",
                extra_query={"session": "rt-cut"},
                extra_headers=headers,
                on_reconnecting=on_reconnecting,
            ) as conn:

                async def read() -> Any:
                    nonlocal count, text
                    async for event in conn:
                        count += 1
                        types.append(event.type)
                        if event.type == "response.output_text.delta":
                            deltas.append(event.delta)
                            if len(deltas) == 10:
                                relay.cut()
                        elif event.type == "response.output_text.done":
                            text = event.text
                        elif event.type == "response.done":
                            return event
                    return None

                await next_event(conn, "session.created")
                count = 1
                types.append("session.created")
                await say(conn, "a long answer please")
                await conn.response.create(response={"max_output_tokens": 120})
                done = await asyncio.wait_for(read(), 60)
        finally:
            await relay.close()
        assert reconnects == [1006], reconnects  # one reconnect, after an abnormal close
        assert relay.accepted == 2
        assert done is not None and done.response.status == "incomplete"
        assert types.count("response.done") == 1 and types.count("session.created") == 1, types
        assert "error" not in types, types
        assert len(deltas) == 120 and "".join(deltas) == text
        assert metric(lb, "wslb_resumes_total").get("resumed") == 1


# -- 6. the engine bridge in front of a real llama-server ---------------------------------------


def bridge_connections(bridge: BridgeProc) -> int:
    with urllib.request.urlopen(f"{bridge.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^wslb_worker_connections_total (\S+)$", text, re.M)
    assert m is not None, text
    return int(float(m.group(1)))


@pytest.mark.engine
async def test_a_chat_answer_from_llama_server_survives_a_cut(tmp_path: Path) -> None:
    """One llama-server (Gemma 3 270M on the CPU), the engine bridge before it, wslb with
    resume: a chat session cut mid-answer gets the rest of it, every chunk once and in order,
    one ``done``; the bridge never saw the client leave."""
    try:
        llama_server(), gemma_gguf()
    except EngineSetupError as e:
        pytest.skip(f"the engine cannot be made here: {e}")
    with contextlib.ExitStack() as stop:
        engine = LlamaServer(tmp_path / "llama.log", parallel=1, threads=1).start()
        stop.callback(engine.stop)
        bridge = BridgeProc(engine.url, "llama", "--temperature", "0")
        stop.callback(bridge.stop)
        bridge.wait_health(200, timeout=30)
        cfg = pool_config(
            [{"id": bridge.id, "url": f"ws://127.0.0.1:{bridge.port}"}],
            health={"path": "/healthz", "interval": "0.2s", "timeout": "1s"},
            resume=RESUME,
        )
        lb = Wslb(cfg, tmp_path, name="wslb")
        stop.callback(lb.stop)
        lb.start(wait_ready=False)
        lb.wait_ready(timeout=20)
        c = Client(lb.url, "llama-cut")
        await c.open()
        assert (await c.recv())["type"] == "hello"
        assert c.ws is not None
        prompt = {"type": "prompt", "text": STORY, "max_tokens": 120, "temperature": 0}
        await c.ws.send(json.dumps(prompt))
        chunks: list[dict[str, Any]] = []
        while len(chunks) < 10:
            msg = await c.recv()
            assert msg["type"] == "token" and msg["i"] == len(chunks), msg
            chunks.append(msg)
        c.cut()
        await away(lb, "llama-cut")
        await c.open(resume=True)
        assert c.resumed == str(c.count)
        while True:
            msg = await asyncio.wait_for(c.recv(), 60)
            if msg["type"] == "done":
                break
            assert msg["type"] == "token" and msg["i"] == len(chunks), (msg, len(chunks))
            chunks.append(msg)
        assert len(chunks) > 10, "nothing after the resume"
        assert msg["tokens"] == len(chunks) <= 120, (msg, len(chunks))
        assert all(isinstance(m["text"], str) for m in chunks)
        assert bridge_connections(bridge) == 1  # the bridge saw one connection, no reconnect
        # The conversation goes on.
        await c.ws.send(json.dumps({"type": "prompt", "text": "Give it a name.", "max_tokens": 8}))
        while (await asyncio.wait_for(c.recv(), 60))["type"] != "done":
            pass
        await c.ws.close()
