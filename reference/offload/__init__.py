"""Activation offload, reference implementation (area ``offload``).

Public API (the optimized implementation exposes the same names with the same behaviour):

- :class:`OffloadConfig` and the mode constants: the validated knobs (shared contract).
- :class:`ActivationOffload`: the saved-tensor-hooks context manager; reuse one instance across steps.
- :func:`checkpoint`: reentrant (inputs offloaded through the engine) and non-reentrant checkpointing.
- :func:`mark_checkpoint_input`: mark a tensor as a checkpoint input for ``mode="checkpoint_inputs"``.
- :class:`OffloadStats`: what a manager did; :func:`current_manager` / :func:`active_managers`.
- :class:`MissingDependencyError`: the HF integration was asked for without ``transformers``.
- :func:`build_checkpoint`: the ``checkpoint`` of a manager class (contract).

What is decided here: the manager (:mod:`reference.offload.manager`) and the engine (:mod:`reference.offload.engine`).
The rules every implementation shares (selection, storage-span layout, version check, HF patch, checkpoint, the
stack of active managers) are in ``reference/contract/offload_*.py``.

The reference is blocking and allocates a fresh pinned buffer per tensor; it is the oracle the conformance
suite compares the optimized implementation against.
"""

from __future__ import annotations

from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.offload_checkpoint import build_checkpoint
from reference.contract.offload_config import MODE_ALL, MODE_CHECKPOINT_INPUTS, MODES, OffloadConfig
from reference.contract.offload_hf import MissingDependencyError
from reference.contract.offload_manager import active_managers, current_manager
from reference.contract.offload_selection import mark_checkpoint_input
from reference.contract.offload_stats import OffloadStats
from reference.offload.manager import ActivationOffload

#: ``checkpoint`` on the reference manager (see :data:`reference.contract.offload_checkpoint.CHECKPOINT_DOC`).
checkpoint = build_checkpoint(ActivationOffload)

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
