"""What README.md and docs/*.md promise a user in prose, held to the code and the build (issue 52's first-hour
defects: each was a page that told a new user something the code or the packaging did not do).

The examples themselves run in ``test_docs_examples.py``; these checks cover what an example cannot show: a
behaviour the docs call supported that the code refuses, a signature written differently from the function's,
an example needing a package that ``pip install .`` does not bring, a command whose cost the page does not warn
about.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from conformance.harness.docs_examples import all_blocks, pages
from conformance.selftest.runner import source_root

pytestmark = pytest.mark.conformance_area("harness")

ROOT = source_root()


def _root() -> Path:
    if ROOT is None:
        pytest.skip("no source checkout (README.md and docs/ are not in the wheel): set HOSTOFFLOAD_SOURCE_ROOT")
    return ROOT


def _sentences(text: str) -> list[str]:
    """The page's prose as sentences, line breaks and list markers folded into spaces (code blocks dropped)."""
    prose = re.sub(r"^```.*?^```", " ", text, flags=re.M | re.S)
    flat = re.sub(r"\s+", " ", prose)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(*])", flat)]


#: A checkpoint save placed between the boundary's last backward and its step.
_SAVE_BEFORE_STEP = re.compile(
    r"(save|checkpoint)[^.;]{0,80}between the (last )?backward and the step"
    r"|between the (last )?backward and the step[^.;]{0,80}(save|checkpoint)",
    re.I,
)


def test_no_page_calls_a_save_between_the_last_backward_and_step_supported():
    """Issue 52, defect 5: docs/zero.md listed "checkpoints (a save between the last backward and the step ...)"
    among what R30 supports, and docs/accumulation.md counted "a checkpoint save" among the reads there, while
    ``save_checkpoint`` refuses a save with a gradient accumulated since the last boundary
    (UnsupportedOperationError: the gradient is not part of a checkpoint; the conformance test
    ``test_R30_a_save_between_last_backward_and_step_is_refused_and_leaves_no_trace`` holds the engine to it).
    Every sentence of the docs that places a save or checkpoint between the last backward and the step says it is
    refused."""
    wrong = []
    for page in pages(_root()):
        for sentence in _sentences(page.read_text()):
            if _SAVE_BEFORE_STEP.search(sentence) and not re.search(r"refused|UnsupportedOperationError", sentence):
                wrong.append(f"{page.name}: {sentence[:300]}")
    assert not wrong, "sentences that call a save between the last backward and the step supported:\n" + "\n".join(
        wrong
    )


# ---- signatures ----------------------------------------------------------------------------------------------

#: The public modules whose functions and classes' methods the pages write signatures of.
_PUBLIC = ("optimized", "optimized.accumulation", "reference", "reference.accumulation")
#: An inline-code call or signature: `name(...)`, possibly broken over lines, no nested parentheses.
_SPAN = re.compile(r"`(\w+)\(([^`()]*)\)`")
_ITEM = re.compile(r"(?P<star>\*{0,2})(?P<name>[A-Za-z_]\w*)?(?:=(?P<default>.+))?")


def _public_signatures() -> dict[str, list[inspect.Signature]]:
    """name -> the signatures of the public callables of that name (functions, and methods of public classes)."""
    out: dict[str, list[inspect.Signature]] = {}

    def add(name: str, obj: object) -> None:
        try:
            sig = inspect.signature(obj)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        if sig not in out.setdefault(name, []):
            out[name].append(sig)

    for module_name in _PUBLIC:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if inspect.isclass(obj):
                for member in vars(obj):
                    if not member.startswith("_") and callable(getattr(obj, member, None)):
                        add(member, getattr(obj, member))
            elif callable(obj):
                add(name, obj)
    return out


def _rendered(sig: inspect.Signature) -> list[str]:
    """The parameter list as a page writes a signature: ``*`` before the first keyword-only parameter (unless a
    ``*args`` stands there), ``*args`` / ``**kwargs`` with their stars; ``self`` left out."""
    out: list[str] = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not any(i == "*" or i.startswith("*") for i in out):
            out.append("*")
        out.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return out


def _documented(args: str) -> list[tuple[str, str | None]] | None:
    """The items of a written parameter list as (name with its stars, default text), or None where an item is not
    a parameter (an expression: then the span is a call, not a signature)."""
    items = []
    for raw in (a.strip() for a in re.sub(r"\s+", " ", args).split(",")):
        m = _ITEM.fullmatch(raw)
        if not raw or m is None or (m.group("name") is None and m.group("star") != "*"):
            return None
        items.append((m.group("star") + (m.group("name") or ""), m.group("default")))
    return items


