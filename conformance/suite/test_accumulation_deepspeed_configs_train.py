"""DeepSpeed configs train unchanged (docs/zero.md, "DeepSpeed-style config"): a ZeRO-2 and a ZeRO-3 offload config
of the shape DeepSpeed's and HF's documentation show -- written out here from their documented keys, with HF's
``"auto"`` where the rest of the config determines the value, their no-effect knobs, and a scheduler.

Each config trains three boundaries on every implementation (its ``run_scenario``, compared with the reference's
trace and replayed with the oracle's scheduled lr), and on a distributed engine the raw dict goes straight into
``ZeroEngine`` at two ranks on gloo, as a ported script does. Three, because DeepSpeed's warm-ups train the first
two boundaries at ``warmup_min_lr`` (0 where HF's "auto" puts it): the third is the first to move the ZeRO-3
config's weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conformance.areas.accumulation_assertions import (
    assert_replay_consistent,
    assert_traces_match,
    cross_implementation_tolerance,
    replay_applies,
)
from conformance.areas.accumulation_engines import REQUIRES_ENGINE, engine_api
from conformance.areas.lr_schedule_oracle import expected_lr
from reference.accumulation import Backward, ModelSpec, Scenario, Step, compute_loss

pytestmark = pytest.mark.conformance_area("accumulation")

#: ZeRO-2 with the optimizer offloaded, as DeepSpeed's ZeRO-Offload tutorial and HF's ZeRO-2 example write it.
ZERO2_OFFLOAD = {
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 2, "total_num_steps": 10}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 2,
    "wall_clock_breakdown": False,
}

#: ZeRO-3 with optimizer and parameters offloaded, as HF's ZeRO-3 example writes it (bf16 instead of its fp16).
ZERO3_OFFLOAD = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": 3}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "wall_clock_breakdown": False,
}

CONFIGS = {"zero2-offload": ZERO2_OFFLOAD, "zero3-offload": ZERO3_OFFLOAD}
WORLD = 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_R19_R26_documented_deepspeed_config_trains(area_api, reference_api, impl, accelerator,
                                                                   name):
    """The config, translated at W=2 (its "auto" batch key derived: gas 2), trains three boundaries: the trace
    matches the reference's and replays exactly with the scheduled lr of each boundary."""
    cfg = area_api.AccumulationConfig.from_dict(copy.deepcopy(CONFIGS[name]), world_size=WORLD)
    assert cfg.gradient_accumulation_steps == 2 and cfg.train_batch_size == 8 and cfg.scheduler is not None
    scenario = Scenario(config=cfg, world_size=WORLD, calls=(Backward(), Step()) * 6, seed=4, name=name)
    actual = area_api.run_scenario(scenario)
    assert len(actual.boundaries()) == 3
    assert_traces_match(actual, reference_api.run_scenario(scenario),
                        cross_implementation_tolerance(scenario, impl, accelerator))
    if replay_applies(impl):
        assert_replay_consistent(actual)


def _train(group, engine_cls, config: dict) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(ModelSpec().build(6), config, process_group=group)
    before = engine.state_dict()
    lrs, boundaries = [], 0
    for i in range(6):
        lrs.append(engine.get_lr()[0])
        gen = torch.Generator().manual_seed(10 * i + rank)
        x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)
        engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
        boundaries += engine.step().boundary
    after = engine.state_dict()
    engine.destroy()
    return {"lrs": lrs, "boundaries": boundaries, "gas": engine.config.gradient_accumulation_steps,
            "moved": any(not torch.equal(before[n], p) for n, p in after.items()),
            "finite": all(bool(torch.isfinite(p).all()) for p in after.values())}


@REQUIRES_ENGINE
@pytest.mark.runs_in_subprocesses
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_R19_engine_takes_the_documented_config_as_written(impl, name):
    """``ZeroEngine(model, ds_config)`` with the raw dict at two ranks: three boundaries in six micro-steps, the
    lr of each micro-step the schedule's for its boundary, the weights moved and finite."""
    api = engine_api(impl)
    out = api.run_on_ranks(_train, WORLD, api.ZeroEngine, copy.deepcopy(CONFIGS[name]))
    section = copy.deepcopy(CONFIGS[name]["scheduler"])
    params = section["params"]
    if params["warmup_min_lr"] == "auto":
        params["warmup_min_lr"] = 0.0
    if params.get("warmup_max_lr") == "auto":
        params["warmup_max_lr"] = CONFIGS[name]["optimizer"]["params"]["lr"]
    lr = params["warmup_max_lr"]
    for rank_out in out:
        assert rank_out["gas"] == 2 and rank_out["boundaries"] == 3
        assert rank_out["lrs"] == [expected_lr(section, lr, i // 2) for i in range(6)]
        assert rank_out["moved"] and rank_out["finite"]


def _buckets(group, engine_cls) -> dict:
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 64}}
    out = {}
    for name, kwargs in (("config", {}), ("same", {"bucket_elements": 64}), ("other", {"bucket_elements": 32})):
        try:
            engine_cls(ModelSpec().build(1), config, process_group=group, **kwargs).destroy()
            out[name] = None
        except Exception as exc:  # reported to the test process, which checks the class and the message
            out[name] = (type(exc).__name__, str(exc))
    return out


@REQUIRES_ENGINE
@pytest.mark.runs_in_subprocesses
def test_R19_engine_bucket_argument_must_agree_with_reduce_bucket_size(impl):
    """The config's ``reduce_bucket_size`` sets the engine's bucket size; an explicit ``bucket_elements`` argument
    that agrees is fine, one that disagrees is refused naming both, rather than one silently winning."""
    api = engine_api(impl)
    out = api.run_on_ranks(_buckets, 1, api.ZeroEngine)[0]
    assert out["config"] is None and out["same"] is None, out
    kind, message = out["other"]
    assert kind == "ConfigurationError", out
    assert "bucket_elements" in message and "reduce_bucket_size" in message, message
