"""Plain HTTP's lanes in the offload thread (``balancer/_offload.c``, ``aio/offload.py``) as the
event loop sees them: plain HTTP's steady state.

A small JSON request through the event loop costs about 25x what nginx spends on it, all of it
Python per request. Most requests on a kept-alive connection are the one before again: the same
target and the same routing headers, so the same pool, key and worker. After such a request the
client connection and its worker connection are handed to a thread written in C, which serves
the next ones byte for byte as ``httpproxy.py`` would, and hands the connection back for anything
else. The rules, from the event loop's side:

- **Taken** (``HttpClient.finished`` -> ``Lanes.take``): after an exchange that ended well on
  a kept-alive worker connection, with both legs plain TCP, an HTTP/1.1 client, a key the client
  named (a key wslb makes is new per request, and so is its placement), the pool balanced by
  ``consistent`` hashing (its requests of one key go to one worker anyway), no JWT (a token is
  checked per request), nothing waiting to be written either way and the client's connection
  going on. The lane's *spec* is what this request's routing decided (``lane_spec``): the
  signature (the target, then the values of every header the routing reads), the worker's target
  and wslb's header blocks (``httpmsg.request_blocks``), the limits and timeouts of the pool.
  The key stays placed on the worker while the lane lives (it counts there as one session).
- **Served by the thread**: each next request whose head is whole, plainly framed, and whose
  signature is the lane's (``_offload.c``'s rules); its record (``take_log``) and counts come
  here in batches (``flush``, every ``TICK_S`` and before a metrics scrape), and its access line
  is written here, by ``logs.py`` as the event loop's own are: the thread formats none.
- **Given back**: the first request the thread does not take (its bytes come back unread:
  ``HttpClient.lane_back`` parses, routes and answers it as ever), the client's or the worker's
  end, a failure (the thread answered as rule 4 says; a client that takes nothing of an answer
  for ``timeouts.backpressure`` is cut), ``IDLE_S`` without a request, and a
  ``release``: the worker not ready any more (a drain, health), the balancer stopping
  (``stop``). A drain's or shutdown's timeout ``abort``\\s a lane mid-exchange.

``AVAILABLE`` is false where the C module is not built or ``WSLB_PURE_PYTHON`` is set; config
``relay.thread: false`` turns the lanes off with the relay. Every request then runs in Python, as
before. The lanes share the relay's thread (``Offload``): its events for a lane come here
(``returned``), and the lanes' ``close`` stops it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from balancer.logs import access_line, access_sink, log_http_access
from balancer.metrics import HTTP_BUCKETS, Histogram

if TYPE_CHECKING:
    from balancer._offload import Spec
    from balancer.aio.offload import Offload
    from balancer.metrics import Stats
    from balancer.pool import Backend

__all__ = ["AVAILABLE", "Back", "LaneOwner", "Lanes"]

log = logging.getLogger("wslb.http")

_lanes: ModuleType | None
try:
    from balancer import _offload as _lanes
except ImportError:  # no C compiler at install, or not Linux
    _lanes = None

AVAILABLE = _lanes is not None and not os.environ.get("WSLB_PURE_PYTHON")

TICK_S: Final = 0.25
"""How often the access lines and counts are taken from the thread, and each lane's worker is
checked (a drain's release reaches a lane within this)."""
IDLE_S: Final = 2.0
"""How long a lane waits for its next request before the event loop takes the wait over (an
idle connection costs the thread a watch, and the event loop nothing)."""

REASONS: dict[int, str] = {}
CLIENT_ENDED: frozenset[int] = frozenset()
if _lanes is not None:
    REASONS = {
        _lanes.HANDBACK: "handback",
        _lanes.RETRY: "retry",
        _lanes.WORKER_DONE: "worker done",
        _lanes.RELEASED: "released",
        _lanes.IDLE: "idle",
        _lanes.CLIENT_EOF: "client eof",
        _lanes.CLIENT_GONE: "client gone",
        _lanes.FAILED: "failed",
        _lanes.CLOSED: "closed",
    }
    # The client connection is over (the thread wrote what it had to, if anything).
    CLIENT_ENDED = frozenset({_lanes.CLIENT_EOF, _lanes.CLIENT_GONE, _lanes.FAILED, _lanes.CLOSED})


class Back(NamedTuple):
    """What a lane leaves when it comes back (``Lanes.remove``)."""

    carry: bytes  # the client's bytes not served (from a request's first byte)
    reason: int
    worker_ok: bool  # the worker's connection may carry another request
    client_ended: bool  # the client's connection is not to be used again
    client_gone: bool  # it broke under the thread (reset it; nothing is owed it)
    exchanges: int  # requests the thread served
    idle_for: float  # seconds of the keep-alive wait the thread spent


class LaneOwner(Protocol):
    """A client connection in a lane (``HttpClient``)."""

    lane_backend: Backend | None

    def lane_back(self, back: Back) -> None: ...

    def lane_check(self) -> None: ...

    def abort_lane(self, why: str) -> None: ...


class Lanes:
    """One serving process's lanes in its offload thread, and the connections they serve now."""

    def __init__(self, offload: Offload, stats: Stats, access: bool) -> None:
        """``access``: config ``log.access`` (the thread writes no line without it)."""
        assert _lanes is not None
        self.loop = offload.loop
        self.stats = stats
        self.access = access
        self.offload = offload
        self._c = offload.c
        offload.lanes = self
        self.owners: dict[int, LaneOwner] = {}
        # Each lane's part of its access lines (the spec's peer, key, pool and backend).
        self._who: dict[int, tuple[str, str, str, str]] = {}
        self.stopping = False  # no new lanes (a shutdown, a restart's hand-over)
        self._handler: logging.StreamHandler[Any] | None = None
        self.set_log()
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(TICK_S, self._tick)

    def set_log(self) -> None:
        """Whether the thread keeps its exchanges' records for access lines, and where the
        lines go (``logs.access_sink``: one plain handler is written to in batches, anything
        else gets each line through ``log_http_access``); again after a change to the logging
        set-up (a reload)."""
        sink = access_sink() if self.access else ("off", "", None)
        self._handler = sink[2] if sink is not None else None
        self._c.set_log(sink is None or sink[0] != "off")

    def add(
        self, owner: LaneOwner, client_fd: int, worker_fd: int, carry: bytes, spec: Spec
    ) -> int:
        """Hand a connection to the thread; its handle. Raises OSError (nothing was taken)."""
        handle: int = self._c.add_lane(client_fd, worker_fd, carry, spec)
        self.owners[handle] = owner
        peer, key, pool, backend = spec[15:19]
        self._who[handle] = (
            peer.decode("latin-1"),
            key.decode("latin-1"),
            pool.decode("utf-8", "replace"),
            backend.decode("utf-8", "replace"),
        )
        self.stats.http_lanes["taken"] += 1
        return handle

    def release(self, handle: int) -> None:
        """Back at the lane's next boundary (now, if it waits between requests)."""
        self._c.release(handle)

    def abort(self, handle: int, why: str) -> None:
        """End the lane's exchange now: 503 with ``why`` if nothing was answered, else a cut."""
        self._c.abort(handle, why)

    def live(self) -> int:
        return len(self.owners)

    def release_on(self, backend: Backend) -> None:
        """Every lane on ``backend`` back at its next boundary (a drain: now, not at a tick)."""
        for handle, owner in list(self.owners.items()):
            if owner.lane_backend is backend:
                self._c.release(handle)

    def on(self, backend: Backend) -> list[LaneOwner]:
        """The lanes on ``backend`` (a drain waits for them, then aborts those left)."""
        return [o for o in self.owners.values() if o.lane_backend is backend]

    def returned(self, handles: list[int]) -> None:
        """The thread's events for lanes (``Offload``): these came back, or lines wait."""
        self.flush()  # the lines of the exchanges these lanes served come first
        for handle in handles:
            self._back(handle)

    def _back(self, handle: int) -> None:
        owner = self.owners.pop(handle, None)
        self._who.pop(handle, None)
        carry, reason, worker_ok, client_eof, exchanges, idle_for = self._c.remove_lane(handle)
        self.stats.http_lanes[REASONS.get(reason, str(reason))] += 1
        if owner is None:
            return
        ended = reason in CLIENT_ENDED or bool(client_eof)
        try:
            owner.lane_back(
                Back(
                    bytes(carry),
                    reason,
                    bool(worker_ok),
                    ended,
                    reason == _lanes.CLIENT_GONE if _lanes is not None else False,
                    int(exchanges),
                    idle_for,
                )
            )
        except Exception:
            log.exception("a lane's connection failed to come back")

    def _tick(self) -> None:
        self._timer = self.loop.call_later(TICK_S, self._tick)
        self.flush()
        for owner in list(self.owners.values()):
            owner.lane_check()

    def flush(self) -> None:
        """Take the thread's records and counts since the last call: the access lines written,
        the metrics counted."""
        records = self._c.take_log()
        if records:
            self._write_log(records)
        tallies, bytes_in, bytes_out, exchanges = self._c.take_stats()
        if not exchanges and not tallies:
            return
        st = self.stats
        for pool, sse, status, buckets, n, total in tallies:
            kind = "sse" if sse else "plain"
            st.http_requests[(pool, kind, status)] += n
            key = f"{pool}\x00{kind}"
            h = st.http_duration.by.get(key)
            if h is None:
                h = st.http_duration.by[key] = Histogram(HTTP_BUCKETS, keep=False)
            for i, c in enumerate(buckets):
                h.counts[i] += c
            h.count += n
            h.sum += total
        st.http_bytes["client_to_worker"] += bytes_in
        st.http_bytes["worker_to_client"] += bytes_out
        st.http_upstream["reused"] += exchanges
        st.http_lanes["exchanges"] += exchanges

    def _write_log(self, records: list[tuple[Any, ...]]) -> None:
        """The access lines of the thread's exchanges: the event loop's fields (httpproxy.py's
        ``logged``), formatted by logs.py; to one plain handler in one write, with each
        line's time the exchange's end."""
        handler = self._handler
        formatter = handler.formatter if handler is not None else None
        lines: list[str] = []
        for handle, at, method, path, status, sse, headers_s, duration, *rest in records:
            bytes_in, bytes_out, end, ua = rest
            client, key, pool, backend = self._who.get(handle, ("-", "-", "-", "-"))
            fields = {
                "client": client,
                "method": method.decode("latin-1"),
                "path": path.decode("latin-1"),
                "status": status,
                "session": key,
                "pool": pool,
                "backend": backend,
                "kind": "sse" if sse else "plain",
                "connect_ms": 0.0,
                "headers_ms": round(headers_s * 1000, 1),
                "duration_s": round(duration, 3),
                "bytes_in": bytes_in,
                "bytes_out": bytes_out,
                "end": end,
                "user_agent": ua.decode("latin-1") if ua is not None else None,
            }
            if formatter is None:
                log_http_access(fields)
                continue
            lines.append(access_line(formatter, at, fields))
        if handler is None or not lines:
            return
        handler.acquire()
        try:
            handler.stream.write("\n".join(lines) + "\n")
            handler.flush()
        except (OSError, ValueError):
            pass  # the stream closed under it (stderr gone): as logging.Handler.handleError
        finally:
            handler.release()

    def stop(self) -> None:
        """No new lanes; every lane back at its next boundary (a shutdown, a restart)."""
        self.stopping = True
        for handle in list(self.owners):
            self._c.release(handle)

    async def wait_empty(self, timeout: float) -> None:
        """Until every lane is back (bounded)."""
        until = self.loop.time() + timeout
        while self.owners and self.loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Stop the thread (``Offload.stop``: the relay's sessions come back first); every lane
        still in it comes back (CLOSED: its client closes). A thread that does not stop within
        ``_offload.c``'s deadline is left, with its lanes, to the process's exit (logged): a
        shutdown never hangs on it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        handles = self.offload.stop()  # those that came back on their own are in it too
        self.offload.lanes = None
        self.flush()  # the lines of the exchanges that ended meanwhile, while their lanes are known
        if handles is None:
            log.error("%d lanes left in the offload thread", len(self.owners))
            self.owners.clear()
            return
        for handle in handles:
            self._back(handle)
        self.flush()
