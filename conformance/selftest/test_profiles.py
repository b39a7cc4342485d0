"""Item 5: ``ci`` (what ``tox -e test`` runs) is the fast profile; the deep profiles keep their depth.

The counts of the deep profiles are pinned here on purpose: making CI faster must not quietly thin the main job
(``conformance``), the GPU job or release qualification.
"""

from __future__ import annotations

import pytest

from conformance.harness import profiles
from conformance.selftest.runner import run_pytest

pytestmark = pytest.mark.conformance_area("harness")

# (examples, state-machine examples, steps per state-machine example, derandomized) of the deep profiles.
_DEEP = {
    "dev": (30, 40, 50, False),
    "conformance": (60, 400, 50, True),
    "gpu": (30, 100, 50, True),
    "thorough": (1000, 4000, 100, False),
}


def _shape(name: str) -> tuple[int, int, int, bool]:
    from hypothesis import settings

    profiles.register_profiles()
    s = settings.get_profile(profiles.hypothesis_name(name))
    return (s.max_examples, profiles.STATE_MACHINE_EXAMPLES[name], s.stateful_step_count, s.derandomize)


@pytest.mark.parametrize("name", sorted(_DEEP))
def test_deep_profiles_keep_their_depth(name):
    assert _shape(name) == _DEEP[name]


def test_profiles_do_not_inherit_what_is_loaded_when_registered():
    """Under $CI hypothesis loads a derandomized profile of its own; ``dev`` must stay random all the same."""
    from hypothesis import settings

    previous = settings.get_current_profile_name()
    settings.register_profile("selftest-loaded", derandomize=True, max_examples=3)
    settings.load_profile("selftest-loaded")
    try:
        assert _shape("dev") == _DEEP["dev"] and _shape("thorough") == _DEEP["thorough"]
    finally:
        settings.load_profile(previous)


def test_ci_is_the_fast_reproducible_profile():
    examples, machines, steps, derandomized = _shape("ci")
    assert derandomized and "ci" in profiles.SKIPS_SLOW
    for deep in ("conformance", "gpu"):
        d_examples, d_machines, d_steps, _ = _shape(deep)
        assert examples <= d_examples and machines * steps < d_machines * d_steps
    assert not (profiles.SKIPS_SLOW & set(_DEEP)), "only the fast profile may leave slow tests out"
    assert profiles.choose_profile(None) in profiles.PROFILES


_SLOW_SUITE = '''
import pytest

@pytest.mark.slow
def test_long_running():
    pass
'''


def test_ci_skips_slow_tests_with_the_reason(tmp_path):
    """(That every other profile runs them is SKIPS_SLOW holding only ci, checked above.)"""
    (tmp_path / "test_slow_suite.py").write_text(_SLOW_SUITE)
    ci = run_pytest("test_slow_suite.py", "--conformance-profile", "ci", "-rs", cwd=tmp_path, timeout=300)
    assert ci.returncode == 0 and "1 skipped" in ci.stdout and "left out by the ci profile" in ci.stdout, ci.stdout
