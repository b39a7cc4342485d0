"""Self-tests of the conformance harness: discovery and the report of a real suite run.

The other harness self-tests: test_activation (inert unless asked), test_usage_errors, test_report,
test_example_plugin (out-of-tree extension, default accelerator), test_profiles.

Each runs pytest in a child process, as a user or a vendor would, and reads what it printed or wrote.
"""

from __future__ import annotations

import json

import pytest

from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")


def test_list_shows_discovered_plugins(tmp_path):
    proc = run_pytest("--conformance-list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "implementations (hostoffload.implementations):" in out
    assert "reference" in out and "areas pinning" in out
    assert "cpu:" in out and "cuda:" in out


def test_report_matrix_is_written(tmp_path):
    """The report of a passing run. The implementation is named: without ``--conformance-impl`` the run would
    judge whatever else is installed in the environment too, and this test would fail with any imperfect one."""
    report = tmp_path / "report"
    proc = run_pytest(
        "--pyargs",
        "conformance.suite.test_accelerators_contract",
        "conformance.suite.test_pinning_api",
        "-k",
        "contract or bad_arguments or unpin_of_unpinned",
        "--conformance-profile",
        "ci",
        "--conformance-impl",
        "reference",
        "--conformance-report",
        str(report),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((report / "report.json").read_text())
    assert {"date", "versions", "hardware", "profile", "seed", "command", "duration_s", "totals", "matrix"} <= set(data)
    assert data["verdict"] == "passed" and data["profile"] == "ci" and data["seed"] is None
    assert data["implementations"] == ["reference"]
    cells = {(r["area"], r["implementation"], r["accelerator"]): r for r in data["matrix"]}
    assert cells[("pinning", "reference", "cpu")]["status"] == "passed"
    assert cells[("pinning", "reference", "cpu")]["passed"] > 0
    assert cells[("accelerator", "-", "-")]["status"] == "passed"
    md = (report / "report.md").read_text()
    assert "| pinning | reference | cpu | **passed** (" in md
    assert (report / "matrix.svg").read_text().startswith("<svg")
