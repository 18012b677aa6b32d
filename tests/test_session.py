"""The session's, the drain's and the migration's state machines, without a network.

As uvicorn's protocol tests do: the protocol objects are driven with bytes against mock
transports and a fake host (``session.SessionHost``), and what they write is read back with
wslb's own frame scanner. The rules under test are the ones at the top of ``aio/session.py``,
``aio/drain.py`` and ``aio/migrate.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from balancer.aio import drain as drain_mod
from balancer.aio import migrate as migrate_mod
from balancer.aio import offload as offload_mod
from balancer.aio.drain import Drainer, DrainProgress
from balancer.aio.handoff import HandoffClient
from balancer.aio.session import (
    ClientLeg,
    Leg,
    Mode,
    Phase,
    Session,
    SessionSettings,
)
from balancer.aio.state import ServerState
from balancer.aio.wheel import TimerWheel
from balancer.config import BackendCfg, Config, FailoverCfg, PoolCfg, Timeouts
from balancer.frames import (
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    CloseCode,
    FrameScanner,
    build_frame,
    close_payload,
)
from balancer.handshake import ClientRequest
from balancer.metrics import Stats
from balancer.pool import ACTIVE, DRAINED, DRAINING, Pool
from balancer.session_core import VIOLATION_GRACE
from tests.waits import until


class FakeTransport(asyncio.Transport):
    """Records what the protocol does with it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.paused = False
        self.protocol: asyncio.BaseProtocol | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def frames(self, masked: bool) -> list[tuple[int, bytes]]:
        """(opcode, payload) of every frame written, read with wslb's scanner rules."""
        out = []
        bits = []
        data = bytes(self.written)
        pos = 0
        while pos < len(data):
            b1 = data[pos + 1]
            n = b1 & 0x7F
            at = pos + 2
            if n == 126:
                n, at = int.from_bytes(data[at : at + 2], "big"), at + 2
            key = b""
            bits.append(bool(b1 & 0x80))
            if b1 & 0x80:
                key, at = data[at : at + 4], at + 4
            payload = data[at : at + n]
            if key:
                payload = bytes(c ^ key[i % 4] for i, c in enumerate(payload))
            out.append((data[pos] & 0x0F, payload))
            pos = at + n
        assert all(bit == masked for bit in bits), "wslb masks towards the worker only"
        return out


