"""What a client's upgrade says about resuming (SPEC section 13): its token and its count.

A client names a secret for its session on its first upgrade (``X-WSLB-Resume-Token``, or
``wslb_resume`` in the query for a browser, which cannot set headers) or gets one wslb made in
the 101. Reconnecting, it sends the token again with the number of data messages it has
received (``X-WSLB-Resume-From``, ``wslb_from``). Query parameters starting ``wslb_`` are
wslb's: they never reach a worker. Tokens are compared in constant time; a session's key is
already scoped to its owner (``auth.py``), so another owner's reconnect never finds it.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import secrets
from urllib.parse import parse_qsl, urlencode

from balancer.handshake import ClientRequest, HandshakeReject

__all__ = [
    "FROM_HEADER",
    "NO_RESUME",
    "RESUMED_HEADER",
    "TOKEN_HEADER",
    "Resume",
    "new_token",
    "read_resume",
    "same_token",
    "without_wslb_params",
]

TOKEN_HEADER = b"x-wslb-resume-token"
FROM_HEADER = b"x-wslb-resume-from"
RESUMED_HEADER = b"x-wslb-resumed"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")
_MAX_FROM = 1 << 53


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """A request's resume fields: ``token`` (None: none named), ``count`` (None: not a
    reconnect that says what it has)."""

    token: str | None
    count: int | None


NO_RESUME = Resume(None, None)


def read_resume(req: ClientRequest) -> Resume:
    """The token and count of ``req``, headers first, then the query.

    Raises:
        HandshakeReject: 400 naming the rule a malformed token or count breaks.
    """
    if "wslb_" not in req.query and req.header(TOKEN_HEADER) is None:
        if req.header(FROM_HEADER) is not None:
            raise HandshakeReject(400, "a resume count needs the session's resume token")
        return NO_RESUME
    query = dict(parse_qsl(req.query, keep_blank_values=True))
    raw_token = req.header(TOKEN_HEADER)
    token = raw_token.decode("latin-1") if raw_token is not None else query.get("wslb_resume")
    raw_from = req.header(FROM_HEADER)
    count_s = raw_from.decode("latin-1") if raw_from is not None else query.get("wslb_from")
    if token is not None and not _TOKEN.fullmatch(token):
        raise HandshakeReject(
            400, "a resume token is 16-128 characters of A-Z, a-z, 0-9, '_' and '-'"
        )
    count = None
    if count_s is not None:
        if not count_s.isdigit() or int(count_s) > _MAX_FROM:
            raise HandshakeReject(400, "a resume count is the number of messages received (0-)")
        if token is None:
            raise HandshakeReject(400, "a resume count needs the session's resume token")
        count = int(count_s)
    return Resume(token, count)


def without_wslb_params(req: ClientRequest) -> ClientRequest:
    """``req`` without its ``wslb_*`` query parameters (they are wslb's, not the worker's)."""
    if "wslb_" not in req.query:
        return req
    kept = [
        (k, v) for k, v in parse_qsl(req.query, keep_blank_values=True) if not k.startswith("wslb_")
    ]
    query = urlencode(kept)
    target = req.path + ("?" + query if query else "")
    return dataclasses.replace(req, query=query, target=target)


def new_token() -> str:
    """A token wslb makes for a client that named none (192 random bits)."""
    return secrets.token_urlsafe(24)


def same_token(a: str | None, b: str) -> bool:
    """Constant-time comparison (a wrong guess learns nothing from the time it took)."""
    return a is not None and hmac.compare_digest(a.encode(), b.encode())
