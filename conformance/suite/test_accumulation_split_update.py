"""The split update (docs/accumulation.md R28, config ``gpu_share`` / ``gpu_memory_budget``).

Every test here needs the implementation to declare ``accumulation_split_update``; one that does not is skipped
with that reason. The defining property is that a split changes where the optimizer step runs, never what it
computes: every trace at share 0.5, 1 or "auto" is the all-host (share 0) trace of the same scenario, bitwise on
the cpu accelerator -- for the reference too, so the oracle is checked, not only trusted. The rule's two formulas
(where a share cuts a partition, what "auto" chooses from a measurement) are checked as properties of the
contract module every implementation calls; the engine tests (``distributed_engine`` as well) check that the
engine's reported "auto" choice is that formula's for its reported measurement, and that checkpoints move
between shares.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import (
    arithmetic_tolerance,
    assert_matches_reference,
    assert_traces_match,
    cross_implementation_tolerance,
)
from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_CHECKPOINT, REQUIRES_ENGINE, engine_api
from conformance.areas.accumulation_strategies import SPLIT_SHARES, split_update_scenarios
from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, compute_loss, scenario_calls
from reference.contract.accumulation_partition import FLAT_ALIGNMENT
from reference.contract.accumulation_split import (
    DevicelessSplitWarning,
    SplitMeasurement,
    choose_split,
    device_bytes_per_element,
    split_point,
)
from reference.contract.errors import ConfigurationError

REQUIRES_SPLIT = pytest.mark.requires("accumulation_split_update")
pytestmark = pytest.mark.conformance_area("accumulation")

VALID = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "gpu_share": 0.5}


# ---- the config (R19) ----------------------------------------------------------------------------------------


@REQUIRES_SPLIT
def test_R28_R19_split_keys_flat_and_nested(area_api):
    """R28/R19: ``gpu_share`` defaults to 0.0 and ``gpu_memory_budget`` to None; both are accepted flat and, in
    DeepSpeed's nested shape, inside ``zero_optimization.offload_optimizer``; the ints 0 and 1 are shares."""
    cfg_cls = area_api.AccumulationConfig
    default = cfg_cls.from_dict({})
    assert (default.gpu_share, default.gpu_memory_budget) == (0.0, None)
    assert cfg_cls.from_dict(VALID).gpu_share == 0.5
    assert cfg_cls.from_dict({**VALID, "gpu_share": 1}).gpu_share == 1.0
    nested = cfg_cls.from_dict({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "gpu_share": "auto",
                                                                "gpu_memory_budget": 1 << 20}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    })
    assert (nested.gpu_share, nested.gpu_memory_budget, nested.zero_stage) == ("auto", 1 << 20, 3)
    with pytest.raises(ConfigurationError, match="gpu_share"):
        cfg_cls.from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "gpu_share": 0.5}}})


@REQUIRES_SPLIT
@pytest.mark.parametrize("spelling", ["AUTO", "Auto", "aUtO"])
def test_R28_R19_auto_is_accepted_in_any_case(area_api, spelling):
    """R28/R19: ``gpu_share`` "auto" is read case-insensitively, like the optimizer type ("AdamW"), flat and
    nested, and stored as "auto" (so ``split_report()`` and a re-read config say the one spelling)."""
    cfg_cls = area_api.AccumulationConfig
    assert cfg_cls.from_dict({**VALID, "gpu_share": spelling}).gpu_share == "auto"
    nested = cfg_cls.from_dict({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "gpu_share": spelling}},
        "optimizer": {"type": "AdamW"},
    })
    assert nested.gpu_share == "auto"


