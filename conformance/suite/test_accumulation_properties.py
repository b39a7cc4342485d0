"""Properties of the accumulation model itself, checked on every implementation of the area.

Each test states one rule or one consequence of the rules of docs/accumulation.md (ids in the names and
docstrings). Where two runs perform the same arithmetic the comparison is exact; the one documented exception
is R23's summation-order bound.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import (
    assert_boundaries_match,
    assert_named_tensors,
    assert_replay_consistent,
    assert_tensor_close,
    assert_tensor_equal,
    assert_traces_match,
    local_gradients_before_first_boundary,
    replay_applies,
    summation_error_bound,
)
from conformance.areas.accumulation_strategies import (
    accumulation_configs,
    call_sequences,
    model_specs,
    optimizer_configs,
    scenarios,
)
from reference.accumulation import (
    AccumulationConfig,
    Backward,
    BackwardRecord,
    ControlRecord,
    EnterNoSync,
    ExitNoSync,
    ModelSpec,
    Scenario,
    SetBoundary,
    Step,
    build_layout,
)

pytestmark = pytest.mark.conformance_area("accumulation")

worlds = st.sampled_from((1, 2, 3, 4))
seeds = st.integers(0, 2**16)


def _at_stage(cfg: AccumulationConfig, stage: int) -> AccumulationConfig:
    """``cfg`` moved to ``stage``, dropping parameter offload where R19 forbids it."""
    return cfg.replace(zero_stage=stage, offload_param=cfg.offload_param if stage == 3 else "none")


# ---- R2, R3, R6: boundaries and counters -------------------------------------------------------------------


def _expected_flags_and_counters(sc: Scenario) -> list[tuple[bool, tuple[int, int, int] | None]]:
    """An independent statement of R2/R3/R6: (boundary flag, counters after) per call; None = no counters."""
    cfg = sc.config
    managed, gas = cfg.managed_gradient_accumulation, cfg.gradient_accumulation_steps
    per_step = cfg.train_micro_batch_size_per_gpu * sc.world_size
    micro = steps = samples = since = 0
    override = None
    out = []

    def boundary_now() -> bool:
        if not managed:
            return False
        return override if override is not None else (micro + 1) % gas == 0

    for call in sc.calls:
        if isinstance(call, Backward):
            flag = boundary_now()
            since += 1
            out.append((flag, (micro, steps, samples)))
        elif isinstance(call, Step):
            flag = boundary_now() if managed else True
            if flag:
                steps += 1
                samples += per_step * (gas if managed else since)
                since = 0
            if managed:
                micro += 1
            out.append((flag, (micro, steps, samples)))
        else:
            if isinstance(call, SetBoundary):
                override = call.flag
            out.append((boundary_now(), None))
    return out


@st.composite
def counter_scenarios(draw):
    cfg = draw(accumulation_configs(dtypes=("fp32",)))
    cfg = cfg.replace(gradient_accumulation_steps=draw(st.integers(1, 4)))
    return Scenario(cfg, draw(st.sampled_from((1, 2))), draw(call_sequences(cfg, max_steps=6)), seed=draw(seeds))


@given(sc=counter_scenarios())
def test_R2_R3_R6_boundary_flags_and_counters(area_api, sc):
    """R2/R3 (managed: boundary from micro_steps or the override; micro_steps per step, global counters per
    boundary with mb*W*gas samples) and R6 (unmanaged: no micro-step counting, every step a boundary,
    mb*W*backwards samples, is_gradient_accumulation_boundary() False outside step())."""
    trace = area_api.run_scenario(sc)
    expected = _expected_flags_and_counters(sc)
    for rec, (flag, counters) in zip(trace.records, expected, strict=True):
        assert rec.boundary == flag, f"record {rec.call_index} ({type(rec).__name__}): boundary {rec.boundary}"
        if counters is not None:
            got = (rec.counters.micro_steps, rec.counters.global_steps, rec.counters.global_samples)
            assert got == counters, f"record {rec.call_index}: counters {got} != expected {counters}"


# ---- R4: a non-boundary step changes nothing ---------------------------------------------------------------


@given(cfg=accumulation_configs(managed=True), world=worlds, seed=seeds, n_back=st.integers(0, 2))
def test_R4_non_boundary_step_changes_nothing(reference_api, cfg, world, seed, n_back):
    """R4: a non-boundary step leaves parameters, fp32 masters and optimizer state as they were, and the
    gradients
    accumulated before it reach the next boundary exactly as if the step had not been called."""
    api = reference_api
    cfg = cfg.replace(gradient_accumulation_steps=3)
    sc = Scenario(cfg, world, (), seed=seed)
    engine = api.build_engine(sc)

    def backward(index):
        losses = [
            api.compute_loss(engine.module(r), *api.micro_batch(sc, index, r), cfg.model_dtype) for r in range(world)
        ]
        engine.backward(losses)

    # One boundary first, so that optimizer state is non-trivial.
    engine.set_gradient_accumulation_boundary(True)
    backward(0)
    engine.step()
    engine.set_gradient_accumulation_boundary(False)
    before = (engine.full_parameters(), engine.master_partitions(), engine.optimizer_states())
    for k in range(n_back):
        backward(1 + k)
    out = engine.step()
    assert out.boundary is False and out.gradients is None and out.grad_norm is None
    assert_named_tensors(engine.full_parameters(), before[0], "parameters after a non-boundary step")
    for r, (m, m0) in enumerate(zip(engine.master_partitions(), before[1], strict=True)):
        assert_tensor_equal(m, m0, f"fp32 master of rank {r} after a non-boundary step")
    for r, (s, s0) in enumerate(zip(engine.optimizer_states(), before[2], strict=True)):
        assert s.step == s0.step
        for name in s0.buffers:
            assert_tensor_equal(s.buffers[name], s0.buffers[name], f"optimizer {name} of rank {r}")
    # The accumulated gradients survive: same boundary as a run without the intermediate step.
    calls_with = (
        SetBoundary(True),
        Backward(),
        Step(),
        SetBoundary(False),
        *[Backward()] * n_back,
        Step(),
        SetBoundary(True),
        Backward(),
        Step(),
    )
    calls_without = (
        SetBoundary(True),
        Backward(),
        Step(),
        SetBoundary(False),
        *[Backward()] * n_back,
        SetBoundary(True),
        Backward(),
        Step(),
    )
    assert_boundaries_match(
        api.run_scenario(dataclasses.replace(sc, calls=calls_with)),
        api.run_scenario(dataclasses.replace(sc, calls=calls_without)),
        "R4: with vs without a non-boundary step",
    )


# ---- R5: scale_wrt_gas -------------------------------------------------------------------------------------


@given(cfg=accumulation_configs(), world=worlds, seed=seeds, n=st.integers(1, 3))
def test_R5_scale_wrt_gas_is_division_by_configured_gas(area_api, cfg, world, seed, n):
    """R5: backward(loss, scale_wrt_gas=True) equals backward(loss / gas, scale_wrt_gas=False), bitwise, in
    both
    modes (the configured gas, whatever the number of backwards)."""
    gas = cfg.gradient_accumulation_steps
    tail = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    scaled = Scenario(cfg, world, (*tail, *[Backward(True)] * n, Step()), seed=seed)
    manual = Scenario(cfg, world, (*tail, *[Backward(False, gas)] * n, Step()), seed=seed)
    assert_traces_match(area_api.run_scenario(scaled), area_api.run_scenario(manual))


# ---- R22: unmanaged == managed with override ---------------------------------------------------------------


@given(
    base=accumulation_configs(managed=True),
    world=worlds,
    seed=seeds,
    n=st.integers(1, 4),
    rounds=st.integers(1, 2),
    steps_between=st.booleans(),
    spec=model_specs(),
)
def test_R22_unmanaged_equals_managed_with_override(area_api, base, world, seed, n, rounds, steps_between, spec):
    """R22: N backwards of loss/N + one step in unmanaged mode == the same backwards in managed mode with the
    override False before each but the last (optionally a non-boundary step after each) and True before the
    last;
    every stage, offload on or off, bitwise, over several boundaries."""
    managed = base.replace(overlap_comm=False)
    unmanaged = managed.replace(managed_gradient_accumulation=False)
    un_calls, m_calls = [], []
    for _ in range(rounds):
        un_calls += [Backward(False, n)] * n + [Step()]
        for i in range(n):
            m_calls += [SetBoundary(i == n - 1), Backward(False, n)]
            if steps_between and i < n - 1:
                m_calls.append(Step())
        m_calls.append(Step())
    a = area_api.run_scenario(Scenario(unmanaged, world, tuple(un_calls), model=spec, seed=seed))
    b = area_api.run_scenario(Scenario(managed, world, tuple(m_calls), model=spec, seed=seed))
    assert_boundaries_match(a, b, "R22 unmanaged vs managed+override")


# ---- R23: stages agree -------------------------------------------------------------------------------------


@given(
    cfg=accumulation_configs(managed=True),
    world=worlds,
    seed=seeds,
    steps=st.integers(1, 3),
    spec=model_specs(),
)
def test_R23_all_stages_bitwise_equal_with_one_backward_per_boundary(area_api, cfg, world, seed, steps, spec):
    """R23: with one backward per boundary (gas=1) and an accumulation dtype at least as wide as the model
    dtype, every stage, with or without offload, gives the same trace bitwise (R9 and R10 perform the same
    roundings)."""
    if cfg.dtype == "fp32" and cfg.grad_accum_dtype == "bf16":
        cfg = cfg.replace(grad_accum_dtype="fp32")
    calls = (Backward(), Step()) * steps
    traces = []
    for stage in (0, 1, 2, 3):
        c = _at_stage(cfg, stage).replace(gradient_accumulation_steps=1)
        traces.append(area_api.run_scenario(Scenario(c, world, calls, model=spec, seed=seed)))
    for stage in (1, 2, 3):
        assert_traces_match(traces[stage], traces[0])


@given(cfg=accumulation_configs(managed=False), seed=seeds, n=st.integers(2, 3), spec=model_specs())
def test_R23_all_stages_bitwise_equal_at_world_size_1(area_api, cfg, seed, n, spec):
    """R23: at W=1, with a communication dtype at least as wide as the model and accumulation dtypes, the
    stages
    agree bitwise even with several backwards per boundary (dividing by 1 is exact, every cast is exact)."""
    if "fp32" in (cfg.dtype, cfg.grad_accum_dtype):
        cfg = cfg.replace(communication_data_type="fp32")
    cfg = cfg.replace(offload_param="none")
    calls = (*[Backward()] * n, Step(), *[Backward()] * n, Step())
    traces = [
        area_api.run_scenario(Scenario(cfg.replace(zero_stage=s, overlap_comm=False), 1, calls, model=spec, seed=seed))
        for s in (0, 1, 2, 3)
    ]
    for s in (1, 2, 3):
        assert_traces_match(traces[s], traces[0])


@given(
    cfg=accumulation_configs(managed=False),
    world=st.sampled_from((2, 3, 4)),
    seed=seeds,
    n=st.integers(2, 4),
    spec=model_specs(),
)
def test_R23_stages_01_vs_23_within_summation_bound(area_api, cfg, world, seed, n, spec):
    """R23: with several backwards per boundary, stages 0/1 (R9) and 2/3 (R10) differ only by summation order:
    the first boundary's gradients agree within the documented recursive-summation bound, computed per element
    from the local gradients (plain autograd, independent of any engine)."""
    calls = (*[Backward()] * n, Step())
    cfg = cfg.replace(overlap_comm=False)
    local_sc = Scenario(_at_stage(cfg, 0), world, calls, model=spec, seed=seed)
    traces = {}
    for s in (0, 1, 2, 3):
        traces[s] = area_api.run_scenario(dataclasses.replace(local_sc, config=_at_stage(cfg, s)))
    bound_flat = summation_error_bound(local_sc, local_gradients_before_first_boundary(local_sc))
    g0 = traces[0].boundaries()[0].gradients
    layout = build_layout([(k, v.shape) for k, v in g0.items()], world)
    for a, b in ((0, 2), (1, 3), (0, 3)):
        ga, gb = traces[a].boundaries()[0].gradients, traces[b].boundaries()[0].gradients
        for seg in layout.segments:
            bound = bound_flat[seg.offset : seg.end].view(seg.shape)
            assert_tensor_close(
                gb[seg.name], ga[seg.name], f"stage {b} vs {a} gradient {seg.name}", rtol=0.0, atol=bound
            )
    assert_traces_match(traces[1], traces[0])  # same order (R9) at stages 0 and 1
    assert_traces_match(traces[3], traces[2])  # same order (R10) at stages 2 and 3


# ---- R7, R9, R10, R11: the reduced gradient, from an independent oracle ------------------------------------


def _fold(terms: list[torch.Tensor], world: int) -> torch.Tensor:
    total = terms[0] / world
    for t in terms[1:]:
        total = total + t / world
    return total


@given(cfg=accumulation_configs(), world=worlds, seed=seeds, n=st.integers(1, 3), spec=model_specs())
def test_R7_R9_R10_R11_first_boundary_gradient_follows_the_formula(area_api, cfg, world, seed, n, spec):
    """R7 (one flat model-dtype gradient per backward, zeros for unused parameters), R9 (stages 0/1: local
    accumulation in grad_accum_dtype, one rank-ordered reduction in communication_data_type), R10 (stages 2/3:
    reduction per backward, accumulation of the reduced result), R11 (dtype defaults): the recorded gradient
    of
    the first boundary equals the formula evaluated on gradients from plain autograd, bitwise."""
    cfg = cfg.replace(gradient_accumulation_steps=1) if cfg.managed_gradient_accumulation else cfg
    calls = (*([SetBoundary(True)] if cfg.managed_gradient_accumulation else []), *[Backward()] * n, Step())
    sc = Scenario(cfg, world, calls, model=spec, seed=seed)
    local = local_gradients_before_first_boundary(sc)
    acc, comm = cfg.accum_dtype, cfg.comm_dtype
    if cfg.zero_stage <= 1:
        accs = [torch.zeros_like(local[0][0], dtype=acc) for _ in range(world)]
        for per_rank in local:
            accs = [a + g.to(acc) for a, g in zip(accs, per_rank, strict=True)]
        expected = _fold([a.to(comm) for a in accs], world).to(acc)
    else:
        expected = torch.zeros_like(local[0][0], dtype=acc)
        for per_rank in local:
            expected = expected + _fold([g.to(comm) for g in per_rank], world).to(acc)
    got = area_api.run_scenario(sc).boundaries()[0].gradients
    layout = build_layout([(k, v.shape) for k, v in got.items()], world)
    for seg in layout.segments:
        assert_tensor_equal(
            got[seg.name],
            expected[seg.offset : seg.end].view(seg.shape).float(),
            f"stage {cfg.zero_stage} reduced gradient {seg.name}",
        )
    if spec.unused_parameter:
        assert not bool(got["unused"].any()), "R7: the unused parameter's gradient must be zero"


@given(cfg=accumulation_configs(), world=worlds, seed=seeds)
def test_R7_frozen_parameters_never_change_and_have_no_gradient(area_api, cfg, world, seed):
    """R7: frozen parameters are absent from the recorded gradients and equal their initial value in every
    record; the unused trainable parameter is present with a zero gradient."""
    spec = ModelSpec(frozen_layer=True, unused_parameter=True)
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    trace = area_api.run_scenario(
        Scenario(cfg, world, (*lead, Backward(), Step(), Backward(), Step()), model=spec, seed=seed)
    )
    frozen = ("frozen.weight", "frozen.bias")
    for rec in trace.steps():
        for name in frozen:
            assert_tensor_equal(rec.parameters[name], trace.initial_parameters[name], f"record {rec.call_index} {name}")
        if rec.gradients is not None:
            assert not set(frozen) & set(rec.gradients), "frozen parameters must have no gradient entry"
            assert not bool(rec.gradients["unused"].any())


# ---- R1: ranks start equal and stay equal ------------------------------------------------------------------


@given(cfg=accumulation_configs(), world=worlds, seed=seeds, spec=model_specs())
def test_R1_initial_parameters_are_the_seeded_model_in_model_dtype(area_api, cfg, world, seed, spec):
    """R1: every rank starts from the model built once from the seed, cast to the model dtype."""
    trace = area_api.run_scenario(Scenario(cfg, world, (), model=spec, seed=seed))
    built = dict(spec.build(seed).to(cfg.model_dtype).named_parameters())
    assert_named_tensors(trace.initial_parameters, {k: v.detach() for k, v in built.items()}, "initial parameters")


@given(cfg=accumulation_configs(stages=(0, 1, 2)), world=st.sampled_from((2, 3, 4)), seed=seeds)
def test_R1_R12_every_rank_holds_the_same_parameters_after_steps(reference_api, cfg, world, seed):
    """R1/R12: after boundaries every rank's replica holds the same parameters (stage 0 updates redundantly,
    stages 1/2 all-gather), and stage 0 keeps full masters while stages 1/2 keep one partition per rank."""
    api = reference_api
    sc = Scenario(cfg.replace(managed_gradient_accumulation=False, overlap_comm=False), world, ())
    engine = api.build_engine(sc)
    for k in range(2):
        engine.backward(
            [api.compute_loss(engine.module(r), *api.micro_batch(sc, k, r), cfg.model_dtype) for r in range(world)]
        )
        engine.step()
    p0 = engine.full_parameters(0)
    for r in range(1, world):
        assert_named_tensors(engine.full_parameters(r), p0, f"parameters of rank {r} vs rank 0")
    sizes = {m.numel() for m in engine.master_partitions()}
    assert sizes == {engine.layout.total if cfg.zero_stage == 0 else engine.layout.partition_size}


# ---- R24: rank order ---------------------------------------------------------------------------------------


@given(cfg=accumulation_configs(), seed=seeds, spec=model_specs())
def test_R24_world_2_trace_independent_of_rank_order(area_api, cfg, seed, spec):
    """R24: at W=2 swapping which rank reads which data changes nothing but the order of the recorded
    losses."""
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    calls = (*lead, Backward(), Backward(), Step(), Backward(), Backward(), Backward(), Step())
    a = area_api.run_scenario(Scenario(cfg, 2, calls, model=spec, seed=seed))
    b = area_api.run_scenario(Scenario(cfg, 2, calls, model=spec, seed=seed, data_ranks=(1, 0)))
    for ra, rb in zip(a.records, b.records, strict=True):
        if isinstance(ra, BackwardRecord):
            assert_tensor_equal(ra.losses[0], rb.losses[1], f"record {ra.call_index} loss")
            assert_tensor_equal(ra.losses[1], rb.losses[0], f"record {ra.call_index} loss")
    assert_boundaries_match(b, a, "R24 swapped data ranks")


@given(
    values=st.lists(st.floats(-1e4, 1e4, width=32, allow_subnormal=False), min_size=1, max_size=16),
    other=st.lists(st.floats(-1e4, 1e4, width=32, allow_subnormal=False), min_size=16, max_size=16),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
)
def test_R24_two_rank_average_is_order_free(reference_api, values, other, dtype):
    """R24: average_across_ranks of two contributions is the same in both orders (bitwise), in fp32 and
    bf16."""
    a = torch.tensor(values, dtype=torch.float32).to(dtype)
    b = torch.tensor(other[: len(values)], dtype=torch.float32).to(dtype)
    assert_tensor_equal(
        reference_api.average_across_ranks([a, b], order=[1, 0]),
        reference_api.average_across_ranks([a, b]),
        "two-rank average, reversed order",
    )


def test_R24_three_rank_average_depends_on_order(reference_api):
    """R24: from W=3 on the order matters, which is why the reference fixes rank order: 1 + 1e-8 - 1 in
    fp32."""
    t = [torch.tensor([3.0]), torch.tensor([3e-8]), torch.tensor([-3.0])]
    in_order = reference_api.average_across_ranks(t)
    other = reference_api.average_across_ranks(t, order=[0, 2, 1])
    assert in_order.item() == 0.0 and other.item() != 0.0


# ---- R17: offload ------------------------------------------------------------------------------------------


@given(cfg=accumulation_configs(), world=worlds, seed=seeds, spec=model_specs())
def test_R17_offload_is_bitwise_invisible_on_cpu(area_api, cfg, world, seed, spec):
    """R17: on a CPU run, offload_optimizer (and offload_param at stage 3) change placement only: the trace is
    identical with and without them."""
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    calls = (*lead, Backward(), Backward(), Step(), Backward(), Step())
    on = cfg.replace(offload_optimizer="cpu", offload_param="cpu" if cfg.zero_stage == 3 else "none")
    off = cfg.replace(offload_optimizer="none", offload_param="none")
    assert_traces_match(
        area_api.run_scenario(Scenario(on, world, calls, model=spec, seed=seed)),
        area_api.run_scenario(Scenario(off, world, calls, model=spec, seed=seed)),
    )


@given(sc=scenarios())
def test_R17_nvme_offload_trace_equals_cpu_offload_trace(area_api, tmp_path, sc):
    """R17: offload_optimizer='nvme' is 'cpu' offload with the optimizer state in files between steps: the
    trace of any drawn scenario is bitwise the cpu-offload trace of the same scenario, and the engine leaves no
    file behind in nvme_path."""
    cpu = dataclasses.replace(sc, config=sc.config.replace(offload_optimizer="cpu"))
    nvme = dataclasses.replace(sc, config=sc.config.replace(offload_optimizer="nvme", nvme_path=str(tmp_path)))
    assert_traces_match(area_api.run_scenario(nvme), area_api.run_scenario(cpu))
    assert list(tmp_path.iterdir()) == [], f"files left in nvme_path: {list(tmp_path.iterdir())}"


def test_R17_nvme_state_lives_in_files_between_steps(reference_api, tmp_path):
    """R17 (nvme): between steps the reference engine holds no optimizer-state tensor; each rank's buffers are
    files in the engine's own directory under nvme_path, read back equal to the cpu-offload engine's state;
    destroy() deletes the directory."""
    from reference.accumulation import compute_loss, micro_batch

    api = reference_api
    cfg = AccumulationConfig(zero_stage=1, dtype="bf16", optimizer={"type": "adam"}, offload_optimizer="cpu")
    engines = [
        api.build_engine(Scenario(c, 2, ()))
        for c in (cfg, cfg.replace(offload_optimizer="nvme", nvme_path=str(tmp_path)))
    ]
    sc = Scenario(cfg, 2, ())
    for k in range(2):
        for e in engines:
            e.backward([compute_loss(e.module(r), *micro_batch(sc, k, r), cfg.model_dtype) for r in range(2)])
            assert e.step().boundary
    cpu, nvme = engines
    assert all(s.buffers == {} for s in nvme._opt_states), "optimizer state kept in memory between steps"
    directory = nvme.swap_directory
    assert directory is not None and os.path.dirname(directory) == str(tmp_path)
    assert sorted(os.listdir(directory)) == sorted(
        f"rank{r}.{n}.swp" for r in range(2) for n in ("exp_avg", "exp_avg_sq")
    )
    # swap_stats(): the initial zero state written once, then every boundary reads and writes all of it.
    per_round = 2 * 2 * nvme.layout.partition_size * 4  # ranks x buffers x fp32 bytes
    stats = nvme.swap_stats()
    assert cpu.swap_stats() is None
    assert (stats.bytes_written, stats.bytes_read, stats.failed_requests) == (3 * per_round, 2 * per_round, 0), stats
    for a, b in zip(nvme.optimizer_states(), cpu.optimizer_states(), strict=True):
        assert a.step == b.step == 2
        assert_named_tensors(a.buffers, b.buffers, "optimizer state read back from the swap files")
    for e in engines:
        e.destroy()
    assert not os.path.exists(directory) and list(tmp_path.iterdir()) == []


def test_R17_offloaded_state_lives_on_the_host(reference_api):
    """R17: with offload the reference engine keeps masters, optimizer state and stage-3 parameter partitions
    on
    the host device."""
    api = reference_api
    cfg = AccumulationConfig(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    engine = api.build_engine(Scenario(cfg, 2, ()))
    assert engine.master_device.type == "cpu" and engine.param_device.type == "cpu"
    assert all(m.device.type == "cpu" for m in engine.master_partitions())
    assert all(b.device.type == "cpu" for s in engine.optimizer_states() for b in s.buffers.values())


# ---- R18: no_sync ------------------------------------------------------------------------------------------


@given(cfg=accumulation_configs(stages=(0, 1)), world=worlds, seed=seeds, n=st.integers(1, 3))
def test_R18_no_sync_changes_no_value_on_stages_0_1(area_api, cfg, world, seed, n):
    """R18: backwards inside no_sync() give exactly the values they give outside it (stages 0/1 reduce only in
    the boundary step), in managed and unmanaged mode."""
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    plain = (*lead, *[Backward()] * (n + 1), Step())
    wrapped = (*lead, EnterNoSync(), *[Backward()] * n, ExitNoSync(), Backward(), Step())
    a = area_api.run_scenario(Scenario(cfg, world, plain, seed=seed))
    b = area_api.run_scenario(Scenario(cfg, world, wrapped, seed=seed))
    assert_boundaries_match(b, a, "R18 no_sync vs plain")
    assert [r.counters for r in b.records if not isinstance(r, ControlRecord)] == [
        r.counters for r in a.records if not isinstance(r, ControlRecord)
    ]


# ---- R13-R16: the boundary epilogue ------------------------------------------------------------------------


@given(cfg=accumulation_configs(), world=worlds, seed=seeds, opt=optimizer_configs())
def test_R13_R14_R15_R16_epilogue_replays_from_recorded_gradients(area_api, impl, cfg, world, seed, opt):
    """R13 (order), R14 (norm over partitions), R15 (clip coefficient), R16 (optimizer): norm, clip
    coefficient and parameters of every boundary follow exactly from the recorded gradients; with
    gradient_clipping=0.05
    clipping always triggers, with 0 it never does."""
    for clip in (0.05, 0.0):
        c = cfg.replace(gradient_clipping=clip, optimizer=opt)
        lead = (SetBoundary(True),) if c.managed_gradient_accumulation else ()
        trace = area_api.run_scenario(
            Scenario(c, world, (*lead, Backward(), Backward(), Step(), Backward(), Step()), seed=seed)
        )
        if replay_applies(impl):
            assert_replay_consistent(trace)
        for rec in trace.boundaries():
            assert (rec.clip_coef is not None) == (clip > 0), f"clip_coef {rec.clip_coef} with clipping {clip}"
            assert rec.grad_norm > 0


@given(cfg=accumulation_configs(), world=worlds, seed=seeds)
def test_R14_norm_is_the_l2_norm_of_the_recorded_gradient(area_api, cfg, world, seed):
    """R14: the recorded norm is the L2 norm of the recorded (unclipped) gradient, whatever the grouping, to
    fp64 accuracy (an independent one-shot fp64 computation)."""
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    trace = area_api.run_scenario(Scenario(cfg, world, (*lead, Backward(), Step()), seed=seed))
    rec = trace.boundaries()[0]
    direct = torch.cat([g.double().reshape(-1) for g in rec.gradients.values()]).norm().item()
    assert abs(rec.grad_norm - direct) <= 1e-12 * max(direct, 1e-300), (rec.grad_norm, direct)
