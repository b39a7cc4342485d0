"""The offload engine: what happens to one saved tensor between pack (forward) and unpack (backward).

:class:`EngineBase` holds everything both implementations must agree on: which tensors are candidates, the
``keep_last_count`` window, the in-place-modification check, the record life cycle and the stats. Subclasses
only decide *how* bytes move (:meth:`EngineBase._move_to_host`, :meth:`EngineBase._copy_to_device`,
:meth:`EngineBase._free_host`). :class:`ReferenceEngine` moves them the obvious way: a blocking copy into a
fresh pinned buffer on pack, a blocking copy into a fresh device buffer on unpack.

Life cycle of a record. ``pack`` returns a :class:`Record` that autograd stores instead of the tensor. The
record first sits in the keep window on the device; when ``keep_last_count`` newer candidates have arrived
it is moved to host. ``unpack`` returns a device tensor with the original size and strides. When autograd
drops the record (graph freed after backward, or after an exception in forward), ``Record.__del__`` hands
its host memory back. Nothing keeps a restored tensor alive: once the backward op that needed it is done,
its memory is free.

Autograd does not check the version counter of tensors that went through saved-tensor hooks, so the engine
does: at pack it keeps a *version probe* (a detached alias whose storage is swapped for an empty one, so it
shares the tensor's version counter without keeping its memory alive) and at unpack raises the same error
autograd raises when the tensor was modified in place after it was saved.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from reference.contract.accelerators import Accelerator
from reference.contract.offload_config import MODE_CHECKPOINT_INPUTS, OffloadConfig
from reference.contract.offload_stats import OffloadStats, StatsRecorder
from reference.offload.layout import StorageSpan, flat_source, rebuild, span_of
from reference.offload.selection import (
    is_marked_checkpoint_input,
    never_offload_reason,
    saved_by_torch_checkpoint,
)

ON_DEVICE = "device"
ON_HOST = "host"
RELEASED = "released"


def _version_probe(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter but none of its memory (see module docstring)."""
    probe = t.detach()
    # ``.data =`` swaps the storage and metadata but keeps the version counter (and does not bump it).
    probe.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return probe


class _SavedInPlace:
    """Packed form of a tensor that stays where it is; still version-checked (see module docstring)."""

    __slots__ = ("grad_fn_name", "output_nr", "tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version
        grad_fn = t.grad_fn
        self.grad_fn_name = grad_fn.name() if grad_fn is not None else None
        self.output_nr = t.output_nr


def _inplace_error(
    t_type: str, size: tuple[int, ...], grad_fn_name: str | None, output_nr: int, current: int, saved: int
) -> RuntimeError:
    # Same wording as autograd's SavedVariable check, so code and tests matching on it keep working.
    where = f", which is output {output_nr} of {grad_fn_name}," if grad_fn_name else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t_type} [{', '.join(str(s) for s in size)}]]{where} is at version {current}; "
        f"expected version {saved} instead. Hint: enable anomaly detection to find the operation that "
        "failed to compute its gradient, with torch.autograd.set_detect_anomaly(True)."
    )


class Record:
    """One saved tensor that is (or may become) offloaded. Owned by autograd; dies with the graph."""

    __slots__ = (
        "__weakref__",
        "d2h_event",
        "dev",
        "engine",
        "grad_fn_name",
        "host",
        "host_block",
        "kept_counted",
        "nbytes",
        "output_nr",
        "prefetched",
        "probe",
        "producer_stream",
        "read_events",
        "restore_epoch",
        "seq",
        "span",
        "state",
        "type_name",
        "unpacked",
        "version",
    )

    def __init__(self, engine: EngineBase, seq: int, t: torch.Tensor, span: StorageSpan) -> None:
        self.engine = engine
        self.seq = seq
        self.span = span
        self.nbytes = span.nbytes
        self.dev: torch.Tensor | None = t.detach()
        self.state = ON_DEVICE
        self.host: torch.Tensor | None = None
        self.host_block: Any = None
        self.producer_stream: Any = None
        self.d2h_event: Any = None
        self.prefetched: Any = None
        self.read_events: list[Any] = []
        self.kept_counted = False
        self.unpacked = False
        self.restore_epoch = -1
        self.version = t._version
        self.probe = _version_probe(t)
        self.type_name = t.type()
        grad_fn = t.grad_fn
        self.grad_fn_name = grad_fn.name() if grad_fn is not None else None
        self.output_nr = t.output_nr

    def check_version(self) -> None:
        current = self.probe._version
        if current != self.version:
            raise _inplace_error(
                self.type_name, self.span.size, self.grad_fn_name, self.output_nr, current, self.version
            )

    def __del__(self) -> None:
        try:
            self.engine._release(self)
        except Exception:  # interpreter shutdown or an already-closed engine: nothing left to give back
            pass


