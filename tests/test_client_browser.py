"""The browser library in a browser: headless Chromium (Debian's, driven by Playwright) runs the
demo page ``clients/js/examples/chat.html``, which uses ``ResumableSocket`` from
``clients/js/wslb.js``, against wslb through a TCP relay the test cuts (``tests/cutrelay.py``).

- ``wslb --config balancer.yaml`` (the repository's own file, its three spawned reference
  workers): an answer cut mid-way by a reset, the network back 1.5 s later, arrives whole, once
  and in order, and the page saw ``reconnecting`` then ``resumed``; the same after a silent
  drop (packets stop, nothing closes), which only the page's ``idleTimeout`` finds; and after
  the browser went offline and back (Playwright's ``set_offline``): the window's ``online``
  resumes at once.
- A cut longer than the pool's ``grace`` (balancer.yaml with ``resume.grace: 3s``): the page
  learns the session is gone (``gone``, or ``giveup`` when its own grace ran out first) and
  starts a new session that works: a new ``hello``, a whole new answer.
- Two wslb instances in cluster mode behind HAProxy round robin: the reconnect after a reset
  lands on the instance that does not hold the session, which carries it to its holder; the
  answer is whole.

The page is served over HTTP from ``clients/js/`` (it imports ``../wslb.js`` as a module) and
keeps what it saw on ``window.chat``: every library event, every ``hello``, each answer's token
indices in arrival order. Each test prints that record (``-s`` shows it; a failure always does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from aiohttp import web

from backends.model import token_text
from tests.browser import PageLog, browser, require_browser
from tests.cutrelay import CutRelay
from tests.procs import ROOT, Worker, Wslb, free_port, free_ports
from tests.tier import Tier, metric, workers

CLIENTS = ROOT / "clients" / "js"
PAGE = "examples/chat.html"
BALANCER_YAML = ROOT / "balancer.yaml"

# The spawned reference workers stream 50 tokens/s: 300 tokens take 6 s, so a cut after the
# 40th leaves ~5 s of answer to stream while the page is away (down 1.5 s, or 2 s of silence
# before its idleTimeout fires).
TOKENS = 300
CUT_AFTER = 40
DOWN_S = 1.5
IDLE_MS = 2000
SHORT_GRACE_S = 3
# Deadlines (ms) for what the page waits for.
OPEN_MS = 15_000
ANSWER_MS = 40_000


# -- what runs: wslb from balancer.yaml, the page's HTTP server ------------------------------


def balancer_yaml(tmp: Path, name: str, config: Path = BALANCER_YAML) -> Wslb:
    """``wslb --config CONFIG`` as balancer.yaml's quick start runs it, on free ports (its
    ``WSLB_LISTEN``, ``WSLB_ADMIN_LISTEN``, ``WSLB_WORKER_PORT1..3``), started and ready
    (its three ``spawn: reference`` workers active). ``Wslb`` runs it (``python -m balancer``,
    the ``wslb`` command) from CONFIG itself instead of a file of its own."""
    lb = Wslb({}, tmp, name=name)
    lb.path = config
    w1, w2, w3 = free_ports(3)
    lb.env.update(
        WSLB_LISTEN=f"127.0.0.1:{lb.port}",
        WSLB_ADMIN_LISTEN=f"127.0.0.1:{lb.admin_port}",
        WSLB_WORKER_PORT1=str(w1),
        WSLB_WORKER_PORT2=str(w2),
        WSLB_WORKER_PORT3=str(w3),
    )
    for var in ("WSLB_METRICS_LISTEN", "WSLB_ADMIN_TOKEN"):
        lb.env.pop(var, None)
    try:
        lb.start(wait_ready=False)
        lb.wait_ready(timeout=30)
    except BaseException:
        print(f"--- {lb.name}\n{lb.log_tail()}")
        if lb.proc is not None:
            lb.stop()
        raise
    return lb


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wslb]:
    require_browser()
    lb = balancer_yaml(tmp_path_factory.mktemp("quickstart"), "quickstart")
    yield lb
    lb.stop()


@pytest.fixture
async def site() -> AsyncIterator[str]:
    """``clients/js/`` over HTTP on 127.0.0.1 (a module script needs an http origin)."""
    app = web.Application()
    app.router.add_static("/", CLIENTS)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def cut_relay(port: int) -> AsyncIterator[CutRelay]:
    relay = await CutRelay("127.0.0.1", port).start()
    try:
        yield relay
    finally:
        await relay.close()


# -- the page ------------------------------------------------------------------------------


class Chat:
    """The demo page in Chromium, and what it saw."""

    def __init__(self, page: Any, log: PageLog) -> None:
        self.page = page
        self.log = log

    async def wait(self, condition: str, arg: Any = None, timeout_ms: int = OPEN_MS) -> None:
        """Until the JavaScript ``condition`` (a function of ``arg``, reading ``chat``) holds."""
        await self.page.wait_for_function(condition, arg=arg, timeout=timeout_ms)

    async def seen(self) -> dict[str, Any]:
        """``window.chat`` as data: events, hellos, answers (indices, texts, done), errors."""
        state: dict[str, Any] = await self.page.evaluate(
            """() => ({key: chat.key, events: chat.events, hellos: chat.hellos,
                answers: chat.answers, errors: chat.errors,
                status: document.getElementById('status').textContent,
                shown: [...document.querySelectorAll('#answers .answer .text')]
                    .map(e => e.textContent),
                listed: [...document.querySelectorAll('#events li')]
                    .map(li => li.textContent.split(' ')[0])})"""
        )
        return state

    async def ask(self, tokens: int, text: str = "tell me a long story") -> int:
        """Ask on the page (as its form does); the index of the answer in ``chat.answers``."""
        index: int = await self.page.evaluate(
            "([text, n]) => { chat.ask(text, n); return chat.answers.length - 1; }",
            [text, tokens],
        )
        return index

    async def tokens_at_least(self, answer: int, n: int) -> None:
        await self.wait(
            "([a, n]) => chat.answers[a] && chat.answers[a].indices.length >= n",
            [answer, n],
            ANSWER_MS,
        )

    async def done(self, answer: int) -> dict[str, Any]:
        await self.wait("a => chat.answers[a] && chat.answers[a].done !== null", answer, ANSWER_MS)
        state = await self.seen()
        return dict(state["answers"][answer], shown=state["shown"][answer])


def summary(state: dict[str, Any]) -> str:
    """One line per event, then the hellos and each answer's count: what the page saw."""
    lines = [f"page {state['key']}: status {state['status']!r}"]
    for e in state["events"]:
        detail = json.dumps(e.get("detail")) if e.get("detail") else ""
        lines.append(f"  {e['at']:>7} ms  {e['type']} {detail}")
    lines.append(f"  hellos: {state['hellos']}")
    for a in state["answers"]:
        lines.append(
            f"  answer session {a['session']} turn {a['turn']}: {len(a['indices'])} tokens,"
            f" done {a['done']}"
        )
    if state["errors"]:
        lines.append(f"  errors: {state['errors']}")
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def chat_page(site: str, ws_url: str, key: str, **params: Any) -> AsyncIterator[Chat]:
    """The demo page on ``ws_url`` with session ``key`` (``params``: its other query
    parameters), open (its first ``hello`` in). Prints what the page saw when done, and the
    page's script errors on a failure."""
    query = urlencode({"session": key, "ws": ws_url, **params})
    async with browser() as b:
        page = await b.new_page()
        log = PageLog()
        log.attach(page)
        chat = Chat(page, log)
        await page.goto(f"{site}/{PAGE}?{query}")
        failed = False
        try:
            await chat.wait("() => window.chat && chat.hellos.length === 1")
            yield chat
        except BaseException:
            failed = True
            raise
        finally:
            with contextlib.suppress(Exception):
                print(summary(await chat.seen()))
            if failed or log.errors:
                print(f"page errors: {log.errors}\nconsole errors: {log.console}")
            await page.close()


