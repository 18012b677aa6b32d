"""The board: shared memory of the processes of one balancer (``workers: N``).

``workers: N`` runs one supervisor and N serving processes on one listening port
(SO_REUSEPORT). Routing must stay one balancer's routing: the same ring (same config), the same
scraped signals and health, and bounds over *all* live sessions, not one process's share. The
board is a small memory-mapped file that gives each of them exactly that, without a message on
the hot path:

- a table of backend ids: a backend's slot is found by id, so every process agrees on it
  whatever order backends were added in (claims are rare and take an ``flock``);
- per slot, what the supervisor learnt about the backend (health, the four scraped signals and
  when they were scraped), written under a sequence lock so a reader never sees half a scrape;
- per process and slot, that process's live session count. Each count has one writer (the
  process that owns the row), and an aligned 8-byte store is atomic on the platforms we run on,
  so a reader sums the other rows without a lock;
- the affinity table: where each session key was last placed, so a key's reconnect finds its
  worker whichever process the kernel hands it to. It is a direct-mapped cache of
  ``AFFINITY_ENTRIES`` entries indexed by a stable 64-bit hash of the key (Python's ``hash`` is
  salted per process); a collision or a torn write (the hash is stored at both ends of the entry)
  reads as "not remembered", which costs one ring walk, never a wrong answer about the key.

A serving process that dies loses its sessions with it; the supervisor zeroes its row
(:meth:`Board.clear_row`) before starting its replacement.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass

__all__ = ["MAX_BACKENDS", "Board", "BoardInfo"]

MAGIC = b"WSLBBRD2"
MAX_BACKENDS = 1024
ID_BYTES = 128
_HEADER = struct.Struct("<8sII")
_HEADER_SIZE = 64
# seq, healthy, gpu_util, kv_cache_usage, running, waiting, tpot, scraped_at (monotonic)
_INFO = struct.Struct("<Q7d")
_INFO_SIZE = 64
assert _INFO.size <= _INFO_SIZE
AFFINITY_ENTRIES = 1 << 16
# key hash, backend slot + 1, first slot + 1 (0: none), time (CLOCK_MONOTONIC), key hash again
_AFF = struct.Struct("<QHH4xdQ")
_NAN = math.nan


@dataclass(frozen=True, slots=True)
class BoardInfo:
    """The supervisor's view of one backend; ``scraped_at`` is CLOCK_MONOTONIC (None: never)."""

    seq: int
    healthy: bool
    gpu_util: float | None
    kv_cache_usage: float | None
    running: float | None
    waiting: float | None
    tpot: float | None
    scraped_at: float | None


def _opt(v: float) -> float | None:
    return None if math.isnan(v) else v