@REQUIRES_SPLIT
@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"gpu_share": 1.5}, "gpu_share"), ({"gpu_share": -0.1}, "gpu_share"), ({"gpu_share": True}, "gpu_share"),
        ({"gpu_share": "half"}, "gpu_share"), ({"gpu_share": float("nan")}, "gpu_share"),
        ({"gpu_share": None}, "gpu_share"),
        ({"gpu_share": "auto", "gpu_memory_budget": -1}, "gpu_memory_budget"),
        ({"gpu_share": "auto", "gpu_memory_budget": 1.5}, "gpu_memory_budget"),
        ({"gpu_share": "auto", "gpu_memory_budget": True}, "gpu_memory_budget"),
        ({"gpu_share": 0.5, "gpu_memory_budget": 1024}, "gpu_memory_budget"),
    ],
)
def test_R28_R19_bad_split_values_are_rejected(area_api, change, key):
    """R19/R28: a share outside "auto" / [0, 1], a budget that is not None or bytes, or a budget given with a
    numeric share (only "auto" reads it) is a ConfigurationError naming the key and the allowed values."""
    with pytest.raises(ConfigurationError, match=key) as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change})
    assert "allowed" in str(info.value)


@REQUIRES_SPLIT
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"offload_optimizer": "none"}, "offload_optimizer='none'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"optimizer": {"type": "sgd"}}, "optimizer.type='sgd'"),
    ],
)
@pytest.mark.parametrize("share", [0.5, "auto"])
def test_R28_R19_split_outside_its_domain_is_rejected(area_api, change, named, share):
    """R19/R28: a share other than 0 needs ``offload_optimizer: cpu``, stage 2 or 3 and Adam/AdamW; anything
    else names the key, the offending setting and the allowed values. At share 0 the same config is fine."""
    with pytest.raises(ConfigurationError, match="gpu_share") as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change, "gpu_share": share})
    assert named in str(info.value) and "allowed" in str(info.value)
    area_api.AccumulationConfig.from_dict({**VALID, **change, "gpu_share": 0.0})


# ---- the rule's formulas (the contract every implementation calls) -------------------------------------------

partitions = st.integers(0, 1 << 20).map(lambda n: n * FLAT_ALIGNMENT)


@given(share=st.floats(0.0, 1.0), other=st.floats(0.0, 1.0), P=partitions)
def test_R28_split_point_cuts_aligned_leading_elements(share, other, P):
    """R28: ``split_point(s, P)`` is ``s * P`` rounded down to the alignment (exactly), 0 at 0 and P at 1, and
    never decreases as the share grows."""
    d = split_point(share, P)
    assert 0 <= d <= P and d % FLAT_ALIGNMENT == 0
    assert (split_point(0.0, P), split_point(1.0, P)) == (0, P)
    if share < 1.0:
        assert d <= Fraction(share) * P < d + FLAT_ALIGNMENT
    lo, hi = sorted((share, other))
    assert split_point(lo, P) <= split_point(hi, P)


measurements = st.builds(
    SplitMeasurement,
    host_s_per_element=st.floats(1e-10, 1e-6),
    device_s_per_element=st.floats(1e-12, 1e-7),
    hide_s=st.floats(0.0, 1.0),
    sample_elements=st.integers(1, 1 << 16),
)


@given(P=partitions, m=measurements, budget=st.none() | st.integers(0, 1 << 26),
       kind=st.sampled_from(("adam", "adamw")), accum=st.sampled_from(("fp32", "bf16")))
