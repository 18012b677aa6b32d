"""Late binding: a new WebSocket session placed by its first message, sans I/O.

A WebSocket session is placed when its upgrade arrives, before it has said anything; its
conversation starts with its first message (a chat's system prompt and question, the Realtime
``session.update`` with its instructions, the Responses ``response.create``). In a pool whose
``prefix_placement.websocket`` is on, wslb answers a new session's upgrade itself, reads that
message, and only then chooses the worker, by the message's prompt as a keyless plain request is
chosen (``balancer.prefix``), opens the worker leg and replays what the client sent. This module
is what happens between wslb's ``101`` and the worker leg; ``aio/proxy.py`` is its shell.

States of the read (``Read``)::

    READING --first data message whole--------------------------> PLACE (its prompt, if any)
       |  \\--more than ``limit`` bytes, or the wait is over------> PLACE (no prompt)
       \\--the client's close, or a framing error-----------------> END (a close to the client)

Rules:

1. Every byte the client sends after wslb's ``101`` is kept as it came (masked frames) and
   replayed to the worker leg once it is open, so the worker sees the session from its first
   byte; nothing reaches a worker before the session is placed.
2. The bytes are decoded by wsproto's frame parser only to read the first data message: control
   frames before it (a ping) are kept and replayed like the rest. The message (text, or a
   binary message's bytes) gives the prompt (``prefix.message_prompt``); one that is not a
   prompt places the session without one.
3. The read ends with PLACE when the first data message is whole, when ``limit`` bytes are
   kept without one (what is kept is replayed, the rest streams after it), or when the shell's
   wait for it is over (``timeout``: a client that waits for the server to speak first).
4. It ends with END, and no worker leg is opened, when the client sends a close frame before
   any data message (wslb answers it with the same code) or frames that break RFC 6455 (wslb
   closes with the parser's code: 1002, 1007). Bytes after an END are not read.
5. Once wslb has sent its ``101``, a refusal can only be a close: ``refusal_close`` maps the
   status wslb would have answered (its own, or a worker's refusal of the upgrade) to a close
   code and a JSON reason.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from wsproto.frame_protocol import FrameProtocol, Opcode, ParseFailed

from balancer import prefix

__all__ = ["Outcome", "Read", "Reader", "refusal_close"]


class Read(enum.Enum):
    READING = "reading"
    PLACE = "place"
    END = "end"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the read ended: PLACE with the prompt (None: placed without one) and why, or END
    with the close wslb sends the client."""

    state: Read
    why: str  # "message", "not a prompt", "too large", "timeout"; "close", "violation"
    prompt: prefix.Prompt | None = None
    code: int = 1000
    reason: str = ""


class Reader:
    """The client's bytes between wslb's ``101`` and the worker leg (rules 1-4)."""

    def __init__(self, rules: prefix.Rules, limit: int) -> None:
        self.rules = rules
        self.limit = limit
        self.kept = bytearray()  # rule 1: every byte, as it came
        self.outcome: Outcome | None = None
        self._frames = FrameProtocol(client=False, extensions=[])
        self._message: list[str | bytes] = []

    def feed(self, data: bytes) -> Outcome | None:
        """Take what the client sent; the outcome once the read has ended (then and after)."""
        if self.outcome is not None or not data:
            return self.outcome
        self.kept += data
        self._frames.receive_bytes(data)
        try:
            for frame in self._frames.received_frames():
                if frame.opcode is Opcode.CLOSE:
                    code, reason = frame.payload if isinstance(frame.payload, tuple) else (1000, "")
                    return self._end("close", int(code), str(reason))
                if frame.opcode.iscontrol():
                    continue
                if isinstance(frame.payload, str | bytes):
                    self._message.append(frame.payload)
                if frame.message_finished:
                    return self._place_message()
        except ParseFailed as exc:
            return self._end("violation", int(exc.code), str(exc)[:120])
        if len(self.kept) > self.limit:
            return self._place(None, "too large")
        return None

    def timeout(self) -> Outcome:
        """The shell's wait for the first message is over (rule 3)."""
        if self.outcome is None:
            return self._place(None, "timeout")
        return self.outcome

    def _place_message(self) -> Outcome:
        parts = self._message
        if all(isinstance(p, str) for p in parts):
            text: str | bytes = "".join(p for p in parts if isinstance(p, str))
        else:
            text = b"".join(p if isinstance(p, bytes) else p.encode() for p in parts)
        found = prefix.message_prompt(text, self.rules)
        return self._place(found, "message" if found is not None else "not a prompt")

    def _place(self, found: prefix.Prompt | None, why: str) -> Outcome:
        self._message = []
        self.outcome = Outcome(Read.PLACE, why, found)
        return self.outcome

    def _end(self, why: str, code: int, reason: str) -> Outcome:
        if code in (1005, 1006, 1015):  # never sent on the wire: a close without a code
            code = 1000
        self.outcome = Outcome(Read.END, why, code=code, reason=reason)
        return self.outcome


def refusal_close(status: int, message: str) -> tuple[int, str]:
    """Rule 5: the close code and reason for a refusal after wslb's ``101``: a worker's or
    wslb's 4xx is a policy matter (1008), 503 "try again later" (1013), 502/504 a bad gateway
    (1014), anything else an internal error (1011). The reason is JSON with the status, cut to
    a close frame's 123 bytes."""
    if 400 <= status < 500:
        code = 1008
    elif status == 503:
        code = 1013
    elif status in (502, 504):
        code = 1014
    else:
        code = 1011
    reason = json.dumps({"status": status, "error": message}, separators=(",", ":"))
    while len(reason.encode()) > 123:
        message = message[: max(0, len(message) - 8)]
        reason = json.dumps({"status": status, "error": message}, separators=(",", ":"))
    return code, reason
