"""What an accumulation engine's step returns and keeps: the area's shared result types and constants.

Every implementation's ``step()`` returns a :class:`StepOutcome`; its optimizer state, as handed out by
``optimizer_state()`` / ``optimizer_states()``, is an :class:`OptimizerState` whose buffers carry the names of
:func:`state_buffer_names` (the names users and checkpoints see, and the files of ``nvme`` offload are named
after); the clipping coefficient of R15 adds :data:`CLIP_EPSILON` to the norm. How an implementation computes
any of it is its own (docs/accumulation.md R13-R16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.errors import ConfigurationError

__all__ = [
    "ADAM_KERNEL_TYPES", "CLIP_EPSILON", "OptimizerState", "StepOutcome", "check_adam_kernel_call",
    "state_buffer_names",
]

#: Added to the norm in the clipping coefficient (R15) so a zero gradient never divides by zero.
CLIP_EPSILON = 1e-6


@dataclass(frozen=True)
class StepOutcome:
    """What one ``step()`` did. Everything but ``boundary`` is ``None`` on a non-boundary step (R4).

    ``gradients``: the reduced, averaged, accumulated gradient of every trainable parameter as fp32 (an exact
    widening of the accumulation dtype), *before* clipping. ``clip_coef``: the factor the gradients were
    multiplied by, or ``None`` when clipping was off or not triggered.
    """

    boundary: bool
    grad_norm: float | None = None
    clip_coef: float | None = None
    gradients: dict[str, torch.Tensor] | None = None


@dataclass
class OptimizerState:
    """Per-rank state for one master shard: step count and the moment buffers the optimizer needs."""

    step: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> OptimizerState:
        return OptimizerState(self.step, {k: v.to(device) for k, v in self.buffers.items()})


def state_buffer_names(config: OptimizerConfig) -> tuple[str, ...]:
    """The state buffers ``config``'s optimizer keeps per master element (R16), in this order: Adam/AdamW the
    two moments, SGD its momentum buffer only when ``momentum > 0``."""
    if config.type == "sgd":
        return ("momentum_buffer",) if config.momentum > 0 else ()
    return ("exp_avg", "exp_avg_sq")


#: The optimizer types a one-pass Adam kernel (the native CPU one, a fused device one) implements.
ADAM_KERNEL_TYPES = ("adam", "adamw")


def check_adam_kernel_call(config: OptimizerConfig, step: int, refusal: str) -> None:
    """The arguments every one-pass Adam kernel refuses alike: an optimizer it does not implement (``refusal``
    completes the sentence after ``config.type=...``, naming the kernel) and a step count that is not R16's
    1-based ``t``."""
    if config.type not in ADAM_KERNEL_TYPES:
        raise ConfigurationError(
            f"config.type={config.type!r} {refusal}; allowed values: {', '.join(ADAM_KERNEL_TYPES)}"
        )
    if type(step) is not int or step < 1:
        raise ConfigurationError(f"step={step!r} must be an int >= 1 (the 1-based step count t)")
