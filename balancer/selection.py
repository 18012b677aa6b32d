"""The balance algorithms: which ready backend a new session goes to.

Kept apart from ``balancer.pool`` so that each policy is a small, sans-I/O function of what it is
given (the ready backends, the key's ring walk, their counts, effective weights and the load
estimates the pool keeps on each ``Backend``) and can be read and tested alone; the pool owns the
state they read (membership, holds, the affinity table, the conversations' sizes) and dispatches
on ``balance``. Nothing here imports the pool.

``consistent``: place for the whole conversation, move only when it pays.

- *Candidates.* A key's candidates are the first ``choices`` ready backends on its ring walk that
  stay within their bound, ``ring.load_bound`` with ``c = hash_balance_factor`` (HAProxy's and
  Envoy's bounded load), counting held places as ``balancer.pool`` describes. The bound is a
  ceiling, not a target: a backend is not filled to it while another candidate has room.
- *A new key* (the pool has no placement for it) goes to the first candidate unless another is
  lighter: a candidate's *load* is its counted conversations after the placement per unit of
  effective weight, and the lightest candidate takes the key when the first's load is more than
  ``slack`` above it (ring order decides among equals, so a key's worker stays predictable and a
  pool at rest places exactly as plain bounded-load hashing). Before that, candidates without KV
  room are passed over while one has it: room means the tokens the conversations counted there
  are expected to grow into (``Backend.kv_demand``: their estimated context now plus their
  expected turns ahead times the growth per turn, from what wslb relayed), plus the new
  conversation's expected size, stay within ``kv_limit`` of the backend's KV size (scraped; a
  backend of unknown size always has room). So a burst of new conversations, all placed before
  any load shows, is spread by their counts, not stacked on the worker the ring favours up to
  its bound; and mixed conversation sizes are spread by the KV they will need.
- *A returning key* has a home: the backend it was last placed on (the affinity table, a bounded
  LRU like an HAProxy stick table), if the key's first ready backend on the ring is still the
  one it was then, else the backend holding its place. If readiness changed since its placement
  (a worker went down and came back), the ring decides again, so keys return to a worker when it
  returns. The key stays home unless a move *pays*: its worker holds the conversation's KV cache,
  and anywhere else its whole context is prefilled again. With ``x`` the backend the key would be
  placed on as a new key (the home left out), ``n`` the key's estimated context tokens and
  ``p(b)`` the backend's prefill time per token (scraped, else the pool's median, else
  ``prefill_ms_per_token``)::

      stay = wait(home) + evicted(home) x n x p(home)
      move = n x p(x) + wait(x)
      the key moves iff stay > move_cost x move

  ``wait(b)`` is the expected time a new turn waits there before its prefill starts: the
  requests queued ahead per running one times the time a running answer takes (``waiting /
  max(1, running) x answer tokens x tpot``, smoothed), and ``evicted(b)`` the share of the
  counted conversations' context that does not fit in its KV cache (``1 - capacity / context``
  when they exceed it: the part LRU evicts, which a turn prefills again even at home). A key of
  unknown size (placed by another process) does not move for cost. Identical workers, each
  with its share, wait alike, so no returning key moves between them; a worker whose queue
  makes a turn wait longer than re-prefilling the conversation elsewhere gives it up.
- A hard ceiling stays: a returning key leaves a home that would go above ``affinity_ceiling``
  x its weighted share (the same bound with the ceiling in place of ``c``), e.g. when the pool
  empties around the conversations one worker holds; it then walks its ring as a new key does.
- *Sticky homes* (``sticky``: cluster mode, where the affinity table is the tier's): a returning
  key goes home, with neither the ceiling nor the cost rule. Both read a load view that is each
  instance's own (its sessions and holds now, the others' as of its last scrape), so applying
  them would send one key to different workers from different instances; the key's worker is
  a fact every instance shares instead. A backend going down that was the key's first then
  does not send it away from a home still up (there is nothing to return to); a backend ahead
  of that one coming back does, as above. So only new keys, keys whose home is not ready, and
  keys a returning backend takes back are placed by the bounded-load rules.

A key holding a place on a ready backend is already counted there: placing it anywhere adds
nothing to the total, and taking its own place back adds nothing there.

Each decision says why (``Choice``): the candidates passed over (``bound``: above its ``c``
bound; ``load``: a lighter candidate took the key; ``kv``: no KV room) and a returning key's
move (``cost`` or ``ceiling``). The pool counts them per backend for ``GET /backends`` and
``/metrics``.

``overloaded``, measured relative to the peers, is reported (``GET /backends``) but no longer
moves keys by itself: a backend's pressure is the median load factor of the ready backends with
fresh signals divided by its own (effective weight per unit of static weight: ``weights``). It
becomes overloaded at pressure ``>= overload_ratio`` and stays so until its pressure falls below
``1 + (overload_ratio - 1) / 2``, so a backend at the threshold does not flap. A backend with
stale or no signals, or fewer than two fresh ready backends, is never overloaded.

``least_conn``: the fewest live sessions (every process's) per unit of effective weight, ties to
the lowest id. ``round_robin``: smooth weighted round robin, as nginx does it. ``random``: a
weighted draw from the pool's seeded ``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from balancer.backend import Backend
from balancer.ring import load_bound
from balancer.weights import median

__all__ = [
    "MOVED",
    "REFUSED",
    "Choice",
    "Rules",
    "SmoothRoundRobin",
    "consistent",
    "evicted",
    "least_conn",
    "move_pays",
    "overloaded",
    "weighted_random",
]

_Fits = Callable[[Backend, float], bool]

REFUSED = ("bound", "load", "kv")
"""Why a new key's ring candidate was passed over (``Choice.passed``)."""
MOVED = ("cost", "ceiling")
"""Why a returning key left its home (``Choice.left``)."""


