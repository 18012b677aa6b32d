"""Sans-I/O WebSocket frame scanner for the relay hot path.

The relay forwards frames as raw bytes: decoding and re-encoding every frame with wsproto would
cost 6-9 us per frame (docs/benchmarks.md), more than nginx spends on the whole relay. The
scanner reads only what it must to know every frame and message boundary and to enforce RFC
6455 framing.

Rules of the state machine (each direction of a session has its own scanner):

- Bytes arrive in arbitrary chunks; ``feed`` returns the bytes to forward now. The result does not
  depend on how the stream was split: a frame header (2-14 bytes) is held back until it is whole,
  then the payload of a data frame passes through as it arrives, without a copy or unmasking.
- Control frames (close, ping, pong; at most 125 payload bytes) are held until whole, because the
  relay must read them: a pong that answers wslb's own ping (payload ``own_ping``) is consumed and
  never forwarded; a close frame is validated, recorded in ``close`` and forwarded (unless
  ``drop_close`` is set), and everything after it is discarded (RFC 6455 5.5.1: no frames follow a
  close).
- Data frames are checked at their header: mask bit as the direction requires, RSV bits clear (no
  extension is ever negotiated), a known opcode, continuation only inside a fragmented message and
  a new message only outside one (1002), the frame and the message within the size limits (1009).
- The first violation sets ``error`` (a ``ProtocolError`` with its close code); the bytes before
  the offending frame are still returned, so the peer sees every valid message that preceded it.
  After an error or a close, ``feed`` returns nothing.
- ``stop()`` (the relay sent its own close into the stream) forwards nothing more either, but
  the stream is still read until the peer's close (or a violation) arrives: that answer ends the
  close handshake. What is read then is not counted in ``frames`` or ``messages``.
- ``messages`` counts complete data messages whose last byte has been returned for forwarding:
  the handoff protocol switches a session at these boundaries. With ``ends`` set to a list, the
  output offset of each message end is recorded too, so the relay can replay messages.
  ``at_frame_boundary`` tells the relay whether it may inject a frame of its own into the
  forwarded stream.

``notable`` is set whenever a close, an error or a consumed pong occurs, so the relay tests one
attribute per chunk instead of three.

``feed``'s fast loop over whole small data frames runs in C (``balancer/_scan.c``, built at
install when a compiler is there; ``ACCELERATED`` says whether it was). At saturation a read
holds hundreds of frames, and the loop in Python cost ~0.1 us per frame, most of wslb's CPU per
frame there. The Python loop stays as the fallback; ``WSLB_PURE_PYTHON`` set to anything
non-empty forces it (and keeps the relay thread off: ``aio/offload.py``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from enum import IntEnum
from typing import Any

__all__ = [
    "ACCELERATED",
    "OP_BINARY",
    "OP_CLOSE",
    "OP_CONT",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "CloseCode",
    "FrameScanner",
    "ProtocolError",
    "build_frame",
    "close_payload",
    "parse_close_payload",
    "unmask",
]

OP_CONT = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA


class CloseCode(IntEnum):
    """The close codes wslb sends or reads itself (RFC 6455 7.4.1); plain ints on the wire."""

    NORMAL = 1000
    GOING_AWAY = 1001  # shutdown, idle timeout, the other side went away
    PROTOCOL_ERROR = 1002
    NO_STATUS = 1005  # a close frame without a payload (never sent)
    INVALID_DATA = 1007  # a close reason that is not UTF-8
    POLICY = 1008  # a peer that stopped reading (backpressure)
    TOO_BIG = 1009
    INTERNAL_ERROR = 1011  # the worker was lost, a ping went unanswered
    SERVICE_RESTART = 1012  # the worker drains: reconnect (elsewhere)
    BAD_GATEWAY = 1014  # the worker broke framing


CLOSE_NO_STATUS = CloseCode.NO_STATUS
_PROTOCOL = CloseCode.PROTOCOL_ERROR  # short names for the scanner's many failure sites
_TOO_BIG = CloseCode.TOO_BIG

_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")


def _load_skip_frames() -> Callable[[bytes, int, int, int, int], tuple[int, int]] | None:
    if os.environ.get("WSLB_PURE_PYTHON"):
        return None
    try:
        from balancer._scan import skip_frames
    except ImportError:  # not built (no C compiler at install): the Python loop
        return None
    return skip_frames


_skip_frames = _load_skip_frames()
ACCELERATED = _skip_frames is not None


class ProtocolError(Exception):
    """A framing violation, carrying the close code to send (1002, 1007 or 1009)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason


