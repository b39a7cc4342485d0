"""The accelerator contract: everything hostoffload needs from a device, and nothing more.

An accelerator is the seam between host-memory semantics and one device family. Pinning needs to register host
pages with the device (so DMA engines can read them without a bounce), offload engines need streams and events,
and the conformance suite needs to know which capabilities exist so it can skip what a device cannot do instead of
failing. A vendor porting hostoffload implements this class in its own package and registers it under the
``hostoffload.accelerators`` entry point; nothing in hostoffload names it.

Contract: both implementations (and the suite) drive devices only through this interface.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Accelerator(abc.ABC):
    """Abstract device interface. Subclasses must implement every abstract member.

    Capability flags (``supports_streams``, ``has_torch_pinning``, ``supports_host_registration``) are read by
    the implementations and the suite; they must be truthful for the machine the object runs on, which is why
    some of them are properties rather than class constants.
    """

    #: Short, unique name; it is also the entry-point name and the value ``HOSTOFFLOAD_ACCELERATOR`` takes.
    name: str = ""

    #: Whether this accelerator may be chosen when nobody names one (no argument, no ``HOSTOFFLOAD_ACCELERATOR``).
    #: Installing a package must not change what every hostoffload program in the environment runs on, so
    #: test-only accelerators (pretend devices, fault injectors, the example plugin's) set this to False: they run
    #: only where they are asked for by name, as the conformance suite does.
    may_be_default: bool = True

    # -- identity -------------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def device_type(self) -> str:
        """The torch device type of this accelerator's memory ('cpu', 'cuda', ...)."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True if the device can be used in this process (driver present, at least one device)."""

    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The torch device for ``index`` (default: the current device)."""

    # -- execution ------------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def supports_streams(self) -> bool:
        """False for devices that execute synchronously (then streams and events are no-op stand-ins)."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream the caller's work is queued on right now (resolved at each call, never cached)."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A new side stream."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` current."""

    @abc.abstractmethod
    def new_event(self) -> Any:
        """A new event with ``record(stream)``, ``wait(stream)``, ``synchronize()`` and ``query()``."""

    def new_timing_event(self) -> Any | None:
        """An event that can also measure ``elapsed_time(end)`` in milliseconds, or None (the default) if the device
        cannot time its work. Engines that report copy bandwidth ask for these instead of building
        device-specific event classes themselves, so they work on every accelerator with streams."""
        return None

    @abc.abstractmethod
    def synchronize(self, index: int | None = None) -> None:
        """Wait for all work queued on the device."""

    # -- host memory ----------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def has_torch_pinning(self) -> bool:
        """True if ``torch.empty(..., pin_memory=True)`` really pins memory for this device in this build."""

    @property
    @abc.abstractmethod
    def supports_host_registration(self) -> bool:
        """True if :meth:`register_host_memory` can make existing host pages DMA-capable for the device."""

    @property
    @abc.abstractmethod
    def host_register_alignment(self) -> int:
        """Alignment in bytes that :meth:`register_host_memory` needs for ``ptr`` and ``nbytes``."""

    @abc.abstractmethod
    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` with the device. Returns False (never raises) if the device refused."""

    @abc.abstractmethod
    def unregister_host_memory(self, ptr: int) -> None:
        """Undo :meth:`register_host_memory` for the range starting at ``ptr``. Must precede freeing the pages."""

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Device and host-allocator counters the device exposes (may be empty); values are ints."""

    def peak_memory_allocated(self, index: int | None = None) -> int | None:
        """The most device bytes allocated at once (by this process, on device ``index``; default the current
        one) since the last :meth:`reset_peak_memory`, or None (the default) where the device keeps no such
        counter. ``gpu_memory_limit`` (docs/accumulation.md R28) measures the engine's floor with it and is refused
        where it is None."""
        return None

    def reset_peak_memory(self, index: int | None = None) -> None:
        """Start a new peak: :meth:`peak_memory_allocated` then reports the bytes allocated now and any later
        high-water mark. A no-op where there is no counter."""
        return None

    # -- helpers shared by every accelerator ------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for reports."""
        return {
            "name": self.name,
            "may_be_default": self.may_be_default,
            "device_type": self.device_type,
            "available": self.is_available(),
            "supports_streams": self.supports_streams,
            "has_torch_pinning": self.has_torch_pinning,
            "supports_host_registration": self.supports_host_registration,
            "host_register_alignment": self.host_register_alignment,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"


class SynchronousEvent:
    """Event stand-in for devices without streams: work is complete as soon as it is issued."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def null_stream_context(stream: Any) -> Iterator[Any]:
    """Stream context stand-in for devices without streams."""
    yield stream

__all__ = [
    "Accelerator",
    "SynchronousEvent",
    "null_stream_context",
]
