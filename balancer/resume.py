"""What a client's upgrade says about resuming (SPEC section 13): its token and its count.

A client names a secret for its session on its first upgrade (``X-WSLB-Resume-Token``, or
``wslb_resume`` in the query for a browser, which cannot set headers) or gets one wslb made in
the 101. Reconnecting, it sends the token again with the number of data messages it has
received (``X-WSLB-Resume-From``, ``wslb_from``). Query parameters starting ``wslb_`` are
wslb's: they never reach a worker. Tokens are compared in constant time; a session's key is
already scoped to its owner (``auth.py``), so another owner's reconnect never finds it.

A browser sees neither the status nor the headers of a handshake, so when the token came in the
query (``answers_in_band``) every answer to a resume is one a ``WebSocket`` object shows: an
open is the session resumed from exactly the count it named (wslb never resumes from another),
and a resume wslb cannot honour is accepted and closed at once with a 4xxx code and the 409's
JSON as the reason (``in_band_close``): 4404 gone, 4409 refused, 4429 throttled, 4400 invalid.
The header form keeps its statuses.

A token belongs to one session instance (``ServerState.find_resumable``): a reconnect finds its
session by token, so a new session on the same key never hides a detached one, and a token in
use by another session is refused rather than shared. Failed resumes are throttled per client
address (``FailureThrottle``): a token is a secret, and guessing one must stay slow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import secrets
from urllib.parse import parse_qsl, urlencode

from balancer.handshake import ClientRequest, HandshakeReject

__all__ = [
    "CLOSE_GONE",
    "CLOSE_INVALID",
    "CLOSE_REFUSED",
    "CLOSE_THROTTLED",
    "COUNT_RULE",
    "FROM_HEADER",
    "HANDOVER_REASON",
    "NO_RESUME",
    "PARK_HEADER",
    "REATTACH_FROM_HEADER",
    "REATTACH_HEADER",
    "RESUMED_HEADER",
    "TOKEN_HEADER",
    "TOKEN_RULE",
    "FailureThrottle",
    "Resume",
    "answers_in_band",
    "in_band_close",
    "new_token",
    "park_value",
    "read_resume",
    "same_token",
    "token_digest",
    "without_wslb_params",
]

TOKEN_HEADER = b"x-wslb-resume-token"
# wslb -> a worker that parks (docs/protocol.md, "Parking"): the park parameters of a leg, and a
# reattach of a parked session from the client's count.
PARK_HEADER = b"x-wslb-park"
REATTACH_HEADER = b"x-wslb-reattach"
REATTACH_FROM_HEADER = b"x-wslb-reattach-from"
# The close a stop sends a client whose session its worker keeps: a 1012 whose reason ends in
# ": resume" is not an ending: the client reconnects (through any instance) and resumes.
HANDOVER_REASON = "wslb stopping: resume"
PARK_GRACE_MAX = 3600.0  # what a worker takes (seconds)
PARK_WINDOW_MAX = 64 * 1024 * 1024
FROM_HEADER = b"x-wslb-resume-from"
RESUMED_HEADER = b"x-wslb-resumed"
# 22 characters of base64url carry 132 bits: a client-named token is at least as hard to guess
# as a 128-bit key.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{22,128}")
TOKEN_RULE = "a resume token is 22-128 characters of A-Z, a-z, 0-9, '_' and '-' (128 bits or more)"
# ASCII digits only (str.isdigit() takes '²', which int() refuses), and few enough of them that
# int() is cheap: a count above 10^16 messages is no session's.
_COUNT = re.compile(r"[0-9]{1,16}")
COUNT_RULE = "a resume count is 1-16 ASCII digits: the number of messages received"


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """A request's resume fields: ``token`` (None: none named), ``count`` (None: not a
    reconnect that says what it has)."""

    token: str | None
    count: int | None


NO_RESUME = Resume(None, None)


# The query form's closes, named after the statuses the header form answers with.
CLOSE_INVALID = 4400
CLOSE_GONE = 4404
CLOSE_REFUSED = 4409
CLOSE_THROTTLED = 4429
_IN_BAND = {"invalid": CLOSE_INVALID, "unknown": CLOSE_GONE, "closed": CLOSE_GONE}
_IN_BAND |= {"refused": CLOSE_REFUSED, "taken": CLOSE_REFUSED, "throttled": CLOSE_THROTTLED}


def answers_in_band(req: ClientRequest) -> bool:
    """True when ``req`` names its token in the query, not a header (a browser): its resume
    refusals are closes after a 101, not statuses."""
    if "wslb_resume=" not in req.query or req.header(TOKEN_HEADER) is not None:
        return False
    return any(k == "wslb_resume" for k, _ in parse_qsl(req.query, keep_blank_values=True))


def in_band_close(rej: HandshakeReject) -> tuple[int, str] | None:
    """The close code and JSON reason that say ``rej`` to a browser; None when ``rej`` is not
    a resume's answer (a 503, an auth refusal: a browser retries those as a network failure).
    """
    details = rej.details or {}
    code = _IN_BAND.get(str(details.get("resume")))
    if code is None:
        return None
    reason: dict[str, object] = {"resume": details["resume"]}
    if "reason" in details:
        reason["reason"] = details["reason"]
    for name, value in rej.headers:
        if name == b"retry-after":
            reason["retry_after"] = int(value)
    return code, json.dumps(reason, separators=(",", ":"))


def read_resume(req: ClientRequest) -> Resume:
    """The token and count of ``req``, headers first, then the query.

    Raises:
        HandshakeReject: 400 naming the rule a malformed token or count breaks.
    """
    if "wslb_" not in req.query and req.header(TOKEN_HEADER) is None:
        if req.header(FROM_HEADER) is not None:
            raise _invalid("a resume count needs the session's resume token", "count")
        return NO_RESUME
    query = dict(parse_qsl(req.query, keep_blank_values=True))
    raw_token = req.header(TOKEN_HEADER)
    token = raw_token.decode("latin-1") if raw_token is not None else query.get("wslb_resume")
    raw_from = req.header(FROM_HEADER)
    count_s = raw_from.decode("latin-1") if raw_from is not None else query.get("wslb_from")
    if token is not None and not _TOKEN.fullmatch(token):
        raise _invalid(TOKEN_RULE, "token")
    count = None
    if count_s is not None:
        if not _COUNT.fullmatch(count_s):
            raise _invalid(COUNT_RULE, "count")
        if token is None:
            raise _invalid("a resume count needs the session's resume token", "count")
        count = int(count_s)
    return Resume(token, count)


def _invalid(rule: str, what: str) -> HandshakeReject:
    return HandshakeReject(400, rule, details={"resume": "invalid", "reason": what})


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


def park_value(base: int, grace: float, window: int, token: str) -> bytes:
    """The ``X-WSLB-Park`` value of a worker leg whose first message is the session's message
    ``base``: the worker keeps the session ``grace`` seconds if the leg drops without a close,
    with a window of ``window`` bytes; ``token``'s digest is what a reattach must name."""
    grace = min(grace, PARK_GRACE_MAX)
    window = min(window, PARK_WINDOW_MAX)
    digest = token_digest(token).hex()
    return f"base={base}; grace={grace:g}; window={window}; token={digest}".encode("ascii")


