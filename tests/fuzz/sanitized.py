"""A pytest plugin (``-p tests.fuzz.sanitized``, loaded before any test module): with
``WSLB_SANITIZED`` set (tools/sanitize.sh sets it), ``balancer._scan`` and ``_offload``
are the sanitized builds in that directory, not the ones beside the sources.

``balancer``'s package path gets the scratch directory first, so ``from balancer import _offload``
finds its build there; the rest of the package still comes from the sources. It must happen
before anything imports a C module (balancer.frames imports _scan), hence a plugin, which pytest
loads before conftest.py and the test modules.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import balancer

MODULES = ("balancer._scan", "balancer._offload")


def sanitized_dir() -> Path | None:
    """The sanitized build's directory, when this run is one."""
    d = os.environ.get("WSLB_SANITIZED")
    return Path(d).resolve() if d else None


def check_sanitized() -> None:
    """Each C module imported is the sanitized build's (a no-op when this run is not one)."""
    d = sanitized_dir()
    if d is None:
        return
    for name in MODULES:
        module = importlib.import_module(name)
        origin = Path(module.__file__ or "").resolve()
        assert origin.parent == d / "balancer", f"{name} came from {origin}, not from {d}"


def _install() -> None:
    d = sanitized_dir()
    if d is None:
        return
    early = [m for m in MODULES if m in sys.modules]
    assert not early, f"imported before the sanitized builds could replace them: {early}"
    balancer.__path__.insert(0, str(d / "balancer"))
    check_sanitized()


_install()
