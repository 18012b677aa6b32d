"""The operator dashboard (``GET /ui``) in a real browser: headless Chromium from Debian, driven
by Playwright, against wslb in front of reference workers.

What an operator relies on: the page reveals nothing without the token and says so when it is
wrong; its tables agree with ``GET /backends`` and ``GET /sessions`` and follow changes within
2 s; Drain moves live sessions (the pushed event feed shows each migration); client-chosen
strings are text, never markup; ``workers: N`` shows the supervisor's merged view.

``WSLB_SCREENSHOTS=1`` also rewrites ``docs/dashboard-drain.png`` (the docs' screenshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from balancer.aio.ui import HEADERS
from balancer.handshake import quote_key
from tests.browser import VIEWPORT, PageLog, browser, require_browser
from tests.procs import ROOT, Worker, Wslb, free_port, pool_config

TOKEN = "dash-s3cret"
FOLLOW_S = 2.0  # the promise: the page follows a change within 2 s
XSS_KEY = "<img src=x onerror=alert(1)>"
XSS_KEY2 = '"><svg onload=alert(2)>'
# What the session key rule (balancer/handshake.py) lets through that a page or a URL could still
# get wrong: markup is refused at the handshake.
ODD_KEY = "a:b@c~d.e"
ODD_KEY2 = ".."

# The backends table as the page shows it: each row's cells by their data-col.
_READ_BACKENDS = """() => Object.fromEntries([...document.querySelectorAll('#backends tbody tr')]
  .map(tr => [tr.dataset.backend, {
    state: tr.querySelector('.state').textContent,
    sessions: tr.querySelector('[data-col=sessions]').textContent,
    held: tr.querySelector('[data-col=held]').textContent,
    drain: tr.querySelector('[data-col=drain]').textContent,
    cluster: tr.querySelector('[data-col=cluster]').textContent,
    migrations: tr.querySelector('[data-col=migrations]').textContent,
  }]))"""
_READ_SESSIONS = """() => [...document.querySelectorAll('#sessions tbody tr')].map(tr => ({
    key: tr.querySelector('[data-col=key]').textContent,
    backend: tr.querySelector('[data-col=backend]').textContent,
    process: tr.querySelector('[data-col=process]').textContent,
  }))"""


# -- processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    ws = [Worker(f"node-{c}", ["--tokens-per-s", "50"]).start() for c in "abc"]
    yield ws
    for w in ws:
        w.stop()


def start_lb(
    workers: list[Worker],
    tmp: Path,
    pool: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> Wslb:
    """wslb in front of ``workers``; ``pool``: more pool settings, ``top``: top-level ones."""
    backends = [{"id": w.id, "url": w.url} for w in workers]
    cfg = pool_config(backends, hash_balance_factor=1.5, **(pool or {}))
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    cfg.update(top or {})
    lb = Wslb(cfg, tmp, token=TOKEN).start()
    lb.wait_ready()
    return lb


@pytest.fixture
def lb(workers: list[Worker], tmp_path: Path) -> Iterator[Wslb]:
    proc = start_lb(workers, tmp_path)
    yield proc
    proc.stop()


def has_event_stream(lb: Wslb) -> bool:
    """Whether this wslb serves ``GET /events/stream`` (the feed's source)."""
    req = urllib.request.Request(f"http://127.0.0.1:{lb.admin_port}/events/stream", headers=lb.auth)
    try:
        with urllib.request.urlopen(req, timeout=5):
            return True
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return False
        raise


async def chat(lb: Wslb, key: str) -> ClientConnection:
    ws = await connect(f"{lb.url}/ws?session={quote(key, safe='')}")
    hello = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert hello["type"] == "hello", hello
    return ws


async def answer(ws: ClientConnection, tokens: int) -> str:
    """Ask for ``tokens`` tokens and read the whole answer: the worker its ``done`` names.
    A close (a session the drain failed to move) fails the test."""
    await ws.send(json.dumps({"type": "prompt", "text": "hi", "max_tokens": tokens}))
    i = 0
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 20))
        if msg["type"] == "done":
            assert msg["tokens"] == tokens == i, msg
            return str(msg["worker"])
        assert msg["type"] == "token" and msg["i"] == i, msg
        i += 1


