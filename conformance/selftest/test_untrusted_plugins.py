"""The harness judging implementations it has never seen: each deliberately broken plugin of
``conformance.selftest.plugins`` is flagged by the right test, and the run still completes with its report.

The plugins are registered as an installed package would be: a ``*.dist-info`` directory with an
``entry_points.txt`` on ``PYTHONPATH`` (nothing is installed into the environment). One pytest run in a child
process, as a vendor would start it (``--junitxml``, ``-ra`` and ``--conformance-report``), covers every plugin,
each on the few suite tests that matter for it (each test of theirs isolated in a child forked from the harness's
zygote); each check reads its output, its junit XML and the report it wrote, and the three must agree on every
count and every skip reason.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
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
#: A test every pinning plugin must pass (or, without the area, skip): it calls no pinning function that is broken.
_HARMLESS = "test_unpin_of_unpinned_memory_is_false"
#: Per plugin, the suite tests its run selects: the ones that must flag its defects and one that must not fail.
#: The run stays short (seconds per plugin) and each defect is one failed test.
_EMPTY_PIN = "(test_pin_empty_and_like and native)"
_TESTS = {
    "selftest-abort": (_EMPTY_PIN, _HARMLESS),
    "selftest-leak": ("(test_bad_arguments_name_the_argument and native and dtype)", _HARMLESS),
    "selftest-linear": ("test_registry_lookup_and_remove_cost_is_logarithmic",),
    "selftest-foreign-engine": ("(test_R17_destroy_returns_every_pinned_byte and 0)", _HARMLESS),
    "selftest-stranger": (
        _EMPTY_PIN, "test_views_survive_unpin_and_gc_of_the_base",
        "test_simultaneous_pins_and_unpins_are_all_recorded", "test_is_pinned_cost_is_logarithmic_in_live_buffers",
        _HARMLESS,
    ),
    "selftest-missing-area": ("test_pin_empty_and_like", _HARMLESS),
}
#: How many defects each plugin has: exactly as many of its tests fail (or error), one each.
_DEFECTS = {"selftest-abort": 1, "selftest-leak": 1, "selftest-linear": 1, "selftest-foreign-engine": 1,
            "selftest-stranger": 4, "selftest-missing-area": 0}
_SELECTION = " or ".join(f"({name} and ({' or '.join(tests)}))" for name, tests in _TESTS.items())
_MODULES = ("test_pinning_api", "test_pinning_lifetime", "test_pinning_threads", "test_pinning_cost_growth",
            "test_ranges_cost_growth", "test_accumulation_engine_faults")


@pytest.fixture(scope="module")
def verdict(tmp_path_factory):
    """(process, output, report data, junit XML root) of one run of the selected suite tests on every self-test
    plugin, with every report pytest and the harness can write."""
    tmp_path = tmp_path_factory.mktemp("untrusted")
    report = tmp_path / "report"
    xml = tmp_path / "out.xml"
    # The one engine test selected runs on two ranks: the rank pool starts only those (not its default four).
    env = {**_plugin_path(tmp_path), POOL_SIZE_ENV: "2"}
    proc = run_pytest(
        "--pyargs", *(f"conformance.suite.{m}" for m in _MODULES), "-k", _SELECTION,
        "--conformance-impl", ",".join(_PLUGIN_NAMES), "--conformance-accelerator", "cpu",
        "--conformance-profile", "ci", "--conformance-report", str(report), "--junitxml", str(xml), "-ra",
        env=env, cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert (report / "report.json").exists(), f"the run wrote no report:\n{text[-4000:]}"
    assert xml.exists(), f"the run wrote no junit XML:\n{text[-4000:]}"
    return proc, text, json.loads((report / "report.json").read_text()), ET.parse(xml).getroot()


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
    """Despite aborts and segfaults inside the implementations, every selected test ran and the report covers
    every plugin."""
    proc, text, data, _ = verdict
    assert proc.returncode == 1 and "INTERNALERROR" not in text, text[-4000:]
    tail = proc.stdout.strip().splitlines()[-4:]  # the verdict, then the report paths, end the output
    assert any(line.startswith("hostoffload conformance: FAILED") and "passed" in line for line in tail), tail
    assert set(data["implementations"]) == set(_PLUGIN_NAMES), data["implementations"]


def test_each_defect_is_one_failed_test(verdict):
    """Every plugin's run selects one test per defect (and tests it must pass): each defect costs exactly one
    failed or errored test, never the tests around it, however the implementation died."""
    _, text, _, _ = verdict
    for impl, defects in _DEFECTS.items():
        mine = re.compile(rf"impl={re.escape(impl)}[\]-]")
        flagged = [line.split()[1] for line in text.splitlines()
                   if line.startswith(("FAILED ", "ERROR ")) and mine.search(line)]
        assert len(flagged) == defects, (impl, flagged)


def test_abort_in_pin_empty_fails_the_tests_that_call_it(verdict):
    """A native abort() in pin_empty fails the tests that call it, each naming SIGABRT and quoting the child's
    last output; the test that does not call pin_empty passes."""
    proc, text, _, _ = verdict
    assert _failed(text, "selftest-abort") == {"test_pin_empty_and_like"}, text[-4000:]
    quoted = proc.stdout.split("its last output lines:", 1)[-1]  # the crash report's quote, not stderr
    assert "killed by SIGABRT" in text and "native assertion `nbytes >= 0' failed" in quoted, text[-4000:]
    # After importing torch the run has threads, so the children are forked from the zygote (milliseconds each),
    # never fresh interpreters (seconds each): the fast path is what keeps a third party's isolated run usable.
    assert "isolated child (child of the zygote)" in text and "(fresh interpreter)" not in text, text[-4000:]


def test_locked_memory_leaked_outside_pinned_stats_is_caught(verdict):
    """A failed pin_empty that leaves locked pages behind, invisible to pinned_stats(): the leak check of the
    very test that made the failed calls reports VmLck growth."""
    _, text, _, _ = verdict
    assert _failed(text, "selftest-leak") == {"test_bad_arguments_name_the_argument"}, text[-4000:]
    verdicts = _verdicts(text, "selftest-leak")
    assert verdicts and all("page-locked memory grew" in v and "(VmLck)" in v for v in verdicts), verdicts
    assert not any("pinned_stats changed" in v for v in verdicts), "the leak is outside pinned_stats"


def test_linear_registry_scan_is_flagged_by_the_cost_growth_property(verdict):
    """A registry that answers every lookup correctly but scans all ranges fails the cost-growth property."""
    _, text, _, _ = verdict
    assert _failed(text, "selftest-linear") == {"test_registry_lookup_and_remove_cost_is_logarithmic"}, text[-4000:]
    assert any("is not O(log n)" in v for v in _verdicts(text, "selftest-linear")), text[-4000:]


def test_foreign_engine_is_the_engine_under_test(verdict):
    """The engine tests take ZeroEngine and pinned_stats from the implementation that declares them: a foreign
    engine whose destroy() keeps pinned copies of its buffers fails the release test (hostoffload's own engine
    passes it in the suite); its pinning tests (hostoffload's optimized pinning) pass."""
    _, text, data, _ = verdict
    assert _failed(text, "selftest-foreign-engine") == {"test_R17_destroy_returns_every_pinned_byte"}, text[-4000:]
    assert "pinned_stats before" in text, text[-4000:]
    cells = {(r["area"], r["implementation"]): r for r in data["matrix"]}
    assert cells[("accumulation", "selftest-foreign-engine")]["failed"] == 1


def _failure_messages(data: dict, impl: str) -> dict[str, str]:
    """Test name -> the report's failure message, for ``impl``'s failures."""
    return {
        f["nodeid"].split("::")[-1].split("[")[0]: f["message"]
        for row in data["matrix"] if row["implementation"] == impl for f in row["failures"]
    }


def test_the_strangers_crash_assert_race_and_scan_are_each_one_failed_test(verdict):
    """A third party's pinning reached only through the public calls: its native assert (SIGABRT), its freed
    view (SIGSEGV), its unlocked table (updates lost when eight threads pin and unpin at once) and its linear
    scan (is_pinned's cost grows with the live buffers) each fail exactly one test, with a message that says
    which; the tests it has no reason to fail pass (among them the race on the torch backend, where it keeps the
    answer of the library it forwards to)."""
    _, text, data, _ = verdict
    expected = {
        "test_pin_empty_and_like", "test_views_survive_unpin_and_gc_of_the_base",
        "test_simultaneous_pins_and_unpins_are_all_recorded", "test_is_pinned_cost_is_logarithmic_in_live_buffers",
    }
    assert _failed(text, "selftest-stranger") == expected, text[-4000:]
    race = [line for line in text.splitlines() if line.startswith("FAILED ") and "simultaneous" in line]
    assert len(race) == 1 and "backend=native-impl=selftest-stranger" in race[0], race
    messages = _failure_messages(data, "selftest-stranger")
    assert "killed by SIGABRT" in messages["test_pin_empty_and_like"], messages
    assert "killed by SIGSEGV" in messages["test_views_survive_unpin_and_gc_of_the_base"], messages
    assert "native assertion `nbytes > 0' failed" in text, text[-4000:]
    assert "wrong answers after simultaneous pins and unpins" in messages[
        "test_simultaneous_pins_and_unpins_are_all_recorded"], messages
    assert "is not O(log n)" in messages["test_is_pinned_cost_is_logarithmic_in_live_buffers"], messages
    passed = {r["implementation"]: r["passed"] for r in data["matrix"] if r["area"] == "pinning"}
    assert passed["selftest-stranger"] >= 3 and passed["selftest-abort"] >= 1, passed


def test_an_area_declared_without_its_module_is_skipped_with_that_reason(verdict):
    """An implementation that declares the pinning area but did not ship its module: every selected test of it
    is skipped, none runs, and the reason says the module is missing (in the XML and the report alike)."""
    _, _, data, xml = verdict
    reason = "selftest-missing-area does not provide area 'pinning' (declared but its module is missing)"
    rows = [r for r in data["matrix"] if r["implementation"] == "selftest-missing-area"]
    assert rows and all(r["ran"] == 0 and r["status"] == "skipped" for r in rows), rows
    assert {k for r in rows for k in r["skip_reasons"]} == {reason}, rows
    cases = [c for c in xml.iter("testcase") if "impl=selftest-missing-area" in c.get("name", "")]
    assert len(cases) == sum(r["total"] for r in rows) >= 2, [c.get("name") for c in cases]
    assert all([(e.tag, e.get("message")) for e in c] == [("skipped", reason)] for c in cases)


def _summary_counts(stdout: str) -> Counter:
    """pytest's final outcome line as counts (``errors``, ``warnings`` in the plural)."""
    line = next(line for line in reversed(stdout.splitlines()) if re.match(r"^=+ .* in [\d.]+s", line))
    out = Counter()
    for n, word in re.findall(r"(\d+) (\w+)", line.split(" in ")[0]):
        out[{"error": "errors", "warning": "warnings"}.get(word, word)] += int(n)
    return out


def _summary_lines(stdout: str, word: str) -> list[str]:
    section = stdout.split("short test summary info", 1)[-1]
    return [line for line in section.splitlines() if line.startswith(word + " ")]


def _case_name(case: ET.Element) -> str:
    return case.get("name", "").split("::")[-1]


def test_the_xml_the_summary_and_the_report_agree(verdict):
    """Every count (passed, failed, errors, skipped) and every skip reason is the same in pytest's ``-ra``
    summary, the junit XML and the conformance report, though most of the tests ran in isolated children and
    some of those crashed."""
    proc, _, data, xml = verdict
    totals, summary = data["totals"], _summary_counts(proc.stdout)
    for outcome in ("passed", "failed", "errors", "skipped", "xfailed", "xpassed"):
        assert totals[outcome] == summary[outcome], (outcome, totals, summary)
    suite = xml if xml.tag == "testsuite" else xml.find("testsuite")
    assert int(suite.get("failures")) == totals["failed"] and int(suite.get("errors")) == totals["errors"]
    assert int(suite.get("skipped")) == totals["skipped"] + totals["xfailed"]
    assert len({_case_name(c) for c in suite.iter("testcase")}) == sum(r["total"] for r in data["matrix"])

    def by_kind(tag: str) -> set[str]:
        return {_case_name(c) for c in suite.iter("testcase") if c.find(tag) is not None}

    report_failed = {f["nodeid"].split("::")[-1] for r in data["matrix"] for f in r["failures"] if f["when"] == "call"}
    report_errors = {f["nodeid"].split("::")[-1] for r in data["matrix"] for f in r["failures"] if f["when"] != "call"}
    summary_failed = {line.split()[1].split("::")[-1] for line in _summary_lines(proc.stdout, "FAILED")}
    summary_errors = {line.split()[1].split("::")[-1] for line in _summary_lines(proc.stdout, "ERROR")}
    assert by_kind("failure") == report_failed == summary_failed and len(report_failed) == totals["failed"]
    assert by_kind("error") == report_errors == summary_errors

    xml_reasons = Counter(e.get("message") for e in suite.iter("skipped") if e.get("type") != "pytest.xfail")
    report_reasons = Counter()
    for row in data["matrix"]:
        report_reasons.update(row["skip_reasons"])
    summary_reasons = Counter()
    for line in _summary_lines(proc.stdout, "SKIPPED"):
        n, reason = re.match(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", line).groups()
        summary_reasons[reason] += int(n)
    assert xml_reasons == report_reasons == summary_reasons, (xml_reasons, report_reasons, summary_reasons)
    assert sum(report_reasons.values()) == totals["skipped"] > 0


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
