"""Fuzz targets shared by the hypothesis tests and the atheris harnesses.

Each target feeds untrusted bytes, split into the given chunk sizes, through a parser that faces
the network and checks the contract: only the parser's own rejection is raised, every call
returns (no hang: the work is bounded by the input), and the results are consistent.
"""

from __future__ import annotations

from balancer.config import KeySource
from balancer.frames import FrameScanner
from balancer.handshake import (
    HandshakeReject,
    RequestReader,
    check_client_request,
    session_key,
    upstream_request,
)

SOURCES = (
    KeySource("query", "session"),
    KeySource("header", "X-Session-Id"),
    KeySource("cookie", "wslb_session"),
    KeySource("path", "-1"),
    KeySource("path", "2"),
)


def split(data: bytes, chunks: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in chunks:
        if pos >= len(data):
            break
        out.append(data[pos : pos + n])
        pos += n
    out.append(data[pos:])
    return out


def handshake_target(data: bytes, chunks: list[int]) -> None:
    """Client bytes -> request head -> validated upgrade -> session key -> worker request."""
    reader = RequestReader(max_bytes=4096, max_headers=50)
    try:
        for part in split(data, chunks):
            event = reader.feed(part)
            if event is None:
                continue
            req = check_client_request(event)
            key = session_key(SOURCES, req)
            assert key is None or 0 < len(key) <= 256
            request, nonce = upstream_request("/ws", "127.0.0.1:1", req, key or "k", "127.0.0.1")
            assert len(nonce) == 24 and request.method == b"GET"
            break
    except HandshakeReject as rej:
        assert 400 <= rej.status < 500


def scanner_target(data: bytes, chunks: list[int], masked: bool) -> None:
    """Bytes -> frame scanner: only ProtocolError verdicts, same result for any chunking."""
    whole = FrameScanner(masked=masked, max_frame_size=512, max_message_size=1024)
    whole_out = whole.feed(data)
    sc = FrameScanner(masked=masked, max_frame_size=512, max_message_size=1024)
    sc.ends = []
    out = b"".join(sc.feed(p) for p in split(data, chunks))
    assert out == whole_out
    assert (sc.error is None) == (whole.error is None)
    if sc.error is not None and whole.error is not None:
        assert sc.error.code == whole.error.code in (1002, 1007, 1009)
    assert sc.messages == whole.messages == len(sc.ends)
    assert all(0 < e <= len(out) for e in sc.ends)
