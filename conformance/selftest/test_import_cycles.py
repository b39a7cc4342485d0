"""No import cycle inside ``optimized/`` or ``reference/``, not even one hidden in a function.

A cycle is two modules that each need the other: whichever is imported first sees the other half-built, so the
code works around it with an import inside a function, a ``TYPE_CHECKING`` block or a lazy name, and the layering
that docs/architecture.md draws no longer holds. The fix is structural: move what both need into a module both
can import, or hand the lower module callbacks instead of the higher one's object.

The graph is read from the source with :mod:`ast` ($HOSTOFFLOAD_SOURCE_ROOT, as tox sets it, else this checkout;
skipped where only the installed wheel is present), so it sees every import: at module level, inside functions,
under ``if TYPE_CHECKING:``, and ``importlib.import_module("literal")``. An edge goes to the most specific module
named: ``from a.b import c`` is an edge to ``a.b.c`` where that is a module, else to ``a.b`` (the package's
``__init__``); a package's ``__init__`` that re-exports its own submodules is the ordinary package pattern, so the
implicit import of parent packages is not an edge. Nothing here imports ``optimized``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.selftest.runner import source_root

#: The trees whose modules may not form a cycle (each with itself and with the other).
PACKAGES = ("optimized", "reference")


def _root() -> Path:
    root = source_root()
    if root is None or not all((root / p / "__init__.py").is_file() for p in PACKAGES):
        pytest.skip("no source checkout: set HOSTOFFLOAD_SOURCE_ROOT to one (the import graph is a property of the "
                    "source)")
    return root


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of :data:`PACKAGES` under ``root``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted target, line) of every import in the module ``name`` at ``path``, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name, path)
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno  # resolved to base below when no such module
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            yield node.args[0].value, node.lineno


def _bound_names(path: Path) -> set[str]:
    """The names a module's top level binds (definitions, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def import_graph(found: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module of :data:`PACKAGES`: first line}; targets resolved to the most specific
    module that exists (``a.b.c`` if a module, else ``a.b``). ``from pkg import name`` where ``name`` is neither a
    ``.py`` module nor bound by ``pkg/__init__.py`` names a compiled extension (``optimized._native``): it
    imports no Python module, so it is no edge."""
    graph: dict[str, dict[str, int]] = {}
    bound: dict[str, set[str]] = {}
    for name, path in found.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path):
            parent, _, leaf = target.rpartition(".")
            if target not in found and parent in found and found[parent].name == "__init__.py":
                if parent not in bound:
                    bound[parent] = _bound_names(found[parent])
                if leaf not in bound[parent]:
                    continue
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit on deep trees)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, {})))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def _one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as the modules in import order, first repeated."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ in members and succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is strongly connected but no cycle through {start} was found")


def cycles(root: Path) -> list[str]:
    """One line per import cycle: ``a (path:line) -> b (path:line) -> a``."""
    found = modules(root)
    graph = import_graph(found)
    lines = []
    for component in _strongly_connected(graph):
        cycle = _one_cycle(graph, component)
        steps = [f"{a} ({found[a].relative_to(root)}:{graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        extra = f" [{len(component)} modules in this knot: {', '.join(component)}]" if len(component) > 2 else ""
        lines.append(" -> ".join([*steps, cycle[0]]) + extra)
    return lines


def test_optimized_and_reference_have_no_import_cycle() -> None:
    found = cycles(_root())
    assert not found, (
        "import cycles (module (file:line of its import) -> ...); move what both modules need into one both can "
        "import, or pass the lower module callbacks instead of the higher one's object:\n"
        + "\n".join(f"  {line}" for line in found)
    )


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The reader finds the imports that hide cycles: inside a function, under TYPE_CHECKING, relative, and by
    ``importlib.import_module``; and the cycle report names the modules in order."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "optimized" / "a.py").write_text("def f():\n    from optimized.b import g\n    return g\n")
    (tmp_path / "optimized" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from optimized import c\n")
    (tmp_path / "optimized" / "c.py").write_text("from . import a\n")
    (tmp_path / "reference" / "x.py").write_text("import importlib\nimportlib.import_module('reference.y')\n")
    (tmp_path / "reference" / "y.py").write_text("import reference.x\n")
    (tmp_path / "reference" / "z.py").write_text("from reference import x\n")  # no cycle through z
    # a package whose submodules import a compiled extension of it (no .py file) is no cycle
    (tmp_path / "optimized" / "__init__.py").write_text("from optimized.d import f\n")
    (tmp_path / "optimized" / "d.py").write_text("from optimized import _native\n\ndef f():\n    pass\n")
    found = cycles(tmp_path)
    assert len(found) == 2, found
    assert found[0].startswith("optimized.a (optimized/a.py:2) -> optimized.b (optimized/b.py:3) -> "
                               "optimized.c (optimized/c.py:1) -> optimized.a"), found
    assert found[1].startswith("reference.x (reference/x.py:2) -> reference.y (reference/y.py:1) -> reference.x"), (
        found)
