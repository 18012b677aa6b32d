"""A backend's one owner of health and state (balancer/backend.py), with no socket.

Each source of a change (probes, a spawned process, the ``workers: N`` board, failover's
verdict, drains, passive ejection and its end) goes through a method of ``Backend``, which
calls the listeners exactly once per change of the state word or health and never without
one; the feed's ``state`` events are made of those calls (``LocalControl.watch_states``). The
last test reads every module to check that nothing else writes those fields.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client.registry import CollectorRegistry

from balancer import workerauth
from balancer.aio.control import LocalControl
from balancer.aio.drain import Drainer
from balancer.aio.monitors import BOARD_FOLLOW, BoardFollower, Monitors
from balancer.aio.spawn import Spawner
from balancer.aio.state import ServerState
from balancer.backend import AdminState, Backend, BackendSpec, Change
from balancer.board import Board, BoardInfo
from balancer.config import BackendCfg, Config, OutlierCfg, PoolCfg
from balancer.metrics import Stats
from balancer.pool import ACTIVE, DRAINED, DRAINING, Pool
from tests.waits import until

ROOT = Path(__file__).resolve().parent.parent

Heard = list[tuple[str, str, bool]]


def heard_by(b: Backend) -> Heard:
    """What ``b``'s listener hears: (before, after, health flipped) per call."""
    heard: Heard = []

    def listener(backend: Backend, change: Change) -> None:
        assert backend is b
        heard.append((change.before, change.after, change.flipped))

    b.listen(listener)
    return heard


def backend() -> Backend:
    return Backend(BackendCfg("b", "ws://127.0.0.1:9001"))


def test_probes_are_heard_once_per_flip() -> None:
    b = backend()
    heard = heard_by(b)
    assert not b.probe(False, rise=2, fall=3, reason="connect refused", kind="refused")
    assert not b.probe(False, rise=2, fall=3, reason="connect refused", kind="refused")
    assert heard == []  # no flip yet: nothing to hear
    assert b.probe(False, rise=2, fall=3, reason="connect refused", kind="refused", at=5.0)
    assert heard == [("active", "down", True)]
    assert not b.probe(False, rise=2, fall=3, reason="timeout after 1s", kind="timeout")
    assert not b.probe(True, rise=2, fall=3)
    assert heard == [("active", "down", True)]  # a new reason, a first success: no change
    assert b.health_reason == "timeout after 1s"
    assert b.probe(True, rise=2, fall=3, at=9.0)
    assert heard == [("active", "down", True), ("down", "active", True)]
    assert (b.health_reason, b.health_since, b.ready) == (None, 9.0, True)


def test_a_process_coming_and_going_is_heard_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(workerauth.SPAWN_ENV, raising=False)  # Spawner() generates one
    b = backend()
    heard = heard_by(b)
    told: list[bool] = []
    spawner = Spawner(lambda backend, healthy: told.append(healthy))
    spawner._set(b, False, "worker process exited with -9")
    spawner._set(b, False, "worker process exited with 1")  # down already: no change
    assert heard == [("active", "down", True)] and told == [False, False]
    assert (b.health_reason, b.health_kind) == ("worker process exited with 1", "process")
    spawner._set(b, True)
    spawner._set(b, True)
    assert heard == [("active", "down", True), ("down", "active", True)]


class FakeBoard:
    """``Board.read_info`` of a supervisor that rewrites a backend's health."""

    def __init__(self) -> None:
        self.seq = 0
        self.healthy = True
        self.reads = 0

    def set(self, healthy: bool) -> None:
        self.seq += 1
        self.healthy = healthy

    def read_info(self, backend_id: str) -> BoardInfo | None:
        self.reads += 1
        return BoardInfo(self.seq, self.healthy, None, None, None, None, None, None)


async def test_the_board_is_heard_once_per_change() -> None:
    pool = Pool(PoolCfg("p", backends=(BackendCfg("b", "ws://127.0.0.1:9001"),)))
    b = pool.backends["b"]
    heard = heard_by(b)
    board = FakeBoard()
    follower = BoardFollower(cast(Board, board), asyncio.get_running_loop())
    await follower.start([pool])
    try:

        async def settle() -> None:
            """Two more passes over the board: the last change was read and acted on."""
            reads = board.reads
            await until(lambda: board.reads >= reads + 2, 5 + BOARD_FOLLOW * 3, "two passes")

        board.set(True)  # rewritten (new signals, say), health unchanged
        await settle()
        assert heard == []
        board.set(False)
        await settle()
        board.set(False)
        await settle()
        assert heard == [("active", "down", True)] and not b.ready
        board.set(True)
        await settle()
        assert heard == [("active", "down", True), ("down", "active", True)]
    finally:
        await follower.stop()


