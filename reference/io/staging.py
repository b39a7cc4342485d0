"""How the reference handle moves a request's bytes: flat byte views, staging copies and file-call blocks.

These are the oracle's own means, not shared rules: what counts as direct, which arguments are refused and the
record format are the contract (:mod:`reference.contract.io_transfer`, :mod:`reference.contract.io_record`);
how the bytes get there is each implementation's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Staging", "blocks", "byte_view", "flat_bytes"]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (same memory, same device).

    ``as_strided`` rather than ``reshape``: torch calls a tensor with size-1 dimensions contiguous whatever their
    strides, and ``reshape`` keeps such a stride, which ``view(uint8)`` then rejects.
    """
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes, without copying.

    Through numpy's uint8 view of the tensor's bytes (numpy has no bfloat16, uint8 always works), which also keeps
    the tensor's storage alive for as long as the view exists.
    """
    return flat_bytes(t.detach()).numpy().data  # ndarray.data: the memoryview of its buffer


@dataclass
class Staging:
    """The contiguous tensor a request really moves, and how to finish.

    ``source``: ``tensor`` itself when it is contiguous, else a contiguous temporary (one full-size copy: a
    strided tensor's bytes are not one run). For a read into a strided tensor the temporary is copied back into
    ``tensor`` when the payload has arrived (``finish``).
    """

    tensor: torch.Tensor
    source: torch.Tensor

    @classmethod
    def for_write(cls, t: torch.Tensor) -> Staging:
        return cls(t, t if t.is_contiguous() else t.contiguous())

    @classmethod
    def for_read(cls, t: torch.Tensor) -> Staging:
        return cls(t, t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device))

    def finish_read(self) -> None:
        if self.source is not self.tensor:
            self.tensor.copy_(self.source)


def blocks(nbytes: int, block_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of at most ``block_size`` covering ``nbytes``."""
    return [(a, min(a + block_size, nbytes)) for a in range(0, nbytes, block_size)]
