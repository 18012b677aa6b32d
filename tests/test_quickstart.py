"""The README's quick start as a new user runs it, in a fresh virtualenv.

The virtualenv has no system site packages, so it holds only what the README's install command
(``pip install -e .``, read from README.md's Quick start block) brings. Then, from the repository
root, the block's ``wslb --config balancer.yaml`` runs with the virtualenv's ``wslb``, and every
command of the "talk to it" block with the virtualenv's ``python`` and ``wslb``: the chat client
must print an answer to each prompt, ``wslb ctl`` must work without a token flag (wslb generates
one when none is configured and ctl finds it). SIGINT must stop wslb with status 0 and take its
spawned workers with it.

What differs from the README: balancer.yaml's ports come from ``WSLB_LISTEN``,
``WSLB_ADMIN_LISTEN`` and ``WSLB_WORKER_PORT1..3``, set here to free loopback ports (so the chat
client gets ``--url`` and ctl ``--admin``); ``WSLB_STATE_DIR`` (where the generated admin token
goes) is a temporary directory; ``WSLB_ADMIN_TOKEN``, ``PYTHONPATH`` and the like are cleared.

The install uses the machine's pip configuration (index, find-links) and takes ~10 s with a
reachable index, so no wheel cache is kept. An editable install writes ``wslb.egg-info/`` and the
C scanner's ``balancer/_scan*.so`` into the checkout, both git-ignored (the ``.so`` is replaced,
not rewritten in place, so processes that loaded the old one keep working); the test checks that
the install leaves no new untracked file that git does not ignore. Installs into one checkout are
serialized by a lock file, so two test runs on one checkout do not write those files at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import pytest

from tests.procs import ROOT, free_ports

README = ROOT / "README.md"
CHAT_CLIENT = "examples/chat_client.py"


VENV_STEPS = [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]


def split_steps(line: str) -> list[list[str]]:
    """A shell line's commands split at ``&&`` (comments dropped)."""
    steps: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            steps.append([])
        else:
            steps[-1].append(word)
    return steps


def quick_start() -> tuple[list[list[str]], list[list[str]]]:
    """The README's Quick start: the install-and-run command split at ``&&``, and the commands
    of the "talk to it" block (comments dropped)."""
    text = README.read_text()
    assert "\n## Quick start\n" in text, "README.md has no '## Quick start' section"
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "Quick start: expected the install block and the 'talk to it' block"
    steps = split_steps(blocks[0].splitlines()[0])
    talk = [shlex.split(line, comments=True) for line in blocks[1].splitlines()]
    return steps, [argv for argv in talk if argv]


def test_readme_quick_start_is_parsed() -> None:
    """The shape the quick-start test relies on (a README change should fail loudly here)."""
    steps, talk = quick_start()
    assert steps[:2] == VENV_STEPS, steps
    assert [s[:2] for s in steps[2:]] == [["pip", "install"], ["wslb", "--config"]], steps
    assert talk[0][:2] == ["python", CHAT_CLIENT], talk[0]
    assert ["wslb", "ctl", "backends"] in talk
    assert ["wslb", "ctl", "dashboard"] in talk


def readme_test_command() -> list[list[str]]:
    """The README's test command (the Quick start block's second line), split at ``&&``."""
    section = README.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    return split_steps(block.splitlines()[1])


def test_ci_runs_the_readmes_test_command() -> None:
    """The README's test command is a virtualenv, the test install and the suite; ``.ci/run``
    runs the same steps in order (with quieter output, and the sanitizers before the suite)."""
    steps = readme_test_command()
    assert steps[:2] == VENV_STEPS, steps
    assert steps[2:] == [["pip", "install", "-e", ".[test]"], ["python", "-m", "pytest"]], steps
    quiet = {"--quiet", "-q"}
    ci: list[list[str]] = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        for step in split_steps(line):
            if step and step[0] not in ("set", "cd", "tools/sanitize.sh"):
                ci.append([w for w in step if w not in quiet])
    assert ci == steps, ci


def user_env(venv: Path, **extra: str) -> dict[str, str]:
    """This process's environment as a new user's shell with the virtualenv activated has it:
    nothing that points Python elsewhere, no wslb settings but ``extra``."""
    drop = ("PYTHON", "WSLB_", "PIP_USER", "PIP_TARGET", "PIP_PREFIX", "CONDA_PREFIX")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k != "VIRTUAL_ENV"}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@contextlib.contextmanager
