"""docs/offload.md and docs/io.md stay in step with the suite: every stream-ordering rule (O1-O7, IO1-IO2) is
exercised by a test that cites it, and every citation names a rule that exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.doc_rules import ROOT, cited_rules, defined_rules

pytestmark = pytest.mark.conformance_area("offload")

DOC = ROOT / "docs" / "offload.md"


def _rules() -> set[int]:
    return defined_rules(DOC, "O")


def _citations() -> dict[int, list[str]]:
    return cited_rules("O", "test_offload_*.py", exclude=Path(__file__).name)


def test_every_offload_rule_is_cited_by_a_test():
    """Every rule O1..On of docs/offload.md is cited (by name or docstring) by at least one test."""
    rules = _rules()
    assert rules, f"{DOC} defines no O-rules"
    assert rules == set(range(1, max(rules) + 1)), f"rule ids are not consecutive: {sorted(rules)}"
    missing = sorted(rules - set(_citations()))
    assert not missing, f"rules without a test citing them: {[f'O{n}' for n in missing]}"


IO_DOC = ROOT / "docs" / "io.md"


def test_every_io_stream_rule_is_cited_by_a_test():
    """Every rule IO1..IOn of docs/io.md is cited by a test of test_io_*.py, and every citation exists."""
    rules = defined_rules(IO_DOC, "IO")
    assert rules == set(range(1, max(rules, default=0) + 1)) and rules, f"IO rule ids: {sorted(rules)}"
    cited = set(cited_rules("IO", "test_io_*.py"))
    assert not rules - cited, f"io rules without a test citing them: {sorted(rules - cited)}"
    assert not cited - rules, f"tests cite undefined io rules: {sorted(cited - rules)}"


def test_every_offload_citation_names_an_existing_rule():
    """Tests cite only O-rules that docs/offload.md defines."""
    rules = _rules()
    dangling = {n: where for n, where in _citations().items() if n not in rules}
    assert not dangling, f"tests cite undefined rules: {dangling}"
