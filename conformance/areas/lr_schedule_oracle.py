"""The suite's own statement of DeepSpeed's learning-rate schedules: the lr (and OneCycle's betas) each boundary
trains with, from a ``scheduler`` section as a user writes it.

Written for the suite from DeepSpeed's documentation of ``deepspeed.runtime.lr_schedules`` (0.19.8): the parameter
names and their defaults (``DEFAULTS``; ``None`` = required), and each schedule's formula in terms of
``last_batch_iteration`` -- -1 when DeepSpeed builds the scheduler, +1 after every boundary update -- so boundary
``k`` (0-based) trains with the value at iteration ``k - 1``. It shares no code with any implementation: an
implementation's engine and oracle are checked against it. The float operations are grouped as DeepSpeed groups
them (e.g. a warm-up fraction is ``(1 / log(n)) * log(i + 1)``), so the values are DeepSpeed's exactly and the
suite compares them with ``==``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: DeepSpeed's constructor defaults per schedule (None: required, no default).
DEFAULTS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": "optimizer lr", "warmup_num_steps": 1000,
                 "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": "first", "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": "first", "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
}


def _filled(section: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = section["type"]
    p = dict(DEFAULTS[kind])
    for k, v in dict(section.get("params", {})).items():
        if v is not None or not isinstance(p.get(k), str):  # None keeps a "derived" default, as DeepSpeed's
            p[k] = v
    missing = [k for k, v in p.items() if v is None]
    assert not missing, f"the oracle needs {missing} for {kind}"
    return kind, p


def _rise(i: int, n: int, how: str) -> float:
    return i / n if how == "linear" else (1.0 / math.log(n)) * math.log(i + 1)


def _onecycle_scale(p: Mapping[str, Any], i: int) -> float:
    up = float(p["cycle_first_step_size"])
    down = up if p["cycle_second_step_size"] == "first" else float(p["cycle_second_step_size"])
    stairs_up = p["cycle_first_stair_count"]
    stairs_down = stairs_up if p["cycle_second_stair_count"] == "first" else p["cycle_second_stair_count"]
    size = up + down
    n = i + 1
    frac = 1.0 + n / size - math.floor(1 + n / size)
    peak_at = up / size
    scale, stairs = (frac / peak_at, stairs_up) if frac <= peak_at else ((frac - 1) / (peak_at - 1), stairs_down)
    if stairs > 0:
        pos = n % size
        scale = math.floor(pos * stairs / up if pos <= up else (size - pos) * stairs / down) / stairs
    return scale


def _onecycle_size(p: Mapping[str, Any]) -> float:
    up = float(p["cycle_first_step_size"])
    return up + (up if p["cycle_second_step_size"] == "first" else float(p["cycle_second_step_size"]))


def expected_lr(section: Mapping[str, Any], optimizer_lr: float, boundary: int) -> float:
    """The lr boundary ``boundary`` (0-based) trains with under ``section``."""
    kind, p = _filled(section)
    i = boundary - 1
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo = p["warmup_min_lr"]
        hi = optimizer_lr if p["warmup_max_lr"] == "optimizer lr" else p["warmup_max_lr"]
        if i < 0:
            return lo
        n = max(2, p["warmup_num_steps"])
        if i < n:
            g = _rise(i, n, p["warmup_type"])
        elif kind == "WarmupDecayLR":
            g = max(0.0, float(p["total_num_steps"] - i) / float(max(1.0, p["total_num_steps"] - n)))
        else:
            g = 1.0
        return lo + (hi - lo) * g
    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        n = max(2, p["warmup_num_steps"])
        if i < n:
            r = p["warmup_min_ratio"] + _rise(i, n, p["warmup_type"]) * (1.0 - p["warmup_min_ratio"])
        else:
            t = min(1.0, (i - n + 1) / max(1, p["total_num_steps"] - n))
            r = max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * ((1 + math.cos(math.pi * t)) / 2))
        return optimizer_lr * r
    if kind == "OneCycle":
        if i < _onecycle_size(p):
            return p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * _onecycle_scale(p, i)
        if p["decay_step_size"] == 0 or p["decay_lr_rate"] == 0:
            return p["cycle_min_lr"]
        return p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * ((i - _onecycle_size(p) + 1) / p["decay_step_size"]))
    x = (i + 1) / p["lr_range_test_step_size"]
    if p["lr_range_test_staircase"]:
        x = math.floor(x)
    return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * x)


def expected_betas(section: Mapping[str, Any], betas: tuple[float, float], boundary: int) -> tuple[float, float]:
    """The Adam betas boundary ``boundary`` trains with: ``betas`` unless OneCycle cycles momentum, which sets
    beta1 (``cycle_min_mom`` as built, then against the lr) and beta2 = 0.99."""
    kind, p = _filled(section)
    if kind != "OneCycle" or not p["cycle_momentum"]:
        return betas
    i = boundary - 1
    if i < 0:
        return (p["cycle_min_mom"], 0.99)
    if i < _onecycle_size(p):
        return (p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * _onecycle_scale(p, i), 0.99)
    if p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0:
        return (p["cycle_max_mom"], 0.99)
    return (p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * ((i - _onecycle_size(p) + 1) / p["decay_step_size"])),
            0.99)
