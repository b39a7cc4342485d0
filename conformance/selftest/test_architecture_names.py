"""Every module, file and name that docs/architecture.md puts in backticks exists in the source tree.

The page is a map: a reader follows it to a file and a function. A name that was renamed or removed sends the reader
nowhere, so each backticked span of the page is checked on the source (with :mod:`ast`, nothing is imported), by
what it looks like:

- a **path** (has a ``/`` or ends in a file suffix: ``optimized/accumulation/engine.py``, ``update_paths/``,
  ``lr.py``) must exist: from the tree's root, else relative to the directory of the last path named in the same
  paragraph (a list right after a paragraph belongs to it) or table cell, or one of that directory's parents (the
  page writes ``-> `engine.py``` after ``optimized/offload/manager.py``).
- a **dotted module name** rooted at one of the tree's packages (``optimized.accumulation.device_spans``,
  ``reference.contract.errors.HostOffloadError``) must name a module (a ``.py`` file, a package, or an extension
  that ``csrc/`` declares with ``PYBIND11_MODULE``), and what follows the module must be defined in it: a top-level
  ``def``/``class``/assignment/import, then a member of that class (method, class attribute, ``self.x =``).
- a **name after a Python file in a table cell** (``optimized/accumulation/engine.py`` ``ZeroEngine.backward``,
  ``.step``) is defined in that file by the same rule; a bare name may also be a member of one of its classes. In
  parentheses (``(`master_device`)``, an aside about the code) it only has to occur in that file's text; after a
  C++ file or a directory, each of its parts has to occur in that file's (directory's) text.
- any **other identifier** (prose: ``StreamedOffloadEngine``, ``offload_optimizer``) has to occur as a whole word
  somewhere in the source tree (Python, C++, build files): the loosest rule, so that it has no false positives.

Spans that are none of these (``HOSTOFFLOAD_*``, ``*.boundary``, ``/proc``, phrases with spaces) and fenced code
blocks are not checked. The rules themselves are exercised on a small made-up tree, so that a checker that finds
nothing cannot pass for one that finds everything.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conformance.selftest.runner import source_root

DOC = Path("docs") / "architecture.md"
_SUFFIXES = (".py", ".cpp", ".h", ".hpp", ".toml", ".md", ".sh", ".cfg", ".ini", ".txt")
_CORPUS_SUFFIXES = (".py", ".cpp", ".h", ".hpp", ".toml", ".txt", ".cfg", ".ini", ".sh")
_CORPUS_DIRS = ("reference", "optimized", "conformance", "csrc", "benchmarks", "examples")
_IDENT = r"[A-Za-z_]\w*"
_NAME = re.compile(rf"(?:{_IDENT})?(?:\.{_IDENT})*(?:::{_IDENT})*(?:\(\))?")
_SPAN = re.compile(r"`([^`\n]+)`")


@dataclass
class Span:
    text: str
    line: int
    in_parens: bool


@dataclass
class Unit:
    """A paragraph or one table cell: the scope in which a path gives context to the names after it."""

    in_table: bool
    spans: list[Span] = field(default_factory=list)
    depth: int = 0  # parentheses of the prose still open at the end of the lines read so far


def _units(doc: str) -> Iterator[Unit]:
    """The page's paragraphs and table cells, fenced code blocks left out."""
    paragraph: Unit | None = None
    fenced = False
    blank: bool | None = None
    for number, line in enumerate(doc.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("|"):
            if paragraph:
                yield paragraph
                paragraph = None
            if re.fullmatch(r"\|[\s|:-]+\|?", line.strip()):
                continue
            for cell in _cells(line):
                unit = Unit(in_table=True)
                _add_spans(unit, cell, number)
                yield unit
        elif line.startswith("#"):
            if paragraph:
                yield paragraph
            paragraph = blank = None
        elif not line.strip():
            blank = True
        else:
            if paragraph and blank and not re.match(r"\s*(?:[-*]|\d+\.)\s", line):
                yield paragraph  # a new paragraph; a list after a paragraph continues it (its items name its files)
                paragraph = None
            blank = False
            paragraph = paragraph or Unit(in_table=False)
            _add_spans(paragraph, line, number)
    if paragraph:
        yield paragraph


def _cells(line: str) -> list[str]:
    """A table row split at the ``|`` outside code spans."""
    cells, current, in_code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(current)
            current = ""
        else:
            current += ch
    return [*cells, current]


def _add_spans(unit: Unit, text: str, line: int) -> None:
    """Append the code spans of ``text``, each knowing whether it sits inside parentheses of the prose."""
    pos, depth = 0, unit.depth
    for m in _SPAN.finditer(text):
        between = text[pos : m.start()]
        depth = max(0, depth + between.count("(") - between.count(")"))
        unit.spans.append(Span(m.group(1).strip(), line, depth > 0))
        pos = m.end()
    rest = text[pos:]
    unit.depth = max(0, depth + rest.count("(") - rest.count(")"))


# -- the source tree, read with ast ------------------------------------------------------------------------------


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from _targets(elt)


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module (or class) body binds: defs, classes, assignments, imports, also under ``if``/``try``."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(dict.fromkeys(_targets(target), node))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            names.update(dict.fromkeys(_targets(node.target), node))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(node, block, []):
                    names.update(_defined(sub.body if isinstance(sub, ast.ExceptHandler) else [sub]))
    return names


def _members(cls: ast.ClassDef, module: dict[str, ast.AST]) -> set[str]:
    """A class's members: its body's names, ``self.<x> =`` in its methods, and those of its bases in the module."""
    members = set(_defined(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                members.add(node.attr)
    for base in cls.bases:
        if isinstance(base, ast.Name) and isinstance(module.get(base.id), ast.ClassDef) and base.id != cls.name:
            members |= _members(module[base.id], module)  # type: ignore[arg-type]
    return members


class Tree:
    """The source checkout: files, Python modules (parsed once) and one text of everything for word look-ups."""

    def __init__(self, root: Path, exclude: tuple[Path, ...] = ()) -> None:
        self.root = root
        self._parsed: dict[Path, dict[str, ast.AST]] = {}
        self._texts: dict[Path, str] = {}
        self.packages = {p.parent.name for p in root.glob("*/__init__.py")}
        dirs = sorted(self.packages | set(_CORPUS_DIRS))
        files = [p for d in dirs for p in sorted((root / d).rglob("*")) if p.suffix in _CORPUS_SUFFIXES]
        files += [p for p in root.glob("*") if p.suffix in _CORPUS_SUFFIXES]
        excluded = {p.resolve() for p in exclude}
        self.corpus = "\n".join(self.text(p) for p in files if p.is_file() and p.resolve() not in excluded)

    def text(self, path: Path) -> str:
        if path not in self._texts:
            self._texts[path] = path.read_text(errors="replace")
        return self._texts[path]

    def names(self, path: Path) -> dict[str, ast.AST]:
        if path not in self._parsed:
            self._parsed[path] = _defined(ast.parse(self.text(path), str(path)).body)
        return self._parsed[path]

    def module_file(self, dotted: str) -> Path | None:
        base = self.root / dotted.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def native_module(self, dotted: str) -> str | None:
        """The C++ text of the extension ``dotted`` (declared by ``PYBIND11_MODULE(<last part>, ...)``), if any."""
        name = dotted.rsplit(".", 1)[-1]
        sources = [p for p in sorted((self.root / "csrc").rglob("*")) if p.suffix in (".cpp", ".h", ".hpp")]
        if any(re.search(rf"PYBIND11_MODULE\(\s*{name}\s*,", self.text(p)) for p in sources):
            return "\n".join(self.text(p) for p in sources)
        return None

    def has_word(self, word: str, text: str | None = None) -> bool:
        return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", self.corpus if text is None else text) is not None


def _attribute_problem(tree: Tree, path: Path, parts: list[str], bare_may_be_member: bool) -> str | None:
    """None if ``parts`` (``Class``, ``method``...) is defined in the Python file ``path``, else why not."""
    module = tree.names(path)
    where = path.relative_to(tree.root)
    head = parts[0]
    if head not in module:
        if bare_may_be_member and len(parts) == 1:
            if any(head in _members(n, module) for n in module.values() if isinstance(n, ast.ClassDef)):
                return None
        return f"{where} defines no top-level {head!r}"
    node = module[head]
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return None  # an imported or assigned object: its attributes are not readable from the source
        if part not in _members(node, module):
            return f"{where}: class {node.name} has no member {part!r}"
        node = _defined(node.body).get(part)  # type: ignore[assignment]
    return None


# -- the rules -----------------------------------------------------------------------------------------------------


@dataclass
class Check:
    span: Span
    rule: str
    problem: str | None


def _is_path(text: str) -> bool:
    return "/" in text or text.endswith(_SUFFIXES)


def _resolve_path(tree: Tree, text: str, context: Path | None) -> Path | None:
    rel = text.rstrip("/")
    bases = [tree.root]
    if context is not None:
        bases += [d for d in (context, *context.parents) if tree.root in (d, *d.parents) and d != tree.root]
    for base in bases:
        for candidate in (base / rel, base / (rel + ".py")):
            if candidate.exists() and (not text.endswith("/") or candidate.is_dir()):
                return candidate
    return None


def _check_dotted(tree: Tree, text: str) -> str | None:
    parts = text.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        path = tree.module_file(module)
        if path is not None:
            return _attribute_problem(tree, path, parts[cut:], bare_may_be_member=False) if parts[cut:] else None
        native = tree.native_module(module) if cut > 1 else None
        if native is not None:
            missing = [p for p in parts[cut:][:1] if f'"{p}"' not in native]
            return f"extension {module} binds no {missing[0]!r}" if missing else None
    return f"no module {parts[0]}{'.' + parts[1] if len(parts) > 1 else ''}... in the tree"


def check_page(tree: Tree, doc: str) -> list[Check]:
    """Every backticked span of ``doc`` that a rule applies to, with the rule and its problem (None: resolves)."""
    checks: list[Check] = []
    for unit in _units(doc):
        context: Path | None = None  # the last path named in this paragraph / cell
        owner: str | None = None  # the class of the last ``Class.member`` (for a following ``.member``)
        for span in unit.spans:
            text = span.text
            if text.startswith("/") or any(c in text for c in "*<> ,"):
                continue
            if _is_path(text):
                found = _resolve_path(tree, text, context.parent if context and context.is_file() else context)
                checks.append(Check(span, "path", None if found else "no such file or directory"))
                if found is not None:
                    context = found
                continue
            if not _NAME.fullmatch(text) or not text.strip("().:"):
                continue
            name = text.removesuffix("()")
            if name.startswith(".") and owner:
                name = owner + name
            root = name.split(".")[0]
            if root in tree.packages and "." in name:
                checks.append(Check(span, "module", _check_dotted(tree, name)))
                continue
            if "." in name.strip("."):
                owner = name.split(".")[0]
            parts = [p for p in re.split(r"\.|::", name) if p]
            if unit.in_table and context is not None and context.suffix == ".py" and not span.in_parens:
                problem = _attribute_problem(tree, context, parts, bare_may_be_member=True)
                checks.append(Check(span, f"defined in {context.relative_to(tree.root)}", problem))
            elif unit.in_table and context is not None:
                texts = [context] if context.is_file() else sorted(p for p in context.rglob("*") if p.is_file())
                scope = "\n".join(tree.text(p) for p in texts if p.suffix in _CORPUS_SUFFIXES)
                missing = [p for p in parts if not tree.has_word(p, scope)]
                checks.append(Check(span, f"occurs in {context.relative_to(tree.root)}",
                                    f"{missing} not in its text" if missing else None))
            else:
                missing = [p for p in parts if not tree.has_word(p)]
                checks.append(Check(span, "occurs in the tree", f"{missing} occur nowhere" if missing else None))
    return checks


def _failures(checks: list[Check]) -> list[str]:
    return [f"{DOC}:{c.span.line}: `{c.span.text}` ({c.rule}): {c.problem}" for c in checks if c.problem]


# -- the tests -----------------------------------------------------------------------------------------------------


def test_every_backticked_name_in_architecture_md_exists() -> None:
    root = source_root()
    if root is None or not (root / DOC).is_file() or not (root / "optimized").is_dir():
        pytest.skip(f"no source checkout with {DOC}: set HOSTOFFLOAD_SOURCE_ROOT to one")
    tree = Tree(root, exclude=(Path(__file__),))
    checks = check_page(tree, (root / DOC).read_text())
    failures = _failures(checks)
    assert not failures, (
        "docs/architecture.md names what the source does not have (rename it in the page, or say what replaced "
        "it):\n" + "\n".join(failures)
    )
    # The page is a map of the tree: if the rules found next to nothing to check, they broke, not the page.
    strict = [c for c in checks if c.rule in ("path", "module") or c.rule.startswith("defined in")]
    assert len(strict) >= 80, f"only {len(strict)} paths/names were checked strictly; the span rules broke"


_TOY_DOC = """\
Intro: `pkg/mod.py` (`Thing`) -> `other.py`; `pkg.mod.Thing.run` and `pkg.mod.helper` and `pkg.gone`,
`pkg.mod.Thing.nope`, `csrc/`, `pkg/missing.py`, `HOSTOFFLOAD_*`, `word_in_cpp`, `no_such_word`.

```
`pkg.fenced_is_skipped`
```

| question | where |
|---|---|
| a | `pkg/mod.py` `Thing.run`, `.size`, `helper` (`local_name`); `other.py` `gone_def` |
| b | `csrc/thing.cpp` `Box::fill` (`absent_cpp`) |
"""


def test_the_rules_on_a_made_up_tree(tmp_path: Path) -> None:
    """Each rule accepts what exists and names what does not (the page test alone could pass by checking nothing)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(
        "class Thing:\n    def run(self):\n        self.size = 1\n\n\ndef helper():\n    local_name = 2\n"
    )
    (tmp_path / "pkg" / "other.py").write_text("def present(): ...\n")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "thing.cpp").write_text("struct Box { void fill(); }; // word_in_cpp\n")
    problems = {c.span.text: c.problem for c in check_page(Tree(tmp_path), _TOY_DOC)}
    fine = ["pkg/mod.py", "Thing", "other.py", "pkg.mod.Thing.run", "pkg.mod.helper", "csrc/", "word_in_cpp",
            "Thing.run", ".size", "helper", "local_name", "csrc/thing.cpp", "Box::fill"]
    wrong = ["pkg.gone", "pkg.mod.Thing.nope", "pkg/missing.py", "no_such_word", "gone_def", "absent_cpp"]
    assert {n: problems.get(n, "not checked") for n in fine if problems.get(n, "not checked")} == {}
    assert [n for n in wrong if not problems.get(n)] == [], problems
    assert "HOSTOFFLOAD_*" not in problems and "pkg.fenced_is_skipped" not in problems
