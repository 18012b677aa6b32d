"""Run the Autobahn fuzzingclient against wslb and against its echo worker directly, and compare.

The testsuite only runs on Python 2.7 (Twisted 19), so it lives in its own ``pip --target``
directory (``~/.cache/wslb/autobahn``: outside the checkout, so a fresh clone on the same machine,
as CI makes, finds it installed) and runs as a ``python2.7`` subprocess chosen by
``PYENV_VERSION``. The echo worker is a conformant implementation, so the goal is not that every
case passes but that no case ends worse through wslb than against the worker directly. wslb runs
with the config a new user writes (no ``health`` section, a path-less backend URL): the echo
worker is a stock ``websockets`` server with no health route or ``/metrics``.

With ``tls=True`` (``--tls``) the fuzzer speaks ``wss://`` to a TLS listener of wslb (a
self-signed ECDSA P-256 certificate, ``listen: [{address, tls: {cert, key}}]`` as a new user
writes it) and that run is compared with the worker directly in the same way. The testsuite's
pinned dependencies include pyOpenSSL and service_identity, so Twisted's TLS is there; with no
``hostname`` in the spec the fuzzer uses Twisted's ``ClientContextFactory``, which checks no
certificate.

By hand::

    python -m tests.conformance.autobahn [--cases 1.*,2.*] [--out reports/autobahn] [--tls]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from tests.installs import cache_dir
from tests.procs import ROOT, Wslb, free_port, stop, wait_port

PYTHON2 = "python2.7"
PYENV_VERSION = "2.7.18"
PACKAGE = "autobahntestsuite==25.10.1"
# Per user, not per checkout: CI runs each job in a fresh clone on the same machine.
CACHE = cache_dir() / "autobahn"
# Written last into a fully installed tree; the tree only ever appears under its final name by an
# atomic rename, so seeing the marker means a complete install, without any lock.
MARKER = ".wslb-installed"

# Framing (1-7) and limits (10); 9 (performance) is opt-in; 12 and 13 need permessage-deflate,
# which wslb never negotiates.
DEFAULT_CASES = ("1.*", "2.*", "3.*", "4.*", "5.*", "6.*", "7.*", "10.*")
EXCLUDE_CASES = ("12.*", "13.*")

# Autobahn's verdicts, best first. OK, INFORMATIONAL and UNIMPLEMENTED are all passes;
# "FAILED BY CLIENT" (the client, not the server, dropped TCP) is a lesser flaw like NON-STRICT;
# anything else (FAILED, WRONG CODE, UNCLEAN, a missing case) is a failure.
_RANK = {
    "OK": 2,
    "INFORMATIONAL": 2,
    "UNIMPLEMENTED": 2,
    "NON-STRICT": 1,
    "FAILED BY CLIENT": 1,
}
_VERDICTS = ("behavior", "behaviorClose")  # each compared on its own
PASSING = ("OK", "INFORMATIONAL")
# The agent names of wslb's plain listener and of its TLS listener in a run's results.
WSLB_AGENT = "wslb"
TLS_AGENT = "wslb-tls"

Results = dict[str, dict[str, dict[str, Any]]]
"""``index.json``: agent -> case id -> {"behavior", "behaviorClose", "remoteCloseCode", ...}."""


class Python2Missing(RuntimeError):
    """No Python 2.7 interpreter: the suite cannot run here at all."""


class InstallFailed(RuntimeError):
    """pip could not install the testsuite (typically no network)."""


def python2_env() -> dict[str, str]:
    return dict(os.environ, PYENV_VERSION=PYENV_VERSION, PYTHONDONTWRITEBYTECODE="1")


def python2_available() -> bool:
    """Whether ``python2.7`` under pyenv 2.7.18 starts and is a 2.7."""
    try:
        proc = subprocess.run(
            [PYTHON2, "-c", "import sys; sys.exit(sys.version_info[:2] != (2, 7))"],
            env=python2_env(),
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _py2_code(target: Path, code: str) -> list[str]:
    """A ``python2.7 -c`` command with ``target`` as a site dir (zope is a namespace package,
    whose ``.pth`` file only a site dir honours, not a plain ``sys.path`` entry)."""
    return [PYTHON2, "-c", f"import site; site.addsitedir({str(target)!r}); {code}"]


_PROVEN: set[Path] = set()


def _imports(target: Path) -> bool:
    """Whether the testsuite in ``target`` imports (proven once per process before use)."""
    try:
        check = subprocess.run(
            _py2_code(target, "import autobahntestsuite.wstest"),
            env=python2_env(),
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return check.returncode == 0


def installed(target: Path = CACHE) -> bool:
    return (target / MARKER).is_file()


def install(target: Path = CACHE, timeout: float = 900) -> Path:
    """Install the testsuite into ``target`` unless it is already there; return ``target``.

    pip writes into a private sibling directory that is renamed into place once the import works,
    so concurrent installers never see (or leave) a half-written tree: the first rename wins and
    the others discard theirs.
    """
    if installed(target):
        if target in _PROVEN or _imports(target):
            _PROVEN.add(target)
            return target
        # Marked whole once and broken now (a half-deleted tree): installed again, not used.
        shutil.rmtree(target, ignore_errors=True)
    if not python2_available():
        raise Python2Missing(f"{PYTHON2} (PYENV_VERSION={PYENV_VERSION}) is not available")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        pip = [PYTHON2, "-m", "pip", "install", "--disable-pip-version-check"]
        pip += ["--no-warn-script-location", "--target", str(staging), PACKAGE]
        proc = subprocess.run(
            pip, env=python2_env(), capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise InstallFailed(f"pip install {PACKAGE} failed:\n{proc.stdout}\n{proc.stderr}")
        check = subprocess.run(
            _py2_code(staging, "import autobahntestsuite.wstest"),
            env=python2_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check.returncode != 0:
            raise InstallFailed(f"installed {PACKAGE} does not import:\n{check.stderr}")
        (staging / MARKER).write_text(PACKAGE + "\n")
        if target.exists() and not installed(target):
            shutil.rmtree(target, ignore_errors=True)  # a tree from before the marker existed
        with contextlib.suppress(OSError):  # lost the race to another installer: fine
            staging.rename(target)
        if not installed(target):
            raise InstallFailed(f"could not move the install into {target}")
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def fuzzing_spec(
    servers: Mapping[str, str], outdir: Path, cases: Sequence[str] = DEFAULT_CASES
) -> dict[str, Any]:
    """A fuzzingclient spec running ``cases`` against each agent name -> ws:// URL in turn."""
    return {
        "outdir": str(outdir),
        "servers": [{"agent": agent, "url": url} for agent, url in servers.items()],
        "cases": list(cases),
        "exclude-cases": list(EXCLUDE_CASES),
        "exclude-agent-cases": {},
    }


