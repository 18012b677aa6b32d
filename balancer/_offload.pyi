# The offload thread (balancer/_offload.c; balancer/aio/offload.py and aio/lanes.py drive it).
from typing import Final

# Event kinds of Thread.events().
RETURNED: Final[int]
RECORD: Final[int]
FLUSH: Final[int]
# Why a session came back (the reason of Thread.remove()).
TAKEN_BACK: Final[int]
FRAME: Final[int]
EOF: Final[int]
READ_ERROR: Final[int]
WRITE_ERROR: Final[int]
NOMEM: Final[int]  # out of memory; its bytes come back intact all the same
BUF_SIZE: Final[int]
REC_NOTIFY: Final[int]
# Why a lane came back (the reason of Thread.remove_lane()).
HANDBACK: Final[int]
RETRY: Final[int]
WORKER_DONE: Final[int]
RELEASED: Final[int]
IDLE: Final[int]
CLIENT_EOF: Final[int]
CLIENT_GONE: Final[int]
FAILED: Final[int]
CLOSED: Final[int]

# A lane's spec, as ``Exchange.lane_spec`` makes it (its one definition).
Spec = tuple[
    bytes,  # sig: the target, then each routing header's values ("\0name\0v1\1v2")
    tuple[bytes, ...],  # sig_names: those headers (lowercase)
    bytes,  # target: the worker's
    bytes,  # pre: wslb's header lines before the client's
    bytes,  # post: and after them
    tuple[bytes, ...],  # drop: client header names not copied
    tuple[bytes, ...],  # resp_drop: worker header names not copied
    bytes,  # resp_add: wslb's header lines in the answer
    int,  # max_head
    int,  # max_headers
    int,  # max_body
    float,  # t_request
    float,  # t_server
    float,  # t_idle
    float,  # t_stall: timeouts.backpressure (a client that takes nothing for this long is cut)
    bytes,  # peer (the access line's client)
    bytes,  # key (the client's)
    bytes,  # pool
    bytes,  # backend
]

class Thread:
    live: int
    def __init__(self, buckets: tuple[float, ...] = ...) -> None: ...
    # Sessions (the relay).
    def add(
        self, worker_fd: int, client_fd: int, limit: int, record: bool, chunked: bool = False
    ) -> int: ...
    def remove(self, handle: int) -> tuple[bytes, bytes, bytes, int, int, int, int]: ...
    def counts(self, handle: int) -> tuple[int, int]: ...
    def take_record(self, handle: int) -> bytes: ...
    # Lanes (plain HTTP).
    def add_lane(self, client_fd: int, worker_fd: int, carry: bytes, spec: Spec) -> int: ...
    def release(self, handle: int) -> bool: ...
    def abort(self, handle: int, why: str) -> bool: ...
    def remove_lane(self, handle: int) -> tuple[bytes, int, int, int, int, float]: ...
    def take_log(
        self,
    ) -> list[
        tuple[int, float, bytes, bytes, int, bool, float, float, int, int, str, bytes | None]
    ]: ...
    def take_stats(
        self,
    ) -> tuple[list[tuple[str, int, int, tuple[int, ...], int, float]], int, int, int]: ...
    def set_log(self, on: bool) -> None: ...
    # Both.
    def events(self) -> list[tuple[int, int]]: ...
    def fileno(self) -> int: ...
    def close(self) -> list[int]: ...

# Test-only (tests/test_relay_faults.py): the next ``n`` allocations of a session's I/O (kind
# "alloc") or lists of Thread.events() ("events") fail; what was left of the last setting (``n``
# < 0: only that). Inert unless a test sets it; nothing else may call it.
def _fail_next(kind: str, n: int) -> int: ...

# Test-only (tests/test_hostile_worker.py): while on, every offload thread spins without a lock.
def _spin(on: bool) -> None: ...
