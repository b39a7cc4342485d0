"""Activation offload, reference implementation (area ``offload``).

Public API (the optimized implementation exposes the same names with the same behaviour):

- :class:`OffloadConfig` and the mode constants: the validated knobs (shared contract, defined here).
- :class:`ActivationOffload`: the saved-tensor-hooks context manager; reuse one instance across steps.
- :func:`checkpoint`: reentrant (inputs offloaded through the engine) and non-reentrant checkpointing.
- :func:`mark_checkpoint_input`: mark a tensor as a checkpoint input for ``mode="checkpoint_inputs"``.
- :class:`OffloadStats`: what a manager did; :func:`current_manager` / :func:`active_managers`.
- :class:`MissingDependencyError`: the HF integration was asked for without ``transformers``.

The reference is blocking and allocates a fresh pinned buffer per tensor; it is the oracle the conformance
suite compares the optimized implementation against.
"""

from __future__ import annotations

from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.offload_config import MODE_ALL, MODE_CHECKPOINT_INPUTS, MODES, OffloadConfig
from reference.contract.offload_stats import OffloadStats
from reference.offload.checkpoint import build_checkpoint, checkpoint
from reference.offload.hf import MissingDependencyError
from reference.offload.hooks import ActivationOffload, active_managers, current_manager
from reference.offload.selection import mark_checkpoint_input

IMPLEMENTATION_NAME = "reference"

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
