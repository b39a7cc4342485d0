"""The precision the Adam moments are stored in between boundaries (docs/accumulation.md R29), defined once.

``state_precision: "fp32"`` (the default) keeps ``exp_avg`` and ``exp_avg_sq`` in fp32, as R16 has always done.
``"bf16"`` stores both moments in bfloat16 -- half the bytes the host AdamW streams for them -- while the fp32
master stays fp32. A step is then:

1. widen the stored moments to fp32 (exact: every bf16 value is an fp32 value);
2. run R16's fp32 sequence unchanged, the new weights computed from the *unrounded* new moments;
3. store the new moments rounded to bf16 by :func:`round_to_bf16`.

The rounding is round-to-nearest-even on the fp32 bit pattern (:func:`round_to_bf16`), chosen over stochastic
rounding because it is deterministic: the result is a pure function of the inputs, so every implementation, ISA
and thread count agrees bitwise, a run is reproducible without carrying a generator's state in checkpoints, and
the property the suite checks stays "equal", not "equal in distribution". Every finite value and infinity rounds
exactly as ``tensor.to(torch.bfloat16)`` rounds it (values beyond bf16's largest finite round to infinity); a NaN
becomes the one quiet NaN ``0x7FC0`` (sign dropped), because torch's own NaN payload differs between versions and
kernels and a bitwise contract needs one answer.

Why ``exp_avg_sq`` is stored as bf16 of ``v`` and not of ``sqrt(v)``: bf16 keeps fp32's exponent range, so ``v``
loses no range (below 2^-126 it becomes subnormal with fewer bits, but there ``sqrt(v) / sqrt(1 - beta2^t)`` is
some 10^-17 and the ``eps`` of R16 decides the denominator alone); the relative error of one rounding is at most
2^-9 of the stored value, which the square root halves, so storing ``v`` puts at most 2^-10 into the denominator
against 2^-9 for storing ``sqrt(v)``; and ``sqrt(v)`` moves half as much per step as ``v``, so it would stall
under rounding (see docs/accumulation.md R29) at twice the rate of change. It would also cost a square and a
square root per element more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.contract.errors import ConfigurationError, allowed_values_error

__all__ = [
    "BF16_QUIET_NAN",
    "DEFAULT_STATE_PRECISION",
    "STATE_PRECISIONS",
    "StatePrecision",
    "resolve_state_precision",
    "round_to_bf16",
]

#: The bf16 bit pattern every NaN is stored as (sign clear, quiet bit set, zero payload).
BF16_QUIET_NAN = 0x7FC0


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, any shape and device) rounded to bf16, to nearest with ties to even; NaN -> ``0x7FC0``.

    The definition the native kernels implement word for word: add ``0x7FFF`` plus the lowest bit that is kept
    (bit 16) to the fp32 bit pattern and keep the upper 16 bits. A carry out of the mantissa raises the exponent,
    which is what rounding up to the next binade (or to infinity) means. Subnormals round like every other value
    (their bit pattern is linear in the value), so no flush to zero happens here.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16 needs fp32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    rounded = torch.where(torch.isnan(x), torch.full_like(rounded, BF16_QUIET_NAN), rounded)
    signed = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    return signed.view(torch.bfloat16)


@dataclass(frozen=True)
class StatePrecision:
    """One stored precision of the Adam moments: its config name, its dtype and how an fp32 value is stored."""

    name: str
    dtype: torch.dtype

    @property
    def bytes_per_moment(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def zeros(self, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(numel, dtype=self.dtype, device=device)

    def store(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """``dst`` (a moment buffer of this precision) := fp32 ``value`` rounded as R29 says."""
        if self.dtype == torch.float32:
            dst.copy_(value)
        else:
            dst.copy_(round_to_bf16(value.to(torch.float32)))

    @staticmethod
    def of(buffer: torch.Tensor, name: str = "optimizer state buffer") -> StatePrecision:
        """The precision a moment buffer is stored in (its dtype says; anything else is refused, naming the buffer
        as ``name``: a kernel passes its argument's name)."""
        for p in STATE_PRECISIONS.values():
            if p.dtype == buffer.dtype:
                return p
        raise ConfigurationError(
            f"{name} of dtype {buffer.dtype} is not a state precision; allowed dtypes: "
            f"{', '.join(str(p.dtype) for p in STATE_PRECISIONS.values())}"
        )


#: The precisions ``state_precision`` may name.
STATE_PRECISIONS: dict[str, StatePrecision] = {
    "fp32": StatePrecision("fp32", torch.float32),
    "bf16": StatePrecision("bf16", torch.bfloat16),
}
DEFAULT_STATE_PRECISION = "fp32"


def resolve_state_precision(name: object, key: str = "state_precision") -> StatePrecision:
    """The precision ``name`` names (case-insensitive), or a ConfigurationError naming ``key`` and the allowed
    values."""
    if isinstance(name, str) and name.lower() in STATE_PRECISIONS:
        return STATE_PRECISIONS[name.lower()]
    raise allowed_values_error(key, name, tuple(STATE_PRECISIONS))


def state_dtype(optimizer_type: str, precision: StatePrecision | None) -> torch.dtype:
    """The dtype of every optimizer-state buffer (the one home of this rule): Adam's moments at their stored
    precision (R29; fp32 when none is given), SGD's momentum always fp32 (R29 covers Adam's moments only)."""
    return torch.float32 if precision is None or optimizer_type == "sgd" else precision.dtype


def adam_pass_bytes_per_element(precision: StatePrecision, *, bf16_copy: bool, grad_bytes: int = 4,
                                backup: bool = False) -> int:
    """Bytes one Adam/AdamW step moves per element in one pass (the floor of the host update, docs/zero.md): the
    fp32 master read and written (8), the gradient read (``grad_bytes``: 4 for an fp32 sum, 2 for a bf16 one the
    kernel widens as it reads), each moment read and written at its stored size (fp32: 16, bf16: 8), with
    ``bf16_copy`` the bf16 weights written (2) and with ``backup`` (R30's speculation) the master and the moments
    written once more, to their copies before the step (4 + 2 x the moment's size). 30 with fp32 moments and
    gradient, 22 with bf16 moments (write-allocate reads of the write-only outputs not counted)."""
    moments = 2 * precision.bytes_per_moment
    return 8 + grad_bytes + 2 * moments + (2 if bf16_copy else 0) + ((4 + moments) if backup else 0)
