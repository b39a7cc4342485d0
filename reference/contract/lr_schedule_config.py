"""The ``scheduler`` section: DeepSpeed's five learning-rate schedules, their parameters and defaults, validated.

A DeepSpeed config names a schedule (``{"type": "WarmupLR", "params": {...}}``) and DeepSpeed builds it on the
optimizer at construction and steps it after every boundary update. The parameter names and defaults here are
DeepSpeed's (0.19.8, ``deepspeed/runtime/lr_schedules.py``: the defaults of each class's constructor, which is what
its config path passes the params to), so a config ports unchanged; the formulas are in
:mod:`reference.contract.lr_schedules`.

Where DeepSpeed warns and carries on, this refuses (a config that does not do what it says is worse than an error):
an unknown ``warmup_type`` (DeepSpeed falls back to ``log``), a per-group list of values (one parameter group
here), a step count that is not a positive int. Required parameters (``total_num_steps``, ``cycle_min_lr``,
``cycle_max_lr``) are required here too.

Contract: both implementations parse a ``scheduler`` section into the same :class:`SchedulerConfig` (it is a field
of :class:`~reference.contract.accumulation_config.AccumulationConfig`) and refuse the same sections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from reference.contract.errors import ConfigurationError, allowed_values_error

__all__ = [
    "SCHEDULER_TYPES",
    "WARMUP_TYPES",
    "LRRangeTestParams",
    "OneCycleParams",
    "SchedulerConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
]

#: How the warm-up rises from its start to its end value (DeepSpeed's names).
WARMUP_TYPES: tuple[str, ...] = ("log", "linear")


def _number(name: str, value: object, low: float = 0.0, high: float = math.inf, *, high_open: bool = True) -> float:
    if (
        isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value)
        and value >= low and (value < high if high_open else value <= high)
    ):
        return float(value)
    upper = f"{high})" if high_open else f"{high}]"
    hint = " (one parameter group here: a single number, not a list)" if isinstance(value, (list, tuple)) else ""
    raise ConfigurationError(f"{name}={value!r} must be a finite number in [{low}, {upper}{hint}")


def _count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise ConfigurationError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def _flag(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise ConfigurationError(f"{name}={value!r} must be a bool; allowed values: True, False")
    return value


def _warmup_type(name: str, value: object) -> str:
    if value not in WARMUP_TYPES:
        raise allowed_values_error(name, value, WARMUP_TYPES)
    return str(value)


_P = "scheduler.params."


@dataclass(frozen=True)
class WarmupLRParams:
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` (None: the optimizer's lr) over ``warmup_num_steps``, then
    constant."""

    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        object.__setattr__(self, "warmup_min_lr", _number(_P + "warmup_min_lr", self.warmup_min_lr))
        if self.warmup_max_lr is not None:
            object.__setattr__(self, "warmup_max_lr", _number(_P + "warmup_max_lr", self.warmup_max_lr))
        _count(_P + "warmup_num_steps", self.warmup_num_steps, 1)
        _warmup_type(_P + "warmup_type", self.warmup_type)


