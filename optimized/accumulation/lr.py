"""``engine.optimizer``: a ``torch.optim.Optimizer`` whose hyper-parameters drive the engine's own update.

The engine's update is not a torch optimizer: it runs R16 on a flat fp32 master partition, natively on the host
when offloaded. What LR schedules need is the *interface*: ``param_groups`` with ``lr`` (and ``betas`` /
``momentum`` / ``weight_decay``, which OneCycleLR and friends also move), ``state_dict()`` /
``load_state_dict()``, and a ``step()`` that the scheduler can observe having run. This class is a real
``torch.optim.Optimizer`` over the model's trainable parameters (so ``isinstance`` checks and every scheduler in
``torch.optim.lr_scheduler`` accept it) with one parameter group; the engine reads the group's values at every
boundary and runs its update with them, and calls :meth:`step` itself after the update so a scheduler sees the
usual optimizer-then-scheduler order. Users never call :meth:`step`; doing so raises.

:class:`LrSchedule` is the rest of the engine's learning-rate surface (``engine.lr_scheduler``, ``get_lr`` /
``set_lr``): the attached scheduler, checked to drive this optimizer, and a scheduler state a checkpoint load read
before any scheduler was attached, kept until one is (a training script usually loads first, then attaches).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from reference.contract.accumulation_config import AccumulationConfig, OptimizerConfig
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.lr_schedules import DeepSpeedSchedule

__all__ = ["EngineOptimizer", "LrSchedule", "config_scheduler"]


def config_scheduler(optimizer: EngineOptimizer, config: AccumulationConfig) -> DeepSpeedSchedule:
    """The config's ``scheduler`` section as a scheduler on ``optimizer``. OneCycle cycles ``betas`` for the Adam
    types only: DeepSpeed cycles momentum only where the optimizer has ``betas``, which torch's SGD has not."""
    assert config.scheduler is not None  # the engine calls this for a config with a scheduler section
    return DeepSpeedSchedule(optimizer, config.scheduler, cycle_betas=config.optimizer.type != "sgd")


class EngineOptimizer(torch.optim.Optimizer):
    """One parameter group over ``params`` whose hyper-parameters start as ``config``'s."""

    def __init__(self, params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> None:
        defaults = {
            "lr": config.lr,
            "betas": config.betas,
            "eps": config.eps,
            "weight_decay": config.weight_decay,
            "momentum": config.momentum,
        }
        self._base = config
        self._engine_stepping = False
        super().__init__(list(params), defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "param_groups", None):
            raise UnsupportedOperationError(
                "engine.optimizer has one parameter group (every trainable parameter of the model, updated as one "
                "flat partition); allowed: change the group's hyper-parameters (e.g. param_groups[0]['lr'])"
            )
        super().add_param_group(param_group)

    def current(self) -> OptimizerConfig:
        """The optimizer config of the next update: the engine's, with the group's current values (validated
        again, so a scheduler that drives ``lr`` negative fails loudly at the step that would use it)."""
        g = self.param_groups[0]
        return replace(
            self._base,
            lr=float(g["lr"]),
            betas=tuple(float(b) for b in g["betas"]),  # type: ignore[arg-type]  # OptimizerConfig checks the pair
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            momentum=float(g["momentum"]),
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # torch's overloads; no closure here
        """Called by the engine after each boundary update (so schedulers see optimizer-then-scheduler)."""
        if not self._engine_stepping:
            raise UnsupportedOperationError(
                "engine.optimizer.step() is driven by the engine; allowed: engine.step() (it updates at the "
                "gradient-accumulation boundary and then steps an attached lr_scheduler)"
            )
        return None

    def engine_step(self) -> None:
        self._engine_stepping = True
        try:
            self.step()
        finally:
            self._engine_stepping = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients never stay on the parameters (the engine accumulates them in its own buffers): nothing to
        clear here; ``engine.zero_grad()`` discards the engine's accumulated gradient."""
        return None


class LrSchedule:
    """The scheduler ``step()`` advances at each boundary (``scheduler``, None: none) over ``optimizer``."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer
        self.scheduler: Any = None
        self._pending_state: dict[str, Any] | None = None

    def attach(self, scheduler: Any) -> None:
        """``engine.lr_scheduler = scheduler``: one built on the engine's optimizer, or None. A state loaded
        before (:meth:`load_state_dict`) is applied to it now."""
        if scheduler is not None:
            if getattr(scheduler, "optimizer", None) is not self.optimizer or not callable(
                getattr(scheduler, "step", None)
            ):
                raise ConfigurationError(
                    f"lr_scheduler={scheduler!r} must be a scheduler built on engine.optimizer (e.g. "
                    f"torch.optim.lr_scheduler.LambdaLR(engine.optimizer, ...)), or None"
                )
            if self._pending_state is not None:
                scheduler.load_state_dict(self._pending_state)
                self._pending_state = None
                # Building the scheduler reset the group's lr to its first value; the loaded one is in force.
                for g, lr in zip(self.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                    g["lr"] = lr
        self.scheduler = scheduler

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's scheduler state: into the attached scheduler, or held for the next one attached."""
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)
        else:
            self._pending_state = state

    def boundary_done(self) -> None:
        """After a boundary's update: the optimizer steps (as schedulers expect), then the scheduler."""
        self.optimizer.engine_step()
        if self.scheduler is not None:
            self.scheduler.step()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        if not isinstance(lr, (int, float)) or type(lr) is bool or not math.isfinite(lr) or lr < 0:
            raise ConfigurationError(f"lr={lr!r} must be a finite number >= 0")
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)
