"""A pinned slab: one large locked (and device-registered) allocation, handed out in aligned pieces.

Why: pinning is expensive per call (locking and, above all, registering pages with the device costs tens of
microseconds to milliseconds and grows the driver's tables), while activation offload and ZeRO offload need
many pinned buffers of varying sizes, often per step. A slab pays for pinning once; pieces are then carved out
and returned in microseconds, and every piece is recognised by ``is_pinned`` (of :mod:`optimized.pinning`)
because it lies inside the slab's single registered range.

Usage::

    from optimized.slab import PinnedSlab

    with PinnedSlab(256 << 20) as slab:                  # 256 MiB, pinned + registered now
        grads = slab.allocate(1024, 1024, dtype=torch.bfloat16)   # a pinned piece (uninitialised)
        acts = slab.allocate_like(activation)             # same shape/dtype as a tensor
        ...                                               # copy with non_blocking=True in and out
        slab.free(grads)                                  # the bytes may be handed out again
        print(slab.stats())                               # SlabStats(capacity, used, free, largest_free, ...)
    # leaving the block unpins the slab (unregister + munlock at once);
    # the memory is unmapped when the last piece dies

Rules:

- Pieces are views of the slab's base tensor: they keep the mapping alive, so a piece that outlives ``free``
  or ``close`` never points at unmapped memory. After ``free`` its bytes may back a new piece, so writing
  through a freed piece corrupts that piece: the same discipline as any allocator.
- ``free`` takes the piece tensor itself (or any tensor starting at the piece's first byte). Freeing something
  that is not a live piece raises ``ConfigurationError``; so does a second ``free``.
- ``unpin`` (pinning API) of a piece returns False: the slab owns the pin. ``close()`` unpins the slab.
- ``allocate`` raises ``MemoryError`` when no free run fits (the slab never grows: size it up front), and
  ``UnsupportedOperationError`` after ``close``.
- Thread-safe: the offset allocator is native and locked; pieces are coarse-grained.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from optimized import _native
from optimized.pinning import native_backend
from reference.contract import envvars
from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.pinning_rules import check_dtype, check_tensor, normalize_shape

__all__ = ["DEFAULT_ALIGNMENT", "PinnedSlab", "SlabStats"]

#: Default piece alignment: a cache line pair and the widest vector loads; device copy engines want >= 64.
DEFAULT_ALIGNMENT = 256


class SlabStats(NamedTuple):
    """``capacity``: slab bytes (page-rounded). ``used``: bytes requested by live pieces. ``free``: bytes not
    held by a live piece (alignment padding counts as free). ``largest_free``: the longest free run, i.e.
    the largest piece that can be allocated with alignment 1. ``pieces``: live pieces. ``free_blocks``:
    free runs (fragmentation indicator)."""

    capacity: int
    used: int
    free: int
    largest_free: int
    pieces: int
    free_blocks: int


def _check_alignment(alignment: object) -> int:
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment < 1
        or alignment & (alignment - 1)
    ):
        raise ConfigurationError(f"alignment must be a power of two >= 1, got {alignment!r}")
    return alignment


class PinnedSlab:
    """One pinned allocation of ``nbytes`` (page-rounded) with sub-allocation.

    ``register``: register with the accelerator (default: ``HOSTOFFLOAD_PIN_REGISTER_DEVICE``, on).
    ``accelerator``: an :class:`~reference.contract.accelerators.Accelerator` or its name (default: the current one).
    ``alignment``: default alignment of pieces (power of two).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        register: bool | None = None,
        accelerator: Accelerator | str | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ConfigurationError(f"nbytes must be an int >= 1, got {nbytes!r}")
        self._alignment = _check_alignment(alignment)
        resolved = accelerator if isinstance(accelerator, Accelerator) else get_accelerator(accelerator)
        if register is None:
            register = envvars.pin_register_device()
        elif not isinstance(register, bool):
            raise ConfigurationError(f"register must be True, False or None, got {register!r}")
        self._base = native_backend.allocate(nbytes, resolved, register, slab=True)
        self._ptr = self._base.data_ptr()
        self._capacity = self._base.numel()
        self._arena = _native.SlabArena(self._capacity)
        self._lock = threading.Lock()
        self._closed = False

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable bytes (the requested size rounded up to whole pages)."""
        return self._capacity

    @property
    def data_ptr(self) -> int:
        """Address of the slab's first byte."""
        return self._ptr

    @property
    def base(self) -> torch.Tensor:
        """The whole slab as a flat uint8 tensor (a view; it keeps the memory mapped)."""
        return self._base

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def registered(self) -> bool:
        """True while the slab is registered with the device."""
        alloc = _native.allocation_of(self._ptr, 0)
        return bool(alloc is not None and alloc.registered)

    # -- pieces --------------------------------------------------------------------------------------------
    def allocate(
        self, *shape: int | tuple[int, ...], dtype: torch.dtype | None = None, alignment: int | None = None
    ) -> torch.Tensor:
        """A new uninitialised piece of ``shape``/``dtype`` (contiguous), aligned to ``alignment`` bytes."""
        dims = normalize_shape(shape)
        dt = check_dtype(dtype)
        align = self._alignment if alignment is None else _check_alignment(alignment)
        itemsize = torch.empty((), dtype=dt).element_size()
        numel = 1
        for s in dims:
            numel *= s
        nbytes = numel * itemsize
        align = max(align, itemsize)  # a typed view needs at least element alignment
        with self._lock:
            if self._closed:
                raise UnsupportedOperationError("allocate() on a closed PinnedSlab")
            offset = self._arena.allocate(nbytes, align)
        if offset is None:
            s = self._arena.stats()
            raise MemoryError(
                f"PinnedSlab cannot fit {nbytes} bytes (alignment {align}): "
                f"{s.free} of {s.capacity} bytes free, "
                f"largest free run {s.largest_free} bytes; size the slab larger or free pieces"
            )
        return self._base[offset : offset + nbytes].view(dt).view(dims)

    def allocate_like(
        self, t: torch.Tensor, *, dtype: torch.dtype | None = None, alignment: int | None = None
    ) -> torch.Tensor:
        """A new piece with ``t``'s shape and dtype (unless ``dtype`` is given); ``t`` may live anywhere."""
        check_tensor("t", t)
        return self.allocate(
            tuple(t.shape), dtype=dtype if dtype is not None else t.dtype, alignment=alignment
        )

    def _offset_of(self, piece: torch.Tensor) -> int:
        check_tensor("piece", piece)
        if piece.device.type != "cpu" or piece.is_meta:
            raise ConfigurationError(
                f"piece must be a CPU tensor from this slab, got a tensor on {piece.device}"
            )
        offset = piece.data_ptr() - self._ptr
        if not 0 <= offset < max(self._capacity, 1):
            raise ConfigurationError(
                "piece must be a tensor allocated from this slab; it lies outside the slab"
            )
        return offset

    def owns(self, piece: torch.Tensor) -> bool:
        """True if ``piece`` starts at a live piece of this slab."""
        try:
            offset = self._offset_of(piece)
        except ConfigurationError:
            return False
        return self._arena.piece_size(offset) is not None

    def free(self, piece: torch.Tensor) -> None:
        """Return ``piece``'s bytes to the slab. Raises ConfigurationError if it is not a live piece."""
        offset = self._offset_of(piece)
        if not self._arena.release(offset):
            raise ConfigurationError(
                f"piece at offset {offset} of the slab is not a live piece "
                "(freed twice, or a view into a piece)"
            )

    def stats(self) -> SlabStats:
        s = self._arena.stats()
        return SlabStats(s.capacity, s.used, s.free, s.largest_free, s.pieces, s.free_blocks)

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> bool:
        """Unpin the slab now (unregister, munlock, drop its range); True if this call did it.

        Pieces stay readable and writable (the mapping lives until the last piece dies) but are no longer
        pinned.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        alloc = _native.allocation_of(self._ptr, 0)
        return bool(alloc is not None and alloc.unpin())

    def __enter__(self) -> PinnedSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return f"<PinnedSlab {state} capacity={s.capacity} used={s.used} pieces={s.pieces} at {self._ptr:#x}>"
