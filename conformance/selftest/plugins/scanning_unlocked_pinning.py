"""A pinning area whose table of pinned buffers is scanned on every lookup and updated without a lock.

It forwards allocation to another library's native pinning (here the reference's mmap + mlock backend), and keeps
its own table of the buffers it pinned, in the style of a quick port: a copy-on-write list so that lookups never
lock, whose writers do not lock either (two pins at the same moment each publish their own copy and one entry is
lost), and whose lookups walk every entry (O(n) where the contract promises O(log n)). Every answer on one thread
is correct. It exposes only the public pinning calls, no registry: the suite must find both defects through
``pin_empty``/``is_pinned``/``unpin`` alone (conformance.selftest.test_public_contract_properties).
"""

from __future__ import annotations

import torch

from reference.contract import envvars
from reference.contract.accelerators import get_accelerator
from reference.contract.capabilities import Capabilities
from reference.contract.implementation import Implementation
from reference.contract.pinning_rules import (
    PinnedRange,
    PinnedStats,
    check_tensor,
    is_data_less,
    pin_empty_arguments,
    pin_empty_like_arguments,
    pin_memory_arguments,
    refuse_moving_a_view,
)
from reference.pinning import native_backend, torch_backend
from reference.ranges import tensor_extent

__all__ = ["PinnedStats", "is_pinned", "pin_empty", "pin_empty_like", "pin_memory", "pinned_stats", "unpin"]


class _ScanningUnlockedTable:
    """The table the native allocator records into (add on pin, remove on unpin or free, find on lookup)."""

    def __init__(self) -> None:
        self._entries: list[PinnedRange] = []

    def add(self, start: int, nbytes: int, owner: int = 0) -> None:
        snapshot = self._entries  # no lock: a pin on another thread may publish in between, and is lost
        self._entries = sorted([*snapshot, PinnedRange(start, nbytes, owner)])

    def remove(self, start: int) -> bool:
        snapshot = self._entries
        kept = [r for r in snapshot if r.start != start]
        self._entries = kept
        return len(kept) != len(snapshot)

    def find(self, ptr: int) -> PinnedRange | None:
        for r in self._entries:  # every entry, every lookup
            if r.start <= ptr < r.start + r.nbytes:
                return r
        return None

    def contains(self, ptr: int, nbytes: int) -> bool:
        r = self.find(ptr)
        return r is not None and ptr + nbytes <= r.start + r.nbytes


_TABLE = _ScanningUnlockedTable()


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    backend = envvars.check_pinning_environment()
    accelerator = get_accelerator()
    if backend == "native":
        return native_backend.empty(shape, dtype, accelerator, envvars.pin_register_device(), _TABLE)
    return torch_backend.empty(shape, dtype, accelerator)


def pin_empty(*shape, dtype=None, device=None) -> torch.Tensor:
    dims, dt = pin_empty_arguments(shape, dtype, device)
    return _allocate(dims, dt)


def pin_empty_like(t: torch.Tensor, *, dtype=None) -> torch.Tensor:
    dims, dt = pin_empty_like_arguments(t, dtype)
    return _allocate(dims, dt)


def pin_memory(t: torch.Tensor, *, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
    shape = pin_memory_arguments(t, make_copy, match_shape)
    if not make_copy and is_pinned(t) and t.is_contiguous():
        if not match_shape:
            t.data = t.data.view(shape)
        return t
    if not make_copy:
        refuse_moving_a_view(t)
    dst = _allocate(shape, t.dtype)
    dst.view(t.shape).copy_(t)
    if make_copy:
        return dst
    with torch.no_grad():
        t.data = dst
    return t


def is_pinned(t: torch.Tensor) -> bool:
    check_tensor("t", t)
    if is_data_less(t) or t.device.type != "cpu" or t.numel() == 0:
        return False
    if _TABLE.contains(*tensor_extent(t)):
        return True
    return get_accelerator().has_torch_pinning and bool(t.is_pinned())


def unpin(t: torch.Tensor) -> bool:
    check_tensor("t", t)
    if is_data_less(t) or t.device.type != "cpu":
        return False
    alloc = native_backend.allocation_of(*tensor_extent(t), _TABLE)
    return alloc.unpin() if alloc is not None else False


def pinned_stats() -> PinnedStats:
    return native_backend.stats()


IMPLEMENTATION = Implementation(
    name="selftest-scan-unlocked",
    version="0.0.0",
    areas={"pinning": __name__},
    capabilities=Capabilities(pin_backends=("torch", "native")),
)
