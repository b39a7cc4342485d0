"""The pinning and ranges rules every implementation shares: result types, argument checks and their messages.

Contract, not oracle: the reference's pinning and ranges modules are the executable specification the suite
compares implementations with; an implementation that imported them would share the oracle's bugs and hide them
from the comparison. What must be identical in every implementation lives here instead: the result types
(``PinnedRange``, what a registry's ``find``/``ranges`` return, and ``PinnedStats``, what ``pinned_stats()``
returns), which arguments each pinning call refuses with which ``ConfigurationError`` (the suite feeds every
implementation the same bad input), and the in-place rule for views. How memory is then pinned is each
implementation's own.

The optimized native registry reports argument errors through :func:`check_range_int` and :func:`check_range_end`
(called from C++ only once its own fast checks failed), so each message is written once, here.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from typing import NamedTuple

import torch

from reference.contract.errors import ConfigurationError, PinnedAllocationError

__all__ = [
    "MAX_NBYTES",
    "QUANTIZED_DTYPES",
    "PinnedRange",
    "PinnedStats",
    "allocation_error",
    "check_bool",
    "check_dtype",
    "check_host_device",
    "check_host_tensor",
    "check_nbytes",
    "check_plain_source",
    "check_range_end",
    "check_range_int",
    "check_tensor",
    "is_data_less",
    "is_torch_allocation_failure",
    "normalize_shape",
    "pin_empty_arguments",
    "pin_empty_like_arguments",
    "pin_memory_arguments",
    "refuse_moving_a_view",
    "shares_storage",
    "torch_empty",
]


# ---- value types ------------------------------------------------------------------------------------------------
class PinnedRange(NamedTuple):
    """One registered range: its first byte, its length, and an opaque owner token (an int)."""

    start: int
    nbytes: int
    owner: int


class PinnedStats(NamedTuple):
    """Counters of memory pinned by the native backend.

    ``allocations`` and ``bytes``: allocations that are pinned now and their page-rounded locked bytes.
    ``registered_bytes``: the part of ``bytes`` registered with the device. ``unpinned_alive``: allocations that
    were unpinned (or inherited through ``fork()``: docs/usage.md, "After fork()") but are still mapped because a
    view references them.
    """

    allocations: int
    bytes: int
    registered_bytes: int
    unpinned_alive: int


# ---- ranges arguments -------------------------------------------------------------------------------------------
def check_range_int(name: str, value: object, minimum: int, limit: int | None = None) -> int:
    """An int ``>= minimum`` (and ``< limit`` where the registry stores bounded words); else ``ConfigurationError``
    naming the argument and the allowed values."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value}")
    if limit is not None and value >= limit:
        raise ConfigurationError(
            f"{name} must be an int < {_power_of_two(limit)} (a 64-bit address or size), got {value}"
        )
    return value


def check_range_end(start: int, nbytes: int, limit: int | None = None) -> None:
    """A range must end inside the address space a bounded registry stores (``start + nbytes <= limit``)."""
    if limit is not None and start + nbytes > limit:
        raise ConfigurationError(
            f"start + nbytes must be <= {_power_of_two(limit)} (the range must fit the address space), "
            f"got {start} + {nbytes}"
        )


def _power_of_two(limit: int) -> str:
    bits = limit.bit_length() - 1
    return f"2**{bits}" if limit == 1 << bits else str(limit)


# ---- tensors ------------------------------------------------------------------------------------------------------
def is_data_less(t: torch.Tensor) -> bool:
    """True for tensors whose data must not (or cannot) be touched: meta tensors and fake tensors.

    A fake tensor may claim ``device='cpu'``, so the device check alone is not enough; and reading
    ``data_ptr()`` of one raises, which is exactly what ``is_pinned`` must never do.
    """
    if t.is_meta:
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return bool(is_fake(t))


def check_tensor(name: str, t: object) -> torch.Tensor:
    """A tensor with a dense (strided) layout. Sparse, sparse-compressed, jagged and mkldnn tensors have no single
    byte extent to pin or look up, so every pinning call refuses them by name instead of failing inside torch. A
    strided nested tensor passes: its components are packed in one buffer, which is its extent (``ranges``); only
    the calls that would build a dense copy of it refuse it (:func:`check_plain_source`)."""
    if not isinstance(t, torch.Tensor):
        raise ConfigurationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ConfigurationError(
            f"{name} must be a dense (strided) tensor, got layout {t.layout}; convert it with .to_dense() first"
        )
    return t


