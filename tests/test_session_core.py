"""The session core's rules and modes, with no socket, loop or clock (h11's and websockets'
protocol tests are the model): events in, actions out, the state read back."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from balancer.session_core import (
    TRANSITIONS,
    VIOLATION_GRACE,
    Action,
    IllegalTransition,
    Leg,
    Mode,
    Op,
    Phase,
    ResumeRefused,
    SessionCore,
    Side,
    walk,
)


def core(replay: int = 4096) -> SessionCore:
    return SessionCore(
        "sid",
        "w1",
        max_frame_size=1 << 20,
        max_message_size=1 << 20,
        replay_limit=replay,
        rand=lambda n: b"p" * n,
    )


def text(payload: bytes, mask: bool) -> bytes:
    return build_frame(OP_TEXT, payload, mask=mask)


def close(code: int, reason: str = "", mask: bool = False) -> bytes:
    return build_frame(OP_CLOSE, close_payload(code, reason), mask=mask)


def mode_of(c: SessionCore) -> Mode:
    """Read afresh (mypy keeps an attribute narrowed by an earlier assert)."""
    return c.mode


def ops(actions: list[Action]) -> list[tuple[Op, Side | None]]:
    return [(op, side) for op, side, _ in actions]


def close_code(actions: list[Action], side: Side) -> int | None:
    """The code of wslb's own close frame to ``side`` among ``actions``."""
    for op, s, arg in actions:
        if op is Op.SEND_CLOSE and s is side and arg is not None:
            sc = FrameScanner(masked=side is Side.WORKER)
            sc.feed(arg)
            assert sc.close is not None
            return sc.close[0]
    return None


def client_sends(c: SessionCore, data: bytes) -> list[Action]:
    c.cs.feed(data)
    if c.cs.notable:
        c.cs.notable = False
        return c.client_event()
    return []


def worker_sends(c: SessionCore, data: bytes) -> list[Action]:
    c.ws.feed(data)
    if c.ws.notable:
        c.ws.notable = False
        return c.worker_event()
    return []


# -- the mode --------------------------------------------------------------------------------


def test_every_mode_change_is_the_tables() -> None:
    """Exactly the listed steps are legal; any other raises and leaves the mode alone."""
    for a, b in itertools.product(Mode, Mode):
        c = core()
        c.mode = a
        if b in TRANSITIONS[a]:
            c.enter(b)
            assert c.mode is b
        else:
            with pytest.raises(IllegalTransition):
                c.enter(b)
            assert c.mode is a


@pytest.mark.parametrize("mode", [m for m in Mode if m is not Mode.RELAYING])
def test_only_a_relaying_session_may_go_to_the_thread(mode: Mode) -> None:
    c = core()
    assert c.may_offload()
    c.mode = mode
    assert not c.may_offload()


def test_nor_one_paused_closing_or_mid_message() -> None:
    c = core()
    c.paused_since = 1.0
    assert not c.may_offload()
    c = core()
    c.ws.feed(build_frame(OP_TEXT, b"part", mask=False, fin=False))
    assert not c.may_offload()
    c = core()
    c.close(CloseCode.GOING_AWAY, "bye")
    assert not c.may_offload()


def test_client_held_in_held_and_failing_over_only() -> None:
    for m in Mode:
        c = core()
        c.mode = m
        assert c.client_held is (m in (Mode.HELD, Mode.FAILING_OVER))


# -- Rules 1-5 ----------------------------------------------------------------------------------


def test_rule1_a_close_is_forwarded_and_the_server_closes_tcp_first() -> None:
    c = core()
    out = client_sends(c, close(1000, "bye", mask=True))
    assert (c.client, c.worker, c.phase) == (Leg.OPEN, Leg.CLOSING, Phase.CLOSING)
    assert (Op.COUNTED, Side.WORKER, 1000) in out and (Op.SCHEDULE, None, None) in out
    out = worker_sends(c, close(1000, "bye"))
    assert c.client is Leg.CLOSING and (Op.CLOSE, Side.CLIENT) in ops(out)
    # The client is gone and the worker's close was seen: wslb closes the worker's TCP.
    assert ops(c.client_lost()) == [(Op.CLOSE, Side.WORKER)]
    out = c.worker_lost(journal=False, draining=False)
    assert ops(out) == [(Op.FINISH, None)] and c.phase is Phase.FINISHED
    assert (c.close_to_client, c.close_to_worker, c.ended) == (1000, 1000, "client closed")


