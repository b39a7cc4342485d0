"""NVIDIA CUDA through torch.

Host registration goes through the CUDA runtime that torch already loaded (``torch.cuda.cudart()``), so this
module needs no compiled code and no second copy of the runtime. Everything is resolved lazily: importing this
module on a machine without CUDA is free, and ``is_available`` is simply False there.

Contract: the shipped devices are plugins of :mod:`reference.contract.accelerators`, shared by every
implementation (an implementation is judged on a device, it does not bring its own).
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import torch

from reference.contract.accelerators.base import Accelerator

# cudaHostRegisterDefault: plain page-locking of existing pages for DMA. Portable/mapped flags are not needed for
# copies issued on the device that is current, which is how every hostoffload component copies.
_CUDA_HOST_REGISTER_DEFAULT = 0
_CUDA_SUCCESS = 0


class CudaAccelerator(Accelerator):
    name = "cuda"

    @property
    def device_type(self) -> str:
        return "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    @property
    def supports_streams(self) -> bool:
        return True

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def new_timing_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def synchronize(self, index: int | None = None) -> None:
        torch.cuda.synchronize(index)

    @property
    def has_torch_pinning(self) -> bool:
        return self.is_available()

    @property
    def supports_host_registration(self) -> bool:
        return self.is_available()

    @property
    def host_register_alignment(self) -> int:
        return mmap.PAGESIZE

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        if not self.is_available():
            return False
        try:
            rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_DEFAULT)
        except Exception:
            return False
        return int(rc) == _CUDA_SUCCESS

    def unregister_host_memory(self, ptr: int) -> None:
        if not self.is_available():
            return
        rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(rc) != _CUDA_SUCCESS:
            raise RuntimeError(f"cudaHostUnregister({ptr:#x}) failed with CUDA error {int(rc)}")

    def peak_memory_allocated(self, index: int | None = None) -> int | None:
        if not self.is_available():
            return None
        return int(torch.cuda.max_memory_allocated(index))

    def reset_peak_memory(self, index: int | None = None) -> None:
        if self.is_available():
            torch.cuda.reset_peak_memory_stats(index)

    def memory_stats(self) -> dict[str, int]:
        if not self.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        keep = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current")
        out = {k: int(stats.get(k, 0)) for k in keep}
        host_stats = getattr(torch.cuda, "host_memory_stats", None)
        if host_stats is not None:
            try:
                for k, v in host_stats().items():
                    if isinstance(v, int):
                        out[f"host.{k}"] = v
            except RuntimeError:
                pass
        return out
