"""The update-path interface (see the package docstring) and what every path shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optimized.accumulation.buckets import Bucket
from optimized.accumulation.collectives import Collectives
from optimized.accumulation.host_buffers import HostBuffers
from optimized.accumulation.partition import unflatten
from optimized.accumulation.weights import LiveWeights
from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_norm import norm_from_total
from reference.contract.accumulation_partition import FlatLayout
from reference.contract.accumulation_state_precision import StatePrecision
from reference.contract.accumulation_step import OptimizerState, StepOutcome, state_buffer_names
from reference.contract.errors import ConfigurationError

__all__ = [
    "BufferPlan",
    "HostBuffer",
    "PathReports",
    "UpdateContext",
    "UpdatePath",
    "gathered_gradients",
    "global_norm",
    "host_model_buffer",
    "initial_master",
    "state_buffers",
]


@dataclass(frozen=True)
class HostBuffer:
    """One host buffer an engine will allocate: what it holds, its bytes, whether it is page-locked."""

    name: str
    nbytes: int
    pinned: bool


@dataclass(frozen=True)
class BufferPlan:
    """What decides an update path's host buffers, known before the engine exists: the config, this rank's master
    and partition sizes (R8 layout, padding included), and where the engine runs."""

    config: AccumulationConfig
    stage: int
    master_numel: int
    partition_size: int
    #: the accelerator is not the host (a device run pins what it copies from)
    on_device: bool
    #: stage 3: the parameter partitions are host buffers (``offload_param``, or a run on the host)
    params_on_host: bool

    def buffer(self, name: str, numel: int, dtype: torch.dtype, *, pinned: bool) -> HostBuffer:
        return HostBuffer(name, numel * torch.empty((), dtype=dtype).element_size(), pinned)

    def state(self) -> list[HostBuffer]:
        """The fp32 master and the optimizer state on the host (pinned; R29's precision for Adam's moments)."""
        cfg = self.config
        dtype = cfg.state_dtype
        out = [self.buffer("master", self.master_numel, torch.float32, pinned=True)]
        out += [self.buffer(n, self.master_numel, dtype, pinned=True) for n in state_buffer_names(cfg.optimizer)]
        return out


@dataclass
class UpdateContext:
    """What the engine hands an update path at construction; the path allocates everything else itself."""

    config: AccumulationConfig
    layout: FlatLayout
    rank: int
    world_size: int
    stage: int
    device: torch.device
    comm: Collectives
    #: the model-dtype parameters the module computes with (the path writes its new partition there)
    weights: LiveWeights
    #: allocator of the engine's host memory (freed by the engine's destroy(), after the path's close())
    host: HostBuffers
    #: stages 2/3: the gradient buckets, in flat order (:class:`~optimized.accumulation.buckets.Bucket`: the path
    #: reads ``start``, ``end``, ``index`` and consumes a launched bucket through its methods); empty at stages 0/1
    buckets: Sequence[Bucket]
    #: how many boundaries the engine has completed (R3's ``global_steps``; during ``boundary()`` the ones before
    #: this one, also after a checkpoint load)
    boundaries_done: Callable[[], int] = lambda: 0
    #: the hyper-parameters a ``step()`` now would use (the optimizer facade's group; R30 guesses with them)
    hyper_now: Callable[[], OptimizerConfig] = OptimizerConfig

    @property
    def partition(self) -> tuple[int, int]:
        """This rank's partition ``[lo, hi)`` in flat coordinates."""
        P = self.layout.partition_size
        return self.rank * P, (self.rank + 1) * P

    @property
    def master_numel(self) -> int:
        """Elements of this rank's master: the whole flat buffer at stage 0 (R11), one partition above (R12)."""
        return self.layout.total if self.stage == 0 else self.layout.partition_size


class PathReports:
    """What an update path reports besides training, for benchmarks and inspection (the engine's
    ``offload_timings()``, ``split_report()``, ``pinned_buffers()``, ``swap_directory``, ``swap_stats()``). These
    defaults describe a path with nothing to report; a path that has something sets its own ``reports``."""

    def offload_timings(self) -> dict[str, float] | None:
        """Where a streamed update spent its time since the last call, or None (see ``ZeroEngine``)."""
        return None

    def overlap_report(self) -> dict[str, int] | None:
        """R30: how many boundaries (and buckets) were updated under the last backward and redone, or None
        (``host_update_start: step``)."""
        return None

    def split_report(self) -> dict | None:
        """R28: the cut of this rank's partition between the device and the host, or None (no split, or
        ``gpu_share: "auto"`` before it has chosen)."""
        return None

    def resident_buffers(self) -> tuple[torch.Tensor, ...]:
        """Pinned buffers the path holds apart from the engine's :class:`HostBuffers` (``nvme``: the state while
        it is in memory)."""
        return ()

    @property
    def swap_directory(self) -> str | None:
        return None

    def swap_stats(self) -> Any:
        return None


