"""One background loop per backend (scrapes, probes): started once, cancelled together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

__all__ = ["PerBackend"]


class PerBackend:
    """Keeps at most one named task per backend id."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def spawn(self, backend_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` for this backend unless one already runs (then ``coro`` is dropped)."""
        if backend_id in self._tasks:
            coro.close()
            return
        self._tasks[backend_id] = asyncio.get_running_loop().create_task(
            coro, name=f"{self._kind}-{backend_id}"
        )

    async def stop(self, backend_id: str | None = None) -> None:
        """Cancel one backend's task, or all of them, and wait for them to end."""
        ids = [backend_id] if backend_id is not None else list(self._tasks)
        tasks = [t for i in ids if (t := self._tasks.pop(i, None)) is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
