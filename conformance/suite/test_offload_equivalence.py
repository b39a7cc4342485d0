"""Offload must not change a single bit: outputs and gradients equal the same model run without offload.

Hypothesis draws layer stacks (depth, widths, fp32/bf16, saved views with offsets, strides, transposes and
stride 0, strided and shared inputs, residuals, dropout, every checkpoint flavour) and knob combinations,
and runs several steps with one manager (so the optimized pool is reused) on every selected accelerator
(cpu runs the engine logic with streams off; cuda runs the stream path).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.offload_assertions import assert_nothing_held, assert_results_bitwise_equal
from conformance.areas.offload_strategies import build_stack, make_input, offload_knobs, run_step, stack_specs

pytestmark = pytest.mark.conformance_area("offload")

STEPS = 2
# Each example runs 2 x STEPS forward/backward passes of a whole stack; a third of the profile's example
# count keeps this module within the CI budget (about a minute per implementation on 2 cores) while the
# profile still scales.
_FEWER = settings(max_examples=max(5, settings.default.max_examples // 3))


@_FEWER
@given(spec=stack_specs(), knobs=offload_knobs(), backward_inside=st.booleans())
def test_bitwise_equal_to_no_offload(area_api, accelerator, spec, knobs, backward_inside):
    device = accelerator.device()
    model = build_stack(spec, device)
    manager = area_api.ActivationOffload(accelerator=accelerator, **knobs)
    for step in range(STEPS):
        leaf = make_input(spec, step, device)
        expected = run_step(model, leaf, area_api, step)
        actual = run_step(model, leaf, area_api, step, manager=manager, backward_inside=backward_inside)
        assert_results_bitwise_equal(actual, expected, f"step {step} spec={spec} knobs={knobs}")
    assert_nothing_held(manager, f"spec={spec} knobs={knobs}")
    manager.close()


@_FEWER
@given(spec=stack_specs(max_depth=3))
def test_offloads_something_when_everything_qualifies(area_api, accelerator, spec):
    """Guards the equivalence test against passing vacuously: with no threshold every stack offloads."""
    device = accelerator.device()
    model = build_stack(spec, device)
    manager = area_api.ActivationOffload(accelerator=accelerator, mode="all", min_offload_bytes=0, keep_last_count=0)
    expected = run_step(model, make_input(spec, 0, device), area_api, 0)
    actual = run_step(model, make_input(spec, 0, device), area_api, 0, manager=manager)
    assert_results_bitwise_equal(actual, expected, f"spec={spec}")
    stats = manager.stats
    assert stats.tensors_offloaded > 0, f"nothing was offloaded for spec={spec}: {stats}"
    assert stats.tensors_restored == stats.tensors_offloaded, (
        f"every offloaded tensor is needed by the single backward: restored {stats.tensors_restored} "
        f"!= offloaded {stats.tensors_offloaded} ({stats})"
    )


def test_same_decisions_as_reference(area_api, reference_api, accelerator):
    """With no host cap, what is offloaded, kept and skipped is part of the contract (not how it moves)."""
    spec = _fixed_spec()
    device = accelerator.device()
    model = build_stack(spec, device)
    counts = {}
    for name, api in (("impl", area_api), ("reference", reference_api)):
        manager = api.ActivationOffload(accelerator=accelerator, min_offload_bytes=64, keep_last_count=2)
        run_step(model, make_input(spec, 0, device), api, 0, manager=manager)
        s = manager.stats
        counts[name] = (
            s.tensors_offloaded,
            s.bytes_offloaded,
            s.tensors_kept,
            s.tensors_skipped,
            s.skipped_by_reason,
            s.tensors_restored,
        )
    assert counts["impl"] == counts["reference"], f"decisions differ: {counts}"


def _fixed_spec():
    import torch

    from conformance.areas.offload_strategies import StackSpec

    return StackSpec(
        dtype=torch.float32,
        batch=4,
        widths=(8, 8, 16, 8),
        residual=(True, False, False),
        views=("offset", "transpose", "expand"),
        checkpoints=("none", "torch", "impl"),
        dropout=True,
        strided_input=True,
        shared_input=True,
        seed=3,
    )
