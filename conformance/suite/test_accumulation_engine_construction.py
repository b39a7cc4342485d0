"""What a ZeroEngine refuses while it is built, and after ``destroy()`` (issue 28's construction rows).

Each test names the misuse a user made and what the engine must answer: a ``ConfigurationError`` naming the
argument and what is allowed, at construction and on every rank, instead of torch's unrelated error or a
collective that aborts (gloo) or hangs (NCCL) at the first ``step()``. Judged through the public surface only.
"""

from __future__ import annotations

import pytest
import torch

from conformance.areas.accumulation_engines import REQUIRES_ENGINE, engine_api, engine_class
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_scenario import ModelSpec
from reference.contract.errors import UnsupportedOperationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, pytest.mark.runs_in_subprocesses]

CONFIG = {"zero_stage": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "adamw", "lr": 0.01}}


def _attempt(fn) -> tuple[str, str] | None:
    try:
        engine = fn()
    except Exception as exc:  # classified by the test
        return type(exc).__name__, str(exc)
    engine.destroy()
    return None


def _different_models(group, impl) -> tuple[str, str] | None:
    import torch.distributed as dist

    hidden = 6 if dist.get_rank(group) == 0 else 7
    return _attempt(lambda: engine_class(impl)(ModelSpec(hidden=hidden).build(1), CONFIG, process_group=group))


def test_ranks_with_different_models_fail_at_construction_on_every_rank(impl):
    """Two ranks built with different models used to construct, and the first step() aborted rank 0 inside gloo.
    Every rank now raises a ConfigurationError at construction naming the first differing parameter."""
    out = engine_api(impl).run_on_ranks(_different_models, 2, impl)
    for r, got in enumerate(out):
        assert got is not None, f"rank {r}: the engine was built over a model that differs between ranks"
        assert got[0] == "ConfigurationError", f"rank {r}: {got}"
        assert "inp.weight" in got[1] and "rank" in got[1], f"rank {r}: the first differing parameter: {got[1]}"


def _one_extra_trailing_parameter(group, impl, longer: int) -> tuple[str, str] | None:
    import torch.distributed as dist

    model = ModelSpec().build(1)
    if dist.get_rank(group) == longer:
        tail = torch.nn.Module()  # a submodule added last: its parameter comes last in named_parameters()
        tail.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
        model.add_module("tail", tail)
        assert [n for n, _ in model.named_parameters()][-1] == "tail.extra"
    return _attempt(lambda: engine_class(impl)(model, CONFIG, process_group=group))


@pytest.mark.parametrize("longer", [1, 0], ids=["rank1-longer", "rank0-longer"])
def test_ranks_whose_models_differ_only_by_a_trailing_parameter_fail_at_construction(impl, longer):
    """The same model on both ranks except one extra parameter registered last on one of them: every parameter
    both ranks have agrees, so a check that compares only the parameters both lists hold (or only the first)
    lets the engine build, and its flat buffers differ in size between the ranks at the first collective. Every
    rank raises a ConfigurationError at construction naming the extra parameter and the ranks."""
    out = engine_api(impl).run_on_ranks(_one_extra_trailing_parameter, 2, impl, longer)
    for r, got in enumerate(out):
        assert got is not None, f"rank {r}: the engine was built although rank {longer} has one more parameter"
        assert got[0] == "ConfigurationError", f"rank {r}: {got}"
        assert "tail.extra" in got[1] and "rank" in got[1], f"rank {r}: the message must name 'tail.extra': {got[1]}"


def _not_a_module(group, impl) -> tuple[str, str] | None:
    return _attempt(lambda: engine_class(impl)("resnet", CONFIG, process_group=group))


def test_a_model_that_is_neither_a_module_nor_a_factory_is_refused_by_name(impl):
    """``ZeroEngine("resnet", cfg)`` raised ``TypeError: 'str' object is not callable``; it is the engine's own
    ConfigurationError naming ``model`` and what it accepts (a module or a factory)."""
    got = engine_api(impl).run_on_ranks(_not_a_module, 1, impl)[0]
    assert got is not None and got[0] == "ConfigurationError", got
    assert "model" in got[1] and "resnet" in got[1] and "factory" in got[1] and "Module" in got[1], got[1]


def _factory_of_a_string(group, impl) -> tuple[str, str] | None:
    return _attempt(lambda: engine_class(impl)(lambda: "resnet", CONFIG, process_group=group))


