"""Trace comparison, replay and error bounds for the accumulation area (docs/accumulation.md R13-R16, R23,
R25).

Every failure message names the record (call index and kind), the field, the parameter, the first differing
element with both values, and how many elements differ, so a red CI log is a usable bug report on its own.

"Equal" here has ``torch.equal`` semantics plus NaN: the same values at the same positions, NaN where the
expected trace has NaN, and the sign of zero not compared (R25: whether an accumulator starts from +0 or takes
the first gradient as is, is an implementation choice that changes only the sign of exact zeros).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from conformance.areas.lr_schedule_oracle import expected_betas, expected_lr
from reference.accumulation import (
    AccumulationConfig,
    ApplyDelayedUpdate,
    Backward,
    BackwardRecord,
    ControlRecord,
    FlatLayout,
    Scenario,
    Step,
    StepRecord,
    Trace,
    build_layout,
    compute_loss,
    flatten,
    global_grad_norm,
    init_state,
    micro_batch,
    optimizer_step,
    shard,
)

#: R15's epsilon in the clipping coefficient, stated here independently of the reference's constant.
CLIP_EPSILON = 1e-6


# ---- tensors -----------------------------------------------------------------------------------------------


def _first_mismatch(mask: torch.Tensor) -> tuple[int, ...]:
    idx = mask.nonzero()[0]
    return tuple(int(i) for i in idx)


def assert_tensor_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal shape, dtype and values (NaN matches NaN; -0 matches +0)."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: got {type(actual).__name__}, expected a tensor")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    both_nan = torch.isnan(a) & torch.isnan(e)
    bad = (a != e) & ~both_nan
    if bool(bad.any()):
        i = _first_mismatch(bad)
        diff = (a.double() - e.double()).abs()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ (dtype {a.dtype}); first at index {i}: "
            f"{a[i].item()!r} != expected {e[i].item()!r}; max |difference| {diff[bad].max().item():.3e}"
        )


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal shape, dtype and bit patterns (a NaN's payload and the sign of zero included): for values whose
    encoding a rule fixes, such as R29's stored moments."""
    assert_tensor_equal(actual, expected, what)
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual.detach().cpu().contiguous().view(width), expected.detach().cpu().contiguous().view(width)
    bad = a != e
    if bool(bad.any()):
        i = _first_mismatch(bad)
        mask = (1 << (8 * actual.element_size())) - 1
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} bit patterns differ; first at index {i}: "
            f"{int(a[i]) & mask:#x} != expected {int(e[i]) & mask:#x}"
        )


def assert_tensor_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol: float | torch.Tensor
) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise (``atol`` may be a per-element
    tensor)."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    bound = (atol.detach().cpu().double() if isinstance(atol, torch.Tensor) else atol) + rtol * e.abs()
    nan_ok = torch.isnan(a) & torch.isnan(e)
    bad = ~((a - e).abs() <= bound) & ~nan_ok
    if bool(bad.any()):
        i = _first_mismatch(bad)
        b = bound[i].item() if isinstance(bound, torch.Tensor) else bound
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements outside tolerance; first at index {i}: "
            f"{a[i].item()!r} vs expected {e[i].item()!r}, "
            f"|difference| {abs(a[i].item() - e[i].item()):.3e} > "
            f"allowed {b:.3e} (rtol={rtol}, atol={'per-element' if isinstance(atol, torch.Tensor) else atol})"
        )


def assert_float_match(actual: float | None, expected: float | None, what: str, rtol: float | None) -> None:
    if (actual is None) != (expected is None):
        raise AssertionError(f"{what}: {actual!r} != expected {expected!r}")
    if actual is None or expected is None:
        return
    if math.isnan(actual) and math.isnan(expected):
        return
    if rtol is None:
        if actual != expected:
            raise AssertionError(f"{what}: {actual!r} != expected {expected!r} (difference {actual - expected:.3e})")
    elif not abs(actual - expected) <= rtol * abs(expected) + 1e-300:
        raise AssertionError(f"{what}: {actual!r} vs expected {expected!r} differ by more than rtol={rtol}")


