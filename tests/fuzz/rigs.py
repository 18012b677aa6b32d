"""The C threads driven for real on socket pairs, for the property tests of tests/test_c_fuzz.py.

``LaneRig`` is one lane of ``_offload.Thread``: the test plays the client on one socket pair and the
worker on the other, with the spec ``Exchange.lane_spec`` would make for ``GET /t`` with the key
``k1``. Every wait has a deadline: a lane that never comes back (a thread spinning on a bad size)
fails the example, and its ``Lanes`` is leaked on purpose, so that the interpreter's exit does not
wait forever to join a thread that will not stop.
"""

from __future__ import annotations

import ctypes
import select
import socket
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from balancer.aio.httpproxy import _LANE_SIG
from balancer.httpmsg import LANE_DROP, RESPONSE_DROP

if TYPE_CHECKING:
    from balancer._offload import Spec

TARGET = b"/t"
KEY = b"k1"
HOST = b"h"
WORKER_TARGET = b"/w/t"
PRE = b"host: 127.0.0.1:9\r\n"
POST = b"x-session-id: k1\r\nx-forwarded-for: 127.0.0.1\r\nx-forwarded-proto: http\r\n"
RESP_ADD = b"x-session-id: k1\r\n"
MAX_BODY = 1 << 40
WAIT_S = 5.0


def signature(target: bytes = TARGET, host: bytes = HOST) -> bytes:
    """The lane's signature of a request with this target and one Host (no other routing
    header), as ``lane_spec`` builds it."""
    sig = [target]
    for name in _LANE_SIG:
        sig += [b"\0", name, b"\0", host if name == b"host" else b""]
    return b"".join(sig)


def spec(max_head: int = 16384, max_headers: int = 100, t_server: float = 2.0) -> Spec:
    """A spec as ``Exchange.lane_spec`` makes it (balancer._offload.Spec)."""
    return (
        signature(),
        _LANE_SIG,
        WORKER_TARGET,
        PRE,
        POST,
        tuple(sorted(LANE_DROP)),
        tuple(sorted(RESPONSE_DROP)),
        RESP_ADD,
        max_head,
        max_headers,
        MAX_BODY,
        5.0,  # t_request
        t_server,
        30.0,  # t_idle: the test decides when a lane ends
        0.0,  # t_stall: none (a fuzzed client may not read)
        b"127.0.0.1",
        KEY,
        b"p",
        b"b",
    )


class Stuck(AssertionError):
    """The C thread did not return a lane within the deadline."""


def stuck(host: LanesHost | None, given: str) -> NoReturn:
    """Fail for a thread that stopped coming back; every later example on ``host`` fails the
    same way (from here, so that hypothesis sees one failure, not a flaky one)."""
    if host is not None and not host.stuck:
        host.stuck = given
    raise Stuck(f"the C thread did not come back within {WAIT_S} s, given {given}")


def leak(obj: object) -> None:
    """Keep ``obj`` alive past the interpreter's exit: its dealloc would join a stuck thread."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class LanesHost:
    """One ``_offload.Thread`` and the handles it has returned (``events()`` drains them all)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.c = module.Thread((0.1, 1.0))
        self.returned: set[int] = set()
        self.stuck = ""  # what the thread was given when it stopped coming back

    def poll(self, timeout: float) -> None:
        select.select([self.c.fileno()], [], [], timeout)
        self.returned.update(h for h, kind in self.c.events() if kind == self.module.RETURNED)

    def close(self) -> None:
        if self.stuck:
            leak(self.c)
            return
        for handle in self.c.close():
            self.c.remove_lane(handle)


@dataclass
class Back:
    carry: bytes
    reason: int
    exchanges: int


class LaneRig:
    """A lane between a test client (``client``) and a test worker (``worker``)."""

    def __init__(self, host: LanesHost, carry: bytes = b"", **kw: Any) -> None:
        if host.stuck:  # the thread is lost: every later example would fail for that alone
            stuck(None, host.stuck)
        self.host = host
        self.client, self._cours = socket.socketpair()
        self._wours, self.worker = socket.socketpair()
        self.handle: int = host.c.add_lane(
            self._cours.fileno(), self._wours.fileno(), carry, spec(**kw)
        )
        self.back: Back | None = None
        self.to_worker = bytearray()

    def returned(self) -> bool:
        return self.handle in self.host.returned

    def wait_returned(self, what: str) -> Back:
        deadline = time.monotonic() + WAIT_S
        while not self.returned():
            if time.monotonic() > deadline:
                stuck(self.host, what)
            self.host.poll(0.05)
        carry, reason, _, _, exchanges, _ = self.host.c.remove_lane(self.handle)
        self.back = Back(bytes(carry), reason, exchanges)
        return self.back

    def read_worker(self) -> bytes:
        """What the lane forwarded so far (without waiting)."""
        got = _read_available(self.worker)
        self.to_worker += got
        return got

    def client_bytes(self) -> bytes:
        """Everything the client was sent (the lane is back: nothing more comes)."""
        return _read_available(self.client)

    def unread_by_lane(self) -> bytes:
        """Client bytes still in the socket the lane read from (the lane is back)."""
        return _read_available(self._cours)

    def close(self) -> None:
        for s in (self.client, self._cours, self._wours, self.worker):
            s.close()


def _read_available(s: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            got = s.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:  # reset
            break
        if not got:
            break
        out += got
    return bytes(out)
