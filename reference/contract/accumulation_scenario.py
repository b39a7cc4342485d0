"""Scenarios (what to run) and traces (what came out): the language of the area's entry point (R26).

Shared by every implementation of the area (the contract): an implementation's ``run_scenario(scenario) ->
Trace`` takes these types and returns these records, and the conformance suite builds the one and compares the
other. A :class:`Scenario` is plain, picklable data: a config, a world size, a model spec + seed, and a sequence
of engine calls. The data each rank sees is a pure function of ``(seed, micro-batch index, rank)``
(:func:`micro_batch`), so a runner that spawns W worker processes can rebuild everything inside each worker from
the scenario alone; a multi-process runner lets each rank record what it sees and merges the per-rank records
with :func:`merge_rank_traces` (the merge rules are on each record type). Errors a call raises must reach the
caller of ``run_scenario`` as the same class with the same kind of message (ConfigurationError for a bad config,
UnsupportedOperationError for a rejected call sequence).

The runners themselves are implementations and live with them (the reference's in
``reference.accumulation.scenario``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError

# ---- the model ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A small MLP that exercises every parameter category the rules distinguish.

    Layout of the forward: ``inp`` (trainable) -> tanh -> block -> ``out``, where block is ``frozen``
    (``requires_grad=False``, R7/R8/R21) -> tanh. ``unused`` is a trainable parameter that never takes part in
    the forward (R7: zero gradient). With ``checkpoint=True`` the block *and* ``out`` run under non-reentrant
    ``torch.utils.checkpoint``, so the backward replays a forward that needs the frozen weight (R21).
    """

    in_features: int = 4
    hidden: int = 6
    out_features: int = 3
    frozen_layer: bool = True
    unused_parameter: bool = True
    checkpoint: bool = False

    def __post_init__(self) -> None:
        for name in ("in_features", "hidden", "out_features"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ConfigurationError(f"ModelSpec.{name}={v!r} must be an int >= 1")

    def build(self, seed: int) -> nn.Module:
        """The fp32 model initialised from ``seed`` (the engine casts it to the configured dtype)."""
        gen = torch.Generator().manual_seed(seed)
        return AccumulationMLP(self, gen)


class AffineMap(nn.Module):
    """``y = sum_j x_j * W[:, j] + b`` written as an elementwise product and a sum, not a GEMM.

    Why not ``nn.Linear``: a GEMM's summation order depends on the BLAS / oneDNN build and the CPU's vector
    width, so the same scenario could give different last bits on two CI hosts, and oneDNN's bf16 GEMM on CPUs
    without native bf16 costs milliseconds per call on these tiny shapes. A product + ``torch.sum`` is plain
    ATen on every build, and fast. The layer's parameters are ordinary module parameters, so every ZeRO rule
    (R12, R21) applies to it exactly as to ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, gen: torch.Generator) -> None:
        super().__init__()
        bound = 1.0 / in_features**0.5
        self.weight = nn.Parameter(torch.rand(out_features, in_features, generator=gen) * 2 * bound - bound)
        self.bias = nn.Parameter(torch.rand(out_features, generator=gen) * 2 * bound - bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x.unsqueeze(-2) * self.weight, dim=-1) + self.bias


class AccumulationMLP(nn.Module):
    def __init__(self, spec: ModelSpec, gen: torch.Generator) -> None:
        super().__init__()
        self.spec = spec
        self.inp = AffineMap(spec.in_features, spec.hidden, gen)
        self.frozen = AffineMap(spec.hidden, spec.hidden, gen) if spec.frozen_layer else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.out = AffineMap(spec.hidden, spec.out_features, gen)
        self.unused = nn.Parameter(torch.rand(5, generator=gen)) if spec.unused_parameter else None

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        if self.frozen is not None:
            h = torch.tanh(self.frozen(h))
        return self.out(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.spec.checkpoint:
            return checkpoint(self._tail, h, use_reentrant=False)
        return self._tail(h)


def micro_batch(scenario: Scenario, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (fp32) of micro-batch ``index`` on ``rank``: a pure function of the scenario's
    seed."""
    spec = scenario.model
    b = scenario.config.train_micro_batch_size_per_gpu
    gen = torch.Generator().manual_seed(((scenario.seed * 1_000_003 + index) * 257 + rank) % (2**63))
    x = torch.randn(b, spec.in_features, generator=gen)
    y = torch.randn(b, spec.out_features, generator=gen)
    return x, y


def compute_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean squared error in the model dtype, on the module's device; every runner uses this one function.

    The device is that of the module's first parameter (a released ZeRO-3 parameter keeps its device), so the
    host-generated micro-batch follows the model wherever the runner put it.
    """
    device = next(module.parameters()).device
    out = module(x.to(device=device, dtype=dtype))
    diff = out - y.to(device=device, dtype=dtype)
    return torch.mean(diff * diff)


# ---- calls -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backward:
    """Every rank runs a forward on its next micro-batch and ``engine.backward(loss / loss_divisor,
    scale_wrt_gas)``.

    ``loss_divisor`` models a user scaling the loss by hand (``loss / N``), the unmanaged-mode idiom of R22.
    """

    scale_wrt_gas: bool = True
    loss_divisor: int = 1


@dataclass(frozen=True)
class Step:
    """``engine.step()``."""


@dataclass(frozen=True)
class SetBoundary:
    """``engine.set_gradient_accumulation_boundary(flag)``."""

    flag: bool


@dataclass(frozen=True)
class EnterNoSync:
    """Enter ``engine.no_sync()`` (left by the next :class:`ExitNoSync`)."""


@dataclass(frozen=True)
class ExitNoSync:
    """Leave the innermost ``engine.no_sync()``."""


@dataclass(frozen=True)
class ApplyDelayedUpdate:
    """``engine.apply_delayed_update()`` (R27): the last boundary's update reaches the parameters now. Only in
    scenarios of implementations that declare ``accumulation_delayed_parameter_update``."""


Call = Backward | Step | SetBoundary | EnterNoSync | ExitNoSync | ApplyDelayedUpdate


@dataclass(frozen=True)
class Scenario:
    config: AccumulationConfig
    world_size: int
    calls: tuple[Call, ...]
    model: ModelSpec = field(default_factory=ModelSpec)
    seed: int = 0
    #: Rank whose data each simulated rank reads: ``data_ranks[r]`` feeds rank r (default identity). Swapping
    #: ranks' data is how the suite checks that W=2 reductions do not depend on rank order (R24).
    data_ranks: tuple[int, ...] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.config, AccumulationConfig):
            object.__setattr__(self, "config", AccumulationConfig.from_dict(self.config))
        if type(self.world_size) is not int or self.world_size < 1:
            raise ConfigurationError(f"world_size={self.world_size!r} must be an int >= 1")
        object.__setattr__(self, "calls", tuple(self.calls))
        for i, c in enumerate(self.calls):
            if not isinstance(c, (Backward, Step, SetBoundary, EnterNoSync, ExitNoSync, ApplyDelayedUpdate)):
                raise ConfigurationError(
                    f"calls[{i}]={c!r} is not a call; allowed: Backward, Step, SetBoundary, EnterNoSync, ExitNoSync, "
                    f"ApplyDelayedUpdate"
                )
        if self.data_ranks is not None and sorted(self.data_ranks) != list(range(self.world_size)):
            raise ConfigurationError(
                f"data_ranks={self.data_ranks!r} must be a permutation of range(world_size={self.world_size})"
            )

    def data_rank(self, rank: int) -> int:
        return rank if self.data_ranks is None else self.data_ranks[rank]

    def describe(self) -> str:
        c = self.config
        calls = " ".join(_call_token(x) for x in self.calls)
        return (
            f"{self.name or 'scenario'}: stage={c.zero_stage} managed={c.managed_gradient_accumulation} "
            f"gas={c.gradient_accumulation_steps} world={self.world_size} dtype={c.dtype} "
            f"comm={c.communication_data_type} accum={c.grad_accum_dtype} clip={c.gradient_clipping} "
            f"opt={c.optimizer.type} offload_opt={c.offload_optimizer} offload_param={c.offload_param} "
            f"delayed_update={c.delayed_parameter_update} "
            f"model={self.model} seed={self.seed} calls=[{calls}]"
        )


def _call_token(c: Call) -> str:
    if isinstance(c, Backward):
        return f"B{'' if c.scale_wrt_gas else '!'}{'' if c.loss_divisor == 1 else f'/{c.loss_divisor}'}"
    if isinstance(c, Step):
        return "S"
    if isinstance(c, ApplyDelayedUpdate):
        return "A"
    if isinstance(c, SetBoundary):
        return f"set({c.flag})"
    return "[" if isinstance(c, EnterNoSync) else "]"


# ---- the trace ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    micro_steps: int
    global_steps: int
    global_samples: int


@dataclass(frozen=True)
class BackwardRecord:
    """One :class:`Backward` call. ``boundary``: ``is_gradient_accumulation_boundary()`` just before it.

    ``losses[r]``: rank r's loss as computed by the forward (model dtype, before any division by the engine).
    Merge rule for multi-process runners: losses are gathered in rank order; the flags/counters are rank 0's
    and every rank must agree (a disagreement is itself a defect to report).
    """

    call_index: int
    boundary: bool
    losses: tuple[torch.Tensor, ...]
    counters: Counters


@dataclass(frozen=True)
class StepRecord:
    """One :class:`Step` call (counters after it). At a boundary it also holds, from every rank's point of
    view:

    ``grad_norm`` (R14) and ``clip_coef`` (R15, ``None`` if not clipped), ``gradients``: the full reduced
    gradient of every trainable parameter before clipping, fp32 (assembled from the partitions in rank order),
    ``parameters``: every parameter (trainable, frozen, unused) after the step, full shape, model dtype. On a
    non-boundary step ``gradients``/``grad_norm``/``clip_coef`` are ``None`` and ``parameters`` is still
    recorded (R4 says it equals the previous one).
    """

    call_index: int
    boundary: bool
    counters: Counters
    grad_norm: float | None
    clip_coef: float | None
    gradients: dict[str, torch.Tensor] | None
    parameters: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ControlRecord:
    """A :class:`SetBoundary`, :class:`EnterNoSync`, :class:`ExitNoSync` or :class:`ApplyDelayedUpdate` call,
    with the boundary flag after it."""

    call_index: int
    call: Call
    boundary: bool


Record = BackwardRecord | StepRecord | ControlRecord


@dataclass(frozen=True)
class Trace:
    """Exactly one record per call of the scenario, in call order, plus the parameters before the first
    call."""

    scenario: Scenario
    initial_parameters: dict[str, torch.Tensor]
    records: tuple[Record, ...]

    def steps(self) -> list[StepRecord]:
        return [r for r in self.records if isinstance(r, StepRecord)]

    def boundaries(self) -> list[StepRecord]:
        return [r for r in self.records if isinstance(r, StepRecord) and r.boundary]

    @property
    def final_parameters(self) -> dict[str, torch.Tensor]:
        steps = self.steps()
        return steps[-1].parameters if steps else self.initial_parameters


@runtime_checkable
class ScenarioRunner(Protocol):
    """What an implementation's accumulation module provides as ``run_scenario`` (R26)."""

    def __call__(self, scenario: Scenario) -> Trace: ...


def merge_rank_traces(scenario: Scenario, per_rank: Sequence[Trace]) -> Trace:
    """Build the :class:`Trace` of a multi-process run from one trace per rank (R26).

    Rank r's trace holds, in each :class:`BackwardRecord`, only its own loss (``losses == (loss_r,)``); every
    other field is what that rank observed, with gradients and parameters already gathered to full tensors. The
    merged trace has the losses in rank order and everything else from rank 0; all ranks must agree on record
    kinds, call indices, boundary flags and counters (a disagreement is a bug in the engine, reported here).
    """
    if len(per_rank) != scenario.world_size:
        raise ConfigurationError(
            f"per_rank has {len(per_rank)} traces; allowed: exactly world_size={scenario.world_size}"
        )
    first = per_rank[0]
    n = len(first.records)
    for r, t in enumerate(per_rank):
        if len(t.records) != n:
            raise ConfigurationError(f"rank {r} recorded {len(t.records)} calls, rank 0 recorded {n}")
    merged: list[Record] = []
    for i in range(n):
        recs = [t.records[i] for t in per_rank]
        head = recs[0]
        for r, rec in enumerate(recs):
            same = type(rec) is type(head) and rec.call_index == head.call_index and rec.boundary == head.boundary
            if same and not isinstance(head, ControlRecord) and not isinstance(rec, ControlRecord):
                same = rec.counters == head.counters  # (rec's type is head's: checked just above)
            if not same:
                raise ConfigurationError(
                    f"ranks disagree at call {i}: rank 0 recorded {head!r:.200}, rank {r} recorded {rec!r:.200}"
                )
        if isinstance(head, BackwardRecord):
            backwards = [rec for rec in recs if isinstance(rec, BackwardRecord)]  # all of them: same type as head
            for r, rec in enumerate(backwards):
                if len(rec.losses) != 1:
                    raise ConfigurationError(f"rank {r}'s record {i} holds {len(rec.losses)} losses; allowed: 1")
            merged.append(
                BackwardRecord(head.call_index, head.boundary, tuple(rec.losses[0] for rec in backwards), head.counters)
            )
        else:
            merged.append(head)
    return Trace(scenario, first.initial_parameters, tuple(merged))


def scenario_calls(pattern: Sequence[str | Call]) -> tuple[Call, ...]:
    """Shorthand for tests and docs: ``"B"`` backward, ``"S"`` step, ``"T"``/``"F"`` set boundary,
    ``"["``/``"]"`` enter/leave no_sync, ``"A"`` apply the delayed update (R27); :class:`Call` objects pass
    through."""
    table: dict[str, Call] = {
        "A": ApplyDelayedUpdate(),
        "B": Backward(),
        "S": Step(),
        "T": SetBoundary(True),
        "F": SetBoundary(False),
        "[": EnterNoSync(),
        "]": ExitNoSync(),
    }
    out: list[Call] = []
    for token in pattern:
        if isinstance(token, str):
            if token not in table:
                raise ConfigurationError(f"pattern token {token!r} is unknown; allowed: {', '.join(table)}")
            out.append(table[token])
        else:
            out.append(token)
    return tuple(out)

__all__ = [
    "AccumulationMLP",
    "AffineMap",
    "ApplyDelayedUpdate",
    "Backward",
    "BackwardRecord",
    "Call",
    "ControlRecord",
    "Counters",
    "EnterNoSync",
    "ExitNoSync",
    "ModelSpec",
    "Record",
    "Scenario",
    "ScenarioRunner",
    "SetBoundary",
    "Step",
    "StepRecord",
    "Trace",
    "compute_loss",
    "merge_rank_traces",
    "micro_batch",
    "scenario_calls",
]
