"""What a request moves, and from where: the rules both implementations share.

The direct-versus-bounce decision is the point of the whole area. A tensor is used *directly* (the file calls
read or write its own memory) iff

1. it lives on the CPU and is contiguous (its bytes are one run; a strided view must be gathered first),
2. its whole byte extent is registered in the implementation's process-wide pinned-range registry (the
   registry rule of :mod:`reference.ranges`: inside ONE range, so any view or narrow of a pinned buffer or a
   slab piece qualifies, an extent straddling two ranges does not), and
3. when the request's file is open with ``O_DIRECT``, its address is :data:`~reference.contract.io_config.DIRECT_ALIGNMENT`
   aligned (the kernel rejects unaligned direct I/O buffers).

Everything else (pageable memory, unaligned views, strided views, device tensors) is staged through a bounce
buffer from the handle's own pinned pool, ``block_size`` bytes at a time.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import torch

from reference.contract.errors import ConfigurationError
from reference.contract.io_config import DIRECT_ALIGNMENT
from reference.contract.io_temporaries import temporary_name  # noqa: F401  (re-exported: both handles import it here)
from reference.contract.pinning_rules import is_data_less


def check_request(tensor: object, path: object, offset: object) -> tuple[torch.Tensor, str, int]:
    """Argument checks common to ``write`` and ``read``; ConfigurationError names the argument."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if is_data_less(tensor):
        raise ConfigurationError("tensor must hold data; meta and fake tensors cannot be swapped")
    if tensor.layout is not torch.strided:
        raise ConfigurationError(
            f"tensor must be a dense (strided) tensor, got layout {tensor.layout}; convert it with .to_dense()"
        )
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise ConfigurationError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str) or path == "":
        raise ConfigurationError(f"path must be a non-empty str path, got {path!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ConfigurationError(f"offset={offset!r} is not allowed; allowed values: an int >= 0 (bytes)")
    check_file_kind(path)
    return tensor, path, offset


#: File types that cannot hold records at offsets: a FIFO or socket blocks (no reader) or fails with ESPIPE, a
#: directory cannot be opened for data at all.
_REFUSED_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def check_file_kind(path: str) -> None:
    """Refuse, before anything is submitted, a ``path`` that exists and cannot hold records.

    A missing path is fine (a write creates it, a read reports it missing from ``wait()``); so are regular files
    and devices, which are seekable (a raw block device is a legitimate swap target). FIFOs, sockets and
    directories raise :class:`~reference.contract.errors.ConfigurationError` naming ``path`` at once: opening a FIFO without
    a peer blocks forever, which would hang the caller (reference) or a worker and ``close()`` (optimized).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing, or unreadable: the request itself reports it from wait()
    for test, kind in _REFUSED_KINDS:
        if test(mode):
            raise ConfigurationError(
                f"path={path!r} is {kind}; allowed values: a regular file (or a device), existing or not"
            )


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_direct(t: torch.Tensor, registry_contains, extent_of, o_direct: bool) -> bool:
    """The decision in the module docstring. ``registry_contains(ptr, nbytes)`` and ``extent_of(t)`` are the
    implementation's registry lookup and extent function."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    ptr, nbytes = extent_of(t)
    if not registry_contains(ptr, nbytes):
        return False
    return not o_direct or ptr % DIRECT_ALIGNMENT == 0


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (same memory, same device).

    ``as_strided`` rather than ``reshape``: torch calls a tensor with size-1 dimensions contiguous whatever their
    strides, and ``reshape`` keeps such a stride, which ``view(uint8)`` then rejects.
    """
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes, without copying.

    Through numpy's uint8 view of the tensor's bytes (numpy has no bfloat16, uint8 always works), which also keeps
    the tensor's storage alive for as long as the view exists.
    """
    return memoryview(flat_bytes(t.detach()).numpy())


@dataclass
class Staging:
    """The contiguous tensor a request really moves, and how to finish.

    ``source``: ``tensor`` itself when it is contiguous, else a contiguous temporary (one full-size copy: a
    strided tensor's bytes are not one run). For a read into a strided tensor the temporary is copied back into
    ``tensor`` when the payload has arrived (``finish``).
    """

    tensor: torch.Tensor
    source: torch.Tensor

    @classmethod
    def for_write(cls, t: torch.Tensor) -> Staging:
        return cls(t, t if t.is_contiguous() else t.contiguous())

    @classmethod
    def for_read(cls, t: torch.Tensor) -> Staging:
        return cls(t, t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device))

    def finish_read(self) -> None:
        if self.source is not self.tensor:
            self.tensor.copy_(self.source)


def blocks(nbytes: int, block_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of at most ``block_size`` covering ``nbytes``."""
    return [(a, min(a + block_size, nbytes)) for a in range(0, nbytes, block_size)]
