"""TLS sessions on every path, streaming (issue 22: a wss:// session died after four frames).

Before the fix ``Session._offload`` handed a session to the relay thread after 4 streamed frames
without asking whether a leg is TLS, and the thread wrote plaintext onto the TLS socket's
descriptor: every wss:// stream broke after its fourth frame. ``tests/test_tls.py`` exchanges one
message per connection, so nothing streamed over TLS. Here every path streams hundreds of frames
with the relay thread on (the default: no ``relay:`` section), through the TLS listener a new user
configures (``listen: [{address, tls: {cert, key}}]``, an ECDSA P-256 certificate), with clients
and servers nobody wrote for wslb: ``websockets`` clients and a stock ``websockets`` server, the
reference workers (chat protocol), headless Chromium, a ``wss://`` worker leg, drain with
migration and crash failover of TLS sessions, and a burst of 500 TLS connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import re
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from backends.model import token_text
from balancer.aio import offload
from tests.browser import browser, require_browser
from tests.procs import Worker, Wslb, free_port, pool_config

FRAMES = 300  # frames per streamed answer: the old bug broke every session after 4
BIG_EVERY = 50  # every 50th frame is larger than a TLS record (16 KiB): it spans records


# -- certificates and listeners -----------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    """A self-signed ECDSA P-256 CA and a certificate for 127.0.0.1, as PEM files."""

    ca: trustme.CA
    cert: Path  # the certificate chain
    key: Path  # its private key
    ca_file: Path  # the CA, for clients and ``upstream_tls.ca``

    def client_ctx(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        return ctx

    def server_ctx(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def make_certs(tmp: Path, name: str = "edge") -> Certs:
    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = tmp / f"{name}.crt", tmp / f"{name}.key", tmp / f"{name}-ca.pem"
    leaf.private_key_pem.write_to_path(str(key))
    with cert.open("wb") as f:
        for pem in leaf.cert_chain_pems:
            f.write(pem.bytes())
    ca.cert_pem.write_to_path(str(ca_file))
    return Certs(ca, cert, key, ca_file)


def tls_listener(port: int, certs: Certs) -> dict[str, Any]:
    """A ``listen`` entry as docs/config.md shows it: the listener speaks wss://."""
    return {"address": f"127.0.0.1:{port}", "tls": {"cert": str(certs.cert), "key": str(certs.key)}}


def with_listeners(cfg: dict[str, Any], tmp: Path, *entries: Any) -> Wslb:
    """A ``Wslb`` listening on ``entries`` (the first is where ``Wslb`` waits for the port)."""
    cfg = {**cfg, "listen": list(entries)}
    lb = Wslb(cfg, tmp)
    first = entries[0]
    addr = first["address"] if isinstance(first, dict) else first
    lb.port = int(addr.rsplit(":", 1)[1])
    return lb


def relay_thread_taken(lb: Wslb) -> int:
    """Sessions handed to the relay thread so far (``wslb_relay_thread_handovers_total``)."""
    m = re.search(
        r'^wslb_relay_thread_handovers_total\{event="taken"\} (\S+)$', lb.admin("/metrics"), re.M
    )
    return int(float(m.group(1))) if m else 0


def tls_failures(lb: Wslb) -> Counter[str]:
    """Failed TLS handshakes on wslb's listeners by reason
    (``wslb_tls_handshake_failures_total``; ``Wslb.start``'s port probes count as some)."""
    out: Counter[str] = Counter()
    for m in re.finditer(
        r'^wslb_tls_handshake_failures_total\{reason="([^"]+)"\} (\S+)$', lb.admin("/metrics"), re.M
    ):
        out[m.group(1)] += int(float(m.group(2)))
    return out


def live_sessions(lb: Wslb) -> int:
    return sum(int(b["sessions"]) for b in lb.admin("/backends"))


