"""docs/offload.md and docs/io.md stay in step with the suite: every stream-ordering rule (O1-O7, IO1-IO2) is
exercised by a test that cites it, and every citation names a rule that exists."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance_area("offload")

SUITE = Path(__file__).resolve().parent
# The source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it; the installed wheel has no docs/), else this checkout.
_ROOT = Path(os.environ.get("HOSTOFFLOAD_SOURCE_ROOT") or SUITE.parents[1])
DOC = _ROOT / "docs" / "offload.md"
RULE_DEF = re.compile(r"^\*\*O(\d+) \(", re.MULTILINE)
CITATION = re.compile(r"(?<![A-Za-z0-9])O(\d+)(?![0-9])")


def _rules() -> set[int]:
    if not DOC.exists():
        pytest.skip(f"{DOC} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout (docs/ is not in the wheel)")
    return {int(n) for n in RULE_DEF.findall(DOC.read_text())}


def _citations() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for path in sorted(SUITE.glob("test_offload_*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = node.name.replace("_", " ") + " " + (ast.get_docstring(node) or "")
                for n in {int(x) for x in CITATION.findall(text)}:
                    cited.setdefault(n, []).append(f"{path.name}::{node.name}")
    return cited


def test_every_offload_rule_is_cited_by_a_test():
    """Every rule O1..On of docs/offload.md is cited (by name or docstring) by at least one test."""
    rules = _rules()
    assert rules, f"{DOC} defines no O-rules"
    assert rules == set(range(1, max(rules) + 1)), f"rule ids are not consecutive: {sorted(rules)}"
    missing = sorted(rules - set(_citations()))
    assert not missing, f"rules without a test citing them: {[f'O{n}' for n in missing]}"


IO_DOC = _ROOT / "docs" / "io.md"
IO_RULE_DEF = re.compile(r"^\*\*IO(\d+) \(", re.MULTILINE)
IO_CITATION = re.compile(r"(?<![A-Za-z0-9])IO(\d+)(?![0-9])")


def test_every_io_stream_rule_is_cited_by_a_test():
    """Every rule IO1..IOn of docs/io.md is cited by a test of test_io_*.py, and every citation exists."""
    if not IO_DOC.exists():
        pytest.skip(f"{IO_DOC} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    rules = {int(n) for n in IO_RULE_DEF.findall(IO_DOC.read_text())}
    assert rules == set(range(1, max(rules, default=0) + 1)) and rules, f"IO rule ids: {sorted(rules)}"
    cited: set[int] = set()
    for path in sorted(SUITE.glob("test_io_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = node.name.replace("_", " ") + " " + (ast.get_docstring(node) or "")
                cited |= {int(x) for x in IO_CITATION.findall(text)}
    assert not rules - cited, f"io rules without a test citing them: {sorted(rules - cited)}"
    assert not cited - rules, f"tests cite undefined io rules: {sorted(cited - rules)}"


def test_every_offload_citation_names_an_existing_rule():
    """Tests cite only O-rules that docs/offload.md defines."""
    rules = _rules()
    dangling = {n: where for n, where in _citations().items() if n not in rules}
    assert not dangling, f"tests cite undefined rules: {dangling}"
