"""The plugin author's contract in one place: per area, the names an area module provides and their signatures.

Each area of :data:`reference.contract.implementation.AREAS` has one :class:`typing.Protocol` below, written so
that the *module* implementing the area satisfies it (PEP 544: a module is an instance of a protocol whose
members it has): a method here is a module-level function there (``self`` stands for the module), an annotation
``type[X]`` is a class. The suite drives an implementation through these names only, so this is the whole of
what it needs; a module may export more. What a member's annotation asks for, exactly:

- ``type[C]`` with ``C`` a contract class (``PinnedStats``, ``OffloadConfig``, the error classes ...): the
  module's member is that class or a subclass. These types live in ``reference.contract`` and are shared, so
  the suite can compare values across implementations; an implementation re-exports them.
- ``type[P]`` with ``P`` one of the ``...Class`` protocols here: a class of the implementation's own whose
  methods have compatible signatures (the data attributes and properties in ``P`` are documentation).
- a method: a callable whose signature accepts every call the protocol's signature accepts: the same positional
  parameters in the same order, keyword parameters by the same name, the same defaults (a contract default
  ``...``: a default of the implementation's choosing); parameters of its own only with defaults. A native
  function without an inspectable signature is read from its docstring's first line (pybind11 writes
  ``name(arg, ...) -> type`` there).
- a plain annotation (``int``, ``tuple[str, ...]``): a value of that type.

Members of :data:`OPTIONAL_INTERFACES` are checked where the module has them (``stress_registry``: a
production build may leave it out); members of :data:`CAPABILITY_INTERFACES` are required when the
implementation declares the capability named there, those of :data:`UNLESS_CAPABILITY_INTERFACES` when it does
not (``run_scenario``: with a declared ``ZeroEngine`` the harness runs scenarios on it).

An implementation may declare single calls unsupported (``Implementation(unsupported={"pinning.pin_empty_like":
"why"})``, names in :func:`call_names`): the interface check and every test marked as exercising the call are
then skipped with that reason, instead of failing. The checker is ``conformance.harness.interface_check``; the
self-test ``conformance/selftest/test_contract_interfaces.py`` holds both of hostoffload's implementations to
these protocols and their ``__all__``.

Contract: read by implementations (to know what to provide), by ``Implementation`` (to validate
``unsupported``) and by the suite. It imports nothing heavy (of the contract, only ``io_errors``, for the io
area's error names): annotations stay strings here and are resolved against :func:`contract_namespace` by the
checker.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

from reference.contract import io_errors

if TYPE_CHECKING:  # resolved at check time by contract_namespace(); importing them here would import torch
    import os
    from collections.abc import Callable, Iterator, Mapping

    import torch

    from reference.contract.accumulation_config import AccumulationConfig
    from reference.contract.accumulation_scenario import Scenario, Trace
    from reference.contract.accumulation_step import OptimizerState, StepOutcome
    from reference.contract.errors import ConfigurationError, MissingDependencyError, UnsupportedOperationError
    from reference.contract.io_config import SwapConfig
    from reference.contract.io_errors import SwapError
    from reference.contract.io_stats import SwapStats
    from reference.contract.offload_config import OffloadConfig
    from reference.contract.offload_stats import OffloadStats
    from reference.contract.optimizer_kernels import AdamKernel
    from reference.contract.pinning_rules import PinnedRange, PinnedStats


# -- pinning ---------------------------------------------------------------------------------------------------
class PinningArea(Protocol):
    """docs/usage.md, "Pinning". ``pinned_stats()`` is what the suite's leak checks compare (next to what the
    harness observes itself: VmLck, the accelerator's registrations)."""

    PinnedStats: type[PinnedStats]

    def pin_memory(self, t: torch.Tensor, *, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor: ...
    def pin_empty(self, *shape: int | tuple[int, ...], dtype: torch.dtype | None = None,
                  device: object = None) -> torch.Tensor: ...
    def pin_empty_like(self, t: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor: ...
    def is_pinned(self, t: torch.Tensor) -> bool: ...
    def unpin(self, t: torch.Tensor) -> bool: ...
    def pinned_stats(self) -> PinnedStats: ...  # type: ignore[valid-type]  # the class, not the attribute above


# -- ranges ----------------------------------------------------------------------------------------------------
class RangeRegistryClass(Protocol):
    """A set of non-overlapping byte ranges with whole-extent containment (docs/usage.md, "Range recognition")."""

    def add(self, start: int, nbytes: int, owner: int = 0) -> None: ...
    def remove(self, start: int) -> bool: ...
    def find(self, ptr: int) -> PinnedRange | None: ...
    def contains(self, ptr: int, nbytes: int) -> bool: ...
    def ranges(self) -> list[PinnedRange]: ...
    def total_bytes(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, extent: tuple[int, int], /) -> bool: ...


class RangesArea(Protocol):
    PinnedRange: type[PinnedRange]
    RangeRegistry: type[RangeRegistryClass]

    def global_registry(self) -> RangeRegistryClass: ...
    def tensor_extent(self, t: torch.Tensor) -> tuple[int, int]: ...
    def extent_is_registered(self, t: torch.Tensor, registry: RangeRegistryClass | None = None) -> bool: ...


class RangesStress(Protocol):
    """Optional: a native stress run of the registry (threads without the GIL); the suite runs it when present
    and the implementation declares ``concurrent_registry_reads``."""

    def stress_registry(self, readers: int = 4, writers: int = 4,
                        ops_per_writer: int = 20_000) -> dict[str, object]: ...


# -- offload ---------------------------------------------------------------------------------------------------
class ActivationOffloadClass(Protocol):
    """docs/offload.md: a context manager that moves saved activations to pinned host memory."""

    config: OffloadConfig
    stats: OffloadStats

    def __init__(self, config: OffloadConfig | None = None, *, accelerator: Any = None, **knobs: Any) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any, /) -> None: ...
    def close(self) -> None: ...
    def reset_stats(self) -> None: ...


class OffloadArea(Protocol):
    ActivationOffload: type[ActivationOffloadClass]
    OffloadConfig: type[OffloadConfig]
    OffloadStats: type[OffloadStats]
    MissingDependencyError: type[MissingDependencyError]
    ConfigurationError: type[ConfigurationError]
    UnsupportedOperationError: type[UnsupportedOperationError]

    def checkpoint(self, function: Callable[..., Any], *args: Any, use_reentrant: bool = False,
                   offload: Any = None, preserve_rng_state: bool = True, **kwargs: Any) -> Any: ...
    def current_manager(self) -> Any: ...
    def active_managers(self) -> tuple[Any, ...]: ...
    def mark_checkpoint_input(self, t: object) -> None: ...


# -- accumulation ----------------------------------------------------------------------------------------------
class AccumulationArea(Protocol):
    """docs/accumulation.md: a single-process run of a shared ``Scenario`` gives the ``Trace`` the reference
    gives (R1-R27)."""

    AccumulationConfig: type[AccumulationConfig]
    ConfigurationError: type[ConfigurationError]
    UnsupportedOperationError: type[UnsupportedOperationError]


class ScenarioRunner(Protocol):
    """How the suite gets a ``Trace``: the area module's own ``run_scenario``. Required of an implementation
    without a distributed engine; one that declares ``distributed_engine`` may leave it out, and the harness then
    runs each scenario on the declared ``ZeroEngine`` in its own rank processes
    (``conformance.harness.engine_runner.run_engine_scenario``): a multi-process runner is test machinery, not
    product."""

    def run_scenario(self, scenario: Scenario) -> Trace: ...


class ZeroEngineClass(Protocol):
    """docs/extending.md, "Distributed engine", and docs/zero.md: one object per rank."""

    micro_steps: int
    global_steps: int
    global_samples: int

    def __init__(self, model: Any, config: AccumulationConfig | Mapping[str, Any], /, *, process_group: Any = None,
                 device: Any = None, record_gradients: bool = False, bucket_elements: int | None = ...,
                 prefetch: bool = True) -> None: ...
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None: ...
    def step(self) -> StepOutcome: ...
    def no_sync(self) -> Iterator[None]: ...
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None: ...
    def is_gradient_accumulation_boundary(self) -> bool: ...
    def full_parameters(self) -> dict[str, torch.Tensor]: ...
    def master_partition(self) -> torch.Tensor: ...
    def optimizer_state(self) -> OptimizerState: ...
    def pinned_buffers(self) -> tuple[torch.Tensor, ...]: ...
    def swap_stats(self) -> Any: ...
    def zero_grad(self) -> None: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def destroy(self) -> None: ...


class DistributedAccumulation(Protocol):
    """With ``Capabilities(distributed_engine=True)``: the per-rank engine class."""

    ZeroEngine: type[ZeroEngineClass]


class CheckpointingZeroEngineClass(Protocol):
    """docs/zero.md, "Checkpoints" and "Checkpoints: what is guaranteed": DeepSpeed's signatures."""

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True) -> str: ...
    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, *,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict[str, Any]]: ...


