"""Optional packages a test needs, and the one skip reason that says a missing one left a test unjudged.

A test that cannot run because an optional package is not importable here (Triton's interpreter for a fused
kernel, transformers for the Hugging Face tests) skips through :func:`require`, whose reason starts with
:data:`MISSING_PREFIX` and names the package. The report (conformance/harness/rule_ledger.py) reads that reason back,
attributes the skip to the rules the test judges, and lists them at the top of report.md and in report.json:
a rule is never left unjudged silently by an environment that lacks a package. ``pytest.importorskip``'s own
reason ("could not import 'x'") is read the same way, so a test written with it is attributed too.
"""

from __future__ import annotations

import importlib
import re

import pytest

MISSING_PREFIX = "missing optional package"
_REASON = re.compile(rf"^(?:{MISSING_PREFIX} '(?P<ours>[^']+)'|could not import '(?P<pytest>[^']+)')")


def missing(packages: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Each package of ``packages`` that cannot be imported here -> why (the import error's message)."""
    out: dict[str, str] = {}
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            out[name] = str(exc) or type(exc).__name__
    return out


def require(packages: tuple[str, ...] | list[str], needed_for: str) -> None:
    """Skip the calling test, naming the first missing package, unless every one of ``packages`` imports."""
    absent = missing(packages)
    if absent:
        name, why = next(iter(absent.items()))
        pytest.skip(f"{MISSING_PREFIX} '{name}' ({needed_for}): {why}")


def package_of(reason: str | None) -> str | None:
    """The package a skip reason says is missing, or None when the skip has another cause."""
    match = _REASON.match(reason or "")
    if match is None:
        return None
    return match.group("ours") or match.group("pytest")
