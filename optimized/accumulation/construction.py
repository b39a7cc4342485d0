"""What ZeroEngine checks while it is built, before any buffer exists: its arguments and the process group, the
model argument, the device, and that every rank wraps the same model.

Why each check is here and not left to torch: a string where a module belongs failed with ``'str' object is not
callable``; ``device="cuda"`` on a CPU-only build with a bare ``AssertionError`` from torch's lazy init; and two
ranks with different models both constructed, then the first ``step()`` aborted inside gloo (on NCCL it hangs or
corrupts memory, since the ranks' collectives have different sizes). Each is now a ``ConfigurationError`` naming
the argument and what is allowed, raised at construction (issue 28).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optimized.accumulation.partition import FlatLayout, build_layout
from reference.contract import envvars
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

__all__ = [
    "ModelParameters",
    "build_module",
    "check_engine_arguments",
    "check_same_model_on_every_rank",
    "model_parameters",
    "resolve_device",
]


def bucket_size(argument: object, config: AccumulationConfig, default: int) -> object:
    """The stage-2/3 bucket size: the engine's ``bucket_elements`` argument or the config's (DeepSpeed's
    ``reduce_bucket_size``), which must agree when both are given, else ``default``. Checked by
    :func:`check_engine_arguments`."""
    if argument is None:
        return default if config.bucket_elements is None else config.bucket_elements
    if config.bucket_elements is not None and argument != config.bucket_elements:
        raise ConfigurationError(
            f"bucket_elements={argument!r} disagrees with the config's bucket_elements={config.bucket_elements} "
            f"(zero_optimization.reduce_bucket_size); allowed: give one of them, or the same value"
        )
    return argument


def check_engine_arguments(
    config: AccumulationConfig, initialized: bool, bucket_elements: object, record_gradients: object, prefetch: object
) -> int:
    """The engine's own arguments and what it needs before anything is built: data parallelism only, an
    initialized process group, a valid ``HOSTOFFLOAD_DEVICE_ADAM``. Returns the checked ``bucket_elements``."""
    if config.pipeline_parallel_size != 1:
        raise UnsupportedOperationError(
            f"pipeline_parallel_size={config.pipeline_parallel_size} is not modeled by this engine "
            f"(data parallelism only); allowed: pipeline_parallel_size=1"
        )
    if not initialized:
        raise ConfigurationError(
            "torch.distributed is not initialized; allowed: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs; world size 1 is fine) before building the engine"
        )
    if type(bucket_elements) is not int or bucket_elements < 1:
        raise ConfigurationError(f"bucket_elements={bucket_elements!r} must be an int >= 1")
    for name, value in (("record_gradients", record_gradients), ("prefetch", prefetch)):
        if type(value) is not bool:
            raise ConfigurationError(f"{name}={value!r} must be a bool; allowed values: True, False")
    # Every engine refuses a bad HOSTOFFLOAD_DEVICE_ADAM, not only those whose update path steps a master on the
    # device (which decide at construction, device_adam.prepare): a typo must not wait for a config change.
    envvars.device_adam()
    return bucket_elements


def build_module(model: Any) -> nn.Module:
    """``model`` itself, or what the factory ``model`` returns; anything else is refused by name."""
    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigurationError(
            f"model={model!r} ({type(model).__name__}) must be an nn.Module or a factory (a callable taking no "
            f"arguments) that returns one"
        )
    module = model if isinstance(model, nn.Module) else model()
    if not isinstance(module, nn.Module):
        raise ConfigurationError(
            f"model={model!r} is a factory that returned {type(module).__name__}; it must return an nn.Module"
        )
    return module


def available_devices() -> list[str]:
    """The devices this process can use, for messages: cpu, then each accelerator of torch's that reports any."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return out


def resolve_device(device: Any, group: Any) -> torch.device:
    """The engine's device: ``device`` when given and available here, else ``cuda:<current>`` under NCCL, else
    cpu."""
    if device is None:
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(
            f"device={device!r} is not a device ({exc}); available here: {', '.join(available_devices())}"
        ) from exc
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    count = getattr(backend, "device_count", None)
    usable = callable(is_available) and is_available()
    if not usable or (dev.index is not None and callable(count) and dev.index >= count()):
        raise ConfigurationError(
            f"device={device!r} is not available in this process (torch {torch.__version__}"
            f"{'' if usable else f' reports no {dev.type} device'}); available here: {', '.join(available_devices())}"
        )
    return dev


def _fingerprint(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(n, tuple(p.shape), bool(p.requires_grad)) for n, p in named]


def check_same_model_on_every_rank(comm: Any, named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """One all-gather of a CRC-32 of (name, shape, requires_grad) of every parameter; when any rank's differs,
    one more of the lists, and every rank raises a ConfigurationError naming the first differing parameter."""
    mine = _fingerprint(named)
    digests = comm.all_gather_objects(zlib.crc32(repr(mine).encode()), "model layout agreement")
    if all(d == digests[0] for d in digests):
        return
    layouts = comm.all_gather_objects(mine, "model layout comparison")
    base = layouts[0]
    for r, other in enumerate(layouts[1:], start=1):
        for i in range(max(len(base), len(other))):
            a = base[i] if i < len(base) else None
            b = other[i] if i < len(other) else None
            if a != b:
                raise ConfigurationError(
                    f"model differs between ranks: parameter #{i} is {_describe(a)} on rank 0 but {_describe(b)} on "
                    f"rank {r}; allowed: the same model (names, shapes, requires_grad) on every rank"
                )


def _describe(entry: tuple[str, tuple[int, ...], bool] | None) -> str:
    if entry is None:
        return "absent"
    name, shape, grad = entry
    return f"{name!r} of shape {list(shape)}" + ("" if grad else " (frozen)")


@dataclass(frozen=True)
class ModelParameters:
    """A model's parameters as the engine keeps them: by name (in ``named_parameters()`` order), the trainable and
    the frozen names, and their R8 layouts over the world."""

    params: dict[str, nn.Parameter]
    trainable_names: tuple[str, ...]
    frozen_names: tuple[str, ...]
    layout: FlatLayout
    frozen_layout: FlatLayout

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [self.params[n] for n in self.trainable_names]

    def clear_grads(self) -> None:
        """``p.grad = None`` everywhere: the engine's hooks move gradients into its buffers, none stays."""
        for p in self.params.values():
            p.grad = None


def model_parameters(comm: Any, module: nn.Module) -> ModelParameters:
    """``module``'s parameters, checked to be the same on every rank (before any buffer: a mismatch fails on every
    rank) and to include one that trains."""
    named = list(module.named_parameters())
    check_same_model_on_every_rank(comm, named)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    if not trainable:
        raise ConfigurationError("model has no parameter with requires_grad=True; allowed: at least one")
    return ModelParameters(
        params=dict(named),
        trainable_names=tuple(n for n, _ in trainable),
        frozen_names=tuple(n for n, _ in frozen),
        layout=build_layout([(n, p.shape) for n, p in trainable], comm.world),
        frozen_layout=build_layout([(n, p.shape) for n, p in frozen], comm.world),
    )