@dataclass(frozen=True)
class WarmupDecayLRParams:
    """As WarmupLR (but ``warmup_max_lr`` defaults to 0.001, as DeepSpeed's class), then linearly down to
    ``warmup_min_lr`` at ``total_num_steps``."""

    total_num_steps: int
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _count(_P + "total_num_steps", self.total_num_steps, 1)
        object.__setattr__(self, "warmup_min_lr", _number(_P + "warmup_min_lr", self.warmup_min_lr))
        object.__setattr__(self, "warmup_max_lr", _number(_P + "warmup_max_lr", self.warmup_max_lr))
        _count(_P + "warmup_num_steps", self.warmup_num_steps, 1)
        _warmup_type(_P + "warmup_type", self.warmup_type)


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """The optimizer's lr times a ratio: from ``warmup_min_ratio`` up to 1 over ``warmup_num_steps``, then a half
    cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    total_num_steps: int
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _count(_P + "total_num_steps", self.total_num_steps, 1)
        object.__setattr__(self, "warmup_min_ratio", _number(_P + "warmup_min_ratio", self.warmup_min_ratio))
        _count(_P + "warmup_num_steps", self.warmup_num_steps, 1)
        object.__setattr__(self, "cos_min_ratio", _number(_P + "cos_min_ratio", self.cos_min_ratio))
        _warmup_type(_P + "warmup_type", self.warmup_type)


@dataclass(frozen=True)
class OneCycleParams:
    """One cycle of lr from ``cycle_min_lr`` up to ``cycle_max_lr`` and back (momentum the other way), then an
    optional decay every ``decay_step_size`` steps."""

    cycle_min_lr: float
    cycle_max_lr: float
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "decay_mom_rate"):
            object.__setattr__(self, name, _number(_P + name, getattr(self, name)))
        for name in ("cycle_min_mom", "cycle_max_mom"):
            object.__setattr__(self, name, _number(_P + name, getattr(self, name), 0.0, 1.0))
        _count(_P + "cycle_first_step_size", self.cycle_first_step_size, 1)
        _count(_P + "cycle_first_stair_count", self.cycle_first_stair_count, 0)
        _count(_P + "decay_step_size", self.decay_step_size, 0)
        for name in ("cycle_second_step_size", "cycle_second_stair_count"):
            if getattr(self, name) is not None:
                _count(_P + name, getattr(self, name), 0)
        _flag(_P + "cycle_momentum", self.cycle_momentum)


@dataclass(frozen=True)
class LRRangeTestParams:
    """``lr_range_test_min_lr`` growing by ``lr_range_test_step_rate`` per ``lr_range_test_step_size`` steps
    (continuously, or in stairs)."""

    lr_range_test_min_lr: float = 0.001
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr_range_test_min_lr", _number(_P + "lr_range_test_min_lr",
                                                                 self.lr_range_test_min_lr))
        _count(_P + "lr_range_test_step_size", self.lr_range_test_step_size, 1)
        object.__setattr__(self, "lr_range_test_step_rate", _number(_P + "lr_range_test_step_rate",
                                                                    self.lr_range_test_step_rate))
        _flag(_P + "lr_range_test_staircase", self.lr_range_test_staircase)


#: DeepSpeed's schedule names (its ``VALID_LR_SCHEDULES``), each with its parameters.
SCHEDULER_TYPES: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}

Params = WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | OneCycleParams | LRRangeTestParams


def param_names(kind: str) -> tuple[str, ...]:
    """The parameter names of schedule ``kind`` (DeepSpeed's)."""
    return tuple(f.name for f in fields(SCHEDULER_TYPES[kind]))


def required_params(kind: str) -> tuple[str, ...]:
    """The parameters of ``kind`` without a default (DeepSpeed's constructor requires them too)."""
    return tuple(f.name for f in fields(SCHEDULER_TYPES[kind]) if f.default is MISSING)


@dataclass(frozen=True)
class SchedulerConfig:
    """A validated ``scheduler`` section: DeepSpeed's ``type`` and its ``params`` (all of them, defaults filled)."""

    type: str
    params: Params

    def __post_init__(self) -> None:
        if self.type not in SCHEDULER_TYPES:
            raise allowed_values_error("scheduler.type", self.type, tuple(SCHEDULER_TYPES))
        kind = SCHEDULER_TYPES[self.type]
        if isinstance(self.params, Mapping):
            object.__setattr__(self, "params", _params_from_mapping(self.type, self.params))
        if not isinstance(self.params, kind):
            raise ConfigurationError(
                f"scheduler.params={self.params!r} must be a mapping of {self.type}'s parameters: "
                f"{', '.join(param_names(self.type))}"
            )

    @classmethod
    def from_dict(cls, section: Any) -> SchedulerConfig:
        """``{"type": ..., "params": {...}}`` (DeepSpeed's shape; ``params`` may be left out: all defaults)."""
        if isinstance(section, SchedulerConfig):
            return section
        if not isinstance(section, Mapping):
            raise ConfigurationError(f"scheduler={section!r} must be a mapping with keys: type, params")
        unknown = sorted(set(section) - {"type", "params"}, key=str)
        if unknown:
            raise ConfigurationError(
                f"unknown scheduler key(s) {', '.join(map(repr, unknown))}; allowed keys of scheduler: type, params"
            )
        if "type" not in section:
            raise allowed_values_error("scheduler.type", None, tuple(SCHEDULER_TYPES))
        return cls(section["type"], section.get("params", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "params": asdict(self.params)}


def _params_from_mapping(kind: str, params: Mapping[str, Any]) -> Params:
    allowed = param_names(kind)
    unknown = sorted(set(params) - set(allowed), key=str)
    if unknown:
        raise ConfigurationError(
            f"unknown scheduler.params key(s) {', '.join(map(repr, unknown))} for type {kind!r}; allowed keys: "
            f"{', '.join(allowed)}"
        )
    missing = [n for n in required_params(kind) if n not in params]
    if missing:
        raise ConfigurationError(
            f"scheduler.params.{missing[0]} is required by type {kind!r} (no default in DeepSpeed either); "
            f"required: {', '.join(required_params(kind))}"
        )
    return SCHEDULER_TYPES[kind](**dict(params))
