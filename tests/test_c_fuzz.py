"""Property-based fuzzing of the C threads' HTTP code against parsers nobody here wrote.

The C threads read HTTP with llhttp (fetched at build time, tools/llhttp_src.py) and apply their
own rules on top. The lane thread (``_offload.c``: its request rules, its response-head rewriter and
chunk re-framer) and the relay thread's chunk walk (``walk_chunks``) run for real,
on socket pairs, while hypothesis writes what a client and a worker might: sizes at every
boundary (2^31, 2^32, 2^63, 2^64; 15 to 17 hex digits), chunk extensions, trailers, obs-fold,
bare LF, Content-Length with Transfer-Encoding, two Content-Lengths, pipelined requests. The
referees are llhttp (httptools) and h11 (``tests/fuzz/referee.py``):

- a request the lane forwards parses, with both, to the method, headers and body the client sent
  (less the documented rewrites: the worker's target, wslb's own lines, hop-by-hop headers), and
  the client's bytes up to what the lane took are whole requests both referees accept; anything
  else comes back unread, byte for byte;
- a worker's answer both referees accept reaches the client with its status and body bytes
  (compared dechunked); whatever reaches the client parses, and its body holds only bytes the
  worker sent (no heap bytes, whatever the referees think of the answer);
- the relay thread forwards exactly the leading chunks its rules allow, each one llhttp accepts.

The frame scanner's C loop (``_scan.c``) is compared with frames.py's Python loop at every
chunking by tests/test_frames.py; here its entry point gets arbitrary arguments.

The example budget is fixed and the generation derandomized, so a run's length does not vary.
``tools/sanitize.sh`` runs this file against ASan/UBSan builds of the modules (CI does).
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from balancer.httpmsg import LANE_DROP
from tests.fuzz import rigs
from tests.fuzz.referee import (
    Message,
    close_delimited,
    final_response,
    h11_requests,
    h11_response,
    llhttp,
)
from tests.fuzz.sanitized import check_sanitized, sanitized_dir

_lanes: ModuleType | None
_relay: ModuleType | None
_scan: ModuleType | None
try:
    from balancer import _offload, _scan

    _lanes = _relay = _offload
except ImportError:  # no compiler at install, or not Linux
    _lanes = _relay = _scan = None

pytestmark = pytest.mark.skipif(_lanes is None, reason="the C modules are not built")

FUZZ = settings(
    max_examples=int(os.environ.get("WSLB_FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- sizes at the boundaries --------------------------------------------------------------------

BIG = (
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**68,
)


def hex_size(n: int, width: int, upper: bool) -> bytes:
    s = f"{n:X}" if upper else f"{n:x}"
    return s.rjust(width, "0").encode()


sizes_hex = st.one_of(
    st.builds(
        hex_size,
        st.one_of(st.sampled_from(BIG), st.integers(2**60, 2**64 + 16)),
        st.sampled_from((1, 15, 16, 16, 17)),
        st.booleans(),
    ),
    st.builds(
        hex_size,
        st.one_of(st.integers(0, 70), st.sampled_from((65535, 65536))),
        st.sampled_from((1, 2, 8, 9, 15, 16, 17, 20)),
        st.booleans(),
    ),
)
chunk_ext = st.sampled_from((b"", b"", b"", b";a=b", b";a", b' ;a="q"', b";\x01", b"; x=\xe9"))
line_end = st.sampled_from((b"\r\n",) * 8 + (b"\n", b"\r"))


@st.composite
def chunks(draw: st.DrawFn, limit_data: int = 40) -> bytes:
    """A chunked body: chunks (their sizes right, or at a boundary with a few bytes after),
    then mostly a last chunk with trailers."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 3))):
        data = draw(st.binary(max_size=limit_data))
        if draw(st.booleans()):  # a size that is not the data's
            size = draw(sizes_hex)
        else:
            size = hex_size(len(data), draw(st.sampled_from((1, 1, 1, 4, 15, 16, 17))), False)
        out += size + draw(chunk_ext) + draw(line_end) + data + draw(line_end)
    if draw(st.integers(0, 5)) > 0:
        out += b"0" * draw(st.integers(1, 17)) + draw(chunk_ext) + b"\r\n"
        for _ in range(draw(st.integers(0, 2))):
            out += draw(st.sampled_from((b"X-T: 1", b"X-T: a\r\n b", b"Bad Name: 1", b"X-T:\xe9")))
            out += draw(line_end)
        out += b"\r\n"
    return bytes(out)


