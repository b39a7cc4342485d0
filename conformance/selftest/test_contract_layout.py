"""The layering of the source tree (docs/architecture.md), checked on the source, not on an import.

- ``optimized`` imports from ``reference`` only the contract (``reference.contract``): an oracle that an
  implementation reuses is no oracle, a bug in it would be shared and the comparison could not see it.
- the contract imports nothing else of ``reference`` (nor ``optimized`` or ``conformance``): it must be importable
  without any oracle.
- every ``HOSTOFFLOAD_*`` variable of the tree is declared in :mod:`reference.contract.envvars`, and no other module
  of ``reference/`` or ``optimized/`` spells one.

These tests read the files of a source checkout with :mod:`ast` ($HOSTOFFLOAD_SOURCE_ROOT, as tox sets it, else this
checkout); they skip where only the installed wheel is present. Nothing here imports ``optimized``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.selftest.runner import source_root
from reference.contract import envvars

CONTRACT = "reference.contract"


def _root() -> Path:
    root = source_root()
    if root is None or not (root / "optimized").is_dir() or not (root / "reference" / "contract").is_dir():
        pytest.skip("no source checkout: set HOSTOFFLOAD_SOURCE_ROOT to one (the layout is a property of the source)")
    return root


def _modules(root: Path, package: str) -> Iterator[tuple[str, Path]]:
    base = root / package.replace(".", "/")
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imported(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(dotted target, line) of every import in ``tree``: ``import a.b``, ``from a.b import c`` (as ``a.b.c`` when
    ``a.b`` is a package whose attribute may be a submodule, else ``a.b``), ``importlib.import_module("a.b")`` and
    module paths held in strings (lazy imports by name)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if node.module == "reference" else node.module, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"reference(\.[A-Za-z_]\w*)+(:\w+)?", node.value):
                yield node.value.split(":")[0], node.lineno


def _is_contract(target: str) -> bool:
    return target == CONTRACT or target.startswith(CONTRACT + ".")


def oracle_imports(root: Path) -> dict[str, list[str]]:
    """Optimized module -> its imports of ``reference`` outside the contract (``path:line target``)."""
    found: dict[str, list[str]] = {}
    for name, path in _modules(root, "optimized"):
        tree = ast.parse(path.read_text(), str(path))
        for target, line in _imported(tree):
            if (target == "reference" or target.startswith("reference.")) and not _is_contract(target):
                found.setdefault(name, []).append(f"{path.relative_to(root)}:{line} {target}")
    return found


def test_optimized_imports_only_the_contract_from_reference() -> None:
    found = oracle_imports(_root())
    assert not found, (
        "optimized imports oracle code of reference (only reference.contract.* is shared; give optimized its own "
        "code, or move a definition both implementations must agree on into reference/contract/):\n"
        + "\n".join(f"  {line}" for lines in found.values() for line in lines)
    )


def test_contract_imports_no_oracle() -> None:
    root = _root()
    bad = []
    for _, path in _modules(root, CONTRACT):
        for target, line in _imported(ast.parse(path.read_text(), str(path))):
            top = target.split(".")[0]
            if top in ("optimized", "conformance") or (top == "reference" and not _is_contract(target)):
                bad.append(f"{path.relative_to(root)}:{line} {target}")
    assert not bad, "the contract must not import an oracle or an implementation:\n" + "\n".join(bad)


def _judge_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(target, line) of every import of ``conformance`` in ``tree``, function-level ones and module paths held in
    strings (``importlib.import_module("conformance.x")``: a lazy import that ruff's banned-API rule cannot see)."""
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"conformance(\.[A-Za-z_]\w*)+(:\w+)?", node.value):
                targets = [node.value.split(":")[0]]
        for target in targets:
            if target.split(".")[0] == "conformance":
                yield target, node.lineno


def test_production_never_imports_the_judge() -> None:
    """Neither ``optimized`` nor ``reference`` imports ``conformance``, not even lazily: the harness judges them, and
    code that reached up into it would ship test machinery and depend on what checks it (issue 41)."""
    root = _root()
    bad = [f"{path.relative_to(root)}:{line} {target}"
           for package in ("optimized", "reference") for _, path in _modules(root, package)
           for target, line in _judge_imports(ast.parse(path.read_text(), str(path)))]
    assert not bad, "production code imports the conformance harness (move the code into conformance/):\n" + "\n".join(
        bad)