async def until(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- a stock token-streaming server (a plain websockets handler, no wslb routes) ----------------


def stock_token(i: int) -> str:
    """Frame ``i`` of a stock stream: short tokens, and every ``BIG_EVERY``-th one 20 KB."""
    if i % BIG_EVERY == BIG_EVERY - 1:
        return f"{i}:" + "x" * 20_000
    return f"{i}:tok{i * 7919 % 1000}"


@dataclass
class StockServer:
    """``{"frames": N, "close": bool}`` -> N text frames, then ``done N``; with ``close`` the
    server closes with 1000 after it. The close code each connection ended with is kept."""

    close_codes: list[int | None]

    async def handler(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                req = json.loads(raw)
                for i in range(int(req["frames"])):
                    await ws.send(stock_token(i))
                await ws.send(f"done {req['frames']}")
                if req.get("close"):
                    await ws.close(1000, "stream over")
        await ws.wait_closed()
        self.close_codes.append(ws.close_code)


@contextlib.asynccontextmanager
async def stock_server(
    ssl_ctx: ssl.SSLContext | None = None,
) -> AsyncIterator[tuple[int, StockServer]]:
    port = free_port()
    app = StockServer([])
    async with serve(app.handler, "127.0.0.1", port, ssl=ssl_ctx, compression=None):
        yield port, app


async def stock_stream(
    url: str, ctx: ssl.SSLContext | None, frames: int, server_closes: bool
) -> int:
    """One session on the stock server: every frame, in order, then a normal close (by the
    server or by this client); returns the close code this client received."""
    async with connect(url, ssl=ctx, open_timeout=20, max_size=2**20) as ws:
        await ws.send(json.dumps({"frames": frames, "close": server_closes}))
        for i in range(frames):
            try:
                got = await asyncio.wait_for(ws.recv(), 20)
            except ConnectionClosed as exc:
                raise AssertionError(f"{url}: the session ended after {i} frames: {exc}") from exc
            assert got == stock_token(i), (url, i, str(got)[:40])
        assert await asyncio.wait_for(ws.recv(), 20) == f"done {frames}"
        if server_closes:
            with pytest.raises(ConnectionClosedOK) as closed:
                await asyncio.wait_for(ws.recv(), 20)
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "stream over")
            return closed.value.rcvd.code
    rcvd = ws.protocol.close_rcvd
    assert rcvd is not None and rcvd.code == 1000, rcvd  # the server's answer to our close
    return rcvd.code


async def test_wss_streams_from_a_stock_websockets_server(tmp_path: Path) -> None:
    """20 wss:// sessions x 300 frames (some spanning TLS records) from a stock server: every
    frame, in order, closed normally by either side; the relay thread is on (plain sessions of
    the same wslb go to it) and takes no TLS session."""
    certs = make_certs(tmp_path)
    tls_port, plain_port = free_port(), free_port()
    async with stock_server() as (sport, app):
        cfg = pool_config([{"id": "stock", "url": f"ws://127.0.0.1:{sport}"}])
        lb = with_listeners(cfg, tmp_path, tls_listener(tls_port, certs), f"127.0.0.1:{plain_port}")
        lb.start()
        try:
            url = f"wss://127.0.0.1:{tls_port}/stream"
            codes = await asyncio.wait_for(
                asyncio.gather(
                    *(stock_stream(url, certs.client_ctx(), FRAMES, n % 2 == 0) for n in range(20))
                ),
                90,
            )
            assert codes == [1000] * 20
            await until(lambda: len(app.close_codes) == 20, what="the server's 20 closes")
            assert app.close_codes == [1000] * 20  # our closes reached the server as sent
            if offload.AVAILABLE:
                # The thread does not speak TLS: a TLS session there breaks (issue 22).
                assert relay_thread_taken(lb) == 0
                plain = f"ws://127.0.0.1:{plain_port}/stream"
                await asyncio.gather(*(stock_stream(plain, None, FRAMES, False) for _ in range(4)))
                assert relay_thread_taken(lb) > 0, "the relay thread is off: nothing is tested"
            await until(lambda: live_sessions(lb) == 0, what="sessions to end")
            assert "Traceback" not in lb.output(), lb.log_tail()
        finally:
            lb.stop()


# -- the reference workers (chat protocol) -------------------------------------------------------


class Chat:
    """One chat-protocol session over wss://: answers checked token by token."""

    def __init__(self, url: str, sid: str, ctx: ssl.SSLContext | None) -> None:
        self.url, self.sid, self.ctx = url, sid, ctx
        self.ws: ClientConnection | None = None
        self.seen = 0  # tokens of the current answer so far
        self.workers: list[str] = []  # the worker that finished each answer
        self.first = ""

    async def open(self) -> None:
        self.ws = await connect(f"{self.url}/ws?session={self.sid}", ssl=self.ctx, open_timeout=20)
        hello = json.loads(await asyncio.wait_for(self.ws.recv(), 20))
        assert hello["type"] == "hello", hello
        self.first = hello["worker"]

    async def turn(self, turn: int, tokens: int) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps({"type": "prompt", "text": f"q{turn}", "max_tokens": tokens}))
        self.seen = 0
        while True:
            try:
                msg = json.loads(await asyncio.wait_for(self.ws.recv(), 20))
            except ConnectionClosed as exc:
                raise AssertionError(f"{self.sid}: closed after {self.seen} tokens: {exc}") from exc
            assert msg["type"] in ("token", "done"), (self.sid, msg)
            assert msg["turn"] == turn, (self.sid, msg)
            if msg["type"] == "done":
                assert msg["tokens"] == tokens == self.seen, (self.sid, msg, self.seen)
                self.workers.append(msg["worker"])
                return
            assert msg["i"] == self.seen, (self.sid, msg, self.seen)
            assert msg["text"] == token_text(self.sid, turn, self.seen), (self.sid, msg)
            self.seen += 1

    async def close(self) -> None:
        """A normal close: 1000 answered with 1000 (the worker's answer, relayed)."""
        assert self.ws is not None
        assert self.ws.close_code is None, (self.sid, self.ws.close_code)  # never closed before
        await self.ws.close()
        rcvd = self.ws.protocol.close_rcvd
        assert rcvd is not None and rcvd.code == 1000, (self.sid, rcvd)


