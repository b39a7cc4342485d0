"""Flat layout of a parameter set: flatten with alignment padding, split into contiguous per-rank ranges (R8).

ZeRO keeps gradients, master weights and optimizer state as one flat buffer per dtype so that collectives move
one contiguous range per rank. The layout is part of the specification, not an implementation detail, because
the global gradient norm (R14) is summed per (rank, tensor piece): an implementation that cuts the buffer
elsewhere sums in a different grouping and differs in the last bits.

Rule (R8): parameters are laid out in ``named_parameters()`` order; each parameter starts at an offset that is
a multiple of :data:`FLAT_ALIGNMENT` elements; the total is padded up to a multiple of ``FLAT_ALIGNMENT *
world_size``; rank ``r`` owns ``[r * P, (r + 1) * P)`` with ``P = total / world_size``. Padding elements are
zero in every buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from reference.contract.errors import ConfigurationError

#: Alignment of every parameter's start offset and of each rank's partition, in elements. Four elements keep
#: fp32 partitions 16-byte aligned, which is what vectorised host optimizers (issue 6's CPU Adam) load.
FLAT_ALIGNMENT = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives inside the flat buffer."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside one rank's partition.

    ``flat_start`` indexes the flat buffer, ``param_start`` the flattened parameter, ``local_start`` the
    rank's partition (so ``partition[local_start:local_start + length]`` is this piece).
    """

    name: str
    flat_start: int
    param_start: int
    local_start: int
    length: int


@dataclass(frozen=True)
class FlatLayout:
    segments: tuple[Segment, ...]
    total: int
    world_size: int
    alignment: int = FLAT_ALIGNMENT

    @property
    def partition_size(self) -> int:
        return self.total // self.world_size

    def partition_range(self, rank: int) -> tuple[int, int]:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ConfigurationError(f"rank={rank!r} must be an int in [0, {self.world_size - 1}]")
        p = self.partition_size
        return rank * p, (rank + 1) * p

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces of ``rank``'s partition, in flat order (padding excluded)."""
        start, end = self.partition_range(rank)
        out: list[Piece] = []
        for seg in self.segments:
            lo, hi = max(start, seg.offset), min(end, seg.end)
            if lo < hi:
                out.append(Piece(seg.name, lo, lo - seg.offset, lo - start, hi - lo))
        return out

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.segments)


def build_layout(
    named_shapes: Iterable[tuple[str, Sequence[int]]], world_size: int, alignment: int = FLAT_ALIGNMENT
) -> FlatLayout:
    """The R8 layout of ``named_shapes`` (in the given order) for ``world_size`` ranks."""
    if type(world_size) is not int or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} must be an int >= 1")
    if type(alignment) is not int or alignment < 1:
        raise ConfigurationError(f"alignment={alignment!r} must be an int >= 1")
    segments: list[Segment] = []
    cursor = 0
    for name, shape in named_shapes:
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        cursor = _round_up(cursor, alignment)
        segments.append(Segment(name, cursor, numel, shape))
        cursor += numel
    total = _round_up(cursor, alignment * world_size)
    return FlatLayout(tuple(segments), total, world_size, alignment)


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


def unflatten(layout: FlatLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of each parameter inside ``flat`` (no copy), keyed by name."""
    if flat.numel() != layout.total:
        raise ConfigurationError(f"flat buffer has {flat.numel()} elements; the layout expects {layout.total}")
    return {seg.name: flat[seg.offset : seg.end].view(seg.shape) for seg in layout.segments}


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
