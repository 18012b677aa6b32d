"""A session's journal: what wslb relayed, folded into the conversation it can hand to a new worker.

Crash failover (docs/failover.md) needs, when a worker dies without a close, the conversation so
far, the unfinished answer up to the last token the client was sent, and the client messages the
dead worker had not acted on. wslb builds all of it from the frames it relayed; no worker help.

Sans-I/O, and cheap on the relay's hot path:

- ``worker(data)`` is called with the bytes the relay wrote to the client (whole frames and
  perhaps a frame's start); it only appends them to a buffer. ``client(data)`` does the same
  for the bytes written to the worker. Nothing is parsed there.
- The buffers are *folded* (parsed once, frame by frame, into the protocol state below, then
  dropped) when the worker buffer passes ``COMPACT_AT`` bytes, before each client message (so
  the two directions are folded in the order they were relayed), and at the crash. Each frame is
  copied once (into the buffer) and parsed once.
- Bounded: the folded state plus the raw buffers may hold ``limit`` bytes. Past that the journal
  gives up (``over``): its buffers are freed, the session is no longer saved by failover (it gets
  1011 as before) and ``transcript`` says why.

The protocol is recognised by the worker's first message: the chat protocol's ``hello``
(``wslb-chat``), the Realtime protocol's ``session.created`` (``openai-realtime``) or a
Responses event (``response.*``, or an ``error`` without an ``event_id``: ``openai-responses``,
which has no greeting); a crash before any worker message of a session whose client opened
with a Responses ``response.create`` is a Responses session too. Anything else leaves the
journal unable to build a transcript (``unknown_protocol``), and so does a stream it cannot
follow (a token out of order, a turn nobody asked for: ``lost_track``). Client messages
relayed before the protocol is known are kept and folded once it is. At most ``MAX_PENDING``
client messages may wait for the worker's answer; past that the journal could no longer pair
answers with them, so it gives up (``lost_track``) rather than guess.

The rules of the folds (docs/protocol.md sections 3, 3a, 3b and 5a):

- Chat. A valid ``prompt`` (``balancer.contract.read_prompt``: the workers' own rule) waits in
  ``pending`` until the worker starts a new turn (its first ``token`` or ``done``), which takes
  the oldest one: the answer's ``base`` is the conversation plus the prompt (``text``) or the
  prompt's ``messages``. Tokens must come in order (``i`` = the next index). ``done`` appends
  the assistant message (the token texts joined as relayed) to the conversation; an ``error``
  with a ``turn`` ends that answer and rolls the conversation back. The one ``error`` that
  refuses a valid prompt (a full queue: ``balancer.contract.queue_full``) names the turn the
  worker's last queued prompt will have (``after_turn``), so the refused prompt leaves
  ``pending`` and no later turn is paired with it. ``cancel`` marks the running answer
  cancelled.
- Realtime. The session object (``session.created``/``updated``), the items with their ids
  (``conversation.item.added``/``done``) and the running response (``response.created``,
  ``response.output_item.added``, each ``response.output_text.delta``) are tracked from the
  server's events. Each client event waits in ``pending`` until the event that answers it
  (``session.updated``, ``conversation.item.added``, ``response.created``, or an ``error``
  other than an engine's), in order. A ``response.cancel`` of the running response marks it
  cancelling; one sent while a ``response.create`` waits is answered by nothing (the worker
  cancels) or by ``response_cancel_not_active``, so an answer to a later event drops it and any
  other error answers the oldest event that is not such a cancel.
- Responses. Every client message waits in ``pending`` until the worker answers it, in order:
  with ``response.created`` (a ``response.create`` it accepted: the running response's
  conversation is the last response's, when ``previous_response_id`` names it, plus the
  request's ``input``) or with an ``error`` of type ``invalid_request_error``. The running
  response's output item, deltas and ``sequence_number`` are tracked; ``response.completed``
  or ``.incomplete`` makes it the last response (its conversation plus the deltas joined),
  ``response.failed`` leaves the last one as it was. A response continuing one this journal
  did not relay (from an earlier connection) is ``lost_track``.

``transcript`` gives the open transcript state (``"v": 2``) that every worker's ``thaw`` accepts,
with the Realtime or Responses session snapshot (``realtime``, ``responses``) so response and
item ids continue.

``snapshot`` gives the whole journal as a JSON value (raw buffers, a partial frame and the fold
included) and ``restore`` rebuilds it: a hot restart moves a live session, its journal with it,
to a new process, where it must go on exactly as here.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import Any, TypeGuard, cast

from balancer.contract import (
    CHAT,
    PROTOCOLS,
    REALTIME,
    RESPONSES,
    TRANSCRIPT_VERSION,
    ChatPrompt,
    ProtocolError,
    read_prompt,
    rejected_after,
    shown,
)
from balancer.frames import OP_BINARY, OP_CONT, OP_TEXT, unmask

__all__ = ["COMPACT_AT", "SNAPSHOT_VERSION", "Journal", "JournalError"]

log = logging.getLogger("wslb.journal")

COMPACT_AT = 8192  # raw worker bytes that trigger a fold
# Client messages waiting for the worker's answer. A chat connection queues 16 prompts
# (balancer.contract.MAX_QUEUED_PROMPTS) and refuses more, but a client may send many before
# the worker reads them.
MAX_PENDING = 64
_ROLES = ("user", "system", "assistant")
SNAPSHOT_VERSION = 1  # of ``Journal.snapshot``; ``restore`` reads this one only


class JournalError(Exception):
    """No transcript can be built; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# -- as data: the checks ``Journal.restore`` reads a snapshot with --------------------------

_Check = tuple[Callable[[Any], bool], str]  # a test of a snapshot value, and what it must be


