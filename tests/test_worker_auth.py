"""The credential between wslb and its workers (SPEC section 12), tried as an attacker would.

The attacker knows nothing of wslb: plain ``urllib``, ``websockets``, a web page of another
origin in Chromium. Each attack of issue 23 is refused, and the victim's answer goes on; wslb's
own migration and failover still work, because it shows the credential on every request
(``balancer.workerauth``), spawned workers get a generated one, and the handoff client uses the
pool's ``upstream_tls``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trustme
from aiohttp import web
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

import backends.auth
from backends.auth import WorkerAuth, parse_tokens
from backends.bridge import config_from_args as bridge_config
from backends.model import token_text
from balancer import workerauth
from balancer.aio.spawn import Spawner
from balancer.backend import Backend
from balancer.config import BackendCfg, ConfigError, PoolCfg, WorkerAuthCfg, parse
from balancer.config import build as config_build
from balancer.contract import proxied_credential
from tests.browser import browser, require_browser
from tests.procs import ROOT, WORKER_AUTH, WORKER_TOKEN, Worker, Wslb, free_port, pool_config

TOKENS = 400  # an answer long enough to attack while it streams (5 s at 80 tokens/s)


# -- the credential, sans-I/O ------------------------------------------------------------------


def test_one_rule_one_header_on_both_sides() -> None:
    """wslb's side (``balancer``) and the workers' (``backends``) import nothing of each other;
    their constants must agree."""
    assert workerauth.HEADER == backends.auth.HEADER
    assert workerauth.ENV == backends.auth.ENV == "WSLB_WORKER_TOKEN"
    assert workerauth.SPAWNED_ENV == backends.auth.SPAWNED_ENV
    assert workerauth.TOKEN_RULE == backends.auth.TOKEN_RULE
    patterns = {workerauth._TOKEN_RE.pattern, backends.auth._TOKEN_RE.pattern}
    assert patterns == {config_build._WORKER_TOKEN_RE.pattern}


def test_tokens_from_a_file_or_the_environment() -> None:
    assert parse_tokens("new-token-0123456789, old-token-0123456789\n", "x") == (
        "new-token-0123456789",
        "old-token-0123456789",
    )
    assert parse_tokens("# rotation\nnew-token-0123456789  # since May\n", "x") == (
        "new-token-0123456789",
    )
    for bad in ("", "short", "has space-0123456789 é" + "x" * 20):
        with pytest.raises(ValueError) as exc:
            parse_tokens(bad, "where")
        assert exc.value.args[0].startswith("where: ") and "short" not in exc.value.args[0]
    auth = WorkerAuth.from_sources(None, {"WSLB_WORKER_TOKEN": "aaaaaaaaaaaaaaaa,bbbbbbbbbbbbbbbb"})
    for handoff in (True, False):
        assert auth.accepts("aaaaaaaaaaaaaaaa", handoff=handoff)
        assert auth.accepts("bbbbbbbbbbbbbbbb", handoff=handoff)
        assert not auth.accepts("cccccccccccccccc", handoff=handoff)
        assert not auth.accepts(None, handoff=handoff)
        assert not auth.accepts("aaaaaaaaaaaaaaa", handoff=handoff)
        assert not auth.accepts("", handoff=handoff)
    # The proxied form (what wslb forwards client traffic with) opens plain routes only.
    proxied = proxied_credential("bbbbbbbbbbbbbbbb")
    assert auth.accepts(proxied, handoff=False) and not auth.accepts(proxied, handoff=True)
    assert not auth.accepts(proxied_credential("cccccccccccccccc"), handoff=False)
    none = WorkerAuth.from_sources(None, {"WSLB_WORKER_TOKEN": " "})
    assert not none.configured and not none.accepts("anything", handoff=False)
    with pytest.raises(ValueError, match="insecure-handoff"):
        WorkerAuth.from_sources(None, {"WSLB_WORKER_TOKEN": "a" * 16}, insecure=True)


def test_a_rotation_through_the_file_needs_no_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends.auth, "RECHECK", 0.0)
    path = tmp_path / "token"
    old, new = "old-credential-0123456789", "new-credential-0123456789"
    path.write_text(old + "\n")
    auth = WorkerAuth(file=str(path))

    def accepted(token: str) -> bool:  # as the secret, and in its proxied form
        both = (
            auth.accepts(token, handoff=True),
            auth.accepts(proxied_credential(token), handoff=False),
        )
        assert both[0] == both[1]
        return both[0]

    assert accepted(old) and not accepted(new)
    path.write_text(f"{new}\n{old}\n")  # 1. the workers accept both
    assert accepted(old) and accepted(new)
    path.write_text(new + "\n")  # 3. wslb moved to the new one: the old one goes
    assert accepted(new) and not accepted(old)
    path.write_text("not a credential")  # a broken file keeps what worked (logged)
    assert accepted(new)
    with pytest.raises(ValueError, match="worker-token-file"):
        WorkerAuth(file=str(tmp_path / "missing"))


def test_which_credential_wslb_shows() -> None:
    env: dict[str, str] = {}
    plain = BackendCfg("w", "ws://10.0.0.5:9001")
    spawned = BackendCfg("s", "ws://127.0.0.1:9001", spawn="reference")
    pool = PoolCfg("p", backends=(plain, spawned))
    assert workerauth.token_for(pool, plain, env) is None  # a stock server needs none
    generated = workerauth.token_for(pool, spawned, env)
    assert generated is not None and workerauth.valid_token(generated)
    assert env[workerauth.SPAWN_ENV] == generated == workerauth.token_for(pool, spawned, env)
    env["WSLB_WORKER_TOKEN"] = "from-the-env-0123456789,older-one-0123456789"
    assert workerauth.token_for(pool, plain, env) == "from-the-env-0123456789"
    configured = PoolCfg("p", worker_auth=WorkerAuthCfg("from-the-pool-0123456789"))
    assert workerauth.token_for(configured, plain, env) == "from-the-pool-0123456789"
    assert workerauth.token_for(configured, spawned, env) == generated
    assert "from-the-pool" not in repr(configured)  # configs get printed


def test_worker_auth_and_spawn_args_in_the_config() -> None:
    def errors(pool: dict[str, Any]) -> list[str]:
        base = {"name": "p", "backends": [{"id": "w", "url": "ws://127.0.0.1:9101"}]}
        try:
            parse({"pools": [{**base, **pool}]})
        except ConfigError as exc:
            return exc.errors
        return []

    assert not errors({"worker_auth": {"token": "x" * 32}})
    assert errors({"worker_auth": {"token": ""}}) == [
        "pools[0].worker_auth.token: is empty (is its environment variable set?)"
    ]
    (short,) = errors({"worker_auth": {"token": "s3cret"}})
    assert short.startswith("pools[0].worker_auth.token: must be 16-1024") and "s3cret" not in short
    spawn = {"id": "w", "url": "ws://127.0.0.1:9101", "spawn": "reference"}
    args = [
        "--tokens-per-s",
        "5",
        "--host",
        "0.0.0.0",
        "--port=80",
        "--ho=::",
        "--insecure-handoff",
    ]
    found = errors({"backends": [{**spawn, "args": args}]})
    assert [e.split(":")[0] for e in found] == [
        f"pools[0].backends[0].args[{i}]" for i in (2, 4, 5, 6)
    ], found
    assert "wslb sets --host of a spawned worker itself" in found[0]


def test_a_spawned_worker_gets_its_address_last_and_its_credential_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(workerauth.SPAWN_ENV, "spawned-credential-for-this-test")
    b = Backend(BackendCfg("w", "ws://127.0.0.1:9101", spawn="reference", args=("--x", "1")))
    cmd = Spawner().command(b)
    assert cmd[-8:] == ["--x", "1", "--host", "127.0.0.1", "--port", "9101", "--id", "w"]
    env = Spawner.environment()
    assert env["WSLB_WORKER_TOKEN"] == "spawned-credential-for-this-test"
    assert workerauth.SPAWN_ENV not in env
    assert not any(workerauth.spawn_token() in part for part in cmd)
    # Its start-up log says where the credential really came from: the user set nothing.
    said = WorkerAuth.from_sources(None, env).describe()
    assert "generated by the wslb that spawned this worker" in said and "$" not in said, said
    chosen = WorkerAuth.from_sources(None, {"WSLB_WORKER_TOKEN": "a" * 16}).describe()
    assert chosen.startswith("credential from $WSLB_WORKER_TOKEN"), chosen


def test_the_engine_api_key_is_never_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--engine", "openai", "--engine-url", "http://127.0.0.1:1"]
    done = subprocess.run(
        [sys.executable, "-m", "backends.worker", *base, "--engine-api-key", "sk-visible"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--engine-api-key is refused" in done.stderr and "--engine-api-key-file" in done.stderr
    key = tmp_path / "key"
    key.write_text("sk-from-a-file\n")
    cfg, _ = bridge_config([*base, "--engine-api-key-file", str(key)])
    assert cfg.api_key == "sk-from-a-file"
    monkeypatch.setenv("WSLB_ENGINE_API_KEY", "sk-from-the-env")
    assert bridge_config(base)[0].api_key == "sk-from-the-env"


# -- helpers -------------------------------------------------------------------------------------


def http(url: str, body: bytes = b"{}", headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A POST with plain urllib; the status and the JSON answer."""
    req = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def handoffs(w: Worker, direction: str) -> float:
    for line in w.metrics().splitlines():
        if line.startswith(f'wslb_worker_handoffs_total{{direction="{direction}"}}'):
            return float(line.split()[-1])
    raise AssertionError("wslb_worker_handoffs_total missing")