def test_R28_auto_takes_the_smallest_hiding_cut_within_the_budget(P, m, budget, kind, accum):
    """R28: "auto" takes the smallest aligned cut d with ``host * (P - d) <= device * d + hide``, capped by the
    budget (``device_bytes_per_element`` bytes per element) and P; the decision reports its measurement, budget
    and predictions."""
    cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", optimizer={"type": kind}, grad_accum_dtype=accum)
    per = device_bytes_per_element(cfg)
    assert per == 12 + (4 if accum == "fp32" else 2)  # master, two moments, the gradient
    dec = choose_split(P, cfg, budget, m)
    d = dec.device_elements
    assert 0 <= d <= P and d % FLAT_ALIGNMENT == 0 and dec.device_bytes == d * per
    assert dec.gpu_share == (d / P if P else 0.0) and dec.auto and dec.measurement == m
    assert dec.budget_bytes == budget
    h, g = m.host_s_per_element, m.device_s_per_element

    slack = 1e-9 * (h * P + m.hide_s)  # float rounding of the formula, either way

    def hides(n: int, margin: float) -> bool:
        return h * (P - n) <= g * n + m.hide_s + margin

    cap = P if budget is None else min(P, budget // per // FLAT_ALIGNMENT * FLAT_ALIGNMENT)
    assert d <= cap, f"cut {d} over the budget's {cap} elements"
    if hides(cap, -slack):
        assert hides(d, slack), f"cut {d} does not hide the host side though {cap} would"
        assert d == 0 or not hides(d - FLAT_ALIGNMENT, -slack), f"cut {d} is not the smallest that hides"
    else:
        assert d == cap, f"the budget binds: the cut must be its {cap} elements, got {d}"
    assert math.isclose(dec.predicted_host_s, h * (P - d)) and math.isclose(dec.predicted_device_s, g * d)


# ---- traces ------------------------------------------------------------------------------------------------


def _all_host(scenario: Scenario) -> Scenario:
    return Scenario(scenario.config.replace(gpu_share=0.0), scenario.world_size, scenario.calls,
                    model=scenario.model, seed=scenario.seed, name=scenario.name + "-all-host")


def _same_arithmetic(accelerator) -> bool:
    return getattr(accelerator, "name", "cpu") == "cpu"


@REQUIRES_SPLIT
@given(data=st.data())
def test_R28_R25_drawn_split_scenario_is_the_all_host_update(area_api, reference_api, impl, accelerator, data):
    """R28/R25: stages 2/3, W 1-2, managed or not, gas, any dtypes, clipping, Adam/AdamW, shares 0, 0.5, 1 and
    "auto", the delayed update where the implementation has it: the trace equals the reference's, and the
    reference's equals the all-host (share 0) trace of the same scenario -- bitwise on cpu."""
    delayed = (False, True) if impl.capabilities.accumulation_delayed_parameter_update else (False,)
    scenario = data.draw(split_update_scenarios(delayed=delayed))
    expected = reference_api.run_scenario(scenario)
    all_host = reference_api.run_scenario(_all_host(scenario))
    exact = None if _same_arithmetic(accelerator) else arithmetic_tolerance(scenario)
    assert_traces_match(expected, all_host, exact)
    actual = area_api.run_scenario(scenario)
    assert_traces_match(actual, expected, cross_implementation_tolerance(scenario, impl, accelerator))


@REQUIRES_SPLIT
@pytest.mark.parametrize("share", SPLIT_SHARES)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
def test_R28_pinned_shares_equal_the_all_host_update(area_api, reference_api, impl, accelerator, share, stage,
                                                     delayed):
    """R28, pinned by a seed: W = 2, bf16 with fp32 accumulation, gas 2, clipping on, AdamW, 3 boundaries, each
    share at stages 2 and 3, with and without the delayed update: the implementation's trace is the all-host
    trace (bitwise on cpu, R25's tolerance on a device)."""
    if delayed and not impl.capabilities.accumulation_delayed_parameter_update:
        pytest.skip(f"{impl.name} does not declare accumulation_delayed_parameter_update (R27)")
    config = AccumulationConfig(
        zero_stage=stage, dtype="bf16", grad_accum_dtype="fp32", gradient_accumulation_steps=2,
        gradient_clipping=0.05, optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer="cpu", offload_param="cpu" if stage == 3 else "none", delayed_parameter_update=delayed,
        delayed_update_warmup=2, gpu_share=share,  # R27: 2 undelayed boundaries, then the delay
    )
    scenario = Scenario(config, 2, scenario_calls("BSBSBSBSBSBS"), seed=28, name=f"split-{share}")
    all_host = reference_api.run_scenario(_all_host(scenario))
    actual = area_api.run_scenario(scenario)
    tolerance = None if _same_arithmetic(accelerator) else arithmetic_tolerance(scenario)
    assert_traces_match(actual, all_host, tolerance)


def test_R28_reference_auto_reports_the_rules_choice(reference_api):
    """R28 on the oracle: "auto" has not chosen before the second boundary (``split_report()`` None); after it,
    the report is ``choose_split`` of its own measurement and budget; a zero budget keeps everything on the
    host."""
    for budget, check_zero in ((None, False), (0, True)):
        cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", gradient_accumulation_steps=1,
                                 gpu_share="auto", gpu_memory_budget=budget)
        engine = reference_api.AccumulationEngine(lambda: ModelSpec().build(3), cfg, 2)
        try:
            assert engine.split_report() is None, "R28: auto reported a choice before the first boundary"
            _reference_boundary(engine)
            assert engine.split_report() is None, "R28: auto chose at the first boundary (it chooses at the second)"
            _reference_boundary(engine)
            report = engine.split_report()
            assert report is not None and report["auto"], report
            expected = choose_split(engine.layout.partition_size, cfg, report["budget_bytes"],
                                    SplitMeasurement(**report["measurement"]))
            assert report == expected.as_dict()
            if check_zero:
                assert report["device_elements"] == 0 and report["budget_bytes"] == 0
        finally:
            engine.destroy()


