"""Fixtures shared by the pinning-related suite modules."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from reference.envvars import PIN_BACKEND_ENV, PIN_BACKENDS, REGISTER_DEVICE_ENV


@pytest.fixture(params=PIN_BACKENDS, ids=[f"backend={b}" for b in PIN_BACKENDS])
def pin_backend(request: pytest.FixtureRequest, impl, accelerator) -> Iterator[str]:
    """Every backend the specification defines, selected through the environment as a user would."""
    backend = request.param  # undeclared backends are skipped at collection (conformance.capability_marks)
    old = {k: os.environ.get(k) for k in (PIN_BACKEND_ENV, REGISTER_DEVICE_ENV)}
    os.environ[PIN_BACKEND_ENV] = backend
    os.environ.pop(REGISTER_DEVICE_ENV, None)
    try:
        yield backend
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def backend_pins(pin_backend: str, accelerator) -> bool:
    """Whether memory from this backend is really pinned on this accelerator (torch on CPU-only: no-op)."""
    return pin_backend == "native" or accelerator.has_torch_pinning


@pytest.fixture
def leak_check(area_api) -> Iterator[None]:
    """Fails the test if it leaves native pinned allocations (pinned or merely mapped) behind."""
    gc.collect()
    before = area_api.pinned_stats()
    yield
    gc.collect()
    after = area_api.pinned_stats()
    assert after == before, f"pinned_stats changed over the test: before {before}, after {after}"
