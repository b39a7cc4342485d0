"""Numbered rules in docs/*.md and the tests that cite them, read the same way for every area.

A rule is defined in its page as a bold ``**<PREFIX><n> (`` at the start of a line (``**R3 (``, ``**O5 (``); a test
cites it by name or docstring (``test_R3_...``, "rule O5"). The docs tests of each area check both directions: every
rule is cited by a test, and every citation names a rule that exists.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "suite"
# The source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it; the installed wheel has no docs/), else this checkout.
ROOT = Path(os.environ.get("HOSTOFFLOAD_SOURCE_ROOT") or SUITE.parents[1])


def citation_pattern(prefix: str) -> re.Pattern[str]:
    """``<prefix><n>`` as a whole token (``R3`` but not ``IR3`` or ``R30`` for ``R3``)."""
    return re.compile(rf"(?<![A-Za-z0-9]){prefix}(\d+)(?![0-9])")


def defined_rules(doc: Path, prefix: str) -> set[int]:
    """The rule numbers ``doc`` defines; skips where the docs are not installed (a wheel without docs/)."""
    if not doc.exists():
        pytest.skip(f"{doc} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout (docs/ is not in the wheel)")
    return {int(n) for n in re.findall(rf"^\*\*{prefix}(\d+) \(", doc.read_text(), re.MULTILINE)}


def cited_rules(prefix: str, pattern: str, exclude: str | None = None) -> dict[int, list[str]]:
    """Rule number -> the ``module::test`` names citing it, over the suite modules matching ``pattern``."""
    citation = citation_pattern(prefix)
    cited: dict[int, list[str]] = {}
    for path in sorted(SUITE.glob(pattern)):
        if path.name == exclude:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = node.name.replace("_", " ") + " " + (ast.get_docstring(node) or "")
                for n in {int(x) for x in citation.findall(text)}:
                    cited.setdefault(n, []).append(f"{path.name}::{node.name}")
    return cited