class FakeHost:
    """A ``SessionHost``: a real loop and timer wheel, counters, no sockets."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wheel = TimerWheel(loop)
        self.offload: Any = None  # the relay thread (``Offload``) where a test plays it
        self.stats = Stats()
        self.live: list[Session] = []
        self.finished: list[Session] = []
        self.lost: list[Session] = []  # sessions held for failover (Rule 6)
        self.away: list[tuple[Session, bool]] = []  # detached (Rule 8), or back
        self.tokens: dict[Session, str | None] = {}

    def session_started(self, s: Session) -> None:
        self.live.append(s)

    def session_finished(self, s: Session) -> None:
        self.live.remove(s)
        self.finished.append(s)

    def wall_time(self) -> float:
        return 1000.0

    def worker_lost(self, s: Session) -> None:
        self.lost.append(s)

    def detached(self, s: Session, on: bool, counted: bool = True) -> None:
        self.away.append((s, on))

    def handed_off(self, s: Session) -> None:
        self.live.remove(s)

    def token_bound(self, s: Session, old: str | None) -> None:
        self.tokens[s] = s.resume_token  # the host's token index, as ServerState keeps it


REQ = ClientRequest("/ws", "/ws", "", [], b"k", [], "h")


def make(
    host: FakeHost, timeouts: Timeouts | None = None, migrate: bool = True, failover: bool = False
) -> tuple[Session, FakeTransport, FakeTransport, Pool]:
    cfg = Config(timeouts=timeouts or Timeouts(ping_interval=0, idle=0, backpressure=0))
    pool = Pool(PoolCfg("p", backends=(BackendCfg("w", "ws://127.0.0.1:1"),)))
    ct, wt = FakeTransport(), FakeTransport()
    settings = SessionSettings.of(cfg, migrate, FailoverCfg(enabled=failover))
    s = Session(host, settings, pool, pool.backends["w"], "sid", "1.2.3.4", ct, wt, REQ, False)
    ct.set_protocol(ClientLeg(s))
    return s, ct, wt, pool


def text(payload: bytes, mask: bool) -> bytes:
    return build_frame(OP_TEXT, payload, mask=mask)


def close(code: int, reason: str = "", mask: bool = False) -> bytes:
    return build_frame(OP_CLOSE, close_payload(code, reason), mask=mask)


def closes(t: FakeTransport, masked: bool) -> list[int]:
    return [
        int.from_bytes(p[:2], "big") for op, p in t.frames(masked) if op == OP_CLOSE and len(p) >= 2
    ]


def test_leg_transitions() -> None:
    assert Leg.OPEN.sent() is Leg.CLOSING and Leg.LOST.sent() is Leg.CLOSED
    assert Leg.OPEN.lost() is Leg.LOST and Leg.CLOSING.lost() is Leg.CLOSED
    assert not Leg.OPEN.close_sent and Leg.CLOSING.close_sent and not Leg.CLOSING.gone
    assert Leg.LOST.gone and not Leg.LOST.close_sent and Leg.CLOSED.gone


async def test_frames_pass_both_ways_unchanged() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, pool = make(host)
    frame = text(b"hello", mask=True)
    s.client_data(frame)
    assert bytes(wt.written) == frame  # still masked: the worker unmasks it
    s.data_received(text(b"token", mask=False))
    assert ct.frames(False) == [(OP_TEXT, b"token")]
    assert s.totals == (1, 1, len(frame), 7)
    assert pool.backends["w"].sessions == 1 and host.live == [s]


async def test_client_close_handshake_rule_1() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, pool = make(host)
    s.client_data(close(1000, "bye", mask=True))
    assert closes(wt, True) == [1000]  # forwarded
    assert (s.client, s.worker, s.phase) == (Leg.OPEN, Leg.CLOSING, Phase.CLOSING)
    s.data_received(close(1000, "bye"))  # the worker's answer
    assert closes(ct, False) == [1000]
    assert s.client is Leg.CLOSING and ct.closed  # the server closes TCP first
    s.client_lost()
    s.connection_lost(None)
    assert (s.client, s.worker, s.phase) == (Leg.CLOSED, Leg.CLOSED, Phase.FINISHED)
    assert host.finished == [s] and pool.backends["w"].sessions == 0
    assert (s.close_to_client, s.close_to_worker, s.ended) == (1000, 1000, "client closed")


@pytest.mark.parametrize(("admin_state", "code"), [(ACTIVE, 1011), (DRAINING, 1012)])
async def test_worker_lost_rule_2(admin_state: Any, code: int) -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, _wt, pool = make(host)
    pool.backends["w"].set_admin(admin_state)
    s.connection_lost(ConnectionResetError())
    assert closes(ct, False) == [code]
    assert s.worker is Leg.LOST and s.client is Leg.CLOSING
    assert host.stats.closes["client", code] == 1
    s.client_data(close(code, mask=True))  # the client answers
    assert ct.closed
    s.client_lost()
    assert s.phase is Phase.FINISHED and s.ended in ("worker lost", "worker restarting")


async def test_client_lost_gives_the_worker_1001() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, _ct, wt, _ = make(host)
    s.client_lost()
    assert closes(wt, True) == [1001] and s.worker is Leg.CLOSING
    s.data_received(close(1001))
    assert wt.closed  # the client is gone and the worker's close came: wslb closes its TCP
    s.connection_lost(None)
    assert s.phase is Phase.FINISHED and s.ended == "client went away"


async def test_client_violation_rule_3() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, _ = make(host)
    s.client_data(text(b"unmasked", mask=False))  # a client must mask
    assert s.core.pending_client_close == (CloseCode.PROTOCOL_ERROR, "unmasked frame from client")
    s.data_received(text(b"in flight", mask=False))  # still relayed
    assert ct.frames(False) == [(OP_TEXT, b"in flight")]
    await until(lambda: closes(wt, True) == [1001], VIOLATION_GRACE + 5, "the worker told to go")
    s.data_received(close(1001))  # the worker's answer is dropped; the client gets its code
    assert closes(ct, False) == [1002] and ct.closed  # failing the connection: TCP closed
    assert s.ended == "client broke the protocol: unmasked frame from client"


async def test_worker_violation_rule_3() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, _ = make(host)
    s.data_received(text(b"masked", mask=True))  # a server must not mask
    assert closes(wt, True) == [1002]
    assert closes(ct, False) == [1014]


async def test_a_close_waits_at_most_timeouts_close_rule_5() -> None:
    host = FakeHost(asyncio.get_running_loop())
    timeouts = Timeouts(ping_interval=0, idle=0, backpressure=0, close=0.05)
    s, ct, wt, _ = make(host, timeouts)
    s.close(CloseCode.SERVICE_RESTART, "worker draining")
    assert closes(ct, False) == [1012] and closes(wt, True) == [1001]  # the worker goes away
    for _ in range(100):
        if ct.aborted and wt.aborted:
            break
        await asyncio.sleep(0.02)
    assert ct.aborted and wt.aborted  # nobody answered within timeouts.close


async def test_the_clients_answer_to_wslbs_close_ends_it_at_once() -> None:
    """wslb's own close (a drain's 1012): the client's answer closes its TCP then, not after
    ``timeouts.close`` (a client reports the close only once TCP closes)."""
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, _ = make(host)
    s.close(CloseCode.SERVICE_RESTART, "worker draining")
    assert not ct.is_closing()
    s.client_data(text(b"late", mask=True) + close(1012, mask=True))
    assert ct.is_closing() and bytes(wt.written).count(b"late") == 0  # nothing forwarded after
    s.data_received(close(1001))  # the worker's answer, also seen though nothing is forwarded
    s.client_lost()
    assert wt.closed


async def test_rule_4_no_frame_injected_mid_frame() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, _wt, _ = make(host)
    big = text(b"x" * 1000, mask=False)
    s.data_received(big[:100])  # the worker died mid-frame
    s.connection_lost(None)
    assert ct.aborted and closes(ct, False) == []


async def test_heartbeat_pings_both_legs_and_times_out() -> None:
    host = FakeHost(asyncio.get_running_loop())
    timeouts = Timeouts(ping_interval=10, ping_timeout=10, idle=0, backpressure=0)
    s, ct, wt, _ = make(host, timeouts)
    s._tick()
    assert [op for op, _ in ct.frames(False)] == [OP_PING]
    assert [op for op, _ in wt.frames(True)] == [OP_PING]
    ((_, to_worker),) = wt.frames(True)
    s.data_received(build_frame(OP_PONG, to_worker))  # the worker answers; it is consumed
    assert [op for op, _ in ct.frames(False)] == [OP_PING]  # nothing forwarded to the client
    s._tick()  # the client never answered
    assert closes(ct, False) == [1011] and closes(wt, True) == [1001]
    assert s.ended == "client ping timeout"


async def test_idle_timeout() -> None:
    host = FakeHost(asyncio.get_running_loop())
    timeouts = Timeouts(ping_interval=0, idle=0.01, backpressure=0)
    s, ct, _wt, _ = make(host, timeouts)
    await asyncio.sleep(0.02)
    s._tick()
    assert closes(ct, False) == [1001] and s.ended == "idle timeout"


# --------------------------------------------------------------------------- the drain


def drain_state(loop: asyncio.AbstractEventLoop, pool: Pool, close_s: float = 0.05) -> Any:
    cfg = Config(pools=(pool.cfg,), timeouts=Timeouts(close=close_s))
    return ServerState(loop, cfg, [pool], Stats())


async def test_drain_without_migration_closes_after_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """active --drain--> draining --sessions gone--> drained (the diagram in drain.py)."""
    monkeypatch.setattr(drain_mod, "QUIET", 0.02)
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    s, ct, _wt, pool = make(host, migrate=False)
    state = drain_state(loop, pool)
    state.sessions[s] = None
    s.state = state  # the drainer and the session see one state
    b = pool.backends["w"]
    drainer = Drainer(state)
    progress = drainer.start(pool, b, False, 5.0)
    assert b.admin_state == DRAINING and isinstance(progress, DrainProgress)
    # The worker was quiet: its answer was over.
    await until(lambda: closes(ct, False) == [1012], 5, "the client's 1012")
    s.client_lost()
    s.connection_lost(None)
    task = drainer.tasks.get(b.id)
    if task is not None:
        await asyncio.wait_for(task, 5)
    assert b.admin_state == DRAINED and progress.closed_after_answer == 1
    assert progress.finished is not None
    await drainer.undrain(b)
    assert b.admin_state == ACTIVE


async def test_a_worker_that_drains_itself_is_undrained_when_back() -> None:
    loop = asyncio.get_running_loop()
    pool = Pool(PoolCfg("p", backends=(BackendCfg("w", "ws://127.0.0.1:1"),)))
    drainer = Drainer(drain_state(loop, pool))
    b = pool.backends["w"]
    assert drainer.worker_drains(pool, b)
    assert not drainer.worker_drains(pool, b)  # already draining
    await until(lambda: b.admin_state == DRAINED, 5, "drained")
    assert drainer.worker_back(b)
    await until(lambda: b.admin_state == ACTIVE, 5, "active again")
    assert not drainer.worker_back(b)
    # An operator's drain is not undone by probes.
    assert drainer.worker_drains(pool, b)
    drainer.keep_drained(b)
    assert not drainer.worker_back(b)
    await drainer.stop()


# --------------------------------------------------------------------------- the migration


async def test_migration_steps_fail_back_to_the_old_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HOLDING -> FROZEN fails (no handoff API): the session stays, reading again."""
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    s, ct, _wt, pool = make(host)
    state = drain_state(loop, pool)
    calls: list[str] = []

    async def post(st: Any, b: Any, sid: str, step: str, body: dict[str, Any]) -> tuple[int, Any]:
        calls.append(step)
        return 404, None

    monkeypatch.setattr(HandoffClient, "post", post)
    result = await migrate_mod.migrate(HandoffClient(state), s)
    assert (result.ok, result.reason) == (False, "no_api") and calls == ["freeze"]
    assert s.mode is Mode.RELAYING and not ct.paused
    assert s.phase is Phase.RELAYING and state.stats.migrations["no_api"] == 1


