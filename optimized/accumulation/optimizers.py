"""The optimizer step of the boundary epilogue (R15 clipping + R16 formulas) on the engine's fp32 master.

Where the master lives on the host (``offload_optimizer: cpu``, or any run on the cpu accelerator) Adam and
AdamW run in the native kernel (:mod:`optimized.cpu_adam`): one pass, the clipping coefficient applied inside
it, and -- for a bf16 model -- the bf16 copy of the updated weights written in that same pass. The kernel is
bitwise equal to the reference formula, so this choice never changes a result on the host. Everything else
(SGD, masters on a device) uses the reference's torch-op sequence, which is the formula itself.
"""

from __future__ import annotations

import torch

from optimized import cpu_adam
from reference.accumulation.config import OptimizerConfig
from reference.accumulation.optimizers import OptimizerState, correctly_rounded_sqrt, init_state, optimizer_step

__all__ = ["OptimizerState", "correctly_rounded_sqrt", "init_state", "optimizer_step", "step_master", "uses_native"]


def uses_native(config: OptimizerConfig, master: torch.Tensor) -> bool:
    """Whether :func:`step_master` runs the native CPU kernel for this optimizer and master."""
    return (
        config.type in ("adam", "adamw")
        and master.device.type == "cpu"
        and master.dtype == torch.float32
        and master.is_contiguous()
        and cpu_adam.available()
    )


def step_master(
    config: OptimizerConfig,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: OptimizerState,
    *,
    clip_coef: float | None,
    bf16_out: torch.Tensor | None = None,
) -> bool:
    """Clip (R15: multiply by ``clip_coef`` rounded to fp32) and step (R16) ``master`` in place.

    ``grad`` is fp32 on ``master``'s device and is not modified. Returns True when ``bf16_out`` was filled
    with the updated weights (native path only); the caller casts otherwise.
    """
    if uses_native(config, master) and grad.is_contiguous():
        state.step += 1
        cpu_adam.adam_step(
            config,
            master,
            grad,
            state.buffers["exp_avg"],
            state.buffers["exp_avg_sq"],
            state.step,
            grad_scale=clip_coef,
            bf16_out=bf16_out,
        )
        return bf16_out is not None
    g = torch.mul(grad, clip_coef) if clip_coef is not None else grad
    optimizer_step(config, master, g, state)
    return False