class CheckpointingAccumulation(Protocol):
    """With ``Capabilities(accumulation_checkpoint=True)``: the engine class saves and loads checkpoints."""

    ZeroEngine: type[CheckpointingZeroEngineClass]


# -- io --------------------------------------------------------------------------------------------------------
class SwapRequestClass(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> torch.Tensor: ...
    def exception(self) -> SwapError | None: ...


class SwapHandleClass(Protocol):
    """docs/io.md: asynchronous tensor reads and writes to swap files, O_DIRECT where the memory allows."""

    def __init__(self, queue_depth: int = 8, block_size: int = 1048576, num_threads: int = 4,
                 use_o_direct: bool = True) -> None: ...
    def __enter__(self) -> SwapHandleClass: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any, /) -> None: ...
    def read(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequestClass: ...
    def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> SwapRequestClass: ...
    def wait(self, request: SwapRequestClass | None = None) -> None: ...
    def stats(self) -> SwapStats: ...
    def close(self) -> None: ...


class IoArea(Protocol):
    SwapHandle: type[SwapHandleClass]
    SwapRequest: type[SwapRequestClass]
    SwapConfig: type[SwapConfig]
    SwapStats: type[SwapStats]
    HEADER_SIZE: int
    DIRECT_ALIGNMENT: int
    # ... and every error class of the area (``SwapError: type[SwapError]`` ...), added below from the one list.

    def record_nbytes(self, nbytes: int) -> int: ...
    def record_span(self, nbytes: int, alignment: int = 4096) -> int: ...


# -- optimizer_kernels -----------------------------------------------------------------------------------------
class OptimizerKernelsArea(Protocol):
    """reference/contract/optimizer_kernels.py: the Adam / AdamW kernels an implementation declares, each judged
    against R16 (bitwise, or within the tolerance it declares). An empty tuple declares none."""

    OPTIMIZER_KERNELS: tuple[AdamKernel, ...]


# The io area offers each of its error classes by name: the contract lists them once (io_errors.__all__), so the
# protocol's members are derived from that list instead of spelled out again.
IoArea.__annotations__.update({name: f"type[{name}]" for name in io_errors.__all__})


#: area -> the protocol its module satisfies (every name there is required).
AREA_INTERFACES: dict[str, type] = {
    "pinning": PinningArea,
    "ranges": RangesArea,
    "offload": OffloadArea,
    "accumulation": AccumulationArea,
    "io": IoArea,
    "optimizer_kernels": OptimizerKernelsArea,
}
#: area -> protocols whose members are checked only where the module has them.
OPTIONAL_INTERFACES: dict[str, tuple[type, ...]] = {"ranges": (RangesStress,), "accumulation": (ScenarioRunner,)}
#: (area, capability) -> the protocol the area's module satisfies unless the capability is declared (with it, the
#: protocol is checked where the module has its members: the harness provides them otherwise).
UNLESS_CAPABILITY_INTERFACES: dict[tuple[str, str], type] = {("accumulation", "distributed_engine"): ScenarioRunner}
#: (area, capability) -> the protocol the area's module satisfies too when the capability is declared.
CAPABILITY_INTERFACES: dict[tuple[str, str], type] = {
    ("accumulation", "distributed_engine"): DistributedAccumulation,
    ("accumulation", "accumulation_checkpoint"): CheckpointingAccumulation,
}


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The member names a protocol declares itself (annotations, then methods, in the order written).

    A method counts when its function's name is its attribute's name: that leaves out what ``typing.Protocol``
    installs (``__subclasshook__`` is ``_proto_hook``; an ``__init__`` not written is ``_no_init_or_replace_init``).
    """
    names = list(inspect.get_annotations(protocol))
    for name, value in protocol.__dict__.items():
        if inspect.isfunction(value) and value.__name__ == name and name not in names:
            names.append(name)
    return tuple(names)


def call_names(area: str) -> tuple[str, ...]:
    """The names of ``area`` an implementation may declare unsupported: every member of its protocols."""
    protocols = [AREA_INTERFACES[area], *OPTIONAL_INTERFACES.get(area, ())]
    protocols += [p for (a, _), p in CAPABILITY_INTERFACES.items() if a == area]
    return tuple(dict.fromkeys(n for p in protocols for n in protocol_members(p)))


def contract_namespace() -> dict[str, Any]:
    """The names the protocols' annotations use, imported now (torch included) for ``typing.get_type_hints``."""
    import collections.abc
    import os

    import torch

    from reference.contract import (
        accumulation_config,
        accumulation_scenario,
        accumulation_step,
        errors,
        io_config,
        io_errors,
        io_stats,
        offload_config,
        offload_hf,
        offload_stats,
        optimizer_kernels,
        pinning_rules,
    )

    namespace: dict[str, Any] = {"os": os, "torch": torch, "Any": Any}
    for name in ("Callable", "Iterator", "Mapping"):
        namespace[name] = getattr(collections.abc, name)
    for module in (accumulation_config, accumulation_scenario, accumulation_step, errors, io_config, io_errors,
                   io_stats, offload_config, offload_hf, offload_stats, optimizer_kernels, pinning_rules):
        namespace.update({k: v for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_")})
    namespace.update({p.__name__: p for p in PROTOCOLS})
    return namespace


#: Every protocol of this module (what :func:`contract_namespace` and ``reference.contract.catalog`` walk).
PROTOCOLS = (PinningArea, RangeRegistryClass, RangesArea, RangesStress, ActivationOffloadClass, OffloadArea,
              AccumulationArea, ScenarioRunner, ZeroEngineClass, DistributedAccumulation, CheckpointingZeroEngineClass,
              CheckpointingAccumulation, SwapRequestClass, SwapHandleClass, IoArea, OptimizerKernelsArea)

__all__ = [
    "AREA_INTERFACES",
    "CAPABILITY_INTERFACES",
    "OPTIONAL_INTERFACES",
    "PROTOCOLS",
    "UNLESS_CAPABILITY_INTERFACES",
    "AccumulationArea",
    "ActivationOffloadClass",
    "CheckpointingAccumulation",
    "CheckpointingZeroEngineClass",
    "DistributedAccumulation",
    "IoArea",
    "OffloadArea",
    "OptimizerKernelsArea",
    "PinningArea",
    "RangeRegistryClass",
    "RangesArea",
    "RangesStress",
    "ScenarioRunner",
    "SwapHandleClass",
    "SwapRequestClass",
    "ZeroEngineClass",
    "call_names",
    "contract_namespace",
    "protocol_members",
]
