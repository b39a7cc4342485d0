"""Checkpoints of a multi-process accumulation engine: a resumed run is the uninterrupted run, bitwise.

For every implementation that declares ``distributed_engine`` and ``accumulation_checkpoint`` (docs/zero.md,
"Checkpoints"): train N boundary steps, ``save_checkpoint``, build a *fresh* engine (a new model from the same
seed, a different RNG state), ``load_checkpoint``, train M more. Each boundary records the loss, norm, clip
coefficient, learning rate (an LR scheduler is attached), counters, the consolidated ``state_dict()`` and a
draw of the global RNG; the resumed records must equal the uninterrupted N+M run's exactly.

Across world sizes every rank reads the same micro-batch, so the reduced gradient ``g/2 + g/2`` at W=2 is ``g``
exactly and runs at W=1 and W=2 take bitwise the same steps (one backward per boundary, so every stage agrees
too, R23; no clipping, whose coefficient depends on the last bits of the norm's summation order). A run saved at
one world size and stage and resumed at another must then continue exactly like an uninterrupted run at the new
one. W=4 is covered by a round trip W=2 -> W=4 -> W=2 (uneven partitions, padding): nothing may change.

The engine class comes from the implementation under test (``engine_api(impl).ZeroEngine``); ranks run through its
``run_on_ranks``.
"""

from __future__ import annotations

import os

import pytest
import torch

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, engine_api
from reference.accumulation import ModelSpec, compute_loss
from reference.contract.accumulation_checkpoint_names import RESERVED_TAGS
from reference.contract.errors import CheckpointError, ConfigurationError, UnsupportedOperationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_CHECKPOINT, pytest.mark.runs_in_subprocesses]

SEED = 11


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def _batch(index: int, spec: ModelSpec, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same micro-batch on every rank (see the module docstring)."""
    gen = torch.Generator().manual_seed(7919 * index + 17)
    return torch.randn(micro, spec.in_features, generator=gen), torch.randn(micro, spec.out_features, generator=gen)


def _train(
    group, engine_cls, config, start: int, steps: int, load=None, save=None, rng_seed: int = 0,
    attach_after_load: bool = False, stray_backward: bool = False,
) -> list:
    """One rank: a fresh engine (optionally loading ``load=(dir, tag)``; the LR scheduler attached before the
    load, or after it with ``attach_after_load``), ``steps`` boundaries from boundary index ``start``, optionally
    ``save=(dir, tag)`` at the end. Returns this rank's records. ``stray_backward``: a backward on a batch of
    its own before the load, and a save (tag ``after-load``) right after it.

    Each rank's RNG is seeded differently and the model carries a buffer the training loop advances by a
    rank-dependent amount at every boundary (as a rank's BatchNorm statistics would drift on its own data): what
    a rank's checkpoint file holds for that rank alone must come back to that rank."""
    import torch.distributed as dist
    from torch.optim.lr_scheduler import LambdaLR

    rank = dist.get_rank(group)
    torch.manual_seed(rng_seed * 100 + rank)  # differs between runs: a load must restore the saved state
    spec = ModelSpec()
    model = spec.build(SEED)
    model.register_buffer("rank_boundaries", torch.zeros(2))  # state_dict() carries it: see "params"
    engine = engine_cls(model, config, process_group=group)
    try:
        if not attach_after_load:
            engine.lr_scheduler = LambdaLR(engine.optimizer, _decay)
        if load is not None:
            if stray_backward:  # a gradient accumulated before the load: the load must drop it
                x, y = _batch(10_000, spec, engine.config.train_micro_batch_size_per_gpu)
                engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
            engine.load_checkpoint(*load)
            if stray_backward:  # nothing accumulated survived the load, so a save is allowed again
                engine.save_checkpoint(load[0], "after-load")
        if attach_after_load:  # the loaded scheduler state waits for a scheduler, then is applied to it
            engine.lr_scheduler = LambdaLR(engine.optimizer, _decay)
        cfg = engine.config
        records = []
        for k in range(start, start + steps):
            for j in range(cfg.gradient_accumulation_steps):
                x, y = _batch(k * cfg.gradient_accumulation_steps + j, spec, cfg.train_micro_batch_size_per_gpu)
                loss = compute_loss(engine.module, x, y, cfg.model_dtype)
                engine.backward(loss)
                out = engine.step()
            assert out.boundary
            engine.module.rank_boundaries.add_(rank + 1)
            records.append(
                {
                    "loss": loss.detach().clone(),
                    "norm": out.grad_norm,
                    "clip": out.clip_coef,
                    "lr": engine.get_lr(),
                    "counters": (engine.micro_steps, engine.global_steps, engine.global_samples),
                    "params": engine.state_dict(),
                    "rng": torch.rand(3),
                }
            )
        state = engine.state_dict() if steps == 0 else None
        if save is not None:
            engine.save_checkpoint(*save)
    finally:
        engine.destroy()
    return records if steps else [{"params": state}]


def _assert_same(got: list, want: list, what: str, *, samples_offset: int = 0) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} records, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        where = f"{what}, boundary {i}"
        assert torch.equal(a["loss"], b["loss"]), f"{where}: loss {a['loss']} != {b['loss']}"
        assert a["norm"] == b["norm"], f"{where}: grad norm {a['norm']!r} != {b['norm']!r}"
        assert a["clip"] == b["clip"], f"{where}: clip coefficient {a['clip']!r} != {b['clip']!r}"
        assert a["lr"] == b["lr"], f"{where}: lr {a['lr']} != {b['lr']} (scheduler state not restored?)"
        want_counters = (*b["counters"][:2], b["counters"][2] + samples_offset)
        assert a["counters"] == want_counters, f"{where}: counters {a['counters']} != {want_counters}"
        for name, p in b["params"].items():
            assert torch.equal(a["params"][name], p), f"{where}: parameter {name} differs"
        assert torch.equal(a["rng"], b["rng"]), f"{where}: RNG draw differs (RNG state not restored)"


def _config(stage: int, **extra) -> dict:
    cfg = {
        "zero_stage": stage,
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "adamw", "lr": 0.05, "weight_decay": 0.01},
    }
    cfg.update(extra)
    return cfg