# -- client requests ----------------------------------------------------------------------------

TAKEN_LINES = (  # a request with only these (and its Host) is the lane's
    b"User-Agent: ua/1.0",
    b"user-AGENT:   spaced  ",
    b"X-Session-Id: k1",
    b"X-Session-Id: k2",
    b"Connection: keep-alive",
    b"Content-Type: application/json",
    b"Keep-Alive: 5",
    b"TE: trailers",
    b"X-Empty:",
    b"X-Obs: caf\xe9",
    b"X-Tab:\tv\t",
    b"X-WSLB-Resume: t",
    b"Accept: */*",
)
REQUEST_LINES = (  # and any of these may make it the event loop's
    b"Connection: close",
    b"Connection: Upgrade",
    b"Upgrade: websocket",
    b"Expect: 100-continue",
    b"X-Forwarded-For: 10.0.0.1",
    b"Cookie: a=b",
    b"X-Folded: a\r\n b",  # obs-fold
    b"X-Space : 1",
    b"X-Ctl: a\x01b",
    b"X-Del: a\x7fb",
    b"Transfer-Encoding: chunked",
)
CONTENT_LENGTHS = (
    b"+5",
    b"-1",
    b"5 5",
    b"0x10",
    b"",
    b"00000000000000000005",
    *(str(n).encode() for n in (*BIG, 10**18 - 1, 10**18, 10**19)),
)


@st.composite
def request(draw: st.DrawFn) -> bytes:
    method = draw(
        st.sampled_from(
            (b"GET",) * 4 + (b"POST",) * 3 + (b"PUT", b"DELETE", b"get", b"M-SEARCH", b"X" * 17)
        )
    )
    target = draw(st.sampled_from((rigs.TARGET,) * 16 + (b"/t?x=1", b"/other", b"/t/", b"*")))
    version = draw(st.sampled_from((b"HTTP/1.1",) * 20 + (b"HTTP/1.0", b"HTTP/1.2")))
    lines = [b"Host: " + rigs.HOST] * draw(st.sampled_from((1,) * 10 + (0, 2)))
    lines += draw(st.lists(st.sampled_from(TAKEN_LINES), max_size=4))
    if draw(st.integers(0, 3)) == 3:  # (hypothesis leans to 0: the plain request)
        lines.append(draw(st.sampled_from(REQUEST_LINES)))
    body = draw(st.binary(max_size=48))
    framing = draw(
        st.sampled_from(
            ("none",) * 4 + ("cl",) * 6 + ("short", "long", "odd", "odd", "dup", "two", "te")
        )
    )
    if framing == "cl":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "short":
        lines.append(b"Content-Length: %d" % max(0, len(body) - 3))
    elif framing == "long":
        lines.append(b"Content-Length: %d" % (len(body) + 3))
    elif framing == "odd":
        lines.append(b"Content-Length: " + draw(st.sampled_from(CONTENT_LENGTHS)))
    elif framing == "dup":
        lines += [b"Content-Length: %d" % len(body)] * 2
    elif framing == "two":
        lines += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif framing == "te":
        lines.append(b"Transfer-Encoding: chunked")
        body = draw(chunks())
    else:
        body = b""
    lines = draw(st.permutations(lines))
    ends = [draw(line_end) if draw(st.integers(0, 29)) == 29 else b"\r\n" for _ in lines]
    head = method + b" " + target + b" " + version + b"\r\n"
    head += b"".join(line + end for line, end in zip(lines, ends, strict=True))
    return bytes(head + b"\r\n" + body)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


