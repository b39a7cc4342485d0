"""The multi-process ZeRO engine (gloo, one process per rank) against the reference trace (R25, R26).

Engine-specific: only implementations whose accumulation module is a real multi-process engine
(``Capabilities.distributed_engine``) run these. The drawn scenarios of test_accumulation_scenarios.py already cover
W = 1..4 broadly; here fixed scenarios pin down every stage x managed/unmanaged x offload combination at W = 1
and 2, a reduced set at W = 3 and 4, and the bucketing of stages 2/3 (one bucket per parameter, and one bucket
for everything) so that each is checked bitwise on every CI run, not only when hypothesis happens to draw it.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from conformance.areas.accumulation_assertions import (
    arithmetic_tolerance,
    assert_matches_reference,
    assert_traces_match,
    cross_implementation_tolerance,
)
from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_ENGINE, engine_api
from conformance.areas.accumulation_strategies import scenarios
from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, scenario_calls

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, IN_RANK_PROCESSES]

# Managed: boundary every second step, an override, and a no_sync group on stages 0/1. Unmanaged: 2, 1, 3
# backwards per step (R6, R22's idiom with loss / N left to the drawn tests).
MANAGED_CALLS = "BSBSFBSTBS"
MANAGED_NO_SYNC = "[B]SBSFBSTBS"
UNMANAGED_CALLS = "BBSBSBBBS"


def _scenario(stage: int, managed: bool, world: int, *, dtype: str = "fp32", offload: bool = False, **extra):
    cfg = AccumulationConfig(
        zero_stage=stage,
        managed_gradient_accumulation=managed,
        gradient_accumulation_steps=2,
        dtype=dtype,
        grad_accum_dtype="fp32" if dtype == "bf16" else None,
        gradient_clipping=0.05,
        optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer="cpu" if offload else "none",
        offload_param="cpu" if offload and stage == 3 else "none",
        **extra,
    )
    if managed:
        calls = MANAGED_NO_SYNC if stage <= 1 else MANAGED_CALLS
    else:
        calls = UNMANAGED_CALLS
    spec = ModelSpec(checkpoint=stage == 3)
    return Scenario(cfg, world, scenario_calls(calls), model=spec, seed=11 + stage, name=f"engine-s{stage}")


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_R25_R26_engine_matches_reference_every_stage_w1_w2(area_api, reference_api, impl, accelerator, world, stage,
                                                            managed, offload):
    """R25/R26 (R9, R10, R12, R17, R18, R21 exercised): every stage, managed (override, no_sync) and unmanaged,
    with and without CPU offload, at W = 1 and 2 on gloo: the trace equals the reference trace bitwise."""
    api = engine_api(impl)
    sc = _scenario(stage, managed, world, dtype="bf16" if stage % 2 else "fp32", offload=offload)
    assert_matches_reference(api, reference_api, sc, cross_implementation_tolerance(sc, impl, accelerator))


@pytest.mark.parametrize(
    ("world", "stage", "managed"),
    [(3, 0, True), (3, 2, False), (3, 3, True), (4, 1, False), (4, 2, True), (4, 3, False)],
)
def test_R24_R25_engine_matches_reference_w3_w4(area_api, reference_api, impl, accelerator, world, stage, managed):
    """R24/R25: at W = 3 and 4, where a transport-ordered sum could differ in the last bits, the engine's
    rank-ordered reduce-scatter reproduces the reference (exactly when the implementation declares
    accumulation_rank_ordered_reduction, within R25's tolerance otherwise)."""
    api = engine_api(impl)
    sc = _scenario(stage, managed, world, dtype="bf16", offload=stage == 3)
    assert_matches_reference(api, reference_api, sc, cross_implementation_tolerance(sc, impl, accelerator))


@pytest.mark.parametrize("bucket_elements", [1, 10**9], ids=["bucket-per-parameter", "one-bucket"])
@pytest.mark.parametrize("stage", [2, 3])
def test_R10_bucketing_changes_no_bit(impl, area_api, reference_api, stage, bucket_elements):
    """R10: the per-backward reduction is elementwise, so how the flat buffer is cut into buckets (each
    launched from the gradient hooks as soon as it is complete) cannot change a bit of the trace."""
    api = engine_api(impl)
    sc = _scenario(stage, False, 2, dtype="bf16")
    assert_traces_match(api.run_scenario(sc, bucket_elements=bucket_elements), reference_api.run_scenario(sc))


@pytest.mark.parametrize("stage", [2, 3])
def test_R19_unmanaged_overlap_comm_on_stages_2_3_through_the_engine(impl, area_api, reference_api, stage):
    """R19: unmanaged mode with overlap_comm stays allowed on stages 2/3, and the engine (which always overlaps
    the bucket reductions with backward there) gives the reference trace."""
    api = engine_api(impl)
    sc = _scenario(stage, False, 2, overlap_comm=True)
    assert_traces_match(api.run_scenario(sc), reference_api.run_scenario(sc))


@pytest.mark.gpu
@given(scenario=scenarios(world_sizes=(1,)))
def test_R17_R25_engine_on_nccl_matches_reference_within_tolerance(impl, reference_api, accelerator, scenario):
    """R25/R17: the engine on NCCL (world size 1, rank on the GPU, offload keeping state on the host) gives the
    reference's records, flags and counters exactly and its values within R25's device tolerance."""
    api = engine_api(impl)
    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL); the host runs are the tests above")
    # The reference runs on the same device, so both traces come from the same kernels (a CPU reference would
    # bring CPU-vs-GPU bf16 matmul differences that grow through the optimizer steps); only the reduction and
    # the optimizer's placement can differ, which R25's tolerance covers.
    assert_matches_reference(
        api, reference_api, scenario, arithmetic_tolerance(scenario),
        reference_kwargs={"device": accelerator.device()}, backend="nccl"
    )
