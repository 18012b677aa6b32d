"""Shared fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.wsraw import RawClient


@pytest.fixture(autouse=True)
async def _close_raw_clients() -> AsyncIterator[None]:
    yield
    await RawClient.close_all()
