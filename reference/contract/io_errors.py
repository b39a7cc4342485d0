"""Errors of the swap I/O area, shared by every implementation of it.

Argument mistakes are :class:`~reference.contract.errors.ConfigurationError` and are raised at once, by the call that
received the argument. Everything that can only be known once the file is touched (a missing directory, a short
file, a record of another dtype, a full disk, a write failing half way) is a :class:`SwapError`, stored on the
request and raised by ``wait()``: an asynchronous implementation cannot raise it any earlier, so the blocking
reference raises it at the same place to keep the two interchangeable.

Each class also derives from the builtin a Python user would reach for (``OSError`` and ``FileNotFoundError``
for operating-system failures, ``EOFError`` for a file that ends too early, ``ValueError`` for a record that does
not match the tensor), so existing ``except`` clauses keep working.

``__all__`` is the area's error classes, which ``reference.io`` and ``optimized.io`` re-export (and the io area's
protocol requires); the helpers :func:`swap_io_error` and :func:`with_cause` are for implementations, imported by
name.

Contract: which class a failed request raises, and from where (``wait()``), is what makes the blocking
reference and an asynchronous handle interchangeable; both raise these classes.
"""

from __future__ import annotations

import errno as _errno

from reference.contract.errors import HostOffloadError, UnsupportedOperationError


class SwapError(HostOffloadError):
    """A swap request failed. Raised by ``wait()``; ``request`` is the failed request (or None)."""

    request: object = None


class SwapIOError(SwapError, OSError):
    """The operating system refused an I/O call of the request; ``errno``/``filename`` say which and where."""

    def __init__(self, message: str, err: int | None = None, filename: str | None = None) -> None:
        OSError.__init__(self, err, message, filename) if err is not None else OSError.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SwapFileNotFoundError(SwapIOError, FileNotFoundError):
    """Reading a file that does not exist, or writing into a directory that does not exist."""


class SwapNoSpaceError(SwapIOError):
    """The filesystem ran out of space (ENOSPC) or quota (EDQUOT) during a write."""


class ShortFileError(SwapError, EOFError):
    """The file ends before the record the read asked for (truncated, or an offset past its end)."""


class RecordError(SwapError, ValueError):
    """The bytes at the requested offset are not a usable record for this tensor."""


class RecordFormatError(RecordError):
    """No swap record starts at the requested offset (wrong magic, version or header size)."""


class IncompleteRecordError(RecordError):
    """The record's write did not finish (it failed, or is still being written by another handle)."""


class DtypeMismatchError(RecordError):
    """The record holds another dtype than the tensor it is read into."""


class SizeMismatchError(RecordError):
    """The record holds another number of bytes than the tensor it is read into."""


class HandleClosedError(UnsupportedOperationError):
    """A request submitted to a handle after ``close()``."""


def swap_io_error(op: str, path: str, exc: OSError) -> SwapIOError:
    """Translate an ``OSError`` raised by ``op`` on ``path`` into the matching :class:`SwapIOError`."""
    code = exc.errno
    reason = exc.strerror or str(exc)
    if code == _errno.ENOENT:
        return SwapFileNotFoundError(f"{op} {path!r}: no such file or directory ({reason})", code, path)
    if code in (_errno.ENOSPC, _errno.EDQUOT):
        return SwapNoSpaceError(f"{op} {path!r}: out of space ({reason})", code, path)
    return SwapIOError(f"{op} {path!r} failed: {reason} (errno {code})", code, path)


def with_cause(error: SwapError, cause: BaseException) -> SwapError:
    """Attach ``cause`` as the error's ``__cause__`` (the original traceback stays visible)."""
    error.__cause__ = cause
    return error

__all__ = [
    "DtypeMismatchError",
    "HandleClosedError",
    "IncompleteRecordError",
    "RecordError",
    "RecordFormatError",
    "ShortFileError",
    "SizeMismatchError",
    "SwapError",
    "SwapFileNotFoundError",
    "SwapIOError",
    "SwapNoSpaceError",
]
