"""Hypothesis strategies for the swap I/O suite: handle knobs, record offsets, and tensors in every kind of
memory a swap handle is handed (pageable, strided, native pinned, views and narrows of pinned buffers at aligned
and unaligned addresses, device tensors where the accelerator has a device).

Tensors are built by :func:`swap_tensors` from a drawn :class:`TensorSpec`, so a failing example prints the spec
(dtype, shape, memory kind, lead elements) rather than a tensor dump.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from conformance.areas.strategies import DTYPES, filled

#: Memory kinds for tensors written from. ``*-strided`` kinds are transposed views (non-contiguous).
SOURCE_KINDS = (
    "pageable",
    "pageable-strided",
    "pageable-expanded",
    "pinned",
    "pinned-narrow",
    "pinned-aligned-view",
    "pinned-strided",
)
#: Memory kinds for tensors read into (an expanded tensor cannot be written into element by element).
DEST_KINDS = tuple(k for k in SOURCE_KINDS if k != "pageable-expanded")

_ALIGN = 4096


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str
    lead: int  # elements before the view in its pinned base (narrow kinds)
    seed: int

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@st.composite
def record_shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Mostly small multi-dimensional shapes, sometimes a 1-D run of several 4 KiB blocks (O_DIRECT heads and
    tails, several blocks per request), sometimes no elements at all."""
    choice = draw(st.integers(0, 9))
    if choice < 6:
        return tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
    if choice < 9:
        return (draw(st.integers(1000, 9000)),)
    return tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(lambda s: 0 in s)))


def tensor_specs(kinds: tuple[str, ...] = SOURCE_KINDS, dtype=None, shape=None) -> st.SearchStrategy[TensorSpec]:
    return st.builds(
        TensorSpec,
        dtype=st.sampled_from(DTYPES) if dtype is None else st.just(dtype),
        shape=record_shapes() if shape is None else st.just(shape),
        kind=st.sampled_from(kinds),
        lead=st.integers(1, 40),
        seed=st.integers(0, 2**16),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def swap_tensors(spec: TensorSpec, pin_empty: Callable[..., torch.Tensor], device: torch.device | None = None,
                 *, fill: bool = True) -> torch.Tensor:
    """Build the tensor a spec describes; values are deterministic in ``seed`` (zeros when ``fill`` is False).

    ``pin_empty`` is the implementation's pinning function (with the native backend selected), so "pinned"
    means pinned in that implementation's registry. A ``device`` turns the spec into a device tensor.
    """
    values = filled(spec.shape, spec.dtype, spec.seed) if fill else torch.zeros(spec.shape, dtype=spec.dtype)
    if device is not None and device.type != "cpu":
        return values.to(device)
    kind = spec.kind
    numel = _numel(spec.shape)
    if kind == "pageable":
        return values.clone()
    if kind == "pageable-strided":
        if values.dim() >= 2:
            return values.transpose(0, -1).contiguous().transpose(0, -1)
        return torch.stack([values, torch.zeros_like(values)], dim=-1)[..., 0]  # every other element
    if kind == "pageable-expanded":
        if values.dim() == 0 or spec.shape[0] == 0:
            return values
        return values[:1].expand(spec.shape)
    itemsize = values.element_size()
    if kind == "pinned":
        out = pin_empty(spec.shape, dtype=spec.dtype)
        out.copy_(values)
        return out
    if kind in ("pinned-narrow", "pinned-aligned-view"):
        lead = spec.lead if kind == "pinned-narrow" else _ALIGN // itemsize
        base = pin_empty((lead + numel + spec.lead,), dtype=spec.dtype)
        out = base[lead : lead + numel].view(spec.shape)
        out.copy_(values)
        return out
    if kind == "pinned-strided":
        if values.dim() < 2:
            base = pin_empty((2 * max(numel, 1),), dtype=spec.dtype)
            out = base[: 2 * numel : 2].view(spec.shape) if numel else base[:0].view(spec.shape)
        else:
            base = pin_empty(tuple(reversed(spec.shape)), dtype=spec.dtype)
            out = base.permute(*reversed(range(values.dim())))
        out.copy_(values)
        return out
    raise ValueError(f"unknown tensor kind {kind!r}")


@st.composite
def handle_configs(draw: st.DrawFn) -> dict[str, object]:
    """Small handle knobs (small bounce pools: CI machines lock little memory), every combination reachable."""
    return {
        "queue_depth": draw(st.integers(1, 4)),
        "block_size": draw(st.sampled_from((4096, 8192, 16384))),
        "num_threads": draw(st.integers(1, 3)),
        "use_o_direct": draw(st.booleans()),
    }


def offsets() -> st.SearchStrategy[int]:
    """Record offsets: 0, 4 KiB-aligned ones (O_DIRECT eligible), and arbitrary ones (buffered only)."""
    return st.one_of(st.just(0), st.integers(1, 6).map(lambda k: k * _ALIGN), st.integers(1, 20000))


#: Bad values for each knob, for the configuration-error tests.
BAD_KNOBS: dict[str, tuple[object, ...]] = {
    "queue_depth": (0, -1, 1025, 2.0, "8", True, None),
    "block_size": (0, 4095, 6000, 1 << 29, 4096.0, "1MiB", True, None),
    "num_threads": (0, 65, -3, 1.5, "4", False, None),
    "use_o_direct": (1, 0, "yes", None, "true"),
}