# -- environment variables --------------------------------------------------------------------------------------

_SCANNED = (".py", ".md", ".toml", ".ini", ".cfg", ".txt", ".cpp", ".h", ".sh")
_SKIPPED_DIRS = {".git", "build", ".tox", "__pycache__", "conformance-report", "dist"}
_NAME = re.compile(r"\bHOSTOFFLOAD_[A-Z0-9][A-Z0-9_]*\b")
#: C preprocessor macros and CMake variables share the prefix but are not environment variables.
_NOT_ENV = re.compile(r"(?:#\s*define\s+|set\(\s*|option\(\s*|\$\{)(HOSTOFFLOAD_[A-Z0-9_]+)")


def _source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.suffix in _SCANNED and path.is_file() and not (_SKIPPED_DIRS & set(path.relative_to(root).parts)):
            if any(p.endswith(".egg-info") for p in path.relative_to(root).parts):
                continue
            yield path


def mentioned_variables(root: Path) -> dict[str, list[str]]:
    """Every ``HOSTOFFLOAD_*`` name in the tree that is not a C macro or CMake variable -> where (first 3)."""
    found: dict[str, list[str]] = {}
    macros: set[str] = set()
    texts = {}
    for path in _source_files(root):
        text = path.read_text(errors="replace")
        texts[path] = text
        macros.update(_NOT_ENV.findall(text))
    for path, text in texts.items():
        for m in _NAME.finditer(text):
            if m.group(0) not in macros:
                line = text.count("\n", 0, m.start()) + 1
                found.setdefault(m.group(0), []).append(f"{path.relative_to(root)}:{line}")
    return found


def test_every_variable_is_declared_in_the_contract() -> None:
    found = mentioned_variables(_root())
    undeclared = {n: w[:3] for n, w in found.items() if n not in envvars.BY_NAME}
    assert not undeclared, (
        "HOSTOFFLOAD_* variables used but not declared in reference/contract/envvars.py (add a Variable to "
        f"VARIABLES, with its parser if an implementation reads it): {undeclared}"
    )
    unused = sorted(set(envvars.BY_NAME) - set(found))
    assert not unused, f"declared in reference.contract.envvars but used nowhere: {unused}"


def test_only_the_contract_spells_a_variable_in_the_implementations() -> None:
    """A ``"HOSTOFFLOAD_..."`` string literal (a definition or an ``os.environ`` read) in ``reference/`` or
    ``optimized/`` outside :mod:`reference.contract.envvars` is a second definition of the variable."""
    root = _root()
    bad = []
    for package in ("reference", "optimized"):
        for name, path in _modules(root, package):
            if name == "reference.contract.envvars":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
                    bad.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
    assert not bad, "use the constant and parser of reference.contract.envvars instead:\n" + "\n".join(bad)


def test_every_variable_is_in_the_usage_table() -> None:
    usage = _root() / "docs" / "usage.md"
    rows = set(re.findall(r"^\| `(HOSTOFFLOAD_[A-Z0-9_]+)` \|", usage.read_text(), re.MULTILINE))
    missing = sorted(set(envvars.BY_NAME) - rows)
    assert not missing, f"docs/usage.md's variable table lacks: {missing}"


def test_each_variable_has_its_constant_by_the_naming_rule() -> None:
    """``HOSTOFFLOAD_<X>`` is ``envvars.<X>_ENV``, so that a reader finds the constant from the variable's name."""
    wrong = [v.name for v in envvars.VARIABLES if getattr(envvars, v.name.removeprefix("HOSTOFFLOAD_") + "_ENV", None)
             != v.name]
    assert not wrong, f"no constant <X>_ENV for: {wrong}"


def test_the_readers_named_in_the_table_exist() -> None:
    assert {v.reader for v in envvars.VARIABLES} <= set(envvars.READERS)
    assert len(envvars.BY_NAME) == len(envvars.VARIABLES), "a variable is declared twice"