def assert_named_tensors(
    actual: dict[str, torch.Tensor] | None,
    expected: dict[str, torch.Tensor] | None,
    what: str,
    tol: tuple[float, float] | None = None,
) -> None:
    if (actual is None) != (expected is None):
        raise AssertionError(f"{what}: {'missing' if actual is None else 'present'}, expected the opposite")
    if actual is None or expected is None:
        return
    if list(actual) != list(expected):
        raise AssertionError(f"{what}: parameter names {list(actual)} != expected {list(expected)}")
    for name in expected:
        if tol is None:
            assert_tensor_equal(actual[name], expected[name], f"{what}[{name!r}]")
        else:
            assert_tensor_close(actual[name], expected[name], f"{what}[{name!r}]", rtol=tol[0], atol=tol[1])


# ---- traces ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceTolerance:
    """Allowed differences where R25 permits them; ``None`` fields mean "equal"."""

    gradients: tuple[float, float] | None  # (rtol, atol)
    parameters: tuple[float, float] | None
    losses: tuple[float, float] | None
    norm_rtol: float | None
    reason: str


def _label(record: Any) -> str:
    return f"record {record.call_index} ({type(record).__name__})"


def assert_traces_match(actual: Trace, expected: Trace, tolerance: TraceTolerance | None = None) -> None:
    """R25: same record kinds, boundary flags and counters exactly; tensors/norms equal or within
    ``tolerance``."""
    tol = tolerance
    if not isinstance(actual, Trace):
        raise AssertionError(f"run_scenario returned {type(actual).__name__}, expected a Trace")
    ptol = tol.parameters if tol else None
    assert_named_tensors(actual.initial_parameters, expected.initial_parameters, "initial_parameters", ptol)
    if len(actual.records) != len(expected.records):
        raise AssertionError(
            f"trace has {len(actual.records)} records, expected {len(expected.records)} (one per call)"
        )
    for a, e in zip(actual.records, expected.records, strict=True):
        label = _label(e)
        if type(a) is not type(e) or a.call_index != e.call_index:
            raise AssertionError(f"{label}: got {_label(a)}")
        if a.boundary != e.boundary:
            raise AssertionError(f"{label}: boundary={a.boundary} != expected {e.boundary}")
        if isinstance(e, ControlRecord):
            assert isinstance(a, ControlRecord)  # a's type is e's (checked above): for the type checker
            if a.call != e.call:
                raise AssertionError(f"{label}: call {a.call!r} != expected {e.call!r}")
            continue
        assert not isinstance(a, ControlRecord)  # as e
        if a.counters != e.counters:
            raise AssertionError(f"{label}: counters {a.counters} != expected {e.counters}")
        if isinstance(e, BackwardRecord):
            assert isinstance(a, BackwardRecord)  # as e
            if len(a.losses) != len(e.losses):
                raise AssertionError(f"{label}: {len(a.losses)} losses != expected {len(e.losses)} (one per rank)")
            for r, (la, le) in enumerate(zip(a.losses, e.losses, strict=True)):
                if tol is None or tol.losses is None:
                    assert_tensor_equal(la, le, f"{label} loss of rank {r}")
                else:
                    assert_tensor_close(la, le, f"{label} loss of rank {r}", rtol=tol.losses[0], atol=tol.losses[1])
            continue
        assert isinstance(e, StepRecord) and isinstance(a, StepRecord)
        assert_float_match(a.grad_norm, e.grad_norm, f"{label} grad_norm", tol.norm_rtol if tol else None)
        if tol is None:
            assert_float_match(a.clip_coef, e.clip_coef, f"{label} clip_coef", None)
        elif (a.clip_coef is None) != (e.clip_coef is None) and tol.norm_rtol is None:
            raise AssertionError(f"{label}: clip_coef {a.clip_coef!r} != expected {e.clip_coef!r}")
        assert_named_tensors(a.gradients, e.gradients, f"{label} gradients", tol.gradients if tol else None)
        assert_named_tensors(a.parameters, e.parameters, f"{label} parameters", ptol)


