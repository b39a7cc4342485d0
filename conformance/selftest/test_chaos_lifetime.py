"""The chaos accelerator's lifetime rule (conformance.faults.chaos, module docstring) on hand-made copies: memory freed
while a copy on another stream still uses it is a use-after-free on a device, and must fail here although the
host would keep the bytes; each of the three ways to make it safe must pass."""

from __future__ import annotations

import gc

import pytest
import torch

from conformance.faults.chaos import ChaosAccelerator, ChaosSchedule, ChaosViolation

pytestmark = pytest.mark.conformance_area("harness")


def _stalled() -> ChaosAccelerator:
    """Side stream 0 never advances by itself: a queued copy runs only when something waits for it."""
    return ChaosAccelerator(ChaosSchedule(seed=0, eagerness=0.0, stall=0))


def _copy_then_drop(chaos: ChaosAccelerator, *, record: bool = False, order: bool = False,
                    keep: list | None = None) -> torch.Tensor:
    side = chaos.new_stream()
    host = torch.zeros(1024)
    with chaos.activate():
        src = torch.arange(1024, dtype=torch.float32) * 1  # allocated on the host stream
        ready = chaos.new_event()
        ready.record()
        ready.wait(side)
        with chaos.stream(side):
            host.copy_(src, non_blocking=True)
        done = chaos.new_event()
        done.record(side)
        if record:
            src.record_stream(side)
        if order:
            done.wait(chaos.current_stream())  # the allocation stream waits: reuse there comes after the copy
        if keep is not None:
            keep.append(src)
        del src
        gc.collect()
        done.synchronize()
    return host


def test_a_source_freed_before_its_copy_ran_is_a_violation():
    with pytest.raises(ChaosViolation, match=r"source of a copy queued on side0 .* freed before the copy ran"):
        _copy_then_drop(_stalled())


@pytest.mark.parametrize("how", ["record_stream", "ordered", "kept alive"])
def test_a_source_freed_safely_is_not(how):
    keep: list = []
    host = _copy_then_drop(_stalled(), record=how == "record_stream", order=how == "ordered",
                           keep=keep if how == "kept alive" else None)
    assert torch.equal(host, torch.arange(1024, dtype=torch.float32))


def test_a_destination_allocated_on_the_copy_stream_may_be_freed():
    """Memory allocated while the copy's own stream was current is reused in that stream's order: dropping it
    while the copy is queued is safe (how an engine allocates its prefetch buffers)."""
    chaos = _stalled()
    side = chaos.new_stream()
    src = torch.ones(256)
    with chaos.activate():
        with chaos.stream(side):
            dst = torch.empty(256)
        made = chaos.new_event()
        made.record()  # (host ops run on the host stream here: order the allocation's write before the copy)
        made.wait(side)
        with chaos.stream(side):
            dst.copy_(src, non_blocking=True)
        done = chaos.new_event()
        done.record(side)
        del dst
        gc.collect()
        done.synchronize()
