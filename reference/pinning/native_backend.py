"""The reference native pinning backend: mmap + mlock + device registration, in pure Python.

Why not just ``torch.empty(pin_memory=True)``? torch's pinned allocator rounds to powers of two, caches blocks,
and cannot pin memory that already exists. The native backend allocates exactly (page-rounded), page-locks the
pages itself, registers them with the accelerator, and records the range in the process-wide registry so that any
view of the buffer is recognised by every component.

Lifetime, and why it is safe: the pages are wrapped in a ctypes buffer object whose only strong references are
held by torch storages (``torch.frombuffer`` keeps the exporter alive). When the last view dies the buffer object
is finalised and the pages are released in a fixed order: drop the range, unregister from the device, munlock,
munmap. ``unpin`` performs the first three steps at once but leaves the mapping alone, so a view that survives
``unpin`` keeps reading valid (merely pageable) memory instead of freed memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import threading
import warnings
from typing import Any

import torch

from reference.contract.accelerators import Accelerator
from reference.contract.errors import PinnedMemoryLockError
from reference.contract.pinning_rules import PinnedStats, allocation_error
from reference.ranges import RangeRegistry

__all__ = ["NativeAllocation", "PinnedStats", "allocation_of", "empty", "stats"]

_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_FAILED = ctypes.c_void_p(-1).value


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.restype = ctypes.c_int
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munlock.restype = ctypes.c_int
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_libc = _load_libc()


class _Ledger:
    """Process-wide bookkeeping of native allocations, guarded by one lock."""

    def __init__(self) -> None:
        # Re-entrant: code run under the lock (the accelerator's unregister hook, a registry call) can trigger the
        # garbage collector, whose finalisers free *other* allocations through ``free()`` on this same thread; a
        # plain Lock would deadlock there. Each block's own state is only touched by calls holding the lock.
        self.lock = threading.RLock()
        self.live: dict[int, NativeAllocation] = {}
        # Allocations between their registry entry and their place in ``live`` (the fork rule must find them).
        self.creating: dict[int, NativeAllocation] = {}
        self.ids = itertools.count(1)
        self.warned_registration = False


_ledger = _Ledger()


# ---- fork() -----------------------------------------------------------------------------------------------------
# The fork rule (docs/native.md, "fork()"; the optimized native layer follows the same one): in a forked child no
# allocation made before the fork is pinned. The kernel does not copy page locks to the child and a device
# registration belongs to the parent's device context, so the child must neither report these buffers pinned nor
# undo the parent's locks or registrations. Each inherited allocation stays mapped (copy-on-write) while a view of
# it lives, is counted as unpinned-but-alive, and is unmapped (never unlocked or unregistered) when the last view
# dies; ``unpin`` of it returns False. The ledger lock is held across the fork so the child never inherits it
# half-way through an update (a thread of the parent may be inside mlock or a hook, with the GIL released).


def _before_fork() -> None:
    _ledger.lock.acquire()


def _after_fork_in_parent() -> None:
    _ledger.lock.release()


def _after_fork_in_child() -> None:
    _ledger.lock = threading.RLock()  # the parent's is held by the thread that forked; start with a fresh one
    # Half-made allocations of threads that did not survive the fork are forgotten, their ranges dropped too.
    creating, _ledger.creating = list(_ledger.creating.values()), {}
    for alloc in [*_ledger.live.values(), *creating]:
        if alloc.pinned:
            entry = alloc.registry.find(alloc.ptr)
            if entry is not None and entry.start == alloc.ptr and entry.owner == alloc.id:
                alloc.registry.remove(alloc.ptr)
        alloc.pinned = False
        alloc.registered = False


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class NativeAllocation:
    """One mmap'ed, locked and (optionally) registered block of host memory."""

    def __init__(self, nbytes: int, accelerator: Accelerator, register: bool, registry: RangeRegistry) -> None:
        page = mmap.PAGESIZE
        self.size = max(page, -(-nbytes // page) * page)
        self.accelerator = accelerator
        self.registry = registry
        self.registered = False
        self.pinned = False
        self.mapped = False
        self.id = next(_ledger.ids)

        ptr = _libc.mmap(None, self.size, _PROT_READ_WRITE, _MAP_PRIVATE_ANON, -1, 0)
        if ptr is None or ptr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise allocation_error(self.size, "native", f"mmap of {self.size} bytes failed: {os.strerror(err)}")
        self.ptr = int(ptr)
        self.mapped = True
        try:
            if _libc.mlock(ctypes.c_void_p(self.ptr), self.size) != 0:
                err = ctypes.get_errno()
                raise PinnedMemoryLockError(
                    f"cannot page-lock {self.size} bytes of host memory (mlock: {os.strerror(err)}). The locked-memory "
                    "limit is too small: raise it with `ulimit -l unlimited` (or the memlock entry in "
                    "/etc/security/limits.conf, or the container's --ulimit memlock), or pin less memory."
                )
            self.pinned = True
            if register and accelerator.supports_host_registration:
                self.registered = accelerator.register_host_memory(self.ptr, self.size)
                if not self.registered:
                    _warn_registration_failed(accelerator, self.size)
            with _ledger.lock:
                _ledger.creating[self.id] = self
            registry.add(self.ptr, self.size, self.id)
        except BaseException:
            with _ledger.lock:
                _ledger.creating.pop(self.id, None)
            self._release_pins()
            self._unmap()
            raise
        with _ledger.lock:
            _ledger.creating.pop(self.id, None)
            _ledger.live[self.id] = self

    def _release_pins(self) -> None:
        """Drop the range, unregister, unlock; idempotent. Must run before the pages are unmapped."""
        if self.pinned:
            self.registry.remove(self.ptr)
            if self.registered:
                self.registered = False
                try:
                    self.accelerator.unregister_host_memory(self.ptr)
                except Exception as exc:  # the last view is gone: nobody to raise to, the release goes on
                    warnings.warn(f"unregistering {self.size} bytes at {self.ptr:#x} from {self.accelerator.name!r} "
                                  f"failed while freeing them: {exc!r}", RuntimeWarning, stacklevel=2)
            self.pinned = False
            _libc.munlock(ctypes.c_void_p(self.ptr), self.size)

    def _unmap(self) -> None:
        if self.mapped:
            self.mapped = False
            if _libc.munmap(ctypes.c_void_p(self.ptr), self.size) != 0:  # pragma: no cover - kernel refused
                warnings.warn(f"munmap({self.ptr:#x}, {self.size}) failed: {os.strerror(ctypes.get_errno())}")

    def unpin(self) -> bool:
        """Unregister, unlock and drop the range now; keep the mapping for live views. False if already unpinned.

        The device unregistration runs first and alone: if the accelerator's hook raises, its exception
        propagates and nothing has changed (still registered, locked, in the registry and counted), so the call
        can be retried (docs/native.md, "When an accelerator hook fails").
        """
        with _ledger.lock:
            if not self.pinned:
                return False
            if self.registered:
                self.accelerator.unregister_host_memory(self.ptr)
                self.registered = False
            self._release_pins()
            return True

    def free(self) -> None:
        """Called when the last view is gone."""
        with _ledger.lock:
            self._release_pins()
            self._unmap()
            _ledger.live.pop(self.id, None)


def _warn_registration_failed(accelerator: Accelerator, nbytes: int) -> None:
    with _ledger.lock:
        if _ledger.warned_registration:
            return
        _ledger.warned_registration = True
    warnings.warn(
        f"registering {nbytes} bytes of locked host memory with accelerator {accelerator.name!r} failed; the buffer "
        "stays page-locked but device copies from it may be staged. This warning is shown once per process; set "
        "HOSTOFFLOAD_PIN_REGISTER_DEVICE=0 to skip registration.",
        RuntimeWarning,
        stacklevel=4,
    )


_block_types: dict[int, Any] = {}  # ctypes array classes made per size (from_address is theirs)


def _block_type(size: int) -> Any:
    """A ctypes byte-array type of ``size`` whose instances free their allocation when finalised."""
    cls = _block_types.get(size)
    if cls is None:

        def __del__(self: ctypes.Array) -> None:
            alloc = self.__dict__.get("allocation")
            if alloc is not None:
                alloc.free()

        cls = type(f"PinnedBlock{size}", (ctypes.c_ubyte * size,), {"__del__": __del__})
        _block_types[size] = cls
    return cls


def empty(
    shape: tuple[int, ...], dtype: torch.dtype, accelerator: Accelerator, register: bool, registry: RangeRegistry
) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` in a fresh native pinned allocation."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    alloc = NativeAllocation(numel * itemsize, accelerator, register, registry)
    try:
        block = _block_type(alloc.size).from_address(alloc.ptr)
        block.allocation = alloc
    except BaseException:
        alloc.free()
        raise
    # From here on the block owns the allocation: it is freed when the last storage referencing it dies.
    flat = torch.frombuffer(block, dtype=torch.uint8, count=alloc.size)
    del block
    return flat[: numel * itemsize].view(dtype).view(shape)


def allocation_of(ptr: int, nbytes: int, registry: RangeRegistry) -> NativeAllocation | None:
    """The live, pinned allocation whose range holds the whole extent, if any."""
    if not registry.contains(ptr, nbytes):
        return None
    entry = registry.find(ptr)
    if entry is None:
        return None
    with _ledger.lock:
        return _ledger.live.get(entry.owner)


def stats() -> PinnedStats:
    with _ledger.lock:
        pinned = [a for a in _ledger.live.values() if a.pinned]
        return PinnedStats(
            allocations=len(pinned),
            bytes=sum(a.size for a in pinned),
            registered_bytes=sum(a.size for a in pinned if a.registered),
            unpinned_alive=len(_ledger.live) - len(pinned),
        )
