"""Optimizer state on NVMe between steps (``offload_optimizer: nvme``, docs/accumulation.md R17), one rank.

The state buffers of this rank's partition (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum) exist in
memory only around the optimizer step; in between they live in one file each, in a directory this engine makes
under ``nvme_path``. The cycle at a boundary, driven by :class:`~optimized.accumulation.engine.ZeroEngine`:

1. :meth:`begin_swap_in` when the boundary's work starts: pinned buffers are allocated through the project's
   pinning API and their reads submitted, so the file reads overlap the gradient reduction, the norm
   all-gather and the clipping decision;
2. :meth:`finish_swap_in` just before the CPU Adam runs: waits for the reads;
3. :meth:`begin_swap_out` right after it: the writes are submitted and the step goes on (cast, parameter
   all-gather) while they run;
4. :meth:`release` at the next ``backward()`` (or the next boundary, or ``destroy()``): waits for the writes,
   raising their error if any, and unpins the buffers.

Why pinned buffers from :func:`optimized.pinning.pin_empty`: memory the native backend pins is in the range
registry, so :class:`optimized.io.SwapHandle` moves it directly (no bounce copy, ``O_DIRECT`` where the size
and filesystem allow) -- the engine's swaps report zero bounced bytes. Pinning per step costs a page lock per
buffer; it is what lets host memory hold the state only while it is used.
"""

from __future__ import annotations

import contextlib
import shutil
import weakref
from collections.abc import Callable

import torch

from optimized.io import SwapHandle, SwapRequest
from optimized.pinning import pin_empty, unpin
from reference.contract.accumulation_swap_files import make_state_directory, state_file
from reference.contract.io_config import SwapConfig
from reference.contract.io_stats import SwapStats

__all__ = ["StateSwapper"]


class StateSwapper:
    """The swap cycle of one rank's optimizer-state buffers ``names``, each ``numel`` fp32 elements."""

    def __init__(self, nvme_path: str, swap_config: SwapConfig, rank: int, names: tuple[str, ...], numel: int,
                 allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None):
        # The directory (named by the contract) goes with this object even without close(): the finalizer runs
        # when the swapper is garbage collected, and close() runs it now.
        self.directory = make_state_directory(nvme_path)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        c = swap_config
        try:
            self.handle = SwapHandle(c.queue_depth, c.block_size, c.num_threads, c.use_o_direct)
        except BaseException:
            self._cleanup()
            raise
        self.names = names
        self.numel = numel
        #: pinned buffers for the state while it is in memory (default: the pinning API's backend)
        self._pin = allocate if allocate is not None else (lambda n, dtype: pin_empty(n, dtype=dtype))
        self.paths = {n: state_file(self.directory, rank, n) for n in names}
        self._buffers: dict[str, torch.Tensor] | None = None
        self._reads: list[SwapRequest] = []
        self._writes: list[SwapRequest] = []

    # ---- the cycle -----------------------------------------------------------------------------------------
    def write_initial(self) -> None:
        """Store the zero state (step 0) so that the first boundary reads like every later one."""
        bufs = self._allocate()
        for b in bufs.values():
            b.zero_()
        self.begin_swap_out()
        self.release()

    def write_state(self, buffers: dict[str, torch.Tensor]) -> None:
        """Replace the state in the files with ``buffers`` (a loaded checkpoint), synchronously."""
        self.release()  # a step's writes may still hold the buffers
        bufs = self._allocate()
        for k, b in bufs.items():
            b.copy_(buffers[k])
        self.begin_swap_out()
        self.release()

    def begin_swap_in(self) -> None:
        """Submit the reads of every buffer into pinned memory (reusing buffers a pending write still holds)."""
        if self._reads:
            return  # already in flight (e.g. optimizer_state() between begin and finish): nothing to add
        if self._buffers is None:
            buffers = self._allocate()
        else:
            buffers = self._buffers
            self._wait(self._writes)  # the buffers are about to be overwritten: their writes must be done
        self._reads = [self.handle.read(buffers[n], self.paths[n]) for n in self.names]

    def finish_swap_in(self) -> dict[str, torch.Tensor]:
        """Wait for the reads (raising the first failure) and return the buffers by name."""
        if self._buffers is None:
            self.begin_swap_in()
        self._wait(self._reads)
        assert self._buffers is not None  # begin_swap_in allocated them
        return dict(self._buffers)

    def begin_swap_out(self) -> None:
        """Submit the writes of every buffer; the handle owns the buffers until :meth:`release`."""
        assert self._buffers is not None  # swapped in (or allocated) before anything writes them out
        self._writes = [self.handle.write(self._buffers[n], self.paths[n]) for n in self.names]

    def release(self) -> None:
        """Wait for pending requests (raising the first failure) and unpin the buffers. A no-op when none are
        held. The buffers are unpinned even when a request failed."""
        if self._buffers is None:
            return
        try:
            self._wait(self._reads)
            self._wait(self._writes)
        finally:
            self._free()

    # ---- inspection and lifetime ---------------------------------------------------------------------------
    @property
    def resident(self) -> tuple[torch.Tensor, ...]:
        """The pinned buffers held now (empty between a ``release`` and the next swap-in)."""
        return () if self._buffers is None else tuple(self._buffers.values())

    def stats(self) -> SwapStats:
        return self.handle.stats()

    def close(self) -> None:
        """Finish or abandon pending requests without raising, close the handle, unpin the buffers and delete
        the directory with its files. Idempotent; safe after any failure."""
        with contextlib.suppress(Exception):
            self.handle.wait()
        try:
            self.handle.close()
        finally:
            self._reads, self._writes = [], []
            self._free()
            self._cleanup()

    # ---- internals -----------------------------------------------------------------------------------------
    def _allocate(self) -> dict[str, torch.Tensor]:
        bufs: dict[str, torch.Tensor] = {}
        try:
            for n in self.names:
                bufs[n] = self._pin(self.numel, torch.float32)
        except BaseException:
            for b in bufs.values():
                unpin(b)
            raise
        self._buffers = bufs
        return bufs

    def _wait(self, requests: list[SwapRequest]) -> None:
        pending = list(requests)
        requests.clear()
        first: BaseException | None = None
        for r in pending:  # wait for all, so no request still owns a buffer when we raise
            try:
                r.wait()
            except BaseException as exc:
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def _free(self) -> None:
        bufs, self._buffers = self._buffers, None
        if bufs:
            for b in bufs.values():
                unpin(b)
