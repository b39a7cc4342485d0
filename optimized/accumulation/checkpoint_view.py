"""What checkpoint save and load see of a ZeroEngine: :class:`CheckpointView`, built by the engine per call.

:mod:`.checkpoint` writes an engine's state into files and installs it back. It needs more than the engine's public
surface (the collectives, the schedule's counters, the update path, the live weights' frozen partition), and less
than the whole engine: this view names exactly that, so the checkpoint code reads no private attribute of the
engine and the engine can change its insides without the checkpoint code noticing. The two things a load changes
on the engine itself (the scheduler state held until a scheduler is attached, the "gradients accumulated" flag) go
through the engine's :class:`~.lr.LrSchedule` and a function the engine hands over, not fields the checkpoint code
writes. The view also says where the engine is (inside ``backward()``, ``no_sync()``, gradients pending) so the
checkpoint code refuses a call at the wrong time before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optimized.accumulation.collectives import Collectives
from optimized.accumulation.lr import EngineOptimizer, LrSchedule
from optimized.accumulation.update_paths import UpdatePath
from optimized.accumulation.weights import LiveWeights
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_partition import FlatLayout
from reference.contract.accumulation_schedule import AccumulationSchedule
from reference.contract.accumulation_step import OptimizerState

__all__ = ["CheckpointView"]


@dataclass(frozen=True)
class CheckpointView:
    """One rank of an engine, as checkpoint save and load need it (names as on the engine where it has them)."""

    comm: Collectives
    rank: int
    world_size: int
    stage: int
    device: torch.device
    config: AccumulationConfig
    layout: FlatLayout
    frozen_layout: FlatLayout
    frozen_names: tuple[str, ...]
    #: the wrapped model (its buffers are saved and loaded)
    module: nn.Module
    #: every parameter by name (the frozen ones are saved from and loaded into them below stage 3)
    params: Mapping[str, nn.Parameter]
    #: the parameters' storage (stage 3: the frozen partition)
    weights: LiveWeights
    #: the update path: master, optimizer state, R27's live weights; install() on load
    path: UpdatePath
    #: the counters (R2-R6) a checkpoint records and restores
    schedule: AccumulationSchedule
    optimizer: EngineOptimizer
    #: the attached lr_scheduler, and where a loaded scheduler state waits for one attached later
    lr_schedule: LrSchedule
    #: the gradient accumulated since the last boundary was dropped (an install)
    gradients_dropped: Callable[[], None]
    #: when the view was built: inside backward(), inside no_sync(), gradients accumulated since the last boundary
    in_backward: bool
    in_no_sync: bool
    grads_pending: bool

    @property
    def lr_scheduler(self) -> Any:
        return self.lr_schedule.scheduler

    @property
    def global_steps(self) -> int:
        return self.schedule.global_steps

    def optimizer_state(self) -> OptimizerState:
        """A copy of this rank's optimizer state (with ``nvme``: read back from its files). The engine waited for
        the update in flight before building the view."""
        return self.path.optimizer_state()
