"""The split update (docs/accumulation.md R28, ``gpu_share``): the streamed host update with the leading part of
the partition updated on the device.

The leading ``d`` elements of this rank's partition (the first parameters in flat order, the ones the next
forward needs first) keep their fp32 master and Adam moments on the device (:class:`_DeviceSide`, 12 bytes per
element); at each boundary, once the norm and the clip coefficient are known, they take their R15 + R16 step
there and their new weights are written into the live parameters on the current stream, before the host worker
starts on ``[d, P)`` as the streamed path does (:meth:`.HostUpdateWorker.update_from`). The two sides share the step
count, the hyper-parameters and the clip coefficient, so the values are the all-host update's (bitwise on the
cpu accelerator, where the device side runs the same R16 arithmetic; the device's Adam kernel on a GPU).

The host buffers keep their full size: they stay the checkpoint's and the readers' coordinates. The device side
is copied back into them (master, moments, and with the delayed update the cast buffer) only when something
reads them (``master``, ``optimizer_state()``, ``apply_delayed_update()``), and reloaded from them when a
checkpoint or ``load_state_dict`` installs new values. The gradient of the device side reaches the device from
the host accumulator once, at the boundary the cut is made; from the next accumulation on it is accumulated on the
device (:meth:`.GradientStream.keep_on_device`) and never crosses to the host, so only the host side's gradient
streams out.

``gpu_share: "auto"`` decides at the second boundary, before its update (the first step carries one-off start-up
costs; until then the host updates everything, and the device side is then copied from the host's buffers): it
takes the host kernel's time per element from the first boundary's whole update and times the device step on a
sample (the second of two runs), takes the second step's
device work from its first backward to the boundary (synchronized) and counts what the host side can run beside
-- with the delayed
update the whole step, otherwise the next micro-batch's forward, taken as a third of a micro-batch's forward and
backward -- and the ranks agree on the slowest host and device and the least hide; the cut is
:func:`reference.contract.accumulation_split.choose_split`'s, within ``gpu_memory_budget`` (or half the free
device memory). ``split_report()`` returns the decision and it is logged.

With ``gpu_memory_limit`` (:mod:`reference.contract.accumulation_limit`) the budget is what the engine's floor
leaves: the engine's device must keep a peak counter (checked in :meth:`DeviceSplit.prepare`, before the path
allocates anything), the counter restarts when the device side is built (the path's buffers exist by then) and is
read at the choice before the device sample is allocated; the ranks gather their floors with the measurement and
the largest decides, so every rank refuses (from ``step()``, before the device side or the host worker starts) or
none does; the sample is capped to the budget.

This module is the part the streamed path (:mod:`.streamed`) composes when it splits: :class:`DeviceSplit` (the
cut, the device side and when the host buffers are older than it) and :class:`AutoShare` ("auto"'s measurements
and choice). The order of the device side's update and publish is the release policy's (:mod:`.release`: with
R27 the device side too publishes the previous boundary's weights first).
"""

from __future__ import annotations

import logging
import time

import torch

from optimized import cpu_adam
from optimized.accumulation import device_adam
from optimized.accumulation.optimizers import step_master
from optimized.accumulation.update_paths.base import UpdateContext
from optimized.accumulation.update_paths.gradient_stream import GradientStream
from optimized.accumulation.update_paths.host_worker import HostUpdateWorker
from optimized.accumulation.update_paths.release import Release
from optimized.accumulation.update_paths.timings import UpdateTimings
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_limit import fit_limit, floor_meter, limit_margin
from reference.contract.accumulation_split import (
    SplitDecision,
    SplitMeasurement,
    auto_budget,
    choose_split,
    fixed_split,
    sample_within,
    warn_if_auto_without_device,
)
from reference.contract.accumulation_step import OptimizerState

__all__ = ["SAMPLE_ELEMENTS", "AutoShare", "DeviceSplit"]

#: Elements the "auto" measurement steps the device side on (or the whole partition when smaller): 2^24 (256 MB of
#: master, moments and gradient) makes the per-element time the kernels' bandwidth, not their launches (a 2^20
#: sample, the first version's, overstated an H200's step about four times). The host side is timed on the first
#: boundary's whole update instead (:attr:`.HostUpdateWorker.last_host_seconds_per_element`), falling back to a sample
#: of this size where that update did not run.
SAMPLE_ELEMENTS = 1 << 24

_log = logging.getLogger("optimized.accumulation")


