"""DeepSpeed's ``scheduler`` section (docs/zero.md, "Schedules from the config"): WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle and LRRangeTest, with DeepSpeed's parameter names and defaults, stepped once per boundary
after the update as DeepSpeed's engine steps them.

The expected values come from the suite's own statement of DeepSpeed's formulas
(:mod:`conformance.areas.lr_schedule_oracle`), never from an implementation: the config's defaults are compared with
its table; every implementation's scenario trace is replayed boundary by boundary with the oracle's lr (and
OneCycle's betas), exactly; a distributed engine's ``get_lr()`` and group betas before every micro-step equal the
oracle's for drawn parameters; and a checkpoint resumes the schedule where it stopped.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import (
    assert_replay_consistent,
    assert_traces_match,
    cross_implementation_tolerance,
    replay_applies,
)
from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, REQUIRES_ENGINE, engine_api
from conformance.areas.assertions import assert_names_argument
from conformance.areas.lr_schedule_oracle import DEFAULTS, expected_betas, expected_lr
from reference.accumulation import Backward, ModelSpec, Scenario, Step, compute_loss
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")

#: One section per type whose value changes at (nearly) every one of a few boundaries, every branch reached.
SECTIONS = {
    "WarmupLR": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 4}},
    "WarmupDecayLR": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 2,
                                                          "total_num_steps": 5, "warmup_type": "linear"}},
    "WarmupCosineLR": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                            "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2}},
    "OneCycle": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05,
                                                "cycle_first_step_size": 2, "cycle_second_step_size": 1,
                                                "decay_step_size": 1, "decay_lr_rate": 0.5,
                                                "decay_mom_rate": 0.01}},
    "LRRangeTest": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2,
                                                      "lr_range_test_step_rate": 0.5}},
}


@pytest.mark.parametrize("kind", sorted(DEFAULTS))
def test_R19_scheduler_defaults_are_deepspeeds(area_api, kind):
    """Each type's parameters, with only the required ones given, take DeepSpeed's defaults (the oracle's table;
    ``warmup_max_lr`` unset means the optimizer's lr, an unset second half or stair count means the first's)."""
    required = {k: 7 if "steps" in k else 0.5 for k, v in DEFAULTS[kind].items() if v is None}
    cfg = area_api.AccumulationConfig.from_dict({"scheduler": {"type": kind, "params": required}})
    got = cfg.scheduler.to_dict()
    want = {k: required[k] if k in required else (None if v in ("optimizer lr", "first") else v)
            for k, v in DEFAULTS[kind].items()}
    assert got == {"type": kind, "params": want}


@pytest.mark.parametrize(
    "section,name",
    [
        ({"type": "CosineAnnealing"}, "scheduler.type"),
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, "total_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "warmup_type"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}, "warmup_max_lr"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "cycle_max_lr"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.5}},
         "cycle_max_mom"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, "lr_range_test_step_size"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 10}}, "warmup_steps"),
    ],
)
def test_R19_bad_scheduler_section_is_refused_by_name(area_api, section, name):
    """A scheduler section DeepSpeed would reject, warn about and reinterpret, or crash on later, is refused naming
    the key, in the flat config and in DeepSpeed's shape."""
    for cfg in ({"scheduler": section}, {"scheduler": section, "zero_optimization": {"stage": 1}}):
        with pytest.raises(ConfigurationError) as info:
            area_api.AccumulationConfig.from_dict(cfg)
        assert_names_argument(info.value, name, qualified=True)


def _scenario(kind: str, optimizer: dict, world_size: int = 2) -> Scenario:
    config = {"zero_stage": 2, "gradient_clipping": 0.0, "gradient_accumulation_steps": 2,
              "optimizer": optimizer, "scheduler": SECTIONS[kind]}
    return Scenario(config=config, world_size=world_size, calls=(Backward(), Step()) * 12, seed=3,
                    name=f"schedule-{kind}")


@pytest.mark.parametrize("kind", sorted(SECTIONS))
def test_R16_every_boundary_trains_with_the_schedules_lr(area_api, reference_api, impl, accelerator, kind):
    """Six boundaries (gas 2, W 2) under each schedule: the implementation's trace matches the reference's, and
    replaying its recorded gradients with the oracle's lr at each boundary (and OneCycle's betas: AdamW) gives
    exactly its parameters, so the lr each boundary used is DeepSpeed's."""
    optimizer = {"type": "adamw", "lr": 0.03} if kind == "OneCycle" else {"type": "sgd", "lr": 0.03}
    scenario = _scenario(kind, optimizer)
    actual = area_api.run_scenario(scenario)
    assert len(actual.boundaries()) == 6
    assert_traces_match(actual, reference_api.run_scenario(scenario),
                        cross_implementation_tolerance(scenario, impl, accelerator))
    if replay_applies(impl):
        assert_replay_consistent(actual)
    lrs = [expected_lr(SECTIONS[kind], 0.03, b) for b in range(6)]
    assert len(set(lrs)) >= 4, f"{kind}: the section must move the lr for the replay to mean something: {lrs}"


