"""How a declared Adam kernel's result is compared with the reference: bitwise, or within its declared tolerance.

A kernel (reference/contract/optimizer_kernels.py) claims either the reference's arithmetic -- then every value it
writes equals the reference's bit for bit -- or a :class:`~reference.contract.optimizer_kernels.Tolerance`.

R29's stored moments need a rule of their own for a tolerance kernel: a bf16 moment is the *rounding* of an fp32
value, and a difference within the tolerance before rounding may cross a rounding boundary and become one whole
bf16 ulp after it (2^-8 relative, far above any tolerance the contract allows). So a stored moment is accepted
when it is what R29's rounding gives for *some* fp32 value within the tolerance of the reference's unrounded
moment: rounding is monotonic, so that set is every bf16 value from the rounding of the interval's lower end to
the rounding of its upper end. A kernel that rounds another way (truncation, a different tie rule) lands
outside that interval wherever the unrounded value is not within the tolerance of a rounding boundary.

Used by conformance/suite/test_optimizer_kernels.py; the harness self-tests check the comparison itself.
"""

from __future__ import annotations

import torch

from conformance.areas.accumulation_assertions import assert_bits_equal, assert_tensor_equal
from reference.contract.accumulation_state_precision import round_to_bf16
from reference.contract.optimizer_kernels import AdamKernel, Tolerance

__all__ = ["assert_claim", "assert_stored_moment_claim"]


def _excess(tol: Tolerance, a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return (a.double() - e.double()).abs() - (tol.atol + tol.rtol * e.double().abs())


def _fail(what: str, bad: torch.Tensor, total: int, detail: str) -> None:
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {total} elements {detail}; first at index {i}")


def assert_claim(kernel: AdamKernel, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """An fp32 result (master, R16's moments): bitwise for the reference's arithmetic, else within the kernel's
    declared tolerance (NaN exactly where the reference has NaN)."""
    if kernel.bitwise:
        assert_tensor_equal(actual, expected, what)
        return
    tol = kernel.arithmetic
    assert isinstance(tol, Tolerance)  # not bitwise: the kernel declared a tolerance
    a, e = actual.detach().cpu(), expected.detach().cpu()
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} != {e.shape}/{e.dtype}"
    nan = torch.isnan(e)
    assert torch.equal(torch.isnan(a), nan), f"{what}: NaN where the reference has none, or the reverse"
    excess = _excess(tol, a, e)
    excess[nan] = 0.0
    excess[torch.isinf(e) & (a == e)] = 0.0  # inf - inf is NaN, and an infinity the reference has is matched
    bad = (excess > 0) | torch.isnan(excess)
    if bool(bad.any()):
        i = int(torch.where(bad, excess.nan_to_num(float("inf")), -1.0).argmax())
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements differ by more than the declared "
                             f"{tol.describe()}; worst at index {i}: {float(a[i])!r} vs {float(e[i])!r}")


def assert_stored_moment_claim(kernel: AdamKernel, stored: torch.Tensor, expected_stored: torch.Tensor,
                               unrounded: torch.Tensor, what: str) -> None:
    """R29: a bf16 moment the kernel stored. Bitwise kernels: the bit pattern of the reference's stored moment
    (``expected_stored``; NaN as 0x7FC0). Tolerance kernels: the rounding of some fp32 value within the tolerance
    of the reference's ``unrounded`` fp32 moment (module docstring), NaN exactly where the reference has NaN and
    an infinity where the reference's moment is infinite."""
    if stored.dtype != torch.bfloat16:
        raise AssertionError(f"{what}: the stored moment is {stored.dtype}, the kernel was given bfloat16")
    if kernel.bitwise:
        assert_bits_equal(stored, expected_stored, what)
        return
    tol = kernel.arithmetic
    assert isinstance(tol, Tolerance)  # not bitwise: the kernel declared a tolerance
    s, u = stored.detach().cpu().float(), unrounded.detach().cpu().float()
    nan, inf = torch.isnan(u), torch.isinf(u)
    _fail(what, torch.isnan(s) != nan, s.numel(), "are NaN where the reference's moment is not, or the reverse")
    _fail(what, inf & (s != u), s.numel(), "are not the reference's infinity")
    slack = (tol.atol + tol.rtol * u.double().abs()).float()
    # The interval's ends, widened outward by one fp32 step so that the fp32 arithmetic here never narrows it.
    lo = torch.nextafter(u - slack, torch.tensor(-float("inf")))
    hi = torch.nextafter(u + slack, torch.tensor(float("inf")))
    finite = ~(nan | inf)
    outside = finite & ((s < round_to_bf16(lo).float()) | (s > round_to_bf16(hi).float()))
    _fail(what, outside, s.numel(), f"are not R29's rounding of a value {tol.describe()} of the reference's "
          "unrounded moment")
