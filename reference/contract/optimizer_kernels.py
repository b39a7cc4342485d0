"""The optimizer-kernel area: an Adam / AdamW kernel declares what it claims; the suite holds it to R16 (and R29).

A kernel is any callable that performs R16's Adam or AdamW step in place on flat tensors (a native CPU kernel, a
fused device kernel, another library's CPU Adam). An implementation declares its kernels in the module of its
``optimizer_kernels`` area as ``OPTIMIZER_KERNELS``, a tuple of :class:`AdamKernel`; a third party that ships
only a kernel declares only this area (``Implementation(areas={"optimizer_kernels": "mypkg.kernels"})``).
The suite (conformance/suite/test_optimizer_kernels.py) runs R16's properties over every declared kernel, on
every variant it names and every accelerator it runs on, and reads nothing else about it.

Why each field exists:

- ``arithmetic``: what the comparison with the reference may assume. :data:`SAME_AS_REFERENCE` claims R16's
  operation sequence, one fp32 rounding per operation and no FMA, so equality is bitwise (R25's ``torch.equal``
  semantics). A kernel that computes otherwise (another library's operation order, a contraction into FMAs)
  declares a :class:`Tolerance` with the reason; the tolerance is bounded by :data:`MAX_RTOL` / :data:`MAX_ATOL`
  so that "R16 within a tolerance" cannot be declared into meaning nothing.
- ``variants``: the variants of one kernel the caller can choose (ISAs, thread layouts, an interpreter); each is
  judged separately, passed as ``variant=``. Empty: the kernel is called without ``variant``.
- ``devices``: the device types (``torch.device.type``) the kernel runs on; it is judged on each accelerator of
  the run whose device type is listed.
- ``requires``: importable packages the kernel needs (a compiler such as ``triton``). Where one is missing the
  suite says so at the top of its report, naming the rules left unjudged, instead of passing silently.
- ``state_precisions``: the dtypes the kernel keeps the moments ``exp_avg`` / ``exp_avg_sq`` in. The precision
  is carried by the moment tensors the suite passes (their dtype), so a new state precision adds a value here
  and a rule the suite judges it by, never a new call signature. ``"float32"`` is R16; ``"bfloat16"`` is R29
  (docs/accumulation.md: widen, R16's step, store rounded to nearest even by
  :func:`~reference.contract.accumulation_state_precision.round_to_bf16`). A kernel is judged on R29 only when
  it declares ``"bfloat16"``; otherwise the suite reports each R29 test skipped for it, with that reason.

The call every kernel accepts: ``step(config, param, grad, exp_avg, exp_avg_sq, t, *, grad_scale=None)`` plus
``variant=`` when it declares variants; ``config`` is an
:class:`~reference.contract.accumulation_config.OptimizerConfig`
of a type in ``optimizers``; tensors are flat, contiguous and of one device; ``grad`` is never modified; ``t`` is
R16's 1-based step; ``grad_scale`` is R15's clipping coefficient (the gradient is multiplied by it rounded to fp32
first). Bad arguments raise :class:`~reference.contract.errors.ConfigurationError` naming the argument, and
nothing is written.

Contract: read by implementations (to declare their kernels) and by the suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reference.contract.accumulation_step import ADAM_KERNEL_TYPES

__all__ = [
    "MAX_ATOL",
    "MAX_RTOL",
    "SAME_AS_REFERENCE",
    "STATE_PRECISIONS",
    "AdamKernel",
    "Tolerance",
]

#: The loosest tolerance a kernel may declare: about 80 fp32 ulps relative, and an absolute floor far below any
#: learning rate, for the elements that cancel to near zero (where a relative bound means nothing). Another
#: library's Adam (torch.optim's operation order: lerp for the first moment, the bias correction divided into
#: the square root) stays within rtol 1e-6, atol 1e-7 of R16 over the suite's inputs.
MAX_RTOL = 1e-5
MAX_ATOL = 1e-6
#: Moment dtypes a kernel may declare (``float32``: R16; ``bfloat16``: R29).
STATE_PRECISIONS = ("float32", "bfloat16")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class Tolerance:
    """A kernel's declared difference from R16: ``|actual - expected| <= atol + rtol * |expected|`` element-wise
    on the master and both moments (NaN where the reference has NaN), with the reason the arithmetic differs."""

    rtol: float
    atol: float
    reason: str

    def __post_init__(self) -> None:
        for name, value, ceiling in (("rtol", self.rtol, MAX_RTOL), ("atol", self.atol, MAX_ATOL)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= ceiling:
                raise ValueError(f"Tolerance.{name}={value!r} must be a number in [0, {ceiling}] "
                                 f"(reference.contract.optimizer_kernels.MAX_{name.upper()})")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"Tolerance.reason must say why the arithmetic differs from R16, got {self.reason!r}")

    def describe(self) -> str:
        return f"within rtol {self.rtol:g}, atol {self.atol:g} ({self.reason})"


#: The arithmetic of R16 itself: compared with the reference bitwise.
SAME_AS_REFERENCE = "same_as_reference"


@dataclass(frozen=True)
class AdamKernel:
    """One Adam / AdamW kernel and what it claims (the module docstring says why each field exists)."""

    name: str
    step: Callable[..., Any]
    arithmetic: str | Tolerance = SAME_AS_REFERENCE
    optimizers: tuple[str, ...] = ADAM_KERNEL_TYPES
    devices: tuple[str, ...] = ("cpu",)
    variants: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    state_precisions: tuple[str, ...] = ("float32",)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"AdamKernel.name={self.name!r} must be lower-case letters, digits, '_', '.', '-'")
        if not callable(self.step):
            raise ValueError(f"AdamKernel {self.name!r}: step must be callable, got {type(self.step).__name__}")
        if self.arithmetic != SAME_AS_REFERENCE and not isinstance(self.arithmetic, Tolerance):
            raise ValueError(f"AdamKernel {self.name!r}: arithmetic={self.arithmetic!r}; allowed: "
                             f"{SAME_AS_REFERENCE!r} or a reference.contract.optimizer_kernels.Tolerance")
        for field_name, allowed in (("optimizers", ADAM_KERNEL_TYPES), ("state_precisions", STATE_PRECISIONS)):
            values = getattr(self, field_name)
            if not isinstance(values, tuple) or not values or not set(values) <= set(allowed):
                raise ValueError(f"AdamKernel {self.name!r}: {field_name}={values!r} must be a non-empty tuple of "
                                 f"{', '.join(allowed)}")
        for field_name in ("devices", "variants", "requires"):
            values = getattr(self, field_name)
            if not isinstance(values, tuple) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"AdamKernel {self.name!r}: {field_name}={values!r} must be a tuple of names")
        if not self.devices:
            raise ValueError(f"AdamKernel {self.name!r}: devices must name at least one device type")

    @property
    def bitwise(self) -> bool:
        return self.arithmetic == SAME_AS_REFERENCE

    def describe(self) -> str:
        claim = self.arithmetic.describe() if isinstance(self.arithmetic, Tolerance) else "bitwise R16"
        return f"{self.name} ({', '.join(self.optimizers)} on {', '.join(self.devices)}; {claim})"

    def call(self, config: Any, param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, t: int, *,
             grad_scale: float | None = None, variant: str | None = None) -> None:
        """The kernel's step, with ``variant=`` only where it declares variants."""
        extra = {"variant": variant} if self.variants else {}
        self.step(config, param, grad, exp_avg, exp_avg_sq, t, grad_scale=grad_scale, **extra)