@contextlib.contextmanager
def chat_stack(
    tmp: Path, certs: Certs, workers: int, args: Sequence[str], **pool: Any
) -> Iterator[tuple[Wslb, str, list[Worker]]]:
    """Reference workers behind a wslb whose only listener is a TLS one: (wslb, wss URL,
    workers)."""
    ws = [Worker(f"w{i}", list(args)).start() for i in range(workers)]
    port = free_port()
    cfg = pool_config([{"id": w.id, "url": f"ws://127.0.0.1:{w.port}"} for w in ws], **pool)
    cfg["timeouts"] = {"close": "2s", "shutdown_grace": "0.1s"}
    lb = with_listeners(cfg, tmp, tls_listener(port, certs))
    try:
        lb.start()
        lb.wait_ready()
        yield lb, f"wss://127.0.0.1:{port}", ws
    finally:
        lb.stop()
        for w in ws:
            w.stop()


async def test_wss_streams_long_answers_from_reference_workers(tmp_path: Path) -> None:
    """20 wss:// chat sessions x 2 answers of 300 tokens from 3 reference workers: every token
    once, in order, one ``done`` each, then a normal close."""
    certs = make_certs(tmp_path)
    with chat_stack(tmp_path, certs, 3, ["--tokens-per-s", "1000"]) as (lb, url, _):
        chats = [Chat(url, f"long-{n}", certs.client_ctx()) for n in range(20)]
        await asyncio.wait_for(asyncio.gather(*(c.open() for c in chats)), 30)
        for turn in (1, 2):
            await asyncio.wait_for(asyncio.gather(*(c.turn(turn, FRAMES) for c in chats)), 60)
        await asyncio.gather(*(c.close() for c in chats))
        assert {c.first for c in chats} == {"w0", "w1", "w2"}
        assert all(c.workers == [c.first] * 2 for c in chats)
        await until(lambda: live_sessions(lb) == 0, what="sessions to end")
        if offload.AVAILABLE:
            assert relay_thread_taken(lb) == 0


