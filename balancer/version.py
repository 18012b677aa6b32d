"""What code is running: the installed package's version and when this process loaded it.

``STARTED`` is set when the module is first imported (early in every wslb process), so after a
restart it says when the code now serving was loaded (``GET /version``, ``wslb_build_info``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import time

STARTED = time.time()


def version() -> str:
    """The installed package's version (``0+unknown`` when run from a tree never installed)."""
    try:
        return importlib.metadata.version("wslb")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def started_iso() -> str:
    """``STARTED`` as ISO 8601 in UTC (``GET /version``; a restart's answer)."""
    return datetime.datetime.fromtimestamp(STARTED, datetime.UTC).isoformat()
