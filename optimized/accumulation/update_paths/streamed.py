"""The host update streamed per bucket (stages 2/3, ``offload_optimizer: cpu``, the native CPU Adam), with or
without the one-step delay of R27. The pipelining itself is :mod:`optimized.accumulation.streamed_update`; this
module is the path around it: its buffers, the boundary, and what waits for what."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from optimized.accumulation.partition import owners
from optimized.accumulation.streamed_update import StreamedUpdate
from optimized.accumulation.update_paths.base import UpdateContext, UpdatePath
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_norm import clip_coefficient, fold_left
from reference.contract.accumulation_step import OptimizerState, StepOutcome

__all__ = ["DelayedHostUpdate", "StreamedHostUpdate"]


class StreamedHostUpdate(UpdatePath):
    """Master, Adam moments and the fp32 gradient accumulator pinned on the host; each bucket's reduced gradient
    streams out during backward, the CPU Adam runs per bucket on a worker from ``step()`` on, and the next
    forward waits per module for its own buckets only."""

    def __init__(self, ctx: UpdateContext) -> None:
        super().__init__(ctx)
        cfg = self.config
        lo = ctx.partition[0]
        on_device = ctx.device.type != "cpu"
        self.master = self._initial_master(on_host=True)
        self.opt_state = OptimizerState(0, self._state_buffers(("exp_avg", "exp_avg_sq"), on_host=True))
        self._cast = self._cast_buffer() if cfg.model_dtype == torch.bfloat16 else None
        self.accumulator = ctx.host.empty(ctx.layout.partition_size, cfg.accum_dtype, pinned=on_device).zero_()
        ranges = []
        for b in ctx.buckets:
            mine = owners(ctx.layout, b.start, b.end)[ctx.rank]
            ranges.append((mine.start - lo, mine.end - lo) if mine.length else (0, 0))
        self._update = StreamedUpdate(
            device=ctx.device,
            layout=ctx.layout,
            rank=ctx.rank,
            ranges=ranges,
            accum_dtype=cfg.accum_dtype,
            accumulator=self.accumulator,
            master=self.master,
            exp_avg=self.opt_state.buffers["exp_avg"],
            exp_avg_sq=self.opt_state.buffers["exp_avg_sq"],
            cast_out=self._cast,
            weights=ctx.weights.partition(),
            delayed_accumulator=self._second_accumulator(),
        )
        #: buckets whose reduce-scatter was launched and whose result is not yet absorbed
        self._launched: deque[Any] = deque()
        #: whether this backward takes the R14 piece sums on the device as buckets stream out
        self._want_norm_pieces = False

    def _cast_buffer(self) -> torch.Tensor:
        """Where the kernel writes the model-dtype weights: the live parameters themselves where they are on the
        host, else a host buffer the H2D copies from."""
        ctx = self.ctx
        if ctx.stage == 3 and ctx.weights.param_device.type == "cpu":
            return ctx.weights.part
        if ctx.stage == 2 and ctx.device.type == "cpu":
            return ctx.weights.partition()
        return self._host_model_buffer()

    def _second_accumulator(self) -> torch.Tensor | None:
        return None

    # ---- backward ----------------------------------------------------------------------------------------
    def begin_backward(self, boundary_predicted: bool) -> None:
        self._wait_before_backward()
        # The R14 piece sums are taken on the device as buckets stream out when this backward is (predicted to
        # be) the boundary's; otherwise the boundary sums the host accumulator.
        managed = self.config.managed_gradient_accumulation
        self._want_norm_pieces = boundary_predicted or (not managed and self.ctx.device.type != "cpu")
        self._update.begin_backward()
        self._launched.clear()

    def _wait_before_backward(self) -> None:
        self.synchronize()  # the last update's tail ran during this micro-step's forward

    def bucket_gradients(self, bucket: Any) -> torch.Tensor:
        """Allocated at the bucket's first gradient and dropped once reduced (no model-sized flat buffer)."""
        if bucket.grads is None:
            size = bucket.end - bucket.start
            bucket.grads = torch.zeros(size, dtype=self.config.comm_dtype, device=self.ctx.device)
        return bucket.grads

    def bucket_launched(self, bucket: Any) -> None:
        # Accumulate and stream out the bucket launched before this one while this one's reduce-scatter runs
        # (one behind, so a gradient hook does not wait on its own collective).
        self._launched.append(bucket)
        while len(self._launched) > 1:
            self._absorb(self._launched.popleft())

    def finish_backward(self, buckets: Sequence[Any]) -> None:
        while self._launched:
            self._absorb(self._launched.popleft())
        self._update.end_backward(self._want_norm_pieces)

    def _absorb(self, bucket: Any) -> None:
        """R10 for one bucket: its reduced slice into the host accumulator."""
        reduced = bucket.reduce.result()
        self._update.absorb(bucket.index, reduced, self._want_norm_pieces)
        bucket.reduce = None
        bucket.keep_alive = None

    # ---- the boundary --------------------------------------------------------------------------------------
    def before_step(self) -> None:
        self.synchronize()

    def boundary(self, hyper: OptimizerConfig, record_gradients: bool) -> StepOutcome:
        """R13: the reduction finished in backward; the norm from the per-piece sums; the update runs per bucket
        on the worker and this returns while it does (stage 2 at W > 1: after the per-bucket all-gather, which
        overlaps the update of the next bucket)."""
        ctx, update = self.ctx, self._update
        gradients = self._record(update.grad_for_boundary()) if record_gradients else None
        # R14: per-piece fp64 sums in flat order (taken on the device as the buckets streamed out), rank order.
        norm = self._norm(fold_left(update.piece_sums()))
        clip_coef = clip_coefficient(norm, self.config.gradient_clipping)
        self.opt_state.step += 1
        self._before_host_update(hyper, self.opt_state.step, clip_coef)
        update.start(hyper, self.opt_state.step, clip_coef)
        if ctx.stage == 2 and ctx.world_size > 1:
            # R12 (stage 2): every rank needs every bucket's new weights; broadcast each owner's slice as soon as
            # its bucket is updated, while the worker updates the next one.
            works = []
            flat = ctx.weights.flat
            for b in ctx.buckets:
                update.wait_bucket(b.index)
                pieces = [(o.rank, flat[o.start : o.end]) for o in owners(ctx.layout, b.start, b.end)]
                works.extend(ctx.comm.start_broadcasts(pieces, "parameter all-gather (per bucket)"))
            ctx.comm.wait_all(works, "parameter all-gather (per bucket)")
            self._wait_after_all_gather()
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=gradients)

    def _before_host_update(self, hyper: OptimizerConfig, step: int, clip_coef: float | None) -> None:
        """The boundary's norm and clip coefficient are known and the host update is about to start (R28's
        split path updates its device side here)."""

    def _wait_after_all_gather(self) -> None:
        self._update.wait_all()

    # ---- what is in flight ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        update = self.__dict__.get("_update")
        if update is not None and update.in_flight:
            update.wait_all()

    def wait_range(self, lo: int, hi: int) -> None:
        if self._update.in_flight:
            self._update.wait_range(lo, hi)

    def install_forward_waits(self, module: nn.Module, names_of: dict[int, str], add_hook: Callable) -> None:
        """Stage 2: before each module's forward, wait for the buckets holding its own parameters only (other
        ranks' slices arrive in step())."""
        ctx = self.ctx
        if ctx.stage != 2:
            return
        lo, hi = ctx.partition
        segments = {s.name: s for s in ctx.layout.segments}
        for mod in module.modules():
            segs = [segments[names_of[id(p)]] for p in mod.parameters(recurse=False) if id(p) in names_of]
            a = max(lo, min((s.offset for s in segs), default=hi))
            b = min(hi, max((s.end for s in segs), default=lo))
            if a >= b:
                continue

            def wait_own(module: nn.Module, args: Any, a: int = a - lo, b: int = b - lo) -> None:
                update = self.__dict__.get("_update")
                if update is not None and update.in_flight:
                    update.wait_range(a, b)

            add_hook(mod.register_forward_pre_hook(wait_own))

    def offload_timings(self) -> dict[str, float] | None:
        return self._update.take_timings()

    # ---- state ----------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self._update.reset()
        super().zero_grad()

    def close(self) -> None:
        update = self.__dict__.pop("_update", None)
        if update is not None:
            update.close()  # never raises: lets the worker finish (it writes into buffers the engine unpins next)
        super().close()