# -- the lane: requests -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host() -> Iterator[rigs.LanesHost]:
    assert _lanes is not None
    check_sanitized()
    h = rigs.LanesHost(_lanes)
    yield h
    h.close()


def _lines(block: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    for line in block.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b": ")
            out.append((name, value))
    return out


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def serve_requests(rig: rigs.LaneRig, data: bytes, cuts: list[int]) -> rigs.Back:
    """The client writes ``data`` (in pieces) and its EOF; the worker answers each request it
    gets whole (h11 reads them); until the lane comes back."""
    for piece in split(data, cuts):
        rig.client.sendall(piece)
    rig.client.shutdown(socket.SHUT_WR)
    worker = h11.Connection(h11.SERVER)
    deadline = time.monotonic() + rigs.WAIT_S
    while not rig.returned():
        if time.monotonic() > deadline:
            rigs.stuck(rig.host, repr(data))
        select.select([rig.worker, rig.host.c.fileno()], [], [], 0.05)
        got = rig.read_worker()
        if got:
            worker.receive_data(got)
            while True:
                try:
                    event = worker.next_event()
                except h11.RemoteProtocolError:
                    break  # the check below says what the forwarded bytes were
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.EndOfMessage):
                    rig.worker.sendall(OK)
                    worker.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                    worker.send(h11.Data(b"ok"))
                    worker.send(h11.EndOfMessage())
                    worker.start_next_cycle()
        rig.host.poll(0)
    back = rig.wait_returned(repr(data))
    rig.read_worker()
    return back


def expected_headers(sent: Message) -> list[tuple[bytes, bytes]]:
    """The header lines the worker gets for a client request (``_offload.c``'s rewrite)."""
    out = _lines(rigs.PRE)
    out += [(n, v) for n, v in sent.headers if n not in LANE_DROP]
    out += _lines(rigs.POST)
    lengths = [v for n, v in sent.headers if n == b"content-length"]
    if lengths:
        out.append((b"content-length", lengths[0]))
    return out


def check_requests(host: rigs.LanesHost, data: bytes, cuts: list[int]) -> None:
    assert _lanes is not None
    rig = rigs.LaneRig(host)
    try:
        back = serve_requests(rig, data, cuts)
        forwarded = bytes(rig.to_worker)
        answers = rig.client_bytes()
        unread = rig.unread_by_lane()
    finally:
        rig.close()
    by_h11 = h11_requests(forwarded, eof=False)
    assert by_h11.error is None, (forwarded, by_h11)
    sent_h11 = h11_requests(data)
    # llhttp knows a fixed list of methods (h11 and the lane take any token): it referees the
    # requests of the methods it knows.
    sent_llhttp = llhttp(data)
    by_llhttp = llhttp(forwarded)
    known = not (sent_llhttp.error or "").startswith("HttpParserInvalidMethodError")
    if known:
        assert by_llhttp.error is None and len(by_llhttp.messages) == len(by_h11.messages)
    for i, fh in enumerate(by_h11.messages):
        # Each forwarded request is one both referees read in full from the client's bytes.
        assert i < len(sent_h11.messages) and sent_h11.messages[i].head_done, (data, sent_h11)
        sent = sent_h11.messages[i]
        assert fh.method == sent.method
        assert fh.target == rigs.WORKER_TARGET
        assert fh.headers == expected_headers(sent), (fh.headers, sent.headers)
        if known:
            assert sent_llhttp.messages[i].head_done, (data, sent_llhttp)
            fl = by_llhttp.messages[i]
            assert fl.method == sent.method == sent_llhttp.messages[i].method
            assert [n for n, _ in fl.headers] == [n for n, _ in fh.headers]
            assert fl.body == fh.body
        if fh.complete:
            assert sent.complete and fh.body == sent.body
            if known:
                assert sent_llhttp.messages[i].body == sent.body
        else:  # the client's EOF in its body: the last one, cut
            assert i == len(by_h11.messages) - 1 and sent.body.startswith(fh.body)
            assert back.reason in (_lanes.CLIENT_GONE, _lanes.FAILED), back
    complete = sum(m.complete for m in by_h11.messages)
    got = llhttp(answers, response=True)
    assert got.error is None, (answers, got)
    assert len(got.complete()) >= complete
    if back.reason in (_lanes.HANDBACK, _lanes.CLIENT_EOF, _lanes.WORKER_DONE, _lanes.RETRY):
        # Nothing was lost or repeated: what the lane took is whole requests, the rest is back.
        rest = back.carry + unread
        assert data.endswith(rest), (data, back, unread)
        taken = data[: len(data) - len(rest)]
        took_h11, took_llhttp = h11_requests(taken, eof=False), llhttp(taken)
        assert len(took_h11.messages) == len(took_h11.complete()) == complete, took_h11
        if known:
            assert len(took_llhttp.messages) == len(took_llhttp.complete()) == complete


