"""A Lightning ``Trainer`` with the implementation's engine strategy trains exactly as the plain engine loop does
(issue 52, docs/zero.md "Lightning").

The strategy is an optional component the accumulation area declares by name, ``lightning_strategy``: a module
with ``ZeroStrategy`` (a Lightning 2.x ``Strategy``), ``load_lightning()`` (Lightning's package, or a
``MissingDependencyError`` naming the extra), and the rules that merge the Trainer's settings into the engine
config (``resolve_config``, ``TrainerSettings``, ``optimizer_section``). Implementations that declare none are
skipped with that reason, and so is everything that needs Lightning where it is not installed (the reason names
the package, conformance.harness.optional_packages).

The Trainer runs are real: ``conformance.areas.lightning_runs`` is started once per rank as torchrun would (one and two
gloo ranks), runs each case's Trainer and then the plain loop a user would write for the same config and data on
the same process group, and the tests compare the records bitwise -- losses of every micro-batch, grad norm, clip
coefficient, scheduled lr and optimizer step count of every update, and the final full parameters.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT
from conformance.harness.optional_packages import MISSING_PREFIX
from reference.contract.errors import ConfigurationError, MissingDependencyError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_CHECKPOINT, pytest.mark.runs_in_subprocesses]

#: (implementation, world size) -> what each rank recorded; one run of the rank program per key.
_RECORDS: dict[tuple[str, int], list[dict[str, Any]]] = {}
#: Boundaries of one epoch in the cases (8 micro-batches, accumulate_grad_batches=2).
BOUNDARIES = 4


def _declared(impl) -> Any:
    integration = getattr(impl.load("accumulation"), "lightning_strategy", None)
    if integration is None:
        pytest.skip("this implementation declares no Lightning strategy (lightning_strategy)")
    return integration


def _lightning(impl) -> Any:
    """The declared integration, with Lightning importable (else the test is skipped naming the package)."""
    integration = _declared(impl)
    try:
        integration.load_lightning()
    except MissingDependencyError as exc:
        pytest.skip(f"{MISSING_PREFIX} 'lightning' (the Lightning strategy): {exc}")
    return integration


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _records(impl, world: int) -> list[dict[str, Any]]:
    """Each rank's records of ``conformance.areas.lightning_runs`` at ``world`` ranks (run once per implementation)."""
    _lightning(impl)
    key = (impl.name, world)
    if key not in _RECORDS:
        out = tempfile.mkdtemp(prefix="lightning-records-")
        try:
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), OMP_NUM_THREADS="1",
                       PYTHONWARNINGS="ignore")
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "conformance.areas.lightning_runs", impl.load("accumulation").__name__, out],
                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world)), cwd=out,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
                for r in range(world)
            ]
            logs = [p.communicate(timeout=300)[0] for p in procs]
            for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
                assert p.returncode == 0, f"rank {r} of the Lightning runs failed ({p.returncode}):\n{log[-5000:]}"
            _RECORDS[key] = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return _RECORDS[key]


def _assert_same_run(ours: dict[str, Any], plain: dict[str, Any], where: str) -> None:
    assert len(ours["losses"]) == len(plain["losses"]), f"{where}: micro-batches {len(ours['losses'])} != plain"
    for i, (a, b) in enumerate(zip(ours["losses"], plain["losses"], strict=True)):
        assert torch.equal(a, b), f"{where}: the loss of micro-batch {i} differs from the plain loop's: {a} vs {b}"
    # (grad norm, clip coefficient, lr the update used, optimizer step count) of every update, exactly
    assert ours["outcomes"] == plain["outcomes"], f"{where}: updates differ:\n{ours['outcomes']}\n{plain['outcomes']}"
    assert ours["params"].keys() == plain["params"].keys(), where
    for name, value in plain["params"].items():
        assert torch.equal(ours["params"][name], value), f"{where}: parameter {name} differs from the plain loop's"
    assert ours["global_steps"] == plain["global_steps"] == ours["trainer_global_step"], (
        f"{where}: engine boundaries {ours['global_steps']}, plain {plain['global_steps']}, Trainer.global_step "
        f"{ours['trainer_global_step']} must be one count")


