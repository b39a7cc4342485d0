"""Finding Lightning 2.x: ``lightning.pytorch`` (the ``lightning`` distribution), else ``pytorch_lightning``.

One function, so that the strategy module (which needs Lightning at import) and the public facade (which must not)
name the same packages and the same install hint.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from reference.contract.errors import MissingDependencyError

__all__ = ["INSTALL_HINT", "LIGHTNING_PACKAGES", "load_lightning"]

#: Import names tried, in order: the ``lightning`` distribution's, then ``pytorch-lightning``'s.
LIGHTNING_PACKAGES: tuple[str, ...] = ("lightning.pytorch", "pytorch_lightning")
INSTALL_HINT = "pip install 'hostoffload[lightning]' (or pytorch-lightning>=2.0)"


def load_lightning() -> ModuleType:
    """Lightning's ``pytorch`` package (``lightning.pytorch`` or ``pytorch_lightning``, 2.x), or
    :class:`MissingDependencyError` with the install hint."""
    reasons = []
    for name in LIGHTNING_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            reasons.append(f"{name}: {exc}")
            continue
        major = str(getattr(module, "__version__", "0")).split(".")[0]
        if not major.isdigit() or int(major) < 2:
            reasons.append(f"{name} {getattr(module, '__version__', '?')} is older than 2.0")
            continue
        return module
    raise MissingDependencyError(
        f"the hostoffload Lightning strategy needs Lightning 2.x ({'; '.join(reasons)}); allowed: {INSTALL_HINT}"
    )