# ---- the engine: get_lr() at every micro-step, for drawn parameters ------------------------------------------

_steps = st.integers(1, 5)
_lr = st.floats(1e-4, 0.1)


@st.composite
def sections(draw) -> dict:
    """A scheduler section of any type, sized so that eight boundaries cross its warm-up, cycle and decay."""
    kind = draw(st.sampled_from(sorted(DEFAULTS)))
    wtype = st.sampled_from(("log", "linear"))
    if kind == "WarmupLR":
        p = {"warmup_min_lr": draw(_lr), "warmup_num_steps": draw(_steps), "warmup_type": draw(wtype)}
        if draw(st.booleans()):
            p["warmup_max_lr"] = draw(_lr)
    elif kind == "WarmupDecayLR":
        p = {"total_num_steps": draw(st.integers(1, 8)), "warmup_min_lr": draw(_lr), "warmup_max_lr": draw(_lr),
             "warmup_num_steps": draw(_steps), "warmup_type": draw(wtype)}
    elif kind == "WarmupCosineLR":
        p = {"total_num_steps": draw(st.integers(1, 8)), "warmup_min_ratio": draw(st.floats(0, 1)),
             "warmup_num_steps": draw(_steps), "cos_min_ratio": draw(st.floats(0, 1)), "warmup_type": draw(wtype)}
    elif kind == "OneCycle":
        p = {"cycle_min_lr": draw(_lr), "cycle_max_lr": draw(_lr), "cycle_first_step_size": draw(st.integers(1, 3)),
             "cycle_second_step_size": draw(st.none() | st.integers(0, 3)),
             "cycle_first_stair_count": draw(st.integers(0, 2)),
             "cycle_second_stair_count": draw(st.none() | st.integers(0, 2)),
             "decay_step_size": draw(st.integers(0, 2)), "decay_lr_rate": draw(st.floats(0, 1)),
             "cycle_momentum": draw(st.booleans()), "cycle_min_mom": draw(st.floats(0.5, 0.8)),
             "cycle_max_mom": draw(st.floats(0.8, 0.9)), "decay_mom_rate": draw(st.floats(0, 0.01))}
        p = {k: v for k, v in p.items() if v is not None}
    else:
        p = {"lr_range_test_min_lr": draw(_lr), "lr_range_test_step_size": draw(_steps),
             "lr_range_test_step_rate": draw(st.floats(0, 2)), "lr_range_test_staircase": draw(st.booleans())}
    return {"type": kind, "params": p}


def _engine_schedule(group, engine_cls, sections_: list, gas: int, micro_steps: int) -> list:
    """Per section: (lr, betas) of engine.optimizer's group before each micro-step."""
    out = []
    for section in sections_:
        config = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.85, 0.95]}}, "scheduler": section}
        engine = engine_cls(ModelSpec().build(1), config, process_group=group)
        seen = []
        for i in range(micro_steps):
            seen.append((engine.get_lr()[0], tuple(engine.optimizer.param_groups[0]["betas"])))
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)
            engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
            engine.step()
        engine.destroy()
        out.append(seen)
    return out


