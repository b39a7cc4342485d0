"""The pinning API, optimized: same functions, arguments, errors and environment variables as
:mod:`reference.pinning`, over the native allocator and lock-free registry of ``optimized._native``.

``HOSTOFFLOAD_PIN_BACKEND`` picks where new pinned memory comes from (``torch``: torch's pinned allocator;
``native``: :mod:`optimized.pinning.native_backend`). Queries recognise memory from either backend. Argument checks,
messages and result types come from the contract (:mod:`reference.contract.pinning_rules`,
:mod:`reference.contract.envvars`, :mod:`reference.contract.accelerators`); nothing here imports the reference's
pinning or ranges modules, which are the oracle the suite compares this module against.

``is_pinned`` is the hot call (every copy decision asks it); how it decides is written down once, at
:data:`is_pinned` below.
"""

from __future__ import annotations

import os
from typing import Any

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
    torch_empty,
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
_native.set_tensor_types(_Tensor, _Parameter, _strided)
_registry_contains = _native.registry_contains


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Fresh pinned memory from the selected backend. Reads the environment now (see module docstring)."""
    backend = envvars.check_pinning_environment()
    accelerator: Accelerator = get_accelerator()
    if backend == "native":
        return native_backend.empty(shape, dtype, accelerator, envvars.pin_register_device())
    # torch's pinned allocator where the accelerator has one; elsewhere a documented no-op (pageable memory).
    return torch_empty(shape, dtype, pin_memory=accelerator.has_torch_pinning)


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


# ---- is_pinned ------------------------------------------------------------------------------------------------------
#: ``is_pinned(t) -> bool``: True iff ``t``'s whole byte extent is pinned host memory; never touches the data of
#: meta or fake tensors. It is one native function (``optimized._native.is_pinned``, csrc/module.cpp), which
#: decides, in this order:
#:
#: 1. a plain (``torch.Tensor``/``Parameter``) contiguous CPU tensor whose ``(data_ptr, nbytes)`` lies inside one
#:    range of the native registry: True;
#: 2. a plain strided tensor that is not on the CPU (a device or meta tensor): False, without running Python;
#: 3. a plain contiguous CPU tensor outside every range (a miss): False where the current accelerator has no
#:    torch pinning, and for a tensor with no elements; otherwise what torch reports: asked from C++ of the CUDA
#:    runtime (``cudaPointerGetAttributes``, csrc/cuda_loader) on the stock CUDA accelerator, else through
#:    ``Tensor.is_pinned()``. Which applies is cached per value of ``HOSTOFFLOAD_ACCELERATOR`` (and per forked
#:    process) by :func:`_answer_misses`, the first time a miss reaches Python;
#: 4. anything else (subclasses such as fake tensors, strided views, sparse layouts, non-tensors):
#:    :func:`_is_pinned_general`, the specification's checks with the contract's errors.
is_pinned = _native.is_pinned


def _is_pinned_general(t: Any, hit: bool | None) -> bool:  # whatever is_pinned() got: check_tensor checks it
    """Steps 3 (``hit`` False: a miss the native side could not answer yet) and 4 (``hit`` None) of
    :data:`is_pinned`; installed as the native function's fallback."""
    if hit is None:
        tp = type(t)
        # A plain tensor on the CPU is data-less only as a functionalization wrapper, so plain strided CPU views
        # skip the fake-tensor probe and go straight to their extent.
        if not ((tp is _Tensor or tp is _Parameter) and t.layout is _strided and t.is_cpu and not _is_functional(t)):
            check_tensor("t", t)
            if is_data_less(t) or t.device.type != "cpu":
                return False
        ptr, nbytes = tensor_extent(t)
        if _registry_contains(ptr, nbytes):
            return True
    if t.numel() == 0:
        # No elements, no bytes: never pinned (torch's own is_pinned() looks at the storage and may say yes).
        return False
    return _answer_misses() and bool(t.is_pinned())


_torch_pinning_by_env: dict[str | None, bool] = {}


def _answer_misses() -> bool:
    """Whether the current accelerator has torch pinning (so torch decides a miss), cached per value of
    ``HOSTOFFLOAD_ACCELERATOR``; tells the native ``is_pinned`` to answer later misses itself.

    Resolving the accelerator is the expensive part (entry points, availability); the variable is still read at
    every call, and an invalid value still raises from ``get_accelerator`` (errors are never cached).
    """
    key = os.environ.get(ACCELERATOR_ENV)
    has = _torch_pinning_by_env.get(key)
    if has is None:
        has = bool(get_accelerator().has_torch_pinning)
        _torch_pinning_by_env[key] = has
    cuda_pointers = has and native_backend.is_stock_cuda(get_accelerator())
    _native.set_miss_answer(key, has, cuda_pointers)
    return has


_native.set_is_pinned_fallback(_is_pinned_general)


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
