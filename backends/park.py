"""Parking: a session whose wslb leg dropped keeps going on the worker, for a reattach.

Sans-I/O (no asyncio, no clock): the ``X-WSLB-Park`` parameters, the window of what a
connection sent, and the state of one connection's park. ``backends.server`` is the shell: it
parks on a lost leg, runs the grace timer, makes a parked ``send`` wait, and serves reattaches.

Why on the worker: when a wslb instance dies (kill -9, OOM) or is stopped for a rollout, the
legs it held drop without a close frame, and the answer in flight would be lost. The worker is
where the messages come from, so it keeps what it sent for a while, and any wslb instance that
holds the handoff secret and the client's resume token can continue the session from the
client's message count.

The rules, for one connection opened with park parameters (``Park``):

- Numbering. Data messages are numbered in the session's numbering: the connection's first
  data message sent is number ``base`` (the messages the client already had); every data
  message ``Connection.send`` sends is counted (a greeting, tokens, the end of an answer,
  errors, Realtime and Responses events).
- The window keeps the texts sent, as sent (the same ``str`` objects), oldest first. While the
  leg is attached it is trimmed oldest-first to at most ``window`` bytes, always keeping the
  newest message. Nothing else removes a message.
- ATTACHED: a message goes into the window, then onto the leg.
- The leg ends without a close frame from wslb (reset, EOF, error), and the connection was not
  frozen, retired or dropped and the worker is not shutting down: ATTACHED -> PARKED. A close
  frame (any code) is an ending, as it is without parking.
- PARKED: the answer keeps running; a message goes into the window only, and is never trimmed
  or dropped: while the window holds ``window`` bytes or more, the sender waits (the answer
  pauses). ``grace`` seconds after the loss without a reattach, the session ends as when a
  client leaves.
- A reattach from message N with the digest of the resume token: refused (the park unchanged)
  when the digest differs (``unknown``), N is before the window's first message (``expired``)
  or after the last one sent (``count_ahead``). Accepted: PARKED -> REPLAYING
  (``resumed``), or ATTACHED / REPLAYING -> REPLAYING when the old leg is still there (the
  worker has not noticed its loss: ``taken_over``; the old leg gets nothing more and is
  aborted). The new leg's parameters replace the old ones.
- REPLAYING: the new leg is written the window's messages N, N+1, ...; a message sent
  meanwhile goes into the window only (as PARKED), so it is written in its turn. Caught up:
  REPLAYING -> ATTACHED. The new leg lost during the replay: REPLAYING -> PARKED.
- ENDED: by the grace, a close frame, a freeze or the worker's shutdown; final.
"""

from __future__ import annotations

import enum
import hmac
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "MAX_GRACE",
    "MAX_WINDOW",
    "MIN_WINDOW",
    "Park",
    "ParkError",
    "ParkParams",
    "ParkState",
    "Refusal",
    "Window",
    "parse_count",
    "parse_park",
]

MIN_WINDOW: Final = 1024
MAX_WINDOW: Final = 64 * 1024 * 1024
MAX_GRACE: Final = 3600.0
MAX_COUNT_DIGITS: Final = 16
PARK_RULE: Final = (
    "expected 'base=B; grace=G; window=W; token=D' (B an integer >= 0, G seconds in (0, 3600], "
    "W bytes in 1024..67108864, D 64 lowercase hex characters)"
)

_DIGITS: Final = re.compile(r"[0-9]{1,16}")
_GRACE: Final = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,9})?")
_TOKEN: Final = re.compile(r"[0-9a-f]{64}")
_KEYS: Final = ("base", "grace", "window", "token")

Refusal = Literal["unknown", "expired", "count_ahead"]


class ParkError(ValueError):
    """A malformed ``X-WSLB-Park`` or ``X-WSLB-Reattach-From``; the message names the rule."""


@dataclass(frozen=True, slots=True)
class ParkParams:
    """``X-WSLB-Park``: ``base`` messages the client had, ``grace`` seconds a parked session
    waits, ``window`` bytes kept, ``token`` the resume token's sha256 (hex)."""

    base: int
    grace: float
    window: int
    token: str

    def matches(self, token: str) -> bool:
        """``token`` is this park's digest (constant time)."""
        return hmac.compare_digest(self.token.encode("ascii"), token.encode("ascii", "replace"))


def parse_count(value: str, what: str = "X-WSLB-Reattach-From") -> int:
    """A message count: 1-16 ASCII digits.

    Raises:
        ParkError: naming the rule.
    """
    value = value.strip(" \t")
    if not _DIGITS.fullmatch(value):
        raise ParkError(f"{what}: expected 1-16 ASCII digits")
    return int(value)