def test_resume_with_the_scheduler_attached_after_the_load_equals_uninterrupted_run(impl, tmp_path):
    """docs/zero.md, "LR schedules": a checkpoint loaded before any lr_scheduler is attached keeps the saved
    scheduler state and applies it to the scheduler attached next (its lr in force, not the schedule's first
    value): the resumed run's learning rates, and everything they drive, equal the uninterrupted run's."""
    api = engine_api(impl)
    cfg = _config(1)
    full = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 4, None, None, 1)[0]
    api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 2, None, (str(tmp_path), "ck"), 1)
    resumed = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 2, 2, (str(tmp_path), None), None, 2, True)[0]
    _assert_same(resumed, full[2:], "scheduler attached after the load")


SAME_WORLD = [
    pytest.param(0, {}, id="stage0"),
    pytest.param(1, {"dtype": "bf16", "grad_accum_dtype": "fp32"}, id="stage1-bf16"),
    pytest.param(2, {"offload_optimizer": "cpu"}, id="stage2-offload"),
    pytest.param(1, {"offload_optimizer": "nvme"}, id="stage1-nvme"),
    pytest.param(3, {"dtype": "bf16", "offload_optimizer": "cpu", "offload_param": "cpu"}, id="stage3-offload-bf16"),
]


@pytest.mark.parametrize("stage,extra", SAME_WORLD)
def test_R3_R16_resume_at_same_world_size_equals_uninterrupted_run(impl, tmp_path, stage, extra):
    """Train 3 boundaries on 2 ranks, save, load into fresh engines, train 2 more: losses, norms, clip
    coefficients, scheduled learning rates, counters (R3), full parameters (the optimizer state and step count
    of R16 included, or they would drift), every rank's buffers and every rank's RNG draws equal an uninterrupted
    5-boundary run bitwise."""
    api = engine_api(impl)
    cfg = _config(stage, **extra)
    if extra.get("offload_optimizer") == "nvme":  # the Adam state is read back from / written into its files
        cfg["nvme_path"] = str(tmp_path / "swap")
        os.mkdir(cfg["nvme_path"])
    full = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 5, None, None, 1)
    api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 3, None, (str(tmp_path), "ck"), 1)
    resumed = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 3, 2, (str(tmp_path), None), None, 2)
    for r in range(2):  # each rank's own RNG state and buffers come back to it
        _assert_same(resumed[r], full[r][3:], f"stage {stage} resumed at W=2, rank {r}")