@pytest.mark.parametrize(("draining", "code"), [(False, 1011), (True, 1012)])
def test_rule2_a_lost_worker_gives_the_client_1011_or_1012(draining: bool, code: int) -> None:
    c = core()
    out = c.worker_lost(journal=False, draining=draining)
    assert close_code(out, Side.CLIENT) == code and c.worker is Leg.LOST
    assert c.ended == ("worker restarting" if draining else "worker lost")


def test_rule2_a_lost_client_gives_the_worker_1001() -> None:
    c = core()
    out = c.client_lost()
    assert close_code(out, Side.WORKER) == 1001 and c.ended == "client went away"


def test_rule3_a_client_violation_lets_the_worker_finish_first() -> None:
    c = core()
    out = client_sends(c, text(b"unmasked", mask=False))
    assert c.pending_client_close == (CloseCode.PROTOCOL_ERROR, "unmasked frame from client")
    assert (Op.LATER, None, VIOLATION_GRACE) in out and close_code(out, Side.CLIENT) is None
    assert close_code(c.grace_over(), Side.WORKER) == 1001
    out = worker_sends(c, close(1001))  # the worker's answer is dropped: the client gets 1002
    assert close_code(out, Side.CLIENT) == 1002 and (Op.CLOSE, Side.CLIENT) in ops(out)


def test_rule3_a_worker_violation_gives_1002_and_1014() -> None:
    c = core()
    out = worker_sends(c, build_frame(OP_TEXT, b"masked", mask=True))
    assert close_code(out, Side.WORKER) == 1002 and close_code(out, Side.CLIENT) == 1014


def test_rule4_no_close_frame_inside_a_frame() -> None:
    c = core()
    frame = text(b"x" * 100, mask=False)
    c.ws.feed(frame[:20])  # the worker died mid-frame
    out = c.worker_lost(journal=False, draining=False)
    assert (Op.SEND_CLOSE, Side.CLIENT, None) in out  # abort, not a frame inside a frame


def test_rule5_the_close_timer_aborts_what_is_left() -> None:
    c = core()
    c.close(CloseCode.GOING_AWAY, "bye")
    out = c.tick(
        5.0,
        0,
        ping_interval=0,
        ping_timeout=0,
        idle=0,
        backpressure=0,
        first_tick=0,
        journal=False,
    )
    assert ops(out) == [(Op.ABORT, Side.CLIENT), (Op.ABORT, Side.WORKER)]


def test_rule5_finished_comes_once() -> None:
    c = core()
    seen = c.close(CloseCode.GOING_AWAY, "bye") + c.client_lost()
    seen += c.worker_lost(journal=False, draining=False) + c.worker_gone(draining=False)
    assert [a for a in seen if a[0] is Op.FINISH] == [(Op.FINISH, None, None)]


# -- Rule 6 and the modes around it -----------------------------------------------------------


def test_rule6_a_lost_worker_is_failed_over_with_the_client_held() -> None:
    c = core()
    out = c.worker_lost(journal=True, draining=False)
    assert ops(out) == [(Op.PAUSE, Side.CLIENT), (Op.FAIL_OVER, None)]
    assert c.mode is Mode.FAILING_OVER and c.worker is Leg.OPEN and c.client_held
    out = c.worker_gone(draining=False)  # no worker took it: Rule 2 after all
    assert ops(out)[0] == (Op.READ, Side.CLIENT) and close_code(out, Side.CLIENT) == 1011
    assert mode_of(c) is Mode.RELAYING


