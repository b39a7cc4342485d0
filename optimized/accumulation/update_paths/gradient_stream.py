"""The streamed update's first stage: this rank's reduced gradient, bucket by bucket, into the pinned host
accumulator during backward (R10), with R14's piece sums on the boundary's backward.

Each backward, as soon as a bucket's rank-ordered reduce-scatter has a result, an offload stream adds it into the
bucket's accumulator and copies the result into the pinned host accumulator. The fp32 accumulator never lives on
the device: a second stream brings the bucket's running sum up from the host into a staging buffer (``0 + g`` on
the first backward of a boundary, so the arithmetic is R10's ``acc + red`` in the same order), the offload stream
adds and sends it back. The upload has a stream of its own so that it runs on the other copy engine, beside the
previous bucket's D2H: on one stream the two directions would run one after the other, and the last backward of an
accumulation would move twice the bytes it has time for. On the backward a managed schedule says is the
boundary's, the same stream also sums the squares of every R14 piece of the bucket (:mod:`.norm_sums`).

The first backward of an accumulation that more backwards will follow (a managed schedule says so) sends its reduced
gradient at the comm dtype's width instead: the running sum after it is ``0 + red``, which that dtype holds exactly,
so the D2H and the next backward's upload carry 2 bytes per element instead of 4 with bf16 reductions (the host's
memory, shared by those copies and the host Adam under R30, sees half the traffic). The narrow values live in the
first bytes of the bucket's own host accumulator range (:func:`packed_view`); the next backward brings them up
into a narrow staging buffer and adds ``0 + red_1`` then ``red_2`` on the device, R10's arithmetic in R10's order.
A boundary that comes after such a backward anyway (an unforeseen one) widens them on the host first.

A middle backward (neither the accumulation's first nor, by a managed schedule, its last) sends its reduced
gradient down at the comm dtype's width into a landing buffer and :class:`.HostRunningSum` adds it on the host
(:mod:`.host_sums`: nothing is brought up; the boundary's backward still adds on the device and sums R14's pieces
there). Only where the path gave the stream a landing buffer (``running_sum``: ``HOSTOFFLOAD_MIDDLE_BACKWARDS=host``).

R28 (the split): once :meth:`GradientStream.keep_on_device` made a cut, the device side's slices are added into an
fp32 accumulator on the device and never leave it (no D2H, no upload of the running sum); the host accumulator's
``[0, cut)`` is then stale until :meth:`GradientStream.grad_for_boundary` joins it in for a reader of the whole
partition.

R27 (the delayed update): :meth:`GradientStream.hand_over` gives the finished accumulator to the host update and
accumulates the next boundary into the second one.

On the cpu accelerator there is nothing to copy: the accumulator is the host buffer itself and the sums are taken
there. Who reads the result: the host update worker (:mod:`.host_worker`), bucket by bucket once
:meth:`GradientStream.wait_landed` says its D2H has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optimized.accumulation.device_spans import timing_event
from optimized.accumulation.update_paths.host_sums import HostRunningSum
from optimized.accumulation.update_paths.norm_sums import BucketRange, NormPieceSums
from optimized.accumulation.update_paths.timings import UpdateTimings
from reference.contract.envvars import staging_elements

__all__ = ["GradientStream", "packed_view", "widen_packed"]


class GradientStream:
    """The host accumulator(s) of one rank, filled per bucket off the device (see the module docstring).

    ``accumulators``: one pinned host buffer of the partition (accumulation dtype), or two for R27.
    """

    def __init__(self, *, device: torch.device, ranges: Sequence[BucketRange], norms: NormPieceSums,
                 accum_dtype: torch.dtype, comm_dtype: torch.dtype, accumulators: Sequence[torch.Tensor],
                 timings: UpdateTimings, running_sum: HostRunningSum | None = None) -> None:
        self.device = device
        self.on_device = device.type != "cpu"
        self.ranges = ranges
        self.norms = norms
        self.accum_dtype = accum_dtype
        self._accumulators = list(accumulators)
        self._current = 0
        #: the accumulator the running backward adds into
        self.accumulator = self._accumulators[0]
        self._timings = timings
        self._first = True  # no backward since the last boundary: the accumulator is logically zero
        #: whether the running backward sends its gradient narrow (see the module docstring), and whether the host
        #: accumulator holds such narrow values now (the last backward did)
        self._pack = self._packed = False
        #: the middle backwards' adds on the host (None: every backward adds on the device), and whether the
        #: running backward is such a middle one
        self._host_sum = running_sum if self.on_device else None
        self._middle = False
        #: the comm dtype when it is narrower than the accumulation dtype (else None: nothing to gain by packing)
        self._narrow = comm_dtype if comm_dtype.itemsize < accum_dtype.itemsize else None
        #: whether the accumulation dtype holds every comm-dtype value exactly (bf16 into fp32, or the same dtype):
        #: then ``acc.add_(red)`` computes R10's ``acc + red.to(accum_dtype)`` with the same single rounding, and
        #: the bucket-sized converted copy of ``red`` is never made (on the 886M shape the vocabulary buckets'
        #: copy was 0.25 GiB live at the peak, issue 49 item 2). A narrower accumulation keeps the conversion: fp32
        #: into bf16 would round twice.
        self._adds_without_copy = torch.promote_types(comm_dtype, accum_dtype) == accum_dtype
        #: R28: the elements of the partition below this are the device side's (set by :meth:`keep_on_device`)
        self._cut = 0
        #: R28, device runs: the device side's fp32 gradient accumulator for ``[0, cut)``
        self._device_grad: torch.Tensor | None = None
        #: whether the current accumulation keeps ``[0, cut)`` in ``_device_grad`` alone
        self._device_side_here = False
        if self.on_device:
            self._init_device_streams()

    def _narrow_dtype(self) -> torch.dtype:
        """The comm dtype a packed backward keeps its running sum in (set where it is narrower than accum)."""
        assert self._narrow is not None, "packing needs a comm dtype narrower than the accumulation dtype"
        return self._narrow

    def _narrow_slots(self) -> list[torch.Tensor]:
        """The staging slots a packed running sum is brought up to (allocated at the first packed backward)."""
        assert self._narrow_staging is not None, "no packed backward allocated the narrow staging slots"
        return self._narrow_staging

    def _device_side_grad(self) -> torch.Tensor:
        """R28: the device side's gradient accumulator (a device run with a device side only)."""
        assert self._device_grad is not None, "no device side keeps its gradient on the device"
        return self._device_grad

    def _init_device_streams(self) -> None:
        """A device run's staging buffers, copy streams and per-bucket events."""
        device = self.device
        # A bucket's host part passes through the two slots in chunks of at most HOSTOFFLOAD_STAGING_ELEMENTS
        # (16 Mi by default: 64 MiB at fp32, large enough for copies at PCIe's full rate). Sized by the longest
        # bucket instead, the slots of the 886M shape's vocabulary buckets (65.5M elements each) held 0.73 GiB of
        # the device for the whole run, at the peak too (issue 49 item 2).
        longest = min(max((b.length for b in self.ranges), default=0), staging_elements())
        #: how many elements of a bucket pass through a staging slot at a time
        self._chunk = max(1, longest)
        # Two staging buffers: the stream adds into one while the other's D2H drains.
        self._staging = [torch.empty(longest, dtype=self.accum_dtype, device=device) for _ in range(2)]
        #: where a packed running sum is brought up to (allocated at the first packed backward)
        self._narrow_staging: list[torch.Tensor] | None = None
        self._turn = 0
        self._d2h_stream = torch.cuda.Stream(device)
        #: brings a bucket's running sum up from the host on a copy engine of its own, so that it runs beside
        #: the previous bucket's D2H instead of after it (one stream would serialize the two directions)
        self._up_stream = torch.cuda.Stream(device)
        #: per staging slot, the event after the last D2H that read it (an upload into it waits for it)
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._d2h_done: list[torch.cuda.Event | None] = [None] * len(self.ranges)

    def keep_on_device(self, n: int) -> None:
        """R28: from the next accumulation on, the gradient of the partition's ``[0, n)`` is the device side's: on
        a device run it is accumulated on the device and never crosses to the host."""
        self._cut = n
        if self.on_device:
            self._device_grad = torch.empty(n, dtype=self.accum_dtype, device=self.device)

    # ---- backward: accumulate (R10) and stream out ----------------------------------------------------------
    def begin_backward(self, more_follow: bool) -> None:
        """``more_follow``: a managed schedule says this backward is not the accumulation's last (it may pack)."""
        self.norms.fresh = False
        if self._first:  # a new accumulation: where the device side's gradient lives is decided for all of it
            self._device_side_here = self.on_device and self._device_grad is not None and self._cut > 0
        self._pack = self._first and more_follow and self.on_device and self._narrow is not None
        self._middle = not self._first and more_follow and self._host_sum is not None
        if self._pack and self._narrow_staging is None:
            self._narrow_staging = [torch.empty(self._chunk, dtype=self._narrow, device=self.device)
                                    for _ in range(2)]

    def absorb(self, index: int, reduced: torch.Tensor, want_sums: bool) -> None:
        """Add this rank's reduced slice of bucket ``index`` (comm dtype, on the device) into its accumulator
        (R10: ``acc + red.to(accum_dtype)``, acc from zeros after a boundary); with ``want_sums`` also the
        R14 piece sums of the result."""
        b = self.ranges[index]
        if not b.length:
            return
        if self._host_sum is not None:  # its last add read the landing buffer and wrote the running sum
            self._host_sum.wait(index)
        if not self.on_device:
            host = self.accumulator[b.lo : b.hi]
            if self._first:
                host.zero_()
            host.add_(reduced.to(self.accum_dtype))
            if want_sums:
                self.norms.take(b, b.lo, None, host)
            return
        # R28: [b.lo, cut) is the device side's and stays in _device_grad; [cut, b.hi) goes through the host.
        cut = max(b.lo, min(b.hi, self._cut)) if self._device_side_here else b.lo
        stream = self._d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # any conversion runs on the D2H stream, which alone reads it
            # a packed or middle backward without a device side needs no wide copy of the gradient at all
            red = (None if (self._pack or self._middle) and cut == b.lo
                   else reduced if self._adds_without_copy else reduced.to(self.accum_dtype))
        if want_sums:
            self.norms.clear(b)
        if cut > b.lo:
            # a device side here: its accumulator exists, and red was made (only [cut, hi) may go packed)
            assert self._device_grad is not None and red is not None
            with torch.cuda.stream(stream):
                kept = self._device_grad[b.lo : cut]
                if self._first:
                    kept.zero_()
                kept.add_(red[: cut - b.lo])
                if want_sums:
                    self.norms.take_part(b, b.lo, kept)
        if self._middle:  # a managed schedule's middle backward: its piece sums are never wanted
            assert not want_sums, "the piece sums are taken on the boundary's backward, which is no middle one"
            self._send_to_host_sum(index, b, cut, reduced)
            return
        narrow = self._pack or self._packed
        packed = packed_view(self.accumulator, cut, b.hi, self._narrow_dtype()) if narrow and cut < b.hi else None
        event = None
        # The host part passes through the staging slots a chunk at a time, last chunk first: a wide D2H of chunk
        # k overwrites the bytes where a packed backward left chunks 2k and 2k+1, which descending order has
        # uploaded already (ascending order would overwrite chunk k+1's packed values before they were read).
        for lo in reversed(range(cut, b.hi, self._chunk)):
            hi = min(b.hi, lo + self._chunk)
            slot, uploaded = self._upload(index, lo, hi, None if packed is None else packed[lo - cut : hi - cut])
            with torch.cuda.stream(stream):
                if self._pack:  # 0 + red is red itself: it leaves at the comm dtype's width
                    assert packed is not None  # a packing backward has the packed view of [cut, hi)
                    source, target = reduced[lo - b.lo : hi - b.lo], packed[lo - cut : hi - cut]
                else:
                    assert red is not None  # made whenever this backward does not pack
                    source = self._running_sum(slot, hi - lo, uploaded, red[lo - b.lo : hi - b.lo])
                    target = self.accumulator[lo:hi]
                    if want_sums:
                        self.norms.take_part(b, lo, source)
                begin = timing_event(stream)
                target.copy_(source, non_blocking=True)
                event = timing_event(stream)
                self._slot_free[slot] = event
                self._timings.span("d2h_s", begin, event)
        if event is None:
            event = timing_event(stream)
        reduced.record_stream(stream)
        self._d2h_done[index] = event

    def _send_to_host_sum(self, index: int, b: BucketRange, cut: int, reduced: torch.Tensor) -> None:
        """A middle backward's host part of bucket ``b``: ``reduced[cut:]`` down into the landing buffer as it is
        (comm dtype), then added on the host (:mod:`.host_sums`); a packed first backward's values are widened
        there first."""
        host_sum = self._host_sum
        assert host_sum is not None  # a middle backward needs the landing buffer
        stream = self._d2h_stream
        event = None
        if cut < b.hi:
            with torch.cuda.stream(stream):
                begin = timing_event(stream)
                host_sum.landing[cut : b.hi].copy_(reduced[cut - b.lo :], non_blocking=True)
                event = timing_event(stream)
            self._timings.span("d2h_s", begin, event)
            widen = None
            if self._packed:
                narrow, acc, hi = self._narrow_dtype(), self.accumulator, b.hi

                def widen() -> None:
                    widen_packed(acc, cut, hi, narrow)

            host_sum.add(index, self.accumulator, cut, b.hi, event.synchronize, widen)
        if event is None:
            event = timing_event(stream)
        reduced.record_stream(stream)
        self._d2h_done[index] = event

    def _running_sum(self, slot: int, n: int, uploaded: torch.cuda.Event | None, red: torch.Tensor) -> torch.Tensor:
        """On the D2H stream: staging slot ``slot``'s first ``n`` elements become R10's ``acc + red`` -- acc from
        zeros on an accumulation's first backward, else the running sum :meth:`_upload` brought up (narrow after a
        packed backward: ``0 + red_1`` first, the order R10 adds in)."""
        stage = self._staging[slot][:n]
        if uploaded is None:
            stage.zero_()
        else:
            self._d2h_stream.wait_event(uploaded)
            if self._packed:
                stage.zero_()
                stage.add_(self._narrow_slots()[slot][:n])
        stage.add_(red)
        return stage

    def _upload(self, index: int, lo: int, hi: int,
                packed: torch.Tensor | None) -> tuple[int, torch.cuda.Event | None]:
        """A staging slot for the host chunk ``[lo, hi)`` of bucket ``index`` and, after the first backward of an
        accumulation, the event of the upload of its running sum into it (on the upload stream: once the slot's
        last D2H and the previous backward's last D2H of this bucket have run). None: nothing to upload (the sum
        starts at 0). ``packed``: the chunk's narrow values where the last backward packed them."""
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
            if self._packed:
                assert packed is not None  # the last backward packed: the chunk's narrow values are given
                self._narrow_slots()[slot][: hi - lo].copy_(packed, non_blocking=True)
            else:
                self._staging[slot][: hi - lo].copy_(self.accumulator[lo:hi], non_blocking=True)
            done = timing_event(up)
        self._timings.span("grad_up_s", begin, done)
        return slot, done

    def end_backward(self, summed: bool) -> None:
        """Every bucket was absorbed; ``summed``: the piece sums were taken in this backward (the boundary's)."""
        self._first = False
        self._packed, self._pack = self._pack, False
        self.norms.fresh = summed
        if summed and self.on_device and self._timings.recording:
            # How long the boundary waits for the gradient stream after backward's last kernel (clamped at 0).
            ended = timing_event(torch.cuda.current_stream(self.device))
            self._timings.span("grad_exposed_s", ended, timing_event(self._d2h_stream))

    # ---- the boundary: the finished gradient ---------------------------------------------------------------
    def wait_landed(self, index: int) -> None:
        """Bucket ``index``'s gradient has landed in the host accumulator (the others may not have)."""
        if self.on_device:
            done = self._d2h_done[index]
            if done is not None:
                done.synchronize()
        if self._host_sum is not None:
            self._host_sum.wait(index)

    def wait_transfers_out(self) -> None:
        """The host accumulator holds the final gradient (every D2H has landed), and every kernel or copy queued
        so far has run: the update may now write host buffers those copies read (stage-3 gathers from pinned
        partitions) and device buffers those kernels read. The norm needs all of backward anyway."""
        if self.on_device:
            self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._d2h_stream.synchronize()
        if self._host_sum is not None:
            self._host_sum.wait_all()

    def host_side_gradient(self) -> torch.Tensor:
        """The host accumulator with every D2H landed (zeros if no backward since the boundary): complete on
        ``[cut, P)``, the part the worker updates; ``[0, cut)`` is stale where the device side's gradient stayed
        on the device (:meth:`device_gradient` has it)."""
        if self._first:
            self.accumulator.zero_()
        self.wait_transfers_out()
        if self._packed:  # an accumulation that ended after a packed backward: widen on the host (0 + red)
            self._packed = False
            lo = self._cut if self._device_side_here else 0
            for b in self.ranges:
                if max(b.lo, lo) < b.hi:
                    widen_packed(self.accumulator, max(b.lo, lo), b.hi, self._narrow_dtype())
        return self.accumulator

    def grad_for_boundary(self) -> torch.Tensor:
        """The accumulated partition gradient, on the host, complete (zeros if no backward since the boundary):
        for readers of the whole partition (``record_gradients``, the norm when backward did not sum it)."""
        grad = self.host_side_gradient()
        if self._device_side_here and not self._first:
            grad[: self._cut].copy_(self._device_side_grad()[: self._cut])
        return grad

    def device_gradient(self, n: int) -> torch.Tensor | None:
        """R28: the accumulated gradient of ``[0, n)`` where this accumulation kept it on the device (complete
        once :meth:`host_side_gradient` returned), or None (take it from the host accumulator)."""
        if self._first or not self._device_side_here:
            return None
        self.wait_transfers_out()
        return self._device_side_grad()[:n]

    def piece_sums(self) -> list[float]:
        """R14's per-piece fp64 sums of squares of the accumulated gradient, in flat order."""
        if not self.norms.fresh:
            self.norms.sum_host(self.grad_for_boundary(), self.ranges)
        if self.norms.on_the_device():
            torch.cuda.current_stream(self.device).wait_stream(self._d2h_stream)
        return self.norms.values()

    # ---- a new accumulation ---------------------------------------------------------------------------------
    def restart(self) -> None:
        """R13 step 6: the next backward starts a new accumulation (the accumulator is logically zero)."""
        self._first = True
        self._packed = False
        self.norms.fresh = False

    def hand_over(self) -> None:
        """R27: the host update reads the finished accumulator; the next backward accumulates into the other one
        (R13 step 6)."""
        self._current ^= 1
        self.accumulator = self._accumulators[self._current]
        self.restart()

    def close(self) -> None:
        """Let the copies in flight finish (errors dropped: called from destroy)."""
        if self.on_device:
            try:
                self._d2h_stream.synchronize()
                self._up_stream.synchronize()
            except BaseException:
                pass
        if self._host_sum is not None:
            self._host_sum.close()


def packed_view(accumulator: torch.Tensor, lo: int, hi: int, narrow: torch.dtype) -> torch.Tensor:
    """The ``hi - lo`` narrow (comm dtype) values a packed backward keeps in the first bytes of ``accumulator[lo:hi]``
    (the same pinned memory: a copy into it is a D2H like any other)."""
    return accumulator[lo:hi].view(torch.uint8)[: (hi - lo) * narrow.itemsize].view(narrow)


def widen_packed(accumulator: torch.Tensor, lo: int, hi: int, narrow: torch.dtype) -> None:
    """``accumulator[lo:hi] = 0 + packed`` (R10 after one backward) from :func:`packed_view`'s values, in place.
    The narrow values share the range's bytes, so they are copied out first."""
    values = packed_view(accumulator, lo, hi, narrow).clone()
    wide = accumulator[lo:hi]
    wide.zero_()
    wide.add_(values)
