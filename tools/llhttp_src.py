"""llhttp's C sources for the C modules, fetched at build time, never copied into the repository.

The offload thread (``balancer/_offload.c``: the relay and the lanes) parses HTTP/1.1 with
llhttp (Node's parser, the one httptools and aiohttp build on), not with a parser written here.
Its C sources (``llhttp.c``, ``api.c``, ``http.c``, ``llhttp.h``) come from the ``llhttp``
sdist on PyPI, pinned by version and sha256, and live in the per-user cache, outside the
checkout: ``$WSLB_CACHE_DIR/llhttp/VERSION/src`` (else ``~/.cache/wslb/...``).

The rules (as ``tests/engines.py`` builds llama-server):

- Made under a file lock (``.lock-llhttp-VERSION``: concurrent builds wait for one another) in a
  scratch directory and renamed into place whole, so a ``src`` that exists is complete; an
  interrupted attempt leaves only scratch that the next one removes.
- Trusted only when proven: the sdist's sha256 is the pinned one, and a small C program built
  against the sources with this machine's compiler parses a known request and a known chunked
  response (``PROOF_C``) as they must be read. ``proof.json`` records the sdist's and each file's
  sha256; a cached ``src`` whose files no longer match it is fetched again.
- Anything that fails (no pip, no network, a different sha256, no compiler, a failed proof)
  raises ``Unavailable`` naming the step: setup.py then builds without the modules that need
  llhttp (the pure-Python paths take their place), as it does without a compiler.

``python tools/llhttp_src.py`` prints the proven source directory (tools/sanitize.sh uses it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path

VERSION = "9.3.0.0"  # the PyPI sdist's version: llhttp 9.3.0, its generated C
SDIST = f"llhttp-{VERSION}.tar.gz"
SDIST_SHA256 = "0d989363e7fb6f270b9d49956e7a3945c26778f8c70a166815264309ac6a8295"
FILES = ("llhttp.c", "api.c", "http.c", "llhttp.h")
SOURCES = ("llhttp.c", "api.c", "http.c")
TIMEOUT_S = 300.0

# Proof: a request with a body and a chunked response (an extension, a trailer) read in pieces
# of one byte, as llhttp must read them; prints "ok" and exits 0, else says what differed.
PROOF_C = r"""
#include <stdio.h>
#include <string.h>
#include "llhttp.h"

static char body[64];
static size_t body_len;
static int chunks, complete;
static const char *error;
static unsigned long long sizes;

static int on_body(llhttp_t *p, const char *at, size_t n) {
    (void)p;
    if (body_len + n > sizeof body) return -1;
    memcpy(body + body_len, at, n);
    body_len += n;
    return 0;
}
static int on_chunk_header(llhttp_t *p) { chunks++; sizes += p->content_length; return 0; }
static int on_message_complete(llhttp_t *p) { (void)p; complete++; return 0; }

static int parse(llhttp_type_t type, const char *msg) {
    llhttp_settings_t s;
    llhttp_t p;
    llhttp_settings_init(&s);
    s.on_body = on_body;
    s.on_chunk_header = on_chunk_header;
    s.on_message_complete = on_message_complete;
    llhttp_init(&p, type, &s);
    body_len = 0; chunks = 0; complete = 0; sizes = 0; error = "";
    for (size_t i = 0; msg[i]; i++) {
        if (llhttp_execute(&p, msg + i, 1) != HPE_OK) {
            error = llhttp_get_error_reason(&p);
            return -1;
        }
    }
    return type == HTTP_REQUEST ? (int)llhttp_get_method(&p) : llhttp_get_status_code(&p);
}

