"""docs/architecture.md names every module of the two areas a newcomer has to find their way through (issue 51).

test_architecture_names.py checks that what the page names exists; this checks the other direction for the
packages whose modules multiply fastest: every module of ``optimized/accumulation/`` (its ``update_paths/``
included) and of ``reference/contract/`` appears on the page in backticks, as its path or its file name. A module
added without a line on the map fails here, with its path.
"""

from __future__ import annotations

import re
from pathlib import Path

from conformance.selftest.runner import source_root

DOC = Path("docs") / "architecture.md"
#: the packages whose every module the page must name (``__init__.py`` files excepted: their package is named)
PACKAGES = ("optimized/accumulation", "reference/contract")


def unnamed_modules(root: Path) -> list[str]:
    """The modules under :data:`PACKAGES` that the page never puts in backticks (as a path ending in the module's
    relative path or as its bare file name), sorted."""
    spans = set(re.findall(r"`([^`\n]+)`", (root / DOC).read_text()))
    names = {s.strip().rstrip("/") for s in spans}
    missing = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            rel = path.relative_to(root).as_posix()
            inner = path.relative_to(root / package).as_posix()
            if not any(n == path.name or n.endswith(inner) or n == rel for n in names):
                missing.append(rel)
    return missing


def test_architecture_names_every_module_of_the_accumulation_and_contract_packages():
    root = source_root()
    assert (root / DOC).is_file(), f"{DOC} is missing under {root}"
    counted = sum(1 for p in PACKAGES for f in (root / p).rglob("*.py") if f.name != "__init__.py")
    assert counted > 40, f"found only {counted} modules under {PACKAGES}: the walk looked in the wrong place"
    missing = unnamed_modules(root)
    assert not missing, ("docs/architecture.md does not name these modules (add each where a reader would look "
                         "for it): " + ", ".join(missing))


def test_the_check_finds_a_module_the_page_does_not_name(tmp_path):
    """The rule on a made-up tree: a module named only in prose (no backticks) or not at all is reported; one named
    by path or by file name is not."""
    for rel in ("optimized/accumulation/named.py", "optimized/accumulation/update_paths/by_path.py",
                "optimized/accumulation/prose.py", "reference/contract/absent.py", "reference/contract/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / DOC).write_text("`named.py` and `optimized/accumulation/update_paths/by_path.py`; prose.py\n")
    assert unnamed_modules(tmp_path) == ["optimized/accumulation/prose.py", "reference/contract/absent.py"]
