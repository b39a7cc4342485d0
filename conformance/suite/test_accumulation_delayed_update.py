"""The opt-in one-step-delayed parameter update (docs/accumulation.md R27, config ``delayed_parameter_update``).

Every test here needs the implementation to declare ``accumulation_delayed_parameter_update``; one that does not
is skipped with that reason, never failed. The area-level tests compare the implementation's ``run_scenario``
with the reference's on drawn delayed scenarios and replay R27 from the trace alone (so the oracle is checked
too, not only trusted); the engine tests (``distributed_engine`` as well) drive the per-rank engine the way a
training loop does -- no read of any weight between steps, so the update of one boundary really runs while the
next step's forward and backward do -- and check checkpoints: a delayed run resumed from a checkpoint is the
uninterrupted delayed run, bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from torch import nn

from conformance.areas.accumulation_assertions import (
    assert_delayed_replay_consistent,
    assert_matches_reference,
    assert_traces_match,
    cross_implementation_tolerance,
)
from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_CHECKPOINT, REQUIRES_ENGINE, engine_api
from conformance.areas.accumulation_strategies import delayed_update_scenarios
from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, compute_loss, scenario_calls
from reference.contract.errors import ConfigurationError

REQUIRES_DELAYED = pytest.mark.requires("accumulation_delayed_parameter_update")
pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_DELAYED]

#: The delay from the first boundary on (no warm-up): what most tests here check; the warm-up has tests of its own.
VALID = {
    "zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "delayed_parameter_update": True,
    "delayed_update_warmup": 0,
}


# ---- the config (R19) ----------------------------------------------------------------------------------------


def test_R27_R19_delayed_parameter_update_key_flat_and_nested(area_api):
    """R27/R19: ``delayed_parameter_update`` defaults to False, is accepted in the flat shape and, in DeepSpeed's
    nested shape, inside ``zero_optimization.offload_optimizer`` (next to ``device``); a non-bool is rejected by
    name with the allowed values."""
    cfg_cls = area_api.AccumulationConfig
    assert cfg_cls.from_dict({}).delayed_parameter_update is False
    assert cfg_cls.from_dict(VALID).delayed_parameter_update is True
    nested = cfg_cls.from_dict({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "delayed_parameter_update": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    })
    assert (nested.delayed_parameter_update, nested.zero_stage, nested.offload_optimizer) == (True, 3, "cpu")
    for bad in (1, "true", None):
        with pytest.raises(ConfigurationError, match=r"delayed_parameter_update=.*True, False"):
            cfg_cls.from_dict({**VALID, "delayed_parameter_update": bad})
    with pytest.raises(ConfigurationError, match="delayed_parameter_update"):
        cfg_cls.from_dict({"zero_optimization": {"stage": 2, "offload_param": {"delayed_parameter_update": True}}})


def test_R27_R19_delayed_update_warmup_key_flat_and_nested(area_api):
    """R27/R19: ``delayed_update_warmup`` (undelayed boundaries before the delay starts) defaults to the contract's
    documented value, which is above zero (the delay from the first boundary does not train: docs/accumulation.md),
    is accepted flat and inside DeepSpeed's ``zero_optimization.offload_optimizer``, and anything but an int >= 0
    is rejected naming the key."""
    from reference.contract.accumulation_config import DEFAULT_DELAYED_UPDATE_WARMUP

    cfg_cls = area_api.AccumulationConfig
    assert cfg_cls.from_dict({}).delayed_update_warmup == DEFAULT_DELAYED_UPDATE_WARMUP > 0
    assert cfg_cls.from_dict({**VALID, "delayed_update_warmup": 7}).delayed_update_warmup == 7
    nested = cfg_cls.from_dict({
        "zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu", "delayed_parameter_update": True, "delayed_update_warmup": 3}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    })
    assert (nested.delayed_parameter_update, nested.delayed_update_warmup) == (True, 3)
    for bad in (-1, True, 1.5, "3", None):
        with pytest.raises(ConfigurationError, match=r"delayed_update_warmup=.*int >= 0"):
            cfg_cls.from_dict({**VALID, "delayed_update_warmup": bad})
    with pytest.raises(ConfigurationError, match="delayed_update_warmup"):
        cfg_cls.from_dict({"zero_optimization": {"stage": 2, "offload_param": {"delayed_update_warmup": 1}}})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"offload_optimizer": "none"}, "offload_optimizer='none'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"zero_stage": 0}, "zero_stage=0"),
        ({"optimizer": {"type": "sgd"}}, "optimizer.type='sgd'"),
    ],
)
def test_R27_R19_delayed_update_outside_its_domain_is_rejected(area_api, change, named):
    """R19/R27: the delayed update needs ``offload_optimizer: cpu``, stage 2 or 3 and Adam/AdamW; anything else
    is a ConfigurationError naming the key, the offending value and the allowed values (also nested)."""
    with pytest.raises(ConfigurationError, match="delayed_parameter_update") as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change})
    assert named in str(info.value) and "allowed" in str(info.value)
    # Without the key the same config is fine (today's semantics): the rejection is the key's, not the config's.
    area_api.AccumulationConfig.from_dict({**VALID, **change, "delayed_parameter_update": False})


# ---- traces ------------------------------------------------------------------------------------------------


@given(scenario=delayed_update_scenarios())
def test_R27_R25_drawn_delayed_scenario_matches_reference_and_replays(area_api, reference_api, impl, accelerator,
                                                                       scenario):
    """R27/R25: stages 2/3, W 1-2, managed or not, any dtypes, clipping, Adam/AdamW, ``apply_delayed_update``
    calls anywhere: the trace equals the reference's (R25's comparison), and it replays R27 from its own records:
    after boundary k the parameters are the cast of the master before k's update (after the first boundary the
    initial ones), after ``apply_delayed_update`` the cast of the current master."""
    actual, _ = assert_matches_reference(
        area_api, reference_api, scenario, cross_implementation_tolerance(scenario, impl, accelerator),
        replay=assert_delayed_replay_consistent,
    )
    assert_delayed_replay_consistent(actual)


@pytest.mark.gpu
@REQUIRES_ENGINE
@given(scenario=delayed_update_scenarios(world_sizes=(1,)))
def test_R27_R17_engine_on_nccl_matches_reference_within_tolerance(impl, reference_api, accelerator, scenario):
    """R27/R25 on the device path (streams, events, pinned buffers): the engine on NCCL (world size 1) gives the
    reference's records, flags and counters exactly and its values within R25's device tolerance, with the
    reference on the same device (as the undelayed NCCL test does)."""
    from conformance.areas.accumulation_assertions import arithmetic_tolerance

    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL); the host runs are the tests above")
    assert_matches_reference(
        engine_api(impl), reference_api, scenario, arithmetic_tolerance(scenario),
        reference_kwargs={"device": accelerator.device()}, backend="nccl"
    )


def test_R27_the_delay_is_one_boundary_exactly(reference_api, area_api, impl, accelerator):
    """R27 against today's semantics: with one backward per boundary, the delayed run's first boundary leaves the
    initial weights in place, and its second boundary installs the update the first one computed -- bitwise the
    parameters the undelayed run has after its first boundary (same first gradient: both runs computed it with
    the initial weights)."""
    calls = scenario_calls("BSBSBS")
    delayed = AccumulationConfig(**{**VALID, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01}})
    sc = Scenario(delayed, 2, calls, seed=4)
    plain = Scenario(delayed.replace(delayed_parameter_update=False), 2, calls, seed=4)
    d, p = area_api.run_scenario(sc), reference_api.run_scenario(plain)
    assert_traces_match(d, reference_api.run_scenario(sc), cross_implementation_tolerance(sc, impl, accelerator))
    db, pb = d.boundaries(), p.boundaries()
    for name, t in d.initial_parameters.items():
        assert torch.equal(db[0].parameters[name], t), f"R27: boundary 1 moved {name} (applied a step early)"
        assert torch.equal(db[1].parameters[name], pb[0].parameters[name]), (
            f"R27: boundary 2 of the delayed run must install the first update: {name} differs"
        )
    for name, g in pb[0].gradients.items():  # the premise: the same first gradient
        assert torch.equal(db[0].gradients[name], g), f"premise: first gradients differ at {name}"


@pytest.mark.parametrize("warmup", [1, 2])
def test_R27_warmup_boundaries_are_the_synchronous_ones_then_the_delay(reference_api, area_api, impl, accelerator,
                                                                       warmup):
    """R27 with ``delayed_update_warmup = N``: with one backward per boundary, the parameters after each of the
    first N boundaries are bitwise the synchronous run's; boundary N+1 leaves them in place (its update is the
    delayed one) and boundary N+2 installs it -- the synchronous run's parameters after boundary N+1 (same
    gradient: both computed it with the weights of boundary N). The trace equals the reference's."""
    calls = scenario_calls("BS" * (warmup + 3))
    delayed = AccumulationConfig(**{**VALID, "delayed_update_warmup": warmup,
                                    "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01}})
    sc = Scenario(delayed, 2, calls, seed=4)
    plain = Scenario(delayed.replace(delayed_parameter_update=False), 2, calls, seed=4)
    d, p = area_api.run_scenario(sc), reference_api.run_scenario(plain)
    assert_traces_match(d, reference_api.run_scenario(sc), cross_implementation_tolerance(sc, impl, accelerator))
    assert_delayed_replay_consistent(d)
    db, pb = d.boundaries(), p.boundaries()
    for k in range(warmup):
        for name, t in pb[k].parameters.items():
            assert torch.equal(db[k].parameters[name], t), f"warm-up boundary {k + 1}: {name} is not synchronous"
    for name in d.initial_parameters:
        assert torch.equal(db[warmup].parameters[name], pb[warmup - 1].parameters[name]), (
            f"R27: boundary {warmup + 1} (the first delayed one) must leave the parameters in place: {name} moved"
        )
        assert torch.equal(db[warmup + 1].parameters[name], pb[warmup].parameters[name]), (
            f"R27: boundary {warmup + 2} must install boundary {warmup + 1}'s update: {name} differs"
        )
    moved = [n for n in pb[0].gradients if not torch.equal(pb[warmup].parameters[n], pb[warmup - 1].parameters[n])]
    assert moved, f"premise: the synchronous update of boundary {warmup + 1} moved nothing"


# ---- the engine in a training loop -------------------------------------------------------------------------

#: About 5.5k trainable elements in several buckets (16-element buckets: one per parameter), a frozen layer and an
#: unused parameter: every R7/R8 category, with real partitions at W = 2.
WIDE = ModelSpec(in_features=24, hidden=96, out_features=32)


class _Racer(nn.Module):
    """A large parameter first in flat order whose forward work is tiny (``big[:out]``), then two small ones
    (16 elements each: a bucket of their own at 16-element buckets) whose gradients autograd produces first
    (their operations come last in the forward). The host update of a boundary spends its time on ``big``
    (flat order) while the next step's backward delivers ``tail``'s gradient -- the end of the flat order,
    the first bucket the engine accumulates -- long before the update reaches it."""

    def __init__(self, spec: RacerSpec, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.big = nn.Parameter(torch.rand(spec.big, generator=gen) - 0.5)
        self.head = nn.Parameter(torch.rand(spec.out_features, spec.in_features, generator=gen) - 0.5)
        self.tail = nn.Parameter(torch.rand(16, generator=gen) - 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.head.shape[0]
        shift = self.big[:n]
        affine = torch.sum(x.unsqueeze(-2) * self.head, dim=-1)
        return shift + affine * self.tail[:n]


@dataclass(frozen=True)
class RacerSpec:
    """Builds :class:`_Racer` (the loop below takes it like a :class:`ModelSpec`)."""

    big: int = 3_000_000
    in_features: int = 4
    out_features: int = 4

    def build(self, seed: int) -> nn.Module:
        return _Racer(self, seed)


def _loop(group, engine_cls, config: dict, boundaries: int, load=None, save=None, apply_every: int = 0,
          spec: ModelSpec = WIDE) -> dict:
    """One rank: a training loop that reads nothing between steps (so nothing waits for the update in flight);
    the losses, and at the end the consolidated weights, the fp32 master and the optimizer state."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(spec.build(5), config, process_group=group, bucket_elements=16)
    try:
        if load is not None:
            engine.load_checkpoint(*load)
        cfg = engine.config
        gas = cfg.gradient_accumulation_steps
        start = engine.global_steps
        losses = []
        for k in range(start, start + boundaries):
            for j in range(gas):
                gen = torch.Generator().manual_seed(1000 * k + 10 * j + rank)
                x = torch.randn(cfg.train_micro_batch_size_per_gpu, spec.in_features, generator=gen)
                y = torch.randn(cfg.train_micro_batch_size_per_gpu, spec.out_features, generator=gen)
                loss = compute_loss(engine.module, x, y, cfg.model_dtype)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().clone())
            if apply_every and (k + 1) % apply_every == 0:
                engine.apply_delayed_update()
        if save is not None:
            engine.save_checkpoint(*save)
        out = {"losses": losses, "weights": engine.state_dict(), "master": engine.master_partition(),
               "state": engine.optimizer_state().buffers}
        engine.apply_delayed_update()
        out["applied"] = engine.state_dict()
        return out
    finally:
        engine.destroy()


def _reference_loop(config: dict, world: int, boundaries: int, apply_every: int = 0, spec: ModelSpec = WIDE) -> dict:
    """The same loop on the reference engine (every rank in one process)."""
    from reference.accumulation import AccumulationEngine

    engine = AccumulationEngine(lambda: spec.build(5), config, world)
    cfg = engine.config
    losses = []
    for k in range(boundaries):
        for j in range(cfg.gradient_accumulation_steps):
            batch = []
            for r in range(world):
                gen = torch.Generator().manual_seed(1000 * k + 10 * j + r)
                x = torch.randn(cfg.train_micro_batch_size_per_gpu, spec.in_features, generator=gen)
                y = torch.randn(cfg.train_micro_batch_size_per_gpu, spec.out_features, generator=gen)
                batch.append(compute_loss(engine.module(r), x, y, cfg.model_dtype))
            engine.backward(batch)
            engine.step()
            losses.append(batch[0].detach().clone())
        if apply_every and (k + 1) % apply_every == 0:
            engine.apply_delayed_update()
    out = {"losses": losses, "weights": engine.full_parameters(), "master": engine.master_partition(0)}
    engine.apply_delayed_update()
    out["applied"] = engine.full_parameters()
    engine.destroy()
    return out


def _assert_same(got: dict, want: dict, what: str, keys=("losses", "weights", "master", "applied")) -> None:
    for key in keys:
        a, b = got[key], want[key]
        if isinstance(a, dict):
            for name in b:
                assert torch.equal(a[name], b[name]), f"{what}: {key}[{name!r}] differs"
        elif isinstance(a, list):
            assert len(a) == len(b), f"{what}: {len(a)} {key}, expected {len(b)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"{what}: {key}[{i}] {x} != {y}"
        else:
            assert torch.equal(a, b), f"{what}: {key} differs"


def _config(stage: int, dtype: str, **extra) -> dict:
    return {
        **VALID, "zero_stage": stage, "dtype": dtype, "grad_accum_dtype": "fp32", "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "offload_param": "cpu" if stage == 3 else "none", **extra,
    }


@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("stage", "dtype", "world"), [(2, "bf16", 1), (2, "fp32", 2), (3, "bf16", 2)])
@pytest.mark.parametrize(("apply_every", "warmup"), [(0, 0), (2, 0), (0, 2)],
                         ids=["delayed", "apply-every-2", "warmup-2"])
def test_R27_training_loop_without_reads_matches_reference(impl, stage, dtype, world, apply_every, warmup):
    """R27 in a training loop that reads nothing between steps (the update of boundary k overlaps step k+1 and
    the next step's gradients accumulate while it runs): losses of every micro-step, the weights the module
    computes with, the fp32 master, and the weights after ``apply_delayed_update()`` equal the reference engine's
    bitwise; the master is one update ahead of the weights. With ``delayed_update_warmup = 2`` the first two
    boundaries are undelayed inside the engine, as the reference says."""
    api = engine_api(impl)
    cfg = _config(stage, dtype, delayed_update_warmup=warmup)
    got = api.run_on_ranks(_loop, world, api.ZeroEngine, cfg, 4, None, None, apply_every)
    want = _reference_loop(cfg, world, 4, apply_every)
    _assert_same(got[0], want, f"stage {stage} {dtype} W={world} apply_every={apply_every}")
    if not apply_every:
        lagging = [n for n in want["weights"] if not torch.equal(got[0]["weights"][n], got[0]["applied"][n])]
        assert lagging, "R27: the weights after the last boundary already hold its update (applied one step early)"


@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R27_next_step_accumulates_apart_from_the_update_in_flight(impl, monkeypatch):
    """R27 (R10, R13 step 6): the update of boundary k reads step k's gradient while step k+1's backward
    accumulates its own; with a large parameter and a cheap forward (:class:`RacerSpec`) the second is under way
    before the first is done, and the run still equals the reference bitwise -- which it cannot if the two
    gradients share a buffer, or if step k+1's gradient is cleared or added into step k's. The engine's buffers
    (tens of MB here) come from the pinning backend, not page-locked exactly: this test is about the accumulators,
    and must run under a CI runner's default 8 MiB ``ulimit -l``."""
    monkeypatch.setenv("HOSTOFFLOAD_ZERO_HOST_MEMORY", "pin_backend")
    api = engine_api(impl)
    cfg = _config(2, "fp32", gradient_accumulation_steps=1)
    got = api.run_on_ranks(_loop, 1, api.ZeroEngine, cfg, 8, None, None, 0, RacerSpec())[0]
    _assert_same(got, _reference_loop(cfg, 1, 8, 0, RacerSpec()), "a large parameter first, gas 1")


@REQUIRES_CHECKPOINT
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("stage", "dtype", "world", "warmup"), [(2, "bf16", 2, 0), (3, "fp32", 1, 3)])
def test_R27_resume_from_checkpoint_equals_uninterrupted_delayed_run(impl, tmp_path, stage, dtype, world, warmup):
    """R27 + checkpoints: 2 boundaries, ``save_checkpoint``, a fresh engine ``load_checkpoint`` + 2 boundaries
    equals 4 uninterrupted boundaries bitwise (losses, the weights the module computes with, the master, the
    optimizer state): the checkpoint keeps the weights the run computes with, which are not the master's cast.
    Saved inside a warm-up of 3 boundaries, the resumed run finishes it (boundary 3 undelayed, 4 delayed)."""
    api = engine_api(impl)
    cfg = _config(stage, dtype, delayed_update_warmup=warmup)
    full = api.run_on_ranks(_loop, world, api.ZeroEngine, cfg, 4)[0]
    first = api.run_on_ranks(_loop, world, api.ZeroEngine, cfg, 2, None, (str(tmp_path), "ck"))[0]
    resumed = api.run_on_ranks(_loop, world, api.ZeroEngine, cfg, 2, (str(tmp_path), "ck"))[0]
    _assert_same({"losses": first["losses"] + resumed["losses"]}, full, "resumed losses", keys=("losses",))
    _assert_same(resumed, full, f"stage {stage} {dtype} W={world} resumed", keys=("weights", "master", "applied"))
    for name, t in full["state"].items():
        assert torch.equal(resumed["state"][name], t), f"resumed optimizer state {name} differs"


@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R27_R8_delayed_checkpoint_reshards_both_weights(impl, tmp_path):
    """R27 + R8: a delayed checkpoint saved at W = 2, stage 2, loads at W = 1, stage 3 (and back at W = 2): the
    weights the module computes with and, after ``apply_delayed_update()``, the master's weights are the saved
    run's bitwise -- both ranges are resharded, not only the master."""
    api = engine_api(impl)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = api.run_on_ranks(_loop, 2, api.ZeroEngine, _config(2, "bf16"), 2, None, (a, "ck"))[0]
    narrow = api.run_on_ranks(_loop, 1, api.ZeroEngine, _config(3, "bf16"), 0, (a, "ck"), (b, "ck"))[0]
    back = api.run_on_ranks(_loop, 2, api.ZeroEngine, _config(2, "bf16"), 0, (b, "ck"))[0]
    for what, got in (("W=1 stage 3", narrow), ("back at W=2", back)):
        _assert_same(got, saved, what, keys=("weights", "applied"))
    lagging = [n for n in saved["weights"] if not torch.equal(saved["weights"][n], saved["applied"][n])]
    assert lagging, "premise: the saved run had an update pending"


@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R27_checkpoints_between_delayed_and_undelayed_engines(impl, tmp_path):
    """R27: a delayed run's checkpoint loaded by an engine without the delay computes with the master's cast
    (the pending update lands at the load), i.e. the weights the delayed run has after apply_delayed_update();
    an undelayed checkpoint loaded with the delay has nothing pending (weights = the saved ones)."""
    api = engine_api(impl)
    cfg = _config(2, "bf16")
    plain = {**cfg, "delayed_parameter_update": False}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = api.run_on_ranks(_loop, 2, api.ZeroEngine, cfg, 2, None, (a, "ck"))[0]
    loaded = api.run_on_ranks(_loop, 2, api.ZeroEngine, plain, 0, (a, "ck"))[0]
    _assert_same(loaded, saved, "delayed checkpoint into an undelayed engine", keys=("master",))
    for name, t in saved["applied"].items():
        assert torch.equal(loaded["weights"][name], t), f"undelayed load: {name} is not the master's cast"
    saved_plain = api.run_on_ranks(_loop, 1, api.ZeroEngine, plain, 2, None, (b, "ck"))[0]
    loaded_delayed = api.run_on_ranks(_loop, 1, api.ZeroEngine, cfg, 0, (b, "ck"))[0]
    for name, t in saved_plain["weights"].items():
        assert torch.equal(loaded_delayed["weights"][name], t), f"delayed load of an undelayed checkpoint: {name}"
        assert torch.equal(loaded_delayed["applied"][name], t), f"nothing may be pending after that load: {name}"



def _apply_inside_backward(group, engine_cls, config: dict) -> tuple:
    """One rank: ``apply_delayed_update()`` from a hook that runs inside ``backward()``; returns what it raised
    and whether a whole step afterwards still works."""
    spec = ModelSpec()
    engine = engine_cls(spec.build(5), config, process_group=group)
    caught: list = []
    try:
        x, y = torch.randn(2, spec.in_features), torch.randn(2, spec.out_features)
        out = engine(x)

        def hook(grad: torch.Tensor) -> None:
            try:
                engine.apply_delayed_update()
            except Exception as exc:  # classified by the test
                caught.append((type(exc).__name__, str(exc)))

        out.register_hook(hook)
        engine.backward(torch.mean((out - y) ** 2))
        engine.step()
        engine.apply_delayed_update()  # between calls it is fine
        return caught[0] if caught else None, engine.global_steps
    finally:
        engine.destroy()


@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R27_R20_apply_delayed_update_inside_backward_is_refused(impl):
    """R20/R27: ``apply_delayed_update()`` called while ``backward()`` runs (from a tensor hook) is refused with an
    UnsupportedOperationError naming the call and the allowed alternative; the engine goes on working."""
    api = engine_api(impl)
    cfg = {**VALID, "gradient_accumulation_steps": 1}
    refused, steps = api.run_on_ranks(_apply_inside_backward, 1, api.ZeroEngine, cfg)[0]
    assert refused is not None, "apply_delayed_update() inside backward() was not refused"
    kind, message = refused
    assert kind == "UnsupportedOperationError" and "apply_delayed_update" in message and "allowed" in message, message
    assert steps == 1
