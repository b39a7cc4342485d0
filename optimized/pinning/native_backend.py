"""optimized's native pinning backend: the C++ allocator of ``optimized._native`` behind the reference's API.

Same contract as :mod:`reference.pinning.native_backend` (page-rounded, locked, registered, recorded in the
process-wide registry; registration failure warns once and keeps the lock; lock failure raises
``PinnedMemoryLockError`` with everything released; unpin releases at once, the mapping lives until the last
view dies). What is different is where the time goes:

- pages are faulted in by several threads at once, as 2 MiB transparent huge pages where the kernel allows,
  and locked as they fault (``mlock2(MLOCK_ONFAULT)``), instead of mlock faulting 4 KiB pages on one thread;
- on the stock CUDA accelerator, registration calls ``cudaHostRegister`` from C++ through the runtime torch
  already loaded, so the memory is unregistered by the DLPack deleter on whatever thread drops the last view,
  without the GIL. Any other accelerator (a plugin, or a patched one) is registered through its Python hook.
- the buffer reaches torch as a DLPack capsule, so the allocation lives exactly as long as the tensor storage.

Tuning knobs specific to this implementation (read at each call, like every pinning variable):

``HOSTOFFLOAD_PIN_HUGE_PAGES`` in {auto, thp, hugetlb, off} (default auto): ``auto``/``thp`` ask for
transparent huge pages on buffers of 2 MiB and more; ``hugetlb`` tries reserved hugetlbfs pages first (falls
back to THP when none are reserved; sizes then round to 2 MiB); ``off`` uses 4 KiB pages.
``HOSTOFFLOAD_PIN_POPULATE_THREADS``: an int >= 0, threads faulting pages in (0 or unset: one per 256 MiB, at
most 4 and at most the CPU count; measured best on the H200 box, see docs/native.md).
``HOSTOFFLOAD_PIN_REGISTER_OVERLAP`` (boolean, default on): start ``cudaHostRegister`` while the
population threads are still faulting pages in (the driver faults in what is missing itself), so registration
and population share wall time instead of adding up. Measured on the H200 box (docs/benchmarks.md): 4 GiB in
263 ms overlapped against 309 ms one after the other (torch: 1892 ms). ``0`` restores the sequential order
(population, then registration); the CUDA suite runs both (capability ``pin_env_variants``).
"""

from __future__ import annotations

import threading
import warnings

import torch

from optimized import _native
from reference.contract.accelerators import Accelerator
from reference.contract.accelerators.cuda import CudaAccelerator
from reference.contract.envvars import (
    pin_huge_pages,
    pin_populate_threads,
    pin_register_overlap,
)
from reference.contract.errors import HostOffloadError
from reference.contract.pinning_rules import PinnedStats, allocation_error

# The reference CUDA accelerator registers with cudaHostRegisterDefault; the native path uses the same flags
# so both implementations produce the same kind of registration.
_CUDA_REGISTER_FLAGS = 0

_warn_lock = threading.Lock()
_warned_registration = False
_itemsizes: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _itemsizes.get(dtype)
    if size is None:
        size = torch.empty((), dtype=dtype).element_size()
        _itemsizes[dtype] = size
    return size


# The stock hooks, captured at import: a hook replaced later (even on CudaAccelerator itself, as a test or a
# wrapper might) must be called instead of the native registration path.
_STOCK_REGISTER = CudaAccelerator.register_host_memory
_STOCK_UNREGISTER = CudaAccelerator.unregister_host_memory


def is_stock_cuda(accelerator: Accelerator) -> bool:
    """The stock CUDA accelerator with its registration hooks as shipped, and a CUDA runtime the native layer can
    reach: the native layer may then talk to the runtime directly (registration, the is_pinned miss query)."""
    return (
        isinstance(accelerator, CudaAccelerator)
        and type(accelerator).register_host_memory is _STOCK_REGISTER
        and type(accelerator).unregister_host_memory is _STOCK_UNREGISTER
        and _native.cuda_runtime_available()
    )