def _split_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DevicelessSplitWarning)]


def test_R28_reference_auto_without_a_device_says_so_once(reference_api):
    """R28: "auto" on an engine whose device is the host (the cpu accelerator) compares the host with itself,
    so the share it picks is noise: the engine warns (``DevicelessSplitWarning``) once, at construction, and not
    again at the boundary where it chooses; on an accelerator device, and for a numeric share, it says nothing."""
    for share in ("auto", 0.5):
        cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", gradient_accumulation_steps=1,
                                 gpu_share=share)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = reference_api.AccumulationEngine(lambda: ModelSpec().build(3), cfg, 2)
            try:
                _reference_boundary(engine)
                _reference_boundary(engine)
                device = engine.device.type
            finally:
                engine.destroy()
        said = _split_warnings(caught)
        expected = 1 if share == "auto" and device == "cpu" else 0
        assert len(said) == expected, f"gpu_share={share!r} on {device}: {len(said)} warnings {said}"
        assert all("gpu_share" in m and "cpu" in m for m in said), said


def _reference_boundary(engine) -> None:
    spec = ModelSpec()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for r in range(engine.world_size):
        x, y = torch.randn(2, spec.in_features, generator=gen), torch.randn(2, spec.out_features, generator=gen)
        losses.append(compute_loss(engine.module(r), x, y, engine.config.model_dtype))
    engine.backward(losses)
    assert engine.step().boundary


# ---- the engine: the "auto" report, checkpoints across shares ----------------------------------------------

WIDE = ModelSpec(in_features=24, hidden=96, out_features=32)


def _config(stage: int, share, **extra) -> dict:
    return {
        "zero_stage": stage, "dtype": "bf16", "grad_accum_dtype": "fp32", "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "offload_optimizer": "cpu", "offload_param": "cpu" if stage == 3 else "none", "gpu_share": share, **extra,
    }


