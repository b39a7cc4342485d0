"""docs/accumulation.md and the suite stay in step: every rule is exercised by a test that cites it, and every
citation names a rule that exists (R1-R26)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance_area("accumulation")

SUITE = Path(__file__).resolve().parent
# The source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it; the installed wheel has no docs/), else this checkout.
_ROOT = Path(os.environ.get("HOSTOFFLOAD_SOURCE_ROOT") or SUITE.parents[1])
DOC = _ROOT / "docs" / "accumulation.md"
RULE_DEF = re.compile(r"^\*\*R(\d+) \(", re.MULTILINE)
CITATION = re.compile(r"(?<![A-Za-z0-9])R(\d+)(?![0-9])")


def _rules() -> set[int]:
    if not DOC.exists():
        pytest.skip(f"{DOC} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout (docs/ is not in the wheel)")
    return {int(n) for n in RULE_DEF.findall(DOC.read_text())}


def _citations() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for path in sorted(SUITE.glob("test_accumulation_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = node.name.replace("_", " ") + " " + (ast.get_docstring(node) or "")
                for n in {int(x) for x in CITATION.findall(text)}:
                    cited.setdefault(n, []).append(f"{path.name}::{node.name}")
    return cited


def test_R26_every_rule_is_cited_by_a_test():
    """Every rule R1..Rn of docs/accumulation.md is cited (by name or docstring) by at least one test."""
    rules = _rules()
    assert rules == set(range(1, max(rules) + 1)), f"rule ids are not consecutive: {sorted(rules)}"
    missing = sorted(rules - set(_citations()))
    assert not missing, f"rules without a test citing them: {[f'R{n}' for n in missing]}"


def test_R26_every_citation_names_an_existing_rule():
    """Tests and the reference code cite only rules that docs/accumulation.md defines."""
    rules = _rules()
    dangling = {n: where for n, where in _citations().items() if n not in rules}
    assert not dangling, f"tests cite undefined rules: {dangling}"
    import reference.accumulation as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        for n in {int(x) for x in CITATION.findall(path.read_text())}:
            assert n in rules, f"{path.name} cites R{n}, which docs/accumulation.md does not define"
