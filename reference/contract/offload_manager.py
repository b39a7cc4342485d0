"""Offload contract: what every activation-offload manager shares with the others.

- :class:`OffloadManager`: the interface ``checkpoint`` and the suite rely on (a manager has an ``engine`` with
  ``pack(t, *, force=False)`` and ``unpack(packed)``). Each implementation's ``ActivationOffload`` derives from it,
  so ``checkpoint(..., offload=m)`` accepts a manager of any implementation and rejects anything else.
- The per-thread stack of active managers (:func:`active_managers`, :func:`current_manager`). Saved-tensor hooks
  nest process-wide whatever implementation installed them, so which manager is innermost is one fact for all of
  them: one stack, shared.
- :func:`manager_accelerator`: the validation of a manager's ``accelerator`` argument against its config, with the
  same errors in every implementation.
"""

from __future__ import annotations

import abc
import threading
from typing import TYPE_CHECKING, Any

from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.errors import ConfigurationError

if TYPE_CHECKING:  # importing the config here would import reference.offload, which imports this module
    from reference.contract.offload_config import OffloadConfig


class OffloadManager(abc.ABC):
    """An activation-offload manager of some implementation (an interface: no behaviour lives here)."""

    @property
    @abc.abstractmethod
    def engine(self) -> Any:
        """The engine whose ``pack(t, *, force=False)`` / ``unpack(packed)`` are the manager's saved-tensor hooks.

        ``force=True`` offloads an eligible tensor whatever the ``mode`` (hostoffload's ``checkpoint`` lets only
        checkpoint inputs reach it)."""


_active = threading.local()


def active_managers() -> tuple[OffloadManager, ...]:
    """Managers active in this thread, outermost first."""
    return tuple(getattr(_active, "stack", ()))


def current_manager() -> OffloadManager | None:
    """The innermost manager active in this thread, or None."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def push_active(manager: OffloadManager) -> None:
    """Note that ``manager`` was entered in this thread (it is now the innermost)."""
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    stack.append(manager)


def pop_active(manager: OffloadManager) -> None:
    """Note that ``manager`` exited in this thread (managers may exit out of order when an exception unwinds)."""
    stack = getattr(_active, "stack", [])
    if stack and stack[-1] is manager:
        stack.pop()
    elif manager in stack:
        stack.remove(manager)


def manager_accelerator(accelerator: Accelerator | str | None, config: OffloadConfig) -> Accelerator:
    """The accelerator a manager runs on: an Accelerator, its name, or None for the default one; ``use_streams=True``
    needs one with streams."""
    if accelerator is None or isinstance(accelerator, str):
        resolved = get_accelerator(accelerator)
    elif isinstance(accelerator, Accelerator):
        resolved = accelerator
    else:
        raise ConfigurationError(
            f"accelerator={accelerator!r} is invalid; allowed: None, an accelerator name, or an Accelerator"
        )
    if config.use_streams and not resolved.supports_streams:
        raise ConfigurationError(
            f"use_streams=True is not possible on accelerator {resolved.name!r} (no streams); "
            "allowed: False or None (auto)"
        )
    return resolved
