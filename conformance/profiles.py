"""Hypothesis profiles of the conformance suite.

``dev``: quick local iteration. ``ci``: derandomized (the same examples on every run, so a red CI is reproducible)
and without deadlines (2-core CI machines stall). ``gpu``: like ci with fewer examples, since each example moves
real device memory. ``thorough``: for release qualification and vendor ports.

State machines get their own example counts per profile: a state-machine example is a whole sequence of steps,
and the ``ci`` count is what guarantees the foundation's 20 000 registry steps per implementation.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "HOSTOFFLOAD_HYPOTHESIS_PROFILE"
PROFILES: tuple[str, ...] = ("dev", "ci", "gpu", "thorough")

# The accelerator/implementation fixtures are function-scoped but constant across a test's examples, which is the
# case the function_scoped_fixture health check cannot tell apart from a real bug. Pinned allocations are slow to
# generate on purpose (they lock real pages), hence too_slow.
_SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]

#: Examples per state-machine test, by profile; steps per example is the profile's stateful_step_count.
STATE_MACHINE_EXAMPLES = {"dev": 40, "ci": 400, "gpu": 100, "thorough": 4000}


def register_profiles() -> None:
    # ci and gpu share everything that makes a run reproducible; gpu draws fewer examples.
    reproducible = dict(derandomize=True, deadline=None, database=None, print_blob=True, stateful_step_count=50)
    settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=_SUPPRESS)
    settings.register_profile("ci", max_examples=60, suppress_health_check=_SUPPRESS, **reproducible)
    settings.register_profile("gpu", max_examples=30, suppress_health_check=_SUPPRESS, **reproducible)
    settings.register_profile(
        "thorough", max_examples=1000, deadline=None, stateful_step_count=100, suppress_health_check=_SUPPRESS
    )


def choose_profile(option: str | None) -> str:
    name = option or os.environ.get(PROFILE_ENV) or ("ci" if os.environ.get("CI") else "dev")
    if name not in PROFILES:
        from reference.errors import allowed_values_error

        raise allowed_values_error("--conformance-profile / " + PROFILE_ENV, name, PROFILES)
    return name


def state_machine_settings() -> settings:
    """Settings for a state-machine test under the loaded profile."""
    current = settings.default
    getter = getattr(settings, "get_current_profile_name", None)
    name = getter() if getter is not None else getattr(settings, "_current_profile", "default")
    return settings(current, max_examples=STATE_MACHINE_EXAMPLES.get(name, current.max_examples))
