"""The torch pinning backend: torch's own pinned host allocator.

It is the default because it is what every torch user already has. Where the accelerator has no torch pinning
(a CPU-only torch build), pinning is a documented no-op: memory is allocated pageable, values and shapes are still
honoured, and ``is_pinned`` reports False, so code written for a GPU machine keeps running on a laptop.
"""

from __future__ import annotations

import torch

from reference.contract.accelerators import Accelerator
from reference.contract.pinning_rules import torch_empty


def empty(shape: tuple[int, ...], dtype: torch.dtype, accelerator: Accelerator) -> torch.Tensor:
    """torch's (pinned, where it pins) ``empty``; its allocator running out is the contract's
    ``PinnedAllocationError`` naming the size and the limits, not torch's raw enforce message."""
    return torch_empty(shape, dtype, pin_memory=accelerator.has_torch_pinning)
