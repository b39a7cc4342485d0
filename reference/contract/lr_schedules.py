"""DeepSpeed's learning-rate schedules: the value at each boundary, and a ``torch.optim.lr_scheduler`` that applies it.

The schedule is a function of DeepSpeed's ``last_batch_iteration`` ``i``: -1 when the scheduler is built (the
first boundary trains with that value), +1 after each boundary update (DeepSpeed's engine steps its scheduler
right after the optimizer, at boundaries only). So the ``b``-th boundary (0-based) trains with the value at
``i = b - 1``. The formulas are written from DeepSpeed's documented definitions (0.19.8), including its edges:
``warmup_num_steps`` is taken as at least 2; a ``log`` warm-up rises as ``log(i + 1) / log(warmup_num_steps)``;
WarmupCosineLR trains its first boundary at lr 0; OneCycle sets beta1 to ``cycle_min_mom`` at construction, and
whenever it cycles momentum it sets beta2 to 0.99 (DeepSpeed pairs the cycled beta1 with a fixed 0.99); a decay
rate or step size of exactly 0 switches the post-cycle decay off. Float operations are grouped as DeepSpeed groups
them (a reciprocal of the log, multiplied), so the values are DeepSpeed's to the bit.

Both implementations use these functions: the oracle evaluates them per boundary, the engine through
:class:`DeepSpeedSchedule` on ``engine.optimizer``. A scheduler state (for checkpoints) is the iteration only, as
DeepSpeed's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.lr_schedule_config import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)

__all__ = ["ONE_CYCLE_BETA2", "DeepSpeedSchedule", "scheduled_beta1", "scheduled_lr", "scheduled_optimizer"]

#: The beta2 DeepSpeed's OneCycle writes next to the cycled beta1 (whatever the optimizer's beta2 was).
ONE_CYCLE_BETA2 = 0.99


def _warmup_fraction(i: int, steps: int, kind: str) -> float:
    """How far through the warm-up iteration ``i`` (0 <= i < steps) is."""
    if kind == "log":
        return (1.0 / math.log(steps)) * math.log(i + 1)
    return i / steps


def _warmup_lr(p: WarmupLRParams | WarmupDecayLRParams, base_lr: float, i: int) -> float:
    low = p.warmup_min_lr
    high = base_lr if p.warmup_max_lr is None else p.warmup_max_lr
    if i < 0:
        return low
    steps = max(2, p.warmup_num_steps)
    if i < steps:
        gamma = _warmup_fraction(i, steps, p.warmup_type)
    elif isinstance(p, WarmupDecayLRParams):
        gamma = max(0.0, float(p.total_num_steps - i) / float(max(1.0, p.total_num_steps - steps)))
    else:
        gamma = 1.0
    return low + (high - low) * gamma


def _warmup_cosine_lr(p: WarmupCosineLRParams, base_lr: float, i: int) -> float:
    if i < 0:
        return 0.0
    steps = max(2, p.warmup_num_steps)
    if i < steps:
        ratio = p.warmup_min_ratio + _warmup_fraction(i, steps, p.warmup_type) * (1.0 - p.warmup_min_ratio)
    else:
        progress = min(1.0, (i - steps + 1) / max(1, p.total_num_steps - steps))
        ratio = max(0.0, p.cos_min_ratio + (1.0 - p.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))
    return base_lr * ratio


def _cycle_shape(p: OneCycleParams) -> tuple[float, float, float, int, int]:
    """(first half, second half, whole cycle) in steps, as floats, and the two halves' stair counts."""
    first = float(p.cycle_first_step_size)
    second = first if p.cycle_second_step_size is None else float(p.cycle_second_step_size)
    stairs2 = p.cycle_first_stair_count if p.cycle_second_stair_count is None else p.cycle_second_stair_count
    return first, second, first + second, p.cycle_first_stair_count, stairs2


def _cycle_position(p: OneCycleParams, i: int) -> float:
    """0 at the cycle's low end, 1 at its peak: up over the first half, down over the second (in stairs when the
    half has a stair count)."""
    first, second, total, stairs1, stairs2 = _cycle_shape(p)
    done = i + 1
    rise = first / total
    x = 1.0 + done / total - math.floor(1 + done / total)
    if x <= rise:
        position, stairs = x / rise, stairs1
    else:
        position, stairs = (x - 1) / (rise - 1), stairs2
    if stairs > 0:
        into = done % total
        steps = into * stairs / first if into <= first else (total - into) * stairs / second
        position = math.floor(steps) / stairs
    return position


def _one_cycle_lr(p: OneCycleParams, i: int) -> float:
    total = _cycle_shape(p)[2]
    if i < total:
        return p.cycle_min_lr + (p.cycle_max_lr - p.cycle_min_lr) * _cycle_position(p, i)
    if p.decay_step_size == 0 or p.decay_lr_rate == 0:
        return p.cycle_min_lr
    return p.cycle_min_lr / (1 + p.decay_lr_rate * ((i - total + 1) / p.decay_step_size))


def _range_test_lr(p: LRRangeTestParams, i: int) -> float:
    interval = (i + 1) / p.lr_range_test_step_size
    if p.lr_range_test_staircase:
        interval = math.floor(interval)
    return p.lr_range_test_min_lr * (1 + p.lr_range_test_step_rate * interval)


