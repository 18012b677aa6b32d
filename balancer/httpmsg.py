"""Plain HTTP/1.1 through wslb, without I/O: which requests are plain, which headers cross, and
the answers wslb gives itself.

A request is a WebSocket handshake when it asks for ``Upgrade: websocket`` or carries a
``Sec-WebSocket-Key``/``-Version`` (a broken handshake still gets the handshake's own 400/426);
anything else is plain HTTP, proxied to a worker (``aio/httpproxy.py``). h11 parses the client's
requests and frames what the client gets; towards the worker wslb writes the request itself
(``request_head``, ``chunk``) and reads the response with ``ResponseReader``, a strict parser of
its own (h11's event objects cost more than the rest of a small request). Each body is framed
by the side that sends it (``Content-Length`` or chunked): wslb copies no framing header, it
states the framing it sends. Headers that belong to one hop (RFC 9110 7.6.1: ``Connection`` and
every header it names, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``,
``Proxy-*``) are dropped both ways. Towards the worker wslb writes what it vouches for, as on
the upgrade path (``handshake.upstream_request``): ``Host`` (the worker's), ``X-Session-Id``,
``X-Forwarded-For``/``Forwarded``/``X-Real-IP`` (made by ``ClientRequest.forwarded_for``),
``X-Forwarded-Proto`` (``http``/``https``), ``X-Forwarded-Host`` and its credential; a client's
own are dropped, and so is every ``X-WSLB-*`` header a client sends (wslb's own). Towards the
client the key comes back in ``X-Session-Id``, as in the 101.
"""

from __future__ import annotations

import http
import json
import re
from collections.abc import Sequence
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import h11

from balancer.handshake import WSLB_PREFIX, ClientRequest, HandshakeReject

__all__ = [
    "CHUNK_MAX",
    "END",
    "IDEMPOTENT",
    "LANE_DROP",
    "NEED_DATA",
    "RESPONSE_DROP",
    "BadResponse",
    "ResponseHead",
    "ResponseReader",
    "chunk",
    "error_response",
    "is_handshake",
    "plain_request",
    "request_blocks",
    "request_head",
    "request_headers",
    "response_headers",
    "upstream_target",
]

WORKER_TOKEN: Final = b"x-wslb-worker-token"  # balancer.workerauth.HEADER
SESSION_ID: Final = b"x-session-id"

# RFC 9110 7.6.1 and the older lists nginx and HAProxy still drop.
_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Never copied from the client: framing (h11 writes its own), what wslb writes itself, and
# ``Expect`` (wslb answers a client's 100-continue itself; the worker gets the body at once).
_NOT_FROM_CLIENT: Final = _HOP | {
    b"content-length",
    b"host",
    b"expect",
    SESSION_ID,
    b"x-forwarded-for",
    b"x-forwarded-proto",
    b"x-forwarded-host",
    b"forwarded",
    b"x-real-ip",
    b"x-wslb-resume",
    WORKER_TOKEN,
    b"sec-websocket-key",
    b"sec-websocket-version",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
}
# Made by ``ClientRequest.forwarded_for``; copied as it made them.
_FORWARDING: Final = (b"x-forwarded-for", b"forwarded", b"x-real-ip")
# Not passed from the worker: its hop, and the key it saw (the client gets its own).
_NOT_FROM_WORKER: Final = _HOP | {SESSION_ID}
LANE_DROP: Final = _NOT_FROM_CLIENT | frozenset(_FORWARDING)
"""The client header names the worker never gets as the client wrote them (the lane thread's
``drop``, ``_offload.c``): wslb writes its own of the forwarding ones (``request_blocks``)."""
RESPONSE_DROP: Final = _NOT_FROM_WORKER

IDEMPOTENT: Final = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
"""Methods a proxy may send again (RFC 9110 9.2.2), on a fresh connection, when a kept-alive
one turned out dead before any answer."""


