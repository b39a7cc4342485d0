"""Update paths that update the whole partition at the boundary, in one call of the optimizer.

:class:`DeviceUpdate` (no offload: master and state on the device), :class:`HostUpdate` (``offload_optimizer:
cpu`` where the update is not streamed: stages 0/1, SGD, or a build without the native CPU Adam) and
:class:`NvmeUpdate` (``offload_optimizer: nvme``: the host update with the state in files between steps). Their
boundary is R13 as written: the reduction finished here at stages 0/1 (during backward at 2/3, into a device
accumulator), the norm of the partition, the optimizer over the whole master, the cast all-gathered.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from optimized.accumulation import device_adam
from optimized.accumulation.buckets import Bucket
from optimized.accumulation.device_spans import DeviceSpans
from optimized.accumulation.optimizers import native_adam, step_master
from optimized.accumulation.partition import owners
from optimized.accumulation.swap import StateSwapper
from optimized.accumulation.update_paths.base import (
    BufferPlan,
    HostBuffer,
    PathReports,
    UpdateContext,
    UpdatePath,
    gathered_gradients,
    global_norm,
    host_model_buffer,
    initial_master,
    state_buffers,
)
from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_norm import clip_coefficient, rank_square_sum
from reference.contract.accumulation_step import OptimizerState, StepOutcome, state_buffer_names
from reference.contract.errors import ConfigurationError

__all__ = ["DeviceAdamTimings", "DeviceUpdate", "HostUpdate", "NvmeUpdate", "SwapReports", "WholePartitionUpdate"]


class WholePartitionUpdate(UpdatePath):
    """R13 as written, for a master on :attr:`masters_on_host` or the device (subclasses choose)."""

    #: where the fp32 master and the optimizer state live (R17)
    masters_on_host: bool = False

    def __init__(self, ctx: UpdateContext) -> None:
        super().__init__(ctx)
        cfg = self.config
        self.master = initial_master(ctx, on_host=self.masters_on_host)
        state = state_buffers(ctx, self._resident_state_names(), on_host=self.masters_on_host)
        self.opt_state = OptimizerState(0, state)
        numel = ctx.master_numel
        #: device -> host gradient staging for the host update (not needed when everything is on the host)
        self._grad_host = (
            ctx.host.empty(numel, torch.float32, pinned=True)
            if self.masters_on_host and ctx.device.type != "cpu" else None
        )
        #: where the native kernel writes the cast master (R13 step 5), or None (the caller casts)
        self._cast = self._cast_buffer()
        #: device copy of this rank's cast partition, the all-gather's input (stages 1/2)
        self._gather_source = (
            torch.empty(ctx.layout.partition_size, dtype=cfg.model_dtype, device=ctx.device)
            if ctx.stage in (1, 2) else None
        )
        self.live_staging = self._gather_source
        if ctx.stage <= 1:
            self.accumulator = torch.zeros(ctx.layout.total, dtype=cfg.accum_dtype, device=ctx.device)
            self._comm_grads = None
        else:
            self.accumulator = torch.zeros(ctx.layout.partition_size, dtype=cfg.accum_dtype, device=ctx.device)
            #: the flat communication-dtype gradient of one backward
            self._comm_grads = torch.zeros(ctx.layout.total, dtype=cfg.comm_dtype, device=ctx.device)

    def _resident_state_names(self) -> tuple[str, ...]:
        return state_buffer_names(self.config.optimizer)

    def _cast_buffer(self) -> torch.Tensor | None:
        ctx, cfg = self.ctx, self.config
        if cfg.model_dtype != torch.bfloat16 or not (native_adam(cfg.optimizer) and self.master.device.type == "cpu"):
            return None
        if ctx.stage == 0 and ctx.device.type == "cpu":
            return ctx.weights.flat
        if ctx.stage == 3 and ctx.weights.param_device.type == "cpu":
            return ctx.weights.part
        return host_model_buffer(ctx)

    # ---- backward ----------------------------------------------------------------------------------------
    def bucket_gradients(self, bucket: Bucket) -> torch.Tensor:
        assert self._comm_grads is not None  # buckets exist at stages 2/3 only, which allocate it
        return self._comm_grads[bucket.start : bucket.end]

    def finish_backward(self, buckets: Sequence[Bucket]) -> None:
        ctx = self.ctx
        base = ctx.partition[0]
        accum = self.config.accum_dtype
        for b in buckets:
            mine = owners(ctx.layout, b.start, b.end)[ctx.rank]
            reduced = b.take_reduced()
            if mine.length:
                self.accumulator[mine.start - base : mine.end - base].add_(reduced.to(accum))

    # ---- the boundary --------------------------------------------------------------------------------------
    def _reduced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """R13 step 1: (this rank's partition of the reduced gradient, what its master is updated with: the
        whole gradient at stage 0), accumulation dtype."""
        ctx, cfg = self.ctx, self.config
        W, P = ctx.world_size, ctx.layout.partition_size
        if ctx.stage >= 2:
            return self.accumulator, self.accumulator
        contribution = torch.div(self.accumulator.to(cfg.comm_dtype), W)
        part = ctx.comm.start_reduce_scatter(contribution, [P] * W, "boundary reduce-scatter").result()
        part = part.to(cfg.accum_dtype)
        if ctx.stage == 1:
            return part, part
        owned = torch.empty(ctx.layout.total, dtype=cfg.accum_dtype, device=ctx.device)
        ctx.comm.all_gather_into(owned, part, "boundary all-gather of gradients")
        return part, owned

    def boundary(self, hyper: OptimizerConfig, record_gradients: bool) -> StepOutcome:
        ctx, cfg = self.ctx, self.config
        self._before_reduction()
        part, owned = self._reduced()
        gradients = None
        if record_gradients:
            gradients = gathered_gradients(ctx, part, owned if ctx.stage == 0 else None)
        norm = global_norm(ctx, rank_square_sum(ctx.layout, ctx.rank, part))  # R14
        clip_coef = clip_coefficient(norm, cfg.gradient_clipping)  # R15; applied with the optimizer
        # R16 on the fp32 master, on the host when offloaded (R17).
        wrote_lp = self._optimizer_step(hyper, self._master_gradient(owned.to(torch.float32)), clip_coef)
        if wrote_lp:
            assert self._cast is not None  # the step writes the model-dtype weights only into a cast buffer
            lp = self._cast
        else:
            lp = self.master.to(cfg.model_dtype)
        ctx.weights.write(lp, "parameter all-gather", staging=self._gather_source, non_blocking=True)  # R12
        self.accumulator.zero_()  # R13 step 6
        return StepOutcome(boundary=True, grad_norm=norm, clip_coef=clip_coef, gradients=gradients)

    def _before_reduction(self) -> None:
        """The boundary starts (before the reduction finishes)."""

    def _master_gradient(self, g32: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient where the master is."""
        if self._grad_host is not None:
            self._grad_host.copy_(g32, non_blocking=True)
            torch.cuda.current_stream(self.ctx.device).synchronize()
            return self._grad_host
        return g32 if g32.device == self.master.device else g32.to(self.master.device)

    def _optimizer_step(self, hyper: OptimizerConfig, g32: torch.Tensor, clip_coef: float | None) -> bool:
        return step_master(hyper, self.master, g32, self.opt_state, clip_coef=clip_coef, bf16_out=self._cast)


