"""The reference's user-facing context manager: the shared manager life cycle
(:class:`~reference.contract.offload_manager.SavedTensorHooksManager`) bound to its offload engine
(:class:`~reference.offload.engine.BlockingOffloadEngine`, which copies synchronously and caches no host memory).
"""

from __future__ import annotations

from reference.contract.accelerators import Accelerator
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_manager import SavedTensorHooksManager
from reference.offload.engine import BlockingOffloadEngine


class ActivationOffload(SavedTensorHooksManager):
    """Offload saved activations to host memory during forward and bring them back in backward.

    ``ActivationOffload(config=None, *, accelerator=None, **knobs)``: ``knobs`` override fields of
    ``config`` (see :class:`~reference.contract.offload_config.OffloadConfig`); ``accelerator`` is an Accelerator,
    its name, or None for the default one.
    """

    _engine: BlockingOffloadEngine

    def _new_engine(self, config: OffloadConfig, accelerator: Accelerator) -> BlockingOffloadEngine:
        return BlockingOffloadEngine(config, accelerator)

    @property
    def engine(self) -> BlockingOffloadEngine:
        return self._engine