def _named_by_connection(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    out: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            out.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return out


def is_handshake(req: h11.Request) -> bool:
    """The request is a WebSocket opening handshake, perhaps a broken one (module docstring)."""
    for name, value in req.headers:
        if name == b"upgrade":
            if b"websocket" in value.lower():
                return True
        elif name == b"sec-websocket-key" or name == b"sec-websocket-version":
            return True
    return False


def plain_request(event: h11.Request) -> ClientRequest:
    """A plain request as the routing reads it (path, query, headers, ``Host``).

    Raises:
        HandshakeReject: 400 for a target that is not an absolute path (absolute-form and
            ``*`` are for proxies and servers, not a balancer's clients).
    """
    target = event.target.decode("latin-1")
    if not target.startswith("/"):
        raise HandshakeReject(400, "request target must be an absolute path")
    parts = urlsplit(target)
    headers = list(event.headers)
    host = next((v.decode("latin-1") for k, v in headers if k == b"host"), "")
    return ClientRequest(target, parts.path, parts.query, headers, b"", [], host)


def upstream_target(backend_path: str | None, req: ClientRequest) -> str:
    """The worker's request target: the client's own for a path-less backend URL (nginx's
    ``proxy_pass`` without a URI), else the URL's path with the client's query."""
    if backend_path is None:
        return req.target
    if not req.query:
        return backend_path
    return backend_path + ("&" if "?" in backend_path else "?") + req.query


def request_headers(
    req: ClientRequest,
    *,
    authority: str,
    session_id: str,
    secure: bool,
    worker_token: str | None,
    length: int | None,
    chunked: bool,
) -> list[tuple[bytes, bytes]]:
    """The headers wslb sends the worker for ``req`` (module docstring). ``length``/``chunked``:
    the request body's framing as h11 read it (neither: no body)."""
    pre, post = request_blocks(
        req, authority=authority, session_id=session_id, secure=secure, worker_token=worker_token
    )
    named = _named_by_connection(req.headers)
    headers = pre + [
        (name, value)
        for name, value in req.headers
        if name not in LANE_DROP and name not in named and not name.startswith(WSLB_PREFIX)
    ]
    headers += post
    if chunked:
        headers.append((b"transfer-encoding", b"chunked"))
    elif length is not None:
        headers.append((b"content-length", str(length).encode()))
    return headers


def request_blocks(
    req: ClientRequest, *, authority: str, session_id: str, secure: bool, worker_token: str | None
) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
    """wslb's own headers before and after the client's (``request_headers``; the lane thread
    writes the same two blocks around each next request's headers): ``Host`` and the key, then
    the forwarding headers ``ClientRequest.forwarded_for`` made and the ``X-Forwarded-*`` and
    credential ones."""
    pre = [(b"host", authority.encode("latin-1")), (SESSION_ID, session_id.encode("latin-1"))]
    post = [(name, value) for name, value in req.headers if name in _FORWARDING]
    post.append((b"x-forwarded-proto", b"https" if secure else b"http"))
    if req.host:
        post.append((b"x-forwarded-host", req.host.encode("latin-1")))
    if worker_token is not None:
        post.append((WORKER_TOKEN, worker_token.encode("ascii")))
    return pre, post


def response_headers(
    headers: list[tuple[bytes, bytes]], session_key: str | None
) -> list[tuple[bytes, bytes]]:
    """The worker's response headers as the client gets them: its hop dropped, its
    ``Content-Length`` kept (h11 frames by it), the client's key added."""
    named = _named_by_connection(headers)
    out = [(k, v) for k, v in headers if k not in _NOT_FROM_WORKER and k not in named]
    if session_key is not None:
        out.append((SESSION_ID, session_key.encode("latin-1")))
    return out


def error_response(
    status: int,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    details: dict[str, Any] | None = None,
) -> bytes:
    """wslb's own answer (``502``, ``503``, ``504``, ``408``, ``413``, a routing refusal), whole,
    closing the connection: a JSON body ``{"error": message, **details}``, what an API client
    such as the OpenAI SDK reads."""
    body = json.dumps({"error": message, **(details or {})}).encode()
    lines = [f"HTTP/1.1 {status} {_reason(status)}".encode()]
    lines += [name + b": " + value for name, value in headers]
    lines += [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


# -- towards the worker: the request as wslb writes it ---------------------------------------------


def request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The request line and headers for the worker, or None if they cannot be sent as they
    are: a CR, LF or NUL anywhere but the line ends, or a space in the target (wslb's own
    values come from configuration, the query and h11-checked headers; this is the backstop
    h11's writer was)."""
    head = b"".join(
        [method, b" ", target, b" HTTP/1.1\r\n"]
        + [name + b": " + value + b"\r\n" for name, value in headers]
        + [b"\r\n"]
    )
    lines = len(headers) + 2
    if (
        head.count(b"\r\n") != lines
        or head.count(b"\n") != lines
        or head.count(b"\r") != lines
        or b"\x00" in head
        or b" " in target
    ):
        return None
    return head


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (never empty: that is the last chunk)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK: Final = b"0\r\n\r\n"


# -- from the worker: a strict response parser -----------------------------------------------------


class BadResponse(Exception):
    """The worker broke HTTP/1.1 (its connection is not used again; the client gets 502 or a
    cut answer)."""


class ResponseHead(NamedTuple):
    """A response head as ``ResponseReader`` read it: names lowercased, values stripped."""

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]


class _Mark:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Mark("NEED_DATA")
"""``ResponseReader.next_event``: nothing more until more bytes arrive."""
END: Final = _Mark("END")
"""``ResponseReader.next_event``: the response is complete."""

_STATUS_LINE: Final = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([\t !-~\x80-\xff]*))?")
_FIELD: Final = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[!-~\x80-\xff]+(?:[ \t]+[!-~\x80-\xff]+)*)?)[ \t]*"
)
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\t -~\x80-\xff]*)?\r\n")
_DIGITS: Final = re.compile(rb"[0-9]{1,18}")
_CHUNK_LINE_LIMIT: Final = 4096  # a chunk-size line with its extensions
CHUNK_MAX: Final = 1 << 40
"""The largest chunk a worker may announce (``_offload.c``'s ``CHUNK_MAX``): a size past it is a
bad answer on every path, not a body forwarded until the worker closes."""
# States of ``ResponseReader``.
_HEAD, _LENGTH, _SIZE, _DATA, _DATA_END, _TRAILER, _CLOSE, _DONE = range(8)


