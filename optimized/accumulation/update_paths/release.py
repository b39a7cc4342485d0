"""When a streamed boundary's new weights reach the live parameters: in the same step, or one boundary later
(R27, ``delayed_parameter_update``).

The choice is made once, at construction (:class:`ImmediateRelease` or :class:`DelayedRelease`), and the streamed
path asks its release object wherever the two differ: the buffer the kernel writes the model-dtype weights into,
the second gradient accumulator, what a backward, a step and the stage-2 all-gather wait for, R27's warm-up and
``apply_delayed_update()``, what a checkpoint saves and installs, and the order of the split's device side
(:mod:`.split`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from optimized.accumulation.update_paths.base import BufferPlan, UpdateContext, host_model_buffer
from optimized.accumulation.update_paths.host_worker import HostUpdateWorker
from reference.contract.accumulation_config import OptimizerConfig

__all__ = ["ConfirmedRelease", "DelayedRelease", "ImmediateRelease", "Release"]


class ImmediateRelease:
    """Without R27: the boundary's update is in the live parameters before anything reads them (the next forward
    waits per bucket; the next backward and step wait for all of it)."""

    #: R27: the live parameters lag the master by one boundary
    lags_parameters = False

    def __init__(self, ctx: UpdateContext) -> None:
        self.ctx = ctx

    def cast_buffer(self, master: torch.Tensor) -> torch.Tensor:
        """Where the kernel writes the model-dtype weights (bf16 model): the live parameters themselves where
        they are on the host, else a host buffer the H2D copies from."""
        ctx = self.ctx
        if ctx.stage == 3 and ctx.weights.param_device.type == "cpu":
            return ctx.weights.part
        if ctx.stage == 2 and ctx.device.type == "cpu":
            return ctx.weights.partition()
        return host_model_buffer(ctx)

    def second_accumulator(self) -> torch.Tensor | None:
        """R27's second host accumulator (None: one is enough)."""
        return None

    #: host gradient accumulators the streamed path keeps (R27: two, one per boundary in flight)
    accumulators: ClassVar[int] = 1

    @staticmethod
    def cast_is_own_buffer(plan: BufferPlan) -> bool:
        """Whether :meth:`cast_buffer` allocates (False: it writes into the live parameters on the host)."""
        return not ((plan.stage == 3 and plan.params_on_host) or (plan.stage == 2 and not plan.on_device))

    def before_backward(self, worker: HostUpdateWorker) -> None:
        """A backward starts: the last update's tail ran during this micro-step's forward; wait for all of it."""
        if worker.in_flight:
            worker.wait_all()

    def before_step(self, worker: HostUpdateWorker) -> None:
        """``step()`` starts (boundary or not)."""
        if worker.in_flight:
            worker.wait_all()

    def warming_up(self) -> bool:
        """Whether this boundary is one of R27's warm-up boundaries (applied at once)."""
        return False

    def after_all_gather(self, worker: HostUpdateWorker) -> None:
        """Stage 2 at W > 1: every bucket's owner slices were broadcast; what ``step()`` waits for before returning."""
        worker.wait_all()

    def apply(self, newest: Callable[[], torch.Tensor], write: Callable[[torch.Tensor, str], None]) -> None:
        """``apply_delayed_update()``: nothing to apply (the parameters already are the master's cast)."""

    def live_weights_to_save(self) -> torch.Tensor | None:
        """What a checkpoint saves besides the master (None: the live weights are the master's cast)."""
        return None

    def installed(self, cast: torch.Tensor | None, lp: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
        """What the live parameters become on a checkpoint load or ``load_state_dict``: the master's cast ``lp``."""
        return lp

    def step_device_side(self, live: torch.Tensor, side: Any, hyper: OptimizerConfig, step: int,
                         clip_coef: float | None, grad: torch.Tensor) -> None:
        """R28, R13 steps (4) and (5) for the split's device side: update, then its weights become the live
        parameters (written by the fused kernel in its pass where it can, else cast)."""
        fits = live.dtype == torch.bfloat16 and live.is_contiguous() and live.device == side.master.device
        if not side.step(hyper, step, clip_coef, grad, out=live if fits else None):
            live.copy_(side.cast())


class ConfirmedRelease(ImmediateRelease):
    """R30 (``host_update_start: last_backward``): as :class:`ImmediateRelease`, but the kernel's model-dtype
    output is always a buffer of its own, copied into the live parameters only once the step settled the bucket:
    a speculative update runs while the last backward still reads the live weights (host parameters included)."""

    def cast_buffer(self, master: torch.Tensor) -> torch.Tensor:
        cast = host_model_buffer(self.ctx)
        cast.copy_(master)
        return cast

    @staticmethod
    def cast_is_own_buffer(plan: BufferPlan) -> bool:
        return True


class DelayedRelease:
    """R27: boundary k publishes the weights of boundary k - 1 into the live parameters and then runs its update,
    overlapping all of step k + 1. The next backward fills a second host accumulator; the kernel's cast output is
    a buffer of its own. (The same calls as :class:`ImmediateRelease`.)"""

    lags_parameters = True
    accumulators: ClassVar[int] = 2

    def __init__(self, ctx: UpdateContext) -> None:
        self.ctx = ctx

    @staticmethod
    def cast_is_own_buffer(plan: BufferPlan) -> bool:
        return True

    def cast_buffer(self, master: torch.Tensor) -> torch.Tensor:
        # The live parameters hold the previous boundary's weights: the kernel's output is a buffer of its own;
        # it starts as the cast of the master (no update pending).
        cast = host_model_buffer(self.ctx)
        cast.copy_(master)
        return cast

    def second_accumulator(self) -> torch.Tensor:
        ctx = self.ctx
        pinned = ctx.device.type != "cpu"
        return ctx.host.empty(ctx.layout.partition_size, ctx.config.accum_dtype, pinned=pinned).zero_()

    def before_backward(self, worker: HostUpdateWorker) -> None:
        # Only the published weights matter here; the update itself runs on through this backward.
        worker.wait_published()

    def before_step(self, worker: HostUpdateWorker) -> None:
        """A boundary waits for the previous update in its epilogue; a non-boundary step reads nothing."""

    def warming_up(self) -> bool:
        """R27: delayed from the boundary after the first ``delayed_update_warmup`` ones on; a warm-up boundary is
        the delayed one followed at once by ``apply_delayed`` (so its parameters are the synchronous update's,
        bitwise, and the next step computes with them). Asked before the boundary counts."""
        return self.ctx.boundaries_done() < self.ctx.config.delayed_update_warmup

    def after_all_gather(self, worker: HostUpdateWorker) -> None:
        worker.wait_published()

    def apply(self, newest: Callable[[], torch.Tensor], write: Callable[[torch.Tensor, str], None]) -> None:
        ctx = self.ctx
        source = newest()
        if ctx.device.type == "cuda":
            # Host partitions (offload_param) may still be read by a gather's H2D queued before this call.
            torch.cuda.current_stream(ctx.device).synchronize()
        write(source, "apply_delayed_update parameter all-gather")

    def live_weights_to_save(self) -> torch.Tensor | None:
        # R27: the weights a delayed run computes with are not the master's cast; resuming needs them
        return self.ctx.weights.partition().to("cpu", copy=True)

    def installed(self, cast: torch.Tensor | None, lp: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
        # R27: no update is pending after a load unless the checkpoint kept the weights a delayed run was
        # computing with (``applied``): those stay live and the master's cast waits for the next boundary.
        if cast is not None:
            cast.copy_(lp)
        return lp if applied is None else applied.to(self.ctx.config.model_dtype)

    def step_device_side(self, live: torch.Tensor, side: Any, hyper: OptimizerConfig, step: int,
                         clip_coef: float | None, grad: torch.Tensor) -> None:
        """R28 with R27: the device side too installs the weights of the previous boundary before its update."""
        live.copy_(side.cast())  # R27: the master as it is before this boundary's update
        side.step(hyper, step, clip_coef, grad)


#: the release a streamed path is built with (the two have the same calls)
Release = ImmediateRelease | DelayedRelease
