"""Hot restart (issue 28, SPEC section 14): ``POST /restart``, SIGUSR2 and ``wslb ctl restart``
hand the listeners and every live session to the code installed now, and the pid a supervisor
tracks stays.

Every test runs the repo's ``balancer.yaml`` as a user does (``tests.test_failover``'s
``default_system``: three spawned reference workers), with real clients on loopback; each
answer is checked token by token (every token once, in order, the text the model gives it, one
``done``), and no client sees a close or has to reconnect. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from websockets.exceptions import ConnectionClosed

from balancer.aio import offload
from tests.etcd import Etcd
from tests.procs import ROOT, Procs, Worker, Wslb, free_port
from tests.servers import WORDS
from tests.test_cluster_etcd import cluster_config
from tests.test_failover import default_system, failovers, relay_thread, worker_proc
from tests.test_resume import Client, rest_of_words, stock_system
from tests.test_resume_compose import TlsClient, rest_of_answer, start_answer, transport_stack
from tests.waits import until

TOKENS = 250  # at balancer.yaml's workers' 50 tokens/s: 5 s per answer
N = int(os.environ.get("RESTART_N", "100"))


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its ``SigCgt`` mask, Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def restart(lb: Wslb) -> dict[str, Any]:
    """``POST /restart``; its answer (raises with the body on an error status)."""
    status, body = restart_error(lb)
    assert status == 200, f"{status}: {body}"
    return body


def restart_error(lb: Wslb) -> tuple[int, dict[str, Any]]:
    """``POST /restart``: its status and JSON body, whatever the status."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{lb.admin_port}/restart",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json", **lb.auth},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.loads(exc.read()))


async def stream_through(lb: Wslb, n: int, restarts: int, gap: float) -> list[dict[str, Any]]:
    """``n`` answers streaming, ``restarts`` restarts ``gap`` s apart while they do; each
    answer checked; the restarts' answers."""
    clients = [Client(lb.url, f"r{i}") for i in range(n)]
    seen = await asyncio.gather(*(start_answer(c, TOKENS, 3) for c in clients))
    answers = []
    for k in range(restarts):
        if k:
            await asyncio.sleep(gap)
        answer = await asyncio.to_thread(restart, lb)
        answer["version_after"] = await asyncio.to_thread(lb.admin, "/version")
        answers.append(answer)
    dones = await asyncio.gather(
        *(rest_of_answer(c, s) for c, s in zip(clients, seen, strict=True))
    )
    for c, s, done in zip(clients, seen, dones, strict=True):
        assert s == list(range(TOKENS)), (c.sid, s[:5], len(s))
        assert done["tokens"] == TOKENS
        assert c.ws is not None and c.ws.close_code is None
    for c in clients:
        assert c.ws is not None
        await c.ws.close()
    return answers


@pytest.fixture
def system(tmp_path: Path) -> Any:
    lb, _ = default_system(tmp_path)
    yield lb
    lb.stop()


async def test_answers_stream_through_two_restarts_and_the_tracked_pid_stays(system: Wslb) -> None:
    lb = system
    before = lb.admin("/version")
    assert before["pid"] == lb.pid and before["keeper"] is None
    workers = {p.pid for p in lb.children() if "backends.worker" in " ".join(p.cmdline())}
    answers = await stream_through(lb, N, 2, 2.0)
    versions = [before]
    for a in answers:
        assert a["ok"] is True
        assert a["sessions"]["moved"] == N, a
        assert a["sessions"]["not_moved"] == {}, a
        assert a["sessions"]["adopted"] == N, a
        versions.append(a["version_after"])
    after = lb.admin("/version")
    # The pid a supervisor tracks is alive and is the keeper; the serving code is new.
    assert lb.proc is not None and lb.proc.poll() is None
    assert after["keeper"] == lb.pid and after["pid"] != lb.pid
    starts = [v["started"] for v in versions]
    assert len(set(starts)) == 3, starts
    assert answers[0]["new"]["pid"] == answers[1]["old"]["pid"]
    # The spawned workers kept running (their sessions with them).
    alive = {p.pid for p in psutil.process_iter() if p.pid in workers}
    assert alive == workers
    # The old serving processes are gone within 5 s of their answer.
    deadline = time.monotonic() + 5
    while psutil.pid_exists(answers[1]["old"]["pid"]) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert not psutil.pid_exists(answers[1]["old"]["pid"])
    # Stopping the keeper stops wslb as before: workers too.
    assert lb.stop() == 0
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in workers) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in workers)


