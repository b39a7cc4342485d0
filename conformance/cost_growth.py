"""Cost-growth properties: how the cost of one operation grows with the number of live ranges.

The contract (docs/native.md) promises O(log n) lookups. A property of that kind is checked as a *ratio* measured
in one process: the per-operation time with ``LARGE`` live ranges over the time with ``SMALL`` live ranges. An
O(log n) structure stays within a small factor (log2(100 000) / log2(10) is 5, and call overhead dominates both);
a scan of every range grows ten thousand times. The bound, :data:`MAX_RATIO`, sits far from both, so that a loaded
CI machine cannot make a logarithmic implementation fail and no linear one can pass. These are not benchmarks:
no absolute time is asserted.

Each measurement is the best of several batches (the least-disturbed estimate of the per-operation cost).
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable
from typing import Any

SMALL = 10
LARGE = 100_000
#: Largest accepted per-operation time ratio between LARGE and SMALL live ranges.
MAX_RATIO = 50.0
#: Bytes between the starts of two synthetic ranges (each range is half of it: a miss lies in every gap).
STRIDE = 8192


#: Seconds one measurement may take: a slow (linear) operation is measured on fewer keys rather than for minutes.
BUDGET_S = 0.25


def per_op_seconds(op: Callable[[int], object], keys: list[int], *, batches: int = 7) -> float:
    """Best-of-``batches`` time of ``op(key)`` per key; a batch stops early once it has used the time budget
    (the per-operation figure is then over the keys it did), and no new batch starts after the budget."""
    best = float("inf")
    spent = 0.0
    for _ in range(batches):
        start = time.perf_counter()
        done = 0
        for k in keys:
            op(k)
            done += 1
            if done % 16 == 0 and time.perf_counter() - start > BUDGET_S:
                break
        elapsed = time.perf_counter() - start
        best = min(best, elapsed / done)
        spent += elapsed
        if spent > BUDGET_S:
            break
    return best


def per_call_seconds(setup: Callable[[int], object], op: Callable[[object], object], keys: list[int]) -> float:
    """Best time of ``op(setup(key))`` over the keys, timing only ``op`` (for operations that consume state)."""
    best = float("inf")
    spent = 0.0
    for k in keys:
        arg = setup(k)
        start = time.perf_counter()
        op(arg)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        if spent > BUDGET_S:
            break
    return best


def growth_message(what: str, small: float, large: float, bound: float = MAX_RATIO) -> str:
    return (
        f"{what}: {large * 1e6:.2f} us per operation with {LARGE} live ranges vs {small * 1e6:.2f} us with {SMALL} "
        f"(ratio {large / small:.1f}, bound {bound:.0f}): the cost grows with the number of ranges, so the "
        f"lookup is not O(log n) as the contract requires"
    )


#: Ratio bound for a whole request (an io write or read): the request's own work (a thread hand-off, a file
#: open, a copy, syscalls) does not depend on the number of live ranges and dominates an O(log n) check, so such a
#: handle measures a ratio near 1 (up to about 2 on a loaded machine); a check that visits every one of LARGE
#: ranges costs milliseconds per request, ten times a request's own cost or more.
MAX_REQUEST_RATIO = 8.0


class SyntheticRanges:
    """Live ranges added to an implementation's process-wide registry, inside address space reserved with
    ``PROT_NONE`` (no memory behind it, no allocation can ever be placed there), so they never collide with a real
    buffer and cost no memory. ``grow_to(n)`` adds ranges until ``n`` of them are live; leaving the ``with``
    block removes every one and returns the reservation.

    They stand for the other pinned buffers of a large program: the registry is the structure every lookup of the
    pinning and io areas goes through, so its size is the ``n`` of the contract's O(log n).
    """

    def __init__(self, registry: Any, capacity: int = LARGE) -> None:
        self.registry = registry
        self.capacity = capacity
        self._size = (capacity + 1) * STRIDE
        self._base = 0
        self.starts: list[int] = []

    def __enter__(self) -> SyntheticRanges:
        self._base = _reserve(self._size)
        return self

    def grow_to(self, n: int) -> None:
        if n > self.capacity:
            raise ValueError(f"n={n} is more than the reserved capacity {self.capacity}")
        for i in range(len(self.starts), n):
            start = self._base + i * STRIDE
            self.registry.add(start, STRIDE // 2)
            self.starts.append(start)

    def __exit__(self, *exc: object) -> None:
        try:
            for start in reversed(self.starts):  # last first: a sorted-array registry then never shifts its tail
                self.registry.remove(start)
            self.starts.clear()
        finally:
            _release(self._base, self._size)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _reserve(size: int) -> int:
    """Inaccessible address space (PROT_NONE, no memory behind it): addresses no allocation can ever get."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    addr = _libc.mmap(None, size, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap(PROT_NONE) failed")
    return addr


def _release(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        raise OSError(ctypes.get_errno(), "munmap failed")