def test_a_factory_that_returns_no_module_is_refused_by_name(impl):
    """A factory is called at construction; one that returns something other than an ``nn.Module`` is refused
    there, naming ``model`` and what the factory must return -- not an ``AttributeError`` from deep inside."""
    got = engine_api(impl).run_on_ranks(_factory_of_a_string, 1, impl)[0]
    assert got is not None and got[0] == "ConfigurationError", got
    assert "model" in got[1] and "factory" in got[1] and "Module" in got[1], got[1]


def _all_frozen(group, impl) -> tuple[str, str] | None:
    model = ModelSpec().build(1)
    for p in model.parameters():
        p.requires_grad_(False)
    return _attempt(lambda: engine_class(impl)(model, CONFIG, process_group=group))


def test_a_model_with_nothing_to_train_is_refused_by_name(impl):
    """Every parameter frozen: there is nothing to update, so the engine refuses at construction, naming
    ``requires_grad`` -- instead of building empty partitions and stepping nothing."""
    got = engine_api(impl).run_on_ranks(_all_frozen, 1, impl)[0]
    assert got is not None and got[0] == "ConfigurationError", got
    assert "requires_grad" in got[1], got[1]


#: Engine keyword arguments of the wrong kind, each with the argument name the refusal must carry.
BAD_ARGUMENTS = [
    ({"bucket_elements": 0}, "bucket_elements"),
    ({"bucket_elements": -5}, "bucket_elements"),
    ({"bucket_elements": 2.5}, "bucket_elements"),
    ({"bucket_elements": True}, "bucket_elements"),
    ({"record_gradients": "yes"}, "record_gradients"),
    ({"prefetch": 1}, "prefetch"),
]


def _bad_argument(group, impl, kwargs) -> tuple[str, str] | None:
    return _attempt(lambda: engine_class(impl)(ModelSpec().build(1), CONFIG, process_group=group, **kwargs))


@pytest.mark.parametrize("kwargs,name", BAD_ARGUMENTS, ids=[f"{n}={v[n]!r}" for v, n in BAD_ARGUMENTS])
def test_engine_arguments_of_the_wrong_kind_are_refused_by_name(impl, kwargs, name):
    """``bucket_elements`` must be an int >= 1 (0 buckets nothing, a bool is not a size), ``record_gradients``
    and ``prefetch`` bools: each wrong kind is a ConfigurationError naming the argument, at construction."""
    got = engine_api(impl).run_on_ranks(_bad_argument, 1, impl, kwargs)[0]
    assert got is not None and got[0] == "ConfigurationError", f"{kwargs}: {got}"
    assert name in got[1], f"{kwargs}: the message must name {name!r}: {got[1]}"


def _differs_on_the_last_rank(group, impl) -> tuple[str, str] | None:
    import torch.distributed as dist

    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    return _attempt(lambda: engine_class(impl)(ModelSpec(hidden=7 if last else 6).build(1), CONFIG,
                                               process_group=group))


def test_a_model_that_differs_only_on_the_last_of_three_ranks_fails_on_every_rank(impl):
    """W=3, ranks 0 and 1 agree and rank 2 wraps another model: every rank refuses at construction (a check that
    compared rank 0 with rank 1 only would let rank 2 into the first collective with other sizes), and the
    message names rank 2."""
    out = engine_api(impl).run_on_ranks(_differs_on_the_last_rank, 3, impl)
    for r, got in enumerate(out):
        assert got is not None and got[0] == "ConfigurationError", f"rank {r}: {got}"
        assert "rank 2" in got[1], f"rank {r}: the message must name rank 2: {got[1]}"


def _unavailable_device(group, impl) -> tuple[str, tuple[str, str] | None]:
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    return device, _attempt(lambda: engine_class(impl)(ModelSpec().build(1), CONFIG, process_group=group,
                                                       device=device))


def test_an_unavailable_device_is_refused_naming_what_is_available(impl):
    """``device="cuda"`` on a CPU-only build raised a bare AssertionError from torch (here: a CUDA index past the
    last GPU where there are GPUs). It is a ConfigurationError naming ``device`` and the devices available."""
    device, got = engine_api(impl).run_on_ranks(_unavailable_device, 1, impl)[0]
    assert got is not None and got[0] == "ConfigurationError", got
    assert "device" in got[1] and device in got[1] and "cpu" in got[1], got[1]


