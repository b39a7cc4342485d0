"""Drawn scenarios, run by every implementation of the area, compared with the reference trace (R25, R26).

For the reference itself the comparison is a second, independent run: it checks that a scenario determines its
trace (R25 determinism). An optimized engine joins simply by declaring the area: its ``run_scenario`` gets the
same scenarios and must reproduce the reference's records within R25.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given

from conformance.areas.accumulation_assertions import (
    assert_matches_reference,
    assert_replay_consistent,
    assert_traces_match,
    cross_implementation_tolerance,
    replay_applies,
)
from conformance.areas.accumulation_strategies import scenarios
from reference.accumulation import BackwardRecord, ControlRecord, Scenario, StepRecord, Trace

pytestmark = pytest.mark.conformance_area("accumulation")


@given(scenario=scenarios())
def test_R25_R26_drawn_scenario_matches_reference_trace(area_api, reference_api, impl, accelerator, scenario):
    """R25/R26: stage 0-3, managed or not, gas, 0-3 backwards per step, W 1-4, fp32/bf16 with any
    communication and accumulation dtype, clipping off/default/always, SGD/Adam/AdamW, offload: the
    implementation's trace equals the reference trace (or meets R25's tolerance where the arithmetic may
    differ), and its own boundary epilogue
    replays exactly (R13-R16)."""
    actual, _ = assert_matches_reference(
        area_api, reference_api, scenario, cross_implementation_tolerance(scenario, impl, accelerator)
    )
    if replay_applies(impl):
        assert_replay_consistent(actual)


@given(scenario=scenarios(world_sizes=(1, 2)))
def test_R26_trace_has_one_record_per_call(area_api, scenario):
    """R26: one record per call, in call order, of the kind that matches the call; losses one per rank."""
    trace = area_api.run_scenario(scenario)
    assert isinstance(trace, Trace)
    assert trace.scenario == scenario
    assert [r.call_index for r in trace.records] == list(range(len(scenario.calls)))
    for call, rec in zip(scenario.calls, trace.records, strict=True):
        kind = type(call).__name__
        expected = {"Backward": BackwardRecord, "Step": StepRecord}.get(kind, ControlRecord)
        assert isinstance(rec, expected), f"call {kind} produced {type(rec).__name__}"
        if isinstance(rec, BackwardRecord):
            assert len(rec.losses) == scenario.world_size
        if isinstance(rec, StepRecord) and rec.boundary:
            assert rec.gradients is not None and rec.grad_norm is not None
            assert set(rec.parameters) == set(trace.initial_parameters)


@given(scenario=scenarios(world_sizes=(1, 2)))
def test_R26_scenario_survives_pickling(reference_api, scenario):
    """R26: a scenario is plain data a multi-process runner can send to its workers; the copy runs
    identically."""
    copy = pickle.loads(pickle.dumps(scenario))
    assert isinstance(copy, Scenario) and copy == scenario
    assert_traces_match(reference_api.run_scenario(copy), reference_api.run_scenario(scenario))


@pytest.mark.gpu
@given(scenario=scenarios(world_sizes=(1, 2)))
def test_R17_R25_reference_engine_on_device_matches_host_run(reference_api, accelerator, scenario):
    """R17/R25: the reference engine placed on a device accelerator (offload keeping state on the host) agrees
    with its host run within R25's tolerance, with the same records, flags and counters."""
    if accelerator.device_type == "cpu":
        pytest.skip("needs a device accelerator; the host run is the reference itself")
    from conformance.areas.accumulation_assertions import arithmetic_tolerance

    host = reference_api.run_scenario(scenario)
    device = reference_api.run_scenario(scenario, device=accelerator.device())
    assert_traces_match(device, host, arithmetic_tolerance(scenario))


@given(scenario=scenarios(world_sizes=(2, 3)))
def test_R26_per_rank_traces_merge_into_the_trace(reference_api, scenario):
    """R26: splitting a trace into per-rank traces (each BackwardRecord keeping only that rank's loss) and merging
    them with merge_rank_traces gives the trace back; ranks that disagree on a flag are reported."""
    api = reference_api
    trace = api.run_scenario(scenario)

    def rank_view(r, flip_boundary_at=None):
        recs = []
        for rec in trace.records:
            if isinstance(rec, BackwardRecord):
                boundary = rec.boundary if rec.call_index != flip_boundary_at else not rec.boundary
                rec = BackwardRecord(rec.call_index, boundary, (rec.losses[r],), rec.counters)
            recs.append(rec)
        return Trace(scenario, trace.initial_parameters, tuple(recs))

    views = [rank_view(r) for r in range(scenario.world_size)]
    assert_traces_match(api.merge_rank_traces(scenario, views), trace)
    backward = next((rec for rec in trace.records if isinstance(rec, BackwardRecord)), None)
    if backward is not None:
        views[-1] = rank_view(scenario.world_size - 1, flip_boundary_at=backward.call_index)
        with pytest.raises(api.ConfigurationError, match="ranks disagree"):
            api.merge_rank_traces(scenario, views)
