"""Failure behaviour of the multi-process ZeRO engine: no deadlock, a clear error on every rank, and
``destroy()`` giving back every pinned byte (issue 6 "Faults"; R17 offload buffers, R20 destroyed engine).

The rank functions below run inside the engine's worker processes (they are pickled by reference, so they live
at module level). Offloaded state is allocated with the native pinning backend here, because that is the
backend whose pinned bytes ``pinned_stats()`` can count on every machine.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from conformance.areas.accumulation_engines import (
    IN_RANK_PROCESSES,
    REQUIRES_ENGINE,
    engine_api,
    engine_class,
    pinned_stats_of,
)
from conformance.areas.assertions import assert_names_argument
from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, compute_loss, micro_batch
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, IN_RANK_PROCESSES]

FAULT_TIMEOUT_S = 4  # the process-group timeout the fault test runs under (seconds)


class InjectedBackwardError(RuntimeError):
    """The failure the tests inject into one rank's backward."""


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise InjectedBackwardError("injected failure inside backward")


def _engine_rank(group, impl, stage: int, failing_rank: int | None, catch: bool) -> dict:
    """Build an offloading engine, run two micro-steps (``failing_rank`` raises inside its first backward),
    then destroy it; report the error (if ``catch``) and the pinned-memory statistics around the engine."""
    import torch.distributed as dist

    ZeroEngine = engine_class(impl)
    pinned_stats = pinned_stats_of(impl)

    rank = dist.get_rank(group)
    cfg = AccumulationConfig(
        zero_stage=stage, offload_optimizer="cpu", offload_param="cpu" if stage == 3 else "none", dtype="bf16"
    )
    sc = Scenario(cfg, dist.get_world_size(group), ())
    gc.collect()
    before = pinned_stats()
    engine = ZeroEngine(ModelSpec().build(0), cfg, process_group=group)
    during = pinned_stats()
    start = time.monotonic()
    error = None
    try:
        for k in range(2):
            loss = compute_loss(engine.module, *micro_batch(sc, k, rank), cfg.model_dtype)
            if rank == failing_rank:
                loss = _FailInBackward.apply(loss)
            engine.backward(loss)
            engine.step()
    except Exception as exc:
        error = exc
    elapsed = time.monotonic() - start
    engine.destroy()
    gc.collect()
    after = pinned_stats()
    if error is not None and not catch:
        raise error
    return {
        "error": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
        "elapsed": elapsed,
        "before": tuple(before),
        "during": tuple(during),
        "after": tuple(after),
    }


@pytest.mark.parametrize("stage", [0, 3])
def test_R17_destroy_returns_every_pinned_byte(impl, area_api, native_pinning, stage):
    """R17: offloaded masters, optimizer state (and stage-3 parameter partitions) live in pinned host memory
    from the pinning API; after destroy() the pinned allocations and bytes are back at their starting value."""
    api = engine_api(impl)
    for r, out in enumerate(api.run_on_ranks(_engine_rank, 2, impl, stage, None, True)):
        assert out["error"] is None, out
        assert out["during"][0] > out["before"][0], f"rank {r}: the engine pinned nothing: {out}"
        assert out["after"] == out["before"], f"rank {r}: pinned_stats before {out['before']} after {out['after']}"


def _counters(engine) -> dict:
    """Every counter a step may move, read through the public surface."""
    state = engine.optimizer_state()
    return {
        "micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "optimizer_state_step": getattr(state, "step", None),
        "lr_scheduler_epoch": engine.lr_scheduler.last_epoch, "lr": engine.get_lr(),
        "boundary_next": engine.is_gradient_accumulation_boundary(),
    }


def _raising_boundary_rank(group, impl, stage: int, fail: bool) -> dict:
    """Four micro-steps (gas=2) with a LambdaLR attached. With ``fail``, the group's lr is made negative by hand
    before the first boundary's step() (a scheduler gone wrong): that step must raise, naming lr, and leave
    every counter where it was; with the lr put back, the same step() then goes on as if it had never raised."""
    import torch.distributed as dist
    from torch.optim.lr_scheduler import LambdaLR

    rank = dist.get_rank(group)
    cfg = AccumulationConfig(zero_stage=stage, gradient_accumulation_steps=2)
    sc = Scenario(cfg, dist.get_world_size(group), ())
    engine = engine_class(impl)(ModelSpec().build(0), cfg, process_group=group)
    engine.lr_scheduler = LambdaLR(engine.optimizer, lambda step: 0.5**step)
    out: dict = {"error": None}
    for k in range(4):
        engine.backward(compute_loss(engine.module, *micro_batch(sc, k, rank), cfg.model_dtype))
        if fail and k == 1:
            lr = engine.optimizer.param_groups[0]["lr"]
            engine.optimizer.param_groups[0]["lr"] = -1.0
            out["before"] = _counters(engine)
            try:
                engine.step()
            except (ConfigurationError, ValueError) as exc:
                out["error"] = (type(exc).__name__, str(exc))
            engine.optimizer.param_groups[0]["lr"] = lr
            out["after"] = _counters(engine)
            out["after"]["lr"] = out["before"]["lr"]  # the test itself set it and put it back
        engine.step()
    out["final"] = _counters(engine)
    out["params"] = engine.state_dict()
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_R20_boundary_step_that_raises_leaves_every_counter(impl, area_api, stage):
    """R20 (a call that cannot complete changes nothing): a boundary step() whose hyper-parameters are invalid
    raises a ConfigurationError naming ``lr`` and leaves the micro/global step and sample counters, the
    optimizer state's step, the scheduler's epoch and the boundary rule where they were; with the lr put back
    the run ends bitwise equal to one that never raised."""
    api = engine_api(impl)
    failed = api.run_on_ranks(_raising_boundary_rank, 2, impl, stage, True)
    clean = api.run_on_ranks(_raising_boundary_rank, 2, impl, stage, False)
    for r, (got, want) in enumerate(zip(failed, clean, strict=True)):
        assert got["error"] is not None, f"rank {r}: step() with lr=-1.0 did not raise"
        assert got["error"][0] == "ConfigurationError" and "lr" in got["error"][1], got["error"]
        assert got["after"] == got["before"], (
            f"rank {r}: a boundary step that raised moved counters: before {got['before']}, after {got['after']}"
        )
        assert got["final"] == want["final"], f"rank {r}: counters {got['final']} != a clean run's {want['final']}"
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), f"rank {r}: {name} differs from a run that never raised"


