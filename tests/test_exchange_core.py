"""Plain HTTP's rules (``balancer/exchange_core.py``) driven with no socket, loop or clock:
events in, actions out, the state read back. Each numbered rule of the module docstring has a
test here; ``tests/test_http_proxy.py`` checks the same through wslb with real clients."""

from __future__ import annotations

import pytest

from balancer.config.model import HttpCfg
from balancer.exchange_core import (
    LANE_SKIP,
    TRANSITIONS,
    Action,
    ClientCore,
    ExchangeCore,
    Fate,
    IllegalTransition,
    Op,
    State,
    Timer,
)
from balancer.httpmsg import LAST_CHUNK
from balancer.session_core import IllegalTransition as SessionIllegal

CFG = HttpCfg(max_body=1000, timeout_request=7.0, timeout_server=30.0, timeout_keepalive=9.0)


def state_of(c: ClientCore) -> State:
    """Read afresh (mypy keeps an attribute narrowed by an earlier assert)."""
    return c.state


def ops(actions: list[Action]) -> list[Op]:
    return [op for op, _ in actions]


def arg(actions: list[Action], op: Op) -> object:
    found = [a for o, a in actions if o is op]
    assert len(found) == 1, (op, actions)
    return found[0]


def exchange(
    method: bytes = b"GET",
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    named: bool = False,
    prefix_limit: int | None = None,
    known: bool = False,
    backpressure: float = 5.0,
    client: ClientCore | None = None,
) -> tuple[ExchangeCore, list[Action]]:
    """A request head routed (ROUTING, then PLACING or the choice of a worker)."""
    c = client if client is not None else ClientCore()
    assert c.head(False)
    ex = ExchangeCore(c, method, headers or [], 0.0, backpressure)
    return ex, ex.routed(CFG, named=named, prefix_limit=prefix_limit, known=known)


def serving(
    method: bytes = b"GET", headers: list[tuple[bytes, bytes]] | None = None, **kw: object
) -> tuple[ExchangeCore, list[Action]]:
    """An exchange on a fresh worker connection (EXCHANGE)."""
    ex, acts = exchange(method, headers, **kw)  # type: ignore[arg-type]
    assert ops(acts) == [Op.CHOOSE]
    assert ops(ex.chosen(True, False)) == [Op.CONNECT]
    return ex, ex.begin(1.0, True)


def test_the_table_and_an_illegal_step() -> None:
    assert IllegalTransition is SessionIllegal  # one exception for every core's table
    assert set(TRANSITIONS) == set(State)
    c = ClientCore()
    with pytest.raises(IllegalTransition, match="IDLE -> EXCHANGE"):
        c.enter(State.EXCHANGE)  # no exchange without routing first
    assert state_of(c) is State.IDLE
    assert not c.head(True)
    assert state_of(c) is State.UPGRADED
    with pytest.raises(IllegalTransition):
        c.close(True)  # the upgrade path owns it now
    assert not TRANSITIONS[State.CLOSED]


def test_rule1_a_pipelined_request_is_read_ahead_up_to_the_head_limit() -> None:
    c = ClientCore()
    assert c.head(False)
    assert c.read_ahead(600, 1000)
    assert not c.read_ahead(600, 1000)  # past max_header_bytes: stop reading
    c.enter(State.CLOSED)
    c2 = ClientCore()
    c2.unread = 5
    c2.head(False)
    assert c2.unread == 0  # each request counts afresh


