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
- The KV cache is a prefix cache shared by every session and request of the worker, as an
  engine's is (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's prompt cache).
  A context is cut into blocks of ``kv_block_tokens`` tokens; block ``i`` is keyed by
  ``hash((key of block i-1, its tokens))``, so a key stands for the whole prefix up to it, and
  only full blocks are cached. The context of a turn is the conversation before it plus the new
  prompt; ``cached_tokens`` is the longest run of its leading blocks found in the cache, times
  the block size, whichever session cached them. Only the remaining tokens are prefilled, taking
  ``uncached x prefill_ms_per_token / (1 - background_util)`` milliseconds.
- The cache holds at most ``kv_capacity_tokens // kv_block_tokens`` blocks. A running answer
  holds (pins) the blocks it found, then, once its prefill is over, those of its whole context,
  and each block its decoded tokens fill. When it ends they become evictable, and a block that
  needs room evicts the least recently used evictable one; held blocks are never evicted, so
  with none evictable the new block is simply not cached. A chain is released tail first, so a
  prefix's deeper blocks go before the blocks they extend. Sessions expiring, migrating away or
  being forgotten leave their blocks to this rule, as an engine does.
- Decode: each stream runs at ``tokens_per_s`` while at most ``max_batch`` streams decode at once;
  beyond that every stream slows in proportion (``tokens_per_s x max_batch / active``). A share
  ``background_util`` of the GPU taken by something else makes everything ``1 / (1 - U)``
  slower. ``tokens_per_s`` of 0 or at least ``UNLIMITED_TOKENS_PER_S`` means no decode delay.
- A session is held while connected and for ``session_ttl`` seconds after its last connection
  closes, so a reconnect continues its conversation and turn numbering; expiry is swept lazily
  (on attach, on each turn and when stats are read).
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
    "BlockChain",
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
    kv_block_tokens: int = 1
    """Tokens per KV cache block: the prefix cache's granularity (1: token by token, as
    llama.cpp's and SGLang's caches are by default; 16: vLLM's default block)."""

    def __post_init__(self) -> None:
        if self.tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0")
        if self.prefill_ms_per_token < 0:
            raise ValueError("prefill_ms_per_token must be >= 0")
        if self.kv_transfer_ms_per_token < 0:
            raise ValueError("kv_transfer_ms_per_token must be >= 0")
        if self.kv_capacity_tokens < 0:
            raise ValueError("kv_capacity_tokens must be >= 0")
        if self.kv_block_tokens < 1:
            raise ValueError("kv_block_tokens must be >= 1")
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
    chain: BlockChain | None = None
    """The block hashes of ``context``, for the KV cache."""
    blocks: list[int] = field(default_factory=list)
    """The KV cache blocks this answer holds (the leading blocks of ``chain``)."""

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
    """Tokens in the KV cache's blocks, evictable ones included."""
    kv_capacity_tokens: int
    kv_cache_usage: float
    """KV tokens the answers in progress (prefill or decode) occupy over the capacity, at most 1:
    the blocks running requests hold, each once, as vLLM's ``kv_cache_usage_perc`` counts them
    (cached blocks no running answer holds are evictable, so free for new work)."""
    gpu_utilization: float
    kv_hit_tokens_total: int
    prefill_tokens_total: int
    decode_tokens_total: int
    kv_transfer_tokens_total: int
    prefill_seconds_total: float = 0.0
    """Simulated prefill time of those tokens (with ``prefill_tokens_total``: the rate a
    balancer prices a cold move at)."""


@dataclass(slots=True)
class _Block:
    parent: int | None
    tokens: tuple[str, ...]
    refs: int = 0
    """Running answers holding the block: it cannot be evicted while any does."""


class BlockChain:
    """The chained block hashes of one token list, computed once and extended as it grows.

    Block ``i`` holds tokens ``[i*B, (i+1)*B)``; its hash is ``hash((h[i-1], tokens))`` with
    ``h[-1]`` None, so equal hashes mean equal prefixes up to that block. Only full blocks count.
    The list is only ever appended to (see ``SessionState``), so what was hashed stays valid.
    """

    __slots__ = ("block_tokens", "blocks", "hashes", "tokens")

    def __init__(self, tokens: list[str], block_tokens: int) -> None:
        self.tokens = tokens
        self.block_tokens = block_tokens
        self.hashes: list[int] = []
        self.blocks: list[tuple[str, ...]] = []

    def update(self) -> int:
        """Hash the full blocks appended since the last call; return how many there are."""
        size = self.block_tokens
        hashes, blocks, tokens = self.hashes, self.blocks, self.tokens
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            block = tuple(tokens[start : start + size])
            parent = hash((parent, block))
            hashes.append(parent)
            blocks.append(block)
        return len(hashes)


