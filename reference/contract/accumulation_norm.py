"""R14 and R15 written once: the global gradient norm and the clipping coefficient every engine computes.

Both engines, and every update path of the optimized one, must produce the same norm bit for bit (the trace
compares it exactly): each rank sums the squares of each of its R8 pieces in fp64 (``torch.sum(x * x)``), adds
those per-piece sums as Python floats in flat order starting from 0.0, the ranks' sums are added the same way in
rank order (how the sums reach one place -- a loop over simulated ranks, an all-gather -- is each engine's own),
and the square root is taken. The clipping coefficient is ``gradient_clipping / (norm + CLIP_EPSILON)``, applied
only when it is below 1 (docs/accumulation.md R14, R15).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from reference.contract.accumulation_partition import FlatLayout
from reference.contract.accumulation_step import CLIP_EPSILON

__all__ = ["clip_coefficient", "fold_left", "norm_from_total", "piece_square_sums", "rank_square_sum"]


def fold_left(values: Iterable[float]) -> float:
    """``((0.0 + v0) + v1) + ...`` in Python floats (fp64), in the order given."""
    total = 0.0
    for v in values:
        total += v
    return total


def piece_square_sums(layout: FlatLayout, rank: int, partition: torch.Tensor) -> list[float]:
    """R14, one rank: the fp64 sum of squares of each piece of ``rank``'s partition (accumulation dtype, any
    device), in flat order; one device-to-host transfer for all of them."""
    sums = []
    for piece in layout.pieces(rank):
        seg = partition[piece.local_start : piece.local_start + piece.length].to(torch.float64)
        sums.append(torch.sum(torch.mul(seg, seg)))
    return torch.stack(sums).cpu().tolist() if sums else []


def rank_square_sum(layout: FlatLayout, rank: int, partition: torch.Tensor) -> float:
    """R14, one rank: its pieces' sums of squares added in flat order."""
    return fold_left(piece_square_sums(layout, rank, partition))


def norm_from_total(total: float) -> float:
    """R14: the global norm from the ranks' sums already added in rank order (:func:`fold_left`)."""
    return math.sqrt(total)


def clip_coefficient(norm: float, gradient_clipping: float) -> float | None:
    """R15: the factor the gradient is multiplied by, or None when clipping is off or not triggered."""
    if gradient_clipping > 0:
        coef = gradient_clipping / (norm + CLIP_EPSILON)
        if coef < 1.0:
            return coef
    return None
