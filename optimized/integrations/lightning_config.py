"""What a Lightning ``Trainer`` and ``LightningModule`` say about training, merged into one engine config.

A Lightning user states some of what the engine's config holds in Lightning's own places:
``Trainer(accumulate_grad_batches=, gradient_clip_val=, gradient_clip_algorithm=, precision=)`` and the optimizer
that ``LightningModule.configure_optimizers`` returns. The strategy (:mod:`optimized.integrations.lightning`)
must not let the two disagree silently: Lightning counts ``global_step``, steps its LR schedulers and runs its
``on_before_optimizer_step`` hooks at *its* accumulation boundaries, the engine updates at *its* own, and a run
whose config says one clipping and whose Trainer says another has no right answer. So each setting is taken from
wherever it is given, and a setting given in both places with different values is refused by name
(:class:`~reference.contract.errors.ConfigurationError`, both values and what to change). HF-style ``"auto"`` for
``gradient_accumulation_steps`` and ``gradient_clipping`` means "the Trainer's", for
``train_micro_batch_size_per_gpu`` the training DataLoader's batch size, for ``train_batch_size`` "derive it".

Nothing here imports Lightning: the inputs are plain values (:class:`TrainerSettings`) and a torch optimizer, so
the rules are tested without the framework and read in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig, is_deepspeed_shaped
from reference.contract.errors import ConfigurationError

__all__ = ["AUTO", "TRAINER_PRECISIONS", "TrainerSettings", "optimizer_section", "resolve_config"]

#: The value HF's DeepSpeed configs write for "derive it": here, "take it from the Trainer".
AUTO = "auto"
#: ``Trainer(precision=...)`` values the strategy runs, and the engine dtype each means. "bf16-true" casts the
#: batch to bf16 (Lightning's HalfPrecision), as a bf16 engine needs; mixed precision (autocast over fp32 weights)
#: and fp16 (loss scaling) are not what the engine computes, so they are refused rather than approximated.
TRAINER_PRECISIONS: dict[str, str] = {"32-true": "fp32", "32": "fp32", "bf16-true": "bf16"}


@dataclass(frozen=True)
class TrainerSettings:
    """The Trainer's settings that overlap the engine config (read from a ``Trainer`` by the strategy)."""

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    precision: str = "32-true"
    automatic_optimization: bool = True
    #: The training DataLoader's batch size (None: unknown), what ``train_micro_batch_size_per_gpu: "auto"`` means.
    micro_batch_size: int | None = None


def resolve_config(
    config: AccumulationConfig | Mapping[str, Any] | None,
    trainer: TrainerSettings,
    optimizer: Mapping[str, Any] | None,
    world_size: int,
) -> AccumulationConfig:
    """The engine config of a Lightning run: ``config`` (flat or DeepSpeed's nested shape; None: defaults) with
    accumulation, clipping, dtype and optimizer completed from ``trainer`` and ``optimizer`` (the section
    :func:`optimizer_section` made of ``configure_optimizers``'s optimizer, or None), conflicts refused."""
    if not trainer.automatic_optimization:
        raise ConfigurationError(
            "LightningModule.automatic_optimization=False is not supported by the hostoffload strategy (the engine "
            "owns backward() and the update); allowed: automatic_optimization=True"
        )
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, AccumulationConfig):
        raw = config.to_dict()
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise ConfigurationError(
            f"config={config!r} must be None, an AccumulationConfig or a mapping (flat keys or DeepSpeed's nested "
            f"shape)"
        )
    _take_auto(raw, "train_micro_batch_size_per_gpu", trainer.micro_batch_size)
    _take_auto(raw, "train_batch_size", None)  # derived from the other two (and the world size) when left out
    gas_given = _take_auto(raw, "gradient_accumulation_steps", trainer.accumulate_grad_batches)
    clip_given = _take_auto(raw, "gradient_clipping", _trainer_clip(trainer))
    dtype_given = any(k in raw for k in (("bf16", "fp16") if is_deepspeed_shaped(raw) else ("dtype",)))
    cfg = AccumulationConfig.from_dict(raw, world_size=world_size)
    if not cfg.managed_gradient_accumulation:
        raise ConfigurationError(
            "managed_gradient_accumulation=False is not supported by the hostoffload strategy: Lightning calls the "
            "optimizer step once per batch and the engine must know the boundary; allowed: True (the default), "
            "with Trainer(accumulate_grad_batches=N)"
        )
    changes: dict[str, Any] = {}
    _agree(changes, "gradient_accumulation_steps", cfg.gradient_accumulation_steps, gas_given or
           "train_batch_size" in raw, trainer.accumulate_grad_batches, "Trainer(accumulate_grad_batches=...)")
    clip = _trainer_clip(trainer)
    if clip is not None:
        _agree(changes, "gradient_clipping", cfg.gradient_clipping, clip_given, clip, "Trainer(gradient_clip_val=...)")
    _agree(changes, "dtype", cfg.dtype, dtype_given, _engine_dtype(trainer.precision), "Trainer(precision=...)")
    if optimizer is not None:
        _agree_optimizer(changes, cfg.optimizer, "optimizer" in raw, optimizer)
    return cfg.replace(**changes) if changes else cfg


