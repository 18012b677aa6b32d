"""Frame scanner: boundaries, validation, and independence from how the stream is chunked."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import frames
from balancer.frames import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    FrameScanner,
    build_frame,
    close_payload,
    parse_close_payload,
)


def scan(data: bytes, chunks: list[int] | None = None, **kw: object) -> tuple[bytes, FrameScanner]:
    sc = FrameScanner(masked=kw.pop("masked", True), **kw)  # type: ignore[arg-type]
    out = bytearray()
    pos = 0
    for size in chunks or []:
        out += sc.feed(data[pos : pos + size])
        pos += size
        if pos >= len(data):
            break
    if pos < len(data):
        out += sc.feed(data[pos:])
    return bytes(out), sc


def cf(op: int, payload: bytes = b"", fin: bool = True) -> bytes:
    return build_frame(op, payload, mask=True, fin=fin)


def test_whole_frames_pass_through_unchanged() -> None:
    data = cf(OP_TEXT, b"hello") + cf(OP_BINARY, os.urandom(300)) + cf(OP_TEXT, b"x" * 70000)
    out, sc = scan(data)
    assert out == data
    assert (sc.frames, sc.messages, sc.error) == (3, 3, None)
    assert sc.at_message_boundary


def test_fragmented_message_counts_once_and_tracks_boundaries() -> None:
    sc = FrameScanner(masked=True)
    sc.feed(cf(OP_TEXT, b"a", fin=False))
    assert sc.at_frame_boundary and not sc.at_message_boundary
    sc.feed(cf(OP_PING, b"p"))  # control frames may interleave
    sc.feed(cf(OP_CONT, b"b", fin=False))
    assert sc.messages == 0
    sc.feed(cf(OP_CONT, b"c"))
    assert sc.messages == 1 and sc.at_message_boundary and sc.frames == 4


def test_partial_payload_forwarded_immediately_and_header_held() -> None:
    frame = cf(OP_BINARY, b"z" * 1000)
    sc = FrameScanner(masked=True)
    assert sc.feed(frame[:1]) == b""  # incomplete header is held
    assert sc.feed(frame[1:100]) == frame[:100]
    assert not sc.at_frame_boundary
    assert sc.feed(frame[100:]) == frame[100:]
    assert sc.at_frame_boundary and sc.messages == 1


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (build_frame(OP_TEXT, b"x", mask=False), 1002),  # client frame must be masked
        (bytes([0x80 | 0x40 | OP_TEXT, 0x80]) + b"\0\0\0\0", 1002),  # RSV1
        (bytes([0x83, 0x80]) + b"\0\0\0\0", 1002),  # reserved data opcode
        (bytes([0x8B, 0x80]) + b"\0\0\0\0", 1002),  # reserved control opcode
        (cf(OP_CONT, b"x"), 1002),  # continuation without a message
        (cf(OP_TEXT, b"a", fin=False) + cf(OP_TEXT, b"b"), 1002),  # new message inside one
        (cf(OP_PING, b"x", fin=False), 1002),  # fragmented control frame
        (cf(OP_PING, b"x" * 126), 1002),  # control frame too long
        (cf(OP_CLOSE, b"\x03"), 1002),  # 1-byte close payload
        (cf(OP_CLOSE, struct.pack("!H", 999)), 1002),  # invalid close code
        (cf(OP_CLOSE, struct.pack("!H", 1005)), 1002),  # reserved close code on the wire
        (cf(OP_CLOSE, struct.pack("!H", 1000) + b"\xff"), 1007),  # reason not UTF-8
        (bytes([0x82, 0xFF]) + b"\x80" + b"\0" * 7 + b"\0\0\0\0", 1002),  # 64-bit length MSB
    ],
    # Named, not by their bytes: masked frames have a random key, and pytest-xdist's workers
    # must collect the same test ids.
    ids=[
        "unmasked",
        "rsv1",
        "reserved-data-opcode",
        "reserved-control-opcode",
        "lone-continuation",
        "message-inside-message",
        "fragmented-control",
        "long-control",
        "close-1-byte",
        "close-code-999",
        "close-code-1005",
        "close-reason-not-utf8",
        "length-msb",
    ],
)
def test_violations_give_close_codes(data: bytes, code: int) -> None:
    _, sc = scan(data)
    assert sc.error is not None and sc.error.code == code
    assert sc.closed and sc.notable


def test_size_limits_give_1009() -> None:
    _, sc = scan(cf(OP_BINARY, b"x" * 101), max_frame_size=100)
    assert sc.error is not None and sc.error.code == 1009
    data = cf(OP_TEXT, b"x" * 60, fin=False) + cf(OP_CONT, b"x" * 60)
    _, sc = scan(data, max_frame_size=100, max_message_size=100)
    assert sc.error is not None and sc.error.code == 1009


def test_valid_prefix_is_forwarded_before_an_error() -> None:
    good = cf(OP_TEXT, b"ok")
    out, sc = scan(good + bytes([0xC1, 0x80, 0, 0, 0, 0]))
    assert out == good and sc.error is not None and sc.messages == 1


def test_own_pong_consumed_other_pongs_forwarded() -> None:
    sc = FrameScanner(masked=True)
    sc.own_ping = b"wslb1"
    other = cf(OP_PONG, b"app")
    mine = cf(OP_PONG, b"wslb1")
    text = cf(OP_TEXT, b"t")
    assert sc.feed(other + mine + text) == other + text
    assert sc.pong_received and sc.own_ping is None
    assert sc.feed(mine) == mine  # a second identical pong is not ours any more


def test_close_recorded_forwarded_and_nothing_after_it() -> None:
    close = cf(OP_CLOSE, close_payload(1000, "bye"))
    out, sc = scan(close + cf(OP_TEXT, b"late"))
    assert out == close and sc.close == (1000, "bye") and sc.closed
    assert sc.feed(cf(OP_TEXT, b"more")) == b""
    sc2 = FrameScanner(masked=False)
    sc2.drop_close = True
    assert sc2.feed(build_frame(OP_TEXT, b"a") + build_frame(OP_CLOSE, b"")) == build_frame(
        OP_TEXT, b"a"
    )
    assert sc2.close == (1005, "")


def test_server_direction_rejects_masked_frames() -> None:
    _, sc = scan(cf(OP_TEXT, b"x"), masked=False)
    assert sc.error is not None and sc.error.code == 1002
    _, sc = scan(build_frame(OP_TEXT, b"x" * 200), masked=False)
    assert sc.error is None and sc.messages == 1


def test_close_payload_roundtrip_and_truncation() -> None:
    assert parse_close_payload(close_payload(1011, "é" * 100))[0] == 1011
    assert len(close_payload(1000, "é" * 100)) <= 125
    assert parse_close_payload(b"") == (1005, "")


# --- property tests ---------------------------------------------------------------------

frame_st = st.one_of(
    st.tuples(st.sampled_from([OP_TEXT, OP_BINARY]), st.binary(max_size=300)).map(
        lambda t: [cf(t[0], t[1])]
    ),
    st.tuples(st.binary(max_size=40), st.binary(max_size=40), st.binary(max_size=70000)).map(
        lambda t: [cf(OP_TEXT, t[0], fin=False), cf(OP_CONT, t[1], fin=False), cf(OP_CONT, t[2])]
    ),
    st.binary(max_size=125).map(lambda p: [cf(OP_PING, p)]),
    st.binary(max_size=125).map(lambda p: [cf(OP_PONG, p)]),
)


def splits(total: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=1, max_value=max(1, total)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(st.lists(frame_st, max_size=8), st.data())
def test_same_result_for_any_chunking(frames: list[list[bytes]], data: st.DataObject) -> None:
    stream = b"".join(b"".join(f) for f in frames) + bytes([0x81, 0x85])  # ends mid-header
    whole_out, whole = scan(stream)
    chunks = data.draw(splits(len(stream)))
    out, sc = scan(stream, chunks)
    assert out == whole_out == stream[:-2]
    assert (sc.frames, sc.messages, sc.error) == (whole.frames, whole.messages, None)
    assert sc.at_frame_boundary and sc.bytes == len(stream)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.data(), st.booleans())
def test_random_bytes_only_protocol_errors(
    stream: bytes, data: st.DataObject, masked: bool
) -> None:
    whole_out, whole = scan(stream, masked=masked, max_frame_size=200, max_message_size=300)
    out, sc = scan(
        stream,
        data.draw(splits(len(stream))),
        masked=masked,
        max_frame_size=200,
        max_message_size=300,
    )
    # Same verdict and the same forwarded bytes, whatever the chunking.
    assert out == whole_out
    assert (sc.error is None) == (whole.error is None)
    if sc.error is not None:
        assert whole.error is not None and sc.error.code == whole.error.code
        assert sc.error.code in (1002, 1007, 1009)
    assert stream.startswith(out) or sc.messages >= 0  # output is made of input frames


@settings(max_examples=150, deadline=None)
@given(st.lists(frame_st, max_size=8), st.data())
def test_message_end_offsets_split_the_output_at_message_boundaries(
    frames: list[list[bytes]], data: st.DataObject
) -> None:
    stream = b"".join(b"".join(f) for f in frames)
    sc = FrameScanner(masked=True)
    sc.ends = []
    own = b"own!"
    sc.own_ping = own  # a consumed pong shifts output offsets; it must not break them
    stream = cf(OP_PONG, own) + stream
    out = bytearray()
    pos = 0
    for size in data.draw(splits(len(stream))):
        out += sc.feed(stream[pos : pos + size])
        pos += size
    out += sc.feed(stream[pos:])
    assert sc.out_bytes == len(out) == len(stream) - len(cf(OP_PONG, own))
    assert len(sc.ends) == sc.messages
    # Every recorded end is where a data message's last frame ends in the output.
    for end in sc.ends:
        rest = FrameScanner(masked=True)
        rest.feed(bytes(out[end:]))
        assert rest.error is None, "replay from a message end must start with a fresh message"


# --- fast path of feed() against the general path ------------------------------------------


def _general(sc: FrameScanner, chunk: bytes) -> bytes:
    return sc._feed(chunk)  # the general path alone, every rule, no fast path


def _state(sc: FrameScanner) -> tuple[object, ...]:
    err = None if sc.error is None else (sc.error.code, sc.error.reason)
    return (
        sc.frames,
        sc.messages,
        sc.bytes,
        sc.out_bytes,
        sc.ends,
        sc.close,
        sc.closed,
        err,
        sc.pong_received,
        sc.notable,
        sc.at_frame_boundary,
        sc.at_message_boundary,
    )


def _frame(op: int, payload: bytes, masked: bool, fin: bool = True) -> bytes:
    return build_frame(op, payload, mask=masked, fin=fin)


def stream_st(masked: bool) -> st.SearchStrategy[bytes]:
    """Mostly small whole data frames (the fast path), mixed with everything else."""
    small = st.tuples(st.sampled_from([OP_TEXT, OP_BINARY]), st.binary(max_size=140)).map(
        lambda t: _frame(t[0], t[1], masked)
    )
    ext16 = st.sampled_from([126, 300, 301, 499, 500, 501, 700, 65535]).map(
        lambda n: _frame(OP_TEXT, b"x" * n, masked)
    )
    valid = st.one_of(
        small,
        small,
        ext16,
        st.tuples(st.binary(max_size=20), st.binary(max_size=20)).map(
            lambda t: _frame(OP_TEXT, t[0], masked, fin=False) + _frame(OP_CONT, t[1], masked)
        ),
        st.binary(max_size=125).map(lambda p: _frame(OP_PING, p, masked)),
        st.binary(max_size=125).map(lambda p: _frame(OP_PONG, p, masked)),
        st.just(_frame(OP_PONG, b"own!", masked)),
    )
    last = st.one_of(  # ends the stream for the scanner; what follows must be dropped
        st.just(_frame(OP_CLOSE, close_payload(1000, "bye"), masked)),
        st.just(_frame(OP_TEXT, b"wrong mask bit", not masked)),
        st.just(bytes([0xC1, 0x80 if masked else 0])),  # RSV1 set
        st.just(_frame(OP_CONT, b"stray", masked)),
        st.just(_frame(0x3, b"", masked)),  # reserved opcode
        st.binary(min_size=1, max_size=12),  # garbage
    )
    return st.tuples(
        st.lists(valid, max_size=12), st.lists(last, max_size=1), st.lists(small, max_size=2)
    ).map(lambda t: b"".join(t[0] + t[1] + t[2]))


@contextlib.contextmanager
def fast_loop(in_c: bool) -> Iterator[None]:
    """Run ``feed``'s fast loop in C (``balancer._scan``) or in Python, for the block."""
    saved = frames._skip_frames
    if in_c and saved is None:
        pytest.skip("balancer._scan is not built here (no C compiler at install)")
    frames._skip_frames = saved if in_c else None
    try:
        yield
    finally:
        frames._skip_frames = saved


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "python"])
def test_fast_path_matches_general_path_over_any_chunking(in_c: bool) -> None:
    @settings(max_examples=600, deadline=None)
    @given(st.booleans(), st.booleans(), st.sampled_from([100, 300, 1 << 20]), st.data())
    def check(masked: bool, with_ends: bool, limit: int, data: st.DataObject) -> None:
        stream = data.draw(stream_st(masked))
        chunks = data.draw(splits(len(stream)))
        kw = {"masked": masked, "max_frame_size": limit, "max_message_size": limit + 200}
        fast, ref = FrameScanner(**kw), FrameScanner(**kw)  # type: ignore[arg-type]
        for sc in (fast, ref):
            sc.ends = [] if with_ends else None
            sc.own_ping = b"own!"
        pos = 0
        for size in [*chunks, len(stream)]:
            chunk = stream[pos : pos + size]
            pos += len(chunk)
            assert fast.feed(chunk) == _general(ref, chunk)
            assert _state(fast) == _state(ref)

    with fast_loop(in_c):
        check()


