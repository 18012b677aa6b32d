"""Hypothesis fuzzing of the parsers that face the network: only protocol errors, never a hang.

The atheris harnesses in tests/fuzz/ run the same targets coverage-guided, by hand.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fuzz.targets import handshake_target, scanner_target

VALID = (
    b"GET /chat/ws?session=abc&x=1 HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n"
    b"Connection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: a, b\r\n"
    b"Cookie: wslb_session=c; other=1\r\nAuthorization: Bearer x\r\n\r\n\x81\x80abcd"
)


def mutations() -> st.SearchStrategy[bytes]:
    """Valid requests with bytes flipped, cut or inserted, and plain noise."""
    flip = st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)).map(
        lambda t: VALID[: t[0]] + bytes([t[1]]) + VALID[t[0] + 1 :]
    )
    cut = st.integers(0, len(VALID)).map(lambda n: VALID[:n])
    insert = st.tuples(st.integers(0, len(VALID)), st.binary(max_size=40)).map(
        lambda t: VALID[: t[0]] + t[1] + VALID[t[0] :]
    )
    return st.one_of(flip, cut, insert, st.binary(max_size=600))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations(), st.lists(st.integers(1, 64), max_size=20))
@example(VALID, [])
def test_handshake_parser_raises_only_rejections(data: bytes, chunks: list[int]) -> None:
    handshake_target(data, chunks)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(1, 64), max_size=30), st.booleans())
def test_frame_scanner_raises_nothing(data: bytes, chunks: list[int], masked: bool) -> None:
    scanner_target(data, chunks, masked)