@pytest.mark.parametrize("world", [1, 2], ids=["world=1", "world=2"])
def test_trainer_with_the_strategy_equals_the_plain_engine_loop_bitwise(impl, world):
    """Stage 2 with optimizer offload. The strategy's config names neither accumulation, clipping nor the
    optimizer: ``Trainer(accumulate_grad_batches=2, gradient_clip_val=0.05)`` and ``configure_optimizers``
    (AdamW + a LambdaLR warm-up stepped per update) give them; the plain loop has them in its config and the
    scheduler on ``engine.optimizer``. Every loss, update and final parameter is equal, on every rank; the
    engine updated once per two batches (Trainer.global_step counts the same updates); and clipping acted (a
    clip coefficient below 1 at every update, which the plain loop with the same threshold shows too)."""
    for rank, rec in enumerate(_records(impl, world)):
        case = rec["equivalence"]
        _assert_same_run(case["lightning"], case["plain"], f"rank {rank}")
        assert case["lightning"]["global_steps"] == BOUNDARIES, "accumulate_grad_batches=2 over 8 batches: 4 updates"
        coefs = [o[1] for o in case["lightning"]["outcomes"]]
        assert all(c is not None and c < 1.0 for c in coefs), f"gradient_clip_val=0.05 did not clip: {coefs}"
        lrs = [o[2] for o in case["lightning"]["outcomes"]]
        assert lrs == sorted(lrs) and len(set(lrs)) == BOUNDARIES, f"the warm-up did not move the lr per update: {lrs}"


@pytest.mark.parametrize("world", [1, 2], ids=["world=1", "world=2"])
def test_model_checkpoint_writes_engine_checkpoints_a_plain_engine_loads(impl, world):
    """The run above had ``ModelCheckpoint(every_n_train_steps=2, save_top_k=1)``: it saved at updates 2 and 4
    through the strategy and removed the older one, and did not change the run (it is still the plain loop's,
    above). What is left is an engine checkpoint (``checkpoint/`` and ``latest``) that a plain engine, built without
    Lightning, loads: the final weights bitwise, 4 boundaries, and the Trainer's state (``global_step``, ``loops``,
    ``callbacks``) in its client_state."""
    for rank, rec in enumerate(_records(impl, world)):
        case = rec["equivalence"]
        assert case["saves"] == {"epoch=0-step=4.ckpt": ["checkpoint", "latest"]}, f"rank {rank}: {case['saves']}"
        loaded = case["loaded"]
        assert loaded["global_steps"] == BOUNDARIES and loaded["client_global_step"] == BOUNDARIES, loaded
        assert {"loops", "callbacks", "lr_schedulers"} <= set(loaded["client_keys"]), loaded["client_keys"]
        assert "state_dict" not in loaded["client_keys"], "the weights are the engine's, not a copy in client_state"
        for name, value in case["lightning"]["params"].items():
            assert torch.equal(loaded["params"][name], value), f"rank {rank}: {name} differs after the plain load"


@pytest.mark.parametrize("world", [1, 2], ids=["world=1", "world=2"])
def test_bf16_true_trainer_equals_the_plain_bf16_loop_bitwise(impl, world):
    """``Trainer(precision="bf16-true")`` with a config that names no dtype runs the engine in bf16 (the batch cast
    by Lightning) and equals the plain loop of a ``dtype: bf16`` config that casts its batches, bitwise; the
    optimizer is the config's (``configure_optimizers`` returns None, Lightning's optimizer is the engine's)."""
    for rank, rec in enumerate(_records(impl, world)):
        case = rec["bf16"]
        assert all(v.dtype == torch.bfloat16 for v in case["lightning"]["params"].values()), "the model is not bf16"
        _assert_same_run(case["lightning"], case["plain"], f"rank {rank}")


@pytest.mark.parametrize("world", [1, 2], ids=["world=1", "world=2"])
def test_trainer_checkpoint_save_and_resume_equals_the_uninterrupted_loop(impl, world):
    """Stage 3 with parameter and optimizer offload, DeepSpeed-shaped config: one epoch,
    ``trainer.save_checkpoint(path)``, then a fresh module (other seed) and Trainer resumed with
    ``fit(ckpt_path=path)`` for a second epoch. The checkpoint is the engine's format (``path/checkpoint`` and
    ``path/latest``); the two Trainer runs together equal two uninterrupted epochs of the plain loop bitwise --
    weights, optimizer state (step counts), the LR warm-up continuing across the resume (Lightning's scheduler
    state and the engine's lr), and Trainer.global_step. ``release_engine()`` gives
    the module back with the trained weights (gathered at stage 3), and ``Trainer.validate(other_module,
    ckpt_path=path)`` runs on the checkpoint's weights."""
    for rank, rec in enumerate(_records(impl, world)):
        case = rec["resume"]
        assert case["layout"] == ["checkpoint", "latest"], f"rank {rank}: checkpoint directory {case['layout']}"
        _assert_same_run(case["lightning"], case["plain"], f"rank {rank}")
        assert case["lightning"]["global_steps"] == 2 * BOUNDARIES
        lrs = [o[2] for o in case["lightning"]["outcomes"]]
        assert lrs[BOUNDARIES] > lrs[BOUNDARIES - 1], f"the resumed warm-up restarted or stalled: {lrs}"
        for name, value in case["saved"].items():
            assert torch.equal(case["released"][name], value), f"rank {rank}: release_engine lost {name}"
            assert torch.equal(case["validated"][name], value), f"rank {rank}: validate(ckpt_path) did not load {name}"
        assert case["validation_losses"] == 8, "validate(ckpt_path=...) did not run the validation loop"


