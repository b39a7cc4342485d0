"""R15 clipping + R16 formulas with torch ops, in place: the optimizer step every other path must equal bitwise.

:func:`torch_step` is the reference's torch-op sequence operation for operation (same roundings, same correctly
rounded sqrt), but in place and over chunks of :data:`CHUNK_ELEMENTS`, so its temporaries stay a few chunks in
size instead of several copies of the master (the reference's out-of-place sequence, with its fp64 square root,
would need about five master-sized buffers). Elementwise arithmetic does not depend on where a chunk starts, so
chunking changes no bit.

Its own module because two others build on it: :mod:`optimized.accumulation.optimizers` falls back to it where no
kernel applies, and :mod:`optimized.accumulation.device_adam` checks its fused kernel against it on each device
before trusting it. Neither imports the other for it (no import cycle).
"""

from __future__ import annotations

import math

import torch

from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision, state_dtype
from reference.contract.accumulation_step import OptimizerState, state_buffer_names

__all__ = ["CHUNK_ELEMENTS", "init_state", "torch_step"]


def init_state(
    config: OptimizerConfig, master: torch.Tensor, precision: StatePrecision | None = None
) -> OptimizerState:
    """Zeroed state buffers (the contract's names) for ``master``, on its device; Adam's moments in ``precision``
    (R29; default fp32), SGD's momentum fp32."""
    dtype = state_dtype(config.type, precision)
    return OptimizerState(0, {n: torch.zeros_like(master, dtype=dtype) for n in state_buffer_names(config)})


def _sqrt_rounded_once(x: torch.Tensor) -> torch.Tensor:
    """The fp32 square root of ``x`` with one rounding to nearest, as R16 requires of every operation.

    torch's fp32 CPU ``sqrt`` is one ulp off for some inputs on some builds; the fp64 root is correctly rounded
    and carries more than 2 * 24 + 2 significand bits, so rounding it to fp32 is the correctly rounded fp32 root
    (the double rounding cannot change it). A chunk of ``x`` costs one fp64 temporary (hence the chunking)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


#: Elements per chunk of the torch path (16M: 64 MB of fp32, 128 MB for the fp64 square root).
CHUNK_ELEMENTS = 1 << 24


def torch_step(
    config: OptimizerConfig,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: OptimizerState,
    *,
    clip_coef: float | None,
    chunk: int = CHUNK_ELEMENTS,
) -> None:
    """R15 + R16 with torch ops, in place, chunk by chunk; ``grad`` is not modified. Flat tensors."""
    if master.dtype != torch.float32 or grad.dtype != torch.float32:
        raise TypeError(f"torch_step needs fp32 master and gradient, got {master.dtype} and {grad.dtype}")
    if master.shape != grad.shape:
        raise ValueError(f"master shape {tuple(master.shape)} != gradient shape {tuple(grad.shape)}")
    state.step += 1
    t = state.step
    wd, lr = config.weight_decay, config.lr
    n = master.numel()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        p, g = master[lo:hi], grad[lo:hi]
        if clip_coef is not None:
            g = torch.mul(g, clip_coef)  # R15: the coefficient rounded to fp32 where it meets the tensor
        if config.type == "sgd":
            if wd > 0:
                g = torch.add(g, torch.mul(p, wd))
            if config.momentum > 0:
                buf = state.buffers["momentum_buffer"][lo:hi]
                buf.mul_(config.momentum).add_(g)
                g = buf
            p.sub_(torch.mul(g, lr))
            continue
        beta1, beta2 = config.betas
        if wd > 0:
            if config.type == "adamw":
                p.mul_(1.0 - lr * wd)
            else:
                g = torch.add(g, torch.mul(p, wd))
        stored_m = state.buffers["exp_avg"][lo:hi]
        stored_v = state.buffers["exp_avg_sq"][lo:hi]
        precision = StatePrecision.of(stored_m)
        # R29: fp32 moments are updated in place; bf16 ones are widened into fp32 chunks and stored back rounded.
        m = stored_m if precision.dtype == torch.float32 else stored_m.to(torch.float32)
        v = stored_v if precision.dtype == torch.float32 else stored_v.to(torch.float32)
        m.mul_(beta1).add_(torch.mul(g, 1.0 - beta1))
        gg = torch.mul(g, g)
        v.mul_(beta2).add_(gg.mul_(1.0 - beta2))
        denom = _sqrt_rounded_once(v)
        denom.mul_(1.0 / math.sqrt(1.0 - beta2**t)).add_(config.eps)
        p.sub_(torch.div(m, denom).mul_(lr / (1.0 - beta1**t)))
        if m is not stored_m:
            precision.store(stored_m, m)
            precision.store(stored_v, v)
