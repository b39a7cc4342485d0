"""Rank-ordered collectives on torch.distributed (R9, R10, R14, R24).

A transport's all-reduce / reduce-scatter adds the ranks' contributions in an order it chooses (ring position,
tree shape, NCCL channel), so from three ranks on the last bits depend on it (R24). This engine instead moves
the contributions with ``all_to_all`` -- each rank sends every other rank the slice that rank owns, which is
exactly the traffic of a ring reduce-scatter, ``(W-1)/W`` of the buffer per rank -- and the owner adds the W
slices itself, in rank order. The result is the reference's ``sum over r in rank order of (x_r / W)`` at every
world size, on gloo and NCCL alike, which is why the implementation can declare
``accumulation_rank_ordered_reduction`` (R25). An all-reduce is that reduce-scatter plus an all-gather (the
same bytes as a ring all-reduce).

Every call goes through :class:`Collectives`, which turns a transport failure (a timeout because another rank
died or stopped calling, a closed connection) into :class:`CollectiveError` naming the collective, this rank,
and the likely cause, instead of a bare gloo/NCCL message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reference.contract.accumulation_norm import fold_left
from reference.contract.errors import HostOffloadError

# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); 2.4-2.12 only have the old one.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["CollectiveError", "Collectives", "PendingReduce", "fold_in_rank_order"]


class CollectiveError(HostOffloadError, RuntimeError):
    """A collective failed or timed out, usually because another rank raised or stopped calling the engine."""


def fold_in_rank_order(chunks: torch.Tensor, world: int) -> torch.Tensor:
    """``chunks`` is ``[world, n]`` holding each rank's (already divided) contribution, in rank order; returns
    ``chunks[0] + chunks[1] + ...`` added left to right in their dtype (R9/R10's rank-ordered sum)."""
    total = chunks[0].clone() if world == 1 else torch.add(chunks[0], chunks[1])
    for q in range(2, world):
        total = torch.add(total, chunks[q])
    return total


class PendingReduce:
    """An in-flight rank-ordered reduce-scatter of one bucket; :meth:`result` waits and folds."""

    def __init__(self, owner: Collectives, work: Any, recv: torch.Tensor, length: int, what: str) -> None:
        self._owner = owner
        self._work = work
        self._recv = recv
        self._length = length
        self._what = what

    def result(self) -> torch.Tensor:
        """This rank's slice of the bucket, reduced (comm dtype)."""
        if self._work is not None:
            self._owner._wait(self._work, self._what)
            self._work = None
        return fold_in_rank_order(self._recv.view(self._owner.world, self._length), self._owner.world)


class Collectives:
    """The collectives of one engine over one process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world)]

    # ---- error translation -------------------------------------------------------------------------------
    def _fail(self, what: str, exc: BaseException) -> CollectiveError:
        return CollectiveError(
            f"collective {what} failed on rank {self.rank} of {self.world}: {exc}. Another rank most likely raised "
            f"or stopped calling the engine (every rank must make the same backward()/step() calls); see the "
            f"first failing rank's error"
        )

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CollectiveError:
            raise
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL report timeouts and peer loss as RuntimeError
            raise self._fail(what, exc) from exc

    def _wait(self, work: Any, what: str) -> None:
        self._call(what, work.wait)

    # ---- reductions --------------------------------------------------------------------------------------
    def start_reduce_scatter(
        self, contribution: torch.Tensor, splits: Sequence[int], what: str = "reduce-scatter"
    ) -> PendingReduce:
        """Start the rank-ordered reduce-scatter of ``contribution`` (this rank's already divided terms, a
        contiguous 1-D buffer whose consecutive ``splits[q]`` elements belong to rank q). Every rank must
        pass the same ``splits``; the result on rank r has ``splits[r]`` elements."""
        mine = int(splits[self.rank])
        if self.world == 1:
            return PendingReduce(self, None, contribution, mine, what)
        recv = torch.empty(self.world * mine, dtype=contribution.dtype, device=contribution.device)
        work = self._call(
            what,
            lambda: dist.all_to_all_single(
                recv, contribution, [mine] * self.world, [int(s) for s in splits], group=self.group, async_op=True
            ),
        )
        return PendingReduce(self, work, recv, mine, what)

    def all_gather_into(self, output: torch.Tensor, part: torch.Tensor, what: str = "all-gather") -> None:
        """``output`` (``world * part.numel()`` elements) receives every rank's ``part`` in rank order."""
        if self.world == 1:
            output.copy_(part)
            return
        self._call(what, lambda: _ALL_GATHER(output, part, group=self.group))

    def start_broadcasts(self, pieces: Sequence[tuple[int, torch.Tensor]], what: str = "gather") -> list[Any]:
        """Post, for each ``(owner, tensor)``, the broadcast of the owner's tensor into everyone's; returns the
        works for :meth:`wait_all` (ZeRO-3 gathers and their prefetch)."""
        if self.world == 1:
            return []
        works = []
        for owner, t in pieces:
            if t.numel() == 0:
                continue
            src = self._global[owner]
            works.append(
                self._call(what, lambda t=t, src=src: dist.broadcast(t, src, group=self.group, async_op=True))
            )
        return works

    def wait_all(self, works: Sequence[Any], what: str) -> None:
        for w in works:
            self._wait(w, what)

    def broadcast_pieces(self, pieces: Sequence[tuple[int, torch.Tensor]], what: str = "gather") -> None:
        """:meth:`start_broadcasts` and wait."""
        self.wait_all(self.start_broadcasts(pieces, what), what)

    def sum_floats_in_rank_order(self, value: float, device: torch.device, what: str = "norm") -> float:
        """Every rank's fp64 ``value`` added in rank order as Python floats (R14's cross-rank sum)."""
        if self.world == 1:
            return fold_left((value,))
        mine = torch.tensor([value], dtype=torch.float64, device=device)
        out = torch.empty(self.world, dtype=torch.float64, device=device)
        self.all_gather_into(out, mine, what)
        return fold_left(out.cpu().tolist())

    def all_gather_objects(self, obj: Any, what: str = "object all-gather") -> list[Any]:
        """Every rank's picklable ``obj`` in rank order (checkpoint agreement: tags, per-rank errors)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self, what: str = "barrier") -> None:
        if self.world > 1:
            self._call(what, lambda: dist.barrier(group=self.group))
