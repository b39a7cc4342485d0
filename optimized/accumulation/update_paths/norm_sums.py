"""R14's per-piece sums of squares, taken while the gradient streams out, and this rank's slice of each bucket.

The global norm (R14) is the square root of the rank-ordered sum of every piece's fp64 sum of squares, and R15
needs it before any element is updated. On the backward a managed schedule says is the boundary's, the gradient
stream sums each piece of a bucket on the device as soon as the bucket's final gradient is there
(:meth:`NormPieceSums.take`), so the norm is known the moment backward ends; otherwise the boundary sums the host
accumulator (:meth:`NormPieceSums.sum_host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference.contract.accumulation_partition import FlatLayout

__all__ = ["BucketRange", "NormPieceSums", "sum_squares"]


def sum_squares(values: torch.Tensor) -> torch.Tensor:
    """R14's fp64 sum of squares of one piece (a 0-d tensor on the values' device)."""
    seg = values.to(torch.float64)
    return torch.sum(torch.mul(seg, seg))


@dataclass
class BucketRange:
    """The part of one gradient bucket this rank owns, in partition coordinates, with the R14 pieces in it."""

    index: int
    lo: int
    hi: int
    #: (position of the piece in flat order, start in the partition, length)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.hi - self.lo


class NormPieceSums:
    """Per R14 piece of this rank's partition, its fp64 sum of squares: a device scalar on a device run, else a
    float. Assigns each piece to the bucket range holding its start (``ranges[i].pieces``)."""

    def __init__(self, layout: FlatLayout, rank: int, ranges: Sequence[BucketRange], on_device: bool) -> None:
        self.on_device = on_device
        pieces = layout.pieces(rank)
        for position, piece in enumerate(pieces):
            owner = next(b for b in ranges if b.lo <= piece.local_start < b.hi)
            owner.pieces.append((position, piece.local_start, piece.length))
        self._sums: list[torch.Tensor | float | None] = [None] * len(pieces)
        #: whether every piece sum is of the accumulator as it is now (invalidated by each backward)
        self.fresh = False

    def take(self, b: BucketRange, cut: int, kept: torch.Tensor | None, rest: torch.Tensor | None) -> None:
        """R14's sums of the pieces of bucket ``b``: ``[.., cut)`` read from ``kept`` (partition coordinates, the
        device side's gradient), ``[cut, ..)`` from ``rest`` (which starts at ``cut``). A piece across the cut
        is summed in two parts, added in fp64 (on a device run the sums agree with the host's within R25's
        tolerance anyway; on the cpu accelerator nothing is cut)."""
        for position, start, length in b.pieces:
            end = start + length
            total: torch.Tensor | None = None
            if start < cut:
                assert kept is not None  # a piece below the cut: the caller gave the device side's gradient
                total = sum_squares(kept[start : min(end, cut)])
            if end > cut:
                assert rest is not None  # a piece above the cut: the caller gave the rest
                part = sum_squares(rest[max(start, cut) - cut : end - cut])
                total = part if total is None else total + part
            if self.on_device:
                self._sums[position] = total
            else:
                assert total is not None  # every piece has elements: one side of the cut summed it
                self._sums[position] = total.item()

    def clear(self, b: BucketRange) -> None:
        """Forget bucket ``b``'s sums: :meth:`take_part` adds its parts to them next."""
        for position, _, _ in b.pieces:
            self._sums[position] = None

    def take_part(self, b: BucketRange, lo: int, values: torch.Tensor) -> None:
        """Add R14's sums over the part ``[lo, lo + len(values))`` of bucket ``b`` (partition coordinates) to the
        sums since :meth:`clear`, on a device run where the bucket streams out in parts (the split's device side,
        :class:`GradientStream`'s staging chunks): a piece inside the part is summed whole, as :meth:`take` sums
        it; one a part boundary cuts is summed part by part, the parts added in fp64 (on a device the sums agree
        with the host's within R25's tolerance, as at the split's cut)."""
        hi = lo + values.numel()
        for position, start, length in b.pieces:
            a, z = max(start, lo), min(start + length, hi)
            if a >= z:
                continue
            part = sum_squares(values[a - lo : z - lo])
            previous = self._sums[position]
            self._sums[position] = part if previous is None else previous + part

    def sum_host(self, grad: torch.Tensor, ranges: Sequence[BucketRange]) -> None:
        """Not predicted (unmanaged step, or the boundary override changed after backward): sum the host copy of
        the whole accumulated gradient; on a device run the value agrees with the device's within R25's
        tolerance."""
        for b in ranges:
            for position, start, length in b.pieces:
                self._sums[position] = sum_squares(grad[start : start + length]).item()

    def on_the_device(self) -> bool:
        """Whether some sums are device scalars (their stream must be waited for before reading them)."""
        return any(isinstance(s, torch.Tensor) for s in self._sums)

    def values(self) -> list[float]:
        """The sums in flat order, as floats (one device-to-host copy for all device scalars)."""
        device_sums = [s for s in self._sums if isinstance(s, torch.Tensor)]
        values = torch.stack(device_sums).cpu().tolist() if device_sums else []
        it = iter(values)
        return [next(it) if isinstance(s, torch.Tensor) else float(_taken(s)) for s in self._sums]


def _taken(total: float | None) -> float:
    """A host piece sum, which every backward or :meth:`NormPieceSums.sum_host` takes before it is read."""
    if total is None:
        raise RuntimeError("a norm piece sum was read before it was taken")
    return total