async def read_until_closed(ws: ClientConnection) -> None:
    """Read and drop, so that answers flow and a close from wslb completes at once."""
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


# -- the page -------------------------------------------------------------------------------


@dataclass
class Dash:
    """One browser tab on the dashboard, and what it did."""

    page: Any
    lb: Wslb
    log: PageLog
    urls: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.lb.admin_port}"

    async def open(self) -> None:
        await self.page.goto(f"{self.base}/ui")

    async def login(self, token: str = TOKEN) -> None:
        await self.page.get_by_label("Admin token").fill(token)
        await self.page.get_by_role("button", name="Sign in").click()

    async def backends(self) -> dict[str, dict[str, str]]:
        return dict(await self.page.evaluate(_READ_BACKENDS))

    async def sessions(self) -> list[dict[str, str]]:
        return list(await self.page.evaluate(_READ_SESSIONS))

    async def feed(self) -> list[str]:
        return list(await self.page.locator("#feed li").all_inner_texts())

    def row(self, bid: str) -> Any:
        return self.page.locator(f'#backends tbody tr[data-backend="{bid}"]')

    def check_clean(self) -> None:
        """Nothing ran that should not: no dialog, no script error, no CSP violation, no
        request elsewhere, no token in any URL."""
        assert not self.log.dialogs, self.log.dialogs
        assert not self.log.errors, self.log.errors
        assert not self.log.csp_violations(), self.log.csp_violations()
        assert self.urls and all(u.startswith(self.base + "/") for u in self.urls), self.urls
        assert not [u for u in self.urls if TOKEN in u], self.urls


@contextlib.asynccontextmanager
async def dashboard(lb: Wslb, viewport: dict[str, int] | None = None) -> AsyncIterator[Dash]:
    async with browser() as b:
        context = await b.new_context(viewport=viewport or VIEWPORT)
        page = await context.new_page()
        dash = Dash(page, lb, PageLog())
        dash.log.attach(page)
        page.on("request", lambda r: dash.urls.append(r.url))
        await dash.open()
        yield dash
        dash.check_clean()


async def eventually(
    probe: Callable[[], Awaitable[tuple[bool, Any]]], timeout: float, what: str
) -> Any:
    """Poll ``probe`` (``(done, detail)``) until done; fail after ``timeout`` s with the detail."""
    deadline = time.monotonic() + timeout
    while True:
        done, detail = await probe()
        if done:
            return detail
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g}s: {detail}")
        await asyncio.sleep(0.05)


def api_view(lb: Wslb) -> dict[str, tuple[str, str]]:
    return {b["id"]: (b["state"], str(b["sessions"])) for b in lb.admin("/backends")}


async def table_matches_api(dash: Dash) -> tuple[bool, Any]:
    api = api_view(dash.lb)
    page = {bid: (r["state"], r["sessions"]) for bid, r in (await dash.backends()).items()}
    return page == api, {"page": page, "api": api}


# -- tests ----------------------------------------------------------------------------------


def test_the_page_is_served_without_the_token_with_its_headers(lb: Wslb) -> None:
    """No token to load it (it holds no data); the API itself still needs one."""
    base = f"http://127.0.0.1:{lb.admin_port}"
    types = {"/ui": "text/html", "/ui/app.js": "text/javascript", "/ui/style.css": "text/css"}
    for path, ctype in types.items():
        with urllib.request.urlopen(base + path, timeout=5) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith(ctype), r.headers["Content-Type"]
            for name, value in HEADERS.items():
                assert r.headers[name] == value, (path, name)
            body = r.read().decode()
        assert "node-a" not in body and TOKEN not in body  # no data in the page itself
    assert "default-src 'none'" in HEADERS["Content-Security-Policy"]
    with urllib.request.urlopen(base + "/ui/", timeout=5) as r:
        assert r.url == base + "/ui"  # /ui/ redirects to the one address
    assert lb.admin("/openapi.json")["paths"]["/ui"]["get"]["security"] == []
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/backends", timeout=5)
    assert err.value.code == 401
    err.value.close()


