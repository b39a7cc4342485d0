"""The harness judging implementations it has never seen: each deliberately broken plugin of
``conformance.selftest.plugins`` is flagged by the right test, and the run still completes with its report.

The plugins are registered as an installed package would be: a ``*.dist-info`` directory with an
``entry_points.txt`` on ``PYTHONPATH`` (nothing is installed into the environment). Each check runs pytest in a
child process, as a vendor would, and reads the report it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.selftest.plugins import ENTRY_POINTS
from conformance.selftest.test_harness import run_pytest

pytestmark = pytest.mark.conformance_area("harness")


def _plugin_path(tmp_path: Path) -> dict[str, str]:
    """A throw-away distribution declaring the self-test plugins under hostoffload.implementations."""
    import os

    site = tmp_path / "site"
    info = site / "hostoffload_selftest_plugins-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostoffload-selftest-plugins\nVersion: 0.0.0\n")
    lines = ["[hostoffload.implementations]", *(f"{k} = {v}" for k, v in ENTRY_POINTS.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def _run(tmp_path: Path, impl: str, *args: str):
    report = tmp_path / "report"
    proc = run_pytest(
        *args, "--conformance-impl", impl, "--conformance-accelerator", "cpu", "--conformance-profile", "ci",
        "--conformance-report", str(report), "-rfE", env=_plugin_path(tmp_path), cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert (report / "report.json").exists(), f"the run wrote no report:\n{text[-4000:]}"
    return proc, text, json.loads((report / "report.json").read_text())


def _failed(text: str) -> set[str]:
    """Names of the tests reported FAILED (call) or ERROR (setup/teardown, where leak checks report)."""
    return {
        line.split()[1].split("::")[-1].split("[")[0]
        for line in text.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    }


def test_abort_in_pin_empty_fails_one_test_and_the_run_completes(tmp_path):
    """A native abort() in pin_empty is one failed test naming SIGABRT and the child's last output; tests of
    the same implementation that do not call pin_empty still pass, and the report is written."""
    proc, text, data = _run(
        tmp_path, "selftest-abort", "--pyargs", "conformance.suite.test_pinning_api",
        "-k", "test_pin_empty_and_like or test_unpin_of_unpinned_memory_is_false",
    )
    assert proc.returncode == 1, text[-4000:]
    assert _failed(text) == {"test_pin_empty_and_like"}, text[-4000:]
    assert "killed by SIGABRT" in text and "native assertion `nbytes >= 0' failed" in text, text[-4000:]
    assert "2 passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
    cells = {(r["area"], r["implementation"]): r for r in data["matrix"]}
    assert cells[("pinning", "selftest-abort")]["failed"] >= 1


def test_locked_memory_leaked_outside_pinned_stats_is_caught(tmp_path):
    """A failed pin_empty that leaves locked pages behind, invisible to pinned_stats(): the leak check of the
    very test that made the failed calls reports VmLck growth."""
    proc, text, _ = _run(
        tmp_path, "selftest-leak", "--pyargs", "conformance.suite.test_pinning_api",
        "-k", "test_bad_arguments_name_the_argument and native",
    )
    if "page-locked memory grew" not in text and "RLIMIT" in text:
        pytest.skip("this process may not lock memory (RLIMIT_MEMLOCK)")
    assert proc.returncode == 1, text[-4000:]
    assert _failed(text) == {"test_bad_arguments_name_the_argument"}, text[-4000:]
    verdicts = [line for line in text.splitlines() if line.startswith("E") and "AssertionError:" in line]
    assert verdicts and all("page-locked memory grew" in v and "(VmLck)" in v for v in verdicts), verdicts
    assert not any("pinned_stats changed" in v for v in verdicts), "the leak is outside pinned_stats"


def test_linear_registry_scan_is_flagged_by_the_cost_growth_property(tmp_path):
    """A registry that answers every lookup correctly but scans all ranges fails the cost-growth property, and
    only that one (its answers agree with the contract)."""
    proc, text, _ = _run(tmp_path, "selftest-linear", "--pyargs", "conformance.suite.test_ranges_cost_growth")
    assert proc.returncode == 1, text[-4000:]
    assert _failed(text) == {"test_registry_lookup_and_remove_cost_is_logarithmic"}, text[-4000:]
    assert "is not O(log n)" in text and "contains (miss)" in text, text[-4000:]


def test_foreign_engine_is_the_engine_under_test(tmp_path):
    """The engine tests take ZeroEngine and pinned_stats from the implementation that declares them: a foreign
    engine whose destroy() forgets its pinned buffers fails the release test (hostoffload's own engine passes
    it in the suite), and the rest of the run completes with the report."""
    proc, text, data = _run(
        tmp_path, "selftest-foreign-engine", "--pyargs", "conformance.suite.test_accumulation_engine_faults",
        "-k", "test_R17_destroy_returns_every_pinned_byte and 0",
    )
    assert proc.returncode == 1, text[-4000:]
    assert _failed(text) == {"test_R17_destroy_returns_every_pinned_byte"}, text[-4000:]
    assert "pinned_stats before" in text, text[-4000:]
    cells = {(r["area"], r["implementation"]): r for r in data["matrix"]}
    assert cells[("accumulation", "selftest-foreign-engine")]["failed"] == 1
