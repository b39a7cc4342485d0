"""The reference offload engine: what happens to one saved tensor between pack (forward) and unpack (backward).

This is the oracle the suite compares the optimized engine with, so it is written for obviousness: a blocking copy
into a fresh pinned buffer on pack, a blocking copy into a fresh device buffer on unpack, no streams, no pool, no
prefetch. It is built only on the contract (``reference.contract.offload_*``, the config and the stats); nothing
here is shared with another implementation.

Life cycle of a :class:`SavedActivation`. ``pack`` returns one for every candidate tensor, and autograd stores it
instead of the tensor. It first sits in the keep window on the device; when ``keep_last_count`` newer candidates
have arrived its bytes are moved to host. ``unpack`` returns a device tensor with the original size and strides.
When autograd drops the saved activation (graph freed after backward, or after an exception in forward), its
``__del__`` hands the host memory back. Nothing keeps a restored tensor alive: once the backward op that needed it
is done, its memory is free.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import torch

from reference.contract.accelerators import Accelerator
from reference.contract.offload_config import MODE_CHECKPOINT_INPUTS, OffloadConfig
from reference.contract.offload_layout import StorageSpan, flat_source, rebuild, span_of
from reference.contract.offload_selection import (
    ModuleStateStorages,
    is_marked_checkpoint_input,
    never_offload_reason,
    saved_by_torch_checkpoint,
)
from reference.contract.offload_stats import OffloadStats, StatsRecorder
from reference.contract.offload_version_check import SavedVersion, version_probe

#: Where a saved activation's bytes are.
ON_DEVICE = "device"
ON_HOST = "host"
RELEASED = "released"


class SavedInPlace:
    """The packed form of a tensor that is not a candidate: the tensor itself, still version-checked."""

    __slots__ = ("saved_version", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.saved_version = SavedVersion(t, self.tensor)


class SavedActivation:
    """The packed form of a candidate tensor: its bytes on the device (``device_tensor``) or on the host
    (``host_copy``). Owned by autograd; dies with the graph."""

    __slots__ = (
        "__weakref__",
        "counted_as_kept",
        "device_tensor",
        "engine",
        "host_copy",
        "place",
        "saved_version",
        "span",
        "unpacked",
    )

    def __init__(self, engine: BlockingOffloadEngine, t: torch.Tensor, span: StorageSpan) -> None:
        self.engine = engine
        self.span = span
        self.device_tensor: torch.Tensor | None = t.detach()
        self.host_copy: torch.Tensor | None = None
        self.place = ON_DEVICE
        self.counted_as_kept = False  # in tensors_kept already (each saved activation counts once)
        self.unpacked = False  # a backward used it (a kept one is then no longer worth moving)
        self.saved_version = SavedVersion(t, version_probe(t))

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    def __del__(self) -> None:
        try:
            self.engine._release(self)
        except Exception:  # interpreter shutdown or an already-closed engine: nothing left to give back
            pass


class BlockingOffloadEngine:
    """Selection, keep window, version checks and stats; blocking copies into fresh buffers."""

    def __init__(self, config: OffloadConfig, accelerator: Accelerator) -> None:
        self.config = config
        self.accelerator = accelerator
        self.device_type = accelerator.device_type
        self.stats = StatsRecorder()
        self._lock = threading.RLock()
        self._window: deque[weakref.ref[SavedActivation]] = deque()  # candidates still on the device, oldest first
        self._module_state = ModuleStateStorages(self.device_type)
        self._host_bytes = 0

    # -- manager life cycle -------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A manager using this engine was entered: note the storages of module state from now on."""
        self._module_state.start()

    def end(self) -> None:
        """The manager exited (also on exceptions). Saved activations stay valid for a later backward."""
        self._module_state.stop()

    def close(self) -> None:
        """Give cached host memory back: the reference caches none."""

    def snapshot_stats(self) -> OffloadStats:
        return self.stats.snapshot()

    def reset_stats(self) -> None:
        self.stats.reset()

    # -- pack / unpack ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, *, force: bool = False) -> SavedActivation | SavedInPlace:
        """Packed form of ``t`` for autograd. ``force`` ignores ``mode`` (used by hostoffload's checkpoint)."""
        if not force and self.config.mode == MODE_CHECKPOINT_INPUTS:
            if not (is_marked_checkpoint_input(t) or saved_by_torch_checkpoint()):
                return self._skip(t, "not_checkpoint_input")
        reason = never_offload_reason(t, self.device_type, self._module_state.storages)
        if reason is not None:
            return self._skip(t, reason)
        span = span_of(t)
        if span.nbytes < self.config.min_offload_bytes:
            return self._skip(t, "small")
        with self._lock:
            saved = SavedActivation(self, t, span)
            self.stats.add(device_bytes_held=saved.nbytes)
            self._window.append(weakref.ref(saved))
            self._drain_window(self.config.keep_last_count)
        return saved

    def unpack(self, packed: SavedActivation | SavedInPlace) -> torch.Tensor:
        packed.saved_version.check()
        if isinstance(packed, SavedInPlace):
            return packed.tensor
        with self._lock:
            first_use = not packed.unpacked
            packed.unpacked = True
            if packed.place == ON_DEVICE:
                if first_use and not packed.counted_as_kept:
                    self._count_kept(packed)
                assert packed.device_tensor is not None
                return packed.device_tensor
        restored = self._copy_to_device(packed)
        self.stats.add(tensors_restored=1, bytes_restored=packed.nbytes)
        return restored

    # -- internals ----------------------------------------------------------------------------------------------
    def _skip(self, t: torch.Tensor, reason: str) -> SavedInPlace:
        nbytes = t.numel() * t.element_size() if t.layout == torch.strided else 0
        self.stats.skip(reason, nbytes)
        return SavedInPlace(t)

    def _count_kept(self, saved: SavedActivation) -> None:
        saved.counted_as_kept = True
        self.stats.add(tensors_kept=1, bytes_kept=saved.nbytes)

    def _drain_window(self, keep: int) -> None:
        """Move the oldest candidates still on the device to host until ``keep`` remain (lock held)."""
        while len(self._window) > keep:
            saved = self._window.popleft()()
            if saved is None or saved.place != ON_DEVICE or saved.unpacked:
                continue
            host = self._copy_to_host(saved)
            if host is None:  # host memory cap reached: the tensor stays on the device for good
                self._count_kept(saved)
                continue
            saved.host_copy = host
            saved.place = ON_HOST
            saved.device_tensor = None
            self.stats.add(tensors_offloaded=1, bytes_offloaded=saved.nbytes, device_bytes_held=-saved.nbytes)

    def _sync(self) -> None:
        if self.accelerator.supports_streams:
            self.accelerator.synchronize()

    def _copy_to_host(self, saved: SavedActivation) -> torch.Tensor | None:
        """A fresh pinned copy of the saved span, or None if it would exceed ``pool_bytes``."""
        from reference import pin_empty  # deferred: reference/__init__ imports this package's parent lazily

        cap = self.config.pool_bytes
        if cap is not None and self._host_bytes + saved.nbytes > cap:
            return None
        assert saved.device_tensor is not None
        host = pin_empty(saved.span.span_numel, dtype=saved.span.dtype)
        start = time.perf_counter()
        self._sync()
        host.copy_(flat_source(saved.device_tensor, saved.span))
        self._sync()
        elapsed = time.perf_counter() - start
        self._host_bytes += saved.nbytes
        self.stats.add(d2h_seconds=elapsed, d2h_timed_bytes=saved.nbytes, host_bytes_in_use=saved.nbytes)
        return host

    def _copy_to_device(self, saved: SavedActivation) -> torch.Tensor:
        """A fresh device tensor with the saved geometry and values; the engine keeps no reference to it."""
        assert saved.host_copy is not None
        span = saved.span
        start = time.perf_counter()
        flat = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        flat.copy_(saved.host_copy)
        self._sync()
        elapsed = time.perf_counter() - start
        # Blocking: the caller (and the compute stream behind it) waited for the whole copy.
        self.stats.add(h2d_seconds=elapsed, h2d_timed_bytes=saved.nbytes, compute_wait_seconds=elapsed)
        return rebuild(flat, span)

    def _release(self, saved: SavedActivation) -> None:
        """Autograd dropped ``saved``: give its memory back and settle its counters."""
        with self._lock:
            if saved.place == ON_HOST:
                saved.host_copy = None
                saved.place = RELEASED
                self._host_bytes -= saved.nbytes
                self.stats.add(host_bytes_in_use=-saved.nbytes)
                return
            self.stats.add(device_bytes_held=-saved.nbytes)
            if not saved.counted_as_kept and not saved.unpacked:
                # Saved, never needed by a backward, and never moved (e.g. forward raised): still "kept".
                self._count_kept(saved)
