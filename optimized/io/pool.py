"""The handle's bounce pool: ``queue_depth`` buffers of ``block_size`` bytes in ONE pinned allocation.

One allocation because pinning (locking and device registration) costs per call, and because a handle never
has more than ``queue_depth`` file calls in flight, so it never needs more buffers than that: ``acquire`` can
therefore never wait. The allocation comes from :mod:`optimized.pinning`'s native backend (page-aligned, so
every buffer is ``O_DIRECT``-aligned) and is allocated on the first bounced request, so a handle that only ever
sees pinned tensors pins nothing. If the lock limit refuses it, the pool falls back to page-aligned pageable
memory (correct, slower; ``pool_pinned`` is False in the stats).
"""

from __future__ import annotations

import threading

import torch

from optimized.pinning import native_backend
from reference.contract import envvars
from reference.contract.accelerators import get_accelerator
from reference.contract.errors import PinnedMemoryLockError
from reference.contract.io_config import DIRECT_ALIGNMENT


class BouncePool:
    def __init__(self, count: int, size: int) -> None:
        self._count = count
        self._size = size
        self._lock = threading.Lock()
        self._flat: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        self.pinned = False

    def _allocate_locked(self) -> None:
        total = self._count * self._size
        try:
            flat = native_backend.allocate(total, get_accelerator(), envvars.pin_register_device())
            self.pinned = True
        except PinnedMemoryLockError:
            raw = torch.empty(total + DIRECT_ALIGNMENT, dtype=torch.uint8)
            skip = -raw.data_ptr() % DIRECT_ALIGNMENT
            flat = raw[skip : skip + total]
            self.pinned = False
        self._flat = flat
        self._buffers = [flat[i * self._size : (i + 1) * self._size] for i in range(self._count)]
        self._free = list(range(self._count - 1, -1, -1))

    def acquire(self) -> tuple[int, torch.Tensor]:
        """A free buffer (index, tensor). The caller's queue-depth bound guarantees one is free."""
        with self._lock:
            if self._flat is None:
                self._allocate_locked()
            if not self._free:  # pragma: no cover - would be a scheduler bug
                raise RuntimeError("bounce pool exhausted: more file calls in flight than queue_depth")
            i = self._free.pop()
            return i, self._buffers[i]

    def release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    @property
    def in_use(self) -> int:
        with self._lock:
            return 0 if self._flat is None else self._count - len(self._free)

    def close(self) -> None:
        """Unpin now and drop every reference (the memory is freed with them). Buffers must all be back."""
        with self._lock:
            flat, self._flat = self._flat, None
            self._buffers, self._free = [], []
        if flat is not None and self.pinned:
            native_backend.unpin_extent(flat.data_ptr(), flat.numel())
        self.pinned = False
        del flat
