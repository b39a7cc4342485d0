"""HF integration: the reference's module, shared on purpose.

The patch of ``transformers.GradientCheckpointingLayer`` is process-wide state with one reference count; two
copies of it (one per implementation) could restore each other's ``__call__`` in the wrong order.
"""

from reference.offload.hf import MissingDependencyError, acquire, is_patched, release

__all__ = ["MissingDependencyError", "acquire", "is_patched", "release"]
