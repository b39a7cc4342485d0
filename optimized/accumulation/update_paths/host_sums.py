"""The running sum of an accumulation's middle backwards, added on the host (issue 49 item 4; opt-in with
``HOSTOFFLOAD_MIDDLE_BACKWARDS=host`` until its run on a GPU is measured and checked).

Without this, every backward after the first brings each bucket's fp32 running sum up from the pinned host
accumulator, adds the new reduced gradient on the device and sends the sum back: 8 bytes per element over the bus
per micro-batch, more than a backward has time for at 8 micro-batches on the 886M shape (run AD: D2H 348 ms and
upload 325 ms per boundary). A *middle* backward -- one a managed schedule says neither starts the accumulation nor
ends it -- sends its reduced gradient down at the comm dtype's width instead (2 bytes per element with bf16
reductions) into a landing buffer, and a thread of its own adds it into the host accumulator: R10's
``acc + red.to(accum_dtype)`` on the same values in the same order, one IEEE rounding per element on either side
of the bus, so the sum is bitwise what the device computed (``acc.add_(red)`` where the accumulation dtype holds
every comm-dtype value, the conversion first where it does not, as :class:`.GradientStream` does on the device).

The boundary's own backward is left as it was: it brings the running sum up, adds on the device and sums R14's
pieces there while the gradient streams out, so the global norm (R15) is computed where and in the order it
always was, and the host adds never sit between the last backward and the update. The first backward is left as
it was too (it sends ``0 + red``, packed at the comm dtype's width where more backwards follow); the middle
backward after a packed one widens the bucket on the host before adding into it.

Who waits for what: the landing buffer is written by a bucket's D2H and read by its add, so the bucket's next D2H
or upload waits for its add (:meth:`HostRunningSum.wait`, on the training thread before queueing them: the add
ran a whole micro-batch earlier, so this seldom blocks); a reader of the accumulator waits for every add
(:meth:`HostRunningSum.wait_all`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from optimized.accumulation.update_paths.timings import UpdateTimings

__all__ = ["HostRunningSum"]


class HostRunningSum:
    """The landing buffer of the middle backwards and the thread that adds it into the host accumulator.

    ``landing``: a pinned host buffer of the partition at the comm dtype; ``buckets``: how many buckets (one add
    in flight per bucket at most)."""

    def __init__(self, landing: torch.Tensor, accum_dtype: torch.dtype, buckets: int, timings: UpdateTimings) -> None:
        self.landing = landing
        self.accum_dtype = accum_dtype
        #: R10's conversion is exact (bf16 into fp32, or the same dtype): add the comm-dtype values directly
        self._exact = torch.promote_types(landing.dtype, accum_dtype) == accum_dtype
        self._timings = timings
        self._adds: list[Future | None] = [None] * buckets
        self._executor: ThreadPoolExecutor | None = None

    def add(self, index: int, accumulator: torch.Tensor, lo: int, hi: int, landed: Callable[[], None],
            widen: Callable[[], None] | None) -> None:
        """Queue ``accumulator[lo:hi] += landing[lo:hi]`` (R10) for bucket ``index``, once ``landed()`` returned
        (the D2H into the landing buffer has run); ``widen``: first turn the bucket's packed values (a packed first
        backward's ``0 + red``) into the accumulation dtype, in place."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostoffload-running-sum")
        self._adds[index] = self._executor.submit(self._add, accumulator, lo, hi, landed, widen)

    def _add(self, accumulator: torch.Tensor, lo: int, hi: int, landed: Callable[[], None],
             widen: Callable[[], None] | None) -> None:
        landed()
        t0 = time.perf_counter()
        if widen is not None:
            widen()
        red = self.landing[lo:hi]
        accumulator[lo:hi].add_(red if self._exact else red.to(self.accum_dtype))
        self._timings.add("host_add_s", time.perf_counter() - t0)

    def wait(self, index: int) -> None:
        """Bucket ``index``'s last add has run (re-raises its error)."""
        add = self._adds[index]
        if add is not None:
            add.result()

    def wait_all(self) -> None:
        """Every add queued so far has run (re-raises the first error)."""
        for index in range(len(self._adds)):
            self.wait(index)

    def close(self) -> None:
        """Let the adds in flight finish (their errors dropped: called from destroy, which frees the buffers they
        write next) and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