class UpdatePath:
    """Base of every update path: the core of the interface, with the defaults of a path with nothing in flight.

    Attributes every path sets in its constructor: ``master`` (this rank's fp32 master, R11/R12), ``opt_state``
    (an :class:`OptimizerState` whose ``step`` the engine's checkpoint load sets; its buffers may be empty when
    the state lives elsewhere, see :meth:`optimizer_state`), ``accumulator`` (the gradient accumulator the
    engine adds into at stages 0/1 -- the full flat buffer -- and this path fills at stages 2/3 -- the
    partition --, accumulation dtype); ``reports`` (:class:`PathReports`) where it has something to report.
    """

    master: torch.Tensor
    opt_state: OptimizerState
    accumulator: torch.Tensor

    def __init__(self, ctx: UpdateContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        #: R27: the live parameters lag the master by one boundary (a checkpoint then saves the live weights too)
        self.lags_parameters = False
        self.reports = PathReports()
        #: the device buffer the live weights' all-gather copies through (stages 1/2), or None
        self.live_staging: torch.Tensor | None = None

    @classmethod
    def check_config(cls, config: AccumulationConfig) -> None:
        """Checks of the environment this path needs, run before the engine touches the model (default none)."""

    @classmethod
    def planned_host_buffers(cls, plan: BufferPlan) -> list[HostBuffer]:
        """The host buffers this path allocates for ``plan``, before anything exists (``estimate_host_memory``;
        the conformance compares them with what the operating system counts). Default: not estimated."""
        raise ConfigurationError(
            f"estimate_host_memory: offload_optimizer={plan.config.offload_optimizer!r} with this config takes "
            f"the {cls.__name__} path on {'an accelerator' if plan.on_device else 'the host'}, whose host memory "
            f"is not estimated; allowed: offload_optimizer 'none' on an accelerator, or 'cpu' at zero_stage 2/3 "
            f"with Adam/AdamW and gpu_share=0"
        )

    # ---- backward (R9, R10) ----------------------------------------------------------------------------------
    def begin_backward(self, boundary_predicted: bool) -> None:
        """A backward starts (``boundary_predicted``: a managed schedule says it is the boundary's). Waits for
        whatever of the last update the backward must not overlap."""

    def bucket_gradients(self, bucket: Bucket) -> torch.Tensor:
        """Where this backward's gradients of ``bucket`` go (R10, communication dtype; stages 2/3)."""
        raise NotImplementedError

    def bucket_launched(self, bucket: Bucket) -> None:
        """``bucket``'s reduce-scatter was launched (``bucket.reduce``); the path may consume earlier ones."""

    def finish_backward(self, buckets: Sequence[Bucket]) -> None:
        """Every bucket was launched: add this rank's reduced slices into the accumulator (R10), then drop
        each bucket's ``reduce`` and ``keep_alive``."""
        raise NotImplementedError

    # ---- the boundary (R13-R17) --------------------------------------------------------------------------
    def before_step(self) -> None:
        """``step()`` starts (boundary or not): wait for what a step must not overlap."""

    def boundary(self, hyper: OptimizerConfig, record_gradients: bool) -> StepOutcome:
        """R13 on this rank: finish the reduction, norm (R14), clip (R15), optimizer (R16/R17), cast back and
        all-gather (R12), clear the gradient state. ``hyper``: this boundary's hyper-parameters."""
        raise NotImplementedError

    # ---- what is in flight ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """The last boundary's update is complete and visible to the current stream; re-raises its error."""

    def wait_range(self, lo: int, hi: int) -> None:
        """The weights of partition range ``[lo, hi)`` are in place for work queued from now on (stage 3)."""

    def install_forward_waits(self, module: nn.Module, names_of: dict[int, str], add_hook: Callable) -> None:
        """Register forward pre-hooks that wait for a module's own weights (stage 2, an update in flight)."""

    def apply_delayed(self) -> None:
        """R27: let the last boundary's update reach the parameters now (no-op where they already have it)."""

    # ---- state: gradients, checkpoints ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drop the gradient accumulated since the last boundary."""
        self.accumulator.zero_()

    def optimizer_state(self) -> OptimizerState:
        """A copy of this rank's optimizer state (read back from wherever it waits between steps)."""
        return OptimizerState(self.opt_state.step, {k: v.clone() for k, v in self.opt_state.buffers.items()})

    def live_weights_to_save(self) -> torch.Tensor | None:
        """R27: this rank's live partition when it is not the master's cast (a host copy), else None."""
        return None

    def install(
        self, master: torch.Tensor, opt_buffers: dict[str, torch.Tensor] | None, applied: torch.Tensor | None
    ) -> None:
        """Make ``master`` (this rank's master range) the master and its cast the live parameters (R13 step 5),
        ``opt_buffers`` (if given) the optimizer state, and drop the accumulated gradient. ``applied``: the
        live weights a delayed run saved (used only where :attr:`lags_parameters`)."""
        self.master.copy_(master)
        if opt_buffers is not None:
            self._install_state_buffers(opt_buffers)
        lp = self._install_cast(master.to(self.config.model_dtype), applied)
        self.ctx.weights.write(lp, "checkpoint parameter all-gather", staging=self.live_staging)
        self.zero_grad()

    def _install_state_buffers(self, opt_buffers: dict[str, torch.Tensor]) -> None:
        # R29: into this engine's state precision -- a wider value rounded by the contract, a narrower one widened.
        for k, v in opt_buffers.items():
            dst = self.opt_state.buffers[k]
            StatePrecision.of(dst).store(dst, v.to(device=dst.device))

    def _install_cast(self, lp: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
        """What the live parameters become on :meth:`install` (the master's cast, by default)."""
        return lp

    def close(self) -> None:
        """Stop everything in flight and drop every reference to buffers, so that objects still holding this
        path (an autograd graph a caller kept) keep no memory alive (never raises, never communicates).
        Subclasses stop their own machinery first, then call this."""
        self.__dict__.clear()


# ---- what every path builds its buffers and its boundary from ---------------------------------------------------
def initial_master(ctx: UpdateContext, *, on_host: bool) -> torch.Tensor:
    """This rank's fp32 master from the broadcast initial parameters (R1), on the host (pinned) or device."""
    numel = ctx.master_numel
    if on_host:
        master = ctx.host.empty(numel, torch.float32, pinned=True)
    else:
        master = torch.empty(numel, dtype=torch.float32, device=ctx.device)
    lo, hi = ctx.partition
    master.copy_(ctx.weights.initial if ctx.stage == 0 else ctx.weights.initial[lo:hi])
    return master


def state_buffers(ctx: UpdateContext, names: Sequence[str], *, on_host: bool) -> dict[str, torch.Tensor]:
    """Zeroed optimizer-state buffers next to the master, Adam's moments in the state precision (R29: bf16
    halves their pinned bytes; SGD's momentum stays fp32)."""
    dtype = ctx.config.state_dtype
    out = {}
    for name in names:
        if on_host:
            b = ctx.host.empty(ctx.master_numel, dtype, pinned=True)
        else:
            b = torch.empty(ctx.master_numel, dtype=dtype, device=ctx.device)
        out[name] = b.zero_()
    return out


def host_model_buffer(ctx: UpdateContext) -> torch.Tensor:
    """A host buffer of the master's size in the model dtype (pinned when a device copies from it)."""
    return ctx.host.empty(ctx.master_numel, ctx.config.model_dtype, pinned=ctx.device.type != "cpu")


def global_norm(ctx: UpdateContext, rank_sum: float) -> float:
    """R14: this rank's sum of squares added to the others' in rank order, square root."""
    return norm_from_total(ctx.comm.sum_floats_in_rank_order(rank_sum, ctx.device, "gradient norm all-gather"))


def gathered_gradients(ctx: UpdateContext, part: torch.Tensor, full: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """The full reduced gradient as fp32 per parameter (``record_gradients``): ``full`` if this rank has it
    (stage 0), else all-gathered from every rank's ``part``."""
    if full is None:
        full = torch.empty(ctx.layout.total, dtype=ctx.config.accum_dtype, device=ctx.device)
        ctx.comm.all_gather_into(full, part.to(ctx.device), "gradient record all-gather")
    return {n: t.clone() for n, t in unflatten(ctx.layout, full.to(torch.float32)).items()}