def assert_matches_reference(
    implementation: Any, reference_api: Any, scenario: Scenario, tolerance: TraceTolerance | None = None, *,
    replay: Any = None, reference_kwargs: dict | None = None, **run_kwargs: Any,
) -> tuple[Trace, Trace]:
    """The comparison every scenario test makes, written once: the reference's trace of ``scenario`` (with
    ``reference_kwargs``, e.g. a device), checked against the rules it was built from by ``replay`` where given
    (:func:`assert_replay_consistent`, :func:`assert_delayed_replay_consistent`: the oracle itself is tested), then
    the implementation's (``implementation.run_scenario(scenario, **run_kwargs)``: an area API, or an engine API
    with a backend) compared with it under R25 (``tolerance`` None: exactly). Returns ``(actual, expected)`` for
    the test's own further checks."""
    expected = reference_api.run_scenario(scenario, **(reference_kwargs or {}))
    if replay is not None:
        replay(expected)
    actual = implementation.run_scenario(scenario, **run_kwargs)
    assert_traces_match(actual, expected, tolerance)
    return actual, expected


def assert_boundaries_match(actual: Trace, expected: Trace, what: str) -> None:
    """The boundary steps of two traces (not their other records or counters) are equal: R22-style
    equivalences."""
    ab, eb = actual.boundaries(), expected.boundaries()
    if len(ab) != len(eb):
        raise AssertionError(f"{what}: {len(ab)} boundary steps != expected {len(eb)}")
    assert_named_tensors(actual.initial_parameters, expected.initial_parameters, f"{what} initial parameters")
    for k, (a, e) in enumerate(zip(ab, eb, strict=True)):
        label = f"{what} boundary #{k} (record {a.call_index} vs {e.call_index})"
        assert_float_match(a.grad_norm, e.grad_norm, f"{label} grad_norm", None)
        assert_float_match(a.clip_coef, e.clip_coef, f"{label} clip_coef", None)
        assert_named_tensors(a.gradients, e.gradients, f"{label} gradients")
        assert_named_tensors(a.parameters, e.parameters, f"{label} parameters")


def cross_implementation_tolerance(scenario: Scenario, impl: Any, accelerator: Any) -> TraceTolerance | None:
    """R25: ``None`` (equal) where the arithmetic is the same, otherwise the documented tolerance.

    Same arithmetic: the reference itself (a second run checks determinism), or any implementation on the cpu
    accelerator with W <= 2 (R24: two-term sums are order-free) or declaring
    ``accumulation_rank_ordered_reduction``.

    Otherwise the difference starts as a reduction-order difference of a few ulps in the gradients (R23 bounds
    it for one boundary) and then passes through the optimizer. Justification of the numbers, for the
    scenarios of conformance/areas/accumulation_strategies.py (lr <= 0.1, <= 5 boundaries, |parameters| < 2):
    gradients: rtol 1e-3 / atol 1e-5 in fp32 (thousands of ulps: room for the parameter drift below feeding
    back into the next gradients) and rtol 2^-5 / atol 2^-10 in bf16 (four bf16 ulps); parameters: one Adam
    step moves a parameter by at most ~lr, and near-zero gradients (|g| ~ eps) let a tiny gradient difference
    flip that step, so the parameter atol is ``2 * lr * boundaries`` plus four ulps of the model dtype; norms:
    rtol 1e-3 (fp32) / 2^-5 (bf16). This tolerance has not yet been exercised by a non-reference
    implementation; tighten it with figures when one lands.
    """
    import reference

    if impl.load("accumulation") is reference.IMPLEMENTATION.load("accumulation"):
        return None  # the oracle's own module: compared with itself, exactly
    caps = impl.capabilities
    on_cpu = getattr(accelerator, "name", "cpu") == "cpu"
    if on_cpu and (scenario.world_size <= 2 or caps.accumulation_rank_ordered_reduction):
        if not caps.accumulation_optimizer_ulps:
            return None
    return arithmetic_tolerance(scenario)


