"""The host update under the boundary's last backward (docs/accumulation.md R30, config ``host_update_start``).

R30 changes when the host update runs, never its arithmetic: an engine may update each bucket speculatively,
unclipped, as its gradient lands during the boundary's last backward, but the trace of a boundary -- clipped or
not -- is R15/R16's. So the traces with ``host_update_start: last_backward`` are the reference's, bitwise on the
cpu accelerator, with clipping that triggers at every boundary (a speculating engine must redo every bucket) and
that never does (it must keep every bucket), at stages 2 and 3, with accumulation, at both state precisions. A
distributed engine's ``overlap_report()`` counts the redone boundaries: exactly those whose ``step()`` returned a
clip coefficient; that the first boundary did start early is also observed in host memory, not only in that
report. What is read between the last backward and the step (the master and the optimizer state) is the state
before the step; a checkpoint save there is refused, and the refusal leaves no trace. Everything that runs an
engine needs ``accumulation_overlapped_update``.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import (
    assert_matches_reference,
    assert_replay_consistent,
    assert_traces_match,
)
from conformance.areas.accumulation_assertions import cross_implementation_tolerance as tolerance
from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_ENGINE, engine_api
from conformance.areas.accumulation_strategies import SPLIT_SHARES, overlapped_update_scenarios
from conformance.suite.test_accumulation_split_update import REQUIRES_SPLIT, WIDE, _assert_same, pinned_state_copies
from reference.accumulation import AccumulationConfig, Scenario, compute_loss, scenario_calls
from reference.contract.errors import ConfigurationError

REQUIRES_OVERLAP = pytest.mark.requires("accumulation_overlapped_update")
pytestmark = pytest.mark.conformance_area("accumulation")

VALID = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"},
         "host_update_start": "last_backward"}


# ---- the config (R19) ----------------------------------------------------------------------------------------


@REQUIRES_OVERLAP
def test_R30_R19_host_update_start_default_and_values(area_api):
    """R30/R19: ``host_update_start`` defaults to "step" (any config); "last_backward" is accepted in its domain
    at stages 2 and 3, at both state precisions."""
    cfg_cls = area_api.AccumulationConfig
    assert cfg_cls.from_dict({}).host_update_start == "step"
    assert cfg_cls.from_dict({"host_update_start": "step"}).host_update_start == "step"
    for stage in (2, 3):
        for precision in ("fp32", "bf16"):
            cfg = cfg_cls.from_dict({**VALID, "zero_stage": stage, "state_precision": precision})
            assert cfg.host_update_start == "last_backward"


@REQUIRES_OVERLAP
@REQUIRES_SPLIT
@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
def test_R30_R28_last_backward_with_a_split_is_accepted(area_api, share):
    """R19/R30 with R28: "last_backward" and a ``gpu_share`` other than 0 go together (the host side starts early,
    the device side steps in ``step()``), flat and in DeepSpeed's nested shape."""
    cfg = area_api.AccumulationConfig.from_dict({**VALID, "gpu_share": share})
    assert (cfg.host_update_start, cfg.gpu_share) == ("last_backward", share)
    nested = area_api.AccumulationConfig.from_dict({"optimizer": {"type": "adamw"}, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "gpu_share": share, "host_update_start": "last_backward"},
    }})
    assert (nested.host_update_start, nested.gpu_share) == ("last_backward", share)


@REQUIRES_OVERLAP
@pytest.mark.parametrize("value", ["backward", "Last_Backward", "", None, 1, True])
def test_R30_R19_unknown_host_update_start_is_rejected(area_api, value):
    """R19/R30: anything but "step" / "last_backward" is a ConfigurationError naming the key and both values."""
    with pytest.raises(ConfigurationError, match="host_update_start") as info:
        area_api.AccumulationConfig.from_dict({**VALID, "host_update_start": value})
    assert "allowed" in str(info.value) and "step" in str(info.value) and "last_backward" in str(info.value)


@REQUIRES_OVERLAP
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"offload_optimizer": "none"}, "offload_optimizer='none'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"optimizer": {"type": "sgd", "momentum": 0.9}}, "optimizer.type='sgd'"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation=False"),
        ({"delayed_parameter_update": True}, "delayed_parameter_update=True"),
        ({"gpu_share": 0.5, "delayed_parameter_update": True}, "delayed_parameter_update=True"),
    ],
)
def test_R30_R19_last_backward_outside_its_domain_is_rejected(area_api, change, named):
    """R19/R30: "last_backward" needs the streamed host update (cpu offload, stage 2/3, Adam), a managed schedule,
    and not R27's delay (with R28's split or without); each names the key, the offending setting and the allowed
    values. The same config with "step" is fine."""
    with pytest.raises(ConfigurationError, match="host_update_start") as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change})
    assert named in str(info.value) and "allowed" in str(info.value)
    area_api.AccumulationConfig.from_dict({**VALID, **change, "host_update_start": "step"})


