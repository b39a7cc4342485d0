"""ZeRO gradient-accumulation semantics: the reference model (area ``accumulation``, docs/accumulation.md).

The uniform entry point every implementation of the area provides is :func:`run_scenario` (``Scenario ->
Trace``, rule R26). The reference also exposes its engine for direct use, the config, the scenario/trace types
the suite builds and compares, and the error classes its rejections raise.
"""

from __future__ import annotations

from reference.accumulation.collectives import average_across_ranks
from reference.accumulation.engine import AccumulationEngine, StepOutcome, global_grad_norm
from reference.accumulation.optimizers import OptimizerState, init_state, optimizer_step
from reference.accumulation.partition import (
    FLAT_ALIGNMENT,
    FlatLayout,
    build_layout,
    flatten,
    gather,
    shard,
    unflatten,
)
from reference.accumulation.scenario import build_engine, run_scenario
from reference.contract.accumulation_config import CONFIG_KEYS, DTYPES, AccumulationConfig, OptimizerConfig
from reference.contract.accumulation_scenario import (
    AccumulationMLP,
    AffineMap,
    ApplyDelayedUpdate,
    Backward,
    BackwardRecord,
    Call,
    ControlRecord,
    Counters,
    EnterNoSync,
    ExitNoSync,
    ModelSpec,
    Record,
    Scenario,
    ScenarioRunner,
    SetBoundary,
    Step,
    StepRecord,
    Trace,
    compute_loss,
    merge_rank_traces,
    micro_batch,
    scenario_calls,
)
from reference.contract.accumulation_step import CLIP_EPSILON
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

__all__ = [
    "CLIP_EPSILON",
    "CONFIG_KEYS",
    "DTYPES",
    "FLAT_ALIGNMENT",
    "AccumulationConfig",
    "AccumulationEngine",
    "AccumulationMLP",
    "AffineMap",
    "ApplyDelayedUpdate",
    "Backward",
    "BackwardRecord",
    "Call",
    "ConfigurationError",
    "ControlRecord",
    "Counters",
    "EnterNoSync",
    "ExitNoSync",
    "FlatLayout",
    "ModelSpec",
    "OptimizerConfig",
    "OptimizerState",
    "Record",
    "Scenario",
    "ScenarioRunner",
    "SetBoundary",
    "Step",
    "StepOutcome",
    "StepRecord",
    "Trace",
    "UnsupportedOperationError",
    "average_across_ranks",
    "build_engine",
    "build_layout",
    "compute_loss",
    "flatten",
    "gather",
    "global_grad_norm",
    "init_state",
    "merge_rank_traces",
    "micro_batch",
    "optimizer_step",
    "run_scenario",
    "scenario_calls",
    "shard",
    "unflatten",
]
