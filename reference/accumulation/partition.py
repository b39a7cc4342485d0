"""The reference's flat-buffer operations on the R8 layout: flatten, shard, all-gather, written plainly.

The layout itself (where every parameter and every rank's partition lies) is the area's contract,
:mod:`reference.contract.accumulation_partition`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from reference.contract.accumulation_partition import (
    FLAT_ALIGNMENT,
    FlatLayout,
    Piece,
    Segment,
    build_layout,
    unflatten,
)
from reference.contract.errors import ConfigurationError

__all__ = [
    "FLAT_ALIGNMENT",
    "FlatLayout",
    "Piece",
    "Segment",
    "build_layout",
    "flatten",
    "gather",
    "shard",
    "unflatten",
]


def flatten(
    layout: FlatLayout,
    tensors: Mapping[str, torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A new zero-padded flat buffer holding ``tensors`` cast to ``dtype``; a missing or ``None`` entry is
    zeros.

    Zeros for a missing gradient is R7: a parameter that took no part in a backward contributes nothing, but
    it still occupies its range so every rank's buffer has the same shape.
    """
    flat = torch.zeros(layout.total, dtype=dtype, device=device)
    for seg in layout.segments:
        t = tensors.get(seg.name)
        if t is None:
            continue
        if tuple(t.shape) != seg.shape:
            raise ConfigurationError(f"tensor {seg.name!r} has shape {tuple(t.shape)}; the layout expects {seg.shape}")
        flat[seg.offset : seg.end].copy_(t.detach().reshape(-1).to(dtype))
    return flat


def shard(layout: FlatLayout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s contiguous partition of ``flat`` (a view)."""
    start, end = layout.partition_range(rank)
    return flat[start:end]


def gather(layout: FlatLayout, shards: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """All-gather: the ranks' partitions concatenated in rank order into a new flat buffer on ``device``."""
    if len(shards) != layout.world_size:
        raise ConfigurationError(f"got {len(shards)} shards; the layout has world_size={layout.world_size}")
    for r, s in enumerate(shards):
        if s.numel() != layout.partition_size:
            raise ConfigurationError(
                f"shard of rank {r} has {s.numel()} elements; the layout expects {layout.partition_size}"
            )
    return torch.cat([s.reshape(-1).to(device) for s in shards])