class KVCache:
    """A prefix cache of fixed-size blocks shared by every session, as engines keep one.

    Blocks are keyed by their chained hash (``BlockChain``), so two conversations that start
    with the same tokens share the blocks of that prefix, whatever their sessions. The cache
    holds at most ``capacity // block_tokens`` blocks. A block held by a running answer
    (``refs`` > 0) is never evicted; the others wait in least-recently-used order, and a block
    that does not fit is evicted from there, else not cached. A chain is touched head to tail
    and released tail first, so a block's children always go before it (vLLM frees a request's
    blocks in reverse for the same reason).
    """

    def __init__(self, capacity: int, block_tokens: int = 1) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.capacity = capacity
        self.block_tokens = block_tokens
        self.max_blocks = capacity // block_tokens
        self._blocks: dict[int, _Block] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Blocks no running answer holds, least recently used first: the evictable ones."""

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used(self) -> int:
        """Tokens in the cache (every block, idle ones included)."""
        return len(self._blocks) * self.block_tokens

    @property
    def held(self) -> int:
        """Tokens in blocks that running answers hold."""
        return (len(self._blocks) - len(self._idle)) * self.block_tokens

    def chain(self, tokens: list[str]) -> BlockChain:
        """A ``BlockChain`` of ``tokens`` at this cache's block size, hashed."""
        chain = BlockChain(tokens, self.block_tokens)
        chain.update()
        return chain

    def peek(self, chain: BlockChain) -> int:
        """How many leading blocks of ``chain`` are cached (no LRU touch)."""
        chain.update()
        n = 0
        parent: int | None = None
        for h, block in zip(chain.hashes, chain.blocks, strict=True):
            found = self._blocks.get(h)
            if found is None or found.parent != parent or found.tokens != block:
                break  # absent, or a hash collision: a miss, never a wrong hit
            parent = h
            n += 1
        return n

    def acquire(self, chain: BlockChain, held: list[int]) -> int:
        """Hold the leading blocks of ``chain`` that are cached (for a running answer): touch
        them, pin them, and append their hashes to ``held``; return how many."""
        n = self.peek(chain)
        for h in chain.hashes[len(held) : n]:
            self._hold(h)
            held.append(h)
        return n

    def insert(self, chain: BlockChain, held: list[int], upto: int | None = None) -> int:
        """Cache ``chain``'s full blocks after the ``held`` ones (up to block ``upto``), held
        too; stop at the first that does not fit. Returns the blocks now held."""
        chain.update()
        end = len(chain.hashes) if upto is None else min(upto, len(chain.hashes))
        for i in range(len(held), end):
            h = chain.hashes[i]
            parent = chain.hashes[i - 1] if i else None
            found = self._blocks.get(h)
            if found is not None:
                if found.parent != parent or found.tokens != chain.blocks[i]:
                    break  # a hash collision: leave the other prefix's block alone
                self._hold(h)
            elif not self._make_room():
                break
            else:
                self._blocks[h] = _Block(parent, chain.blocks[i], refs=1)
            held.append(h)
        return len(held)

    def release(self, held: list[int]) -> None:
        """A running answer ended: its blocks become evictable, the deepest first."""
        for h in reversed(held):
            block = self._blocks.get(h)
            if block is None or block.refs <= 0:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._idle[h] = None
        held.clear()

    def _hold(self, h: int) -> None:
        block = self._blocks[h]
        if block.refs == 0:
            del self._idle[h]
        block.refs += 1

    def _make_room(self) -> bool:
        if len(self._blocks) < self.max_blocks:
            return True
        if not self._idle:
            return False
        victim, _ = self._idle.popitem(last=False)
        del self._blocks[victim]
        return True


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
        self.kv = KVCache(self.config.kv_capacity_tokens, self.config.kv_block_tokens)
        self._sessions: dict[str, _Held] = {}
        self._chains: dict[str, BlockChain] = {}
        """Each held session's context hashed into blocks, kept so a turn hashes only what is
        new."""
        self._running: dict[int, Turn] = {}
        """Answers in progress by ``id``: what they hold of the KV cache is in use."""
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
            self._chains.pop(session, None)
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
        """Drop ``session`` now, not after the ttl: an HTTP request that named no session is one
        turn, and nothing can continue it (its blocks stay in the shared KV cache)."""
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
        self._chains.pop(session, None)

    def cached(self, session: str) -> int:
        """Leading tokens of ``session``'s context in the KV cache now (0 if not held)."""
        held = self._sessions.get(session)
        if held is None:
            return 0
        return self.kv.peek(self._chain(session, held.state.context)) * self.kv.block_tokens

    def _chain(self, session: str, context: list[str]) -> BlockChain:
        chain = self._chains.get(session)
        if chain is None or chain.tokens is not context:
            chain = self._chains[session] = BlockChain(context, self.kv.block_tokens)
        chain.update()
        return chain

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
        chain = self._chain(session, context)
        blocks: list[int] = []
        cached = self.kv.acquire(chain, blocks) * self.kv.block_tokens
        uncached = len(context) - cached
        state.turns += 1
        held.running += 1
        self._prefilling += 1
        self.kv_hit_tokens_total += cached
        self.prefill_tokens_total += uncached
        prefill_s = uncached * self.config.prefill_ms_per_token / 1000.0 / self._slack()
        self.prefill_seconds_total += prefill_s
        turn = Turn(
            session=session,
            turn=state.turns,
            max_tokens=max_tokens,
            cached_tokens=cached,
            prefill_tokens=uncached,
            prefill_s=prefill_s,
            context=context,
            delay_s=prefill_s,
            chain=chain,
            blocks=blocks,
        )
        self._running[id(turn)] = turn
        return turn

    def begin_decode(self, turn: Turn) -> None:
        """Prefill is over: the turn's context is now in the KV cache and the stream decodes."""
        if turn.phase is not TurnPhase.PREFILL:
            return
        self._prefilling -= 1
        self._decoding += 1
        turn.phase = TurnPhase.DECODE
        if turn.chain is not None:
            self.kv.insert(turn.chain, turn.blocks)

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
        if turn.chain is not None and len(turn.context) % self.kv.block_tokens == 0:
            self.kv.insert(turn.chain, turn.blocks)  # a block just filled up
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
            self.kv.release(turn.blocks)
            self._running.pop(id(turn), None)
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
        """Export ``session`` for another worker and forget it here (its KV blocks stay, evictable).

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
            kv_cached=self.cached(session),
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
        size = self.kv.block_tokens
        chain = self._chain(session, state.context)
        have = self.kv.peek(chain)
        blocks: list[int] = []
        got = self.kv.insert(
            chain, blocks, upto=min(snapshot.kv_cached, len(state.context)) // size
        )
        self.kv.release(blocks)
        moved = max(0, got - have) * size
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
        chain = self._chain(session, context)
        blocks: list[int] = []
        uncached = len(context) - self.kv.acquire(chain, blocks) * self.kv.block_tokens
        held.running += 1
        self._prefilling += 1
        self.prefill_tokens_total += uncached
        delay = uncached * self.config.prefill_ms_per_token / 1000.0 / self._slack()
        self.prefill_seconds_total += delay
        turn = Turn(
            session=session,
            turn=answer.turn,
            max_tokens=answer.max_tokens,
            cached_tokens=answer.cached_tokens,
            prefill_tokens=uncached,
            prefill_s=answer.prefill_ms / 1000.0,
            context=context,
            delay_s=delay + extra_delay_s,
            produced=answer.produced,
            chain=chain,
            blocks=blocks,
        )
        self._running[id(turn)] = turn
        return turn

    # -- load -------------------------------------------------------------------------------

    @property
    def decoding(self) -> int:
        """Streams decoding now."""
        return self._decoding

    def kv_in_use_tokens(self) -> int:
        """KV tokens the answers in progress occupy: the cache blocks they hold, each once
        however many share it, plus each answer's context beyond its blocks (being prefilled,
        or a block not full yet)."""
        size = self.kv.block_tokens
        rest = sum(len(t.context) - len(t.blocks) * size for t in self._running.values())
        return self.kv.held + rest

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
            kv_cache_usage=min(1.0, self.kv_in_use_tokens() / cap) if cap else 0.0,
            gpu_utilization=self.gpu_utilization(),
            kv_hit_tokens_total=self.kv_hit_tokens_total,
            prefill_tokens_total=self.prefill_tokens_total,
            decode_tokens_total=self.decode_tokens_total,
            kv_transfer_tokens_total=self.kv_transfer_tokens_total,
            prefill_seconds_total=self.prefill_seconds_total,
        )

    def _slack(self) -> float:
        return 1.0 - self.config.background_util