def arithmetic_tolerance(scenario: Scenario) -> TraceTolerance:
    """R25's tolerance for two runs of ``scenario`` whose arithmetic may differ (see
    :func:`cross_implementation_tolerance` for the justification of the numbers)."""
    bf16 = scenario.config.dtype == "bf16" or "bf16" in (
        scenario.config.communication_data_type,
        scenario.config.grad_accum_dtype,
    )
    eps = 2.0**-8 if scenario.config.dtype == "bf16" else 2.0**-24
    n_boundaries = sum(1 for c in scenario.calls if isinstance(c, Step))
    p_atol = 2 * scenario.config.optimizer.lr * n_boundaries + 4 * eps * 2
    g = (2.0**-5, 2.0**-10) if bf16 else (1e-3, 1e-5)
    return TraceTolerance(
        gradients=g,
        parameters=(0.0, p_atol),
        losses=g,
        norm_rtol=2.0**-5 if bf16 else 1e-3,
        reason="R25: summation order chosen by the transport or a device accelerator",
    )


# ---- replay of the boundary epilogue (R13-R16) -------------------------------------------------------------


def _norm_and_clip(
    cfg: AccumulationConfig, layout: FlatLayout, gradients: dict[str, torch.Tensor] | None, world_size: int
) -> tuple[float, float | None, torch.Tensor]:
    """R14-R15 on one boundary's gradients: the global norm over the ranks' shards, the clip coefficient (None when
    clipping is off or does not bite) and the flat fp32 gradient the optimizer then sees."""
    if gradients is None:
        raise AssertionError("a boundary record without gradients: the replay needs a trace with its gradients")
    grads = flatten(layout, gradients, torch.float32)
    norm = global_grad_norm(layout, [shard(layout, grads, r) for r in range(world_size)])
    coef = None
    if cfg.gradient_clipping > 0:
        c = cfg.gradient_clipping / (norm + CLIP_EPSILON)
        if c < 1.0:
            coef = c
            grads = torch.mul(grads, c)
    return norm, coef, grads


def scheduled_hyperparameters(cfg: AccumulationConfig, boundary: int) -> Any:
    """The optimizer config boundary ``boundary`` (0-based) trains with: the config's, with the ``scheduler``
    section's lr (and OneCycle's betas, for the Adam types) as the suite's own oracle computes them."""
    if cfg.scheduler is None:
        return cfg.optimizer
    section = cfg.scheduler.to_dict()
    changes: dict[str, Any] = {"lr": expected_lr(section, cfg.optimizer.lr, boundary)}
    if cfg.optimizer.type != "sgd":
        changes["betas"] = expected_betas(section, cfg.optimizer.betas, boundary)
    return replace(cfg.optimizer, **changes)