class DelayedHostUpdate(StreamedHostUpdate):
    """R27 (``delayed_parameter_update``): the streamed update, whose boundary k publishes the weights of
    boundary k - 1 into the live parameters and then runs its CPU Adam, overlapping all of step k + 1. The next
    backward fills a second host accumulator; the kernel's cast output is a buffer of its own."""

    lags_parameters = True

    def _cast_buffer(self) -> torch.Tensor:
        # The live parameters hold the previous boundary's weights: the kernel's output is a buffer of its own;
        # it starts as the cast of the master (no update pending).
        cast = self._host_model_buffer()
        cast.copy_(self.master)
        return cast

    def _second_accumulator(self) -> torch.Tensor:
        ctx = self.ctx
        pinned = ctx.device.type != "cpu"
        return ctx.host.empty(ctx.layout.partition_size, self.config.accum_dtype, pinned=pinned).zero_()

    def _wait_before_backward(self) -> None:
        # Only the published weights matter here; the update itself runs on through this backward.
        self._update.wait_published()

    def before_step(self) -> None:
        """A boundary waits for the previous update in its epilogue; a non-boundary step reads nothing."""

    def boundary(self, hyper: OptimizerConfig, record_gradients: bool) -> StepOutcome:
        """R27: delayed from the boundary after the first ``delayed_update_warmup`` ones on; a warm-up boundary
        is the delayed one followed at once by :meth:`apply_delayed` (so its parameters are the synchronous
        update's, bitwise, and the next step computes with them)."""
        warming_up = self.ctx.boundaries_done() < self.config.delayed_update_warmup
        outcome = super().boundary(hyper, record_gradients)
        if warming_up:
            self.synchronize()
            self.apply_delayed()
        return outcome

    def _wait_after_all_gather(self) -> None:
        self._update.wait_published()

    def apply_delayed(self) -> None:
        ctx = self.ctx
        if ctx.device.type == "cuda":
            # Host partitions (offload_param) may still be read by a gather's H2D queued before this call.
            torch.cuda.current_stream(ctx.device).synchronize()
        source = self.master if self._cast is None else self._cast
        self._write_live(source, "apply_delayed_update parameter all-gather")

    def live_weights_to_save(self) -> torch.Tensor | None:
        # R27: the weights a delayed run computes with are not the master's cast; resuming needs them
        return self.ctx.weights.partition().to("cpu", copy=True)

    def _install_cast(self, lp: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
        # R27: no update is pending after a load unless the checkpoint kept the weights a delayed run was
        # computing with (``applied``): those stay live and the master's cast waits for the next boundary.
        if self._cast is not None:
            self._cast.copy_(lp)
        return lp if applied is None else applied.to(self.config.model_dtype)