#: The largest allocation a pinning call accepts: what a signed 64-bit byte count (torch's, mmap's) can hold.
MAX_NBYTES = 2**63 - 1


def check_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The byte count of ``shape``/``dtype``, refused by name when no allocator could ever hold it."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_NBYTES:
        raise ConfigurationError(
            f"shape {shape!r} of {dtype} is {nbytes} bytes; allowed values: at most {MAX_NBYTES} bytes (2**63 - 1)"
        )
    return nbytes


#: Quantized dtypes: their values mean something only with the tensor's quantizer (scale, zero point), which a
#: pinned buffer of that dtype would not have (torch builds one that cannot be read or copied into).
QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def check_plain_source(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor whose shape and values a plain dense pinned tensor can hold. Refused by name: a nested tensor (it
    has no single shape; pin its buffer or its components) and a quantized one (its quantizer would be lost)."""
    if t.is_nested:
        raise ConfigurationError(
            f"{name} is a nested tensor: it has no single shape for a dense pinned copy; allowed: a dense tensor "
            f"(pin each component of {name}.unbind(), or a dense buffer you build the nested tensor from)"
        )
    if t.dtype in QUANTIZED_DTYPES:
        raise ConfigurationError(
            f"{name} is quantized ({t.dtype}): a pinned copy of its integers would lose its scale and zero point; "
            f"allowed: a dense tensor of a plain dtype (pin {name}.int_repr() and keep {name}.q_scale() / "
            f"{name}.q_zero_point() beside it)"
        )
    return t


def check_host_tensor(name: str, t: object) -> torch.Tensor:
    t = check_tensor(name, t)
    if is_data_less(t) or t.device.type != "cpu":
        what = "a meta/fake tensor" if is_data_less(t) else f"a tensor on {t.device}"
        raise ConfigurationError(f"{name} must be a CPU tensor with data (device 'cpu'), got {what}")
    return t


def normalize_shape(shape: Sequence[object]) -> tuple[int, ...]:
    """Accept ``pin_empty(2, 3)`` and ``pin_empty((2, 3))`` alike; every size an int >= 0."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    out = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigurationError(f"shape must be ints >= 0, got {tuple(shape)!r}")
        out.append(int(s))
    return tuple(out)


def check_dtype(dtype: object) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if dtype in QUANTIZED_DTYPES:
        raise ConfigurationError(
            f"dtype={dtype} is quantized: a pinned buffer of it has no scale or zero point; allowed: a plain dtype "
            f"(pin the tensor's int_repr() and keep its q_scale() / q_zero_point() beside it)"
        )
    return dtype


def check_host_device(device: object) -> None:
    """``pin_empty*`` allocate host memory only; a device argument may say so, nothing else."""
    if device is None:
        return
    try:
        dev = torch.device(device)  # type: ignore[call-overload]  # any object: torch.device() is the check
    except (RuntimeError, TypeError):
        raise ConfigurationError(f"device must be None or 'cpu', got {device!r}") from None
    if dev.type != "cpu":
        raise ConfigurationError(
            f"device must be None or 'cpu' (pinned memory is host memory), got {device!r}"
        )


def check_bool(name: str, value: object) -> bool:
    """A flag argument: True or False, nothing truthy in between."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def pin_empty_arguments(shape: Sequence[object], dtype: object, device: object) -> tuple[tuple[int, ...], torch.dtype]:
    """The checks of ``pin_empty(*shape, dtype, device)``, in the order every implementation applies them;
    returns the shape and dtype to allocate."""
    dims = normalize_shape(shape)
    dt = check_dtype(dtype)
    check_host_device(device)
    check_nbytes(dims, dt)
    return dims, dt


def pin_empty_like_arguments(t: object, dtype: object) -> tuple[tuple[int, ...], torch.dtype]:
    """The checks of ``pin_empty_like(t, dtype)`` (``t`` may live anywhere, even on meta: only its shape and dtype
    are read); returns the shape and dtype to allocate."""
    t = check_tensor("t", t)
    if dtype is None or t.is_nested:
        check_plain_source("t", t)
    dims, dt = tuple(t.shape), check_dtype(dtype if dtype is not None else t.dtype)
    check_nbytes(dims, dt)
    return dims, dt


def pin_memory_arguments(t: object, make_copy: object, match_shape: object) -> tuple[int, ...]:
    """The checks of ``pin_memory(t, make_copy, match_shape)``; returns the shape of the pinned result (``t``'s, or
    flat with ``match_shape=False``). The in-place rule for views is :func:`refuse_moving_a_view`."""
    t = check_plain_source("t", check_host_tensor("t", t))
    check_bool("make_copy", make_copy)
    check_bool("match_shape", match_shape)
    return tuple(t.shape) if match_shape else (t.numel(),)


def shares_storage(t: torch.Tensor) -> bool:
    """True if ``t`` is a view of another tensor or a window into a storage larger than its own elements.

    Such a tensor cannot be moved onto new memory in place without detaching it from the storage it shares
    (docs/usage.md, "Pinning in place"). What torch does not record cannot be seen: a tensor made by
    ``detach()`` or read from ``.data`` before the call spans the same storage without being a view, and keeps
    the old memory.
    """
    if t._base is not None or t.storage_offset() != 0:
        return True
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def refuse_moving_a_view(t: torch.Tensor) -> None:
    """``pin_memory(t, make_copy=False)`` on memory that is not pinned yet: refuse a ``t`` that shares its storage
    (replacing its ``.data`` would silently cut it off from its base), before anything is allocated."""
    if shares_storage(t):
        raise ConfigurationError(
            "make_copy=False cannot move t onto pinned memory: t is a view of another tensor or a window "
            f"into a storage it does not span (shape {tuple(t.shape)}, storage offset {t.storage_offset()}), "
            "and replacing its data would detach it from that storage; pin the base tensor in place, or pass "
            "make_copy=True"
        )


# ---- allocation failures ----------------------------------------------------------------------------------------
def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value} bytes"


def _read_first(path: str, key: str | None = None) -> str | None:
    try:
        with open(path) as fh:
            for line in fh:
                if key is None:
                    return line.strip()
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def allocation_error(nbytes: int, backend: str, cause: str) -> PinnedAllocationError:
    """The one error of every backend when host memory for a pinning call cannot be allocated at all: it names
    the size and what limits it here (available memory, the overcommit policy, the address-space and
    locked-memory limits), so the user can tell a typo in a size from a machine that is too small. The caller
    raises it ``from`` the backend's own error (torch's ``alloc_cpu.cpp`` enforce message, ``mmap``'s errno)."""
    available = _read_first("/proc/meminfo", "MemAvailable")
    overcommit = _read_first("/proc/sys/vm/overcommit_memory")
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return PinnedAllocationError(
        f"cannot allocate {nbytes} bytes ({nbytes / 2**30:.3g} GiB) of host memory to pin ({backend} backend: "
        f"{cause}); what limits it here: available memory (MemAvailable) {available or 'unknown'}, "
        f"vm.overcommit_memory={overcommit or 'unknown'} (0: requests far beyond RAM + swap are refused, 2: strict "
        f"accounting), RLIMIT_AS {_limit(address_space)}, RLIMIT_MEMLOCK {_limit(memlock)} (what can then be "
        f"page-locked); allowed: a size the machine can hold, or more memory or looser limits. Nothing was pinned"
    )


def is_torch_allocation_failure(exc: BaseException) -> bool:
    """Whether an error from ``torch.empty`` (with or without ``pin_memory``) of a size the arguments already
    accepted is the allocator running out: torch's CPU allocator raises a plain ``RuntimeError`` ("can't
    allocate memory"), its pinned allocator an out-of-memory error; anything else is not ours to rename."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool) -> torch.Tensor:
    """``torch.empty`` for the torch backend of every implementation: its allocator running out is the contract's
    :class:`PinnedAllocationError` naming the size and the limits (:func:`allocation_error`), not torch's raw
    enforce message; any other error is torch's own."""
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as exc:
        if not is_torch_allocation_failure(exc):
            raise
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raise allocation_error(nbytes, "torch", str(exc).splitlines()[0][:200]) from exc
