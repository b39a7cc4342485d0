"""docs/accumulation.md and the suite stay in step: every rule is exercised by a test that cites it, and every
citation names a rule that exists (R1-Rn, consecutive)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.doc_rules import ROOT, citation_pattern, cited_rules, defined_rules

pytestmark = pytest.mark.conformance_area("accumulation")

DOC = ROOT / "docs" / "accumulation.md"
CITATION = citation_pattern("R")


def _rules() -> set[int]:
    return defined_rules(DOC, "R")


def _citations() -> dict[int, list[str]]:
    """Citations of the accumulation tests and of the optimizer-kernel area's (R15/R16 of any declared kernel)."""
    cited = cited_rules("R", "test_accumulation_*.py")
    for n, where in cited_rules("R", "test_optimizer_kernels.py").items():
        cited.setdefault(n, []).extend(where)
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