@pytest.mark.parametrize("mode", [Mode.MIGRATING, Mode.HELD])
def test_rule6_during_a_migration_the_migration_hands_it_on(mode: Mode) -> None:
    c = core()
    c.enter(Mode.MIGRATING)
    if mode is Mode.HELD:
        c.enter(Mode.HELD)
    out = c.worker_lost(journal=True, draining=False)
    assert ops(out) == [(Op.PAUSE, Side.CLIENT)] and c.mode is Mode.FAILING_OVER
    c.new_leg("w2", c.cs.messages, moved=True)  # the migration's switch came through
    assert mode_of(c) is Mode.HELD and c.migrations == 1 and c.backend_id == "w2"


def test_rule6_not_inside_a_client_message_nor_twice() -> None:
    c = core()
    c.cs.feed(build_frame(OP_TEXT, b"part", mask=True, fin=False))
    assert not c.may_fail_over(True)
    c = core()
    c.worker_lost(journal=True, draining=False)
    assert not c.may_fail_over(True)


def test_a_failover_leg_keeps_the_counts_of_the_old() -> None:
    c = core()
    worker_sends(c, text(b"token", mask=False))
    c.worker_lost(journal=True, draining=False)
    c.new_leg("w2", c.cs.messages, moved=False)
    worker_sends(c, text(b"more", mask=False))
    assert c.counts() == (2, 2, len(text(b"token", False)) + len(text(b"more", False)))
    assert c.prior_backends == ("w1",) and c.failovers == 1 and c.mode is Mode.RELAYING


# -- heartbeat --------------------------------------------------------------------------------


def tick(c: SessionCore, now: float, relayed: int = 0, idle: float = 0) -> list[Action]:
    return c.tick(
        now,
        relayed,
        ping_interval=10,
        ping_timeout=5,
        idle=idle,
        backpressure=0,
        first_tick=10,
        journal=False,
    )


def test_heartbeat_pings_both_legs_and_consumes_the_pongs() -> None:
    c = core()
    out = tick(c, 10)
    assert [(op, side) for op, side, _ in out if op is Op.WRITE] == [
        (Op.WRITE, Side.CLIENT),
        (Op.WRITE, Side.WORKER),
    ]
    assert out[-1] == (Op.SCHEDULE, None, 5)
    assert client_sends(c, build_frame(OP_PONG, b"p" * 8, mask=True)) == []
    assert worker_sends(c, build_frame(OP_PONG, b"p" * 8, mask=False)) == []
    assert c.cs.out_bytes == 0 and c.ws.out_bytes == 0  # wslb's pongs are not forwarded
    assert ops(tick(c, 15)) == [(Op.SCHEDULE, None)]


def test_a_missing_pong_closes_with_1011() -> None:
    c = core()
    tick(c, 10)
    out = tick(c, 15)  # no pong from the client
    assert close_code(out, Side.CLIENT) == 1011 and close_code(out, Side.WORKER) == 1001
    assert c.ended == "client ping timeout"


def test_an_endpoints_own_ping_passes_through() -> None:
    c = core()
    ping = build_frame(OP_PING, b"theirs", mask=True)
    assert c.cs.feed(ping) == ping


def test_the_idle_timer_counts_messages_both_ways() -> None:
    c = core()

    def idle_tick(now: float, relayed: int) -> list[Action]:
        return c.tick(
            now,
            relayed,
            ping_interval=0,
            ping_timeout=0,
            idle=30,
            backpressure=0,
            first_tick=10,
            journal=False,
        )

    assert close_code(idle_tick(10, 1), Side.CLIENT) is None
    assert close_code(idle_tick(35, 1), Side.CLIENT) is None  # 25 s quiet
    assert close_code(idle_tick(41, 1), Side.CLIENT) == 1001 and c.ended == "idle timeout"


# -- the replay log ---------------------------------------------------------------------------


