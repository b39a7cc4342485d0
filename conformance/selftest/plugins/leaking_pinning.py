"""The reference pinning API, except that a *failed* ``pin_empty`` leaves 64 KiB of locked memory behind.

The leak is outside the implementation's own accounting (``pinned_stats()`` does not change), like a native
error path that forgets its ``munlock``/``munmap``: only an observer of the process (VmLck) can see it.
"""

from __future__ import annotations

import ctypes
import mmap

from reference.pinning import *  # noqa: F403 (the whole area API, unchanged)
from reference.pinning import __all__ as _REFERENCE_ALL
from reference.pinning import pin_empty as _pin_empty

_LEAK_BYTES = 64 * 1024
_LEAKED: list[mmap.mmap] = []  # kept alive forever: the pages stay locked
_libc = ctypes.CDLL(None, use_errno=True)


def _lock_scratch() -> None:
    buf = mmap.mmap(-1, _LEAK_BYTES)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(_LEAK_BYTES)) == 0:
        _LEAKED.append(buf)


def pin_empty(*size, **kwargs):
    try:
        return _pin_empty(*size, **kwargs)
    except Exception:
        _lock_scratch()  # the error path forgets to release its locked scratch buffer
        raise


__all__ = list(_REFERENCE_ALL)