def _copied(value: Any) -> Any:
    """A JSON value with lists and objects of its own. The folds update their dicts in place,
    so a snapshot must not share them with the journal it describes, nor a restored journal
    with the data it was read from."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _b64(data: bytes | bytearray) -> str:
    return base64.b64encode(data).decode("ascii")


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_messages(v: object) -> bool:
    return isinstance(v, list) and all(
        isinstance(m, dict) and all(isinstance(x, str) for x in m.values()) for m in v
    )


def _nullable(check: _Check) -> _Check:
    ok, what = check
    return (lambda v: v is None or ok(v)), f"{what} or null"


_ANY: _Check = (lambda v: True, "any JSON value")
_COUNT: _Check = (_is_count, "a non-negative integer")
_FLAG: _Check = (lambda v: isinstance(v, bool), "true or false")
_STR: _Check = (lambda v: isinstance(v, str), "a string")
_STRS: _Check = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "strings")
_NUMBER: _Check = (lambda v: isinstance(v, int | float), "a number")  # as the folds take one
_OBJECT: _Check = (lambda v: isinstance(v, dict), "an object")
_MESSAGES: _Check = (_is_messages, "a list of messages (objects of strings)")
_EVENTS: _Check = (
    lambda v: isinstance(v, list) and all(e is None or isinstance(e, dict) for e in v),
    "a list of objects and nulls",
)


def _unb64(text: str, path: str) -> bytearray:
    try:
        return bytearray(base64.b64decode(text, validate=True))
    except binascii.Error:
        raise ValueError(f"journal snapshot: {path} must be base64, not {shown(text)}") from None


class _Fields:
    """One object of a journal snapshot, read with each field's type checked: a snapshot this
    code cannot read fails in ``restore``, naming the field, not at some later frame."""

    __slots__ = ("data", "path")

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            where = f": {path}" if path else ""
            raise ValueError(f"journal snapshot{where} must be an object, not {shown(data)}")
        self.data: dict[str, Any] = data
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, check: _Check) -> Any:
        if key not in self.data:
            raise ValueError(f"journal snapshot: {self.at(key)} is missing")
        value = self.data[key]
        ok, what = check
        if not ok(value):
            raise ValueError(f"journal snapshot: {self.at(key)} must be {what}, not {shown(value)}")
        return value

    def count(self, key: str) -> int:
        return cast(int, self.get(key, _COUNT))

    def flag(self, key: str) -> bool:
        return cast(bool, self.get(key, _FLAG))

    def text(self, key: str) -> str:
        return cast(str, self.get(key, _STR))

    def sub(self, key: str) -> _Fields:
        return _Fields(self.get(key, _OBJECT), self.at(key))

    def obj(self, key: str) -> _Fields | None:
        """A nested object, None for null."""
        value = self.get(key, _nullable(_OBJECT))
        return None if value is None else _Fields(value, self.at(key))

    def objs(self, key: str) -> list[_Fields]:
        value = self.get(key, (lambda v: isinstance(v, list), "a list"))
        return [_Fields(v, f"{self.at(key)}[{n}]") for n, v in enumerate(value)]

    def blob(self, key: str) -> bytearray:
        return _unb64(self.text(key), self.at(key))

    def exact(self, spec: dict[str, _Check]) -> dict[str, Any]:
        """An object a fold keeps as it is (it goes into transcripts): these fields, no other."""
        extra = self.data.keys() - spec.keys()
        if extra:
            raise ValueError(f"journal snapshot: {self.at(min(extra))} is not a known field")
        return {key: self.get(key, check) for key, check in spec.items()}


class _Stream:
    """One direction's raw frames, cut into data messages (control frames skipped)."""

    __slots__ = ("buf", "masked", "opcode", "parts")

    def __init__(self, masked: bool) -> None:
        self.buf = bytearray()
        self.masked = masked
        self.parts: list[bytes] = []  # a fragmented message's payloads so far
        self.opcode = 0

    def messages(self) -> list[tuple[int, bytes]]:
        """The complete data messages in the buffer, which keeps what is left of it."""
        buf = self.buf
        n = len(buf)
        pos = 0
        out: list[tuple[int, bytes]] = []
        masked = self.masked
        while pos + 2 <= n:
            b0 = buf[pos]
            length = buf[pos + 1] & 0x7F
            head = pos + 2
            if length == 126:
                if head + 2 > n:
                    break
                length = int.from_bytes(buf[head : head + 2], "big")
                head += 2
            elif length == 127:
                if head + 8 > n:
                    break
                length = int.from_bytes(buf[head : head + 8], "big")
                head += 8
            key = b""
            if masked:
                key = bytes(buf[head : head + 4])
                head += 4
            end = head + length
            if end > n:
                break
            opcode = b0 & 0x0F
            pos = end
            if opcode > OP_BINARY:
                continue  # ping, pong, close: not the conversation's
            payload = bytes(buf[head:end])
            if masked:
                payload = unmask(payload, key)
            fin = b0 & 0x80
            if opcode != OP_CONT:
                self.opcode = opcode
                if fin:
                    out.append((opcode, payload))
                    continue
                self.parts = [payload]
                continue
            self.parts.append(payload)
            if fin:
                out.append((self.opcode, b"".join(self.parts)))
                self.parts = []
        if pos:
            del buf[:pos]
        return out

    @property
    def size(self) -> int:
        return len(self.buf) + sum(len(p) for p in self.parts)

    def snapshot(self) -> dict[str, Any]:
        """Mid-frame too: the raw bytes not folded yet, a fragmented message's parts so far."""
        return {
            "buf": _b64(self.buf),
            "masked": self.masked,
            "parts": [_b64(p) for p in self.parts],
            "opcode": self.opcode,
        }

    @classmethod
    def restore(cls, f: _Fields, masked: bool) -> _Stream:
        if f.flag("masked") is not masked:
            raise ValueError(f"journal snapshot: {f.at('masked')} must be {str(masked).lower()}")
        s = cls(masked)
        s.buf = f.blob("buf")
        parts = f.get("parts", _STRS)
        s.parts = [bytes(_unb64(p, f"{f.at('parts')}[{n}]")) for n, p in enumerate(parts)]
        s.opcode = f.get("opcode", (lambda v: _is_count(v) and v <= OP_BINARY, "0, 1 or 2"))
        return s


def _loads(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):  # a client's 100k-deep message is not a protocol one
        return None
    return obj if isinstance(obj, dict) else None