def parse_park(value: str) -> ParkParams:
    """``base=B; grace=G; window=W; token=D``: each key exactly once, in any order.

    Raises:
        ParkError: naming the rule broken.
    """
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, eq, val = part.strip(" \t").partition("=")
        if not eq or key not in _KEYS:
            raise ParkError(f"unknown or malformed field {part.strip()[:32]!r}: {PARK_RULE}")
        if key in fields:
            raise ParkError(f"{key} given twice: {PARK_RULE}")
        fields[key] = val.strip(" \t")
    missing = [k for k in _KEYS if k not in fields]
    if missing:
        raise ParkError(f"missing {', '.join(missing)}: {PARK_RULE}")
    if not _DIGITS.fullmatch(fields["base"]):
        raise ParkError("base must be an integer >= 0 (1-16 digits)")
    if not _GRACE.fullmatch(fields["grace"]) or not 0 < float(fields["grace"]) <= MAX_GRACE:
        raise ParkError("grace must be seconds in (0, 3600]")
    if not _DIGITS.fullmatch(fields["window"]) or not (
        MIN_WINDOW <= int(fields["window"]) <= MAX_WINDOW
    ):
        raise ParkError(f"window must be bytes in {MIN_WINDOW}..{MAX_WINDOW}")
    if not _TOKEN.fullmatch(fields["token"]):
        raise ParkError("token must be 64 lowercase hex characters (the resume token's sha256)")
    return ParkParams(
        int(fields["base"]), float(fields["grace"]), int(fields["window"]), fields["token"]
    )


class Window:
    """The messages a connection sent, numbered from ``first``; ``size`` is their bytes (the
    texts are JSON with ASCII escapes, so characters are bytes)."""

    __slots__ = ("_texts", "first", "size")

    def __init__(self, base: int) -> None:
        self._texts: deque[str] = deque()
        self.first = base
        self.size = 0

    def __len__(self) -> int:
        return len(self._texts)

    @property
    def next(self) -> int:
        """The number the next message sent gets."""
        return self.first + len(self._texts)

    def append(self, text: str) -> None:
        self._texts.append(text)
        self.size += len(text)

    def trim(self, limit: int) -> None:
        """Oldest first to at most ``limit`` bytes, keeping the newest message."""
        texts = self._texts
        while self.size > limit and len(texts) > 1:
            self.size -= len(texts.popleft())
            self.first += 1

    def get(self, n: int) -> str:
        """Message number ``n`` (``first <= n < next``)."""
        return self._texts[n - self.first]

    def since(self, n: int) -> Iterator[str]:
        """Messages ``n``, ``n+1``, ... as they are now."""
        for i in range(n - self.first, len(self._texts)):
            yield self._texts[i]

    def refusal(self, n: int) -> Refusal | None:
        """Why a reattach from message ``n`` cannot be served, if it cannot."""
        if n < self.first:
            return "expired"
        if n > self.next:
            return "count_ahead"
        return None


class ParkState(enum.Enum):
    ATTACHED = "attached"
    PARKED = "parked"
    REPLAYING = "replaying"
    ENDED = "ended"


_ATTACHED: Final = ParkState.ATTACHED


class Park:
    """One connection's park (the rules: the module docstring)."""

    __slots__ = ("params", "state", "window")

    def __init__(self, params: ParkParams) -> None:
        self.params = params
        self.window = Window(params.base)
        self.state = ParkState.ATTACHED

    @property
    def attached(self) -> bool:
        return self.state is ParkState.ATTACHED

    @property
    def parked(self) -> bool:
        return self.state is ParkState.PARKED

    def must_wait(self) -> bool:
        """A message now would exceed the bound while no leg takes it: the sender waits."""
        return self.state is not ParkState.ATTACHED and self.window.size >= self.params.window

    def record(self, text: str) -> bool:
        """A message sent: into the window (trimmed while attached). True when attached: the
        leg takes it too."""
        window = self.window
        window.append(text)
        if self.state is _ATTACHED:
            if window.size > self.params.window:
                window.trim(self.params.window)
            return True
        return False

    def lost(self) -> None:
        """The leg ended without a close frame."""
        self.state = ParkState.PARKED

    def judge(self, token: str, n: int) -> Refusal | None:
        """A reattach from message ``n`` with digest ``token``: why it is refused, if it is."""
        if self.state is ParkState.ENDED or not self.params.matches(token):
            return "unknown"
        return self.window.refusal(n)

    def reattach(self, params: ParkParams) -> None:
        """A reattach accepted (``judge`` said None): the replay starts; new parameters."""
        self.params = params
        self.state = ParkState.REPLAYING

    def caught_up(self) -> None:
        """The replay wrote the last message: the leg is live again."""
        self.state = ParkState.ATTACHED
        self.window.trim(self.params.window)

    def end(self) -> None:
        self.state = ParkState.ENDED