class DeviceUpdate(WholePartitionUpdate):
    """``offload_optimizer: none``: master and optimizer state on the device (R11, R12)."""

    masters_on_host = False

    @classmethod
    def planned_host_buffers(cls, plan: BufferPlan) -> list[HostBuffer]:
        """Nothing on the host on an accelerator (on the host itself every buffer is host memory: not estimated)."""
        if not plan.on_device:
            super().planned_host_buffers(plan)
        return []

    def __init__(self, ctx: UpdateContext) -> None:
        # The fused kernel's check and first launches now, not in the first training step (device_adam.prepare).
        device_adam.prepare(ctx.config.optimizer, ctx.device, ctx.config.moment_precision)
        super().__init__(ctx)
        self.reports = self._adam_timings = DeviceAdamTimings(ctx.device)

    def _optimizer_step(self, hyper: OptimizerConfig, g32: torch.Tensor, clip_coef: float | None) -> bool:
        timed = self._adam_timings.open()
        wrote_lp = super()._optimizer_step(hyper, g32, clip_coef)
        if timed is not None:
            timed()
        return wrote_lp


class DeviceAdamTimings(PathReports):
    """What the device update reports: nothing is offloaded; on a GPU run the device optimizer's time since the
    last call (``device_adam_s``, timed from the first call on), so that a benchmark sets the model's time of
    the no-offload step beside the offloaded paths' timelines. None on the cpu accelerator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: once :meth:`offload_timings` was called on a GPU run: the spans of each optimizer step
        self._spans: DeviceSpans | None = None

    def open(self) -> Callable[[], None] | None:
        """Start a span of the optimizer step on the current stream (once timings were asked for), else None."""
        if self._spans is None:
            return None
        return self._spans.open("device_adam_s", torch.cuda.current_stream(self.device))

    def offload_timings(self) -> dict[str, float] | None:
        if self.device.type != "cuda":
            return None
        if self._spans is None:
            self._spans = DeviceSpans(self.device)
        return self._spans.collect({"device_adam_s": 0.0})


class HostUpdate(WholePartitionUpdate):
    """``offload_optimizer: cpu``, not streamed: master and state pinned on the host (R17); the reduced gradient
    is copied to the host at the boundary and the weights back after the step."""

    masters_on_host = True


class NvmeUpdate(HostUpdate):
    """``offload_optimizer: nvme``: :class:`HostUpdate` with the optimizer state in files under ``nvme_path``
    between steps (R17): read back asynchronously from the start of the boundary, written after the step while
    the weights are cast and all-gathered; the next backward waits for the writes."""

    def __init__(self, ctx: UpdateContext) -> None:
        super().__init__(ctx)  # the master first: its pinned memory before the swap handle's bounce pool
        names = state_buffer_names(ctx.config.optimizer)
        # R17 (nvme): the state exists only in its files until the first boundary swaps it in; while in memory
        # it is pinned like the engine's other buffers (exactly, by default), so the handle moves it directly.
        assert ctx.config.nvme_path is not None  # the config refuses nvme offload without an nvme_path
        try:
            self._swap = StateSwapper(ctx.config.nvme_path, ctx.config.nvme_swap, ctx.rank, names,
                                      ctx.master_numel, allocate=ctx.host.pinned_untracked)
            self._swap.write_initial()
        except BaseException:
            self.close()
            raise
        self.reports = SwapReports(self._swap)

    @classmethod
    def check_config(cls, config: AccumulationConfig) -> None:
        assert config.nvme_path is not None  # the config refuses nvme offload without an nvme_path
        _probe_nvme_path(config.nvme_path)

    def _resident_state_names(self) -> tuple[str, ...]:
        return ()

    def begin_backward(self, boundary_predicted: bool) -> None:
        self._swap.release()  # the last step's state writes ran during this micro-step's forward

    def _before_reduction(self) -> None:
        # Start reading the optimizer state now; the reduction and the norm overlap the reads.
        self._swap.begin_swap_in()

    def _optimizer_step(self, hyper: OptimizerConfig, g32: torch.Tensor, clip_coef: float | None) -> bool:
        self.opt_state.buffers = self._swap.finish_swap_in()
        wrote_lp = super()._optimizer_step(hyper, g32, clip_coef)
        # The writes run while the weights are cast and all-gathered; the next backward() waits for them.
        self.opt_state.buffers = {}
        self._swap.begin_swap_out()
        return wrote_lp

    def optimizer_state(self) -> OptimizerState:
        self._swap.begin_swap_in()
        try:
            buffers = {k: v.clone() for k, v in self._swap.finish_swap_in().items()}
        finally:
            self._swap.release()
        return OptimizerState(self.opt_state.step, buffers)

    def _install_state_buffers(self, opt_buffers: dict[str, torch.Tensor]) -> None:
        self._swap.write_state(opt_buffers)

    def close(self) -> None:
        swap = self.__dict__.pop("_swap", None)
        if swap is not None:
            swap.close()  # never raises: finishes the requests, closes the handle, deletes the files, unpins
        super().close()


class SwapReports(PathReports):
    """What the ``nvme`` path reports: the state buffers while they are in memory, the swap directory and the
    swap handle's statistics."""

    def __init__(self, swap: StateSwapper) -> None:
        self._swap = swap

    def resident_buffers(self) -> tuple[torch.Tensor, ...]:
        return self._swap.resident

    @property
    def swap_directory(self) -> str | None:
        return self._swap.directory

    def swap_stats(self) -> Any:
        return self._swap.stats()


def _probe_nvme_path(path: str) -> None:
    """R19 says ``nvme_path`` must be an existing *writable* directory; write permission cannot be read off the
    mode bits (root, read-only mounts, ACLs), so create and remove a file there now, at construction."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".hostoffload-probe-", dir=path)
    except OSError as exc:
        raise ConfigurationError(
            f"nvme_path={path!r} is not usable: creating a file there failed ({exc.strerror or exc}); "
            f"allowed: an existing directory this process can write (offload_optimizer='nvme' swaps the "
            f"optimizer state into files there)"
        ) from exc
    os.close(fd)
    os.unlink(probe)
