"""Item 2: a selection that cannot run is a usage error: one clear line, exit status 4, before any test runs.

The unavailable accelerator is a real installed plugin (a distribution written here onto PYTHONPATH, registering an
accelerator that is never available), so the check does not depend on which machine runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")

_ABSENT_ACCELERATOR = '''
from reference.contract.accelerators.cpu import CpuAccelerator

class AbsentAccelerator(CpuAccelerator):
    """A device this machine never has."""
    name = "absent-device"
    may_be_default = False

    def is_available(self):
        return False
'''


def _install_absent_accelerator(site: Path) -> dict[str, str]:
    site.mkdir()
    (site / "absent_accelerator.py").write_text(_ABSENT_ACCELERATOR)
    info = site / "absent_accelerator-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: absent-accelerator\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[hostoffload.accelerators]\nabsent-device = absent_accelerator:AbsentAccelerator\n"
    )
    return {"PYTHONPATH": str(site)}


@pytest.mark.parametrize(
    "case", ["unavailable-accelerator", "unknown-accelerator", "unknown-impl", "unwritable-report", "bad-profile-env"]
)
def test_bad_selection_is_one_clear_line_before_any_test(tmp_path, case):
    env: dict[str, str | None] = {}
    if case == "unavailable-accelerator":
        env = _install_absent_accelerator(tmp_path / "site")
        args, expected = ["--conformance-accelerator", "cpu,absent-device"], ["absent-device", "not available"]
    elif case == "unknown-accelerator":
        args, expected = ["--conformance-accelerator", "nonesuch"], ["--conformance-accelerator", "nonesuch", "cpu"]
    elif case == "unknown-impl":
        args, expected = ["--conformance-impl", "nonesuch"], ["--conformance-impl", "nonesuch", "reference"]
    elif case == "unwritable-report":
        args, expected = ["--conformance-report", "/proc/no-such-dir/report"], ["--conformance-report", "/proc"]
    else:
        env = {"HOSTOFFLOAD_HYPOTHESIS_PROFILE": "nonesuch"}
        args, expected = [], ["HOSTOFFLOAD_HYPOTHESIS_PROFILE", "nonesuch", "ci"]
    proc = run_pytest("--pyargs", "conformance.suite.test_accelerators_contract", *args, env=env, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-3000:]
    assert "INTERNALERROR" not in text and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and all(word in errors[0] for word in expected), text[-3000:]
    assert "passed" not in text and "collected" not in text, text[-3000:]


def test_default_selection_reports_unavailable_accelerators_without_failing(tmp_path):
    """Without the option, an unavailable accelerator is listed as such; only naming it is an error."""
    env = _install_absent_accelerator(tmp_path / "site")
    proc = run_pytest("--pyargs", "conformance.suite.test_pinning_api", "--co", "-q", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "acc=cpu" in proc.stdout and "acc=absent-device" not in proc.stdout
