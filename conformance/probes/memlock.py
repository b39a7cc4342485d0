"""Run in a child process: pin under a tiny RLIMIT_MEMLOCK without CAP_IPC_LOCK and report what happened.

Used by the suite's memlock test. It must run in its own process because dropping a capability and lowering a
resource limit cannot be undone, and the suite itself must keep pinning afterwards.

Usage: ``python -m conformance.probes.memlock <pinning module> <limit bytes> <request bytes>``; prints one JSON line.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import resource
import sys
import threading

_CAP_IPC_LOCK = 14
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_ipc_lock() -> bool:
    """Remove CAP_IPC_LOCK from this process (effective and permitted). True if it is gone afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return False
    mask = ~(1 << _CAP_IPC_LOCK) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        return False
    libc.capget(ctypes.byref(header), data)
    return not (data[0].effective >> _CAP_IPC_LOCK) & 1


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _mappings() -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for _ in fh)


def main() -> None:
    module, limit, request = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    api = importlib.import_module(module)
    import torch

    dropped = drop_ipc_lock()
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    small = api.pin_empty(1024, dtype=torch.uint8)  # under the limit: pinning itself works here
    small_pinned = bool(api.is_pinned(small))
    del small
    before = {"vmlck_kib": _status("VmLck"), "threads": threading.active_count(), "maps": _mappings(),
              "stats": list(api.pinned_stats())}
    error = None
    try:
        api.pin_empty(request, dtype=torch.uint8)
    except BaseException as exc:  # report whatever happened; the parent decides
        error = {"type": type(exc).__name__, "is_memory_error": isinstance(exc, MemoryError), "message": str(exc)}
    after = {"vmlck_kib": _status("VmLck"), "threads": threading.active_count(), "maps": _mappings(),
             "stats": list(api.pinned_stats())}
    print(json.dumps({"dropped_cap": dropped, "uid": os.getuid(), "small_pinned": small_pinned, "error": error,
                      "before": before, "after": after}))


if __name__ == "__main__":
    main()
