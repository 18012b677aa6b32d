"""The credential wslb shows its workers, and the one it makes for the workers it spawns.

A worker's handoff API hands out a whole conversation and takes one in, and an ``X-WSLB-Resume``
upgrade continues any session thawed there: anyone who can reach the port could otherwise read
or take over every session, bypassing wslb's JWT and Origin checks (and any web page the
operator opens can reach a loopback port). So every request wslb makes to a worker (its
upgrade, freeze, thaw, resumed upgrade) carries a shared secret in ``X-WSLB-Worker-Token``; the
workers wslb ships refuse those routes without it (``backends.auth``). A bearer secret compared
in constant time, not a signature: it travels on the pool's own transport, so a network that
cannot be trusted needs ``wss://`` (or ``https://``) and ``upstream_tls`` (the handoff client
uses them too).

Which secret a backend gets, first that applies:

1. a ``spawn:`` backend: the one this process generated (``spawn_token``), given to the worker
   in its environment; no configuration needed, and nothing else knows it;
2. the pool's ``worker_auth.token``;
3. ``$WSLB_WORKER_TOKEN`` (one credential for every pool);
4. none: the upgrade goes without one (a stock server needs none), and the workers wslb ships
   refuse migration and failover until they are given one.

The secret itself goes only with wslb's own handoff requests (freeze, thaw, the resumed
upgrade); what wslb forwards for a client carries the *proxied* credential made from it
(``balancer.contract.proxied_credential``), which the workers wslb ships accept on plain
upgrades and requests and refuse on their internal routes (``credential_for``).

The generated secret lives in this process's environment (``WSLB_SPAWN_TOKEN``) so that the
serving processes of ``workers: N`` and a hot restart, which inherit it, show the spawned
workers the same one.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
from collections.abc import MutableMapping
from typing import Final

from balancer.config import BackendCfg, PoolCfg
from balancer.contract import proxied_credential

__all__ = [
    "ENV",
    "HEADER",
    "SPAWNED_ENV",
    "SPAWN_ENV",
    "TOKEN_RULE",
    "credential_for",
    "spawn_token",
    "tier_secret",
    "token_for",
    "valid_token",
]

HEADER: Final = "X-WSLB-Worker-Token"
"""The request header that carries the credential (a worker's ``backends.wire`` has its twin)."""
ENV: Final = "WSLB_WORKER_TOKEN"
"""The default credential of pools without ``worker_auth``; also what a worker reads."""
SPAWNED_ENV: Final = "WSLB_WORKER_TOKEN_SPAWNED"
"""Set in a spawned worker's environment beside its credential: the worker's log then says
wslb generated it (``backends.auth.SPAWNED_ENV``)."""
SPAWN_ENV: Final = "WSLB_SPAWN_TOKEN"
"""The generated credential of spawned workers, shared with this process's children."""
TOKEN_RULE: Final = "16-1024 printable ASCII characters, no spaces or commas"
_TOKEN_RE: Final = re.compile(r"[\x21-\x2b\x2d-\x7e]{16,1024}")


def valid_token(token: str) -> bool:
    """``token`` can be a credential: long enough to guess at no rate, safe in a header, and
    without the comma that separates a worker's list of accepted ones."""
    return _TOKEN_RE.fullmatch(token) is not None


def spawn_token(env: MutableMapping[str, str] | None = None) -> str:
    """The credential of the workers this process spawns: generated once (256 random bits),
    then the same for the process and every child that inherits its environment."""
    env = os.environ if env is None else env
    token = env.get(SPAWN_ENV, "")
    if not valid_token(token):
        token = env[SPAWN_ENV] = secrets.token_urlsafe(32)
    return token


def token_for(
    pool: PoolCfg, backend: BackendCfg, env: MutableMapping[str, str] | None = None
) -> str | None:
    """The credential wslb shows ``backend`` of ``pool`` (module docstring), or None.

    ``$WSLB_WORKER_TOKEN`` may list several, comma-separated, as a worker's may during a
    rotation (``new,old``): wslb shows the first.
    """
    env = os.environ if env is None else env
    if backend.spawn is not None:
        return spawn_token(env)
    if pool.worker_auth is not None:
        return pool.worker_auth.token
    default = env.get(ENV, "").split(",")[0].strip()
    return default if valid_token(default) else None


def tier_secret(pool: PoolCfg, env: MutableMapping[str, str] | None = None) -> str | None:
    """The secret the instances of a tier share for ``pool`` (its ``worker_auth.token``, else
    ``$WSLB_WORKER_TOKEN``), or None. A spawn token is each process's own: never shared."""
    env = os.environ if env is None else env
    if pool.worker_auth is not None:
        return pool.worker_auth.token
    default = env.get(ENV, "").split(",")[0].strip()
    return default if valid_token(default) else None


def credential_for(
    pool: PoolCfg,
    backend: BackendCfg,
    *,
    handoff: bool,
    env: MutableMapping[str, str] | None = None,
) -> str | None:
    """What wslb shows ``backend`` on a request: the secret itself on its own ``handoff``
    requests, the proxied credential made from it on a client's (module docstring)."""
    secret = token_for(pool, backend, env)
    if secret is None or handoff:
        return secret
    return _proxied(secret)


@functools.lru_cache(maxsize=64)
def _proxied(secret: str) -> str:
    """One HMAC per secret, not per forwarded request."""
    return proxied_credential(secret)