async def recv(ws: ClientConnection, timeout: float = 20) -> dict[str, Any]:
    obj = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    assert isinstance(obj, dict)
    return obj


async def answer(ws: ClientConnection, sid: str, turn: int, tokens: int) -> dict[str, Any]:
    """The rest of an answer, every token checked (order, count, text); its ``done``."""
    i = 0
    while True:
        msg = await recv(ws)
        if msg["type"] == "done":
            assert msg["tokens"] == i == tokens, (msg, i)
            return msg
        assert msg["type"] == "token" and (msg["turn"], msg["i"]) == (turn, i), msg
        assert msg["text"] == token_text(sid, turn, i)
        i += 1


async def start_answer(lb: Wslb, sid: str, tokens: int = TOKENS) -> ClientConnection:
    ws = await connect(f"{lb.url}/ws?session={sid}")
    assert (await recv(ws))["type"] == "hello"
    await ws.send(
        json.dumps({"type": "prompt", "text": "tell me everything", "max_tokens": tokens})
    )
    first = await recv(ws)
    assert (first["type"], first["i"]) == ("token", 0), first
    return ws


async def rest_of(ws: ClientConnection, sid: str, tokens: int = TOKENS) -> dict[str, Any]:
    """The answer ``start_answer`` began, from its second token."""
    i = 1
    while True:
        msg = await recv(ws)
        if msg["type"] == "done":
            assert msg["tokens"] == i == tokens, (msg, i)
            return msg
        assert (msg["turn"], msg["i"], msg["text"]) == (1, i, token_text(sid, 1, i)), msg
        i += 1


