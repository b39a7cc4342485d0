"""Hypothesis profiles of the conformance suite, and what else each profile decides about a run.

- ``dev``: local iteration (the default without ``$CI``), random examples.
- ``ci``: the fast one, what ``tox -e test`` runs on the 2-core CI machine (and the default under ``$CI``):
  derandomized (the same examples on every run, so a red CI is reproducible), no deadlines (2-core machines stall),
  few examples, and tests marked ``slow`` skipped with the reason.
- ``conformance``: the main job's verdict (``tox -e conformance``): reproducible like ci, with the full counts;
  its state-machine count is what guarantees the foundation's 20 000 registry steps per implementation.
- ``gpu``: reproducible, fewer examples than conformance, since each example moves real device memory.
- ``thorough``: release qualification and vendor ports.

State machines get their own example counts per profile: a state-machine example is a whole sequence of steps.

The profiles are registered with hypothesis as ``hostoffload-<name>`` so that they never replace a profile of
hypothesis's own (it ships a ``ci`` profile that it loads under ``$CI``) or of the user's. This module imports
hypothesis only when a profile is registered or loaded, so the ``pytest11`` entry point can read :data:`PROFILES`
without making every pytest session of the environment pay for it.
"""

from __future__ import annotations

import os
from typing import Any

#: Declared in reference.contract.envvars (HYPOTHESIS_PROFILE_ENV, a self-test checks they agree); spelled here
#: because the pytest11 entry point reads this module and must not import ``reference``.
PROFILE_ENV = "HOSTOFFLOAD_HYPOTHESIS_PROFILE"
PROFILES: tuple[str, ...] = ("dev", "ci", "conformance", "gpu", "thorough")
#: Prefix of the names the profiles are registered under with hypothesis.
HYPOTHESIS_PREFIX = "hostoffload-"

#: Examples per state-machine test, by profile; steps per example is the profile's stateful_step_count.
STATE_MACHINE_EXAMPLES = {"dev": 40, "ci": 100, "conformance": 400, "gpu": 100, "thorough": 4000}

#: Profiles that skip tests marked ``slow`` (with the reason, so the report shows what the run left out).
SKIPS_SLOW: frozenset[str] = frozenset({"ci"})


def hypothesis_name(profile: str) -> str:
    """The name ``profile`` is registered under with hypothesis."""
    return HYPOTHESIS_PREFIX + profile


def _settings_by_profile() -> dict[str, dict[str, Any]]:
    from hypothesis import HealthCheck

    # The accelerator/implementation fixtures are function-scoped but constant across a test's examples, which is
    # the case the function_scoped_fixture health check cannot tell apart from a real bug. Pinned allocations are
    # slow to generate on purpose (they lock real pages), hence too_slow.
    suppress = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
    # ci, conformance and gpu share everything that makes a run reproducible.
    reproducible = dict(derandomize=True, deadline=None, database=None, print_blob=True)
    return {
        "dev": dict(max_examples=30, deadline=None, stateful_step_count=50, suppress_health_check=suppress),
        "ci": dict(max_examples=20, stateful_step_count=30, suppress_health_check=suppress, **reproducible),
        "conformance": dict(max_examples=60, stateful_step_count=50, suppress_health_check=suppress, **reproducible),
        "gpu": dict(max_examples=30, stateful_step_count=50, suppress_health_check=suppress, **reproducible),
        "thorough": dict(
            max_examples=1000, deadline=None, stateful_step_count=100, suppress_health_check=suppress
        ),
    }


def register_profiles() -> None:
    from hypothesis import settings

    # Parent: hypothesis's library defaults, not whatever is loaded now (under $CI hypothesis loads its own ``ci``
    # profile, and a profile registered without a parent would inherit its derandomize/database: ``dev`` would
    # silently stop being random on a CI machine).
    library_defaults = settings.get_profile("default")
    for name, kwargs in _settings_by_profile().items():
        settings.register_profile(hypothesis_name(name), parent=library_defaults, **kwargs)


def choose_profile(option: str | None) -> str:
    """The profile this run uses: the option, else ``$HOSTOFFLOAD_HYPOTHESIS_PROFILE``, else by ``$CI``."""
    from reference.contract.envvars import normalize

    # The variable follows the one rule of reference.contract.envvars: stripped, case-insensitive, blank = unset.
    name = option or normalize(os.environ.get(PROFILE_ENV)) or ("ci" if os.environ.get("CI") else "dev")
    if name not in PROFILES:
        from reference.contract.errors import allowed_values_error

        source = "--conformance-profile" if option else PROFILE_ENV
        raise allowed_values_error(source, name, PROFILES)
    return name


def load_profile(profile: str) -> None:
    from hypothesis import settings

    settings.load_profile(hypothesis_name(profile))


def current_profile() -> str | None:
    """The loaded conformance profile (``ci``, ...), or None when hypothesis runs a profile that is not ours."""
    from hypothesis import settings

    getter = getattr(settings, "get_current_profile_name", None)
    name = getter() if getter is not None else getattr(settings, "_current_profile", "default")
    return name.removeprefix(HYPOTHESIS_PREFIX) if name and name.startswith(HYPOTHESIS_PREFIX) else None


def state_machine_settings() -> Any:
    """Settings for a state-machine test under the loaded profile."""
    from hypothesis import settings

    current = settings.default
    assert current is not None  # hypothesis always has a loaded profile
    profile = current_profile()
    return settings(current, max_examples=STATE_MACHINE_EXAMPLES.get(profile or "", current.max_examples))
