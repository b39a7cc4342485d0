"""The host itself as an accelerator.

There is no device to register pages with and no asynchrony, so streams and events are synchronous stand-ins and
host registration is unsupported (pinning then means page-locking only). It is always available, which makes it
the accelerator every CI machine can run the whole suite on.

Contract: the shipped devices are plugins of :mod:`reference.contract.accelerators`, shared by every
implementation (an implementation is judged on a device, it does not bring its own).
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import torch

from reference.contract.accelerators.base import Accelerator, SynchronousEvent, null_stream_context


class CpuAccelerator(Accelerator):
    name = "cpu"

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
        # torch pins host memory for a device backend; with only the CPU there is nothing to pin for, and on a
        # CPU-only build torch.empty(pin_memory=True) raises. The torch backend is a documented no-op here.
        return False

    @property
    def supports_host_registration(self) -> bool:
        return False

    @property
    def host_register_alignment(self) -> int:
        return mmap.PAGESIZE

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        return False

    def unregister_host_memory(self, ptr: int) -> None:
        return None

    def memory_stats(self) -> dict[str, int]:
        return {}