def _loop(group, engine_cls, config: dict, boundaries: int, load=None, save=None, load_after: int = 0) -> dict:
    """One rank: ``boundaries`` boundaries of a loop that reads nothing between steps, resumed from a checkpoint
    (``load``: before the first boundary, or after ``load_after`` boundaries of its own, into the running engine)
    and saved to one (``save``); the losses, the weights, the master, the optimizer state and the split report
    before the first boundary and after each."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
    try:
        if load is not None and not load_after:
            engine.load_checkpoint(*load)
        reports = [engine.split_report()]
        losses = []
        if load_after:
            for k in range(load_after):
                _micro_steps(engine, rank, k, [])
            engine.load_checkpoint(*load)
        start = engine.global_steps
        for k in range(start, start + boundaries):
            _micro_steps(engine, rank, k, losses)
            reports.append(engine.split_report())
        if save is not None:
            engine.save_checkpoint(*save)
        return {"losses": losses, "weights": engine.state_dict(), "master": engine.master_partition(),
                "state": engine.optimizer_state().buffers, "reports": reports,
                "partition": engine.master_partition().numel()}
    finally:
        engine.destroy()


def _micro_steps(engine, rank: int, k: int, losses: list) -> None:
    """Boundary k's micro-steps (data from k, the micro-step and the rank)."""
    cfg = engine.config
    for j in range(cfg.gradient_accumulation_steps):
        gen = torch.Generator().manual_seed(1000 * k + 10 * j + rank)
        x = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.in_features, generator=gen)
        y = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.out_features, generator=gen)
        loss = compute_loss(engine.module, x, y, cfg.model_dtype)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())


def _assert_same(got: dict, want: dict, what: str, keys=("losses", "weights", "master", "state")) -> None:
    for key in keys:
        a, b = got[key], want[key]
        if isinstance(a, dict):
            assert set(a) == set(b), f"{what}: {key} names differ"
            for name in b:
                assert torch.equal(a[name], b[name]), f"{what}: {key}[{name!r}] differs"
        elif isinstance(a, list):
            assert len(a) == len(b), f"{what}: {len(a)} {key}, expected {len(b)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"{what}: {key}[{i}] {x} != {y}"
        else:
            assert torch.equal(a, b), f"{what}: {key} differs"


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize("budget", [None, 0, 4096])
def test_R28_engine_auto_reports_the_rules_choice(impl, budget):
    """R28: on every rank, "auto" has not chosen before the second boundary and afterwards reports
    ``choose_split(P, config, budget, measurement)`` of its own reported measurement and budget (the one
    formula), the same share on every rank, within a given budget (a zero budget: nothing on the device)."""
    api = engine_api(impl)
    extra = {} if budget is None else {"gpu_memory_budget": budget}
    cfg = AccumulationConfig.from_dict(_config(2, "auto", **extra))
    ranks = api.run_on_ranks(_loop, 2, api.ZeroEngine, _config(2, "auto", **extra), 2)
    shares = set()
    for rank, out in enumerate(ranks):
        before, first, after = out["reports"]
        assert before is None and first is None, (
            f"rank {rank}: auto reported a choice before the second boundary: {before}, {first}"
        )
        assert after is not None and after["auto"], f"rank {rank}: no auto decision after a boundary: {after}"
        expected = choose_split(out["partition"], cfg, after["budget_bytes"],
                                SplitMeasurement(**after["measurement"]))
        assert after == expected.as_dict(), f"rank {rank}: the report is not the rule's choice"
        if budget is not None:
            assert after["budget_bytes"] == budget and after["device_bytes"] <= budget
        shares.add(after["gpu_share"])
    assert len(shares) == 1, f"ranks cut differently: {shares}"


