"""When a step is a gradient-accumulation boundary, and how the counters move (R2-R6, R18, R20): the contract.

This is the part of an engine that has nothing to do with tensors: the micro-step counter, the boundary override,
the no_sync() region rules and the sample count. They are rules of the area with exact error messages, so every
engine (the reference's simulated ranks, the optimized torch.distributed one) keeps one
:class:`AccumulationSchedule` and answers its counter and boundary calls from it: the rules and messages are
written once and cannot drift between implementations. :class:`ScheduledEngine` is the public surface over it
that both engines inherit (counters, boundary query and override, ``no_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypedDict

from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError, UnsupportedOperationError


class ScheduleCounters(TypedDict):
    """What :meth:`AccumulationSchedule.counters` records in a checkpoint (R2's override included)."""

    micro_steps: int
    global_steps: int
    global_samples: int
    boundary_override: bool | None

class AccumulationSchedule:
    """Counters and boundary rules of one engine over ``world_size`` data-parallel ranks at ``stage``."""

    def __init__(self, config: AccumulationConfig, world_size: int, stage: int) -> None:
        self.config = config
        self.world_size = world_size
        self.stage = stage
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._backwards_since_boundary = 0
        self._boundary_override: bool | None = None
        self._in_step = False
        self._in_no_sync = False

    def is_boundary(self) -> bool:
        """R2 (managed: the counter, unless overridden) / R6 (unmanaged: exactly while step() runs)."""
        if not self.config.managed_gradient_accumulation:
            return self._in_step
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_boundary(self, is_boundary: bool) -> None:
        """R2: override the counter-driven boundary until called again. Rejected in unmanaged mode (R20)."""
        if not self.config.managed_gradient_accumulation:
            raise UnsupportedOperationError(
                "set_gradient_accumulation_boundary() cannot be used with "
                "managed_gradient_accumulation=False: "
                "every step() is the boundary there; allowed: managed_gradient_accumulation=True"
            )
        if type(is_boundary) is not bool:
            raise ConfigurationError(f"is_boundary={is_boundary!r} must be a bool; allowed values: True, False")
        self._boundary_override = is_boundary

    @property
    def in_no_sync(self) -> bool:
        """Whether a :meth:`no_sync` region is open (a checkpoint save refuses inside one, R18)."""
        return self._in_no_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """R18: a region of backwards that must not communicate. Stages 0/1 only, not nested, no step() inside."""
        if self.stage >= 2:
            raise UnsupportedOperationError(
                f"no_sync() is not supported with zero_stage={self.stage}: stages 2/3 reduce every backward; "
                f"allowed: zero_stage 0 or 1"
            )
        if self._in_no_sync:
            raise UnsupportedOperationError("no_sync() contexts cannot be nested; allowed: one no_sync() at a time")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def counters(self) -> ScheduleCounters:
        """The counters a checkpoint records: ``micro_steps``, ``global_steps``, ``global_samples`` and the
        boundary override (R2)."""
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "boundary_override": self._boundary_override,
        }

    def restore_counters(self, counters: ScheduleCounters) -> None:
        """Resume from :meth:`counters` (a checkpoint load): a new accumulation starts, no backward counted."""
        self.micro_steps, self.global_steps = counters["micro_steps"], counters["global_steps"]
        self.global_samples, self._boundary_override = counters["global_samples"], counters["boundary_override"]
        self._backwards_since_boundary = 0

    def backward_done(self) -> None:
        """One backward finished (counted for R6's sample count in unmanaged mode)."""
        self._backwards_since_boundary += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[bool]:
        """R2-R4 / R6: the body of ``step()`` runs inside; yields whether it is a boundary.

        The counters advance only if the body returns normally: a step that raised did not happen.
        """
        if self._in_no_sync:
            raise UnsupportedOperationError(
                "step() was called inside no_sync(); allowed: call step() after the no_sync() context has exited"
            )
        cfg = self.config
        self._in_step = True
        try:
            boundary = self.is_boundary()
            yield boundary
        finally:
            self._in_step = False
        if boundary:
            self.global_steps += 1
            per_boundary = (
                cfg.gradient_accumulation_steps if cfg.managed_gradient_accumulation else self._backwards_since_boundary
            )
            self.global_samples += cfg.train_micro_batch_size_per_gpu * self.world_size * per_boundary
            self._backwards_since_boundary = 0
        if cfg.managed_gradient_accumulation:
            self.micro_steps += 1


class ScheduledEngine:
    """The public calls every engine answers straight from its :class:`AccumulationSchedule` (counters,
    boundary query and override, ``no_sync``): one surface, so the names, kinds and rules cannot drift between
    implementations. The engine sets ``self._schedule`` and provides ``_check_alive()`` (raises once destroyed)."""

    _schedule: AccumulationSchedule

    def _check_alive(self) -> object:  # pragma: no cover - every engine overrides it (the result is the engine's)
        raise NotImplementedError

    @property
    def micro_steps(self) -> int:
        return self._schedule.micro_steps

    @property
    def global_steps(self) -> int:
        return self._schedule.global_steps

    @property
    def global_samples(self) -> int:
        return self._schedule.global_samples

    def is_gradient_accumulation_boundary(self) -> bool:
        """R2 (managed) / R6 (unmanaged)."""
        return self._schedule.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """R2: override the counter-driven boundary until called again. Rejected in unmanaged mode (R20)."""
        self._schedule.set_boundary(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """R18: a region of backwards that must not communicate. Stages 0/1 only, not nested, no step() inside."""
        self._check_alive()
        with self._schedule.no_sync():
            yield
