"""A pool's backends: membership, refresh and smoothing, ejection, held places and affinity.

``Pool`` keeps the state the balance algorithms read and hands them what they need
(``balancer.selection``); the backends themselves and their admin states are in
``balancer.backend`` (re-exported here). The ring is built off the hot path when membership
changes and swapped in as one reference. A pool passes on its backends' changes of state
(``Pool.listen``: the event feed's ``state`` events) while they are its members.

Ejection (``failed``) ends at ``ejected_until``: the shell sets a timer there
(``ServerState.worker_failed`` calls ``readmit``), so the backend's return is an event on time;
``refresh`` also readmits what is due, for callers with no timer.

Held places: when a session ends, its key keeps its place on the backend for ``hold_s`` seconds
(the pool's ``affinity_hold``, 30 s by default): the worker still holds the conversation's KV
cache, and chat clients that open a connection per turn (as HTTP-style clients do) come back
after a think time. A held place counts in the backend's counted load (``Backend.counted``) and
in the pool's total, as a live session does, until the key returns (its session takes the place
back: the count does not grow) or the hold expires. A key placed on a backend counts there from
its placement, before its session attaches (``Backend.pending``, for ``PENDING_S`` at most): a
burst of keys arriving together sees the ones placed before it, not only the sessions whose
handshakes are done. So the bounded-load rule counts conversations rather than open sockets,
and a returning key is not pushed off its worker because it was between turns. The rule,
exactly: a placement never takes a backend's counted load above its *limit*,
``ring.load_bound`` of the pool's counted total after it with the backends' *effective* weights
at that moment and a factor that ``balancer.selection`` states: ``hash_balance_factor`` for new
keys (and for a returning key that moves), ``affinity_ceiling`` for a key returning to its
backend. A key taking back
its held place adds nothing to either count, so it fits wherever the backend is within its
limit counting the key's place already. A held place is a reservation, not a session: when its
backend's counted load is above its limit (of the current total), places held there are given
up, the longest-quiet conversations first, until it is within the limit again or holds none;
live sessions are never moved for a bound.

Held places per client: nothing says a key a client names will come back, so one client could
name a new key per request and fill the counted loads with reservations nobody returns to (the
bounds then mean nothing, and real conversations' places are given up first, being the
oldest). So a client holds at most ``affinity_hold_per_client`` places at once: its next one
gives up its own longest-quiet place. The client is the address ``detach`` is given (the one
wslb counts the connection from, for sessions, plain requests and lanes alike), or with
``auth.jwt`` (``client_of``) the owner whose tag the scoped key carries: many users behind one
address. A key given up keeps its remembered placement (it goes back to its worker while the
bounds allow), only its place stops counting; live sessions are never touched.

Overload is the pool's state, refreshed with the weights (``refresh``): the set of backends
``selection.overloaded`` finds among the ready backends with fresh signals, given the set before,
so that its hysteresis holds across refreshes (reported; it moves no key by itself). Under
``workers: N`` every process works it out from the same published signals.

Conversations: what placement and the move rule (``balancer.selection``) read of each key,
learnt from what wslb relayed. When a session ends, its client's bytes and data messages and the
worker's data messages update the key's *turns* (client messages) and *context estimate* in
tokens: the larger of the estimate before and the session's mean client message (a chat client
that sends the whole conversation each turn sends its context; ``placement.bytes_per_token``
turns bytes into tokens), plus the worker's messages (an answer streams about a token or a chunk
per message). A conversation is *counted* on the backend of its live session or held place;
each backend sums the context and turns of those counted there, and the pool learns, over all
keys, the context growth per turn, the answer tokens per turn, and from conversations whose
place lapsed their turns and final context. A backend's *KV demand* is the context counted
there plus what it is expected to grow into (its conversations' expected turns left, at least
half a turn each, times the growth per turn); a new conversation is expected to reach the
learnt final context. Each refresh also brings, per backend, the *wait* before a new turn
starts (``waiting / max(1, running) x answer tokens per turn x tpot``, smoothed over
``weights.smoothing``), its prefill time per token and KV size (scraped signals ``prefill`` and
``kv_capacity``). These estimates are per process: under ``workers: N`` a key that returns
through another process has no size there, and does not move for cost.

Under ``workers: N`` each process keeps its own holds and publishes its live sessions plus
held places on the board, so every process's bounds count them (``remote_sessions``); a key that
returns through another process than the one holding its place is counted twice until that hold
expires, which errs on the side of a tighter bound. The per-client bound is per process too.

In cluster mode (``placements``) the affinity table is the tier's, shared through etcd
(``balancer.cluster.Placements``): each instance writes its placements there and reads
everyone's from its own copy, and a returning key found there goes home whatever this
instance's load view (``selection.consistent``'s ``sticky``), so every instance sends it to
the same worker. Holds, pending placements and conversations stay per instance.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from balancer import prefix, selection
from balancer.backend import AdminState, Backend, Change, Upstream
from balancer.config import BackendCfg, PoolCfg
from balancer.ring import Ring, load_bound
from balancer.weights import denoise, effective_weight, median, speed

__all__ = [
    "ACTIVE",
    "DRAINED",
    "DRAINING",
    "AdminState",
    "Backend",
    "Change",
    "Conversation",
    "Pool",
    "Relayed",
    "SharedLoad",
    "SharedPlacements",
    "Upstream",
]

RESPONSE_KEY = "prefix\nresponse:"
"""Before a response id in the affinity table (``responded``): no client's key has a newline."""
# How long a key's last placement is remembered after its session ends: longer than a worker
# keeps a disconnected session's context (the reference worker's --session-ttl is 300 s).
AFFINITY_TTL = 600.0
# How long a key keeps its place (counted in its backend's load) after its session ends.
HOLD_S = PoolCfg("").affinity_hold
# How long a placement counts on its backend before its session attaches (longer than a
# worker's connect and handshake take; a placement whose handshake failed lapses then).
PENDING_S = 15.0

