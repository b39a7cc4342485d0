"""The user-facing context manager: saved-tensor hooks bound to an offload engine.

``with ActivationOffload(...)`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose pack/unpack go
to the manager's engine. Create one manager and enter it once per step: its engine (and, in the optimized
implementation, its pinned pool and streams) is reused across steps. Backward may run inside or after the
``with`` block: records carry their engine with them.

Managers nest (the innermost one packs, as with any saved-tensor hooks); one instance cannot be entered
twice at the same time. Exiting, normally or through an exception, removes the hooks, the module hook and
the HF patch; records already handed to autograd stay valid and give their memory back when autograd drops
them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.errors import ConfigurationError, UnsupportedOperationError
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_stats import OffloadStats
from reference.offload.engine import EngineBase, ReferenceEngine

_active = threading.local()


def active_managers() -> tuple[ActivationOffload, ...]:
    """Managers active in this thread, outermost first."""
    return tuple(getattr(_active, "stack", ()))


def current_manager() -> ActivationOffload | None:
    """The innermost manager active in this thread, or None."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def _resolve_accelerator(accelerator: Accelerator | str | None) -> Accelerator:
    if accelerator is None or isinstance(accelerator, str):
        return get_accelerator(accelerator)
    if not isinstance(accelerator, Accelerator):
        raise ConfigurationError(
            f"accelerator={accelerator!r} is invalid; allowed: None, an accelerator name, or an Accelerator"
        )
    return accelerator


class ActivationOffload:
    """Offload saved activations to host memory during forward and bring them back in backward.

    ``ActivationOffload(config=None, *, accelerator=None, **knobs)``: ``knobs`` override fields of
    ``config`` (see :class:`~reference.contract.offload_config.OffloadConfig`); ``accelerator`` is an Accelerator,
    its name, or None for the default one.
    """

    #: The engine class; implementations subclass the manager and change only this.
    engine_class: type[EngineBase] = ReferenceEngine

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        accelerator: Accelerator | str | None = None,
        **knobs: Any,
    ) -> None:
        self._config = OffloadConfig.from_knobs(config, knobs)
        self._accelerator = _resolve_accelerator(accelerator)
        if self._config.use_streams and not self._accelerator.supports_streams:
            raise ConfigurationError(
                f"use_streams=True is not possible on accelerator {self._accelerator.name!r} (no streams); "
                "allowed: False or None (auto)"
            )
        self._engine = self.engine_class(self._config, self._accelerator)
        self._hooks: Any = None
        self._hf_acquired = False
        self._active = False

    # -- properties
    # ---------------------------------------------------------------------------------------------
    @property
    def config(self) -> OffloadConfig:
        return self._config

    @property
    def accelerator(self) -> Accelerator:
        return self._accelerator

    @property
    def engine(self) -> EngineBase:
        return self._engine

    @property
    def active(self) -> bool:
        return self._active

    @property
    def stats(self) -> OffloadStats:
        """A frozen snapshot of the counters (resolving any pending copy timings first)."""
        return self._engine.snapshot_stats()

    def reset_stats(self) -> None:
        self._engine.stats.reset()

    def close(self) -> None:
        """Give cached host memory back now (it is otherwise kept for the next step)."""
        if self._active:
            raise UnsupportedOperationError("close() called while the offload manager is active; exit it first")
        self._engine.close()

    # -- hooks
    # --------------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        return self._engine.pack(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return self._engine.unpack(packed)

    def __enter__(self) -> ActivationOffload:
        if self._active:
            raise UnsupportedOperationError(
                "this ActivationOffload is already active; nest a different instance instead"
            )
        if self._config.hf_integration:
            from reference.offload import hf  # optional dependency: imported only when asked for

            hf.acquire()
            self._hf_acquired = True
        try:
            self._engine.begin()
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
        except BaseException:
            self._engine.end()
            self._release_hf()
            raise
        self._hooks = hooks
        self._active = True
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        stack = getattr(_active, "stack", [])
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)
        try:
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            self._active = False
            self._engine.end()
            self._release_hf()

    def _release_hf(self) -> None:
        if self._hf_acquired:
            from reference.offload import hf

            self._hf_acquired = False
            hf.release()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._config} accelerator={self._accelerator.name!r}>"