@pytest.mark.parametrize("world", [1, 2], ids=["world=1", "world=2"])
def test_trainer_refuses_a_config_accumulation_that_disagrees_with_the_trainer(impl, world):
    """``gradient_accumulation_steps: 4`` in the config with ``Trainer(accumulate_grad_batches=2)``: refused at
    setup on every rank, naming both values, instead of a run whose updates and Lightning's steps disagree; and
    ``Trainer(sync_batchnorm=True)``, which the strategy does not apply, refused rather than ignored."""
    for rank, rec in enumerate(_records(impl, world)):
        error = rec["refusal"]["error"]
        assert error is not None, f"rank {rank}: the conflicting accumulation was accepted"
        assert error[0] == "ConfigurationError", f"rank {rank}: {error}"
        assert "gradient_accumulation_steps=4" in error[1] and "accumulate_grad_batches" in error[1], error[1]
        sync = rec["refusal"]["sync_batchnorm"]
        assert sync is not None and sync[0] == "ConfigurationError" and "sync_batchnorm=True" in sync[1], sync


# ---- the merge rules, without a Trainer ---------------------------------------------------------------------


def _resolve(impl, config, **trainer) -> Any:
    integration = _declared(impl)
    return integration.resolve_config(config, integration.TrainerSettings(**trainer), None, 1)


def test_trainer_settings_fill_what_the_config_leaves_out(impl):
    """Accumulation, clipping and dtype come from the Trainer where the config does not give them (or says
    ``"auto"``, as HF's DeepSpeed configs do); ``bf16-true`` is the engine's bf16; an ``"auto"`` micro-batch size is
    the DataLoader's and an ``"auto"`` train_batch_size is left to be derived."""
    cfg = _resolve(impl, {"zero_stage": 2}, accumulate_grad_batches=3, gradient_clip_val=0.5, precision="bf16-true")
    assert (cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.dtype) == (3, 0.5, "bf16")
    auto = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    cfg = _resolve(impl, auto, accumulate_grad_batches=4, gradient_clip_val=2.0)
    assert (cfg.zero_stage, cfg.gradient_accumulation_steps, cfg.gradient_clipping) == (2, 4, 2.0)
    hf = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    cfg = _resolve(impl, hf, accumulate_grad_batches=2, micro_batch_size=8)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (8, 2, None)
    same = _resolve(impl, {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5},
                    accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert (same.gradient_accumulation_steps, same.gradient_clipping) == (2, 0.5)


@pytest.mark.parametrize(
    ("config", "trainer", "words"),
    [
        ({"gradient_accumulation_steps": 4}, {"accumulate_grad_batches": 2}, ["gradient_accumulation_steps=4", "2"]),
        ({"gradient_clipping": 1.0}, {"gradient_clip_val": 0.5}, ["gradient_clipping=1.0", "gradient_clip_val"]),
        ({}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, ["gradient_clip_algorithm", "'norm'"]),
        ({}, {"precision": "16-mixed"}, ["precision='16-mixed'", "'bf16-true'"]),
        ({}, {"precision": "bf16-mixed"}, ["precision='bf16-mixed'", "'32-true'"]),
        ({"bf16": {"enabled": True}}, {"precision": "32-true"}, ["dtype='bf16'", "precision"]),
        ({"managed_gradient_accumulation": False}, {}, ["managed_gradient_accumulation=False"]),
        ({}, {"automatic_optimization": False}, ["automatic_optimization=False"]),
        ("zero2.json", {}, ["config=", "mapping"]),
    ],
    ids=["accumulation", "clipping", "clip-by-value", "fp16-mixed", "bf16-mixed", "dtype", "unmanaged",
         "manual-optimization", "not-a-mapping"],
)
def test_conflicting_or_unsupported_trainer_settings_are_refused_by_name(impl, config, trainer, words):
    """A setting the config and the Trainer both give with different values, or one the engine does not compute
    (clipping by value, mixed precision, fp16, manual optimization, an unmanaged schedule), is a
    ConfigurationError naming it and what is allowed."""
    with pytest.raises(ConfigurationError) as info:
        _resolve(impl, config, **trainer)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return list(torch.nn.Linear(3, 2).parameters())


def test_configure_optimizers_optimizer_maps_to_the_engine_optimizer(impl):
    """torch's AdamW / Adam / SGD become the engine's ``adamw`` / ``adam`` (L2) / ``sgd`` with their
    hyper-parameters; a scheduler built on the optimizer already scaled ``lr``, the base value (``initial_lr``)
    is the one taken."""
    section = _declared(impl).optimizer_section
    params = _params()
    opt = torch.optim.AdamW(params, lr=0.3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert section(opt, params) == {"type": "adamw", "lr": 0.3, "betas": (0.8, 0.9), "eps": 1e-6,
                                    "weight_decay": 0.1}
    assert section(torch.optim.Adam(params, lr=0.2), params)["type"] == "adam"
    assert section(torch.optim.SGD(params, lr=0.1, momentum=0.9), params) == {
        "type": "sgd", "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9}


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: torch.optim.RMSprop(p), ["RMSprop", "SGD, Adam or AdamW"]),
        (lambda p: torch.optim.Adam(p, amsgrad=True), ["amsgrad=True"]),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), ["nesterov=True"]),
        (lambda p: torch.optim.AdamW([{"params": p[:1]}, {"params": p[1:], "lr": 0.1}]), ["2 parameter group"]),
        (lambda p: torch.optim.AdamW(p[:1]), ["1 parameter(s)", "(2)"]),
    ],
    ids=["other-optimizer", "amsgrad", "nesterov", "two-groups", "some-parameters"],
)
def test_an_optimizer_the_engine_cannot_run_is_refused_by_name(impl, make, words):
    """What R16 has no formula for (another optimizer, AMSGrad, Nesterov), per-group hyper-parameters and an
    optimizer over only some parameters are refused naming what to change, never approximated."""
    params = _params()
    with pytest.raises(ConfigurationError) as info:
        _declared(impl).optimizer_section(make(params), params)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


