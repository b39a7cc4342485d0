"""A Lightning 2.x strategy that trains a ``LightningModule`` with :class:`~optimized.accumulation.ZeroEngine`.

``Trainer(strategy=ZeroStrategy(config))`` runs the engine where Lightning would run DDP: ZeRO stages 0-3,
optimizer (and stage-3 parameter) offload, the engine's gradient accumulation and clipping, and checkpoints in the
engine's own format (docs/zero.md, "Lightning"). The class is in :mod:`._lightning_strategy`, which imports
Lightning; this module does not, so ``import optimized.integrations.lightning`` works anywhere and only *using*
the strategy without Lightning raises :class:`~reference.contract.errors.MissingDependencyError` with the extra to
install. Both distributions are accepted: ``lightning`` (``lightning.pytorch``, tried first) and
``pytorch-lightning`` (``pytorch_lightning``), 2.0 or newer.

How the config meets the Trainer (accumulation, clipping, precision, the optimizer of ``configure_optimizers``)
is :mod:`.lightning_config`'s, without Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from optimized.integrations.lightning_config import (
    TRAINER_PRECISIONS,
    TrainerSettings,
    optimizer_section,
    resolve_config,
)
from optimized.integrations.lightning_package import INSTALL_HINT, LIGHTNING_PACKAGES, load_lightning

__all__ = [
    "INSTALL_HINT",
    "LIGHTNING_PACKAGES",
    "TRAINER_PRECISIONS",
    "TrainerSettings",
    "ZeroStrategy",  # noqa: F822 (module __getattr__ imports it with Lightning)
    "load_lightning",
    "optimizer_section",
    "resolve_config",
]


def __getattr__(name: str) -> Any:
    """``ZeroStrategy`` is built on Lightning's classes, so it is imported on first use (and the missing package
    reported then, not when this module is imported)."""
    if name == "ZeroStrategy":
        load_lightning()
        return importlib.import_module("optimized.integrations._lightning_strategy").ZeroStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