async def test_a_wrong_token_shows_an_error_and_no_data(lb: Wslb) -> None:
    require_browser()
    async with dashboard(lb) as dash:
        page = dash.page
        await dash.login("not-the-token")
        error = page.get_by_role("alert")
        await error.wait_for(state="visible", timeout=5000)
        assert "401" in await error.inner_text()
        assert "wrong admin token" in (await error.inner_text()).lower()
        assert await page.locator("#data").is_hidden()
        assert await page.locator("#backends tbody tr, #sessions tbody tr, #feed li").count() == 0
        assert await page.evaluate("() => sessionStorage.length") == 0
        # The right one then works, and hides the error.
        await dash.login()
        await eventually(lambda: table_matches_api(dash), 5, "backends after a good token")
        assert await error.is_hidden()


async def test_login_and_the_backends_table_matches_the_api(lb: Wslb) -> None:
    require_browser()
    async with dashboard(lb) as dash:
        page = dash.page
        assert await page.locator("#backends tbody tr").count() == 0  # nothing before login
        await dash.login()
        await eventually(lambda: table_matches_api(dash), 5, "backends table == GET /backends")
        rows = await dash.backends()
        assert sorted(rows) == ["node-a", "node-b", "node-c"]
        assert {r["state"] for r in rows.values()} == {"active"}
        # Accessible names: one row per backend in a real table; its actions are buttons.
        assert await page.get_by_role("table").count() == 2
        row = dash.row("node-a")
        assert await row.get_by_role("button", name="Drain", exact=True).is_enabled()
        assert await row.get_by_role("button", name="Undrain", exact=True).is_disabled()
        # The token stays in session storage; a reload signs in again without typing it.
        assert await page.evaluate("() => Object.values(sessionStorage)") == [TOKEN]
        assert TOKEN not in page.url
        await page.reload()
        await eventually(lambda: table_matches_api(dash), 5, "backends after a reload")
        assert await page.get_by_label("Admin token").is_hidden()
        await page.get_by_role("button", name="Sign out").click()
        assert await page.evaluate("() => sessionStorage.length") == 0
        assert await page.locator("#backends tbody tr").count() == 0


def test_every_backends_column_is_described_in_the_docs() -> None:
    """docs/dashboard.md's table of the backends' columns names each column the page has."""
    html = (ROOT / "balancer" / "ui" / "index.html").read_text()
    table = html.split('<table id="backends">', 1)[1].split("</thead>", 1)[0]
    columns = [re.sub(r"<[^>]+>", "", th).strip() for th in re.findall(r"<th[^>]*>.*?</th>", table)]
    doc = (ROOT / "docs" / "dashboard.md").read_text()
    section = doc.split("**Backends**", 1)[1].split("**Sessions**", 1)[0]
    described = " | ".join(
        line.split("|")[1] for line in section.splitlines() if line.startswith("| ")
    )
    missing = [c for c in columns if c not in described]
    assert len(columns) > 10 and not missing, missing