def test_rule2_bodies_stream_and_a_full_buffer_pauses_the_other_side() -> None:
    headers = [(b"transfer-encoding", b"chunked"), (b"expect", b"100-continue")]
    ex, acts = serving(b"POST", headers)
    assert ops(acts) == [Op.COUNT, Op.ARM, Op.CONTINUE, Op.ARM, Op.PUMP, Op.FLUSH]
    assert ex.wants_body
    assert ex.request_data(b"abc", 2.0) == [(Op.WRITE, b"3\r\nabc\r\n")]  # one read, one chunk
    assert ex.worker_full(True) == [(Op.READ_CLIENT, False)]
    assert not ex.wants_body
    assert ex.worker_full(False) == [(Op.READ_CLIENT, True)]
    end = ex.request_end()
    assert (Op.WRITE, LAST_CHUNK) in end and ex.sent
    assert ex.worker_full(True) == []  # the request is in: the client is not held back
    ex.response_head(200, True, True)
    acts = ex.client_full(True, 10.0)
    assert acts == [(Op.READ_WORKER, False), (Op.ARM, (Timer.STALL, 5.0))]
    assert ex.client_full(False, 11.0) == [(Op.READ_WORKER, True)]
    assert ex.client_full(True, 12.0) == [(Op.READ_WORKER, False)]  # its timer runs already
    assert ex.fired(Timer.STALL, 15.0) == [(Op.ARM, (Timer.STALL, 2.0))]  # paused at 12
    cut = ex.fired(Timer.STALL, 17.0)
    # No answer (the head went); the server timer cancelled; then the client's transport.
    assert ops(cut) == [Op.ABORT_WORKER, Op.CANCEL, Op.FINISH, Op.STALLED]
    assert arg(cut, Op.FINISH) == (False, Fate.NONE, True)
    assert ex.end == "client not reading" and ex.status == 200


def test_rule2_a_client_that_reads_again_is_not_cut() -> None:
    ex, _ = serving()
    ex.request_end()
    ex.response_head(200, False, False)
    ex.client_full(True, 1.0)
    ex.client_full(False, 2.0)
    assert ex.fired(Timer.STALL, 6.0) == []
    assert not ex.done
    no_limit, _ = serving(backpressure=0.0)
    assert ops(no_limit.client_full(True, 1.0)) == [Op.READ_WORKER]  # no clock at all


def test_rule3_an_idempotent_bodiless_request_goes_again_once_on_a_new_connection() -> None:
    ex, _ = serving()
    ex.request_end()
    acts = ex.worker_failed("the worker closed the connection", reused=True)
    assert ops(acts) == [Op.ABORT_WORKER, Op.CONNECT]
    assert state_of(ex.client) is State.ROUTING and ex.retried
    again = ex.begin(2.0, True)
    assert ops(again) == [Op.FLUSH]  # counted and timed already; all of it goes
    assert ex.sent
    acts = ex.worker_failed("the worker closed the connection", reused=True)
    assert ops(acts) == [Op.ABORT_WORKER, Op.FAILED, Op.ANSWER, Op.CANCEL, Op.FINISH]
    assert arg(acts, Op.ANSWER) == (502, "the worker failed to answer")


@pytest.mark.parametrize(
    ("method", "headers", "reused"),
    [
        (b"POST", [], True),  # not idempotent
        (b"PUT", [(b"content-length", b"3")], True),  # a body: it may be gone
        (b"GET", [], False),  # a fresh connection: the worker itself failed
    ],
)
def test_rule3_no_retry_otherwise(
    method: bytes, headers: list[tuple[bytes, bytes]], reused: bool
) -> None:
    ex, _ = serving(method, headers)
    acts = ex.worker_failed("reset", reused=reused)
    assert Op.CONNECT not in ops(acts)
    assert arg(acts, Op.ANSWER) == (502, "the worker failed to answer")


def test_rule3_after_the_walk_502_or_503() -> None:
    ex, _ = exchange()
    assert arg(ex.no_worker_took(True), Op.ANSWER) == (502, "no worker could take the request")
    left, _ = exchange()
    assert arg(left.no_worker_took(False), Op.ANSWER) == (503, "no worker available")
    none, _ = exchange()
    acts = none.chosen(False, False)
    assert arg(acts, Op.ANSWER) == (503, "no worker available")
    assert state_of(none.client) is State.ROUTING  # the shell closes it (FINISH, not kept)
    assert arg(acts, Op.FINISH) == (False, Fate.NONE, False)


