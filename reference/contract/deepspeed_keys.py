"""What each DeepSpeed config key does here: honoured, mapped, accepted with no effect, or refused (and why).

One table per section. docs/zero.md's mapping table is written from these (a docs test checks that every key here
appears there with its effect), and the translation (:mod:`reference.contract.deepspeed_config`) refuses a key
with the hint written here. Effects:

- ``honoured``: the key means the same here and is applied;
- ``mapped``: applied through a key of this engine with a different name or unit (the ``why`` says how);
- ``no effect``: accepted (its value validated: ``accepts``) because it changes nothing observable here --
  logging, a memory or speed knob of a mechanism this engine does differently -- and refusing it would only make a
  working config fail; a value that *would* change the numbers is refused (``accepts`` says which are fine);
- ``refused``: a feature this engine does not model; the config is refused naming the key and ``why``.

Keys of no table are unknown: refused with the allowed keys of their section.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SECTIONS", "KeyRule", "is_auto", "size_value"]

AUTO = "auto"


def is_auto(value: object) -> bool:
    """HF's placeholder: the Trainer fills it from its arguments before DeepSpeed sees the config."""
    return isinstance(value, str) and value == AUTO


def size_value(value: object) -> int | None:
    """An element count as DeepSpeed reads one: an int, or an integral float (JSON ``5e8``); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


@dataclass(frozen=True)
class KeyRule:
    """What one key does here. ``accepts`` (for ``no effect`` keys): the values that change nothing; other
    values are refused with ``why``. ``allowed`` says what to write instead when refused."""

    effect: str
    why: str
    accepts: Callable[[Any], bool] | None = None
    allowed: str = ""


def _bool(v: Any) -> bool:
    return type(v) is bool


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda v: type(v) is type(expected) and v == expected


def _size(minimum: int = 0, *, auto: bool = False) -> Callable[[Any], bool]:
    return lambda v: (auto and is_auto(v)) or ((s := size_value(v)) is not None and s >= minimum)


def _number_in(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      and low <= v <= high)


def _anything(v: Any) -> bool:
    return True


def _disabled_section(v: Any) -> bool:
    return isinstance(v, dict) and v.get("enabled", False) is False


_H, _M, _N, _R = "honoured", "mapped", "no effect", "refused"

TOP: dict[str, KeyRule] = {
    "train_batch_size": KeyRule(_H, "checked: train_batch_size = micro x gas x world size; 'auto' derived from the "
                                    "other two"),
    "train_micro_batch_size_per_gpu": KeyRule(_H, "the micro-batch size; 'auto' derived from the other two"),
    "gradient_accumulation_steps": KeyRule(_H, "gas; 'auto' derived from the other two"),
    "gradient_clipping": KeyRule(_H, "the global-norm clip (0: off, DeepSpeed's default)"),
    "optimizer": KeyRule(_H, "type Adam/AdamW/SGD and its params"),
    "scheduler": KeyRule(_H, "DeepSpeed's five schedules, stepped at each boundary"),
    "zero_optimization": KeyRule(_H, "the ZeRO section (its own table)"),
    "bf16": KeyRule(_H, "enabled: true makes the model dtype bf16"),
    "fp16": KeyRule(_H, "accepted while not enabled (fp16 needs dynamic loss scaling, not modeled)"),
    "communication_data_type": KeyRule(_H, "the reduction dtype"),
    "data_types": KeyRule(_H, "grad_accum_dtype"),
    "aio": KeyRule(_M, "the NVMe swap's knobs: onto nvme_swap"),
    "managed_gradient_accumulation": KeyRule(_H, "who decides the boundary"),
    "nvme_swap": KeyRule(_H, "this project's swap-handle knobs"),
    "steps_per_print": KeyRule(_N, "logging", _size(1), "an int >= 1"),
    "wall_clock_breakdown": KeyRule(_N, "logging", _bool, "true or false"),
    "memory_breakdown": KeyRule(_N, "logging", _bool, "true or false"),
    "dump_state": KeyRule(_N, "logging", _bool, "true or false"),
    "zero_allow_untested_optimizer": KeyRule(_N, "the optimizer is always one of this engine's", _bool,
                                             "true or false"),
    "zero_force_ds_cpu_optimizer": KeyRule(_N, "offload always runs this engine's CPU Adam", _bool, "true or false"),
    "prescale_gradients": KeyRule(_N, "gradients are averaged after the reduction (R10); prescaling would round "
                                      "differently", _is(False), "false"),
    "gradient_predivide_factor": KeyRule(_N, "as prescale_gradients", _is(1.0), "1.0"),
    "sparse_gradients": KeyRule(_N, "gradients are dense here", _is(False), "false"),
    "tensorboard": KeyRule(_N, "monitoring is not provided", _disabled_section, "enabled: false, or no section"),
    "wandb": KeyRule(_N, "monitoring is not provided", _disabled_section, "enabled: false, or no section"),
    "csv_monitor": KeyRule(_N, "monitoring is not provided", _disabled_section, "enabled: false, or no section"),
    "comms_logger": KeyRule(_N, "monitoring is not provided", _disabled_section, "enabled: false, or no section"),
    "flops_profiler": KeyRule(_N, "profiling is not provided", _disabled_section, "enabled: false, or no section"),
    "activation_checkpointing": KeyRule(_R, "DeepSpeed's checkpointing API is not provided", None,
                                        "torch.utils.checkpoint in the model (stage 3 re-gathers for it, R21)"),
    "checkpoint": KeyRule(_R, "checkpoint options are not modeled", None,
                          "leave it out (save_checkpoint/load_checkpoint take their options as arguments)"),
    "amp": KeyRule(_R, "apex amp is not supported", None, "bf16.enabled: true"),
    "torch_autocast": KeyRule(_R, "autocast is not modeled (weights are in the model dtype)", None,
                              "bf16.enabled: true"),
    "elasticity": KeyRule(_R, "elastic training is not modeled", None, "leave it out"),
}

ZERO: dict[str, KeyRule] = {
    "stage": KeyRule(_H, "zero_stage 0-3"),
    "offload_optimizer": KeyRule(_H, "device none/cpu/nvme (its own table)"),
    "offload_param": KeyRule(_H, "device none/cpu at stage 3 (its own table)"),
    "overlap_comm": KeyRule(_H, "reductions overlap backward"),
    "contiguous_gradients": KeyRule(_N, "always so here (flat buffers)", _is(True), "true"),
    "reduce_scatter": KeyRule(_N, "always so here (rank-ordered reduce-scatter)", _is(True), "true"),
    "allgather_partitions": KeyRule(_N, "always so here", _is(True), "true"),
    "reduce_bucket_size": KeyRule(_M, "bucket_elements: elements per gradient bucket at stages 2/3 (DeepSpeed "
                                      "counts elements too); 'auto': the engine's default"),
    "allgather_bucket_size": KeyRule(_M, "bucket_elements when reduce_bucket_size is absent (the all-gather after "
                                         "the update runs per reduce bucket or whole here); else no effect"),
    "sub_group_size": KeyRule(_N, "the host update streams per bucket; the sub-group only bounds DeepSpeed's "
                                  "memory", _size(0), "an int >= 0"),
    "round_robin_gradients": KeyRule(_N, "the order gradients are copied to the host; same numbers", _bool,
                                     "true or false"),
    "stage3_prefetch_bucket_size": KeyRule(_N, "stage 3 prefetches one module ahead (the engine's prefetch "
                                               "argument)", _size(0, auto=True), "an int >= 0 or 'auto'"),
    "stage3_param_persistence_threshold": KeyRule(_N, "every parameter is partitioned; no persistence",
                                                  _size(0, auto=True), "an int >= 0 or 'auto'"),
    "stage3_model_persistence_threshold": KeyRule(_N, "as stage3_param_persistence_threshold", _size(0),
                                                  "an int >= 0"),
    "stage3_max_live_parameters": KeyRule(_N, "parameters are released after each module's use", _size(0),
                                          "an int >= 0"),
    "stage3_max_reuse_distance": KeyRule(_N, "parameters are released after each module's use", _size(0),
                                         "an int >= 0"),
    "stage3_gather_16bit_weights_on_model_save": KeyRule(_N, "engine.state_dict() always gathers the full "
                                                             "model-dtype weights", _bool, "true or false"),
    "stage3_gather_fp16_weights_on_model_save": KeyRule(_N, "as stage3_gather_16bit_weights_on_model_save", _bool,
                                                        "true or false"),
    "stage3_module_granularity_threshold": KeyRule(_N, "gathers are per module", _size(0), "an int >= 0"),
    "stage3_use_all_reduce_for_fetch_params": KeyRule(_N, "gathers are all-gathers; same values", _bool,
                                                      "true or false"),
    "stage3_allgather_sequential": KeyRule(_N, "gather order only", _bool, "true or false"),
    "use_multi_rank_bucket_allreduce": KeyRule(_N, "reductions are reduce-scatters here", _bool, "true or false"),
    "memory_efficient_linear": KeyRule(_N, "no linear-layer replacement here", _bool, "true or false"),
    "ignore_unused_parameters": KeyRule(_N, "unused parameters get zero gradients (R7)", _is(True), "true"),
    "load_from_fp32_weights": KeyRule(_N, "checkpoints always restore the fp32 masters", _is(True), "true"),
    "elastic_checkpoint": KeyRule(_N, "checkpoints load at any world size anyway", _bool, "true or false"),
    "compute_grad_norm": KeyRule(_N, "the global norm is always computed (R14)", _is(True), "true"),
    "legacy_stage1": KeyRule(_N, "no legacy stage 1", _is(False), "false"),
    "zero_hpz_partition_size": KeyRule(_N, "hierarchical partitioning (ZeRO++) is not modeled", _is(1), "1"),
    "zero_quantized_weights": KeyRule(_N, "quantized communication (ZeRO++) would change the numbers", _is(False),
                                      "false"),
    "zero_quantized_nontrainable_weights": KeyRule(_N, "as zero_quantized_weights", _is(False), "false"),
    "zero_quantized_gradients": KeyRule(_N, "as zero_quantized_weights", _is(False), "false"),
    "mics_shard_size": KeyRule(_R, "MiCS sharding is not modeled", None, "leave it out"),
    "mics_hierarchical_params_gather": KeyRule(_R, "MiCS sharding is not modeled", None, "leave it out"),
    "cpu_offload": KeyRule(_R, "DeepSpeed's deprecated spelling", None, "offload_optimizer: {device: cpu}"),
    "cpu_offload_param": KeyRule(_R, "DeepSpeed's deprecated spelling", None, "offload_param: {device: cpu}"),
    "cpu_offload_use_pin_memory": KeyRule(_R, "DeepSpeed's deprecated spelling", None,
                                          "offload_optimizer: {pin_memory: true}"),
    "zenflow": KeyRule(_R, "ZenFlow's stale-gradient update is not modeled", None,
                       "offload_optimizer.delayed_parameter_update (R27) for a one-step delay"),
}

_OWN_OPTIMIZER_OFFLOAD = ("delayed_parameter_update", "delayed_update_warmup", "gpu_share", "gpu_memory_budget",
                          "gpu_memory_limit", "state_precision", "host_update_start")

OFFLOAD_OPTIMIZER: dict[str, KeyRule] = {
    "device": KeyRule(_H, "none, cpu or nvme"),
    "nvme_path": KeyRule(_H, "the directory nvme swaps into"),
    "pin_memory": KeyRule(_N, "offloaded buffers are always pinned", _is(True), "true"),
    "buffer_count": KeyRule(_N, "the swap handle sizes its own buffers (nvme_swap / aio)", _size(0), "an int >= 0"),
    "pipeline_read": KeyRule(_N, "swap reads are asynchronous anyway", _bool, "true or false"),
    "pipeline_write": KeyRule(_N, "swap writes are asynchronous anyway", _bool, "true or false"),
    "fast_init": KeyRule(_N, "initialisation speed only", _bool, "true or false"),
    "cpuadam_cores_perc": KeyRule(_N, "the CPU Adam's threads are torch's", _number_in(0.0, 1.0),
                                  "a number in [0, 1]"),
    "ratio": KeyRule(_N, "ZeRO-Offload++'s share kept on the host; here gpu_share = 1 - ratio", _is(1.0),
                     "1.0, and gpu_share for a device share"),
    "super_offload": KeyRule(_N, "SuperOffload is not modeled", _is(False), "false"),
    **{k: KeyRule(_H, "this project's key (docs/zero.md)") for k in _OWN_OPTIMIZER_OFFLOAD},
}

OFFLOAD_PARAM: dict[str, KeyRule] = {
    "device": KeyRule(_H, "none or cpu (stage 3)"),
    "pin_memory": KeyRule(_N, "offloaded buffers are always pinned", _is(True), "true"),
    "nvme_path": KeyRule(_R, "parameters are not swapped to NVMe", None, "offload_param.device: cpu"),
    "buffer_count": KeyRule(_N, "parameter NVMe buffers do not exist here", _size(0), "an int >= 0"),
    "buffer_size": KeyRule(_N, "parameter NVMe buffers do not exist here", _size(0), "an int >= 0"),
    "max_in_cpu": KeyRule(_N, "parameter NVMe buffers do not exist here", _size(0), "an int >= 0"),
}

BF16: dict[str, KeyRule] = {
    "enabled": KeyRule(_H, "true: bf16 model dtype; 'auto' is refused (nothing here says which)"),
    "immediate_grad_update": KeyRule(_N, "gradients are accumulated per R9/R10", _is(False), "false"),
    "check_grad_overflow": KeyRule(_N, "bf16 has no overflow check here", _bool, "true or false"),
    "bf16_master_weights_and_grads": KeyRule(_N, "the masters are fp32 (R11)", _is(False), "false"),
    "bf16_optimizer_states": KeyRule(_N, "moments in bf16 are this engine's state_precision", _is(False),
                                     "false, and offload_optimizer.state_precision: bf16"),
}

#: fp16's keys do nothing while it is not enabled (and it cannot be enabled here).
FP16: dict[str, KeyRule] = {
    "enabled": KeyRule(_H, "false only; 'auto' is refused (nothing here says which)"),
    **{k: KeyRule(_N, "fp16 is not enabled", _anything, "anything") for k in (
        "loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale", "auto_cast", "fp16_master_weights_and_grads")},
}

OPTIMIZER_PARAMS: dict[str, KeyRule] = {
    **{k: KeyRule(_H, "the optimizer's hyper-parameter") for k in ("lr", "betas", "eps", "weight_decay", "momentum")},
    "adam_w_mode": KeyRule(_H, "Adam with decoupled weight decay (true, DeepSpeed's default) or L2 (false)"),
    "torch_adam": KeyRule(_N, "the same Adam formula (R16)", _bool, "true or false"),
    "bias_correction": KeyRule(_N, "Adam is always bias-corrected (R16)", _is(True), "true"),
    "amsgrad": KeyRule(_N, "AMSGrad is not modeled", _is(False), "false"),
}

AIO: dict[str, KeyRule] = {
    "block_size": KeyRule(_M, "nvme_swap.block_size"),
    "queue_depth": KeyRule(_M, "nvme_swap.queue_depth"),
    "thread_count": KeyRule(_M, "nvme_swap.num_threads"),
    "intra_op_parallelism": KeyRule(_M, "nvme_swap.num_threads"),
    "single_submit": KeyRule(_N, "submission batching only", _bool, "true or false"),
    "overlap_events": KeyRule(_N, "completion handling only", _bool, "true or false"),
    "use_gds": KeyRule(_N, "GPUDirect Storage is not used", _is(False), "false"),
}

#: Every table, by the dotted section it governs ("" is the top level).
SECTIONS: dict[str, dict[str, KeyRule]] = {
    "": TOP,
    "zero_optimization": ZERO,
    "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER,
    "zero_optimization.offload_param": OFFLOAD_PARAM,
    "bf16": BF16,
    "fp16": FP16,
    "optimizer.params": OPTIMIZER_PARAMS,
    "aio": AIO,
}
