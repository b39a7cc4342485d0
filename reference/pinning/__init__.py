"""The pinning API: one set of functions over two backends.

``HOSTOFFLOAD_PIN_BACKEND`` picks where new pinned memory comes from (``torch``: torch's pinned allocator,
``native``: :mod:`reference.pinning.native_backend`). Queries (``is_pinned``, ``unpin``, ``pinned_stats``) are
backend-agnostic: they recognise memory from either backend, because a buffer allocated while one backend was
selected stays pinned after the variable changes.
"""

from __future__ import annotations

import torch

from reference.contract import envvars
from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.pinning_rules import (
    PinnedStats,
    check_tensor,
    is_data_less,
    pin_empty_arguments,
    pin_empty_like_arguments,
    pin_memory_arguments,
    refuse_moving_a_view,
)
from reference.pinning import native_backend, torch_backend
from reference.ranges import global_registry, tensor_extent

__all__ = [
    "PinnedStats",
    "is_pinned",
    "pin_empty",
    "pin_empty_like",
    "pin_memory",
    "pinned_stats",
    "unpin",
]


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Fresh pinned memory from the selected backend. Reads the environment now (see module docstring)."""
    backend = envvars.check_pinning_environment()
    accelerator: Accelerator = get_accelerator()
    if backend == "native":
        register = envvars.pin_register_device()
        return native_backend.empty(shape, dtype, accelerator, register, global_registry())
    return torch_backend.empty(shape, dtype, accelerator)


def pin_empty(*shape: int | tuple[int, ...], dtype: torch.dtype | None = None, device: object = None) -> torch.Tensor:
    """An uninitialised pinned host tensor. ``device`` may only be None or 'cpu'."""
    dims, dt = pin_empty_arguments(shape, dtype, device)
    return _allocate(dims, dt)


def pin_empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A pinned host tensor with ``t``'s shape (contiguous), and ``t``'s dtype unless ``dtype`` is given.

    ``t`` may live on any device (including meta): only its shape and dtype are read.
    """
    dims, dt = pin_empty_like_arguments(t, dtype)
    return _allocate(dims, dt)


def pin_memory(t: torch.Tensor, *, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
    """``t``'s values in pinned host memory.

    ``make_copy=True`` returns a new tensor and leaves ``t`` alone. ``make_copy=False`` moves ``t`` itself onto
    the pinned storage (``t.data`` is replaced) and returns ``t``: the caller's references all see pinned memory
    and the pageable storage is freed with its last reference. A view (or a window into a larger storage) whose
    memory is not pinned yet is refused with a ``ConfigurationError`` naming ``make_copy`` and ``t``: moving it
    would detach it from its base (docs/usage.md, "Pinning in place").
    ``match_shape=False`` returns (and, without a copy,
    turns ``t`` into) a flat tensor of ``t.numel()`` elements. The values are copied straight from ``t``'s strided
    layout into the pinned buffer, so no full-size pageable temporary is ever made.
    """
    shape = pin_memory_arguments(t, make_copy, match_shape)
    if not make_copy and is_pinned(t) and t.is_contiguous():
        # Already pinned in place: nothing to move. Flattening a contiguous tensor is a view, not a copy.
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
    """True iff ``t``'s whole byte extent is pinned host memory. Never touches data of meta/fake tensors."""
    check_tensor("t", t)
    if is_data_less(t) or t.device.type != "cpu" or t.numel() == 0:
        # No elements, no bytes to copy: torch reports data pointer 0, but its own is_pinned() looks at the
        # storage and may say True; the specification answers False on every backend and accelerator.
        return False
    ptr, nbytes = tensor_extent(t)
    if global_registry().contains(ptr, nbytes):
        return True
    return get_accelerator().has_torch_pinning and bool(t.is_pinned())


def unpin(t: torch.Tensor) -> bool:
    """Unpin the native allocation holding ``t`` now; True if this call unpinned it.

    "Holding ``t``" means holding ``t``'s byte extent at this call: after ``t.data`` was replaced, the new data
    is what is looked up, never a buffer ``t`` held before (docs/usage.md, "Pinning in place").

    The device registration, the page lock and the registry entry go at once; the memory stays valid until the
    last view dies. False for a second call, for torch-backend memory (torch owns and frees it) and for memory
    hostoffload did not pin.
    """
    check_tensor("t", t)
    if is_data_less(t) or t.device.type != "cpu":
        return False
    ptr, nbytes = tensor_extent(t)
    alloc = native_backend.allocation_of(ptr, nbytes, global_registry())
    return alloc.unpin() if alloc is not None else False


def pinned_stats() -> PinnedStats:
    """Counters of memory the native backend pinned (torch's allocator keeps its own: ``memory_stats()``)."""
    return native_backend.stats()