def test_rule4_wslb_answers_before_the_head_and_cuts_after_it() -> None:
    # 413: declared, and streamed past max_body.
    ex, acts = exchange(b"POST", [(b"content-length", b"5000")])
    assert ops(acts) == [Op.REFUSE] and ex.done
    rej = arg(acts, Op.REFUSE)
    assert getattr(rej, "status", None) == 413
    ex, _ = serving(b"POST", [(b"transfer-encoding", b"chunked")])
    assert arg(ex.request_data(b"x" * 1001, 2.0), Op.ANSWER) == (413, "request body too large")
    # 408, unless the worker is the slow one.
    ex, _ = serving(b"POST", [(b"content-length", b"10")])
    ex.worker_full(True)
    assert ex.fired(Timer.REQUEST, 8.0) == [(Op.ARM, (Timer.REQUEST, 7.0))]
    ex.worker_full(False)
    assert arg(ex.fired(Timer.REQUEST, 15.0), Op.ANSWER)[0] == 408  # type: ignore[index]
    # 504 after timeout_server of silence; a client not reading does not count.
    ex, _ = serving()
    ex.request_end()
    assert ex.fired(Timer.SERVER, 20.0) == [(Op.ARM, (Timer.SERVER, 11.0))]
    ex.heard(25.0)
    assert ex.fired(Timer.SERVER, 31.0) == [(Op.ARM, (Timer.SERVER, 24.0))]
    assert arg(ex.fired(Timer.SERVER, 55.0), Op.ANSWER)[0] == 504  # type: ignore[index]
    # 400: a target that cannot be written.
    ex, _ = exchange()
    acts = ex.begin(1.0, False)
    assert ops(acts)[:2] == [Op.COUNT, Op.ABORT_WORKER]
    assert arg(acts, Op.ANSWER)[0] == 400  # type: ignore[index]
    # After the head: a cut, no answer.
    ex, _ = serving()
    ex.request_end()
    ex.response_head(200, False, False)
    acts = ex.worker_failed("the worker closed the connection", reused=False)
    assert acts[-2:] == [(Op.CANCEL, Timer.SERVER), (Op.FINISH, (False, Fate.NONE, True))]
    assert ops(acts) == [Op.ABORT_WORKER, Op.FAILED, Op.CANCEL, Op.FINISH]
    assert ex.status == 200 and ex.end == "the worker closed the connection"
    # A 101 on a plain request is the worker's failure; other 1xx are skipped.
    assert ex.informational(100) is None
    assert ex.informational(101) is not None
    # The client gone before any answer: nginx's 499; a drain's abort: 503.
    ex, _ = serving()
    assert ops(ex.client_gone("client went away")) == [Op.ABORT_WORKER, Op.CANCEL, Op.FINISH]
    assert ex.status == 499
    assert ex.client_gone("again") == [] and ex.fail(500, "x", "y") == []  # once
    ex, _ = serving()
    assert arg(ex.abort("balancer shutting down"), Op.ANSWER) == (503, "balancer shutting down")


def test_rule4_426_where_plain_http_is_off() -> None:
    c = ClientCore()
    c.head(False)
    ex = ExchangeCore(c, b"GET", [], 0.0, 5.0)
    acts = ex.routed(HttpCfg(enabled=False), named=False, prefix_limit=None, known=False)
    assert getattr(arg(acts, Op.REFUSE), "status", None) == 426
    assert c.close(True) and state_of(c) is State.CLOSED


def test_rule5_the_worker_connection_is_kept_only_with_both_messages_complete() -> None:
    ex, _ = serving()
    ex.request_end()
    ex.response_head(200, False, False)
    assert arg(ex.response_end(True), Op.FINISH) == (True, Fate.KEEP, True)
    named, _ = serving(named=True)
    named.request_end()
    assert arg(named.response_end(True), Op.FINISH) == (True, Fate.SPARE, True)  # rule 8
    unframed, _ = serving()
    unframed.request_end()
    assert arg(unframed.response_end(False), Op.FINISH) == (True, Fate.CLOSE, True)
    early, _ = serving(b"POST", [(b"content-length", b"10")])
    acts = early.response_end(True)  # answered before the request body ended
    assert arg(acts, Op.FINISH) == (False, Fate.CLOSE, True)
    assert early.end == "answered before the request body ended"
    assert ex.response_end(True) == [] and ex.request_end() == []  # once
    # The connection goes on only where all agree.
    c = ClientCore()
    assert c.may_go_on(True, False, True)
    assert not c.may_go_on(False, False, True)
    assert not c.may_go_on(True, True, True)  # shutting down
    assert not c.may_go_on(True, False, False)  # h11: not both done (HTTP/1.0, close)
    c.eof = True
    assert not c.may_go_on(True, False, True)


