"""Stage 3's parameter lifecycle (R12, R21): parameters hold no data between uses.

A module's parameters are gathered (broadcast from the ranks owning each piece of the R8 layout) before its
forward -- with the next module's gather prefetched --, released after it, gathered again when the gradient
reaches the module's output (prefetching the module before it) and by any checkpoint recompute (R21), and all
released when the engine's ``backward()`` returns. The order of modules is the first forward's; every rank posts
the same broadcasts in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optimized.accumulation.collectives import Collectives
from optimized.accumulation.origin import tensors_in
from optimized.accumulation.partition import FlatLayout, owners, unflatten
from optimized.accumulation.weights import LiveWeights

__all__ = ["Stage3Parameters"]


@dataclass
class _Unit:
    """The parameters a module owns directly (stage 3 gathers per module)."""

    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    gathered: bool = False
    prefetched: list[Any] = field(default_factory=list)


class Stage3Parameters:
    """The gather / release / prefetch hooks of one stage-3 engine.

    ``in_backward``: whether the engine's ``backward()`` runs (a forward then is a checkpoint recompute).
    ``wait_update(lo, hi)``: wait until an update in flight has written partition range ``[lo, hi)``.
    ``add_hook``: where hook handles go (the engine removes them on destroy)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        params: dict[str, nn.Parameter],
        layout: FlatLayout,
        frozen_layout: FlatLayout,
        weights: LiveWeights,
        comm: Collectives,
        device: torch.device,
        model_dtype: torch.dtype,
        prefetch: bool,
        in_backward: Callable[[], bool],
        wait_update: Callable[[int, int], None],
        add_hook: Callable[[Any], None],
    ) -> None:
        self._params, self._weights, self._comm = params, weights, comm
        self._layout, self._frozen_layout = layout, frozen_layout
        self._segments = {s.name: s for s in layout.segments}
        self._frozen_segments = {s.name: s for s in frozen_layout.segments}
        self._device, self._dtype, self._prefetch = device, model_dtype, prefetch
        self._in_backward, self._wait_update = in_backward, wait_update
        self._rank, self._world = comm.rank, comm.world
        #: gathers that found their parameters already prefetched (for tests and tuning)
        self.prefetch_hits = 0
        self._units: dict[int, _Unit] = {}
        self._order: list[int] = []
        self._order_done = False
        names_of = {id(p): n for n, p in params.items()}
        for mod in module.modules():
            direct = [names_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in names_of]
            if not direct:
                continue
            self._units[id(mod)] = _Unit(
                tuple(n for n in direct if n in self._segments), tuple(n for n in direct if n in self._frozen_segments)
            )
            add_hook(mod.register_forward_pre_hook(self._make_pre_forward(id(mod))))
            add_hook(mod.register_forward_hook(self._make_post_forward(id(mod))))
        self.release_all()

    def close(self) -> None:
        """Drop every reference (the engine's destroy: a ``regather`` hook left on an output tensor a caller
        still holds then keeps no partition alive)."""
        self.__dict__.clear()

    def gather_all(self, layout: FlatLayout, part: torch.Tensor) -> torch.Tensor:
        """The full flat buffer of ``layout`` from every rank's ``part`` (a collective)."""
        full = torch.empty(layout.total, dtype=self._dtype, device=self._device)
        self._comm.all_gather_into(full, part.to(self._device), "full parameter all-gather")
        return full

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full flat tensor, gathered (trainable and frozen), by name."""
        out = dict(unflatten(self._layout, self.gather_all(self._layout, self._weights.part)))
        out.update(unflatten(self._frozen_layout, self.gather_all(self._frozen_layout, self._weights.frozen_part)))
        return out

    def _start_gather(self, unit: _Unit) -> list[Any]:
        """Post the broadcasts that assemble ``unit``'s parameters; returns what :meth:`_install` needs."""
        plans = []
        pieces = []
        for names, layout, segs, part in (
            (unit.trainable, self._layout, self._segments, self._weights.part),
            (unit.frozen, self._frozen_layout, self._frozen_segments, self._weights.frozen_part),
        ):
            if not names:
                continue
            a, b = min(segs[n].offset for n in names), max(segs[n].end for n in names)
            P = layout.partition_size
            if part is self._weights.part:
                # An update in flight (streamed): wait for this rank's buckets of the unit only.
                base = self._rank * P
                self._wait_update(max(a, base) - base, min(b, base + P) - base)
            if self._world == 1 and part.device == self._device:
                # One rank owns everything and it is already on the device: view it, copy nothing.
                plans.append((names, segs, a, part[a:b]))
                continue
            buf = torch.empty(b - a, dtype=self._dtype, device=self._device)
            for o in owners(layout, a, b):
                if not o.length:
                    continue
                view = buf[o.start - a : o.end - a]
                if o.rank == self._rank:
                    view.copy_(part[o.start - self._rank * P : o.end - self._rank * P], non_blocking=True)
                pieces.append((o.rank, view))
            plans.append((names, segs, a, buf))
        return [plans, pieces]

    def _install(self, unit: _Unit, plan: list[Any], works: list[Any] | None = None) -> None:
        plans, pieces = plan
        if works is None:
            self._comm.broadcast_pieces(pieces, "stage-3 parameter gather")
        else:
            self._comm.wait_all(works, "stage-3 parameter prefetch")
        for names, segs, a, buf in plans:
            for n in names:
                s = segs[n]
                self._params[n].data = buf[s.offset - a : s.end - a].view(s.shape)
        unit.gathered = True

    def _gather(self, key: int) -> None:
        unit = self._units[key]
        if unit.gathered:
            return
        if unit.prefetched:
            plan, works = unit.prefetched
            unit.prefetched = []
            self._install(unit, plan, works)
            self.prefetch_hits += 1
            return
        self._install(unit, self._start_gather(unit))

    def _release(self, key: int) -> None:
        unit = self._units[key]
        if unit.prefetched:  # prefetched but never used: complete the broadcasts every rank posted
            works = unit.prefetched[1]
            unit.prefetched = []
            self._comm.wait_all(works, "stage-3 parameter prefetch")
        for n in (*unit.trainable, *unit.frozen):
            p = self._params[n]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        unit.gathered = False

    def release_all(self) -> None:
        """Release every module's parameters (the end of ``backward()``); the first call after a forward
        fixes the module order prefetching follows."""
        for key in self._units:
            self._release(key)
        if self._order:
            self._order_done = True

    def _make_pre_forward(self, key: int) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            # R21: every parameter of the module, frozen or not, is gathered before its forward runs,
            # including the forward that activation checkpointing replays during backward.
            self._gather(key)
            if not self._in_backward():
                if not self._order_done:
                    self._order.append(key)
                elif self._prefetch:
                    self._prefetch_next(key, 1)

        return pre_forward

    def _prefetch_next(self, key: int, direction: int) -> None:
        """Post the gather of the module that ran just after (``direction=1``, forward) or just before
        (``direction=-1``, backward) ``key`` in the first forward, so it is ready when it runs. Every rank posts
        the same broadcasts in the same order (the recorded order is the same everywhere)."""
        try:
            pos = self._order.index(key) + direction
        except ValueError:
            return
        if not 0 <= pos < len(self._order):
            return
        unit = self._units[self._order[pos]]
        if not unit.gathered and not unit.prefetched:
            plan = self._start_gather(unit)
            unit.prefetched = [plan, self._comm.start_broadcasts(plan[1], "stage-3 parameter prefetch")]

    def _make_post_forward(self, key: int) -> Callable[..., None]:
        def regather(grad: torch.Tensor) -> None:
            self._gather(key)
            if self._prefetch and self._order_done:
                # Backward visits modules roughly in reverse forward order: fetch the one before this now.
                self._prefetch_next(key, -1)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward():
                # A checkpoint recompute: its backward nodes still need the parameters until backward() ends.
                return
            self._release(key)
            # The module's backward reads the parameters it saved; gather them again as soon as the gradient
            # reaches its output, i.e. before any of its backward nodes run.
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(regather)

        return post_forward