def test_failovers_verdict_is_one_change_and_the_checks_start_over() -> None:
    b = backend()
    heard = heard_by(b)
    assert not b.probe(True, rise=2, fall=3)
    assert b.probe_oks == 1
    # Failover's ``_probe``: a lost session's worker failed its check, down at once.
    assert b.set_health(False, "lost mid-session; connect refused", "refused", at=3.0)
    assert not b.set_health(False, "lost mid-session; connect refused", "refused", at=3.1)
    assert heard == [("active", "down", True)] and b.probe_oks == 0
    assert not b.probe(True, rise=2, fall=3)  # the run of passed checks started over
    assert b.probe(True, rise=2, fall=3)
    assert heard == [("active", "down", True), ("down", "active", True)]


def test_drains_are_heard_once_per_step_and_health_under_a_drain_too() -> None:
    b = backend()
    heard = heard_by(b)
    assert b.set_admin(DRAINING) and not b.set_admin(DRAINING)
    assert heard == [("active", "draining", False)] and not b.ready
    assert b.set_health(False, "connect refused", "refused")
    # The word stays ``draining``: the listener hears the health, the feed gets no event.
    assert heard[-1] == ("draining", "draining", True)
    assert b.set_admin(DRAINED) and b.set_admin(ACTIVE)
    assert heard[-2:] == [("draining", "drained", False), ("drained", "down", False)]
    assert len(heard) == 4
    assert b.set_admin("draining") and b.admin_state is AdminState.DRAINING  # words convert


def test_ejection_and_its_end_are_heard_once_each() -> None:
    cfg = PoolCfg(
        "p",
        outlier=OutlierCfg(consecutive_failures=2, base_ejection_time=10.0),
        backends=tuple(BackendCfg(f"w{i}", f"ws://127.0.0.1:{9001 + i}") for i in range(2)),
    )
    pool = Pool(cfg)
    b = pool.backends["w0"]
    heard = heard_by(b)
    assert not pool.failed(b, now=100.0)
    assert heard == []
    assert pool.failed(b, now=100.0)
    assert heard == [("active", "ejected", False)] and b.ejected_until == 110.0
    assert not pool.failed(b, now=101.0) and not pool.failed(b, now=101.0)  # ejected already
    pool.refresh(now=109.0)
    assert heard == [("active", "ejected", False)]
    pool.readmit(110.0)  # the shell's timer at its end
    pool.refresh(now=111.0)
    pool.readmit(112.0)
    assert heard == [("active", "ejected", False), ("ejected", "active", False)]
    assert b.ready and b.returned_at == 110.0
    # Without the timer, the next refresh readmits it (and says so, once).
    pool.failed(b, now=200.0)
    pool.failed(b, now=200.0)
    assert b.ejected_until == 220.0  # back for less than max_ejection_time: twice as long
    pool.refresh(now=219.0)
    pool.refresh(now=221.0)
    pool.refresh(now=222.0)
    assert heard[2:] == [("active", "ejected", False), ("ejected", "active", False)]


def test_state_and_ready_follow_the_rule_in_every_combination() -> None:
    for admin in AdminState:
        for healthy in (True, False):
            for ejected in (True, False):
                b = backend()
                b.set_admin(admin)
                b.set_health(healthy)
                if ejected:
                    b.eject(0.0, 5.0, 10.0)
                assert b.ready == (healthy and admin == ACTIVE and not ejected)
                word = admin if admin != ACTIVE else "active" if healthy else "down"
                if word == "active" and ejected:
                    word = "ejected"
                assert b.state == word and type(b.state) is str


def test_the_pool_passes_on_its_members_changes_while_they_are_members() -> None:
    pool = Pool(PoolCfg("p", backends=(BackendCfg("a", "ws://127.0.0.1:9001"),)))
    heard: list[tuple[str, str, str, str]] = []
    pool.listen(lambda p, b, c: heard.append((p.name, b.id, c.before, c.after)))
    added = pool.add(BackendCfg("n", "ws://127.0.0.1:9002"))
    pool.backends["a"].set_health(False)
    added.set_admin(DRAINING)
    assert heard == [("p", "a", "active", "down"), ("p", "n", "active", "draining")]
    pool.remove("n")
    added.set_admin(ACTIVE)  # no longer a member: not the pool's to tell
    assert len(heard) == 2


