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

import time
from collections.abc import Callable

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


def growth_message(what: str, small: float, large: float) -> str:
    return (
        f"{what}: {large * 1e6:.2f} us per operation with {LARGE} live ranges vs {small * 1e6:.2f} us with {SMALL} "
        f"(ratio {large / small:.1f}, bound {MAX_RATIO:.0f}): the cost grows with the number of ranges, so the "
        f"lookup is not O(log n) as the contract requires"
    )
