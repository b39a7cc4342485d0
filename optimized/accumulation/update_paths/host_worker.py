"""The streamed update's middle stage: the CPU Adam of every bucket on one worker thread, and the waits for it.

R15 needs the global norm before any update, so the update starts in ``step()``, with that step's
hyper-parameters (:meth:`HostUpdateWorker.start`): buckets in flat order (the order the next forward needs them),
each waiting only for its own gradient (:meth:`.GradientStream.wait_landed`), the native kernel writing the fp32
master, the moments and the model-dtype copy in one pass, then the bucket's weights handed to
:class:`.WeightUpload`. ``step()`` returns at once (world size 1, or stage 3); a reader waits for the buckets it
reads only (:meth:`HostUpdateWorker.wait_range`), everything else that reads weights or optimizer state for all
(:meth:`HostUpdateWorker.wait_all`).

With R27's delayed update (``publish_first``) boundary k first *publishes* the weights of boundary k - 1 (the
model-dtype source -- the kernel's cast buffer, or the fp32 master of an fp32 model -- holds them: every update
writes it) into the live parameters, bucket by bucket in flat order, then runs this boundary's Adam on each bucket
once the bucket's publish has read the source. The next forward waits only for the publish of its buckets
(:meth:`HostUpdateWorker.wait_published`); only the next boundary waits for the Adam.

R30 (``host_update_start: last_backward``, ``speculation``): buckets already updated under the last backward by
:mod:`.speculation` are settled there instead (kept, or restored and updated again), then uploaded as any other.

R28 (the split): :meth:`HostUpdateWorker.update_from` leaves the partition's leading elements to the device side;
the worker updates, publishes and copies out the rest only (with R30, it speculates on the rest only, and a cut
made at a boundary whose buckets were already updated early first gives the device side its elements back as they
were before the step: :meth:`.SpeculativeUpdate.release_leading`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from optimized import cpu_adam
from optimized.accumulation.update_paths.gradient_stream import GradientStream
from optimized.accumulation.update_paths.norm_sums import BucketRange
from optimized.accumulation.update_paths.speculation import SpeculativeUpdate
from optimized.accumulation.update_paths.timings import UpdateTimings
from optimized.accumulation.update_paths.weight_upload import WeightUpload
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision, adam_pass_bytes_per_element

__all__ = ["HostUpdateWorker"]


class HostUpdateWorker:
    """The pipelined CPU update of one rank (see the module docstring).

    ``master`` / ``exp_avg`` / ``exp_avg_sq``: the fp32 master and the Adam moments (host, pinned on a device run).
    ``cast_out``: host buffer the kernel writes the model-dtype weights into (bf16 model), or None (fp32 model:
    the master is the weights). ``weights``: where the model-dtype weights of the partition must end up (a device
    view, or ``cast_out`` itself when the parameters stay on the host).
    """

    def __init__(self, *, ranges: Sequence[BucketRange], gradients: GradientStream, upload: WeightUpload,
                 timings: UpdateTimings, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 cast_out: torch.Tensor | None, weights: torch.Tensor, publish_first: bool,
                 speculation: SpeculativeUpdate | None = None) -> None:
        self.ranges = ranges
        self._gradients = gradients
        self._upload = upload
        self._timings = timings
        self.master = master
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        #: R29: the moments' stored precision (what the kernel reads and writes per element)
        self._moments = StatePrecision.of(exp_avg, "exp_avg")
        self.cast_out = cast_out
        self.weights = weights
        #: R27: publish the previous boundary's weights, then update (see the module docstring)
        self.publish_first = publish_first
        #: R30: the buckets updated under the last backward, settled in the step's task
        self._speculation = speculation
        if speculation is not None:
            speculation.bind(self.run_on_thread, self.adam, self.host_part)
        #: R28: the partition's elements below this are the device side's
        self._host_from = 0
        self._done: list[threading.Event] = [threading.Event() for _ in ranges]
        #: R27: set once the bucket's previous-boundary weights are in the live parameters (queued, on a device)
        self._published: list[threading.Event] = [threading.Event() for _ in ranges]
        for e in (*self._done, *self._published):
            e.set()
        self._pending: Future | None = None
        self._error: BaseException | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._last_host_rate: float | None = None
        #: seconds and elements of every kernel call so far (R30's early updates included), and their values when
        #: the last update completed: the host's rate is taken over what a boundary's kernel calls did
        self._kernel_seconds = self._kernel_elements = 0.0
        self._kernel_mark = (0.0, 0.0)
        #: threads of the native kernel; a device run leaves one core to the thread that launches the next
        #: forward's kernels
        self.threads = cpu_adam.default_threads()
        if upload.on_device:
            self.threads = max(1, self.threads - 1)

    def update_from(self, n: int) -> None:
        """R28: from the next :meth:`start` on, update, publish and copy out the partition's ``[n, P)`` only. Waits
        for the update in flight (it must not see the cut move under it)."""
        self.wait_all()
        if self._speculation is not None:  # R30: the early updates of [0, n) go back to the state before them
            self._speculation.release_leading(n)
        self._host_from = n

    @property
    def last_host_seconds_per_element(self) -> float | None:
        """The CPU Adam's time per element in the last completed update (None before one ran): what R28's
        "auto" measures the host side with -- a whole update, not a sample, so thread start-up and a sample's
        fixed costs do not inflate it."""
        return self._last_host_rate

    def run_on_thread(self, fn: Callable[[], None]) -> Future:
        """Queue ``fn`` on the worker thread (first in, first out with the updates: R30's speculation)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostoffload-zero-update")
        return self._executor.submit(fn)

    # ---- the update -----------------------------------------------------------------------------------------
    def start(self, config: OptimizerConfig, step: int, clip_coef: float | None) -> None:
        """Update every bucket on the worker, in flat order, with these hyper-parameters (R15 + R16, step ``t``).
        Returns at once; :meth:`wait_range` / :meth:`wait_all` wait."""
        self.wait_all()
        grad = self._gradients.host_side_gradient()
        # The H2D of the new weights must not overtake the kernels already queued that still read the old ones.
        self._upload.fence()
        for e in self._done:
            e.clear()
        if not self.publish_first:
            self._pending = self.run_on_thread(lambda: self._run(config, step, clip_coef, grad))
            return
        for e in self._published:
            e.clear()
        self._gradients.hand_over()  # R27: the next backward fills the other accumulator (R13 step 6)
        self._pending = self.run_on_thread(lambda: self._run_delayed(config, step, clip_coef, grad))

    def host_part(self, b: BucketRange) -> BucketRange | None:
        """R28: the part of bucket ``b`` the host updates (None: nothing of it, or all of it is the device's)."""
        lo = max(b.lo, self._host_from)
        if lo >= b.hi:
            return None
        return b if lo == b.lo else BucketRange(b.index, lo, b.hi)

    def _run(self, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor) -> None:
        try:
            for b in self.ranges:
                h = self.host_part(b)
                if h is not None:
                    self._update_bucket(h, config, step, clip_coef, grad)
                self._done[b.index].set()
            # Every kernel call since the last update completed: this boundary's, and R30's under its backward.
            (s0, e0), self._kernel_mark = self._kernel_mark, (self._kernel_seconds, self._kernel_elements)
            seconds, elements = self._kernel_seconds - s0, self._kernel_elements - e0
            if elements:
                self._last_host_rate = max(0.0, seconds) / elements
        except BaseException as exc:  # reported by the next wait, on the caller's thread
            self._error = exc
        finally:
            if self._speculation is not None:  # before the waiters go on (a next backward opens a new one)
                self._speculation.finish()
            for e in self._done:
                e.set()
            self._gradients.restart()  # R13 step 6: the next backward starts a new accumulation

    def _run_delayed(self, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor) -> None:
        """R27: publish the previous boundary's weights (every bucket, flat order), then this boundary's update,
        each bucket once its publish has read the source. ``start`` already waited for every D2H."""
        try:
            source = self.master if self.cast_out is None else self.cast_out
            for b in self.ranges:
                h = self.host_part(b)
                if h is not None:
                    self._upload.copy(h.index, source[h.lo : h.hi], self.weights[h.lo : h.hi], publish=True)
                self._published[b.index].set()
            for b in self.ranges:
                h = self.host_part(b)
                if h is not None:
                    self._upload.wait_read(b.index)
                    self.adam(h, config, step, clip_coef, grad)
                self._done[b.index].set()
        except BaseException as exc:  # reported by the next wait, on the caller's thread
            self._error = exc
        finally:
            for e in (*self._published, *self._done):
                e.set()

    def _update_bucket(
        self, b: BucketRange, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor
    ) -> None:
        self._gradients.wait_landed(b.index)  # this bucket's gradient has landed (the others may not)
        spec = self._speculation
        if spec is None or not spec.settle(b, config, step, clip_coef, grad):
            self.adam(b, config, step, clip_coef, grad)
        src = self.master[b.lo : b.hi] if self.cast_out is None else self.cast_out[b.lo : b.hi]
        dst = self.weights[b.lo : b.hi]
        if dst.data_ptr() == src.data_ptr():
            return
        self._upload.copy(b.index, src, dst, publish=False)

    def adam(
        self, b: BucketRange, config: OptimizerConfig, step: int, clip_coef: float | None, grad: torch.Tensor,
        backup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """R15 + R16 on bucket ``b`` (native kernel, bf16 copy in the same pass); returns the bf16 slice or None.
        ``backup``: R30's speculation -- master, exp_avg and exp_avg_sq slices the kernel copies the bucket's state
        into before updating it, in the same pass."""
        t0 = time.perf_counter()
        g = grad[b.lo : b.hi]
        if g.dtype not in (torch.float32, torch.bfloat16):  # the kernel widens a bf16 sum as it reads it
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
            threads=self.threads,
            backup=backup,
        )
        took = time.perf_counter() - t0
        self._timings.add("cpu_adam_s", took)
        self._timings.add_kernel_bytes(b.length * self._pass_bytes(g, out is not None, backup is not None))
        self._kernel_seconds += took  # one thread calls the kernel: no lock
        self._kernel_elements += b.length
        return out

    def _pass_bytes(self, grad: torch.Tensor, bf16_copy: bool, backup: bool) -> int:
        """Bytes per element one kernel call moves (:func:`adam_pass_bytes_per_element` for these buffers)."""
        return adam_pass_bytes_per_element(self._moments, bf16_copy=bf16_copy, grad_bytes=grad.element_size(),
                                           backup=backup)

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
        gate = self._published[index] if self.publish_first else self._done[index]
        idle = None
        if not gate.is_set():
            idle = self._idle_mark() if mark_idle else None
            t0 = time.perf_counter()
            gate.wait()
            self._timings.add("wait_s", time.perf_counter() - t0)
        self._raise_error()
        if self._upload.pending(index):
            if idle is None and mark_idle:  # the thread did not block; the stream may wait for the copy
                idle = self._idle_mark()
            self._upload.queue_wait(index)
        if idle is not None:
            idle()

    def _idle_mark(self) -> Callable[[], None] | None:
        """Before the training thread blocks (device runs, timings on): record an event on the current stream and
        return the function that records its partner once the stream may go on (``gpu_idle_s``)."""
        return self._timings.time_device_work("gpu_idle_s")

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
            self._timings.add("wait_s", time.perf_counter() - t0)
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
        """Seconds since the last call, per :data:`.timings.TIMING_KEYS`; copies and device work are measured
        from the first call on (their events are recorded only then). Waits for the update in flight."""
        self._timings.recording = True
        self.wait_all()
        return self._timings.take()

    def close(self) -> None:
        """Finish the worker (errors dropped: called from destroy) and stop its thread."""
        try:
            if self._pending is not None:
                self._pending.result()
        except BaseException:  # destroy() must not raise
            pass
        self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
