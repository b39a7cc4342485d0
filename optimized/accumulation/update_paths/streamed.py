"""The host update streamed per bucket (stages 2/3, ``offload_optimizer: cpu``, the native CPU Adam; issue 16;
rules R10, R13-R17 of docs/accumulation.md), with or without R27's one-step delay and R28's split.

With ``offload_optimizer: cpu`` the boundary work is three transfers and one host computation per bucket: the
reduced gradient goes device -> host, the CPU Adam updates the bucket's fp32 master (writing the model-dtype
weights in the same pass), the weights go host -> device. Run one after the other for the whole partition they
add up to more than the GPU's own step; streamed per bucket they overlap. The path is composed of one object per
stage, each with one job:

- :class:`.GradientStream` -- during backward, each bucket's reduced slice into the pinned host accumulator
  (R10) on copy streams of its own, and on the boundary's backward R14's piece sums (:class:`.NormPieceSums`);
- :class:`.HostUpdateWorker` -- from ``step()`` on (R15: the norm first), the CPU Adam of each bucket on a
  worker thread, in flat order, each waiting only for its own gradient; and the waits for it;
- :class:`.WeightUpload` -- each bucket's new weights into the live parameters (H2D on a stream of its own), the
  event the next forward waits for;
- :class:`.UpdateTimings` -- what each stage spent, for ``engine.offload_timings()``;
- :class:`.ImmediateRelease` / :class:`.DelayedRelease` -- whether the weights reach the parameters in this
  step or one boundary later (R27);
- :class:`.DeviceSplit` (R28, ``gpu_share``), optional -- the leading part of the partition on the device;
- :class:`.SpeculativeUpdate` (R30, ``host_update_start: last_backward``), optional -- each bucket's update
  started under the boundary's last backward, settled in ``step()``.

Which of these a path has is decided once, from the config, by one table (:data:`STREAMED_CHOICES`,
:func:`streamed_choices`), into a :class:`StreamedChoices` the path is assembled from.

This module is the path around them: its buffers, the boundary, and what waits for what. Every operation is the
reference's, elementwise, on the same values: streaming changes when and where, never the arithmetic (the
accumulation suite compares the traces bitwise on the host). On the cpu accelerator there is nothing to copy: the
accumulator is the host buffer itself, the norm is summed there, and the asynchrony is the worker thread's (the
next forward waits per module the same way).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optimized.accumulation.buckets import Bucket
from optimized.accumulation.partition import owners
from optimized.accumulation.update_paths.base import (
    BufferPlan,
    HostBuffer,
    PathReports,
    UpdateContext,
    UpdatePath,
    gathered_gradients,
    global_norm,
    initial_master,
    state_buffers,
)
from optimized.accumulation.update_paths.gradient_stream import GradientStream
from optimized.accumulation.update_paths.host_sums import HostRunningSum
from optimized.accumulation.update_paths.host_worker import HostUpdateWorker
from optimized.accumulation.update_paths.norm_sums import BucketRange, NormPieceSums
from optimized.accumulation.update_paths.release import ConfirmedRelease, DelayedRelease, ImmediateRelease, Release
from optimized.accumulation.update_paths.speculation import SpeculativeUpdate
from optimized.accumulation.update_paths.split import DeviceSplit
from optimized.accumulation.update_paths.timings import UpdateTimings
from optimized.accumulation.update_paths.weight_upload import WeightUpload
from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_norm import clip_coefficient, fold_left
from reference.contract.accumulation_step import OptimizerState, StepOutcome
from reference.contract.envvars import middle_backwards
from reference.contract.errors import ConfigurationError

__all__ = ["STREAMED_CHOICES", "StreamedChoices", "StreamedHostUpdate", "streamed_choices"]


def bucket_ranges(ctx: UpdateContext) -> list[BucketRange]:
    """This rank's slice of every gradient bucket, in partition coordinates (ascending, tiling ``[0, P)``)."""
    lo = ctx.partition[0]
    ranges = []
    for i, b in enumerate(ctx.buckets):
        mine = owners(ctx.layout, b.start, b.end)[ctx.rank]
        ranges.append(BucketRange(i, mine.start - lo, mine.end - lo) if mine.length else BucketRange(i, 0, 0))
    return ranges


