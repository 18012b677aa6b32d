"""The admin API's generated token: made at start when none is configured, kept in a file.

An admin API that takes anything from anyone who can reach loopback is reachable from every web
page the operator has open, so wslb never runs one without a token. When ``admin.token`` and
``WSLB_ADMIN_TOKEN`` are both unset it makes a random token at start (as Jupyter does), writes it
to ``admin-<port>.token`` in a directory only its user can enter, and logs the path; ``wslb
ctl`` finds the file by the admin URL's port, so the quick start still needs no flags.

Where the file goes, first that is set: ``$WSLB_STATE_DIR``, ``$XDG_RUNTIME_DIR/wslb`` (a
per-user tmpfs on systemd machines, gone at logout like the process's token), ``~/.local/state/
wslb``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = ["generate", "read", "remove", "state_dir", "token_path"]


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory of generated tokens (module docstring)."""
    env = os.environ if env is None else env
    if env.get("WSLB_STATE_DIR"):
        return Path(env["WSLB_STATE_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "wslb"
    return Path.home() / ".local" / "state" / "wslb"


def token_path(port: int, env: Mapping[str, str] | None = None) -> Path:
    """The file holding the generated token of the admin API on ``port``."""
    return state_dir(env) / f"admin-{port}.token"


def generate(port: int, env: Mapping[str, str] | None = None) -> tuple[str, Path]:
    """Make a token for the admin API on ``port`` and write it where ``read`` finds it.

    The directory is created 0700 and the file 0600 from the start (``O_EXCL`` on a fresh name,
    then an atomic rename), so no other user can read the token at any moment.
    Raises OSError when the directory cannot be written.
    """
    token = secrets.token_urlsafe(32)
    path = token_path(port, env)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token, path


def read(port: int, env: Mapping[str, str] | None = None) -> str | None:
    """The generated token of the admin API on ``port``, or None when there is no file."""
    try:
        return token_path(port, env).read_text().strip() or None
    except OSError:
        return None


def remove(port: int, token: str, env: Mapping[str, str] | None = None) -> None:
    """Delete the token file at shutdown if it still holds ``token`` (not a newer process's)."""
    if read(port, env) == token:
        with contextlib.suppress(OSError):
            token_path(port, env).unlink()