async def test_a_restart_during_a_drain_and_with_detached_clients(system: Wslb) -> None:
    """A drain that migrates is handed on with the time it has left and finishes in the new
    code; clients away (cut without a close) resume from the new code."""
    lb = system
    clients = [Client(lb.url, f"d{i}") for i in range(30)]
    seen = await asyncio.gather(*(start_answer(c, TOKENS, 3) for c in clients))
    away = clients[:5]
    for c in away:
        c.cut()
    # Detached before the drain starts (a client lost mid-migration is not detached: Rule 8).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        modes = [v["mode"] for v in lb.admin("/sessions")]
        if modes.count("detached") == len(away):
            break
        await asyncio.sleep(0.05)
    busiest = max(lb.admin("/backends"), key=lambda b: b["sessions"])["id"]
    lb.admin_post(f"/backends/{busiest}/drain", {"migrate": True})
    answer = await asyncio.to_thread(restart, lb)
    assert answer["sessions"]["not_moved"] == {}, answer
    assert answer["sessions"]["moved"] == 30, answer
    for c in away:
        await c.open(resume=True)
        assert c.resumed == str(c.count)
    dones = await asyncio.gather(
        *(rest_of_answer(c, s) for c, s in zip(clients, seen, strict=True))
    )
    for c, s, d in zip(clients, seen, dones, strict=True):
        assert s == list(range(TOKENS)), c.sid
        assert d["tokens"] == TOKENS
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = lb.admin(f"/backends/{busiest}")["state"]
        if state == "drained":
            break
        await asyncio.sleep(0.1)
    assert state == "drained"
    assert lb.admin(f"/backends/{busiest}")["sessions"] == 0


async def test_an_invalid_config_leaves_the_old_code_serving(system: Wslb) -> None:
    lb = system
    before = lb.admin("/version")
    c = Client(lb.url, "bad-config")
    seen = await start_answer(c, TOKENS, 3)
    good = lb.path.read_text()
    cfg = yaml.safe_load(good)
    cfg["pools"][0]["balance"] = "no-such-balance"
    lb.path.write_text(yaml.safe_dump(cfg))
    try:
        status, body = await asyncio.to_thread(restart_error, lb)
    finally:
        lb.path.write_text(good)
    assert status == 500, body
    assert "config" in body["error"] and "pools[0].balance" in body["error"], body
    assert lb.admin("/version") == before
    await rest_of_answer(c, seen)
    assert seen == list(range(TOKENS))
    assert "restart failed (config)" in lb.output()
    # The next restart, with the config fixed, works.
    assert (await asyncio.to_thread(restart, lb))["ok"] is True


async def test_the_new_code_killed_mid_restart_leaves_the_old_code_listening(
    system: Wslb,
) -> None:
    """The new code dies after it took the listeners (SIGKILL, once its admin API answers): the
    restart fails with the reason, and the old code accepts again on every listener, the admin
    API's too; the next restart works."""
    lb = system
    before = lb.admin("/version")
    c = Client(lb.url, "kill-taker")
    await c.open()
    assert (await c.recv())["type"] == "hello"
    restarting = asyncio.create_task(asyncio.to_thread(restart_error, lb))
    taker = 0
    deadline = time.monotonic() + 60
    while not taker and time.monotonic() < deadline and not restarting.done():
        pid = int((await asyncio.to_thread(lb.admin, "/version"))["pid"])
        if pid != before["pid"]:
            taker = pid
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.01)
    assert taker, "the new code's admin API never answered"
    status, body = await restarting
    assert status == 500, body
    assert "restart failed (taker)" in body["error"], body
    # The old code answers on both listeners again, as it was.
    assert lb.admin("/version") == before
    again = Client(lb.url, "after-kill")
    seen = await start_answer(again, 20, 3)
    await rest_of_answer(again, seen)
    assert seen == list(range(20))
    for cl in (c, again):
        if cl.ws is not None:
            await cl.ws.close()
    assert (await asyncio.to_thread(restart, lb))["ok"] is True


