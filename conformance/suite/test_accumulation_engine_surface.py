"""The surface a DeepSpeed user trains with, on a multi-process accumulation engine (docs/zero.md).

LR schedules: ``engine.optimizer`` is a ``torch.optim.Optimizer`` any ``torch.optim.lr_scheduler`` accepts; an
attached scheduler steps at boundaries only and its learning rate is the one the update uses -- checked bitwise
against the same run with ``set_lr`` called by hand, on the torch-op path (SGD) and the native CPU Adam path
(offloaded AdamW). ``zero_grad()`` drops the accumulated gradient. Misuse is caught at the call: a loss of
another model, a model another live engine wraps, an ``nvme_path`` that cannot be written; each error names
the problem and the engine stays usable. The engine class comes from the implementation under test.
"""

from __future__ import annotations

import os

import pytest
import torch

from conformance.areas.accumulation_engines import REQUIRES_ENGINE, engine_api
from reference.accumulation import ModelSpec, compute_loss
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, pytest.mark.runs_in_subprocesses]

SEED = 5


def _batch(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.9**step


def _micro(engine, index: int, rank: int):
    x, y = _batch(index, rank)
    engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
    return engine.step()


def _scheduled(group, engine_cls, config: dict, mode: str) -> dict:
    """mode: 'scheduler' (LambdaLR attached), 'manual' (set_lr before each boundary), 'constant'."""
    import torch.distributed as dist
    from torch.optim.lr_scheduler import LambdaLR

    rank = dist.get_rank(group)
    engine = engine_cls(ModelSpec().build(SEED), config, process_group=group)
    base = engine.get_lr()[0]
    if mode == "scheduler":
        engine.lr_scheduler = LambdaLR(engine.optimizer, _warmup)
    lrs, boundaries = [], 0
    for i in range(8):
        if mode == "manual":
            engine.set_lr(base * _warmup(boundaries))  # the lr of the boundary this micro-step accumulates for
        lrs.append(engine.get_lr()[0])
        if _micro(engine, i, rank).boundary:
            boundaries += 1
    is_optimizer = isinstance(engine.optimizer, torch.optim.Optimizer)
    out = {"lrs": lrs, "params": engine.state_dict(), "is_optimizer": is_optimizer}
    engine.destroy()
    return out


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param({"optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}, id="sgd-torch-path"),
        pytest.param(
            {"optimizer": {"type": "adamw", "lr": 0.02, "weight_decay": 0.1}, "offload_optimizer": "cpu"},
            id="adamw-native-cpu-adam",
        ),
    ],
)
def test_R2_R16_lr_scheduler_on_engine_optimizer_steps_at_boundaries(impl, optimizer):
    """A LambdaLR built on ``engine.optimizer`` (a torch.optim.Optimizer) moves the learning rate once per
    boundary (R2, gas=2: unchanged across the micro-step in between), and the updates use it: parameters
    equal, bitwise, the run that calls ``set_lr`` with the same values by hand, and differ from a constant-lr
    run -- on the torch-op path and on the native CPU Adam path (R16)."""
    api = engine_api(impl)
    cfg = {"zero_stage": 2, "gradient_accumulation_steps": 2, **optimizer}
    sched = api.run_on_ranks(_scheduled, 2, api.ZeroEngine, cfg, "scheduler")[0]
    manual = api.run_on_ranks(_scheduled, 2, api.ZeroEngine, cfg, "manual")[0]
    const = api.run_on_ranks(_scheduled, 2, api.ZeroEngine, cfg, "constant")[0]
    base = cfg["optimizer"]["lr"]
    assert sched["is_optimizer"]
    want = [base * _warmup(i // 2) for i in range(8)]
    assert sched["lrs"] == pytest.approx(want, rel=1e-12), f"scheduled lrs {sched['lrs']} != {want}"
    assert sched["lrs"] == manual["lrs"]
    for name, p in manual["params"].items():
        assert torch.equal(sched["params"][name], p), f"{name}: scheduled run != set_lr run"
    assert any(not torch.equal(sched["params"][n], p) for n, p in const["params"].items()), (
        "the schedule had no effect on the parameters"
    )


def _surface(group, engine_cls) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    cfg = {"zero_stage": 1, "gradient_accumulation_steps": 2}
    out: dict = {}
    engine = engine_cls(ModelSpec().build(SEED), cfg, process_group=group)
    out["train_default"] = engine.module.training
    out["eval_returns"] = engine.eval() is engine and not engine.module.training
    engine.train()
    out["train_again"] = engine.module.training
    out["parameters"] = [tuple(p.shape) for p in engine.parameters()] == [
        tuple(p.shape) for p in engine.module.parameters()
    ]
    out["prefetch_hits"] = engine.prefetch_hits  # below stage 3 nothing is gathered, so nothing prefetched
    for name, call in (
        ("optimizer_step", lambda: engine.optimizer.step()),
        ("add_group", lambda: engine.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})),
        ("bad_scheduler", lambda: setattr(engine, "lr_scheduler", object())),
        ("bad_lr", lambda: engine.set_lr(-1.0)),
    ):
        try:
            call()
            out[name] = None
        except (UnsupportedOperationError, ConfigurationError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    # zero_grad drops what was accumulated: a discarded micro-batch then an accumulated one equals (bitwise) a
    # run whose first micro-batch contributed exactly zero.
    x0, y0 = _batch(0, rank)
    engine.backward(compute_loss(engine.module, x0, y0, engine.config.model_dtype))
    engine.step()
    engine.zero_grad()
    _micro(engine, 1, rank)
    dropped = engine.state_dict()
    engine.destroy()
    ref = engine_cls(ModelSpec().build(SEED), cfg, process_group=group)
    ref.backward(compute_loss(ref.module, x0, y0, ref.config.model_dtype) * 0.0)
    ref.step()
    _micro(ref, 1, rank)
    zeroed = ref.state_dict()
    ref.destroy()
    out["zero_grad"] = all(torch.equal(dropped[k], v) for k, v in zeroed.items())
    return out


def test_R4_module_surface_and_zero_grad(impl):
    """train()/eval() reach the module and return the engine; parameters() are the module's; prefetch_hits is 0
    below stage 3 (docs/zero.md: it counts stage-3 gathers the prefetch served); the optimizer's own
    step() and add_param_group() and a scheduler not built on engine.optimizer are refused with messages naming
    the alternative; zero_grad() between micro-steps discards the accumulated gradient (R4's kept gradient),
    bitwise like a zero contribution."""
    api = engine_api(impl)
    for r, out in enumerate(api.run_on_ranks(_surface, 2, api.ZeroEngine)):
        assert out["train_default"] and out["eval_returns"] and out["train_again"], out
        assert out["parameters"]
        assert out["prefetch_hits"] == 0, f"rank {r}: a stage-1 engine reports {out['prefetch_hits']!r} prefetch hits"
        assert out["optimizer_step"] and "engine.step()" in out["optimizer_step"][1], out["optimizer_step"]
        assert out["add_group"] and "one parameter group" in out["add_group"][1], out["add_group"]
        assert out["bad_scheduler"] and "engine.optimizer" in out["bad_scheduler"][1], out["bad_scheduler"]
        assert out["bad_lr"] and "lr=" in out["bad_lr"][1], out["bad_lr"]
        assert out["zero_grad"], f"rank {r}: zero_grad() did not drop the accumulated gradient"


class _Other(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return (x * self.w).sum()


def _misuse(group, engine_cls, stage: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    cfg = {"zero_stage": stage}
    out: dict = {}
    model = ModelSpec().build(SEED)
    engine = engine_cls(model, cfg, process_group=group)
    # A loss of another model: rejected before anything is accumulated or communicated.
    try:
        engine.backward(_Other()(torch.ones(3)))
        out["foreign"] = None
    except ConfigurationError as exc:
        out["foreign"] = str(exc)
    # A detached output: also not this engine's graph.
    x, y = _batch(0, rank)
    detached = compute_loss(engine.module, x, y, torch.float32).detach().requires_grad_()
    try:
        engine.backward(detached)
        out["detached"] = None
    except ConfigurationError as exc:
        out["detached"] = str(exc)
    # A second engine on the model (or a sub-module of it) while the first lives.
    for key, target in (("owned", model), ("owned_sub", model.out)):
        try:
            engine_cls(target, cfg, process_group=group).destroy()
            out[key] = None
        except ConfigurationError as exc:
            out[key] = str(exc)
    out["counters"] = (engine.micro_steps, engine.global_steps)
    _micro(engine, 1, rank)
    after = engine.state_dict()
    engine.destroy()
    ref = engine_cls(ModelSpec().build(SEED), cfg, process_group=group)
    _micro(ref, 1, rank)
    expected = ref.state_dict()
    ref.destroy()
    out["usable"] = all(torch.equal(after[k], v) for k, v in expected.items())
    if stage < 3:  # after destroy() the model is free again
        again = engine_cls(model, cfg, process_group=group)
        again.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_R20_misuse_is_rejected_at_the_call_and_leaves_the_engine_usable(impl, stage):
    """backward() of a loss from another model or from a detached output raises ConfigurationError saying so
    (not a silent zero-gradient micro-step); wrapping the model or one of its sub-modules in a second engine
    while the first lives raises naming the owner (at stage 3 the second would have broken the first); counters
    are unchanged and the first engine's next step equals a run that never saw the misuse, bitwise (R20: a
    rejected call changes nothing)."""
    api = engine_api(impl)
    for r, out in enumerate(api.run_on_ranks(_misuse, 2, api.ZeroEngine, stage)):
        for key in ("foreign", "detached"):
            assert out[key] is not None and "not computed from this engine's module" in out[key], (key, out[key])
        for key in ("owned", "owned_sub"):
            assert out[key] is not None and "already wrapped by another" in out[key], (key, out[key])
        assert out["counters"] == (0, 0), out["counters"]
        assert out["usable"], f"rank {r}: the engine's next step differs after the rejected calls"


class _Routed(torch.nn.Module):
    """A trainable expert and a frozen path: a forward routed to the frozen path touches no trainable parameter,
    yet its loss is this module's (a legitimate zero-gradient micro-step, as for an expert no token chose)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.expert = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(4, 3).requires_grad_(False)
        self.route_to_expert = True

    def forward(self, x):
        return self.expert(x) if self.route_to_expert else self.frozen(x)


def _own_losses(group, engine_cls) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    out: dict = {}
    for stage in (1, 3):
        model = _Routed()
        engine = engine_cls(model, {"zero_stage": stage}, process_group=group)
        dtype = engine.config.model_dtype
        device = next(engine.module.parameters()).device
        x, y = (t.to(device=device, dtype=dtype) for t in _batch(rank, rank))
        # The input requires grad (it comes from upstream layers): the routed-away output has a graph that
        # reaches no parameter of the engine, only the module's output.
        model.route_to_expert = False
        routed = ((engine(x.clone().requires_grad_()) - y) ** 2).mean()
        # Many forwards between this micro-batch's forward and its backward (an evaluation with grad enabled).
        model.route_to_expert = True
        for _ in range(100):
            engine(x)
        accepted = []
        for name, loss in (("routed_away", routed), ("after_100_forwards", ((engine(x) - y) ** 2).mean())):
            try:
                engine.backward(loss)
                engine.step()
                accepted.append(name)
            except ConfigurationError as exc:
                out[f"stage{stage}_{name}_error"] = str(exc)
        out[f"stage{stage}"] = (accepted, engine.micro_steps)
        engine.destroy()
    return out


def test_R20_every_loss_of_this_module_is_accepted(impl):
    """The other side of the loss-origin check: a loss computed from the engine's module is accepted however it
    was reached -- through the module's output when the forward touched no trainable parameter (the input
    requires grad, the trainable expert was routed away), and after 100 other forwards since its own; at
    stages 1 and 3 (where the parameters are gathered and released around each forward)."""
    api = engine_api(impl)
    for r, out in enumerate(api.run_on_ranks(_own_losses, 2, api.ZeroEngine)):
        for stage in (1, 3):
            assert out[f"stage{stage}"] == (["routed_away", "after_100_forwards"], 2), (r, stage, out)


def _nvme(group, engine_cls, path: str) -> dict:
    cfg = {"zero_stage": 1, "offload_optimizer": "nvme", "nvme_path": path}
    try:
        engine_cls(ModelSpec().build(SEED), cfg, process_group=group).destroy()
        return {"error": None}
    except ConfigurationError as exc:
        return {"error": str(exc)}


def test_R19_unwritable_nvme_path_is_rejected_at_construction(impl, tmp_path):
    """R19: an ``nvme_path`` the process cannot write is a ConfigurationError naming ``nvme_path`` when the
    engine is built (not a raw PermissionError at the first boundary), leaving no file behind."""
    api = engine_api(impl)
    if os.geteuid() == 0:
        target = "/proc/self"  # a directory even root cannot create files in
    else:
        target = str(tmp_path / "ro")
        os.mkdir(target, 0o500)
    out = api.run_on_ranks(_nvme, 1, api.ZeroEngine, target)[0]
    assert out["error"] is not None and "nvme_path" in out["error"] and "not usable" in out["error"], out
    if target != "/proc/self":
        assert os.listdir(target) == []


def _rank_state(group, engine_cls, config: dict) -> dict:
    import torch.distributed as dist

    from reference.accumulation import AccumulationConfig, Scenario, micro_batch

    rank = dist.get_rank(group)
    sc = Scenario(AccumulationConfig.from_dict(config), dist.get_world_size(group), ())
    engine = engine_cls(sc.model.build(sc.seed), sc.config, process_group=group)
    for k in range(4):
        engine.backward(compute_loss(engine.module, *micro_batch(sc, k, rank), sc.config.model_dtype))
        engine.step()
    out = {"master": engine.master_partition(), "state": engine.optimizer_state()}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_R8_R16_per_rank_state_accessors_agree_with_the_reference(impl, reference_api, stage):
    """The accessors both engine kinds share by name (docs/zero.md, "Differences from the reference engine"):
    on every rank r, the distributed engine's ``master_partition()`` and ``optimizer_state()`` equal the
    reference engine's ``master_partition(r)`` and ``optimizer_state(r)`` after the same micro-steps (R8: the same
    partition of the fp32 masters; R16: the same state, buffer names included), bitwise on the host."""
    api = engine_api(impl)
    config = {
        "zero_stage": stage, "gradient_accumulation_steps": 2, "dtype": "fp32",
        "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.1},
    }
    per_rank = api.run_on_ranks(_rank_state, 2, api.ZeroEngine, config)
    sc = reference_api.Scenario(reference_api.AccumulationConfig.from_dict(config), 2, ())
    ref = reference_api.build_engine(sc)
    for k in range(4):
        losses = [
            compute_loss(ref.module(r), *reference_api.micro_batch(sc, k, r), sc.config.model_dtype) for r in range(2)
        ]
        ref.backward(losses)
        ref.step()
    for r, out in enumerate(per_rank):
        want_master, want_state = ref.master_partition(r), ref.optimizer_state(r)
        assert torch.equal(out["master"], want_master), f"rank {r}: master_partition() != reference's ({stage=})"
        assert out["state"].step == want_state.step == 2, (out["state"].step, want_state.step)
        assert sorted(out["state"].buffers) == sorted(want_state.buffers) == ["exp_avg", "exp_avg_sq"]
        for name, b in want_state.buffers.items():
            assert torch.equal(out["state"].buffers[name], b), f"rank {r}: optimizer_state().{name} differs"
    ref.destroy()
