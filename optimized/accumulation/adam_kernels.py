"""Every Adam / AdamW kernel of the optimized implementation, in one table (issue 51 item 5).

Three readers need the same facts about a kernel: the engine (which kernel steps this master, and how it is
called with the engine's extras -- the bf16 copy of the weights written in the same pass), the conformance area
``optimizer_kernels`` (what each kernel claims, :class:`~reference.contract.optimizer_kernels.AdamKernel`) and the
benchmarks (which kernels exist here, by the names the report prints). Each kernel is one :class:`KernelEntry`
in :data:`ADAM_KERNELS`, in the engine's order of preference; a new kernel is one more entry, and all three see
it. What is not here: the kernels themselves (:mod:`optimized.cpu_adam`, :mod:`.device_adam`) and the torch-op
sequence every other master runs (:mod:`.torch_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from optimized import cpu_adam
from optimized.accumulation import device_adam
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision
from reference.contract.accumulation_step import ADAM_KERNEL_TYPES, OptimizerState
from reference.contract.optimizer_kernels import AdamKernel

__all__ = ["ADAM_KERNELS", "KernelEntry", "declared_kernels", "engine_kernel", "kernel_named"]

#: R16's fp32 moments and R29's bf16 ones: both kernels take the precision from the moments' dtype.
BOTH_PRECISIONS = ("float32", "bfloat16")


@dataclass(frozen=True)
class KernelEntry:
    """One kernel: its name (the conformance area's and the reports'), whether this build has it, what it claims
    to the conformance area, whether the engine steps a given master with it, and the engine's call."""

    name: str
    available: Callable[[], bool]
    #: the declaration the ``optimizer_kernels`` area judges (built only where the kernel is available)
    declaration: Callable[[], AdamKernel]
    #: ``(config, master, grad, moments)``: whether the engine steps this master with it (moments: R29's
    #: precision of the state, None for a state without moments)
    steps: Callable[[OptimizerConfig, torch.Tensor, torch.Tensor, StatePrecision | None], bool]
    #: ``(config, master, grad, state, clip_coef, bf16_out)``: one step (``state.step`` advanced); True when it
    #: wrote the updated weights into ``bf16_out``
    run: Callable[[OptimizerConfig, torch.Tensor, torch.Tensor, OptimizerState, float | None, torch.Tensor | None],
                  bool]


# ---- the native CPU kernel ------------------------------------------------------------------------------------
def _native_conformance_step(config, param, grad, exp_avg, exp_avg_sq, t, *, grad_scale=None, variant=None):
    cpu_adam.adam_step(config, param, grad, exp_avg, exp_avg_sq, t, grad_scale=grad_scale, isa=variant)


def _native_steps(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor,
                  moments: StatePrecision | None) -> bool:
    return (config.type in ADAM_KERNEL_TYPES and cpu_adam.available() and master.device.type == "cpu"
            and master.dtype == torch.float32 and master.is_contiguous() and grad.is_contiguous())


def _native_run(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor, state: OptimizerState,
                clip_coef: float | None, bf16_out: torch.Tensor | None) -> bool:
    state.step += 1
    cpu_adam.adam_step(config, master, grad, state.buffers["exp_avg"], state.buffers["exp_avg_sq"], state.step,
                       grad_scale=clip_coef, bf16_out=bf16_out)
    return bf16_out is not None


# ---- the fused device kernel ----------------------------------------------------------------------------------
def _fused_steps(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor,
                 moments: StatePrecision | None) -> bool:
    return (master.is_contiguous() and grad.is_contiguous() and grad.device == master.device
            and device_adam.use_for(config, master, moments))


def _fused_run(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor, state: OptimizerState,
               clip_coef: float | None, bf16_out: torch.Tensor | None) -> bool:
    state.step += 1
    fill = bf16_out is not None and bf16_out.device == master.device and bf16_out.is_contiguous()
    device_adam.adam_step(config, master, grad, state.buffers["exp_avg"], state.buffers["exp_avg_sq"], state.step,
                          grad_scale=clip_coef, bf16_out=bf16_out if fill else None)
    return fill


#: The kernels, in the engine's order of preference (the first whose ``steps`` says yes steps the master).
ADAM_KERNELS: tuple[KernelEntry, ...] = (
    KernelEntry(
        name="native-cpu-adam", available=cpu_adam.available,
        declaration=lambda: AdamKernel(name="native-cpu-adam", step=_native_conformance_step, devices=("cpu",),
                                       variants=tuple(cpu_adam.available_isas()), state_precisions=BOTH_PRECISIONS),
        steps=_native_steps, run=_native_run,
    ),
    KernelEntry(
        name="fused-device-adam", available=lambda: True,  # it says itself where it runs (Triton, the verdicts)
        declaration=lambda: AdamKernel(name="fused-device-adam", step=device_adam.adam_step, devices=("cpu", "cuda"),
                                       requires=("triton",), state_precisions=BOTH_PRECISIONS),
        steps=_fused_steps, run=_fused_run,
    ),
)


def engine_kernel(config: OptimizerConfig, master: torch.Tensor, grad: torch.Tensor,
                  moments: StatePrecision | None) -> KernelEntry | None:
    """The kernel the engine steps ``master`` with, or None (the torch-op sequence)."""
    return next((k for k in ADAM_KERNELS if k.steps(config, master, grad, moments)), None)


def kernel_named(name: str) -> KernelEntry:
    """The entry called ``name`` (a KeyError naming the ones there are otherwise)."""
    for k in ADAM_KERNELS:
        if k.name == name:
            return k
    raise KeyError(f"no Adam kernel {name!r}; there are: {', '.join(k.name for k in ADAM_KERNELS)}")


def declared_kernels() -> tuple[AdamKernel, ...]:
    """What the ``optimizer_kernels`` area declares: every kernel this build has, as it claims it."""
    return tuple(k.declaration() for k in ADAM_KERNELS if k.available())
