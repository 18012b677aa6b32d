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
relayed before the protocol is known are kept (at most ``MAX_PENDING``) and folded once it is.

The rules of the folds (docs/protocol.md sections 3, 3a, 3b and 5a):

- Chat. A valid ``prompt`` (the worker's rules) waits in ``pending`` until the worker starts a
  new turn (its first ``token`` or ``done``), which takes the oldest one: the answer's ``base``
  is the conversation plus the prompt (``text``) or the prompt's ``messages``. Tokens must come
  in order (``i`` = the next index). ``done`` appends the assistant message (the token texts
  joined as relayed) to the conversation; an ``error`` with a ``turn`` ends that answer and
  rolls the conversation back. ``cancel`` marks the running answer cancelled.
- Realtime. The session object (``session.created``/``updated``), the items with their ids
  (``conversation.item.added``/``done``) and the running response (``response.created``,
  ``response.output_item.added``, each ``response.output_text.delta``) are tracked from the
  server's events. Each client event but a cancel waits in ``pending`` until the event that
  answers it (``session.updated``, ``conversation.item.added``, ``response.created``, or an
  ``error`` other than an engine's); a cancel marks the running response as cancelling.
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
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from typing import Any

from balancer.frames import OP_BINARY, OP_CONT, OP_TEXT, unmask

__all__ = ["COMPACT_AT", "Journal", "JournalError"]

log = logging.getLogger("wslb.journal")

COMPACT_AT = 8192  # raw worker bytes that trigger a fold
MAX_PENDING = 64  # client messages waiting for the worker (the workers queue at most 64)
CHAT = "wslb-chat"
REALTIME = "openai-realtime"
RESPONSES = "openai-responses"
_ROLES = ("user", "system", "assistant")


class JournalError(Exception):
    """No transcript can be built; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


def _chat_messages(value: object) -> list[dict[str, str]] | None:
    if not isinstance(value, list):
        return None
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None
        role = m.get("role", "user")
        text = _text_of(m.get("content"))
        if not isinstance(role, str) or not role or text is None:
            return None
        out.append({"role": role, "content": text})
    return out


def chat_prompt(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A chat ``prompt`` as the workers would accept it (docs/protocol.md 3), normalised to a
    transcript's queued prompt; None if a worker would answer it with an error."""
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and _count(max_tokens) is None:
        return None
    temperature = obj.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        return None
    has_text, has_messages = "text" in obj, "messages" in obj
    out: dict[str, Any]
    if has_text == has_messages:
        return None
    if has_text:
        if not isinstance(obj["text"], str):
            return None
        out = {"text": obj["text"]}
    else:
        messages = _chat_messages(obj["messages"])
        if messages is None:
            return None
        out = {"messages": messages}
    out["max_tokens"] = max_tokens
    if temperature is not None:
        out["temperature"] = temperature
    return out


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


class _ChatFold:
    """The chat protocol's conversation as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.pending: deque[dict[str, Any]] = deque()
        self.answer: _Answer | None = None
        self.turns = 0

    def client(self, obj: dict[str, Any] | None) -> None:
        if obj is None:
            return  # not JSON: the worker answers it with an error
        kind = obj.get("type")
        if kind == "prompt":
            prompt = chat_prompt(obj)
            if prompt is not None and len(self.pending) < MAX_PENDING:
                self.pending.append(prompt)
        elif kind == "cancel" and self.answer is not None:
            turn = obj.get("turn")
            if turn is None or turn == self.answer.turn:
                self.answer.cancelled = True

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
        if "text" in prompt:
            base = [*before, {"role": "user", "content": prompt["text"]}]
        else:
            base = list(prompt["messages"])
        self.answer = _Answer(turn, base, before, prompt.get("max_tokens"))
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
            held += len(p.get("text") or "") + _chars(p.get("messages") or ())
        return held

    def transcript(self, sid: str) -> dict[str, Any]:
        ans = self.answer
        return {
            "v": 2,
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
            "queued": list(self.pending),
            "turns": self.turns,
        }


class _RealtimeFold:
    """The Realtime protocol session as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.instructions = ""
        self.max_output_tokens: int | str = "inf"
        self.items: list[dict[str, Any]] = []
        self.by_id: dict[str, dict[str, Any]] = {}
        self.response: dict[str, Any] | None = None
        self.chunks: list[str] = []
        self.events = 0
        self.responses = 0
        self.pending: deque[dict[str, Any] | None] = deque()  # None: a message no worker acts on

    def client(self, obj: dict[str, Any] | None) -> None:
        running = self.response is not None and not self._pending("response.create")
        if running and obj is not None and obj.get("type") == "response.cancel":
            assert self.response is not None
            self.response["cancelling"] = True
            return
        if len(self.pending) < MAX_PENDING:
            self.pending.append(obj)

    def _pending(self, kind: str) -> bool:
        return any(e is not None and e.get("type") == kind for e in self.pending)

    def _ack(self, kind: str | None) -> None:
        """The worker answered the oldest pending client event (of ``kind``, if given)."""
        pending = self.pending
        if kind is None:
            if pending:
                pending.popleft()
            return
        for n, event in enumerate(pending):
            if event is not None and event.get("type") == kind:
                del pending[n]
                return

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
                self._ack("session.update")
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
                self._ack("conversation.item.create")
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
            self._ack("response.create")
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
            if not (isinstance(error, dict) and error.get("code") == "engine_error"):
                self._ack(None)
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
        for event in self.pending:
            if event is not None:
                held += len(json.dumps(event))
        return held

    def transcript(self, sid: str) -> dict[str, Any]:
        r = self.response
        if r is not None and r["item_id"] is None:
            raise JournalError("lost_track", "a response without its output item")
        text = "".join(self.chunks)
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
            "v": 2,
            "session": sid,
            "protocol": REALTIME,
            "messages": messages,
            "answer": None
            if r is None
            else {
                "turn": self.responses,
                "i": r["deltas"],
                "text": text,
                "max_tokens": r["max_tokens"],
                "cancelled": r["cancelling"],
            },
            "queued": [e for e in self.pending if e is not None],
            "turns": self.responses,
            "realtime": snapshot,
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


class _ResponsesFold:
    """The Responses WebSocket session as the worker holds it (module docstring)."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.last: dict[str, Any] | None = None  # {"id", "messages"}: what may be continued
        self.response: dict[str, Any] | None = None  # the running one, as a snapshot holds it
        self.chunks: list[str] = []
        self.chars = 0
        self.responses = 0
        self.pending: deque[dict[str, Any] | None] = deque()  # None: a message no worker acts on

    def client(self, obj: dict[str, Any] | None) -> None:
        if len(self.pending) < MAX_PENDING:
            self.pending.append(obj)

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
            answers = isinstance(error, dict) and error.get("type") == "invalid_request_error"
            if answers and self.pending:
                self.pending.popleft()  # the answer to the oldest client message
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
        request = self.pending.popleft() if self.pending else None
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
        for event in self.pending:
            if event is not None:
                held += len(json.dumps(event))
        return held

    def transcript(self, sid: str) -> dict[str, Any]:
        r = self.response
        if r is not None and r["item_id"] is None:
            raise JournalError("lost_track", "a response without its output item")
        text = "".join(self.chunks)
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
            "v": 2,
            "session": sid,
            "protocol": RESPONSES,
            "messages": messages,
            "answer": None
            if r is None
            else {
                "turn": self.responses,
                "i": r["deltas"],
                "text": text,
                "max_tokens": r["max_tokens"],
                "cancelled": False,
            },
            "queued": [e for e in self.pending if e is not None],
            "turns": self.responses,
            "responses": snapshot,
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
                self.trouble = JournalError("lost_track", why)
                log.warning(
                    "session %s: journal lost track (%s); a crash would end it with 1011",
                    self.sid,
                    why,
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
                if len(self._early) < MAX_PENDING:
                    self._early.append(obj)
                continue
            fold.client(obj)

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
        for early in self._early:
            self._fold.client(early)
        self._early = []

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
