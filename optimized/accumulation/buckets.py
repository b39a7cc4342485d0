"""The gradient buckets of a stage-2/3 ZeroEngine: contiguous ranges of the flat gradient, each reduced by one
collective (R10), and the life of one bucket through a backward.

Its own module because two sides use it: the gradient hooks (:mod:`.gradients`) fill a bucket and launch its
reduce-scatter, the update path (:mod:`.update_paths`) says where its gradients go and takes its reduced slice.
Each side changes a bucket through its methods only -- :meth:`Bucket.reset` at a backward's start,
:meth:`Bucket.gradient_arrived` per parameter, :meth:`Bucket.launched` once the reduce-scatter runs,
:meth:`Bucket.take_reduced` to consume it -- so the order of those steps is written here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.accumulation.collectives import PendingReduce
from optimized.accumulation.partition import FlatLayout, owners

__all__ = ["Bucket", "plan_buckets"]


@dataclass
class Bucket:
    """A contiguous range ``[start, end)`` of the flat gradient buffer reduced by one collective (stages 2/3)."""

    start: int
    end: int
    #: the parameters (flat segments) whose gradients it holds
    names: tuple[str, ...]
    #: each rank's share of the reduce-scatter, in rank order
    splits: list[int]
    #: its position in flat order
    index: int
    #: gradients this backward still waits for before the reduce-scatter can start
    pending: int = 0
    #: the reduce-scatter in flight (None: not launched this backward, or already taken)
    reduce: PendingReduce | None = None
    #: what the reduce-scatter reads, alive until it is taken
    keep_alive: torch.Tensor | None = None
    #: streamed offload: this backward's gradients of the bucket (comm dtype, zeros where none arrived), allocated
    #: at its first gradient and dropped once reduced, instead of a view of a model-sized flat buffer
    grads: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def reset(self) -> None:
        """A backward starts: wait for every gradient again; nothing launched, nothing allocated."""
        self.pending = len(self.names)
        self.reduce = None
        self.keep_alive = None
        self.grads = None

    def gradient_arrived(self) -> bool:
        """One of its parameters' gradients was copied in; True when it was the last one (launch now)."""
        self.pending -= 1
        return self.pending == 0

    def own_gradients(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The bucket's own gradient buffer, zeroed at its first use in a backward (streamed offload)."""
        if self.grads is None:
            self.grads = torch.zeros(self.size, dtype=dtype, device=device)
        return self.grads

    def launched(self, contribution: torch.Tensor, reduce: PendingReduce) -> None:
        """Its reduce-scatter of ``contribution`` runs: keep what it reads alive, drop the gradient buffer."""
        self.keep_alive = contribution
        self.grads = None
        self.reduce = reduce

    def take_reduced(self) -> torch.Tensor:
        """Wait for the reduce-scatter and return this rank's reduced slice; the bucket holds nothing after."""
        if self.reduce is None:
            raise RuntimeError(f"bucket {self.index}: no reduce-scatter in flight to take")
        reduced = self.reduce.result()
        self.reduce = None
        self.keep_alive = None
        return reduced


def plan_buckets(layout: FlatLayout, bucket_elements: int) -> list[Bucket]:
    """Group parameters in reverse flat order (roughly the order backward produces gradients) into buckets of
    about ``bucket_elements``; the buckets tile the flat buffer so padding travels too."""
    offset = {s.name: s.offset for s in layout.segments}
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for seg in reversed(layout.segments):
        current.append(seg.name)
        size += seg.numel
        if size >= bucket_elements:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    groups.sort(key=lambda g: min(offset[n] for n in g))
    starts = [0] + [min(offset[n] for n in g) for g in groups[1:]]
    ends = [*starts[1:], layout.total]
    buckets: list[Bucket] = []
    for g, a, b in zip(groups, starts, ends, strict=True):
        splits = [o.length for o in owners(layout, a, b)]
        buckets.append(Bucket(a, b, tuple(g), splits, index=len(buckets)))
    return buckets