async def test_at_1280_px_drain_is_on_screen_and_a_fresh_start_counts_no_errors(
    tmp_path: Path,
) -> None:
    """The quick start's system (wslb spawning its workers) on a 1280 x 800 screen: right after
    the start no backend shows an error (a worker still binding its port is starting, not
    failing), every column of the backends table fits, and every row's Drain button is inside
    the window and answers a click. The screenshot stays in the test's directory
    (dash1280.png)."""
    require_browser()
    ports = [free_port() for _ in range(3)]
    backends = [
        {"id": f"w{i}", "url": f"ws://127.0.0.1:{p}/ws", "spawn": "reference"}
        for i, p in enumerate(ports, 1)
    ]
    cfg = pool_config(backends, health={"interval": "2s", "timeout": "1s", "path": "/healthz"})
    cfg["pools"][0]["weights"] = {"scrape_interval": "1s", "metrics": "reference"}
    cfg["timeouts"] = {"close": "1s", "shutdown_grace": "0.1s"}
    lb = Wslb(cfg, tmp_path, token=TOKEN).start()
    try:
        lb.wait_ready()
        width, height = 1280, 800
        async with dashboard(lb, {"width": width, "height": height}) as dash:
            await dash.login()
            await eventually(lambda: table_matches_api(dash), 10, "backends table")
            # Past the first health interval: every backend probed again since (and scraped a
            # few times, every second), none of it failed.
            first = {b["id"]: b["health"]["last_check"] or 0 for b in lb.admin("/backends")}

            async def probed_again() -> tuple[bool, Any]:
                now = await asyncio.to_thread(lb.admin, "/backends")
                again = [(b["health"]["last_check"] or 0) > first[b["id"]] for b in now]
                return all(again), now

            await eventually(probed_again, 15, "a second round of health checks")
            for b in lb.admin("/backends"):
                counters = b["counters"]
                assert counters["health_check_failures"] == 0, b
                assert counters["connect_failures"] == 0, b
            errors = await dash.page.eval_on_selector_all(
                "#backends tbody td[data-col=errors]", "cells => cells.map(c => c.textContent)"
            )
            assert errors == ["0", "0", "0"], errors
            for bid in ("w1", "w2", "w3"):
                button = dash.row(bid).get_by_role("button", name="Drain", exact=True)
                box = await button.bounding_box()
                assert box is not None, bid
                assert box["x"] >= 0 and box["x"] + box["width"] <= width, (bid, box)
                assert box["y"] >= 0 and box["y"] + box["height"] <= height, (bid, box)
                # Nothing covers it: a click there lands on the button.
                hit = await dash.page.evaluate(
                    "([x, y]) => document.elementFromPoint(x, y)?.textContent",
                    [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2],
                )
                assert hit == "Drain", (bid, hit)
            page_width = await dash.page.evaluate("() => document.documentElement.scrollWidth")
            assert page_width <= width, page_width  # the table scrolls in its card, not the page
            # At 1280 px every column fits (narrower, the rest scroll under the pinned Actions).
            card = await dash.page.evaluate(
                "() => { const s = document.querySelector('#backends').parentElement;"
                " return [s.scrollWidth, s.clientWidth]; }"
            )
            assert card[0] <= card[1], card
            await dash.page.screenshot(path=str(tmp_path / "dash1280.png"))
            await dash.row("w2").get_by_role("button", name="Drain", exact=True).click()

            async def drained() -> tuple[bool, Any]:
                rows = await dash.backends()
                return rows["w2"]["state"] == "drained", rows

            await eventually(drained, 10, "w2 drained from the 1280 px page")
    finally:
        lb.stop()


async def test_session_counts_follow_within_2s(lb: Wslb) -> None:
    require_browser()
    async with dashboard(lb) as dash:
        await dash.login()
        await eventually(lambda: table_matches_api(dash), 5, "first render")
        keys = [f"live-{i}" for i in range(7)]
        conns = [await chat(lb, k) for k in keys]
        where = {s["id"]: s["backend"] for s in lb.admin("/sessions")}
        assert set(where) == set(keys)
        await eventually(lambda: table_matches_api(dash), FOLLOW_S, "counts after opening")

        async def sessions_listed() -> tuple[bool, Any]:
            got = {s["key"]: s["backend"] for s in await dash.sessions()}
            return got == where, got

        await eventually(sessions_listed, FOLLOW_S, "sessions table")
        # The filter by backend shows that backend's sessions only.
        bid = max(set(where.values()), key=list(where.values()).count)
        await dash.page.get_by_label("Backend", exact=True).select_option(bid)
        shown = {s["key"] for s in await dash.sessions()}
        assert shown == {k for k, b in where.items() if b == bid}
        await dash.page.get_by_label("Backend", exact=True).select_option("")
        assert len(await dash.sessions()) == len(keys)

        for ws in conns[:4]:
            await ws.close()
        await eventually(lambda: table_matches_api(dash), FOLLOW_S, "counts after 4 closes")
        for ws in conns[4:]:
            await ws.close()

        async def all_zero() -> tuple[bool, Any]:
            done, detail = await table_matches_api(dash)
            zero = all(s == "0" for _, s in detail["page"].values())
            return done and zero and not await dash.sessions(), detail

        await eventually(all_zero, FOLLOW_S, "no session left")