def _decoded(
    messages: list[tuple[int, bytes]],
) -> list[tuple[int, bytes, dict[str, Any] | None]]:
    """Each message with its JSON object (None: binary, not JSON, not an object).

    One ``json.loads`` of all the text messages as one array: a token stream is hundreds of
    small objects per fold, and per call ``json.loads`` costs more than the decoding itself.
    A batch that does not parse, or parses to another count (a payload that is not one JSON
    value), is decoded message by message instead.
    """
    texts = [p for op, p in messages if op == OP_TEXT]
    objs: list[Any] | None = None
    if len(texts) > 1:
        try:
            batch = json.loads(b"[" + b",".join(texts) + b"]")
        except (ValueError, RecursionError):
            batch = None
        if isinstance(batch, list) and len(batch) == len(texts):
            objs = batch
    out: list[tuple[int, bytes, dict[str, Any] | None]] = []
    k = 0
    for op, payload in messages:
        obj: dict[str, Any] | None = None
        if op == OP_TEXT:
            if objs is None:
                obj = _loads(payload)
            else:
                value = objs[k]
                obj = value if isinstance(value, dict) else None
            k += 1
        out.append((op, payload, obj))
    return out


# ``_ChatFold.token_run``: a run of small unmasked text frames (FIN, 7-bit length), each a chat
# token as the workers write it; a JSON string without a quote, a backslash or a control
# character is its own text, so the bytes between the quotes are the token's UTF-8.
_TOKEN_RUN = re.compile(
    rb'(?:\x81[\x00-\x7d]\{"type":"token","turn":\d+,"i":\d+,"text":"[^"\\\x00-\x1f]*"\})+'
)
_RUN_TURNS = re.compile(rb'\{"type":"token","turn":(\d+),')
_RUN_IS = re.compile(rb',"i":(\d+),"text":"')
_RUN_TEXTS = re.compile(rb'"text":"([^"\\\x00-\x1f]*)"\}')


