"""Helpers for the suite's tests of multi-process accumulation engines (tests of the optimized torch.distributed
engine and any third-party engine that declares ``DISTRIBUTED_ENGINE``), kept in one place so the engine test
modules share one skip rule and one pinning setup."""

from __future__ import annotations

from types import ModuleType

import pytest


def engine_api(area_api: ModuleType) -> ModuleType:
    """``area_api`` if its accumulation module runs real ranks (``DISTRIBUTED_ENGINE = True``), else skip: the
    reference simulates its ranks in one process and has no engine object per rank to test."""
    if not getattr(area_api, "DISTRIBUTED_ENGINE", False):
        pytest.skip("this implementation's accumulation module is not a multi-process engine")
    return area_api


@pytest.fixture
def native_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native pin backend without device registration: engine buffers are then page-locked, recorded in the
    range registry and counted by ``pinned_stats``, which is what the release and direct-swap checks read."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")
