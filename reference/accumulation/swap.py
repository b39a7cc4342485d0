"""Optimizer state on NVMe between steps (``offload_optimizer: nvme``, docs/accumulation.md R17), reference form.

Why files at all: the optimizer state of Adam is two fp32 copies of the partition, usually the largest thing a
rank keeps; with ``nvme`` it lives in files under ``nvme_path`` between boundary steps and in memory only while
the optimizer runs. The masters stay on the host (as with ``cpu``), so the arithmetic is that of ``cpu`` offload
operation for operation and a trace is bitwise the cpu-offload trace.

The reference does it the obvious way, blocking: before a rank's optimizer step every state buffer is read
back into fresh host tensors, after it every buffer is written out and the tensors are dropped. Each engine
owns a private directory made under ``nvme_path`` (so engines sharing a path never touch each other's files),
one file per (rank, buffer), and removes it in :meth:`OptimizerStateSwap.close`.
"""

from __future__ import annotations

import shutil
import weakref

import torch

from reference.accumulation.optimizers import OptimizerState
from reference.contract.accumulation_swap_files import make_state_directory, state_file
from reference.io import SwapConfig, SwapHandle


def open_swap_directory(owner: object, nvme_path: str, swap_config: SwapConfig, handle_type: type) -> tuple:
    """What the reference's state swapper starts with: a fresh private directory under ``nvme_path`` (named by
    :mod:`reference.contract.accumulation_swap_files`), a finalizer that deletes it when ``owner`` is dropped
    or when called, and a ``handle_type`` swap handle built from ``swap_config``. Returns
    ``(directory, cleanup, handle)``; if the handle cannot be built the directory is already gone."""
    directory = make_state_directory(nvme_path)
    cleanup = weakref.finalize(owner, shutil.rmtree, directory, True)
    c = swap_config
    try:
        handle = handle_type(c.queue_depth, c.block_size, c.num_threads, c.use_o_direct)
    except BaseException:
        cleanup()
        raise
    return directory, cleanup, handle


class OptimizerStateSwap:
    """Swaps the state buffers of W simulated ranks to files through a blocking :class:`reference.io.SwapHandle`.

    ``shapes[r]`` maps each buffer name of rank r to its element count (fp32). While a rank's state is swapped
    out its :class:`OptimizerState` keeps the step count and an empty ``buffers`` dict, so nothing can read
    stale values by accident.
    """

    def __init__(self, nvme_path: str, swap_config: SwapConfig) -> None:
        # An engine dropped without destroy() still removes its files (the handle has its own finalizer).
        self.directory, self._cleanup, self.handle = open_swap_directory(self, nvme_path, swap_config, SwapHandle)
        self._numel: dict[tuple[int, str], int] = {}
        self._closed = False

    def swap_out(self, rank: int, state: OptimizerState) -> None:
        """Write every buffer of ``state`` to its file and drop it from memory."""
        for name, buf in state.buffers.items():
            self._numel[(rank, name)] = buf.numel()
            self.handle.write(buf, state_file(self.directory, rank, name)).wait()
        state.buffers = {}

    def swap_in(self, rank: int, state: OptimizerState) -> None:
        """Read every buffer of ``rank`` back from its file into fresh host fp32 tensors held by ``state``."""
        buffers = {}
        for (r, name), numel in self._numel.items():
            if r != rank:
                continue
            t = torch.empty(numel, dtype=torch.float32)
            self.handle.read(t, state_file(self.directory, rank, name)).wait()
            buffers[name] = t
        state.buffers = buffers

    def close(self) -> None:
        """Close the handle and delete the engine's directory with every file in it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.handle.close()
        finally:
            self._cleanup()