async def test_drain_moves_live_sessions_and_the_feed_shows_each(lb: Wslb, tmp_path: Path) -> None:
    require_browser()
    feed = has_event_stream(lb)
    async with dashboard(lb) as dash:
        await dash.login()
        await eventually(lambda: table_matches_api(dash), 5, "first render")
        keys = [f"drain-{i}" for i in range(9)]
        conns = [await chat(lb, k) for k in keys]
        answers = [asyncio.ensure_future(answer(ws, 300)) for ws in conns]  # ~6 s each

        async def streaming() -> tuple[bool, Any]:
            live = await asyncio.to_thread(lb.admin, "/sessions")
            tokens = [s["messages"]["worker_to_client"] > 1 for s in live]  # the hello, a token
            return len(live) == len(keys) and all(tokens), live

        live = await eventually(streaming, 10, "every answer streaming")
        where = {s["id"]: s["backend"] for s in live}
        victim = max(set(where.values()), key=list(where.values()).count)
        moving = sorted(k for k, b in where.items() if b == victim)
        await eventually(lambda: table_matches_api(dash), FOLLOW_S, "sessions shown")

        await dash.row(victim).get_by_role("button", name="Drain", exact=True).click()

        async def drained() -> tuple[bool, Any]:
            row = (await dash.backends())[victim]
            return row["state"] == "drained" and row["sessions"] == "0", row

        row = await eventually(drained, 10, f"{victim} drained")
        assert f"{len(moving)} migrated" in row["drain"], row
        assert row["migrations"] == str(len(moving)), row  # the counters column
        shot = tmp_path / "drain.png"
        await dash.page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # Every session finished its answer elsewhere, with no close and no token lost.
        for ws, done in zip(
            conns, await asyncio.wait_for(asyncio.gather(*answers), 30), strict=True
        ):
            assert done != victim
            await ws.close()

        # Undrain from the page: active again.
        await dash.row(victim).get_by_role("button", name="Undrain", exact=True).click()

        async def active() -> tuple[bool, Any]:
            row = (await dash.backends())[victim]
            return row["state"] == "active", row

        await eventually(active, FOLLOW_S + 1, f"{victim} active again")

        if not feed:
            pytest.skip("the feed part waits for GET /events/stream (it answers 404 here)")

        async def feed_shows_moves() -> tuple[bool, Any]:
            items = await dash.feed()
            moved = f"moved {victim}"
            missing = [k for k in moving if not any(f"session {k} {moved}" in i for i in items)]
            return not missing, {"missing": missing, "feed": items}

        await eventually(feed_shows_moves, FOLLOW_S, "a migration item per session")
        items = await dash.feed()
        text = "\n".join(items)
        assert f"drain of {victim} started" in text and f"{victim} drained" in text, text
        assert f"{victim} undrained" in text, text
        assert items[0].split()[1].lower() in ("undrain", "state"), items[:3]  # newest first


async def test_client_chosen_strings_are_text(lb: Wslb) -> None:
    """A session key that is markup never gets in (400 at the handshake); the oddest keys the
    rule allows show as themselves, in the table and in the feed, and run nothing: no dialog,
    no element made from them."""
    require_browser()
    for markup in (XSS_KEY, XSS_KEY2):
        with pytest.raises(InvalidStatus) as exc:
            await chat(lb, markup)
        assert exc.value.response.status_code == 400
    feed = has_event_stream(lb)
    async with dashboard(lb) as dash:
        await dash.login()
        conns = [await chat(lb, k) for k in (ODD_KEY, ODD_KEY2)]
        assert {s["id"] for s in lb.admin("/sessions")} == {ODD_KEY, ODD_KEY2}

        async def listed() -> tuple[bool, Any]:
            keys = {s["key"] for s in await dash.sessions()}
            return keys == {ODD_KEY, ODD_KEY2}, keys

        await eventually(listed, FOLLOW_S, "the keys as text")
        th = dash.page.locator("#sessions tbody th", has_text="a:b@c")
        assert await th.inner_text() == ODD_KEY
        # Move them, so that the keys are in the feed's items too.
        for key in (ODD_KEY, ODD_KEY2):
            bid = lb.admin(f"/sessions/{quote_key(key)}")["backend"]
            lb.admin_post(f"/sessions/{quote_key(key)}/migrate", {})
            if feed:

                async def in_feed(key: str = key, bid: str = bid) -> tuple[bool, Any]:
                    items = await dash.feed()
                    return any(f"session {key} moved {bid}" in i for i in items), items

                await eventually(in_feed, FOLLOW_S, "the key in the feed")
        # Negative check: time for a handler, had any been made, to fire.
        await asyncio.sleep(0.5)
        for where in ("#sessions", "#feed", "#backends"):
            assert await dash.page.locator(f"{where} img, {where} script").count() == 0
        assert await dash.page.locator("#sessions svg, #feed svg").count() == 0
        assert not dash.log.dialogs
        for ws in conns:
            await ws.close()