def _take_auto(raw: dict[str, Any], key: str, trainer_value: Any) -> bool:
    """Replace ``"auto"`` under ``key`` with the Trainer's value (dropped when the Trainer has none); whether the
    config gave a value of its own."""
    if isinstance(raw.get(key), str) and raw[key].lower() == AUTO:
        if trainer_value is None:
            del raw[key]
        else:
            raw[key] = trainer_value
        return False
    return key in raw


def _trainer_clip(trainer: TrainerSettings) -> float | None:
    algorithm = trainer.gradient_clip_algorithm
    if algorithm is not None and str(algorithm).lower() != "norm":
        raise ConfigurationError(
            f"Trainer(gradient_clip_algorithm={algorithm!r}) is not supported by the hostoffload strategy (the engine "
            f"clips by the global gradient norm, R15); allowed: 'norm'"
        )
    value = trainer.gradient_clip_val
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value) and value >= 0
    if not ok:
        raise ConfigurationError(f"Trainer(gradient_clip_val={value!r}) must be a finite number >= 0, or None")
    return float(value)


def _engine_dtype(precision: str) -> str:
    key = str(precision)
    if key not in TRAINER_PRECISIONS:
        raise ConfigurationError(
            f"Trainer(precision={precision!r}) is not supported by the hostoffload strategy; allowed values: "
            f"{', '.join(map(repr, TRAINER_PRECISIONS))} (the engine keeps fp32 masters; bf16-true runs a bf16 model)"
        )
    return TRAINER_PRECISIONS[key]


def _agree(changes: dict[str, Any], key: str, ours: Any, given: bool, theirs: Any, where: str) -> None:
    """Take the Trainer's value for ``key`` unless the config gave one; refuse two different values."""
    if not given:
        if ours != theirs:
            changes[key] = theirs
        return
    if ours != theirs:
        raise ConfigurationError(
            f"the config says {key}={ours!r} but {where} gives {theirs!r}; the strategy needs one value; allowed: "
            f"leave {key} out of the config (or {AUTO!r}) to take the Trainer's, or make the two equal"
        )


def _agree_optimizer(changes: dict[str, Any], ours: OptimizerConfig, given: bool, theirs: Mapping[str, Any]) -> None:
    wanted = OptimizerConfig.from_dict(theirs)
    if not given:
        changes["optimizer"] = asdict(wanted)
        return
    differ = [f"{k}: config {getattr(ours, k)!r} vs configure_optimizers {v!r}"
              for k, v in asdict(wanted).items() if getattr(ours, k) != v]
    if differ:
        raise ConfigurationError(
            f"the config's optimizer section and the optimizer LightningModule.configure_optimizers returns differ "
            f"({'; '.join(differ)}); allowed: define the optimizer in one place, or make them equal"
        )


# ---- the optimizer configure_optimizers returns ----------------------------------------------------------------

#: torch optimizer classes the engine runs (its own update, R16) -> the engine's optimizer type.
_TYPES: dict[type, str] = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: Options of those classes that change the arithmetic and that R16 does not have: they must be off.
_MUST_BE_OFF = ("amsgrad", "maximize", "nesterov", "dampening")


def optimizer_section(optimizer: torch.optim.Optimizer, trainable: list[torch.nn.Parameter]) -> dict[str, Any]:
    """The flat optimizer section equivalent to ``optimizer`` (torch's SGD, Adam or AdamW with one parameter group
    over exactly the ``trainable`` parameters and none of the options R16 lacks), or a ConfigurationError naming
    what does not map. torch's Adam with weight decay is L2 Adam (``adam``), AdamW and ``Adam(decoupled_weight_decay=
    True)`` are ``adamw``: the engine then runs R16's formula of that name with these hyper-parameters."""
    kind = _TYPES.get(type(optimizer))
    if kind is None:
        raise ConfigurationError(
            f"configure_optimizers returned {type(optimizer).__module__}.{type(optimizer).__qualname__}; the "
            f"hostoffload strategy runs the engine's own update and accepts torch.optim.SGD, Adam or AdamW (read "
            f"for their hyper-parameters); allowed: one of those, or configure_optimizers returning None and the "
            f"config's optimizer section"
        )
    groups = optimizer.param_groups
    group_ids = [id(p) for g in groups for p in g["params"]]
    if len(groups) != 1 or sorted(group_ids) != sorted(id(p) for p in trainable):
        raise ConfigurationError(
            f"configure_optimizers returned an optimizer with {len(groups)} parameter group(s) over {len(group_ids)} "
            f"parameter(s); the engine updates every trainable parameter ({len(trainable)}) as one group; allowed: "
            f"one group over self.parameters() (per-group hyper-parameters are not supported)"
        )
    group = groups[0]
    on = [k for k in _MUST_BE_OFF if group.get(k)]
    if on:
        raise ConfigurationError(
            f"configure_optimizers' optimizer sets {', '.join(f'{k}={group[k]!r}' for k in on)}, which the engine's "
            f"update (R16) does not have; allowed: the default (off)"
        )
    if kind == "adam" and group.get("decoupled_weight_decay"):
        kind = "adamw"
    # A scheduler built in configure_optimizers has already scaled "lr"; the optimizer's own value is "initial_lr".
    lr = group.get("initial_lr", group["lr"])
    section: dict[str, Any] = {"type": kind, "lr": float(lr), "weight_decay": float(group["weight_decay"])}
    if kind == "sgd":
        section["momentum"] = float(group["momentum"])
    else:
        section["betas"] = tuple(float(b) for b in group["betas"])
        section["eps"] = float(group["eps"])
    return section