# ---- traces against the reference ------------------------------------------------------------------------------


def _config(stage: int, clip: float, precision: str = "fp32", dtype: str = "fp32", start: str = "last_backward"):
    return AccumulationConfig(
        zero_stage=stage, dtype=dtype, grad_accum_dtype="fp32", gradient_accumulation_steps=2,
        gradient_clipping=clip, optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer="cpu", offload_param="cpu" if stage == 3 else "none", state_precision=precision,
        host_update_start=start,
    )


@REQUIRES_OVERLAP
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_R30_R25_traces_match_reference_clipping_or_not(area_api, reference_api, impl, accelerator, stage,
                                                       precision):
    """R30/R25, pinned by a seed: W = 2, gas 2, AdamW, bf16 model for stage 3, 4 boundaries, with clipping that
    triggers at every boundary (0.05: every speculative bucket must be redone) and that never does (1e3: every
    one stands): the trace is the reference's (bitwise on cpu), the reference's is its "step" trace and replays
    from its own gradients (R15/R16: the start changes nothing of the arithmetic), and the clipped run differs
    from the unclipped one (the test would see the clip ignored)."""
    dtype = "bf16" if stage == 3 else "fp32"
    finals = {}
    for clip in (0.05, 1e3):
        calls = scenario_calls("BSBSBSBSBSBSBSBS")
        scenario = Scenario(_config(stage, clip, precision, dtype), 2, calls, seed=30, name="R30")
        expected = reference_api.run_scenario(scenario)
        coefs = [r.clip_coef for r in expected.boundaries()]
        assert len(coefs) == 4 and all((c is not None) == (clip < 1) for c in coefs), coefs
        assert_replay_consistent(expected)
        stepped = Scenario(_config(stage, clip, precision, dtype, "step"), 2, calls, seed=30, name="R30-step")
        assert_traces_match(reference_api.run_scenario(stepped), expected, None)
        actual = area_api.run_scenario(scenario)
        assert_traces_match(actual, expected, tolerance(scenario, impl, accelerator))
        finals[clip] = expected.boundaries()[-1].parameters
    assert any(not torch.equal(finals[0.05][n], finals[1e3][n]) for n in finals[1e3]), "clipping changed nothing"


@REQUIRES_OVERLAP
@REQUIRES_SPLIT
@pytest.mark.parametrize(("share", "stage"), [(0.5, 2), (1.0, 2), ("auto", 2), (0.5, 3)])
def test_R30_R28_split_traces_match_reference_clipping_or_not(area_api, reference_api, impl, accelerator, share,
                                                              stage):
    """R30 with R28 (W = 2, gas 2, AdamW, bf16 model, 4 boundaries, clipping at every boundary and never): the
    trace is the reference's, which is the all-host "step" trace (R28's values, R30's arithmetic). A fixed share
    cuts at the first boundary and "auto" at the second, both boundaries an engine may have speculated on the whole
    partition: the device side must start from the state before the step."""
    for clip in (0.05, 1e3):
        calls = scenario_calls("BSBSBSBSBSBSBSBS")
        config = _config(stage, clip, dtype="bf16").replace(gpu_share=share)
        scenario = Scenario(config, 2, calls, seed=32, name=f"R30-R28-{share}")
        expected = reference_api.run_scenario(scenario)
        all_host = Scenario(_config(stage, clip, dtype="bf16", start="step"), 2, calls, seed=32, name="R30-R28-host")
        assert_traces_match(reference_api.run_scenario(all_host), expected, None)
        actual = area_api.run_scenario(scenario)
        assert_traces_match(actual, expected, tolerance(scenario, impl, accelerator))


