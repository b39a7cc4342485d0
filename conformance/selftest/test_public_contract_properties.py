"""The cost and race properties judge an implementation through its public calls alone: a pinning area that
exposes no registry, scans its table on every lookup and updates it without a lock
(``conformance.selftest.plugins.scanning_unlocked_pinning``) is flagged for both defects in the default selection
(every backend it declares), registered as an installed package would be and run as a vendor would run the suite.
"""

from __future__ import annotations

import os

import pytest

from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")

_NAME = "selftest-scan-unlocked"
_ENTRY = "conformance.selftest.plugins.scanning_unlocked_pinning:IMPLEMENTATION"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(return code, output) of the pinning cost and contention tests on the plugin, isolated children included."""
    tmp_path = tmp_path_factory.mktemp("scan-unlocked")
    info = tmp_path / "site" / "hostoffload_scan_unlocked-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostoffload-scan-unlocked\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[hostoffload.implementations]\n{_NAME} = {_ENTRY}\n")
    path = os.pathsep.join(filter(None, [str(info.parent), os.environ.get("PYTHONPATH")]))
    proc = run_pytest(
        "--pyargs", "conformance.suite.test_pinning_cost_growth", "conformance.suite.test_pinning_threads",
        "-k", "cost_is_logarithmic or threads_pin_view or never_miss or simultaneous",
        "--conformance-impl", _NAME, "--conformance-accelerator", "cpu", "--conformance-profile", "ci", "-rfE",
        env={"PYTHONPATH": path}, cwd=tmp_path,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _failed(text: str) -> set[str]:
    return {line.split()[1].split("::")[-1] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))}


def test_linear_is_pinned_is_flagged_without_a_registry(run):
    """The table is never written by the harness: the live buffers come from pin_empty, and is_pinned's growth
    with them is reported as not O(log n)."""
    code, text = run
    assert code == 1, text[-4000:]
    assert f"test_is_pinned_cost_is_logarithmic_in_live_buffers[impl={_NAME}]" in _failed(text), text[-4000:]
    assert "is_pinned (hit)" in text and "is not O(log n)" in text, text[-4000:]


def test_unlocked_table_race_is_flagged_on_the_default_selection(run):
    """No backend is named on the command line: the contention tests run for both declared backends, and the
    lost updates of the native one's table fail the simultaneous-pins race; the torch backend (no table) passes."""
    _, text = run
    failed = _failed(text)
    race = f"test_simultaneous_pins_and_unpins_are_all_recorded[backend=native-impl={_NAME}-acc=cpu]"
    assert race in failed, text[-4000:]
    assert not {f for f in failed if "backend=torch" in f}, failed
    assert "wrong answers after simultaneous pins and unpins" in text, text[-4000:]
