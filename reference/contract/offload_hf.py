"""Offload contract: the integration with Hugging Face ``transformers`` (optional dependency).

One module for every implementation on purpose: the patch of ``GradientCheckpointingLayer`` is process-wide state
with one reference count, and two copies of it (one per implementation) could restore each other's ``__call__`` in
the wrong order when managers of both are active.

While at least one manager with ``hf_integration=True`` is active,
``transformers.GradientCheckpointingLayer`` gets a ``__call__`` that marks the layer's hidden-states input
(first positional argument, else ``hidden_states=``) as a checkpoint input before running the layer as
usual. With ``mode="checkpoint_inputs"`` the manager then offloads exactly those tensors when the layer's
gradient checkpointing saves them, whichever checkpoint function transformers was configured with
(reentrant or not).

The patch is reference counted across managers and threads: installed by the first manager that enters,
removed (the class's original ``__call__`` restored, or the inherited one uncovered again) by the last that
exits, including exits through an exception. transformers is imported only here and only when the
integration is asked for; without it, asking gives :class:`MissingDependencyError`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from reference.contract.errors import MissingDependencyError
from reference.contract.offload_selection import mark_checkpoint_input

_MISSING = object()
_lock = threading.Lock()
_refcount = 0
_patched_class: Any = None
_original_call: Any = _MISSING


def _layer_class() -> Any:  # transformers' class: an optional dependency, untyped here (pyproject.toml)
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "hf_integration=True needs the optional dependency 'transformers' "
            "(pip install 'hostoffload[hf]'); allowed without it: hf_integration=False"
        ) from exc
    found = getattr(transformers, "GradientCheckpointingLayer", None)
    if found is not None:
        return found
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as exc:
        raise MissingDependencyError(
            f"hf_integration=True needs transformers.GradientCheckpointingLayer, which transformers "
            f"{getattr(transformers, '__version__', '?')} does not have; allowed: transformers>=4.52"
        ) from exc
    return GradientCheckpointingLayer


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _make_call(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "gradient_checkpointing", False) and self.training:
            mark_checkpoint_input(_hidden_states(args, kwargs))
        return original(self, *args, **kwargs)

    __call__.__hostoffload_patch__ = True  # type: ignore[attr-defined]
    return __call__


def acquire() -> None:
    """Install the patch (or count one more user of it)."""
    global _refcount, _patched_class, _original_call
    cls = _layer_class()
    with _lock:
        if _refcount == 0:
            own = cls.__dict__.get("__call__", _MISSING)
            inherited = cls.__call__
            _original_call = own
            _patched_class = cls
            cls.__call__ = _make_call(inherited)
        _refcount += 1


def release() -> None:
    """Count one user less; the last one restores the original ``__call__``."""
    global _refcount, _patched_class, _original_call
    with _lock:
        if _refcount == 0:
            return
        _refcount -= 1
        if _refcount == 0:
            cls = _patched_class
            if _original_call is _MISSING:
                del cls.__call__
            else:
                cls.__call__ = _original_call
            _patched_class = None
            _original_call = _MISSING


def is_patched() -> bool:
    """True while the patch is installed."""
    with _lock:
        return _refcount > 0

__all__ = [
    "MissingDependencyError",
    "acquire",
    "is_patched",
    "release",
]
