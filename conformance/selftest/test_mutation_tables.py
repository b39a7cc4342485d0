"""The mutation run's committed tables stay true to the tree (docs/mutation.md), checked in CI without a run.

`tools/mutation_targets.toml` says which test modules judge which implementation module; a renamed test module
or a new implementation module without an entry would make `tox -e mutation` skip code silently.
`tools/mutation_equivalents.toml` excuses survivors; an entry whose mutated line is gone from its file excuses
nothing and misleads the next reader. Reads the source checkout ($HOSTOFFLOAD_SOURCE_ROOT); skips without one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conformance.selftest.runner import source_root

pytestmark = pytest.mark.conformance_area("harness")


@pytest.fixture(scope="module")
def mutation():
    root = source_root()
    if root is None or not (root / "tools" / "mutation.py").is_file():
        pytest.skip("no source checkout with tools/mutation.py (set HOSTOFFLOAD_SOURCE_ROOT)")
    if sys.version_info < (3, 11):
        pytest.importorskip("tomli")
    spec = importlib.util.spec_from_file_location("hostoffload_mutation_tool", root / "tools" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _implementation_modules(root: Path) -> list[str]:
    paths = [*root.glob("optimized/**/*.py"), *root.glob("reference/contract/**/*.py")]
    return sorted(p.relative_to(root).as_posix() for p in paths if "__pycache__" not in p.parts)


def test_every_implementation_module_has_test_modules(mutation):
    """Every module of optimized/ and reference/contract/ is matched by a target entry, and every entry matches a
    module and names test modules that exist."""
    root = mutation.ROOT
    _, targets = mutation.load_targets()
    missing = [m for m in _implementation_modules(root) if not mutation.tests_for(m, targets)]
    assert not missing, f"no entry in tools/mutation_targets.toml for: {missing}"
    modules = _implementation_modules(root) + sorted(p.relative_to(root).as_posix()
                                                     for p in root.glob("conformance/*.py"))  # fmt: skip
    for entry in targets:
        for pattern in entry["modules"]:
            assert any(mutation.fnmatch.fnmatch(m, pattern) for m in modules), f"{pattern} matches no module"
        for test in entry["tests"]:
            assert (root / (test.replace(".", "/") + ".py")).is_file(), f"{test} (in {entry['modules']}) is gone"


def test_every_equivalent_survivor_still_exists_and_has_a_reason(mutation):
    """Each equivalents entry names a file that exists and whose text still holds the mutated line; the loader
    refuses an entry without a reason."""
    root = mutation.ROOT
    for (file, function, operator, before, _after), reason in mutation.load_equivalents().items():
        path = root / file
        assert path.is_file(), f"equivalent survivor in a file that is gone: {file}"
        lines = {line.strip() for line in path.read_text().splitlines()}
        assert before in lines, f"{file}: {function}: the line `{before}` ({operator}) is gone; edit or drop it"
        assert reason


def test_an_equivalent_without_a_reason_is_refused(mutation, tmp_path):
    bad = tmp_path / "eq.toml"
    bad.write_text('[[equivalent]]\nfile = "a.py"\nfunction = "f"\noperator = "o"\nbefore = "x"\nafter = "y"\n'
                   'reason = " "\n')  # fmt: skip
    with pytest.raises(SystemExit, match="no reason"):
        mutation.load_equivalents(bad)


def test_changed_lines_reads_the_diffs_hunks(mutation, monkeypatch):
    """--changed-lines keeps the lines a hunk adds (``+start,count``; one line without a count; none for a pure
    deletion)."""
    diff = "@@ -3,0 +4,2 @@\n+a\n+b\n@@ -10 +12 @@\n-c\n+d\n@@ -20,3 +21,0 @@\n-e\n"
    monkeypatch.setattr(mutation.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": diff})())
    assert mutation.changed_lines("HEAD", "x.py") == {4, 5, 12}