@pytest.fixture
def victim_stack(tmp_path: Path) -> Iterator[tuple[Wslb, Worker]]:
    """wslb in front of one worker; both got the test's credential from ``tests.procs``."""
    w = Worker("victim-w", ["--tokens-per-s", "80"]).start()
    lb = Wslb(pool_config([{"id": w.id, "url": w.url}]), tmp_path).start()
    try:
        yield lb, w
    finally:
        lb.stop()
        w.stop()


# -- attacks on a worker's port ------------------------------------------------------------------


async def test_attacks_on_a_worker_port_are_refused_and_the_victim_goes_on(
    victim_stack: tuple[Wslb, Worker],
) -> None:
    """Issue 23's first attack, each way it was tried: nothing is frozen, thawed or joined,
    and alice's answer goes on to its last token with her context intact."""
    lb, w = victim_stack
    alice = await start_answer(lb, "alice")
    base = f"http://127.0.0.1:{w.port}/wslb/sessions"
    attacks = [
        # The request of the issue: no credential, text/plain, from a web page's origin.
        (
            f"{base}/alice/freeze",
            b"{}",
            {"Content-Type": "text/plain", "Origin": "http://evil.example"},
            403,
        ),
        (f"{base}/alice/freeze", b"{}", {"Content-Type": "text/plain"}, 401),
        (f"{base}/alice/freeze", b"{}", {"Content-Type": "application/json"}, 401),
        (
            f"{base}/alice/freeze",
            b"{}",
            {"Content-Type": "application/json", "X-WSLB-Worker-Token": "guess-" * 4},
            401,
        ),
        # A made-up conversation thawed into a session that is not connected here.
        (
            f"{base}/bob/thaw",
            json.dumps(
                {
                    "state": {
                        "v": 2,
                        "session": "bob",
                        "protocol": "wslb-chat",
                        "messages": [{"role": "user", "content": "wire the money"}],
                        "answer": None,
                        "queued": [],
                    }
                }
            ).encode(),
            {"Content-Type": "application/json"},
            401,
        ),
    ]
    for url, body, headers, status in attacks:
        got, reply = await asyncio.to_thread(http, url, body, headers)
        assert got == status, (url, headers, got, reply)
        assert "state" not in (reply or {})
    # A direct upgrade resuming her session, and a plain one naming it: both 401.
    for headers in ({"X-WSLB-Resume": "alice", "X-Session-Id": "alice"}, {"X-Session-Id": "alice"}):
        with pytest.raises(InvalidStatus) as exc:
            async with connect(f"ws://127.0.0.1:{w.port}/ws", additional_headers=headers):
                pass
        assert exc.value.response.status_code == 401
    with pytest.raises(InvalidStatus):
        async with connect(f"ws://127.0.0.1:{w.port}/ws?session=alice"):
            pass
    assert handoffs(w, "freeze") == handoffs(w, "thaw") == 0
    await rest_of(alice, "alice")
    await alice.send(json.dumps({"type": "prompt", "text": "and then", "max_tokens": 3}))
    done = await answer(alice, "alice", 2, 3)
    assert done["cached_tokens"] > TOKENS  # her conversation, whole, on her worker
    await alice.close()
    assert "Traceback" not in lb.output()


