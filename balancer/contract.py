"""What wslb's workers and wslb's journal agree on: the chat protocol's prompts, the queue that
holds them and the open transcript (docs/protocol.md sections 3 and 5a), each rule written once.

The journal (``balancer.journal``) pairs each turn a worker starts with the prompt it answers and
hands the prompts still waiting to the next worker on a crash. A prompt it kept that the worker
rejected would be paired with the wrong turn, or answered a second time after a failover; one it
dropped that the worker took would be lost. So the reference worker (``backends.handoff``), the
engine bridge (``backends.bridge``) and the journal decide with the same functions:
``read_prompt`` for a ``prompt`` message and a transcript's queued one, ``chat_messages`` for a
conversation, ``read_transcript`` for the fields of a transcript every worker reads alike, and
``queue_full`` / ``rejected_after`` for the one ``error`` that refuses a valid prompt.

The worker protocol's internal surface is agreed here too. Its routes live under
``RESERVED_PREFIX`` (``/wslb/``: freeze, thaw), and wslb answers every client request whose
path falls there itself (``reserved_target``, read as conservatively as any server would read
it: percent-decoded, dot segments resolved, slashes merged, any case), so none reaches a worker.
And wslb shows a worker two credentials made from the one secret they share:
the *handoff* credential (the secret itself) on its own freeze, thaw and resumed upgrade, and
the *proxied* credential (``proxied_credential``: an HMAC of a fixed label under the secret) on
everything it forwards for a client. A worker takes either on a plain upgrade or request and
only the handoff one on its internal routes, so a request that does slip through with
client-chosen parts carries nothing that opens them: two locks, each enough alone.

A core module: standard library only, no I/O. It is the one ``balancer`` module that
``backends`` imports (docs/architecture.md): wslb's workers speak wslb's contract.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, cast
from urllib.parse import unquote, urlsplit

__all__ = [
    "CHAT",
    "EVENT_PROTOCOLS",
    "MAX_QUEUED_PROMPTS",
    "MAX_TEMPERATURE",
    "MAX_TOKENS_LIMIT",
    "PROTOCOLS",
    "QUEUE_FULL",
    "REALTIME",
    "RESERVED_PREFIX",
    "RESPONSES",
    "TRANSCRIPT_VERSION",
    "ChatPrompt",
    "Msg",
    "Protocol",
    "ProtocolError",
    "StateError",
    "TranscriptHead",
    "chat_messages",
    "peer_credential",
    "proxied_credential",
    "queue_full",
    "read_prompt",
    "read_temperature",
    "read_transcript",
    "rejected_after",
    "reserved_target",
    "shown",
]

MAX_QUEUED_PROMPTS = 16
"""Prompts a chat connection queues behind the running answer; the next one is refused."""
MAX_TOKENS_LIMIT = 1_000_000
"""The largest ``max_tokens`` a prompt may ask for."""
MAX_TEMPERATURE = 2.0
TRANSCRIPT_VERSION = 2
CHAT: Final = "wslb-chat"
REALTIME: Final = "openai-realtime"
RESPONSES: Final = "openai-responses"
Protocol: TypeAlias = Literal["wslb-chat", "openai-realtime", "openai-responses"]
PROTOCOLS: tuple[Protocol, ...] = (CHAT, REALTIME, RESPONSES)
EVENT_PROTOCOLS: tuple[Protocol, ...] = (REALTIME, RESPONSES)
"""Protocols whose transcript's ``queued`` holds client events (not chat prompts)."""
QUEUE_FULL = f"too many queued prompts (at most {MAX_QUEUED_PROMPTS})"

Msg: TypeAlias = dict[str, str]

RESERVED_PREFIX: Final = "/wslb/"
"""Where a worker serves the worker protocol's internal routes; never a client's to reach."""
_RESERVED_SEGMENT: Final = RESERVED_PREFIX.strip("/")
_PEER_LABEL: Final = b"wslb peer instance v1"
_PROXIED_LABEL: Final = b"wslb proxied client traffic v1"


def reserved_target(target: str) -> bool:
    """``target`` (a request target as the client sent it) names a path under
    ``RESERVED_PREFIX`` as some server could read it: percent-decoding repeated until it
    settles, ``\\`` as ``/``, empty and ``.`` segments dropped, ``..`` resolved, the first
    segment in any case. Errs on the side of refusing: an application's own ``/WSLB/x`` or
    ``/a/../wslb`` is refused as well."""
    path = target.partition("#")[0].partition("?")[0]
    if not path.startswith("/"):  # absolute form (or a bare authority): its path
        path = urlsplit(target).path
    for _ in range(8):
        decoded = unquote(path, errors="replace")
        if decoded == path:
            break
        path = decoded
    segments: list[str] = []
    for seg in path.replace("\\", "/").split("/"):
        seg = seg.strip(" \t\x00")
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    return bool(segments) and segments[0].lower() == _RESERVED_SEGMENT