def test_rule5_a_close_lingers_while_the_client_may_still_be_sending() -> None:
    c = ClientCore()
    assert not c.close(False)  # mid-request: shut the write side, read and discard a while
    assert c.lingering and state_of(c) is State.CLOSED
    assert c.close(False)  # the linger's end
    settled = ClientCore()
    assert settled.close(True)
    gone = ClientCore()
    gone.gone = True
    assert gone.close(False)


def test_rule6_a_request_counts_on_its_worker_once_while_it_runs() -> None:
    ex, acts = serving()
    assert ops(acts).count(Op.COUNT) == 1 and ex.counted
    ex.worker_failed("reset", reused=True)  # retried: still counted, not again
    assert Op.COUNT not in ops(ex.begin(2.0, True))
    ex.request_end()
    assert arg(ex.response_end(True), Op.FINISH)[2] is True  # type: ignore[index]
    assert not ex.counted
    never, _ = exchange()
    assert arg(never.chosen(False, False), Op.FINISH)[2] is False  # type: ignore[index]


def test_rule7_a_chunked_answer_goes_to_the_relay_thread_and_comes_back() -> None:
    ex, _ = serving()
    ex.request_end()
    ex.response_head(200, True, True)
    for _ in range(3):
        ex.response_data(10)
    assert not ex.offload_due(4)
    ex.response_data(10)
    assert ex.offload_due(4) and ex.kind == "sse" and ex.bytes_out == 40
    assert ex.offloaded(True) == [(Op.READ_WORKER, False)]
    assert state_of(ex.client) is State.RELAYED and not ex.offload_due(4)
    with pytest.raises(IllegalTransition):
        ex.client.close(True)  # decisions are taken after the answer is taken back
    assert ex.reclaimed(100, True, 50.0) == [(Op.READ_WORKER, True)]
    assert state_of(ex.client) is State.EXCHANGE and ex.bytes_out == 140 and ex.last == 50.0
    ex.offloaded(False)  # a TLS leg: never again
    assert not ex.offload_due(4)
    sized, _ = serving()
    sized.request_end()
    sized.response_head(200, False, False)
    for _ in range(10):
        sized.response_data(1)
    assert not sized.offload_due(4)  # a Content-Length answer stays here
    paused, _ = serving()
    paused.request_end()
    paused.response_head(200, True, True)
    for _ in range(5):
        paused.response_data(1)
    paused.client_full(True, 1.0)
    assert not paused.offload_due(4)


def test_rule8_a_lane_that_served_none_is_not_tried_again_so_soon() -> None:
    c = ClientCore()
    assert c.lane_due()
    c.enter(State.LANE)
    go_on, wait = c.lane_back(client_ended=False, served=0, idle_for=2.0, closing=False)
    assert go_on and state_of(c) is State.IDLE and wait == 58.0
    assert [c.lane_due() for _ in range(LANE_SKIP + 1)] == [False] * LANE_SKIP + [True]
    c.enter(State.LANE)
    go_on, _ = c.lane_back(client_ended=True, served=3, idle_for=0.0, closing=False)
    assert not go_on and state_of(c) is State.CLOSED


