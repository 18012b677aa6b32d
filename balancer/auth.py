"""Handshake authentication: JWT bearer tokens and the Origin allow-list, before any worker.

The algorithms come from the config and only from it: the token's own ``alg`` header is never
trusted to pick one (so ``alg=none`` and HS256-signed-with-the-RSA-public-key tricks fail). A
token must carry ``exp`` and be unexpired; ``aud`` is checked when an audience is configured.
The token comes from ``Authorization: Bearer`` or, for browsers that cannot set headers on a
WebSocket, from the configured query parameter (which is never forwarded to the worker).

A session key a client names is a bearer secret: whoever knows it joins the conversation. With
JWT on, keys are scoped to their owner (``owner_claim``, ``sub`` by default): the key the workers
see is ``scoped_key(owner, key)``, so another subject naming the same key gets another session.
A key from ``session_claim`` is the token issuer's choice, not the client's, and is used as is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jwt

from balancer.config import AuthCfg
from balancer.handshake import ClientRequest, HandshakeReject, check_key

__all__ = ["OWNER_TAG_LEN", "Authenticator", "normalise_origin", "scoped_key"]

OWNER_TAG_LEN = 32
"""Hex digits of an owner's tag in a scoped key (128 bits of SHA-256)."""


def scoped_key(owner: str, key: str) -> str:
    """The key workers see for ``owner``'s session ``key``: ``TAG~KEY``, TAG a fixed-length
    digest of the owner, so two (owner, key) pairs never give one string (no separator can be
    forged inside a fixed-length field); what a client names stays readable in the logs."""
    tag = hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:OWNER_TAG_LEN]
    return f"{tag}~{key}"


def key_owner(key: str, address: str) -> str:
    """Whom a held place of the scoped key ``key`` counts against (``pools[].
    affinity_hold_per_client``): the owner its tag names; a key a token's claim gave (not
    scoped) counts against its client's ``address``."""
    if key[OWNER_TAG_LEN : OWNER_TAG_LEN + 1] == "~":
        return "owner:" + key[:OWNER_TAG_LEN]
    return address


_CHALLENGE = [(b"www-authenticate", b'Bearer realm="wslb", error="invalid_token"')]


def normalise_origin(origin: str) -> str:
    """Lower-case scheme and host, default port dropped: how the config stores origins."""
    parts = urlsplit(origin.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    port = parts.port
    default = {"http": 80, "https": 443}.get(scheme)
    netloc = host if port is None or port == default else f"{host}:{port}"
    return f"{scheme}://{netloc}"


class Authenticator:
    """Checks a client's upgrade request; returns the token's claims (or {} without JWT)."""

    def __init__(self, cfg: AuthCfg) -> None:
        self.cfg = cfg
        self._origins = frozenset(cfg.origins)
        self._key: Any = None
        if cfg.jwt is not None:
            if cfg.jwt.secret is not None:
                self._key = cfg.jwt.secret
            elif cfg.jwt.public_key_file is not None:
                self._key = Path(cfg.jwt.public_key_file).read_text()

    def check(self, req: ClientRequest) -> dict[str, Any]:
        """Raise ``HandshakeReject`` (401 or 403) unless the request may pass."""
        if self._origins:
            origin = req.header(b"origin")
            if origin is None or normalise_origin(origin.decode("latin-1")) not in self._origins:
                raise HandshakeReject(403, "origin not allowed")
        jcfg = self.cfg.jwt
        if jcfg is None:
            return {}
        token = self._token(req, jcfg.query_param)
        if token is None:
            raise HandshakeReject(401, "missing bearer token", _CHALLENGE)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._key,
                algorithms=list(jcfg.algorithms),
                audience=jcfg.audience,
                options={"require": ["exp"], "verify_aud": jcfg.audience is not None},
            )
        except jwt.PyJWTError as exc:
            raise HandshakeReject(401, f"invalid token: {exc}", _CHALLENGE) from None
        return claims

    @staticmethod
    def _token(req: ClientRequest, query_param: str | None) -> str | None:
        auth = req.header(b"authorization")
        if auth is not None:
            scheme, _, value = auth.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                return value.strip()
        if query_param:
            for k, v in parse_qsl(req.query):
                if k == query_param and v:
                    return v
        return None

    def session_key(self, claims: dict[str, Any]) -> str | None:
        """The configured claim as session key, when present.

        Raises:
            HandshakeReject: 400 when its value breaks the session key rule.
        """
        jcfg = self.cfg.jwt
        if jcfg is None or jcfg.session_claim is None:
            return None
        value = claims.get(jcfg.session_claim)
        if value in (None, ""):
            return None
        return check_key(str(value), f"claim {jcfg.session_claim!r}")

    def owner(self, claims: dict[str, Any]) -> str | None:
        """Whom the request's sessions belong to: the owner claim with JWT on, else None.

        Raises:
            HandshakeReject: 401 when the token has no owner claim (it could own nothing).
        """
        jcfg = self.cfg.jwt
        if jcfg is None:
            return None
        value = claims.get(jcfg.owner_claim)
        if value in (None, "") or isinstance(value, dict | list):
            raise HandshakeReject(
                401, f"token has no {jcfg.owner_claim!r} claim (auth.jwt.owner_claim)", _CHALLENGE
            )
        return str(value)

    def strip(self, req: ClientRequest) -> ClientRequest:
        """``req`` without the JWT's query parameter: the worker must not see the token."""
        jcfg = self.cfg.jwt
        if jcfg is None or not jcfg.query_param:
            return req
        return req.without_query(jcfg.query_param)
