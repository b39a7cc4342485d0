"""A stranger's pinning: a binding that forwards to another library's pinning (hostoffload's reference) and keeps
its own table of what it pinned, in "native" code with four defects a third party could ship. It exposes the
public pinning calls only (no range registry), so the harness can judge it through those alone.

- **It asserts**: the native allocator asserts ``nbytes > 0``; ``pin_empty`` of an empty shape aborts the process
  (SIGABRT), after the binding has checked the arguments (bad arguments still raise).
- **It frees a live view's pages**: for a buffer of 1 MiB or more (mapped on its own, as ``malloc`` does above
  its mmap threshold) the binding ties the ``munmap`` to the Python tensor ``pin_empty`` returned, not to its
  storage: once that tensor is collected, a view that outlives it reads unmapped memory (SIGSEGV).
- **It races**: the table is updated without a lock, read-change-publish, and the native code releases the GIL
  in between (``time.sleep(0)`` here): two threads updating at once lose one update, so a buffer just pinned
  can read as not pinned, or one just unpinned as pinned.
- **It scans**: ``is_pinned`` and ``unpin`` look a buffer up by scanning every entry of the table (O(n)).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
import weakref

import torch

from reference import pinning as _library
from reference.contract.pinning_rules import PinnedStats, is_data_less, pin_empty_arguments
from reference.pinning import pinned_stats

#: Buffers this large are mapped on their own, and unmapped when the returned tensor object dies (the defect).
_OWN_MAPPING_BYTES = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class _Table:
    """The binding's table of pinned extents ``(start, end)``: a list replaced on every change, no lock."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int]] = []

    def add(self, start: int, nbytes: int) -> None:
        new = [*self.entries, (start, start + nbytes)]
        time.sleep(0)  # the native update releases the GIL here, between reading the table and publishing it
        self.entries = new

    def holds(self, ptr: int, nbytes: int) -> bool:
        for start, end in self.entries:  # a scan of every entry
            if start <= ptr and ptr + nbytes <= end:
                return True
        return False

    def remove_holding(self, ptr: int, nbytes: int) -> None:
        entries = self.entries
        for i, (start, end) in enumerate(entries):
            if start <= ptr and ptr + nbytes <= end:
                new = entries[:i] + entries[i + 1 :]
                time.sleep(0)
                self.entries = new
                return


_TABLE = _Table()


def _extent(t: torch.Tensor) -> tuple[int, int]:
    from reference.ranges import tensor_extent

    return tensor_extent(t)


def _listed(t: torch.Tensor) -> torch.Tensor:
    ptr, nbytes = _extent(t)
    if nbytes:
        _TABLE.add(ptr, nbytes)
        if nbytes >= _OWN_MAPPING_BYTES and _library.is_pinned(t):
            length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            weakref.finalize(t, _libc.munmap, ptr, length)  # tied to this tensor object, not to its storage
    return t


def pin_empty(*shape, dtype=None, device=None) -> torch.Tensor:
    dims, dt = pin_empty_arguments(shape, dtype, device)
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes <= 0:
        sys.stderr.write("selftest-stranger: native assertion `nbytes > 0' failed in pin_alloc\n")
        sys.stderr.flush()
        os.abort()
    return _listed(_library.pin_empty(*shape, dtype=dtype, device=device))


def pin_empty_like(t, *, dtype=None) -> torch.Tensor:
    return _listed(_library.pin_empty_like(t, dtype=dtype))


def pin_memory(t, *, make_copy=True, match_shape=True) -> torch.Tensor:
    was_pinned = isinstance(t, torch.Tensor) and not is_data_less(t) and _library.is_pinned(t)
    out = _library.pin_memory(t, make_copy=make_copy, match_shape=match_shape)
    return out if (was_pinned and out is t) else _listed(out)


def is_pinned(t) -> bool:
    answer = _library.is_pinned(t)  # checks the argument and says what the memory is
    if t.device.type != "cpu" or is_data_less(t) or t.numel() == 0:
        return answer
    listed = _TABLE.holds(*_extent(t))
    return answer and listed


def unpin(t) -> bool:
    answer = _library.unpin(t)
    if answer:
        _TABLE.remove_holding(*_extent(t))
    return answer


__all__ = ["PinnedStats", "is_pinned", "pin_empty", "pin_empty_like", "pin_memory", "pinned_stats", "unpin"]