def _unknown_device_adam_mode(group, impl, extra: dict) -> tuple[tuple[str, str] | None, int, int, list[str]]:
    import os

    from conformance.areas.accumulation_engines import pinned_stats_of
    from conformance.harness.observation import Observation

    stats = pinned_stats_of(impl)
    before, seen = stats().allocations, Observation.now()
    os.environ["HOSTOFFLOAD_DEVICE_ADAM"] = "fastest"
    try:
        got = _attempt(lambda: engine_class(impl)(ModelSpec().build(1), {**CONFIG, **extra}, process_group=group))
    finally:
        del os.environ["HOSTOFFLOAD_DEVICE_ADAM"]
    return got, before, stats().allocations, Observation.now().leaks_since(seen)


@pytest.mark.parametrize(
    "extra",
    [{}, {"offload_optimizer": "cpu", "gpu_share": 0.5}, {"offload_optimizer": "cpu"}],
    ids=["no-offload", "split", "host-update"],
)
def test_an_unknown_device_adam_mode_is_refused_at_construction(impl, extra):
    """An engine that steps masters on the device (no offload; R28's device side) with a fused kernel chosen by
    ``HOSTOFFLOAD_DEVICE_ADAM`` decides at construction (the first training step must not carry the kernel's
    check): an unknown value is a ConfigurationError there naming the variable and its values, with no pinned
    memory, locked page, file descriptor or thread left behind -- not an error at the first boundary, minutes
    into a run. An engine that updates every master on the host (share 0) refuses it too: the variable is
    wrong whatever the config, and a user who sets it expects it to be read."""
    if getattr(impl.load("accumulation"), "fused_device_adam", None) is None:
        pytest.skip("this implementation declares no fused device Adam (fused_device_adam)")
    got, before, after, leaks = engine_api(impl).run_on_ranks(_unknown_device_adam_mode, 1, impl, extra)[0]
    assert got is not None and got[0] == "ConfigurationError", got
    assert "HOSTOFFLOAD_DEVICE_ADAM" in got[1] and "auto, fused, torch" in got[1], got[1]
    assert after == before, f"pinned allocations {before} -> {after} after the refused construction"
    assert not leaks, f"the refused construction left behind (seen by the OS): {leaks}"


def _fused_device_adam_mode(group, impl, extra: dict) -> dict:
    """One rank: the engine's device (an engine built with the default mode), whether the implementation's own
    ``use_for`` steps an AdamW master there with the kernel (mode ``auto``), and what construction does with
    ``HOSTOFFLOAD_DEVICE_ADAM=fused``; pinned allocations and OS-visible leaks around the attempt."""
    import os

    from conformance.areas.accumulation_engines import pinned_stats_of
    from conformance.harness.observation import Observation

    config = {**CONFIG, **extra}
    engine = engine_class(impl)(ModelSpec().build(1), config, process_group=group)
    device = engine.device
    engine.destroy()
    kernel = impl.load("accumulation").fused_device_adam
    optimizer = OptimizerConfig(type="adamw")
    used = bool(kernel.use_for(optimizer, torch.zeros(8, device=device)))
    stats = pinned_stats_of(impl)
    before, seen = stats().allocations, Observation.now()
    os.environ["HOSTOFFLOAD_DEVICE_ADAM"] = "fused"
    try:
        got = _attempt(lambda: engine_class(impl)(ModelSpec().build(1), config, process_group=group))
    finally:
        del os.environ["HOSTOFFLOAD_DEVICE_ADAM"]
    return {"device": str(device), "used": used, "got": got, "before": before, "after": stats().allocations,
            "leaks": Observation.now().leaks_since(seen)}


