"""A host accelerator that supports registration and refuses every request: the device-side failure path of
pinning, made reachable on a machine without a device.

A real device may refuse to register host memory (out of IOMMU mappings, a driver limit, memory another device
registered first). The contract for that case (docs/native.md, "When an accelerator hook fails") is that the
hook returns False and the pinning call goes on: the buffer stays page-locked and usable, unregistered, counted
as pinned but not as registered, with one ``RuntimeWarning`` per process; and its unregister hook is never
called. On CUDA that path runs only when the driver refuses, which a test cannot arrange; this accelerator
refuses every time, so the rule is checked on CPU (``conformance/suite/test_pinning_refused_registration.py``).

It is a test device: no entry point names it (it would add a whole suite pass to every run's default
selection), it is never a default, and the suite installs it in the process's accelerator registry for one test.
"""

from __future__ import annotations

import threading

from reference.contract.accelerators.cpu import CpuAccelerator


class RefusingHostAccelerator(CpuAccelerator):
    """The host, with host registration supported and always refused; records every hook call."""

    name = "cpu-refusing-registration"
    may_be_default = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []

    @property
    def supports_host_registration(self) -> bool:
        return True

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        with self._lock:
            self.register_calls.append((ptr, nbytes))
        return False

    def unregister_host_memory(self, ptr: int) -> None:
        with self._lock:
            self.unregister_calls.append(ptr)