async def test_the_feed_has_one_state_event_per_change_with_todays_fields() -> None:
    """``LocalControl.watch_states`` (no polling) and the shell's timer at an ejection's end."""
    cfg = PoolCfg(
        "p",
        outlier=OutlierCfg(consecutive_failures=1, base_ejection_time=0.05),
        backends=tuple(BackendCfg(f"w{i}", f"ws://127.0.0.1:{9001 + i}") for i in range(2)),
    )
    pool = Pool(cfg)
    loop = asyncio.get_running_loop()
    state = ServerState(loop, Config(pools=(cfg,)), [pool], Stats())
    local = LocalControl(
        state, cast(Drainer, None), cast(Monitors, None), CollectorRegistry(auto_describe=False)
    )
    local.watch_states()
    b = pool.backends["w0"]

    def states() -> list[dict[str, Any]]:
        return [
            {k: v for k, v in e.items() if k not in ("seq", "time")}
            for e in state.events.since(0)
            if e["kind"] == "state"
        ]

    b.probe(False, 1, 1, "connect refused", "refused")
    b.probe(False, 1, 1, "connect refused", "refused")
    assert states() == [
        {
            "kind": "state",
            "backend": "w0",
            "pool": "p",
            "from": "active",
            "to": "down",
            "reason": "connect refused",
        }
    ]
    b.set_admin(DRAINING)
    b.set_health(True)  # draining, healthy again: the word did not change, no event
    b.set_admin(ACTIVE)
    assert [(e["from"], e["to"]) for e in states()[1:]] == [
        ("down", "draining"),
        ("draining", "active"),
    ]
    w1 = pool.backends["w1"]
    state.worker_failed(pool, w1)  # ejected for 0.05 s; nothing selects meanwhile
    assert [(e["backend"], e["from"], e["to"]) for e in states()[3:]] == [
        ("w1", "active", "ejected")
    ]
    await until(lambda: len(states()) > 4, 5, "w1 back from its ejection")
    assert [(e["backend"], e["from"], e["to"]) for e in states()[3:]] == [
        ("w1", "active", "ejected"),
        ("w1", "ejected", "active"),
    ]
    assert w1.ready


def test_the_spec_is_immutable_and_swapped_whole() -> None:
    pool = Pool(PoolCfg("p", backends=(BackendCfg("a", "ws://127.0.0.1:9001/ws"),)))
    b = pool.backends["a"]
    spec = b.spec
    assert (spec.id, spec.url, spec.weight, spec.upstream.port) == ("a", b.url, 1.0, 9001)
    assert spec == BackendSpec.of(b.cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.weight = 2.0  # type: ignore[misc]
    ring = pool.ring
    pool.update("a", dataclasses.replace(b.cfg, metrics_url="http://127.0.0.1:9/m"))
    assert pool.ring is ring and b.spec is not spec and b.cfg.metrics_url is not None
    pool.update("a", dataclasses.replace(b.cfg, weight=3.0))
    assert pool.ring is not ring and b.weight == 3.0 and spec.weight == 1.0
    with pytest.raises(ValueError, match="new backend"):
        b.configure(BackendCfg("a", "ws://127.0.0.1:9002/ws"))


@pytest.mark.parametrize("field", ["healthy", "admin_state", "ejected_until", "health_reason"])
def test_the_state_cannot_be_assigned(field: str) -> None:
    with pytest.raises(AttributeError):
        setattr(backend(), field, None)


# What only balancer/backend.py writes: the spec and the health and state, public and private.
# The names other classes also have (a test's server is ``healthy``, a session has a ``state``)
# are checked in balancer/ alone, where no other class writes them on anything but ``self``;
# at run time the properties among them refuse a write anyway.
SHARED_NAMES = {"id", "cfg", "url", "upstream", "weight", "ready", "state", "healthy"}
OWNED = SHARED_NAMES | {
    "spec",
    "admin_state",
    "health_reason",
    "health_kind",
    "health_since",
    "last_check",
    "probe_oks",
    "probe_fails",
    "ejected_until",
    "ejections",
    "returned_at",
    *(s for s in Backend.__slots__ if s.startswith("_")),
}
# The code that can hold a Backend (``backends/`` may not import it: test_architecture).
SCANNED = ("balancer", "tests", "bench")


def foreign_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, field) of each assignment, deletion or ``setattr`` of an owned field on anything
    but ``self`` (other classes' own attributes of the same name are theirs)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in OWNED
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
        ):
            out.append((node.lineno, str(node.args[1].value)))
        flat: list[ast.expr] = []
        for t in targets:
            flat += t.elts if isinstance(t, ast.Tuple | ast.List) else [t]
        for t in flat:
            if (
                isinstance(t, ast.Attribute)
                and t.attr in OWNED
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
            ):
                out.append((t.lineno, t.attr))
    return out


def test_the_checker_finds_foreign_writes() -> None:
    code = "b.healthy = False\nx.state, y = 1, 2\nb._oks += 1\nsetattr(b, 'ready', 1)\n"
    code += "self.state = 1\nitem.other = 2\n"
    found = sorted(foreign_writes(ast.parse(code)))
    assert found == [(1, "healthy"), (2, "state"), (3, "_oks"), (4, "ready")]


def test_nothing_but_the_owner_writes_the_health_and_state() -> None:
    here = Path(__file__).resolve()
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "balancer" / "backend.py" or path == here:
                continue
            for line, attr in foreign_writes(ast.parse(path.read_text(), str(path))):
                if top == "balancer" or attr not in SHARED_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{line}: .{attr}")
    assert not found, "written outside balancer/backend.py:\n" + "\n".join(found)
