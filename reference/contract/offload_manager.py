"""Offload contract: what every activation-offload manager shares with the others.

- :class:`OffloadManager`: the interface ``checkpoint`` and the suite rely on (a manager has an ``engine`` with
  ``pack(t, *, force=False)`` and ``unpack(packed)``). Each implementation's ``ActivationOffload`` derives from it,
  so ``checkpoint(..., offload=m)`` accepts a manager of any implementation and rejects anything else.
- The per-thread stack of active managers (:func:`active_managers`, :func:`current_manager`). Saved-tensor hooks
  nest process-wide whatever implementation installed them, so which manager is innermost is one fact for all of
  them: one stack, shared.
- :func:`manager_accelerator`: the validation of a manager's ``accelerator`` argument against its config, with the
  same errors in every implementation.
- :class:`SavedTensorHooksManager`: the life cycle every hostoffload manager shares (config and accelerator from
  the arguments, saved-tensor hooks installed on entry and removed on exit, the HF patch, re-entry and
  ``close()``-while-active refused with the same errors); an implementation supplies only its engine. Third-party
  managers may derive from :class:`OffloadManager` alone.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

import torch

from reference.contract import offload_hf
from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_stats import OffloadStats


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


class SavedTensorHooksManager(OffloadManager):
    """``with manager:`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose pack/unpack go to the
    manager's engine, made once by :meth:`_new_engine` and reused at every entry (one manager per training loop,
    entered once per step). Backward may run inside or after the ``with`` block: saved activations carry their
    engine with them.

    Managers nest (the innermost one packs; the stack of active managers is this module's, shared by every
    implementation); one instance cannot be entered twice at the same time. Exiting, normally or through an
    exception, removes the hooks, the engine's module hook and the HF patch; saved activations already handed to
    autograd stay valid and give their memory back when autograd drops them.

    ``Manager(config=None, *, accelerator=None, **knobs)``: ``knobs`` override fields of ``config`` (see
    :class:`~reference.contract.offload_config.OffloadConfig`); ``accelerator`` is an Accelerator, its name, or
    None for the default one.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        accelerator: Accelerator | str | None = None,
        **knobs: Any,
    ) -> None:
        self._config = OffloadConfig.from_knobs(config, knobs)
        self._accelerator = manager_accelerator(accelerator, self._config)
        self._engine = self._new_engine(self._config, self._accelerator)
        self._hooks: Any = None
        self._hf_acquired = False
        self._active = False

    @abc.abstractmethod
    def _new_engine(self, config: OffloadConfig, accelerator: Accelerator) -> Any:
        """The implementation's engine: ``begin()``/``end()`` at entry/exit, ``pack``/``unpack``, ``close()``,
        ``snapshot_stats()`` and ``reset_stats()``."""

    @property
    def config(self) -> OffloadConfig:
        return self._config

    @property
    def accelerator(self) -> Accelerator:
        return self._accelerator

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def active(self) -> bool:
        return self._active

    @property
    def stats(self) -> OffloadStats:
        """A frozen snapshot of the counters (the engine first accounts for copies still in flight)."""
        return self._engine.snapshot_stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def close(self) -> None:
        """Give the engine's cached host memory back now (it is otherwise kept for the next step)."""
        if self._active:
            raise UnsupportedOperationError("close() called while the offload manager is active; exit it first")
        self._engine.close()

    def __enter__(self) -> SavedTensorHooksManager:
        if self._active:
            raise UnsupportedOperationError(
                "this ActivationOffload is already active; nest a different instance instead"
            )
        if self._config.hf_integration:
            offload_hf.acquire()  # imports transformers (only when asked for)
            self._hf_acquired = True
        engine = self._engine
        try:
            engine.begin()
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
        except BaseException:
            engine.end()
            self._release_hf()
            raise
        self._hooks = hooks
        self._active = True
        push_active(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        pop_active(self)
        try:
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            self._active = False
            self._engine.end()
            self._release_hf()

    # The saved-tensor hooks. Methods rather than the engine's own bound methods so the frame walk of
    # reference.contract.offload_selection.saved_by_torch_checkpoint sees the same call depth in every
    # implementation.
    def _pack(self, t: torch.Tensor) -> Any:
        return self._engine.pack(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return self._engine.unpack(packed)

    def _release_hf(self) -> None:
        if self._hf_acquired:
            self._hf_acquired = False
            offload_hf.release()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._config} accelerator={self._accelerator.name!r}>"
