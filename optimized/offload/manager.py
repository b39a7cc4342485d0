"""The optimized user-facing context manager: saved-tensor hooks bound to a
:class:`~optimized.offload.engine.StreamedOffloadEngine`.

``with ActivationOffload(...)`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose pack/unpack go to the
manager's engine. Create one manager and enter it once per step: its engine, with its pinned pool and its copy
streams, is reused across steps (``close()`` gives the pool's cached memory back). Backward may run inside or after
the ``with`` block: saved activations carry their engine with them.

Managers nest (the innermost one packs, as with any saved-tensor hooks; the stack of active managers is shared
with every implementation, :mod:`reference.contract.offload_manager`); one instance cannot be entered twice at the
same time. Exiting, normally or through an exception, removes the hooks, the module hook and the HF patch; saved
activations already handed to autograd stay valid and give their memory back when autograd drops them.
"""

from __future__ import annotations

from typing import Any

import torch

from optimized.offload.engine import StreamedOffloadEngine
from reference.contract import offload_hf
from reference.contract.accelerators import Accelerator
from reference.contract.errors import UnsupportedOperationError
from reference.contract.offload_config import OffloadConfig
from reference.contract.offload_manager import OffloadManager, manager_accelerator, pop_active, push_active
from reference.contract.offload_stats import OffloadStats


class ActivationOffload(OffloadManager):
    """Offload saved activations with pooled pinned memory, copy streams and prefetch.

    ``ActivationOffload(config=None, *, accelerator=None, **knobs)``: ``knobs`` override fields of ``config``
    (see :class:`~reference.contract.offload_config.OffloadConfig`); ``accelerator`` is an Accelerator, its name,
    or None for the default one.
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
        self._engine = StreamedOffloadEngine(self._config, self._accelerator)
        self._hooks: Any = None
        self._hf_acquired = False
        self._active = False

    @property
    def config(self) -> OffloadConfig:
        return self._config

    @property
    def accelerator(self) -> Accelerator:
        return self._accelerator

    @property
    def engine(self) -> StreamedOffloadEngine:
        return self._engine

    @property
    def active(self) -> bool:
        return self._active

    @property
    def stats(self) -> OffloadStats:
        """A frozen snapshot of the counters (waits for the timings of copies still in flight)."""
        return self._engine.snapshot_stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def close(self) -> None:
        """Give the pool's cached host memory back now (it is otherwise kept for the next step)."""
        if self._active:
            raise UnsupportedOperationError("close() called while the offload manager is active; exit it first")
        self._engine.close()

    def __enter__(self) -> ActivationOffload:
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
