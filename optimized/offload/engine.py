"""The optimized offload engine: pooled pinned memory, copy streams, events, prefetch, early release.

Same contract as :class:`reference.offload.engine.ReferenceEngine` (selection, keep window, version checks
and
stats live in the shared :class:`~reference.offload.engine.EngineBase`); what differs is how bytes move:

- host memory comes from a :class:`~optimized.offload.pool.PinnedPool` owned by the engine, so after the
  first step no pinned allocation happens;
- device-to-host copies run on a dedicated D2H stream after an event recorded on the stream that produced
  the tensor; the source's memory is handed back to the allocator with ``record_stream`` so it is reused
  only once the copy has read it. No host synchronisation anywhere on the steady path;
- the stream of the caller is looked up at every call (never captured at construction): autograd may run a
  backward op on a different stream than the forward op;
- restore buffers are allocated while the consumer's stream is current, so the caching allocator ties them
  to the stream that uses and frees them;
- every restore starts host-to-device copies, on a dedicated H2D stream, of the next ``prefetch_count``
  offloaded tensors in backward order (reverse offload order), bounded by ``max_inflight_bytes``;
- the engine drops its reference to a restored buffer at the moment it hands it to autograd, so the buffer
  is freed as soon as the backward op that used it is done. Keeping restored tensors until the context exits
  would make peak memory the same as without offload.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections import deque
from typing import Any

import torch

from optimized.offload.pool import PinnedPool
from reference.contract.accelerators import Accelerator
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_stats import OffloadStats
from reference.offload.engine import ON_HOST, RELEASED, EngineBase, Record
from reference.offload.layout import flat_source, rebuild

# Per record, how many "last read" events to keep for pool reuse (one per restore; more only with
# retain_graph).
_MAX_READ_EVENTS = 4
# Resolve copy timings once this many are pending, so the list stays short between stats reads.
_TIMING_BACKLOG = 256
# How many autograd nodes after a restore get a one-shot post-hook that may issue the planned prefetch.
_PREFETCH_HOOK_NODES = 8
# After this many of those hooks ran without a safe moment, the planned prefetch is issued anyway: a late
# prefetch still beats a copy on demand. Six covers one MLP block (the post-peak frees show up at the fifth).
_PREFETCH_DEADLINE_NODES = 6


def _current_autograd_node() -> Any:
    getter = getattr(torch._C, "_current_autograd_node", None)
    return getter() if getter is not None else None


class _DeferredPrefetch:
    """Prefetch planned at a restore, issued right after the region's memory peak has been released.

    Allocating the look-ahead buffers at the moment a tensor is restored would add them on top of the peak of
    the backward ops that follow (the restored tensor's consumers allocate their gradients right after). So
    the buffers are allocated from one-shot post-hooks on the next autograd nodes, at the first node boundary
    where memory has just fallen: ``allocated + buffer`` is at most the previous boundary's sample (at least a
    buffer's worth was freed since: the tensors of a peak) and at most the highest sample since the restore.
    Issued there, the buffer fills room that a peak already used, and its copy overlaps the rest of the
    region's backward (in a transformer MLP block: the first linear layer's two matmuls).

    Two tempting signals are wrong. The allocator's global peak (``max_memory_allocated``) includes the peaks
    of earlier regions of the same shape, so it reports headroom before this region's own peak has happened;
    issuing on it raised the H200 benchmark's peak by most of a buffer. And a node's post-hook runs before
    autograd frees that node's inputs and saved tensors, so the hook of the node that makes the peak still
    sees the peak: the fall shows up one boundary later, which is what the "fallen since the previous sample"
    test waits for. After ``_PREFETCH_DEADLINE_NODES`` hooks without such a moment the prefetch is issued
    anyway (bounded lateness).
    """

    def __init__(self, engine: StreamedEngine, candidates: list[Record], epoch: int, start: int) -> None:
        self._engine = weakref.ref(engine)
        self._pending = [weakref.ref(c) for c in candidates]
        self._epoch = epoch
        self._high = start
        self._previous = start
        self._calls = 0

    def attach(self, node: Any) -> None:
        queue = [node]
        # Keyed by id() but holding the node objects: the Python wrappers next_functions hands out can be
        # temporary, and a freed wrapper's id is reused by the next one, which would then be skipped as "seen"
        # (on the H200 run that cut the walk off after three nodes, before the block's memory peak).
        seen: dict[int, Any] = {}
        attached = 0
        while queue and attached < _PREFETCH_HOOK_NODES:
            current = queue.pop(0)
            if current is None or id(current) in seen:
                continue
            seen[id(current)] = current
            if type(current).__name__ != "AccumulateGrad":
                current.register_hook(self._on_node_done)
                attached += 1
            queue.extend(fn for fn, _ in current.next_functions)

    def _on_node_done(self, grad_inputs: Any, grad_outputs: Any) -> None:
        engine = self._engine()
        if engine is None or not self._pending:
            return
        allocated = engine._allocated_bytes()
        if allocated is None:
            return
        self._calls += 1
        self._high = max(self._high, allocated)
        previous, self._previous = self._previous, allocated
        deadline = self._calls >= _PREFETCH_DEADLINE_NODES
        while self._pending:
            candidate = self._pending[0]()
            if candidate is None:
                self._pending.pop(0)
                continue
            after = allocated + candidate.nbytes
            if not deadline and (after > previous or after > self._high):
                return
            self._pending.pop(0)
            engine._issue_deferred(candidate, self._epoch)
            allocated = after


class StreamedEngine(EngineBase):
    """Asynchronous offload engine (see module docstring)."""

    def __init__(self, config: OffloadConfig, accelerator: Accelerator) -> None:
        super().__init__(config, accelerator)
        self.use_streams = accelerator.supports_streams if config.use_streams is None else bool(config.use_streams)
        self._pool = PinnedPool(config.pool_bytes)
        self._d2h: Any = None
        self._h2d: Any = None
        self._inflight: deque[tuple[Any, int]] = deque()  # D2H copies not yet known complete
        self._inflight_bytes = 0
        self._prefetch_bytes = 0
        self._order_seq: list[int] = []  # offloaded records, in offload (= pack) order
        self._order_ref: list[weakref.ref[Record]] = []
        self._live_offloaded = 0
        self._timings: list[tuple[str, Any, Any, int]] = []
        self._epoch = 0

    # -- helpers
    # ----------------------------------------------------------------------------------------------
    def _streams(self) -> tuple[Any, Any]:
        if self._d2h is None:
            self._d2h = self.accelerator.new_stream()
            self._h2d = self.accelerator.new_stream()
        return self._d2h, self._h2d

    def _async_for(self, device: torch.device) -> bool:
        """Streams only for the accelerator's current device; other devices take the blocking path."""
        return self.use_streams and device == self.accelerator.device()

    def _timing_event(self) -> Any:
        return self.accelerator.new_timing_event() if self.use_streams else None

    def _record_timing(self, kind: str, start: Any, end: Any, nbytes: int) -> None:
        if start is None or end is None:
            return
        self._timings.append((kind, start, end, nbytes))
        if len(self._timings) > _TIMING_BACKLOG:
            self._resolve_timings(block=False)

    def _resolve_timings(self, block: bool) -> None:
        pending = []
        for kind, start, end, nbytes in self._timings:
            if not block and not end.query():
                pending.append((kind, start, end, nbytes))
                continue
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
            if kind == "d2h":
                self.stats.add(d2h_seconds=seconds, d2h_timed_bytes=nbytes)
            elif kind == "h2d":
                self.stats.add(h2d_seconds=seconds, h2d_timed_bytes=nbytes)
            if kind in ("wait", "h2d_on_demand"):
                self.stats.add(compute_wait_seconds=seconds)
            if kind == "h2d_on_demand":
                self.stats.add(h2d_seconds=seconds, h2d_timed_bytes=nbytes)
        self._timings = pending

    def snapshot_stats(self) -> OffloadStats:
        with self._lock:
            self._resolve_timings(block=True)
            self.stats.set(host_pool_bytes=self._pool.reserved_bytes, host_allocations=self._pool.allocations)
        return self.stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._resolve_timings(block=True)
            self._pool.trim()
            self.stats.set(host_pool_bytes=self._pool.reserved_bytes)

    # -- device -> host
    # ---------------------------------------------------------------------------------------
    def _move_to_host(self, record: Record) -> bool:
        span = record.span
        block = self._pool.acquire(record.nbytes)
        if block is None:
            return False
        self.stats.set(host_pool_bytes=self._pool.reserved_bytes, host_allocations=self._pool.allocations)
        host = block.tensor[: record.nbytes].view(span.dtype)
        assert record.dev is not None
        src = flat_source(record.dev, span)
        if self._async_for(span.device):
            d2h, _ = self._streams()
            acc = self.accelerator
            ready = acc.new_event()
            ready.record(record.producer_stream)
            ready.wait(d2h)
            for event in block.wait_events:  # earlier reads of this block must finish before we overwrite it
                event.wait(d2h)
            block.wait_events = []
            start = self._timing_event()
            if start is not None:
                start.record(d2h)
            with acc.stream(d2h):
                host.copy_(src, non_blocking=True)
            done = self._timing_event() or acc.new_event()
            done.record(d2h)
            src.record_stream(d2h)  # the allocator may reuse the source only after the copy read it
            record.d2h_event = done
            self._record_timing("d2h", start, done, record.nbytes)
            self._throttle_d2h(done, record.nbytes)
        else:
            if span.device.type != "cpu":
                self.accelerator.synchronize()
            begin = time.perf_counter()
            host.copy_(src)
            if span.device.type != "cpu":
                self.accelerator.synchronize()
            self.stats.add(d2h_seconds=time.perf_counter() - begin, d2h_timed_bytes=record.nbytes)
            record.d2h_event = None
        record.host = host
        record.host_block = block
        self._order_seq.append(record.seq)
        self._order_ref.append(weakref.ref(record))
        self._live_offloaded += 1
        self.stats.add(host_bytes_in_use=record.nbytes)
        return True

    def _throttle_d2h(self, done: Any, nbytes: int) -> None:
        self._inflight.append((done, nbytes))
        self._inflight_bytes += nbytes
        while self._inflight and self._inflight[0][0].query():
            self._inflight_bytes -= self._inflight.popleft()[1]
        cap = self.config.max_inflight_bytes
        while cap is not None and self._inflight_bytes > cap and len(self._inflight) > 1:
            event, size = self._inflight.popleft()
            event.synchronize()  # back-pressure the user asked for with max_inflight_bytes
            self._inflight_bytes -= size

    # -- host -> device
    # ---------------------------------------------------------------------------------------
    def _copy_to_device(self, record: Record) -> torch.Tensor:
        span = record.span
        acc = self.accelerator
        with self._lock:
            prefetched = record.prefetched
            record.prefetched = None
            if prefetched is not None:
                self._prefetch_bytes -= record.nbytes
                self.stats.add(device_bytes_held=-record.nbytes)
        if prefetched is not None:
            buf, ready, alloc_stream = prefetched
            if self._async_for(span.device):
                consumer = acc.current_stream()
                start = self._timing_event()
                if start is not None:
                    start.record(consumer)
                ready.wait(consumer)
                end = self._timing_event()
                if end is not None:
                    end.record(consumer)
                self._record_timing("wait", start, end, 0)
                if consumer != alloc_stream:
                    buf.record_stream(consumer)
            return rebuild(buf, span)
        assert record.host is not None
        buf = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        if self._async_for(span.device):
            consumer = acc.current_stream()
            if record.d2h_event is not None:
                record.d2h_event.wait(consumer)
            start = self._timing_event()
            if start is not None:
                start.record(consumer)
            buf.copy_(record.host, non_blocking=True)
            done = self._timing_event() or acc.new_event()
            done.record(consumer)
            self._record_timing("h2d_on_demand", start, done, record.nbytes)
            self._note_read(record, done)
        else:
            begin = time.perf_counter()
            buf.copy_(record.host)
            if span.device.type != "cpu":
                acc.synchronize()
            elapsed = time.perf_counter() - begin
            self.stats.add(h2d_seconds=elapsed, h2d_timed_bytes=record.nbytes, compute_wait_seconds=elapsed)
        return rebuild(buf, span)

    def _note_read(self, record: Record, event: Any) -> None:
        events = record.read_events
        events.append(event)
        if len(events) > _MAX_READ_EVENTS:
            del events[0]

    def _after_unpack(self, record: Record) -> None:
        if self.config.prefetch_count == 0:
            return
        with self._lock:
            self._epoch += 1
            record.restore_epoch = self._epoch
            candidates = self._prefetch_candidates(record.seq)
            if not candidates:
                return
            start = self._allocated_bytes()
            node = _current_autograd_node() if start is not None else None
            if node is None or start is None:
                for candidate in candidates:
                    self._issue_prefetch(candidate)
                return
        _DeferredPrefetch(self, candidates, self._epoch, start).attach(node)

    def _prefetch_candidates(self, seq: int) -> list[Record]:
        """The next ``prefetch_count`` offloaded records older than ``seq`` not yet prefetched (lock held)."""
        cap = self.config.max_inflight_bytes
        j = bisect.bisect_left(self._order_seq, seq) - 1
        seen = 0
        planned = self._prefetch_bytes
        out = []
        while j >= 0 and seen < self.config.prefetch_count:
            candidate = self._order_ref[j]()
            j -= 1
            if candidate is None or candidate.state != ON_HOST:
                continue
            seen += 1
            if candidate.prefetched is not None:
                continue
            if cap is not None and planned + candidate.nbytes > cap:
                break
            planned += candidate.nbytes
            out.append(candidate)
        return out

    def _allocated_bytes(self) -> int | None:
        """Device bytes allocated now, if the device reports it cheaply (CUDA); None otherwise."""
        if self.device_type != "cuda":
            return None
        return int(torch.cuda.memory_allocated())

    def _issue_deferred(self, candidate: Record, epoch: int) -> None:
        """Issue a planned prefetch unless it became pointless (restored, freed or prefetched meanwhile)."""
        with self._lock:
            if candidate.state != ON_HOST or candidate.prefetched is not None or candidate.restore_epoch > epoch:
                return
            self._issue_prefetch(candidate)

    def _issue_prefetch(self, record: Record) -> None:
        span = record.span
        acc = self.accelerator
        assert record.host is not None
        # Allocated while the consumer's stream is current: the allocator ties the block to that stream.
        buf = torch.empty(span.span_numel, dtype=span.dtype, device=span.device)
        if self._async_for(span.device):
            consumer = acc.current_stream()
            _, h2d = self._streams()
            allocated = acc.new_event()
            allocated.record(consumer)  # earlier consumer work on this memory must finish before we write it
            allocated.wait(h2d)
            if record.d2h_event is not None:
                record.d2h_event.wait(h2d)
            start = self._timing_event()
            if start is not None:
                start.record(h2d)
            with acc.stream(h2d):
                buf.copy_(record.host, non_blocking=True)
            done = self._timing_event() or acc.new_event()
            done.record(h2d)
            self._record_timing("h2d", start, done, record.nbytes)
            self._note_read(record, done)
        else:
            consumer = None
            begin = time.perf_counter()
            buf.copy_(record.host)
            if span.device.type != "cpu":
                acc.synchronize()
            self.stats.add(h2d_seconds=time.perf_counter() - begin, h2d_timed_bytes=record.nbytes)
            done = acc.new_event()
        record.prefetched = (buf, done, consumer)
        self._prefetch_bytes += record.nbytes
        self.stats.add(tensors_prefetched=1, device_bytes_held=record.nbytes)

    # -- release
    # ----------------------------------------------------------------------------------------------
    def _free_host(self, record: Record) -> None:
        prefetched = record.prefetched
        if prefetched is not None:
            buf, ready, alloc_stream = prefetched
            record.prefetched = None
            if alloc_stream is not None:
                ready.wait(alloc_stream)  # never let the allocator hand out memory the H2D copy still writes
            del buf
            self._prefetch_bytes -= record.nbytes
            self.stats.add(device_bytes_held=-record.nbytes)
        block = record.host_block
        record.host = None
        record.host_block = None
        if block is not None:
            events = list(record.read_events)
            if record.d2h_event is not None:
                events.append(record.d2h_event)
            self._pool.release(block, events)
        self._live_offloaded -= 1
        self.stats.add(host_bytes_in_use=-record.nbytes)
        self._compact_order()

    def _compact_order(self) -> None:
        seqs, refs = self._order_seq, self._order_ref
        while refs and (refs[-1]() is None or refs[-1]().state == RELEASED):
            refs.pop()
            seqs.pop()
        if len(refs) > 2 * self._live_offloaded + 64:
            keep = [(s, r) for s, r in zip(seqs, refs, strict=True) if (x := r()) is not None and x.state == ON_HOST]
            self._order_seq = [s for s, _ in keep]
            self._order_ref = [r for _, r in keep]