def proxied_credential(secret: str) -> str:
    """The credential wslb shows a worker on client traffic it forwards, made from the
    ``secret`` they share (module docstring): a worker that knows the secret derives it, and
    it opens no internal route."""
    mac = hmac.new(secret.encode("utf-8"), _PROXIED_LABEL, hashlib.sha256)
    return "proxied-" + mac.hexdigest()


def peer_credential(secret: str) -> str:
    """The credential one wslb instance shows another when it carries a client's resume to
    the instance holding the session (``aio/peers.py``): made from the tier's worker secret, so
    only instances that hold it forward, and it is neither the secret nor the proxied one."""
    mac = hmac.new(secret.encode("utf-8"), _PEER_LABEL, hashlib.sha256)
    return "peer-" + mac.hexdigest()


class ProtocolError(Exception):
    """A client message the worker cannot act on; its text is the ``error`` message sent."""


class StateError(ValueError):
    """A handoff state that cannot be installed; the message names the bad field."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A valid ``prompt``: ``text`` continues the held conversation, ``messages`` replaces it.

    ``max_tokens`` None: the prompt named none, so the answering worker's default applies (a
    journal cannot know it, and a failover may land on a worker with another).
    """

    text: str | None = None
    messages: tuple[Msg, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The prompt as a transcript's ``queued`` holds it (``read_prompt`` reads it back)."""
        out: dict[str, Any] = (
            {"text": self.text}
            if self.text is not None
            else {"messages": [dict(m) for m in self.messages or ()]}
        )
        out["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        return out


def read_prompt(obj: dict[str, Any], limit: int = MAX_TOKENS_LIMIT) -> ChatPrompt:
    """Validate a chat-protocol ``prompt`` message (its ``type`` is not looked at).

    Unknown keys are ignored. ``temperature`` is checked by every worker, though only the
    engine bridge passes it on, so a prompt is valid or not whichever worker gets it.

    Raises:
        ProtocolError: the message does not follow the chat protocol (docs/protocol.md).
    """
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ProtocolError("max_tokens must be a non-negative integer")
        if max_tokens > limit:
            raise ProtocolError(f"max_tokens must be at most {limit}")
    temperature = read_temperature(obj.get("temperature"), ProtocolError)
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text and has_messages:
        raise ProtocolError("a prompt takes 'text' or 'messages', not both")
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise ProtocolError("'text' must be a string")
        return ChatPrompt(text=text, max_tokens=max_tokens, temperature=temperature)
    if has_messages:
        messages = chat_messages(obj["messages"], "messages", ProtocolError, quote=True)
        return ChatPrompt(messages=tuple(messages), max_tokens=max_tokens, temperature=temperature)
    raise ProtocolError("a prompt needs 'text' or 'messages'")


def read_temperature(value: object, error: Callable[[str], Exception]) -> float | None:
    """A prompt's (or a transcript answer's) ``temperature``: null, or a number in 0..2."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_TEMPERATURE
    ):
        raise error(f"temperature must be a number in 0..{MAX_TEMPERATURE:g}")
    return float(value)


def chat_messages(
    value: object, where: str, error: Callable[[str], Exception], quote: bool = False
) -> list[Msg]:
    """Chat messages as ``{"role", "content"}`` with string content, by the rules both workers
    and the journal apply (a prompt's ``messages``, a transcript's): the role defaults to user,
    content parts' texts are joined, null content is empty. ``error`` builds what is raised,
    naming ``where`` (quoted with ``quote``, as a client field is)."""
    if not isinstance(value, list):
        raise error(f"'{where}' must be a list" if quote else f"{where} must be a list")
    out: list[Msg] = []
    for n, message in enumerate(value):
        at = f"{where}[{n}]"
        if not isinstance(message, dict):
            raise error(f"{at} must be an object")
        role = message.get("role", "user")
        if not isinstance(role, str) or not role:
            raise error(f"{at}.role must be a non-empty string")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        else:
            raise error(f"{at}.content must be a string or a list of parts")
        out.append({"role": role, "content": text})
    return out


def queue_full(after_turn: int) -> dict[str, Any]:
    """The ``error`` that refuses a valid prompt: the connection's queue is full.

    ``after_turn`` is the turn the last queued prompt will have (the session's turns started
    plus the prompts queued): the refused prompt is the one the client sent after that one.
    Without it nobody outside the worker can tell which prompt was refused, since a running
    answer may have ended (or the next begun) unseen; the journal needs exactly that.
    """
    return {"type": "error", "error": QUEUE_FULL, "after_turn": after_turn}


def rejected_after(obj: dict[str, Any]) -> int | None:
    """A worker message's ``after_turn`` when it is ``queue_full``'s error, else None."""
    after = obj.get("after_turn")
    if obj.get("type") != "error" or isinstance(after, bool) or not isinstance(after, int):
        return None
    return after if after >= 0 and "turn" not in obj else None


@dataclass(frozen=True, slots=True)
class TranscriptHead:
    """The fields of a version 2 state (the open transcript) that every worker reads alike;
    the unfinished ``answer`` (an object or None, unchecked) is each worker's own to check,
    against its model, and ``realtime`` / ``responses`` its protocol module's."""

    session: str
    protocol: Protocol
    messages: list[Msg]
    """The conversation up to the answer's prompt."""
    answer: dict[str, Any] | None
    queued: tuple[ChatPrompt, ...]
    """wslb-chat: the prompts waiting, in order."""
    events: tuple[dict[str, Any], ...]
    """openai-realtime, openai-responses: client events to act on after the resume."""
    given_turns: int | None
    realtime: object = None
    responses: object = None

    def turns(self, answer_turn: int | None) -> int:
        """Turns started: ``state.turns``, by default the answer's turn, else the assistant
        messages; the answer's turn (when there is one) must be the last one started.

        Raises:
            StateError: it is not.
        """
        turns = self.given_turns
        if turns is None:
            if answer_turn is not None:
                return answer_turn
            return sum(1 for m in self.messages if m["role"] == "assistant")
        if answer_turn is not None and answer_turn != turns:
            raise StateError("state.answer.turn must be the last turn started (state.turns)")
        return turns


def read_transcript(
    value: object,
    *,
    session: str | None = None,
    max_queued: int | None = None,
    max_tokens_limit: int = MAX_TOKENS_LIMIT,
) -> TranscriptHead:
    """Validate the shared fields of a version 2 state.

    Args:
        value: the ``state`` member of a thaw request.
        session: the session id the state must carry (the one in the thaw URL).
        max_queued: most queued prompts (or client events) the receiving worker accepts.
        max_tokens_limit: largest ``max_tokens`` of a queued prompt.

    Raises:
        StateError: the state is malformed, of another version, or for another session.
    """
    if not isinstance(value, dict):
        raise StateError("state must be an object")
    obj = cast(dict[str, Any], value)
    if obj.get("v") != TRANSCRIPT_VERSION:
        raise StateError(f"state.v must be {TRANSCRIPT_VERSION}, got {shown(obj.get('v'))}")
    sid = obj.get("session")
    if not isinstance(sid, str) or not sid:
        raise StateError("state.session must be a non-empty string")
    if session is not None and sid != session:
        raise StateError(f"state.session is {sid!r}, not {session!r}")
    protocol = obj.get("protocol")
    if protocol not in PROTOCOLS:
        raise StateError(f"state.protocol must be one of {PROTOCOLS}, got {shown(protocol)}")
    messages = chat_messages(obj.get("messages"), "state.messages", StateError)
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, dict):
        raise StateError("state.answer must be an object")
    turns = obj.get("turns")
    if turns is not None and (isinstance(turns, bool) or not isinstance(turns, int) or turns < 0):
        raise StateError("state.turns must be a non-negative integer")
    raw_queued = obj.get("queued", [])
    if not isinstance(raw_queued, list):
        raise StateError("state.queued must be a list")
    if max_queued is not None and len(raw_queued) > max_queued:
        raise StateError(f"state.queued holds more than {max_queued} prompts")
    queued: list[ChatPrompt] = []
    events: list[dict[str, Any]] = []
    for n, item in enumerate(raw_queued):
        if not isinstance(item, dict):
            raise StateError(f"state.queued[{n}] must be an object")
        if protocol in EVENT_PROTOCOLS:
            events.append(item)  # checked as the client's own events are, when acted on
            continue
        try:
            queued.append(read_prompt(item, max_tokens_limit))
        except ProtocolError as exc:
            raise StateError(f"state.queued[{n}]: {exc}") from None
    return TranscriptHead(
        sid,
        cast(Protocol, protocol),
        messages,
        answer,
        tuple(queued),
        tuple(events),
        turns,
        obj.get("realtime"),
        obj.get("responses"),
    )


def shown(value: object) -> str:
    """A client value in a message: scalars only, clipped (a deep list's repr could be huge)."""
    if value is not None and not isinstance(value, str | int | float):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
