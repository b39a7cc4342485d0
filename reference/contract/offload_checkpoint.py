"""Offload contract: activation checkpointing on an implementation's offload engine.

:func:`build_checkpoint` makes an implementation's ``checkpoint`` from its manager class; it relies only on the
:class:`~reference.contract.offload_manager.OffloadManager` interface (a manager's engine packs and unpacks), so
every implementation gets the same argument checks, the same choice of manager and the same RNG and autocast
handling. The suite compares the result with ``torch.utils.checkpoint`` bitwise, not with another implementation.

The ``checkpoint`` it makes is documented by :data:`CHECKPOINT_DOC`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from reference.contract.errors import ConfigurationError
from reference.contract.offload_manager import OffloadManager, current_manager
from reference.contract.offload_selection import mark_checkpoint_input

#: The docstring of every ``checkpoint`` :func:`build_checkpoint` makes.
CHECKPOINT_DOC = """\
``checkpoint(function, *args, use_reentrant=False, offload=None, preserve_rng_state=True, **kwargs)``:

- ``use_reentrant=False`` delegates to ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and
  marks the tensor arguments as checkpoint inputs. Under an active manager the manager offloads them (in
  either mode); with an explicit ``offload`` manager, or with none active, the region's input saves go
  through that manager's (or the implementation's default manager's) engine for this call only.
- ``use_reentrant=True`` is a reentrant checkpoint whose inputs are saved through the engine, i.e. copied
  to host memory after forward and copied back for the recompute in backward (the ``cpu_checkpointing``
  idea). Unlike the implementation that idea is known from, the forward runs on the caller's inputs
  untouched (they are never emptied or moved before or during forward), and the recompute runs on the
  restored values, never on emptied placeholders. The inputs go through ``save_for_backward``, so the usual
  in-place modification check applies.

Both paths preserve the RNG state (CPU and the inputs' devices) unless ``preserve_rng_state=False``, so
dropout in the recompute draws the same numbers as in forward and gradients are bitwise those of the plain
model.
"""


def _device_rng_states(args: tuple[Any, ...]) -> tuple[str | None, list[int], list[torch.Tensor]]:
    """RNG states of the non-CPU devices the tensor arguments live on (one device type, like torch
    assumes)."""
    devices: dict[int, None] = {}
    device_type = None
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
            device_type = a.device.type
            devices[a.device.index or 0] = None
    if device_type is None:
        return None, [], []
    module = getattr(torch, device_type)
    indices = list(devices)
    return device_type, indices, [module.get_rng_state(i) for i in indices]


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    try:
        return {
            "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }
    except (TypeError, RuntimeError, AttributeError):  # device type without autocast support
        return None


class _ReentrantOffloadCheckpoint(torch.autograd.Function):
    """Runs ``run_function`` without a graph; saves its tensor inputs (offloaded by the enclosing hooks)."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        if preserve_rng_state:
            ctx.cpu_rng_state = torch.get_rng_state()
            ctx.device_type, ctx.rng_devices, ctx.device_rng_states = _device_rng_states(args)
        else:
            ctx.device_type, ctx.rng_devices, ctx.device_rng_states = _device_rng_states(())
        dev_type = ctx.device_type or "cpu"
        ctx.autocast_device = dev_type
        ctx.autocast = _autocast_state(dev_type)
        ctx.cpu_autocast = _autocast_state("cpu") if dev_type != "cpu" else None
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.input_requires_grad = [args[i].requires_grad for i in ctx.tensor_indices]
        ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint with use_reentrant=True does not support torch.autograd.grad(); "
                "use .backward() or use_reentrant=False"
            )
        saved = ctx.saved_tensors  # restored from host by the engine's unpack
        inputs = list(ctx.other_args)
        pairs = zip(ctx.tensor_indices, ctx.input_requires_grad, strict=True)
        for slot, (i, needs_grad) in enumerate(pairs):
            x = saved[slot].detach()
            x.requires_grad_(needs_grad)
            inputs[i] = x
        rng: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if ctx.preserve_rng_state:
            rng = torch.random.fork_rng(devices=ctx.rng_devices, enabled=True, device_type=ctx.device_type or "cuda")
        with contextlib.ExitStack() as stack:
            stack.enter_context(rng)
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng_state)
                if ctx.device_type is not None:
                    module = getattr(torch, ctx.device_type)
                    for index, state in zip(ctx.rng_devices, ctx.device_rng_states, strict=False):
                        module.set_rng_state(state, index)
            if ctx.autocast is not None:
                stack.enter_context(torch.autocast(ctx.autocast_device, **ctx.autocast))
            if ctx.cpu_autocast is not None:
                stack.enter_context(torch.autocast("cpu", **ctx.cpu_autocast))
            stack.enter_context(torch.enable_grad())
            outputs = ctx.run_function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        grad_pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if not grad_pairs:
            raise RuntimeError("none of the checkpointed outputs requires grad; this checkpoint() is not necessary")
        torch.autograd.backward([o for o, _ in grad_pairs], [g for _, g in grad_pairs])
        input_grads = [x.grad if isinstance(x, torch.Tensor) else None for x in inputs]
        return (None, None, *input_grads)


def _forced_hooks(engine: Any) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that offload every eligible tensor they see (mode ignored): the callers only let inputs reach
    them."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: engine.pack(t, force=True), engine.unpack)


def build_checkpoint(manager_class: type[OffloadManager]) -> Callable[..., Any]:
    """The ``checkpoint`` function of an implementation whose manager class is ``manager_class`` (its default
    manager, created at the first call that needs one, serves calls made with no manager active and none passed)."""
    lock = threading.Lock()
    default: list[OffloadManager] = []

    def default_manager() -> OffloadManager:
        with lock:
            if not default:
                default.append(manager_class())
            return default[0]

    def checkpoint(
        function: Callable[..., Any],
        *args: Any,
        use_reentrant: bool = False,
        offload: OffloadManager | None = None,
        preserve_rng_state: bool = True,
        **kwargs: Any,
    ) -> Any:
        if not isinstance(use_reentrant, bool):
            raise ConfigurationError(f"use_reentrant={use_reentrant!r} is invalid; allowed: True, False")
        if offload is not None and not isinstance(offload, OffloadManager):
            raise ConfigurationError(f"offload={offload!r} is invalid; allowed: None or an ActivationOffload")
        active = current_manager()
        if use_reentrant:
            if kwargs:
                raise ConfigurationError(
                    f"keyword arguments {sorted(kwargs)} are not supported with use_reentrant=True; allowed: "
                    "positional arguments only (or use_reentrant=False)"
                )
            if not torch.is_grad_enabled():
                return function(*args)
            engine = (offload or active or default_manager()).engine
            with _forced_hooks(engine):
                return _ReentrantOffloadCheckpoint.apply(function, preserve_rng_state, *args)
        for a in args:
            mark_checkpoint_input(a)
        if offload is None and active is not None:
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
            )
        engine = (offload or default_manager()).engine
        with _forced_hooks(engine):
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
            )

    checkpoint.__doc__ = CHECKPOINT_DOC
    return checkpoint