async def test_migration_that_cannot_flush_ends_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FROZEN -> FLUSHED fails (the worker claims more than wslb forwarded): 1012."""
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    s, ct, _wt, pool = make(host)
    state = drain_state(loop, pool)

    async def post(st: Any, b: Any, sid: str, step: str, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"state": {}, "sent": 5, "received": 0}

    monkeypatch.setattr(HandoffClient, "post", post)
    monkeypatch.setattr(migrate_mod, "STEP_TIMEOUT", 0.05)
    result = await migrate_mod.migrate(HandoffClient(state), s)
    assert (result.ok, result.reason) == (False, "flush_lost")
    assert closes(ct, False) == [1012]


async def test_a_pool_without_migration_refuses_at_once() -> None:
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    s, _, _, pool = make(host, migrate=False)
    result = await migrate_mod.migrate(HandoffClient(drain_state(loop, pool)), s)
    assert (result.ok, result.reason) == (False, "disabled")


def test_scanner_commands() -> None:
    sc = FrameScanner(masked=False)
    sc.expect_pong(b"12345678")
    assert (sc.own_ping, sc.pong_received) == (b"12345678", False)
    sc.feed(build_frame(OP_PONG, b"12345678"))
    assert (sc.own_ping, sc.pong_received) == (None, True)
    sc.drop_next_close()
    assert sc.feed(close(1000)) == b"" and sc.close == (1000, "")
    sc2 = FrameScanner(masked=False)
    sc2.stop()
    assert sc2.feed(text(b"late", mask=False)) == b""
    assert sc2.feed(close(1000)) == b"" and sc2.close == (1000, "") and sc2.notable
    assert sc2.feed(text(b"after the close", mask=False)) == b"" and sc2.messages == 0


async def test_a_late_first_message_after_a_move_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that re-prefills before its first token: the move's pause ends at the switch,
    the watcher times the first message (``wslb_migration_first_message_seconds``)."""
    loop = asyncio.get_running_loop()
    host = FakeHost(loop)
    s, _ct, _wt, pool = make(host)
    state = drain_state(loop, pool)
    monkeypatch.setattr(migrate_mod, "FIRST_MESSAGE_POLL", 0.005)
    t_freeze = loop.time()
    watcher = asyncio.ensure_future(migrate_mod.watch_first_message(state, s, s.ws, t_freeze))
    # Negative check: the engine's re-prefill (0.1 s of its own) counts nothing meanwhile.
    await asyncio.sleep(0.1)
    assert state.stats.migration_first_message.count == 0
    s.data_received(text(b"first token after the move", mask=False))
    await asyncio.wait_for(watcher, 1)
    (late,) = state.stats.migration_first_message.samples
    assert 0.1 <= late < 0.5
    # A session that closes meanwhile is not counted.
    s.close(CloseCode.GOING_AWAY, "bye")
    again = asyncio.ensure_future(migrate_mod.watch_first_message(state, s, s.ws, loop.time()))
    await asyncio.wait_for(again, 1)
    assert state.stats.migration_first_message.count == 1


