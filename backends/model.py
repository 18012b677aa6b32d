"""Simulated LLM serving model: conversations, a prefix KV cache, prefill and decode timing.

Sans-I/O, like h11 and wsproto: no sockets, no asyncio, no clock. The caller passes ``now``
where expiry matters and gets durations (seconds) back where time would pass, so the worker
decides how to wait and tests run without sleeping.

Rules of the simulation (the contract is docs/protocol.md):

- A message's tokens are its whitespace-separated words. A session's *context* is every token
  of the conversation so far: the user's prompts and the worker's answers.
- A ``text`` prompt appends its words to the held context; a ``messages`` prompt (the whole
  conversation, as chat-completions clients send it) replaces the context with the messages'
  words. Answer tokens join the context as they are produced, so an answer that completes adds
  all of its tokens and a cancelled one adds exactly those that were sent.
- The context of a turn is the conversation before it plus the new prompt. ``cached_tokens`` is
  the length of the longest leading part of that context found in the KV cache under the same
  session; only the remaining tokens are prefilled, taking
  ``uncached x prefill_ms_per_token / (1 - background_util)`` milliseconds.
- The KV cache holds at most ``kv_capacity_tokens`` tokens, shared by all sessions. Once a turn
  has been prefilled its whole context is cached, and each decoded token is added to it. When the
  cache is over capacity, tokens are dropped from the tail of the least-recently-used session's
  cached prefix (as block-level LRU in a real prefix cache does), then the next one's, and so on.
- Decode: each stream runs at ``tokens_per_s`` while at most ``max_batch`` streams decode at once;
  beyond that every stream slows in proportion (``tokens_per_s x max_batch / active``). A share
  ``background_util`` of the GPU taken by something else makes everything ``1 / (1 - U)``
  slower. ``tokens_per_s`` of 0 or at least ``UNLIMITED_TOKENS_PER_S`` means no decode delay.
- A session is held while connected and for ``session_ttl`` seconds after its last connection
  closes, so a reconnect continues its conversation and turn numbering; expiry is swept lazily
  (on attach, on each turn and when stats are read). An expired session's KV entry goes with it.
- Handoff (live migration): ``freeze`` exports a session as a ``SessionSnapshot`` (context, turn
  counter, the unfinished answer, queued prompts, how much of it the KV cache held) and forgets
  it here; ``thaw`` installs a snapshot on another worker, either copying the cached prefix
  (``kv_transfer_ms_per_token`` per token, far cheaper than prefill) or leaving the KV cache
  cold so the context is prefilled again; ``resume_turn`` continues the unfinished answer from
  its next token. ``backends.handoff`` turns snapshots into JSON and back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "UNLIMITED_TOKENS_PER_S",
    "KVCache",
    "Model",
    "ModelConfig",
    "ModelStats",
    "PendingAnswer",
    "Prompt",
    "QueuedPrompt",
    "SessionSnapshot",
    "SessionState",
    "Token",
    "Turn",
    "TurnPhase",
    "TurnResult",
    "token_text",
    "words",
]

UNLIMITED_TOKENS_PER_S = 1e6
"""At or above this decode speed (or at 0) tokens are produced without any delay."""


def token_text(session: str, turn: int, i: int) -> str:
    """Return the text of token ``i`` (0-based) of turn ``turn`` (1-based) of ``session``.

    The text is ``f"t{turn}.{i}-{h}"`` where ``h`` is the first 8 hex digits of
    ``blake2b(f"{session}\\x1f{turn}\\x1f{i}".encode(), digest_size=4)``. It is a pure function,
    so any client can check that it received every token exactly once and in order, even
    across reconnects and migrations; it never contains whitespace, so it is one context token.
    """
    key = f"{session}\x1f{turn}\x1f{i}".encode()
    return f"t{turn}.{i}-{hashlib.blake2b(key, digest_size=4).hexdigest()}"


def words(text: str) -> list[str]:
    """Split a message into tokens: the simulation counts whitespace-separated words."""
    return text.split()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Knobs of the simulated model; the worker's CLI options map one to one onto these."""

    tokens_per_s: float = 50.0
    prefill_ms_per_token: float = 0.2
    kv_capacity_tokens: int = 200_000
    session_ttl: float = 300.0
    max_batch: int = 64
    background_util: float = 0.0
    kv_transfer_ms_per_token: float = 0.02

    def __post_init__(self) -> None:
        if self.tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0")
        if self.prefill_ms_per_token < 0:
            raise ValueError("prefill_ms_per_token must be >= 0")
        if self.kv_transfer_ms_per_token < 0:
            raise ValueError("kv_transfer_ms_per_token must be >= 0")
        if self.kv_capacity_tokens < 0:
            raise ValueError("kv_capacity_tokens must be >= 0")
        if self.session_ttl < 0:
            raise ValueError("session_ttl must be >= 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0.0 <= self.background_util < 1.0:
            raise ValueError("background_util must be in [0, 1)")

    @property
    def unlimited(self) -> bool:
        """True when decode has no simulated delay."""
        return self.tokens_per_s == 0 or self.tokens_per_s >= UNLIMITED_TOKENS_PER_S


@dataclass(frozen=True, slots=True)
class Prompt:
    """A client prompt reduced to what the model needs: its tokens and whether it replaces."""

    words: tuple[str, ...]
    replace: bool = False

    @classmethod
    def from_text(cls, text: str) -> Prompt:
        """A ``text`` prompt: continues the held conversation."""
        return cls(tuple(words(text)), replace=False)

    @classmethod
    def from_messages(cls, contents: Iterable[str]) -> Prompt:
        """A ``messages`` prompt: the message contents, in order, become the whole context."""
        return cls(tuple(w for content in contents for w in words(content)), replace=True)


@dataclass(slots=True)
class SessionState:
    """One conversation: what a handoff would move to another worker.

    ``context`` is append-only while it is the session's context; replacing the conversation
    assigns a new list. The KV cache relies on this to reference contexts without copying them.
    """

    session: str
    context: list[str] = field(default_factory=list)
    turns: int = 0
    """Turns started so far; the next turn is ``turns + 1``."""


class TurnPhase(Enum):
    """Where one answer is: prefilling, decoding, or finished (completed or cancelled)."""

    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(slots=True)
class Turn:
    """One answer in progress. Plain data, like ``SessionState``.

    ``cached_tokens`` and ``prefill_s`` are measured when the turn starts and reported in
    ``done`` even when the turn is resumed on another worker; ``delay_s`` is what this worker
    waits before the next token (the prefill, or for a resumed turn the KV transfer and any
    re-prefill), so the two can differ.
    """

    session: str
    turn: int
    max_tokens: int
    cached_tokens: int
    prefill_tokens: int
    """Context tokens prefilled for this turn on this worker."""
    prefill_s: float
    context: list[str]
    """The session's context list this answer extends (a reference, not a copy)."""
    delay_s: float = 0.0
    produced: int = 0
    phase: TurnPhase = TurnPhase.PREFILL

    @property
    def prefill_ms(self) -> float:
        """Simulated prefill time in milliseconds, as reported in ``done``."""
        return self.prefill_s * 1000.0

    @property
    def remaining(self) -> int:
        """Tokens still to produce before the answer is complete."""
        return self.max_tokens - self.produced


@dataclass(frozen=True, slots=True)
class Token:
    """One produced token."""

    turn: int
    i: int
    text: str


@dataclass(frozen=True, slots=True)
class TurnResult:
    """The fields of the ``done`` message."""

    turn: int
    tokens: int
    cached_tokens: int
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class PendingAnswer:
    """An answer that a freeze interrupted: where it stopped and what ``done`` will report."""

    turn: int
    produced: int
    """Tokens already sent; the next one has index ``produced``."""
    max_tokens: int
    cached_tokens: int
    prefill_ms: float
    cancelled: bool = False
    """The client cancelled it but the answer had not ended yet: the next worker ends it."""


@dataclass(frozen=True, slots=True)
class QueuedPrompt:
    """A prompt received while an answer was running, not started yet."""

    prompt: Prompt
    max_tokens: int


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """Everything a worker needs to continue a session exactly where another one stopped."""

    session: str
    context: tuple[str, ...]
    """The whole conversation, including the tokens of ``answer`` sent so far."""
    turns: int
    kv_cached: int
    """Leading context tokens the old worker's KV cache held (what a transfer can copy)."""
    answer: PendingAnswer | None = None
    queued: tuple[QueuedPrompt, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelStats:
    """A snapshot for ``/metrics``."""

    active_sessions: int
    """Sessions with at least one open connection."""
    held_sessions: int
    """Sessions held, including disconnected ones still within their ttl."""
    decoding: int
    prefilling: int
    queue_depth: int
    """Streams decoding beyond ``max_batch`` (vLLM's ``num_requests_waiting``: requests the
    batch has no room for; a prefill is running work, not waiting)."""
    kv_used_tokens: int
    """Tokens in the KV cache, idle sessions' cached prefixes included."""
    kv_capacity_tokens: int
    kv_cache_usage: float
    """Context tokens of the answers in progress (prefill or decode) over the capacity, at most
    1: the blocks running requests hold, as vLLM's ``kv_cache_usage_perc`` counts them (cached
    prefixes of idle sessions are evictable, so free for new work)."""
    gpu_utilization: float
    kv_hit_tokens_total: int
    prefill_tokens_total: int
    decode_tokens_total: int
    kv_transfer_tokens_total: int
    prefill_seconds_total: float = 0.0
    """Simulated prefill time of those tokens (with ``prefill_tokens_total``: the rate a
    balancer prices a cold move at)."""


@dataclass(slots=True)
class _KVEntry:
    tokens: list[str]
    length: int


class KVCache:
    """Per-session cached prefixes under one token capacity, evicted LRU across sessions.

    An entry references a token list and caches its first ``length`` tokens. The lists are
    only ever appended to (see ``SessionState``), so an entry stays valid as its list grows.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[str, _KVEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, key: str) -> int:
        """Tokens cached for ``key`` (no LRU touch)."""
        entry = self._entries.get(key)
        return entry.length if entry is not None else 0

    def lru_order(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def match(self, key: str, tokens: list[str]) -> int:
        """Return how many leading ``tokens`` are cached under ``key``, and touch the entry."""
        if key in self._entries:
            self._entries.move_to_end(key)
        return self.peek(key, tokens)

    def peek(self, key: str, tokens: list[str]) -> int:
        """Like ``match`` without touching the LRU order (for a handoff looking, not using)."""
        entry = self._entries.get(key)
        if entry is None:
            return 0
        limit = min(entry.length, len(tokens))
        if entry.tokens is tokens or entry.tokens[:limit] == tokens[:limit]:
            return limit
        n = 0
        for a, b in zip(entry.tokens, tokens, strict=False):
            if n >= limit or a != b:
                break
            n += 1
        return n

    def store(self, key: str, tokens: list[str], length: int | None = None) -> None:
        """Cache the first ``length`` (default: all) of ``tokens`` for ``key``; evict if over."""
        length = len(tokens) if length is None else min(length, len(tokens))
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= old.length
        self._entries[key] = _KVEntry(tokens, length)
        self.used += length
        self._evict()

    def extend(self, key: str, tokens: list[str]) -> None:
        """Cache the token just appended to ``tokens`` if the entry is contiguous with it.

        An entry that was truncated or replaced meanwhile is left alone: the cache holds a
        prefix, never a prefix with a hole.
        """
        entry = self._entries.get(key)
        if entry is None or entry.tokens is not tokens or entry.length != len(tokens) - 1:
            return
        entry.length += 1
        self.used += 1
        self._entries.move_to_end(key)
        self._evict()

    def drop(self, key: str) -> None:
        """Forget ``key``'s cached prefix."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.length

    def _evict(self) -> None:
        while self.used > self.capacity and self._entries:
            key, victim = next(iter(self._entries.items()))
            overflow = self.used - self.capacity
            if victim.length <= overflow:
                del self._entries[key]
                self.used -= victim.length
            else:
                victim.length -= overflow
                self.used -= overflow


@dataclass(slots=True)
class _Held:
    state: SessionState
    connections: int = 0
    running: int = 0


class Model:
    """The simulated model of one worker: sessions, KV cache, timing and counters.

    Typical use by an I/O shell, per connection and per answer::

        model.attach(sid, now)
        turn = model.start_turn(sid, prompt, max_tokens, now)
        wait(turn.delay_s)
        model.begin_decode(turn)
        while turn.remaining and not cancelled:
            wait(model.token_delay())
            send(model.emit(turn))
        send(model.finish(turn))
        model.detach(sid, now)
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config if config is not None else ModelConfig()
        self.kv = KVCache(self.config.kv_capacity_tokens)
        self._sessions: dict[str, _Held] = {}
        # Disconnected sessions -> expiry time. The ttl is constant, so insertion order is
        # expiry order and the sweep only looks at the front.
        self._expiry: OrderedDict[str, float] = OrderedDict()
        self._connected = 0
        self._decoding = 0
        self._prefilling = 0
        self.kv_hit_tokens_total = 0
        self.prefill_tokens_total = 0
        self.prefill_seconds_total = 0.0
        self.decode_tokens_total = 0
        self.kv_transfer_tokens_total = 0

    # -- sessions ---------------------------------------------------------------------------

    def attach(self, session: str, now: float) -> SessionState:
        """A connection for ``session`` opened: hold it (creating it if new or expired)."""
        self.sweep(now)
        held = self._sessions.get(session)
        if held is None:
            held = self._sessions[session] = _Held(SessionState(session))
        self._expiry.pop(session, None)
        if held.connections == 0:
            self._connected += 1
        held.connections += 1
        return held.state

    def detach(self, session: str, now: float) -> None:
        """A connection for ``session`` closed; the last one starts the ttl."""
        held = self._sessions.get(session)
        if held is None or held.connections == 0:
            return
        held.connections -= 1
        if held.connections == 0:
            self._connected -= 1
            self._expiry[session] = now + self.config.session_ttl
            self._expiry.move_to_end(session)

    def sweep(self, now: float) -> int:
        """Forget disconnected sessions whose ttl has passed; return how many went."""
        expired = 0
        for _ in range(len(self._expiry)):
            session, deadline = next(iter(self._expiry.items()))
            if deadline > now:
                break
            del self._expiry[session]
            held = self._sessions[session]
            if held.running:
                # An answer still finishing: keep the session one more ttl.
                self._expiry[session] = now + self.config.session_ttl
                continue
            del self._sessions[session]
            self.kv.drop(session)
            expired += 1
        return expired

    def session(self, session: str) -> SessionState | None:
        """The held state of ``session``, if any (no sweep)."""
        held = self._sessions.get(session)
        return held.state if held is not None else None

    def connected(self, session: str) -> bool:
        """True while ``session`` has an open connection here."""
        held = self._sessions.get(session)
        return held is not None and held.connections > 0

    def forget(self, session: str) -> None:
        """Drop ``session`` and its KV entry now, not after the ttl: an HTTP request that named
        no session is one turn, and nothing can continue it."""
        held = self._sessions.get(session)
        if held is not None and held.connections == 0 and held.running == 0:
            self._forget(session)

    def _forget(self, session: str) -> None:
        held = self._sessions.pop(session, None)
        if held is None:
            return
        self._expiry.pop(session, None)
        if held.connections:
            self._connected -= 1
        self.kv.drop(session)

    # -- turns ------------------------------------------------------------------------------

    def start_turn(self, session: str, prompt: Prompt, max_tokens: int, now: float) -> Turn:
        """Take a prompt: update the context, look up the KV cache, and plan the prefill.

        Raises:
            KeyError: ``session`` is not held (call ``attach`` first).
            ValueError: ``max_tokens`` is negative.
        """
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.sweep(now)
        held = self._sessions[session]
        state = held.state
        if prompt.replace:
            state.context = list(prompt.words)  # a new list: see SessionState
        else:
            state.context.extend(prompt.words)
        context = state.context
        cached = self.kv.match(session, context)
        uncached = len(context) - cached
        state.turns += 1
        held.running += 1
        self._prefilling += 1
        self.kv_hit_tokens_total += cached
        self.prefill_tokens_total += uncached
        prefill_s = uncached * self.config.prefill_ms_per_token / 1000.0 / self._slack()
        self.prefill_seconds_total += prefill_s
        return Turn(
            session=session,
            turn=state.turns,
            max_tokens=max_tokens,
            cached_tokens=cached,
            prefill_tokens=uncached,
            prefill_s=prefill_s,
            context=context,
            delay_s=prefill_s,
        )

    def begin_decode(self, turn: Turn) -> None:
        """Prefill is over: the turn's context is now in the KV cache and the stream decodes."""
        if turn.phase is not TurnPhase.PREFILL:
            return
        self._prefilling -= 1
        self._decoding += 1
        turn.phase = TurnPhase.DECODE
        self.kv.store(turn.session, turn.context)

    def token_delay(self) -> float:
        """Seconds until a decoding stream's next token at the current load (0: no delay)."""
        cfg = self.config
        if cfg.unlimited:
            return 0.0
        active = max(1, self._decoding)
        rate = cfg.tokens_per_s * min(1.0, cfg.max_batch / active) * self._slack()
        return 1.0 / rate

    def emit(self, turn: Turn) -> Token:
        """Produce the turn's next token and add it to the context and the KV cache.

        Raises:
            RuntimeError: the turn is not decoding or has no tokens left.
        """
        if turn.phase is not TurnPhase.DECODE or turn.remaining <= 0:
            raise RuntimeError(f"turn {turn.turn} cannot emit in phase {turn.phase.value}")
        i = turn.produced
        text = token_text(turn.session, turn.turn, i)
        turn.context.append(text)
        self.kv.extend(turn.session, turn.context)
        turn.produced += 1
        self.decode_tokens_total += 1
        return Token(turn.turn, i, text)

    def finish(self, turn: Turn) -> TurnResult:
        """End the turn (complete, cancelled or abandoned); idempotent."""
        if turn.phase is not TurnPhase.DONE:
            if turn.phase is TurnPhase.PREFILL:
                self._prefilling -= 1
            else:
                self._decoding -= 1
            turn.phase = TurnPhase.DONE
            held = self._sessions.get(turn.session)
            if held is not None and held.running > 0:
                held.running -= 1
        return TurnResult(turn.turn, turn.produced, turn.cached_tokens, turn.prefill_ms)

    # -- handoff ----------------------------------------------------------------------------

    def freeze(
        self,
        session: str,
        turn: Turn | None = None,
        queued: Sequence[QueuedPrompt] = (),
        cancelled: bool = False,
    ) -> SessionSnapshot:
        """Export ``session`` for another worker and forget it here (its KV entry too).

        ``turn`` is the connection's answer in progress, if any (it is finished here, keeping
        its position); ``queued`` the prompts waiting behind it; ``cancelled`` whether the client
        already cancelled ``turn``. The session is forgotten so that a stale copy can never
        answer again: the snapshot is now the only live state.

        Raises:
            KeyError: ``session`` is not held.
        """
        state = self._sessions[session].state
        answer = None
        if turn is not None and turn.phase is not TurnPhase.DONE:
            answer = PendingAnswer(
                turn=turn.turn,
                produced=turn.produced,
                max_tokens=turn.max_tokens,
                cached_tokens=turn.cached_tokens,
                prefill_ms=turn.prefill_ms,
                cancelled=cancelled,
            )
            self.finish(turn)
        snapshot = SessionSnapshot(
            session=session,
            context=tuple(state.context),
            turns=state.turns,
            kv_cached=self.kv.peek(session, state.context),
            answer=answer,
            queued=tuple(queued),
        )
        self._forget(session)
        return snapshot

    def thaw(self, snapshot: SessionSnapshot, now: float, transfer_kv: bool = True) -> float:
        """Hold ``snapshot``'s session here (disconnected, within its ttl until resumed).

        With ``transfer_kv`` the old worker's cached prefix is copied into this KV cache (only
        the part not already here); otherwise the cache stays as it is and the context is
        prefilled again when needed. Any disconnected copy held here is replaced. Returns the
        simulated transfer time in seconds, which the caller waits before resuming.

        Raises:
            ValueError: the session has an open connection here.
        """
        session = snapshot.session
        if self.connected(session):
            raise ValueError(f"session {session!r} is connected here")
        self.sweep(now)
        old = self._sessions.pop(session, None)
        if old is not None:
            self._expiry.pop(session, None)
        state = SessionState(session, list(snapshot.context), snapshot.turns)
        self._sessions[session] = _Held(state)
        self._expiry[session] = now + self.config.session_ttl
        if not transfer_kv:
            return 0.0
        have = self.kv.peek(session, state.context)
        wanted = min(snapshot.kv_cached, len(state.context))
        moved = max(0, wanted - have)
        if have or wanted:
            self.kv.store(session, state.context, max(have, wanted))
        self.kv_transfer_tokens_total += moved
        return moved * self.config.kv_transfer_ms_per_token / 1000.0 / self._slack()

    def resume_turn(self, session: str, answer: PendingAnswer, extra_delay_s: float = 0.0) -> Turn:
        """Continue a frozen answer here: the turn starts in prefill with its position kept.

        The part of the context missing from this KV cache is prefilled again (``delay_s``,
        plus ``extra_delay_s`` such as a KV transfer); ``done`` still reports the
        ``cached_tokens`` and ``prefill_ms`` measured when the turn first started.

        Raises:
            KeyError: ``session`` is not held (``thaw`` then ``attach`` first).
        """
        held = self._sessions[session]
        context = held.state.context
        uncached = len(context) - self.kv.match(session, context)
        held.running += 1
        self._prefilling += 1
        self.prefill_tokens_total += uncached
        delay = uncached * self.config.prefill_ms_per_token / 1000.0 / self._slack()
        self.prefill_seconds_total += delay
        return Turn(
            session=session,
            turn=answer.turn,
            max_tokens=answer.max_tokens,
            cached_tokens=answer.cached_tokens,
            prefill_tokens=uncached,
            prefill_s=answer.prefill_ms / 1000.0,
            context=context,
            delay_s=delay + extra_delay_s,
            produced=answer.produced,
        )

    # -- load -------------------------------------------------------------------------------

    @property
    def decoding(self) -> int:
        """Streams decoding now."""
        return self._decoding

    def running_context_tokens(self) -> int:
        """Context tokens of the sessions with an answer in progress (prefill or decode)."""
        return sum(len(h.state.context) for h in self._sessions.values() if h.running)

    def gpu_utilization(self) -> float:
        """Simulated utilisation: decode streams over ``max_batch``, at least the background."""
        busy = min(1.0, self._decoding / self.config.max_batch)
        return max(self.config.background_util, busy)

    def stats(self, now: float | None = None) -> ModelStats:
        """A snapshot of load and counters (sweeping expired sessions first if ``now`` given)."""
        if now is not None:
            self.sweep(now)
        cap = self.kv.capacity
        return ModelStats(
            active_sessions=self._connected,
            held_sessions=len(self._sessions),
            decoding=self._decoding,
            prefilling=self._prefilling,
            queue_depth=max(0, self._decoding - self.config.max_batch),
            kv_used_tokens=self.kv.used,
            kv_capacity_tokens=cap,
            kv_cache_usage=min(1.0, self.running_context_tokens() / cap) if cap else 0.0,
            gpu_utilization=self.gpu_utilization(),
            kv_hit_tokens_total=self.kv_hit_tokens_total,
            prefill_tokens_total=self.prefill_tokens_total,
            decode_tokens_total=self.decode_tokens_total,
            kv_transfer_tokens_total=self.kv_transfer_tokens_total,
            prefill_seconds_total=self.prefill_seconds_total,
        )

    def _slack(self) -> float:
        return 1.0 - self.config.background_util
