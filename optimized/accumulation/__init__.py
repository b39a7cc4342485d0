"""ZeRO data-parallel engine on torch.distributed (area ``accumulation``, optimized; docs/zero.md).

:class:`ZeroEngine` is what training scripts use (one per rank, like DeepSpeed's engine). :func:`run_scenario`
is the area's uniform entry point (R26): it runs a shared :class:`Scenario` on W rank processes and returns the
shared :class:`Trace`, which the conformance suite compares with the reference's. The config, scenario and
trace types are the reference's own (shared contracts).
"""

from __future__ import annotations

from optimized import cpu_adam as native_cpu_adam
from optimized.accumulation.collectives import CollectiveError, Collectives, fold_in_rank_order
from optimized.accumulation.config import CONFIG_KEYS, DTYPES, AccumulationConfig, OptimizerConfig
from optimized.accumulation.engine import DEFAULT_BUCKET_ELEMENTS, StepOutcome, ZeroEngine
from optimized.accumulation.lr import EngineOptimizer
from optimized.accumulation.optimizers import step_master, torch_step, uses_native
from optimized.accumulation.scenario import BACKEND_ENV, POOL_SIZE_ENV, TIMEOUT_ENV, run_on_ranks, run_scenario
from optimized.accumulation.workers import WorkerTimeoutError, shutdown_pools
from reference.accumulation.scenario import (
    Backward,
    BackwardRecord,
    ControlRecord,
    Counters,
    EnterNoSync,
    ExitNoSync,
    ModelSpec,
    Scenario,
    SetBoundary,
    Step,
    StepRecord,
    Trace,
    compute_loss,
    micro_batch,
    scenario_calls,
)
from reference.errors import CheckpointError, ConfigurationError, UnsupportedOperationError

#: Marks this module as the multi-process engine (engine-specific conformance tests look for it).
DISTRIBUTED_ENGINE = True

__all__ = [
    "BACKEND_ENV",
    "CONFIG_KEYS",
    "DEFAULT_BUCKET_ELEMENTS",
    "DISTRIBUTED_ENGINE",
    "DTYPES",
    "POOL_SIZE_ENV",
    "TIMEOUT_ENV",
    "AccumulationConfig",
    "Backward",
    "BackwardRecord",
    "CheckpointError",
    "CollectiveError",
    "Collectives",
    "ConfigurationError",
    "ControlRecord",
    "Counters",
    "EngineOptimizer",
    "EnterNoSync",
    "ExitNoSync",
    "ModelSpec",
    "OptimizerConfig",
    "Scenario",
    "SetBoundary",
    "Step",
    "StepOutcome",
    "StepRecord",
    "Trace",
    "UnsupportedOperationError",
    "WorkerTimeoutError",
    "ZeroEngine",
    "compute_loss",
    "fold_in_rank_order",
    "micro_batch",
    "native_cpu_adam",
    "run_on_ranks",
    "run_scenario",
    "scenario_calls",
    "shutdown_pools",
    "step_master",
    "torch_step",
    "uses_native",
]
