"""The host memory one ZeroEngine owns: offloaded masters, optimizer state, accumulators, cast and parameter buffers.

Every such buffer is allocated here and remembered, so that the engine's ``destroy()`` (and a constructor that
fails half-way) gives all of it back, and ``pinned_buffers()`` can list it. Pinned buffers come from the
project's pinning API (``pin_empty``: no pageable temporary).
"""

from __future__ import annotations

import torch

from optimized.pinning import pin_empty, unpin

__all__ = ["HostBuffers"]


class HostBuffers:
    """Allocates one engine's host buffers and frees them together."""

    def __init__(self) -> None:
        self._pinned: list[torch.Tensor] = []

    def empty(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """An uninitialised 1-D host buffer, pinned when ``pinned`` (then owned until :meth:`release`)."""
        if not pinned:
            return torch.empty(numel, dtype=dtype)
        t = pin_empty(numel, dtype=dtype)
        self._pinned.append(t)
        return t

    @property
    def pinned(self) -> tuple[torch.Tensor, ...]:
        """The pinned buffers held now."""
        return tuple(self._pinned)

    def release(self) -> None:
        """Unpin every buffer allocated here (never raises on a buffer already gone)."""
        pinned, self._pinned = self._pinned, []
        for t in pinned:
            unpin(t)