class Board:
    """One process's handle on the board file.

    ``row`` is the process's own row of session counts (serving processes 0..N-1); the
    supervisor passes ``row=None`` and reads every row as remote.
    """

    def __init__(self, path: str, processes: int, row: int | None, *, create: bool = False):
        if processes < 1:
            raise ValueError("a board needs at least one process row")
        self.path = path
        self.processes = processes
        self.row = row
        self._names_at = _HEADER_SIZE
        self._info_at = self._names_at + MAX_BACKENDS * ID_BYTES
        self._aff_at = self._info_at + MAX_BACKENDS * _INFO_SIZE
        self._conns_at = self._aff_at + AFFINITY_ENTRIES * _AFF.size
        self._counts_at = self._conns_at + processes * 8
        size = self._counts_at + processes * MAX_BACKENDS * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self._fd, size)
            elif os.fstat(self._fd).st_size != size:
                raise ValueError(f"board {path} does not fit {processes} processes")
            self._mm = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        if create:
            _HEADER.pack_into(self._mm, 0, MAGIC, processes, MAX_BACKENDS)
        elif _HEADER.unpack_from(self._mm, 0) != (MAGIC, processes, MAX_BACKENDS):
            self.close()
            raise ValueError(f"{path} is not a wslb board for {processes} processes")
        view = memoryview(self._mm)
        self._counts = view[self._counts_at :].cast("q")
        self._conns = view[self._conns_at : self._counts_at].cast("q")
        self._slots: dict[str, int] = {}
        self._ids: dict[int, str] = {}

    def close(self) -> None:
        if hasattr(self, "_counts"):
            self._counts.release()
            self._conns.release()
            del self._counts, self._conns
        if not self._mm.closed:
            self._mm.close()
            os.close(self._fd)

    # -- slots -----------------------------------------------------------------------------

    def _find(self, raw: bytes) -> int | None:
        at = self._names_at
        for slot in range(MAX_BACKENDS):
            name = self._mm[at : at + ID_BYTES]
            if name[0] == 0:
                return None  # slots are claimed in order: the first empty one ends the table
            if name.rstrip(b"\0") == raw:
                return slot
            at += ID_BYTES
        return None

    def slot(self, backend_id: str) -> int:
        """The backend's slot, claimed on first use by whichever process sees it first."""
        slot = self._slots.get(backend_id)
        if slot is not None:
            return slot
        raw = backend_id.encode()
        if not raw or len(raw) > ID_BYTES or b"\0" in raw:
            raise ValueError(f"backend id {backend_id!r} does not fit the board")
        found = self._find(raw)
        if found is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                found = self._find(raw)
                if found is None:
                    found = next(
                        (
                            s
                            for s in range(MAX_BACKENDS)
                            if self._mm[self._names_at + s * ID_BYTES] == 0
                        ),
                        None,
                    )
                    if found is None:
                        raise ValueError(f"board full: more than {MAX_BACKENDS} backends")
                    at = self._names_at + found * ID_BYTES
                    self._mm[at : at + ID_BYTES] = raw.ljust(ID_BYTES, b"\0")
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._slots[backend_id] = found
        return found

    def _id_of(self, slot: int) -> str:
        bid = self._ids.get(slot)
        if bid is None:
            at = self._names_at + slot * ID_BYTES
            bid = self._mm[at : at + ID_BYTES].rstrip(b"\0").decode()
            self._ids[slot] = bid
        return bid

    # -- session counts (serving processes write their row, everyone reads) ---------------

    def publish(self, backend_id: str, sessions: int) -> None:
        """Set this process's live session count on the backend."""
        if self.row is None:
            raise ValueError("the supervisor has no row of its own")
        self._counts[self.row * MAX_BACKENDS + self.slot(backend_id)] = sessions

    def remote(self, backend_id: str) -> int:
        """Sessions the other processes hold on the backend."""
        slot = self.slot(backend_id)
        counts = self._counts
        return sum(counts[r * MAX_BACKENDS + slot] for r in range(self.processes) if r != self.row)

    def total(self, backend_id: str) -> int:
        slot = self.slot(backend_id)
        return sum(self._counts[r * MAX_BACKENDS + slot] for r in range(self.processes))

    def publish_connections(self, n: int) -> None:
        """Set this process's open client connections (for the balancer's ``max_connections``)."""
        if self.row is None:
            raise ValueError("the supervisor has no row of its own")
        self._conns[self.row] = n

    def connections(self) -> int:
        """Open client connections over every serving process."""
        return sum(self._conns)

    def clear_row(self, row: int) -> None:
        """Forget a dead process's counts (its sessions and connections died with it)."""
        self._conns[row] = 0
        start = row * MAX_BACKENDS
        for i in range(start, start + MAX_BACKENDS):
            self._counts[i] = 0

    # -- backend info (the supervisor writes, serving processes read) ----------------------

    def write_info(
        self,
        backend_id: str,
        *,
        healthy: bool,
        signals: tuple[float | None, ...] | None,
        scraped_at: float | None,
    ) -> None:
        at = self._info_at + self.slot(backend_id) * _INFO_SIZE
        seq = struct.unpack_from("<Q", self._mm, at)[0]
        struct.pack_into("<Q", self._mm, at, seq + 1)  # odd: a write is in progress
        """``signals``: gpu_util, kv_cache_usage, running, waiting, tpot (None: never scraped)."""
        values = [_NAN if v is None else v for v in (signals or (None,) * 5)]
        assert len(values) == 5
        _INFO.pack_into(
            self._mm,
            at,
            seq + 1,
            float(healthy),
            *values,
            _NAN if scraped_at is None else scraped_at,
        )
        struct.pack_into("<Q", self._mm, at, seq + 2)

    def read_info(self, backend_id: str) -> BoardInfo | None:
        """The supervisor's latest view of the backend, or None before its first write."""
        at = self._info_at + self.slot(backend_id) * _INFO_SIZE
        for _ in range(100):
            seq, healthy, gpu, kv, running, waiting, tpot, scraped = _INFO.unpack_from(self._mm, at)
            if seq % 2:
                continue  # a write is in progress: read again
            if struct.unpack_from("<Q", self._mm, at)[0] != seq:
                continue
            if seq == 0:
                return None
            return BoardInfo(
                seq,
                healthy > 0.5,
                _opt(gpu),
                _opt(kv),
                _opt(running),
                _opt(waiting),
                _opt(tpot),
                _opt(scraped),
            )
        return None

    # -- affinity (every serving process reads and writes) ---------------------------------

    @staticmethod
    def _hash(key: str) -> int:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return h or 1  # 0 marks an empty entry

    def remember(self, key: str, backend_id: str, first: str | None) -> None:
        """Record the key's placement (backend, and the key's first ready backend then)."""
        h = self._hash(key)
        at = self._aff_at + (h % AFFINITY_ENTRIES) * _AFF.size
        first_slot = 0 if first is None else self.slot(first) + 1
        _AFF.pack_into(self._mm, at, h, self.slot(backend_id) + 1, first_slot, time.monotonic(), h)

    def touch(self, key: str, backend_id: str) -> None:
        """Restart the placement's age if the key is still placed on ``backend_id``."""
        entry = self.recall(key, math.inf)
        if entry is not None and entry[0] == backend_id:
            self.remember(key, backend_id, entry[1])

    def recall(self, key: str, ttl: float) -> tuple[str, str | None, float] | None:
        """The key's placement if remembered and younger than ``ttl`` seconds: (backend, first
        ready backend then, CLOCK_MONOTONIC time of the placement)."""
        h = self._hash(key)
        at = self._aff_at + (h % AFFINITY_ENTRIES) * _AFF.size
        h1, slot, first, when, h2 = _AFF.unpack_from(self._mm, at)
        if h1 != h or h2 != h or slot == 0 or time.monotonic() - when > ttl:
            return None
        return self._id_of(slot - 1), None if first == 0 else self._id_of(first - 1), when
