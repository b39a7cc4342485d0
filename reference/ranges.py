"""The process-wide registry of pinned host ranges, and the one rule for recognising them.

Pinned buffers are handed around as views, slices and narrows, and the code that later wants to know "can I DMA
from this directly?" (a copy engine, a swap handle, an offload pool) only sees the view. It cannot ask the view's
allocation, so every component asks this registry instead, with the view's byte extent.

The single rule, shared by every implementation: an extent ``[ptr, ptr + nbytes)`` is pinned iff it lies entirely
inside one registered range. An extent that straddles two adjacent ranges is *not* pinned (the two ranges may be
unregistered independently, so no single registration covers the copy). A zero-length extent is pinned iff its
address lies inside a range; a tensor with no elements has data pointer 0 in torch, so it is never pinned.

The reference keeps sorted range starts and bisects them (O(log n) lookups, O(n) inserts). It takes one lock for
every operation: obviously correct beats fast here; the optimized registry is where reads stop serialising.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref

import torch

from reference.contract.pinning_rules import PinnedRange, check_range_int

__all__ = ["PinnedRange", "RangeRegistry", "extent_is_registered", "global_registry", "tensor_extent"]


def _check_int(name: str, value: object, minimum: int) -> int:
    return check_range_int(name, value, minimum)


class RangeRegistry:
    """A set of non-overlapping byte ranges with whole-extent containment queries.

    ``add`` rejects a range that overlaps one already registered: overlapping registrations would make
    ``remove`` ambiguous and are always a bookkeeping bug in the caller.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._entries: dict[int, PinnedRange] = {}
        self._total = 0
        _instances.add(self)

    def add(self, start: int, nbytes: int, owner: int = 0) -> None:
        """Register ``[start, start + nbytes)``. Raises ``ValueError`` if it overlaps a registered range."""
        _check_int("start", start, 1)
        _check_int("nbytes", nbytes, 1)
        _check_int("owner", owner, 0)
        with self._lock:
            i = bisect.bisect_right(self._starts, start)
            if i > 0:
                prev = self._entries[self._starts[i - 1]]
                if prev.start + prev.nbytes > start:
                    raise ValueError(
                        f"range [{start:#x}, +{nbytes}) overlaps registered range [{prev.start:#x}, +{prev.nbytes})"
                    )
            if i < len(self._starts) and self._starts[i] < start + nbytes:
                nxt = self._entries[self._starts[i]]
                raise ValueError(
                    f"range [{start:#x}, +{nbytes}) overlaps registered range [{nxt.start:#x}, +{nxt.nbytes})"
                )
            self._starts.insert(i, start)
            self._entries[start] = PinnedRange(start, nbytes, owner)
            self._total += nbytes

    def remove(self, start: int) -> bool:
        """Drop the range that begins exactly at ``start``. Returns False if there is none."""
        with self._lock:
            entry = self._entries.pop(start, None)
            if entry is None:
                return False
            del self._starts[bisect.bisect_left(self._starts, start)]
            self._total -= entry.nbytes
            return True

    def find(self, ptr: int) -> PinnedRange | None:
        """The range containing address ``ptr``, or None."""
        with self._lock:
            return self._find_locked(ptr)

    def _find_locked(self, ptr: int) -> PinnedRange | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        entry = self._entries[self._starts[i]]
        return entry if ptr < entry.start + entry.nbytes else None

    def contains(self, ptr: int, nbytes: int) -> bool:
        """True iff ``[ptr, ptr + nbytes)`` lies inside one registered range (the module docstring's rule)."""
        if ptr <= 0 or nbytes < 0:
            return False
        with self._lock:
            entry = self._find_locked(ptr)
            return entry is not None and ptr + nbytes <= entry.start + entry.nbytes

    def ranges(self) -> list[PinnedRange]:
        """A sorted snapshot of every registered range."""
        with self._lock:
            return [self._entries[s] for s in self._starts]

    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    def __len__(self) -> int:
        with self._lock:
            return len(self._starts)

    def __contains__(self, extent: tuple[int, int]) -> bool:
        ptr, nbytes = extent
        return self.contains(ptr, nbytes)


# ---- fork() -----------------------------------------------------------------------------------------------------
# A thread of the parent may hold a registry's lock at the moment another thread forks; the child's copy of that
# lock would then stay locked forever. Every instance's lock is therefore held across the fork (taken just before,
# released just after, in the parent and the child alike), so the copy is never taken half-way through an update.
# What the ranges *mean* after a fork is the pinning area's business (reference.pinning.native_backend drops the
# inherited allocations' ranges in the child); a registry itself is plain data and keeps its ranges.
_instances: weakref.WeakSet[RangeRegistry] = weakref.WeakSet()
_held_across_fork: list[RangeRegistry] = []


def _before_fork() -> None:
    held = sorted(_instances, key=id)
    for registry in held:
        registry._lock.acquire()
    _held_across_fork[:] = held


def _after_fork() -> None:
    held, _held_across_fork[:] = list(_held_across_fork), []
    for registry in reversed(held):
        registry._lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)

_GLOBAL_REGISTRY = RangeRegistry()


def global_registry() -> RangeRegistry:
    """The process-wide registry that reference's native pinning backend registers into."""
    return _GLOBAL_REGISTRY


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte extent ``(ptr, nbytes)`` that a strided tensor can touch.

    It runs from the first element's address to one past the last byte of the element with the largest
    offset, so gaps between strided rows are included (a copy engine reads the whole extent). torch has no
    negative strides, so the first element is the lowest address. A tensor with no elements has a zero-length
    extent at its data pointer.
    """
    ptr = t.data_ptr()
    if t.numel() == 0:
        return ptr, 0
    if t.is_nested:  # strided nested: its components are packed in one buffer of numel elements
        return ptr, t.numel() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return ptr, (last + 1) * t.element_size()


def extent_is_registered(t: torch.Tensor, registry: RangeRegistry | None = None) -> bool:
    """Apply the registry rule to a tensor's extent."""
    ptr, nbytes = tensor_extent(t)
    return (registry or _GLOBAL_REGISTRY).contains(ptr, nbytes)