def scheduled_lr(schedule: SchedulerConfig, base_lr: float, i: int) -> float:
    """The learning rate at DeepSpeed iteration ``i`` (-1: as built) of ``schedule`` over an optimizer whose lr
    was ``base_lr`` when the scheduler was built."""
    p = schedule.params
    if isinstance(p, (WarmupLRParams, WarmupDecayLRParams)):
        return _warmup_lr(p, base_lr, i)
    if isinstance(p, WarmupCosineLRParams):
        return _warmup_cosine_lr(p, base_lr, i)
    if isinstance(p, OneCycleParams):
        return _one_cycle_lr(p, i)
    return _range_test_lr(p, i)


def scheduled_beta1(schedule: SchedulerConfig, i: int) -> float | None:
    """OneCycle's beta1 at iteration ``i`` (then beta2 is :data:`ONE_CYCLE_BETA2`); None where the schedule leaves
    the betas alone (every other type, or ``cycle_momentum: false``)."""
    p = schedule.params
    if not isinstance(p, OneCycleParams) or not p.cycle_momentum:
        return None
    if i < 0:
        return p.cycle_min_mom
    total = _cycle_shape(p)[2]
    if i < total:
        return p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * _cycle_position(p, i)
    if p.decay_step_size == 0 or p.decay_mom_rate == 0:
        return p.cycle_max_mom
    return p.cycle_max_mom * (1 + p.decay_mom_rate * ((i - total + 1) / p.decay_step_size))


def scheduled_optimizer(optimizer: Any, schedule: SchedulerConfig | None, boundaries_done: int) -> Any:
    """The optimizer config (:class:`~reference.contract.accumulation_config.OptimizerConfig`) the boundary after
    ``boundaries_done`` earlier ones trains with: ``optimizer`` with the schedule's lr (and OneCycle's betas, for
    the Adam types: DeepSpeed cycles ``betas`` only, so SGD's momentum stays)."""
    if schedule is None:
        return optimizer
    i = boundaries_done - 1
    changes: dict[str, Any] = {"lr": scheduled_lr(schedule, optimizer.lr, i)}
    beta1 = scheduled_beta1(schedule, i)
    if beta1 is not None and optimizer.type != "sgd":
        changes["betas"] = (beta1, ONE_CYCLE_BETA2)
    return replace(optimizer, **changes)


class DeepSpeedSchedule(LRScheduler):
    """``schedule`` as a ``torch.optim.lr_scheduler`` on ``optimizer`` (every group from its own lr at build time).

    Built, it sets the groups to the values at iteration -1; each :meth:`step` advances one iteration. With
    ``cycle_betas`` (default: the optimizer has ``betas``) OneCycle also sets each group's ``betas``. The state
    (:meth:`state_dict`) is the iteration, as DeepSpeed's; loading one sets the iteration and leaves the groups
    as they are (the optimizer's own state holds their values).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: SchedulerConfig | Mapping[str, Any], *,
                 cycle_betas: bool | None = None) -> None:
        self.schedule = SchedulerConfig.from_dict(schedule)
        self.cycle_betas = "betas" in optimizer.defaults if cycle_betas is None else bool(cycle_betas)
        super().__init__(optimizer, last_epoch=-1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the iteration: -1 as built, +1 per step."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float | torch.Tensor]:  # torch's signature
        # torch types base_lrs float | Tensor; the lr is passed on as the optimizer holds it (a float here)
        return [scheduled_lr(self.schedule, base, self.last_batch_iteration)  # type: ignore[arg-type]
                for base in self.base_lrs]

    def step(self, epoch: int | None = None) -> None:
        """Advance one iteration and set the groups' lr (and OneCycle's betas)."""
        if epoch is not None:
            raise UnsupportedOperationError(
                f"step(epoch={epoch!r}) is not supported; allowed: step() (one boundary, as DeepSpeed steps it)"
            )
        self._step_count += 1
        self.last_epoch += 1
        self._last_lr = self.get_lr()
        beta1 = scheduled_beta1(self.schedule, self.last_batch_iteration) if self.cycle_betas else None
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr
            if beta1 is not None:
                group["betas"] = (beta1, ONE_CYCLE_BETA2)

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.schedule.type, "last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """DeepSpeed's state (``last_batch_iteration``), or a torch scheduler's (``last_epoch``, one ahead): a run
        that attached its own scheduler resumes this one at the same boundary."""
        i = None
        if isinstance(state_dict, Mapping):
            i = state_dict.get("last_batch_iteration")
            if i is None and type(state_dict.get("last_epoch")) is int:
                i = state_dict["last_epoch"] - 1
        if type(i) is not int or i < -1:
            raise ConfigurationError(
                f"lr_scheduler state {state_dict!r} is not a DeepSpeed schedule's state; allowed: a mapping with "
                f"last_batch_iteration (an int >= -1), as DeepSpeedSchedule.state_dict() returns, or a torch "
                f"scheduler's last_epoch"
            )
        self.last_epoch = i + 1
        self._last_lr = self.get_lr()