@dataclass(frozen=True, slots=True)
class Rules:
    """A pool's ``consistent`` settings (``PoolCfg`` and its ``placement``)."""

    factor: float = 1.25
    ceiling: float = 2.0
    choices: int = 2
    slack: float = 1.0
    kv_limit: float = 0.9
    move_cost: float = 1.5
    prefill_s: float = 0.0002
    """Prefill seconds per token where none is scraped (the pool's median first)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a key goes, and why it did not go elsewhere."""

    backend: Backend
    passed: tuple[tuple[Backend, str], ...] = ()
    """Ring candidates before ``backend`` that did not take the new key, with the reason."""
    left: tuple[Backend, str] | None = None
    """The home a returning key left, with the reason."""


def overloaded(factors: Mapping[str, float], was: Set[str], ratio: float) -> set[str]:
    """The backends among ``factors`` (id -> load factor, fresh ready backends only) that are
    overloaded relative to their peers, given those that were (``was``): the hysteresis of the
    module docstring. ``ratio`` of 1 or less turns the test off (none is overloaded)."""
    if ratio <= 1.0 or len(factors) < 2:
        return set()
    mid = median(factors.values())
    if mid is None or mid <= 0:
        return set()
    leave = 1.0 + (ratio - 1.0) / 2.0
    out = set()
    for bid, f in factors.items():
        pressure = mid / f if f > 0 else math.inf
        if pressure >= ratio or (bid in was and pressure >= leave):
            out.add(bid)
    return out


def evicted(b: Backend) -> float:
    """The share of the context counted on ``b`` that its KV cache cannot hold (0 when it fits
    or its size is unknown): what LRU has evicted, or will, by the time a turn comes back."""
    if b.kv_capacity <= 0 or b.context_counted <= b.kv_capacity:
        return 0.0
    return 1.0 - b.kv_capacity / b.context_counted


def move_pays(
    home: Backend, target: Backend, context: float, move_cost: float, prefill_s: float
) -> bool:
    """Whether a returning key of ``context`` estimated tokens should leave ``home`` for
    ``target`` (the module docstring's formula; ``prefill_s``: the time per token of a backend
    that reports none)."""
    stay = home.wait_s + evicted(home) * context * (home.prefill_s or prefill_s)
    move = context * (target.prefill_s or prefill_s) + target.wait_s
    return stay > move_cost * move


def within_bound(ready: Sequence[Backend], factor: float) -> Callable[[Backend], bool]:
    """Whether one more request or session keeps a backend within ``factor`` times its share
    of the load after it (the bounded-load rule of ``consistent``, for other placements),
    and never below its share plus one: with few running, ``factor`` times a share of one or
    two would move a prompt off its cache for less than one request of balance."""
    total_after = sum(b.counted for b in ready) + 1
    weight_sum = sum(b.effective_weight for b in ready)

    def fits(b: Backend) -> bool:
        w = b.effective_weight
        bound = max(
            load_bound(total_after, factor, w, weight_sum),
            load_bound(total_after, 1.0, w, weight_sum) + 1,
        )
        return b.counted + 1 <= bound

    return fits


