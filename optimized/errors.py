"""The error classes of hostoffload, importable from the implementation a user imports.

They are the shared contract's classes (:mod:`reference.contract.errors`, :mod:`reference.contract.io_errors`),
not copies: an ``except optimized.ConfigurationError`` catches what either implementation raises, and the
conformance suite checks both against the same classes.
"""

from __future__ import annotations

from reference.contract.errors import (
    ConfigurationError,
    HostOffloadError,
    PinnedAllocationError,
    PinnedMemoryLockError,
    UnknownPluginError,
    UnsupportedOperationError,
)
from reference.contract.io_errors import (
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

__all__ = [
    "ConfigurationError",
    "DtypeMismatchError",
    "HandleClosedError",
    "HostOffloadError",
    "IncompleteRecordError",
    "PinnedAllocationError",
    "PinnedMemoryLockError",
    "RecordError",
    "RecordFormatError",
    "ShortFileError",
    "SizeMismatchError",
    "SwapError",
    "SwapFileNotFoundError",
    "SwapIOError",
    "SwapNoSpaceError",
    "UnknownPluginError",
    "UnsupportedOperationError",
]