def test_the_replay_log_gives_the_messages_after_a_count() -> None:
    c = core()
    frames = [text(f"m{i}".encode(), mask=True) for i in range(3)]
    for f in frames:
        c.log_client(c.cs.feed(f))
    assert c.replay_from(0) == b"".join(frames)
    assert c.replay_from(2) == frames[2] and c.replay_from(3) == b""
    assert c.replay_from(4) is None


def test_a_replay_log_past_its_bound_forgets_the_oldest() -> None:
    c = core(replay=64)
    for i in range(20):
        c.log_client(c.cs.feed(text(f"message {i}".encode(), mask=True)))
    assert c.clog is not None and len(c.clog) == 64
    assert c.replay_from(0) is None and c.replay_from(19) is not None


# -- as data ------------------------------------------------------------------------------------


def stream(seed: int, masked: bool) -> bytes:
    rnd = random.Random(seed)
    out = b""
    for _ in range(rnd.randint(1, 12)):
        kind = rnd.random()
        payload = bytes(rnd.randrange(256) for _ in range(rnd.choice([0, 5, 130, 300])))
        if kind < 0.7:
            out += build_frame(OP_TEXT if rnd.random() < 0.5 else 0x2, payload, mask=masked)
        elif kind < 0.85:
            out += build_frame(OP_TEXT, payload, mask=masked, fin=False)
            out += build_frame(0x0, payload[:3], mask=masked)
        else:
            out += build_frame(OP_PING, payload[:10], mask=masked)
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), cut_c=st.integers(0, 4000), cut_w=st.integers(0, 4000))
def test_snapshot_round_trip_at_any_byte(seed: int, cut_c: int, cut_w: int) -> None:
    """A core described as JSON at any point (mid-frame too) and rebuilt goes on exactly as the
    original: the same bytes out, the same counters, the same snapshot."""
    c = core()
    up, down = stream(seed, True), stream(seed + 1, False)
    cut_c, cut_w = min(cut_c, len(up)), min(cut_w, len(down))
    c.log_client(c.cs.feed(up[:cut_c]))
    c.ws.feed(down[:cut_w])
    tick(c, 10.0)
    data = json.loads(json.dumps(c.snapshot()))
    r = SessionCore.restore(data)
    assert r.snapshot() == c.snapshot()
    for x in (c, r):
        x.rand = lambda n: b"q" * n
    a = (c.cs.feed(up[cut_c:]), c.ws.feed(down[cut_w:]))
    b = (r.cs.feed(up[cut_c:]), r.ws.feed(down[cut_w:]))
    assert a == b
    assert r.snapshot() == c.snapshot()
    assert r.counts() == c.counts() and r.replay_from(0) == c.replay_from(0)


def test_restore_moves_clock_readings_into_the_new_process() -> None:
    c = core()
    c.last_active = 100.0
    c.paused_since = 90.0
    r = SessionCore.restore(c.snapshot(), now_offset=1000.0)
    assert (r.last_active, r.paused_since) == (1100.0, 1090.0)


def test_restore_keeps_the_mode_and_the_close_states() -> None:
    c = core()
    c.enter(Mode.MIGRATING)
    client_sends(c, text(b"unmasked", mask=False))
    r = SessionCore.restore(json.loads(json.dumps(c.snapshot())))
    assert (r.mode, r.phase, r.pending_client_close) == (c.mode, c.phase, c.pending_client_close)
    assert r.cs.error is not None and r.cs.error.code == CloseCode.PROTOCOL_ERROR


# -- Rule 8: client resume ----------------------------------------------------------------------


def resumable(buffer: int = 1 << 16, grace: float = 30.0) -> SessionCore:
    return SessionCore(
        "sid",
        "w1",
        max_frame_size=1 << 20,
        max_message_size=1 << 20,
        replay_limit=4096,
        resume_buffer=buffer,
        grace=grace,
        rand=lambda n: b"p" * n,
    )


def written(c: SessionCore, *payloads: bytes) -> bytes:
    """Worker messages relayed to the client (and kept in the window, as the shell does)."""
    out = b""
    for p in payloads:
        data = c.ws.feed(text(p, mask=False))
        assert c.window is not None
        c.window.buf += data
        out += data
    return out


