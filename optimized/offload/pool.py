"""Pinned host pool for offloaded activations, reused across steps.

Training repeats the same activation shapes every step, so after the first step every request finds a free
block of the right size and no pinned allocation happens any more (page-locking is slow and serialises with
device work). Blocks are bucketed by size rounded up to :data:`GRANULE`; a request may also take a free
block up to twice its size so that slightly varying shapes do not grow the pool.

Reuse is stream-safe without host synchronisation: a block handed back carries the events of the copies that
last read it, and the next user makes its copy stream wait on them before writing.

Where the memory comes from is behind :class:`HostBlockSource`. On an accelerator that registers host memory
(CUDA) blocks are carved out of native pinned slabs (:class:`SlabSource`); elsewhere they come from the pinning
API (:class:`PinEmptySource`).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

#: Rounding of block sizes; also keeps every block start aligned for any dtype view.
GRANULE = 64 * 1024
#: A free block is reused for a request if it is at most this many times the rounded request size.
MAX_OVERSIZE = 2


class HostBlockSource(Protocol):
    """Where pool blocks come from: ``allocate`` returns a 1-D uint8 host tensor of ``nbytes`` bytes."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def free(self, block: torch.Tensor) -> None: ...


class PinEmptySource:
    """Blocks from the project pinning API (``HOSTOFFLOAD_PIN_BACKEND`` decides which backend); freeing drops
    the last reference and the backend reclaims the memory."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        from optimized import pin_empty

        return pin_empty(nbytes, dtype=torch.uint8)

    def free(self, block: torch.Tensor) -> None:
        del block


class SlabSource:
    """Blocks carved out of native pinned slabs (:class:`optimized.slab.PinnedSlab`).

    Pinning and device registration are paid once per slab instead of once per block, and every block is
    recognised by ``is_pinned`` through the slab's single registered range. Slabs are chained: a request that
    fits no open slab opens a new one of ``max(slab_bytes, request)``, and a slab whose last block is freed is
    closed (unpinned) at once, so the pool's cap bounds pinned memory too.
    """

    def __init__(self, slab_bytes: int = 256 << 20) -> None:
        self._slab_bytes = slab_bytes
        self._slabs: list[Any] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        from optimized.slab import PinnedSlab

        for slab in self._slabs:
            try:
                return slab.allocate(nbytes, dtype=torch.uint8, alignment=GRANULE)
            except MemoryError:
                continue
        slab = PinnedSlab(max(self._slab_bytes, nbytes))
        self._slabs.append(slab)
        return slab.allocate(nbytes, dtype=torch.uint8, alignment=GRANULE)

    def free(self, block: torch.Tensor) -> None:
        for slab in self._slabs:
            if slab.owns(block):
                slab.free(block)
                if slab.stats().pieces == 0:
                    slab.close()
                    self._slabs.remove(slab)
                return
        raise ValueError("block was not allocated by this SlabSource")


def default_source() -> HostBlockSource:
    """The native slab where the accelerator can use registered host memory (that is where pinning pays),
    otherwise the pinning API (on a CPU-only machine it does not lock memory, so no RLIMIT_MEMLOCK applies)."""
    from reference.contract.accelerators import get_accelerator

    if get_accelerator().supports_host_registration:
        return SlabSource()
    return PinEmptySource()


#: Factory of the backing store every new pool uses.
DEFAULT_SOURCE = default_source


@dataclass(eq=False)
class PoolBlock:
    """A block of pool memory; ``wait_events`` must complete before the next write into it."""

    tensor: torch.Tensor
    nbytes: int
    wait_events: list[Any] = field(default_factory=list)


def _round_up(nbytes: int) -> int:
    return max(GRANULE, -(-nbytes // GRANULE) * GRANULE)


class PinnedPool:
    """Size-bucketed free lists over a :class:`HostBlockSource`, capped at ``cap_bytes`` reserved (None: no
    cap)."""

    def __init__(self, cap_bytes: int | None = None, source: HostBlockSource | None = None) -> None:
        self._cap = cap_bytes
        self._source = source if source is not None else DEFAULT_SOURCE()
        self._lock = threading.Lock()
        self._free: dict[int, list[PoolBlock]] = {}
        self._free_sizes: list[int] = []  # sorted keys of _free with a non-empty list
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int) -> PoolBlock | None:
        """A block of at least ``nbytes``, or None if the cap does not allow one."""
        size = _round_up(nbytes)
        with self._lock:
            block = self._take_free(size)
            if block is None:
                if self._cap is not None and self.reserved_bytes + size > self._cap:
                    self._evict_until(self._cap - size)
                    if self.reserved_bytes + size > self._cap:
                        return None
                block = PoolBlock(self._source.allocate(size), size)
                self.reserved_bytes += size
                self.allocations += 1
            self.in_use_bytes += block.nbytes
            return block

    def release(self, block: PoolBlock, wait_events: list[Any]) -> None:
        """Hand ``block`` back; its next writer waits for ``wait_events`` (the last reads of its
        contents)."""
        with self._lock:
            block.wait_events = list(wait_events)
            self.in_use_bytes -= block.nbytes
            bucket = self._free.setdefault(block.nbytes, [])
            if not bucket:
                bisect.insort(self._free_sizes, block.nbytes)
            bucket.append(block)

    def trim(self) -> None:
        """Free every cached block (blocks in use are unaffected)."""
        with self._lock:
            self._evict_until(0)

    # -- internals (lock held)
    # ------------------------------------------------------------------------------------
    def _take_free(self, size: int) -> PoolBlock | None:
        i = bisect.bisect_left(self._free_sizes, size)
        if i == len(self._free_sizes) or self._free_sizes[i] > size * MAX_OVERSIZE:
            return None
        key = self._free_sizes[i]
        bucket = self._free[key]
        block = bucket.pop()
        if not bucket:
            self._free_sizes.pop(i)
        return block

    def _evict_until(self, target_reserved: int) -> None:
        # Largest blocks first: fewest frees to make room.
        while self.reserved_bytes > target_reserved and self._free_sizes:
            key = self._free_sizes[-1]
            bucket = self._free[key]
            block = bucket.pop()
            if not bucket:
                self._free_sizes.pop()
            for event in block.wait_events:
                event.synchronize()  # an in-flight read may still use the pages being freed
            self._source.free(block.tensor)
            self.reserved_bytes -= block.nbytes
