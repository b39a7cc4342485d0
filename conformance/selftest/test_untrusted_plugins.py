"""The harness judging implementations it has never seen: each deliberately broken plugin of
``conformance.selftest.plugins`` is flagged by the right test, and the run still completes with its report.

The plugins are registered as an installed package would be: a ``*.dist-info`` directory with an
``entry_points.txt`` on ``PYTHONPATH`` (nothing is installed into the environment). One pytest run in a child
process, as a vendor would start it, covers all four plugins (each test of theirs isolated in a child forked from
the harness's zygote); each check reads its output and the report it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.selftest.plugins import ENTRY_POINTS
from conformance.selftest.test_harness import run_pytest
from reference.contract.envvars import ACCUMULATION_POOL_SIZE_ENV as POOL_SIZE_ENV

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


_PLUGIN_NAMES = tuple(ENTRY_POINTS)
_SELECTION = " or ".join(
    (
        "test_pin_empty_and_like",
        "test_unpin_of_unpinned_memory_is_false",
        "(test_bad_arguments_name_the_argument and native)",
        "test_registry_lookup_and_remove_cost_is_logarithmic",
        "(test_R17_destroy_returns_every_pinned_byte and 0)",
    )
)


@pytest.fixture(scope="module")
def verdict(tmp_path_factory):
    """(returncode, output, report data) of one run of the selected suite tests on every self-test plugin."""
    tmp_path = tmp_path_factory.mktemp("untrusted")
    report = tmp_path / "report"
    # The one engine test selected runs on two ranks: the rank pool starts only those (not its default four).
    env = {**_plugin_path(tmp_path), POOL_SIZE_ENV: "2"}
    proc = run_pytest(
        "--pyargs", "conformance.suite.test_pinning_api", "conformance.suite.test_ranges_cost_growth",
        "conformance.suite.test_accumulation_engine_faults", "-k", _SELECTION,
        "--conformance-impl", ",".join(_PLUGIN_NAMES), "--conformance-accelerator", "cpu",
        "--conformance-profile", "ci", "--conformance-report", str(report), "-rfE",
        env=env, cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert (report / "report.json").exists(), f"the run wrote no report:\n{text[-4000:]}"
    return proc, text, json.loads((report / "report.json").read_text())


def _failed(text: str, impl: str) -> set[str]:
    """Names of ``impl``'s tests reported FAILED (call) or ERROR (setup/teardown, where leak checks report)."""
    return {
        line.split()[1].split("::")[-1].split("[")[0]
        for line in text.splitlines()
        if line.startswith(("FAILED ", "ERROR ")) and f"impl={impl}" in line
    }


def _verdicts(text: str, impl: str) -> list[str]:
    """The assertion lines pytest printed for ``impl``'s failures (the E lines of its sections)."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("_") and "[" in line:
            current = line
        elif current and f"impl={impl}" in current and line.startswith("E") and "Error:" in line:
            out.append(line)
    return out


def test_the_run_completes_with_a_report(verdict):
    """Despite an abort inside one implementation, every selected test ran and the report covers all four."""
    proc, text, data = verdict
    assert proc.returncode == 1, text[-4000:]
    tail = proc.stdout.strip().splitlines()[-4:]  # the verdict, then the report paths, end the output
    assert any(line.startswith("hostoffload conformance: FAILED") and "passed" in line for line in tail), tail
    assert set(data["implementations"]) == set(_PLUGIN_NAMES), data["implementations"]


def test_abort_in_pin_empty_fails_the_tests_that_call_it(verdict):
    """A native abort() in pin_empty fails the tests that call it, each naming SIGABRT and quoting the child's
    last output; the test that does not call pin_empty passes."""
    proc, text, _ = verdict
    failed = _failed(text, "selftest-abort")
    assert "test_pin_empty_and_like" in failed, text[-4000:]
    assert failed <= {"test_pin_empty_and_like", "test_bad_arguments_name_the_argument"}, failed
    quoted = proc.stdout.split("its last output lines:", 1)[-1]  # the crash report's quote, not stderr
    assert "killed by SIGABRT" in text and "native assertion `nbytes >= 0' failed" in quoted, text[-4000:]
    # After importing torch the run has threads, so the children are forked from the zygote (milliseconds each),
    # never fresh interpreters (seconds each): the fast path is what keeps a third party's isolated run usable.
    assert "isolated child (child of the zygote)" in text and "(fresh interpreter)" not in text, text[-4000:]


def test_locked_memory_leaked_outside_pinned_stats_is_caught(verdict):
    """A failed pin_empty that leaves locked pages behind, invisible to pinned_stats(): the leak check of the
    very test that made the failed calls reports VmLck growth."""
    _, text, _ = verdict
    assert _failed(text, "selftest-leak") == {"test_bad_arguments_name_the_argument"}, text[-4000:]
    verdicts = _verdicts(text, "selftest-leak")
    assert verdicts and all("page-locked memory grew" in v and "(VmLck)" in v for v in verdicts), verdicts
    assert not any("pinned_stats changed" in v for v in verdicts), "the leak is outside pinned_stats"


def test_linear_registry_scan_is_flagged_by_the_cost_growth_property(verdict):
    """A registry that answers every lookup correctly but scans all ranges fails the cost-growth property."""
    _, text, _ = verdict
    assert _failed(text, "selftest-linear") == {"test_registry_lookup_and_remove_cost_is_logarithmic"}, text[-4000:]
    assert any("is not O(log n)" in v for v in _verdicts(text, "selftest-linear")), text[-4000:]


def test_foreign_engine_is_the_engine_under_test(verdict):
    """The engine tests take ZeroEngine and pinned_stats from the implementation that declares them: a foreign
    engine whose destroy() forgets its pinned buffers fails the release test (hostoffload's own engine passes
    it in the suite); its pinning tests (hostoffload's optimized pinning) pass."""
    _, text, data = verdict
    assert _failed(text, "selftest-foreign-engine") == {"test_R17_destroy_returns_every_pinned_byte"}, text[-4000:]
    assert "pinned_stats before" in text, text[-4000:]
    cells = {(r["area"], r["implementation"]): r for r in data["matrix"]}
    assert cells[("accumulation", "selftest-foreign-engine")]["failed"] == 1


def test_a_single_threaded_run_forks_its_children_directly(tmp_path):
    """The direct-fork path of the isolation (a fork of this very process, no zygote involved) is taken only while
    the run is single-threaded; importing torch starts an OpenBLAS pool, so the suite's own runs never take it.
    With that pool held to one thread the run is single-threaded, and the same native abort must still cost
    exactly one failed test that names the signal and quotes the child's output."""
    proc = run_pytest(
        "--pyargs", "conformance.suite.test_pinning_api", "-k", "test_pin_empty_and_like",
        "--conformance-impl", "selftest-abort", "--conformance-accelerator", "cpu",
        "--conformance-profile", "ci", "-rfE",
        env={**_plugin_path(tmp_path), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    assert _failed(text, "selftest-abort") == {"test_pin_empty_and_like"}, text[-4000:]
    assert "isolated child (forked child)" in text and "killed by SIGABRT" in text, text[-4000:]
    quoted = proc.stdout.split("its last output lines:", 1)[-1]  # the crash report's quote, not stderr
    assert "native assertion `nbytes >= 0' failed" in quoted, text[-4000:]
    assert "child of the zygote" not in text and "(fresh interpreter)" not in text, text[-4000:]
