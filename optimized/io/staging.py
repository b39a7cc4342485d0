"""How the optimized handle reaches a request's bytes: the contiguous source it moves, and byte views of it.

The handle's own means (the reference handle has its own, :mod:`reference.io.staging`): what the contract fixes
is which requests go direct and what lands in the file (:mod:`reference.contract.io_transfer`,
:mod:`reference.contract.io_record`), not how the bytes are reached.
"""

from __future__ import annotations

import torch

__all__ = ["Staging", "byte_view", "flat_bytes"]


class Staging:
    """A request's tensor and the contiguous tensor whose bytes the file calls move.

    A contiguous tensor is its own source. A strided one is gathered into a contiguous copy: for a write at
    submission (its values are those of that moment), for a read into a fresh buffer that :meth:`finish_read`
    scatters back once the payload is in.
    """

    __slots__ = ("source", "tensor")

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor) -> None:
        self.tensor = tensor
        self.source = source

    @classmethod
    def for_write(cls, t: torch.Tensor) -> Staging:
        return cls(t, t.contiguous())  # t itself when already contiguous

    @classmethod
    def for_read(cls, t: torch.Tensor) -> Staging:
        if t.is_contiguous():
            return cls(t, t)
        return cls(t, torch.empty(t.shape, dtype=t.dtype, device=t.device))

    def finish_read(self) -> None:
        if self.source is not self.tensor:
            self.tensor.copy_(self.source)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as one flat uint8 tensor over the same memory.

    Built with ``as_strided``: torch counts a tensor with size-1 dimensions as contiguous whatever their strides,
    and a reshape can carry such a stride into a view that ``view(torch.uint8)`` then refuses.
    """
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of contiguous CPU ``t``'s bytes, sharing its memory (numpy's view of the uint8 bytes
    keeps the storage alive as long as the memoryview lives; uint8 works for every dtype, bfloat16 included)."""
    return flat_bytes(t.detach()).numpy().data  # ndarray.data: the memoryview of its buffer
