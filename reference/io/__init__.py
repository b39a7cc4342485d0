"""Tensor swap I/O, reference implementation: a blocking twin of :mod:`optimized.io`.

A :class:`SwapHandle` writes tensors to files as self-describing records and reads them back, using a
caller's tensor directly when its whole extent is registered pinned memory and a bounce buffer otherwise. The
config (:mod:`reference.io.config`), the errors (:mod:`reference.io.errors`), the record format
(:mod:`reference.io.record`) and the direct-versus-bounce rule (:mod:`reference.io.transfer`) are the area's
shared contract: every implementation imports them from here.

Usage::

    from reference.io import SwapHandle

    with SwapHandle(block_size=1 << 20) as h:
        h.write(state, "/nvme/swap/part0.bin").wait()
        h.read(state_buffer, "/nvme/swap/part0.bin").wait()
"""

from __future__ import annotations

from reference.io.config import DIRECT_ALIGNMENT, SwapConfig, SwapStats
from reference.io.errors import (
    DtypeMismatchError,
    HandleClosedError,
    IncompleteRecordError,
    RecordError,
    RecordFormatError,
    ShortFileError,
    SizeMismatchError,
    SwapError,
    SwapFileNotFoundError,
    SwapIOError,
    SwapNoSpaceError,
)
from reference.io.handle import SwapHandle, SwapRequest
from reference.io.record import HEADER_SIZE, record_nbytes, record_span

__all__ = [
    "DIRECT_ALIGNMENT",
    "HEADER_SIZE",
    "DtypeMismatchError",
    "HandleClosedError",
    "IncompleteRecordError",
    "RecordError",
    "RecordFormatError",
    "ShortFileError",
    "SizeMismatchError",
    "SwapConfig",
    "SwapError",
    "SwapFileNotFoundError",
    "SwapHandle",
    "SwapIOError",
    "SwapNoSpaceError",
    "SwapRequest",
    "SwapStats",
    "record_nbytes",
    "record_span",
]
