"""Every relative link of README.md and docs/*.md reaches its file and, with a ``#section``, a heading of that page.

Pages move and split (docs/benchmarks.md's run history became docs/benchmarks-log.md); a link to a section that
went elsewhere still renders, and sends the reader to the top of the wrong page. The anchor of a heading is the one
GitHub renders: the heading's text in lower case, every character that is not a letter, digit, ``_``, ``-`` or
space dropped, spaces turned into ``-``, and ``-1``, ``-2``... appended to repeats. Fenced code blocks are neither
links nor headings. Links with a scheme (``https:``, ``mailto:``) are not checked. Reads the source checkout
($HOSTOFFLOAD_SOURCE_ROOT); skips without one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance.selftest.runner import source_root

_FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.M | re.S)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their lines kept blank, so line numbers stay)."""
    return _FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(text: str) -> set[str]:
    """The section anchors GitHub gives the headings of a page."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for m in _HEADING.finditer(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(root: Path) -> list[str]:
    """``page:line: target (why)`` for every relative link that does not resolve."""
    broken = []
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in (p for p in pages if p.is_file()):
        text = _prose(page.read_text())
        for m in _LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[A-Za-z][\w+.-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file) if file else page
            where = f"{page.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{where} (no heading of {dest.relative_to(root)} has this anchor)")
    return broken


def test_every_relative_link_of_the_docs_resolves() -> None:
    root = source_root()
    if root is None or not (root / "docs").is_dir():
        pytest.skip("no source checkout with docs/: set HOSTOFFLOAD_SOURCE_ROOT to one")
    broken = broken_links(root)
    assert not broken, "links that lead nowhere (the section moved or was renamed?):\n" + "\n".join(broken)


def test_the_anchor_rule_on_made_up_pages(tmp_path: Path) -> None:
    """The rule accepts GitHub's anchors (punctuation dropped, repeats numbered) and names a wrong one."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Top\n\n## Pinning (`bench.py`, issue 3)\n\n## Runs\n\n## Runs\n\n```\n# not a heading\n```\n"
    )
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#pinning-benchpy-issue-3) [ok](docs/a.md#runs-1) [ok](https://example.com/#x)\n"
        "[bad](docs/a.md#runs-2) [bad](docs/a.md#not-a-heading) [bad](docs/gone.md)\n"
        "```\n[in code](docs/gone.md)\n```\n"
    )
    assert broken_links(tmp_path) == [
        "README.md:2: docs/a.md#runs-2 (no heading of docs/a.md has this anchor)",
        "README.md:2: docs/a.md#not-a-heading (no heading of docs/a.md has this anchor)",
        "README.md:2: docs/gone.md (no such file)",
    ]