def assert_whole(answer: dict[str, Any], session: str, tokens: int) -> None:
    """Every token once, in order, and shown so on the page (texts are the worker's, a pure
    function of the session, turn and index)."""
    assert answer["indices"] == list(range(tokens)), answer["indices"]
    assert answer["done"] == tokens, answer
    expected = [token_text(session, answer["turn"], i) for i in range(tokens)]
    assert answer["texts"] == expected
    assert answer["shown"] == " ".join(expected)


def event_types(state: dict[str, Any]) -> list[str]:
    """The events the page got, in order, as its event list shows them too."""
    types = [e["type"] for e in state["events"]]
    assert state["listed"] == types, state["listed"]
    return types


def of_type(state: dict[str, Any], *types: str) -> list[dict[str, Any]]:
    return [e for e in state["events"] if e["type"] in types]


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rst", "silent"])
async def test_an_answer_cut_mid_way_arrives_whole(how: str, quickstart: Wslb, site: str) -> None:
    # The silent drop is found by the page's idle timer, set short; a reset needs none.
    idle = {"idle": IDLE_MS} if how == "silent" else {}
    async with (
        cut_relay(quickstart.port) as relay,
        chat_page(site, f"ws://127.0.0.1:{relay.port}/chat", f"page-{how}", **idle) as chat,
    ):
        resumes = metric(quickstart, "wslb_resumes_total", result="resumed")
        a = await chat.ask(TOKENS)
        await chat.tokens_at_least(a, CUT_AFTER)
        cut_at = await chat.page.evaluate("performance.now()")
        assert relay.cut(how, down=DOWN_S) == 1
        answer = await chat.done(a)
        state = await chat.seen()
        hello = state["hellos"][0]
        assert_whole(answer, hello["session"], TOKENS)
        assert len(state["hellos"]) == 1, state["hellos"]  # the same session: no new hello
        types = event_types(state)
        assert types[0] == "open" and "reconnecting" in types, types
        assert not of_type(state, "gone", "giveup", "close"), types
        resumed = of_type(state, "resumed")
        assert len(resumed) == 1, types
        # Resumed from the page's own count: the hello and the tokens it had shown.
        assert resumed[0]["detail"]["from"] >= 1 + CUT_AFTER, resumed
        assert types.index("reconnecting") < types.index("resumed")
        first = of_type(state, "reconnecting")[0]
        if how == "rst":  # the reset closed the page's socket (1006): resume at once
            assert first["detail"]["why"] == "lost", first
        else:  # nothing closed: the page's idle timer found it
            assert first["detail"]["why"] == "idle", first
            assert first["at"] - cut_at >= IDLE_MS - 100, (first, cut_at)
        assert metric(quickstart, "wslb_resumes_total", result="resumed") == resumes + 1
        # The session goes on: the next turn on the same session, the same worker.
        b = await chat.ask(5, "and then?")
        nxt = await chat.done(b)
        assert_whole(nxt, hello["session"], 5)
        assert nxt["turn"] == answer["turn"] + 1