def _check_separate(weights: torch.Tensor, source: torch.Tensor, accumulator: torch.Tensor,
                    delayed_accumulator: torch.Tensor) -> None:
    """R27 needs the live weights, the update's source and both accumulators in buffers of their own (the worker
    writes one while the forward reads another)."""
    for a, b in ((weights, source), (accumulator, delayed_accumulator), (weights, delayed_accumulator)):
        if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
            raise ValueError("delayed update: the live weights, the update's source and both accumulators "
                             "must be separate buffers")


@dataclass(frozen=True)
class StreamedChoices:
    """The choices one streamed path is assembled from: when the new weights reach the parameters (``release``:
    now, R27's one boundary later, or R30's once the step confirmed a speculation), whether the leading part of the
    partition is updated on the device (``splits``, R28) and whether each bucket's update starts under the
    boundary's last backward (``speculates``, R30)."""

    release: type[Release]
    splits: bool
    speculates: bool


#: Every combination the config can produce, keyed by (``delayed_parameter_update``, ``gpu_share`` other than 0,
#: ``host_update_start == "last_backward"``). R30 speculates into a buffer of its own, so its release is the
#: confirmed one; R27 with R30 is refused by the config (``_check_host_update_start``), so it has no row.
STREAMED_CHOICES: dict[tuple[bool, bool, bool], StreamedChoices] = {
    (False, False, False): StreamedChoices(ImmediateRelease, splits=False, speculates=False),
    (True, False, False): StreamedChoices(DelayedRelease, splits=False, speculates=False),
    (False, True, False): StreamedChoices(ImmediateRelease, splits=True, speculates=False),
    (True, True, False): StreamedChoices(DelayedRelease, splits=True, speculates=False),
    (False, False, True): StreamedChoices(ConfirmedRelease, splits=False, speculates=True),
    (False, True, True): StreamedChoices(ConfirmedRelease, splits=True, speculates=True),
}


def streamed_choices(config: AccumulationConfig) -> StreamedChoices:
    """The row of :data:`STREAMED_CHOICES` ``config`` selects (the only place these three keys are decoded)."""
    key = (bool(config.delayed_parameter_update), config.gpu_share != 0.0,
           config.host_update_start == "last_backward")
    choices = STREAMED_CHOICES.get(key)
    if choices is None:  # the config's own checks refuse these first; kept for a config built around them
        raise ConfigurationError(
            f"delayed_parameter_update={config.delayed_parameter_update!r} with gpu_share={config.gpu_share!r} and "
            f"host_update_start={config.host_update_start!r} is no streamed update path; allowed combinations "
            f"(delayed, split, last_backward): {sorted(STREAMED_CHOICES)}"
        )
    return choices


