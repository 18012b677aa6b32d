"""Prefix placement: a keyless plain request goes where its prompt's longest prefix likely is
cached, sans I/O.

An OpenAI-style request without a session key (the ``openai`` SDK's chat completions, Responses,
completions over HTTP) names no conversation, but its prompt does: a conversation's next turn
sends the whole history again, and conversations that share a system prompt or tool definitions
start with the same text. An engine with a prefix cache (vLLM, SGLang, llama.cpp) answers such a
prompt from its cache for as much of the prefix as it holds. This module is what wslb knows of
that, without asking the engines; ``balancer.pool`` asks it, ``aio/httpproxy.py`` hands it the
request body it buffered.

Rules:

1. *The prompt.* The text an engine would prefill is taken from the JSON body, in the order the
   engine renders it (after vLLM's ``cache_salt``, if any: the engine shares no blocks between
   salts, so neither does the table): the ``tools`` definitions (canonical JSON), then each chat
   ``messages`` entry (its role, its text parts, any other part or ``tool_calls`` as canonical
   JSON); for the Responses API ``instructions`` then each ``input`` item the same way (a string
   ``input`` is one user message); for completions the ``prompt`` string. A body that is not
   JSON or has none of these has no prompt, and is placed as any keyless request is. A WebSocket
   session's first message (late binding, ``message_prompt``) is read as such a body: the
   Realtime ``session.update`` as its session's ``tools`` and ``instructions``,
   ``conversation.item.create`` as an ``input`` of its one item, ``response.create`` as its
   ``response`` object (or the event itself: the Responses WebSocket mode), the reference
   worker's ``prompt`` event's ``text`` as a user message; so Realtime instructions and a chat's
   system message of the same text make the same blocks.
2. *Blocks.* Each segment (a message, the tools, the instructions) is cut into blocks of at most
   ``block`` bytes from its start, so a block ends at a segment's end or ``block`` bytes into it:
   a later turn, which repeats the earlier messages byte for byte and adds new ones, repeats
   their blocks exactly, however short its first turn was. Each block's hash chains all the
   bytes before it (BLAKE2b, 64 bits, keyed by nothing: the same on every instance), so equal
   hashes mean equal prefixes.
3. *The table* maps a block hash to the workers a prompt containing it was sent to, the most
   recent first (at most ``HOLDERS``), each with the number of the send that put it there. A
   placement records every block of its prompt, the deepest first, so the least recently used
   entry, evicted first once the table holds ``table_size`` blocks, is never the start of a
   live chain. Learning is from what wslb sent where: an engine keeps what it was sent until
   its own cache evicts it, which it tells only in its answers (rule 6).
4. *The match* is the longest run of the prompt's blocks, from the first, found in the table
   with a ready holder; its holders are the ready workers recorded for its deepest block. When
   the run ends where a message ends and an assistant message comes next, the match covers that
   message too: the holder generated it, and an engine keeps what it generated (so a short
   first turn with a long answer still draws its follow-up). It counts when it covers at least
   ``threshold`` of the prompt's bytes.
5. *The choice* (SGLang's and vLLM's ``cache_aware``, with a ring instead of the smallest
   tree): with ``load(b)`` the backend's counted requests and sessions per unit of effective
   weight, the pool is *imbalanced* when ``max - min > balance_abs`` and ``max > balance_rel x
   min`` over the ready backends, both at once. Imbalanced: the least loaded backend. Else a
   match that counts: its least loaded holder within its bound (``fits``). For a prompt that
   only shares a prefix with others (a new conversation on a system prompt) that is ``bound``:
   ``balance_factor`` (1.5, as SGLang's ``balance_rel``; the keys' ``hash_balance_factor`` is
   tighter) times its share of what runs, plus the square root of that (the spread of a random
   count that size), never below the share plus one; so a worker holding a popular prefix takes
   no more than its share and the margin once there are enough conversations for a share to
   mean something, and a few arrivals in a row for one prefix do not copy it onto another
   worker. What runs is the counted load less the places held for keys between turns: a
   conversation between turns holds its KV, not the engine, and a keyless one counts nowhere
   then either (under ``workers: N`` the other processes publish one count, their held places
   in it: those still count). For a conversation going on (its match ends with an answer the
   holder wrote), ``affinity_ceiling`` times the share of the counted load, as for a returning
   key, or the new conversation's bound if that is looser. The bound of a new conversation
   holds for the traffic too, not only for the load of the moment: a holder must also be within
   ``bound`` of its share of what was placed by prompt lately (``Recent``: decayed with a time
   constant of ``RECENT_S``: the new conversations, not the turns of those going on), since
   short requests leave no load to count and a popular prefix would otherwise take all of them.
   A match whose holders are all over the bound is ``bound``; no match that counts is ``ring``:
   either way (``None`` here) the caller places the prompt's *anchor* on the pool's ring with
   the bounded-load rule (at ``balance_factor``), as a key, which passes over the workers above
   their bound (both bounds for a new conversation): the chain hash of the first block boundary
   at or past ``anchor`` bytes (the whole prompt if shorter). So every instance, with no state
   shared, sends a long shared system prompt to the same worker, and a conversation's later
   turns, which start with the same bytes, follow its first.

6. *Reports.* An answer to a request placed by its prompt says how much of the prompt the
   engine found cached (``usage...cached_tokens`` over the prompt tokens, llama.cpp's
   ``timings.cache_n`` over ``cache_n + prompt_n``); as a share of the prompt's bytes, it
   agrees with the table unless a block the table had on that worker lies more than two
   blocks past it. Then the engine had evicted that block, and with it everything that
   extends it: a prefix cache finds a block only through the blocks before it (vLLM's and
   SGLang's), and llama.cpp's server would have chosen an idle slot that held more of the
   prompt. So what was sent to that worker through that block before (other conversations
   that share the prefix up to it) is taken as gone there (the block's *cut*, a number per
   holder: no walk over the table), and what does not pass through it is not touched, since
   an engine does not evict least recently used first across the board (llama.cpp's server
   reuses the slot most like the new prompt). The prompt itself, sent again, is there again.
   A report proves an eviction only against a send whose answer had ended when the request
   went (``Sent.settled``): a prompt the engine is still reading is not cached yet.
7. *Conversations across instances.* A prompt's *conversation* is the chain hash where its
   first message after the system prompt and tools ends: the same for every turn of one
   conversation, different between conversations sharing a system prompt. Each placement by
   prompt is remembered under that key in the affinity table the others read (the tier's in
   etcd in cluster mode, ``Pool.placements``; the board's under ``workers: N``,
   ``Pool.shared``), and a prompt this process's table does not know as a conversation going
   on is placed where that table says its conversation went, as one going on (rule 5): so
   turns that alternate between instances or serving processes stay on one worker, each
   one's own table and bounds notwithstanding. Between instances outside a cluster, only the
   anchor is shared (rule 5).
8. *Responses that continue another.* A Responses request naming ``previous_response_id``
   sends only its new input: the history is where that response was made, and an engine that
   stores responses (vLLM's and SGLang's servers, the reference worker) can continue it only
   there. So the ``id`` of each response an answer carries (a JSON body whose ``object`` is
   ``response``, or the last streamed event's ``response``) is remembered with the worker that
   sent it, as a key's placement is (``Pool.responded``: this process's affinity table, the
   board's under ``workers: N``, the tier's in cluster mode, for the same window), and a
   request naming it goes to that worker while it is ready, whatever its load: anywhere else
   it would fail. The first worker to name an id keeps it: a worker that names another's
   response later is not believed. An id not remembered (too old, or made through another way
   in) leaves the request placed by its prompt as any other.

Ties go to the backend first on the anchor's ring walk, so equal instances choose alike.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from balancer.backend import Backend
from balancer.config import PrefixCfg

__all__ = [
    "HOLDERS",
    "Match",
    "Prompt",
    "Report",
    "Rules",
    "Sent",
    "Table",
    "choose",
    "imbalanced",
    "message_body",
    "message_prompt",
    "prompt_of",
    "reported",
    "response_of",
    "segments",
]

HOLDERS = 4
"""Workers remembered per block (a shared system prompt spread by load sits on several)."""

_SEP = b"\x1e"  # ends a segment inside the hash, so boundaries are part of what is hashed
_ASSISTANT = "assistant\x1f"
# What comes before a conversation's first message.
_PREAMBLE = ("salt", "system", "developer", "tools")


def _opens(seg: str) -> bool:
    """Whether ``seg`` is a message that can open a conversation (rule 7): a role's, not the
    preamble's; a completions prompt (no role) is none."""
    role, sep, _ = seg.partition("\x1f")
    return bool(sep) and role.isalpha() and role not in _PREAMBLE


