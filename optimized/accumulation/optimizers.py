"""The optimizer step of the boundary epilogue (R15 clipping + R16 formulas) on the engine's fp32 master.

Where the master lives on the host (``offload_optimizer: cpu``, or any run on the cpu accelerator) Adam and
AdamW run in the native kernel (:mod:`optimized.cpu_adam`): one pass, the clipping coefficient applied inside
it, and -- for a bf16 model -- the bf16 copy of the updated weights written in that same pass. The kernel is
bitwise equal to the reference formula, so this choice never changes a result on the host.

An Adam/AdamW master on a device steps in one fused pass (:mod:`optimized.accumulation.device_adam`, Triton)
where that kernel is available and has matched :func:`torch_step` bitwise on the device (``HOSTOFFLOAD_DEVICE_ADAM``
decides; the same bits either way, a fraction of the memory traffic).

Which kernel steps which master is decided by the one table of kernels, :mod:`.adam_kernels` (the first entry
whose ``steps`` accepts the master), which the ``optimizer_kernels`` area and the benchmarks read too.

Everything else (SGD, device masters without the fused kernel) runs :func:`torch_step`
(:mod:`optimized.accumulation.torch_optimizer`, re-exported here with :func:`init_state` and
:data:`CHUNK_ELEMENTS`): the reference's torch-op sequence, in place and chunk by chunk.

R29 (``state_precision: bf16``): the moment buffers are bf16 and their dtype is the precision. The native kernel
and the fused device kernel read and write them in their one pass; :func:`torch_step` widens a chunk, runs the
same fp32 sequence and stores it back rounded by the contract's ``round_to_bf16``.
"""

from __future__ import annotations

import torch

from optimized.accumulation.adam_kernels import engine_kernel, kernel_named
from optimized.accumulation.torch_optimizer import CHUNK_ELEMENTS, init_state, torch_step
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision
from reference.contract.accumulation_step import ADAM_KERNEL_TYPES, OptimizerState

__all__ = [
    "CHUNK_ELEMENTS", "OptimizerState", "init_state", "native_adam", "step_master", "torch_step", "uses_native",
]


def native_adam(config: OptimizerConfig) -> bool:
    """Whether this optimizer has the native CPU kernel in this build (Adam/AdamW with ``optimized.cpu_adam``)."""
    return config.type in ADAM_KERNEL_TYPES and kernel_named("native-cpu-adam").available()


def uses_native(config: OptimizerConfig, master: torch.Tensor) -> bool:
    """Whether :func:`step_master` runs the native CPU kernel for this optimizer and master."""
    return kernel_named("native-cpu-adam").steps(config, master, master, None)


def _moments(state: OptimizerState) -> StatePrecision | None:
    """R29: the precision Adam's moments are stored in (None for a state without them: SGD)."""
    m = state.buffers.get("exp_avg")
    return None if m is None else StatePrecision.of(m)


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
    with the updated weights (the native and fused kernels fill it in their pass); the caller casts otherwise.
    """
    kernel = engine_kernel(config, master, grad, _moments(state))
    if kernel is not None:
        return kernel.run(config, master, grad, state, clip_coef, bf16_out)
    torch_step(config, master, grad, state, clip_coef=clip_coef)
    return False
