"""The optimized offload engine: pooled pinned memory, copy streams, events, prefetch, early release.

It keeps the contract every implementation keeps (which tensors are candidates, the ``keep_last_count`` window, the
in-place modification check, the stats; the shared rules come from ``reference.contract.offload_*``) and moves
the bytes its own way:

- host memory comes from a :class:`~optimized.offload.pool.PinnedBlockPool` owned by the engine, so after the
  first step no pinned allocation happens;
- device-to-host copies run on a dedicated D2H stream after an event recorded on the stream that produced
  the tensor; the source's memory is handed back to the allocator with ``record_stream`` so it is reused
  only once the copy has read it. No host synchronisation anywhere on the steady path;
- the stream of the caller is looked up at every call (never captured at construction): autograd may run a
  backward op on a different stream than the forward op;
- restore buffers are allocated while the consumer's stream is current, so the caching allocator ties them
  to the stream that uses and frees them;
- every restore plans host-to-device copies, on a dedicated H2D stream, of the next ``prefetch_count``
  offloaded tensors in backward order (reverse offload order), bounded by ``max_inflight_bytes``;
  :mod:`optimized.offload.prefetch` decides when they are issued;
- the engine drops its reference to a restored buffer at the moment it hands it to autograd, so the buffer
  is freed as soon as the backward op that used it is done. Keeping restored tensors until the context exits
  would make peak memory the same as without offload;
- copies are timed on the device (:mod:`optimized.offload.copy_timing`).

Life cycle of a :class:`SavedActivation`: on the device (keep window) -> on the host (D2H copy issued, pool block
held) -> possibly prefetched (a device buffer with its H2D copy in flight) -> released when autograd drops it (its
pool block goes back with the events of the copies that read it, so the next writer waits for them).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch

from optimized.offload.copy_timing import CONSUMER_WAIT, D2H, H2D_ON_DEMAND, H2D_PREFETCH, CopyTimer
from optimized.offload.pool import PinnedBlock, PinnedBlockPool
from optimized.offload.prefetch import DeferredPrefetch, current_autograd_node
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

# Per saved activation, how many "last read" events to keep for pool reuse (one per restore; more only with
# retain_graph).
_MAX_READ_EVENTS = 4


class SavedInPlace:
    """The packed form of a tensor that is not a candidate: the tensor itself, still version-checked."""

    __slots__ = ("saved_version", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.saved_version = SavedVersion(t, self.tensor)


class Prefetched:
    """A restore buffer whose H2D copy was issued ahead of its unpack."""

    __slots__ = ("alloc_stream", "buffer", "ready")

    def __init__(self, buffer: torch.Tensor, ready: Any, alloc_stream: Any) -> None:
        self.buffer = buffer  # flat, the span's elements
        self.ready = ready  # completes when the copy has landed
        self.alloc_stream = alloc_stream  # the stream the buffer was allocated on (None on the blocking path)


class SavedActivation:
    """The packed form of a candidate tensor, with the stream state of its copies. Owned by autograd."""

    __slots__ = (
        "__weakref__",
        "counted_as_kept",
        "d2h_done",
        "device_tensor",
        "engine",
        "host_block",
        "host_view",
        "place",
        "prefetched",
        "producer_stream",
        "read_events",
        "restore_epoch",
        "saved_version",
        "seq",
        "span",
        "unpacked",
    )

    def __init__(self, engine: StreamedOffloadEngine, seq: int, t: torch.Tensor, span: StorageSpan) -> None:
        self.engine = engine
        self.seq = seq  # pack order: backward order is its reverse
        self.span = span
        self.device_tensor: torch.Tensor | None = t.detach()
        self.place = ON_DEVICE
        self.host_view: torch.Tensor | None = None  # the span's elements inside host_block
        self.host_block: PinnedBlock | None = None
        self.producer_stream: Any = None  # the stream that was current when the tensor was saved
        self.d2h_done: Any = None  # completes when the D2H copy has landed (None: it was blocking)
        self.prefetched: Prefetched | None = None
        self.read_events: list[Any] = []  # the last copies that read host_view (the pool block's next writer waits)
        self.restore_epoch = -1  # engine epoch of its last restore: prefetches planned before it are stale
        self.counted_as_kept = False
        self.unpacked = False
        self.saved_version = SavedVersion(t, version_probe(t))

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    def __del__(self) -> None:
        try:
            self.engine._release(self)
        except Exception:  # interpreter shutdown or an already-closed engine: nothing left to give back
            pass


class StreamedOffloadEngine:
    """Asynchronous offload engine (see module docstring)."""

    def __init__(self, config: OffloadConfig, accelerator: Accelerator) -> None:
        self.config = config
        self.accelerator = accelerator
        self.device_type = accelerator.device_type
        self.use_streams = accelerator.supports_streams if config.use_streams is None else bool(config.use_streams)
        self.stats = StatsRecorder()
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._window: deque[weakref.ref[SavedActivation]] = deque()  # candidates still on the device, oldest first
        self._module_state = ModuleStateStorages(self.device_type)
        self._pool = PinnedBlockPool(config.pool_bytes)
        self._timer = CopyTimer(accelerator, self.stats, enabled=self.use_streams)
        self._d2h_stream: Any = None
        self._h2d_stream: Any = None
        self._d2h_inflight: deque[tuple[Any, int]] = deque()  # D2H copies not yet known complete
        self._d2h_inflight_bytes = 0
        self._prefetch_bytes = 0
        self._offloaded_seqs: list[int] = []  # offloaded activations, in offload (= pack) order
        self._offloaded_refs: list[weakref.ref[SavedActivation]] = []
        self._live_offloaded = 0
        self._epoch = 0  # counts restores (prefetch planning)

    # -- manager life cycle -------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A manager using this engine was entered: note the storages of module state from now on."""
        self._module_state.start()

    def end(self) -> None:
        """The manager exited (also on exceptions). Saved activations stay valid for a later backward."""
        self._module_state.stop()

    def close(self) -> None:
        """Give the pool's cached blocks back (blocks still holding saved activations are unaffected)."""
        with self._lock:
            self._timer.resolve(block=True)
            self._pool.trim()
            self.stats.set(host_pool_bytes=self._pool.reserved_bytes)

    def snapshot_stats(self) -> OffloadStats:
        """Frozen stats, after folding in the timings of every copy issued so far."""
        with self._lock:
            self._timer.resolve(block=True)
            self._note_pool()
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
            saved = SavedActivation(self, next(self._seq), t, span)
            saved.producer_stream = self.accelerator.current_stream()
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
            kept = packed.place == ON_DEVICE
            if kept and first_use and not packed.counted_as_kept:
                self._count_kept(packed)
        if kept:
            assert packed.device_tensor is not None
            restored = packed.device_tensor
        else:
            restored = self._copy_to_device(packed)
            self.stats.add(tensors_restored=1, bytes_restored=packed.nbytes)
        self._plan_prefetch(packed)
        return restored

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
            if not self._move_to_host(saved):  # pool cap reached: the tensor stays on the device for good
                self._count_kept(saved)
                continue
            saved.place = ON_HOST
            saved.device_tensor = None
            self.stats.add(tensors_offloaded=1, bytes_offloaded=saved.nbytes, device_bytes_held=-saved.nbytes)

    # -- streams ------------------------------------------------------------------------------------------------
    def _streams(self) -> tuple[Any, Any]:
        """The D2H and H2D side streams, created at first use."""
        if self._d2h_stream is None:
            self._d2h_stream = self.accelerator.new_stream()
            self._h2d_stream = self.accelerator.new_stream()
        return self._d2h_stream, self._h2d_stream

    def _async_for(self, device: torch.device) -> bool:
        """Streams only for the accelerator's current device; other devices take the blocking path."""
        return self.use_streams and device == self.accelerator.device()

    def _note_pool(self) -> None:
        self.stats.set(host_pool_bytes=self._pool.reserved_bytes, host_allocations=self._pool.allocations)

    # -- device -> host -----------------------------------------------------------------------------------------
    def _move_to_host(self, saved: SavedActivation) -> bool:
        """Issue the copy of the saved span into a pool block. False if the pool's cap leaves no room (lock held)."""
        span = saved.span
        block = self._pool.acquire(saved.nbytes)
        if block is None:
            return False
        self._note_pool()
        host = block.tensor[: saved.nbytes].view(span.dtype)
        assert saved.device_tensor is not None
        src = flat_source(saved.device_tensor, span)
        if self._async_for(span.device):
            accelerator = self.accelerator
            d2h, _ = self._streams()
            produced = accelerator.new_event()
            produced.record(saved.producer_stream)
            produced.wait(d2h)
            for event in block.wait_events:  # earlier reads of this block must finish before we overwrite it
                event.wait(d2h)
            block.wait_events = []
            start = self._timer.start(d2h)
            with accelerator.stream(d2h):
                host.copy_(src, non_blocking=True)
            done = self._timer.end(D2H, start, d2h, saved.nbytes)
            src.record_stream(d2h)  # the allocator may reuse the source only after the copy read it
            saved.d2h_done = done
            self._throttle_d2h(done, saved.nbytes)
        else:
            if span.device.type != "cpu":
                self.accelerator.synchronize()
            begin = time.perf_counter()
            host.copy_(src)
            if span.device.type != "cpu":
                self.accelerator.synchronize()
            self.stats.add(d2h_seconds=time.perf_counter() - begin, d2h_timed_bytes=saved.nbytes)
            saved.d2h_done = None
        saved.host_view = host
        saved.host_block = block
        self._offloaded_seqs.append(saved.seq)
        self._offloaded_refs.append(weakref.ref(saved))
        self._live_offloaded += 1
        self.stats.add(host_bytes_in_use=saved.nbytes)
        return True

    def _throttle_d2h(self, done: Any, nbytes: int) -> None:
        """Keep D2H copies in flight under ``max_inflight_bytes``: the back-pressure the user asked for."""
        self._d2h_inflight.append((done, nbytes))
        self._d2h_inflight_bytes += nbytes
        while self._d2h_inflight and self._d2h_inflight[0][0].query():
            self._d2h_inflight_bytes -= self._d2h_inflight.popleft()[1]
        cap = self.config.max_inflight_bytes
        while cap is not None and self._d2h_inflight_bytes > cap and len(self._d2h_inflight) > 1:
            event, size = self._d2h_inflight.popleft()
            event.synchronize()
            self._d2h_inflight_bytes -= size

    # -- host -> device -----------------------------------------------------------------------------------------
    def _copy_to_device(self, saved: SavedActivation) -> torch.Tensor:
        """The restored tensor, safe to use on the caller's current stream; the engine keeps no reference to it."""
        span = saved.span
        accelerator = self.accelerator
        with self._lock:
            prefetched = saved.prefetched
            saved.prefetched = None
            if prefetched is not None:
                self._prefetch_bytes -= saved.nbytes
                self.stats.add(device_bytes_held=-saved.nbytes)
        if prefetched is not None:
            if self._async_for(span.device):
                consumer = accelerator.current_stream()
                start = self._timer.start(consumer)
                prefetched.ready.wait(consumer)
                if start is not None:
                    self._timer.end(CONSUMER_WAIT, start, consumer, 0)
                if consumer != prefetched.alloc_stream:
                    prefetched.buffer.record_stream(consumer)
            return rebuild(prefetched.buffer, span)
        assert saved.host_view is not None
        flat = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        if self._async_for(span.device):
            consumer = accelerator.current_stream()
            if saved.d2h_done is not None:
                saved.d2h_done.wait(consumer)
            start = self._timer.start(consumer)
            flat.copy_(saved.host_view, non_blocking=True)
            done = self._timer.end(H2D_ON_DEMAND, start, consumer, saved.nbytes)
            self._note_read(saved, done)
        else:
            begin = time.perf_counter()
            flat.copy_(saved.host_view)
            if span.device.type != "cpu":
                accelerator.synchronize()
            elapsed = time.perf_counter() - begin
            self.stats.add(h2d_seconds=elapsed, h2d_timed_bytes=saved.nbytes, compute_wait_seconds=elapsed)
        return rebuild(flat, span)

    def _note_read(self, saved: SavedActivation, event: Any) -> None:
        events = saved.read_events
        events.append(event)
        if len(events) > _MAX_READ_EVENTS:
            del events[0]

    # -- prefetch -----------------------------------------------------------------------------------------------
    def _plan_prefetch(self, restored: SavedActivation) -> None:
        """After each unpack: plan the look-ahead copies, issued now or after the coming memory peak."""
        if self.config.prefetch_count == 0:
            return
        with self._lock:
            self._epoch += 1
            restored.restore_epoch = self._epoch
            candidates = self._prefetch_candidates(restored.seq)
            if not candidates:
                return
            allocated = self.allocated_device_bytes()
            node = current_autograd_node() if allocated is not None else None
            if node is None or allocated is None:
                for candidate in candidates:
                    self._issue_prefetch(candidate)
                return
        DeferredPrefetch(self.allocated_device_bytes, self.issue_planned_prefetch, candidates, self._epoch,
                         allocated).attach(node)

    def _prefetch_candidates(self, seq: int) -> list[SavedActivation]:
        """The next ``prefetch_count`` offloaded activations older than ``seq`` not yet prefetched, as far as
        ``max_inflight_bytes`` allows (lock held)."""
        cap = self.config.max_inflight_bytes
        j = bisect.bisect_left(self._offloaded_seqs, seq) - 1
        seen = 0
        planned = self._prefetch_bytes
        out = []
        while j >= 0 and seen < self.config.prefetch_count:
            candidate = self._offloaded_refs[j]()
            j -= 1
            if candidate is None or candidate.place != ON_HOST:
                continue
            seen += 1
            if candidate.prefetched is not None:
                continue
            if cap is not None and planned + candidate.nbytes > cap:
                break
            planned += candidate.nbytes
            out.append(candidate)
        return out

    def allocated_device_bytes(self) -> int | None:
        """Device bytes allocated now, if the device reports it cheaply (CUDA); None otherwise."""
        if self.device_type != "cuda":
            return None
        return int(torch.cuda.memory_allocated())

    def issue_planned_prefetch(self, candidate: SavedActivation, epoch: int) -> None:
        """Issue a prefetch planned at restore ``epoch`` unless it became pointless (restored, freed or prefetched
        meanwhile)."""
        with self._lock:
            if candidate.place != ON_HOST or candidate.prefetched is not None or candidate.restore_epoch > epoch:
                return
            self._issue_prefetch(candidate)

    def _issue_prefetch(self, saved: SavedActivation) -> None:
        """Allocate the restore buffer and issue its copy on the H2D stream (lock held)."""
        span = saved.span
        accelerator = self.accelerator
        assert saved.host_view is not None
        # Allocated while the consumer's stream is current: the allocator ties the block to that stream.
        flat = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        if self._async_for(span.device):
            consumer = accelerator.current_stream()
            _, h2d = self._streams()
            allocated = accelerator.new_event()
            allocated.record(consumer)  # earlier consumer work on this memory must finish before we write it
            allocated.wait(h2d)
            if saved.d2h_done is not None:
                saved.d2h_done.wait(h2d)
            start = self._timer.start(h2d)
            with accelerator.stream(h2d):
                flat.copy_(saved.host_view, non_blocking=True)
            done = self._timer.end(H2D_PREFETCH, start, h2d, saved.nbytes)
            self._note_read(saved, done)
        else:
            consumer = None
            begin = time.perf_counter()
            flat.copy_(saved.host_view)
            if span.device.type != "cpu":
                accelerator.synchronize()
            self.stats.add(h2d_seconds=time.perf_counter() - begin, h2d_timed_bytes=saved.nbytes)
            done = accelerator.new_event()
        saved.prefetched = Prefetched(flat, done, consumer)
        self._prefetch_bytes += saved.nbytes
        self.stats.add(tensors_prefetched=1, device_bytes_held=saved.nbytes)

    # -- release ------------------------------------------------------------------------------------------------
    def _release(self, saved: SavedActivation) -> None:
        """Autograd dropped ``saved``: give its memory back and settle its counters."""
        with self._lock:
            if saved.place == ON_HOST:
                self._free_host(saved)
                saved.place = RELEASED
                return
            self.stats.add(device_bytes_held=-saved.nbytes)
            if not saved.counted_as_kept and not saved.unpacked:
                # Saved, never needed by a backward, and never moved (e.g. forward raised): still "kept".
                self._count_kept(saved)

    def _free_host(self, saved: SavedActivation) -> None:
        """Drop an unused prefetch and hand the pool block back with the events its next writer waits for."""
        prefetched = saved.prefetched
        if prefetched is not None:
            saved.prefetched = None
            if prefetched.alloc_stream is not None:
                # Never let the allocator hand out memory the H2D copy still writes.
                prefetched.ready.wait(prefetched.alloc_stream)
            del prefetched
            self._prefetch_bytes -= saved.nbytes
            self.stats.add(device_bytes_held=-saved.nbytes)
        block = saved.host_block
        saved.host_view = None
        saved.host_block = None
        if block is not None:
            events = list(saved.read_events)
            if saved.d2h_done is not None:
                events.append(saved.d2h_done)
            self._pool.release(block, events)
        self._live_offloaded -= 1
        self.stats.add(host_bytes_in_use=-saved.nbytes)
        self._compact_order()

    def _compact_order(self) -> None:
        """Drop released activations from the offload order: from its end at once, everywhere when it grew."""
        seqs, refs = self._offloaded_seqs, self._offloaded_refs
        while refs and ((last := refs[-1]()) is None or last.place == RELEASED):
            refs.pop()
            seqs.pop()
        if len(refs) > 2 * self._live_offloaded + 64:
            keep = [(s, r) for s, r in zip(seqs, refs, strict=True) if (x := r()) is not None and x.place == ON_HOST]
            self._offloaded_seqs = [s for s, _ in keep]
            self._offloaded_refs = [r for _, r in keep]
