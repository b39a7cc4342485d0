"""The optimized implementation's Adam / AdamW kernels, declared for the conformance suite (area ``optimizer_kernels``).

Both perform R16's operation sequence one fp32 rounding at a time, so both claim the reference's arithmetic and
are judged bitwise (reference/contract/optimizer_kernels.py says what each field of a declaration means). Both
keep the moments in fp32 (R16) or bf16 (R29: widened in registers, stored rounded to nearest even in the same
pass), chosen by the moment tensors' dtype, so both declare the two state precisions and are judged on both.

- ``native-cpu-adam``: the vectorised host kernel (optimized/cpu_adam.py), once per ISA this CPU runs.
- ``fused-device-adam``: the Triton kernel (optimized/accumulation/device_adam.py); on the cpu accelerator it
  runs in Triton's interpreter, which holds its operation sequence to the formula; it needs ``triton``.
"""

from __future__ import annotations

from optimized import cpu_adam
from optimized.accumulation import device_adam
from reference.contract.optimizer_kernels import AdamKernel

__all__ = ["OPTIMIZER_KERNELS"]

#: R16's fp32 moments and R29's bf16 ones: both kernels take the precision from the moments' dtype.
BOTH = ("float32", "bfloat16")


def _native_step(config, param, grad, exp_avg, exp_avg_sq, t, *, grad_scale=None, variant=None):
    cpu_adam.adam_step(config, param, grad, exp_avg, exp_avg_sq, t, grad_scale=grad_scale, isa=variant)


def _declared() -> tuple[AdamKernel, ...]:
    kernels = [AdamKernel(name="fused-device-adam", step=device_adam.adam_step, devices=("cpu", "cuda"),
                          requires=("triton",), state_precisions=BOTH)]
    if cpu_adam.available():  # a build without the native extension has no host kernel to declare
        kernels.insert(0, AdamKernel(name="native-cpu-adam", step=_native_step, devices=("cpu",),
                                     variants=tuple(cpu_adam.available_isas()), state_precisions=BOTH))
    return tuple(kernels)


OPTIMIZER_KERNELS: tuple[AdamKernel, ...] = _declared()