# The admin states, as the names every caller imports (``balancer.backend.AdminState``).
ACTIVE = AdminState.ACTIVE
DRAINING = AdminState.DRAINING
DRAINED = AdminState.DRAINED


Relayed: TypeAlias = tuple[int, int, int]
"""What one session relayed: client bytes, client data messages, worker data messages."""

# Samples after which a learnt mean becomes an exponential one (it follows a changing workload).
_WINDOW = 200


class _Mean:
    """A running mean of the last ``_WINDOW`` or so samples; None before the first."""

    __slots__ = ("n", "value")

    def __init__(self) -> None:
        self.n = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += (x - self.value) / min(self.n, _WINDOW)

    def get(self) -> float | None:
        return self.value if self.n else None


@dataclass(slots=True)
class Conversation:
    """One key's conversation as wslb has relayed it (module docstring)."""

    turns: int = 0
    context: float = 0.0  # estimated tokens
    on: Backend | None = None  # where it is counted: its live session's or held place's backend


class SharedPlacements(Protocol):
    """The affinity table of a cluster's instances (``balancer.cluster.Placements``)."""

    def remember(self, key: str, backend_id: str, first: str | None) -> None:
        """Record a key's placement for every instance."""
        ...

    def touch(self, key: str, backend_id: str) -> bool:
        """Refresh the key's placement if still on ``backend_id``; False if it is unknown."""
        ...

    def recall(self, key: str, ttl: float) -> tuple[str, str | None, float] | None:
        """The key's placement (backend, first ready backend then, time) if younger than ttl."""
        ...


class SharedLoad(Protocol):
    """Where the processes of one balancer publish their per-backend session counts."""

    def publish(self, backend_id: str, sessions: int) -> None:
        """Set what this process counts on the backend (live sessions and held places)."""
        ...

    def remote(self, backend_id: str) -> int:
        """Sessions the *other* processes hold on the backend."""
        ...

    def remember(self, key: str, backend_id: str, first: str | None) -> None:
        """Record a key's placement for every process (the affinity table, shared)."""
        ...

    def touch(self, key: str, backend_id: str) -> None:
        """Restart the key's expiry if it is still placed on ``backend_id``."""
        ...

    def recall(self, key: str, ttl: float) -> tuple[str, str | None, float] | None:
        """The key's placement (backend, first ready backend then, time) if younger than ttl."""
        ...


PoolListener: TypeAlias = "Callable[[Pool, Backend, Change], None]"
"""Called after a member's state word or health changed (``Pool.listen``)."""