def _uses_native_cuda(accelerator: Accelerator) -> bool:
    """True if registration may bypass the Python hook: the stock CUDA accelerator, hook not overridden.

    torch's CUDA state is initialised first (a no-op after the first call): torch reports
    ``Tensor.is_pinned()`` False for every pointer until it has initialised CUDA itself, and registering
    through the runtime directly would not do that for it (the reference's hook does, via
    ``torch.cuda.cudart()``). It also makes the registration land in the primary context torch uses.
    """
    if not is_stock_cuda(accelerator):
        return False
    torch.cuda.init()
    return True


def _warn_registration_failed(accelerator: Accelerator, nbytes: int, detail: str) -> None:
    global _warned_registration
    with _warn_lock:
        if _warned_registration:
            return
        _warned_registration = True
    reason = f" ({detail})" if detail else ""
    warnings.warn(
        f"registering {nbytes} bytes of locked host memory with accelerator {accelerator.name!r} "
        f"failed{reason}; the buffer stays page-locked but device copies from it may be staged. "
        "This warning is shown once per process; set HOSTOFFLOAD_PIN_REGISTER_DEVICE=0 to skip registration.",
        RuntimeWarning,
        stacklevel=4,
    )


def allocate(nbytes: int, accelerator: Accelerator, register: bool, *, slab: bool = False) -> torch.Tensor:
    """A flat uint8 tensor over a fresh native pinned allocation of ``nbytes`` (page-rounded length).

    The tensor spans the whole page-rounded allocation; callers slice it. Reads the tuning variables now.
    """
    huge = pin_huge_pages()
    threads = pin_populate_threads()
    overlap = pin_register_overlap()
    want_registration = register and accelerator.supports_host_registration
    native_cuda = want_registration and _uses_native_cuda(accelerator)
    try:
        alloc = _native.allocate(nbytes, huge, threads, native_cuda, _CUDA_REGISTER_FLAGS, slab, overlap)
    except MemoryError as exc:
        if isinstance(exc, HostOffloadError):  # PinnedMemoryLockError: the lock limit, named already
            raise
        raise allocation_error(nbytes, "native", str(exc)) from exc
    # Until export() hands it to torch, `alloc` is the only owner: any exception below drops it, and its
    # destructor unregisters, unlocks, drops the range and unmaps.
    if native_cuda:
        if not alloc.registered:
            _warn_registration_failed(accelerator, alloc.size, alloc.register_error)
    elif want_registration:
        try:
            ok = accelerator.register_host_memory(alloc.data, alloc.size)
        except BaseException:
            # A hook must return False to refuse; raising is a broken plugin and the error propagates. `alloc` is
            # the only owner: drop it now (its destructor unlocks, drops the range and unmaps), not when the
            # traceback holding this frame dies (docs/native.md, "When an accelerator hook fails").
            del alloc
            raise
        if ok:
            alloc.set_external_registration(accelerator.unregister_host_memory)
        else:
            _warn_registration_failed(accelerator, alloc.size, "")
    return torch.utils.dlpack.from_dlpack(alloc.export())


def empty(
    shape: tuple[int, ...], dtype: torch.dtype, accelerator: Accelerator, register: bool
) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` in a fresh native pinned allocation."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * _itemsize(dtype)
    flat = allocate(nbytes, accelerator, register)
    return flat[:nbytes].view(dtype).view(shape)


def allocation_of(ptr: int, nbytes: int) -> _native.NativeAllocation | None:
    """The live pinned allocation whose range holds the whole extent, if any (diagnostics and tests)."""
    return _native.allocation_of(ptr, nbytes)


def unpin_extent(ptr: int, nbytes: int) -> bool:
    """Unpin the (non-slab) allocation holding the extent; True iff this call unpinned it."""
    return _native.unpin_extent(ptr, nbytes) == 1


def stats() -> PinnedStats:
    allocations, nbytes, registered, unpinned_alive, _errors = _native.pinned_counters()
    return PinnedStats(allocations, nbytes, registered, unpinned_alive)
