"""ZeRO data-parallel engine on torch.distributed (area ``accumulation``, optimized; docs/zero.md).

:class:`ZeroEngine` is what training scripts use (one per rank, like DeepSpeed's engine). The area declares it
(``Capabilities(distributed_engine=True)``) and has no ``run_scenario`` of its own: the conformance harness runs
a shared :class:`Scenario` on W rank processes of this engine (``conformance.harness.engine_runner``; test machinery,
which production code never imports) and compares the :class:`Trace` with the reference's. The config, scenario and
trace types are the area's contract (``reference.contract.accumulation_config``, ``reference.contract.accumulation_*``),
re-exported here unchanged so that the engine accepts exactly what the reference accepts; everything else in
this package is the optimized implementation's own code.

Two optional components are declared for the conformance suite to find by name (a third-party area module may
declare them too, or not): ``fused_device_adam`` (a device Adam kernel; test_accumulation_engine_device_adam) and
``transport_handoff``, the object through which :class:`Collectives` hands every tensor to torch.distributed --
``lend(*tensors)`` returns the aliases to post, ``held()`` counts those a transport may still reference,
``drain(timeout)`` waits for them -- so that no tensor is last released by a transport thread
(test_accumulation_transport_handoff; docs/zero.md, "Exactness and the runner"). A third,
``lightning_strategy``, is the module of this engine's Lightning 2.x ``Strategy`` (``ZeroStrategy``, imported
with Lightning on first use; ``load_lightning()`` names the missing extra): test_accumulation_lightning trains a
``LightningModule`` through it and compares with the plain loop of the same engine (docs/zero.md, "Lightning").
"""

from __future__ import annotations

from optimized import cpu_adam as native_cpu_adam
from optimized.accumulation import device_adam as fused_device_adam
from optimized.accumulation.collectives import HANDOFF as transport_handoff
from optimized.accumulation.collectives import CollectiveError, Collectives, fold_in_rank_order
from optimized.accumulation.engine import DEFAULT_BUCKET_ELEMENTS, StepOutcome, ZeroEngine
from optimized.accumulation.host_memory import HostMemoryEstimate, estimate_host_memory
from optimized.accumulation.lr import EngineOptimizer
from optimized.accumulation.optimizers import step_master, torch_step, uses_native
from optimized.integrations import lightning as lightning_strategy
from reference.contract.accumulation_config import (
    CONFIG_KEYS,
    DTYPES,
    OFFLOAD_DEVICES,
    OFFLOAD_OPTIMIZER_DEVICES,
    OPTIMIZERS,
    ZERO_STAGES,
    AccumulationConfig,
    OptimizerConfig,
)
from reference.contract.accumulation_scenario import (
    ApplyDelayedUpdate,
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
from reference.contract.errors import CheckpointError, ConfigurationError, UnsupportedOperationError

__all__ = [
    "CONFIG_KEYS",
    "DEFAULT_BUCKET_ELEMENTS",
    "DTYPES",
    "OFFLOAD_DEVICES",
    "OFFLOAD_OPTIMIZER_DEVICES",
    "OPTIMIZERS",
    "ZERO_STAGES",
    "AccumulationConfig",
    "ApplyDelayedUpdate",
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
    "HostMemoryEstimate",
    "ModelSpec",
    "OptimizerConfig",
    "Scenario",
    "SetBoundary",
    "Step",
    "StepOutcome",
    "StepRecord",
    "Trace",
    "UnsupportedOperationError",
    "ZeroEngine",
    "compute_loss",
    "estimate_host_memory",
    "fold_in_rank_order",
    "fused_device_adam",
    "lightning_strategy",
    "micro_batch",
    "native_cpu_adam",
    "scenario_calls",
    "step_master",
    "torch_step",
    "transport_handoff",
    "uses_native",
]
