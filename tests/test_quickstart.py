"""The README's quick start as a new user runs it: a fresh clone, Debian's own ``python3``.

The Quick start's first command is run exactly as written (``bash -c`` on the README's line:
``python3 -m venv .venv && . .venv/bin/activate && pip install -e . && wslb --config
balancer.yaml``) in a copy of the checkout (tracked and untracked files git does not ignore), so
its ``.venv``, egg-info and C build land there and never in the checkout. ``python3`` on the PATH
is Debian's ``/usr/bin/python3``, which is externally managed on Debian 12 (``pip install``
outside a virtualenv is refused): the virtualenv is what makes the line work. ``python3-venv``
is installed with apt when its ``venv`` module is missing (``tests/installs.py``). pip in the
virtualenv uses the machine's pip configuration (its index, or PyPI); nothing is cached.

Then every command of the "talk to it" block runs with the virtualenv's ``python`` and
``wslb``, as from a second shell that activated it: the chat client must print a streamed
answer to each prompt, ``wslb ctl dashboard`` the dashboard's URL, ``wslb ctl`` must work
without a token flag. SIGINT to wslb must end the line with status 0 and stop its spawned
workers.

What differs from the README: balancer.yaml's ports come from ``WSLB_LISTEN``,
``WSLB_ADMIN_LISTEN`` and ``WSLB_WORKER_PORT1..3``, set here to free loopback ports (so the chat
client gets ``--url`` and ctl ``--admin``); ``WSLB_STATE_DIR`` (where the generated admin token
goes) is a temporary directory; ``WSLB_*``, ``PYTHON*`` and the like are cleared.

The other tests here check that the README's two set-up commands keep their shape and that
``.ci/run`` runs the README's test command.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import pytest

from tests import installs
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


DEBIAN_PYTHON = Path("/usr/bin/python3")


def debian_python() -> tuple[Path, bool]:
    """Debian's own ``python3`` with its ``venv`` module working (``python3-venv`` installed
    with apt when missing), and whether it is externally managed (PEP 668: Debian 12, Ubuntu
    23.04 and later refuse ``pip install`` outside a virtualenv)."""
    if not DEBIAN_PYTHON.exists():
        try:
            installs.apt_install("python3", f"{DEBIAN_PYTHON} is missing")
        except installs.CannotInstall as e:
            pytest.skip(str(e))
    probe = [str(DEBIAN_PYTHON), "-c", "import ensurepip, venv"]
    if subprocess.run(probe, capture_output=True, timeout=60).returncode != 0:
        try:
            installs.apt_install("python3-venv", f"{DEBIAN_PYTHON} has no venv module")
        except installs.CannotInstall as e:
            pytest.skip(str(e))
    stdlib = subprocess.run(
        [str(DEBIAN_PYTHON), "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    return DEBIAN_PYTHON, (Path(stdlib) / "EXTERNALLY-MANAGED").exists()


def checkout_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone would have them plus what is not committed yet
    (tracked and untracked files that git does not ignore), so that the README's ``.venv`` and
    the editable install's build land in the copy, never in the checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        ignore = shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "__pycache__", "*.so", ".*_cache", "build"
        )
        shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
        return dest
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file() or src.is_symlink():  # a tracked file deleted meanwhile is not
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    return dest


def the_wslb(shell: psutil.Process) -> psutil.Process | None:
    """The ``wslb --config`` process the README's line runs (bash's child, or bash itself
    when it ran the line's last command in its place)."""
    for p in [shell, *shell.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            line = p.cmdline()
            worker = any("backends.worker" in a for a in line)
            if "--config" in line and not worker and any(Path(a).name == "wslb" for a in line[:2]):
                return p
    return None


@pytest.mark.slow  # ~1 min: a virtualenv and an install from the index; runs by default (CI)
def test_readme_quick_start_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    """The README's first command, exactly as written, in a copy of the checkout, with
    Debian's externally managed ``python3`` first on the PATH; then its "talk to it" commands,
    as from a second shell with the virtualenv activated: a streamed answer, the dashboard's
    URL and token, ``wslb ctl``; Ctrl-C (SIGINT) stops it with status 0 and its workers."""
    steps, talk = quick_start()
    assert steps[:2] == VENV_STEPS and steps[3][0] == "wslb", steps
    section = README.read_text().split("\n## Quick start\n", 1)[1]
    line = re.findall(r"```sh\n(.*?)```", section, re.S)[0].splitlines()[0]
    python, managed = debian_python()
    print(f"\n[quick start: {python} (externally managed: {managed}): {line}]")

    before = untracked()
    work = checkout_copy(tmp_path / "wslb")
    venv = work / ".venv"
    bin_ = venv / "bin"
    listen, admin, *worker_ports = free_ports(5)
    drop = ("PYTHON", "WSLB_", "PIP_USER", "PIP_TARGET", "PIP_PREFIX", "CONDA_", "PYENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k != "VIRTUAL_ENV"}
    env.update(
        PATH=f"{python.parent}{os.pathsep}/bin{os.pathsep}/usr/sbin{os.pathsep}/sbin",
        PYTHONUNBUFFERED="1",
        WSLB_LISTEN=f"127.0.0.1:{listen}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        WSLB_STATE_DIR=str(tmp_path / "state"),
        **{f"WSLB_WORKER_PORT{i}": str(p) for i, p in enumerate(worker_ports, 1)},
    )
    log_path = tmp_path / "quickstart.log"
    workers: list[psutil.Process] = []
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        shell = subprocess.Popen(
            ["bash", "-c", line],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C at pytest's terminal is not a second signal
        )

    def output() -> str:
        return "\nthe command's output:\n" + log_path.read_text(errors="replace")[-6000:]

    try:
        deadline = time.monotonic() + 240  # the virtualenv, the install, the start
        while (status := upgrade_status(listen)) != 101:
            assert shell.poll() is None, f"the line exited with {shell.returncode}" + output()
            assert time.monotonic() < deadline, f"no 101 on :{listen} (last {status})" + output()
            time.sleep(0.2)
        print(f"[quick start: answering {time.monotonic() - t0:.1f}s after the command]")

        def py(code: str) -> str:
            done = subprocess.run(
                [str(bin_ / "python"), "-c", code], cwd=work, env=env, capture_output=True,
                text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, shown(done)
            return done.stdout.strip()

        where = Path(py("import balancer; print(balancer.__file__)"))
        assert where.resolve().is_relative_to(work.resolve()), where  # editable, in the copy
        base = Path(py("import sys; print(sys.base_prefix)"))
        assert (base / "bin" / python.name).resolve() == python.resolve(), base  # Debian's
        wslb = the_wslb(psutil.Process(shell.pid))
        assert wslb is not None, [p.cmdline() for p in psutil.Process(shell.pid).children()]
        workers = [
            p for p in wslb.children(recursive=True) if "backends.worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 3, [p.cmdline() for p in workers]

        shell_env = dict(env, VIRTUAL_ENV=str(venv), PATH=f"{bin_}{os.pathsep}{env['PATH']}")
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
            done = subprocess.run(
                cmd, cwd=work, env=shell_env, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=90,
            )  # fmt: skip
            assert done.returncode == 0, shown(done) + output()
            if argv[:2] == ["python", CHAT_CLIENT]:  # a streamed answer to every prompt
                prompts = chat_prompts(argv[2:])
                turns = [int(n) for n in re.findall(r"\[turn \d+: (\d+) tokens", done.stdout)]
                assert len(turns) == len(prompts) and all(turns), shown(done)
                assert "[hello: worker=" in done.stdout, shown(done)
            if argv == ["wslb", "ctl", "dashboard"]:
                assert f"dashboard: {admin_url}/ui" in done.stdout, shown(done)
            if argv == ["wslb", "ctl", "backends"]:
                assert all(re.search(rf"^{w}\b", done.stdout, re.M) for w in ("w1", "w2", "w3")), (
                    shown(done)
                )

        wslb.send_signal(signal.SIGINT)
        try:
            code = shell.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("wslb still running 30s after SIGINT" + output())
        assert code == 0, f"the line exited with {code} on SIGINT" + output()
        _, alive = psutil.wait_procs(workers, timeout=10)
        alive = [p for p in alive if _running(p)]
        assert not alive, f"workers left after wslb stopped: {alive}" + output()
    finally:
        if shell.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=10)
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    after = untracked()
    if before is not None and after is not None:
        assert after <= before, f"the test left files in the checkout: {sorted(after - before)}"
    print(f"[quick start: {time.monotonic() - t0:.1f}s in all]")
    shutil.rmtree(work, ignore_errors=True)  # kept only when the test fails


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
