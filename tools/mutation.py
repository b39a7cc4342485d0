"""Scoped mutation testing of the implementations: `tox -e mutation` (issue 50).

The conformance suite is the project's product, so its strength is measured here: Cosmic Ray's mutation operators
plant one small bug at a time in a module of `optimized/`, `reference/` or the harness's assertion helpers, and the
conformance tests that cover the mutated line run against it. A mutant that every selected test passes is a
survivor: either the suite has a blind spot (write the test that kills it) or the change is equivalent (record it
in tools/mutation_equivalents.toml with a one-line reason). Only a survivor that is neither killed nor recorded fails
the run, so the run can gate a change without re-judging old, reasoned survivors.

How a run goes, per module group (modules that share the same test modules in tools/mutation_targets.toml):
1. the tracked tree is copied to a scratch directory (the checkout is never mutated; an interrupted run leaves it
   as it was), with the native extension copied next to the copy's `optimized/` package;
2. the group's test modules run once, unmutated, under coverage with one coverage context per test: that run must
   pass, gives each test's duration, and maps each line to the tests that execute it;
3. each mutant runs only the tests that executed its line (a line no traced test executed, e.g. one that runs only
   in a worker process, runs the group's whole test modules), with a timeout from those tests' baseline time;
4. survivors go into mutation-report/report.md and report.json.

Cosmic Ray's own session database and scheduler are not used: they run one fixed test command for every mutant,
and this suite is too slow (torch start-up, engine runs) for that on the 2-core CI machine. The mutations
themselves are Cosmic Ray's (`cosmic_ray.mutating`), applied and restored by its context manager.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tox env installs tomli (tox.ini)
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "tools" / "mutation_targets.toml"
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.toml"
MUTABLE_ROOTS = ("optimized/", "reference/", "conformance/")
PYTEST_ARGS = (
    "-p", "no:cacheprovider", "--conformance-accelerator", "cpu", "--conformance-profile", "ci", "-q", "-x",
    "-o", "addopts=",
)  # fmt: skip


@dataclasses.dataclass
class Mutant:
    """One mutation: where it is, what it does, and (after the run) what the tests made of it."""

    path: str  # repository-relative
    operator: str
    occurrence: int
    line: int
    function: str
    before: str
    after: str
    diff: str
    outcome: str = "not run"  # killed | survived | equivalent | timeout | not run
    tests: int = 0
    seconds: float = 0.0
    reason: str = ""

    def key(self) -> tuple[str, str, str, str, str]:
        """What identifies the mutant across edits: file, function, operator and the mutated line's text."""
        return (self.path, self.function, self.operator, self.before.strip(), self.after.strip())


# ------------------------------------------------------------------------------------------------ configuration


def load_targets(path: Path = TARGETS) -> tuple[list[str], list[dict]]:
    """The default operator list and the module -> test modules table."""
    data = tomllib.loads(path.read_text())
    return list(data["operators"]), list(data["target"])


def load_equivalents(path: Path = EQUIVALENTS) -> dict[tuple[str, str, str, str, str], str]:
    """The survivors judged equivalent, keyed as `Mutant.key`; each entry must give its reason."""
    if not path.exists():
        return {}
    entries = tomllib.loads(path.read_text()).get("equivalent", [])
    out = {}
    for entry in entries:
        reason = entry.get("reason", "").strip()
        if not reason:
            raise SystemExit(f"{path}: an equivalent mutant has no reason: {entry}")
        key = (entry["file"], entry["function"], entry["operator"], entry["before"].strip(), entry["after"].strip())
        out[key] = reason
    return out


def tests_for(module: str, targets: list[dict]) -> list[str]:
    """The test modules (dotted) of every target entry whose glob matches the module's path."""
    tests: list[str] = []
    for entry in targets:
        if any(fnmatch.fnmatch(module, pattern) for pattern in entry["modules"]):
            tests += [t for t in entry["tests"] if t not in tests]
    return tests