# -- headless Chromium ---------------------------------------------------------------------------

PAGE_STREAM = """
async ([base, sids, tokens]) => {
  const one = (sid) => new Promise((resolve) => {
    const out = {sid, texts: [], order: true, done: null, hello: null, code: null, clean: null};
    const timer = setTimeout(() => { out.error = "timeout"; resolve(out); }, 45000);
    const ws = new WebSocket(`${base}/ws?session=${sid}`);
    ws.onerror = () => { out.error = "error event"; };
    ws.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg.type === "hello") {
        out.hello = msg.worker;
        ws.send(JSON.stringify({type: "prompt", text: "hi", max_tokens: tokens}));
      } else if (msg.type === "token") {
        if (msg.i !== out.texts.length || msg.turn !== 1) out.order = false;
        out.texts.push(msg.text);
      } else if (msg.type === "done") {
        out.done = msg.tokens;
        ws.close(1000, "thanks");
      }
    };
    ws.onclose = (ev) => {
      clearTimeout(timer);
      out.code = ev.code;
      out.clean = ev.wasClean;
      resolve(out);
    };
  });
  return Promise.all(sids.map(one));
}
"""


async def test_chromium_streams_over_wss(tmp_path: Path) -> None:
    """Headless Chromium opens 5 wss:// sockets through the TLS listener and counts 500 streamed
    messages on each: every token, in order, one ``done``, a clean 1000 close."""
    require_browser()
    certs = make_certs(tmp_path)
    tokens = 500
    with chat_stack(tmp_path, certs, 2, ["--tokens-per-s", "1000"]) as (lb, url, _):
        sids = [f"chromium-{n}" for n in range(5)]
        async with browser() as b:
            # The self-signed certificate: Chromium's first handshake fails (the log shows
            # ``certificate unknown``), Playwright accepts the error and the page connects.
            context = await b.new_context(ignore_https_errors=True)
            try:
                page = await context.new_page()
                # A loopback page: from about:blank Chromium's Local Network Access checks refuse
                # a socket to 127.0.0.1 (ERR_BLOCKED_BY_LOCAL_NETWORK_ACCESS_CHECKS).
                await page.goto(f"http://127.0.0.1:{lb.admin_port}/healthz")
                results = await asyncio.wait_for(
                    page.evaluate(PAGE_STREAM, [url, sids, tokens]), 60
                )
            finally:
                await context.close()
        for r in results:
            sid = r["sid"]
            assert "error" not in r, r.get("error")
            assert r["hello"] in ("w0", "w1"), r["hello"]
            assert r["order"] and r["done"] == tokens, (sid, len(r["texts"]), r["done"])
            assert r["texts"] == [token_text(sid, 1, i) for i in range(tokens)], sid
            assert (r["code"], r["clean"]) == (1000, True), (sid, r["code"], r["clean"])
        await until(lambda: live_sessions(lb) == 0, what="sessions to end")


# -- a wss:// worker leg -------------------------------------------------------------------------