def run_fuzzingclient(
    spec: dict[str, Any], workdir: Path, target: Path = CACHE, timeout: float = 600
) -> Results:
    """Run wstest with ``spec`` (its log goes to ``workdir/wstest.log``) and return index.json."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / "fuzzingclient.json"
    spec_file.write_text(json.dumps(spec, indent=2))
    log = workdir / "wstest.log"
    cmd = _py2_code(target, "from autobahntestsuite.wstest import run; run()")
    cmd += ["-m", "fuzzingclient", "-s", str(spec_file)]
    with log.open("wb") as out:
        proc = subprocess.run(
            cmd,
            cwd=workdir,
            env=python2_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    index = Path(spec["outdir"]) / "index.json"
    if proc.returncode != 0 or not index.is_file():
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"wstest exited with {proc.returncode}, no {index}:\n{tail}")
    results: Results = json.loads(index.read_text())
    return results


def rank(behavior: str | None) -> int:
    return _RANK.get(behavior or "", 0)


def _case_key(case_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in case_id.split(".") if p.isdigit())


@dataclass(frozen=True)
class Difference:
    """One case whose verdicts differ between the baseline agent and the candidate."""

    case: str
    base: dict[str, Any]
    other: dict[str, Any]

    @property
    def worse(self) -> bool:
        if not self.other:
            return True
        return any(rank(self.other.get(k)) < rank(self.base.get(k)) for k in _VERDICTS)

    def __str__(self) -> str:
        def show(r: dict[str, Any]) -> str:
            if not r:
                return "missing"
            return f"{r['behavior']}/{r['behaviorClose']} (close code {r.get('remoteCloseCode')})"

        return f"{self.case}: {show(self.base)} -> {show(self.other)}"


def compare(results: Results, base: str = "direct", other: str = "wslb") -> list[Difference]:
    """Every case whose behavior, behaviorClose or close code differs, in case order."""
    a, b = results.get(base, {}), results.get(other, {})
    diffs = []
    for case in sorted(a.keys() | b.keys(), key=_case_key):
        ra, rb = a.get(case, {}), b.get(case, {})
        fields = (*_VERDICTS, "remoteCloseCode")
        if not ra or not rb or any(ra.get(k) != rb.get(k) for k in fields):
            diffs.append(Difference(case, ra, rb))
    return diffs


def counts(results: Results, agent: str, field: str = "behavior") -> Counter[str]:
    return Counter(r[field] for r in results.get(agent, {}).values())


def passing(results: Results, agent: str) -> int:
    """Cases whose behavior is OK or INFORMATIONAL."""
    return sum(r["behavior"] in PASSING for r in results.get(agent, {}).values())


def summary(results: Results, base: str = "direct", other: str = "wslb") -> str:
    """Verdict counts per agent, then every differing case (worse ones marked)."""
    lines = []
    for field in _VERDICTS:
        names = sorted({n for agent in results for n in counts(results, agent, field)})
        lines.append(f"{field:<16}" + "".join(f"{n:>18}" for n in names))
        for agent in results:
            c = counts(results, agent, field)
            lines.append(f"  {agent:<14}" + "".join(f"{c[n]:>18}" for n in names))
    diffs = compare(results, base, other)
    lines.append(f"{len(diffs)} case(s) differ between {base} and {other}:")
    lines += [f"  {'WORSE ' if d.worse else '      '}{d}" for d in diffs]
    return "\n".join(lines)


def wslb_config(echo_port: int) -> dict[str, Any]:
    """wslb in front of one echo worker, without heartbeat pings (they would be extra frames in
    the fuzzer's transcript) and with limits above case 9's 16 MiB messages. No ``health``
    section and a path-less URL, as a new user writes it: the probe is a TCP connect, and the
    fuzzer's path goes to the worker unchanged."""
    return {
        "pools": [
            {"name": "echo", "backends": [{"id": "echo", "url": f"ws://127.0.0.1:{echo_port}"}]}
        ],
        "limits": {"max_frame_size": "16MiB", "max_message_size": "64MiB"},
        "timeouts": {"ping_interval": "0s", "close": "2s"},
    }


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS listener: its certificate chain, its key and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts ``ca`` (``wait_echo`` checks the certificate)."""
        return ssl.create_default_context(cafile=str(self.ca))


def tls_files(workdir: Path) -> TlsFiles:
    """A fresh self-signed ECDSA P-256 CA and a certificate for 127.0.0.1 it signed, written to
    ``workdir`` (``tls.crt``, ``tls.key``, ``tls-ca.pem``)."""
    import trustme  # a test dependency, as the fuzzer's TLS runs are tests

    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = TlsFiles(workdir / "tls.crt", workdir / "tls.key", workdir / "tls-ca.pem")
    files.cert.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(files.key))
    ca.cert_pem.write_to_path(str(files.ca))
    return files


def wss_url(wslb: Wslb) -> str:
    """The ``wss://`` URL of ``wslb``'s TLS listener (``wslb_in_front`` with ``tls``)."""
    listen = wslb.config["listen"]
    entries = listen if isinstance(listen, list) else [listen]
    for entry in entries:
        if isinstance(entry, dict) and entry.get("tls"):
            return f"wss://{entry['address']}/"
    raise ValueError(f"wslb has no TLS listener: {listen!r}")


def wait_echo(url: str, timeout: float = 20.0, tls: TlsFiles | None = None) -> None:
    """Wait until ``url`` echoes a message: a fuzzer run against a server that is not up yet (or
    a wslb whose backend is not ready) would report every case FAILED instead of the cause.
    A ``wss://`` URL needs ``tls``, whose CA the check trusts."""
    deadline = time.monotonic() + timeout
    ctx = tls.client_context() if tls is not None and url.startswith("wss:") else None
    while True:
        try:
            with connect(url, open_timeout=2, close_timeout=2, compression=None, ssl=ctx) as ws:
                ws.send("ready?")
                if ws.recv(timeout=2) == "ready?":
                    return
                raise RuntimeError(f"{url} answered with something else than the echo")
        except (OSError, TimeoutError, WebSocketException) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} does not echo after {timeout}s: {exc!r}") from exc
        time.sleep(0.1)


