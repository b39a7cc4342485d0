"""The optimized context manager: the reference manager with
:class:`~optimized.offload.engine.StreamedEngine`.

The hook plumbing (enter/exit, nesting, HF patch, exception safety) is the contract's, so it is inherited
rather than repeated; only the engine differs.
"""

from __future__ import annotations

from optimized.offload.engine import StreamedEngine
from reference.offload.hooks import ActivationOffload as _ReferenceActivationOffload
from reference.offload.hooks import active_managers, current_manager


class ActivationOffload(_ReferenceActivationOffload):
    """Offload saved activations with pooled pinned memory, copy streams and prefetch."""

    engine_class = StreamedEngine


__all__ = ["ActivationOffload", "active_managers", "current_manager"]
