"""Hypothesis strategies for the accumulation area: configs, call sequences and whole scenarios.

Scenarios stay small on purpose (a 4-6-3 MLP, at most 4 ranks, a handful of micro-batches) so that one example
runs in tens of milliseconds: the rules are about the *order* of operations, which a tiny model exercises as
well as a big one, and the ``ci`` profile has to run hundreds of them on 2 cores. Every drawn scenario is
valid (no rejected option or call sequence); rejections are tested explicitly in
test_accumulation_rejections.py.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference.accumulation import (
    AccumulationConfig,
    ApplyDelayedUpdate,
    Backward,
    EnterNoSync,
    ExitNoSync,
    ModelSpec,
    OptimizerConfig,
    Scenario,
    SetBoundary,
    Step,
)

STAGES = (0, 1, 2, 3)
WORLD_SIZES = (1, 2, 3, 4)


@st.composite
def optimizer_configs(draw: st.DrawFn, types: tuple[str, ...] = ("sgd", "adam", "adamw")) -> OptimizerConfig:
    kind = draw(st.sampled_from(types))
    return OptimizerConfig(
        type=kind,
        lr=draw(st.sampled_from((1e-3, 1e-2, 0.1))),
        betas=draw(st.sampled_from(((0.9, 0.999), (0.8, 0.99)))),
        eps=draw(st.sampled_from((1e-8, 1e-6))),
        weight_decay=draw(st.sampled_from((0.0, 0.01))),
        momentum=draw(st.sampled_from((0.0, 0.9))) if kind == "sgd" else 0.0,
    )


@st.composite
def accumulation_configs(
    draw: st.DrawFn,
    stages: tuple[int, ...] = STAGES,
    managed: bool | None = None,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    max_gas: int = 3,
) -> AccumulationConfig:
    """Valid configs. ``gradient_clipping`` is drawn from off / default / tiny (the tiny one always clips)."""
    stage = draw(st.sampled_from(stages))
    is_managed = draw(st.booleans()) if managed is None else managed
    dtype = draw(st.sampled_from(dtypes))
    return AccumulationConfig(
        zero_stage=stage,
        train_micro_batch_size_per_gpu=draw(st.integers(1, 2)),
        gradient_accumulation_steps=draw(st.integers(1, max_gas)),
        managed_gradient_accumulation=is_managed,
        dtype=dtype,
        communication_data_type=draw(st.sampled_from((None, "fp32", "bf16"))),
        grad_accum_dtype=draw(st.sampled_from((None, "fp32", "bf16"))),
        gradient_clipping=draw(st.sampled_from((0.0, 1.0, 0.05))),
        optimizer=draw(optimizer_configs()),
        offload_optimizer=draw(st.sampled_from(("none", "cpu"))),
        offload_param=draw(st.sampled_from(("none", "cpu"))) if stage == 3 else "none",
        # overlap_comm changes nothing numerically; it is drawn where it is allowed so that it is exercised.
        overlap_comm=draw(st.booleans()) if (is_managed or stage >= 2) else False,
    )


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    return ModelSpec(
        frozen_layer=draw(st.booleans()),
        unused_parameter=draw(st.booleans()),
        checkpoint=draw(st.booleans()),
    )


@st.composite
def call_sequences(draw: st.DrawFn, config: AccumulationConfig, max_steps: int = 4) -> tuple:
    """A valid call sequence for ``config``: groups of 0-3 backwards each followed by one step.

    Managed mode sometimes sets the boundary override before a group; stages 0/1 sometimes wrap a group's
    backwards in ``no_sync()``. At least one step is always a boundary (a trailing override-True group is
    added when the drawn groups contain none), so every trace has something to compare.
    """
    calls: list = []
    n_steps = draw(st.integers(1, max_steps))
    micro_steps = 0
    override: bool | None = None
    any_boundary = False
    for _ in range(n_steps):
        n_back = draw(st.sampled_from((0, 1, 1, 1, 2, 3)))
        if config.managed_gradient_accumulation and draw(st.integers(0, 3)) == 0:
            override = draw(st.booleans())
            calls.append(SetBoundary(override))
        wrap = config.zero_stage <= 1 and n_back > 0 and draw(st.integers(0, 3)) == 0
        if wrap:
            calls.append(EnterNoSync())
        for _ in range(n_back):
            calls.append(Backward(scale_wrt_gas=draw(st.booleans()), loss_divisor=draw(st.sampled_from((1, 1, 2)))))
        if wrap:
            calls.append(ExitNoSync())
        calls.append(Step())
        if config.managed_gradient_accumulation:
            boundary = override if override is not None else (micro_steps + 1) % config.gradient_accumulation_steps == 0
            micro_steps += 1
        else:
            boundary = True
        any_boundary = any_boundary or boundary
    if not any_boundary:
        if config.managed_gradient_accumulation:
            calls.append(SetBoundary(True))
        calls.extend([Backward(), Step()])
    return tuple(calls)


@st.composite
def scenarios(
    draw: st.DrawFn,
    stages: tuple[int, ...] = STAGES,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    managed: bool | None = None,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> Scenario:
    config = draw(accumulation_configs(stages=stages, managed=managed, dtypes=dtypes))
    return Scenario(
        config=config,
        world_size=draw(st.sampled_from(world_sizes)),
        calls=draw(call_sequences(config)),
        model=draw(model_specs()),
        seed=draw(st.integers(0, 2**16)),
        name="drawn",
    )


@st.composite
def delayed_update_scenarios(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2)) -> Scenario:
    """Valid ``delayed_parameter_update`` scenarios (R27): what R19 allows with it (stages 2/3, ``cpu`` optimizer
    offload, Adam/AdamW), the rest drawn as in :func:`scenarios`, and ``ApplyDelayedUpdate`` calls inserted at
    random points between calls (including before any boundary, where it changes nothing)."""
    base = draw(accumulation_configs(stages=(2, 3)))
    config = base.replace(
        optimizer={**base.to_dict()["optimizer"], "type": draw(st.sampled_from(("adam", "adamw"))), "momentum": 0.0},
        offload_optimizer="cpu",
        delayed_parameter_update=True,
        delayed_update_warmup=draw(st.sampled_from((0, 0, 1, 2))),
    )
    calls = list(draw(call_sequences(config, max_steps=5)))
    for _ in range(draw(st.integers(0, 2))):
        calls.insert(draw(st.integers(0, len(calls))), ApplyDelayedUpdate())
    return Scenario(
        config=config,
        world_size=draw(st.sampled_from(world_sizes)),
        calls=tuple(calls),
        model=draw(model_specs()),
        seed=draw(st.integers(0, 2**16)),
        name="drawn-delayed",
    )


#: R28's shares the suite pins: all on the host, half, all on the device, and the measured choice.
SPLIT_SHARES = (0.0, 0.5, 1.0, "auto")


#: R29's state precisions; the suite draws the compressed one where an implementation declares it.
STATE_PRECISIONS = ("fp32", "bf16")


@st.composite
def split_update_scenarios(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2),
                           delayed: tuple[bool, ...] = (False,),
                           state_precisions: tuple[str, ...] = ("fp32",)) -> Scenario:
    """Valid ``gpu_share`` scenarios (R28): R19's domain for a share (stages 2/3, ``cpu`` optimizer offload,
    Adam/AdamW), a share from :data:`SPLIT_SHARES`, the delayed update (R27) drawn from ``delayed`` (with
    ``ApplyDelayedUpdate`` calls inserted when on), the moments' ``state_precision`` (R29) from
    ``state_precisions``, the rest drawn as in :func:`scenarios`."""
    base = draw(accumulation_configs(stages=(2, 3)))
    with_delay = draw(st.sampled_from(delayed))
    config = base.replace(
        optimizer={**base.to_dict()["optimizer"], "type": draw(st.sampled_from(("adam", "adamw"))), "momentum": 0.0},
        offload_optimizer="cpu",
        delayed_parameter_update=with_delay,
        delayed_update_warmup=draw(st.sampled_from((0, 1))),  # R27: with the delay, warm-up or none
        gpu_share=draw(st.sampled_from(SPLIT_SHARES)),
        state_precision=draw(st.sampled_from(state_precisions)),
    )
    calls = list(draw(call_sequences(config, max_steps=4)))
    if with_delay:
        for _ in range(draw(st.integers(0, 1))):
            calls.insert(draw(st.integers(0, len(calls))), ApplyDelayedUpdate())
    return Scenario(
        config=config,
        world_size=draw(st.sampled_from(world_sizes)),
        calls=tuple(calls),
        model=draw(model_specs()),
        seed=draw(st.integers(0, 2**16)),
        name="drawn-split",
    )


@st.composite
def overlapped_update_scenarios(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2),
                                shares: tuple = (0.0,)) -> Scenario:
    """Valid ``host_update_start: last_backward`` scenarios (R30): R19's domain (stages 2/3, ``cpu`` optimizer
    offload, Adam/AdamW, a managed schedule, no delay), a ``gpu_share`` from ``shares`` (R28; share 0 unless the
    caller's implementation splits), either state precision (R29), clipping off / default / tiny (the tiny one
    always clips), boundary overrides, the rest drawn as in :func:`scenarios`."""
    base = draw(accumulation_configs(stages=(2, 3), managed=True))
    config = base.replace(
        optimizer={**base.to_dict()["optimizer"], "type": draw(st.sampled_from(("adam", "adamw"))), "momentum": 0.0},
        offload_optimizer="cpu",
        state_precision=draw(st.sampled_from(("fp32", "bf16"))),
        host_update_start="last_backward",
        gpu_share=draw(st.sampled_from(shares)),
    )
    return Scenario(
        config=config,
        world_size=draw(st.sampled_from(world_sizes)),
        calls=tuple(draw(call_sequences(config, max_steps=4))),
        model=draw(model_specs()),
        seed=draw(st.integers(0, 2**16)),
        name="drawn-overlap",
    )


def optimizer_values(n: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    """``n`` normal values times ``scale`` with exact zeros every ``n // 7`` (sqrt(0) and 0 / denom in R16): the
    inputs the optimizer-kernel tests (native CPU, fused device) hold to the formula."""
    x = torch.randn(n, generator=gen) * scale
    x[:: max(1, n // 7)] = 0.0
    return x


#: fp32 gradients whose bf16 rounding (R29) is delicate, for the optimizer-kernel tests: with betas (0, 0) a step
#: stores ``m = g`` and ``v = g * g`` before rounding, so these are rounded as they are. Ties to even, down and up
#: (``1 + 2^-8``, ``1 + 3 * 2^-8``), and ``g * g`` an exact tie (``1.0625^2 = 1 + 2^-3 + 2^-8``); the largest values
#: that round to infinity or stay finite; subnormals of fp32 and of bf16; signed zeros; infinities and NaN.
BF16_ROUNDING_CASES = (
    1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 2.0**-8 + 2.0**-20, 1.0625, -1.3125, 3.3961e38,
    3.3895e38, 3.4028235e38, -3.3961e38, 1e-40, -1e-40, 2.0**-133, 3 * 2.0**-134, 1.4e-45, 1e-38, 0.0, -0.0, 1e30,
    -1e-30, 6.5e-5, 1e20, float("inf"), -float("inf"), float("nan"),
)
