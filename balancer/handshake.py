"""The two HTTP/1.1 upgrade handshakes, without I/O.

Client side: an h11 ``Request`` is checked against RFC 6455 4.2.1 before any worker connection is
opened; every rejection carries its status (400 malformed, 426 wrong version or not an upgrade).
Session keys follow one rule (``SESSION_KEY_RULE``: 400 otherwise, never cut or cleaned) and
are percent-encoded wherever they enter a URL (``quote_key``).
Worker side: wslb is the WebSocket client. It builds its own request (a fresh key, the client's
subprotocols, ``X-Session-Id``, ``X-Forwarded-For``, ``Forwarded`` and ``X-Real-IP`` of its own,
its credential, the client's end-to-end headers) and checks the worker's answer: 101,
``Upgrade``/``Connection``, the ``Sec-WebSocket-Accept`` derived from its key, a subprotocol the
client offered and no extension (wslb never offers one, so frames stay uncompressed and a
session's state can move between workers). Anything else is a 502.
"""

from __future__ import annotations

import base64
import binascii
import http
import ipaddress
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any, Final
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import h11
from wsproto.utilities import generate_accept_token, generate_nonce

from balancer.config import KeySource

__all__ = [
    "SESSION_KEY_RULE",
    "WSLB_PREFIX",
    "ClientRequest",
    "ClosedBeforeRequest",
    "HandshakeReject",
    "RequestReader",
    "UpstreamReject",
    "accept_headers",
    "check_client_request",
    "check_key",
    "check_upstream_response",
    "new_session_id",
    "next_request",
    "quote_key",
    "session_key",
    "upstream_request",
    "valid_key",
]

SESSION_KEY_RULE: Final = "a session key is 1-256 characters of A-Z a-z 0-9 . _ ~ : @ -"
_KEY_RE: Final = re.compile(r"[A-Za-z0-9._~:@-]{1,256}")
_WORKER_TOKEN: Final = b"x-wslb-worker-token"  # wslb's credential (balancer.workerauth.HEADER)

# Headers that belong to one hop or to the handshake itself, or that wslb writes itself (its
# credential, the addresses it vouches for): never copied from the client to the worker.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"upgrade",
        b"host",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"proxy-connection",
        b"proxy-authorization",
        b"content-length",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
        b"x-session-id",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"x-wslb-resume",
        _WORKER_TOKEN,
        b"forwarded",
        b"x-real-ip",
    }
)
WSLB_PREFIX: Final = b"x-wslb-"
"""``X-WSLB-*`` headers are wslb's (its credential, resume, handoff): a client's never reach a
worker, whatever the name after the prefix."""
# Hop headers wslb rewrites itself and keeps for a session's later worker legs (migration).
_FORWARDING: Final = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})


class HandshakeReject(Exception):
    """The client's upgrade request is refused with ``status``; ``details`` makes the body JSON
    (``{"error": message, **details}``)."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message
        self.headers = list(headers)
        self.details = details


class ClosedBeforeRequest(HandshakeReject):
    """The client closed its connection with no request under way: nothing to answer (a
    kept-alive client's goodbye), though a reader that needed a request refuses it (400)."""

    def __init__(self) -> None:
        super().__init__(400, "connection closed before a request")


class RequestReader:
    """Reads a client's upgrade request head with h11, within size and count limits.

    ``feed`` returns the ``h11.Request`` once its head is complete, None while more bytes are
    needed, and raises ``HandshakeReject`` (400, 431) for anything malformed. Bytes that follow
    the head (frames sent eagerly) are kept in ``trailing``.
    """

    def __init__(self, max_bytes: int = 16 * 1024, max_headers: int = 100) -> None:
        self.max_bytes = max_bytes
        self.max_headers = max_headers
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
        self.request: h11.Request | None = None

    def feed(self, data: bytes) -> h11.Request | None:
        if self.request is not None:
            self._h11.receive_data(data)  # after the head: kept as trailing data
            return None
        self._h11.receive_data(data)
        event = next_request(self._h11, self.max_bytes, self.max_headers)
        if event is not None:
            self.request = event
        return event

    @property
    def connection(self) -> h11.Connection:
        """The h11 connection: plain HTTP reads its bodies and next requests on it."""
        return self._h11

    def renew(self) -> h11.Connection:
        """A fresh h11 connection in place of the current one (the lane thread served
        requests it never saw: ``aio/lanes.py``)."""
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_bytes)
        return self._h11

    @property
    def trailing(self) -> bytes:
        return bytes(self._h11.trailing_data[0])