async def test_wslb_itself_still_migrates_with_the_credential(tmp_path: Path) -> None:
    """What the attacker cannot do, wslb does: a drain moves a live answer (freeze, thaw and
    the resumed upgrade carry the credential)."""
    ws_ = [Worker(f"mig-{i}", ["--tokens-per-s", "80"]).start() for i in range(2)]
    lb = Wslb(pool_config([{"id": w.id, "url": w.url} for w in ws_]), tmp_path).start()
    try:
        ws = await start_answer(lb, "carol", 120)
        home = lb.admin("/sessions/carol")["backend"]
        moved = await asyncio.to_thread(lb.admin_post, f"/backends/{home}/drain", {})
        assert moved
        done = await rest_of(ws, "carol", 120)
        assert done["worker"] != home
        await ws.close()
        assert 'wslb_migrations_total{result="migrated"} 1.0' in lb.admin("/metrics")
    finally:
        lb.stop()
        for w in ws_:
            w.stop()


async def test_a_worker_without_a_credential_keeps_its_handoff_api_closed(
    tmp_path: Path,
) -> None:
    """No credential configured: plain upgrades work (a client that knows nothing of wslb),
    the handoff API and resumes get 401 saying how to open them; ``--insecure-handoff`` opens
    them, but still only to JSON without an ``Origin``."""
    closed = Worker("closed", extra_env={"WSLB_WORKER_TOKEN": ""}).start()
    insecure = Worker("insecure", ["--insecure-handoff"], extra_env={"WSLB_WORKER_TOKEN": ""})
    insecure.start()
    try:
        async with connect(f"ws://127.0.0.1:{closed.port}/ws?session=direct") as ws:
            assert (await recv(ws))["type"] == "hello"
        json_ct = {"Content-Type": "application/json"}
        status, body = await asyncio.to_thread(
            http, f"http://127.0.0.1:{closed.port}/wslb/sessions/direct/freeze", b"{}", json_ct
        )
        assert status == 401 and "--worker-token-file" in body["error"], body
        with pytest.raises(InvalidStatus) as exc:
            headers = {"X-WSLB-Resume": "direct"}
            async with connect(f"ws://127.0.0.1:{closed.port}/ws", additional_headers=headers):
                pass
        assert exc.value.response.status_code == 401
        url = f"http://127.0.0.1:{insecure.port}/wslb/sessions/nobody/freeze"
        assert (await asyncio.to_thread(http, url, b"{}", json_ct))[0] == 404  # let through
        evil = {**json_ct, "Origin": "http://evil.example"}
        assert (await asyncio.to_thread(http, url, b"{}", evil))[0] == 403
        assert (await asyncio.to_thread(http, url, b"{}", {"Content-Type": "text/plain"}))[0] == 415
    finally:
        closed.stop()
        insecure.stop()


