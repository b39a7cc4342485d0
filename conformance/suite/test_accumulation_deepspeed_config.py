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

from conformance.areas.assertions import assert_names_argument
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
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
        ({"zero_optimization": {"offload_param": {"device": "cpu", "nvme_path": "/nvme"}}}, "nvme_path"),
        ({"zero_optimization": {"stag": 2}}, "zero_optimization.stag"),
        ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "reduce_bucket_size"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "amsgrad"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}, "warmup_steps"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
        ({"tensorboard": {"enabled": True}}, "tensorboard"),
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
    """R19: a DeepSpeed key this engine does not model (or a flat key mixed into the nested shape, a misspelt key,
    or a value that would change what is computed) is a ConfigurationError naming it, never silently ignored."""
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict({"bf16": {"enabled": False}, **patch})
    assert_names_argument(info.value, name, qualified=True)


# ---- every problem at once; HF's "auto"; bucket sizes; keys with no effect here ----------------------------------

def test_R19_one_refusal_names_every_problem_of_every_section(area_api):
    """A config with problems in every section (unknown, misspelt, unsupported, unresolvable "auto", a value that
    would change the numbers) is refused by one ConfigurationError that names each of them by its dotted key, so
    the user fixes the config in one edit."""
    bad = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": True, "loss_scale": 0},
        "optimizer": {"type": "Lion", "params": {"lr": 1e-3, "amsgrad": True, "betas": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_step": 5}},
        "zero_optimization": {
            "stage": 3, "stag3_max_live_parameters": 1e9, "zero_quantized_gradients": True, "cpu_offload": True,
            "offload_optimizer": {"device": "cpu", "ratio": 0.5},
            "offload_param": {"device": "cpu", "nvme_path": "/nvme"},
        },
        "tensorboard": {"enabled": True},
        "sparse_attention": {"mode": "fixed"},
    }
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict(bad, world_size=2)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping", "bf16.enabled",
                "fp16.enabled", "optimizer.type", "optimizer.params.amsgrad", "optimizer.params.betas",
                "scheduler.params.total_num_steps", "scheduler.params.warmup_step",
                "zero_optimization.stag3_max_live_parameters", "zero_optimization.zero_quantized_gradients",
                "zero_optimization.cpu_offload", "zero_optimization.offload_optimizer.ratio",
                "zero_optimization.offload_param.nvme_path", "tensorboard", "sparse_attention"):
        assert_names_argument(info.value, key, qualified=True)
    assert "stage3_max_live_parameters" in str(info.value), "a misspelt key should be answered with the close one"


def _ds(**top) -> dict:
    return {"zero_optimization": {"stage": 2}, **top}


def test_R19_auto_values_are_resolved_where_the_config_determines_them(area_api):
    """HF's "auto": one batch key from the other two and the world size; the optimizer's lr from the scheduler's
    peak and the scheduler's warmup_max_lr from the optimizer's lr (HF fills both from one learning_rate);
    warmup_min_lr as 0 (HF's constant); the performance-only sizes as this engine's defaults."""
    build = area_api.AccumulationConfig.from_dict
    cfg = build(_ds(train_batch_size="auto", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2),
                world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    cfg = build(_ds(train_batch_size=24, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=3),
                world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 4
    cfg = build(_ds(train_batch_size=24, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps="auto"),
                world_size=2)
    assert cfg.gradient_accumulation_steps == 4
    warm = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": 3e-4, "warmup_num_steps": 5}}
    cfg = build(_ds(optimizer={"type": "AdamW", "params": {"lr": "auto"}}, scheduler=warm))
    assert cfg.optimizer.lr == 3e-4 and cfg.scheduler.params.warmup_min_lr == 0.0
    warm = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 5}}
    cfg = build(_ds(optimizer={"type": "AdamW", "params": {"lr": 2e-3}}, scheduler=warm))
    assert cfg.scheduler.params.warmup_max_lr == 2e-3
    cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 5e-3}}
    assert build(_ds(optimizer={"params": {"lr": "auto"}}, scheduler=cycle)).optimizer.lr == 5e-3
    cfg = build({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto"}})
    assert cfg.bucket_elements is None and cfg.zero_stage == 3


@pytest.mark.parametrize(
    "patch,name",
    [
        ({"gradient_clipping": "auto"}, "gradient_clipping"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": "auto"}}}, "optimizer.params.eps"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"optimizer": {"params": {"lr": "auto"}}, "scheduler": {"type": "WarmupCosineLR",
                                                                 "params": {"total_num_steps": 9}}},
         "optimizer.params.lr"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
         "scheduler.params.warmup_num_steps"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, "train_batch_size"),
    ],
)
def test_R19_auto_values_nothing_determines_are_refused_by_name(area_api, patch, name):
    """An "auto" that only HF's Trainer arguments could fill (clipping, betas/eps, step counts, precision flags,
    two batch keys at once, an lr with no scheduler peak to take it from) is refused naming the key."""
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict(_ds(**patch), world_size=2)
    assert_names_argument(info.value, name, qualified=True)
    assert "auto" in str(info.value)


