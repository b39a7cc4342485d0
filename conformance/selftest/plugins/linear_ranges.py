"""The reference range-registry API with a plausible performance bug: every lookup and removal scans all
ranges (O(n)). Its answers are all correct; only the cost-growth property can tell."""

from __future__ import annotations

import threading

from reference.contract.pinning_rules import PinnedRange
from reference.ranges import *  # noqa: F403 (tensor_extent and the rest, unchanged)


class RangeRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[PinnedRange] = []

    def add(self, start: int, nbytes: int, owner: int = 0) -> None:
        with self._lock:
            self._ranges.append(PinnedRange(start, nbytes, owner))  # (the overlap check is omitted too)

    def remove(self, start: int) -> bool:
        with self._lock:
            for i, r in enumerate(self._ranges):
                if r.start == start:
                    del self._ranges[i]
                    return True
            return False

    def find(self, ptr: int) -> PinnedRange | None:
        with self._lock:
            for r in self._ranges:
                if r.start <= ptr < r.start + r.nbytes:
                    return r
            return None

    def contains(self, ptr: int, nbytes: int) -> bool:
        r = self.find(ptr)
        return r is not None and ptr + nbytes <= r.start + r.nbytes

    def ranges(self) -> list[PinnedRange]:
        with self._lock:
            return sorted(self._ranges)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)

    def __contains__(self, extent: tuple[int, int]) -> bool:
        return self.contains(*extent)


_GLOBAL = RangeRegistry()


def global_registry() -> RangeRegistry:
    return _GLOBAL