async def test_deep_json_is_a_400_not_a_500(victim_stack: tuple[Wslb, Worker]) -> None:
    """100k nested arrays (json's parser recurses per level): the admin API and a worker's thaw
    answer 400, with no traceback in either log."""
    lb, w = victim_stack
    deep = b"[" * 100_000 + b"]" * 100_000
    admin = {"Content-Type": "application/json", **lb.auth}
    status, body = await asyncio.to_thread(
        http, f"http://127.0.0.1:{lb.admin_port}/backends", deep, admin
    )
    assert status == 400 and "nested" in body["error"], body
    status, body = await asyncio.to_thread(
        http,
        f"http://127.0.0.1:{w.port}/wslb/sessions/x/thaw",
        deep,
        {"Content-Type": "application/json", **WORKER_AUTH},
    )
    assert status == 400, body
    assert "Traceback" not in lb.output()


async def test_post_backends_cannot_move_a_spawned_worker(
    victim_stack: tuple[Wslb, Worker],
) -> None:
    """``spawn`` args naming ``--host 0.0.0.0`` (a worker on every interface): 400, nothing
    started."""
    lb, _ = victim_stack
    port = free_port()
    body = {
        "id": "sneaky",
        "url": f"ws://127.0.0.1:{port}",
        "spawn": "reference",
        "args": ["--host", "0.0.0.0"],
    }
    status, reply = await asyncio.to_thread(
        http,
        f"http://127.0.0.1:{lb.admin_port}/backends",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **lb.auth},
    )
    assert status == 400 and reply["error"].startswith("args[0]: '--host'"), reply
    assert all(b["id"] != "sneaky" for b in lb.admin("/backends"))
    assert not any("--insecure" in " ".join(p.cmdline()) for p in lb.children())


# -- spawned workers -----------------------------------------------------------------------------