@pytest.mark.parametrize(
    "extra",
    [{}, {"offload_optimizer": "cpu", "gpu_share": 0.5}, {"offload_optimizer": "cpu"}],
    ids=["no-offload", "split", "host-update"],
)
def test_fused_device_adam_where_the_kernel_is_not_used_is_refused_at_construction(impl, extra):
    """Issue 52, defect 7: ``HOSTOFFLOAD_DEVICE_ADAM=fused`` "requires the kernel (an error where it is missing)"
    (docs/zero.md), yet a CPU engine accepted it silently and trained with other kernels. "Missing" is judged by
    the implementation's own choice: where its ``fused_device_adam.use_for`` would not step an Adam master on the
    engine's device with the kernel in mode ``auto`` (on the cpu accelerator the Triton kernel only runs in
    Triton's interpreter, for verification, and is never chosen for training; or Triton is not installed),
    ``fused`` is a ConfigurationError at construction naming the variable and its values, leaving nothing behind;
    where it would, ``fused`` builds. An engine that updates every master on the host refuses it the same way: the
    variable asks for something this process cannot do, whatever the config."""
    module = impl.load("accumulation")
    kernel = getattr(module, "fused_device_adam", None)
    if kernel is None or not hasattr(kernel, "use_for"):
        pytest.skip("this implementation declares no fused device Adam with a run-time choice (use_for)")
    out = engine_api(impl).run_on_ranks(_fused_device_adam_mode, 1, impl, extra)[0]
    if out["used"]:
        assert out["got"] is None, f"on {out['device']} the kernel is used, yet fused was refused: {out['got']}"
        return
    got = out["got"]
    assert got is not None, f"HOSTOFFLOAD_DEVICE_ADAM=fused was accepted on {out['device']}, where no master steps " \
                            f"with the fused kernel"
    assert got[0] == "ConfigurationError", got
    assert "HOSTOFFLOAD_DEVICE_ADAM" in got[1] and "auto, fused, torch" in got[1], got[1]
    assert out["after"] == out["before"], f"pinned allocations {out['before']} -> {out['after']} after the refusal"
    assert not out["leaks"], f"the refused construction left behind (seen by the OS): {out['leaks']}"


def _forward_after_destroy(group, impl) -> tuple[str, str] | None:
    engine = engine_class(impl)(ModelSpec().build(1), CONFIG, process_group=group)
    engine.destroy()
    try:
        engine(torch.randn(2, ModelSpec().in_features))
    except Exception as exc:  # classified by the test
        return type(exc).__name__, str(exc)
    return None


def test_the_forward_after_destroy_is_refused_like_step(impl):
    """``engine(x)`` after ``destroy()`` still ran the forward at stage 2; it is refused like ``step()``."""
    got = engine_api(impl).run_on_ranks(_forward_after_destroy, 1, impl)[0]
    assert got is not None, "the forward ran on a destroyed engine"
    assert got[0] == UnsupportedOperationError.__name__ and "destroy" in got[1], got


def _misspelled_variable(group, impl, typo: str) -> list[str]:
    """One rank: with ``typo`` set, build an offloading engine (it pins its host buffers), train two boundaries and
    destroy it, twice; the warnings that name ``typo``, every warning shown."""
    import os
    import warnings

    from reference.contract.accumulation_scenario import compute_loss

    spec = ModelSpec()
    os.environ[typo] = "native"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                engine = engine_class(impl)(spec.build(1), {**CONFIG, "offload_optimizer": "cpu"}, process_group=group)
                for k in range(2):
                    gen = torch.Generator().manual_seed(k)
                    x, y = torch.randn(2, spec.in_features, generator=gen), torch.randn(2, spec.out_features,
                                                                                       generator=gen)
                    engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
                    engine.step()
                engine.destroy()
    finally:
        del os.environ[typo]
    return [str(w.message) for w in caught if typo in str(w.message)]


def test_a_misspelled_variable_warns_once_per_process_not_at_every_call(impl):
    """Issue 52, defect 10: one misspelled ``HOSTOFFLOAD_*`` variable warned three or more times per
    construct-and-step (every pinning call of the engine's buffers warned again). Two engines built, trained and
    destroyed in one process with a misspelled name set give exactly one warning naming it (with every warning
    shown: ``simplefilter("always")``). The name carries the test's process id and time, so no earlier test in
    the rank's process has warned about it already."""
    import os
    import time

    from reference.contract import envvars

    misspelled = envvars.PIN_BACKEND_ENV.replace("BACKEND", "BACKND")  # spelt out, the layout check would flag it
    typo = f"{misspelled}_{os.getpid()}_{time.monotonic_ns()}"
    texts = engine_api(impl).run_on_ranks(_misspelled_variable, 1, impl, typo)[0]
    assert len(texts) == 1, f"{len(texts)} warnings name {typo}: {texts}"
    assert envvars.PIN_BACKEND_ENV in texts[0], texts[0]
