"""What one ZeroEngine is made of, built in order and released in order: :func:`build_parts` and
:class:`EngineParts`.

Why a separate object: the engine's construction wires the parameters' storage, the update path, the gradient hooks
and stage 3's hooks to one another, and ``destroy()`` must undo exactly that -- every hook removed, every pinned
buffer unpinned, the ``nvme`` swap closed, the model released to other engines -- even when construction failed
half-way and even after another rank failed (it never communicates). One object that holds each resource as it is
built and releases what it holds is the only place that knows both orders; the engine keeps the training surface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optimized.accumulation.buckets import plan_buckets
from optimized.accumulation.collectives import HANDOFF, Collectives
from optimized.accumulation.construction import ModelParameters
from optimized.accumulation.gradients import GradientHooks
from optimized.accumulation.host_buffers import HostBuffers
from optimized.accumulation.origin import LossOrigin
from optimized.accumulation.ownership import ModuleClaim
from optimized.accumulation.stage3 import Stage3Parameters
from optimized.accumulation.update_paths import PathReports, UpdateContext, UpdatePath
from optimized.accumulation.weights import LiveWeights
from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_schedule import AccumulationSchedule
from reference.contract.errors import UnsupportedOperationError

__all__ = ["EngineParts", "LiveParts", "build_parts"]


@dataclass(frozen=True)
class LiveParts:
    """The parts of an engine that is not destroyed, every one built (``stage3`` at stage 3 only): what the engine's
    calls work on, so none of them handles a part that :meth:`EngineParts.close` already dropped."""

    weights: LiveWeights
    path: UpdatePath
    grads: GradientHooks
    stage3: Stage3Parameters | None


@dataclass
class EngineParts:
    """The resources of one engine; a part is None until built and after :meth:`close`."""

    host: HostBuffers = field(default_factory=HostBuffers)
    #: every hook the engine installed (forward waits, gradient hooks, stage 3's, the loss-origin mark)
    hooks: list[Any] = field(default_factory=list)
    claim: ModuleClaim | None = None
    weights: LiveWeights | None = None
    path: UpdatePath | None = None
    grads: GradientHooks | None = None
    stage3: Stage3Parameters | None = None
    closed: bool = False

    @property
    def reports(self) -> PathReports:
        """The update path's reports (nothing to report once closed)."""
        return PathReports() if self.path is None else self.path.reports

    def pinned_buffers(self) -> tuple[torch.Tensor, ...]:
        """The pinned host buffers held now: the engine's own and those the path keeps apart (``nvme`` state)."""
        return self.host.pinned + self.reports.resident_buffers()

    def live(self) -> LiveParts:
        """The built parts; refused once :meth:`close` dropped them (a destroyed engine)."""
        if self.closed or self.weights is None or self.path is None or self.grads is None:
            raise UnsupportedOperationError("the engine was destroyed; allowed: build a new ZeroEngine")
        return LiveParts(weights=self.weights, path=self.path, grads=self.grads, stage3=self.stage3)

    def synchronize(self) -> None:
        """Wait for the update in flight, if any (a no-op once closed)."""
        if self.path is not None:
            self.path.synchronize()

    def close(self) -> None:
        """Remove every hook, free the model for other engines, close the update path (a worker finishes, a swap
        handle closes), the weights and stage 3, then unpin the host buffers. Never raises on a part that was
        never built, never communicates; safe to call twice."""
        HANDOFF.drain()  # the transport's threads let go of this engine's tensors before they are unpinned
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        if self.claim is not None:
            self.claim.release()
            self.claim = None
        path, self.path = self.path, None
        if path is not None:
            # never raises: lets a worker finish (it writes into buffers unpinned below), closes a swap handle
            path.close()
        for part in (self.weights, self.stage3):
            if part is not None:
                part.close()
        self.weights = self.stage3 = self.grads = None
        del path, part
        self.host.release()
        self.closed = True


def build_parts(
    *,
    config: AccumulationConfig,
    path_class: type[UpdatePath],
    module: nn.Module,
    params: ModelParameters,
    comm: Collectives,
    device: torch.device,
    bucket_elements: int,
    prefetch: bool,
    schedule: AccumulationSchedule,
    origin: LossOrigin,
    in_backward: Callable[[], bool],
    hyper_now: Callable[[], OptimizerConfig],
) -> EngineParts:
    """The model claimed, the parameters' storage, the gradient buckets, the update path, then the hooks that
    connect them (stage 3's last but one, the loss-origin mark last). A failure releases what was built."""
    stage, rank = config.zero_stage, comm.rank
    layout, frozen_layout, named = params.layout, params.frozen_layout, params.params
    parts = EngineParts()
    try:
        parts.claim = ModuleClaim(module, stage=stage, rank=rank)
        parts.weights = weights = LiveWeights(
            stage=stage, rank=rank, layout=layout, frozen_layout=frozen_layout, device=device, comm=comm,
            params=named, host=parts.host, offload_param=config.offload_param == "cpu",
            model_dtype=config.model_dtype,
        )
        buckets = plan_buckets(layout, bucket_elements) if stage >= 2 else []
        parts.path = path = path_class(UpdateContext(
            config=config, layout=layout, rank=rank, world_size=comm.world, stage=stage, device=device,
            comm=comm, weights=weights, host=parts.host, buckets=buckets,
            boundaries_done=lambda: schedule.global_steps, hyper_now=hyper_now,
        ))
        weights.drop_initial()
        trainable_of = {id(named[n]): n for n in params.trainable_names}
        path.install_forward_waits(module, trainable_of, parts.hooks.append)
        parts.grads = GradientHooks(
            stage=stage, layout=layout, comm=comm, accum_dtype=config.accum_dtype, buckets=buckets,
            in_backward=in_backward,
        )
        parts.grads.attach(path, named, parts.hooks.append)
        if stage == 3:
            parts.stage3 = Stage3Parameters(
                module=module, params=named, layout=layout, frozen_layout=frozen_layout, weights=weights,
                comm=comm, device=device, model_dtype=config.model_dtype, prefetch=prefetch,
                in_backward=in_backward, wait_update=path.wait_range, add_hook=parts.hooks.append,
            )
        parts.hooks.append(module.register_forward_hook(lambda _m, _args, out: origin.mark_outputs(out)))
    except BaseException:
        parts.close()
        raise
    return parts
