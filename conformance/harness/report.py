"""The conformance report: area x implementation x accelerator -> passed / failed / skipped, and the run's verdict.

It is what a vendor attaches to a port and what the main job prints at the end, so it records enough to judge and
to reproduce the run: the command line, profile, hypothesis seed, duration, versions, hardware, the selection, the
outcome counts and skip reasons per cell, and each failure with its message and the command that reruns it.

A cell's status is honest about what ran: ``failed`` if any test failed or errored, ``skipped`` if nothing ran
(every test skipped, or only expected failures), ``passed`` only if something passed and nothing failed. The
markdown shows the ran/total counts next to the status, so "passed, 1 of 48 ran" cannot hide behind "passed". The
outcome counts are pytest's (a test that passes and errors in teardown is one passed and one error, as in pytest's
summary); ran and total count tests.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.harness.rule_ledger import RuleLedger, compact

#: What a test's report can count as, in the order the report lists them. ``xfailed`` / ``xpassed``: tests marked
#: as expected to fail (by the suite, or listed in ``--conformance-xfails``) that failed / passed;
#: ``xpassed_strict``: a listed test that passed in a strict run, which fails the run; ``skipped_by_file``: tests
#: listed in ``--conformance-skips``, apart from the suite's own skips (conformance/harness/expectations.py).
OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "xpassed_strict", "skipped_by_file")
#: Outcomes of a test that did not run to a verdict of its own.
NOT_RUN = ("skipped", "skipped_by_file")
#: How pytest's message for a strict expected failure that passed begins.
XPASS_STRICT = "[XPASS(strict)]"
#: Lines of a failure's message kept in the report (the full traceback is in pytest's output).
MESSAGE_LINES = 8
MESSAGE_CHARS = 1200


@dataclass
class Failure:
    nodeid: str
    when: str
    message: str
    reproduce: str
    #: The id an xfails or skips file lists this test by (conformance.harness.expectations), whatever pytest's node id.
    test_id: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"nodeid": self.nodeid, "id": self.test_id or self.nodeid, "when": self.when, "message": self.message,
                "reproduce": self.reproduce}


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0
    xpassed: int = 0
    xpassed_strict: int = 0
    skipped_by_file: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    #: Each test of the cell (node id) -> whether it ran to a verdict of its own (any outcome but a skip).
    tests: dict[str, bool] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.failed or self.errors or self.xpassed_strict:
            return "failed"
        if self.passed or self.xpassed:
            return "passed"
        return "skipped"

    @property
    def ran(self) -> int:
        """Tests that ran to a verdict of their own (not skipped): an error in setup is one, and a test that
        passed and then errored in teardown is one test, though pytest counts it once passed and once an error."""
        return sum(self.tests.values())

    @property
    def total(self) -> int:
        """Tests of the cell, each counted once whatever its phases reported."""
        return len(self.tests)


def first_lines(text: str, lines: int = MESSAGE_LINES, chars: int = MESSAGE_CHARS) -> str:
    """The head of a failure message: enough to see what broke, short enough for a table of failures."""
    kept = text.strip().splitlines()[:lines]
    out = "\n".join(kept)
    if len(out) > chars:
        out = out[:chars].rstrip() + " ..."
    elif len(text.strip().splitlines()) > lines:
        out += "\n..."
    return out


class ReportCollector:
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], Cell] = defaultdict(Cell)
        self.properties: dict[str, int] = defaultdict(int)
        self.ledger = RuleLedger()

    def record(
        self,
        key: tuple[str, str, str],
        outcome: str,
        nodeid: str,
        reason: str | None = None,
        *,
        when: str = "call",
        message: str = "",
        reproduce: str = "",
        rules: tuple[str, ...] = (),
        test_id: str = "",
    ) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome={outcome!r} is not allowed; allowed values: {', '.join(OUTCOMES)}")
        cell = self.cells[key]
        setattr(cell, outcome, getattr(cell, outcome) + 1)
        cell.tests[nodeid] = cell.tests.get(nodeid, False) or outcome not in NOT_RUN
        if outcome == "skipped" and reason:
            cell.skip_reasons[reason] = cell.skip_reasons.get(reason, 0) + 1
        if outcome in ("failed", "errors", "xpassed_strict"):
            cell.failures.append(Failure(nodeid, when, first_lines(message), reproduce, test_id))
        self.ledger.record(nodeid, rules, outcome, reason)

    def add_property(self, name: str, value: int) -> None:
        self.properties[name] += value


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "cpu_count": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # pragma: no cover - report must never fail the run
        pass
    return info


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "hypothesis", "pytest"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover
            out[mod] = "missing"
    try:
        from importlib.metadata import version

        out["hostoffload"] = version("hostoffload")
    except Exception:  # pragma: no cover
        out["hostoffload"] = "not installed"
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Test outcomes summed over every cell, and how many cells have each status."""
    out: dict[str, Any] = {o: sum(r[o] for r in rows) for o in OUTCOMES}
    out["cells"] = {s: sum(1 for r in rows if r["status"] == s) for s in ("passed", "failed", "skipped")}
    return out


