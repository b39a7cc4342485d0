"""An isolated test's reports, carried from its child process back into the parent as pytest made them.

Whatever consumes reports in the parent (the terminal summary's ``-r`` lines, ``--junitxml``, ``--lf``, the
conformance report, a plugin reading ``longrepr``) must not be able to tell that a test ran in a child. So a
report crosses the process boundary through pytest's own serialization (``pytest_report_to_serializable`` /
``pytest_report_from_serializable``, what pytest-xdist uses): exception reprs, sections, durations, ``wasxfail``
and user properties come back as pytest rebuilds them; the warnings pytest recorded in the child come back too,
for the parent's warnings summary. The one thing JSON loses on the way, and xdist's transport
keeps, is the difference between a tuple and a list: a skip's ``longrepr`` is the tuple ``(path, line, reason)``,
which pytest's skip summary and junitxml writer assert on, and ``location``, ``sections`` and user properties are
tuples too. Each line this module writes therefore marks tuples, and reading it makes them tuples again.

Two reports do not come from the child's pytest:

- the crash report: when the child died (signal, ``exit()``, timeout), the phase that was running fails with
  what happened and the child's last output lines;
- the parent's teardown: the parent's own fixtures of a wider scope (module, session) end where the next test no
  longer needs them, as they would after an in-process test; what that teardown reports (its failure, its
  captured output) is folded into the test's teardown report, the one report of that phase pytest would show.
"""

from __future__ import annotations

import importlib
import json
import signal
import warnings
from typing import Any, Literal

import pytest

#: The key that marks a tuple in a report line (a dict with only this key is a tuple).
_TUPLE_KEY = "__hostoffload_tuple__"
#: How many of the child's last output lines a crash report quotes.
TAIL_LINES = 30


def _mark_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE_KEY: [_mark_tuples(v) for v in value]}
    if isinstance(value, list):
        return [_mark_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: _mark_tuples(v) for k, v in value.items()}
    return value


def _restore_tuple(obj: dict) -> Any:
    if len(obj) == 1 and _TUPLE_KEY in obj:
        return tuple(obj[_TUPLE_KEY])
    return obj


def encode_report(config: pytest.Config, report: pytest.TestReport) -> str:
    """One line: the report as pytest serializes it, tuples marked. A value JSON cannot hold (a user property
    that is an arbitrary object) travels as its ``str``, which is all junitxml would write of it anyway."""
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    return json.dumps({"report": _mark_tuples(data)}, default=str)


def encode_warning(warning_message: warnings.WarningMessage, when: str, nodeid: str) -> str:
    """One line: a warning pytest recorded in the child (``pytest_warning_recorded``), for the parent's summary."""
    category = warning_message.category
    return json.dumps({"warning": {
        "message": str(warning_message.message), "category": f"{category.__module__}:{category.__qualname__}",
        "filename": warning_message.filename, "lineno": warning_message.lineno, "line": warning_message.line,
        "when": when, "nodeid": nodeid,
    }})


def _warning_category(name: str) -> type[Warning]:
    module, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return UserWarning
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


def _warning_kwargs(data: dict) -> dict[str, Any]:
    """The keyword arguments of ``pytest_warning_recorded`` for a warning of :func:`encode_warning`."""
    category = _warning_category(data["category"])
    try:
        message = category(data["message"])
    except Exception:  # a category whose constructor wants more than a message
        category, message = UserWarning, UserWarning(data["message"])
    warning = warnings.WarningMessage(message, category, data["filename"], data["lineno"], None, data["line"])
    return {"warning_message": warning, "when": data["when"], "nodeid": data["nodeid"], "location": None}


def decode_lines(config: pytest.Config, text: str) -> tuple[list[pytest.TestReport], list[dict[str, Any]]]:
    """The reports (rebuilt by pytest) and the warnings (``pytest_warning_recorded`` keyword arguments) of the
    lines of ``text``, written by :func:`encode_report` and :func:`encode_warning`."""
    reports, recorded = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        entry = json.loads(line, object_hook=_restore_tuple)
        if "warning" in entry:
            recorded.append(_warning_kwargs(entry["warning"]))
            continue
        rep = config.hook.pytest_report_from_serializable(config=config, data=entry["report"])
        if isinstance(rep, pytest.TestReport):
            reports.append(rep)
    return reports, recorded


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (signal {-returncode})"
    return f"exited with status {returncode} before reporting"


def output_tail(output: str) -> list[str]:
    """The child's last output lines; where faulthandler dumped a crash, the lines the child printed before it
    and the innermost frames of the dump (most recent call first), without its list of extension modules."""
    lines = [line for line in output.splitlines() if not line.startswith("Extension modules:")]
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return lines[max(0, i - TAIL_LINES // 3) : i] + lines[i : i + TAIL_LINES - TAIL_LINES // 3]
    return lines[-TAIL_LINES:]


def child_reports(
    item: pytest.Item, reports: list[pytest.TestReport], output: str, returncode: int | None, *, child: str,
    timeout_s: float, attach_output: bool,
) -> list[pytest.TestReport]:
    """The child's reports, each noting which kind of ``child`` ran it (attribute ``isolated_in``, which no
    consumer of reports writes out); if the child died before its teardown report, the phase that was running
    fails with how it died and the child's last output lines (``attach_output``: also where it did not die, for a
    child whose output pytest did not capture)."""
    tail = output_tail(output)
    whens = {r.when for r in reports}
    if returncode is not None and "teardown" in whens:
        if attach_output and tail:
            for rep in reports:
                rep.sections.append(("isolated child output", "\n".join(tail)))
        out = reports
    else:
        how = f"timed out after {timeout_s:g}s" if returncode is None else describe_exit(returncode)
        phase: Literal["setup", "call", "teardown"] = (
            "setup" if not whens else ("call" if "call" not in whens else "teardown")
        )
        message = (
            f"the isolated child ({child}) running {item.path.name}::{item.name} {how} during {phase}; "
            f"its last output lines:\n" + ("\n".join(tail) if tail else "(none)")
        )
        crash = pytest.TestReport(
            nodeid=item.nodeid, location=item.location, keywords={k: 1 for k in item.keywords},
            outcome="failed", longrepr=message, when=phase, sections=[], duration=0.0,
        )
        out = [*(r for r in reports if r.when != phase), crash]
    for rep in out:
        rep.isolated_in = child  # type: ignore[attr-defined]
    return out


def with_parent_teardown(
    reports: list[pytest.TestReport], parent: pytest.TestReport
) -> list[pytest.TestReport]:
    """``reports`` (the child's, ending with its teardown unless it died) with the parent's ``teardown`` report
    folded in, so that the test has exactly one teardown report, as in-process: the parent's where the child has
    none (it died earlier) or the child's passed; else the child's failed one, the parent's captured output and
    any failure of the parent's teardown added as sections."""
    child_teardown = next((r for r in reports if r.when == "teardown"), None)
    if reports:  # junitxml writes a test's properties from its teardown report
        parent.user_properties = list(reports[-1].user_properties)
    if child_teardown is None:
        return [*reports, parent]
    if parent.failed and child_teardown.passed:
        parent.sections = [*child_teardown.sections, *parent.sections]
        parent.duration += child_teardown.duration
        return [parent if r is child_teardown else r for r in reports]
    child_teardown.sections.extend(parent.sections)
    if parent.failed:
        child_teardown.sections.append(("teardown in the parent process", parent.longreprtext))
    return reports