def consistent(
    ready: Sequence[Backend],
    walk: Iterable[str],
    rules: Rules,
    held_on: Backend | None = None,
    remembered: tuple[str, str | None] | None = None,
    *,
    context: float | None = None,
    size: float = 0.0,
    sticky: bool = False,
) -> Choice:
    """Bounded-load consistent hashing over ``ready`` (not empty), placing for the whole
    conversation and moving a returning key only when it pays (module docstring).

    ``walk`` is the key's ring walk (backend ids, nearest first). ``held_on`` is the backend the
    key holds a place on, if any; ``remembered`` its last placement: (backend placed on, the
    key's first ready backend then). ``context``: the key's estimated context tokens (None:
    unknown); ``size``: the tokens a new conversation is expected to grow into; ``sticky``: a
    returning key stays home whatever the loads (module docstring).
    """
    by_id = {b.id: b for b in ready}
    holder = held_on if held_on is not None and by_id.get(held_on.id) is held_on else None
    total_after = sum(b.counted for b in ready) + (0 if holder is not None else 1)
    weight_sum = sum(b.effective_weight for b in ready)

    def fits(b: Backend, c: float) -> bool:
        after = b.counted if b is holder else b.counted + 1
        return after <= load_bound(total_after, c, b.effective_weight, weight_sum)

    on_ring = [b for bid in walk if (b := by_id.get(bid)) is not None]
    first = on_ring[0].id if on_ring else None
    home: Backend | None = None
    if remembered is not None:
        if remembered[1] == first or (sticky and remembered[1] not in by_id):
            home = by_id.get(remembered[0])
    else:
        home = holder
    left: tuple[Backend, str] | None = None
    if home is not None and sticky:
        return Choice(home)
    if home is not None:
        if not fits(home, max(rules.factor, rules.ceiling)):
            left = (home, "ceiling")
            on_ring = [b for b in on_ring if b is not home]
        elif context is None:
            return Choice(home)
        else:
            others = [b for b in on_ring if b is not home]
            target = _place(others, rules, fits, holder, size)
            if target is None or not move_pays(
                home, target.backend, context, rules.move_cost, rules.prefill_s
            ):
                return Choice(home)
            return Choice(target.backend, target.passed, (home, "cost"))
    placed = _place(on_ring, rules, fits, holder, size)
    if placed is None:
        # Unreachable with factor > 1 (the bounds sum above the load); be safe regardless.
        b = min(ready, key=lambda b: (b.counted / b.effective_weight, b.id))
        return Choice(b, left=left)
    return Choice(placed.backend, placed.passed, left)


def _place(
    on_ring: Sequence[Backend],
    rules: Rules,
    fits: _Fits,
    holder: Backend | None,
    size: float,
) -> Choice | None:
    """A new key's backend among ``on_ring`` (its walk, nearest first), or None if none is
    within its ``c`` bound: the module docstring's candidates, KV room and load rules."""
    candidates: list[Backend] = []
    passed: list[tuple[Backend, str]] = []
    for b in on_ring:
        if fits(b, rules.factor):
            candidates.append(b)
            if len(candidates) >= rules.choices:
                break
        elif not candidates:
            passed.append((b, "bound"))
    if not candidates:
        return None

    def room(b: Backend) -> bool:
        cap = b.kv_capacity
        return cap <= 0 or b.kv_demand + (0.0 if b is holder else size) <= rules.kv_limit * cap

    def load(b: Backend) -> float:
        return (b.counted + (0 if b is holder else 1)) / b.effective_weight

    roomy = [b for b in candidates if room(b)] or candidates
    chosen = roomy[0]
    lightest = min(roomy, key=lambda b: (load(b), roomy.index(b)))
    if load(chosen) - load(lightest) > rules.slack:
        chosen = lightest
    for b in candidates:
        if b is chosen:
            break
        passed.append((b, "load" if b in roomy else "kv"))
    return Choice(chosen, tuple(passed))


def least_conn(ready: Sequence[Backend]) -> Backend:
    """The fewest live sessions per unit of effective weight, counting the new one."""
    return min(ready, key=lambda b: ((b.load + 1) / b.effective_weight, b.id))


def weighted_random(rng: random.Random, ready: Sequence[Backend]) -> Backend:
    """A draw weighted by effective weight (one ``rng.choices`` call per pick)."""
    return rng.choices(ready, weights=[b.effective_weight for b in ready])[0]


class SmoothRoundRobin:
    """Smooth weighted round robin, as nginx does it: each pick adds every ready backend's
    weight to its current value, takes the highest (the first in order on a tie) and takes the
    round's total weight off it."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def pick(self, ready: Sequence[Backend]) -> Backend:
        current = self.current
        total = 0.0
        best: Backend | None = None
        for b in ready:
            cur = current.get(b.id, 0.0) + b.effective_weight
            current[b.id] = cur
            total += b.effective_weight
            if best is None or cur > current[best.id]:
                best = b
        assert best is not None
        current[best.id] -= total
        return best

    def forget(self, backend_id: str) -> None:
        """Drop a removed backend's state."""
        self.current.pop(backend_id, None)
