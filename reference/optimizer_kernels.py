"""The reference's ``optimizer_kernels`` area: no kernel of its own.

The oracle of every kernel is R16's torch sequence in :mod:`reference.accumulation.optimizers`; declaring it as a
kernel would judge it against itself. The area exists so that the reference, like every implementation, answers
the area's interface (reference/contract/optimizer_kernels.py).
"""

from __future__ import annotations

from reference.contract.optimizer_kernels import AdamKernel

__all__ = ["OPTIMIZER_KERNELS"]

OPTIMIZER_KERNELS: tuple[AdamKernel, ...] = ()