def valid_close_code(code: int) -> bool:
    """Codes an endpoint may send in a close frame (RFC 6455 7.4, IANA registry, 3000-4999)."""
    return 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999


def parse_close_payload(payload: bytes) -> tuple[int, str]:
    """Return (code, reason) of a close frame payload, or raise ProtocolError.

    An empty payload means "no status" (1005), which is legal on the wire.
    """
    if not payload:
        return CLOSE_NO_STATUS, ""
    if len(payload) == 1:
        raise ProtocolError(CloseCode.PROTOCOL_ERROR, "close frame with a 1-byte payload")
    code = _U16.unpack_from(payload)[0]
    if not valid_close_code(code):
        raise ProtocolError(CloseCode.PROTOCOL_ERROR, f"invalid close code {code}")
    try:
        reason = payload[2:].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(CloseCode.INVALID_DATA, "close reason is not valid UTF-8") from None
    return code, reason


def close_payload(code: int, reason: str = "") -> bytes:
    """Encode a close payload, truncating the reason to fit a control frame."""
    raw = reason.encode("utf-8")[:123]
    while raw:
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:  # cut inside a multi-byte character
            raw = raw[:-1]
    return _U16.pack(code) + raw


def unmask(payload: bytes, key: bytes) -> bytes:
    """A masked payload in clear (masking is its own inverse, so this also masks)."""
    if not payload:
        return payload
    n = len(payload)
    k = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(k, "big")).to_bytes(n, "big")


def build_frame(
    opcode: int, payload: bytes = b"", *, mask: bool = False, fin: bool = True
) -> bytes:
    """Build one frame that wslb itself originates (pings, pongs, closes, tests).

    Frames towards a worker are masked (wslb is the client on that leg) with a fresh random key.
    """
    n = len(payload)
    head = bytearray([(0x80 if fin else 0) | opcode])
    mbit = 0x80 if mask else 0
    if n < 126:
        head.append(mbit | n)
    elif n < 65536:
        head.append(mbit | 126)
        head += _U16.pack(n)
    else:
        head.append(mbit | 127)
        head += _U64.pack(n)
    if mask:
        key = os.urandom(4)
        return bytes(head) + key + unmask(payload, key)
    return bytes(head) + payload