@pytest.mark.parametrize("stage,extra", [SAME_WORLD[0], SAME_WORLD[2]])
def test_R20_load_drops_a_gradient_accumulated_before_it(impl, tmp_path, stage, extra):
    """A load after a backward drops the gradient that backward accumulated (no checkpoint holds it): a save
    right after the load is accepted (nothing would be lost), and the run continues exactly as one resumed
    without that backward -- no stale gradient reaches the first boundary after the load."""
    api = engine_api(impl)
    cfg = _config(stage, **extra)
    full = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 4, None, None, 1)
    api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 3, None, (str(tmp_path), "ck"), 1)
    resumed = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 3, 1, (str(tmp_path), "ck"), None, 2, False, True)
    for r in range(2):
        _assert_same(resumed[r], full[r][3:], f"stage {stage}, loaded after a backward, rank {r}")


CROSS_WORLD = [
    pytest.param(1, 1, 2, 3, "fp32", id="W1-stage1-to-W2-stage3"),
    pytest.param(2, 2, 1, 0, "bf16", id="W2-stage2-to-W1-stage0"),
]


@pytest.mark.parametrize("w_save,s_save,w_load,s_load,dtype", CROSS_WORLD)
def test_R23_resume_at_another_world_size_and_stage_continues_exactly(
    impl, tmp_path, w_save, s_save, w_load, s_load, dtype
):
    """A checkpoint saved at one world size and stage loads at another (resharding): the run continues exactly
    like an uninterrupted run at the new world size (identical data on every rank and one backward per
    boundary make both world sizes and all stages take the same steps, R23); global_samples continues from the
    saved count."""
    api = engine_api(impl)
    base = {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "dtype": dtype}
    save_cfg, load_cfg = _config(s_save, **base), _config(s_load, **base)
    first = api.run_on_ranks(_train, w_save, api.ZeroEngine, save_cfg, 0, 3, None, (str(tmp_path), "ck"), 1)[0]
    full = api.run_on_ranks(_train, w_load, api.ZeroEngine, load_cfg, 0, 5, None, None, 1)[0]
    for name, p in full[2]["params"].items():  # the premise: both world sizes took the same first 3 steps
        assert torch.equal(first[2]["params"][name], p), f"premise: W={w_save} and W={w_load} differ at {name}"
    resumed = api.run_on_ranks(_train, w_load, api.ZeroEngine, load_cfg, 3, 2, (str(tmp_path), "ck"), None, 2)[0]
    offset = first[2]["counters"][2] - full[2]["counters"][2]
    _assert_same(resumed, full[3:], f"W={w_save} stage {s_save} -> W={w_load} stage {s_load}", samples_offset=offset)


def test_R8_reshard_round_trip_through_four_ranks_changes_nothing(impl, tmp_path):
    """W=2 (stage 1) -> W=4 (stage 3, parameters offloaded: uneven pieces, padding) -> W=2: the W=4 engine's
    consolidated parameters equal the saved ones, and the run resumed at W=2 from the W=4 checkpoint equals the
    uninterrupted W=2 run bitwise (R8's partitions moved, nothing else)."""
    api = engine_api(impl)
    cfg = _config(1, dtype="bf16", grad_accum_dtype="fp32", offload_optimizer="cpu")
    wide = _config(3, dtype="bf16", grad_accum_dtype="fp32", offload_optimizer="cpu", offload_param="cpu")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    full = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 4, None, None, 1)[0]
    api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 0, 2, None, (a, "ck"), 1)
    mid = api.run_on_ranks(_train, 4, api.ZeroEngine, wide, 0, 0, (a, "ck"), (b, "ck"), 3)[0]
    for name, p in full[1]["params"].items():
        assert torch.equal(mid[0]["params"][name], p), f"W=4 after loading: parameter {name} differs"
    resumed = api.run_on_ranks(_train, 2, api.ZeroEngine, cfg, 2, 2, (b, "ck"), None, 2)[0]
    _assert_same(resumed, full[2:], "W=2 -> W=4 -> W=2")


