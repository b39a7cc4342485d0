"""The offloaded stage-2/3 update, streamed bucket by bucket (issue 16; rules R10, R13-R17 of docs/accumulation.md).

With ``offload_optimizer: cpu`` the boundary work is three transfers and one host computation per bucket:
the reduced gradient goes device -> host, the CPU Adam updates the bucket's fp32 master (writing the model-dtype
weights in the same pass), the weights go host -> device. Run one after the other for the whole partition they
add up to more than the GPU's own step; streamed per bucket they overlap:

- **D2H overlaps backward.** Each backward, as soon as a bucket's rank-ordered reduce-scatter has a result, an
  offload stream adds it into the bucket's accumulator (R10) and copies the result into the pinned host
  accumulator. The fp32 accumulator never lives on the device: a third stream brings the bucket's running sum
  up from the host into a staging buffer (``0 + g`` on the first backward of a boundary, so the arithmetic is
  R10's ``acc + red`` in the same order), the offload stream adds and sends it back. The upload has a stream of
  its own so that it runs on the other copy engine, beside the previous bucket's D2H: on one stream the two
  directions would run one after the other, and the last backward of an accumulation would move twice the
  bytes it has time for. R28's device side (``device_grad``) never leaves the device. On the backward that a
  managed schedule says is the boundary's, the same stream also sums the squares of every R14 piece of the
  bucket on the device (fp64, ``torch.sum(x * x)`` per piece), so the global norm is known the moment backward
  ends.
- **The CPU Adam overlaps the H2D and the next forward.** R15 needs the global norm before any update, so the
  update starts in ``step()``, with that step's hyper-parameters, on a worker thread: buckets in flat order
  (the order the next forward needs them), each waiting only for its own D2H. After each bucket its weights
  are copied to the device on a second stream and an event is recorded; ``step()`` returns at once (world size
  1, or stage 3), and the next forward of a module waits for the buckets holding its parameters only
  (:meth:`StreamedUpdate.wait_range`). Everything else that reads weights or optimizer state waits for all
  (:meth:`StreamedUpdate.wait_all`). At stages 1/2 with several ranks the owners' slices are all-gathered per
  bucket in ``step()`` while the worker updates the next bucket.

With ``delayed_parameter_update`` (R27, opt-in) the update of boundary k is not waited for by anything of step
k + 1: at the boundary the worker first *publishes* the weights of the previous boundary (the model-dtype source
-- the kernel's cast buffer, or the fp32 master of an fp32 model -- holds them: every update writes it) into the
live parameters, bucket by bucket in flat order (H2D on the second stream after a fence recorded by ``step()`` on
the current stream, or a host copy), then runs this boundary's CPU Adam on each bucket once the bucket's publish
has read the source. The next forward waits only for the publish of its buckets; the next backward accumulates
into a second host accumulator (the worker still reads this boundary's); only the next boundary waits for the
Adam. Host cost: one more partition-sized accumulator (``grad_accum_dtype``) and, for a bf16 model, a cast
buffer of its own (the live parameters may no longer double as the kernel's output).

On the cpu accelerator there is nothing to copy: the accumulator is the host buffer itself, the norm is
summed there, and the asynchrony is the worker thread's (the next forward waits per module the same way).

Every operation is the reference's, elementwise, on the same values: streaming changes when and where, never
the arithmetic (the accumulation suite compares the traces bitwise on the host).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from optimized import cpu_adam
from optimized.accumulation.device_spans import DeviceSpans, timing_event
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_partition import FlatLayout

__all__ = ["TIMING_KEYS", "BucketRange", "StreamedUpdate"]

#: What :meth:`StreamedUpdate.take_timings` reports, in seconds: ``cpu_adam_s`` (the worker in the kernel),
#: ``wait_s`` (the training thread blocked on an update), ``d2h_s`` (gradients out), ``grad_up_s`` (running sums
#: back up for the next backward's add), ``h2d_s`` (weights in) -- the copies on their streams, summed per bucket,
#: overlapping other work --, ``grad_exposed_s`` (how long the gradient stream ran on after the boundary's
#: backward: the boundary waits for it), ``device_adam_s`` (R28's device side, on the training stream) and
#: ``gpu_idle_s``: how long the training stream sat idle because of the update -- ``wait_s`` is the *thread's*
#: blocked time, and the thread launches ahead of the GPU, so the GPU may run queued work through much of it. Per
#: wait, an event recorded before the thread blocks (done when the work queued before the wait is) and one after
#: it and after the stream's wait for the bucket's H2D; the gap between them is the stream's idle time.
TIMING_KEYS = ("cpu_adam_s", "wait_s", "d2h_s", "grad_up_s", "h2d_s", "grad_exposed_s", "device_adam_s",
               "gpu_idle_s")


def _sum_squares(values: torch.Tensor) -> torch.Tensor:
    """R14's fp64 sum of squares of one piece (a 0-d tensor on the values' device)."""
    seg = values.to(torch.float64)
    return torch.sum(torch.mul(seg, seg))


@dataclass
class BucketRange:
    """The part of one gradient bucket this rank owns, in partition coordinates, with the R14 pieces in it."""

    index: int
    lo: int
    hi: int
    #: (position of the piece in flat order, start in the partition, length)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.hi - self.lo


def _check_separate(weights: torch.Tensor, source: torch.Tensor, accumulator: torch.Tensor,
                    delayed_accumulator: torch.Tensor) -> None:
    """R27 needs the live weights, the update's source and both accumulators in buffers of their own (the worker
    writes one while the forward reads another)."""
    for a, b in ((weights, source), (accumulator, delayed_accumulator), (weights, delayed_accumulator)):
        if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
            raise ValueError("delayed update: the live weights, the update's source and both accumulators "
                             "must be separate buffers")


class StreamedUpdate:
    """The host accumulator, the per-bucket norm pieces and the pipelined CPU update of one rank.

    ``ranges``: this rank's slice of every bucket (partition coordinates, ascending, tiling ``[0, P)``).
    ``master`` / ``state``: the fp32 master and the Adam moments (host, pinned on a device run).
    ``cast_out``: host buffer the kernel writes the model-dtype weights into (bf16 model), or None (fp32 model:
    the master is the weights). ``weights``: where the model-dtype weights of the partition must end up (a
    device view, or ``cast_out`` itself when the parameters stay on the host). ``delayed_accumulator``: a second
    host accumulator, which turns on the delayed update (R27; then ``weights`` must be a buffer of its own).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        layout: FlatLayout,
        rank: int,
        ranges: list[tuple[int, int]],
        accum_dtype: torch.dtype,
        accumulator: torch.Tensor,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        cast_out: torch.Tensor | None,
        weights: torch.Tensor,
        delayed_accumulator: torch.Tensor | None = None,
    ) -> None:
        self.device = device
        self.on_device = device.type != "cpu"
        self.accum_dtype = accum_dtype
        self.accumulator = accumulator
        self.master = master
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.cast_out = cast_out
        self.weights = weights
        #: R27: a second host accumulator means the delayed update (see the module docstring)
        self.delayed = delayed_accumulator is not None
        self._accumulators = [accumulator, delayed_accumulator]
        self._current = 0
        if self.delayed:
            _check_separate(weights, master if cast_out is None else cast_out, accumulator, delayed_accumulator)
        self.ranges = [BucketRange(i, lo, hi) for i, (lo, hi) in enumerate(ranges)]
        #: R28 (the split path): the partition's elements below this are updated on the device; the worker
        #: updates, publishes and copies out ``[host_from, P)`` only
        self.host_from = 0
        #: R28, device runs: the device side's fp32 gradient accumulator for ``[0, host_from)``. From the first
        #: accumulation that starts with it set, the device side's reduced slices are added here and never leave
        #: the device (no D2H, no upload of the running sum); the host accumulator's ``[0, host_from)`` is then
        #: stale until :meth:`grad_for_boundary` joins it in for a reader of the whole partition
        self.device_grad: torch.Tensor | None = None
        #: whether the current accumulation keeps ``[0, host_from)`` in ``device_grad`` alone
        self._device_side_here = False
        self.pieces = layout.pieces(rank)
        for position, piece in enumerate(self.pieces):
            owner = next(b for b in self.ranges if b.lo <= piece.local_start < b.hi)
            owner.pieces.append((position, piece.local_start, piece.length))
        #: per piece, its fp64 sum of squares (a device scalar on a device run, else a float) or None
        self._sums: list[torch.Tensor | float | None] = [None] * len(self.pieces)
        #: whether every piece sum is of the accumulator as it is now (invalidated by each backward)
        self._sums_fresh = False
        self._first = True  # no backward since the last boundary: the accumulator is logically zero
        self._done: list[threading.Event] = [threading.Event() for _ in self.ranges]
        #: R27: set once the bucket's previous-boundary weights are in the live parameters (queued, on a device)
        self._published: list[threading.Event] = [threading.Event() for _ in self.ranges]
        for e in (*self._done, *self._published):
            e.set()
        #: R27: per bucket, the event of its publish H2D the worker waits for before overwriting the source
        self._publish_read: list[torch.cuda.Event | None] = [None] * len(self.ranges)
        self._pending: Future | None = None
        self._error: BaseException | None = None
        self._executor: ThreadPoolExecutor | None = None
        #: seconds spent, since the last :meth:`take_timings`: the CPU Adam (worker), the caller blocked in waits
        self._times = dict.fromkeys(TIMING_KEYS, 0.0)
        #: device-side spans (copies, exposed waits, the split's device Adam), recorded only once someone asked
        #: for timings (they pile up until read)
        self._spans = DeviceSpans(self.device)
        self._timing = False
        self._last_host_rate: float | None = None
        self._threads = cpu_adam.default_threads()
        if self.on_device:
            # Leave one core to the thread that launches the next forward's kernels.
            self._threads = max(1, self._threads - 1)
            self._init_device_streams()

    def _init_device_streams(self) -> None:
        """A device run's staging buffers, copy streams and per-bucket events."""
        device = self.device
        longest = max((b.length for b in self.ranges), default=0)
        # Two staging buffers: the stream adds into one while the other's D2H drains.
        self._staging = [torch.empty(longest, dtype=self.accum_dtype, device=device) for _ in range(2)]
        self._turn = 0
        self._d2h_stream = torch.cuda.Stream(device)
        #: brings a bucket's running sum up from the host on a copy engine of its own, so that it runs beside
        #: the previous bucket's D2H instead of after it (one stream would serialize the two directions)
        self._up_stream = torch.cuda.Stream(device)
        self._h2d_stream = torch.cuda.Stream(device)
        #: per staging slot, the event after the last D2H that read it (an upload into it waits for it)
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._d2h_done: list[torch.cuda.Event | None] = [None] * len(self.ranges)
        self._h2d_done: list[torch.cuda.Event | None] = [None] * len(self.ranges)

    # ---- backward: accumulate (R10) and stream out ----------------------------------------------------------
    def begin_backward(self) -> None:
        self._sums_fresh = False
        if self._first:  # a new accumulation: where the device side's gradient lives is decided for all of it
            self._device_side_here = self.on_device and self.device_grad is not None and self.host_from > 0

    def absorb(self, index: int, reduced: torch.Tensor, want_sums: bool) -> None:
        """Add this rank's reduced slice of bucket ``index`` (comm dtype, on the device) into its accumulator
        (R10: ``acc + red.to(accum_dtype)``, acc from zeros after a boundary); with ``want_sums`` also the
        R14 piece sums of the result."""
        b = self.ranges[index]
        if not b.length:
            return
        if not self.on_device:
            host = self.accumulator[b.lo : b.hi]
            if self._first:
                host.zero_()
            host.add_(reduced.to(self.accum_dtype))
            if want_sums:
                self._sum_pieces(b, b.lo, None, host)
            return
        # R28: [b.lo, cut) is the device side's and stays in device_grad; [cut, b.hi) goes through the host.
        cut = max(b.lo, min(b.hi, self.host_from)) if self._device_side_here else b.lo
        slot, uploaded = self._upload(index, cut, b.hi) if cut < b.hi else (None, None)
        stream = self._d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            red = reduced.to(self.accum_dtype)
            kept = None
            if cut > b.lo:
                kept = self.device_grad
                if self._first:
                    kept[b.lo : cut].zero_()
                kept[b.lo : cut].add_(red[: cut - b.lo])
            stage = None
            if slot is not None:
                stage = self._staging[slot][: b.hi - cut]
                if uploaded is None:
                    stage.zero_()
                else:
                    stream.wait_event(uploaded)
                stage.add_(red[cut - b.lo :])
            if want_sums:
                self._sum_pieces(b, cut, kept, stage)
            if stage is not None:
                begin = timing_event(stream)
                self.accumulator[cut : b.hi].copy_(stage, non_blocking=True)
                event = timing_event(stream)
                self._slot_free[slot] = event
                if self._timing:
                    self._spans.add("d2h_s", begin, event)
            else:
                event = timing_event(stream)
        reduced.record_stream(stream)
        self._d2h_done[index] = event

    def _upload(self, index: int, lo: int, hi: int) -> tuple[int, torch.cuda.Event | None]:
        """A staging slot for the host part ``[lo, hi)`` of bucket ``index`` and, after the first backward of an
        accumulation, the event of the upload of its running sum into it (on the upload stream: once the slot's
        last D2H and the previous D2H of this range have run). None: nothing to upload (the sum starts at 0)."""
        slot = self._turn
        self._turn ^= 1
        if self._first:
            return slot, None
        up = self._up_stream
        for before in (self._slot_free[slot], self._d2h_done[index]):
            if before is not None:
                up.wait_event(before)
        with torch.cuda.stream(up):
            begin = timing_event(up)
            self._staging[slot][: hi - lo].copy_(self.accumulator[lo:hi], non_blocking=True)
            done = timing_event(up)
        if self._timing:
            self._spans.add("grad_up_s", begin, done)
        return slot, done

    def _sum_pieces(self, b: BucketRange, cut: int, kept: torch.Tensor | None, rest: torch.Tensor | None) -> None:
        """R14's sums of the pieces of bucket ``b``: ``[.., cut)`` read from ``kept`` (partition coordinates, the
        device side's gradient), ``[cut, ..)`` from ``rest`` (which starts at ``cut``). A piece across the cut
        is summed in two parts, added in fp64 (on a device run the sums agree with the host's within R25's
        tolerance anyway; on the cpu accelerator nothing is cut)."""
        for position, start, length in b.pieces:
            end = start + length
            total: torch.Tensor | float | None = None
            if start < cut:
                total = _sum_squares(kept[start : min(end, cut)])
            if end > cut:
                part = _sum_squares(rest[max(start, cut) - cut : end - cut])
                total = part if total is None else total + part
            self._sums[position] = total if self.on_device else total.item()

    def end_backward(self, summed: bool) -> None:
        """Every bucket was absorbed; ``summed``: the piece sums were taken in this backward (the boundary's)."""
        self._first = False
        self._sums_fresh = summed
        if summed and self.on_device and self._timing:
            # How long the boundary waits for the gradient stream after backward's last kernel (clamped at 0).
            ended = timing_event(torch.cuda.current_stream(self.device))
            self._spans.add("grad_exposed_s", ended, timing_event(self._d2h_stream))

    # ---- the boundary --------------------------------------------------------------------------------------
    def wait_transfers_out(self) -> None:
        """The host accumulator holds the final gradient (every D2H has landed), and every kernel or copy queued
        so far has run: the update may now write host buffers those copies read (stage-3 gathers from pinned
        partitions) and device buffers those kernels read. The norm needs all of backward anyway."""
        if self.on_device:
            self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._d2h_stream.synchronize()

    def host_side_gradient(self) -> torch.Tensor:
        """The host accumulator with every D2H landed (zeros if no backward since the boundary): complete on
        ``[host_from, P)``, the part the worker updates; ``[0, host_from)`` is stale where the device side's
        gradient stayed on the device (:meth:`device_gradient` has it)."""
        if self._first:
            self.accumulator.zero_()
        self.wait_transfers_out()
        return self.accumulator

    def grad_for_boundary(self) -> torch.Tensor:
        """The accumulated partition gradient, on the host, complete (zeros if no backward since the boundary):
        for readers of the whole partition (``record_gradients``, the norm when backward did not sum it)."""
        grad = self.host_side_gradient()
        if self._device_side_here and not self._first:
            grad[: self.host_from].copy_(self.device_grad[: self.host_from])
        return grad

    def device_gradient(self, n: int) -> torch.Tensor | None:
        """R28: the accumulated gradient of ``[0, n)`` where this accumulation kept it on the device (complete
        once :meth:`host_side_gradient` returned), or None (take it from the host accumulator)."""
        if self._first or not self._device_side_here:
            return None
        self.wait_transfers_out()
        return self.device_grad[:n]

    def piece_sums(self) -> list[float]:
        """R14's per-piece fp64 sums of squares of the accumulated gradient, in flat order."""
        if not self._sums_fresh:
            grad = self.grad_for_boundary()
            for b in self.ranges:
                # Not predicted (unmanaged step, or the boundary override changed after backward): sum the host
                # copy; on a device run the value agrees with the device's within R25's tolerance.
                for position, start, length in b.pieces:
                    self._sums[position] = _sum_squares(grad[start : start + length]).item()
        device_sums = [s for s in self._sums if isinstance(s, torch.Tensor)]
        if device_sums:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h_stream)
        values = torch.stack(device_sums).cpu().tolist() if device_sums else []
        it = iter(values)
        return [next(it) if isinstance(s, torch.Tensor) else float(s) for s in self._sums]

    def start(self, config: OptimizerConfig, step: int, clip_coef: float | None) -> None:
        """Update every bucket on the worker, in flat order, with these hyper-parameters (R15 + R16, step ``t``).
        Returns at once; :meth:`wait_range` / :meth:`wait_all` wait."""
        self.wait_all()
        grad = self.host_side_gradient()
        if self.on_device:
            # The H2D of the new weights must not overtake the kernels already queued that still read the old
            # ones (the end of backward; stage-3 gathers): each copy waits for this point of the current stream.
            self._fence = torch.cuda.Event()
            self._fence.record(torch.cuda.current_stream(self.device))
        for e in self._done:
            e.clear()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostoffload-zero-update")
        if not self.delayed:
            self._pending = self._executor.submit(self._run, config, step, clip_coef, grad)
            return
        for e in self._published:
            e.clear()
        # R27: the next backward accumulates into the other buffer while the worker reads this one (R13 step 6).
        self._current ^= 1
        self.accumulator = self._accumulators[self._current]
        self._first = True
        self._sums_fresh = False
        self._pending = self._executor.submit(self._run_delayed, config, step, clip_coef, grad)

    def _host_part(self, b: BucketRange) -> BucketRange | None:
        """R28: the part of bucket ``b`` the host updates (None: nothing of it, or all of it is the device's)."""
        lo = max(b.lo, self.host_from)
        if lo >= b.hi:
            return None
        return b if lo == b.lo else BucketRange(b.index, lo, b.hi)

    def _run(self, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor) -> None:
        try:
            adam_s, elements = self._times["cpu_adam_s"], 0
            for b in self.ranges:
                h = self._host_part(b)
                if h is not None:
                    self._update_bucket(h, config, step, clip_coef, grad)
                    elements += h.length
                self._done[b.index].set()
            if elements:
                self._last_host_rate = max(0.0, self._times["cpu_adam_s"] - adam_s) / elements
        except BaseException as exc:  # reported by the next wait, on the caller's thread
            self._error = exc
        finally:
            for e in self._done:
                e.set()
            # R13 step 6: the next backward starts a new accumulation.
            self._first = True
            self._sums_fresh = False

    def _run_delayed(self, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor) -> None:
        """R27: publish the previous boundary's weights (every bucket, flat order), then this boundary's update,
        each bucket once its publish has read the source. ``start`` already waited for every D2H."""
        try:
            source = self.master if self.cast_out is None else self.cast_out
            for b in self.ranges:
                h = self._host_part(b)
                if h is not None:
                    self._copy_out(h, source[h.lo : h.hi], self.weights[h.lo : h.hi], publish=True)
                self._published[b.index].set()
            for b in self.ranges:
                h = self._host_part(b)
                if h is not None:
                    read = self._publish_read[b.index]
                    if read is not None:
                        read.synchronize()
                        self._publish_read[b.index] = None
                    self._adam(h, config, step, clip_coef, grad)
                self._done[b.index].set()
        except BaseException as exc:  # reported by the next wait, on the caller's thread
            self._error = exc
        finally:
            for e in (*self._published, *self._done):
                e.set()

    def _update_bucket(
        self, b: BucketRange, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor
    ) -> None:
        if self.on_device and self._d2h_done[b.index] is not None:
            self._d2h_done[b.index].synchronize()  # this bucket's gradient has landed (the others may not)
        out = self._adam(b, config, step, clip_coef, grad)
        src = self.master[b.lo : b.hi] if out is None else out
        dst = self.weights[b.lo : b.hi]
        if dst.data_ptr() == src.data_ptr():
            return
        self._copy_out(b, src, dst, publish=False)

    def _adam(
        self, b: BucketRange, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """R15 + R16 on bucket ``b`` (native kernel, bf16 copy in the same pass); returns the bf16 slice or None."""
        t0 = time.perf_counter()
        g = grad[b.lo : b.hi]
        if g.dtype != torch.float32:
            g = g.to(torch.float32)
        out = None if self.cast_out is None else self.cast_out[b.lo : b.hi]
        cpu_adam.adam_step(
            config,
            self.master[b.lo : b.hi],
            g,
            self.exp_avg[b.lo : b.hi],
            self.exp_avg_sq[b.lo : b.hi],
            step,
            grad_scale=clip_coef,
            bf16_out=out,
            threads=self._threads,
        )
        self._times["cpu_adam_s"] += time.perf_counter() - t0
        return out

    def _copy_out(self, b: BucketRange, src: torch.Tensor, dst: torch.Tensor, *, publish: bool) -> None:
        """Weights of bucket ``b`` into the live parameters: H2D on the second stream after the fence (its event
        is what the next forward waits for), or a host copy."""
        if self.on_device and dst.device.type != "cpu":
            with torch.cuda.device(self.device), torch.cuda.stream(self._h2d_stream):
                self._h2d_stream.wait_event(self._fence)
                begin = timing_event(self._h2d_stream)
                dst.copy_(src, non_blocking=True)
                event = timing_event(self._h2d_stream)
            if self._timing:
                self._spans.add("h2d_s", begin, event)
            if publish:
                self._publish_read[b.index] = event
            self._h2d_done[b.index] = event
        else:
            dst.copy_(src)

    # ---- waiting -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def wait_bucket(self, index: int, mark_idle: bool = True) -> None:
        """Bucket ``index``'s weights are in place for work queued on the current stream from now on
        (``mark_idle`` False: a caller's own ``gpu_idle_s`` mark covers this wait)."""
        if self._pending is None:
            return
        # R27: with the delayed update the weights are the previous boundary's, in place once published.
        gate = self._published[index] if self.delayed else self._done[index]
        idle = None
        if not gate.is_set():
            idle = self._idle_mark() if mark_idle else None
            t0 = time.perf_counter()
            gate.wait()
            self._times["wait_s"] += time.perf_counter() - t0
        self._raise_error()
        if self.on_device:
            event = self._h2d_done[index]
            if event is not None:
                if idle is None and mark_idle:  # the thread did not block; the stream may wait for the copy
                    idle = self._idle_mark()
                torch.cuda.current_stream(self.device).wait_event(event)
                self._h2d_done[index] = None
        if idle is not None:
            idle()

    def _idle_mark(self) -> Callable[[], None] | None:
        """Before the training thread blocks (device runs, timings on): record an event on the current stream and
        return the function that records its partner once the stream may go on (``gpu_idle_s``)."""
        return self.time_device_work("gpu_idle_s")

    def wait_range(self, lo: int, hi: int) -> None:
        """Wait for the buckets overlapping ``[lo, hi)`` (partition coordinates) only."""
        if self._pending is None:
            return
        for b in self.ranges:
            if b.lo < hi and lo < b.hi:
                self.wait_bucket(b.index)

    def wait_published(self) -> None:
        """The live weights are complete and visible to the current stream (without the delayed update: the whole
        update is done); re-raises the worker's error. With the delayed update the update itself may still run."""
        if self._pending is None:
            return
        for b in self.ranges:
            self.wait_bucket(b.index)

    def wait_all(self) -> None:
        """The whole update is done and visible to the current stream; re-raises the worker's error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        idle = None
        if not pending.done():  # counted like the per-bucket waits (the next backward, or the next boundary)
            idle = self._idle_mark()
            t0 = time.perf_counter()
            concurrent.futures.wait([pending])
            self._times["wait_s"] += time.perf_counter() - t0
        pending.result()
        self._pending = pending  # so wait_bucket still orders the H2D events
        for b in self.ranges:  # with a mark of its own, the buckets' H2D waits are inside it
            self.wait_bucket(b.index, mark_idle=idle is None)
        self._pending = None
        if idle is not None:
            idle()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._pending = None
            raise error

    def take_timings(self) -> dict[str, float]:
        """Seconds since the last call, per :data:`TIMING_KEYS`; copies and device work are measured from the
        first call on (their events are recorded only then). Waits for the update in flight. For benchmarks
        (bench_zero_offload.py)."""
        self._timing = True
        self.wait_all()
        self._spans.collect(self._times)
        out, self._times = self._times, dict.fromkeys(self._times, 0.0)
        return out

    def time_device_work(self, key: str) -> Callable[[], None] | None:
        """Start timing, under ``key``, what the current stream runs (or waits) from now until the returned
        function is called (device runs once timings were asked for), else None."""
        if not (self.on_device and self._timing):
            return None
        return self._spans.open(key, torch.cuda.current_stream(self.device))

    @property
    def last_host_seconds_per_element(self) -> float | None:
        """The CPU Adam's time per element in the last completed update (None before one ran): what R28's
        "auto" measures the host side with -- a whole update, not a sample, so thread start-up and a sample's
        fixed costs do not inflate it."""
        return self._last_host_rate

    def reset(self) -> None:
        """Drop the accumulated gradient (``zero_grad``)."""
        self.wait_all()
        self.wait_transfers_out()
        self._first = True
        self._sums_fresh = False

    def close(self) -> None:
        """Finish the worker (errors dropped: called from destroy) and stop its thread."""
        try:
            if self._pending is not None:
                self._pending.result()
        except BaseException:  # destroy() must not raise
            pass
        self._pending = None
        if self.on_device:
            try:
                self._d2h_stream.synchronize()
                self._up_stream.synchronize()
                self._h2d_stream.synchronize()
            except BaseException:
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
