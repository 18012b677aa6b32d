"""The house style is part of the test command: ruff and mypy --strict must pass."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.procs import ROOT

PATHS = ["balancer", "backends", "wslb", "tests", "examples", "bench"]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_check_and_format() -> None:
    paths = [p for p in PATHS if (ROOT / p).exists()]
    lint = run("ruff", "check", *paths)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run("ruff", "format", "--check", *paths)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_strict() -> None:
    result = run(sys.executable, "-m", "mypy", "balancer", "backends", "wslb")
    assert result.returncode == 0, result.stdout + result.stderr
