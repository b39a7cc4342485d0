"""The pure parts of hostoffload's narrow first backward (issue 50, item 3), on host tensors.

On a CUDA device, the first backward of an accumulation that more backwards will follow sends its reduced
gradient to the pinned host accumulator at the comm dtype's width, packed into the first bytes of each bucket's own
range (`optimized.accumulation.update_paths.gradient_stream.packed_view`); a boundary nobody foresaw widens the
packed values on the host (`widen_packed`, R10's ``0 + red``). The engine tests run that path only on the GPU box
(conformance/suite/test_accumulation_engine_*, cuda accelerator); the byte layout and the widening are plain tensor
arithmetic, so they are held here on the CPU, where CI runs. This checks hostoffload's own code, not an
implementation under judgment: the suite's engine tests judge the whole path through the engine's contract.
"""

from __future__ import annotations

import pytest
import torch

from optimized.accumulation.update_paths.gradient_stream import packed_view, widen_packed

pytestmark = pytest.mark.conformance_area("harness")

NARROW = (torch.bfloat16, torch.float16)
# (lo, hi) inside a 16-element accumulator: a bucket at the start, one in the middle of odd length, one at the
# end, a one-element bucket and an empty one
RANGES = ((0, 5), (5, 12), (12, 16), (7, 8), (9, 9))


def _accumulator(n: int = 16) -> torch.Tensor:
    """fp32 with a distinct bit pattern everywhere, so any byte written outside the expected place shows."""
    return torch.arange(1, n + 1, dtype=torch.float32) * 1.25


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("narrow", NARROW, ids=str)
@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_packed_view_is_the_first_bytes_of_the_range(narrow, lo, hi):
    """The packed values are ``hi - lo`` elements of the comm dtype in the first ``(hi - lo) * 2`` bytes of
    ``accumulator[lo:hi]``: the same memory (a copy into it is the D2H itself), and writing them changes no byte
    outside that prefix (the other buckets' ranges, and the second half of the bucket's own)."""
    acc = _accumulator()
    before = acc.clone()
    view = packed_view(acc, lo, hi, narrow)
    assert view.dtype == narrow and view.shape == (hi - lo,)
    if hi == lo:
        return
    assert view.data_ptr() == acc[lo:hi].data_ptr(), "the packed values are not at the start of the range"
    values = torch.linspace(-3, 3, hi - lo).to(narrow)
    view.copy_(values)
    raw, old = acc.view(torch.uint8), before.view(torch.uint8)
    start, end = lo * 4, lo * 4 + (hi - lo) * narrow.itemsize
    assert torch.equal(raw[:start], old[:start]) and torch.equal(raw[end:], old[end:]), "bytes outside the prefix"
    assert torch.equal(_bits(raw[start:end].view(narrow)), _bits(values)), "the prefix does not hold the values"
    assert torch.equal(_bits(packed_view(acc, lo, hi, narrow)), _bits(values)), "a second view reads otherwise"


@pytest.mark.parametrize("narrow", NARROW, ids=str)
@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_widen_packed_is_zero_plus_the_packed_values(narrow, lo, hi):
    """After widening, ``accumulator[lo:hi]`` is R10's running sum after one backward, ``0 + red`` in fp32,
    bitwise (so ``-0.0`` becomes ``+0.0``, as on the path that never packs), for values the narrow dtype holds
    at its edges (the largest finite, the smallest subnormal, infinities, NaN); the rest of the accumulator is
    untouched."""
    info = torch.finfo(narrow)
    special = [-0.0, 0.0, info.max, -info.max, info.smallest_normal / 4, float("inf"), float("-inf"), 1.0, -2.5]
    red = torch.tensor((special * 2)[: hi - lo], dtype=torch.float32).to(narrow)
    acc = _accumulator()
    before = acc.clone()
    packed_view(acc, lo, hi, narrow).copy_(red)
    widen_packed(acc, lo, hi, narrow)
    expected = torch.zeros(hi - lo, dtype=torch.float32).add_(red.to(torch.float32))
    assert torch.equal(_bits(acc[lo:hi]), _bits(expected)), (acc[lo:hi], expected)
    assert torch.equal(_bits(acc[:lo]), _bits(before[:lo])) and torch.equal(_bits(acc[hi:]), _bits(before[hi:]))


def test_widen_packed_keeps_nan():
    """A NaN in the packed gradient stays a NaN in the widened one (the engine's overflow check reads it)."""
    acc = _accumulator()
    packed_view(acc, 2, 6, torch.bfloat16).copy_(torch.tensor([1.0, float("nan"), -1.0, 0.5]))
    widen_packed(acc, 2, 6, torch.bfloat16)
    assert torch.isnan(acc[3]) and acc[2] == 1.0 and acc[4] == -1.0 and acc[5] == 0.5