int main(void) {
    int m = parse(HTTP_REQUEST, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc");
    if (m != HTTP_POST || complete != 1 || body_len != 3 || memcmp(body, "abc", 3)) {
        printf("request: method %d, %d complete, body %.*s %s\n", m, complete, (int)body_len,
               body, error);
        return 1;
    }
    int st = parse(HTTP_RESPONSE, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  "5;a=b\r\nhello\r\nA\r\n0123456789\r\n0\r\nX: 1\r\n\r\n");
    if (st != 200 || complete != 1 || chunks != 3 || sizes != 15 || body_len != 15
        || memcmp(body, "hello0123456789", 15)) {
        printf("response: status %d, %d complete, %d chunks %s\n", st, complete, chunks, error);
        return 1;
    }
    if (parse(HTTP_RESPONSE, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             "10000000000000000\r\n") != -1) {
        printf("a chunk size past 2^64 was taken\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
"""


class Unavailable(RuntimeError):
    """llhttp's sources could not be fetched or proven here; the message names the step."""


def cache_dir() -> Path:
    """``$WSLB_CACHE_DIR/llhttp``, else ``~/.cache/wslb/llhttp``."""
    env = os.environ.get("WSLB_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "wslb") / "llhttp"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".lock-llhttp-{VERSION}").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(step: str, argv: list[str], **kw: object) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, **kw
        )  # type: ignore[call-overload]
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"llhttp: {step} failed: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise Unavailable(f"llhttp: {step} exited {done.returncode}:\n{tail}")
    return str(done.stdout)


def _download(into: Path) -> Path:
    """The pinned sdist, through pip (its index, proxy and certificates), sha256 checked."""
    # A PEP 517 build runs in an isolated environment whose path hides pip: its own variables
    # are left out, so the interpreter's pip (the one running this install) answers.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "download"]
    argv += ["--no-deps", "--no-binary", ":all:", f"llhttp=={VERSION}", "-d", str(into)]
    _run(f"pip download llhttp=={VERSION}", argv, env=env)
    sdist = into / SDIST
    if not sdist.is_file():
        raise Unavailable(f"llhttp: pip download left no {SDIST} in {into}")
    digest = sha256(sdist)
    if digest != SDIST_SHA256:
        raise Unavailable(f"llhttp: {SDIST} has sha256 {digest}, pinned {SDIST_SHA256}")
    return sdist


def _unpack(sdist: Path, src: Path) -> None:
    """Only the four C files, by name, from the sdist's ``lib/``."""
    src.mkdir()
    with tarfile.open(sdist) as tar:
        for name in FILES:
            member = f"llhttp-{VERSION}/lib/{name}"
            try:
                f = tar.extractfile(member)
            except KeyError:
                f = None
            if f is None:
                raise Unavailable(f"llhttp: {SDIST} has no {member}")
            with f, (src / name).open("wb") as out:
                shutil.copyfileobj(f, out)


def compiler() -> list[str]:
    """The C compiler extensions are built with: ``$CC``, else Python's own."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _prove(src: Path, work: Path) -> None:
    (work / "proof.c").write_text(PROOF_C)
    exe = work / "proof"
    sources = [str(src / name) for name in SOURCES]
    _run(
        "compiling the proof",
        [*compiler(), "-O1", f"-I{src}", str(work / "proof.c"), *sources, "-o", str(exe)],
    )
    out = _run("running the proof", [str(exe)]).strip()
    if out != "ok":
        raise Unavailable(f"llhttp: the proof read the known messages wrong: {out}")


def _record(src: Path) -> dict[str, object]:
    return {
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "files": {name: sha256(src / name) for name in FILES if (src / name).is_file()},
    }


def _record_matches(home: Path) -> bool:
    try:
        record = json.loads((home / "proof.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(record == _record(home / "src"))


def sources() -> Path:
    """The directory with llhttp's proven C sources (fetched and proven once per machine)."""
    cache = cache_dir()
    home = cache / VERSION
    with _locked(cache):
        if (home / "src").is_dir() and _record_matches(home):
            return home / "src"
        home.mkdir(parents=True, exist_ok=True)
        (home / "proof.json").unlink(missing_ok=True)
        shutil.rmtree(home / "src", ignore_errors=True)
        work = home / ".fetch-tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            sdist = _download(work)
            _unpack(sdist, work / "src")
            _prove(work / "src", work)
            staged = work / "proof.json"
            staged.write_text(json.dumps(_record(work / "src"), indent=1) + "\n")
            os.replace(work / "src", home / "src")
            os.replace(staged, home / "proof.json")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return home / "src"


if __name__ == "__main__":
    try:
        print(sources())
    except Unavailable as e:
        sys.exit(str(e))