class StreamedHostUpdate(UpdatePath):
    """Master, Adam moments and the fp32 gradient accumulator pinned on the host; each bucket's reduced gradient
    streams out during backward, the CPU Adam runs per bucket on a worker from ``step()`` on, and the next
    forward waits per module for its own buckets only. Assembled from the config's :class:`StreamedChoices`:
    a release policy, optionally a device side (R28) and a speculative stage (R30)."""

    def __init__(self, ctx: UpdateContext) -> None:
        #: the choices this path was assembled from (:func:`streamed_choices`)
        self.choices = choices = streamed_choices(ctx.config)
        if choices.splits:
            DeviceSplit.prepare(ctx)
        super().__init__(ctx)
        cfg = self.config
        on_device = ctx.device.type != "cpu"
        self._release = choices.release(ctx)
        self.lags_parameters = self._release.lags_parameters
        #: the fp32 master of the whole partition (read through :attr:`master`: the split's device side joined in)
        self._host_master = initial_master(ctx, on_host=True)
        self.opt_state = OptimizerState(0, state_buffers(ctx, ("exp_avg", "exp_avg_sq"), on_host=True))
        self._cast = self._release.cast_buffer(self._host_master) if cfg.model_dtype == torch.bfloat16 else None
        self.accumulator = ctx.host.empty(ctx.layout.partition_size, cfg.accum_dtype, pinned=on_device).zero_()
        accumulators = [self.accumulator]
        second = self._release.second_accumulator()
        weights = ctx.weights.partition()
        if second is not None:
            source = self._host_master if self._cast is None else self._cast
            _check_separate(weights, source, self.accumulator, second)
            accumulators.append(second)
        ranges = bucket_ranges(ctx)
        self._timings = UpdateTimings(ctx.device)
        running_sum = None
        if _adds_middle_backwards_on_host(cfg, on_device):  # issue 49 item 4: .host_sums
            landing = ctx.host.empty(ctx.layout.partition_size, cfg.comm_dtype, pinned=True)
            running_sum = HostRunningSum(landing, cfg.accum_dtype, len(ranges), self._timings)
        self._gradients = GradientStream(
            device=ctx.device, ranges=ranges, norms=NormPieceSums(ctx.layout, ctx.rank, ranges, on_device),
            accum_dtype=cfg.accum_dtype, comm_dtype=cfg.comm_dtype, accumulators=accumulators, timings=self._timings,
            running_sum=running_sum,
        )
        self._upload = WeightUpload(ctx.device, len(ranges), self._timings)
        #: R30: the update under the last backward (None: it starts in step())
        self._speculation = (
            _speculative_stage(ctx, self._gradients, self._host_master, self.opt_state) if choices.speculates
            else None
        )
        self._worker = HostUpdateWorker(
            ranges=ranges, gradients=self._gradients, upload=self._upload, timings=self._timings,
            master=self._host_master, exp_avg=self.opt_state.buffers["exp_avg"],
            exp_avg_sq=self.opt_state.buffers["exp_avg_sq"], cast_out=self._cast, weights=weights,
            publish_first=self._release.lags_parameters, speculation=self._speculation,
        )
        #: R28: the device side and the cut (None: the host updates the whole partition)
        self._split = (
            DeviceSplit(ctx, self._gradients, self._worker, self._timings, self._release,
                        host_starts_in_backward=self._speculation is not None) if choices.splits else None
        )
        self.reports = StreamedReports(self._worker, self._split, self._speculation)
        #: buckets whose reduce-scatter was launched and whose result is not yet absorbed
        self._launched: deque[Bucket] = deque()
        #: whether this backward takes the R14 piece sums on the device as buckets stream out
        self._want_norm_pieces = False

    @classmethod
    def planned_host_buffers(cls, plan: BufferPlan) -> list[HostBuffer]:
        """Master and moments (pinned), the model-dtype buffer the kernel writes where it is not the live
        parameters, the gradient accumulator(s) (pinned on a device run), R30's backup (unpinned)."""
        choices = streamed_choices(plan.config)
        if choices.splits:
            super().planned_host_buffers(plan)  # R28: the cut is decided at run time ("auto" measures it)
        cfg = plan.config
        out = plan.state()
        if cfg.model_dtype == torch.bfloat16 and choices.release.cast_is_own_buffer(plan):
            out.append(plan.buffer("model-dtype weights", plan.master_numel, cfg.model_dtype, pinned=plan.on_device))
        for k in range(choices.release.accumulators):
            out.append(plan.buffer(f"gradient accumulator {k + 1}", plan.partition_size, cfg.accum_dtype,
                                   pinned=plan.on_device))
        if _adds_middle_backwards_on_host(cfg, plan.on_device):
            out.append(plan.buffer("middle backwards' landing buffer", plan.partition_size, cfg.comm_dtype,
                                   pinned=True))
        if choices.speculates:
            out += [HostBuffer(f"backup of {b.name}", b.nbytes, False) for b in plan.state()]
        return out

    def _settled(self) -> None:
        """R30: undo a speculation no step claimed before anything reads or replaces the state it wrote."""
        if self._speculation is not None:
            self._speculation.discard()

    @property
    def master(self) -> torch.Tensor:  # type: ignore[override]  # read-only here: joined from its host/device parts
        """This rank's fp32 master (the host's full-partition buffer; with a split, its device side joined in)."""
        self._settled()
        if self._split is not None:
            self._split.store(self._host_master, self.opt_state, self._cast)
        return self._host_master

    # ---- backward ----------------------------------------------------------------------------------------
    def begin_backward(self, boundary_predicted: bool) -> None:
        if self._split is not None:
            self._split.backward_starts()
        self._release.before_backward(self._worker)
        # The R14 piece sums are taken on the device as buckets stream out when this backward is (predicted to
        # be) the boundary's; otherwise the boundary sums the host accumulator.
        managed = self.config.managed_gradient_accumulation
        self._want_norm_pieces = boundary_predicted or (not managed and self.ctx.device.type != "cpu")
        self._gradients.begin_backward(more_follow=managed and not boundary_predicted)
        self._launched.clear()
        if self._speculation is not None:  # R30: an earlier open speculation is undone first
            if boundary_predicted:
                self._speculation.begin(self.opt_state.step + 1)
            else:
                self._speculation.discard()

    def bucket_gradients(self, bucket: Bucket) -> torch.Tensor:
        """Allocated at the bucket's first gradient and dropped once reduced (no model-sized flat buffer)."""
        return bucket.own_gradients(self.config.comm_dtype, self.ctx.device)

    def bucket_launched(self, bucket: Bucket) -> None:
        # Accumulate and stream out the bucket launched before this one while this one's reduce-scatter runs
        # (one behind, so a gradient hook does not wait on its own collective).
        self._launched.append(bucket)
        while len(self._launched) > 1:
            _absorb(self._gradients, self._launched.popleft(), self._want_norm_pieces, self._speculation)

    def finish_backward(self, buckets: Sequence[Bucket]) -> None:
        while self._launched:
            _absorb(self._gradients, self._launched.popleft(), self._want_norm_pieces, self._speculation)
        self._gradients.end_backward(self._want_norm_pieces)

    # ---- the boundary --------------------------------------------------------------------------------------
    def before_step(self) -> None:
        self._release.before_step(self._worker)

    def boundary(self, hyper: OptimizerConfig, record_gradients: bool) -> StepOutcome:
        """R13: the reduction finished in backward; the norm from the per-piece sums; the update runs per bucket
        on the worker and this returns while it does (stage 2 at W > 1: after the per-bucket all-gather, which
        overlaps the update of the next bucket). R27: a warm-up boundary is applied at once."""
        warming_up = self._release.warming_up()
        ctx, gradients = self.ctx, self._gradients
        recorded = gathered_gradients(ctx, gradients.grad_for_boundary()) if record_gradients else None
        # R14: per-piece fp64 sums in flat order (taken on the device as the buckets streamed out), rank order.
        norm = global_norm(ctx, fold_left(gradients.piece_sums()))
        clip_coef = clip_coefficient(norm, self.config.gradient_clipping)
        self.opt_state.step += 1
        if self._speculation is not None:  # R30: the update task queued next settles what ran under backward
            self._speculation.claim(hyper, self.opt_state.step, clip_coef)
        if self._split is not None:  # R28: the device side's step, before the host's
            self._split.step_device_side(hyper, self.opt_state.step, clip_coef, self._host_master, self.opt_state)
        self._worker.start(hyper, self.opt_state.step, clip_coef)
        if ctx.stage == 2 and ctx.world_size > 1:
            _all_gather_per_bucket(ctx, self._worker)
            self._release.after_all_gather(self._worker)
        if warming_up:
            self.synchronize()
            self.apply_delayed()
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=recorded)

    # ---- what is in flight ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self._worker.in_flight:
            self._worker.wait_all()

    def wait_range(self, lo: int, hi: int) -> None:
        if self._worker.in_flight:
            self._worker.wait_range(lo, hi)

    def install_forward_waits(self, module: nn.Module, names_of: dict[int, str], add_hook: Callable) -> None:
        """Stage 2: before each module's forward, wait for the buckets holding its own parameters only (other
        ranks' slices arrive in step())."""
        if self.ctx.stage == 2:
            _install_forward_waits(self.ctx, self._worker, module, names_of, add_hook)

    def apply_delayed(self) -> None:
        def newest_weights() -> torch.Tensor:
            # The model-dtype source the last update wrote: the kernel's cast buffer, or the master of an fp32
            # model. Reading ``master`` first settles R30 and joins R28's device side into both.
            master = self.master
            return master if self._cast is None else self._cast

        self._release.apply(newest_weights, self.ctx.weights.write)

    # ---- state ----------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self._settled()
        self._worker.wait_all()
        self._gradients.wait_transfers_out()
        self._gradients.restart()
        super().zero_grad()

    def optimizer_state(self) -> OptimizerState:
        self._settled()
        if self._split is not None:
            self._split.store(self._host_master, self.opt_state, self._cast)
        return super().optimizer_state()

    def live_weights_to_save(self) -> torch.Tensor | None:
        return self._release.live_weights_to_save()

    def install(self, master: torch.Tensor, opt_buffers: dict[str, torch.Tensor] | None,
                applied: torch.Tensor | None) -> None:
        super().install(master, opt_buffers, applied)
        if self._split is not None:
            self._split.load(self._host_master, self.opt_state)

    def _install_cast(self, lp: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
        return self._release.installed(self._cast, lp, applied)

    def close(self) -> None:
        # never raises: lets the worker finish (it writes into buffers the engine unpins next)
        self._worker.close()
        self._gradients.close()
        self._upload.close()
        super().close()


class StreamedReports(PathReports):
    """What the streamed path reports (``engine.offload_timings()``, ``engine.split_report()``)."""

    def __init__(self, worker: HostUpdateWorker, split: DeviceSplit | None,
                 speculation: SpeculativeUpdate | None) -> None:
        self._worker = worker
        self._split = split
        self._speculation = speculation

    def offload_timings(self) -> dict[str, float] | None:
        return self._worker.take_timings()

    def split_report(self) -> dict | None:
        return None if self._split is None else self._split.report()

    def overlap_report(self) -> dict | None:
        if self._speculation is None:
            return None
        self._worker.wait_all()  # the last boundary's settling counted
        return self._speculation.report()


def _adds_middle_backwards_on_host(config: AccumulationConfig, on_device: bool) -> bool:
    """Issue 49 item 4: a device run whose managed schedule has middle backwards (three micro-batches or more)
    adds their gradients into the host accumulator on the host (:mod:`.host_sums`; a landing buffer at the comm
    dtype) where ``HOSTOFFLOAD_MIDDLE_BACKWARDS=host``. Read once, at construction (and by the estimate)."""
    return (on_device and config.managed_gradient_accumulation and config.gradient_accumulation_steps >= 3
            and middle_backwards() == "host")


def _absorb(gradients: GradientStream, bucket: Bucket, want_sums: bool,
            speculation: SpeculativeUpdate | None) -> None:
    """R10 for one bucket: its reduced slice into the host accumulator; R30: then its speculative update (queued
    after the bucket's D2H event was recorded, which the worker waits for)."""
    gradients.absorb(bucket.index, bucket.take_reduced(), want_sums)
    if speculation is not None:
        speculation.bucket_landed(gradients.ranges[bucket.index])


def _speculative_stage(ctx: UpdateContext, gradients: GradientStream, master: torch.Tensor,
                       opt_state: OptimizerState) -> SpeculativeUpdate:
    """R30: the speculative stage over the state one bucket's update writes (its backup on the host, unpinned:
    only the worker thread reads it)."""
    return SpeculativeUpdate(
        gradients=gradients, state={"master": master, **opt_state.buffers}, hyper_now=ctx.hyper_now,
        backup=lambda buf: ctx.host.empty(buf.numel(), buf.dtype, pinned=False),
    )


def _all_gather_per_bucket(ctx: UpdateContext, worker: HostUpdateWorker) -> None:
    """R12 (stage 2): every rank needs every bucket's new weights; broadcast each owner's slice as soon as its
    bucket is updated, while the worker updates the next one."""
    works = []
    flat = ctx.weights.flat
    for b in ctx.buckets:
        worker.wait_bucket(b.index)
        pieces = [(o.rank, flat[o.start : o.end]) for o in owners(ctx.layout, b.start, b.end)]
        works.extend(ctx.comm.start_broadcasts(pieces, "parameter all-gather (per bucket)"))
    ctx.comm.wait_all(works, "parameter all-gather (per bucket)")


def _install_forward_waits(ctx: UpdateContext, worker: HostUpdateWorker, module: nn.Module,
                           names_of: dict[int, str], add_hook: Callable) -> None:
    """Before each module's forward, wait for the buckets of this rank's partition holding its own parameters."""
    lo, hi = ctx.partition
    segments = {s.name: s for s in ctx.layout.segments}
    for mod in module.modules():
        segs = [segments[names_of[id(p)]] for p in mod.parameters(recurse=False) if id(p) in names_of]
        a = max(lo, min((s.offset for s in segs), default=hi))
        b = min(hi, max((s.end for s in segs), default=lo))
        if a >= b:
            continue

        def wait_own(module: nn.Module, args: Any, a: int = a - lo, b: int = b - lo) -> None:
            if worker.in_flight:
                worker.wait_range(a, b)

        add_hook(mod.register_forward_pre_hook(wait_own))