def _construction_warnings(group, engine_cls, config: dict) -> tuple[str, list[str]]:
    """One rank: the engine's device and the DevicelessSplitWarnings of building it and running 2 boundaries."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
        try:
            for k in range(2):
                _micro_steps(engine, 0, k, [])
            device = engine.device.type
        finally:
            engine.destroy()
    return device, _split_warnings(caught)


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R28_engine_auto_without_a_device_says_so_once(impl):
    """R28: an engine whose device is the host warns once (``DevicelessSplitWarning``, naming gpu_share and the
    cpu device) when ``gpu_share`` is "auto" -- any spelling -- and never for a numeric share or on an
    accelerator device."""
    api = engine_api(impl)
    for share in ("AUTO", 0.5):
        device, said = api.run_on_ranks(_construction_warnings, 1, api.ZeroEngine, _config(2, share))[0]
        expected = 1 if share == "AUTO" and device == "cpu" else 0
        assert len(said) == expected, f"gpu_share={share!r} on {device}: {len(said)} warnings {said}"
        assert all("gpu_share" in m and "cpu" in m for m in said), said


@REQUIRES_SPLIT
@REQUIRES_CHECKPOINT
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("stage", "world"), [(2, 2), (3, 1)])
def test_R28_checkpoint_saved_at_one_share_loads_at_any_other(impl, tmp_path, stage, world):
    """R28 + checkpoints: 2 boundaries at share 0.5, saved; loaded at shares 0, 1, "auto" and without offload,
    2 more boundaries each equal 4 uninterrupted all-host boundaries bitwise (losses, weights, master, optimizer
    state): a checkpoint holds the whole partition, whatever the share."""
    api = engine_api(impl)
    ck = (str(tmp_path), "ck")
    full = api.run_on_ranks(_loop, world, api.ZeroEngine, _config(stage, 0.0), 4)[0]
    first = api.run_on_ranks(_loop, world, api.ZeroEngine, _config(stage, 0.5), 2, None, ck)[0]
    none = {**_config(stage, 0.0), "offload_optimizer": "none", "offload_param": "none"}
    for label, cfg in (("0", _config(stage, 0.0)), ("1", _config(stage, 1.0)), ("auto", _config(stage, "auto")),
                       ("no offload", none)):
        resumed = api.run_on_ranks(_loop, world, api.ZeroEngine, cfg, 2, ck)[0]
        _assert_same({"losses": first["losses"] + resumed["losses"]}, full, f"resumed at {label}", keys=("losses",))
        _assert_same(resumed, full, f"stage {stage} W={world} resumed at {label}", keys=("weights", "master", "state"))


@REQUIRES_SPLIT
@REQUIRES_CHECKPOINT
@IN_RANK_PROCESSES
@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
def test_R28_checkpoint_loaded_into_a_running_split_engine(impl, tmp_path, delayed):
    """R28 + checkpoints: an engine at share 0.5 that has already updated its device side loads an all-host
    checkpoint of 2 boundaries; 2 more boundaries equal the 4-boundary all-host run bitwise (the load reaches
    the device side too, not only the host buffers)."""
    if delayed and not impl.capabilities.accumulation_delayed_parameter_update:
        pytest.skip(f"{impl.name} does not declare accumulation_delayed_parameter_update (R27)")
    api = engine_api(impl)
    extra = {"delayed_parameter_update": True, "delayed_update_warmup": 1} if delayed else {}
    ck = (str(tmp_path), "ck")
    full = api.run_on_ranks(_loop, 1, api.ZeroEngine, _config(2, 0.0, **extra), 4)[0]
    api.run_on_ranks(_loop, 1, api.ZeroEngine, _config(2, 0.0, **extra), 2, None, ck)
    resumed = api.run_on_ranks(_loop, 1, api.ZeroEngine, _config(2, 0.5, **extra), 2, ck, None, 1)[0]
    _assert_same(resumed, full, f"share 0.5 engine loading mid-run (delayed={delayed})",
                 keys=("weights", "master", "state"))
    _assert_same({"losses": resumed["losses"]}, {"losses": full["losses"][4:]}, "losses after the load",
                 keys=("losses",))


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
@pytest.mark.parametrize(("stage", "world", "delayed"), [(2, 2, False), (3, 1, False), (2, 1, True)])
def test_R28_training_loop_equals_the_all_host_loop(impl, share, stage, world, delayed):
    """R28 in a training loop that reads nothing between steps: losses, weights, master and optimizer state
    after 3 boundaries at each share equal the all-host loop's bitwise (stage 2 at W = 2, stage 3, and with the
    delayed update)."""
    if delayed and not impl.capabilities.accumulation_delayed_parameter_update:
        pytest.skip(f"{impl.name} does not declare accumulation_delayed_parameter_update (R27)")
    api = engine_api(impl)
    extra = {"delayed_parameter_update": True, "delayed_update_warmup": 1} if delayed else {}
    want = api.run_on_ranks(_loop, world, api.ZeroEngine, _config(stage, 0.0, **extra), 3)[0]
    got = api.run_on_ranks(_loop, world, api.ZeroEngine, _config(stage, share, **extra), 3)[0]
    _assert_same(got, want, f"share {share} stage {stage} W={world} delayed={delayed}")


def pinned_state_copies(engine) -> list[torch.Tensor]:
    """The pinned host buffers that hold the master or a moment of the whole partition, flat: right after a read
    (``master_partition()`` / ``optimizer_state()`` refresh every host copy), those whose dtype, size and values
    are the master's or a moment's."""
    wanted = [engine.master_partition(), *engine.optimizer_state().buffers.values()]
    return [t.view(-1) for t in engine.pinned_buffers()
            if any(t.dtype == w.dtype and t.numel() == w.numel() and torch.equal(t.view(-1), w.view(-1))
                   for w in wanted)]


def _mirrors_of(engine, d: int) -> list[torch.Tensor]:
    """:func:`pinned_state_copies`, whose first ``d`` elements are the device side's (none where ``d`` is 0)."""
    return pinned_state_copies(engine) if d else []


