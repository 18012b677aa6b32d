# Event kinds of Relay.events().
RETURNED: int
RECORD: int
# Why a session came back (the reason of Relay.remove()).
TAKEN_BACK: int
FRAME: int
EOF: int
READ_ERROR: int
WRITE_ERROR: int
NOMEM: int  # out of memory; its bytes come back intact all the same
BUF_SIZE: int
REC_NOTIFY: int

class Relay:
    live: int
    def __init__(self) -> None: ...
    def add(
        self, worker_fd: int, client_fd: int, limit: int, record: bool, chunked: bool = False
    ) -> int: ...
    def remove(self, handle: int) -> tuple[bytes, bytes, bytes, int, int, int, int]: ...
    def counts(self, handle: int) -> tuple[int, int]: ...
    def take_record(self, handle: int) -> bytes: ...
    def events(self) -> list[tuple[int, int]]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

# Test-only (tests/test_relay_faults.py): the next ``n`` allocations of the relay thread
# (kind "alloc") or lists of Relay.events() ("events") fail; what was left of the last setting
# (``n`` < 0: only that).
# Inert unless a test sets it; nothing else may call it.
def _fail_next(kind: str, n: int) -> int: ...
