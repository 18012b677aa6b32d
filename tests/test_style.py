"""The house style is part of the test command: ruff and mypy --strict must pass."""

from __future__ import annotations

import ast
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


def _is_sleep(stmt: ast.stmt) -> bool:
    """``await asyncio.sleep(...)`` or ``time.sleep(...)`` as a statement of its own."""
    if not isinstance(stmt, ast.Expr):
        return False
    call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "sleep"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id in ("asyncio", "time")
    )


def test_no_state_is_asserted_after_a_fixed_sleep() -> None:
    """A test waits for the condition it means, with a deadline (``tests/waits.py``): a sleep
    followed by an assert (at once, or after one assignment) asserts a state at a fixed time.
    The rare negative check ("nothing happens within T") says so in a comment on the line above
    the sleep or on its own line: ``# Negative check: ...``."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            for field in ("body", "orelse", "finalbody"):
                body = getattr(node, field, None)
                if not isinstance(body, list):
                    continue
                for i, stmt in enumerate(body):
                    after = body[i + 1 : i + 3]
                    if not _is_sleep(stmt) or not after:
                        continue
                    asserts = isinstance(after[0], ast.Assert) or (
                        len(after) == 2
                        and isinstance(after[0], ast.Assign | ast.AnnAssign)
                        and isinstance(after[1], ast.Assert)
                    )
                    said = " ".join(lines[stmt.lineno - 2 : stmt.end_lineno]).lower()
                    if asserts and "negative check" not in said:
                        found.append(f"{path.relative_to(ROOT)}:{stmt.lineno}")
    assert not found, "an assert after a fixed sleep (wait for the condition instead): " + str(
        found
    )
