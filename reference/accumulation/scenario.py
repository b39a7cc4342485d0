"""The reference's scenario runner (R26): one :class:`~reference.accumulation.engine.AccumulationEngine`
simulating every rank in this process.

The scenario and trace types are the area's contract (:mod:`reference.contract.accumulation_scenario`; the
package re-exports them); what is the reference's own is how it runs them: every rank's forward on its own copy of the
model, one ``backward`` with the list of losses, the trace recorded straight from the engine.
"""

from __future__ import annotations

import torch

from reference.accumulation.engine import AccumulationEngine
from reference.contract.accumulation_scenario import (
    ApplyDelayedUpdate,
    Backward,
    BackwardRecord,
    ControlRecord,
    Counters,
    EnterNoSync,
    Record,
    Scenario,
    SetBoundary,
    Step,
    StepRecord,
    Trace,
    compute_loss,
    micro_batch,
)
from reference.contract.errors import ConfigurationError

__all__ = ["build_engine", "run_scenario"]


# ---- the reference runner ----------------------------------------------------------------------------------


def _counters(engine: AccumulationEngine) -> Counters:
    return Counters(engine.micro_steps, engine.global_steps, engine.global_samples)


def build_engine(scenario: Scenario, *, device: torch.device | str = "cpu") -> AccumulationEngine:
    """The reference engine for ``scenario`` (model built from the scenario's spec and seed)."""
    return AccumulationEngine(
        lambda: scenario.model.build(scenario.seed), scenario.config, scenario.world_size, device=device
    )


def run_scenario(scenario: Scenario, *, device: torch.device | str = "cpu") -> Trace:
    """Run ``scenario`` on the reference engine and return its trace (R26)."""
    if not isinstance(scenario, Scenario):
        raise ConfigurationError(f"scenario={scenario!r} must be a reference.accumulation.Scenario")
    engine = build_engine(scenario, device=device)
    dtype = scenario.config.model_dtype
    records: list[Record] = []
    no_sync_stack: list = []
    micro_index = 0
    try:
        initial = engine.full_parameters()
        for i, call in enumerate(scenario.calls):
            if isinstance(call, Backward):
                boundary = engine.is_gradient_accumulation_boundary()
                losses = []
                for r in range(scenario.world_size):
                    x, y = micro_batch(scenario, micro_index, scenario.data_rank(r))
                    losses.append(compute_loss(engine.module(r), x, y, dtype))
                divided = [loss / call.loss_divisor if call.loss_divisor != 1 else loss for loss in losses]
                engine.backward(divided, scale_wrt_gas=call.scale_wrt_gas)
                micro_index += 1
                records.append(
                    BackwardRecord(i, boundary, tuple(loss.detach().clone() for loss in losses), _counters(engine))
                )
            elif isinstance(call, Step):
                out = engine.step()
                records.append(
                    StepRecord(
                        i,
                        out.boundary,
                        _counters(engine),
                        out.grad_norm,
                        out.clip_coef,
                        out.gradients,
                        engine.full_parameters(),
                    )
                )
            elif isinstance(call, SetBoundary):
                engine.set_gradient_accumulation_boundary(call.flag)
                records.append(ControlRecord(i, call, engine.is_gradient_accumulation_boundary()))
            elif isinstance(call, ApplyDelayedUpdate):
                engine.apply_delayed_update()
                records.append(ControlRecord(i, call, engine.is_gradient_accumulation_boundary()))
            elif isinstance(call, EnterNoSync):
                ctx = engine.no_sync()
                ctx.__enter__()
                no_sync_stack.append(ctx)
                records.append(ControlRecord(i, call, engine.is_gradient_accumulation_boundary()))
            else:
                if not no_sync_stack:
                    raise ConfigurationError(f"calls[{i}] is ExitNoSync without a matching EnterNoSync")
                no_sync_stack.pop().__exit__(None, None, None)
                records.append(ControlRecord(i, call, engine.is_gradient_accumulation_boundary()))
    finally:
        while no_sync_stack:
            no_sync_stack.pop().__exit__(None, None, None)
        engine.destroy()
    return Trace(scenario, initial, tuple(records))