# ---- errors and the consolidated state_dict ----------------------------------------------------------------


def _errors(group, engine_cls, directory: str) -> dict:
    """One rank (W=1): the checkpoint errors, each leaving the engine usable."""
    spec = ModelSpec()
    cfg = _config(2, offload_optimizer="cpu")
    engine = engine_cls(spec.build(SEED), cfg, process_group=group)
    out: dict = {}

    def attempt(key, fn):
        try:
            fn()
        except Exception as exc:  # classified by the test
            out[key] = (type(exc), str(exc))
        else:
            out[key] = None

    def one_boundary(eng):
        for j in range(2):
            x, y = _batch(j, spec, 2)
            eng.backward(compute_loss(eng.module, x, y, eng.config.model_dtype))
            eng.step()

    one_boundary(engine)
    engine.save_checkpoint(directory, "good")
    before = engine.state_dict()
    attempt("missing", lambda: engine.load_checkpoint(directory, "nope"))
    os.makedirs(os.path.join(directory, ".half.partial"))  # a save that died before its commit
    attempt("unfinished", lambda: engine.load_checkpoint(directory, "half"))
    engine.save_checkpoint(directory, "cut")
    os.unlink(os.path.join(directory, "cut", "rank0.pt"))
    attempt("partial", lambda: engine.load_checkpoint(directory, "cut"))
    engine.save_checkpoint(directory, "torn")
    with open(os.path.join(directory, "torn", "rank0.pt"), "r+b") as f:
        f.truncate(10)
    attempt("truncated", lambda: engine.load_checkpoint(directory, "torn"))
    engine.save_checkpoint(directory, "corrupt")
    with open(os.path.join(directory, "corrupt", "rank0.pt"), "r+b") as f:
        f.write(b"\0" * 64)  # same size, unreadable content
    attempt("corrupt", lambda: engine.load_checkpoint(directory, "corrupt"))
    other = engine_cls(ModelSpec(hidden=7).build(SEED), cfg, process_group=group)
    other.save_checkpoint(directory, "foreign")
    other.destroy()
    attempt("foreign", lambda: engine.load_checkpoint(directory, "foreign"))
    os.makedirs(os.path.join(directory, "alien"))
    with open(os.path.join(directory, "alien", "manifest.json"), "w") as f:
        f.write('{"format": "something else"}')
    attempt("alien", lambda: engine.load_checkpoint(directory, "alien"))
    unchanged = all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
    x, y = _batch(5, spec, 2)
    engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
    attempt("pending", lambda: engine.save_checkpoint(directory, "pending"))
    engine.zero_grad()
    engine.load_checkpoint(directory, "good")  # still usable: the good checkpoint loads after all that
    one_boundary(engine)
    after = engine.state_dict()
    engine.destroy()
    ref = engine_cls(spec.build(SEED), cfg, process_group=group)
    one_boundary(ref)
    one_boundary(ref)
    expected = ref.state_dict()
    ref.destroy()
    out["unchanged"] = unchanged
    out["usable"] = all(torch.equal(after[k], v) for k, v in expected.items())
    out["leftovers"] = sorted(e for e in os.listdir(directory) if e.endswith(".tmp") or e.endswith(".old"))
    return out


