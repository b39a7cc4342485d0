"""Offload contract: which saved tensors a manager may move, and which count as checkpoint inputs.

Shared by every implementation: the decisions are compared one to one by the suite (``skipped_by_reason``), and the
checkpoint-input marks are process-wide (a tensor marked through one implementation's ``mark_checkpoint_input``
or the HF patch is a checkpoint input for every manager).

Never moved, whatever the mode:
- parameters, views of parameters and other leaves that require grad: they stay referenced by the model (or
  the caller), so a host copy would only add traffic and a second copy of the data;
- buffers and parameters reached through module storage (a ``detach()``-ed weight is not a view in
  autograd's sense, so the manager also records the storages of modules it sees run);
- tensors not on the accelerator's device type (for CUDA: host tensors; there is nothing to free);
- meta tensors and tensor subclasses (fake tensors, functional wrappers, ...): no plain storage to copy;
- non-strided, conjugate/negative-bit and quantized tensors: a flat span copy would not preserve them;
- empty tensors and tensors whose span is below ``min_offload_bytes``.

Checkpoint inputs are recognised in two ways. Tensors passed to hostoffload's ``checkpoint`` or marked by
the HF integration carry an explicit mark. Tensors saved by ``torch.utils.checkpoint`` itself, as users
already call it, are recognised by the frame that saves them: torch saves a checkpointed region's inputs
from one well-known place (``_CheckpointFrame.save_inputs`` in recent torch, ``_NoopSaveInputs.apply`` /
``CheckpointFunction.apply`` before), and inside the region torch's own hooks take precedence over ours, so
only those saves reach us.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch

_CHECKPOINT_MODULE = "torch.utils.checkpoint"
# How many Python frames to look up from the caller for torch's input-saving frame: the engine's pack, the
# hook, possibly a comprehension frame (Python 3.11), then torch's saver. A small bound keeps the walk
# cheap and precise.
_FRAME_WALK_DEPTH = 8

_marks: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_checkpoint_input(t: object) -> None:
    """Mark ``t`` (if it is a tensor) as the input of a checkpointed region, for ``checkpoint_inputs`` mode.

    The mark lives as long as the tensor and costs nothing if the tensor is never saved.
    """
    if isinstance(t, torch.Tensor):
        _marks[id(t)] = t


def is_marked_checkpoint_input(t: torch.Tensor) -> bool:
    return _marks.get(id(t)) is t


def _torch_checkpoint_saver_classes() -> tuple[type, ...]:
    module = sys.modules.get(_CHECKPOINT_MODULE)
    if module is None:
        return ()
    return tuple(
        cls for cls in (getattr(module, "_NoopSaveInputs", None), getattr(module, "CheckpointFunction", None)) if cls
    )


def saved_by_torch_checkpoint(start_depth: int = 1) -> bool:
    """True if the tensor being packed right now is being saved as a torch checkpoint's input."""
    classes = _torch_checkpoint_saver_classes()
    frame: FrameType | None
    try:
        frame = sys._getframe(start_depth)
    except ValueError:
        return False
    for _ in range(_FRAME_WALK_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "save_inputs" and frame.f_globals.get("__name__") == _CHECKPOINT_MODULE:
            return True
        if code.co_name == "apply" and classes and frame.f_locals.get("cls") in classes:
            return True
        frame = frame.f_back
    return False


class ModuleStateStorages:
    """The storages of module parameters and buffers on ``device_type``, noted while a manager is active.

    A ``detach()``-ed weight is not a view in autograd's sense, so module state is recognised by its storage: a
    process-wide forward pre-hook, installed by :meth:`start` (manager entered) and removed by :meth:`stop`
    (manager exited, also on exceptions), records the storages of every module that runs. ``storages`` is what
    :func:`never_offload_reason` takes as ``excluded_storages``."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.storages: set[int] = set()
        self._hook: Any = None

    def start(self) -> None:
        self.storages = set()
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._note)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.storages = set()

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if tensor.device.type == self.device_type:
                self.storages.add(tensor.untyped_storage().data_ptr())


def never_offload_reason(t: torch.Tensor, device_type: str, excluded_storages: set[int]) -> str | None:
    """Why ``t`` must stay where it is (a short reason used in stats), or None if it may be moved."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return "subclass"
    if t.requires_grad and t.is_leaf:
        return "parameter"
    base = t._base
    if base is not None and base.requires_grad and base.is_leaf:
        return "parameter_view"
    device = t.device.type
    if device == "meta":
        return "meta"
    if device != device_type:
        return "host" if device == "cpu" else "other_device"
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return "layout"
    if t.numel() == 0:
        return "empty"
    if t.untyped_storage().data_ptr() in excluded_storages:
        return "module_state"
    return None
