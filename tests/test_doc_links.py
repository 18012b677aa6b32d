"""The user-facing docs stand on their own in the repository.

Every relative link in README.md and docs/*.md must name a file of the checkout, and every
``#anchor`` (in the same page or another) a heading of that page, slugged the way GitHub does:
the heading's text (inline code and link markup removed) lower-cased, every character that is
not a letter, digit, space, ``-`` or ``_`` dropped, each space turned into ``-``; a repeated slug
gets ``-1``, ``-2``, ... Headings and links inside fenced code blocks do not count.

And none of them may send a reader where a reader cannot follow: no "SPEC" (there is none in
the repository; the contract is in docs/protocol.md and its neighbours) and no "issue N" of a
tracker users cannot see.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.procs import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
K8S = sorted((ROOT / "examples" / "k8s").glob("*.yaml"))

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target stops at whitespace or the closing paren.
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
FORBIDDEN = re.compile(r"\bSPEC\b|\b[Ii]ssues?[ -]#?\d+\b|\b[Ii]ssues? #\d+")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's markdown text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # inline code keeps its text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in prose_lines(path):
        line = INLINE_CODE.sub("", line)
        out.extend((n, m.group(1)) for m in LINK.finditer(line))
    return out


def test_slug_follows_github() -> None:
    assert slug("6. What the client sees") == "6-what-the-client-sees"
    assert slug("### pools[].backends".lstrip("# ")) == "poolsbackends"
    assert slug("trusted_proxies and client addresses") == "trusted_proxies-and-client-addresses"
    assert slug("The listener's SSL context (`Listeners.start`, balancer/aio/app.py)") == (
        "the-listeners-ssl-context-listenersstart-balanceraioapppy"
    )
    assert slug("3a. The OpenAI Realtime protocol (text)") == "3a-the-openai-realtime-protocol-text"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for n, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{doc.name}:{n}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{doc.name}:{n}: {target}: {dest.name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS + K8S, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_spec_sections_or_issue_numbers(doc: Path) -> None:
    """A reader has neither the SPEC nor the tracker: say the thing itself, or link the doc."""
    found = [
        f"{doc.name}:{n}: {line.strip()}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not found, "\n".join(found)
