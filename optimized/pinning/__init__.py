"""The pinning API, optimized: same functions, arguments, errors and environment variables as
:mod:`reference.pinning`, over the native allocator and lock-free registry of ``optimized._native``.

``HOSTOFFLOAD_PIN_BACKEND`` picks where new pinned memory comes from (``torch``: torch's pinned allocator,
exactly as in the reference; ``native``: :mod:`optimized.pinning.native_backend`). Queries recognise memory
from either backend. Argument checks and environment parsing are the contract's (:mod:`reference.contract`), so
messages cannot drift; the allocation, the copy and the registry are this package's own.

``is_pinned`` is the hot call (every copy decision asks it), so it is a native function: plain contiguous CPU
tensors are answered by one registry lookup on ``(data_ptr, nbytes)``; a miss (a pageable tensor, the common case)
is answered natively too once the first miss under the current ``HOSTOFFLOAD_ACCELERATOR`` value has cached
whether that accelerator has torch pinning (False without it; torch's own ``Tensor.is_pinned()`` with it).
Everything else (subclasses such as fake tensors, meta and device tensors, strided views, non-tensors) goes
through the contract's checks.
"""

from __future__ import annotations

import os

import torch

from optimized import _native
from optimized.pinning import native_backend
from optimized.ranges import tensor_extent
from reference.contract import envvars
from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.envvars import ACCELERATOR_ENV
from reference.contract.pinning_rules import (
    PinnedStats,
    check_tensor,
    is_data_less,
    pin_empty_arguments,
    pin_empty_like_arguments,
    pin_memory_arguments,
    refuse_moving_a_view,
)

__all__ = [
    "PinnedStats",
    "is_pinned",
    "pin_empty",
    "pin_empty_like",
    "pin_memory",
    "pinned_stats",
    "unpin",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_is_functional = torch._is_functional_tensor
_native.set_tensor_types(_Tensor, _Parameter)
_registry_contains = _native.registry_contains


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Fresh pinned memory from the selected backend. Reads the environment now (see module docstring)."""
    backend = envvars.check_pinning_environment()
    accelerator: Accelerator = get_accelerator()
    if backend == "native":
        return native_backend.empty(shape, dtype, accelerator, envvars.pin_register_device())
    # torch's pinned allocator where the accelerator has one; elsewhere a documented no-op (pageable memory).
    return torch.empty(shape, dtype=dtype, pin_memory=accelerator.has_torch_pinning)


def pin_empty(
    *shape: int | tuple[int, ...], dtype: torch.dtype | None = None, device: object = None
) -> torch.Tensor:
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
    """``t``'s values in pinned host memory (see :func:`reference.pinning.pin_memory` for the contract).

    The copy goes straight from ``t``'s strided layout into the pinned buffer: no pageable temporary.
    """
    shape = pin_memory_arguments(t, make_copy, match_shape)
    if not make_copy and is_pinned(t) and t.is_contiguous():
        # Already pinned where it is: a flat result of a contiguous tensor is a view, no move.
        if not match_shape:
            t.data = t.data.view(shape)
        return t
    if not make_copy:
        refuse_moving_a_view(t)
    pinned = _allocate(shape, t.dtype)
    pinned.view(t.shape).copy_(t)
    if make_copy:
        return pinned
    with torch.no_grad():
        t.data = pinned
    return t


def _is_pinned_checked(t: object) -> bool:
    """The reference's path: argument check, data-less and device checks, then the registry rule.

    A plain tensor (not a subclass) on the CPU is data-less only as a functionalization wrapper, so plain
    strided CPU views skip the fake-tensor probe and go straight to their extent.
    """
    tp = type(t)
    if (tp is _Tensor or tp is _Parameter) and t.layout is _strided and t.is_cpu and not _is_functional(t):
        ptr, nbytes = tensor_extent(t)
    else:
        check_tensor("t", t)
        if is_data_less(t) or t.device.type != "cpu":
            return False
        ptr, nbytes = tensor_extent(t)
    if _registry_contains(ptr, nbytes):
        return True
    return _torch_reports_pinned(t)


_torch_pinning_by_env: dict[str | None, bool] = {}


def _torch_reports_pinned(t: torch.Tensor) -> bool:
    """Whether torch itself reports ``t`` pinned, where the current accelerator has torch pinning.

    Resolving the accelerator is the expensive part of a miss (entry points, availability), so the answer
    to "does it have torch pinning" is cached per value of ``HOSTOFFLOAD_ACCELERATOR``; the variable is still
    read at every call, and an invalid value still raises from ``get_accelerator`` (errors are never cached).
    """
    if t.numel() == 0:
        # No elements, no bytes: never pinned (torch's own is_pinned() looks at the storage and may say yes).
        return False
    key = os.environ.get(ACCELERATOR_ENV)
    has = _torch_pinning_by_env.get(key)
    if has is None:
        has = bool(get_accelerator().has_torch_pinning)
        _torch_pinning_by_env[key] = has
    # From now on the native is_pinned answers misses under this variable value itself (no call back into Python).
    _native.set_miss_answer(key, has)
    return has and bool(t.is_pinned())


def _is_pinned_fallback(t: object, hit: bool | None) -> bool:
    """The cases the native ``is_pinned`` does not answer itself.

    ``hit`` is False for a plain contiguous CPU tensor outside every registered range (only torch's own pinning
    can still say yes) and None for everything else (the reference's checks decide).
    """
    if hit is None:
        return _is_pinned_checked(t)
    return _torch_reports_pinned(t)


_native.set_is_pinned_fallback(_is_pinned_fallback)

#: ``is_pinned(t) -> bool``: True iff ``t``'s whole byte extent is pinned host memory; never touches the data
#: of meta or fake tensors. It is the hot call (every copy decision asks it), so it is one native function: a
#: plain contiguous CPU tensor whose ``(data_ptr, nbytes)`` lies in a registered range is answered without
#: running any Python; every other case goes through :func:`_is_pinned_fallback` (the reference's checks, the
#: same errors).
is_pinned = _native.is_pinned


def unpin(t: torch.Tensor) -> bool:
    """Unpin the native allocation holding ``t`` now; True if this call unpinned it.

    The device registration, the page lock and the registry entry go at once; the memory stays valid until the
    last view dies. False for a second call, for torch-backend memory (torch owns and frees it), for memory
    hostoffload did not pin, and for pieces of a :class:`optimized.slab.PinnedSlab` (the slab owns the pin:
    free the piece, or close the slab).
    """
    check_tensor("t", t)
    if is_data_less(t) or t.device.type != "cpu":
        return False
    ptr, nbytes = tensor_extent(t)
    return native_backend.unpin_extent(ptr, nbytes)


def pinned_stats() -> PinnedStats:
    """Counters of memory the native backend pinned (torch's allocator keeps its own: ``memory_stats()``)."""
    return native_backend.stats()