def replay_boundaries(trace: Trace) -> list[tuple[float, float | None, dict[str, torch.Tensor]]]:
    """Recompute norm, clip coefficient and parameters of every boundary from the recorded gradients alone.

    Starts from the trace's initial parameters (fp32 master = exact widening of the model-dtype values), and
    at each boundary applies R14 (norm over the R8 partitions), R15 (clipping) and R16 (optimizer), keeping
    its own fp32 master and optimizer state between boundaries, then casts to the model dtype (R13 step 5).
    Everything downstream of the reduction is thereby checked exactly, independently of how the gradients were
    reduced.
    """
    sc = trace.scenario
    cfg: AccumulationConfig = sc.config
    names = list(trace.initial_parameters)
    first = next((r for r in trace.boundaries()), None)
    trainable = list(first.gradients) if first is not None and first.gradients is not None else []
    layout = build_layout([(n, trace.initial_parameters[n].shape) for n in trainable], sc.world_size)
    master = flatten(layout, {n: trace.initial_parameters[n] for n in trainable}, torch.float32)
    state = init_state(cfg.optimizer, master, cfg.moment_precision)  # R29: moments stored as configured
    params = {n: trace.initial_parameters[n].clone() for n in names}
    out = []
    for k, rec in enumerate(trace.boundaries()):
        norm, coef, grads = _norm_and_clip(cfg, layout, rec.gradients, sc.world_size)
        optimizer_step(scheduled_hyperparameters(cfg, k), master, grads, state)
        new = master.to(cfg.model_dtype)
        for seg in layout.segments:
            params[seg.name] = new[seg.offset : seg.end].view(seg.shape).clone()
        out.append((norm, coef, dict(params)))
    return out


def replay_applies(impl: Any) -> bool:
    """R25: the exact replay of R13-R16 applies unless the implementation declares an optimizer ulp bound."""
    return not impl.capabilities.accumulation_optimizer_ulps


def assert_replay_consistent(trace: Trace) -> None:
    """R13-R16 hold exactly on ``trace``: norm, clip coefficient and parameters follow from its own
    gradients."""
    replayed = replay_boundaries(trace)
    for (norm, coef, params), rec in zip(replayed, trace.boundaries(), strict=True):
        label = f"replay of boundary record {rec.call_index}"
        assert_float_match(rec.grad_norm, norm, f"{label}: grad_norm (R14)", None)
        assert_float_match(rec.clip_coef, coef, f"{label}: clip_coef (R15)", None)
        assert_named_tensors(rec.parameters, params, f"{label}: parameters (R13/R16)")
    # Between boundaries nothing moves (R4).
    previous = trace.initial_parameters
    for rec in trace.steps():
        if not rec.boundary:
            assert_named_tensors(rec.parameters, previous, f"non-boundary step record {rec.call_index} (R4)")
        previous = rec.parameters


def assert_delayed_replay_consistent(trace: Trace) -> None:
    """R27 on ``trace`` (a ``delayed_parameter_update`` run), from its own records alone: replaying R14-R16 on
    the recorded gradients gives the fp32 master of every boundary; the parameters recorded after boundary k
    must be the model-dtype cast of the master *before* boundary k's update (so after the first boundary the
    initial parameters), after an ``ApplyDelayedUpdate`` call the cast of the current master, and between
    boundaries nothing moves (R4). Norm and clip coefficient follow R14/R15 as without the delay."""
    sc = trace.scenario
    cfg: AccumulationConfig = sc.config
    assert cfg.delayed_parameter_update, "assert_delayed_replay_consistent needs a delayed_parameter_update trace"
    first = next((r for r in trace.boundaries()), None)
    trainable = list(first.gradients) if first is not None and first.gradients is not None else []
    layout = build_layout([(n, trace.initial_parameters[n].shape) for n in trainable], sc.world_size)
    master = flatten(layout, {n: trace.initial_parameters[n] for n in trainable}, torch.float32)
    state = init_state(cfg.optimizer, master, cfg.moment_precision)  # R29: moments stored as configured
    live = {n: t.clone() for n, t in trace.initial_parameters.items()}

    def install(flat: torch.Tensor) -> None:
        for seg in layout.segments:
            live[seg.name] = flat[seg.offset : seg.end].view(seg.shape).clone()

    done = 0  # boundaries so far: the first ``delayed_update_warmup`` are not delayed
    for rec in trace.records:
        if isinstance(rec, ControlRecord) and isinstance(rec.call, ApplyDelayedUpdate):
            install(master.to(cfg.model_dtype))
            continue
        if not isinstance(rec, StepRecord):
            continue
        label = f"delayed replay of step record {rec.call_index}"
        if rec.boundary:
            delayed = done >= cfg.delayed_update_warmup
            if delayed:
                install(master.to(cfg.model_dtype, copy=True))  # what this boundary installs: the previous update
            norm, coef, grads = _norm_and_clip(cfg, layout, rec.gradients, sc.world_size)
            assert_float_match(rec.grad_norm, norm, f"{label}: grad_norm (R14)", None)
            assert_float_match(rec.clip_coef, coef, f"{label}: clip_coef (R15)", None)
            optimizer_step(scheduled_hyperparameters(cfg, done), master, grads, state)
            if not delayed:
                install(master.to(cfg.model_dtype))  # a warm-up boundary installs its own update
            done += 1
        assert_named_tensors(rec.parameters, live, f"{label}: parameters (R27: one boundary behind the master)")