async def test_connects_during_restarts_all_succeed_and_signals_restart_too(system: Wslb) -> None:
    """A client dialling in a loop through three restarts (POST, SIGUSR2 to the pid a
    supervisor knows, ``wslb ctl restart``): every connect and handshake succeeds."""
    lb = system
    stop = asyncio.Event()
    results: list[str] = []

    async def dial() -> None:
        n = 0
        while not stop.is_set():
            c = Client(lb.url, f"dial-{n}")
            n += 1
            try:
                await c.open()
                msg = await c.recv()
                results.append("ok" if msg["type"] == "hello" else f"bad {msg}")
                assert c.ws is not None
                await c.ws.close()
            except Exception as exc:  # counted, not raised: the test reports them all
                results.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.005)

    # Operators' changes survive: a backend added and one drained at run time.
    lb.admin_post("/backends", {"id": "w9", "url": f"ws://127.0.0.1:{free_port()}"})
    req = urllib.request.Request(
        f"http://127.0.0.1:{lb.admin_port}/backends/w3/drain",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json", **lb.auth},
    )
    await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=10).close())
    dialer = asyncio.create_task(dial())
    try:
        started = {lb.admin("/version")["started"]}
        await asyncio.to_thread(restart, lb)
        started.add(lb.admin("/version")["started"])
        assert lb.proc is not None
        os.kill(lb.pid, signal.SIGUSR2)  # now the keeper: it passes the signal on
        deadline = time.monotonic() + 30
        newest = ""
        while len(started) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            newest = lb.admin("/version")["started"]
            started.add(newest)
        assert len(started) == 3
        # Once the new code answered, the old never does (it would say a restart is running).
        for _ in range(30):
            assert lb.admin("/version")["started"] == newest
        ctl = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "balancer",
                "ctl",
                "--admin",
                f"127.0.0.1:{lb.admin_port}",
                "restart",
            ],
            env=lb.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ctl.returncode == 0, ctl.stderr
        assert re.search(r"\d+ sessions? moved", ctl.stdout), ctl.stdout
        started.add(lb.admin("/version")["started"])
        assert len(started) == 4
        backends = {b["id"]: b["state"] for b in lb.admin("/backends")}
        assert "w9" in backends and backends["w3"] in ("draining", "drained"), backends
    finally:
        stop.set()
        await dialer
    assert len(results) > 20
    assert [r for r in results if r != "ok"] == []