def _poisoned_loop(group, engine_cls, config: dict, boundaries: int) -> dict:
    """One rank: :func:`_loop`'s loop, with the host's copies of the device side's master and moments overwritten
    with NaN after the first boundary (the cut is made), through ``pinned_buffers()``; how many were found."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
    try:
        losses: list = []
        _micro_steps(engine, rank, 0, losses)
        d = split_point(float(config["gpu_share"]), engine.master_partition().numel())
        mirrors = _mirrors_of(engine, d)
        for t in mirrors:
            t[:d].fill_(float("nan"))
        for k in range(1, boundaries):
            _micro_steps(engine, rank, k, losses)
        return {"losses": losses, "weights": engine.state_dict(), "master": engine.master_partition(),
                "state": engine.optimizer_state().buffers, "mirrors": len(mirrors), "device_elements": d}
    finally:
        engine.destroy()


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("share", "delayed", "start"), [(0.5, False, "step"), (1.0, False, "step"),
                                                       (0.5, True, "step"), (0.5, False, "last_backward")],
                         ids=["0.5-sync", "1-sync", "0.5-delayed", "0.5-overlap"])
def test_R28_host_update_never_touches_the_device_sides_elements(impl, share, delayed, start):
    """R28 (ownership): the device side's elements are stepped on the device only; the host's update neither
    reads nor writes its full-size buffers' copies of them, which are a mirror refreshed when read. On the cpu
    accelerator both sides compute the same bits, so a host that also stepped ``[0, d)`` would go unseen by the
    values alone; here the mirrors of the master and moments (the pinned host buffers holding them right after
    a read) are overwritten with NaN once the cut is made, and 3 boundaries (stage 2, W = 1, with and without
    the delayed update, shares 0.5 and 1) must still equal the all-host loop bitwise: losses, weights, master,
    optimizer state; also with R30's host update started under the last backward. An engine that lists no such
    buffer in ``pinned_buffers()`` keeps no host copy to misuse and is skipped with that reason."""
    if delayed and not impl.capabilities.accumulation_delayed_parameter_update:
        pytest.skip(f"{impl.name} does not declare accumulation_delayed_parameter_update (R27)")
    if start != "step" and not impl.capabilities.accumulation_overlapped_update:
        pytest.skip(f"{impl.name} does not declare accumulation_overlapped_update (R30)")
    api = engine_api(impl)
    extra = {"delayed_parameter_update": True, "delayed_update_warmup": 1} if delayed else {}
    extra["host_update_start"] = start
    got = api.run_on_ranks(_poisoned_loop, 1, api.ZeroEngine, _config(2, share, **extra), 3)[0]
    if not got["mirrors"]:
        pytest.skip(f"{impl.name}'s engine lists no pinned host buffer holding the master or a moment after a read "
                    f"(pinned_buffers()): no host copy of the device side's {got['device_elements']} elements to "
                    "observe")
    want = api.run_on_ranks(_loop, 1, api.ZeroEngine, _config(2, 0.0, **extra), 3)[0]
    _assert_same(got, want, f"share {share} delayed={delayed}, the host's copies of the device side's elements "
                 f"poisoned ({got['mirrors']} buffers)")


# ---- on the GPU (NCCL, world size 1) --------------------------------------------------------------------------


@REQUIRES_SPLIT
@pytest.mark.gpu
@REQUIRES_ENGINE
@given(data=st.data())
def test_R28_R17_engine_on_nccl_matches_reference_within_tolerance(impl, reference_api, accelerator, data):
    """R28/R25 on the device path: drawn split scenarios (shares 0, 0.5, 1, "auto"; the delayed update where
    declared) on the engine with NCCL give the reference's records, flags and counters exactly and its values
    within R25's device tolerance (the device side is the GPU's Adam), the reference on the same device."""
    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL); the host runs are the tests above")
    delayed = (False, True) if impl.capabilities.accumulation_delayed_parameter_update else (False,)
    scenario = data.draw(split_update_scenarios(world_sizes=(1,), delayed=delayed))
    assert_matches_reference(
        engine_api(impl), reference_api, scenario, arithmetic_tolerance(scenario),
        reference_kwargs={"device": accelerator.device()}, backend="nccl"
    )


#: About 0.6M trainable elements: a device side of megabytes, well above the allocator's rounding.
LARGE = ModelSpec(in_features=256, hidden=1024, out_features=256)


def _device_growth(group, engine_cls, config: dict) -> tuple:
    """One rank on cuda: the split report and the device memory the engine holds after one boundary (allocated
    bytes, measured from before its construction)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    model = LARGE.build(5)
    engine = engine_cls(model, config, process_group=group, bucket_elements=1 << 16)
    try:
        cfg = engine.config
        gen = torch.Generator().manual_seed(3)
        for _ in range(cfg.gradient_accumulation_steps):
            x = torch.randn(2, LARGE.in_features, generator=gen).to(device)
            y = torch.randn(2, LARGE.out_features, generator=gen).to(device)
            engine.backward(compute_loss(engine.module, x, y, cfg.model_dtype))
            engine.step()
        engine.synchronize()
        torch.cuda.synchronize(device)
        return engine.split_report(), torch.cuda.memory_allocated(device) - before
    finally:
        engine.destroy()


@REQUIRES_SPLIT
@pytest.mark.gpu
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R28_device_side_lives_on_the_device(impl, accelerator):
    """R28, observed on the GPU: after a boundary at share 1 the engine holds at least the reported
    ``device_bytes`` (fp32 master and Adam state of every element) more device memory than at share 0, and at
    share 0.5 at least its own (smaller) reported ``device_bytes`` more."""
    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL)")
    api = engine_api(impl)
    growth = {}
    for share in (0.0, 0.5, 1.0):
        report, grown = api.run_on_ranks(_device_growth, 1, api.ZeroEngine, _config(2, share), backend="nccl")[0]
        growth[share] = (report, grown)
    for share in (0.5, 1.0):
        report, grown = growth[share]
        extra = grown - growth[0.0][1]
        assert report is not None and report["device_bytes"] > 0, f"share {share}: report {report}"
        assert extra >= report["device_bytes"], (
            f"share {share}: the engine holds {extra} more device bytes than at share 0, less than the "
            f"{report['device_bytes']} its device side needs: the device side is not on the device"
        )
