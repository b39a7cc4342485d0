"""Tensor swap I/O, optimized: an asynchronous handle that writes pinned tensors without a bounce copy.

Same names, arguments, records and errors as :mod:`reference.io` (the config, errors and record format are
imported from there, so they cannot drift); see :mod:`optimized.io.handle` for how requests are executed and
``docs/io.md`` for usage and tuning.
"""

from __future__ import annotations

from optimized.io.handle import SwapHandle, SwapRequest
from reference.contract import io_errors
from reference.contract.io_config import (
    DIRECT_ALIGNMENT,
    SwapConfig,
)
from reference.contract.io_errors import *  # noqa: F403  (the area's error classes: io_errors.__all__)
from reference.contract.io_record import (
    HEADER_SIZE,
    record_nbytes,
    record_span,
)
from reference.contract.io_stats import SwapStats

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