# ---- an independent oracle for the first boundary (R7, R9-R11, R23) ----------------------------------------


def local_gradients_before_first_boundary(scenario: Scenario) -> list[list[torch.Tensor]]:
    """``g[k][r]``: rank r's flat model-dtype gradient of the k-th backward, computed with plain autograd.

    Valid for the backwards before the first boundary step (the parameters are still the initial ones). This
    does not touch any engine, so the reduction formulas can be checked against it.
    """
    cfg = scenario.config
    dtype = cfg.model_dtype
    model = scenario.model.build(scenario.seed).to(dtype)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layout = build_layout([(n, p.shape) for n, p in trainable], scenario.world_size)
    out: list[list[torch.Tensor]] = []
    k = 0
    for call in scenario.calls:
        if isinstance(call, Step):
            break
        if not isinstance(call, Backward):
            continue
        per_rank = []
        for r in range(scenario.world_size):
            x, y = micro_batch(scenario, k, scenario.data_rank(r))
            loss = compute_loss(model, x, y, dtype)
            if call.loss_divisor != 1:
                loss = loss / call.loss_divisor
            if call.scale_wrt_gas:
                loss = loss / cfg.gradient_accumulation_steps
            grads = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
            per_rank.append(flatten(layout, {n: g for (n, _), g in zip(trainable, grads, strict=True)}, dtype))
        out.append(per_rank)
        k += 1
    return out


def unflatten_like(scenario: Scenario, flat: torch.Tensor, names_shapes: dict[str, torch.Size]) -> dict:
    layout = build_layout(list(names_shapes.items()), scenario.world_size)
    return {s.name: flat[s.offset : s.end].view(s.shape) for s in layout.segments}


def summation_error_bound(scenario: Scenario, local: list[list[torch.Tensor]]) -> torch.Tensor:
    """R23's per-element bound on |R9 result - R10 result| for the first boundary (flat fp64 tensor)."""
    cfg = scenario.config
    n, w = len(local), scenario.world_size
    s = torch.zeros_like(local[0][0], dtype=torch.float64)
    for per_rank in local:
        for g in per_rank:
            s = s + g.double().abs() / w
    coarse = torch.bfloat16 if torch.bfloat16 in (cfg.comm_dtype, cfg.accum_dtype) else torch.float32
    u = 2.0**-8 if coarse == torch.bfloat16 else 2.0**-24
    tiny = torch.finfo(coarse).tiny
    return 2 * (2 * n * w + 2 * n + 2 * w + 4) * u * s + 2 * n * w * tiny


def reference_optimizer_steps(reference_api, cfg, p0: torch.Tensor, grads: list[torch.Tensor], clip: float | None,
                              precision=None):
    """The oracle's master and optimizer state after one R16 step per gradient from ``p0`` (each gradient
    multiplied by ``clip`` first, R15), the moments stored in ``precision`` (R29; None: fp32): what the
    optimizer-kernel tests (native CPU, fused device) compare with."""
    expected = p0.clone()
    state = reference_api.init_state(cfg, expected, precision)
    for g in grads:
        reference_api.optimizer_step(cfg, expected, torch.mul(g, clip) if clip is not None else g, state)
    return expected, state