class _DeviceSide:
    """The leading ``n`` elements of the partition: fp32 master and optimizer state on the device."""

    def __init__(self, n: int, master: torch.Tensor, state: OptimizerState, device: torch.device,
                 model_dtype: torch.dtype) -> None:
        self.n = n
        self.model_dtype = model_dtype
        self.master = master[:n].to(device, copy=True)
        self.state = OptimizerState(0, {k: v[:n].to(device, copy=True) for k, v in state.buffers.items()})

    def step(self, hyper: OptimizerConfig, t: int, clip_coef: float | None, grad: torch.Tensor,
             out: torch.Tensor | None = None) -> bool:
        """R15 + R16 with step count ``t`` on the device side (``grad``: its accumulated gradient, any device).
        ``out``: bf16 weights the kernel may write in its pass; True when it did (else the caller casts)."""
        self.state.step = t - 1  # step_master advances it to t
        g32 = grad.to(device=self.master.device, dtype=torch.float32)
        return step_master(hyper, self.master, g32, self.state, clip_coef=clip_coef, bf16_out=out)

    def cast(self) -> torch.Tensor:
        return self.master.to(self.model_dtype)

    def store(self, master: torch.Tensor, state: OptimizerState, cast: torch.Tensor | None) -> None:
        """Copy this side into the host's full-size buffers (their first ``n`` elements)."""
        master[: self.n].copy_(self.master)
        for k, v in self.state.buffers.items():
            state.buffers[k][: self.n].copy_(v)
        if cast is not None:
            cast[: self.n].copy_(self.master)

    def load(self, master: torch.Tensor, state: OptimizerState) -> None:
        """Take this side's values from the host's buffers (a checkpoint or ``load_state_dict`` installed them)."""
        self.master.copy_(master[: self.n])
        for k, v in self.state.buffers.items():
            v.copy_(state.buffers[k][: self.n])


class DeviceSplit:
    """R28 for one streamed path (see the module docstring): the cut, the device side once it is made, and when
    the host buffers' leading elements are older than it. Composed into the streamed path, which calls
    :meth:`backward_starts`, :meth:`step_device_side` (once the boundary's norm is known, before the host
    update), :meth:`store` (before a reader of the host buffers) and :meth:`load` (after new values were
    installed in them)."""

    def __init__(self, ctx: UpdateContext, gradients: GradientStream, worker: HostUpdateWorker,
                 timings: UpdateTimings, release: Release, *, host_starts_in_backward: bool = False) -> None:
        self.ctx = ctx
        self._gradients = gradients
        self._worker = worker
        self._timings = timings
        #: R27 or not: the order of the device side's update and publish (:mod:`.release`)
        self._release = release
        warn_if_auto_without_device(ctx.config, ctx.device.type)
        self._side: _DeviceSide | None = None
        self._stale = False  # the host buffers' first n elements are older than the device side
        cfg = ctx.config
        P = ctx.layout.partition_size
        self._decision: SplitDecision | None = (
            None if isinstance(cfg.gpu_share, str) else fixed_split(cfg.gpu_share, P, cfg)  # the str: GPU_SHARE_AUTO
        )
        self._auto = AutoShare(ctx, worker, hides_whole_step=release.lags_parameters,
                               hides_last_backward=host_starts_in_backward)
        self._boundaries = 0

    @staticmethod
    def prepare(ctx: UpdateContext) -> None:
        """Before the path allocates anything: the device side's kernel checked and launched now ("auto" first
        uses it at the cut; :func:`device_adam.prepare`), and ``gpu_memory_limit``'s counter (refused where the
        device has none)."""
        floor_meter(ctx.config, ctx.device)
        device_adam.prepare(ctx.config.optimizer, ctx.device, ctx.config.moment_precision)

    def backward_starts(self) -> None:
        """A backward starts ("auto" times the second step from its first backward)."""
        if self._decision is None and self._boundaries == 1:
            self._auto.backward_starts()

    def step_device_side(self, hyper: OptimizerConfig, step: int, clip_coef: float | None, master: torch.Tensor,
                         state: OptimizerState) -> None:
        """The boundary's norm and clip coefficient are known and the host update is about to start: make the
        cut where it is due, then the device side's R15 + R16 step and its weights into the live parameters.
        ``master`` / ``state``: the host's full-partition buffers (the device side starts from them)."""
        self._boundaries += 1
        if self._decision is None:
            if self._boundaries < 2:
                return  # "auto": the first step is not the steady state; the host updates everything
            self._decision = self._auto.choose()
        if self._side is None:
            d = self._decision.device_elements
            if d == 0:
                return
            self._cut(d, master, state)
        side = self._side
        assert side is not None  # made by _cut
        host_grad = self._gradients.host_side_gradient()  # every D2H has landed, queued kernels have run
        grad = self._gradients.device_gradient(side.n)
        if grad is None:  # not kept on the device for this whole accumulation (the first one, a cpu run)
            grad = host_grad[: side.n]
        live = self.ctx.weights.partition()[: side.n]
        timed = self._timings.time_device_work("device_adam_s")
        self._release.step_device_side(live, side, hyper, step, clip_coef, grad)
        if timed is not None:
            timed()
        self._stale = True

    def _cut(self, d: int, master: torch.Tensor, state: OptimizerState) -> None:
        """Give the partition's ``[0, d)`` to the device: the worker stops updating it (after the update in
        flight, which must have written the buffers the device side starts from), the device side copies its
        master and moments, and from the next accumulation on its gradient stays on the device."""
        self._worker.update_from(d)
        self._side = _DeviceSide(d, master, state, self.ctx.device, self.ctx.config.model_dtype)
        self._gradients.keep_on_device(d)

    def store(self, master: torch.Tensor, state: OptimizerState, cast: torch.Tensor | None) -> None:
        """Before a reader of the host buffers: copy the device side into them where they are older."""
        if self._side is not None and self._stale:
            self._side.store(master, state, cast)
            self._stale = False

    def load(self, master: torch.Tensor, state: OptimizerState) -> None:
        """New values were installed in the host buffers (a checkpoint, ``load_state_dict``): the device side
        takes its part of them."""
        if self._side is not None:
            self._side.load(master, state)
            self._stale = False

    def report(self) -> dict | None:
        """The cut (``split_report()``), or None before "auto" has chosen."""
        return None if self._decision is None else self._decision.as_dict()


