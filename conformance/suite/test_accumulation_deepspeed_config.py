"""DeepSpeed's nested config shape, mapped onto the same validated config (R19; docs/zero.md, "DeepSpeed-style
config").

A DeepSpeed user's ``ds_config`` dict (``zero_optimization.stage``, ``offload_optimizer.device``,
``bf16.enabled``, ``optimizer: {type: "Adam", params: {...}}``, ``train_batch_size``) builds the same
``AccumulationConfig`` as the flat keys, with DeepSpeed's defaults where they differ (gradient clipping off, Adam
with decoupled weight decay); keys it does not model are rejected by their dotted name, and the batch identity
``train_batch_size = micro * gas * world_size`` is checked or completes the missing key. The config class comes
from the implementation under test (``area_api.AccumulationConfig``).
"""

from __future__ import annotations

import pytest

from conformance.assertions import assert_names_argument
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")

DS = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "steps_per_print": 10,
}

FLAT = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "dtype": "bf16",
    "grad_accum_dtype": "fp32",
    "zero_stage": 3,
    "overlap_comm": True,
    "offload_optimizer": "cpu",
    "offload_param": "cpu",
    "optimizer": {"type": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
}


def test_R19_deepspeed_shape_maps_onto_the_flat_config(area_api):
    """R19's config, built from DeepSpeed's nested shape, equals the one built from the flat keys; the batch
    identity holds at world size 2 and is rejected, naming all three keys, at world size 4."""
    cfg = area_api.AccumulationConfig.from_dict(DS, world_size=2)
    assert cfg == area_api.AccumulationConfig.from_dict(FLAT)
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict(DS, world_size=4)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert_names_argument(info.value, key)


def test_R19_deepspeed_defaults_and_derived_batch_keys(area_api):
    """DeepSpeed's defaults where they differ from the flat config's: gradient clipping off (0) and ``Adam``
    meaning decoupled weight decay unless ``adam_w_mode`` is false; optimizer type case-insensitive in both
    shapes; a missing micro-batch size or gas is derived from train_batch_size and the world size."""
    build = area_api.AccumulationConfig.from_dict
    ds = build({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert ds.gradient_clipping == 0.0 and ds.optimizer.type == "adamw" and ds.zero_stage == 1
    l2 = build({"zero_optimization": {"stage": 1}, "optimizer": {"type": "ADAM", "params": {"adam_w_mode": False}}})
    assert l2.optimizer.type == "adam"
    assert build({"optimizer": {"type": "SGD"}}).optimizer.type == "sgd"  # flat shape, DeepSpeed spelling
    derived = build({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": False}},
                    world_size=2)
    assert (derived.gradient_accumulation_steps, derived.dtype) == (4, "fp32")
    derived = build({"train_batch_size": 24, "gradient_accumulation_steps": 3, "zero_optimization": {}}, world_size=2)
    assert derived.train_micro_batch_size_per_gpu == 4
    with pytest.raises(ConfigurationError) as info:  # nothing to derive the other two batch keys from
        build({"train_batch_size": 24, "zero_optimization": {}})
    assert_names_argument(info.value, "train_batch_size")
    with pytest.raises(ConfigurationError) as info:  # 25 is not micro-batch 3 x world size 2 x any gas
        build({"train_batch_size": 25, "train_micro_batch_size_per_gpu": 3, "zero_optimization": {}}, world_size=2)
    assert_names_argument(info.value, "train_batch_size")


@pytest.mark.parametrize(
    "patch,name",
    [
        ({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 5}}, "stage3_prefetch_bucket_size"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 4}}}, "buffer_count"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "amsgrad"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler"),
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "immediate_grad_update"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "offload_optimizer"),
        ({"zero_optimization": {"contiguous_gradients": False}}, "contiguous_gradients"),
        ({"zero_optimization": {"stage": 1}, "zero_stage": 1}, "zero_stage"),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type"),
        # keys accepted for DeepSpeed compatibility (they change nothing here) still reject bad values
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"steps_per_print": "10"}, "steps_per_print"),
        ({"wall_clock_breakdown": "yes"}, "wall_clock_breakdown"),
    ],
)
def test_R19_deepspeed_keys_not_modeled_are_rejected_by_name(area_api, patch, name):
    """R19: a DeepSpeed key this engine does not model (or a flat key mixed into the nested shape, or a value it
    does not support) is a ConfigurationError naming it, never silently ignored."""
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict({"bf16": {"enabled": False}, **patch})
    assert_names_argument(info.value, name, qualified=True)