async def test_spawned_workers_get_a_generated_credential(tmp_path: Path) -> None:
    """No configuration at all (no ``worker_auth``, no ``$WSLB_WORKER_TOKEN``): the spawned
    workers refuse a freeze without the credential, even with the test's own, while wslb
    migrates through them; the credential is in no command line."""
    ports = [free_port(), free_port()]
    cfg = pool_config(
        [
            {"id": f"sp{i}", "url": f"ws://127.0.0.1:{p}", "spawn": "reference",
             "args": ["--tokens-per-s", "80"]}
            for i, p in enumerate(ports)
        ]
    )  # fmt: skip
    lb = Wslb(cfg, tmp_path, extra_env={"WSLB_WORKER_TOKEN": ""}).start()
    try:
        lb.wait_ready()
        ws = await start_answer(lb, "dave", 120)
        home = lb.admin("/sessions/dave")["backend"]
        port = ports[int(home[-1])]
        for headers in ({}, WORKER_AUTH):
            status, _ = await asyncio.to_thread(
                http,
                f"http://127.0.0.1:{port}/wslb/sessions/dave/freeze",
                b"{}",
                {"Content-Type": "application/json", **headers},
            )
            assert status == 401
        await asyncio.to_thread(lb.admin_post, f"/backends/{home}/drain", {})
        done = await rest_of(ws, "dave", 120)
        assert done["worker"] != home  # moved by wslb, with the generated credential
        await ws.close()
        kids = lb.children()
        workers = [p for p in kids if "backends.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2
        (generated,) = {p.environ()["WSLB_WORKER_TOKEN"] for p in workers}
        assert workerauth.valid_token(generated) and generated != WORKER_TOKEN
        for p in [psutil.Process(lb.pid), *kids]:
            assert generated not in " ".join(p.cmdline()), p.cmdline()
        assert generated not in lb.output()
    finally:
        lb.stop()


# -- the handoff client uses upstream_tls ----------------------------------------------------------


@contextlib.asynccontextmanager
async def tls_front(ctx: ssl.SSLContext, target: int) -> AsyncIterator[int]:
    """A TLS terminator (client certificate required) in front of a plain worker port."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    try:
        yield port
    finally:
        server.close()


async def test_the_handoff_client_uses_upstream_tls(tmp_path: Path) -> None:
    """Workers behind mTLS with a private CA: the freeze and thaw go over HTTPS with the pool's
    CA and client certificate (they used the system trust and no certificate, so a migration
    to or from a wss:// worker failed)."""
    worker_ca, client_ca = trustme.CA(), trustme.CA()
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    worker_ca.issue_cert("127.0.0.1").configure_cert(sctx)
    client_ca.configure_trust(sctx)
    sctx.verify_mode = ssl.CERT_REQUIRED
    worker_ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    mine = client_ca.issue_cert("wslb")
    mine.cert_chain_pems[0].write_to_path(str(tmp_path / "client.crt"))
    mine.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    plain = [Worker(f"tls-{i}", ["--tokens-per-s", "80"]).start() for i in range(2)]
    try:
        async with tls_front(sctx, plain[0].port) as p0, tls_front(sctx, plain[1].port) as p1:
            cfg = pool_config(
                [
                    {"id": "tls-0", "url": f"wss://127.0.0.1:{p0}"},
                    {"id": "tls-1", "url": f"wss://127.0.0.1:{p1}"},
                ],
                upstream_tls={
                    "ca": str(tmp_path / "ca.pem"),
                    "cert": str(tmp_path / "client.crt"),
                    "key": str(tmp_path / "client.key"),
                },
                weights={"scrape_interval": "10s"},
            )
            lb = Wslb(cfg, tmp_path)
            await asyncio.to_thread(lb.start)
            try:
                ws = await start_answer(lb, "erin", 120)
                home = (await asyncio.to_thread(lb.admin, "/sessions/erin"))["backend"]
                await asyncio.to_thread(lb.admin_post, f"/backends/{home}/drain", {})
                done = await rest_of(ws, "erin", 120)
                assert done["worker"] != home
                await ws.close()
                metrics = await asyncio.to_thread(lb.admin, "/metrics")
                assert 'wslb_migrations_total{result="migrated"} 1.0' in metrics, metrics
            finally:
                await asyncio.to_thread(lb.stop)
    finally:
        for w in plain:
            w.stop()


# -- a web page of another origin ------------------------------------------------------------------

_ATTACK = """async (base) => {
  const out = {};
  const url = base + "/wslb/sessions/alice/freeze";
  try {
    const r = await fetch(url, {method: "POST", mode: "no-cors",
                                headers: {"Content-Type": "text/plain"}, body: "{}"});
    out.simple = r.type;
  } catch (e) { out.simple = "failed"; }
  try {
    const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
                                body: "{}"});
    out.json = r.status;
  } catch (e) { out.json = "failed"; }
  out.ws = await new Promise((done) => {
    const ws = new WebSocket(base.replace("http", "ws") + "/ws?session=alice");
    ws.onopen = () => { ws.close(); done("open"); };
    ws.onerror = () => done("failed");
  });
  return out;
}"""


async def test_a_page_of_another_origin_cannot_freeze_a_session(
    victim_stack: tuple[Wslb, Worker], tmp_path: Path
) -> None:
    """Chromium on a page of another origin (``http://localhost:P``) POSTs to the worker's
    freeze route (a "simple" request, sent without a preflight, and a JSON one) and opens a
    WebSocket naming alice's session: nothing is frozen, the WebSocket is refused, and the same
    page against an ``--insecure-handoff`` worker is refused too (its ``Origin``)."""
    require_browser()
    lb, w = victim_stack
    insecure = Worker("open-w", ["--insecure-handoff"], extra_env={"WSLB_WORKER_TOKEN": ""})
    insecure.start()

    async def cats(request: web.Request) -> web.Response:
        return web.Response(text="<p>cute cats</p>", content_type="text/html")

    page_app = web.Application()
    page_app.router.add_get("/", cats)
    runner = web.AppRunner(page_app)
    await runner.setup()
    page_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", page_port).start()
    try:
        alice = await start_answer(lb, "alice")
        async with connect(
            f"ws://127.0.0.1:{insecure.port}/ws", additional_headers={"X-Session-Id": "alice"}
        ) as direct:
            await recv(direct)
            async with browser() as b:
                page = await (await b.new_context()).new_page()
                await page.goto(f"http://localhost:{page_port}/")
                against_wslbs = await page.evaluate(_ATTACK, f"http://127.0.0.1:{w.port}")
                against_open = await page.evaluate(_ATTACK, f"http://127.0.0.1:{insecure.port}")
            assert against_wslbs["simple"] == "opaque"  # sent: the worker answered 403
            assert against_wslbs["json"] == "failed"  # its preflight failed: never sent
            assert against_wslbs["ws"] == "failed"  # 401: a page cannot send the credential
            assert against_open["json"] == "failed"
            assert handoffs(w, "freeze") == 0 and handoffs(insecure, "freeze") == 0
            await direct.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": 2}))
            await answer(direct, "alice", 1, 2)  # not frozen: it still answers
        await rest_of(alice, "alice")
        await alice.close()
    finally:
        await runner.cleanup()
        insecure.stop()