def verdict(report: dict[str, Any]) -> str:
    """``failed`` if anything failed or errored (or pytest itself did), ``skipped`` if nothing ran, else ``passed``."""
    t = report["totals"]
    if t["failed"] or t["errors"] or t.get("xpassed_strict") or report.get("exit_status", 0) not in (0, 5):
        return "failed"
    if not (t["passed"] or t["xpassed"]):
        return "skipped"
    return "passed"


def build_report(collector: ReportCollector, meta: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for (area, impl, acc), cell in sorted(collector.cells.items()):
        rows.append(
            {
                "area": area,
                "implementation": impl,
                "accelerator": acc,
                "status": cell.status,
                **{o: getattr(cell, o) for o in OUTCOMES},
                "ran": cell.ran,
                "total": cell.total,
                "skip_reasons": cell.skip_reasons,
                "failures": [f.as_dict() for f in cell.failures],
            }
        )
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "hardware": hardware(),
        **meta,
        "properties": dict(collector.properties),
        "rules": collector.ledger.summary((meta.get("suite") or {}).get("rule_set")),
        "totals": totals(rows),
        "matrix": rows,
    }
    report["verdict"] = verdict(report)
    return report


def totals_line(report: dict[str, Any]) -> str:
    t = report["totals"]
    counts = ", ".join(f"{t[o]} {o}" for o in OUTCOMES if t[o] or o in ("passed", "failed", "skipped"))
    cells = ", ".join(f"{n} {s}" for s, n in t["cells"].items())
    return f"{counts}; cells: {cells}"


def _status_text(r: dict[str, Any]) -> str:
    return f"**{r['status']}** ({r['ran']} of {r['total']} ran)"


def _unjudged_lines(report: dict[str, Any]) -> list[str]:
    """The top of the report: every optional package whose absence left tests unrun, with the rules it left
    unjudged; then the rules no test of this run judged at all, whatever the reason."""
    rules = report.get("rules") or {}
    lines: list[str] = []
    for package, entry in (rules.get("missing_packages") or {}).items():
        parts = []
        if entry["rules_not_judged"]:
            parts.append(f"not judged: {', '.join(entry['rules_not_judged'])}")
        if entry["rules_partly_judged"]:
            parts.append(f"partly judged (other tests of them ran): {', '.join(entry['rules_partly_judged'])}")
        if entry["tests_citing_no_rule"]:
            parts.append(f"{entry['tests_citing_no_rule']} test(s) citing no rule")
        lines.append(f"- **optional package `{package}` is missing**: {entry['tests']} test(s) not run; "
                     f"{'; '.join(parts)}. Why: {entry['reason']}")
    if lines:
        lines = ["## Not judged: missing optional packages", "", *lines, ""]
    if rules.get("rules_not_judged"):
        lines += [f"Rules no test of this run judged (not declared, not available here or not selected; the "
                  f"matrix gives each skip's reason): {compact(rules['rules_not_judged'])}", ""]
    return lines


def _expectation_lines(report: dict[str, Any]) -> list[str]:
    exp = report.get("expectations") or {}
    lines = []
    for name in ("xfails", "skips"):
        if name in exp:
            f = exp[name]
            how = (" (strict: a listed test that passes fails the run)" if exp.get("strict") else
                   " (non-strict: a listed test that passes is reported, the run does not fail)") \
                if name == "xfails" else ""
            lines.append(f"- {name} file: `{f['file']}`, {f['entries']} entries, {f['matched_entries']} matched{how}")
            lines += [f"  - **warning**: `{u}` matches no collected test" for u in f["unmatched"]]
    return lines


