"""The parts of :class:`~optimized.accumulation.engine.ZeroEngine`'s public surface that only pass through.

A DeepSpeed-style engine stands in for the module in a training script (``engine(x)``, ``engine.train()``,
``engine.parameters()``), owns the learning rate (``get_lr`` / ``set_lr`` / ``lr_scheduler``) and reports what
its update did (``offload_timings()``, ``split_report()`` ...). None of that is the engine's own job -- the schedule
of backward() and step(), checkpoints and the update's lifetime are -- but every name must stay on the engine, since
scripts, the benchmarks and the conformance harness call them there. So each group is a small base class here, one
concept each, and the engine class keeps only what it decides.

Each base reads a few of the engine's attributes, named in its docstring and declared on the base as class-level
annotations (no value: the engine assigns them), so the type checker holds the engine to them and a base that reads
anything else is an error; nothing else depends on the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from optimized.accumulation.lr import LrSchedule
from optimized.accumulation.parts import EngineParts

__all__ = ["EngineReports", "LrSurface", "ModuleSurface"]


class ModuleSurface:
    """``nn.Module``'s everyday surface, passed to ``self.module``.

    Reads ``self.module`` and the engine's ``_check_alive()`` / ``synchronize()``: a destroyed engine refuses to
    run a forward, and parameters are handed out only once an update still streaming in has landed (a reader would
    otherwise see a half-updated weight).
    """

    module: nn.Module
    _check_alive: Callable[[], object]
    synchronize: Callable[[], None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Any:
        """``module.train(mode)``; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        """``module.eval()``; returns the engine."""
        self.module.eval()
        return self

    @property
    def training(self) -> bool:
        return self.module.training

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (at stage 3 between forwards they hold no data: shape ``[0]``); waits for
        an update still streaming in (``synchronize()``)."""
        self.synchronize()
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self.synchronize()
        return self.module.named_parameters(*args, **kwargs)


class LrSurface:
    """The learning rate as DeepSpeed's engine exposes it, passed to ``self._lr``
    (:class:`~optimized.accumulation.lr.LrSchedule`, which owns the attached scheduler and its checks)."""

    _lr: LrSchedule

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group of ``optimizer`` (one group)."""
        return self._lr.get_lr()

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group; used from the next boundary on."""
        self._lr.set_lr(lr)

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler ``step()`` advances at each boundary (None: none): the config's ``scheduler`` section
        (DeepSpeed's schedules, built at construction), or one assigned here, built on ``engine.optimizer``;
        a scheduler state ``load_checkpoint()`` loaded before one was attached is applied to it on assignment."""
        return self._lr.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self._lr.attach(scheduler)


class EngineReports:
    """What the engine reports besides training, for benchmarks and inspection: read from ``self._parts``
    (the update path's :class:`~optimized.accumulation.update_paths.base.PathReports` and stage 3's counters).
    None of these changes the engine; those that read the update's timings wait for it first."""

    _parts: EngineParts

    @property
    def prefetch_hits(self) -> int:
        """Stage-3 gathers that found their parameters already prefetched (for tests and tuning)."""
        return 0 if self._parts.stage3 is None else self._parts.stage3.prefetch_hits

    def pinned_buffers(self) -> tuple[torch.Tensor, ...]:
        """The pinned host buffers this engine holds now (offload state; ``nvme`` state while in memory)."""
        return self._parts.pinned_buffers()

    @property
    def swap_directory(self) -> str | None:
        """The directory this rank swaps optimizer state into (``nvme`` offload), else None."""
        return self._parts.reports.swap_directory

    def swap_stats(self):
        """The swap handle's :class:`~reference.io.SwapStats` (``nvme`` offload), else None."""
        return self._parts.reports.swap_stats()

    def offload_timings(self) -> dict[str, float] | None:
        """Where the streamed offloaded update spent its time since the last call (seconds: ``cpu_adam_s``, ``wait_s``
        -- the training thread blocked on it --, ``d2h_s``, ``h2d_s`` ...; without offload on a GPU ``device_adam_s``),
        or None (nothing streamed: a cpu run without offload, stage 0/1, SGD). Synchronizes; for benchmarks."""
        return self._parts.reports.offload_timings()

    def split_report(self) -> dict | None:
        """R28 (``gpu_share``): this rank's cut -- share, elements, device bytes and, for ``"auto"``, the budget and
        the measurement it chose from (``accumulation_split.SplitDecision`` as a mapping) -- or None (share 0, or
        "auto" before the second boundary)."""
        return self._parts.reports.split_report()

    def overlap_report(self) -> dict[str, int] | None:
        """R30 (``host_update_start: last_backward``): boundaries/buckets speculated, redone, discarded; or None."""
        return self._parts.reports.overlap_report()
