"""Activation offload, optimized implementation (area ``offload``).

Same public API as :mod:`reference.offload` (same names, same config object, same errors). Read top-down:

- :mod:`optimized.offload.manager`: :class:`ActivationOffload`, the context manager and its hooks;
- :mod:`optimized.offload.engine`: what happens to one saved tensor (pool, D2H/H2D streams and events, early
  release of restored buffers);
- :mod:`optimized.offload.prefetch`: when a planned look-ahead copy is issued;
- :mod:`optimized.offload.pool`: the pinned host blocks offloaded data lives in;
- :mod:`optimized.offload.copy_timing`: copy durations measured on the device.

The shared rules (config, stats, selection, storage-span layout, version check, HF patch, ``build_checkpoint``,
the stack of active managers) come from the contract and are re-exported here unchanged.
"""

from __future__ import annotations

from optimized.offload.manager import ActivationOffload
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.offload_checkpoint import build_checkpoint
from reference.contract.offload_config import MODE_ALL, MODE_CHECKPOINT_INPUTS, MODES, OffloadConfig
from reference.contract.offload_hf import MissingDependencyError
from reference.contract.offload_manager import active_managers, current_manager
from reference.contract.offload_selection import mark_checkpoint_input
from reference.contract.offload_stats import OffloadStats

IMPLEMENTATION_NAME = "optimized"

#: ``checkpoint`` on the optimized manager (see :data:`reference.contract.offload_checkpoint.CHECKPOINT_DOC`).
checkpoint = build_checkpoint(ActivationOffload)

__all__ = [
    "MODES",
    "MODE_ALL",
    "MODE_CHECKPOINT_INPUTS",
    "ActivationOffload",
    "ConfigurationError",
    "MissingDependencyError",
    "OffloadConfig",
    "OffloadStats",
    "UnsupportedOperationError",
    "active_managers",
    "build_checkpoint",
    "checkpoint",
    "current_manager",
    "mark_checkpoint_input",
]