@REQUIRES_ENGINE
@pytest.mark.runs_in_subprocesses
@settings(max_examples=4)  # each example is one trip to a rank process with five sections (20 sections in ci)
@given(drawn=st.lists(sections(), min_size=5, max_size=5))
def test_R2_engine_lr_at_every_boundary_is_deepspeeds(impl, drawn):
    """For drawn parameters of every type: before each micro-step (gas 2, eight boundaries) ``get_lr()`` and the
    group's betas are the oracle's for the boundary that micro-step accumulates for -- unchanged between
    boundaries (R2), stepped once after each boundary's update."""
    api = engine_api(impl)
    gas, boundaries = 2, 8
    runs = api.run_on_ranks(_engine_schedule, 1, api.ZeroEngine, drawn, gas, gas * boundaries)[0]
    for section, seen in zip(drawn, runs, strict=True):
        want = [(expected_lr(section, 0.02, i // gas), expected_betas(section, (0.85, 0.95), i // gas))
                for i in range(gas * boundaries)]
        assert seen == want, f"{section}: engine {seen} != DeepSpeed's {want}"


# ---- checkpoints ---------------------------------------------------------------------------------------------

def _resume(group, engine_cls, directory: str) -> dict:
    """Three boundaries, save, three more (recorded); then a new engine loads and runs the same three."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.04}}, "scheduler": SECTIONS["WarmupDecayLR"]}

    def run(engine, first: int) -> list:
        lrs = []
        for i in range(first, first + 3):
            lrs.append(engine.get_lr()[0])
            gen = torch.Generator().manual_seed(100 * i + rank)
            x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)
            engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
            engine.step()
        return lrs

    engine = engine_cls(ModelSpec().build(2), config, process_group=group)
    run(engine, 0)
    engine.save_checkpoint(directory, tag="three")
    straight = run(engine, 3)
    straight_params = engine.state_dict()
    engine.destroy()
    engine = engine_cls(ModelSpec().build(9), config, process_group=group)
    fresh_lr = engine.get_lr()[0]
    engine.load_checkpoint(directory, tag="three")
    resumed = run(engine, 3)
    resumed_params = engine.state_dict()
    engine.destroy()
    # A run that attached its own torch scheduler, resumed with the config's: the schedule continues at boundary 3.
    from torch.optim.lr_scheduler import LambdaLR

    plain = {k: v for k, v in config.items() if k != "scheduler"}
    engine = engine_cls(ModelSpec().build(2), plain, process_group=group)
    engine.lr_scheduler = LambdaLR(engine.optimizer, lambda step: 0.5)
    run(engine, 0)
    engine.save_checkpoint(directory, tag="lambda")
    engine.destroy()
    engine = engine_cls(ModelSpec().build(9), config, process_group=group)
    engine.load_checkpoint(directory, tag="lambda")
    crossed = run(engine, 3)[1:]  # the first of them trains with the saved group's lr (the LambdaLR's)
    engine.destroy()
    return {"straight": straight, "resumed": resumed, "fresh_lr": fresh_lr, "crossed": crossed,
            "same": all(torch.equal(straight_params[n], p) for n, p in resumed_params.items())}


@REQUIRES_CHECKPOINT
@pytest.mark.runs_in_subprocesses
def test_R2_checkpoint_resumes_the_configured_schedule(impl, tmp_path):
    """A run saved after three boundaries and resumed by a new engine built from the same config continues the
    schedule where it stopped (the lr of boundaries 3-5 are the oracle's, not a restart's) and ends with the
    parameters, bitwise, of the run that never stopped; a checkpoint of a run that attached its own torch scheduler
    resumes the configured schedule at the same boundary."""
    api = engine_api(impl)
    out = api.run_on_ranks(_resume, 2, api.ZeroEngine, str(tmp_path))[0]
    want = [expected_lr(SECTIONS["WarmupDecayLR"], 0.04, b) for b in (3, 4, 5)]
    assert out["straight"] == want
    assert out["resumed"] == want, f"resumed lrs {out['resumed']} != {want}"
    assert out["fresh_lr"] == expected_lr(SECTIONS["WarmupDecayLR"], 0.04, 0) != want[0]
    assert out["same"], "resumed parameters differ from the uninterrupted run's"
    assert out["crossed"] == want[1:], f"a torch scheduler's state did not resume the schedule: {out['crossed']}"


# ---- DeepSpeed's own classes, where DeepSpeed is installed (the GPU box) -------------------------------------

def _deepspeed_values(lr_schedules, section: dict, boundaries: int) -> list:
    """(lr, betas) before each boundary from DeepSpeed's class on a torch AdamW, stepped as its engine does."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.02, betas=(0.85, 0.95))
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    out = []
    for _ in range(boundaries):
        out.append((float(optimizer.param_groups[0]["lr"]), tuple(optimizer.param_groups[0]["betas"])))
        optimizer.step()
        scheduler.step()
    return out


@REQUIRES_ENGINE
@pytest.mark.runs_in_subprocesses
@settings(max_examples=4)  # as above: five sections per trip to a rank process
@given(drawn=st.lists(sections(), min_size=5, max_size=5))
def test_R2_engine_lr_equals_deepspeeds_own_scheduler_classes(impl, drawn):
    """Where DeepSpeed is importable: the engine's lr and betas before every micro-step equal those of DeepSpeed's
    own ``deepspeed.runtime.lr_schedules`` class built from the same section (skipped elsewhere, e.g. CI; the
    oracle comparison above runs everywhere; ``benchmarks/compare_deepspeed_schedules.py`` prints the same per
    section)."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="DeepSpeed is not installed")
    api = engine_api(impl)
    gas, boundaries = 2, 8
    runs = api.run_on_ranks(_engine_schedule, 1, api.ZeroEngine, drawn, gas, gas * boundaries)[0]
    for section, seen in zip(drawn, runs, strict=True):
        theirs = _deepspeed_values(lr_schedules, section, boundaries)
        assert seen == [theirs[i // gas] for i in range(gas * boundaries)], f"{section}: engine != DeepSpeed"
