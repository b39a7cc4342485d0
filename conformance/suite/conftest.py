"""Fixtures shared by the pinning-related suite modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from conformance.harness.environment import patched_environment
from conformance.harness.observation import Observation, RegistrationWatch
from reference.contract.envvars import PIN_BACKEND_ENV, PIN_BACKENDS, PIN_REGISTER_DEVICE_ENV


@pytest.fixture(params=PIN_BACKENDS, ids=[f"backend={b}" for b in PIN_BACKENDS])
def pin_backend(request: pytest.FixtureRequest, impl, accelerator) -> Iterator[str]:
    """Every backend the specification defines, selected through the environment as a user would."""
    backend = request.param  # undeclared backends are skipped at collection (conformance.harness.capability_marks)
    with patched_environment({PIN_BACKEND_ENV: backend, PIN_REGISTER_DEVICE_ENV: None}):
        yield backend


@pytest.fixture
def backend_pins(pin_backend: str, accelerator) -> bool:
    """Whether memory from this backend is really pinned on this accelerator (torch on CPU-only: no-op)."""
    return pin_backend == "native" or accelerator.has_torch_pinning


@pytest.fixture
def leak_check(area_api, accelerator, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails the test that leaves something behind, observed by the harness itself (conformance.harness.observation):
    page-locked memory (VmLck), host registrations through the accelerator's hooks, device memory, open file
    descriptors, live threads; and, as one more property, a changed ``pinned_stats()``. Checked at this test's
    teardown, so a leak is reported on the test that caused it."""
    watch = RegistrationWatch(accelerator, monkeypatch)
    before = Observation.now(accelerator, watch)
    stats_before = area_api.pinned_stats()
    yield
    after = Observation.now(accelerator, watch)
    stats_after = area_api.pinned_stats()
    # torch's own pinned-memory cache keeps pages locked across tests: VmLck is compared where hostoffload's
    # native backend is what locks pages (or the accelerator has no torch pinning, so nothing else locks them).
    native = os.environ.get(PIN_BACKEND_ENV) == "native" or not accelerator.has_torch_pinning
    problems = after.leaks_since(before, locked=native)
    if stats_after != stats_before:
        problems.append(f"pinned_stats changed over the test: before {stats_before}, after {stats_after}")
    assert not problems, "the test left resources behind: " + "; ".join(problems)
