"""Item 1 of the good-citizen rules: installing hostoffload leaves unrelated pytest sessions alone.

A small unrelated project runs in a child process in this same environment; its test writes down what it sees
(hypothesis's loaded profile and settings, which heavy modules are imported, which plugins are registered). The
same project run with hostoffload's entry point disabled (``-p no:hostoffload_conformance``) is what "untouched"
means, so the check holds whatever hypothesis's own defaults are (it loads a ``ci`` profile of its own under $CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")

_UNRELATED_TEST = '''
import json, os, sys
from hypothesis import given, settings, strategies as st

def test_sees_defaults(pytestconfig):
    s = settings.default
    seen = {
        "profile": settings.get_current_profile_name(),
        "max_examples": s.max_examples,
        "derandomize": s.derandomize,
        "deadline": str(s.deadline),
        "database": type(s.database).__name__,
        "stateful_step_count": s.stateful_step_count,
        "heavy_modules": sorted(m for m in ("torch", "reference", "optimized", "conformance.harness.plugin")
                                if m in sys.modules),
        "conformance_plugin": pytestconfig.pluginmanager.has_plugin("conformance.harness.plugin"),
    }
    with open(os.environ["SEEN_FILE"], "w") as f:
        json.dump(seen, f)

@given(st.integers())
def test_a_property(x):
    assert isinstance(x, int)
'''


def _run_unrelated(tmp_path: Path, tag: str, ci: str | None, *extra: str) -> tuple[dict, str]:
    project = tmp_path / "unrelated"
    project.mkdir(exist_ok=True)
    (project / "test_unrelated.py").write_text(_UNRELATED_TEST)
    seen = tmp_path / f"seen-{tag}.json"
    proc = run_pytest("-q", *extra, env={"SEEN_FILE": str(seen), "CI": ci}, cwd=project, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads(seen.read_text()), proc.stdout


@pytest.mark.parametrize("ci", [None, "true"], ids=["no-CI", "CI=true"])
def test_unrelated_project_sees_pytest_and_hypothesis_defaults(tmp_path, ci):
    seen, out = _run_unrelated(tmp_path, "installed", ci)
    untouched, _ = _run_unrelated(tmp_path, "disabled", ci, "-p", "no:hostoffload_conformance")
    assert seen == untouched, f"with hostoffload installed {seen}; without its plugin {untouched}"
    assert seen["heavy_modules"] == [] and not seen["conformance_plugin"], seen
    assert not seen["profile"].startswith("hostoffload"), seen
    # (An editable install of hostoffload adds a pytest warning naming its import hook, with or without the plugin,
    # so the check is for what the plugin prints: its summary section and its verdict.)
    assert "hostoffload conformance" not in out and "conformance report" not in out, out[-2000:]


def test_a_path_inside_the_suite_activates_it(tmp_path):
    """Naming a suite module by path (no option, no --pyargs) is a conformance run: its tests get parametrized."""
    import conformance.suite.test_accelerators_contract as contract

    proc = run_pytest(contract.__file__, "--co", "-q", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "acc=cpu" in proc.stdout, proc.stdout[-3000:]
