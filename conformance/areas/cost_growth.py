"""Cost-growth properties: how the cost of one operation grows with the number of live ranges.

The contract (docs/native.md) promises O(log n) lookups. A property of that kind is checked as a *ratio* measured
in one process: the per-operation time with ``LARGE`` live ranges over the time with ``SMALL`` live ranges. An
O(log n) structure stays within a small factor (log2(100 000) / log2(10) is 5, and call overhead dominates both);
a scan of every range grows ten thousand times. The bound, :data:`MAX_RATIO`, sits far from both, so that a loaded
CI machine cannot make a logarithmic implementation fail and no linear one can pass. These are not benchmarks:
no absolute time is asserted.

Each measurement is the best of several batches (the least-disturbed estimate of the per-operation cost).

The live ranges are made the way a program makes them: the range registry's own cost is measured through its
public ``RangeRegistry``, and the pinning and io areas' lookups with live buffers pinned through the public
``pin_empty`` (:class:`PinnedBuffers`), never by writing into an implementation's registry: an implementation
that keeps its table to itself is measured like any other. Such a fill locks a page per buffer, so it stops at
the profile's size (:data:`PUBLIC_LARGE`), at the fill budget or at the locked-memory limit, and the bound for
it (:data:`MAX_PUBLIC_RATIO`) is tighter to match.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SMALL = 10
LARGE = 100_000
#: Largest accepted per-operation time ratio between LARGE and SMALL live ranges.
MAX_RATIO = 50.0
#: Bytes between the starts of two synthetic ranges (each range is half of it: a miss lies in every gap).
STRIDE = 8192


#: Live buffers a measurement through the public pinning calls aims for, by profile (conformance.harness.profiles):
#: each is one locked page and tens of microseconds to make and free, so ci stays near a second per fill.
PUBLIC_LARGE = {"dev": 10_000, "ci": 10_000, "conformance": 30_000, "gpu": 30_000, "thorough": LARGE}
#: Seconds a fill through the public calls may take before the measurement goes on with what it has.
FILL_BUDGET_S = 8.0
#: Largest accepted ratio when the live buffers were made through the public calls: fewer of them than
#: :data:`LARGE` (:data:`PUBLIC_LARGE`), so a scan grows less than ten thousand times; a tree, a skip list or a
#: sorted array still measures a ratio near 1, and a scan over the buffers of a ci fill (thousands of them, or
#: some hundreds where the locked-memory limit stops the fill) far above this.
MAX_PUBLIC_RATIO = 6.0
#: Fewest live buffers that make a public-call measurement meaningful; a fill stopped below it fails the test
#: with what stopped it (the locked-memory limit, usually).
MIN_PUBLIC_LARGE = 1000

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


def growth_message(
    what: str, small: float, large: float, bound: float = MAX_RATIO, *, large_n: int = LARGE, small_n: int = SMALL
) -> str:
    return (
        f"{what}: {large * 1e6:.2f} us per operation with {large_n} live ranges vs {small * 1e6:.2f} us with {small_n} "
        f"(ratio {large / small:.1f}, bound {bound:.0f}): the cost grows with the number of ranges, so the "
        f"lookup is not O(log n) as the contract requires"
    )


#: Ratio bound for a whole request (an io write or read): the request's own work (a thread hand-off, a file
#: open, a copy, syscalls) does not depend on the number of live ranges and dominates an O(log n) check, so such a
#: handle measures a ratio near 1 (up to about 2 on a loaded machine); a check that visits every one of LARGE
#: ranges costs milliseconds per request, ten times a request's own cost or more.
MAX_REQUEST_RATIO = 8.0


class PinnedBuffers:
    """Live pinned buffers made through the pinning area's public ``pin_empty`` (one page each), standing for the
    other pinned buffers of a large program: the live ranges that every lookup of the pinning and io areas must
    not scan. Only the public calls are used, so an implementation that exposes no registry is measured too.

    ``grow_to(n)`` pins until ``n`` buffers are live, or until the fill has used :data:`FILL_BUDGET_S`, or until
    the process's locked-memory limit refuses a page (``PinnedMemoryLockError``, the contract's answer); it
    returns how many are live, which the measurement then uses as its large size. Leaving the ``with`` block
    unpins and drops every buffer.
    """

    def __init__(self, pinning: Any, *, page: int = STRIDE // 2) -> None:
        self.pinning = pinning
        self.page = page
        self.buffers: list[Any] = []
        self.stopped_by = ""

    def __enter__(self) -> PinnedBuffers:
        return self

    def grow_to(self, n: int) -> int:
        import torch

        from reference.contract.errors import PinnedMemoryLockError

        start = time.perf_counter()
        while len(self.buffers) < n:
            try:
                self.buffers.append(self.pinning.pin_empty(self.page, dtype=torch.uint8))
            except PinnedMemoryLockError as exc:
                self.stopped_by = f"the locked-memory limit ({exc})"
                break
            if len(self.buffers) % 256 == 0 and time.perf_counter() - start > FILL_BUDGET_S:
                self.stopped_by = f"the fill budget of {FILL_BUDGET_S:.0f} s"
                break
        return len(self.buffers)

    def __exit__(self, *exc: object) -> None:
        import gc

        for t in self.buffers:
            self.pinning.unpin(t)
        self.buffers.clear()
        gc.collect()


def best_again(measure: Callable[[], float], first: float, small: float, bound: float) -> float:
    """``first``, or the better of it and a second measurement when ``first / small`` is over ``bound``: a scan
    is over the bound every time, a machine stalled by its neighbours rarely twice in a row."""
    return min(first, measure()) if first / small > bound else first


def public_large(profile: str | None) -> int:
    """How many live buffers a public-call measurement aims for under ``profile``: the fill costs tens of
    microseconds and one locked page per buffer, so the fast profiles measure fewer than :data:`LARGE`."""
    return PUBLIC_LARGE.get(profile or "", PUBLIC_LARGE["ci"])