def test_rule9_a_keyless_body_is_read_whole_then_placed_by_its_prompt() -> None:
    headers = [(b"content-length", b"6")]
    ex, acts = exchange(b"POST", headers, prefix_limit=100)
    assert state_of(ex.client) is State.PLACING
    assert acts == [(Op.ARM, (Timer.REQUEST, 7.0)), (Op.PUMP, True)]
    assert ex.wants_body and ex.pumped
    assert ex.request_data(b"abc", 1.0) == []  # held: no worker yet
    acts = ex.request_end()
    assert ops(acts) == [Op.CANCEL, Op.READ_CLIENT, Op.CHOOSE]
    assert state_of(ex.client) is State.ROUTING and ex.prompt_wanted
    assert ex.chosen(True, True) == []  # a kept-alive connection: the shell begins on it
    acts = ex.begin(2.0, True)
    assert ops(acts) == [Op.COUNT, Op.ARM, Op.WRITE, Op.FLUSH]  # one write
    assert ex.sent and ex.held is None


def test_rule9_expect_100_continue_is_answered_before_the_read() -> None:
    headers = [(b"content-length", b"6"), (b"expect", b"100-continue")]
    _, acts = exchange(b"POST", headers, prefix_limit=100)
    assert ops(acts) == [Op.ARM, Op.CONTINUE, Op.PUMP]


def test_a_bodiless_request_has_no_request_clock() -> None:
    ex, acts = serving()
    assert ops(acts) == [Op.COUNT, Op.ARM, Op.PUMP, Op.FLUSH]
    assert arg(acts, Op.ARM) == (Timer.SERVER, 30.0)
    assert ex.request_end() == []


def test_rule9_a_larger_body_is_placed_without_a_prompt_and_streamed() -> None:
    ex, _ = exchange(b"POST", [(b"transfer-encoding", b"chunked")], prefix_limit=4)
    ex.request_data(b"abc", 1.0)
    acts = ex.request_data(b"defg", 1.0)  # past prefix_placement.max_body
    assert ops(acts) == [Op.READ_CLIENT, Op.CANCEL, Op.CHOOSE]
    assert not ex.prompt_wanted and not ex.wants_body
    acts = ex.begin(2.0, True)
    writes = [a for o, a in acts if o is Op.WRITE]
    assert writes == [b"3\r\nabc\r\n", b"4\r\ndefg\r\n"]  # re-chunked as read
    assert ops(acts)[-3:] == [Op.ARM, Op.PUMP, Op.FLUSH]  # the rest streams
    assert ex.wants_body


@pytest.mark.parametrize(
    ("method", "headers", "named", "known"),
    [
        (b"GET", [], False, False),  # bodiless
        (b"POST", [(b"content-length", b"500")], False, False),  # declared past the limit
        (b"PUT", [(b"content-length", b"5")], False, False),  # not a POST
        (b"POST", [(b"content-length", b"5")], True, True),  # a placed key goes home
    ],
)
def test_rule9_what_is_not_read_first(
    method: bytes, headers: list[tuple[bytes, bytes]], named: bool, known: bool
) -> None:
    _, acts = exchange(method, headers, named=named, known=known, prefix_limit=100)
    assert acts == [(Op.CHOOSE, None)]
    _, acts = exchange(b"POST", [(b"content-length", b"5")], named=True, prefix_limit=9)
    assert ops(acts)[-1] is Op.PUMP  # a named key's first request is placed by its prompt


def test_a_keepalive_cycle_and_its_states() -> None:
    c = ClientCore()
    ex, _ = serving(client=c)
    assert c.keepalive_s == 9.0
    ex.request_end()
    ex.response_head(204, False, False)
    ex.response_end(True)
    assert state_of(c) is State.EXCHANGE  # the shell moves it on (``may_go_on``)
    c.enter(State.IDLE)
    again, _ = serving(client=c)
    assert state_of(c) is State.EXCHANGE and again.counted


def test_a_clock_this_exchange_did_not_arm_is_nothing_to_it() -> None:
    """The connection's timeout_server clock runs on from the exchange before: one still
    choosing its worker (or reading a body by rule 9) is not judged by it."""
    ex, _ = exchange()
    assert ex.fired(Timer.SERVER, 1000.0) == []
    assert not ex.done
    ex, _ = serving()
    assert arg(ex.fired(Timer.SERVER, 1000.0), Op.ANSWER)[0] == 504  # type: ignore[index]