async def test_the_browser_back_online_resumes_at_once(quickstart: Wslb, site: str) -> None:
    """A dead Wi-Fi: the browser goes offline and the packets stop, nothing closes. Back
    online, the page resumes at once (the window's ``online``), not after its idle timeout."""
    async with (
        cut_relay(quickstart.port) as relay,
        chat_page(site, f"ws://127.0.0.1:{relay.port}/chat", "page-offline") as chat,
    ):
        a = await chat.ask(TOKENS)
        await chat.tokens_at_least(a, CUT_AFTER)
        await chat.page.context.set_offline(True)
        assert relay.cut("silent") == 1
        await chat.wait("() => chat.events.some(e => e.type === 'offline')")
        back_at = await chat.page.evaluate("performance.now()")
        await chat.page.context.set_offline(False)
        answer = await chat.done(a)
        state = await chat.seen()
        assert_whole(answer, state["hellos"][0]["session"], TOKENS)
        types = event_types(state)
        # (the library hears ``online`` before the page's own listener logs it)
        assert types[:2] == ["open", "offline"] and types[4:] == ["resumed"], types
        assert sorted(types[2:4]) == ["online", "reconnecting"], types
        probe = of_type(state, "reconnecting")[0]
        assert probe["detail"]["why"] == "online", probe
        # At once: well before the default idle timeout (30 s) could have found it.
        assert probe["at"] - back_at < 1000, (probe, back_at)