def _chars(messages: Any) -> int:
    return sum(len(m["content"]) for m in messages)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _text_of(content: object) -> str | None:
    """A chat message's content as a string (content parts' texts joined), None if invalid."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return None


def chat_prompt(obj: dict[str, Any]) -> ChatPrompt | None:
    """A chat ``prompt`` as the workers read it (``balancer.contract.read_prompt``, with the
    contract's ``max_tokens`` limit); None if a worker answers it with an error."""
    try:
        return read_prompt(obj)
    except ProtocolError:
        return None


def _overflow(pending: deque[Any]) -> str | None:
    if len(pending) < MAX_PENDING:
        return None
    return f"more than {MAX_PENDING} client messages waiting for the worker's answer"


class _Answer:
    __slots__ = ("base", "cancelled", "chars", "i", "max_tokens", "parts", "rollback", "turn")

    def __init__(
        self,
        turn: int,
        base: list[dict[str, str]],
        rollback: list[dict[str, str]],
        max_tokens: int | None,
    ) -> None:
        self.turn = turn
        self.base = base
        self.rollback = rollback
        self.max_tokens = max_tokens
        self.parts: list[str] = []
        self.chars = 0  # of the parts: the size check runs at every fold
        self.i = 0
        self.cancelled = False

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def snapshot(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """``rollback`` null: the conversation before the answer is ``messages`` (the fold's,
        as while an answer runs), which a snapshot holds once."""
        return {
            "turn": self.turn,
            "base": self.base,
            "rollback": None if self.rollback is messages else self.rollback,
            "max_tokens": self.max_tokens,
            "parts": self.parts,
            "chars": self.chars,
            "i": self.i,
            "cancelled": self.cancelled,
        }

    @classmethod
    def restore(cls, f: _Fields, messages: list[dict[str, str]]) -> _Answer:
        rollback = f.get("rollback", _nullable(_MESSAGES))
        ans = cls(
            f.count("turn"),
            f.get("base", _MESSAGES),
            messages if rollback is None else rollback,
            f.get("max_tokens", _nullable(_COUNT)),
        )
        ans.parts = f.get("parts", _STRS)
        ans.chars = f.count("chars")
        ans.i = f.count("i")
        ans.cancelled = f.flag("cancelled")
        return ans


def _prompt_json(p: ChatPrompt) -> dict[str, Any]:
    """A queued prompt, every field as it is (``ChatPrompt.to_json`` is a transcript's form,
    which a worker reads back through its checks)."""
    messages = None if p.messages is None else list(p.messages)
    return {
        "text": p.text,
        "messages": messages,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
    }


def _prompt_of(f: _Fields) -> ChatPrompt:
    text = f.get("text", _nullable(_STR))
    messages = f.get("messages", _nullable(_MESSAGES))
    if (text is None) == (messages is None):
        raise ValueError(f"journal snapshot: {f.path} must have a text or messages, not both")
    temperature = f.get("temperature", _nullable(_NUMBER))
    return ChatPrompt(
        text=text,
        messages=None if messages is None else tuple(messages),
        max_tokens=f.get("max_tokens", _nullable(_COUNT)),
        temperature=None if temperature is None else float(temperature),
    )


class _ChatFold:
    """The chat protocol's conversation as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.pending: deque[ChatPrompt] = deque()
        self.answer: _Answer | None = None
        self.turns = 0

    def client(self, obj: dict[str, Any] | None) -> str | None:
        """Fold one client message; a reason when the journal can no longer follow."""
        if obj is None:
            return None  # not JSON: the worker answers it with an error
        kind = obj.get("type")
        if kind == "prompt":
            prompt = chat_prompt(obj)
            if prompt is not None:
                why = _overflow(self.pending)
                if why is not None:
                    return why
                self.pending.append(prompt)
        elif kind == "cancel" and self.answer is not None:
            turn = obj.get("turn")
            if turn is None or turn == self.answer.turn:
                self.answer.cancelled = True
        return None

    def worker(self, obj: dict[str, Any]) -> str | None:
        """Fold one worker message; a reason when the journal lost track of the session."""
        kind = obj.get("type")
        ans = self.answer
        if kind == "token" and ans is not None:
            # The hot case, one per streamed token: the next token of the running answer.
            text = obj.get("text")
            if obj.get("turn") == ans.turn and obj.get("i") == ans.i and type(text) is str:
                ans.parts.append(text)
                ans.chars += len(text)
                ans.i += 1
                return None
        if kind == "token":
            turn, i, text = _count(obj.get("turn")), _count(obj.get("i")), obj.get("text")
            if turn is None or i is None or not isinstance(text, str):
                return "a token message without turn, i and text"
            ans = self.answer
            if ans is None or ans.turn != turn:
                why = self._start(turn)
                if why is not None:
                    return why
                ans = self.answer
                assert ans is not None
            if i != ans.i:
                return f"turn {turn}: token {i} after {ans.i - 1}"
            ans.parts.append(text)
            ans.chars += len(text)
            ans.i += 1
        elif kind == "done":
            turn = _count(obj.get("turn"))
            if turn is None:
                return "a done message without a turn"
            if self.answer is None or self.answer.turn != turn:
                why = self._start(turn)
                if why is not None:
                    return why
            ans = self.answer
            assert ans is not None
            self.messages = [*ans.base, {"role": "assistant", "content": ans.text}]
            self.answer = None
        elif kind == "error" and obj.get("turn") is not None:
            turn = _count(obj.get("turn"))
            ans = self.answer
            if ans is not None and ans.turn == turn:
                self.messages = ans.rollback
                self.answer = None
            elif turn is not None and turn > self.turns and self.pending:
                self.pending.popleft()  # the turn failed before its first token
                self.turns = turn
        elif kind == "error":
            after = rejected_after(obj)
            if after is not None:
                return self._refused(after)
        return None

    def _refused(self, after_turn: int) -> str | None:
        """The worker refused a prompt (its queue was full): the one after the prompt of turn
        ``after_turn``. ``pending`` holds, in order, the prompts of turns ``turns + 1``, ...
        (those the worker took, still to start or started unseen) and then the refused one."""
        n = after_turn - self.turns
        if not 0 <= n < len(self.pending):
            return f"a prompt refused after turn {after_turn} that wslb did not relay"
        del self.pending[n]
        return None

    def token_run(self, buf: bytearray) -> int:
        """The fast path of a token stream: the run of frames at the start of ``buf`` that are
        the running answer's next tokens, exactly as the workers write them (small text frames
        of ``{"type":"token","turn":K,"i":I,"text":"..."}`` without escapes), folded by a few
        regex passes in C instead of a JSON decode each; they leave ``buf``. Anything else
        (another message, an escape, another key order, a gap) stops the run where it is and
        goes the general way. Returns the frames folded."""
        ans = self.answer
        assert ans is not None
        run = _TOKEN_RUN.match(buf)
        if run is None:
            return 0
        frames = run.group()
        turns, indexes, texts = (
            _RUN_TURNS.findall(frames),
            _RUN_IS.findall(frames),
            _RUN_TEXTS.findall(frames),
        )
        n = len(texts)
        turn = str(ans.turn).encode()
        if not (
            n == len(turns) == len(indexes)
            and turns.count(turn) == n
            and list(map(int, indexes)) == list(range(ans.i, ans.i + n))
        ):
            return 0
        try:
            text = b"".join(texts).decode("utf-8")
        except UnicodeDecodeError:
            return 0
        ans.parts.append(text)
        ans.chars += len(text)
        ans.i += n
        del buf[: run.end()]
        return n

    def _start(self, turn: int) -> str | None:
        if turn <= self.turns:
            return f"turn {turn} after turn {self.turns}"
        if not self.pending:
            return f"turn {turn} answers no prompt wslb relayed"
        prompt = self.pending.popleft()
        before = self.messages
        if prompt.text is not None:
            base = [*before, {"role": "user", "content": prompt.text}]
        else:
            base = [dict(m) for m in prompt.messages or ()]
        self.answer = _Answer(turn, base, before, prompt.max_tokens)
        self.turns = turn
        return None

    @property
    def size(self) -> int:
        """Characters of text held (the conversation, the answer, the prompts waiting)."""
        ans = self.answer
        held = _chars(ans.base if ans is not None else self.messages)
        if ans is not None:
            held += ans.chars
        for p in self.pending:
            held += len(p.text or "") + _chars(p.messages or ())
        return held

    def transcript(self, sid: str) -> dict[str, Any]:
        ans = self.answer
        return {
            "v": TRANSCRIPT_VERSION,
            "session": sid,
            "protocol": CHAT,
            "messages": list(ans.base if ans is not None else self.messages),
            "answer": None
            if ans is None
            else {
                "turn": ans.turn,
                "i": ans.i,
                "text": ans.text,
                "max_tokens": ans.max_tokens,
                "cancelled": ans.cancelled,
            },
            "queued": [p.to_json() for p in self.pending],
            "turns": self.turns,
        }

    def snapshot(self) -> dict[str, Any]:
        ans = self.answer
        return {
            "messages": self.messages,
            "pending": [_prompt_json(p) for p in self.pending],
            "answer": None if ans is None else ans.snapshot(self.messages),
            "turns": self.turns,
        }

    @classmethod
    def restore(cls, f: _Fields) -> _ChatFold:
        fold = cls()
        fold.messages = f.get("messages", _MESSAGES)
        fold.pending = deque(_prompt_of(p) for p in f.objs("pending"))
        answer = f.obj("answer")
        fold.answer = None if answer is None else _Answer.restore(answer, fold.messages)
        fold.turns = f.count("turns")
        return fold


class _EventFold:
    """What the Realtime and Responses folds share: the client events waiting for the worker's
    answer, in order (None: a message no worker acts on, answered by an error all the same),
    and the transcript's fields of the running response and the queue."""

    def __init__(self) -> None:
        self.pending: deque[dict[str, Any] | None] = deque()
        self.responses = 0

    def silent(self, event: dict[str, Any] | None) -> bool:
        """An event the worker may answer with nothing (none of the Responses protocol's)."""
        return False

    def wait(self, obj: dict[str, Any] | None) -> str | None:
        """A client event now waits for its answer; a reason when too many already do."""
        why = _overflow(self.pending)
        if why is None:
            self.pending.append(obj)
        return why

    def answered(self, kind: str | None = None) -> dict[str, Any] | None:
        """The worker answered the oldest waiting event of type ``kind`` (None: the oldest one
        not ``silent``): it leaves ``pending``, and so do the silent ones ahead of it (had they
        an answer, it would have come first). Returns it; None if none waited."""
        pending = self.pending
        for n, event in enumerate(pending):
            if (
                not self.silent(event)
                if kind is None
                else event is not None and event.get("type") == kind
            ):
                ahead = [e for e in list(pending)[:n] if not self.silent(e)]
                rest = list(pending)[n + 1 :]
                self.pending = deque([*ahead, *rest])
                return event
        return None

    def pending_size(self) -> int:
        """The waiting events' characters, as JSON would hold them."""
        return sum(len(json.dumps(e)) for e in self.pending if e is not None)

    def answer_json(self, r: dict[str, Any] | None, text: str, cancelled: bool) -> Any:
        """A transcript's ``answer`` of the running response ``r`` (None: none runs)."""
        if r is None:
            return None
        if r["item_id"] is None:
            raise JournalError("lost_track", "a response without its output item")
        return {
            "turn": self.responses,
            "i": r["deltas"],
            "text": text,
            "max_tokens": r["max_tokens"],
            "cancelled": cancelled,
        }

    def queued(self) -> list[dict[str, Any]]:
        return [e for e in self.pending if e is not None]

    def snapshot(self) -> dict[str, Any]:
        return {"pending": list(self.pending), "responses": self.responses}

    def restore_events(self, f: _Fields) -> None:
        """The shared fields of a snapshot, into this new fold."""
        self.pending = deque(f.get("pending", _EVENTS))
        self.responses = f.count("responses")


def _is_cancel(event: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """A Realtime ``response.cancel`` the worker acts on (a malformed one gets an error)."""
    return (
        event is not None
        and event.get("type") == "response.cancel"
        and event.keys() <= {"type", "event_id", "response_id"}
        and isinstance(event.get("response_id"), str | None)
    )


class _RealtimeFold(_EventFold):
    """The Realtime protocol session as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.model: str | None = None
        self.instructions = ""
        self.max_output_tokens: int | str = "inf"
        self.items: list[dict[str, Any]] = []
        self.by_id: dict[str, dict[str, Any]] = {}
        self.response: dict[str, Any] | None = None
        self.chunks: list[str] = []
        self.events = 0

    def silent(self, event: dict[str, Any] | None) -> bool:
        # A cancel that waits: sent while a response.create did. The worker cancels that
        # response with no event, or answers response_cancel_not_active.
        return _is_cancel(event)

    def client(self, obj: dict[str, Any] | None) -> str | None:
        r = self.response
        if (
            r is not None
            and _is_cancel(obj)
            and obj.get("response_id") in (None, r["id"])
            and not self._pending("response.create")
        ):
            r["cancelling"] = True
            return None
        return self.wait(obj)

    def _pending(self, kind: str) -> bool:
        return any(e is not None and e.get("type") == kind for e in self.pending)

    def _created(self, r: dict[str, Any]) -> None:
        """``response.created``: the cancels that waited behind its ``response.create`` (up to
        the next one) are the worker's cancels of ``r`` now, as a cancel sent while it runs."""
        kept: deque[dict[str, Any] | None] = deque()
        applies = True
        for event in self.pending:
            if applies and _is_cancel(event) and event.get("response_id") in (None, r["id"]):
                r["cancelling"] = True
                continue
            if event is not None and event.get("type") == "response.create":
                applies = False
            kept.append(event)
        self.pending = kept

    def worker(self, obj: dict[str, Any]) -> str | None:
        self.events += 1
        kind = obj.get("type")
        if kind == "response.output_text.delta":
            r = self.response
            delta = obj.get("delta")
            if r is None or not isinstance(delta, str) or obj.get("response_id") != r["id"]:
                return "a delta outside the running response"
            self.chunks.append(delta)
            r["deltas"] += 1
        elif kind in ("session.created", "session.updated"):
            session = obj.get("session")
            if isinstance(session, dict):
                model = session.get("model")
                self.model = model if isinstance(model, str) else self.model
                instructions = session.get("instructions")
                if isinstance(instructions, str):
                    self.instructions = instructions
                limit = session.get("max_output_tokens")
                if limit == "inf" or _count(limit):
                    self.max_output_tokens = limit  # type: ignore[assignment]
            if kind == "session.updated":
                self.answered("session.update")
        elif kind in ("conversation.item.added", "conversation.item.done"):
            item = obj.get("item")
            if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                return f"{kind} without an item id"
            r = self.response
            if r is not None and item["id"] == r["item_id"]:
                return None  # the running response's own item (added with it)
            why = self._item(item)
            if why is not None:
                return why
            if kind == "conversation.item.added":
                self.answered("conversation.item.create")
        elif kind == "response.created":
            response = obj.get("response")
            if not isinstance(response, dict) or not isinstance(response.get("id"), str):
                return "response.created without a response id"
            self.responses += 1
            limit = response.get("max_output_tokens", "inf")
            metadata = response.get("metadata")
            self.response = {
                "id": response["id"],
                "item_id": None,
                "max_output_tokens": limit,
                "max_tokens": limit if _count(limit) else None,
                "limited": limit != "inf",
                "metadata": metadata if isinstance(metadata, dict) else None,
                "text": "",
                "deltas": 0,
                "cancelling": False,
            }
            self.chunks = []
            self.answered("response.create")
            self._created(self.response)
        elif kind == "response.output_item.added":
            item, r = obj.get("item"), self.response
            if r is None or not isinstance(item, dict) or not isinstance(item.get("id"), str):
                return "an output item outside a response"
            r["item_id"] = item["id"]
            entry = {"id": item["id"], "role": "assistant", "content": [], "status": "in_progress"}
            self.items.append(entry)
            self.by_id[entry["id"]] = entry
        elif kind == "response.done":
            r = self.response
            if r is not None:
                done = self.by_id.get(r["item_id"] or "")
                if done is not None:
                    response = obj.get("response")
                    status = response.get("status") if isinstance(response, dict) else None
                    done["content"] = ["".join(self.chunks)]
                    done["status"] = "completed" if status == "completed" else "incomplete"
            self.response = None
            self.chunks = []
        elif kind == "error":
            error = obj.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            if code == "response_cancel_not_active":
                if self.pending and self.silent(self.pending[0]):
                    self.pending.popleft()  # else: a cancel of a response that had ended
            elif code != "engine_error":
                self.answered()
        return None

    def _item(self, item: dict[str, Any]) -> str | None:
        role = item.get("role")
        if role not in _ROLES:
            return f"item {item['id']!r} with role {role!r}"
        content = item.get("content")
        texts = [
            p["text"]
            for p in content or ()
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        status = item.get("status") if item.get("status") in ("completed", "incomplete") else None
        entry = self.by_id.get(item["id"])
        if entry is None:
            entry = {"id": item["id"], "role": role, "content": texts, "status": "completed"}
            self.items.append(entry)
            self.by_id[entry["id"]] = entry
        else:
            entry["content"] = texts
        if status is not None:
            entry["status"] = status
        return None

    @property
    def size(self) -> int:
        """Characters of text held, plus the client events waiting as JSON would hold them."""
        held = sum(len(t) for i in self.items for t in i["content"]) + len(self.instructions)
        held += sum(len(c) for c in self.chunks)
        return held + self.pending_size()

    def transcript(self, sid: str) -> dict[str, Any]:
        r = self.response
        text = "".join(self.chunks)
        answer = self.answer_json(r, text, r is not None and r["cancelling"])
        items = [
            {**i, "content": list(i["content"])}
            for i in self.items
            if r is None or i["id"] != r["item_id"]
        ]
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [{"role": i["role"], "content": "".join(i["content"])} for i in items]
        if r is not None:
            items.append(
                {"id": r["item_id"], "role": "assistant", "content": [], "status": "in_progress"}
            )
        snapshot = {
            "v": 1,
            "session": sid,
            "model": self.model,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "counters": {"events": self.events, "items": len(items), "responses": self.responses},
            "items": items,
            "response": None if r is None else {**r, "text": text},
            "unsent": [],
        }
        return {
            "v": TRANSCRIPT_VERSION,
            "session": sid,
            "protocol": REALTIME,
            "messages": messages,
            "answer": answer,
            "queued": self.queued(),
            "turns": self.responses,
            "realtime": snapshot,
        }

    def snapshot(self) -> dict[str, Any]:
        """Every field but ``by_id``, which indexes ``items`` (each id's last item)."""
        return {
            **super().snapshot(),
            "model": self.model,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "items": self.items,
            "response": self.response,
            "chunks": self.chunks,
            "events": self.events,
        }

    @classmethod
    def restore(cls, f: _Fields) -> _RealtimeFold:
        fold = cls()
        fold.restore_events(f)
        fold.model = f.get("model", _nullable(_STR))
        fold.instructions = f.text("instructions")
        fold.max_output_tokens = f.get(
            "max_output_tokens",
            (lambda v: v == "inf" or (_is_count(v) and v > 0), '"inf" or a positive integer'),
        )
        fold.items = [i.exact(_RT_ITEM) for i in f.objs("items")]
        fold.by_id = {i["id"]: i for i in fold.items}
        response = f.obj("response")
        fold.response = None if response is None else response.exact(_RT_RESPONSE)
        fold.chunks = f.get("chunks", _STRS)
        fold.events = f.count("events")
        return fold


_RT_ITEM = {"id": _STR, "role": _STR, "content": _STRS, "status": _STR}
_RT_RESPONSE = {
    "id": _STR,
    "item_id": _nullable(_STR),
    "max_output_tokens": _ANY,  # the worker's, as it sent it
    "max_tokens": _nullable(_COUNT),
    "limited": _FLAG,
    "metadata": _nullable(_OBJECT),
    "text": _STR,
    "deltas": _COUNT,
    "cancelling": _FLAG,
}


def _responses_input(value: object) -> list[dict[str, str]]:
    """A ``response.create``'s ``input`` as the workers read it (backends.protocol.responses):
    a string is one user message; items' text parts are joined, ``developer`` is ``system``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, str]] = []
    for item in value if isinstance(value, list) else ():
        if isinstance(item, dict):
            role = item.get("role")
            role = "system" if role == "developer" else role
            out.append({"role": str(role), "content": _text_of(item.get("content")) or ""})
    return out


def _is_responses_create(obj: dict[str, Any] | None) -> bool:
    """A Responses ``response.create`` (top-level fields; a Realtime one nests ``response``)."""
    return obj is not None and obj.get("type") == "response.create" and "response" not in obj


def _is_responses_event(obj: dict[str, Any], kind: str) -> bool:
    """A Responses server event: ``response.*``, or an ``error`` without the ``event_id`` every
    Realtime server event carries."""
    return kind.startswith("response.") or (kind == "error" and "event_id" not in obj)


class _ResponsesFold(_EventFold):
    """The Responses WebSocket session as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.model: str | None = None
        self.last: dict[str, Any] | None = None  # {"id", "messages"}: what may be continued
        self.response: dict[str, Any] | None = None  # the running one, as a snapshot holds it
        self.chunks: list[str] = []
        self.chars = 0

    def client(self, obj: dict[str, Any] | None) -> str | None:
        return self.wait(obj)

    def worker(self, obj: dict[str, Any]) -> str | None:
        kind = obj.get("type")
        r = self.response
        if kind == "response.output_text.delta":
            delta = obj.get("delta")
            if r is None or type(delta) is not str or obj.get("item_id") != r["item_id"]:
                return "a delta outside the running response"
            self.chunks.append(delta)
            self.chars += len(delta)
            r["deltas"] += 1
        elif kind == "response.created":
            why = self._created(obj)
            if why is not None:
                return why
            r = self.response
        elif kind == "response.output_item.added":
            item = obj.get("item")
            if r is None or not isinstance(item, dict) or not isinstance(item.get("id"), str):
                return "an output item outside a response"
            r["item_id"] = item["id"]
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            if r is not None and kind != "response.failed":
                text = "".join(self.chunks)
                self.last = {
                    "id": r["id"],
                    "messages": [*r["messages"], {"role": "assistant", "content": text}],
                }
            self.response = r = None
            self.chunks = []
            self.chars = 0
        elif kind == "error":
            error = obj.get("error")
            if isinstance(error, dict) and error.get("type") == "invalid_request_error":
                self.answered()  # the answer to the oldest client message
        if r is not None:
            seq = _count(obj.get("sequence_number"))
            if seq is not None:
                r["seq"] = seq + 1
        return None

    def _created(self, obj: dict[str, Any]) -> str | None:
        """``response.created`` answers the oldest client message, a ``response.create``."""
        resp = obj.get("response")
        if not isinstance(resp, dict) or not isinstance(resp.get("id"), str):
            return "response.created without a response id"
        request = self.answered()
        if not _is_responses_create(request):
            return "a response wslb relayed no response.create for"
        assert request is not None
        previous = resp.get("previous_response_id")
        base: list[dict[str, str]] = []
        if previous is not None:
            if self.last is None or self.last["id"] != previous:
                return f"a response continuing {previous!r}, which wslb did not relay"
            base = list(self.last["messages"])
        base += _responses_input(request.get("input"))
        model = resp.get("model")
        self.model = model if isinstance(model, str) else self.model
        limit = _count(resp.get("max_output_tokens"))
        created = resp.get("created_at")
        temperature = resp.get("temperature")
        metadata = resp.get("metadata")
        instructions = resp.get("instructions")
        stream_id = obj.get("stream_id")
        self.responses += 1
        self.response = {
            "id": resp["id"],
            "item_id": None,
            "model": model if isinstance(model, str) else "default",
            "created_at": created if isinstance(created, int | float) else 0.0,
            "instructions": instructions if isinstance(instructions, str) else None,
            "max_output_tokens": limit or None,
            "max_tokens": limit or None,
            "metadata": metadata if isinstance(metadata, dict) else None,
            "temperature": temperature if isinstance(temperature, int | float) else None,
            "previous_response_id": previous,
            "stream_id": stream_id if isinstance(stream_id, str) else None,
            "messages": base,
            "text": "",
            "deltas": 0,
            "seq": 0,
        }
        self.chunks = []
        self.chars = 0
        return None

    def _prompt(self, r: dict[str, Any]) -> list[dict[str, str]]:
        head = [{"role": "system", "content": r["instructions"]}] if r["instructions"] else []
        return head + list(r["messages"])

    @property
    def size(self) -> int:
        """Characters of text held, plus the client events waiting as JSON would hold them."""
        held = _chars(self.last["messages"]) if self.last is not None else 0
        if self.response is not None:
            held += _chars(self.response["messages"]) + self.chars
        return held + self.pending_size()

    def transcript(self, sid: str) -> dict[str, Any]:
        r = self.response
        text = "".join(self.chunks)
        answer = self.answer_json(r, text, False)
        snapshot = {
            "v": 1,
            "session": sid,
            "model": self.model,
            "counters": {"responses": self.responses, "items": self.responses},
            "last": None
            if self.last is None
            else {"id": self.last["id"], "messages": list(self.last["messages"])},
            "response": None if r is None else {**r, "messages": list(r["messages"]), "text": text},
            "unsent": [],
        }
        if r is not None:
            messages = self._prompt(r)
        else:
            messages = list(self.last["messages"]) if self.last is not None else []
        return {
            "v": TRANSCRIPT_VERSION,
            "session": sid,
            "protocol": RESPONSES,
            "messages": messages,
            "answer": answer,
            "queued": self.queued(),
            "turns": self.responses,
            "responses": snapshot,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            **super().snapshot(),
            "model": self.model,
            "last": self.last,
            "response": self.response,
            "chunks": self.chunks,
            "chars": self.chars,
        }

    @classmethod
    def restore(cls, f: _Fields) -> _ResponsesFold:
        fold = cls()
        fold.restore_events(f)
        fold.model = f.get("model", _nullable(_STR))
        last = f.obj("last")
        fold.last = None if last is None else last.exact(_RS_LAST)
        response = f.obj("response")
        fold.response = None if response is None else response.exact(_RS_RESPONSE)
        fold.chunks = f.get("chunks", _STRS)
        fold.chars = f.count("chars")
        return fold


_RS_LAST = {"id": _STR, "messages": _MESSAGES}
_RS_RESPONSE = {
    "id": _STR,
    "item_id": _nullable(_STR),
    "model": _STR,
    "created_at": _NUMBER,
    "instructions": _nullable(_STR),
    "max_output_tokens": _nullable(_COUNT),
    "max_tokens": _nullable(_COUNT),
    "metadata": _nullable(_OBJECT),
    "temperature": _nullable(_NUMBER),
    "previous_response_id": _nullable(_STR),
    "stream_id": _nullable(_STR),
    "messages": _MESSAGES,
    "text": _STR,
    "deltas": _COUNT,
    "seq": _COUNT,
}
_FOLDS: dict[str, Callable[[_Fields], _ChatFold | _RealtimeFold | _ResponsesFold]] = {
    CHAT: _ChatFold.restore,
    REALTIME: _RealtimeFold.restore,
    RESPONSES: _ResponsesFold.restore,
}


class Journal:
    """One session's journal (module docstring). ``limit``: bytes it may hold; ``sid``: the
    session's key, for the log line of a journal that gives up."""

    __slots__ = (
        "_c",
        "_early",
        "_fold",
        "_w",
        "folded",
        "limit",
        "over",
        "protocol",
        "sid",
        "trouble",
    )

    def __init__(self, limit: int, sid: str = "") -> None:
        self.limit = limit
        self.sid = sid
        self._w = _Stream(masked=False)
        self._c = _Stream(masked=True)
        self._fold: _ChatFold | _RealtimeFold | _ResponsesFold | None = None
        # Client messages folded before the protocol was known (the Responses protocol has no
        # greeting; a chat or Realtime client may write before the worker's first message).
        self._early: list[dict[str, Any] | None] = []
        self.protocol: str | None = None
        self.over = False
        self.trouble: JournalError | None = None  # why no transcript can be built
        self.folded = 0  # messages folded, both ways

    # -- the relay's calls (hot: worker) ---------------------------------------------------

    def worker(self, data: bytes) -> None:
        """Bytes the relay wrote to the client."""
        w = self._w.buf
        w += data
        if len(w) > COMPACT_AT:
            self.fold()

    def client(self, data: bytes) -> None:
        """Bytes the relay wrote (or was about to write) to the worker."""
        if self.trouble is not None:
            self._w.buf.clear()
            return
        self._fold_worker()  # first what the worker sent before this
        self._c.buf += data
        self._fold_client()
        self._check_size()

    # -- folding ---------------------------------------------------------------------------

    def fold(self) -> None:
        """Parse everything buffered into the protocol state (nothing once it cannot be used:
        the buffers are only emptied, so a stock server's stream costs a copy, no parsing)."""
        if self.trouble is not None:
            self._w.buf.clear()
            self._c.buf.clear()
            return
        self._fold_worker()
        self._fold_client()
        self._check_size()

    def _fold_worker(self) -> None:
        if not self._w.buf:
            return
        fold = self._fold
        if isinstance(fold, _ChatFold) and fold.answer is not None and not self._w.parts:
            self.folded += fold.token_run(self._w.buf)
        for _, _, obj in _decoded(self._w.messages()):
            self.folded += 1
            if self.trouble is not None:
                continue
            if self._fold is None:
                self._recognise(obj)
                if self._fold is None:
                    continue
            if obj is None:
                continue  # not JSON: the client gets it, the conversation does not change
            why = self._fold.worker(obj)
            if why is not None:
                self._lost(why)

    def _lost(self, why: str) -> None:
        """The journal can no longer follow the session: no transcript will be built."""
        self.trouble = JournalError("lost_track", why)
        self._early = []
        log.warning(
            "session %s: journal lost track (%s); a crash would end it with 1011", self.sid, why
        )

    def _fold_client(self) -> None:
        if not self._c.buf:
            return
        for opcode, payload in self._c.messages():
            self.folded += 1
            fold = self._fold
            if self.trouble is not None:
                continue
            obj = _loads(payload) if opcode == OP_TEXT else None
            if fold is None:
                if len(self._early) >= MAX_PENDING:
                    self._lost(f"more than {MAX_PENDING} client messages before the worker's first")
                else:
                    self._early.append(obj)
                continue
            why = fold.client(obj)
            if why is not None:
                self._lost(why)

    def _recognise(self, obj: dict[str, Any] | None) -> None:
        kind = obj.get("type") if obj is not None else None
        if kind == "hello":
            self.protocol, self._fold = CHAT, _ChatFold()
        elif kind == "session.created":
            self.protocol, self._fold = REALTIME, _RealtimeFold()
        elif obj is not None and isinstance(kind, str) and _is_responses_event(obj, kind):
            self.protocol, self._fold = RESPONSES, _ResponsesFold()
        else:
            self.trouble = JournalError(
                "unknown_protocol",
                "the worker's first message is neither the chat protocol's hello, the "
                "Realtime protocol's session.created nor a Responses event",
            )
            self._early = []
            return
        early, self._early = self._early, []
        for obj in early:
            why = self._fold.client(obj)
            if why is not None:
                self._lost(why)
                return

    def _check_size(self) -> None:
        if self.size > self.limit:
            self.over = True
            log.warning(
                "session %s: journal over failover.journal_limit (%d bytes); a crash would "
                "end it with 1011",
                self.sid,
                self.limit,
            )
            self.trouble = JournalError(
                "journal_over_limit",
                f"the journal passed failover.journal_limit ({self.limit} bytes)",
            )
            self._w.buf = bytearray()
            self._c.buf = bytearray()
            self._fold = None

    # -- what failover and operators see ---------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes held: raw frames not folded yet plus the folded conversation's text."""
        folded = self._fold.size if self._fold is not None else 0
        early = sum(len(json.dumps(e)) for e in self._early if e is not None)
        return self._w.size + self._c.size + folded + early

    def transcript(self, sid: str) -> dict[str, Any]:
        """The transcript state (``"v": 2``) of everything relayed so far.

        Raises:
            JournalError: over the limit, an unknown protocol, or a stream it lost track of.
        """
        self.fold()
        if self.trouble is not None:
            raise self.trouble
        if self._w.parts or self._w.buf:
            raise JournalError("mid_message", "the worker was lost in the middle of a message")
        if self._fold is None and self._early and _is_responses_create(self._early[0]):
            # A Responses session whose worker died before its first answer.
            self.protocol, self._fold = RESPONSES, _ResponsesFold()
            self._fold.pending.extend(self._early)
            self._early = []
        if self._fold is None:
            raise JournalError("unknown_protocol", "the worker sent nothing yet")
        return self._fold.transcript(sid)

    # -- as data (hot restart: the session moves to a new process) ---------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole journal as a JSON value (bytes in base64), as it is: nothing is folded,
        so a snapshot taken mid-frame holds the frame's start. ``restore`` rebuilds it; the
        value shares nothing with the journal, which goes on changing.

        Its strings are the relayed messages' as JSON decoded them, lone surrogates (a
        ``"\\ud800"`` escape) included: write it with ``json.dumps``'s default ``ensure_ascii``.
        """
        fold, trouble = self._fold, self.trouble
        data = {
            "v": SNAPSHOT_VERSION,
            "limit": self.limit,
            "sid": self.sid,
            "protocol": self.protocol,
            "over": self.over,
            "trouble": None
            if trouble is None
            else {"reason": trouble.reason, "detail": trouble.detail},
            "folded": self.folded,
            "early": self._early,
            "w": self._w.snapshot(),
            "c": self._c.snapshot(),
            "fold": None if fold is None else fold.snapshot(),
        }
        return cast(dict[str, Any], _copied(data))

    @classmethod
    def restore(cls, data: object) -> Journal:
        """The journal ``snapshot`` described, equal in every field.

        Raises:
            ValueError: not a version 1 snapshot, or a field missing or of the wrong type
                (the message names it).
        """
        f = _Fields(_copied(data), "")
        version = f.data.get("v")
        if not _is_count(version) or version != SNAPSHOT_VERSION:
            raise ValueError(
                f"journal snapshot version {shown(version)} is not the one this wslb reads "
                f"({SNAPSHOT_VERSION})"
            )
        j = cls(f.count("limit"), f.text("sid"))
        j.protocol = f.get(
            "protocol", _nullable((lambda v: v in PROTOCOLS, " or ".join(PROTOCOLS)))
        )
        j.over = f.flag("over")
        trouble = f.obj("trouble")
        if trouble is not None:
            j.trouble = JournalError(trouble.text("reason"), trouble.text("detail"))
        j.folded = f.count("folded")
        j._early = f.get("early", _EVENTS)
        j._w = _Stream.restore(f.sub("w"), masked=False)
        j._c = _Stream.restore(f.sub("c"), masked=True)
        fold = f.obj("fold")
        if fold is not None:
            if j.protocol is None:
                raise ValueError("journal snapshot: a fold without a protocol")
            j._fold = _FOLDS[j.protocol](fold)
        return j