@contextlib.contextmanager
def echo_server(log: Path) -> Iterator[int]:
    """``tests.conformance.echo_server`` on a free port, for the duration of the block."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.conformance.echo_server", "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port, proc=proc)
        yield port
    finally:
        stop(proc)


@contextlib.contextmanager
def wslb_in_front(echo_port: int, workdir: Path, tls: TlsFiles | None = None) -> Iterator[Wslb]:
    """wslb in front of the echo worker; with ``tls``, a TLS listener beside the plain one
    (``wss_url``)."""
    cfg = wslb_config(echo_port)
    plain = free_port() if tls is not None else None
    if tls is not None:
        cfg["listen"] = [
            f"127.0.0.1:{plain}",
            {
                "address": f"127.0.0.1:{free_port()}",
                "tls": {"cert": str(tls.cert), "key": str(tls.key)},
            },
        ]
    wslb = Wslb(cfg, workdir)
    if plain is not None:
        wslb.port = plain  # where ``start`` waits and ``url`` points: the plain listener
    wslb.start(wait_ready=False)
    try:
        yield wslb
    finally:
        wslb.stop()


def run_comparison(
    workdir: Path,
    cases: Sequence[str] = DEFAULT_CASES,
    target: Path = CACHE,
    timeout: float = 600,
    tls: bool = False,
) -> Results:
    """Echo worker + wslb in front of it, the fuzzer against both; results by agent name
    (``direct`` and ``wslb``; with ``tls``, ``direct`` and ``wslb-tls``: wss:// to wslb's TLS
    listener)."""
    install(target)
    workdir.mkdir(parents=True, exist_ok=True)
    files = tls_files(workdir) if tls else None
    with (
        echo_server(workdir / "echo.log") as echo_port,
        wslb_in_front(echo_port, workdir, files) as lb,
    ):
        servers = {"direct": f"ws://127.0.0.1:{echo_port}/"}
        if files is not None:
            servers[TLS_AGENT] = wss_url(lb)
        else:
            servers[WSLB_AGENT] = f"{lb.url}/"
        for url in servers.values():
            wait_echo(url, tls=files)
        spec = fuzzing_spec(servers, workdir / "report", cases)
        return run_fuzzingclient(spec, workdir, target, timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Autobahn fuzzingclient: wslb vs. direct.")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated ids")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "autobahn")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--tls", action="store_true", help="wss:// to wslb's TLS listener")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    started = time.monotonic()
    results = run_comparison(out, cases, timeout=args.timeout, tls=args.tls)
    agent = TLS_AGENT if args.tls else WSLB_AGENT
    print(summary(results, other=agent))
    print(f"report: {out / 'report' / 'index.html'} ({time.monotonic() - started:.1f}s)")
    return 1 if any(d.worse for d in compare(results, other=agent)) else 0


if __name__ == "__main__":
    sys.exit(main())
