"""Which rules a run judged, which it left unjudged and why, and the rule set a report pins.

A rule (R16, O5, IO1) is defined once, in bold at the start of a line of its page in docs/
(conformance.harness.doc_rules reads them the same way), and a test judges the rules its name or docstring cites
(the docs tests keep both directions true: every rule is cited, every citation exists). So:

- :func:`rule_set` is the rule set the report's header prints, read from the pages where they are (a source
  checkout, or ``$HOSTOFFLOAD_SOURCE_ROOT``); an installed wheel has no docs/, and then the set is what the
  installed suite's tests cite, which the docs tests hold equal to it.
- :func:`rules_of` is what one test judges.
- :class:`RuleLedger` collects, test by test, whether a test citing a rule ran, and for each skip that a missing
  optional package caused (conformance.harness.optional_packages), which rules it left unjudged: the top of the report.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field

import pytest

from conformance.harness import optional_packages
from conformance.harness.doc_rules import ROOT, SUITE, citation_pattern

#: The rule prefixes of hostoffload's pages, for an installed suite without docs/ (a source checkout reads them).
FALLBACK_PREFIXES = ("R", "O", "IO")
_DEFINITION = re.compile(r"^\*\*([A-Z]+)(\d+) \(", re.MULTILINE)


def _sort_key(rule: str) -> tuple[str, int]:
    prefix = rule.rstrip("0123456789")
    return prefix, int(rule[len(prefix):])


def sorted_rules(rules: set[str] | list[str]) -> list[str]:
    return sorted(set(rules), key=_sort_key)


def rule_set() -> tuple[list[str], str]:
    """(every rule id, where they were read): the docs' definitions, else the installed suite's citations."""
    docs = ROOT / "docs"
    pages = sorted(docs.glob("*.md")) if docs.is_dir() else []
    defined = {f"{p}{n}" for page in pages for p, n in _DEFINITION.findall(page.read_text())}
    if defined:
        return sorted_rules(defined), f"{docs} (the rules' definitions)"
    cited: set[str] = set()
    for path in sorted(SUITE.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                cited |= _citations(node.name + " " + (ast.get_docstring(node) or ""), FALLBACK_PREFIXES)
    return sorted_rules(cited), f"{SUITE} (the rules its tests cite; docs/ is not installed)"


def compact(rules: list[str]) -> str:
    """``R1, R2, R3, R5`` -> ``R1-R3, R5``: the header's one-line form."""
    runs: list[list[str]] = []
    for rule in sorted_rules(rules):
        prefix, n = _sort_key(rule)
        if runs and _sort_key(runs[-1][-1]) == (prefix, n - 1):
            runs[-1].append(rule)
        else:
            runs.append([rule])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def suite_digest() -> str:
    """A digest of the suite's test modules: two runs with the same digest judged with the same tests."""
    h = hashlib.sha256()
    for path in sorted(SUITE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _citations(text: str, prefixes: tuple[str, ...] | list[str]) -> set[str]:
    return {f"{p}{n}" for p in prefixes for n in citation_pattern(p).findall(text)}


def rules_of(item: pytest.Item, prefixes: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The rules ``item`` judges: those its test function's name or docstring cites."""
    name = getattr(item, "originalname", None) or item.name
    doc = getattr(getattr(item, "obj", None), "__doc__", None) or ""
    return tuple(sorted_rules(_citations(name.replace("_", " ") + " " + doc, prefixes)))


@dataclass
class _Missing:
    reason: str
    tests: set[str] = field(default_factory=set)
    rules: set[str] = field(default_factory=set)
    #: Tests it left out that cite no rule (a harness or integration test): counted, so none is silent either.
    uncited: set[str] = field(default_factory=set)


class RuleLedger:
    """Per rule: did a test citing it run? Per missing optional package: which tests and rules it left out."""

    def __init__(self) -> None:
        self.judged: set[str] = set()
        self.cited: set[str] = set()
        self.missing: dict[str, _Missing] = {}

    def record(self, nodeid: str, rules: tuple[str, ...], outcome: str, reason: str | None) -> None:
        self.cited.update(rules)
        if outcome not in ("skipped", "skipped_by_file"):
            self.judged.update(rules)
            return
        package = optional_packages.package_of(reason) if outcome == "skipped" else None
        if package is not None:
            entry = self.missing.setdefault(package, _Missing(reason or ""))
            entry.tests.add(nodeid)
            entry.rules.update(rules)
            if not rules:
                entry.uncited.add(nodeid)

    def summary(self, rule_set: list[str] | None = None) -> dict[str, object]:
        """What the report shows at its top: per missing package the rules it left unjudged (wholly: no test of
        the rule ran; partly: other tests of it ran), and every rule of ``rule_set`` (default: the rules the
        run's tests cite) no test of this run judged."""
        missing = {}
        for package, entry in sorted(self.missing.items()):
            missing[package] = {
                "reason": entry.reason,
                "tests": len(entry.tests),
                "rules_not_judged": sorted_rules(entry.rules - self.judged),
                "rules_partly_judged": sorted_rules(entry.rules & self.judged),
                "tests_citing_no_rule": len(entry.uncited),
            }
        return {"missing_packages": missing, "rules_judged": sorted_rules(self.judged),
                "rules_not_judged": sorted_rules(set(rule_set or self.cited) - self.judged)}
