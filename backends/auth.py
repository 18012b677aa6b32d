"""Who may use a worker: the credential wslb shows on every request, and the worker's checks.

A worker's handoff API hands out a whole conversation (freeze) and takes one in (thaw), and an
``X-WSLB-Resume`` upgrade continues whatever was thawed: without a check, anyone who can reach
the port reads and takes over every session, past wslb's JWT and Origin checks, and so can any
web page the operator opens (a cross-origin ``fetch`` to a loopback port needs no permission
to be *sent*). So both workers wslb ships (``backends.server``):

- with a credential configured, refuse every WebSocket upgrade and handoff request without it
  (``401``): wslb sends it on all of them (``X-WSLB-Worker-Token``). Two forms of it: the secret
  itself, which wslb sends only on its own freeze, thaw and resumed upgrade, and the *proxied*
  credential made from it (``balancer.contract.proxied_credential``), which wslb sends on what
  it forwards for clients. Plain upgrades and requests take either; the handoff routes and
  resumed upgrades only the secret, so a client request that wslb forwards, whatever its path
  and headers, can never open them;
- with none, accept plain upgrades (the worker alone, in front of a client that knows nothing of
  wslb) but refuse the handoff routes and resumed upgrades (``401``), unless started with
  ``--insecure-handoff`` (tests on a machine of one's own);
- on the handoff routes, always refuse a request with an ``Origin`` (``403``: a browser sent it,
  never wslb) or a body that is not ``application/json`` (``415``: no "simple" cross-origin
  request can have that type).

The credential comes from a file (``--worker-token-file``: one per line, re-read when it
changes, so a rotation needs no restart) or ``$WSLB_WORKER_TOKEN`` (comma-separated), never
from the command line, which ``ps`` shows to every user. Several are accepted at once, for a
rotation: add the new one, move wslb to it, remove the old one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Final

from balancer.contract import proxied_credential

__all__ = ["ENV", "HEADER", "SPAWNED_ENV", "TOKEN_RULE", "WorkerAuth", "parse_tokens"]

log = logging.getLogger("wslb.worker.auth")

HEADER: Final = "X-WSLB-Worker-Token"
"""The request header with wslb's credential (``balancer.workerauth.HEADER``)."""
ENV: Final = "WSLB_WORKER_TOKEN"
SPAWNED_ENV: Final = "WSLB_WORKER_TOKEN_SPAWNED"
"""Set by a wslb that spawned this worker: ``$WSLB_WORKER_TOKEN`` is the credential that wslb
generated for it, not one the user chose (``balancer.workerauth.SPAWNED_ENV``)."""
TOKEN_RULE: Final = "16-1024 printable ASCII characters, no spaces or commas"
_TOKEN_RE: Final = re.compile(r"[\x21-\x2b\x2d-\x7e]{16,1024}")
RECHECK: Final = 1.0
"""Seconds between looks at the token file (a stat; read again only when it changed)."""


def parse_tokens(text: str, where: str) -> tuple[str, ...]:
    """The credentials in ``text``: separated by commas or whitespace (lines of a file; ``#``
    starts a comment).

    Raises:
        ValueError: one breaks ``TOKEN_RULE``, or there is none (naming ``where``, never the
            value: it is a secret).
    """
    tokens: list[str] = []
    for line in text.splitlines():
        for part in line.partition("#")[0].replace(",", " ").split():
            if not _TOKEN_RE.fullmatch(part):
                raise ValueError(f"{where}: a credential must be {TOKEN_RULE}")
            if part not in tokens:
                tokens.append(part)
    if not tokens:
        raise ValueError(f"{where}: no credential in it")
    return tuple(tokens)


def _digests(tokens: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(t.encode("ascii")).digest() for t in tokens)


def _proxied_digests(tokens: tuple[str, ...]) -> tuple[bytes, ...]:
    return _digests(tuple(proxied_credential(t) for t in tokens))


class WorkerAuth:
    """The credentials a worker accepts (module docstring); ``insecure``: the handoff API is
    open to anyone without one (``--insecure-handoff``)."""

    def __init__(
        self, tokens: tuple[str, ...] = (), file: str | None = None, insecure: bool = False
    ) -> None:
        self.file = file
        self.insecure = insecure
        self.spawned = False  # the credential is the one the wslb that spawned us generated
        self._tokens = _digests(tokens)
        self._proxied = _proxied_digests(tokens)
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, size, mtime)
        self._checked = 0.0
        if file is not None:
            self._reload(strict=True)

    @classmethod
    def from_sources(
        cls, file: str | None, env: Mapping[str, str], insecure: bool = False
    ) -> WorkerAuth:
        """The file when given, else ``$WSLB_WORKER_TOKEN`` when set, else none.

        Raises:
            ValueError: the file cannot be read or holds a bad credential, the variable holds
                a bad one, or ``insecure`` is asked for beside a credential.
        """
        raw = env.get(ENV, "")
        if file is None and not raw.strip():
            return cls(insecure=insecure)
        if insecure:
            raise ValueError("--insecure-handoff with a credential configured: drop one of them")
        if file is not None:
            return cls(file=file)
        auth = cls(parse_tokens(raw, f"${ENV}"))
        auth.spawned = bool(env.get(SPAWNED_ENV))
        return auth

    @property
    def configured(self) -> bool:
        return bool(self._tokens)

    def describe(self) -> str:
        """Where the credential comes from, for the start-up log line (never its value)."""
        if self.file is not None:
            return f"credential from {self.file} ({len(self._tokens)} accepted)"
        if self._tokens and self.spawned:
            return "credential generated by the wslb that spawned this worker"
        if self._tokens:
            return f"credential from ${ENV} ({len(self._tokens)} accepted)"
        if self.insecure:
            return "no credential, --insecure-handoff: anyone who reaches the port moves sessions"
        return "no credential: handoff API and resumed upgrades refused (401)"

    def accepts(self, given: str | None, *, handoff: bool) -> bool:
        """``given`` (the header's value) is one of the accepted credentials, in the form the
        request needs (``handoff``: the secret itself; else the secret or its proxied form):
        digests compared in constant time (equal lengths, so not even the length leaks), all of
        them each time."""
        if self.file is not None:
            self._maybe_reload()
        if given is None or not self._tokens:
            return False
        digest = hashlib.sha256(given.strip().encode("utf-8", "replace")).digest()
        ok = False
        for token in self._tokens if handoff else self._tokens + self._proxied:
            ok |= hmac.compare_digest(digest, token)
        return ok

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK:
            return
        self._checked = now
        self._reload(strict=False)

    def _reload(self, strict: bool) -> None:
        """Read the file again if it changed. ``strict``: at start, any problem is an error;
        later a file being rewritten or broken keeps the credentials it had (logged)."""
        assert self.file is not None
        try:
            st = os.stat(self.file)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen == self._seen:
                return
            with open(self.file, encoding="utf-8") as f:
                tokens = parse_tokens(f.read(), self.file)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            if strict:
                raise ValueError(f"--worker-token-file: {exc}") from None
            log.warning("worker credential file unusable, keeping the previous one: %s", exc)
            return
        if self._seen is not None:
            log.info("worker credential file %s changed: %d accepted", self.file, len(tokens))
        self._seen = seen
        self._tokens = _digests(tokens)
        self._proxied = _proxied_digests(tokens)
