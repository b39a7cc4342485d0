"""Assertion helpers whose failure messages say exactly what differed.

A conformance failure is read by someone porting hostoffload to new hardware, often from a CI log: "tensors differ"
is useless to them, "element (3, 1) is 0x3f800000 here and 0x00000000 in the reference" is a bug report.
"""

from __future__ import annotations

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of the raw bits, so that NaN payloads and signed zeros compare exactly."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.contiguous().view(int_dtype)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Same shape, dtype and bit pattern in every element (NaN == NaN with the same payload)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = _bits(actual.detach().cpu()), _bits(expected.detach().cpu())
    diff = (a != e).nonzero()
    if diff.numel():
        first = tuple(int(i) for i in diff[0])
        idx = first[: actual.dim()]
        raise AssertionError(
            f"{what}: {diff.shape[0]} of {a.numel()} elements differ bitwise; first at index {idx}: "
            f"{actual.detach().cpu()[idx].item()!r} (bits {int(a[first]):#x}) != expected "
            f"{expected.detach().cpu()[idx].item()!r} (bits {int(e[first]):#x})"
        )


def assert_same_layout(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Same shape and strides (storage offset is allowed to differ)."""
    if actual.shape != expected.shape or actual.stride() != expected.stride():
        raise AssertionError(
            f"{what}: layout shape={tuple(actual.shape)} stride={actual.stride()} != expected "
            f"shape={tuple(expected.shape)} stride={expected.stride()}"
        )


def assert_pinned(api: object, t: torch.Tensor, expected: bool, what: str = "tensor") -> None:
    got = api.is_pinned(t)  # type: ignore[attr-defined]
    if got is not expected:
        raise AssertionError(
            f"{what}: is_pinned returned {got!r}, expected {expected!r} (data_ptr={t.data_ptr():#x}, "
            f"shape={tuple(t.shape)}, stride={t.stride()}, offset={t.storage_offset()}, dtype={t.dtype})"
        )


def vm_locked_kib() -> int:
    """VmLck of this process in KiB (page-locked memory), from /proc/self/status."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def assert_names_argument(exc: BaseException, name: str, *allowed: str, qualified: bool = False) -> None:
    """The error message names the argument (or environment variable, or config key) ``name`` as a whole word,
    and each of ``allowed`` (the values the specification lists) as a whole word too. The wording around them is
    the implementation's own: the suite checks the error class and what the message names, never its exact text.

    A name preceded by a dot is not a mention (``torch.device`` does not name the argument ``device``), unless
    ``qualified``: a config key may be named by its full key path (``zero_optimization.contiguous_gradients``).
    """
    import re

    message = str(exc)
    before = r"(?<![\w])" if qualified else r"(?<![\w.])"
    assert re.search(rf"{before}{re.escape(name)}(?![\w])", message), (
        f"{type(exc).__name__} does not name the argument {name!r}: {message!r}"
    )
    missing = [a for a in allowed if not re.search(rf"(?<![\w]){re.escape(a)}(?![\w])", message)]
    assert not missing, f"{type(exc).__name__} for {name!r} does not list the allowed values {missing}: {message!r}"