# -- Rule 6: crash failover -----------------------------------------------------------------


def failing_over(s: Session) -> bool:
    """Read afresh (mypy keeps an attribute narrowed by an earlier assert)."""
    return s.mode is Mode.FAILING_OVER


def relayed(s: Session) -> bool:
    """The relay thread holds the session (read afresh, as ``failing_over``)."""
    return s.relay is not None


def offloaded(s: Session) -> None:
    """The relay thread takes the session (as ``Session._offload`` would, with its checks)."""
    s.relay = 1
    s.core.enter(Mode.OFFLOADED)


def reading(t: FakeTransport) -> bool:
    return not t.paused


def _text(obj: str, mask: bool = False) -> bytes:
    return build_frame(OP_TEXT, obj.encode(), mask=mask)


async def test_rule6_a_lost_worker_is_held_for_failover_not_closed() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, wt, _ = make(host, failover=True)
    s.data_received(_text('{"type":"hello"}'))
    s.client_data(_text('{"type":"prompt","text":"hi"}', mask=True))
    s.data_received(_text('{"type":"token","turn":1,"i":0,"text":"a"}'))
    wt.aborted = True
    s.connection_lost(ConnectionResetError())
    assert host.lost == [s] and failing_over(s) and s.worker is Leg.OPEN
    assert ct.paused and s.core.client_held  # the client waits, unread
    assert not any(op == OP_CLOSE for op, _ in ct.frames(masked=False))
    # What the client sends meanwhile (already read) is journalled, not lost.
    s.client_data(_text('{"type":"prompt","text":"more"}', mask=True))
    assert s.journal is not None
    t = s.journal.transcript("sid")
    assert t["answer"]["i"] == 1 and [q["text"] for q in t["queued"]] == ["more"]
    # No failover could save it: Rule 2 after all, and the client is read again for its answer.
    s.worker_gone()
    assert not failing_over(s) and reading(ct)
    assert ct.frames(masked=False)[-1] == (OP_CLOSE, close_payload(1011, "worker lost"))