class FrameScanner:
    """Scan one direction of a WebSocket stream; see the module docstring for the rules.

    Args:
        masked: frames must carry a mask (client to server) or must not (server to client).
        max_frame_size: largest payload of one data frame (1009 above it).
        max_message_size: largest payload of one data message, all fragments (1009 above it).
    """

    __slots__ = (
        "_fin",
        "_held",
        "_in_message",
        "_msg_size",
        "_remaining",
        "bytes",
        "close",
        "closed",
        "drop_close",
        "ends",
        "error",
        "frames",
        "masked",
        "max_frame_size",
        "max_message_size",
        "messages",
        "muted",
        "notable",
        "out_bytes",
        "own_ping",
        "pong_received",
    )

    def __init__(
        self, *, masked: bool, max_frame_size: int = 1 << 20, max_message_size: int = 16 << 20
    ) -> None:
        self.masked = masked
        self.max_frame_size = max_frame_size
        self.max_message_size = max_message_size
        self._remaining = 0  # payload bytes of the current data frame not yet seen
        self._fin = False  # FIN bit of the data frame in progress
        self._held = b""  # an incomplete header or control frame
        self._in_message = False  # inside a fragmented data message
        self._msg_size = 0
        self.frames = 0
        self.messages = 0
        self.bytes = 0
        self.out_bytes = 0  # bytes returned for forwarding
        # When a list: the output offset (in ``out_bytes`` terms) where each data message ends,
        # so a relay can replay messages from a boundary (migration). None on the hot direction.
        self.ends: list[int] | None = None
        self.own_ping: bytes | None = None
        self.pong_received = False
        self.close: tuple[int, str] | None = None
        self.closed = False
        self.muted = False  # closed by the relay, but still reading for the peer's close
        self.drop_close = False
        self.error: ProtocolError | None = None
        self.notable = False

    @property
    def at_frame_boundary(self) -> bool:
        """True when the forwarded stream ends between frames (safe to inject a frame)."""
        return self._remaining == 0

    @property
    def at_message_boundary(self) -> bool:
        """True when the forwarded stream ends between data messages."""
        return self._remaining == 0 and not self._in_message

    @property
    def at_rest(self) -> bool:
        """Between messages with nothing held back: another relay may take the stream over
        from here (the relay thread, ``balancer/aio/offload.py``)."""
        return self._remaining == 0 and not self._in_message and not self._held

    # -- what the relay tells the scanner (it writes no field of the scanner itself) -----------

    def credit(self, frames: int, nbytes: int) -> None:
        """Count what the relay thread forwarded of this stream from rest: ``frames`` whole data
        messages of one frame each, ``nbytes`` bytes, as if ``feed`` had returned them."""
        self.frames += frames
        self.messages += frames
        self.bytes += nbytes
        self.out_bytes += nbytes

    def expect_pong(self, payload: bytes) -> None:
        """The relay sent a ping with ``payload`` the other way: consume the pong answering it."""
        self.own_ping = payload
        self.pong_received = False

    def stop(self) -> None:
        """The relay sent its own close into this stream: forward nothing more, but keep
        reading for the peer's close (its answer completes the close handshake: RFC 6455 7.1.1
        lets the server close TCP once both closes passed)."""
        if not self.closed:
            self.closed = True
            self.muted = True

    def _listen(self, data: bytes) -> None:
        """A stopped stream: scan for the peer's close (or a violation), forward nothing."""
        counts = self.frames, self.messages, self.out_bytes  # they count what is forwarded
        self.closed = False
        self._feed(data)
        self.frames, self.messages, self.out_bytes = counts
        if self.close is not None or self.error is not None:
            self.muted = False  # nothing follows a close (RFC 6455 5.5.1)
        self.closed = True

    def drop_next_close(self) -> None:
        """Consume the peer's close instead of forwarding it (the relay sends its own)."""
        self.drop_close = True

    # -- as data (a session's snapshot: hot restart, tests) ---------------------------------

    def snapshot(self) -> dict[str, object]:
        """Every field as a JSON value; ``restore`` rebuilds an equal scanner, mid-frame too."""
        err = self.error
        return {
            "masked": self.masked,
            "limits": [self.max_frame_size, self.max_message_size],
            "remaining": self._remaining,
            "fin": self._fin,
            "held": self._held.hex(),
            "in_message": self._in_message,
            "msg_size": self._msg_size,
            "counts": [self.frames, self.messages, self.bytes, self.out_bytes],
            "ends": self.ends,
            "own_ping": None if self.own_ping is None else self.own_ping.hex(),
            "pong_received": self.pong_received,
            "close": None if self.close is None else list(self.close),
            "closed": self.closed,
            "muted": self.muted,
            "drop_close": self.drop_close,
            "error": None if err is None else [err.code, err.reason],
            "notable": self.notable,
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> FrameScanner:
        """The scanner ``snapshot`` described."""
        mf, mm = data["limits"]
        sc = cls(masked=bool(data["masked"]), max_frame_size=mf, max_message_size=mm)
        sc._remaining = data["remaining"]
        sc._fin = data["fin"]
        sc._held = bytes.fromhex(data["held"])
        sc._in_message = data["in_message"]
        sc._msg_size = data["msg_size"]
        sc.frames, sc.messages, sc.bytes, sc.out_bytes = data["counts"]
        sc.ends = None if data["ends"] is None else list(data["ends"])
        sc.own_ping = None if data["own_ping"] is None else bytes.fromhex(data["own_ping"])
        sc.pong_received = data["pong_received"]
        sc.close = None if data["close"] is None else (data["close"][0], data["close"][1])
        sc.closed = data["closed"]
        sc.muted = data["muted"]
        sc.drop_close = data["drop_close"]
        err = data["error"]
        sc.error = None if err is None else ProtocolError(err[0], err[1])
        sc.notable = data["notable"]
        return sc

    def keep_message_ends(self) -> None:
        """Record where each data message ends, for replay after a migration."""
        self.ends = []

    def feed(self, data: bytes) -> bytes:
        """Scan a chunk and return the bytes to forward now (possibly empty)."""
        # Fast path (a token stream: one or more small frames per read; saturation: many).
        # Between messages, with nothing held back, whole frames that can only move counters
        # are skipped here: FIN with a text or binary opcode and RSV bits clear (first byte 0x81
        # or 0x82), the mask bit this direction requires, a 7- or 16-bit length within both size
        # limits, the frame whole in the chunk. The first frame that is anything else, and the
        # rest of the chunk, go through ``_scan``, which applies every rule; it is what ``_scan``
        # would have done with these frames, so ``feed`` and ``_feed`` (the general path alone)
        # agree on the output and on every counter, however the stream is chunked.
        if self.closed:
            if self.muted:
                self._listen(data)
            return b""
        n = len(data)
        self.bytes += n
        pos = 0
        if self._remaining:
            pos = self._finish_frame(n)
            if pos < 0:
                return data
        elif self._held:  # a header or control frame cut short: it starts the stream here
            data = self._held + data
            self._held = b""
            n = len(data)
        if self._in_message:
            return self._scan(data, pos)
        if self.masked:
            mbit = 0x80
            hlen = 6
        else:
            mbit = 0
            hlen = 2
        limit = self.max_frame_size
        if self.max_message_size < limit:
            limit = self.max_message_size
        if limit < 125:  # a 7-bit length could exceed it: let _scan check every frame
            return self._scan(data, pos)
        ends = self.ends
        count = 0
        skip = _skip_frames
        if ends is None and skip is not None:
            pos, count = skip(data, pos, mbit, hlen, limit)  # the loop below, in C
        else:
            # The hot loop's Python version (no C build), and the walk that records where each
            # message ends (client frames, migration on): a header cut short by the end of the
            # chunk stops it with ``pos`` still at its frame, which _scan then holds back.
            while pos + 2 <= n:
                b0 = data[pos]
                if b0 != 0x81 and b0 != 0x82:
                    break
                length = data[pos + 1] ^ mbit  # 128 and more: the mask bit is wrong
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
                if ends is not None:
                    ends.append(self.out_bytes + end)
                pos = end
        if count:
            self.frames += count
            self.messages += count
        if pos == n:
            self.out_bytes += n
            return data
        return self._scan(data, pos)

    def _feed(self, data: bytes) -> bytes:
        """``feed`` without its fast path: every frame header goes through ``_scan``."""
        if self.closed:
            return b""
        self.bytes += len(data)
        pos = 0
        if self._remaining:
            pos = self._finish_frame(len(data))
            if pos < 0:
                return data
        elif self._held:
            data = self._held + data
            self._held = b""
        return self._scan(data, pos)

    def _finish_frame(self, n: int) -> int:
        """Account for the next ``n`` bytes of the data frame in progress.

        Returns -1 when they are all payload (the chunk is forwarded whole), else where the
        frame ends in the chunk.
        """
        rem = self._remaining
        if rem >= n:
            self._remaining = rem - n
            if rem == n and self._fin:
                self.messages += 1
                if self.ends is not None:
                    self.ends.append(self.out_bytes + n)
            self.out_bytes += n
            return -1
        self._remaining = 0
        if self._fin:
            self.messages += 1
            if self.ends is not None:
                self.ends.append(self.out_bytes + rem)
        return rem

    def _scan(self, data: bytes, pos: int) -> bytes:
        """Scan the frames of ``data`` from ``pos`` (a frame boundary), with every rule.

        Returns the bytes of ``data`` to forward, from its start.
        """
        n = len(data)
        start = 0  # start of the segment still to be forwarded
        parts: list[bytes] | None = None
        masked = self.masked
        while pos < n:
            avail = n - pos
            if avail < 2:
                break
            b0 = data[pos]
            b1 = data[pos + 1]
            length = b1 & 0x7F
            hlen = 2
            if length == 126:
                hlen = 4
                if avail < 4:
                    break
                length = _U16.unpack_from(data, pos + 2)[0]
            elif length == 127:
                hlen = 10
                if avail < 10:
                    break
                length = _U64.unpack_from(data, pos + 2)[0]
                if length >> 63:
                    return self._fail(
                        data, start, pos, parts, _PROTOCOL, "payload length with MSB set"
                    )
            if b1 & 0x80:
                if not masked:
                    return self._fail(
                        data, start, pos, parts, _PROTOCOL, "masked frame from server"
                    )
                hlen += 4
            elif masked:
                return self._fail(data, start, pos, parts, _PROTOCOL, "unmasked frame from client")
            if avail < hlen:
                break
            if b0 & 0x70:
                return self._fail(data, start, pos, parts, _PROTOCOL, "reserved bits set")
            opcode = b0 & 0x0F
            fin = b0 & 0x80
            if opcode >= 8:
                if opcode > 10:
                    return self._fail(
                        data, start, pos, parts, _PROTOCOL, f"reserved opcode {opcode}"
                    )
                if not fin:
                    return self._fail(
                        data, start, pos, parts, _PROTOCOL, "fragmented control frame"
                    )
                if length > 125:
                    return self._fail(data, start, pos, parts, _PROTOCOL, "control frame too long")
                end = pos + hlen + length
                if end > n:
                    break
                payload = data[pos + hlen : end]
                if masked:
                    payload = unmask(payload, data[pos + hlen - 4 : pos + hlen])
                self.frames += 1
                if opcode == OP_PONG:
                    if self.own_ping is not None and payload == self.own_ping:
                        # The answer to wslb's own heartbeat: consume it (and do not count it:
                        # ``frames`` counts what is forwarded).
                        self.frames -= 1
                        self.own_ping = None
                        self.pong_received = True
                        self.notable = True
                        if parts is None:
                            parts = []
                        parts.append(data[start:pos])
                        start = end
                elif opcode == OP_CLOSE:
                    try:
                        self.close = parse_close_payload(payload)
                    except ProtocolError as exc:
                        return self._fail(data, start, pos, parts, exc.code, exc.reason)
                    self.closed = True
                    self.notable = True
                    if self.drop_close:
                        end = pos
                    return self._emit(data, start, end, parts)
                pos = end
                continue
            if opcode == OP_CONT:
                if not self._in_message:
                    return self._fail(data, start, pos, parts, _PROTOCOL, "unexpected continuation")
                size = self._msg_size + length
            elif opcode in (OP_TEXT, OP_BINARY):
                if self._in_message:
                    return self._fail(data, start, pos, parts, _PROTOCOL, "expected a continuation")
                size = length
            else:
                return self._fail(data, start, pos, parts, _PROTOCOL, f"reserved opcode {opcode}")
            if length > self.max_frame_size:
                return self._fail(data, start, pos, parts, _TOO_BIG, "frame too big")
            if size > self.max_message_size:
                return self._fail(data, start, pos, parts, _TOO_BIG, "message too big")
            self._msg_size = size
            self._in_message = not fin
            self.frames += 1
            end = pos + hlen + length
            if end <= n:
                if fin:
                    self.messages += 1
                    if self.ends is not None:
                        done = sum(map(len, parts)) if parts else 0
                        self.ends.append(self.out_bytes + done + end - start)
                pos = end
            else:
                self._remaining = end - n
                self._fin = bool(fin)
                pos = n
        if pos < n:
            self._held = data[pos:]
        return self._emit(data, start, pos, parts)

    def _emit(self, data: bytes, start: int, end: int, parts: list[bytes] | None) -> bytes:
        if parts is None:
            out = data if start == 0 and end == len(data) else data[start:end]
        else:
            parts.append(data[start:end])
            out = b"".join(parts)
        self.out_bytes += len(out)
        return out

    def _fail(
        self, data: bytes, start: int, pos: int, parts: list[bytes] | None, code: int, reason: str
    ) -> bytes:
        self.error = ProtocolError(code, reason)
        self.closed = True
        self.notable = True
        return self._emit(data, start, pos, parts)
