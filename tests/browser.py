"""Headless Chromium for the dashboard's tests and screenshots: Debian's package, driven by
Playwright's Python API.

Playwright's own browser download is not reachable from where these run, so it drives the
system's ``/usr/bin/chromium``, installed here with apt-get when missing and proven to run
(``tests/installs.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests import installs

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT = {"width": 1680, "height": 1050}


def ensure_chromium() -> str | None:
    """``None`` once ``/usr/bin/chromium`` runs (``--version``), installed with apt if missing;
    else why this machine cannot install it. An install that was tried and failed raises
    ``InstallError`` (a test error naming the step, not a skip)."""
    try:
        installs.apt_binary("chromium", str(CHROMIUM))
    except installs.CannotInstall as e:
        return str(e)
    return None


def require_browser() -> None:
    """Skip the calling test when Playwright or Chromium cannot be had here, saying which."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright not installed (pip install -e '.[test]')")
    reason = ensure_chromium()
    if reason is not None:
        pytest.skip(reason)


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Any]:
    """A headless Chromium (a Playwright ``Browser``); ``require_browser`` first."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield b
        finally:
            await b.close()


class PageLog:
    """What a page did that a test must see: dialogs (dismissed at once), uncaught script
    errors, console errors (a Content-Security-Policy violation is one)."""

    def __init__(self) -> None:
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.console: list[str] = []

    def attach(self, page: Any) -> None:
        async def dialog(d: Any) -> None:
            self.dialogs.append(f"{d.type}: {d.message}")
            await d.dismiss()

        page.on("dialog", dialog)
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("console", self._console)

    def _console(self, msg: Any) -> None:
        if msg.type == "error":
            self.console.append(msg.text)

    def csp_violations(self) -> list[str]:
        return [m for m in self.console if "Content Security Policy" in m]