async def test_wss_worker_leg_streams_to_plain_and_tls_clients(tmp_path: Path) -> None:
    """A stock websockets server with TLS behind ``upstream_tls: {ca}``: 50 plain ws:// clients
    and 10 wss:// ones stream 300 frames each, every frame whole and in order (before the fix:
    1014 after 4 frames), normal closes both ways."""
    worker_certs, edge_certs = make_certs(tmp_path, "worker"), make_certs(tmp_path, "edge")
    plain_port, tls_port = free_port(), free_port()
    async with stock_server(worker_certs.server_ctx()) as (wport, app):
        cfg = pool_config(
            [{"id": "tls-worker", "url": f"wss://127.0.0.1:{wport}"}],
            upstream_tls={"ca": str(worker_certs.ca_file)},
        )
        lb = with_listeners(
            cfg, tmp_path, f"127.0.0.1:{plain_port}", tls_listener(tls_port, edge_certs)
        )
        lb.start()
        try:
            streams = [
                stock_stream(f"ws://127.0.0.1:{plain_port}/s", None, FRAMES, n % 2 == 0)
                for n in range(50)
            ]
            streams += [
                stock_stream(
                    f"wss://127.0.0.1:{tls_port}/s", edge_certs.client_ctx(), FRAMES, n % 2 == 0
                )
                for n in range(10)
            ]
            codes = await asyncio.wait_for(asyncio.gather(*streams), 120)
            assert codes == [1000] * 60
            await until(lambda: len(app.close_codes) == 60, what="the server's 60 closes")
            assert app.close_codes == [1000] * 60
            await until(lambda: live_sessions(lb) == 0, what="sessions to end")
            if offload.AVAILABLE:
                assert relay_thread_taken(lb) == 0
        finally:
            lb.stop()


# -- drain with migration, and crash failover, of TLS sessions ----------------------------------


async def test_drain_migrates_tls_sessions_mid_answer(tmp_path: Path) -> None:
    """20 wss:// sessions mid-answer on 4 reference workers; the two busiest are drained with
    migration one after the other: every token once, in order, one ``done`` per answer, no
    close, and the moved sessions end elsewhere."""
    certs = make_certs(tmp_path)
    stack = chat_stack(tmp_path, certs, 4, ["--tokens-per-s", "80"], hash_balance_factor=1.5)
    with stack as (lb, url, _):
        chats = [Chat(url, f"tls-mig-{n}", certs.client_ctx()) for n in range(20)]
        await asyncio.wait_for(asyncio.gather(*(c.open() for c in chats)), 30)

        async def two_turns(c: Chat) -> None:
            await c.turn(1, 120)
            await c.turn(2, 120)

        clients = [asyncio.ensure_future(two_turns(c)) for c in chats]
        await until(lambda: all(c.seen >= 5 for c in chats), what="every answer streaming")
        drained = []
        for _ in range(2):
            live = {b["id"]: b["sessions"] for b in lb.admin("/backends") if b["state"] == "active"}
            bid = max(live, key=lambda k: live[k])
            assert live[bid] > 0, live
            lb.admin_post(f"/backends/{bid}/drain", {"migrate": True, "timeout": "20s"})
            await until(lambda b=bid: lb.admin(f"/backends/{b}")["state"] == "drained", what=bid)
            drained.append(lb.admin(f"/backends/{bid}"))
        await asyncio.wait_for(asyncio.gather(*clients), 60)
        for b in drained:
            d = b["drain"]
            assert d["migrated"] == d["sessions_at_start"] > 0, b
            assert d["closed_at_timeout"] == 0 and d["closed_after_answer"] == 0, b
        gone = {b["id"] for b in drained}
        assert any(c.first in gone for c in chats)
        assert all(c.workers[-1] not in gone for c in chats)
        await asyncio.gather(*(c.close() for c in chats))
        assert 'wslb_migrations_total{result="migrated"}' in lb.admin("/metrics")


def failovers(lb: Wslb) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in re.finditer(
        r'^wslb_failovers_total\{result="(\w+)"\} (\S+)$', lb.admin("/metrics"), re.M
    ):
        out[m.group(1)] += int(float(m.group(2)))
    return out


