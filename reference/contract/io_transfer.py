"""What a request moves, and from where: the rules both implementations share.

The direct-versus-bounce decision is the point of the whole area. A tensor is used *directly* (the file calls
read or write its own memory) iff

1. it lives on the CPU and is contiguous (its bytes are one run; a strided view must be gathered first),
2. its whole byte extent is registered in the implementation's process-wide pinned-range registry (the
   registry rule of :mod:`reference.ranges`: inside ONE range, so any view or narrow of a pinned buffer or a
   slab piece qualifies, an extent straddling two ranges does not), and
3. when the request's file is open with ``O_DIRECT``, its address is
   :data:`~reference.contract.io_config.DIRECT_ALIGNMENT` aligned (the kernel rejects unaligned direct I/O buffers).

Everything else (pageable memory, unaligned views, strided views, device tensors) is staged through a bounce
buffer from the handle's own pinned pool, ``block_size`` bytes at a time.

Contract: the decision is observable (``SwapStats.direct_bytes``/``bounced_bytes``) and compared across
implementations, and the argument checks decide which error a bad request raises; both must be one definition.
"""

from __future__ import annotations

import os
import stat

import torch

from reference.contract.errors import ConfigurationError
from reference.contract.io_config import DIRECT_ALIGNMENT
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
    directories raise :class:`~reference.contract.errors.ConfigurationError` naming ``path`` at once: opening a FIFO
    without a peer blocks forever, which would hang the caller (reference) or a worker and ``close()`` (optimized).
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