def install_lock(timeout: float = 600.0) -> Iterator[None]:
    """Serialize editable installs into this checkout (they write its egg-info and ``.so``)."""
    key = hashlib.sha256(str(ROOT).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"wslb-editable-install-{key}.lock"
    with path.open("a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for over {timeout}s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def untracked() -> set[str] | None:
    """The checkout's untracked files that git does not ignore, None without git.

    Only these: an install writes no tracked file, and others may be editing tracked files of
    this checkout while the test runs."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        return None
    return {line[3:] for line in done.stdout.splitlines() if line.startswith("?? ")}


def run(
    argv: Sequence[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def shown(done: subprocess.CompletedProcess[str]) -> str:
    return f"$ {shlex.join(done.args)}\nexit {done.returncode}\n{done.stdout}{done.stderr}"


def upgrade_status(port: int) -> int | None:
    """The status of a WebSocket handshake on wslb's listener (then a clean close), or None
    when nothing answers yet."""
    request = (
        f"GET /ws?session=quickstart-probe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(request.encode())
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    return None
                head += chunk
            status = int(head.split(b" ", 2)[1])
            if status == 101:
                s.sendall(b"\x88\x80\x00\x00\x00\x00")  # a masked close frame, no payload
            return status
    except (OSError, ValueError, IndexError):
        return None


def chat_url(port: int) -> str:
    """The chat client's default URL (README: no --url), on the test's listener port."""
    source = (ROOT / CHAT_CLIENT).read_text()
    m = re.search(r'"--url",\s*default="([^"]+)"', source)
    assert m, f"{CHAT_CLIENT}: no --url default found"
    parts = urlsplit(m.group(1))
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def chat_prompts(args: Sequence[str]) -> list[str]:
    """The prompts among the chat client's arguments (its options with a value skipped)."""
    prompts, it = [], iter(args)
    for a in it:
        if a in ("--url", "--session", "--max-tokens"):
            next(it, None)
        elif not a.startswith("-"):
            prompts.append(a)
    return prompts


@pytest.mark.slow  # ~20 s: a virtualenv and an install; runs by default (CI)
def test_readme_quick_start_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    steps, talk = quick_start()
    assert steps[:2] == VENV_STEPS, steps
    install, serve = steps[2], steps[3]
    assert install[:2] == ["pip", "install"] and serve[0] == "wslb", steps

    venv = tmp_path / "venv"
    bin_ = venv / "bin"
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=180
    )
    assert made.returncode == 0, shown(made)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()

    listen, admin, *worker_ports = free_ports(5)
    state = tmp_path / "state"
    env = user_env(
        venv,
        WSLB_LISTEN=f"127.0.0.1:{listen}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        WSLB_STATE_DIR=str(state),
        **{f"WSLB_WORKER_PORT{i}": str(p) for i, p in enumerate(worker_ports, 1)},
    )

    # The README's install command, exactly, from the repository root.
    with install_lock():
        before = untracked()
        t0 = time.monotonic()
        installed = run([str(bin_ / "pip"), *install[1:]], user_env(venv), timeout=600)
        install_s = time.monotonic() - t0
        after = untracked()
    print(f"\n[quick start: {shlex.join(install)} took {install_s:.1f}s]")
    assert installed.returncode == 0, shown(installed)
    if before is not None and after is not None:
        assert after <= before, f"the install left files in the checkout: {sorted(after - before)}"
    where = run([str(bin_ / "python"), "-c", "import balancer; print(balancer.__file__)"], env, 60)
    assert where.returncode == 0, shown(where)
    assert Path(where.stdout.strip()).resolve().is_relative_to(ROOT), where.stdout  # editable

    log_path = tmp_path / "wslb.log"
    workers: list[psutil.Process] = []
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(bin_ / "wslb"), *serve[1:]],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C at pytest's terminal is not a second signal
        )

    def wslb_log() -> str:
        return "\nwslb's log:\n" + log_path.read_text(errors="replace")[-6000:]

    try:
        deadline = time.monotonic() + 60
        while (status := upgrade_status(listen)) != 101:
            assert proc.poll() is None, f"wslb exited with {proc.returncode}" + wslb_log()
            assert time.monotonic() < deadline, f"no 101 on :{listen} (last {status})" + wslb_log()
            time.sleep(0.1)
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "backends.worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 3, [p.cmdline() for p in workers]
        assert all(str(venv) in p.cmdline()[0] for p in workers), [p.cmdline() for p in workers]

        admin_url = f"http://127.0.0.1:{admin}"
        for argv in talk:
            if argv[:2] == ["python", CHAT_CLIENT]:
                cmd = [str(bin_ / "python"), CHAT_CLIENT, "--url", chat_url(listen), *argv[2:]]
            elif argv[:2] == ["wslb", "ctl"]:
                cmd = [str(bin_ / "wslb"), "ctl", "--admin", admin_url, *argv[2:]]
            elif argv[0] == "wslb":
                cmd = [str(bin_ / "wslb"), *argv[1:]]
            else:
                pytest.fail(f"README command this test does not know how to run: {argv}")
            done = run(cmd, env, timeout=90)
            assert done.returncode == 0, shown(done) + wslb_log()
            if argv[:2] == ["python", CHAT_CLIENT]:
                prompts = chat_prompts(argv[2:])
                turns = [int(n) for n in re.findall(r"\[turn \d+: (\d+) tokens", done.stdout)]
                assert len(turns) == len(prompts) and all(turns), shown(done)
                assert "[hello: worker=" in done.stdout, shown(done)
            if argv == ["wslb", "ctl", "backends"]:
                assert all(re.search(rf"^{w}\b", done.stdout, re.M) for w in ("w1", "w2", "w3")), (
                    shown(done)
                )

        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("wslb still running 30s after SIGINT" + wslb_log())
        assert code == 0, f"wslb exited with {code} on SIGINT" + wslb_log()
        _, alive = psutil.wait_procs(workers, timeout=10)
        alive = [p for p in alive if _running(p)]
        assert not alive, f"workers left after wslb stopped: {alive}" + wslb_log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    shutil.rmtree(venv, ignore_errors=True)  # kept only when the test fails


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