class EngineBase:
    """Selection, keep window, version checks, records and stats; subclasses move the bytes."""

    def __init__(self, config: OffloadConfig, accelerator: Accelerator) -> None:
        self.config = config
        self.accelerator = accelerator
        self.device_type = accelerator.device_type
        self.stats = StatsRecorder()
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._window: deque[weakref.ref[Record]] = deque()
        self._excluded_storages: set[int] = set()
        self._module_hook: Any = None

    # -- manager life cycle
    # -------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Called when a manager using this engine is entered: start noting module state storages."""
        self._excluded_storages = set()
        self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._note_module_state)

    def end(self) -> None:
        """Called when the manager exits (also on exceptions). Saved records stay valid for a later
        backward."""
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        self._excluded_storages = set()

    def _note_module_state(self, module: torch.nn.Module, args: Any) -> None:
        excluded = self._excluded_storages
        for p in module.parameters(recurse=False):
            if p.device.type == self.device_type:
                excluded.add(p.untyped_storage().data_ptr())
        for b in module.buffers(recurse=False):
            if b.device.type == self.device_type:
                excluded.add(b.untyped_storage().data_ptr())

    def close(self) -> None:
        """Release cached host memory (pools). The reference keeps none."""

    def snapshot_stats(self) -> OffloadStats:
        """Frozen stats; implementations with asynchronous timing resolve finished copies first."""
        return self.stats.snapshot()

    # -- pack / unpack
    # ------------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, *, force: bool = False) -> Any:
        """Packed form of ``t`` for autograd. ``force`` ignores ``mode`` (used by hostoffload's
        checkpoint)."""
        if not force and self.config.mode == MODE_CHECKPOINT_INPUTS:
            if not (is_marked_checkpoint_input(t) or saved_by_torch_checkpoint()):
                return self._skip(t, "not_checkpoint_input")
        reason = never_offload_reason(t, self.device_type, self._excluded_storages)
        if reason is not None:
            return self._skip(t, reason)
        span = span_of(t)
        if span.nbytes < self.config.min_offload_bytes:
            return self._skip(t, "small")
        with self._lock:
            record = Record(self, next(self._seq), t, span)
            record.producer_stream = self._current_stream()
            self.stats.add(device_bytes_held=record.nbytes)
            self._window.append(weakref.ref(record))
            self._drain_window(self.config.keep_last_count)
        return record

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedInPlace):
            current = packed.tensor._version
            if current != packed.version:
                raise _inplace_error(
                    packed.tensor.type(),
                    tuple(packed.tensor.shape),
                    packed.grad_fn_name,
                    packed.output_nr,
                    current,
                    packed.version,
                )
            return packed.tensor
        record: Record = packed
        record.check_version()
        with self._lock:
            first = not record.unpacked
            record.unpacked = True
            kept = record.state == ON_DEVICE
            if kept and first and not record.kept_counted:
                record.kept_counted = True
                self.stats.add(tensors_kept=1, bytes_kept=record.nbytes)
        if kept:
            assert record.dev is not None
            out = record.dev
        else:
            out = self._copy_to_device(record)
            self.stats.add(tensors_restored=1, bytes_restored=record.nbytes)
        self._after_unpack(record)
        return out

    def flush(self) -> None:
        """Move every record still in the keep window to host (used when a forward is known to be over)."""
        with self._lock:
            self._drain_window(0)

    # -- internals
    # ----------------------------------------------------------------------------------------------
    def _skip(self, t: torch.Tensor, reason: str) -> _SavedInPlace:
        nbytes = t.numel() * t.element_size() if t.layout == torch.strided else 0
        self.stats.skip(reason, nbytes)
        return _SavedInPlace(t)

    def _current_stream(self) -> Any:
        return self.accelerator.current_stream()

    def _drain_window(self, keep: int) -> None:
        while len(self._window) > keep:
            record = self._window.popleft()()
            if record is None or record.state != ON_DEVICE or record.unpacked:
                continue
            if not self._move_to_host(record):
                # Host memory cap reached: the tensor stays on the device for good.
                record.kept_counted = True
                self.stats.add(tensors_kept=1, bytes_kept=record.nbytes)
                continue
            record.state = ON_HOST
            record.dev = None
            self.stats.add(tensors_offloaded=1, bytes_offloaded=record.nbytes, device_bytes_held=-record.nbytes)

    def _release(self, record: Record) -> None:
        with self._lock:
            if record.state == ON_HOST:
                self._free_host(record)
                record.state = RELEASED
                return
            self.stats.add(device_bytes_held=-record.nbytes)
            if not record.kept_counted and not record.unpacked:
                # Saved, never needed by a backward, and never moved (e.g. forward raised): still "kept".
                record.kept_counted = True
                self.stats.add(tensors_kept=1, bytes_kept=record.nbytes)

    # -- to be provided by implementations
    # ------------------------------------------------------------------------
    def _move_to_host(self, record: Record) -> bool:
        """Start (or do) the copy of ``record.dev``'s span to host. False if host memory is capped out."""
        raise NotImplementedError

    def _copy_to_device(self, record: Record) -> torch.Tensor:
        """A device tensor with the record's geometry and values, safe to use on the caller's current
        stream."""
        raise NotImplementedError

    def _free_host(self, record: Record) -> None:
        """Give the record's host memory back (the record is being destroyed)."""
        raise NotImplementedError

    def _after_unpack(self, record: Record) -> None:
        """Called after each unpack (kept or restored); the optimized engine starts its prefetch here."""


