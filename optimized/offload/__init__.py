"""Activation offload, optimized implementation (area ``offload``).

Same public API as :mod:`reference.offload` (same names, same config object, same errors); the engine uses a
pinned pool reused across steps, D2H/H2D copy streams synchronised with events, prefetch in backward order
and early release of restored buffers. See :mod:`optimized.offload.engine`.
"""

from __future__ import annotations

from optimized.offload.checkpoint import checkpoint
from optimized.offload.config import MODE_ALL, MODE_CHECKPOINT_INPUTS, MODES, OffloadConfig
from optimized.offload.hf import MissingDependencyError
from optimized.offload.hooks import ActivationOffload, active_managers, current_manager
from optimized.offload.stats import OffloadStats
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.offload.checkpoint import build_checkpoint
from reference.offload.selection import mark_checkpoint_input

IMPLEMENTATION_NAME = "optimized"

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