def test_config_optimizer_that_differs_from_configure_optimizers_is_refused(impl):
    """The config's optimizer section and configure_optimizers' optimizer are one optimizer: equal, accepted;
    different, refused naming the differing key (the lr here)."""
    integration = _declared(impl)
    settings = integration.TrainerSettings()
    mine = {"type": "adamw", "lr": 0.1}
    assert integration.resolve_config({"optimizer": mine}, settings, mine, 1).optimizer.lr == 0.1
    with pytest.raises(ConfigurationError, match=r"lr: config 0\.2 vs configure_optimizers 0\.1"):
        integration.resolve_config({"optimizer": {"type": "adamw", "lr": 0.2}}, settings, mine, 1)


def test_missing_lightning_is_reported_with_the_extra_only_when_used(impl, monkeypatch):
    """Without Lightning the integration module still imports (the area module imports it); asking for the
    strategy raises MissingDependencyError naming ``hostoffload[lightning]``."""
    integration = _declared(impl)
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    with pytest.raises(MissingDependencyError, match=r"hostoffload\[lightning\]"):
        integration.load_lightning()
    with pytest.raises(MissingDependencyError, match=r"hostoffload\[lightning\]"):
        integration.ZeroStrategy  # noqa: B018 (the attribute access is what is tested)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"checkpoint_io": object()}, ["checkpoint_io", "engine's own format"]),
        ({"find_unused_parameters": True}, ["find_unused_parameters", "allowed: config"]),
        ({"config": "ds_config.json"}, ["config='ds_config.json'", "mapping"]),
    ],
    ids=["checkpoint-io", "ddp-wrapper-option", "config-path"],
)
def test_strategy_arguments_are_checked_at_construction(impl, kwargs, words):
    """``ZeroStrategy(...)`` refuses, before any Trainer exists, a ``checkpoint_io`` plugin (checkpoints are the
    engine's format; it would be ignored), an option of torch's DDP wrapper (DDPStrategy would pass it on silently;
    there is no DDP wrapper here) and a config that is not a mapping, naming each."""
    integration = _lightning(impl)
    with pytest.raises(ConfigurationError) as info:
        integration.ZeroStrategy(**kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"
    strategy = integration.ZeroStrategy({"zero_stage": 1})
    assert strategy.handles_gradient_accumulation and strategy.restore_checkpoint_after_setup
