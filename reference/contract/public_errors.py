"""Every public error class of hostoffload, named once.

The classes are defined where their concept lives (:mod:`reference.contract.errors`: the hierarchy and the errors
of every area but swap I/O; :mod:`reference.contract.io_errors`: the swap errors ``wait()`` raises); this module's
``__all__`` is the one list of them. ``optimized.errors`` and ``reference.errors`` re-export exactly this list
(``from reference.contract.public_errors import *``), and so the packages ``optimized`` and ``reference``, so that
a user catches ``optimized.CheckpointError`` whichever implementation raised it: one class object everywhere,
never a copy. A new error class added to the contract belongs here; ``conformance/selftest/test_public_errors.py``
fails until it is, and checks that every re-export is the class itself.

Contract: the names a user may import from either implementation's top level.
"""

from __future__ import annotations

from reference.contract.errors import (
    CheckpointError,
    CollectiveError,
    ConfigurationError,
    HostOffloadError,
    MissingDependencyError,
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
    "CheckpointError",
    "CollectiveError",
    "ConfigurationError",
    "DtypeMismatchError",
    "HandleClosedError",
    "HostOffloadError",
    "IncompleteRecordError",
    "MissingDependencyError",
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

#: The classes of ``__all__``, in its order.
PUBLIC_ERRORS: tuple[type[HostOffloadError], ...] = tuple(globals()[name] for name in __all__)