async def test_crash_failover_of_tls_sessions(tmp_path: Path) -> None:
    """20 wss:// sessions mid-answer; the busiest reference worker is killed with SIGKILL: each
    of its sessions resumes on another worker from the next token, no close, and the
    conversation goes on."""
    certs = make_certs(tmp_path)
    stack = chat_stack(
        tmp_path,
        certs,
        3,
        ["--tokens-per-s", "50"],
        failover={"enabled": True, "journal_limit": "256KiB"},
        health={"interval": "2s", "timeout": "1s", "path": "/healthz"},
    )
    with stack as (lb, url, workers):
        chats = [Chat(url, f"tls-fo-{n}", certs.client_ctx()) for n in range(20)]
        await asyncio.wait_for(asyncio.gather(*(c.open() for c in chats)), 30)
        tasks = [asyncio.ensure_future(c.turn(1, 150)) for c in chats]
        await until(lambda: all(c.seen >= 5 for c in chats), what="every answer streaming")
        live = {b["id"]: b["sessions"] for b in lb.admin("/backends")}
        victim = max(live, key=lambda k: live[k])
        assert live[victim] > 0, live
        next(w for w in workers if w.id == victim).kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(c.workers[-1] != victim for c in chats)
        assert failovers(lb)["resumed"] == live[victim], lb.log_tail()
        await asyncio.wait_for(asyncio.gather(*(c.turn(2, 20) for c in chats)), 30)
        for c in chats:
            view = lb.admin(f"/sessions/{c.sid}")["failover"]
            assert view["failovers"] == (c.first == victim), (c.sid, view)
        await asyncio.gather(*(c.close() for c in chats))


# -- 500 concurrent TLS connects -----------------------------------------------------------------


def _hold_sessions(
    url: str, ca_file: str, n: int, timeout: float, results: Any, release: Any
) -> None:
    """A client process (uvloop): open ``n`` wss:// sessions at once, each to its ``hello``;
    report the statuses and errors, hold them until ``release``, then close them."""
    import uvloop

    async def main() -> None:
        ctx = ssl.create_default_context(cafile=ca_file)

        async def one(k: int) -> ClientConnection:
            ws = await connect(f"{url}?session=burst-{k}", ssl=ctx, open_timeout=timeout)
            hello = json.loads(await asyncio.wait_for(ws.recv(), timeout))
            assert hello["type"] == "hello", hello
            return ws

        outcome = await asyncio.gather(*(one(k) for k in range(n)), return_exceptions=True)
        conns = [ws for ws in outcome if isinstance(ws, ClientConnection)]
        statuses = Counter(ws.response.status_code for ws in conns if ws.response is not None)
        errors = [repr(e) for e in outcome if isinstance(e, BaseException)]
        results.put({"statuses": dict(statuses), "errors": errors[:10], "failed": len(errors)})
        await asyncio.to_thread(release.wait, timeout)
        await asyncio.gather(*(ws.close() for ws in conns), return_exceptions=True)

    uvloop.run(main())


async def test_500_concurrent_tls_connects_all_get_101(tmp_path: Path) -> None:
    """Two uvloop client processes open 250 wss:// sessions each, all at once: all 500 get 101
    and their worker's ``hello``, and are live in wslb together."""
    certs = make_certs(tmp_path)
    procs_n, per_proc = 2, 250
    with chat_stack(tmp_path, certs, 2, []) as (lb, url, _):
        failed_before = tls_failures(lb)
        mp = multiprocessing.get_context("spawn")
        results, release = mp.Queue(), mp.Event()
        clients = [
            mp.Process(
                target=_hold_sessions,
                args=(f"{url}/ws", str(certs.ca_file), per_proc, 30.0, results, release),
                daemon=True,
            )
            for _ in range(procs_n)
        ]
        for p in clients:
            p.start()
        try:
            reports = [await asyncio.to_thread(results.get, True, 60) for _ in clients]
            statuses: Counter[int] = Counter()
            for r in reports:
                assert r["failed"] == 0, r
                statuses.update({int(k): v for k, v in r["statuses"].items()})
            assert statuses == {101: procs_n * per_proc}, statuses
            assert live_sessions(lb) == procs_n * per_proc
            assert tls_failures(lb) == failed_before  # not one handshake failed
        finally:
            release.set()
            for p in clients:
                await asyncio.to_thread(p.join, 30)
                if p.is_alive():
                    p.kill()
        assert [p.exitcode for p in clients] == [0] * procs_n
        await until(lambda: live_sessions(lb) == 0, what="sessions to end")