@pytest.mark.parametrize("page_grace", ["longer", "same"])
async def test_a_cut_longer_than_grace_starts_a_new_session(
    page_grace: str, tmp_path: Path, site: str
) -> None:
    """``longer``: the page keeps trying past the pool's grace, and the first attempt that
    reaches wslb learns the session is gone (``gone``); ``same``: the page's grace is the
    pool's, it gives up (``giveup``) while the network is still down, and the user's "Start a
    new session" does. Either way the new session works."""
    require_browser()
    config = yaml.safe_load(BALANCER_YAML.read_text())
    config["pools"][0]["resume"]["grace"] = f"{SHORT_GRACE_S}s"
    path = tmp_path / "balancer.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    lb = balancer_yaml(tmp_path, "short-grace", path)
    grace_ms = SHORT_GRACE_S * 1000 * (4 if page_grace == "longer" else 1)
    try:
        async with (
            cut_relay(lb.port) as relay,
            chat_page(
                site, f"ws://127.0.0.1:{relay.port}/chat", f"grace-{page_grace}", grace=grace_ms
            ) as chat,
        ):
            a = await chat.ask(TOKENS)
            await chat.tokens_at_least(a, CUT_AFTER)
            # Down longer than the pool's grace: wslb ends the session before the page is back.
            assert relay.cut("rst", down=SHORT_GRACE_S + 2) == 1
            if page_grace == "longer":
                await chat.wait(
                    "() => chat.events.some(e => e.type === 'gone')", timeout_ms=ANSWER_MS
                )
            else:
                await chat.wait(
                    "() => chat.events.some(e => e.type === 'giveup')", timeout_ms=ANSWER_MS
                )
                # The network back, the user starts a new session.
                loop = asyncio.get_running_loop()
                await asyncio.sleep(max(0.0, relay.down_until - loop.time()))
                await chat.page.click("#again")
            await chat.wait("() => chat.hellos.length === 2", timeout_ms=ANSWER_MS)
            state = await chat.seen()
            types = event_types(state)
            first = state["answers"][a]
            assert first["done"] is None and len(first["indices"]) < TOKENS, first
            if page_grace == "longer":
                gone = of_type(state, "gone")[0]
                assert gone["detail"]["code"] == 4404, gone
                assert gone["detail"]["reason"]["resume"] in ("unknown", "closed"), gone
                assert "giveup" not in types, types
                assert metric(lb, "wslb_resumes_total", result="unknown") == 1
            else:
                giveup = of_type(state, "giveup")[0]
                assert giveup["detail"]["why"] == "error", giveup  # tries reset by the relay
                assert "gone" not in types, types
            assert types.count("open") == 2, types  # the new session's open
            assert "resumed" not in types, types
            b = await chat.ask(20, "again, please")
            answer = await chat.done(b)
            assert_whole(answer, state["hellos"][1]["session"], 20)
    finally:
        lb.stop()


@contextlib.contextmanager
def tier_of_two(tmp: Path) -> Iterator[Tier]:
    """Two wslb instances over etcd behind HAProxy round robin, two reference workers; all
    stopped however the start or the test ends (an instance's log printed on a failure)."""
    ws: list[Worker] = []
    tier: Tier | None = None
    try:
        ws = workers(2, ("--tokens-per-s", "50"))
        tier = Tier(tmp, [{"id": w.id, "url": w.url} for w in ws], instances=2)
        tier.start()
        yield tier
    except BaseException:
        for lb in tier.lbs if tier is not None else []:
            print(f"--- {lb.name}\n{lb.log_tail()}")
        raise
    finally:
        if tier is not None:
            tier.stop()
        for w in ws:
            w.kill()


async def test_a_reconnect_through_round_robin_resumes_at_the_other_instance(
    tmp_path: Path, site: str
) -> None:
    require_browser()
    with tier_of_two(tmp_path) as tier:
        async with (
            cut_relay(tier.port) as relay,
            chat_page(site, f"ws://127.0.0.1:{relay.port}/chat", "page-tier") as chat,
        ):
            held = tier.holding()
            assert sorted(held) == [0, 1], held
            holder = held.index(1)
            a = await chat.ask(TOKENS)
            await chat.tokens_at_least(a, CUT_AFTER)
            assert relay.cut("rst", down=DOWN_S) == 1
            answer = await chat.done(a)
            state = await chat.seen()
            assert_whole(answer, state["hellos"][0]["session"], TOKENS)
            assert len(state["hellos"]) == 1
            types = event_types(state)
            assert len(of_type(state, "resumed")) == 1 and "gone" not in types, types
            # HAProxy sent the reconnect to the other instance, which carried it to the holder.
            other = tier.lbs[1 - holder]
            assert metric(other, "wslb_resumes_total", result="carried") == 1
            assert metric(tier.lbs[holder], "wslb_resumes_total", result="resumed") == 1
