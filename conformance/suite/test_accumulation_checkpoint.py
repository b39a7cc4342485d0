"""ZeRO-3 parameter lifecycle and activation checkpointing with frozen parameters (R12, R21).

The bug this guards against: under ZeRO-3 a frozen parameter had already been released to shape [0] when a
checkpointed region was recomputed during backward, so the recompute failed (or would have computed with
nothing). R21 says the recompute gathers every parameter of the region, frozen ones included.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from conformance.areas.accumulation_assertions import assert_named_tensors, assert_traces_match
from conformance.areas.accumulation_strategies import accumulation_configs
from reference.accumulation import (
    AccumulationConfig,
    AffineMap,
    Backward,
    ModelSpec,
    Scenario,
    SetBoundary,
    Step,
)

pytestmark = pytest.mark.conformance_area("accumulation")


class ShapeRecordingMap(AffineMap):
    """An AffineMap that records the shapes of its parameters each time its forward runs (recompute
    included)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((tuple(self.weight.shape), tuple(self.bias.shape)))
        return super().forward(x)


class CheckpointedNet(nn.Module):
    """inp (trainable) -> tanh -> checkpoint[ frozen (requires_grad=False) -> tanh -> out (trainable) ]."""

    def __init__(self, use_checkpoint: bool, checkpoint_fn=None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.use_checkpoint = use_checkpoint
        self.checkpoint_fn = checkpoint_fn or (lambda f, h: checkpoint(f, h, use_reentrant=False))
        self.inp = ShapeRecordingMap(4, 6, gen)
        self.frozen = ShapeRecordingMap(6, 6, gen)
        self.frozen.requires_grad_(False)
        self.out = ShapeRecordingMap(6, 3, gen)

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.frozen(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.checkpoint_fn(self._tail, h) if self.use_checkpoint else self._tail(h)


def _run(api, engine, steps: int, world: int):
    gen = torch.Generator().manual_seed(11)
    outs = []
    for _ in range(steps):
        losses = []
        for r in range(world):
            x = torch.randn(2, 4, generator=gen).to(engine.config.model_dtype)
            losses.append(engine.module(r)(x).float().pow(2).mean().to(engine.config.model_dtype))
        engine.backward(losses)
        # R12: after backward() returns, nothing is left gathered on any rank.
        for r in range(world):
            for name, p in engine.module(r).named_parameters():
                assert p.numel() == 0, f"rank {r} parameter {name} still gathered after backward(): {tuple(p.shape)}"
        outs.append(engine.step())
    return outs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_R21_recompute_sees_full_frozen_parameters_under_zero3(reference_api, dtype, offload_param):
    """R21: with non-reentrant torch.utils.checkpoint around a frozen and a trainable layer, every forward of
    the region, the original and the recompute during backward, sees full-shape parameters; R12: nothing stays
    gathered after backward(); the result equals the same run without checkpointing, bitwise."""
    api = reference_api
    world = 2
    cfg = AccumulationConfig(zero_stage=3, dtype=dtype, offload_param=offload_param, offload_optimizer=offload_param)
    ck = api.AccumulationEngine(lambda: CheckpointedNet(True), cfg, world)
    plain = api.AccumulationEngine(lambda: CheckpointedNet(False), cfg, world)
    out_ck = _run(api, ck, 2, world)
    out_plain = _run(api, plain, 2, world)
    for r in range(world):
        frozen_seen = ck.module(r).frozen.seen
        assert frozen_seen == [((6, 6), (6,))] * 4, f"rank {r}: frozen layer saw {frozen_seen}"
        assert ck.module(r).out.seen == [((3, 6), (3,))] * 4
        assert plain.module(r).frozen.seen == [((6, 6), (6,))] * 2  # no recompute without checkpointing
    for a, b in zip(out_ck, out_plain, strict=True):
        assert a.grad_norm == b.grad_norm
        assert_named_tensors(a.gradients, b.gradients, "gradients with vs without checkpointing")
    assert_named_tensors(ck.full_parameters(), plain.full_parameters(), "parameters with vs without checkpointing")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_R21_project_offload_checkpoint_sees_full_frozen_parameters(reference_api, use_reentrant):
    """R21 with the project's activation-offload checkpoint (reference.offload.checkpoint, reentrant and
    non-reentrant): the recompute sees full frozen and trainable parameters, nothing stays gathered after
    backward(), and the run equals the one without checkpointing, bitwise."""
    from reference.offload import checkpoint as offload_checkpoint

    api = reference_api
    cfg = AccumulationConfig(zero_stage=3)
    fn = lambda f, h: offload_checkpoint(f, h, use_reentrant=use_reentrant)
    ck = api.AccumulationEngine(lambda: CheckpointedNet(True, fn), cfg, 2)
    plain = api.AccumulationEngine(lambda: CheckpointedNet(False), cfg, 2)
    out_ck, out_plain = _run(api, ck, 2, 2), _run(api, plain, 2, 2)
    for r in range(2):
        assert ck.module(r).frozen.seen == [((6, 6), (6,))] * 4, f"rank {r}: {ck.module(r).frozen.seen}"
    for a, b in zip(out_ck, out_plain, strict=True):
        assert a.grad_norm == b.grad_norm
        assert_named_tensors(a.gradients, b.gradients, "gradients with vs without the offload checkpoint")
    assert_named_tensors(ck.full_parameters(), plain.full_parameters(), "parameters with vs without checkpoint")


class _ReleasesFrozenBeforeRecompute:
    """Mixin reproducing the original bug: during backward, frozen parameters are not gathered for a
    recompute."""

    def _gather(self, rank, names):
        if self._in_backward:
            names = [n for n in names if n not in self.frozen_names]
        super()._gather(rank, names)


def test_R21_the_test_detects_a_recompute_with_released_frozen_parameters(reference_api):
    """R21 (negative control): an engine that skips gathering frozen parameters for the recompute fails the
    scenario above, which shows the checkpoint test exercises exactly the bug it is meant to catch."""
    api = reference_api
    buggy_cls = type("BuggyEngine", (_ReleasesFrozenBeforeRecompute, api.AccumulationEngine), {})
    engine = buggy_cls(lambda: CheckpointedNet(True), AccumulationConfig(zero_stage=3), 2)
    with pytest.raises(Exception) as info:  # torch raises CheckpointError or a shape RuntimeError here
        _run(api, engine, 1, 2)
    assert (
        "checkpoint" in type(info.value).__name__.lower() or "size" in str(info.value) or "shape" in str(info.value)
    ), f"unexpected failure: {info.value!r}"


@given(
    cfg=accumulation_configs(stages=(3,)),
    world=st.sampled_from((1, 2, 3, 4)),
    seed=st.integers(0, 2**16),
    n=st.integers(1, 3),
)
def test_R21_scenarios_with_checkpointing_equal_without(area_api, cfg, world, seed, n):
    """R21 through the runner: ZeRO-3 scenarios whose frozen block is checkpointed give the same trace as
    without
    checkpointing, bitwise, for every implementation."""
    lead = (SetBoundary(True),) if cfg.managed_gradient_accumulation else ()
    calls = (*lead, *[Backward()] * n, Step(), Backward(), Step())
    a = area_api.run_scenario(Scenario(cfg, world, calls, model=ModelSpec(checkpoint=True), seed=seed))
    b = area_api.run_scenario(Scenario(cfg, world, calls, model=ModelSpec(checkpoint=False), seed=seed))
    assert_traces_match(a, b)


def test_R12_stage3_parameters_are_released_between_uses(reference_api):
    """R12: a stage-3 engine holds no parameter data on any replica after construction, after a forward (the
    post-forward release) and after backward(); its partitions are 1/W of the flat layout per rank."""
    api = reference_api
    sc = Scenario(AccumulationConfig(zero_stage=3), 2, ())
    engine = api.build_engine(sc)
    shapes = lambda r: {n: tuple(p.shape) for n, p in engine.module(r).named_parameters()}
    for r in range(2):
        assert set(shapes(r).values()) == {(0,)}
    x, y = api.micro_batch(sc, 0, 0)
    loss = api.compute_loss(engine.module(0), x, y, torch.float32)
    assert set(shapes(0).values()) == {(0,)}, f"after forward: {shapes(0)}"
    engine.backward([loss, api.compute_loss(engine.module(1), *api.micro_batch(sc, 0, 1), torch.float32)])
    assert set(shapes(0).values()) == {(0,)} and set(shapes(1).values()) == {(0,)}
    assert {m.numel() for m in engine.master_partitions()} == {engine.layout.partition_size}
    assert engine.layout.partition_size * 2 == engine.layout.total