@FUZZ
@given(st.lists(request(), min_size=1, max_size=3), st.lists(st.integers(0, 1 << 16), max_size=3))
@example([b"GET /t HTTP/1.1\r\nHost: h\r\n\r\n"] * 2, [])
@example([b"POST /t HTTP/1.1\r\nHost: h\r\nContent-Length: 2147483648\r\n\r\nabc"], [])
@example([b"POST /t HTTP/1.1\r\nHost: h\r\nContent-Length: 9223372036854775808\r\n\r\n"], [])
@example([b"POST /t HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n"], [])
@example([b"GET /t HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n b\r\n\r\n"], [])
@example([b"GET /t HTTP/1.1\r\nHost: h\nX-A: 1\r\n\r\n"], [])
def test_lane_requests_against_the_referees(
    host: rigs.LanesHost, requests: list[bytes], cuts: list[int]
) -> None:
    check_requests(host, b"".join(requests), cuts)


# -- the lane: worker answers -------------------------------------------------------------------

REQUEST = b"GET " + rigs.TARGET + b" HTTP/1.1\r\nHost: " + rigs.HOST + b"\r\n\r\n"
RESPONSE_LINES = (
    b"Content-Type: text/event-stream",
    b"Content-Type: application/json",
    b"X-A: 1",
    b"Connection: keep-alive",
    b"Connection: close",
    b"Connection: x-a",
    b"Keep-Alive: timeout=5",
    b"X-Session-Id: worker",
    b"X-Obs: \xe9",
    b"Trailer: x-t",
    b"X-Folded: a\r\n b",
    b"X-Space : 1",
    b"X-Ctl: \x01",
    b"Bad Name: 1",
)


