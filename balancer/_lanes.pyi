# The lane thread (balancer/_lanes.c; balancer/aio/lanes.py drives it).

# Why a lane came back (the reason of Lanes.remove()).
HANDBACK: int
RETRY: int
WORKER_DONE: int
RELEASED: int
IDLE: int
CLIENT_EOF: int
CLIENT_GONE: int
FAILED: int
CLOSED: int
# The access log's forms (Lanes.set_log()).
LOG_OFF: int
LOG_TEXT: int
LOG_JSON: int
LOG_FIELDS: int

Spec = tuple[
    bytes,  # sig
    tuple[bytes, ...],  # sig_names
    bytes,  # target
    bytes,  # pre
    bytes,  # post
    tuple[bytes, ...],  # drop
    tuple[bytes, ...],  # resp_drop
    bytes,  # resp_add
    int,  # max_head
    int,  # max_headers
    int,  # max_body
    float,  # t_request
    float,  # t_server
    float,  # t_idle
    bytes,  # peer
    bytes,  # key
    bytes,  # pool
    bytes,  # backend
]

class Lanes:
    def __init__(self, buckets: tuple[float, ...]) -> None: ...
    def add(self, client_fd: int, worker_fd: int, carry: bytes, spec: Spec) -> int: ...
    def release(self, handle: int) -> bool: ...
    def abort(self, handle: int, why: str) -> bool: ...
    def remove(self, handle: int) -> tuple[bytes, int, int, int, int, float]: ...
    def events(self) -> list[int]: ...
    def take_log(self) -> bytes: ...
    def take_stats(
        self,
    ) -> tuple[
        list[tuple[str, int, int, int]],
        list[tuple[str, int, tuple[int, ...], int, float]],
        int,
        int,
        int,
    ]: ...
    def set_log(self, mode: int, tag: str) -> None: ...
    def live(self) -> int: ...
    def fileno(self) -> int: ...
    def close(self) -> list[int]: ...

# Test-only (tests/test_hostile_worker.py): while on, every lane thread spins without a lock.
def _spin(on: bool) -> None: ...
