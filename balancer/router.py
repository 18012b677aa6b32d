"""The router: where a request goes, for a WebSocket upgrade and a plain HTTP request alike.

Both entrances call it: ``aio/proxy.py`` for an upgrade, ``aio/httpproxy.py`` for a plain
request. It owns, once, what decides a request's way; the entrances own their connections:

1. *Reserved paths.* A target under ``/wslb/`` (in any spelling, ``contract.reserved_target``)
   is a worker's internal API, never a client's: 404 before anything else.
2. *The client.* The address wslb counts and logs the client as is the TCP peer's, unless the
   peer is a trusted proxy that names it in ``X-Forwarded-For`` (a PROXY header named it
   already, at accept): then the connection is counted under that address, and a client over
   ``limits.max_connections_per_client`` is refused there (the connection's ``named`` says so).
   The forwarding headers the worker sees are wslb's (``ClientRequest.forwarded_for``).
3. *The pool* is the longest path prefix among the pools that serve the request's ``?model=``
   (or name none); no pool: 404, naming the models served on that path if there are any.
4. *Auth and the key.* The origin allow-list and JWT (``auth.py``: 403, 401); the session key is
   the JWT's claim, else the one the client names (``session_key``), else a new one wslb makes;
   with JWT a key is scoped to its owner for the worker (``scoped_key``). wslb's own credentials
   and parameters (``access_token``, ``wslb_resume``, ``wslb_from``) never reach a worker.
5. *The candidates.* ``Walk`` gives the pool's choices for one session or request, best first:
   by the prompt's prefix where there is one (``Pool.place_prompt``), else by the pool's balance
   and the key (``Pool.select``); each ``next()`` excludes what was tried. The caller accepts one
   (its connect and upgrade succeed) or refuses it and asks again; ``None`` when none is left.

Sans I/O: the host (``ServerState``) and the connection are protocols; nothing here awaits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol
from urllib.parse import parse_qsl

from balancer.auth import scoped_key
from balancer.contract import RESERVED_PREFIX, reserved_target
from balancer.handshake import ClientRequest, HandshakeReject, new_session_id, session_key
from balancer.proxyproto import Networks, forwarded_client
from balancer.resume import without_wslb_params

if TYPE_CHECKING:
    from balancer.auth import Authenticator
    from balancer.backend import Backend
    from balancer.pool import Pool
    from balancer.prefix import Prompt

__all__ = ["Client", "Host", "Routed", "Walk", "requested_model", "route"]


class Routed(NamedTuple):
    """Where a request goes: its pool, the request with the forwarding headers wslb vouches
    for, the client's key, the key the worker sees (scoped with JWT) and whether the client
    named it (a conversation) or wslb made it."""

    pool: Pool
    req: ClientRequest
    key: str
    sid: str
    named: bool


class Client(Protocol):
    """The connection a request came on, as the router sees it (rule 2)."""

    peer: str
    trusted: bool  # the TCP peer is a trusted proxy
    proxied: bool  # a PROXY header named the client already

    def named(self, address: str) -> bool:
        """A trusted proxy names the client ``address``: count the connection under it;
        False when that refuses it (over the per-client limit; answered by the connection)."""
        ...


class Host(Protocol):
    """What the router reads of ``ServerState``."""

    trusted_proxies: Networks
    auth: Authenticator

    def route(self, path: str, model: str | None = None) -> Pool | None: ...

    def models(self, path: str) -> list[str]: ...

    def authorize(self, req: ClientRequest) -> tuple[str | None, str | None]: ...


def requested_model(query: str) -> str | None:
    """The ``model`` query parameter (OpenAI Realtime clients name the model there)."""
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "model":
            return value or None
    return None


def route(host: Host, req: ClientRequest, client: Client) -> Routed | None:
    """A request's pool and session key (rules 1-4); None: the connection refused it already
    (rule 2's per-client limit).

    Raises:
        HandshakeReject: 404 (no pool, or a reserved path), 401/403 (auth), 400 (a bad key).
    """
    if reserved_target(req.target):
        raise HandshakeReject(404, f"{RESERVED_PREFIX} is internal to wslb and its workers")
    # X-Forwarded-For gets the address wslb took the connection from (a PROXY header's client:
    # that proxy is transparent), once, whatever worker legs the session opens. Forwarded and
    # X-Real-IP are wslb's too: a client's own are its claims (handshake.py).
    hop = client.peer
    xff = req.header(b"x-forwarded-for")
    if client.trusted and not client.proxied and xff is not None:
        address = forwarded_client(xff.decode("latin-1"), host.trusted_proxies)
        if address is not None and not client.named(address):
            return None
    req = req.forwarded_for(hop, trusted=client.trusted, client=client.peer)
    model = requested_model(req.query)
    pool = host.route(req.path, model)
    if pool is None:
        served = host.models(req.path)
        if served:  # pools here serve models, and not this one: say which they serve
            why = "no ?model= given" if model is None else f"model {model!r} is not served"
            raise HandshakeReject(404, why, details={"models": served})
        raise HandshakeReject(404, f"no pool serves {req.path}")
    owner, claimed = host.authorize(req)
    given = claimed or session_key(pool.cfg.session_key, req)
    key = given or new_session_id()
    # With JWT, a key the client names (or one made for it) is scoped to its owner: the worker
    # sees the scoped one, the client its own (auth.py).
    sid = key if owner is None or claimed else scoped_key(owner, key)
    req = host.auth.strip(req)  # the token in ?access_token= is not the worker's business
    req = without_wslb_params(req)  # wslb_resume, wslb_from: wslb's, not the worker's
    return Routed(pool, req, key, sid, given is not None)


class Walk:
    """The candidates for one session or request, best first (rule 5). ``how`` counts each
    placement by prompt in ``placed[(pool, how)]``."""

    __slots__ = ("now", "placed", "pool", "prompt", "sid", "tried")

    def __init__(
        self,
        pool: Pool,
        sid: str,
        now: Callable[[], float],
        prompt: Prompt | None = None,
        placed: Counter[tuple[str, str]] | None = None,
    ) -> None:
        self.pool = pool
        self.sid = sid
        self.now = now
        self.prompt = prompt
        self.placed = placed
        self.tried: list[str] = []

    def next(self) -> Backend | None:
        """The pool's choice among the backends not tried yet; None when none is left."""
        pool = self.pool
        if len(self.tried) >= len(pool.backends):
            return None
        if self.prompt is not None and pool.prefix is not None:
            backend, how = pool.place_prompt(self.sid, self.prompt, self.tried, self.now())
            if backend is not None and self.placed is not None:
                self.placed[(pool.name, how)] += 1
        else:
            backend = pool.select(self.sid, self.tried, self.now())
        if backend is not None:
            self.tried.append(backend.id)
        return backend
