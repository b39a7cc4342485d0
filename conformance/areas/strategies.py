"""Hypothesis strategies shared by the pinning and range suites."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)

dtypes = st.sampled_from(DTYPES)
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple)


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A deterministic tensor whose values are distinguishable (not all zeros)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


@st.composite
def host_tensors(draw: st.DrawFn) -> torch.Tensor:
    """CPU tensors in every layout a caller hands in: contiguous, transposed, strided slices, offset views."""
    dtype = draw(dtypes)
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**16))
    layout = draw(st.sampled_from(("contiguous", "transposed", "sliced", "offset", "expanded")))
    if layout == "transposed" and len(shape) >= 2:
        return filled(shape, dtype, seed).transpose(0, -1)
    if layout == "sliced" and shape:
        big = filled(tuple(2 * s + 1 for s in shape), dtype, seed)
        return big[tuple(slice(1, None, 2) for _ in shape)]
    if layout == "offset" and shape:
        big = filled((shape[0] + 3, *shape[1:]), dtype, seed)
        return big[3:]
    if layout == "expanded" and shape:
        one = filled((1, *shape[1:]), dtype, seed)
        return one.expand(shape)  # stride 0 in the first dimension
    return filled(shape, dtype, seed)


@st.composite
def views_of(draw: st.DrawFn, base: torch.Tensor) -> torch.Tensor:
    """A view, slice or narrow of ``base`` (1-D or more), never leaving its storage."""
    flat = base.view(-1)
    n = flat.numel()
    kind = draw(st.sampled_from(("narrow", "slice", "step", "whole", "reshape")))
    if n == 0 or kind == "whole":
        return base.view(base.shape)
    if kind == "reshape":
        return flat.view(n, 1)
    start = draw(st.integers(0, n - 1))
    length = draw(st.integers(0, n - start))
    if kind == "narrow":
        return flat.narrow(0, start, length)
    if kind == "slice":
        return flat[start : start + length]
    step = draw(st.integers(1, 4))
    return flat[start::step]