def test_R20_checkpoint_errors_are_clear_and_leave_the_engine_usable(impl, tmp_path):
    """A missing tag, a save that never committed, a checkpoint missing a rank file or with a truncated or
    corrupt one, one of another model and a directory of another format each raise CheckpointError naming the
    problem; the engine is unchanged and loads a good checkpoint afterwards (then trains exactly like a run that never
    failed). Saving with an accumulated, un-stepped gradient is refused like R20's rejected calls."""
    api = engine_api(impl)
    out = api.run_on_ranks(_errors, 1, api.ZeroEngine, str(tmp_path))[0]
    # What each message must say (any of the phrases): the tag, or the nature of the damage.
    expect = {
        "missing": ("nope",),
        "unfinished": ("half",),
        "partial": ("partial",),
        "truncated": ("partial", "damaged", "cannot be"),
        "corrupt": ("partial", "damaged", "cannot be"),
        "foreign": ("another model",),
        "alien": ("alien",),
    }
    for key, phrases in expect.items():
        assert out[key] is not None, f"{key}: load_checkpoint accepted it"
        cls, msg = out[key]
        assert issubclass(cls, CheckpointError), f"{key}: raised {cls.__name__}: {msg}"
        assert any(p in msg for p in phrases), f"{key}: message says none of {phrases}: {msg}"
    assert out["pending"] is not None and issubclass(out["pending"][0], UnsupportedOperationError), out["pending"]
    assert "boundary" in out["pending"][1]
    assert out["unchanged"], "a failed load_checkpoint changed the engine's parameters"
    assert out["usable"], "after the failed loads, loading the good checkpoint did not resume exactly"
    assert out["leftovers"] == [], f"temporary files left behind: {out['leftovers']}"


