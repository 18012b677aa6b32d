"""``balancer.httpmsg``'s worker leg without I/O: the strict response parser wslb reads a
worker's answers with, and the request head it writes (SPEC section 16)."""

from __future__ import annotations

import pytest

from balancer.httpmsg import (
    END,
    NEED_DATA,
    BadResponse,
    ResponseHead,
    ResponseReader,
    chunk,
    request_head,
)

Event = ResponseHead | bytes | str


def read(data: bytes, *, step: int = 0, head_only: bool = False) -> tuple[list[Event], bool]:
    """The events of ``data`` fed whole (or ``step`` bytes at a time), then a close; an error
    as ``"!reason"``; and whether the connection could carry the next request."""
    r = ResponseReader(64 * 1024)
    r.start(head_only)
    out: list[Event] = []
    pieces = [data[i : i + step] for i in range(0, len(data), step)] if step else [data]
    for piece in [*pieces, b""]:
        r.receive(piece)
        while True:
            try:
                event = r.next_event()
            except BadResponse as exc:
                return [*out, f"!{exc}"], r.reusable
            if event is NEED_DATA:
                break
            if event is END:
                return [*out, "END"], r.reusable
            assert isinstance(event, ResponseHead | bytes)
            out.append(event)
    return out, r.reusable


def body(events: list[Event]) -> bytes:
    return b"".join(e for e in events if isinstance(e, bytes))


@pytest.mark.parametrize("step", [0, 1, 3])
def test_content_length_body_whole_or_in_pieces(step: int) -> None:
    events, reusable = read(
        b"HTTP/1.1 200 OK\r\nContent-Type: a/b; x=1\r\nContent-Length: 5\r\n\r\nhello", step=step
    )
    head = events[0]
    assert head == ResponseHead(
        200, b"OK", [(b"content-type", b"a/b; x=1"), (b"content-length", b"5")]
    )
    assert (body(events), events[-1], reusable) == (b"hello", "END", True)


@pytest.mark.parametrize("step", [0, 1, 4])
def test_chunked_body_with_extensions_and_trailer(step: int) -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw += b"5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\n"
    events, reusable = read(raw, step=step)
    assert (body(events), events[-1], reusable) == (b"helloabc", "END", True)


def test_bodies_that_are_not_there() -> None:
    assert read(b"HTTP/1.1 204 No Content\r\n\r\n")[0][-1] == "END"
    events, reusable = read(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", head_only=True)
    assert (events[-1], reusable) == ("END", True)
    events, reusable = read(b"HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n")
    assert (events[0], events[-1], reusable) == (
        ResponseHead(200, b"", [(b"content-length", b"0")]),
        "END",
        True,
    )


def test_what_ends_the_connection() -> None:
    # Read until the close; HTTP/1.0; Connection: close; bytes past the answer.
    events, reusable = read(b"HTTP/1.1 200 OK\r\n\r\nuntil the close")
    assert (body(events), events[-1], reusable) == (b"until the close", "END", False)
    for raw in (
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nConnection: keep-alive, close\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhiXX",
    ):
        events, reusable = read(raw)
        assert (body(events), events[-1], reusable) == (b"hi", "END", False)


def test_informational_heads_come_before_the_answer() -> None:
    events, _ = read(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi")
    assert [e.status for e in events if isinstance(e, ResponseHead)] == [100, 200]
    assert body(events) == b"hi"


def test_identical_content_lengths_pass_once() -> None:
    events, _ = read(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\nhi")
    assert events[0] == ResponseHead(200, b"OK", [(b"content-length", b"2")])


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
            "conflicting Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello", "conflicting Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "both Content-Length and Transfer-Encoding",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "unsupported Transfer-Encoding",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            "unsupported Transfer-Encoding",
        ),
        (b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n", "obsolete line folding"),
        (b"HTTP/1.1 200 OK\r\nBad Name: 2\r\n\r\n", "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nName : 2\r\n\r\n", "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nX: a\rb\r\n\r\n", "malformed header field"),
        (b"HTTP/2 200 OK\r\n\r\n", "malformed status line"),
        (
            b"HTTP/1.1 200 OK\ncontent-length: 0\n\n",
            "the worker closed the connection within its response head",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
            "bad chunk size",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
            "chunk not followed by CRLF",
        ),
        # A hostile worker's sizes: past CHUNK_MAX (2^40), 2^63, 2^64 - 1, a 17th digit.
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000000001\r\nx",
            "chunk size too large",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8000000000000000\r\nx",
            "chunk size too large",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nx",
            "chunk size too large",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\nx",
            "bad chunk size",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel",
            "the worker closed the connection before the body ended",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhe",
            "the worker closed the connection before the body ended",
        ),
        (b"", "the worker closed the connection"),
    ],
)
def test_what_a_proxy_must_not_pass_on(raw: bytes, why: str) -> None:
    events, reusable = read(raw)
    assert (events[-1], reusable) == (f"!{why}", False)


def test_a_head_over_the_limit() -> None:
    r = ResponseReader(100)
    r.start(False)
    r.receive(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 200)
    with pytest.raises(BadResponse, match="too large"):
        r.next_event()


def test_the_request_head_and_chunks_wslb_writes() -> None:
    head = request_head(b"POST", b"/v1/x?a=1", [(b"host", b"w:1"), (b"content-length", b"2")])
    assert head == b"POST /v1/x?a=1 HTTP/1.1\r\nhost: w:1\r\ncontent-length: 2\r\n\r\n"
    assert request_head(b"GET", b"/", [(b"x-session-id", b"a\r\nEvil: 1")]) is None
    assert request_head(b"GET", b"/", [(b"x-session-id", b"a\nb")]) is None
    assert request_head(b"GET", b"/", [(b"x-session-id", b"a\x00b")]) is None
    assert request_head(b"GET", b"/a b", []) is None
    assert chunk(b"hello") == b"5\r\nhello\r\n"