class ReferenceEngine(EngineBase):
    """Blocking copies, a fresh pinned buffer per tensor, no streams, no prefetch: obviously correct."""

    def __init__(self, config: OffloadConfig, accelerator: Accelerator) -> None:
        super().__init__(config, accelerator)
        self._host_bytes = 0

    def _sync(self) -> None:
        if self.accelerator.supports_streams:
            self.accelerator.synchronize()

    def _move_to_host(self, record: Record) -> bool:
        from reference import pin_empty  # deferred: reference/__init__ imports this package's parent lazily

        cap = self.config.pool_bytes
        if cap is not None and self._host_bytes + record.nbytes > cap:
            return False
        assert record.dev is not None
        host = pin_empty(record.span.span_numel, dtype=record.span.dtype)
        start = time.perf_counter()
        self._sync()
        host.copy_(flat_source(record.dev, record.span))
        self._sync()
        elapsed = time.perf_counter() - start
        record.host = host
        self._host_bytes += record.nbytes
        self.stats.add(d2h_seconds=elapsed, d2h_timed_bytes=record.nbytes, host_bytes_in_use=record.nbytes)
        return True

    def _copy_to_device(self, record: Record) -> torch.Tensor:
        assert record.host is not None
        span = record.span
        start = time.perf_counter()
        buf = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        buf.copy_(record.host)
        self._sync()
        elapsed = time.perf_counter() - start
        # Blocking: the caller (and the compute stream behind it) waited for the whole copy.
        self.stats.add(h2d_seconds=elapsed, h2d_timed_bytes=record.nbytes, compute_wait_seconds=elapsed)
        return rebuild(buf, span)

    def _free_host(self, record: Record) -> None:
        record.host = None
        self._host_bytes -= record.nbytes
        self.stats.add(host_bytes_in_use=-record.nbytes)
