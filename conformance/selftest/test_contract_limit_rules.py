"""``gpu_memory_limit``'s contract helpers (reference/contract/accumulation_limit.py, R28), held to figures written
here: every engine fits its limit through them, so the conformance comparisons cannot see a slip in them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference.contract.accumulation_limit import (
    LIMIT_MARGIN_DIVISOR,
    FloorMeter,
    MemoryLimit,
    fit_limit,
    limit_margin,
    smallest_limit,
)
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("harness")


def test_the_margin_is_two_percent_rounded_down():
    assert LIMIT_MARGIN_DIVISOR == 50
    assert (limit_margin(49), limit_margin(50), limit_margin(1000), limit_margin(1049)) == (0, 1, 20, 20)


@pytest.mark.parametrize("floor", [*range(0, 300), 4899, 4900, 4901, 10**9, 10**9 + 7])
def test_smallest_limit_is_the_least_limit_that_runs(floor):
    """The least L >= 1 whose margin leaves ``floor``: it runs, and L - 1 does not (or L is 1)."""
    lim = smallest_limit(floor)
    assert lim >= 1 and lim - limit_margin(lim) >= floor
    assert lim == 1 or (lim - 1) - limit_margin(lim - 1) < floor


def test_fit_limit_spends_the_limit_and_refuses_with_the_figures():
    spent = fit_limit(10_000, 6_000)
    assert spent == MemoryLimit(limit_bytes=10_000, floor_bytes=6_000, margin_bytes=200, budget_bytes=3_800)
    assert fit_limit(smallest_limit(6_000), 6_000).budget_bytes >= 0
    assert fit_limit(1000, 980).budget_bytes == 0
    with pytest.raises(ConfigurationError, match="smallest limit that runs"):
        fit_limit(1000, 981)  # one byte short of the floor plus the margin
    gib = 1 << 30
    with pytest.raises(ConfigurationError) as info:
        fit_limit(2 * gib, 3 * gib)
    text = str(info.value)
    assert "gpu_memory_limit=2147483648 bytes (2.00 GiB)" in text and f"{3 * gib} bytes (3.00 GiB)" in text
    need = smallest_limit(3 * gib)
    assert f"the smallest limit that runs is {need} bytes ({need / gib:.2f} GiB)" in text
    assert f"allowed: gpu_memory_limit >= {need}" in text


def test_a_memory_limit_record_is_consistent_and_frozen():
    with pytest.raises(ValueError, match="margin_bytes"):
        MemoryLimit(limit_bytes=1000, floor_bytes=100, margin_bytes=0, budget_bytes=880)
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryLimit(limit_bytes=1000, floor_bytes=100, margin_bytes=20, budget_bytes=879)
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryLimit(limit_bytes=1000, floor_bytes=990, margin_bytes=20, budget_bytes=-10)
    with pytest.raises(ValueError, match="budget_bytes"):  # consistent, but one byte short
        MemoryLimit(limit_bytes=1000, floor_bytes=981, margin_bytes=20, budget_bytes=-1)
    ok = MemoryLimit(limit_bytes=1000, floor_bytes=100, margin_bytes=20, budget_bytes=880)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.budget_bytes = 0  # type: ignore[misc]


class _Counter:
    """An accelerator whose peak counter says what the test wants."""

    name = "counter"

    def __init__(self, peak: object) -> None:
        self.peak, self.resets = peak, 0

    def reset_peak_memory(self, index: int | None) -> None:
        self.resets += 1

    def peak_memory_allocated(self, index: int | None) -> object:
        return self.peak


@pytest.mark.parametrize("peak", [-1, 1.5, None, True])
def test_the_floor_meter_refuses_a_counter_that_is_no_byte_count(peak):
    meter = FloorMeter(_Counter(peak), torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="peak_memory_allocated"):
        meter.floor()


def test_the_floor_meter_restarts_the_counter_and_reads_it():
    acc = _Counter(0)
    meter = FloorMeter(acc, torch.device("cpu"))  # type: ignore[arg-type]
    assert acc.resets == 1
    assert meter.floor() == 0, "nothing allocated yet is a floor of 0 bytes"
    acc.peak = 12345
    assert meter.floor() == 12345