async def test_workers_2_shows_the_merged_view(workers: list[Worker], tmp_path: Path) -> None:
    require_browser()
    lb = start_lb(workers, tmp_path, top={"workers": 2})
    try:
        conns: list[ClientConnection] = []

        # The kernel's SO_REUSEPORT hash picks the serving process and the ring the backend;
        # draw until some backend holds sessions of both processes (the drain's victim).
        def both() -> list[str]:
            held: dict[str, set[int]] = {}
            for s in lb.admin("/sessions"):
                held.setdefault(s["backend"], set()).add(s["process"])
            return [b for b, procs in held.items() if procs == {0, 1}]

        for attempt in range(20):
            conns += [await chat(lb, f"mp-{attempt}-{i}") for i in range(6)]
            if both():
                break
        sessions = lb.admin("/sessions")
        assert {s["process"] for s in sessions} == {0, 1}
        assert both(), sessions
        async with dashboard(lb) as dash:
            await dash.login()
            await eventually(lambda: table_matches_api(dash), 5, "merged backends")

            async def listed() -> tuple[bool, Any]:
                got = {(s["key"], s["backend"], s["process"]) for s in await dash.sessions()}
                want = {(s["id"], s["backend"], str(s["process"])) for s in lb.admin("/sessions")}
                return got == want, {"page": got, "api": want}

            await eventually(listed, FOLLOW_S, "every process's sessions")
            assert await dash.page.get_by_role("columnheader", name="Process").is_visible()

            # A drain from the page reaches both processes.
            live = {b["id"]: b["sessions"] for b in lb.admin("/backends")}
            victim = max(both(), key=lambda k: live[k])
            await dash.row(victim).get_by_role("button", name="Drain", exact=True).click()

            async def drained() -> tuple[bool, Any]:
                row = (await dash.backends())[victim]
                return row["state"] == "drained" and row["sessions"] == "0", row

            await eventually(drained, 10, f"{victim} drained in both processes")
            await eventually(lambda: table_matches_api(dash), FOLLOW_S, "after the drain")
            if has_event_stream(lb):

                async def moves() -> tuple[bool, Any]:
                    items = [i for i in await dash.feed() if f"moved {victim}" in i]
                    return len(items) >= live[victim], items

                items = await eventually(moves, FOLLOW_S, "each process's migrations in the feed")
                assert {"(process 0)", "(process 1)"} <= {i[i.rfind("(") :] for i in items}, items
        for ws in conns:
            with contextlib.suppress(ConnectionClosed):
                await ws.close()
    finally:
        lb.stop()


async def test_cluster_mode_shows_the_shared_drain_state(
    workers: list[Worker], tmp_path: Path
) -> None:
    """Two instances on one etcd: the page on one shows its own view, and a drain pressed
    there reads drained on every instance once the other has moved its sessions too."""
    require_browser()
    from tests.etcd import Etcd

    etcd = Etcd(tmp_path / "etcd").start()
    top = {"cluster": {"etcd": etcd.url, "prefix": "/wslb-dashboard/"}}
    lbs: list[Wslb] = []
    try:
        lbs += [start_lb(workers, tmp_path, top=top) for _ in range(2)]
        other = [await chat(lbs[1], f"cl-{i}") for i in range(6)]  # sessions elsewhere
        held = {s["backend"] for s in lbs[1].admin("/sessions")}
        victim = sorted(held)[0]
        async with dashboard(lbs[0]) as dash:
            await dash.login()
            await eventually(lambda: table_matches_api(dash), 5, "this instance's view")
            assert all(r["sessions"] == "0" for r in (await dash.backends()).values())
            await dash.row(victim).get_by_role("button", name="Drain", exact=True).click()

            async def everywhere() -> tuple[bool, Any]:
                row = (await dash.backends())[victim]
                return "drained on every instance (2)" in row["cluster"], row

            await eventually(everywhere, 10, "the shared drain state")
            assert lbs[1].admin(f"/backends/{victim}")["sessions"] == 0
            await dash.row(victim).get_by_role("button", name="Undrain", exact=True).click()

            async def active() -> tuple[bool, Any]:
                row = (await dash.backends())[victim]
                return row["state"] == "active" and not row["cluster"], row

            await eventually(active, 5, "undrained everywhere")
        for ws in other:
            await ws.close()
    finally:
        for lb in lbs:
            lb.stop()
        etcd.stop()