Rules = PrefixCfg
"""A pool's ``prefix_placement`` settings: the config's own object, one owner of the numbers."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's chained block hashes, the bytes up to the end of each, and its anchor."""

    hashes: tuple[int, ...]
    ends: tuple[int, ...]
    answers: tuple[int, ...]
    """Per block: where the assistant message right after it ends, if it ends a message that
    one follows, else 0 (rule 4)."""
    anchor: str
    """The ring key of the first block boundary at or past ``Rules.anchor`` bytes (rule 5)."""
    conversation: str | None = None
    """The key of the conversation it belongs to (rule 7): the chain hash where its first
    message after the system prompt and tools ends; None without one (a completions prompt)."""
    follows: str | None = None
    """The ``previous_response_id`` it continues (rule 8), if it names one."""

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0


@dataclass(frozen=True, slots=True)
class Match:
    """The table's longest match for a prompt: bytes covered and the ready holders (rule 4);
    ``answered``: it ends with an answer its holders wrote (a conversation going on)."""

    covered: int
    holders: tuple[str, ...]
    answered: bool = False


def _dump(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content(c: Any) -> str:
    """A message's content as text: a string, or its parts' text (other parts as JSON)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        out = []
        for part in c:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                out.append(_dump(part))
        return "\n".join(out)
    return "" if c is None else _dump(c)


def _message(m: Any) -> str:
    if not isinstance(m, dict):
        return _dump(m)
    role = m.get("role")
    if "content" not in m and role is None:  # a Responses item other than a message
        return _dump(m)
    text = f"{role}\x1f{_content(m.get('content'))}"
    extra = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m}
    return text + _dump(extra) if extra else text


def segments(body: Any) -> list[str] | None:
    """The prompt's segments in the order an engine renders them (rule 1), or None."""
    if not isinstance(body, dict):
        return None
    salt = body.get("cache_salt")  # vLLM's per-tenant cache isolation: other tenants' blocks
    out: list[str] = [f"salt\x1f{salt}"] if isinstance(salt, str) and salt else []
    tools = body.get("tools")
    if tools:
        out.append("tools\x1f" + _dump(tools))
    messages = body.get("messages")
    if isinstance(messages, list):
        out.extend(_message(m) for m in messages)
        return out if messages else None
    instructions = body.get("instructions")
    inp = body.get("input")
    if isinstance(instructions, str) or inp is not None:
        if isinstance(instructions, str):
            out.append(f"system\x1f{instructions}")
        if isinstance(inp, str):
            out.append(f"user\x1f{inp}")
        elif isinstance(inp, list):
            out.extend(_message(m) for m in inp)
        return out or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        out.append(prompt)
        return out
    return None


def prompt_of(body: bytes, rules: Rules) -> Prompt | None:
    """The prompt of a JSON request body, cut and hashed (rules 1 and 2); None without one."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    segs = segments(parsed)
    if not segs:
        return None
    return _following(cut(segs, rules), parsed)


RESPONSE_ID_MAX = 256
"""Characters: a longer ``previous_response_id`` or response ``id`` is not remembered."""


def _response_id(v: Any) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= RESPONSE_ID_MAX else None


def _following(prompt: Prompt | None, body: Any) -> Prompt | None:
    """``prompt`` with the response its body continues (rule 8), if it names one."""
    if prompt is None or not isinstance(body, dict):
        return prompt
    follows = _response_id(body.get("previous_response_id"))
    return prompt if follows is None else replace(prompt, follows=follows)


def message_body(event: Any) -> Any:
    """A WebSocket client's first message as the request body it stands for (rule 1)."""
    if not isinstance(event, dict):
        return None
    kind = event.get("type")
    if kind == "session.update":
        session = event.get("session")
        if not isinstance(session, dict):
            return None
        return {"tools": session.get("tools"), "instructions": session.get("instructions")}
    if kind == "conversation.item.create":
        return {"input": [event.get("item")]}
    if kind == "response.create":
        inner = event.get("response")
        return inner if isinstance(inner, dict) else event
    if kind == "prompt" and isinstance(event.get("text"), str) and "messages" not in event:
        return {"messages": [{"role": "user", "content": event["text"]}]}
    return event


def message_prompt(text: str | bytes, rules: Rules) -> Prompt | None:
    """The prompt of a WebSocket session's first message, cut and hashed; None without one."""
    try:
        parsed = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    body = message_body(parsed)
    segs = segments(body)
    return _following(cut(segs, rules), body) if segs else None


def cut(segs: Iterable[str], rules: Rules) -> Prompt | None:
    """Blocks and chained hashes of ``segs`` (rule 2)."""
    h = hashlib.blake2b(digest_size=8)
    hashes: list[int] = []
    ends: list[int] = []
    size = 0
    block = rules.block
    anchor: int | None = None
    answers: list[int] = []
    conversation: int | None = None
    for seg in segs:
        data = seg.encode("utf-8", "surrogatepass") + _SEP
        if seg.startswith(_ASSISTANT) and answers:
            answers[-1] = size + len(data)
        for i in range(0, len(data), block):
            answers.append(0)
            piece = data[i : i + block]
            h.update(piece)
            size += len(piece)
            hashes.append(int.from_bytes(h.copy().digest(), "big"))
            ends.append(size)
            if anchor is None and size >= rules.anchor:
                anchor = hashes[-1]
        if conversation is None and hashes and _opens(seg):
            conversation = hashes[-1]
    if not hashes:
        return None
    if anchor is None:
        anchor = hashes[-1]
    conv = None if conversation is None else f"prefix\nconversation:{conversation:016x}"
    return Prompt(tuple(hashes), tuple(ends), tuple(answers), f"prefix:{anchor:016x}", conv)


RECENT_S = 30.0
"""Seconds: the time constant of ``Recent``'s decay (about the last minute of traffic)."""


class Recent:
    """Placements by prompt per backend lately, each counting 1 and decaying with time
    constant ``RECENT_S``: the share of that traffic each backend takes (rule 5)."""

    __slots__ = ("_v",)

    def __init__(self) -> None:
        self._v: dict[str, tuple[float, float]] = {}

    def value(self, backend_id: str, now: float) -> float:
        v, at = self._v.get(backend_id, (0.0, now))
        return v * math.exp((at - now) / RECENT_S) if now > at else v

    def add(self, backend_id: str, now: float) -> None:
        self._v[backend_id] = (self.value(backend_id, now) + 1.0, now)

    def forget(self, backend_id: str) -> None:
        self._v.pop(backend_id, None)

    def fits(
        self, ready: Sequence[Backend], factor: float, now: float
    ) -> Callable[[Backend], bool]:
        """Whether one more placement keeps a backend within ``bound`` of its share of what
        was placed lately."""
        v = {b.id: self.value(b.id, now) for b in ready}
        return _within(ready, v, factor)


def bound(share: float, factor: float) -> int:
    """Rule 5's bound for new conversations on a backend whose share is ``share`` of them:
    ``factor`` times it plus its square root (the spread of a random count that size),
    never below the share plus one, rounded up."""
    at = factor * share
    return max(math.ceil(at + math.sqrt(at) - 1e-9), math.ceil(share - 1e-9) + 1)


def running_fits(ready: Sequence[Backend], factor: float) -> Callable[[Backend], bool]:
    """Whether one more request or session keeps a backend within ``bound`` of its share of
    what runs: its counted load less the places held for keys between turns (rule 5)."""
    return _within(ready, {b.id: float(b.counted - b.held) for b in ready}, factor)


def _within(
    ready: Sequence[Backend], load: dict[str, float], factor: float
) -> Callable[[Backend], bool]:
    total = sum(load.values()) + 1.0
    weights = sum(b.effective_weight for b in ready)

    def fits(b: Backend) -> bool:
        share = total * b.effective_weight / weights if weights > 0 else 0.0
        return load[b.id] + 1.0 <= bound(share, factor)

    return fits


@dataclass(frozen=True, slots=True)
class Sent:
    """One prompt's send to a backend as the table recorded it: what a report is read against
    (rule 6). ``prev``: per block, the send after which the table last had it on that backend
    (0: not there); ``settled``: the last send on that backend whose answer had ended when
    this one went (an engine caches a prompt once it has read it)."""

    backend: str
    seq: int
    settled: int
    prev: tuple[int, ...]


class Table:
    """Block hash -> the workers it was sent to, most recent first, each with the send that
    put it there and the send at or before which what extends it there is known gone; least
    recently used out past ``size`` blocks (rules 3 and 6)."""

    __slots__ = ("_flying", "_seq", "_t", "block", "size")

    def __init__(self, size: int, block: int = 256) -> None:
        self.size = size
        self.block = block
        # Per block, flat: [backend, send, cut, backend, send, cut, ...], the most recent first.
        self._t: OrderedDict[int, list[str | int]] = OrderedDict()
        self._seq = 0
        self._flying: dict[str, dict[int, None]] = {}  # per backend, its unanswered sends

    def __len__(self) -> int:
        return len(self._t)

    def learn(self, prompt: Prompt, backend_id: str, answer: bool = False) -> Sent:
        """``prompt`` was sent to ``backend_id``: record its blocks there, the deepest first.
        ``answer``: the caller reads the answer's report and ends the send with ``settle``."""
        self._seq += 1
        seq = self._seq
        t = self._t
        prev: list[int] = []
        for h in reversed(prompt.hashes):
            held = t.get(h)
            if held is None:
                t[h] = [backend_id, seq, 0]
                prev.append(0)
                continue
            if held[0] == backend_id:  # the usual: its holder again, updated in place
                prev.append(cast(int, held[1]))
                held[1] = seq
            else:
                try:
                    i = held.index(backend_id, 3)
                except ValueError:
                    prev.append(0)
                    if len(held) >= 3 * HOLDERS:
                        del held[-3:]
                    held[0:0] = (backend_id, seq, 0)
                else:
                    prev.append(cast(int, held[i + 1]))
                    cut = held[i + 2]
                    del held[i : i + 3]
                    held[0:0] = (backend_id, seq, cut)
            t.move_to_end(h)
        while len(t) > self.size:
            t.popitem(last=False)
        prev.reverse()
        flying = self._flying.setdefault(backend_id, {})
        settled = next(iter(flying), seq) - 1  # the oldest send still unanswered, or none
        if answer:
            flying[seq] = None
        return Sent(backend_id, seq, settled, tuple(prev))

    def settle(self, sent: Sent, prompt: Prompt, reported: tuple[int, int] | None) -> str | None:
        """The answer to ``sent`` ended, with the engine's ``(cached, prompt)`` tokens if it
        said them: whether the report ``agreed`` with the table or showed a block ``evicted``
        (rule 6); None without a report that can say."""
        flying = self._flying.get(sent.backend)
        if flying is not None:
            flying.pop(sent.seq, None)
        if reported is None:
            return None
        cached, total = reported
        if total <= 0 or not 0 <= cached <= total:
            return None
        # The first block surely past what the engine had: two blocks of slack for the
        # tokens-to-bytes estimate and the template's own tokens.
        i = bisect.bisect_right(prompt.ends, prompt.size * cached / total + 2 * self.block)
        if i >= len(prompt.hashes):
            return "agreed"
        was = sent.prev[i]
        if not 0 < was <= sent.settled:
            return "agreed"  # not there for the table either, or not read by the engine yet
        held = self._t.get(prompt.hashes[i])
        if held is not None:
            try:
                j = held.index(sent.backend)
            except ValueError:
                pass
            else:
                held[j + 2] = max(cast(int, held[j + 2]), sent.settled)
        return "evicted"

    def match(self, prompt: Prompt, ready: Iterable[str]) -> Match:
        """The longest run of ``prompt``'s blocks from the first with a holder in ``ready``
        not known to have lost it (rules 4 and 6)."""
        ok = set(ready)
        t = self._t
        last = -1
        at: list[str | int] = []
        below: dict[str, int] | None = None  # the cuts above ``at`` on the chain, if any
        floor: dict[str, int] = {}  # per holder, the highest cut above on the chain
        for i, h in enumerate(prompt.hashes):
            here = t.get(h)
            if here is None:
                break
            if floor:  # after a report of an eviction on this chain (rare)
                for j in range(0, len(here), 3):
                    who = cast(str, here[j])
                    if who in ok and cast(int, here[j + 1]) > floor.get(who, 0):
                        break
                else:
                    break
                last, at, below = i, here, dict(floor)
            else:
                for j in range(0, len(here), 3):
                    if here[j] in ok:
                        break
                else:
                    break
                last, at, below = i, here, None
            for j in range(2, len(here), 3):
                cut = cast(int, here[j])
                if cut and (who := cast(str, here[j - 2])) in ok and cut > floor.get(who, 0):
                    floor[who] = cut
        holders = tuple(
            who
            for j in range(0, len(at), 3)
            if (who := cast(str, at[j])) in ok
            and (below is None or cast(int, at[j + 1]) > below.get(who, 0))
        )
        if last < 0:
            return Match(0, ())
        # The holder wrote the answer that follows what it was sent: it holds that too.
        answer = prompt.answers[last]
        return Match(answer or prompt.ends[last], holders, answer > 0)

    def forget(self, backend_id: str) -> None:
        """A backend left the pool: its entries go (its id may come back as another worker)."""
        t = self._t
        for h, held in list(t.items()):
            try:
                i = held.index(backend_id)
            except ValueError:
                continue
            del held[i : i + 3]
            if not held:
                del t[h]
        self._flying.pop(backend_id, None)


class Report:
    """The end of an answer, kept to read what the engine says of its cache (rule 6): the
    last ``TAIL`` bytes, parsed once the answer has ended."""

    TAIL = 16384

    __slots__ = ("_buf", "_cut")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._cut = False

    def feed(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if len(buf) > 2 * self.TAIL:
            del buf[: len(buf) - self.TAIL]
            self._cut = True

    def _bodies(self, needle: bytes = b"") -> Iterator[Any]:
        """The answer's JSON body, or its last server-sent events' data, the last first; only
        those holding ``needle`` are parsed (a chat stream's 64 chunks are not, for an id)."""
        buf = bytes(self._buf)
        if needle not in buf:
            return
        if not self._cut and buf.lstrip()[:1] in (b"{", b"["):  # a JSON body, whole
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
                yield json.loads(buf)
            return
        for line in reversed(buf.split(b"\n")[-64:]):
            if line.startswith(b"data:") and needle in line:
                with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
                    yield json.loads(line[5:])

    def result(self) -> tuple[int, int] | None:
        """``(cached, prompt)`` tokens the answer reports, or None: a JSON body's, or the last
        server-sent event's that has them."""
        return next((got for b in self._bodies() if (got := reported(b)) is not None), None)

    def response_id(self) -> str | None:
        """The id of the response the answer carries (rule 8), or None: a JSON body's whose
        ``object`` is ``response``, or the last server-sent event's ``response``."""
        bodies = self._bodies(b'"response')
        return next((got for b in bodies if (got := response_of(b)) is not None), None)


def response_of(body: Any) -> str | None:
    """The id of a Responses object, or of the one a streamed event carries (rule 8)."""
    if not isinstance(body, dict):
        return None
    if body.get("object") == "response":
        return _response_id(body.get("id"))
    inner = body.get("response")
    if isinstance(inner, dict) and inner.get("object", "response") == "response":
        return _response_id(inner.get("id"))
    return None


def reported(body: Any) -> tuple[int, int] | None:
    """``(cached, prompt)`` tokens from an answer or event: llama.cpp's ``timings``
    (``cache_n``, ``prompt_n``), else the OpenAI ``usage`` (chat ``prompt_tokens`` with
    ``prompt_tokens_details.cached_tokens``, Responses ``input_tokens`` with
    ``input_tokens_details``, at the top or in its ``response``)."""
    if not isinstance(body, dict):
        return None
    timings = body.get("timings")
    if isinstance(timings, dict):
        cached, fresh = timings.get("cache_n"), timings.get("prompt_n")
        if type(cached) is int and type(fresh) is int:
            return cached, cached + fresh
    usage = body.get("usage")
    if not isinstance(usage, dict):
        inner = body.get("response")
        usage = inner.get("usage") if isinstance(inner, dict) else None
    if not isinstance(usage, dict):
        return None
    for total_key, details_key in (
        ("prompt_tokens", "prompt_tokens_details"),
        ("input_tokens", "input_tokens_details"),
    ):
        total, details = usage.get(total_key), usage.get(details_key)
        if type(total) is int and isinstance(details, dict):
            cached = details.get("cached_tokens")
            if type(cached) is int:
                return cached, total
    return None


def _load(b: Backend) -> float:
    return b.counted / b.effective_weight if b.effective_weight > 0 else float("inf")


def imbalanced(loads: Sequence[float], balance_abs: float, balance_rel: float) -> bool:
    """Both margins of rule 5 at once: ``max - min > abs`` and ``max > rel x min``."""
    if len(loads) < 2:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > balance_abs and hi > balance_rel * lo


def choose(
    prompt: Prompt,
    m: Match,
    ready: Sequence[Backend],
    walk: Iterable[str],
    rules: Rules,
    fits: Callable[[Backend, bool], bool] = lambda b, going_on: True,
) -> tuple[Backend | None, str]:
    """Rule 5 for the table's match ``m`` of ``prompt`` among ``ready``: the backend and why
    (``balance``, ``prefix``), or ``(None, "ring")`` / ``(None, "bound")`` when the caller
    places the anchor on the ring. ``walk``: the anchor's
    ring walk (backend ids), for ties; ``fits``: whether one more request keeps a backend
    within the pool's bound (the looser one for a conversation going on)."""
    order = {bid: i for i, bid in enumerate(walk)}

    def rank(b: Backend) -> tuple[float, int, str]:
        return (_load(b), order.get(b.id, len(order)), b.id)

    if imbalanced([_load(b) for b in ready], rules.balance_abs, rules.balance_rel):
        return min(ready, key=rank), "balance"
    if m.covered and m.covered >= rules.threshold * prompt.size:
        by_id = {b.id: b for b in ready}
        within = [b for x in m.holders if fits(b := by_id[x], m.answered)]
        if not within:
            return None, "bound"
        return min(within, key=rank), "prefix"
    return None, "ring"