@st.composite
def response(draw: st.DrawFn) -> bytes:
    out = b""
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 2)))):
        out += draw(
            st.sampled_from(
                (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 E\r\nLink: a\r\n\r\n")
            )
        )
    version = draw(st.sampled_from((b"HTTP/1.1",) * 6 + (b"HTTP/1.0", b"HTTP/2.0")))
    status = draw(st.sampled_from((200, 200, 200, 201, 204, 206, 304, 404, 500, 599, 600)))
    reason = draw(st.sampled_from((b" OK", b" OK", b"", b" ", b" Wei\xdfrd", b" a\x01b")))
    lines = list(draw(st.lists(st.sampled_from(RESPONSE_LINES), max_size=3)))
    body = draw(st.binary(max_size=64))
    framing = draw(
        st.sampled_from(
            (
                "cl",
                "cl",
                *("chunked",) * 6,
                "close",
                "short",
                "long",
                "big",
                "odd",
                "dup",
                "two",
                "te+cl",
                "gzip",
                "te2",
            )
        )
    )
    if framing == "cl":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "short":
        lines.append(b"Content-Length: %d" % max(0, len(body) - 3))
    elif framing == "long":
        lines.append(b"Content-Length: %d" % (len(body) + 3))
    elif framing == "big":
        lines.append(b"Content-Length: %d" % draw(st.sampled_from(BIG)))
    elif framing == "odd":
        lines.append(b"Content-Length: " + draw(st.sampled_from(CONTENT_LENGTHS)))
    elif framing == "dup":
        lines += [b"Content-Length: %d" % len(body)] * 2
    elif framing == "two":
        lines += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif framing in ("chunked", "te+cl", "gzip", "te2"):
        lines.append(
            {
                "chunked": b"Transfer-Encoding: chunked",
                "te+cl": b"Transfer-Encoding: chunked\r\nContent-Length: 3",
                "gzip": b"Transfer-Encoding: gzip, chunked",
                "te2": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
            }[framing]
        )
        body = draw(chunks())
    lines = draw(st.permutations(lines))
    ends = [draw(line_end) if draw(st.integers(0, 9)) == 9 else b"\r\n" for _ in lines]
    out += version + b" %d" % status + reason + b"\r\n"
    out += b"".join(line + end for line, end in zip(lines, ends, strict=True))
    return bytes(out + b"\r\n" + body)


def subsequence(small: bytes, big: bytes) -> bool:
    it = iter(big)
    return all(c in it for c in small)


def refused_by_rule(answer: bytes) -> bool:
    """What the lane refuses (502) by its documented rules where the referees are lenient: a
    control byte in the head (RFC 9112 forbids them), a version other than HTTP/1.0 and 1.1, a
    status past 599 (RFC 9110 defines 100-599), a Content-Length of more than 18 digits (even
    where no body follows: a 204's, a 304's); and a chunk size of more than 16 hex digits, even
    zeros, which the event loop's reader refuses (httpmsg._CHUNK_SIZE) and the lane, reading
    sizes with llhttp, takes."""
    parts = answer.split(b"\r\n\r\n")
    head = b""
    for part in parts:  # the 1xx heads, then the final one
        head += part
        if not part.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")):
            break
    if any((c < 0x20 and c not in (9, 10, 13)) or c == 0x7F for c in head):
        return True
    if re.search(rb"(?i)content-length:[ \t]*\d{19}", head):
        return True
    if re.search(rb"\n[0-9A-Fa-f]{17}", answer[len(head) :]):
        return True
    return re.search(rb"HTTP/2\.0 |HTTP/1\.[01] [6-9]", head) is not None


def check_response(host: rigs.LanesHost, answer: bytes, cuts: list[int]) -> None:
    rig = rigs.LaneRig(host)
    try:
        rig.client.sendall(REQUEST)
        deadline = time.monotonic() + rigs.WAIT_S
        while b"\r\n\r\n" not in rig.to_worker:
            if time.monotonic() > deadline:
                rigs.stuck(host, "a GET (the request was not forwarded)")
            select.select([rig.worker], [], [], 0.05)
            rig.read_worker()
        for piece in split(answer, cuts):
            rig.worker.sendall(piece)
        rig.worker.shutdown(socket.SHUT_WR)
        rig.wait_returned(repr(answer))
        got = rig.client_bytes()
    finally:
        rig.close()
    seen = llhttp(got, response=True)
    assert seen.error is None, (answer, got, seen)
    mine = final_response(seen)
    assert mine is not None, (answer, got)
    by_llhttp, by_h11 = llhttp(answer, response=True), h11_response(answer)
    ref, ref2 = final_response(by_llhttp), final_response(by_h11)
    accepted = (
        ref is not None
        and ref2 is not None
        and (ref.complete or (close_delimited(ref) and by_llhttp.error is None))
        and ref2.complete
        and (ref.status, ref.body) == (ref2.status, ref2.body)
    )
    if accepted and not refused_by_rule(answer):
        assert ref is not None
        assert (mine.status, mine.body, mine.complete) == (ref.status, ref.body, True), (
            answer,
            got,
        )
    # Whatever the referees think of it: only the worker's bytes, in its order, reach the client.
    if not (mine.status == 502 and mine.body.startswith(b'{"error": ')):
        assert subsequence(mine.body, answer), (answer, got)


@FUZZ
@given(response(), st.lists(st.integers(0, 1 << 16), max_size=3))
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nabc", [])
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8000000000000000\r\nabc", [])
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000000\r\nab", [])
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100000000\r\nabc", [])
@example(b"HTTP/1.1 200 OK\r\nContent-Length: 9223372036854775808\r\n\r\nabc", [])
@example(
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nX: 1\r\n\r\n", []
)
def test_lane_answers_against_the_referees(
    host: rigs.LanesHost, answer: bytes, cuts: list[int]
) -> None:
    check_response(host, answer, cuts)


@FUZZ
@given(
    st.sampled_from((b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 404 Not Found")),
    chunks(),
    st.lists(st.integers(0, 1 << 16), max_size=3),
)
def test_lane_chunk_sizes_against_the_referees(
    host: rigs.LanesHost, status: bytes, body: bytes, cuts: list[int]
) -> None:
    """The chunk re-framer alone, behind a head it takes: sizes at every boundary."""
    head = status + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    check_response(host, head + body, cuts)


# -- the relay thread's chunk walk ----------------------------------------------------------------

CHUNK_LIMIT = 65535  # httpproxy.CHUNK_LIMIT
HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def python_walk(data: bytes, limit: int) -> tuple[int, int]:
    """Where ``walk_chunks`` must stop, and the chunks before: the leading chunks of 1 to 8 hex
    digits, no extension, a size of 1 to ``limit``, CRLF after the size and after the data."""
    pos = count = 0
    while pos < len(data):
        i = pos
        while i < len(data) and i - pos < 9 and chr(data[i]) in "0123456789abcdefABCDEF":
            i += 1
        if i - pos == 0 or i - pos > 8 or data[i : i + 2] != b"\r\n":
            return pos, count
        size = int(data[pos:i], 16)
        end = i + 2 + size + 2
        if size == 0 or size > limit or end > len(data) or data[end - 2 : end] != b"\r\n":
            return pos, count
        pos = end
        count += 1
    return pos, count


def relay_body(body: bytes, cuts: list[int]) -> tuple[bytes, bytes, bytes, int]:
    """The worker writes ``body`` (in pieces), then its EOF; what the client got, the carry, the
    bytes the thread never read, and the frames (chunks) it counted."""
    assert _relay is not None
    relay = _relay.Thread()
    wpeer, wours = socket.socketpair()
    cours, cpeer = socket.socketpair()
    try:
        handle = relay.add(wours.fileno(), cours.fileno(), CHUNK_LIMIT, False, True)
        for piece in split(body, cuts):
            wpeer.sendall(piece)
        wpeer.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + rigs.WAIT_S
        returned = False
        while not returned:
            if time.monotonic() > deadline:
                rigs.leak(relay)
                rigs.stuck(None, repr(body))
            select.select([relay.fileno()], [], [], 0.05)
            returned = any(h == handle and kind == _relay.RETURNED for h, kind in relay.events())
        carry, backlog, _, frames, _, _, _ = relay.remove(handle)
        got = rigs._read_available(cpeer) + bytes(backlog)
        rest = rigs._read_available(wours)
        return got, bytes(carry), rest, frames
    finally:
        relay.close()
        for s in (wpeer, wours, cours, cpeer):
            s.close()


@pytest.mark.skipif(_relay is None, reason="balancer._offload is not built")
@FUZZ
@given(
    st.lists(
        st.one_of(
            chunks(), st.builds(lambda n: b"%x\r\n" % n + b"c" * n + b"\r\n", st.integers(1, 300))
        ),
        max_size=6,
    ),
    st.lists(st.integers(0, 1 << 16), max_size=3),
)
@example([b"ffffffffffffffff\r\nabc\r\n"], [])
@example([b"1\r\na\r\n", b"100000000\r\nabc\r\n"], [])
@example([b"1\r\na\r\n", b"80000000\r\nabc\r\n"], [])
@example([b"0000000000000001\r\na\r\n"], [])
def test_relay_chunk_walk_against_the_referee(parts: list[bytes], cuts: list[int]) -> None:
    body = b"".join(parts)
    got, carry, rest, frames = relay_body(body, cuts)
    assert got + carry + rest == body
    assert (len(got), frames) == python_walk(body, CHUNK_LIMIT), (body, got)
    fwd = llhttp(HEAD + got, response=True)
    assert fwd.error is None, (got, fwd)
    whole = llhttp(HEAD + body, response=True)
    if got:
        assert whole.messages[0].body.startswith(fwd.messages[0].body)


# -- the frame scanner's C entry point ----------------------------------------------------------


def python_skip(data: bytes, pos: int, mbit: int, hlen: int, limit: int) -> tuple[int, int]:
    """frames.py's loop, as ``skip_frames`` must walk."""
    n, count = len(data), 0
    while pos + 2 <= n:
        if data[pos] not in (0x81, 0x82):
            break
        length = data[pos + 1] ^ mbit
        if length < 126:
            end = pos + hlen + length
        elif length == 126 and pos + 4 <= n:
            length = (data[pos + 2] << 8) | data[pos + 3]
            if length > limit:
                break
            end = pos + hlen + 2 + length
        else:
            break
        if end > n:
            break
        count += 1
        pos = end
    return pos, count


def ws_frame(b0: int, length: int, masked: bool, have: int) -> bytes:
    mbit = 0x80 if masked else 0
    if length < 126:
        head = bytes([b0, mbit | length])
    elif length < 65536:
        head = bytes([b0, mbit | 126]) + length.to_bytes(2, "big")
    else:
        head = bytes([b0, mbit | 127]) + (length % 2**64).to_bytes(8, "big")
    return head + (b"mask" if masked else b"") + b"p" * min(length, have)


@pytest.mark.skipif(_scan is None, reason="balancer._scan is not built")
@settings(FUZZ, max_examples=300)
@given(
    st.lists(
        st.builds(
            ws_frame,
            st.sampled_from((0x81, 0x82, 0x01, 0x88, 0xC1)),
            st.sampled_from((0, 1, 125, 126, 127, 300, 65535, 65536, 2**31, 2**63, 2**64 - 1)),
            st.booleans(),
            st.sampled_from((0, 3, 300)),
        ),
        max_size=5,
    ),
    st.booleans(),
    st.sampled_from((125, 126, 300, 65535, 2**31, 2**63 - 1)),
    st.integers(0, 2**63 - 1),
)
def test_scan_entry_point_at_every_cut(
    frames: list[bytes], masked: bool, limit: int, far: int
) -> None:
    assert _scan is not None
    data = b"".join(frames)
    mbit, hlen = (0x80, 6) if masked else (0, 2)
    for cut in range(len(data) + 1):
        part = data[:cut]
        for pos in {0, 1, cut}:
            assert _scan.skip_frames(part, pos, mbit, hlen, limit) == python_skip(
                part, pos, mbit, hlen, limit
            )
    # A start beyond the data (the caller's bug, not the wire's) walks nothing.
    assert _scan.skip_frames(data, len(data) + far % 4, mbit, hlen, limit)[1] == 0


def test_the_sanitized_builds_are_the_ones_tested() -> None:
    """Under tools/sanitize.sh each C module is the sanitized build (a no-op elsewhere), in
    this process and in the Python processes it starts (wslb's, by tests/procs.py)."""
    check_sanitized()
    d = sanitized_dir()
    if d is None:
        return
    code = "import balancer._offload as m, balancer._scan as s; print(m.__file__, s.__file__)"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert [Path(f).resolve().parent for f in out] == [d / "balancer"] * 2, out


# -- what the fuzzing found, by name ------------------------------------------------------------


def test_two_equal_content_lengths_of_a_worker_reach_the_client_as_one(
    host: rigs.LanesHost,
) -> None:
    """A worker's ``Content-Length: 0`` twice (RFC 9110 8.6 lets a recipient take equal ones)
    was copied twice into the client's head, which llhttp (Node's, a browser's parser) refuses
    as a duplicate; the event loop writes one, from h11's headers, and so does the lane now."""
    for n in (0, 5):
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Length: %d\r\n\r\n" % (n, n)
        check_response(host, answer + b"x" * n, [])
