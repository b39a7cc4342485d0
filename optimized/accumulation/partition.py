"""The R8 flat layout (the area's contract) plus the range arithmetic the distributed engine needs.

The layout itself is specification (the norm of R14 is grouped by it), so it comes from
:mod:`reference.contract.accumulation_partition`, the module every implementation cuts its buffers by. What is
added here is where a flat range ``[start, end)`` meets the per-rank partitions: a bucketed reduce-scatter
sends each rank the part of the bucket it owns, and a ZeRO-3 gather fetches each piece of a module's range
from the rank that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.contract.accumulation_partition import (
    FLAT_ALIGNMENT,
    FlatLayout,
    Piece,
    Segment,
    build_layout,
    unflatten,
)

__all__ = [
    "FLAT_ALIGNMENT",
    "FlatLayout",
    "OwnedSlice",
    "Piece",
    "Segment",
    "build_layout",
    "owners",
    "unflatten",
]


@dataclass(frozen=True)
class OwnedSlice:
    """The part ``[start, end)`` (flat indices) of a range that rank ``rank`` owns."""

    rank: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def owners(layout: FlatLayout, start: int, end: int) -> list[OwnedSlice]:
    """For every rank, in rank order, the slice of ``[start, end)`` inside its partition (possibly empty)."""
    p = layout.partition_size
    out = []
    for r in range(layout.world_size):
        lo, hi = max(start, r * p), min(end, (r + 1) * p)
        out.append(OwnedSlice(r, lo, max(lo, hi)))
    return out