def new_token() -> str:
    """A token wslb makes for a client that named none (192 random bits)."""
    return secrets.token_urlsafe(24)


def same_token(a: str | None, b: str) -> bool:
    """Constant-time comparison (a wrong guess learns nothing from the time it took)."""
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def token_digest(token: str) -> bytes:
    """What the token index is keyed by: a lookup compares digests, never the secret itself."""
    return hashlib.sha256(token.encode()).digest()


class FailureThrottle:
    """Failed resumes per client address: a token bucket of ``limit`` failures refilled over
    ``window`` seconds (sans-I/O: the caller passes the time). Only failures take from it, so
    a client whose resumes succeed is never slowed; an address that has spent its bucket is
    refused before any lookup until a token is back.
    """

    __slots__ = ("_buckets", "_logged", "_swept", "limit", "window")

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)
        self._logged: dict[str, float] = {}  # address -> when its refusal was last logged
        self._swept = 0.0

    def _level(self, address: str, now: float) -> float:
        tokens, at = self._buckets.get(address, (float(self.limit), now))
        return min(float(self.limit), tokens + (now - at) * self.limit / self.window)

    def retry_after(self, address: str, now: float) -> float:
        """Seconds until ``address`` may try again; 0: it may now (a limit of 0: never held)."""
        if self.limit <= 0 or address not in self._buckets:
            return 0.0
        level = self._level(address, now)
        if level >= 1.0:
            return 0.0
        return (1.0 - level) * self.window / self.limit

    def failed(self, address: str, now: float) -> None:
        """A failed resume from ``address`` takes one token."""
        if self.limit <= 0:
            return
        self._buckets[address] = (max(0.0, self._level(address, now) - 1.0), now)
        if len(self._buckets) > 1024 and now - self._swept >= self.window:
            self._forget(now)

    def first_refusal(self, address: str, now: float) -> bool:
        """True once per address and window: the refusal worth a log line."""
        last = self._logged.get(address)
        if last is not None and now - last < self.window:
            return False
        self._logged[address] = now
        return True

    def _forget(self, now: float) -> None:
        """Drop full buckets (an address quiet for a window): memory stays bounded by the
        addresses failing now (swept at most once a window)."""
        self._swept = now
        for address in [a for a in self._buckets if self._level(a, now) >= self.limit]:
            del self._buckets[address]
            self._logged.pop(address, None)