def test_documented_signatures_match_the_code():
    """Issue 52, defect 6: docs/zero.md wrote ``estimate_host_memory(module, config, world_size=1,
    device="cuda")``, a signature whose last two parameters are keyword-only in the code (``*`` missing), so a
    user calling it positionally got a TypeError. Where a page writes the whole parameter list of a public
    function or method (every parameter, by name: a signature, not a call), it is the code's: the same names in
    the same order, ``*`` where keyword-only parameters start, and the same defaults where it gives one."""
    signatures = _public_signatures()
    wrong, checked = [], 0
    for page in pages(_root()):
        text = re.sub(r"^```.*?^```", " ", page.read_text(), flags=re.M | re.S)
        for m in _SPAN.finditer(text):
            name, items = m.group(1), _documented(m.group(2))
            if name not in signatures or not items:
                continue
            written = [n for n, _ in items]
            for sig in signatures[name]:
                code = _rendered(sig)
                if {n.lstrip("*") for n in written if n != "*"} != {n.lstrip("*") for n in code if n != "*"}:
                    continue  # not this function's whole parameter list: a call, or another function
                checked += 1
                defaults = {p.name: p.default for p in sig.parameters.values() if p.default is not p.empty}
                bad_defaults = [(n, d) for n, d in items if d is not None and _literal(d) != defaults.get(n)]
                if written != code or bad_defaults:
                    wrong.append(f"{page.name}: `{name}({', '.join(written)})` is {name}{sig}"
                                 + (f" (defaults {bad_defaults})" if bad_defaults else ""))
    assert checked, "no page writes the signature of a public function: the check found nothing to check"
    assert not wrong, "signatures written differently from the code:\n" + "\n".join(wrong)


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _UNREADABLE


_UNREADABLE = object()


# ---- optional packages ---------------------------------------------------------------------------------------

#: How far before an example's first line the page must name the extra it needs (a short paragraph).
_EXTRA_WINDOW_LINES = 25


def _extras(root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """(import name -> the pyproject extras that install it, import names of the base dependencies). A small
    reader of the two lists (``tomllib`` is Python 3.11+; the project supports 3.10)."""
    text = (root / "pyproject.toml").read_text()

    def modules(listing: str) -> list[str]:
        names = (re.match(r"[A-Za-z0-9_.-]+", req) for req in re.findall(r'"([^"]+)"', listing))
        return [n.group(0).lower().replace("-", "_") for n in names if n]

    base = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = {}
    for extra, listing in re.findall(r"^([A-Za-z][\w-]*) = \[(.*?)\]\s*$", section, re.M | re.S):
        for module in modules(listing):
            extras.setdefault(module, set()).add(extra)
    return extras, set(modules(base.group(1))) if base else set()


def _imported(code: str) -> set[str]:
    tree = ast.parse(code)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_an_example_that_needs_an_extra_names_it():
    """Issue 52, defect 6: the docs/zero.md example that builds a Hugging Face model imports ``transformers``,
    which ``pip install .`` does not install (it is the ``hf`` extra of pyproject.toml), and the page did not say
    so: a new user copying it got a ModuleNotFoundError. An example importing a package that only an extra
    installs names that extra (``pip install ".[hf]"``, ``hostoffload[hf]``) in the lines just before it."""
    root = _root()
    extras, base = _extras(root)
    assert extras, "pyproject.toml declares no optional dependencies: the reader found nothing"
    missing, checked = [], 0
    for block in all_blocks(root):
        # a package several extras install (lightning: its own extra and the test extra) is named by any of the
        # user-facing ones; the test extra counts only where it is the one extra that has it
        needed = [sorted(extras[m] - {"test"} or extras[m]) for m in _imported(block.code)
                  if m in extras and m not in base]
        if not needed:
            continue
        checked += 1
        lines = (root / block.page).read_text().splitlines()
        before = "\n".join(lines[max(0, block.line - 2 - _EXTRA_WINDOW_LINES) : block.line - 1])
        for options in needed:
            if not any(f"[{extra}]" in before for extra in options):
                names = " or ".join(f"[{e}]" for e in options)
                missing.append(f"{block.name}: imports a package of the {'/'.join(options)} extra; the "
                               f"{_EXTRA_WINDOW_LINES} lines before it do not name {names}")
    assert checked, "no example imports an optional package: the check found nothing to check"
    assert not missing, "examples that need an extra without saying so:\n" + "\n".join(missing)


# ---- the README's commands -----------------------------------------------------------------------------------

_CPU_INDEX = "download.pytorch.org/whl/cpu"


def test_the_readme_warns_that_tox_installs_the_cuda_torch_and_shows_the_cpu_one():
    """Issue 52, defect 9: ``tox -e test`` (and ``-e conformance``) install ``torch==2.13.0`` (tox.ini, from
    ``HOSTOFFLOAD_TORCH_SPEC``); from a stock index that is the CUDA build with its CUDA libraries (gigabytes), and
    the README warned only for ``pip install .``. The README's part before its first section (where the two tox
    commands are) names the torch version tox pins, says it is the CUDA build from a stock index, and shows how to
    get the CPU wheel: the CPU index through pip's own variable (``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL``, which
    tox passes through) and the spec variable tox.ini reads."""
    root = _root()
    tox = (root / "tox.ini").read_text()
    m = re.search(r"torch\{env:(?P<var>\w+):(?P<spec>[^}]+)\}", tox)
    assert m, "tox.ini no longer installs torch{env:VAR:spec}: update this check"
    var, version = m.group("var"), m.group("spec").lstrip("=<>~! ")
    readme = (root / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    assert "tox -e test" in head, "the README's tox commands moved: update this check"
    missing = [what for what, ok in (
        (f"the version tox pins ({version})", version in head),
        ("that it is the CUDA build", "CUDA" in head),
        (f"the CPU index ({_CPU_INDEX})", _CPU_INDEX in head),
        ("pip's index variable", re.search(r"PIP_(EXTRA_)?INDEX_URL", head) is not None),
        (f"tox.ini's spec variable ({var})", var in head),
    ) if not ok]
    assert not missing, f"the README's tox commands come without: {', '.join(missing)}"
    assert re.search(rf"pass_env\s*=[^\[]*{var.split('_')[0]}_\*", tox), f"tox.ini does not pass {var} through"
