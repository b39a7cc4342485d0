"""Tensor swap I/O, reference implementation: a blocking twin of :mod:`optimized.io`.

A :class:`SwapHandle` writes tensors to files as self-describing records and reads them back, using a
caller's tensor directly when its whole extent is registered pinned memory and a bounce buffer otherwise. The
config (:mod:`reference.contract.io_config`), the stats (:mod:`reference.contract.io_stats`), the errors
(:mod:`reference.contract.io_errors`), the record format (:mod:`reference.contract.io_record`), the temporaries
(:mod:`reference.contract.io_temporaries`) and the direct-versus-bounce rule (:mod:`reference.contract.io_transfer`)
are the area's shared contract: every implementation imports them from :mod:`reference.contract`; this package
re-exports the public ones so that ``reference.io`` and ``optimized.io`` offer the same names.

Usage::

    from reference.io import SwapHandle

    with SwapHandle(block_size=1 << 20) as h:
        h.write(state, "/nvme/swap/part0.bin").wait()
        h.read(state_buffer, "/nvme/swap/part0.bin").wait()
"""

from __future__ import annotations

from reference.contract import io_errors
from reference.contract.io_config import DIRECT_ALIGNMENT, SwapConfig
from reference.contract.io_errors import *  # noqa: F403  (the area's error classes: io_errors.__all__)
from reference.contract.io_record import HEADER_SIZE, record_nbytes, record_span
from reference.contract.io_stats import SwapStats
from reference.io.handle import SwapHandle, SwapRequest

__all__ = [
    *io_errors.__all__,
    "DIRECT_ALIGNMENT",
    "HEADER_SIZE",
    "SwapConfig",
    "SwapHandle",
    "SwapRequest",
    "SwapStats",
    "record_nbytes",
    "record_span",
]
