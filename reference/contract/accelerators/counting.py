"""A host accelerator whose peak-memory counter reports what a test sets: ``gpu_memory_limit`` made measurable on
a machine without a device.

The limit (docs/accumulation.md R28, :mod:`reference.contract.accumulation_limit`) is fitted from the peak device
memory an engine's accelerator counts; the cpu accelerator counts nothing, so there the limit is refused. Its
refusals and its split must still be checked on the CPU (the suite's CI has no device), so this device stands in:
the host in every respect, with a counter a test drives like a device's allocations -- :meth:`allocate_to` says
how many bytes are allocated now, and the counter keeps the high-water mark since the last reset, as torch's
``max_memory_allocated`` does.

It is a test device: no entry point names it, it is never a default, and a test installs it in the accelerator
registry of the process it runs in (:func:`installed`), where every implementation resolves
``HOSTOFFLOAD_ACCELERATOR`` through.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from reference.contract import accelerators
from reference.contract.accelerators.cpu import CpuAccelerator
from reference.contract.envvars import ACCELERATOR_ENV


class CountingHostAccelerator(CpuAccelerator):
    """The host, with a peak-memory counter the test sets (module docstring); records every reset."""

    name = "cpu-counting-memory"
    may_be_default = False

    def __init__(self, allocated: int = 0) -> None:
        self._lock = threading.Lock()
        self._allocated = allocated
        self._peak = allocated
        self.resets = 0

    def allocate_to(self, nbytes: int) -> None:
        """Now ``nbytes`` are allocated: the peak rises to it if it is higher."""
        with self._lock:
            self._allocated = nbytes
            self._peak = max(self._peak, nbytes)

    def peak_memory_allocated(self, index: int | None = None) -> int | None:
        with self._lock:
            return self._peak

    def reset_peak_memory(self, index: int | None = None) -> None:
        with self._lock:
            self._peak = self._allocated
            self.resets += 1


@contextlib.contextmanager
def installed(device: CountingHostAccelerator) -> Iterator[CountingHostAccelerator]:
    """``device`` in this process's accelerator registry and named by ``HOSTOFFLOAD_ACCELERATOR`` for the block;
    both restored after it."""
    known = accelerators.discover_accelerators()
    before_env = os.environ.get(ACCELERATOR_ENV)
    before = known.get(device.name)
    accelerators._instances[device.name] = device
    os.environ[ACCELERATOR_ENV] = device.name
    try:
        yield device
    finally:
        if before_env is None:
            os.environ.pop(ACCELERATOR_ENV, None)
        else:
            os.environ[ACCELERATOR_ENV] = before_env
        if before is None:
            accelerators._instances.pop(device.name, None)
        else:
            accelerators._instances[device.name] = before