class ResponseReader:
    """A worker's responses on one connection, one at a time, without I/O (RFC 9112).

    ``start`` before each request (a HEAD's answer has no body), ``receive`` what the socket
    gave (``b""``: the worker closed), then ``next_event`` until ``NEED_DATA``: a
    ``ResponseHead`` (1xx ones before the final one; a 101 is the caller's to refuse), body
    bytes as they came (never buffered beyond one read), ``END``. ``BadResponse`` for anything
    a proxy must not pass on: a head over ``limit`` bytes, a malformed status or field line,
    obs-fold, two different ``Content-Length`` values, ``Transfer-Encoding`` with
    ``Content-Length`` or other than ``chunked``, a bad chunk size, a close before the end.
    ``reusable`` after ``END``: the connection may carry the next request (HTTP/1.1, no
    ``Connection: close``, the body framed by length, nothing sent past it).
    """

    __slots__ = ("buf", "closed", "head_only", "keep", "left", "limit", "state")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = b""
        self.state = _DONE
        self.left = 0  # body bytes still due (``_LENGTH``, ``_DATA``); -1: ``END`` is due
        self.keep = False
        self.head_only = False
        self.closed = False

    def start(self, head_only: bool) -> None:
        """Expect the answer to the next request (``head_only``: a HEAD's)."""
        self.state = _HEAD
        self.head_only = head_only
        self.keep = False

    @property
    def done(self) -> bool:
        return self.state == _DONE

    @property
    def at_chunk_boundary(self) -> bool:
        """Inside a chunked body, before a chunk's size line, with nothing unread: what comes
        next may be read by someone else (the relay thread) and given back from a boundary."""
        return self.state == _SIZE and not self.buf and not self.closed

    @property
    def reusable(self) -> bool:
        return self.state == _DONE and self.keep and not self.buf and not self.closed

    def receive(self, data: bytes) -> None:
        if not data:
            self.closed = True
        elif self.buf:
            self.buf += data
        else:
            self.buf = data

    def next_event(self) -> ResponseHead | bytes | _Mark:
        state = self.state
        buf = self.buf
        if state == _LENGTH:
            if not buf:
                if self.closed:
                    raise BadResponse("the worker closed the connection before the body ended")
                return NEED_DATA
            left = self.left
            if len(buf) < left:
                self.buf = b""
                self.left = left - len(buf)
                return buf
            self.buf = buf[left:]
            self.left = -1
            self.state = _DONE
            return buf if len(buf) == left else buf[:left]
        if state == _DONE:
            if self.left == -1:
                self.left = 0
                return END
            return NEED_DATA
        if state == _HEAD:
            return self._head()
        if state == _CLOSE:
            if buf:
                self.buf = b""
                return buf
            if self.closed:
                return self._end()
            return NEED_DATA
        return self._chunked()

    def _end(self) -> _Mark:
        self.state = _DONE
        self.left = 0
        return END

    def _head(self) -> ResponseHead | _Mark:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > self.limit:
                raise BadResponse("response head too large")
            if self.closed:
                if buf:
                    raise BadResponse("the worker closed the connection within its response head")
                raise BadResponse("the worker closed the connection")
            return NEED_DATA
        if end > self.limit:
            raise BadResponse("response head too large")
        self.buf = buf[end + 4 :]
        lines = buf[:end].split(b"\r\n")
        m = _STATUS_LINE.fullmatch(lines[0])
        if m is None:
            raise BadResponse("malformed status line")
        minor, code, reason = m.groups()
        status = int(code)
        headers: list[tuple[bytes, bytes]] = []
        length: bytes | None = None
        chunked = False
        close = minor == b"0"
        field = _FIELD.fullmatch
        for line in lines[1:]:
            f = field(line)
            if f is None:
                if line[:1] in (b" ", b"\t"):
                    raise BadResponse("obsolete line folding")
                raise BadResponse("malformed header field")
            name = f[1].lower()
            value = f[2]
            if name == b"content-length":
                values = {v.strip(b" \t") for v in value.split(b",")}
                if len(values) != 1 or (length is not None and length not in values):
                    raise BadResponse("conflicting Content-Length")
                if length is not None:
                    continue  # the same value again (RFC 9110 8.6): it is passed on once
                length = value = values.pop()
                if _DIGITS.fullmatch(length) is None:
                    raise BadResponse("bad Content-Length")
            elif name == b"transfer-encoding":
                if chunked or value.strip(b" \t").lower() != b"chunked":
                    raise BadResponse("unsupported Transfer-Encoding")
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = close or any(t.strip(b" \t") == b"close" for t in value.lower().split(b","))
            headers.append((name, value))
        if chunked and length is not None:
            raise BadResponse("both Content-Length and Transfer-Encoding")
        head = ResponseHead(status, reason or b"", headers)
        if status < 200:
            if status == 101:
                self.state = _DONE
                self.left = 0
            return head  # 1xx: the final answer still comes (``_HEAD``)
        self.keep = not close
        if self.head_only or status == 204 or status == 304:
            self.state = _DONE
            self.left = -1
        elif chunked:
            self.state = _SIZE
        elif length is not None:
            self.left = int(length)
            self.state = _LENGTH if self.left else _DONE
            if not self.left:
                self.left = -1
        else:
            self.keep = False
            self.state = _CLOSE
        return head

    def _chunked(self) -> bytes | _Mark:
        while True:
            state = self.state
            buf = self.buf
            if state == _DATA:
                if not buf:
                    break
                left = self.left
                if len(buf) <= left:
                    self.buf = b""
                    self.left = left - len(buf)
                    if not self.left:
                        self.state = _DATA_END
                    return buf
                self.buf = buf[left:]
                self.left = 0
                self.state = _DATA_END
                return buf[:left]
            if state == _DATA_END:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise BadResponse("chunk not followed by CRLF")
                self.buf = buf[2:]
                self.state = _SIZE
            elif state == _SIZE:
                m = _CHUNK_SIZE.match(buf)
                if m is None:
                    if b"\n" in buf[:_CHUNK_LINE_LIMIT] or len(buf) > _CHUNK_LINE_LIMIT:
                        raise BadResponse("bad chunk size")
                    break
                self.buf = buf[m.end() :]
                size = int(m[1], 16)
                if size > CHUNK_MAX:
                    raise BadResponse("chunk size too large")
                if size:
                    self.left = size
                    self.state = _DATA
                else:
                    self.state = _TRAILER
            else:  # _TRAILER: fields after the last chunk, dropped (h11 did too)
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > self.limit:
                        raise BadResponse("trailer too large")
                    break
                line = buf[:end]
                self.buf = buf[end + 2 :]
                if not line:
                    return self._end()
                if _FIELD.fullmatch(line) is None:
                    raise BadResponse("malformed trailer field")
        if self.closed:
            raise BadResponse("the worker closed the connection before the body ended")
        return NEED_DATA