class Pool:
    """The backends of one pool, the state selection reads, and ``select`` (which dispatches
    on ``balance`` to ``balancer.selection``)."""

    def __init__(
        self,
        cfg: PoolCfg,
        *,
        affinity_size: int = 100_000,
        seed: int | None = None,
        hold_s: float | None = None,
        client_of: Callable[[str, str], str] | None = None,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.balance = cfg.balance
        self.factor = cfg.hash_balance_factor
        self.ceiling = cfg.affinity_ceiling
        self.overload_ratio = cfg.overload_ratio
        pl = cfg.placement
        self.placement = pl
        self.rules = selection.Rules(
            factor=cfg.hash_balance_factor,
            ceiling=cfg.affinity_ceiling,
            choices=pl.choices,
            slack=pl.slack,
            kv_limit=pl.kv_limit,
            move_cost=pl.move_cost,
            prefill_s=pl.prefill_ms_per_token / 1000.0,
        )
        # Keyless plain requests placed by their prompt's prefix (``balancer.prefix``).
        pp = cfg.prefix_placement
        self.prefix_rules = pp
        self.prefix = prefix.Table(pp.table_size, pp.block) if pp.enabled else None
        self.recent = prefix.Recent()  # what was placed where lately (prefix rule 5)
        self.prefix_placed: dict[str, int] = {
            "prefix": 0,
            "balance": 0,
            "ring": 0,
            "bound": 0,
            "response": 0,
        }
        # key -> its conversation (module docstring); forgotten with its placement.
        self._convs: dict[str, Conversation] = {}
        self._growth = _Mean()  # context tokens per turn
        self._answer = _Mean()  # answer tokens (worker messages) per turn
        self._turns = _Mean()  # turns of a conversation whose place lapsed
        self._final = _Mean()  # ... and its context
        # Backends measured overloaded relative to their peers (``selection.overloaded``).
        self.overloaded: set[str] = set()
        self.backends: dict[str, Backend] = {}
        self.ring = Ring({})
        # key -> (backend placed on, the key's first ready backend on the ring then, loop time)
        self._affinity: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()
        self._affinity_size = affinity_size
        # key -> (backend holding its place, loop time the hold ends), in expiry order
        self._held: OrderedDict[str, tuple[Backend, float]] = OrderedDict()
        # key -> (backend placed on, loop time the placement lapses): handshakes under way
        self._pending: OrderedDict[str, tuple[Backend, float]] = OrderedDict()
        self.hold_s = cfg.affinity_hold if hold_s is None else hold_s
        # client -> the keys whose places it holds, the longest-quiet first; key -> its client
        self._holds_of: dict[str, OrderedDict[str, None]] = {}
        self._holder: dict[str, str] = {}
        self.per_client = cfg.affinity_hold_per_client
        # Whose a key's place is, from the key and its client's address (with ``auth.jwt``,
        # ``auth.key_owner``: the owner a scoped key names); None: the address.
        self.client_of = client_of
        self._rr = selection.SmoothRoundRobin()
        self._random = random.Random(seed)
        # Session counts shared with the other processes of ``workers: N`` (None: alone).
        self.shared: SharedLoad | None = None
        # The affinity table the instances of a cluster share (None: not in cluster mode).
        self.placements: SharedPlacements | None = None
        self._listeners: list[PoolListener] = []
        self._readmit_at = math.inf  # the earliest end of an ejection (``readmit``)
        for bc in cfg.backends:
            self.backends[bc.id] = b = Backend(bc)
            b.listen(self._heard)
        self._rebuild()

    # -- membership ------------------------------------------------------------------------

    def _rebuild(self) -> None:
        self.ring = Ring({b.id: b.weight for b in self.backends.values()})

    def add(self, cfg: BackendCfg) -> Backend:
        """Add a backend (a new ring is built and swapped in)."""
        if cfg.id in self.backends:
            raise ValueError(f"backend {cfg.id!r} exists")
        b = self.backends[cfg.id] = Backend(cfg)
        b.listen(self._heard)
        self._rebuild()
        return b

    def update(self, backend_id: str, cfg: BackendCfg) -> None:
        """Apply a new weight (or metrics URL) to a backend; a weight change rebuilds the ring."""
        if self.backends[backend_id].configure(cfg):
            self._rebuild()

    def remove(self, backend_id: str) -> Backend:
        """Remove a backend; its live sessions are the caller's business."""
        b = self.backends.pop(backend_id)
        b.unlisten(self._heard)
        self._rr.forget(backend_id)
        if self.prefix is not None:
            self.prefix.forget(backend_id)
        self.recent.forget(backend_id)
        self._rebuild()
        return b

    def listen(self, listener: PoolListener) -> None:
        """Call ``listener(pool, backend, change)`` after each change of a member's state word
        or health (``balancer.backend``), whatever its source."""
        self._listeners.append(listener)

    def _heard(self, b: Backend, change: Change) -> None:
        for listener in self._listeners:
            listener(self, b, change)

    # -- refresh and selection -------------------------------------------------------------

    def refresh(self, now: float) -> None:
        """Bring time-dependent state up to ``now``: ejections that ended, held places that
        expired, effective weights."""
        held = self._held
        while held:
            key, (hb, until) = next(iter(held.items()))
            if until > now:
                break
            del held[key]
            hb.held -= 1
            self._unhold(key)
            self._lapse(key, hb)
            self._publish(hb)
        pending = self._pending
        while pending:
            key, (pb, until) = next(iter(pending.items()))
            if until > now:
                break
            del pending[key]
            pb.pending -= 1
        w = self.cfg.weights
        shared = self.shared
        mid_tpot = (
            median(
                b.signals.tpot
                for b in self.backends.values()
                if b.ready
                and b.signals is not None
                and b.signals.tpot
                and now - b.signals.at <= w.stale_after
            )
            if w.coefficients.tpot > 0  # else speed() ignores it: skip the walk
            else None
        )
        if now >= self._readmit_at:
            self.readmit(now)
        for b in self.backends.values():
            if shared is not None:
                b.remote_sessions = shared.remote(b.id)
            was_stale = b.stale
            raw, b.stale = effective_weight(1.0, b.signals, now, w.stale_after, w.coefficients)
            if b.stale or was_stale or w.smoothing <= 0:  # no history to smooth against
                b.headroom = raw
            elif now > b.factor_at:
                # Exponential smoothing in time, however often this runs.
                b.headroom += (raw - b.headroom) * (
                    1.0 - math.exp((b.factor_at - now) / w.smoothing)
                )
            b.factor_at = now
            b.factor = b.headroom
            if not b.stale and b.signals is not None:  # tpot is a decayed mean already
                slower = speed(b.signals.tpot, mid_tpot, w.coefficients)
                b.factor = max(w.coefficients.min_factor, b.headroom * slower)
            b.effective_weight = b.spec.weight * b.factor
        # Shares among the ready backends with fresh signals, without the scrape noise.
        fresh = {b.id: b.factor for b in self.backends.values() if b.ready and not b.stale}
        denoised = denoise(fresh, w.coefficients.noise_band)
        for bid, f in denoised.items():
            b = self.backends[bid]
            b.effective_weight = b.spec.weight * f
        self.overloaded = selection.overloaded(denoised, self.overloaded, self.overload_ratio)
        if self.balance == "consistent":
            self._outlook(now)
            if held:
                self._trim_holds()

    def _outlook(self, now: float) -> None:
        """Each backend's wait, prefill time, KV size and demand (module docstring)."""
        w = self.cfg.weights
        answer = self._answer.get() or 0.0
        growth = self._growth.get() or 0.0
        turns = self._turns.get()
        prefills = []
        for b in self.backends.values():
            sig = b.signals
            fresh = sig is not None and not b.stale
            raw = 0.0
            if fresh and sig is not None:
                if sig.waiting and sig.tpot:
                    raw = sig.waiting / max(1.0, sig.running or 0.0) * answer * sig.tpot
                b.prefill_s = sig.prefill or 0.0
                if sig.kv_capacity:
                    b.kv_capacity = sig.kv_capacity
            else:
                b.prefill_s = 0.0
            if not fresh or w.smoothing <= 0:
                b.wait_s = raw
            elif now > b.wait_at:  # smoothed in time, as the weights are
                b.wait_s += (raw - b.wait_s) * (1.0 - math.exp((b.wait_at - now) / w.smoothing))
            b.wait_at = now
            if b.prefill_s > 0 and b.ready:
                prefills.append(b.prefill_s)
            n = b.sessions + b.held
            ahead = 1.0 if turns is None or not n else max(0.5, turns - b.turns_counted / n)
            b.kv_demand = b.context_counted + n * ahead * growth
        mid = median(prefills)
        default = mid if mid is not None else self.placement.prefill_ms_per_token / 1000.0
        if default != self.rules.prefill_s:
            self.rules = dataclasses.replace(self.rules, prefill_s=default)

    def _new_size(self) -> float:
        """The tokens a new conversation is expected to grow into (0 until one is known)."""
        final = self._final.get()
        if final is not None:
            return final
        return (self._growth.get() or 0.0) * (self._turns.get() or 1.0)

    def limit(self, b: Backend) -> float:
        """The factor of ``b``'s bound for a key returning to it (module docstring)."""
        return max(self.factor, self.ceiling)

    def _trim_holds(self) -> None:
        """Give up held places on backends above their limit (module docstring), oldest first.

        Giving one up lowers the total, and so every bound a little: repeat until no backend is
        over, or those that are hold no places.
        """
        ready = [b for b in self.backends.values() if b.ready]
        weight_sum = sum(b.effective_weight for b in ready)
        total = sum(b.counted for b in ready)

        def over(b: Backend) -> bool:
            return b.counted > load_bound(total, self.limit(b), b.effective_weight, weight_sum)

        in_pool = set(ready)
        held = self._held
        for _ in range(len(held)):
            if not any(b.held and over(b) for b in ready):
                return
            trimmed = False
            for key, (hb, _until) in list(held.items()):  # in expiry order: the oldest first
                if hb in in_pool and over(hb):
                    del held[key]
                    hb.held -= 1
                    total -= 1
                    self._unhold(key)
                    self._lapse(key, hb)
                    self._publish(hb)
                    trimmed = True
            if not trimmed:
                return

    def select(
        self,
        key: str,
        exclude: Iterable[str] = (),
        now: float = 0.0,
        prompt: prefix.Prompt | None = None,
    ) -> Backend | None:
        """Pick the backend for a new session with this key, or None if no backend is ready.

        ``exclude`` holds backends already tried for this session (connect failures), so the
        caller walks on to the next candidate. ``now`` is the clock of the scraped signals.
        ``prompt``: a keyless request's prompt, placed by its prefix where the pool has
        ``prefix_placement`` (``balancer.prefix``; ``key`` is then the one wslb made for it).
        """
        if prompt is not None and self.prefix is not None:
            return self.place_prompt(key, prompt, exclude, now)[0]
        self._unreserve(key)  # a retry: its last placement failed, or this one replaces it
        self.refresh(now)
        skip = set(exclude)
        ready = [b for b in self.backends.values() if b.ready and b.id not in skip]
        if not ready:
            return None
        if self.balance == "consistent":
            hold = self._held.get(key)
            remembered = self._remembered(key)
            conv = self._convs.get(key)
            choice = selection.consistent(
                ready,
                self.ring.walk(key),
                self.rules,
                held_on=hold[0] if hold is not None else None,
                remembered=remembered[:2] if remembered is not None else None,
                context=conv.context if conv is not None and conv.context > 0 else None,
                size=self._new_size(),
                sticky=self.placements is not None,
            )
            for b, why in choice.passed:
                b.refused[why] = b.refused.get(why, 0) + 1
            if choice.left is not None:
                b, why = choice.left
                b.moved[why] = b.moved.get(why, 0) + 1
            chosen = choice.backend
            if hold is None or hold[0] is not chosen:  # its held place counts there already
                self._pending[key] = (chosen, now + PENDING_S)
                chosen.pending += 1
            return chosen
        if self.balance == "least_conn":
            return selection.least_conn(ready)
        if self.balance == "round_robin":
            return self._rr.pick(ready)
        return selection.weighted_random(self._random, ready)

    def place_prompt(
        self, key: str, prompt: prefix.Prompt, exclude: Iterable[str] = (), now: float = 0.0
    ) -> tuple[Backend | None, str]:
        """``select`` for a keyless request's ``prompt`` in a pool with ``prefix_placement``
        (``balancer.prefix``), and how it was placed: ``prefix`` (a worker holding its
        prefix), ``balance`` (the least loaded: the load was imbalanced), ``ring`` (its
        anchor on the ring, bounded load), ``bound`` (so placed too: every worker holding
        its prefix was at its bound) or ``response`` (the worker that made the response it
        continues); ``none`` when no backend is ready."""
        self._unreserve(key)
        self.refresh(now)
        skip = set(exclude)
        ready = [b for b in self.backends.values() if b.ready and b.id not in skip]
        if not ready:
            return None, "none"
        home = self._made_on(prompt.follows, ready) if prompt.follows is not None else None
        if home is not None:  # a response's continuation (prefix rule 8)
            chosen, why = home, "response"
            self.prefix_placed[why] += 1
        else:
            chosen, why = self._by_prefix(prompt, ready, now)
        self._pending[key] = (chosen, now + PENDING_S)
        chosen.pending += 1
        return chosen, why

    def _made_on(self, response_id: str, ready: Sequence[Backend]) -> Backend | None:
        """The ready backend that made the response (prefix rule 8), if known."""
        made = self._remembered(RESPONSE_KEY + response_id)
        return next((b for b in ready if made is not None and b.id == made[0]), None)

    def _by_prefix(
        self, prompt: prefix.Prompt, ready: Sequence[Backend], now: float
    ) -> tuple[Backend, str]:
        """``place_prompt``'s choice by the prompt's prefix (prefix rules 4, 5 and 7)."""
        assert self.prefix is not None
        walk = list(self.ring.walk(prompt.anchor))
        # New conversations by prompt have their own factor (prefix rule 5), keys the pool's.
        rules = dataclasses.replace(self.rules, factor=self.prefix_rules.balance_factor)
        strict = prefix.running_fits(ready, rules.factor)
        loose = selection.within_bound(ready, max(rules.factor, rules.ceiling))
        lately = self.recent.fits(ready, rules.factor, now)

        def fits(b: Backend, going_on: bool) -> bool:
            # A conversation going on is never held to less than a new one.
            return (loose(b) or strict(b)) if going_on else strict(b) and lately(b)

        m = self.prefix.match(prompt, (b.id for b in ready))
        shared, conv = self._shared_table(), prompt.conversation
        if shared is not None and conv is not None and not m.answered:
            # A conversation another instance or process placed (prefix rule 7): where the
            # tier or the board says.
            at = shared.recall(conv, AFFINITY_TTL)
            if at is not None and any(b.id == at[0] for b in ready):
                m = prefix.Match(prompt.size, (at[0],), answered=True)
        chosen, why = prefix.choose(prompt, m, ready, walk, self.prefix_rules, fits)
        self.prefix_placed[why] += 1
        if chosen is None:  # the ring, past the workers over their share of late traffic
            calm = [b for b in ready if lately(b)] or ready
            chosen = selection.consistent(calm, walk, rules, size=self._new_size()).backend
        if not (m.answered and why == "prefix"):  # a new conversation (prefix rule 5)
            self.recent.add(chosen.id, now)
        if shared is not None and conv is not None:
            shared.remember(conv, chosen.id, None)
        return chosen, why

    # -- accounting ------------------------------------------------------------------------

    def cancel(self, key: str) -> None:
        """The key's placement will not be attached (its handshake failed, or the caller only
        asked): stop counting it (it would lapse after ``PENDING_S`` anyway)."""
        self._unreserve(key)

    def _unreserve(self, key: str) -> None:
        """Stop counting the key's placement whose handshake was under way, if any."""
        entry = self._pending.pop(key, None)
        if entry is not None:
            entry[0].pending -= 1

    def attach(self, key: str, backend: Backend, now: float = 0.0) -> None:
        """Count a session placed on ``backend`` and remember the key's worker; a place the key
        held (wherever) is taken back, as is its placement under way."""
        self._unreserve(key)
        self._release(key)
        backend.sessions += 1
        backend.sessions_total += 1
        backend.consecutive_failures = 0
        self._publish(backend)
        aff = self._affinity
        first = self._first_ready(key)
        aff[key] = (backend.id, first, now)
        if self.shared is not None:
            self.shared.remember(key, backend.id, first)
        if self.placements is not None:
            self.placements.remember(key, backend.id, self._kept_first(key, backend.id, first))
        aff.move_to_end(key)
        conv = self._convs.get(key)
        if conv is None:
            conv = self._convs[key] = Conversation()
        self._count(conv, backend)
        self._prune(now)

    def _first_ready(self, key: str) -> str | None:
        """The key's first ready backend on the ring (recorded with its placement)."""
        return next(
            (bid for bid in self.ring.walk(key) if (b := self.backends.get(bid)) and b.ready), None
        )

    def _kept_first(self, key: str, backend_id: str, first: str | None) -> str | None:
        """The first backend to record with a cluster placement: a key back on its home while
        the first of its placement is not ready keeps that one, so that backend's return does
        not take the key from the worker holding its conversation (``selection``'s sticky
        homes: only a backend ahead of the recorded first takes keys back)."""
        assert self.placements is not None
        prev = self.placements.recall(key, AFFINITY_TTL)
        if prev is None or prev[0] != backend_id or prev[1] == first or prev[1] is None:
            return first
        was = self.backends.get(prev[1])
        return prev[1] if was is None or not was.ready else first

    def attach_request(self, backend: Backend) -> None:
        """Count a plain HTTP request whose key wslb made for it on ``backend`` while it runs:
        load for the bounds and drains, but no conversation and no held place (nothing says
        the key will come back)."""
        backend.sessions += 1
        backend.consecutive_failures = 0
        self._publish(backend)

    def learn(
        self, prompt: prefix.Prompt | None, backend: Backend, answer: bool = False
    ) -> prefix.Sent | None:
        """``prompt`` was sent to ``backend`` (placed by prefix): its blocks are there now.
        ``answer``: the caller will ``settle`` it with what the answer reports."""
        if prompt is None or self.prefix is None:
            return None
        return self.prefix.learn(prompt, backend.id, answer)

    def settle(
        self, sent: prefix.Sent, prompt: prefix.Prompt, reported: tuple[int, int] | None
    ) -> str | None:
        """The answer to a prompt ``learn`` sent has ended (``prefix.Table.settle``)."""
        return None if self.prefix is None else self.prefix.settle(sent, prompt, reported)

    def responded(self, response_id: str, backend: Backend, now: float = 0.0) -> bool:
        """``backend`` answered with the response ``response_id``: a request that continues it
        goes there (``prefix`` rule 8), from every process and instance that shares this
        one's affinity table. False when another backend named it first (kept there)."""
        key = RESPONSE_KEY + response_id
        made = self._remembered(key)
        if made is not None and made[0] != backend.id:
            return False
        table = self._shared_table()
        if table is not None:
            table.remember(key, backend.id, None)
        else:
            self._affinity[key] = (backend.id, None, now)
            self._affinity.move_to_end(key)
            self._prune(now)
        return True

    def detach_request(self, backend: Backend) -> None:
        """The request ``attach_request`` counted is over."""
        backend.sessions -= 1
        self._publish(backend)

    # -- conversations (module docstring) --------------------------------------------------

    def _count(self, conv: Conversation, b: Backend) -> None:
        """Count ``conv`` on ``b`` (and nowhere else)."""
        if conv.on is b:
            return
        self._uncount(conv)
        b.context_counted += conv.context
        b.turns_counted += conv.turns
        conv.on = b

    @staticmethod
    def _uncount(conv: Conversation) -> None:
        b = conv.on
        if b is not None:
            b.context_counted = max(0.0, b.context_counted - conv.context)
            b.turns_counted = max(0, b.turns_counted - conv.turns)
            conv.on = None

    def _relayed(self, conv: Conversation, relayed: Relayed) -> None:
        """Update a conversation with what one of its sessions relayed."""
        client_bytes, client_msgs, worker_msgs = relayed
        if client_msgs <= 0:
            return
        mean = client_bytes / self.placement.bytes_per_token / client_msgs
        context = max(conv.context, mean) + worker_msgs
        self._growth.add((context - conv.context) / client_msgs)
        self._answer.add(worker_msgs / client_msgs)
        b = conv.on
        if b is not None:
            b.context_counted += context - conv.context
            b.turns_counted += client_msgs
        conv.context = context
        conv.turns += client_msgs

    def _lapse(self, key: str, hb: Backend) -> None:
        """A key's place on ``hb`` lapsed (expired or given up): it is counted nowhere, and
        its conversation, taken as over, teaches the pool a length."""
        conv = self._convs.get(key)
        if conv is None or conv.on is not hb:
            return
        self._uncount(conv)
        if conv.turns:
            self._turns.add(conv.turns)
            self._final.add(conv.context)

    def _prune(self, now: float) -> None:
        """Forget placements older than ``AFFINITY_TTL`` (their KV cache is gone by then) and
        beyond the table's size, so memory follows the live key set, not every key ever seen."""
        aff = self._affinity
        while len(aff) > self._affinity_size:
            self._forget(aff.popitem(last=False)[0])
        if now > 0.0:
            horizon = now - AFFINITY_TTL
            while aff and next(iter(aff.values()))[2] < horizon:
                self._forget(aff.popitem(last=False)[0])

    def _forget(self, key: str) -> None:
        """Drop a forgotten placement's conversation, unless it is still counted somewhere."""
        conv = self._convs.get(key)
        if conv is not None and conv.on is None:
            del self._convs[key]

    def failed(self, backend: Backend, now: float) -> bool:
        """Passive outlier detection: count a connect/handshake failure; True if now ejected.

        After ``consecutive_failures`` in a row the backend is ejected for
        ``base_ejection_time x n`` (n grows with each ejection, capped at ``max_ejection_time``;
        it starts over once the backend has stayed in for ``max_ejection_time``). No more than
        ``max_ejection_percent`` of the pool is ejected at once, so a network blip cannot empty it.
        """
        o = self.cfg.outlier
        backend.connect_failures += 1
        backend.consecutive_failures += 1
        if backend.ejected or backend.consecutive_failures < o.consecutive_failures:
            return False
        ejected = sum(1 for b in self.backends.values() if b.ejected)
        # As Envoy does, one backend may always be ejected, whatever the percentage.
        if ejected and (ejected + 1) * 100 > o.max_ejection_percent * len(self.backends):
            return False
        until = backend.eject(now, o.base_ejection_time, o.max_ejection_time)
        self._readmit_at = min(self._readmit_at, until)
        backend.consecutive_failures = 0
        return True

    def readmit(self, now: float) -> None:
        """End the ejections that are over at loop time ``now`` (the shell's timer at their
        end, or ``refresh``)."""
        nxt = math.inf
        for b in self.backends.values():
            if b.ejected and not b.readmit(now):
                nxt = min(nxt, b.ejected_until)
        self._readmit_at = nxt

    def succeeded(self, backend: Backend) -> None:
        """A connect and handshake worked: the failure streak ends."""
        backend.consecutive_failures = 0

    def _release(self, key: str) -> None:
        """Give back the place the key holds, if any (its conversation is counted nowhere
        until the caller counts it again)."""
        hold = self._held.pop(key, None)
        if hold is not None:
            hold[0].held -= 1
            self._unhold(key)
            conv = self._convs.get(key)
            if conv is not None and conv.on is hold[0]:
                self._uncount(conv)
            self._publish(hold[0])

    def detach(
        self,
        backend: Backend,
        key: str | None = None,
        now: float = 0.0,
        relayed: Relayed | None = None,
        client: str | None = None,
    ) -> None:
        """Count a session gone from ``backend``; its key's placement counts from now, and the
        key holds its place there for ``hold_s`` (module docstring). ``relayed``: what the
        session relayed, for its conversation's size; ``client``: whose place it is (the
        per-client bound; None: no one's, unbounded)."""
        backend.sessions -= 1
        if key is not None:
            entry = self._affinity.get(key)
            if entry is not None and entry[0] == backend.id:
                self._affinity[key] = (entry[0], entry[1], now)
                self._affinity.move_to_end(key)
            if self.shared is not None:
                self.shared.touch(key, backend.id)
            if self.placements is not None and not self.placements.touch(key, backend.id):
                # Forgotten meanwhile (a session longer than the window): placed here still.
                self.placements.remember(key, backend.id, self._first_ready(key))
            conv = self._convs.get(key)
            if conv is not None and relayed is not None:
                self._relayed(conv, relayed)
            if self.hold_s > 0 and self.backends.get(backend.id) is backend:
                self._release(key)
                self._held[key] = (backend, now + self.hold_s)
                backend.held += 1
                if conv is not None:
                    self._count(conv, backend)
                if client is not None and self.per_client > 0:
                    who = client if self.client_of is None else self.client_of(key, client)
                    self._hold_for(who, key)
            elif conv is not None and conv.on is backend:
                self._lapse(key, backend)
        self._publish(backend)

    def _hold_for(self, client: str, key: str) -> None:
        """Count the key's new place as ``client``'s; past the bound its longest-quiet place
        is given up (module docstring)."""
        keys = self._holds_of.get(client)
        if keys is None:
            keys = self._holds_of[client] = OrderedDict()
        keys[key] = None
        self._holder[key] = client
        while len(keys) > self.per_client:
            oldest = next(iter(keys))
            hold = self._held.pop(oldest, None)
            self._unhold(oldest)
            if hold is not None:
                hb = hold[0]
                hb.held -= 1
                self._lapse(oldest, hb)
                self._publish(hb)

    def _unhold(self, key: str) -> None:
        """The key's place is gone (taken back, expired or given up): its client's no more."""
        client = self._holder.pop(key, None)
        if client is None:
            return
        keys = self._holds_of[client]
        del keys[key]
        if not keys:
            del self._holds_of[client]

    def held_by(self, client: str) -> int:
        """Places ``client`` holds now."""
        keys = self._holds_of.get(client)
        return len(keys) if keys is not None else 0

    def _publish(self, backend: Backend) -> None:
        """Tell the other processes of ``workers: N`` what this one counts on the backend:
        its live sessions and the places it holds."""
        if self.shared is not None:
            self.shared.publish(backend.id, backend.sessions + backend.held)

    def _remembered(self, key: str) -> tuple[str, str | None, float] | None:
        """The key's last placement: from the cluster's shared table, or the board under
        ``workers: N`` (the instance or process that accepts a key's reconnect need not be the
        one that placed it), else this process's."""
        table = self._shared_table()
        return self._affinity.get(key) if table is None else table.recall(key, AFFINITY_TTL)

    def _shared_table(self) -> SharedPlacements | SharedLoad | None:
        """The affinity table the other instances or processes read: the tier's in cluster
        mode, else the board's under ``workers: N``, else none (this process's own)."""
        return self.placements if self.placements is not None else self.shared

    def knows(self, key: str) -> bool:
        """Whether the key has a place already (a live conversation, a held place, or a
        remembered worker): its next request goes home rather than by its prompt."""
        return key in self._convs or key in self._held or self._remembered(key) is not None

    def last_backend(self, key: str) -> str | None:
        """The backend this key was last placed on, if remembered."""
        entry = self._remembered(key)
        return entry[0] if entry is not None else None