def _failed_save(group, engine_cls, directory: str) -> dict:
    """Two ranks: save "ck", train on, save "ck" again with rank 1 failing to write its file."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    spec = ModelSpec()
    engine = engine_cls(spec.build(SEED), _config(3), process_group=group)
    out: dict = {}

    def boundary(k):
        for j in range(2):
            x, y = _batch(2 * k + j, spec, 2)
            engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
            engine.step()

    boundary(0)
    engine.save_checkpoint(directory, "ck")
    saved = engine.state_dict()
    boundary(1)
    bad = {"hook": (lambda: None)} if rank == 1 else {}
    try:
        engine.save_checkpoint(directory, "ck", client_state=bad)
        out["second"] = None
    except Exception as exc:  # classified by the test
        out["second"] = (type(exc).__name__, str(exc))
    engine.load_checkpoint(directory, "ck")
    out["restored"] = all(torch.equal(saved[k], v) for k, v in engine.state_dict().items())
    out["steps"] = engine.global_steps
    engine.destroy()
    return out


def test_R20_a_save_that_fails_on_one_rank_leaves_the_previous_checkpoint(impl, tmp_path):
    """Atomic saves: when one rank cannot write its file, every rank raises (none is left waiting in a
    collective), and the tag still loads the previous, complete checkpoint -- the failed save is invisible."""
    api = engine_api(impl)
    out = api.run_on_ranks(_failed_save, 2, api.ZeroEngine, str(tmp_path))
    for r, o in enumerate(out):
        assert o["second"] is not None, f"rank {r}: the failing save did not raise"
        assert o["restored"] and o["steps"] == 1, f"rank {r}: tag 'ck' no longer holds the first checkpoint"
    assert "rank 1" in out[0]["second"][1], out[0]["second"]


def _reserved_tags(group, engine_cls, directory: str) -> dict:
    """One rank: a good save, then a save under every name the layout reserves (with and without
    ``save_latest``); then what the directory holds and what ``load_checkpoint(dir)`` resumes."""
    spec = ModelSpec()
    engine = engine_cls(spec.build(SEED), _config(1), process_group=group)
    for j in range(2):
        x, y = _batch(j, spec, 2)
        engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
        engine.step()
    engine.save_checkpoint(directory, "good")
    listing = sorted(os.listdir(directory))
    out: dict = {"refused": {}}
    for name in RESERVED_TAGS:
        for save_latest in (False, True):
            try:
                engine.save_checkpoint(directory, name, save_latest=save_latest)
            except Exception as exc:  # classified by the test
                out["refused"][(name, save_latest)] = (type(exc), str(exc))
            else:
                out["refused"][(name, save_latest)] = None
            out.setdefault("listings", []).append(sorted(os.listdir(directory)) == listing)
    path, _ = engine.load_checkpoint(directory)
    out["resumed"] = os.path.basename(path)
    engine.destroy()
    return out


def test_R20_reserved_tag_names_are_refused_before_anything_is_written(impl, tmp_path):
    """R20: a tag equal to a name the checkpoint layout reserves (``latest``, ``latest.tmp``:
    ``reference.contract.accumulation_checkpoint_names.RESERVED_TAGS``) is a ConfigurationError naming it, with
    ``save_latest`` True or False, and the directory is left exactly as it was: ``tag="latest",
    save_latest=False`` used to replace the ``latest`` file with a directory, and the next ``load_checkpoint(dir)``
    could not resume."""
    api = engine_api(impl)
    out = api.run_on_ranks(_reserved_tags, 1, api.ZeroEngine, str(tmp_path))[0]
    for (name, save_latest), got in out["refused"].items():
        assert got is not None, f"save_checkpoint(tag={name!r}, save_latest={save_latest}) was accepted"
        cls, msg = got
        assert issubclass(cls, ConfigurationError), f"tag={name!r}: raised {cls.__name__}: {msg}"
        assert repr(name) in msg and "reserved" in msg, f"tag={name!r}: the message does not name it: {msg}"
    assert all(out["listings"]), "a refused save changed the checkpoint directory"
    assert out["resumed"] == "good", out["resumed"]


#: Tags that cannot name a checkpoint directory (R20): empty, the directory itself or its parent, hidden (the
#: staging and rollback directories' names start with '.'), a path, not a str.
MALFORMED_TAGS = ("", ".", "..", ".staging", f"a{os.sep}b", 3)


def _malformed_tags(group, engine_cls, directory: str) -> dict:
    """One rank: a good save, then a save under each malformed tag; what each raised and whether the directory
    changed."""
    spec = ModelSpec()
    engine = engine_cls(spec.build(SEED), _config(1), process_group=group)
    for j in range(2):  # a boundary: a save is allowed
        x, y = _batch(j, spec, 2)
        engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
        engine.step()
    engine.save_checkpoint(directory, "good")
    listing = sorted(os.listdir(directory))
    out: dict = {"refused": {}, "listings": []}
    for tag in MALFORMED_TAGS:
        try:
            engine.save_checkpoint(directory, tag)
        except Exception as exc:  # classified by the test
            out["refused"][repr(tag)] = (type(exc), str(exc))
        else:
            out["refused"][repr(tag)] = None
        out["listings"].append(sorted(os.listdir(directory)) == listing)
    engine.destroy()
    return out


def test_R20_malformed_tags_are_refused_before_anything_is_written(impl, tmp_path):
    """R20: a tag that cannot name a checkpoint directory (empty, ``.``/``..``, ``.``-prefixed, a path, not a
    str) is a ConfigurationError naming ``tag=`` -- not a TypeError from the path arithmetic, not a save into the
    checkpoint directory itself -- and the directory is left exactly as it was."""
    api = engine_api(impl)
    out = api.run_on_ranks(_malformed_tags, 1, api.ZeroEngine, str(tmp_path))[0]
    for tag, got in out["refused"].items():
        assert got is not None, f"save_checkpoint(tag={tag}) was accepted"
        cls, msg = got
        assert issubclass(cls, ConfigurationError), f"tag={tag}: raised {cls.__name__}: {msg}"
        assert f"tag={tag}" in msg, f"tag={tag}: the message does not name it: {msg}"
    assert all(out["listings"]), "a refused save changed the checkpoint directory"


def _save_in_no_sync(group, engine_cls, directory: str) -> dict:
    """One rank, at a boundary (nothing accumulated): a save inside ``no_sync()`` with no backward in it."""
    spec = ModelSpec()
    engine = engine_cls(spec.build(SEED), _config(1), process_group=group)
    for j in range(2):
        x, y = _batch(j, spec, 2)
        engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
        engine.step()
    out: dict = {"refused": None}
    with engine.no_sync():
        try:
            engine.save_checkpoint(directory, "inside")
        except Exception as exc:  # classified by the test
            out["refused"] = (type(exc), str(exc))
    out["listing"] = sorted(os.listdir(directory))
    engine.save_checkpoint(directory, "after")  # still usable
    out["after"] = sorted(os.listdir(directory))
    engine.destroy()
    return out


def test_R20_save_inside_no_sync_is_refused_even_with_nothing_accumulated(impl, tmp_path):
    """R20: ``save_checkpoint`` inside ``no_sync()`` is an UnsupportedOperationError naming ``no_sync()`` -- also
    when no backward ran in it yet (nothing accumulated to lose), so the refusal does not depend on the
    gradient-pending check -- writes nothing, and the engine saves normally after leaving it."""
    api = engine_api(impl)
    out = api.run_on_ranks(_save_in_no_sync, 1, api.ZeroEngine, str(tmp_path))[0]
    assert out["refused"] is not None, "save_checkpoint() inside no_sync() was accepted"
    cls, msg = out["refused"]
    assert issubclass(cls, UnsupportedOperationError) and "no_sync()" in msg, f"{cls.__name__}: {msg}"
    assert out["listing"] == [], f"the refused save wrote {out['listing']}"
    assert "after" in out["after"], out["after"]


def _state_dicts(group, engine_cls, stage: int) -> dict:
    spec = ModelSpec()
    cfg = _config(stage, dtype="bf16")
    engine = engine_cls(spec.build(SEED), cfg, process_group=group)
    for j in range(2):
        x, y = _batch(j, spec, 2)
        engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
        engine.step()
    sd = engine.state_dict()
    plain = spec.build(SEED + 1)
    fresh = engine_cls(plain, cfg, process_group=group)
    fresh.load_state_dict(sd)
    back = fresh.state_dict()
    fp32 = {k: v.float() * 0.5 + 1e-3 for k, v in sd.items()}  # not representable in bf16: the load casts
    fresh.load_state_dict(fp32)
    half = fresh.state_dict()
    try:
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "out.bias"})
        strict = None
    except ConfigurationError as exc:
        strict = str(exc)
    fresh.destroy()
    engine.destroy()
    return {"sd": sd, "back": back, "half": half, "fp32": fp32, "strict": strict}


@pytest.mark.parametrize("stage", [0, 3])
def test_R12_state_dict_is_full_at_every_stage_and_loads_into_a_fresh_engine(impl, stage):
    """R12: even at stage 3 (parameters partitioned, ``[0]``-shaped between uses) ``state_dict()`` returns every
    parameter at full shape, equal on both ranks and equal to the stage-0 values; ``load_state_dict`` of it
    into an engine over another model reproduces it, an fp32 state_dict loads as its model-dtype cast, and a
    missing key is rejected by name."""
    api = engine_api(impl)
    got = api.run_on_ranks(_state_dicts, 2, api.ZeroEngine, stage)
    ref = api.run_on_ranks(_state_dicts, 2, api.ZeroEngine, 0)[0] if stage else got[0]
    spec_shapes = {n: tuple(p.shape) for n, p in ModelSpec().build(SEED).state_dict().items()}
    for r in range(2):
        sd = got[r]["sd"]
        assert {k: tuple(v.shape) for k, v in sd.items()} == spec_shapes, f"rank {r}: state_dict shapes"
        for k, v in ref["sd"].items():
            assert torch.equal(sd[k], v), f"rank {r}: {k} differs from stage 0"
            assert torch.equal(got[r]["back"][k], v), f"rank {r}: {k} after load_state_dict"
            assert torch.equal(got[r]["half"][k], got[r]["fp32"][k].to(v.dtype)), f"rank {r}: fp32 load of {k}"
        assert got[r]["strict"] is not None and "out.bias" in got[r]["strict"], got[r]["strict"]