async def test_rule6_not_without_a_journal_nor_after_a_close() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, _, _ = make(host, failover=False)
    s.connection_lost(None)
    assert host.lost == [] and ct.frames(masked=False)[-1][0] == OP_CLOSE
    s2, _, _, _ = make(host, failover=True)
    s2.data_received(build_frame(OP_CLOSE, close_payload(1000, "bye")))
    s2.connection_lost(None)  # the worker closed: nothing to save
    assert host.lost == []
    s3, _, _, _ = make(host, failover=True)
    s3.client_data(build_frame(OP_TEXT, b"partial", mask=True, fin=False))
    s3.connection_lost(None)  # the client is inside a message: cannot be handed on
    assert host.lost == []


async def test_rule6_resume_on_a_new_leg_reads_the_client_again() -> None:
    host = FakeHost(asyncio.get_running_loop())
    s, ct, _, pool = make(host, failover=True)
    s.data_received(_text('{"type":"hello"}'))
    s.connection_lost(ConnectionResetError())
    assert failing_over(s)
    s.release()  # a migration's release does not undo the failover's hold
    assert ct.paused

    class Up:
        extra = bytearray(_text('{"type":"token","turn":1,"i":0,"text":"a"}'))
        eof = False
        parks = False

    nwt = FakeTransport()
    s.resume_on(pool.backends["w"], nwt, Up(), b"")
    assert not failing_over(s) and reading(ct) and s.failovers == 1
    assert nwt.protocol is s
    assert ct.frames(masked=False)[-1] == (OP_TEXT, b'{"type":"token","turn":1,"i":0,"text":"a"}')