def render_markdown(report: dict[str, Any], image: str | None = None) -> str:
    seed = report.get("seed")
    suite = report.get("suite") or {}
    lines = [
        "# hostoffload conformance report",
        "",
        f"**Verdict: {report['verdict']}** - {totals_line(report)}",
        "",
        f"**Judged by:** hostoffload conformance suite {suite.get('version', '?')}, tests digest "
        f"`{suite.get('digest', '?')}`, rule set {suite.get('rule_set_compact', '?')}",
        "",
        *_unjudged_lines(report),
        *_expectation_lines(report),
        f"- command: `{report.get('command', '')}`",
        f"- hypothesis profile: {report.get('profile')}; seed: {seed if seed is not None else 'derandomized'}",
        f"- duration: {report.get('duration_s', 0):.1f} s; pytest exit status: {report.get('exit_status')}",
        f"- date: {report['date']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
        f"- rules read from: {suite.get('rules_source', '?')}",
        f"- hardware: {json.dumps(report['hardware'])}",
        f"- implementations: {', '.join(report.get('implementations', []))}",
        f"- accelerators: {', '.join(report.get('accelerators', []))}"
        + (f" (not available here: {', '.join(report['unavailable_accelerators'])})"
           if report.get("unavailable_accelerators") else ""),
    ]
    for name, value in report.get("properties", {}).items():
        lines.append(f"- {name}: {value}")
    if image:
        lines += ["", f"![area x implementation x accelerator]({image})"]
    lines += [
        "",
        "| area | implementation | accelerator | status | passed | failed | errors | skipped | expected failures "
        "(xfailed / xpassed / strict xpassed) | skipped by file | skip reasons |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["matrix"]:
        reasons = "; ".join(f"{k} (x{v})" for k, v in r["skip_reasons"].items())
        lines.append(
            f"| {r['area']} | {r['implementation']} | {r['accelerator']} | {_status_text(r)} | {r['passed']} | "
            f"{r['failed']} | {r['errors']} | {r['skipped']} | {r['xfailed']} / {r['xpassed']} / "
            f"{r['xpassed_strict']} | {r['skipped_by_file']} | {reasons.replace('|', '/')} |"
        )
    failures = [f for r in report["matrix"] for f in r["failures"]]
    if failures:
        lines += ["", f"## Failures ({len(failures)})"]
        for f in failures:
            kind = "error in " + f["when"] if f["when"] != "call" else "failed"
            if f["message"].startswith(XPASS_STRICT):
                kind = "listed as an expected failure, but passed"
            lines += ["", f"### `{f['nodeid']}` ({kind})", "", "```", f["message"] or "(no message)", "```", ""]
            lines += ["Reproduce:", "", "```bash", f["reproduce"], "```"]
            if f.get("id"):
                lines += ["", f"Id for `--conformance-xfails` / `--conformance-skips`: `{f['id']}`"]
    return "\n".join(lines) + "\n"


_COLOURS = {"passed": "#2e7d32", "failed": "#c62828", "skipped": "#9e9e9e"}


def render_svg(report: dict[str, Any]) -> str:
    """The matrix as an image: one row per area, one column per implementation/accelerator pair, coloured."""
    rows = report["matrix"]
    areas = sorted({r["area"] for r in rows})
    columns = sorted({(r["implementation"], r["accelerator"]) for r in rows})
    by_key = {(r["area"], r["implementation"], r["accelerator"]): r for r in rows}
    cw, ch, left, top = 130, 28, 110, 46
    width, height = left + cw * len(columns) + 10, top + ch * len(areas) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for j, (impl, acc) in enumerate(columns):
        x = left + cw * j + cw / 2
        out.append(f'<text x="{x}" y="18" text-anchor="middle">{html.escape(impl)}</text>')
        out.append(f'<text x="{x}" y="34" text-anchor="middle" fill="#555">{html.escape(acc)}</text>')
    for i, area in enumerate(areas):
        y = top + ch * i
        out.append(f'<text x="{left - 6}" y="{y + ch / 2 + 4}" text-anchor="end">{html.escape(area)}</text>')
        for j, col in enumerate(columns):
            r = by_key.get((area, *col))
            x = left + cw * j
            if r is None:
                out.append(f'<rect x="{x + 1}" y="{y + 1}" width="{cw - 2}" height="{ch - 2}" fill="#f5f5f5"/>')
                continue
            out.append(
                f'<rect x="{x + 1}" y="{y + 1}" width="{cw - 2}" height="{ch - 2}" fill="{_COLOURS[r["status"]]}"/>'
            )
            label = f"{r['status']} {r['ran']}/{r['total']}"
            expected = r.get("xfailed", 0) + r.get("xpassed", 0) + r.get("xpassed_strict", 0)
            if expected:
                label += f", {expected} xfail"
            if r.get("skipped_by_file"):
                label += f", {r['skipped_by_file']} listed skip"
            out.append(f'<text x="{x + cw / 2}" y="{y + ch / 2 + 4}" text-anchor="middle" fill="white">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def check_report_dir(path: str | os.PathLike[str]) -> Path:
    """Create the report folder and prove it is writable, before any test runs; OSError says why not."""
    folder = Path(path).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-probe-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
    return folder


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``<path>/report.json``, ``<path>/report.md`` and the matrix image ``<path>/matrix.svg``."""
    folder = check_report_dir(path)
    json_path, md_path, svg_path = folder / "report.json", folder / "report.md", folder / "matrix.svg"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    svg_path.write_text(render_svg(report))
    md_path.write_text(render_markdown(report, image=svg_path.name))
    return json_path, md_path
