"""``checkpoint`` bound to the optimized manager (used when no manager is active and none is passed)."""

from __future__ import annotations

from optimized.offload.hooks import ActivationOffload
from reference.offload.checkpoint import build_checkpoint

checkpoint = build_checkpoint(ActivationOffload)

__all__ = ["checkpoint"]
