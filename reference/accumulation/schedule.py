"""The reference engine's public counter and boundary calls, answered from the contract's schedule.

The rules (R2-R6, R18, R20) and their messages are :class:`~reference.contract.accumulation_schedule.
AccumulationSchedule` (re-exported here); :class:`ScheduledEngine` is the reference's surface over it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from reference.contract.accumulation_schedule import AccumulationSchedule

__all__ = ["AccumulationSchedule", "ScheduledEngine"]


class ScheduledEngine:
    """The public calls the reference engine answers straight from its :class:`AccumulationSchedule` (counters,
    boundary query and override, ``no_sync``). The subclass sets ``self._schedule`` and provides
    ``_check_alive()`` (raises once destroyed)."""

    _schedule: AccumulationSchedule

    def _check_alive(self) -> None:  # pragma: no cover - every engine overrides it
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
