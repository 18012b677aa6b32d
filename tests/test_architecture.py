"""The shape of the code: no import circle, one composition root, asyncio only in ``aio/``.

The graph is read with ``ast`` from every module of ``balancer/`` and ``backends/``; every
import counts, function-local ones and ``if TYPE_CHECKING:`` ones included (a circle that is
broken only at run time is still a circle to a reader). docs/architecture.md states the rules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("balancer", "backends")
COMPOSITION_ROOT = "balancer.aio.app"
# The entry points: the console script (and python -m balancer) and a serving process's.
ENTRY_POINTS = {"balancer.cli", "balancer.aio.serving"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imported(path: Path, known: dict[str, Path], me: str) -> set[str]:
    """The project modules ``path`` imports anywhere in its body."""
    deps: set[str] = set()
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):
                deps.add(name)
    return deps


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imported(p, known, m) for m, p in known.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the path around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(g.get(m, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_the_checker_finds_circles() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    known = modules()
    assert "balancer.aio.session" in graph()["balancer.aio.proxy"]
    assert imported(known["balancer.aio.app"], known, "balancer.aio.app") >= {
        "balancer.aio.admin",
        "balancer.aio.control",
    }


def test_no_import_circle() -> None:
    found = cycle(graph())
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_only_the_entry_points_import_the_composition_root() -> None:
    importers = {m for m, deps in graph().items() if COMPOSITION_ROOT in deps}
    assert importers == ENTRY_POINTS


def test_asyncio_stays_in_aio() -> None:
    """The sans-I/O core (frames, handshake, ring, weights, pool, config, ...) has no loop."""
    known = modules()
    for m, path in known.items():
        if m.startswith("balancer.aio") or not m.startswith("balancer"):
            continue
        tree = ast.parse(path.read_text())
        uses = [
            n
            for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name == "asyncio" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.module == "asyncio")
        ]
        assert not uses, f"{m} imports asyncio"


def test_backends_import_only_the_contract_of_balancer() -> None:
    """wslb's workers speak wslb's contract: ``backends`` imports ``balancer.contract`` and no
    other balancer module, and the contract imports nothing of the project (it is shared by
    the workers and the journal, so it must stay a leaf)."""
    g = graph()
    used = {d for m, deps in g.items() if m.startswith("backends") for d in deps}
    assert {d for d in used if d.startswith("balancer")} == {"balancer.contract"}
    assert g["balancer.contract"] == set()


def table_rows() -> dict[str, int]:
    """docs/architecture.md's module table: each listed name (``frames.py``, ``aio/wheel.py``,
    ``config/``) and its row, bottom up."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text.split("## The modules, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith(("| row", "| ---"))
    ]
    rank: dict[str, int] = {}
    for i, line in enumerate(rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([\w/]+(?:\.py)?/?)`", cells[1]):
            rank[name] = i
    return rank


def row_of(module: str, rank: dict[str, int]) -> int | None:
    parts = module.split(".")
    if parts[0] != "balancer" or len(parts) == 1:
        return None
    rel = "/".join(parts[1:])
    if rel + ".py" in rank:
        return rank[rel + ".py"]
    top = rel.split("/", 1)[0] + "/"
    return rank.get(top) if "/" in rel or top in rank else None


def test_every_module_has_a_row_and_imports_point_down_the_table() -> None:
    """Rule 2, enforced: a module of ``balancer/`` imports only modules of its own row or of
    rows above it in the table (the table lists them bottom up)."""
    rank = table_rows()
    g = graph()
    unlisted = sorted(
        m
        for m in g
        if m.startswith("balancer.") and m != "balancer.aio" and row_of(m, rank) is None
    )
    assert unlisted == [], f"modules missing from docs/architecture.md's table: {unlisted}"
    up = [
        f"{m} (row {row_of(m, rank)}) imports {d} (row {row_of(d, rank)})"
        for m, deps in sorted(g.items())
        for d in sorted(deps)
        if (rm := row_of(m, rank)) is not None and (rd := row_of(d, rank)) is not None and rd > rm
    ]
    assert up == [], "imports that point up the table:\n" + "\n".join(up)
