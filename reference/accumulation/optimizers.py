"""SGD, Adam and AdamW on fp32 master shards, written one rounding at a time (R16).

Every line below is a single elementwise torch operation on fp32 tensors, so each intermediate is rounded to
fp32 exactly once, and no operation can be contracted into a fused multiply-add (torch's ``add(..., alpha=)``
and ``addcdiv`` may use FMA in their vector kernels; they are deliberately not used), and no tensor is divided
by a scalar (CUDA rewrites that as a multiplication by the reciprocal; here the reciprocal is explicit
instead). Python-float hyper-parameters are combined in fp64 first (``1 - beta1``, bias corrections, ``lr /
bias_correction1``) and rounded to fp32 when they meet a tensor. That makes the formula reproducible
elementwise by any implementation that performs the same sequence (issue 6's native CPU Adam), and checkable
against scalar numpy float32 arithmetic (the conformance suite does exactly that).

With ``t`` the 1-based step count of this optimizer (one per boundary), ``g`` the clipped fp32 gradient shard
and ``p`` the fp32 master shard:

SGD (``momentum`` mu, ``weight_decay`` wd, ``lr``)::

    if wd > 0: g = g + p * wd
    if mu > 0: b = b * mu + g ; d = b        (b starts at zeros)
    else:      d = g
    p = p - d * lr

Adam (L2 weight decay folded into the gradient)::

    if wd > 0: g = g + p * wd
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    denom = sqrt(v) * (1 / sqrt(1 - beta2**t)) + eps      (sqrt correctly rounded, see correctly_rounded_sqrt)
    p = p - (m / denom) * (lr / (1 - beta1**t))

AdamW (decoupled weight decay, applied before the moment update)::

    if wd > 0: p = p * (1 - lr * wd)
    then the Adam lines without the L2 term.

R29 (``state_precision: bf16``): the moments are *stored* in bf16. ``m`` and ``v`` above are then their exact fp32
widenings, the lines run unchanged in fp32 (``p`` from the unrounded new ``m`` and ``v``), and the new moments are
stored rounded by :func:`reference.contract.accumulation_state_precision.round_to_bf16` (to nearest even).
"""

from __future__ import annotations

import math

import torch

from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision, state_dtype
from reference.contract.accumulation_step import OptimizerState, state_buffer_names


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded once, to nearest.

    torch's fp32 CPU ``sqrt`` is not correctly rounded on every build (this project's CI torch returns a value
    one ulp off for some inputs), and R16 requires one correct rounding per operation. The fp64 square root is
    correctly rounded and fp64 has more than 2 * 24 + 2 significand bits, so rounding it to fp32 gives the
    correctly rounded fp32 square root (double rounding is innocuous for sqrt at that precision).
    """
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def init_state(
    config: OptimizerConfig, master: torch.Tensor, precision: StatePrecision | None = None
) -> OptimizerState:
    """Zeroed state for ``master`` on ``master``'s device (the host when ``offload_optimizer='cpu'``, R17); Adam's
    moments in ``precision`` (R29; default fp32), SGD's momentum always fp32."""
    dtype = state_dtype(config.type, precision)
    return OptimizerState(0, {n: torch.zeros_like(master, dtype=dtype) for n in state_buffer_names(config)})


def optimizer_step(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor, state: OptimizerState) -> None:
    """Apply one step of ``config.type`` to ``master`` in place, advancing ``state``.

    ``master`` and ``grad`` must be fp32 and the same shape; ``grad`` is not modified.
    """
    if master.dtype != torch.float32 or grad.dtype != torch.float32:
        raise TypeError(f"optimizer_step needs fp32 master and gradient, got {master.dtype} and {grad.dtype}")
    if master.shape != grad.shape:
        raise ValueError(f"master shape {tuple(master.shape)} != gradient shape {tuple(grad.shape)}")
    state.step += 1
    if config.type == "sgd":
        _sgd(config, master, grad, state)
    else:
        _adam(config, master, grad, state, decoupled=config.type == "adamw")


def _sgd(config: OptimizerConfig, p: torch.Tensor, g: torch.Tensor, state: OptimizerState) -> None:
    if config.weight_decay > 0:
        g = torch.add(g, torch.mul(p, config.weight_decay))
    if config.momentum > 0:
        buf = state.buffers["momentum_buffer"]
        buf.copy_(torch.add(torch.mul(buf, config.momentum), g))
        direction = buf
    else:
        direction = g
    p.copy_(torch.sub(p, torch.mul(direction, config.lr)))


def _adam(config: OptimizerConfig, p: torch.Tensor, g: torch.Tensor, state: OptimizerState, *, decoupled: bool) -> None:
    beta1, beta2 = config.betas
    t = state.step
    if config.weight_decay > 0:
        if decoupled:
            p.copy_(torch.mul(p, 1.0 - config.lr * config.weight_decay))
        else:
            g = torch.add(g, torch.mul(p, config.weight_decay))
    stored_m = state.buffers["exp_avg"]
    stored_v = state.buffers["exp_avg_sq"]
    precision = StatePrecision.of(stored_m)  # R29: the buffers' dtype is the state precision
    if StatePrecision.of(stored_v) != precision:
        raise TypeError(f"exp_avg is {stored_m.dtype} but exp_avg_sq is {stored_v.dtype}; both must be one precision")
    m = stored_m.to(torch.float32)  # exact widening (the buffer itself at fp32)
    v = stored_v.to(torch.float32)
    m = torch.add(torch.mul(m, beta1), torch.mul(g, 1.0 - beta1))
    v = torch.add(torch.mul(v, beta2), torch.mul(torch.mul(g, g), 1.0 - beta2))
    inv_bias_correction2_sqrt = 1.0 / math.sqrt(1.0 - beta2**t)
    step_size = config.lr / (1.0 - beta1**t)
    denom = torch.add(torch.mul(correctly_rounded_sqrt(v), inv_bias_correction2_sqrt), config.eps)
    p.copy_(torch.sub(p, torch.mul(torch.div(m, denom), step_size)))
    precision.store(stored_m, m)  # R29: fp32 stores as is, bf16 rounds to nearest even
    precision.store(stored_v, v)