class ThreadForwards:
    """The relay thread as ``Session`` sees it (``state.offload``), for one session: what it
    forwarded waits in ``record`` until ``take_record``; ``given_back`` counts hand-backs."""

    def __init__(self) -> None:
        self.record = bytearray()
        self.forwarded = 0
        self.given_back = 0

    def take_record(self, handle: int) -> bytes:
        out = bytes(self.record)
        self.record.clear()
        return out

    def counts(self, handle: int) -> tuple[int, int]:
        return self.forwarded, 0

    def give_back(self, handle: int) -> offload_mod.Returned:
        self.given_back += 1
        frames, self.forwarded = self.forwarded, 0
        return offload_mod.Returned(b"", b"", self.take_record(handle), frames, 0, 0)


class AnswersAtOnce(FakeTransport):
    """A worker leg whose worker answers each message before ``write`` returns, its answer
    forwarded by the relay thread at once: the widest the race between the two threads gets."""

    def __init__(self, thread: ThreadForwards, answer: list[bytes]) -> None:
        super().__init__()
        self.thread = thread
        self.answer = answer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        super().write(data)
        for frame in self.answer:
            self.thread.record += frame


@pytest.mark.parametrize(
    ("hello", "prompt", "answer"),
    [
        (
            '{"type":"hello"}',
            '{"type":"prompt","text":"hi"}',
            ['{"type":"token","turn":1,"i":0,"text":"a"}'],
        ),
        (
            '{"type":"session.created","session":{"model":"m"}}',
            '{"type":"response.create"}',
            [
                '{"type":"response.created","response":{"id":"r1"}}',
                '{"type":"response.output_item.added","item":{"id":"i1"}}',
            ],
        ),
    ],
    ids=["chat", "realtime"],
)
async def test_the_journal_has_the_client_message_before_the_threads_answer_to_it(
    hello: str, prompt: str, answer: list[str]
) -> None:
    """Rule 7 with failover: the worker's answer to a client message, forwarded by the relay
    thread while the event loop was still between writing that message and journalling it,
    comes after it in the journal. (It came first once: the Realtime ``response.create`` then
    stayed queued in the transcript, and the failover's target answered it with
    ``conversation_already_has_active_response``.)"""
    host = FakeHost(asyncio.get_running_loop())
    thread = ThreadForwards()
    host.offload = thread
    s, _, _, _ = make(host, failover=True)
    s.data_received(_text(hello))
    s.wt = AnswersAtOnce(thread, [_text(obj) for obj in answer])
    offloaded(s)  # the thread relays the worker's frames from here on
    s.client_data(_text(prompt, mask=True))
    s.flush_record()
    assert s.journal is not None
    t = s.journal.transcript("sid")
    assert t["queued"] == []
    assert t["turns"] == 1


async def test_the_pong_check_leaves_a_session_with_the_relay_thread() -> None:
    """Rule 7 and the heartbeat: the tick that pings takes the session back (it writes to the
    client); the tick that checks the pongs does not (it reads the Python scanners only), and
    counts what the thread forwarded as activity for the idle timer."""
    host = FakeHost(asyncio.get_running_loop())
    thread = ThreadForwards()
    host.offload = thread
    timeouts = Timeouts(ping_interval=10, ping_timeout=5, idle=12, backpressure=0)
    s, ct, wt, _ = make(host, timeouts)
    offloaded(s)
    s._tick()  # pings both legs
    assert thread.given_back == 1 and not relayed(s)
    assert [op for op, _ in ct.frames(False)] == [OP_PING]
    ((_, to_client),) = ct.frames(False)
    ((_, to_worker),) = wt.frames(True)
    s.client_data(build_frame(OP_PONG, to_client, mask=True))
    s.data_received(build_frame(OP_PONG, to_worker))
    offloaded(s)  # offered to the thread again at its next data frame
    thread.forwarded = 3
    s._tick()  # the pongs came: nothing to write, the thread keeps the session
    assert thread.given_back == 1 and relayed(s) and not s.closing
    assert s.core.last_msgs == 3  # the thread's frames count as activity
    s._tick()  # the next ping
    assert thread.given_back == 2 and not relayed(s)