@pytest.mark.skipif(not os.environ.get("WSLB_SCREENSHOTS"), reason="WSLB_SCREENSHOTS unset")
async def test_screenshot_for_the_docs(tmp_path: Path) -> None:
    """``docs/dashboard-drain.png``: the page during a drain, the feed full of migrations.

    A worker without the handoff API drains slowly (its sessions end after their answer), so
    its progress shows; another, drained just before it, has moved its sessions."""
    require_browser()
    ws_ = [Worker(f"gpu-{i}", ["--tokens-per-s", "40"]).start() for i in range(3)]
    ws_.append(Worker("gpu-3", ["--tokens-per-s", "40", "--no-handoff"]).start())
    lb = start_lb(ws_, tmp_path, pool={"failover": {"enabled": True}})
    try:
        async with dashboard(lb) as dash:
            await dash.login()
            conns = []
            readers = []
            for i in range(28):  # a ramp, so the sparklines have a shape
                conns.append(await chat(lb, f"user-{i:02d}"))
                readers.append(asyncio.ensure_future(read_until_closed(conns[-1])))
                await conns[-1].send(
                    json.dumps({"type": "prompt", "text": "hi", "max_tokens": 620})
                )
                await asyncio.sleep(0.5)
            await dash.row("gpu-3").get_by_role("button", name="Drain", exact=True).click()
            await asyncio.sleep(0.3)
            await dash.row("gpu-1").get_by_role("button", name="Drain", exact=True).click()

            async def shown() -> tuple[bool, Any]:
                rows = await dash.backends()
                one, two = rows["gpu-1"], rows["gpu-3"]
                done = one["state"] == "drained" and two["state"] == "draining"
                return done and "closed" in two["drain"], rows

            await eventually(shown, 15, "one drained, one draining with sessions closed")
            await dash.page.screenshot(path=str(ROOT / "docs" / "dashboard-drain.png"))
            for ws in conns:
                with contextlib.suppress(ConnectionClosed):
                    await ws.close()
            await asyncio.gather(*readers)
    finally:
        lb.stop()
        for w in ws_:
            w.stop()


async def test_the_feed_shows_a_detach_and_its_resume(
    workers: list[Worker], tmp_path: Path
) -> None:
    """Client resume (docs/resume.md): a client whose TCP dies is shown detached, and its
    reconnect with the token and count resumed, with what was replayed."""
    require_browser()
    lb = start_lb(workers, tmp_path, pool={"resume": {"enabled": True, "grace": "10s"}})
    try:
        if not has_event_stream(lb):
            pytest.skip("the feed waits for GET /events/stream (it answers 404 here)")
        async with dashboard(lb) as dash:
            await dash.login()
            ws = await chat(lb, "blip")  # the hello: 1 message
            assert ws.response is not None
            token = ws.response.headers["X-WSLB-Resume-Token"]
            ws.transport.abort()  # an RST, no close frame

            async def shown(text: str) -> tuple[bool, Any]:
                items = await dash.feed()
                return any(text in i for i in items), items

            await eventually(lambda: shown("session blip: client lost"), FOLLOW_S, "detached")
            back = await connect(
                f"{lb.url}/ws?session=blip",
                additional_headers={"X-WSLB-Resume-Token": token, "X-WSLB-Resume-From": "1"},
            )
            item = "session blip resumed on"
            items = await eventually(lambda: shown(item), FOLLOW_S, "resumed")
            assert any(item in i and "from message 1" in i for i in items), items
            await back.close()
    finally:
        lb.stop()