class AutoShare:
    """``gpu_share: "auto"``: the measurements the cut is chosen from and the choice (module docstring), the same
    on every rank. ``hides_whole_step``: with R27 the host side runs beside the whole next step, else beside the
    next micro-batch's forward, and with R30 (``hides_last_backward``) beside the boundary's last backward too."""

    def __init__(self, ctx: UpdateContext, worker: HostUpdateWorker, *, hides_whole_step: bool,
                 hides_last_backward: bool = False) -> None:
        self.ctx = ctx
        self._worker = worker
        self._hides_whole_step = hides_whole_step
        self._hides_last_backward = hides_last_backward
        self._first_backward_at: float | None = None
        #: gpu_memory_limit: the peak device memory from here to the choice (None without a limit)
        self._meter = floor_meter(ctx.config, ctx.device)

    def backward_starts(self) -> None:
        """The second step's first backward starts: its device work is timed from here to the boundary."""
        if self._first_backward_at is None:
            self._sync_device()
            self._first_backward_at = time.perf_counter()

    def choose(self) -> SplitDecision:
        """The "auto" decision (module docstring), the same on every rank; under ``gpu_memory_limit`` the
        refusal where the largest floor leaves nothing, on every rank alike."""
        ctx, cfg = self.ctx, self.ctx.config
        self._sync_device()
        floor = None if self._meter is None else self._meter.floor()  # before the sample below allocates
        started = self._first_backward_at
        step_s = 0.0 if started is None else time.perf_counter() - started
        # A micro-batch's forward taken as a third of its forward and backward, its backward as the other two.
        micro_batch = step_s / cfg.gradient_accumulation_steps
        hide = step_s if self._hides_whole_step else micro_batch if self._hides_last_backward else micro_batch / 3
        P = ctx.layout.partition_size
        n = max(1, min(P, SAMPLE_ELEMENTS))
        host = self._worker.last_host_seconds_per_element
        if host is None:
            host = self._time_host(n) / n
        budget = cfg.gpu_memory_limit
        if floor is not None:  # this rank's own room bounds its sample (a refusal comes after the gather)
            assert budget is not None  # a floor is metered only under gpu_memory_limit
            n = sample_within(n, max(0, budget - limit_margin(budget) - floor), cfg)
        mine = (host, self._time_device(n) / n, hide, floor, n)
        every = ctx.comm.all_gather_objects(mine, "gpu_share auto measurement")
        limit = None if floor is None or budget is None else fit_limit(budget, max(m[3] for m in every))
        measurement = SplitMeasurement(
            host_s_per_element=max(m[0] for m in every), device_s_per_element=max(m[1] for m in every),
            hide_s=min(m[2] for m in every), sample_elements=min(m[4] for m in every),
        )
        free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else None
        budget = auto_budget(cfg, limit, free)
        decision = choose_split(P, cfg, budget, measurement, limit)
        _log.info("R28 gpu_share=auto (rank %d) chose %s", ctx.rank, decision.as_dict())
        return decision

    def _time_host(self, n: int) -> float:
        moments = self.ctx.config.moment_precision.dtype  # R29: timed at the precision the run stores
        z = [torch.zeros(n, dtype=torch.float32 if i < 2 else moments) for i in range(4)]
        for _ in range(2):  # the second run: threads started, pages touched
            t0 = time.perf_counter()
            cpu_adam.adam_step(self.ctx.config.optimizer, z[0], z[1], z[2], z[3], 1, threads=self._worker.threads)
            took = time.perf_counter() - t0
        return took

    def _time_device(self, n: int) -> float:
        device = self.ctx.device
        master = torch.zeros(n, dtype=torch.float32, device=device)
        moments = self.ctx.config.moment_precision.dtype  # R29: timed at the precision the run stores
        state = OptimizerState(0, {k: torch.zeros_like(master, dtype=moments) for k in ("exp_avg", "exp_avg_sq")})
        grad = torch.zeros_like(master)
        for _ in range(2):  # the second run: kernels loaded, allocator warm
            self._sync_device()
            t0 = time.perf_counter()
            step_master(self.ctx.config.optimizer, master, grad, state, clip_coef=None)
            self._sync_device()
            took = time.perf_counter() - t0
        return took

    def _sync_device(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
