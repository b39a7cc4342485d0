"""The engine's configuration: the shared contract of the area, re-exported unchanged.

The config object (keys, validation, R19 rejections and their messages) is part of the specification
(docs/accumulation.md, "Implementing the area"), so the optimized engine accepts exactly what the reference
accepts by using the same class rather than a copy that could drift.
"""

from __future__ import annotations

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

__all__ = [
    "CONFIG_KEYS",
    "DTYPES",
    "OFFLOAD_DEVICES",
    "OFFLOAD_OPTIMIZER_DEVICES",
    "OPTIMIZERS",
    "ZERO_STAGES",
    "AccumulationConfig",
    "OptimizerConfig",
]
