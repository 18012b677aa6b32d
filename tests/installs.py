"""What the test suite installs once per machine, each proven before it is trusted.

A fresh CI machine has none of it: Debian packages (Chromium, HAProxy, etcd, curl) come from
apt, the rest into the per-user cache (``cache_dir()``: ``$WSLB_CACHE_DIR`` or
``~/.cache/wslb``, outside the checkout, since CI clones afresh on the same machine). Every
install ends in a proof that the thing runs (``BINARY --version`` exits 0); a failed or broken
install raises ``InstallError`` naming the step and its output, never leaves a half that the
next run would take for whole. Callers skip only where installing is impossible here (no apt,
not root), never when it was tried and failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

APT_TIMEOUT = 900.0


class InstallError(RuntimeError):
    """Installing or proving a tool failed; the message names the step."""


class CannotInstall(InstallError):
    """Missing, and this machine cannot install it (no apt-get, or not root)."""


def cache_dir() -> Path:
    """``$WSLB_CACHE_DIR``, else ``~/.cache/wslb``."""
    env = os.environ.get("WSLB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "wslb"


_PROVEN: dict[str, str] = {}


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def prove(binary: str, args: Sequence[str] = ("--version",), timeout: float = 60.0) -> str:
    """``binary args`` must exit 0: its first output line, else ``InstallError``."""
    try:
        done = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InstallError(f"proving {binary}: {' '.join(args)} failed: {e}") from e
    if done.returncode != 0:
        out = _tail(done.stderr or done.stdout)
        raise InstallError(f"proving {binary}: {' '.join(args)} exited {done.returncode}: {out}")
    return (
        (done.stdout or done.stderr).strip().splitlines()[0] if done.stdout or done.stderr else ""
    )


def _which(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin:/bin")


def apt_install(package: str, why: str) -> None:
    """``apt-get install -y package`` (``apt-get update`` then once more if it fails: a fresh
    machine's package lists may be empty or old). ``why``: what is missing, for the
    ``CannotInstall`` raised where apt cannot run (no apt-get, not root)."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise CannotInstall(f"{why}; install Debian's {package} (apt, as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")

    def apt(*argv: str) -> subprocess.CompletedProcess[str]:
        cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-q", *argv]
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise InstallError(f"apt-get {' '.join(argv)} failed: {e}") from e

    done = apt("install", "-y", package)
    if done.returncode != 0:
        apt("update")
        done = apt("install", "-y", package)
    if done.returncode != 0:
        raise InstallError(
            f"apt-get install {package} failed ({done.returncode}):\n"
            f"{_tail(done.stderr or done.stdout)}"
        )


def apt_binary(
    package: str, binary: str, args: Sequence[str] = ("--version",), after: Sequence[str] = ()
) -> str:
    """The path of ``binary``, proven to run; Debian's ``package`` installed first if it is
    missing (``apt-get update`` then once more if the install fails: a fresh machine's package
    lists may be empty or old). ``after``: a command run once installed (stopping the service
    the package starts). Raises ``CannotInstall`` or ``InstallError``."""
    if binary in _PROVEN:
        return _PROVEN[binary]
    found = _which(binary)
    if found is None:
        apt_install(package, f"{binary} is missing")
        if after:
            subprocess.run(list(after), capture_output=True, timeout=60, check=False)
        found = _which(binary)
        if found is None:
            raise InstallError(f"apt-get installed {package} but no {binary} is on the PATH")
    prove(found, args)
    _PROVEN[binary] = found
    return found
