"""The optimized user-facing context manager: the shared manager life cycle
(:class:`~reference.contract.offload_manager.SavedTensorHooksManager`) bound to a
:class:`~optimized.offload.engine.StreamedOffloadEngine`.

Create one manager and enter it once per step: its engine, with its pinned pool and its copy streams, is reused
across steps (``close()`` gives the pool's cached memory back).
"""

from __future__ import annotations

from optimized.offload.engine import StreamedOffloadEngine
from reference.contract.accelerators import Accelerator
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_manager import SavedTensorHooksManager


class ActivationOffload(SavedTensorHooksManager):
    """Offload saved activations with pooled pinned memory, copy streams and prefetch.

    ``ActivationOffload(config=None, *, accelerator=None, **knobs)``: ``knobs`` override fields of ``config``
    (see :class:`~reference.contract.offload_config.OffloadConfig`); ``accelerator`` is an Accelerator, its name,
    or None for the default one.
    """

    _engine: StreamedOffloadEngine

    def _new_engine(self, config: OffloadConfig, accelerator: Accelerator) -> StreamedOffloadEngine:
        return StreamedOffloadEngine(config, accelerator)

    @property
    def engine(self) -> StreamedOffloadEngine:
        return self._engine
