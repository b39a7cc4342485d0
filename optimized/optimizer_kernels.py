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

from optimized.accumulation.adam_kernels import declared_kernels
from reference.contract.optimizer_kernels import AdamKernel

__all__ = ["OPTIMIZER_KERNELS"]

#: Read from the one table of the implementation's kernels (:data:`optimized.accumulation.adam_kernels.ADAM_KERNELS`),
#: which the engine and the benchmarks read too.
OPTIMIZER_KERNELS: tuple[AdamKernel, ...] = declared_kernels()
