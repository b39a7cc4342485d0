"""Offload contract: how a saved tensor is moved -- the storage span it covers, copied as one flat run.

Both implementations follow this rule (a restored tensor has the original size and strides, docs/offload.md
"Semantics that are part of the contract"), so it lives in the contract rather than in either engine.

Copying a tensor with ``.contiguous()`` or ``.to()`` would lose its strides, and autograd formulas may rely
on them. Copying the storage span the view actually reads (from its lowest to its highest element) and
rebuilding the same ``(size, stride)`` view over the copy preserves every stride, works for views with a
storage offset, for transposed/strided tensors and for stride-0 (expanded) tensors, where the span is
*smaller* than the logical size. The only cost is that a view with gaps moves its gaps too; such a view
usually shares storage with a live tensor anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StorageSpan:
    """Everything needed to rebuild a view: its geometry relative to the first element of its span."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    span_start: int  # storage offset (in elements) of the span's first element in the original storage
    span_numel: int  # number of elements from the lowest to the highest element the view reads
    offset_in_span: int  # the view's storage offset relative to span_start

    @property
    def nbytes(self) -> int:
        return self.span_numel * self.dtype.itemsize


def span_of(t: torch.Tensor) -> StorageSpan:
    """The span of a strided tensor with at least one element (torch strides are never negative)."""
    size = tuple(t.shape)
    stride = tuple(t.stride())
    start = int(t.storage_offset())  # a plain int: the tensors here are concrete, never traced
    last = start + sum((n - 1) * s for n, s in zip(size, stride, strict=False) if n > 0)
    return StorageSpan(
        size=size,
        stride=stride,
        dtype=t.dtype,
        device=t.device,
        span_start=start,
        span_numel=last - start + 1,
        offset_in_span=0,
    )


def flat_source(t: torch.Tensor, span: StorageSpan) -> torch.Tensor:
    """A 1-D view of exactly the span's elements in ``t``'s storage (no copy)."""
    return t.detach().as_strided((span.span_numel,), (1,), span.span_start)


def rebuild(flat: torch.Tensor, span: StorageSpan) -> torch.Tensor:
    """The original view's geometry over a flat copy of its span."""
    return flat.as_strided(span.size, span.stride, flat.storage_offset() + span.offset_in_span)
