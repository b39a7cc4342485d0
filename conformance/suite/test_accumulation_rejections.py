"""Every rejection of docs/accumulation.md R19/R20, for every implementation, with its message checked.

Config rejections go through the implementation's ``AccumulationConfig.from_dict`` (the config object is part
of the area's API, R26) and the shared ``Scenario``; call-sequence rejections go through
``run_scenario`` (a multi-process runner must bring the worker's error class back, R26) and, for the
reference, through the engine directly to check R20's "state unchanged" clause.
"""

from __future__ import annotations

import pytest
import torch

from conformance.areas.accumulation_assertions import assert_boundaries_match
from conformance.areas.assertions import assert_names_argument
from reference.accumulation import Scenario, scenario_calls
from reference.contract.errors import ConfigurationError, UnsupportedOperationError

pytestmark = pytest.mark.conformance_area("accumulation")

# (config changes, the options the message must name, the allowed values it must list where the specification
# lists them by name). Each case is one rejection of R19. The wording around them is the implementation's own.
CONFIG_REJECTIONS = [
    pytest.param({"gradient_acumulation_steps": 2}, ["gradient_acumulation_steps"], ["gradient_accumulation_steps"],
                 id="unknown-key"),
    pytest.param({"optimizer": {"type": "adam", "betaz": (0.9, 0.9)}}, ["betaz"], ["betas"], id="unknown-opt-key"),
    pytest.param({"zero_stage": 4}, ["zero_stage"], ["0", "1", "2", "3"], id="stage"),
    pytest.param({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps"], [], id="gas"),
    pytest.param({"train_micro_batch_size_per_gpu": 1.5}, ["train_micro_batch_size_per_gpu"], [], id="mb"),
    pytest.param({"managed_gradient_accumulation": 1}, ["managed_gradient_accumulation"], ["True", "False"],
                 id="managed"),
    pytest.param({"dtype": "fp16"}, ["dtype"], ["fp32", "bf16"], id="dtype"),
    pytest.param({"communication_data_type": "fp64"}, ["communication_data_type"], ["fp32", "bf16"], id="comm"),
    pytest.param({"grad_accum_dtype": "int8"}, ["grad_accum_dtype"], ["fp32", "bf16"], id="accum"),
    pytest.param({"gradient_clipping": -1.0}, ["gradient_clipping"], [], id="clip"),
    pytest.param({"optimizer": {"type": "lamb"}}, ["type"], ["sgd", "adam", "adamw"], id="opt-type"),
    pytest.param({"optimizer": {"type": "adam", "betas": (0.9, 1.0)}}, ["betas"], [], id="beta"),
    pytest.param({"optimizer": {"type": "adam", "eps": 0.0}}, ["eps"], [], id="eps"),
    pytest.param({"offload_optimizer": "disk"}, ["offload_optimizer"], ["none", "cpu", "nvme"], id="offload-opt"),
    pytest.param({"offload_optimizer": "nvme"}, ["offload_optimizer", "nvme_path"], [], id="nvme-no-path"),
    pytest.param(
        {"offload_optimizer": "nvme", "nvme_path": "/nonexistent/hostoffload-nvme-dir"},
        ["nvme_path", "/nonexistent/hostoffload-nvme-dir"],
        [],
        id="nvme-path-missing",
    ),
    pytest.param({"nvme_path": 3}, ["nvme_path"], [], id="nvme-path-type"),
    pytest.param({"nvme_swap": {"queue_dept": 4}}, ["queue_dept"], ["queue_depth"], id="nvme-swap-key"),
    pytest.param({"nvme_swap": {"block_size": 1000}}, ["block_size"], [], id="nvme-swap-block"),
    pytest.param({"zero_stage": 3, "offload_param": "nvme"}, ["offload_param"], ["none", "cpu"],
                 id="offload-param-nvme"),
    pytest.param({"zero_stage": 2, "offload_param": "cpu"}, ["offload_param", "zero_stage"], ["none"],
                 id="offload-param-st2"),
    pytest.param(
        {"zero_stage": 0, "managed_gradient_accumulation": False, "overlap_comm": True},
        ["overlap_comm", "managed_gradient_accumulation", "zero_stage"],
        [],
        id="unmanaged-overlap-st0",
    ),
    pytest.param(
        {"zero_stage": 1, "managed_gradient_accumulation": False, "overlap_comm": True},
        ["overlap_comm", "managed_gradient_accumulation", "zero_stage"],
        [],
        id="unmanaged-overlap-st1",
    ),
    pytest.param(
        {"managed_gradient_accumulation": False, "pipeline_parallel_size": 2},
        ["pipeline_parallel_size", "managed_gradient_accumulation"],
        [],
        id="unmanaged-pipeline",
    ),
]


def _assert_names(exc: BaseException, names: list[str], allowed: list[str]) -> None:
    """Each of ``names`` is named (as itself or at the end of a key path such as ``optimizer.type``), and each of
    ``allowed`` is listed."""
    for name in names:
        assert_names_argument(exc, name, qualified=True)
    assert_names_argument(exc, names[0], *allowed, qualified=True)


def _assert_mentions(message: str, words: list[str]) -> None:
    for w in words:
        assert w in message, f"error message {message!r} does not mention {w!r}"


@pytest.mark.parametrize(("changes", "names", "allowed"), CONFIG_REJECTIONS)
def test_R19_config_rejection_names_option(area_api, changes, names, allowed):
    """R19: each rejected configuration raises ConfigurationError (a ValueError) naming the option(s) and the
    allowed values, from the implementation's config object and from the shared Scenario that carries it."""
    with pytest.raises(ConfigurationError) as info:
        area_api.AccumulationConfig.from_dict(changes)
    _assert_names(info.value, names, allowed)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigurationError) as info:
        Scenario(config=changes, world_size=1, calls=())
    _assert_names(info.value, names, allowed)


@pytest.mark.parametrize("stage", [2, 3])
def test_R19_unmanaged_overlap_comm_allowed_on_stages_2_3(area_api, stage):
    """R19 names stages 0/1 only: stages 2/3 reduce inside backward anyway, so overlap_comm stays allowed
    there."""
    cfg = area_api.AccumulationConfig.from_dict(
        {"zero_stage": stage, "managed_gradient_accumulation": False, "overlap_comm": True}
    )
    trace = area_api.run_scenario(Scenario(cfg, 2, scenario_calls("BBS")))
    assert trace.boundaries()


def test_R19_managed_pipeline_parallel_is_not_modeled(area_api):
    """R19: pipeline_parallel_size > 1 in managed mode is a valid config but engines of this area do not model
    pipelines: UnsupportedOperationError naming the option."""
    cfg = area_api.AccumulationConfig.from_dict({"pipeline_parallel_size": 2})
    with pytest.raises(UnsupportedOperationError) as info:
        area_api.run_scenario(Scenario(cfg, 1, scenario_calls("BS")))
    assert_names_argument(info.value, "pipeline_parallel_size")


# (config, call pattern, the calls and options the message must name)
CALL_REJECTIONS = [
    pytest.param(
        {"managed_gradient_accumulation": False},
        "TBS",
        ["set_gradient_accumulation_boundary", "managed_gradient_accumulation"],
        id="override",
    ),
    pytest.param({"zero_stage": 2}, "[B]S", ["no_sync", "zero_stage"], id="no_sync-stage2"),
    pytest.param({"zero_stage": 3}, "[B]S", ["no_sync", "zero_stage"], id="no_sync-stage3"),
    pytest.param({"zero_stage": 0}, "[BS]", ["step", "no_sync"], id="step-in-no_sync"),
    pytest.param(
        {"zero_stage": 1, "managed_gradient_accumulation": False},
        "B[S]",
        ["step", "no_sync"],
        id="step-in-no_sync-unmanaged",
    ),
    pytest.param({"zero_stage": 1}, "[[B]]S", ["no_sync"], id="nested-no_sync"),
]


@pytest.mark.parametrize(("changes", "pattern", "words"), CALL_REJECTIONS)
def test_R20_call_sequence_rejection_names_call(area_api, changes, pattern, words):
    """R20: each rejected call sequence raises UnsupportedOperationError (a RuntimeError) naming the call,
    out of run_scenario, whichever process the engine ran in."""
    sc = Scenario(area_api.AccumulationConfig.from_dict(changes), 2, scenario_calls(pattern))
    with pytest.raises(UnsupportedOperationError) as info:
        area_api.run_scenario(sc)
    assert isinstance(info.value, RuntimeError)
    _assert_names(info.value, words, [])


def _losses(api, engine, sc, index):
    return [
        api.compute_loss(engine.module(r), *api.micro_batch(sc, index, r), sc.config.model_dtype)
        for r in range(engine.world_size)
    ]


@pytest.mark.parametrize("stage", [0, 1])
def test_R20_rejected_step_leaves_state_unchanged(reference_api, stage):
    """R20: a step() rejected inside no_sync() changes nothing: leaving no_sync and stepping gives exactly the
    trace of a run that never made the rejected call (R18: the no_sync backwards are ordinary backwards)."""
    api = reference_api
    sc = api.Scenario(
        api.AccumulationConfig(zero_stage=stage, gradient_accumulation_steps=2), 2, api.scenario_calls("BSBS")
    )
    expected = api.run_scenario(sc)
    engine = api.build_engine(sc)
    initial = engine.full_parameters()
    records = []
    for k in range(2):
        with engine.no_sync():
            engine.backward(_losses(api, engine, sc, k))
            with pytest.raises(UnsupportedOperationError) as info:
                engine.step()
            assert_names_argument(info.value, "step", qualified=True)
        before = (engine.micro_steps, engine.global_steps, engine.global_samples)
        assert before == (k, 0, 0)
        out = engine.step()
        records.append(
            api.StepRecord(
                0,
                out.boundary,
                api.Counters(engine.micro_steps, engine.global_steps, engine.global_samples),
                out.grad_norm,
                out.clip_coef,
                out.gradients,
                engine.full_parameters(),
            )
        )
    got = api.Trace(sc, initial, tuple(records))
    assert_boundaries_match(got, expected, "no_sync run with rejected step()")


def test_R20_rejected_override_and_nested_no_sync_leave_state_unchanged(reference_api):
    """R20: the rejected override leaves unmanaged mode's boundary rule in place; a rejected nested no_sync()
    leaves the outer context active (step() is still refused) and the outer exit clears it."""
    api = reference_api
    un = api.build_engine(api.Scenario(api.AccumulationConfig(managed_gradient_accumulation=False), 1, ()))
    with pytest.raises(UnsupportedOperationError) as info:
        un.set_gradient_accumulation_boundary(True)
    assert_names_argument(info.value, "set_gradient_accumulation_boundary", qualified=True)
    assert un.is_gradient_accumulation_boundary() is False
    eng = api.build_engine(api.Scenario(api.AccumulationConfig(zero_stage=1), 1, ()))
    with eng.no_sync():
        with pytest.raises(UnsupportedOperationError) as info:
            with eng.no_sync():
                pass  # pragma: no cover - never entered
        assert_names_argument(info.value, "no_sync", qualified=True)
        with pytest.raises(UnsupportedOperationError) as info:
            eng.step()
        assert_names_argument(info.value, "no_sync", qualified=True)
    assert eng.step().boundary is True


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda e: e.backward([torch.ones((), requires_grad=True)]), ["losses", "world_size=2"]),
        (lambda e: e.backward([torch.ones((), requires_grad=True)] * 2, scale_wrt_gas=1), ["scale_wrt_gas"]),
        (lambda e: e.set_gradient_accumulation_boundary(1), ["is_boundary", "True, False"]),
        (lambda e: e.module(2), ["rank", "[0, 1]"]),
    ],
    ids=["losses-count", "scale_wrt_gas-type", "override-type", "rank"],
)
def test_R1_engine_argument_errors_name_argument(reference_api, call, words):
    """R1: bad arguments to the engine calls raise ConfigurationError naming the argument and allowed
    values."""
    api = reference_api
    engine = api.build_engine(api.Scenario(api.AccumulationConfig(), 2, ()))
    with pytest.raises(ConfigurationError) as info:
        call(engine)
    _assert_mentions(str(info.value), words)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda api: api.Scenario(api.AccumulationConfig(), 0, ()), ["world_size=0", ">= 1"]),
        (lambda api: api.Scenario(api.AccumulationConfig(), 2, ("B",)), ["calls[0]", "Backward", "Step"]),
        (
            lambda api: api.Scenario(api.AccumulationConfig(), 2, (), data_ranks=(0, 0)),
            ["data_ranks", "permutation"],
        ),
        (lambda api: api.ModelSpec(hidden=0), ["ModelSpec.hidden", ">= 1"]),
        (lambda api: api.scenario_calls("BX"), ["'X'", "allowed"]),
        (
            lambda api: api.run_scenario(api.Scenario(api.AccumulationConfig(), 1, (api.ExitNoSync(),))),
            ["ExitNoSync"],
        ),
        (lambda api: api.run_scenario("BS"), ["scenario", "Scenario"]),
        (
            lambda api: api.AccumulationEngine(torch.nn.Linear(2, 2).requires_grad_(False), {}, 1),
            ["requires_grad"],
        ),
        (lambda api: api.AccumulationEngine(torch.nn.Linear(2, 2), {}, 0), ["world_size=0"]),
        (lambda api: api.average_across_ranks([]), ["contributions", "one tensor per rank"]),
        (
            lambda api: api.average_across_ranks([torch.ones(2)] * 2, order=[0, 0]),
            ["order=[0, 0]", "permutation"],
        ),
        (
            lambda api: api.average_across_ranks([torch.ones(2), torch.ones(3)]),
            ["contributions[1]", "shape (3,)", "shape (2,)"],
        ),
    ],
    ids=[
        "scenario-world",
        "scenario-call",
        "scenario-data_ranks",
        "model-spec",
        "pattern",
        "unmatched-exit",
        "not-a-scenario",
        "no-trainable",
        "engine-world",
        "empty-reduce",
        "bad-order",
        "shape-mismatch",
    ],
)
def test_R26_bad_scenarios_and_engine_inputs_name_the_argument(reference_api, build, words):
    """R26/R1: malformed scenarios, model specs, engine inputs and collective inputs raise ConfigurationError
    naming the argument and what is allowed."""
    with pytest.raises(ConfigurationError) as info:
        build(reference_api)
    _assert_mentions(str(info.value), words)


def test_R20_destroyed_engine_refuses_calls(reference_api):
    """R20: after destroy() every call is an UnsupportedOperationError saying how to continue."""
    api = reference_api
    engine = api.build_engine(api.Scenario(api.AccumulationConfig(zero_stage=3), 2, ()))
    engine.destroy()
    for call in (lambda: engine.step(), lambda: engine.backward([]), lambda: engine.no_sync().__enter__()):
        with pytest.raises(UnsupportedOperationError, match="destroyed"):
            call()
