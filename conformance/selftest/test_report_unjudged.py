"""Issue 42 item 2: a rule is never left unjudged silently when an optional package is missing.

A real conformance run of the optimizer-kernel and fused-device-Adam tests of the optimized implementation, in a
child process where ``import triton`` fails (a finder first on ``sys.meta_path`` refuses it: what a machine
without Triton does). The fused device Adam's tests skip; the report must say at its top, before
anything else, that triton is missing and which rules that left unjudged, and report.json must carry the same.
The ledger's attribution is also checked on the collector directly.
"""

from __future__ import annotations

import json
import os

import pytest

from conformance.harness.optional_packages import MISSING_PREFIX, package_of
from conformance.harness.report import ReportCollector, build_report, render_markdown
from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")


def test_skip_reasons_name_the_missing_package():
    assert package_of(f"{MISSING_PREFIX} 'triton' (the compiler): No module named 'triton'") == "triton"
    assert package_of("could not import 'transformers': No module named 'transformers'") == "transformers"
    assert package_of("this implementation declares no fused device Adam") is None
    assert package_of(None) is None


def test_ledger_attributes_a_missing_package_to_the_rules_it_left_unjudged():
    """A rule whose every test skipped for the package is "not judged"; one with another test that ran is
    "partly judged"; a skip for another reason is not attributed to the package; rules of the rule set no test
    judged are listed too."""
    c = ReportCollector()
    why = f"{MISSING_PREFIX} 'triton' (kernel k): hidden"
    c.record(("k", "i", "cpu"), "skipped", "t1", why, rules=("R13", "R16"))
    c.record(("k", "i", "cpu"), "passed", "t2", rules=("R16",))
    c.record(("k", "i", "cpu"), "skipped", "t3", "not declared", rules=("R5",))
    c.record(("k", "i", "cpu"), "skipped", "t4", why)
    report = build_report(c, {"suite": {"rule_set": ["R5", "R13", "R16", "R17"]}})
    entry = report["rules"]["missing_packages"]["triton"]
    assert entry["rules_not_judged"] == ["R13"] and entry["rules_partly_judged"] == ["R16"], entry
    assert entry["tests"] == 2 and entry["tests_citing_no_rule"] == 1, entry
    assert report["rules"]["rules_not_judged"] == ["R5", "R13", "R17"], report["rules"]
    top = render_markdown(report).split("| area |")[0]
    assert "optional package `triton` is missing" in top and "not judged: R13" in top, top


_HIDE_TRITON = """import sys


class _HideTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is hidden by the harness self-test")
        return None


sys.meta_path.insert(0, _HideTriton())
"""


def test_report_top_names_the_rules_a_hidden_triton_left_unjudged(tmp_path):
    # A finder first on sys.meta_path refuses triton, loaded with -p before any other plugin imports anything. A
    # package named triton early on PYTHONPATH is not enough: where the suite is installed, pytest puts
    # site-packages (the suite's root) ahead of PYTHONPATH for its conftest, and the real triton is found again.
    hider = tmp_path / "hider"
    hider.mkdir()
    (hider / "hostoffload_hide_triton.py").write_text(_HIDE_TRITON)
    report = tmp_path / "report"
    proc = run_pytest(
        "-p", "hostoffload_hide_triton",
        "--pyargs", "conformance.suite.test_optimizer_kernels",
        "conformance.suite.test_accumulation_engine_device_adam",
        "--conformance-impl", "optimized", "--conformance-accelerator", "cpu", "--conformance-profile", "ci",
        "--conformance-report", str(report), "-q",
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(hider), os.environ.get("PYTHONPATH")]))},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    entry = data["rules"]["missing_packages"].get("triton")
    assert entry is not None, data["rules"]
    assert "hidden by the harness self-test" in entry["reason"], entry
    # The fused kernel's R16 tests skipped; the native CPU kernel's ran: R16 is partly judged. R13's only tests
    # here are the fused kernel's bf16 copy: not judged at all.
    assert "R16" in entry["rules_partly_judged"] and "R13" in entry["rules_not_judged"], entry
    md = (report / "report.md").read_text()
    top = md.split("| area |")[0].split("- command:")[0]
    assert "## Not judged: missing optional packages" in top, md[:3000]
    assert "optional package `triton` is missing" in top and "R13" in top and "R16" in top, top
    assert "not judged: optional package triton is missing" in proc.stdout, proc.stdout[-3000:]