_FOLD: Final = re.compile(rb"\n[ \t]")
_HEAD_END: Final = re.compile(rb"\n\r?\n")


def next_request(conn: h11.Connection, max_bytes: int, max_headers: int) -> h11.Request | None:
    """The next request head buffered in ``conn`` (its state IDLE), or None while more bytes
    are needed.

    Raises ``HandshakeReject`` for what h11 refuses (400; 431 for an oversized incomplete
    head) and for what it lets through but a proxy must not: obs-fold (h11 unfolds it, a
    worker behind might split it) and both ``Content-Length`` and ``Transfer-Encoding`` (two
    framings: the smuggling classic, RFC 9112 6.3 lets a server refuse it).
    """
    buf = conn.trailing_data[0]
    end = _HEAD_END.search(buf)
    if end is not None and _FOLD.search(buf, 0, end.start()) is not None:
        raise HandshakeReject(400, "malformed request: obsolete line folding")
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        # h11 hints 431 for an oversized incomplete head, 400 for the rest.
        raise HandshakeReject(exc.error_status_hint, f"malformed request: {exc}") from None
    if event is h11.NEED_DATA:
        return None
    if isinstance(event, h11.ConnectionClosed):
        raise ClosedBeforeRequest
    if not isinstance(event, h11.Request):  # pragma: no cover - a server sees requests
        raise HandshakeReject(400, "unexpected HTTP event")
    # h11 bounds only an incomplete head; a head that arrived whole is measured here.
    size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
    if size > max_bytes or len(event.headers) > max_headers:
        raise HandshakeReject(431, "request header fields too large")
    names = {k for k, _ in event.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise HandshakeReject(400, "malformed request: both Content-Length and Transfer-Encoding")
    return event


class UpstreamReject(Exception):
    """The worker's answer to wslb's upgrade is not an acceptable 101 (the client gets 502).

    ``status`` is the worker's HTTP status when it answered with something other than 101.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)
        self.body = body

    def relayed(self) -> bytes | None:
        """The worker's own answer as the client gets it, or None when wslb answers instead.

        A worker that refuses the upgrade itself (``401``/``403`` from its own auth, ``404``,
        ``429``, ``500``) is heard as it spoke, as nginx and HAProxy pass it: its status,
        its end-to-end headers (``WWW-Authenticate``, ``Retry-After``, ``Content-Type``) and
        its body up to ``WORKER_BODY_LIMIT``, so a client that refreshes its token on 401
        works behind wslb. ``502``-``504`` (busy, going away) make wslb try the next worker,
        and a malformed answer (no status) or a ``2xx`` (an HTTP server that does not speak
        WebSocket there: not a refusal, nothing the client could act on) is wslb's own 502.
        """
        if self.status is None or self.status in (502, 503, 504) or self.status < 300:
            return None
        lines = [f"HTTP/1.1 {self.status} {_reason(self.status)}".encode()]
        for name, value in self.headers:
            if name not in _HOP_BY_HOP and name not in _NOT_RELAYED:
                lines.append(name + b": " + value)
        body = self.body[:WORKER_BODY_LIMIT]
        lines += [b"content-length: " + str(len(body)).encode(), b"connection: close"]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


WORKER_BODY_LIMIT = 64 * 1024
"""The most of a worker's refusal body wslb reads and passes on (a longer one is cut)."""
# A refusal's headers that describe the worker's connection, not the answer.
_NOT_RELAYED: Final = frozenset({b"date", b"server", b"set-cookie2", b"alt-svc"})


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(slots=True)
class ClientRequest:
    """A validated client upgrade request."""

    target: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    key: bytes
    subprotocols: list[str]
    host: str

    def header(self, name: bytes) -> bytes | None:
        """First value of a header (names are lower-case in h11)."""
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def forwarded_for(
        self, hop: str, *, trusted: bool = True, client: str | None = None
    ) -> ClientRequest:
        """A copy with the forwarding headers wslb vouches for.

        ``X-Forwarded-For`` gets ``hop`` (the address wslb took the connection from) appended,
        as nginx's ``$proxy_add_x_forwarded_for`` does. ``Forwarded`` (RFC 7239) gets a
        ``for=HOP`` element appended when the peer is a ``trusted`` proxy; from anyone else it
        is replaced, since every element a client wrote is its own claim. ``X-Real-IP`` is
        always wslb's: ``client`` (the address wslb counts the client as), or ``hop``.
        """
        raw = hop.encode("latin-1")
        prior = self.header(b"x-forwarded-for")
        value = raw if prior is None else prior + b", " + raw
        element = b"for=" + _forwarded_node(hop)
        before = b", ".join(v for k, v in self.headers if k == b"forwarded")
        headers = [(k, v) for k, v in self.headers if k not in _FORWARDING]
        headers.append((b"x-forwarded-for", value))
        headers.append((b"forwarded", before + b", " + element if trusted and before else element))
        headers.append((b"x-real-ip", (client or hop).encode("latin-1")))
        return ClientRequest(
            self.target, self.path, self.query, headers, self.key, self.subprotocols, self.host
        )

    def without_query(self, name: str) -> ClientRequest:
        """A copy whose query has no parameter ``name`` (a credential the worker must not
        see, such as the JWT's ``access_token``); the rest is kept as the client wrote it."""
        if not self.query:
            return self
        parts = self.query.split("&")
        kept = [p for p in parts if unquote(p.partition("=")[0].replace("+", " ")) != name]
        if len(kept) == len(parts):
            return self
        query = "&".join(kept)
        target = self.path + (f"?{query}" if query else "")
        return ClientRequest(
            target, self.path, query, self.headers, self.key, self.subprotocols, self.host
        )

    def for_resume(self) -> ClientRequest:
        """What a live session keeps to open another worker leg (migration): the headers
        ``upstream_request`` forwards or reads, in a plain list (h11's header objects are
        several times larger, and a live session keeps this for its whole life)."""
        keep = [
            (k, v)
            for k, v in self.headers
            if (k not in _HOP_BY_HOP or k in _FORWARDING) and not k.startswith(WSLB_PREFIX)
        ]
        # The path goes to a path-less backend URL's worker again; most sessions share theirs.
        path = sys.intern(self.path)
        return ClientRequest("", path, self.query, keep, b"", self.subprotocols, self.host)


def _forwarded_node(address: str) -> bytes:
    """An address as a ``Forwarded`` node: IPv6 quoted in brackets, a non-address obfuscated."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return b"unknown"
    return f'"[{ip}]"'.encode() if ip.version == 6 else str(ip).encode()


def _tokens(value: bytes) -> list[str]:
    return [t.strip().lower() for t in value.decode("latin-1").split(",") if t.strip()]


def check_client_request(req: h11.Request) -> ClientRequest:
    """Validate a client's opening handshake (RFC 6455 4.2.1) or raise ``HandshakeReject``."""
    if req.method != b"GET":
        raise HandshakeReject(400, "WebSocket upgrade requires GET")
    if req.http_version != b"1.1":
        raise HandshakeReject(400, "WebSocket upgrade requires HTTP/1.1")
    headers = list(req.headers)
    connection: list[str] = []
    upgrade: list[str] = []
    version: list[bytes] = []
    keys: list[bytes] = []
    protocols: list[str] = []
    host = ""
    for name, value in headers:
        if name == b"connection":
            connection += _tokens(value)
        elif name == b"upgrade":
            upgrade += _tokens(value)
        elif name == b"sec-websocket-version":
            version.append(value.strip())
        elif name == b"sec-websocket-key":
            keys.append(value.strip())
        elif name == b"sec-websocket-protocol":
            protocols += [t.strip() for t in value.decode("latin-1").split(",") if t.strip()]
        elif name == b"host":
            host = value.decode("latin-1")
    upgrade_hdr = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade")]
    if "websocket" not in upgrade or "upgrade" not in connection:
        raise HandshakeReject(426, "this endpoint speaks WebSocket only", upgrade_hdr)
    if version != [b"13"]:
        raise HandshakeReject(
            426, "unsupported WebSocket version", [(b"sec-websocket-version", b"13"), *upgrade_hdr]
        )
    if len(keys) != 1:
        raise HandshakeReject(400, "missing or repeated Sec-WebSocket-Key")
    try:
        raw = base64.b64decode(keys[0], validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 16:
        raise HandshakeReject(400, "invalid Sec-WebSocket-Key")
    target = req.target.decode("latin-1")
    parts = urlsplit(target)
    if not parts.path.startswith("/"):
        raise HandshakeReject(400, "request target must be an absolute path")
    return ClientRequest(
        target=target,
        path=parts.path,
        query=parts.query,
        headers=headers,
        key=keys[0],
        subprotocols=protocols,
        host=host,
    )


def new_session_id() -> str:
    """A fresh random session key (128 bits, URL-safe)."""
    return secrets.token_urlsafe(16)


def valid_key(key: str) -> bool:
    """``key`` follows ``SESSION_KEY_RULE``: safe in a header, a log line and, quoted
    (``quote_key``), a URL path segment, whatever the worker behind."""
    return _KEY_RE.fullmatch(key) is not None


def check_key(key: str, where: str) -> str:
    """``key`` if valid, else a 400 naming the rule and where the key came from."""
    if not valid_key(key):
        raise HandshakeReject(400, f"bad session key in {where}: {SESSION_KEY_RULE}")
    return key


def quote_key(key: str) -> str:
    """``key`` as one URL path segment, every character but letters, digits, ``-``, ``_`` and
    ``~`` percent-encoded: ``/``, ``?`` and ``#`` cannot end it, and ``.`` too, so that no
    client library or server takes ``.`` or ``..`` for a dot-segment and walks up the path."""
    return quote(key, safe="").replace(".", "%2E")


def session_key(sources: Sequence[KeySource], req: ClientRequest) -> str | None:
    """The first session key present among the configured sources, or None.

    Raises:
        HandshakeReject: 400 when the key found breaks ``SESSION_KEY_RULE`` (never
            truncated or cleaned: two different keys must not become one).
    """
    query: dict[str, str] | None = None
    for src in sources:
        value: str | None = None
        if src.kind == "query":
            if query is None:
                query = dict(parse_qsl(req.query, keep_blank_values=False))
            value = query.get(src.name)
        elif src.kind == "header":
            raw = req.header(src.name.lower().encode("latin-1"))
            value = raw.decode("latin-1").strip() if raw is not None else None
        elif src.kind == "cookie":
            for name, raw in req.headers:
                if name != b"cookie":
                    continue
                jar: SimpleCookie = SimpleCookie()
                try:
                    jar.load(raw.decode("latin-1"))
                except CookieError:
                    continue
                if src.name in jar:
                    value = jar[src.name].value
                    break
        elif src.kind == "path":
            segments = [s for s in req.path.split("/") if s]
            index = int(src.name)
            index = index - 1 if index > 0 else index
            if -len(segments) <= index < len(segments):
                value = unquote(segments[index])
        if value:
            return check_key(value, str(src))
    return None


def upstream_request(
    upstream_path: str,
    authority: str,
    req: ClientRequest,
    session_id: str,
    client_host: str | None = None,
    *,
    secure_client: bool = False,
    resume: bool = False,
    worker_token: str | None = None,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[h11.Request, bytes]:
    """wslb's own upgrade request to a worker and the key whose accept token it expects.

    The client's query string is appended to the worker URL's path, so workers can read it.
    ``client_host`` is appended to the request's ``X-Forwarded-For``; None sends the header as
    it is (``ClientRequest.forwarded_for`` made it already). ``worker_token``: wslb's
    credential (``balancer.workerauth``), in a header no client can set; ``extra``: wslb's
    own headers to the worker (parking, a reattach: ``balancer.resume``).
    """
    nonce = bytes(generate_nonce())
    target = upstream_path
    if req.query:
        target += ("&" if "?" in target else "?") + req.query
    if client_host is not None:
        req = req.forwarded_for(client_host)
    xff = req.header(b"x-forwarded-for") or b""
    headers: list[tuple[bytes, bytes]] = [
        (b"host", authority.encode("latin-1")),
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"sec-websocket-key", nonce),
        (b"sec-websocket-version", b"13"),
        (b"x-session-id", session_id.encode("latin-1")),
        (b"x-forwarded-for", xff),
        (b"x-forwarded-proto", b"wss" if secure_client else b"ws"),
    ]
    for name, value in req.headers:
        if name in _FORWARDING and name != b"x-forwarded-for":
            headers.append((name, value))
    if worker_token is not None:
        headers.append((_WORKER_TOKEN, worker_token.encode("ascii")))
    if req.host:
        headers.append((b"x-forwarded-host", req.host.encode("latin-1")))
    if req.subprotocols:
        headers.append((b"sec-websocket-protocol", ", ".join(req.subprotocols).encode("latin-1")))
    if resume:
        headers.append((b"x-wslb-resume", session_id.encode("latin-1")))
    headers.extend(extra)
    for name, value in req.headers:
        if name not in _HOP_BY_HOP and not name.startswith(WSLB_PREFIX):
            headers.append((name, value))
    return h11.Request(method=b"GET", target=target, headers=headers), nonce


def check_upstream_response(
    resp: h11.InformationalResponse | h11.Response,
    nonce: bytes,
    offered: Sequence[str],
    body: bytes = b"",
) -> str | None:
    """Check the worker's answer; return the negotiated subprotocol or raise ``UpstreamReject``
    (with the worker's headers and ``body`` when it answered with another status)."""
    if resp.status_code != 101:
        raise UpstreamReject(
            f"worker answered {resp.status_code}, not 101", resp.status_code, resp.headers, body
        )
    upgrade: list[str] = []
    connection: list[str] = []
    accept: bytes | None = None
    protocol: str | None = None
    for name, value in resp.headers:
        if name == b"upgrade":
            upgrade += _tokens(value)
        elif name == b"connection":
            connection += _tokens(value)
        elif name == b"sec-websocket-accept":
            accept = value.strip()
        elif name == b"sec-websocket-protocol":
            protocol = value.decode("latin-1").strip()
        elif name == b"sec-websocket-extensions":
            raise UpstreamReject("worker accepted an extension wslb never offered")
    if "websocket" not in upgrade or "upgrade" not in connection:
        raise UpstreamReject("worker's 101 lacks Upgrade: websocket / Connection: Upgrade")
    if accept is None or accept != generate_accept_token(nonce):
        raise UpstreamReject("worker's Sec-WebSocket-Accept does not match wslb's key")
    if protocol is not None and protocol not in offered:
        raise UpstreamReject(f"worker chose subprotocol {protocol!r} the client did not offer")
    return protocol


def accept_headers(
    key: bytes, subprotocol: str | None, session_id: str | None
) -> list[tuple[bytes, bytes]]:
    """Headers of the 101 wslb sends the client."""
    headers = [
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"sec-websocket-accept", bytes(generate_accept_token(key))),
    ]
    if subprotocol is not None:
        headers.append((b"sec-websocket-protocol", subprotocol.encode("latin-1")))
    if session_id is not None:
        headers.append((b"x-session-id", session_id.encode("latin-1")))
    return headers