def test_R19_bucket_sizes_map_onto_bucket_elements(area_api):
    """``reduce_bucket_size`` (elements, as DeepSpeed counts them; JSON's 5e8 is fine) is ``bucket_elements``;
    ``allgather_bucket_size`` is used only where ``reduce_bucket_size`` is absent; neither: None (the engine's)."""
    build = area_api.AccumulationConfig.from_dict
    zero = lambda **kw: {"zero_optimization": {"stage": 2, **kw}}
    assert build(zero(reduce_bucket_size=5e8)).bucket_elements == 500_000_000
    assert build(zero(allgather_bucket_size=2e8)).bucket_elements == 200_000_000
    assert build(zero(reduce_bucket_size=1000, allgather_bucket_size=2e8)).bucket_elements == 1000
    assert build(zero()).bucket_elements is None
    assert build({"bucket_elements": 64}).bucket_elements == 64
    for bad in (0, -3, 2.5, "big", True):
        with pytest.raises(ConfigurationError) as info:
            build(zero(reduce_bucket_size=bad))
        assert_names_argument(info.value, "reduce_bucket_size", qualified=True)


NO_EFFECT = {
    "steps_per_print": 2000, "wall_clock_breakdown": False, "memory_breakdown": False,
    "zero_allow_untested_optimizer": True, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "tensorboard": {"enabled": False, "output_path": "logs"},
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False, "check_grad_overflow": True},
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "sub_group_size": 1e9, "round_robin_gradients": True,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5, "stage3_gather_16bit_weights_on_model_save": True,
        "ignore_unused_parameters": True, "memory_efficient_linear": False,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "fast_init": False,
                              "ratio": 1.0},
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5, "max_in_cpu": 1e9},
    },
}


def test_R19_keys_with_no_effect_here_are_accepted_and_change_nothing(area_api):
    """Logging, memory and speed knobs of mechanisms this engine does differently are accepted (validated) and
    give the same config as leaving them out; a value of one of them that would change the numbers is refused."""
    build = area_api.AccumulationConfig.from_dict
    plain = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu"}}}
    assert build(NO_EFFECT) == build(plain)
    for patch, name in (({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
                        ({"sub_group_size": -1}, "sub_group_size"),
                        ({"round_robin_gradients": "yes"}, "round_robin_gradients"),
                        ({"ignore_unused_parameters": False}, "ignore_unused_parameters")):
        cfg = {**NO_EFFECT, **patch} if name == "gradient_predivide_factor" else {
            **NO_EFFECT, "zero_optimization": {**NO_EFFECT["zero_optimization"], **patch}}
        with pytest.raises(ConfigurationError) as info:
            build(cfg)
        assert_names_argument(info.value, name, qualified=True)


def test_R19_docs_mapping_table_says_what_every_deepspeed_key_does():
    """docs/zero.md's mapping table has a row for every key of the contract's rule tables, with the same effect
    (honoured / mapped / no effect / refused), and no row for a key the tables do not know."""
    import re

    from conformance.harness.doc_rules import ROOT
    from reference.contract.deepspeed_keys import SECTIONS

    text = (ROOT / "docs" / "zero.md").read_text()
    table = text[text.index("| DeepSpeed key | here | how / why |"):]
    table = table[: table.index("\n\n")]
    documented = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            documented[key] = cells[1]
    wanted = {(f"{where}.{key}" if where else key): rule.effect
              for where, rules in SECTIONS.items() for key, rule in rules.items()}
    assert documented == wanted, {k: (documented.get(k), wanted.get(k)) for k in set(documented) | set(wanted)
                                  if documented.get(k) != wanted.get(k)}


def test_R19_aio_maps_onto_nvme_swap_and_scheduler_round_trips(area_api):
    """DeepSpeed's ``aio`` knobs are the swap handle's (``block_size``, ``queue_depth``, ``thread_count`` ->
    ``num_threads``), refused next to this project's own ``nvme_swap``; a config with a scheduler and a bucket size
    survives ``to_dict`` / ``from_dict`` and pickling unchanged (engines ship it to rank processes)."""
    import pickle

    build = area_api.AccumulationConfig.from_dict
    cfg = build({"zero_optimization": {"stage": 2, "reduce_bucket_size": 4096},
                 "aio": {"block_size": 2097152, "queue_depth": 16, "thread_count": 2, "single_submit": False},
                 "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})
    swap = cfg.nvme_swap
    assert (swap.block_size, swap.queue_depth, swap.num_threads) == (2097152, 16, 2)
    assert build(cfg.to_dict()) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.bucket_elements == 4096 and cfg.scheduler.params.cycle_max_lr == 1e-3
    with pytest.raises(ConfigurationError) as info:
        build({"zero_optimization": {"stage": 2}, "aio": {"queue_depth": 16}, "nvme_swap": {"queue_depth": 8}})
    assert_names_argument(info.value, "aio")