@REQUIRES_OVERLAP
@pytest.mark.parametrize("world", [1, 2])
def test_R30_R25_boundary_moves_match_reference(area_api, reference_api, impl, accelerator, world):
    """R30/R25: a speculation no step takes over -- the predicted boundary's backward, then the boundary moved
    away (``set_gradient_accumulation_boundary(False)``) and more backwards, or moved in early -- leaves no trace:
    clipping that triggers, stage 2, bf16 model: the trace is the reference's."""
    calls = scenario_calls("BSBFSBSBSBTSBSBFSBS")
    scenario = Scenario(_config(2, 0.05, dtype="bf16"), world, calls, seed=31, name="R30-boundary-moves")
    assert_matches_reference(
        area_api, reference_api, scenario, tolerance(scenario, impl, accelerator), replay=assert_replay_consistent
    )


@REQUIRES_OVERLAP
@given(data=st.data())
def test_R30_R25_drawn_scenario_matches_reference(area_api, reference_api, impl, accelerator, data):
    """R30/R25 on drawn scenarios (R30's domain: stages 2/3, W 1-2, gas, any model and communication dtypes,
    clipping off / on / always, Adam/AdamW, either state precision, boundary overrides that move the boundary
    after a predicted one's backward): the trace equals the reference's; the reference's replays."""
    scenario = data.draw(overlapped_update_scenarios())
    assert_matches_reference(
        area_api, reference_api, scenario, tolerance(scenario, impl, accelerator), replay=assert_replay_consistent
    )


@REQUIRES_OVERLAP
@REQUIRES_SPLIT
@given(data=st.data())
def test_R30_R28_drawn_split_scenario_matches_reference(area_api, reference_api, impl, accelerator, data):
    """R30 with R28 on drawn scenarios (as :func:`test_R30_R25_drawn_scenario_matches_reference`, with a share of
    0, 0.5, 1 or "auto"): the trace equals the reference's, which replays."""
    scenario = data.draw(overlapped_update_scenarios(shares=SPLIT_SHARES))
    assert_matches_reference(
        area_api, reference_api, scenario, tolerance(scenario, impl, accelerator), replay=assert_replay_consistent
    )


# ---- the engine: redone boundaries, reads between the backward and the step ------------------------------------


def _let_speculation_settle(engine, seen: dict) -> None:
    """Between the boundary's last backward and its step: where the engine opened a speculation for this boundary
    (its ``boundaries_speculated`` went up since ``seen``), wait until its count of buckets updated early has gone
    up too and then not moved for 200 ms (at most 10 s). An engine may stop speculating once ``step()`` has the
    norm, so how many buckets a step finds speculated depends on timing; waiting here makes the counts the tests
    assert exact (every bucket the engine speculates at all is speculated), and exercises the redo of every one of
    them where the boundary clips. Engines without a report (``host_update_start: step``) return None: no wait.
    ``seen`` carries the counts of the last call."""
    report = engine.overlap_report()
    if report is None:
        return
    opened = report["boundaries_speculated"] > seen.get("boundaries_speculated", 0)
    first = seen.get("buckets_speculated", 0)
    last, since, deadline = report["buckets_speculated"], time.monotonic(), time.monotonic() + 10.0
    while time.monotonic() < deadline and (time.monotonic() - since < 0.2 or (opened and last == first)):
        time.sleep(0.01)
        now = engine.overlap_report()["buckets_speculated"]
        if now != last:
            last, since = now, time.monotonic()
    seen.update(boundaries_speculated=report["boundaries_speculated"], buckets_speculated=last)