def test_rule8_a_client_lost_between_messages_is_detached_not_closed() -> None:
    c = resumable()
    written(c, b"t0", b"t1")
    out = c.client_lost(now=100.0)
    assert c.mode is Mode.DETACHED and c.client is Leg.OPEN and c.worker is Leg.OPEN
    assert ops(out) == [(Op.SCHEDULE, None)] and out[0][2] == 30.0  # the grace timer
    assert close_code(out, Side.WORKER) is None


def test_rule8_a_missing_pong_is_a_loss_not_an_ending() -> None:
    """A client whose path went silent answers no ping: with resume, its transport is
    aborted and the loss detaches the session, as a reset would."""
    c = resumable()
    written(c, b"t0")
    tick(c, 10)
    out = tick(c, 15)  # no pong from the client
    assert ops(out) == [(Op.ABORT, Side.CLIENT)] and not c.ended
    c.client_lost(now=15.0)
    assert c.mode is Mode.DETACHED and c.worker is Leg.OPEN


def test_rule8_not_without_resume_nor_inside_a_client_message() -> None:
    assert close_code(core().client_lost(), Side.WORKER) == 1001
    c = resumable()
    c.cs.feed(build_frame(OP_TEXT, b"half", mask=True, fin=False))
    assert close_code(c.client_lost(), Side.WORKER) == 1001


def test_rule8_attach_gives_what_the_client_missed() -> None:
    c = resumable()
    frames = [text(f"t{i}".encode(), mask=False) for i in range(5)]
    written(c, *(f"t{i}".encode() for i in range(5)))
    c.client_lost(now=1.0)
    assert c.attach(3) == b"".join(frames[3:])
    assert mode_of(c) is Mode.RELAYING and c.resumes == 1 and not c.detached_at


def test_rule8_a_count_beyond_or_before_the_window_is_refused() -> None:
    c = resumable(buffer=4096)
    written(c, *(b"x" * 300 for _ in range(40)))  # 12 KB through a 4 KiB window
    assert c.window is not None
    c.window.trim()
    c.client_lost(now=1.0)
    with pytest.raises(ResumeRefused, match=r"sent before its connection was lost \(40\)"):
        c.attach(41)
    with pytest.raises(ResumeRefused, match="no longer kept"):
        c.attach(0)
    assert c.mode is Mode.DETACHED  # a refusal changes nothing
    assert c.attach(40) == b""


def test_rule8_the_grace_expiring_is_rule_2() -> None:
    c = resumable(grace=5.0)
    c.client_lost(now=100.0)
    assert ops(tick(c, 104.0))[-1] == (Op.SCHEDULE, None)  # still waiting (the worker pinged)
    out = c.tick(
        105.5, 0, ping_interval=10, ping_timeout=5, idle=0, backpressure=0,
        first_tick=10, journal=False,
    )  # fmt: skip
    assert close_code(out, Side.WORKER) == 1001 and c.ended == "client went away"
    assert c.client is Leg.LOST and mode_of(c) is Mode.RELAYING


def test_rule8_a_detached_session_pings_its_worker_only() -> None:
    c = resumable()
    c.client_lost(now=1.0)
    out = tick(c, 10.0)
    assert [side for op, side, _ in out if op is Op.WRITE] == [Side.WORKER]


def test_rule8_a_client_lost_during_a_migration_detaches_and_the_migration_goes_on() -> None:
    for held in (False, True):
        c = resumable()
        written(c, b"t0")
        c.enter(Mode.MIGRATING)
        if held:
            c.enter(Mode.HELD)
        out = c.client_lost(now=1.0)
        assert close_code(out, Side.WORKER) is None and ops(out) == [(Op.SCHEDULE, None)]
        assert c.detached_at == 1.0 and c.mode is (Mode.HELD if held else Mode.MIGRATING)
        c.new_leg("w2", c.cs.messages, moved=True)  # the switch, as ``Session.switch`` does
        written(c, b"t1")  # the new worker's first message: kept for the client
        if c.mode is Mode.HELD:  # ``Session.end_migration``
            c.enter(Mode.MIGRATING)
        c.enter(c.settled)
        assert c.mode is Mode.DETACHED
        assert c.attach(1) == text(b"t1", mask=False) and mode_of(c) is Mode.RELAYING


