"""A pretend device that "registers" host memory by recording it, so registration paths run without hardware.

It behaves like the host (synchronous, no torch pinning) but claims host registration, and it checks the
protocol the pinning backends must follow: only page-aligned ranges are registered, nothing is registered twice,
and only registered ranges are unregistered.

It is a test device, so it declares ``may_be_default = False``: installing this package must not move every
hostoffload program of the environment onto a pretend device. It runs only where it is named
(``HOSTOFFLOAD_ACCELERATOR=example-host``, ``--conformance-accelerator example-host``, or the suite's default
selection of every available accelerator).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Any

import torch

from reference.contract.accelerators.base import Accelerator, SynchronousEvent, null_stream_context


class RecordingHostAccelerator(Accelerator):
    name = "example-host"
    may_be_default = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.registered: dict[int, int] = {}

    @property
    def device_type(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    @property
    def supports_streams(self) -> bool:
        return False

    def current_stream(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return null_stream_context(stream)

    def new_event(self) -> SynchronousEvent:
        return SynchronousEvent()

    def synchronize(self, index: int | None = None) -> None:
        return None

    @property
    def has_torch_pinning(self) -> bool:
        return False

    @property
    def supports_host_registration(self) -> bool:
        return True

    @property
    def host_register_alignment(self) -> int:
        return mmap.PAGESIZE

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        if ptr % mmap.PAGESIZE or nbytes % mmap.PAGESIZE:
            return False
        with self._lock:
            if ptr in self.registered:
                raise RuntimeError(f"range at {ptr:#x} registered twice")
            self.registered[ptr] = nbytes
        return True

    def unregister_host_memory(self, ptr: int) -> None:
        with self._lock:
            if self.registered.pop(ptr, None) is None:
                raise RuntimeError(f"unregister of {ptr:#x}, which is not registered")

    def memory_stats(self) -> dict[str, int]:
        with self._lock:
            return {"registered_bytes": sum(self.registered.values()), "registered_ranges": len(self.registered)}
