"""What a ZeroEngine will hold in host memory, computed before it is built (issue 40: size a model to the host).

With the optimizer state on the host (``offload_optimizer: cpu``) it is the host's memory, not the GPU's, that
decides the largest model a box trains: 18 bytes per parameter with fp32 moments, 14 with R29's bf16 moments, for
a bf16 model at stage 2. Finding that limit by trial means pinning a hundred GiB and failing; this module lists
every host buffer the engine would allocate for a model and a config -- from the same R8 layout the engine builds
(padding included) and from each update path's own plan (:meth:`.UpdatePath.planned_host_buffers`, next to the
code that allocates) -- so a model built on the ``meta`` device can be sized without allocating anything::

    with torch.device("meta"):
        model = build_model()
    print(estimate_host_memory(model, config).describe())

What it does not count: the process's own footprint (torch's libraries and the CUDA context, about 1.5 GiB on the
GPU box), the user's tensors and data, and short-lived copies (a checkpoint save's). Under
``HOSTOFFLOAD_ZERO_HOST_MEMORY=pin_backend`` torch's caching allocator may round each pinned buffer up to a power
of two; the estimate is of the default, exact allocation. The conformance
(``test_accumulation_engine_host_memory.py``) compares the estimate with the locked memory the operating system
counts for the built engine.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optimized.accumulation.partition import build_layout
from optimized.accumulation.update_paths import update_path_class
from optimized.accumulation.update_paths.base import BufferPlan, HostBuffer
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError

__all__ = ["HostBuffer", "HostMemoryEstimate", "estimate_host_memory"]


def _page_rounded(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(frozen=True)
class HostMemoryEstimate:
    """Per buffer, what one rank's engine allocates on the host (see the module docstring)."""

    buffers: tuple[HostBuffer, ...]
    parameters: int

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the page-locked buffers (numel times element size)."""
        return sum(b.nbytes for b in self.buffers if b.pinned)

    @property
    def locked_bytes(self) -> int:
        """What the page-locked buffers add to the process's locked memory (``VmLck``): each rounded to a page."""
        return sum(_page_rounded(b.nbytes) for b in self.buffers if b.pinned)

    @property
    def total_bytes(self) -> int:
        """Every buffer, pinned or not."""
        return sum(b.nbytes for b in self.buffers)

    def describe(self) -> str:
        """One line per buffer and a total, in GiB, with bytes per trainable parameter."""
        lines = [f"{b.name}: {b.nbytes / 2**30:.2f} GiB{' pinned' if b.pinned else ''}" for b in self.buffers]
        per = self.total_bytes / max(1, self.parameters)
        lines.append(f"total: {self.total_bytes / 2**30:.2f} GiB ({per:.1f} bytes per trainable parameter; "
                     f"{self.pinned_bytes / 2**30:.2f} GiB pinned)")
        return "\n".join(lines)


def _device_type(device: Any) -> str:
    try:
        return torch.device(device).type
    except (TypeError, RuntimeError, ValueError):
        raise ConfigurationError(
            f"estimate_host_memory: device={device!r} is not a device; allowed: a torch.device or its name "
            f"('cuda', 'cpu', ...)"
        ) from None


def estimate_host_memory(module: nn.Module, config: AccumulationConfig | Mapping[str, Any], *,
                         world_size: int = 1, device: Any = "cuda") -> HostMemoryEstimate:
    """The host buffers one rank's :class:`~optimized.accumulation.ZeroEngine` allocates for ``module`` (any
    device, ``meta`` included: only shapes and ``requires_grad`` are read) under ``config`` (the engine's config,
    a dict or an ``AccumulationConfig``) at ``world_size`` ranks, on ``device``'s type. Raises
    ``ConfigurationError`` for an invalid argument and for the update paths whose host memory it does not estimate
    (stage 0/1 or SGD offload, ``nvme``, R28's split, any run on the host that keeps its state unpinned)."""
    if not isinstance(module, nn.Module):
        raise ConfigurationError(f"estimate_host_memory: module={type(module).__name__} must be a torch.nn.Module")
    if type(world_size) is not int or world_size < 1:
        raise ConfigurationError(f"estimate_host_memory: world_size={world_size!r} must be an int >= 1")
    on_device = _device_type(device) != "cpu"
    cfg = config if isinstance(config, AccumulationConfig) else AccumulationConfig.from_dict(
        dict(config), world_size=world_size)
    trainable = [(n, p.shape) for n, p in module.named_parameters() if p.requires_grad]
    frozen = [(n, p.shape) for n, p in module.named_parameters() if not p.requires_grad]
    if not trainable:
        raise ConfigurationError("estimate_host_memory: module has no parameter with requires_grad=True; "
                                 "allowed: at least one")
    layout, frozen_layout = build_layout(trainable, world_size), build_layout(frozen, world_size)
    stage = cfg.zero_stage
    params_on_host = stage == 3 and (cfg.offload_param == "cpu" or not on_device)
    plan = BufferPlan(
        config=cfg, stage=stage, master_numel=layout.total if stage == 0 else layout.partition_size,
        partition_size=layout.partition_size, on_device=on_device, params_on_host=params_on_host,
    )
    buffers = list(update_path_class(cfg).planned_host_buffers(plan))
    if params_on_host:  # stage 3's parameter partitions (LiveWeights), pinned with offload_param
        pinned = cfg.offload_param == "cpu"
        buffers.append(plan.buffer("parameter partition", layout.partition_size, cfg.model_dtype, pinned=pinned))
        if frozen_layout.partition_size:
            buffers.append(plan.buffer("frozen parameter partition", frozen_layout.partition_size,
                                       cfg.model_dtype, pinned=pinned))
    return HostMemoryEstimate(tuple(buffers), sum(p.numel() for p in module.parameters() if p.requires_grad))