def test_the_c_loop_is_built_where_a_compiler_is() -> None:
    """The install builds ``balancer._scan`` when it can; where it did not, wslb still runs (the
    Python loop), at about 3x the CPU per frame at saturation (docs/benchmarks.md)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the install falls back to the Python loop")
    if os.environ.get("WSLB_PURE_PYTHON"):
        pytest.skip("WSLB_PURE_PYTHON is set")
    assert frames.ACCELERATED, "balancer._scan did not build: reinstall (pip install -e .)"


def test_c_and_python_loops_agree_at_every_length_boundary() -> None:
    """Deterministic companion of the hypothesis test: frame sizes at each length-encoding and
    limit boundary, every cut near a frame edge, both loops against each other."""
    if frames._skip_frames is None:
        pytest.skip("balancer._scan is not built here")
    sizes = (0, 1, 124, 125, 126, 127, 299, 300, 301, 65535)
    for masked in (False, True):
        tok = _frame(OP_TEXT, b"t", masked)
        for size in sizes:
            mid = _frame(OP_BINARY, b"x" * size, masked)
            stream = tok + mid + tok
            edges = (0, len(tok), len(tok) + len(mid), len(stream))
            cuts = sorted({c for e in edges for c in range(e - 4, e + 5) if 0 <= c <= len(stream)})
            for limit in (125, 126, 300, 65535):
                for cut in cuts:
                    results = []
                    for in_c in (True, False):
                        with fast_loop(in_c):
                            sc = FrameScanner(
                                masked=masked, max_frame_size=limit, max_message_size=limit
                            )
                            out = sc.feed(stream[:cut]) + sc.feed(stream[cut:])
                            results.append((out, _state(sc)))
                    assert results[0] == results[1], (masked, size, limit, cut)


def test_c_loop_arguments_and_buffers() -> None:
    if frames._skip_frames is None:
        pytest.skip("balancer._scan is not built here")
    from balancer._scan import skip_frames

    tok = _frame(OP_TEXT, b"tok", True)
    data = tok * 3 + tok[:4]  # three whole frames and one cut short
    for buf in (data, bytearray(data), memoryview(data)):
        assert skip_frames(buf, 0, 0x80, 6, 1 << 20) == (3 * len(tok), 3)
    assert skip_frames(data, len(tok), 0x80, 6, 1 << 20) == (3 * len(tok), 2)
    assert skip_frames(data, 0, 0, 2, 1 << 20) == (0, 0)  # masked frames, unmasked expected
    assert skip_frames(b"", 0, 0, 2, 125) == (0, 0)
    assert skip_frames(b"\x81", 0, 0, 2, 125) == (0, 0)  # header cut short
    big = _frame(OP_BINARY, b"x" * 300, False)
    assert skip_frames(big, 0, 0, 2, 299) == (0, 0)  # over the limit: _scan's 1009
    assert skip_frames(big, 0, 0, 2, 300) == (len(big), 1)  # at the limit: passed
    assert skip_frames(big + big[:3], 0, 0, 2, 300) == (len(big), 1)
    with pytest.raises(ValueError):
        skip_frames(data, -1, 0x80, 6, 100)
    with pytest.raises(ValueError):
        skip_frames(data, 0, 0x40, 6, 100)
    with pytest.raises(TypeError):
        skip_frames("text", 0, 0x80, 6, 100)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        skip_frames(data, 0, 0x80)  # type: ignore[call-arg]


def test_fast_path_whole_frames_and_limits() -> None:
    for masked in (False, True):
        frames = [_frame(op, p, masked) for op, p in ((1, b"tok"), (2, b"x" * 126), (1, b""))]
        data = b"".join(frames)
        sc = FrameScanner(masked=masked)
        sc.ends = []
        assert sc.feed(data) is data  # no copy
        ends = [len(frames[0]), len(frames[0]) + len(frames[1]), len(data)]
        assert (sc.frames, sc.messages, sc.ends, sc.out_bytes) == (3, 3, ends, len(data))
        # One byte over a limit: the general path's 1009, after the frames before it.
        for size, limit in ((101, 100), (301, 300)):
            big = _frame(OP_TEXT, b"y" * size, masked)
            for ends in (None, []):
                sc = FrameScanner(masked=masked, max_frame_size=limit)
                sc.ends = ends
                assert sc.feed(frames[0] + big) == frames[0]
                assert sc.error is not None and sc.error.code == 1009 and sc.messages == 1
        sc = FrameScanner(masked=masked, max_message_size=100)
        assert sc.feed(big) == b""
        assert sc.error is not None and sc.error.code == 1009
        # The wrong mask bit for the direction is still a 1002.
        for ends in (None, []):
            sc = FrameScanner(masked=masked)
            sc.ends = ends
            wrong = _frame(OP_TEXT, b"t", not masked)
            assert sc.feed(frames[0] + wrong + frames[0] * 4) == frames[0]
            assert sc.error is not None and sc.error.code == 1002
