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
    # Python lists every module it imports on stderr ("import time: ... | torch"): what the check imported.
    env = {**env, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = run_pytest("--pyargs", "conformance.suite.test_accelerators_contract", *args, env=env, cwd=tmp_path)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    text = proc.stdout + "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 4, text[-3000:]
    assert "INTERNALERROR" not in text and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and all(word in errors[0] for word in expected), text[-3000:]
    assert "passed" not in text and "collected" not in text, text[-3000:]
    assert "pytest" in imported, "the import list was not recorded"
    if case != "unavailable-accelerator":  # only the accelerator plugin itself can say whether it is available
        # Decided from the options, the environment and the metadata alone (conformance.harness.option_checks): the
        # user waits a fraction of a second, not the seconds of importing torch and hypothesis.
        assert not imported & {"torch", "hypothesis", "conformance.harness.plugin"}, sorted(
            imported & {"torch", "hypothesis", "conformance.harness.plugin"}
        )


def test_option_checks_read_the_entry_point_groups_discovery_loads():
    """conformance.harness.option_checks spells the groups without importing torch; they must be the ones loaded."""
    from conformance.harness import discovery, option_checks
    from reference.contract.accelerators import ACCELERATOR_ENTRY_POINT_GROUP

    assert option_checks.IMPLEMENTATION_GROUP == discovery.IMPLEMENTATION_ENTRY_POINT_GROUP
    assert option_checks.ACCELERATOR_GROUP == ACCELERATOR_ENTRY_POINT_GROUP
    assert option_checks.installed_names(option_checks.IMPLEMENTATION_GROUP) == sorted(
        discovery.discover_implementations()
    )


def test_default_selection_reports_unavailable_accelerators_without_failing(tmp_path):
    """Without the option, an unavailable accelerator is listed as such; only naming it is an error."""
    env = _install_absent_accelerator(tmp_path / "site")
    proc = run_pytest("--pyargs", "conformance.suite.test_pinning_api", "--co", "-q", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "acc=cpu" in proc.stdout and "acc=absent-device" not in proc.stdout