def test_rule8_a_worker_lost_while_detached_fails_over_and_waits_again() -> None:
    c = resumable()
    written(c, b"t0")
    c.client_lost(now=1.0)
    out = c.worker_lost(journal=True, draining=False)
    assert (Op.FAIL_OVER, None) in ops(out) and c.mode is Mode.FAILING_OVER
    c.new_leg("w2", c.cs.messages, moved=False)
    assert mode_of(c) is Mode.DETACHED and c.backend_id == "w2"
    assert c.attach(1) == b""


def test_rule8_a_close_while_detached_loses_the_client() -> None:
    c = resumable()
    c.client_lost(now=1.0)
    out = c.close(CloseCode.SERVICE_RESTART, "worker draining")
    assert close_code(out, Side.WORKER) == 1001 and c.client is Leg.LOST
    with pytest.raises(ResumeRefused):
        c.attach(0)


def test_rule8_without_a_count_the_unacknowledged_messages_are_written_again() -> None:
    c = resumable()
    frames = written(c, b"a", b"b", b"c")
    last = len(text(b"c", mask=False))
    c.client_lost(now=1.0, unsent=last + 1)  # the last message and a byte of the one before
    assert c.best_effort_count() == 1
    assert c.attach(c.best_effort_count()) == frames[len(text(b"a", mask=False)) :]


def test_rule8_the_window_survives_a_snapshot() -> None:
    c = resumable()
    written(c, b"a", b"b")
    c.client_lost(now=50.0)
    r = SessionCore.restore(json.loads(json.dumps(c.snapshot())), now_offset=10.0)
    assert r.mode is Mode.DETACHED and r.detached_at == 60.0
    assert r.attach(1) == text(b"b", mask=False)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=60), n=st.integers(0, 70))
def test_the_window_walk_agrees_with_the_scanner(sizes: list[int], n: int) -> None:
    """``walk`` finds the same message ends the frame scanner does, fragments and pings
    included, and ``after(n)`` is exactly the bytes from message n on."""
    c = resumable(buffer=1 << 20)
    ends = [0]
    for i, size in enumerate(sizes):
        if i % 7 == 3:
            data = build_frame(OP_TEXT, b"f" * size, mask=False, fin=False)
            data += build_frame(OP_PING, b"x", mask=False) + build_frame(0x0, b"g", mask=False)
        else:
            data = text(b"m" * size, mask=False)
        assert c.window is not None
        c.window.buf += c.ws.feed(data)
        ends.append(len(c.window.buf))
    assert c.window is not None
    assert walk(c.window.buf) == (ends[-1], len(sizes))
    got = c.window.after(n)
    assert got == (bytes(c.window.buf[ends[n] :]) if n <= len(sizes) else None)


def test_rule8_a_ping_the_lost_connection_left_unanswered_is_forgotten() -> None:
    """The heartbeat pinged the client, the client was cut before its pong: the resumed
    connection is not closed for the old ping (it once was, with 1011, a beat later)."""
    c = resumable()
    assert [s for op, s, _ in tick(c, 10.0) if op is Op.WRITE] == [Side.CLIENT, Side.WORKER]
    c.client_lost(now=11.0)
    worker_sends(c, build_frame(OP_PONG, b"p" * 8, mask=False))
    c.attach(0)
    for now in (20.0, 25.0, 30.0, 35.0):
        out = tick(c, now)
        assert close_code(out, Side.CLIENT) is None, now
        if any(op is Op.WRITE and side is Side.CLIENT for op, side, _ in out):
            client_sends(c, build_frame(OP_PONG, b"p" * 8, mask=True))
            worker_sends(c, build_frame(OP_PONG, b"p" * 8, mask=False))