async def test_an_upgrade_serves_the_new_code(tmp_path: Path) -> None:
    """The package is changed on disk between two restarts (as ``pip install`` of a new
    version does): the second restart's code says the new version."""
    src = tmp_path / "src"
    for part in ("balancer", "backends"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    del cfg["listen"], cfg["admin"]
    ports = [free_port() for _ in range(3)]
    env = {f"WSLB_WORKER_PORT{n + 1}": str(p) for n, p in enumerate(ports)}
    lb = Wslb(cfg, tmp_path, src=src, extra_env=env)
    lb.start()
    try:
        lb.wait_ready(timeout=30)
        c = Client(lb.url, "upgrade")
        seen = await start_answer(c, TOKENS, 3)
        first = await asyncio.to_thread(restart, lb)
        # A new version that does not import: the old code serves on, the reason in the answer.
        broken = src / "balancer" / "aio" / "drain.py"
        good = broken.read_text()
        broken.write_text(good + "\nimport no_such_module_for_wslb\n")
        status, body = await asyncio.to_thread(restart_error, lb)
        broken.write_text(good)
        assert status == 500, body
        assert "restart failed (code)" in body["error"], body
        assert "no_such_module_for_wslb" in body["error"], body
        assert lb.admin("/version")["pid"] == first["new"]["pid"]
        version = src / "balancer" / "version.py"
        version.write_text(
            version.read_text().replace(
                'return importlib.metadata.version("wslb")', 'return "99.0.0+upgrade"'
            )
        )
        second = await asyncio.to_thread(restart, lb)
        assert first["new"]["version"] != "99.0.0+upgrade"
        assert second["new"]["version"] == "99.0.0+upgrade"
        assert lb.admin("/version")["version"] == "99.0.0+upgrade"
        await rest_of_answer(c, seen)
        assert seen == list(range(TOKENS))
    finally:
        lb.stop()


def test_the_keeper_passes_signals_on_and_exits_as_the_serving_process_did() -> None:
    """The keeper alone, its pipe above select's 1024 (an old process with thousands of
    sockets made it): SIGUSR2 reaches the process serving now, a successor announced on the
    pipe is followed, and SIGTERM ends it with the status of the last one."""
    script = r"""
import os, subprocess, sys
r, w = os.pipe()
os.dup2(r, 1500); os.close(r)
os.set_inheritable(1500, True)
handler = (
    "import signal, sys, time; "
    "signal.signal(signal.SIGUSR2, lambda *a: print('usr2', flush=True)); time.sleep(30)"
)
first = subprocess.Popen([sys.executable, "-c", handler])
second = subprocess.Popen([sys.executable, "-c", handler])
os.write(w, f"serving {second.pid}\n".encode())
print(first.pid, second.pid, flush=True)
keeper = ["-m", "balancer.keeper", "--pipe", "1500", "--serving", str(first.pid)]
os.execv(sys.executable, [sys.executable, *keeper])
"""
    keeper = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert keeper.stdout is not None
        first, second = map(int, keeper.stdout.readline().split())
        deadline = time.monotonic() + 30  # everyone's handlers are in (else USR2 kills it)
        while not all(catches(pid, signal.SIGUSR2) for pid in (keeper.pid, first, second)):
            assert keeper.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        keeper.send_signal(signal.SIGUSR2)
        assert keeper.stdout.readline().strip() == "usr2"  # the announced successor's
        os.kill(first, signal.SIGKILL)  # the old one exits: the keeper stays for the new
        deadline = time.monotonic() + 10  # the keeper reaped it (a zombie until then)
        while psutil.pid_exists(first):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        keeper.send_signal(signal.SIGUSR2)  # still there, and still passing signals on
        assert keeper.stdout.readline().strip() == "usr2"
        assert keeper.poll() is None
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(10) == 128 + signal.SIGTERM
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
        if keeper.stdout is not None:
            keeper.stdout.close()


async def test_with_two_serving_processes_each_hands_on_and_the_supervisor_stays(
    tmp_path: Path,
) -> None:
    """``workers: 2``: the supervisor restarts each serving process in turn; its own pid, and
    its spawned workers, stay; answers stream through two restarts, clients away resume."""
    cfg = yaml.safe_load((ROOT / "balancer.yaml").read_text())
    del cfg["listen"], cfg["admin"]
    cfg["workers"] = 2
    ports = [free_port() for _ in range(3)]
    env = {f"WSLB_WORKER_PORT{n + 1}": str(p) for n, p in enumerate(ports)}
    lb = Wslb(cfg, tmp_path, extra_env=env)
    lb.start()
    try:
        lb.wait_ready(timeout=30)
        serving = {p.pid for p in lb.children() if "balancer.aio.serving" in " ".join(p.cmdline())}
        assert len(serving) == 2
        clients = [Client(lb.url, f"m{i}") for i in range(40)]
        seen = await asyncio.gather(*(start_answer(c, TOKENS, 3) for c in clients))
        for c in clients[:4]:
            c.cut()
        answers = []
        for k in range(2):
            if k:
                await asyncio.sleep(2.0)
            answers.append(await asyncio.to_thread(restart, lb))
        for a in answers:
            assert a["sessions"]["moved"] == 40 and a["sessions"]["not_moved"] == {}, a
            assert len(a["new"]) == 2
        for c in clients[:4]:
            await c.open(resume=True)
        dones = await asyncio.gather(
            *(rest_of_answer(c, s) for c, s in zip(clients, seen, strict=True))
        )
        for c, s, d in zip(clients, seen, dones, strict=True):
            assert s == list(range(TOKENS)), c.sid
            assert d["tokens"] == TOKENS
        now = {p.pid for p in lb.children() if "balancer.aio.serving" in " ".join(p.cmdline())}
        assert now == {n["pid"] for n in answers[1]["new"]}
        assert not now & serving
        assert lb.proc is not None and lb.proc.poll() is None
        assert lb.admin("/version")["pid"] == lb.pid  # the supervisor answers, and stays
    finally:
        lb.stop()


@pytest.mark.parametrize("scheme", ["ws", "wss"])
async def test_over_each_transport_with_the_relay_thread(tmp_path: Path, scheme: str) -> None:
    """``ws://`` with the relay thread relaying every answer at the restart: each session is
    handed back first and moves. ``wss://``: a TLS client session cannot move (its crypto state
    is in the old process), so it is closed with 1012 and its client resumes from the new code,
    nothing lost or repeated."""
    with Procs(tmp_path) as procs:
        lb, url, ctx = transport_stack(tmp_path, procs, scheme, True)
        try:
            clients = [TlsClient(url, f"{scheme}-r{i}", ctx) for i in range(6)]
            # wss: the 1012 must come mid-answer, however long the restart takes on a loaded
            # machine (seconds): an answer long enough for that (100 tokens/s).
            tokens = 400 if scheme == "ws" else 1500
            seens = await asyncio.gather(*(start_answer(c, tokens, 5) for c in clients))
            if scheme == "ws" and offload.AVAILABLE:
                await until(lambda: relay_thread(lb)["taken"] >= 6, 10, "all six on the thread")
            answer = await asyncio.to_thread(restart, lb)
            if scheme == "ws":
                assert answer["sessions"]["moved"] == 6, answer
                assert answer["sessions"]["not_moved"] == {}, answer
            else:
                # Detached with a 1012 to the client, then moved without their TLS legs.
                assert answer["sessions"]["resume_asked"] == 6, answer
                assert answer["sessions"]["moved"] == 6, answer
                assert answer["sessions"]["not_moved"] == {}, answer
                for c, seen in zip(clients, seens, strict=True):
                    with pytest.raises(ConnectionClosed) as closed:
                        while True:
                            msg = await c.recv()
                            assert msg["type"] == "token"
                            seen.append(msg["i"])
                    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
                    await c.open(resume=True)
                    assert c.resumed == str(c.count)
            for c, seen in zip(clients, seens, strict=True):
                await rest_of_answer(c, seen)
                assert seen == list(range(tokens)), c.sid
                assert c.ws is not None
                await c.ws.close()
        finally:
            lb.stop()


async def test_a_restart_during_a_failover(system: Wslb) -> None:
    """A worker is killed (``kill -9``) and the restart asked at once: its sessions finish
    their failover first (``FAILING_OVER`` is waited out), then move; every answer completes
    once, in order. The killed worker's process is restarted by the new code, which adopted
    the workers."""
    lb = system
    clients = [Client(lb.url, f"f{i}") for i in range(20)]
    seen = await asyncio.gather(*(start_answer(c, TOKENS, 3) for c in clients))
    victim = max(lb.admin("/backends"), key=lambda b: b["sessions"])["id"]
    worker_proc(lb, victim).kill()
    answer = await asyncio.to_thread(restart, lb)
    assert answer["sessions"]["not_moved"] == {}, answer
    dones = await asyncio.gather(
        *(rest_of_answer(c, s) for c, s in zip(clients, seen, strict=True))
    )
    for c, s, d in zip(clients, seen, dones, strict=True):
        assert s == list(range(TOKENS)), c.sid
        assert d["tokens"] == TOKENS
    assert sum(failovers(lb).values()) > 0 or "resumed on" in lb.output()
    deadline = time.monotonic() + 20
    while lb.admin(f"/backends/{victim}")["state"] != "active" and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert lb.admin(f"/backends/{victim}")["state"] == "active"


async def test_a_cluster_instance_keeps_its_place(tmp_path: Path) -> None:
    """Cluster mode over a real etcd: after a restart the instance is the same one (its id,
    its drain reports), not a second instance with the first one's keys expiring."""
    etcd = Etcd(tmp_path / "etcd").start()
    workers = [Worker(f"w{i}", ["--tokens-per-s", "80"]).start() for i in range(2)]
    resume = {"enabled": True, "grace": "30s", "buffer": "1MiB"}
    lb = Wslb(cluster_config(etcd, workers, resume=resume), tmp_path)
    try:
        lb.start()
        lb.wait_ready()
        deadline = time.monotonic() + 10
        while not lb.admin("/readyz")["cluster"]["instances"] and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        before = lb.admin("/readyz")["cluster"]["instances"]
        assert len(before) == 1
        c = Client(lb.url, "cluster-restart")
        seen = await start_answer(c, 200, 3)
        answer = await asyncio.to_thread(restart, lb)
        assert answer["sessions"]["moved"] == 1, answer
        await rest_of_answer(c, seen)
        assert seen == list(range(200))
        await asyncio.sleep(1.0)  # past the old process's exit and lease revocation
        after = lb.admin("/readyz")["cluster"]["instances"]
        deadline = time.monotonic() + 10
        while after != before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = lb.admin("/readyz")["cluster"]["instances"]
        assert after == before
    finally:
        lb.stop()
        for w in workers:
            w.stop()
        etcd.stop()


async def test_a_stock_fastapi_apps_answer_streams_through_a_restart(tmp_path: Path) -> None:
    """In front of a server nobody wrote for wslb (the article's FastAPI app under uvicorn's
    CLI), with a new user's config: an answer streaming word by word through a restart arrives
    whole, on the same client connection."""
    with Procs(tmp_path) as procs:
        lb = stock_system(tmp_path, procs, "article", "/ws/chat")
        c = Client(lb.url, "fa-restart", path="/ws/chat")
        await c.open()
        assert c.ws is not None
        await c.ws.send("hello")
        words = [(await c.recv())["text"] for _ in range(2)]
        answer = await asyncio.to_thread(restart, lb)
        assert answer["sessions"]["moved"] == 1, answer
        await rest_of_words(c, words)
        assert words == list(WORDS)
        assert c.ws.close_code is None
        await c.ws.close()


def test_restart_refuses_a_caller_without_the_admin_token_and_a_cross_origin_page(
    system: Wslb,
) -> None:
    """``POST /restart`` as an attacker would send it: no token, a wrong one, and a page of
    another origin with the right one (a browser's CSRF). Each is refused and nothing
    restarts."""
    lb = system
    before = lb.admin("/version")
    url = f"http://127.0.0.1:{lb.admin_port}/restart"
    attempts = [
        {"Content-Type": "application/json"},
        {"Content-Type": "application/json", "Authorization": "Bearer not-the-token-at-all"},
        {"Content-Type": "application/json", "Origin": "http://evil.example", **lb.auth},
        {"Content-Type": "text/plain", **lb.auth},  # a form a page may post without CORS
    ]
    for headers in attempts:
        req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code in (401, 403, 415), (headers, refused.value.code)
        refused.value.close()
    assert lb.admin("/version") == before