def changed_modules(ref: str) -> list[str]:
    """Python files under the mutable roots that differ from `ref` (committed or not) and still exist."""
    names = subprocess.run(
        ["git", "diff", "--name-only", ref, "--", *MUTABLE_ROOTS], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return sorted(n for n in names if n.endswith(".py") and (ROOT / n).exists())


def changed_lines(ref: str, module: str) -> set[int]:
    """Line numbers of the module (as it is now) that the diff from `ref` adds or changes."""
    diff = subprocess.run(
        ["git", "diff", "-U0", ref, "--", module], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    lines: set[int] = set()
    for header in (h for h in diff.splitlines() if h.startswith("@@")):
        start, _, count = header.split("+", 1)[1].split(" ", 1)[0].partition(",")
        lines.update(range(int(start), int(start) + int(count or 1)))
    return lines


def resolve_module(name: str) -> str:
    """A repository-relative path from a path or a dotted module name."""
    if name.endswith(".py"):
        path = Path(name).resolve() if Path(name).exists() else ROOT / name
    else:
        base = ROOT / name.replace(".", "/")
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    rel = path.resolve().relative_to(ROOT).as_posix()
    if not (ROOT / rel).is_file():
        raise SystemExit(f"no such module: {name}")
    return rel


# ------------------------------------------------------------------------------------------------ scratch tree


def native_extensions() -> list[Path]:
    """The built extension modules: next to the checkout's `optimized/` (a developer build) or the installed ones."""
    local = sorted((ROOT / "optimized").glob("_native*.so"))
    if local:
        return local
    spec = importlib.util.find_spec("optimized")
    if spec is None or spec.origin is None:
        raise SystemExit("hostoffload is not installed and optimized/ has no built extension; build it first")
    return sorted(Path(spec.origin).parent.glob("_native*.so"))


def make_scratch(base: Path) -> Path:
    """A copy of the tracked tree (plus uncommitted edits) and the native extension, to mutate in place."""
    tree = base / "tree"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    for name in files:
        src = ROOT / name
        if src.is_file():
            dst = tree / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    for so in native_extensions():
        shutil.copy2(so, tree / "optimized" / so.name)
    return tree


def test_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The copy replaces the checkout on the path; other entries (where the tools were installed) stay.
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env.update(
        PYTHONPATH=os.pathsep.join([str(tree), *kept]),
        HOSTOFFLOAD_SOURCE_ROOT=str(tree),
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


# ------------------------------------------------------------------------------------------------ enumeration


def _skipped_spans(source: str) -> list[tuple[int, int, int, int]]:
    """Spans not worth mutating: annotations (never evaluated here), docstrings, `if TYPE_CHECKING:` blocks."""
    spans = []

    def span(node: ast.AST) -> tuple[int, int, int, int]:
        return (node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.annotation is not None:
            spans.append(span(node.annotation))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            spans.append(span(node.returns))
        elif isinstance(node, ast.AnnAssign):
            spans.append(span(node.annotation))
        elif isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            spans.append(span(node))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                first.value.value, str
            ):
                spans.append(span(first))
    return spans


def _inside(pos: tuple[int, int], spans: Iterable[tuple[int, int, int, int]]) -> bool:
    return any((l0, c0) <= pos < (l1, c1) for l0, c0, l1, c1 in spans)


def enumerate_mutants(tree: Path, module: str, operators: Sequence[str]) -> list[Mutant]:
    """Every mutation Cosmic Ray's operators make in the module, less annotations, docstrings and pragmas."""
    import cosmic_ray.plugins
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.ast.ast_query import ASTQuery
    from cosmic_ray.mutating import mutate_code

    path = tree / module
    source = path.read_text()
    lines = source.split("\n")
    spans = _skipped_spans(source)
    headers = _function_lines(source)
    seen: set[str] = set()
    mutants = []
    for name in operators:
        operator = cosmic_ray.plugins.get_operator(name)()
        module_ast = get_ast_from_path(path)
        positions = [(n, s) for n in ast_nodes(module_ast) for s, _ in operator.mutation_positions(n)]
        for occurrence, (node, start) in enumerate(positions):
            line = start[0]
            if _inside(start, spans) or "pragma: no mutate" in lines[line - 1]:
                continue
            mutated = mutate_code(source, operator, occurrence)
            if mutated is None or mutated in seen or mutated == source:
                continue
            seen.add(mutated)
            new_lines = mutated.split("\n")
            after = new_lines[line - 1] if len(new_lines) == len(lines) else _changed_text(lines, new_lines)
            if line in headers and "*" in lines[line - 1] and after.replace("/", "*") == lines[line - 1]:
                continue  # Cosmic Ray takes a signature's bare `*` for a product: `*` -> `/` only moves the marker
            mutants.append(
                Mutant(
                    path=module, operator=name, occurrence=occurrence, line=line,
                    function=ASTQuery(node).get_definition_name() or "<module>",
                    before=lines[line - 1], after=after, diff=_diff(lines, new_lines, module),
                )
            )  # fmt: skip
    mutants.sort(key=lambda m: (m.line, m.operator, m.occurrence))
    return mutants


def _changed_text(old: list[str], new: list[str]) -> str:
    import difflib

    return " / ".join(
        line[1:].strip() for line in difflib.unified_diff(old, new, lineterm="", n=0)
        if line.startswith("+") and not line.startswith("+++")
    )  # fmt: skip


def _diff(old: list[str], new: list[str], module: str) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(old, new, f"a/{module}", f"b/{module}", lineterm="", n=1))


# ------------------------------------------------------------------------------------------------ coverage baseline

_COVER_SCRIPT = r"""
import json, os, sys, time
import coverage, pytest
out, rcfile, sitedir, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# Worker processes the tests start (the rank pool spawns interpreters) start coverage from sitecustomize.py; this
# process starts its own, with one context per test.
os.environ["COVERAGE_PROCESS_START"] = rcfile
os.environ["PYTHONPATH"] = os.pathsep.join([sitedir, os.environ.get("PYTHONPATH", "")])
cov = coverage.Coverage(config_file=rcfile, context="")
durations, ids = {}, {}

def test_id(item):
    return item.path.as_posix() + "::" + item.nodeid.split("::", 1)[1]

class Contexts:
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cov.switch_context(test_id(item))
        with open(os.environ["MUTATION_CURRENT_TEST"], "w") as f:  # read by the workers (sitecustomize.py)
            f.write(test_id(item))
        self.start = time.monotonic()
    def pytest_runtest_logfinish(self, nodeid, location):
        durations[nodeid] = time.monotonic() - self.start
    def pytest_collection_modifyitems(self, items):
        ids.update((i.nodeid, test_id(i)) for i in items)

cov.start()
code = pytest.main(argv, plugins=[Contexts()])
cov.stop()
cov.save()
json.dump({"exit": int(code), "durations": {ids.get(k, k): v for k, v in durations.items()}}, open(out, "w"))
"""

_SITECUSTOMIZE = """
import os
import coverage

_cov = coverage.process_startup()
if _cov is not None:
    # A worker (the rank pool's) serves many tests: each message it receives is work for the test running now in
    # the test process, which names it in a file; the worker's coverage context follows.
    from multiprocessing import connection

    _recv = connection._ConnectionBase.recv

    def _recv_in_context(self):
        message = _recv(self)
        try:
            with open(os.environ["MUTATION_CURRENT_TEST"]) as f:
                _cov.switch_context(f.read())
        except OSError:
            pass
        return message

    connection._ConnectionBase.recv = _recv_in_context
    # the workers leave with os._exit, which skips coverage's atexit save
    _exit = os._exit

    def _save_then_exit(code):
        try:
            _cov.stop()
            _cov.save()
        finally:
            _exit(code)

    os._exit = _save_then_exit
"""


@dataclasses.dataclass
class Baseline:
    """What the unmutated runs of a group's test modules told: per line, the tests that ran it in the test process
    (test ids) or in a worker process (the test module's file: the pool is shared by its tests); per test, its time."""

    files: list[str]
    lines: dict[str, dict[int, set[str]]]
    durations: dict[str, float]
    startup: float


def baseline(tree: Path, modules: list[str], tests: list[str], work: Path) -> Baseline:
    """Run each test module once, unmutated, under coverage; it must pass."""
    import coverage

    sources = {str(tree / m): m for m in modules}
    lines: dict[str, dict[int, set[str]]] = {m: {} for m in modules}
    durations: dict[str, float] = {}
    files, startup = [], []
    sitedir = work / "site"
    sitedir.mkdir(exist_ok=True)
    (sitedir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    for index, test in enumerate(tests):
        run = work / f"baseline-{index}"
        run.mkdir(exist_ok=True)
        file = str(tree / (test.replace(".", "/") + ".py"))
        files.append(file)
        rcfile = run / "coveragerc"
        rcfile.write_text(
            f"[run]\ndata_file = {run / 'cov'}\nparallel = True\nsigterm = True\n"
            f"include =\n" + "".join(f"    {s}\n" for s in sources)
        )
        out = run / "result.json"
        cmd = [sys.executable, "-c", _COVER_SCRIPT, str(out), str(rcfile), str(sitedir), file, *PYTEST_ARGS]
        started = time.monotonic()
        env = dict(test_env(tree), MUTATION_CURRENT_TEST=str(run / "current-test"))
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        if proc.returncode != 0 or not out.exists() or json.loads(out.read_text())["exit"] != 0:
            sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-3000:])
            raise SystemExit(f"the unmutated tests fail ({test}): fix them before a mutation run")
        result = json.loads(out.read_text())
        durations.update(result["durations"])
        startup.append(max(0.0, elapsed - sum(result["durations"].values())))
        for part in run.glob("cov.*"):
            data = coverage.CoverageData(basename=str(part))
            try:
                data.read()
            except coverage.CoverageException as exc:  # a worker killed while it saved (a pool rebuilt)
                print(f"  baseline {test}: {part.name} unreadable, skipped ({exc})", flush=True)
                continue
            for source in data.measured_files():
                if source not in sources:
                    continue
                by_line = lines[sources[source]]
                for n, contexts in data.contexts_by_lineno(source).items():
                    # one context per test; a line run before any test (collection: the test module's imports
                    # and module-level code, e.g. a table of contract objects) is the whole test module's
                    by_line.setdefault(n, set()).update(c or file for c in contexts)
        print(f"  baseline {test}: {elapsed:.0f} s", flush=True)
    return Baseline(files, lines, durations, max(startup) if startup else 0.0)


def _function_lines(source: str) -> dict[int, tuple[int, int]]:
    """For each line of a def's header (decorators, signature), the span of its body: a default value or a
    decorator is evaluated at import, but what it changes shows where the body runs."""
    spans: dict[int, tuple[int, int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            head = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            for n in range(head, node.body[0].lineno):
                spans[n] = (node.body[0].lineno, node.end_lineno or node.body[0].lineno)
    return spans


# ------------------------------------------------------------------------------------------------ running


def run_mutant(tree: Path, work: Path, mutant: Mutant, base: Baseline, factor: float, floor: float,
               untraced_runs_all: bool = False) -> None:
    """Apply the mutant on disk (Cosmic Ray restores the file afterwards), run its tests, record the outcome.
    ``untraced_runs_all``: a line no traced test ran is run against every test module of the group (coverage does
    not follow every process a test starts, e.g. an engine built in a pool's worker), instead of being reported
    a survivor unrun."""
    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.plugins import get_operator

    selection = select_tests(tree, mutant, base)
    if not selection and untraced_runs_all:
        selection = list(base.files)
    mutant.tests = len(selection)
    if not selection:
        mutant.outcome = "survived"
        mutant.reason = "no test executes this line"
        return
    spent = sum(
        base.durations.get(t, 0.0) if "::" in t else sum(d for k, d in base.durations.items() if k.startswith(t))
        for t in selection
    )
    timeout = floor + base.startup * 1.5 + factor * spent
    command = [sys.executable, "-m", "pytest", *selection, *PYTEST_ARGS]
    started = time.monotonic()
    with use_mutation(tree / mutant.path, get_operator(mutant.operator)(), mutant.occurrence) as (_, mutated):
        if mutated is None:
            return
        mutant.outcome = _run_tests(command, work, test_env(tree), timeout)
    mutant.seconds = time.monotonic() - started


def select_tests(tree: Path, mutant: Mutant, base: Baseline) -> list[str]:
    """The tests that ran the mutated line (a def header: its body; module or class level: every test module),
    quickest first; a test module whose worker processes ran it is selected whole."""
    covered = base.lines.get(mutant.path, {})
    source = (tree / mutant.path).read_text()
    body = _function_lines(source).get(mutant.line)
    if body is not None:
        wanted = range(body[0], body[1] + 1)
    elif _in_function(source, mutant.line):
        wanted = range(mutant.line, mutant.line + 1)
    else:
        return list(base.files)
    found = set().union(*(covered.get(n, set()) for n in wanted))
    modules = sorted(t for t in found if "::" not in t)
    tests = [t for t in found if "::" in t and t.split("::")[0] not in modules]
    tests.sort(key=lambda t: base.durations.get(t, 0.0))
    return tests + modules


def _in_function(source: str, line: int) -> bool:
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.body[0].lineno <= line <= (n.end_lineno or 0)
        for n in ast.walk(ast.parse(source))
    )


def _run_tests(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """killed (non-zero exit), survived (exit 0) or timeout; a timed-out run's whole process group is killed."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"
    except BaseException:  # interrupted: the tests go with the run (their own session would outlive it)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code == 5:  # pytest: no test collected, so the selection is wrong, not the mutant caught
        raise SystemExit(f"no test collected by: {shlex.join(command)}")
    return "survived" if code == 0 else "killed"


# ------------------------------------------------------------------------------------------------ reporting


def summarize(mutants: list[Mutant]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for m in mutants:
        row = table.setdefault(m.path, dict.fromkeys(("total", "killed", "survived", "equivalent", "not run"), 0))
        row["total"] += 1
        row["killed" if m.outcome == "timeout" else m.outcome] += 1
    for row in table.values():
        judged = row["killed"] + row["survived"]
        row["score"] = round(100.0 * row["killed"] / judged, 1) if judged else 100.0
    return table


def write_report(out: Path, mutants: list[Mutant], command: str, stale: list[tuple]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = summarize(mutants)
    (out / "report.json").write_text(
        json.dumps({"command": command, "modules": table, "mutants": [dataclasses.asdict(m) for m in mutants]},
                   indent=1)
    )  # fmt: skip
    md = [f"# Mutation run\n\n`{command}`\n", "| module | mutants | killed | survived | equivalent | not run | score |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for path, row in sorted(table.items()):
        md.append(
            f"| {path} | {row['total']} | {row['killed']} | {row['survived']} | {row['equivalent']} | "
            f"{row['not run']} | {row['score']} % |"
        )
    survivors = [m for m in mutants if m.outcome == "survived"]
    md.append(f"\nScore: killed / (killed + new survivors), per module. {len(survivors)} new survivor(s).\n")
    for m in survivors:
        tests = m.reason or f"{m.tests} selected test(s) or test module(s)"
        md += [
            f"## {m.path}:{m.line} in `{m.function}` ({m.operator}; {tests})\n", "```diff", m.diff, "```\n",
            "To judge it equivalent, add to tools/mutation_equivalents.toml:\n", "```toml", "[[equivalent]]",
            f"file = {json.dumps(m.path)}", f"function = {json.dumps(m.function)}",
            f"operator = {json.dumps(m.operator)}", f"before = {json.dumps(m.before.strip())}",
            f"after = {json.dumps(m.after.strip())}", 'reason = ""', "```\n",
        ]  # fmt: skip
    if stale:
        md.append("## Equivalents that matched no mutant of a module that ran (edit or delete them)\n")
        md += [f"- {' | '.join(k)}" for k in stale]
    (out / "report.md").write_text("\n".join(md) + "\n")


# ------------------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/mutation.py")
    parser.add_argument("modules", nargs="*", help="module paths or dotted names (default: --since's files)")
    parser.add_argument("--since", metavar="REF", help="mutate the files changed since REF (unless modules are named)")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole run (default 3600)")
    parser.add_argument("--timeout-factor", type=float, default=3.0, help="per-mutant timeout: factor x baseline")
    parser.add_argument("--timeout-floor", type=float, default=20.0, help="per-mutant timeout: seconds added")
    parser.add_argument("--operators", help="comma-separated Cosmic Ray operator names (default: the targets file)")
    parser.add_argument("--changed-lines", action="store_true",
                        help="with --since: only mutants on lines added or changed since REF")  # fmt: skip
    parser.add_argument("--tests", help="comma-separated test modules (dotted) instead of the targets file's")
    parser.add_argument("--lines", help="only mutants on these lines, e.g. 10-40,77 (one module only)")
    parser.add_argument("--untraced", choices=("report", "run-all"), default="report",
                        help="a mutant on a line no traced test ran: report it a survivor unrun (default), or run "
                             "every test module of its group against it (for code that runs only in processes "
                             "coverage does not follow)")
    parser.add_argument("--report", default=str(ROOT / "mutation-report"), help="report directory")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    args = parser.parse_args(argv)

    operators, targets = load_targets()
    if args.operators:
        operators = args.operators.split(",")
    modules = [resolve_module(m) for m in args.modules] if args.modules else []
    if args.since and not modules:  # named modules: --since only says which lines --changed-lines keeps
        modules = changed_modules(args.since)
    if not modules:
        parser.error("name modules or give --since REF")
    if args.changed_lines and not args.since:
        parser.error("--changed-lines needs --since REF")
    groups: dict[tuple[str, ...], list[str]] = {}
    for module in modules:
        tests = args.tests.split(",") if args.tests else tests_for(module, targets)
        if not tests:
            print(f"mutation: {module}: no test modules in {TARGETS.name}; skipped (add an entry)", file=sys.stderr)
            continue
        groups.setdefault(tuple(tests), []).append(module)
    equivalents = load_equivalents()
    command = "tools/mutation.py " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    deadline = time.monotonic() + args.budget
    work = Path(tempfile.mkdtemp(prefix="hostoffload-mutation-"))
    all_mutants: list[Mutant] = []
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated run still reports what it ran
    interrupted = False
    try:
        run_groups(args, groups, operators, equivalents, work, deadline, all_mutants)
    except KeyboardInterrupt:
        interrupted = True
        print("mutation: interrupted; reporting what ran", file=sys.stderr)
    finally:
        if args.keep:
            print(f"mutation: scratch copy kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ran = {m.path for m in all_mutants if m.outcome != "not run"}
    present = {m.key() for m in all_mutants}
    stale = [k for k in equivalents if k[0] in ran and k not in present]
    write_report(Path(args.report), all_mutants, command, stale)
    table = summarize(all_mutants)
    for path, row in sorted(table.items()):
        print(f"mutation: {path}: {row['killed']} killed / {row['killed'] + row['survived']} ({row['score']} %), "
              f"{row['equivalent']} equivalent, {row['not run']} not run")  # fmt: skip
    print(f"mutation: report in {args.report}/report.md")
    if args.list:
        return 0
    if interrupted:
        return 130
    if any(m.outcome == "survived" for m in all_mutants):
        return 1
    if any(m.outcome == "not run" for m in all_mutants):
        print("mutation: the time budget ran out before every mutant ran", file=sys.stderr)
        return 2
    return 0


def run_groups(args, groups, operators, equivalents, work: Path, deadline: float, all_mutants: list[Mutant]) -> None:
    """Enumerate, baseline and run each module group in a scratch copy under `work`, into `all_mutants`."""
    tree = make_scratch(work)
    for tests, group in groups.items():
        mutants = [m for module in group for m in enumerate_mutants(tree, module, operators)]
        if args.lines:
            wanted = {n for part in args.lines.split(",") for n in _line_range(part)}
            mutants = [m for m in mutants if m.line in wanted]
        if args.changed_lines:
            changed = {module: changed_lines(args.since, module) for module in group}
            mutants = [m for m in mutants if m.line in changed[m.path]]
        for m in mutants:
            if m.key() in equivalents:
                m.outcome, m.reason = "equivalent", equivalents[m.key()]
        all_mutants += mutants
        print(f"mutation: {', '.join(group)}: {len(mutants)} mutants; tests: {' '.join(tests)}", flush=True)
        if args.list:
            for m in mutants:
                print(f"  {m.path}:{m.line} {m.operator} {m.function}: {m.after.strip()}")
            continue
        if not any(m.outcome == "not run" for m in mutants):
            continue
        base = baseline(tree, group, list(tests), work)
        for m in mutants:
            if m.outcome == "equivalent":
                continue
            if time.monotonic() > deadline:
                break
            run_mutant(tree, work, m, base, args.timeout_factor, args.timeout_floor, args.untraced == "run-all")
            print(f"  {m.outcome:9} {m.path}:{m.line} {m.operator} ({m.seconds:.1f} s)", flush=True)


def _line_range(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


if __name__ == "__main__":
    sys.exit(main())