@pytest.mark.parametrize("stage", [0, 3])  # reduction at the boundary step / inside backward
def test_R20_fault_in_backward_gives_clear_errors_on_all_ranks(impl, area_api, native_pinning, monkeypatch, stage):
    """R20 (a call that cannot complete): an exception inside backward on rank 1 reaches rank 1's caller as
    itself; rank 0, blocked in its next collective, gets a CollectiveError that names the collective and says
    another rank failed, within the process-group timeout (no deadlock); destroy() after the failure returns
    every pinned byte on both ranks."""
    api = engine_api(impl)
    monkeypatch.setenv(api.TIMEOUT_ENV, str(FAULT_TIMEOUT_S))
    monkeypatch.setenv(api.POOL_SIZE_ENV, "2")  # this pool is discarded afterwards: spawn only what it needs
    try:
        results = api.run_on_ranks(_engine_rank, 2, impl, stage, 1, True, grace_s=60.0)
    finally:
        api.shutdown_pools()  # the group timed out: never reuse it
    failing, survivor = results[1], results[0]
    assert failing["error"] == "InjectedBackwardError", failing
    assert survivor["error"] == "CollectiveError", survivor
    assert "rank 0 of 2" in survivor["message"] and "another rank" in survivor["message"].lower(), survivor
    assert survivor["elapsed"] < FAULT_TIMEOUT_S + 20, f"rank 0 waited {survivor['elapsed']:.1f}s"
    for r, out in enumerate(results):
        assert out["after"] == out["before"], f"rank {r}: pinned_stats before {out['before']} after {out['after']}"


def test_R26_failing_rank_error_reaches_the_caller_without_deadlock(impl, area_api, monkeypatch):
    """R26: when a rank raises and its peer is stuck in a collective, the runner stops the stuck rank after a
    grace period and re-raises the failing rank's exception, same class and message, naming the rank."""
    api = engine_api(impl)
    # The runner kills this pool (its rank 0 is stuck): start only the two ranks the run uses. The collective
    # timeout stays the default (60 s), far beyond the grace period, so rank 0 really is stuck when it is killed.
    monkeypatch.setenv(api.POOL_SIZE_ENV, "2")
    start = time.monotonic()
    with pytest.raises(InjectedBackwardError, match="injected failure inside backward") as info:
        api.run_on_ranks(_engine_rank, 2, impl, 2, 1, False, grace_s=3.0)
    assert time.monotonic() - start < 40, "the runner took too long to give up on the stuck rank"
    assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", [])), info.value


def test_R20_engine_refuses_without_process_group_and_after_destroy(impl, area_api):
    """R20/R1: building the engine before torch.distributed is initialised is a ConfigurationError saying what
    to call; after destroy() every call is an UnsupportedOperationError (checked in a rank process)."""
    api = engine_api(impl)
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this test process already has a default process group")
    with pytest.raises(ConfigurationError) as info:
        api.ZeroEngine(ModelSpec().build(0), AccumulationConfig())
    assert_names_argument(info.value, "init_process_group", qualified=True)
    assert api.run_on_ranks(_destroyed_calls, 1, impl) == [["destroyed"] * 4]


def _destroyed_calls(group, impl) -> list[str]:
    ZeroEngine = engine_class(impl)

    engine = ZeroEngine(ModelSpec().build(0), AccumulationConfig(zero_stage=3), process_group=group)
    engine.destroy()
    engine.destroy()  # idempotent
    out = []
    loss = torch.ones((), requires_grad=True)
    for call in (engine.step, lambda: engine.backward(loss), lambda: engine.no_sync().__enter__(),
                 engine.full_parameters):
        try:
            call()
        except UnsupportedOperationError as exc:
            out.append("destroyed" if "destroyed" in str(exc) else str(exc))
    return out