def _train(group, engine_cls, config: dict, boundaries: int, probe: bool = False, new_lr: float | None = None,
           loss_scales: tuple[float, ...] | None = None, save_dir: str | None = None):
    """One rank: ``boundaries`` boundaries of 2 micro-steps (WIDE, buckets of 16 elements); ``probe``: read the
    master and the optimizer state between each boundary's last backward and its step; ``new_lr``: set the
    learning rate there; ``loss_scales``: per boundary, a factor on its losses (to make given boundaries clip);
    ``save_dir``: try ``save_checkpoint`` there (what it raised, and whether the directory stayed empty, go into
    ``saves``). The losses, clip coefficients, final weights, master, state, the reads, the report."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
    try:
        cfg = engine.config
        losses, coefs, reads, after, speculated, seen = [], [], [], [engine.master_partition()], [], {}
        saves = []
        for k in range(boundaries):
            for j in range(cfg.gradient_accumulation_steps):
                gen = torch.Generator().manual_seed(1000 * k + 10 * j + rank)
                x = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.in_features, generator=gen)
                y = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.out_features, generator=gen)
                loss = compute_loss(engine.module, x, y, cfg.model_dtype)
                if loss_scales is not None:
                    loss = loss * loss_scales[k]
                engine.backward(loss)
                if engine.is_gradient_accumulation_boundary():
                    _let_speculation_settle(engine, seen)
                    if probe:
                        reads.append({"master": engine.master_partition(), **engine.optimizer_state().buffers})
                    if new_lr is not None:
                        engine.set_lr(new_lr * (k + 1))
                    if save_dir is not None:
                        try:
                            engine.save_checkpoint(save_dir, f"boundary{k}")
                            saves.append(("saved", ""))
                        except Exception as exc:  # classified by the test
                            saves.append((type(exc).__name__, str(exc)))
                        saves[-1] += (not os.path.exists(save_dir) or not os.listdir(save_dir),)
                out = engine.step()
                losses.append(loss.detach().clone())
            coefs.append(out.clip_coef)
            after.append(engine.master_partition())
            report = engine.overlap_report()
            if report is not None:
                speculated.append(report["buckets_speculated"])
        return {"losses": losses, "coefs": coefs, "weights": engine.state_dict(), "master": engine.master_partition(),
                "state": engine.optimizer_state().buffers, "reads": reads, "after": after,
                "report": engine.overlap_report(), "speculated": speculated, "saves": saves,
                "split": engine.split_report() if hasattr(engine, "split_report") else None}
    finally:
        engine.destroy()


def _engine_config(stage: int, clip: float, start: str = "last_backward") -> dict:
    return _config(stage, clip, dtype="bf16", start=start).to_dict()


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize("stage", [2, 3])
def test_R30_report_counts_exactly_the_clipped_boundaries(impl, stage):
    """R30 on the engine (W = 2, 3 boundaries): without clipping ``overlap_report()`` counts 3 boundaries
    started under the last backward and none redone; with clipping at every boundary, the first boundary is
    speculated and redone (each bucket it speculated, once), and the two after it, which follow a clipped
    boundary, are not speculated (``boundaries_not_speculated``); in both the run is bitwise the "step" run
    (losses, weights, master, state), whose report is None."""
    api = engine_api(impl)
    for clip, clipped in ((0.05, True), (1e3, False)):
        over = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(stage, clip), 3)
        step = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(stage, clip, "step"), 3)
        for rank, (got, want) in enumerate(zip(over, step, strict=True)):
            what = f"stage {stage}, clip {clip}, rank {rank}"
            _assert_same(got, want, what)
            assert want["report"] is None, f"{what}: host_update_start 'step' reported {want['report']}"
            report = got["report"]
            assert [c is not None for c in got["coefs"]] == [clipped] * 3, f"{what}: coefs {got['coefs']}"
            speculated = 1 if clipped else 3
            assert report["boundaries_speculated"] == speculated, f"{what}: {report}"
            assert report["boundaries_not_speculated"] == 3 - speculated, f"{what}: {report}"
            assert report["buckets_speculated"] > 0, f"{what}: {report}"
            assert report["boundaries_redone"] == (1 if clipped else 0), f"{what}: {report}"
            assert (report["buckets_redone"] > 0) == clipped, f"{what}: {report}"
            if clipped:  # the one speculated boundary clipped: each bucket it speculated is redone, once
                assert report["buckets_redone"] == report["buckets_speculated"], f"{what}: {report}"
            if not clipped:  # every boundary speculated the same buckets (all of them, given the time)
                steps = [b - a for a, b in zip([0, *got["speculated"]], got["speculated"], strict=False)]
                assert len(set(steps)) == 1 and steps[0] > 0, f"{what}: buckets speculated per boundary {steps}"
            assert report["speculations_discarded"] == 0, f"{what}: {report}"


@REQUIRES_OVERLAP
@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("share", "stage", "world"), [(0.5, 2, 2), ("auto", 2, 2), (1.0, 3, 1)])
def test_R30_R28_split_run_is_the_all_host_step_run(impl, share, stage, world):
    """R30 with R28 on the engine (3 boundaries, each boundary's buckets given time to be updated early): with
    clipping at every boundary and without, the run -- losses, weights, master, state -- is bitwise the all-host
    "step" run; a fixed share's device side holds elements (``split_report()``) and the host side updated buckets
    early (before the cut at least: a fixed share cuts at the first boundary, "auto" at the second); with share 1
    the boundaries after the cut are not started early (the host has nothing of them)."""
    api = engine_api(impl)
    for clip in (0.05, 1e3):
        budget = {"gpu_memory_budget": 4096} if share == "auto" else {}  # a cut on the cpu accelerator too
        config = {**_engine_config(stage, clip), "gpu_share": share, **budget}
        over = api.run_on_ranks(_train, world, api.ZeroEngine, config, 3)
        step = api.run_on_ranks(_train, world, api.ZeroEngine, _engine_config(stage, clip, "step"), 3)
        for rank, (got, want) in enumerate(zip(over, step, strict=True)):
            what = f"share {share}, stage {stage}, clip {clip}, rank {rank}"
            _assert_same(got, want, what)
            assert got["split"] is not None, f"{what}: no split reported"
            # "auto" may cut nothing on the cpu accelerator (its timings are noise there); a fixed share always cuts
            assert share == "auto" or got["split"]["device_elements"] > 0, f"{what}: {got['split']}"
            report = got["report"]
            assert report["buckets_speculated"] > 0 and report["speculations_discarded"] == 0, f"{what}: {report}"
            assert report["boundaries_redone"] <= report["boundaries_speculated"], f"{what}: {report}"
            if share == 1.0:  # after the cut the host keeps no element: nothing to start early (R30's report)
                assert (report["boundaries_speculated"], report["boundaries_not_speculated"]) == (1, 2), \
                    f"{what}: {report}"


def _state_changes_before_step(group, engine_cls, config: dict, watch_s: float) -> dict:
    """One rank, one boundary of 2 micro-steps: the pinned host buffers that hold the master or a moment (found as
    the R28 mirror test finds them: dtype, size and values equal to ``master_partition()`` or a buffer of
    ``optimizer_state()`` right after a read), copied before the boundary's last backward and then watched, from
    the backward's return until the step, for up to ``watch_s`` -- read directly, calling nothing of the engine that
    reads state (that would undo an early update, R30). Whether any of them changed before ``step()`` was called,
    how many there were, the report just before the step, and the clip coefficient."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
    try:
        cfg = engine.config
        batches = []
        for j in range(cfg.gradient_accumulation_steps):
            gen = torch.Generator().manual_seed(10 * j + rank)
            batches.append((torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.in_features, generator=gen),
                            torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.out_features, generator=gen)))
        for x, y in batches[:-1]:
            engine.backward(compute_loss(engine.module, x, y, cfg.model_dtype))
            engine.step()
        watched = pinned_state_copies(engine)
        before = [t.clone() for t in watched]
        x, y = batches[-1]
        engine.backward(compute_loss(engine.module, x, y, cfg.model_dtype))
        changed, deadline = False, time.monotonic() + watch_s
        while watched and not changed and time.monotonic() < deadline:
            changed = any(not torch.equal(t, b) for t, b in zip(watched, before, strict=True))
            time.sleep(0.005)
        report = engine.overlap_report()
        out = engine.step()
        return {"changed": changed, "watched": len(watched), "report": report, "coef": out.clip_coef}
    finally:
        engine.destroy()


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R30_update_starts_before_step_as_host_memory_shows(impl):
    """R30's early start, observed in host memory as well as in the engine's report (W = 1, stage 2, no clipping,
    the engine's first boundary, which R30's policy starts early): with "last_backward" a pinned host copy of the
    master or a moment changes after the boundary's last backward returned and before ``step()`` is called; with
    "step" none does (so the observation can fail). An engine that starts nothing early (its report counts no
    bucket and no watched buffer changed) fails. One whose report counts early buckets while no watched buffer
    changed keeps its early results elsewhere (R30 allows side buffers) and is skipped with that reason, as is
    one that lists no pinned buffer holding the master or a moment."""
    api = engine_api(impl)
    # up to 10 s for the early update to show; 1 s of watching the "step" run, where nothing may change
    early = api.run_on_ranks(_state_changes_before_step, 1, api.ZeroEngine, _engine_config(2, 1e3), 10.0)[0]
    if not early["watched"]:
        pytest.skip(f"{impl.name}'s engine lists no pinned host buffer holding the master or a moment "
                    "(pinned_buffers()): nothing to watch")
    late = api.run_on_ranks(_state_changes_before_step, 1, api.ZeroEngine, _engine_config(2, 1e3, "step"), 1.0)[0]
    assert early["coef"] is None and late["coef"] is None, (early, late)
    assert not late["changed"], f'host_update_start "step" changed the state before step(): {late}'
    if not early["changed"]:
        assert early["report"]["buckets_speculated"] > 0, (
            f"R30: the first boundary started nothing early: no watched buffer changed between the last backward "
            f"and step(), and the report counts no bucket: {early}")
        pytest.skip(f"{impl.name}'s report counts {early['report']['buckets_speculated']} buckets updated early, "
                    "but no pinned copy of the master or a moment changed: its early results live elsewhere")


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R30_speculation_resumes_after_a_boundary_that_does_not_clip(impl):
    """R30's policy (W = 2, stage 2, clip 1.0, 4 boundaries whose losses are scaled so that the first and third
    clip and the second and fourth do not): boundaries 1 and 3 are speculated (the first has no predecessor, the
    third follows one that did not clip) and redone; 2 and 4 follow a clipped boundary and are not speculated.
    The run is bitwise the "step" run."""
    api = engine_api(impl)
    scales = (1e4, 1e-4, 1e4, 1e-4)
    over = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1.0), 4, False, None, scales)
    step = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1.0, "step"), 4, False, None, scales)
    for rank, (got, want) in enumerate(zip(over, step, strict=True)):
        _assert_same(got, want, f"rank {rank}")
        assert [c is not None for c in got["coefs"]] == [True, False, True, False], got["coefs"]
        report = got["report"]
        assert report["boundaries_speculated"] == 2 and report["boundaries_not_speculated"] == 2, report
        assert report["boundaries_redone"] == 2 and report["speculations_discarded"] == 0, report


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R30_reads_between_last_backward_and_step_see_the_state_before_it(impl):
    """R30 with a checkpoint's reads between the boundary's last backward and its step (W = 2, stage 2, no
    clipping): the master and the optimizer state read there are the previous boundary's (the speculation does
    not show), the run goes on bitwise as the "step" run, and the report counts each speculation discarded."""
    api = engine_api(impl)
    over = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3), 3, True)
    step = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3, "step"), 3, True)
    for rank, (got, want) in enumerate(zip(over, step, strict=True)):
        _assert_same(got, want, f"rank {rank}")
        for k, (read, ref) in enumerate(zip(got["reads"], want["reads"], strict=True)):
            assert torch.equal(read["master"], got["after"][k]), f"rank {rank}: boundary {k} read a changed master"
            for name in ref:
                assert torch.equal(read[name], ref[name]), f"rank {rank}: boundary {k}: {name} read differs"
        assert got["report"]["speculations_discarded"] == 3, got["report"]


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.requires("accumulation_checkpoint")
def test_R30_a_save_between_last_backward_and_step_is_refused_and_leaves_no_trace(impl, tmp_path):
    """R30 with ``save_checkpoint`` between the boundary's last backward and its step (W = 2, stage 2, no
    clipping; issue 52, defect 5: the docs called it supported). The gradient accumulated by that backward is not
    part of a checkpoint (docs/zero.md, "Checkpoints"), so the save is refused there as on any path -- an
    UnsupportedOperationError on every rank, nothing written -- and the refusal leaves no trace: the speculation
    the backward started is neither discarded nor redone, and the run is bitwise the "step" run."""
    api = engine_api(impl)
    directory = str(tmp_path / "ck")
    over = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3), 3, False, None, None, directory)
    step = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3, "step"), 3)
    for rank, (got, want) in enumerate(zip(over, step, strict=True)):
        assert len(got["saves"]) == 3, got["saves"]
        for k, (kind, message, untouched) in enumerate(got["saves"]):
            assert kind == "UnsupportedOperationError", f"rank {rank}, boundary {k}: {kind}: {message}"
            assert untouched, f"rank {rank}, boundary {k}: the refused save wrote into {directory}"
        _assert_same(got, want, f"rank {rank}")
        report = got["report"]
        assert report["speculations_discarded"] == 0 and report["boundaries_redone"] == 0, report


@REQUIRES_OVERLAP
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R30_learning_rate_set_after_the_backward_is_used(impl):
    """R30: a learning rate set between the boundary's last backward and its step is the step's (the speculation
    guessed the old one): no clipping, W = 2, stage 2 -- bitwise the "step" run, every boundary redone."""
    api = engine_api(impl)
    over = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3), 3, False, 3e-3)
    step = api.run_on_ranks(_train, 2, api.ZeroEngine, _engine_config(2, 1e3, "step"), 3, False, 3e-3)
    for rank, (got, want) in enumerate(zip(over, step, strict=True)):
        _assert_same(got, want, f"rank {rank}")
        assert got["report"]["boundaries_redone"] == 3, got["report"]
