"""Item 3: the report is honest, complete and reproducible, and the run ends with its verdict and the report paths.

The status rules are checked on the collector directly; the rest on a real conformance run of a small suite
written here (one test passes, one fails, one errors in setup, one skips, one checks nothing but skips in every
cell), so the counts come from pytest's own reports, not from numbers the test made up.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from conformance.harness.report import ReportCollector, build_report, render_markdown
from conformance.selftest.runner import child_env, last_lines, run_pytest

pytestmark = pytest.mark.conformance_area("harness")


def _statuses(outcomes: list[str]) -> str:
    collector = ReportCollector()
    for i, outcome in enumerate(outcomes):
        collector.record(("a", "i", "x"), outcome, f"t{i}", "why" if outcome == "skipped" else None, message="boom")
    return build_report(collector, {})["matrix"][0]["status"]


@pytest.mark.parametrize(
    ("outcomes", "status"),
    [
        (["passed"] + ["skipped"] * 47, "passed"),
        (["skipped"] * 48, "skipped"),
        (["xfailed", "skipped"], "skipped"),
        (["passed", "failed", "skipped"], "failed"),
        (["passed", "errors"], "failed"),
        (["errors", "skipped"], "failed"),
    ],
    ids=["1-passed-47-skipped", "all-skipped", "only-xfailed", "a-failure", "an-error", "error-among-skips"],
)
def test_cell_status_rules(outcomes, status):
    assert _statuses(outcomes) == status


def test_markdown_shows_how_much_of_a_passed_cell_ran():
    collector = ReportCollector()
    collector.record(("pinning", "x", "cpu"), "passed", "t")
    for i in range(47):
        collector.record(("pinning", "x", "cpu"), "skipped", f"s{i}", "not declared")
    md = render_markdown(build_report(collector, {"profile": "ci", "seed": None}))
    row = "| pinning | x | cpu | **passed** (1 of 48 ran) | 1 | 0 | 0 | 47 | 0 / 0 / 0 | 0 | not declared (x47) |"
    assert row in md


def test_ran_counts_each_test_that_errored_once():
    """Errors ran: a setup error is a test that ran to a verdict, and a test that passed then errored in teardown
    is one test (pytest counts it as one passed and one error; the counts columns say so, ran and total do not
    double it)."""
    collector = ReportCollector()
    key = ("pinning", "x", "cpu")
    collector.record(key, "errors", "setup_error", when="setup", message="boom")
    collector.record(key, "passed", "teardown_error")
    collector.record(key, "errors", "teardown_error", when="teardown", message="boom")
    collector.record(key, "failed", "fails", message="boom")
    collector.record(key, "skipped", "skips", "why")
    row = build_report(collector, {})["matrix"][0]
    assert (row["passed"], row["failed"], row["errors"], row["skipped"]) == (1, 1, 2, 1), row
    assert (row["ran"], row["total"]) == (3, 4), row
    assert "**failed** (3 of 4 ran) | 1 | 1 | 2 | 1 |" in render_markdown(build_report(collector, {}))


_SMALL_SUITE = '''
import pytest
from hypothesis import given, settings, strategies as st

pytestmark = pytest.mark.conformance_area("pinning")

@pytest.fixture
def broken_fixture():
    raise RuntimeError("fixture exploded on purpose")

def test_passes(impl, accelerator):
    assert impl.name

def test_fails(impl, accelerator):
    assert impl.name == "nobody", f"marker-line-1 for {impl.name}\\nmarker-line-2"

def test_errors(impl, broken_fixture):
    pass

def test_skips(impl):
    pytest.skip("nothing to see")

@settings(database=None)
@given(st.integers(0, 2**62))
def test_drawn(impl, x):
    import os
    if impl.name == "reference":
        with open(os.environ["DRAWN_FILE"], "a") as f:
            f.write(f"{x}\\n")
'''


def test_run_report_counts_failures_with_messages_and_reruns(tmp_path):
    suite = tmp_path / "test_small_suite.py"
    suite.write_text(_SMALL_SUITE)
    report = tmp_path / "report"
    drawn = tmp_path / "drawn.txt"
    proc = run_pytest(
        str(suite),
        "--conformance-accelerator", "cpu",
        "--conformance-impl", "reference",
        "--conformance-profile", "dev",
        "--conformance-report", str(report),
        env={"DRAWN_FILE": str(drawn)},
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    cell = {(r["area"], r["implementation"], r["accelerator"]): r for r in data["matrix"]}
    row = cell[("pinning", "reference", "cpu")]
    assert (row["status"], row["passed"], row["failed"], row["errors"]) == ("failed", 1, 1, 0), row
    errored = cell[("pinning", "reference", "-")]
    assert errored["errors"] == 1 and errored["skipped"] == 1 and errored["status"] == "failed", errored
    assert data["verdict"] == "failed"
    assert data["totals"]["passed"] == 2 and data["totals"]["failed"] == 1 and data["totals"]["errors"] == 1
    assert data["command"].startswith("pytest ") and "--conformance-profile dev" in data["command"]
    assert data["profile"] == "dev" and isinstance(data["seed"], int) and data["duration_s"] > 0

    failures = {f["nodeid"].split("::")[-1]: f for r in data["matrix"] for f in r["failures"]}
    fail = failures["test_fails[impl=reference-acc=cpu]"]
    assert "marker-line-1 for reference" in fail["message"] and "marker-line-2" in fail["message"], fail
    assert failures["test_errors[impl=reference]"]["when"] == "setup"
    assert "fixture exploded on purpose" in failures["test_errors[impl=reference]"]["message"]
    md = (report / "report.md").read_text()
    assert "**Verdict: failed**" in md and "marker-line-1 for reference" in md and fail["reproduce"] in md
    assert f"seed: {data['seed']}" in md and "duration:" in md

    # The run ends with the verdict and the report paths, after pytest's own summary.
    tail = last_lines(proc.stdout, 2)
    assert tail[0].startswith("hostoffload conformance: FAILED (2 passed, 1 failed, 1 errors"), tail
    assert tail[1] == f"conformance report: {report / 'report.md'} and {report / 'report.json'}", tail

    # The rerun command reproduces the failure, and its seed reproduces the random run's examples.
    first_draws = drawn.read_text().splitlines()
    assert f"--hypothesis-seed={data['seed']}" in fail["reproduce"]
    drawn.unlink()
    rerun_drawn = shlex.split(failures["test_fails[impl=reference-acc=cpu]"]["reproduce"])
    rerun_drawn[rerun_drawn.index("test_fails")] = "test_drawn"
    rerun = subprocess.run(
        [sys.executable, *rerun_drawn[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=child_env({"DRAWN_FILE": str(drawn)}),
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-2000:]
    assert drawn.read_text().splitlines() == first_draws
    rerun = subprocess.run(
        [sys.executable, *shlex.split(fail["reproduce"])[1:]], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=child_env({"DRAWN_FILE": str(drawn)}),
    )
    assert rerun.returncode == 1 and "marker-line-1 for reference" in rerun.stdout, rerun.stdout[-3000:]
    summary = next(line for line in reversed(rerun.stdout.splitlines()) if line.startswith("===="))
    assert "1 failed" in summary and "passed" not in summary, rerun.stdout[-1000:]
