"""The engine's own host memory is page-locked at its exact size by default (issue 27 item 5, docs/zero.md
"Host memory"), whatever ``HOSTOFFLOAD_PIN_BACKEND`` selects for user tensors, and a locked-memory limit too low
for it is a clear ``MemoryError`` naming ``ulimit -l`` that leaves nothing locked.

What is measured is the operating system's count of this process's locked memory (``VmLck`` in
``/proc/self/status``) around the engine's construction, against the page-rounded sizes of the buffers the engine
lists (``pinned_buffers()``: numel times element size, as a user would compute it). A buffer rounded up -- as
torch's caching host allocator rounds every allocation to a power of two -- or not locked at all shows as a
difference.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys

import pytest

from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_ENGINE, engine_api, engine_class
from conformance.probes.memlock import _status
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_partition import build_layout
from reference.contract.accumulation_scenario import ModelSpec
from reference.contract.errors import ConfigurationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, IN_RANK_PROCESSES]

#: Partitions (world size 2) a little over a power of two elements and not a whole number of pages, so that a
#: buffer rounded up to a power of two takes more pages than its exact size (checked in the test).
MODEL = ModelSpec(in_features=37, hidden=230, out_features=5)


def _page_rounded(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _locked_around_construction(group, impl, stage: int) -> dict:
    """Rank function: VmLck before and after building an offloading engine, and the buffers it lists."""
    import torch.distributed as dist

    cfg = AccumulationConfig(
        zero_stage=stage, offload_optimizer="cpu", offload_param="cpu" if stage == 3 else "none", dtype="bf16"
    )
    gc.collect()
    before = _status("VmLck")
    engine = engine_class(impl)(MODEL.build(0), cfg, process_group=group)
    try:
        during = _status("VmLck")
        sizes = [t.numel() * t.element_size() for t in engine.pinned_buffers()]
    finally:
        engine.destroy()
    gc.collect()
    return {"before_kib": before, "during_kib": during, "after_kib": _status("VmLck"), "sizes": sizes,
            "world": dist.get_world_size(group)}


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_buffers_are_locked_at_their_exact_size(impl, area_api, monkeypatch, backend, stage):
    """Under either pinning backend for user tensors (``torch`` is the default), the locked memory the engine
    adds is the sum of its buffers' page-rounded sizes: nothing rounded up, nothing left pageable; destroy()
    gives all of it back."""
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", backend)
    monkeypatch.delenv("HOSTOFFLOAD_ZERO_HOST_MEMORY", raising=False)
    api = engine_api(impl)
    world = 2
    trainable = [(n, p.shape) for n, p in MODEL.build(0).named_parameters() if p.requires_grad]
    partition = build_layout(trainable, world).partition_size
    partition_bytes = partition * 4
    power_of_two_bytes = (1 << (partition - 1).bit_length()) * 4
    assert _page_rounded(power_of_two_bytes) > _page_rounded(partition_bytes), "MODEL no longer shows rounding"
    for r, out in enumerate(api.run_on_ranks(_locked_around_construction, world, impl, stage)):
        expected = sum(_page_rounded(n) for n in out["sizes"])
        # The fp32 master and Adam's two moments alone are three partition-sized fp32 buffers (R17).
        assert sum(out["sizes"]) >= 3 * partition_bytes, f"rank {r}: the engine lists too little: {out}"
        locked = (out["during_kib"] - out["before_kib"]) * 1024
        assert locked == expected, (
            f"rank {r} (HOSTOFFLOAD_PIN_BACKEND={backend}, stage {stage}): the engine's construction locked "
            f"{locked} bytes (VmLck); its buffers of {out['sizes']} bytes page-rounded are {expected} bytes"
        )
        assert out["after_kib"] == out["before_kib"], f"rank {r}: destroy() left locked memory: {out}"


def _dropped_without_destroy(group, impl, stage: int) -> dict:
    """Rank function: VmLck before an engine is built, after one training step, and after the engine (and the
    loss that reached it) were dropped without ``destroy()`` and collected."""
    import torch

    from reference.contract.accumulation_scenario import compute_loss

    cfg = AccumulationConfig(
        zero_stage=stage, offload_optimizer="cpu", offload_param="cpu" if stage == 3 else "none", dtype="bf16"
    )
    gc.collect()
    before = _status("VmLck")
    engine = engine_class(impl)(MODEL.build(0), cfg, process_group=group)
    x, y = torch.randn(2, MODEL.in_features), torch.randn(2, MODEL.out_features)
    loss = compute_loss(engine.module, x, y, cfg.model_dtype)
    engine.backward(loss)
    engine.step()
    engine.synchronize()
    during = _status("VmLck")
    del engine, loss
    gc.collect()
    return {"before_kib": before, "during_kib": during, "after_kib": _status("VmLck")}


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_dropped_without_destroy_releases_its_locked_memory(impl, area_api, stage):
    """An engine a script drops without ``destroy()`` (after training with it) gives its locked memory back once
    the garbage collector runs: locked memory counts against ``ulimit -l``, so an engine that could never be
    collected would make every later engine in the process fail."""
    api = engine_api(impl)
    for r, out in enumerate(api.run_on_ranks(_dropped_without_destroy, 2, impl, stage)):
        assert out["during_kib"] > out["before_kib"], f"rank {r}: the engine locked nothing: {out}"
        assert out["after_kib"] == out["before_kib"], f"rank {r}: the dropped engine kept locked memory: {out}"


def test_engine_host_memory_variable_is_checked(impl, area_api, monkeypatch):
    """A value of ``HOSTOFFLOAD_ZERO_HOST_MEMORY`` outside its domain is refused naming the variable."""
    monkeypatch.setenv("HOSTOFFLOAD_ZERO_HOST_MEMORY", "rounded")
    api = engine_api(impl)
    with pytest.raises(ConfigurationError, match="HOSTOFFLOAD_ZERO_HOST_MEMORY"):
        api.run_on_ranks(_locked_around_construction, 1, impl, 2)


LIMIT = 256 * 1024


def test_lock_limit_too_low_is_clear_and_leaks_nothing(impl, area_api):
    """Under a 256 KiB RLIMIT_MEMLOCK (CAP_IPC_LOCK dropped), a small engine builds (its buffers are locked) and a
    larger one fails part-way with a ``MemoryError`` naming ``ulimit -l``; VmLck is back where it was."""
    env = {**os.environ, "HOSTOFFLOAD_PIN_BACKEND": "torch"}
    env.pop("HOSTOFFLOAD_ZERO_HOST_MEMORY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.probes.engine_memlock", impl.areas["accumulation"], str(LIMIT)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"probe crashed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.getuid() == 0:
        assert result["dropped_cap"], "root could not drop CAP_IPC_LOCK; the limit would not apply"
    assert result["small_locked_kib"] > 0, f"the small engine locked nothing; the probe proves nothing: {result}"
    err = result["error"]
    assert err is not None, f"an engine needing more than {LIMIT} locked bytes was built: {result}"
    assert err["is_memory_error"], f"expected a MemoryError subclass, got {err['type']}: {err['message']}"
    assert "ulimit -l" in err["message"], f"the message must tell the user about `ulimit -l`: {err['message']}"
    assert result["after_kib"] == result["before_kib"], f"the failed construction left locked memory: {result}"


# ---- the estimate before construction (capability accumulation_host_memory_estimate; issue 40) ------------------

REQUIRES_ESTIMATE = pytest.mark.requires("accumulation_host_memory_estimate")

#: Configs whose host buffers differ (which buffers exist, their dtypes, whether each is pinned): the moments'
#: precision (R29), R27's second accumulator and own cast buffer, R30's own cast buffer and unpinned backup,
#: stage 3's parameter partitions (pinned with ``offload_param``), an fp32 model (no cast buffer at all), a
#: bf16 accumulator and four micro-batches per boundary.
ESTIMATE_CONFIGS = {
    "s2": {"zero_stage": 2, "dtype": "bf16"},
    "s2-bf16-moments": {"zero_stage": 2, "dtype": "bf16", "state_precision": "bf16"},
    "s2-delayed": {"zero_stage": 2, "dtype": "bf16", "delayed_parameter_update": True},
    "s2-last-backward": {"zero_stage": 2, "dtype": "bf16", "host_update_start": "last_backward"},
    "s2-fp32-model": {"zero_stage": 2, "dtype": "fp32"},
    "s2-bf16-accumulator": {"zero_stage": 2, "dtype": "bf16", "grad_accum_dtype": "bf16"},
    # a schedule with middle micro-batches (an accelerator's engine may keep a buffer for them)
    "s2-gas4": {"zero_stage": 2, "dtype": "bf16", "gradient_accumulation_steps": 4},
    "s3-offload-param": {"zero_stage": 3, "dtype": "bf16", "offload_param": "cpu", "state_precision": "bf16"},
    "s3": {"zero_stage": 3, "dtype": "bf16"},
}


def _estimate_against_construction(group, impl, config: dict, device: str) -> dict:
    """Rank function: the engine class's estimate for MODEL (built on the meta device) and ``config``, then VmLck
    around the construction of that engine on ``device`` and the buffers it lists."""
    import torch
    import torch.distributed as dist

    cls = engine_class(impl)
    with torch.device("meta"):
        meta_model = MODEL.build(0)
    estimate = cls.estimate_host_memory(meta_model, config, world_size=dist.get_world_size(group), device=device)
    gc.collect()
    before = _status("VmLck")
    engine = cls(MODEL.build(0), config, process_group=group, device=device)
    try:
        during = _status("VmLck")
        sizes = [t.numel() * t.element_size() for t in engine.pinned_buffers()]
    finally:
        engine.destroy()
    return {"locked": (during - before) * 1024, "sizes": sizes, "estimate_locked": estimate.locked_bytes,
            "estimate_pinned": estimate.pinned_bytes, "estimate_total": estimate.total_bytes,
            "buffers": [(b.name, b.nbytes, b.pinned) for b in estimate.buffers]}


@REQUIRES_ESTIMATE
@pytest.mark.parametrize("name", sorted(ESTIMATE_CONFIGS))
def test_host_memory_estimate_is_what_construction_locks(impl, area_api, accelerator, monkeypatch, name):
    """The engine class's ``estimate_host_memory``, made from a model on the meta device before any engine
    exists, predicts the locked memory the operating system counts (``VmLck``) for the engine then built on this
    accelerator, to the byte, and the sizes of the buffers the engine lists as pinned (W = 2, offloaded optimizer
    state, each config a different set of buffers). On an accelerator nearly every host buffer is pinned, so
    there the estimate is checked whole; on the host the pinned part of it."""
    monkeypatch.delenv("HOSTOFFLOAD_ZERO_HOST_MEMORY", raising=False)
    api = engine_api(impl)
    cfg = {"offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, **ESTIMATE_CONFIGS[name]}
    config = AccumulationConfig.from_dict(cfg).to_dict()
    device = accelerator.device().type
    world = 2 if device == "cpu" else 1  # one GPU on the box: world size 1 there (R8 padding is checked at 2)
    for r, out in enumerate(api.run_on_ranks(_estimate_against_construction, world, impl, config, device)):
        what = f"rank {r}, {name} on {device}"
        assert out["locked"] > 0, f"{what}: the engine locked nothing; the comparison proves nothing: {out}"
        assert out["estimate_locked"] == out["locked"], (
            f"{what}: estimated {out['estimate_locked']} locked bytes, construction locked {out['locked']} "
            f"(VmLck); estimate: {out['buffers']}; the engine's pinned buffers: {out['sizes']}")
        assert out["estimate_pinned"] == sum(out["sizes"]), f"{what}: {out['buffers']} against {out['sizes']}"
        assert out["estimate_total"] >= out["estimate_pinned"], f"{what}: {out}"


@REQUIRES_ESTIMATE
@pytest.mark.parametrize(
    ("change", "named"),
    [({"offload_optimizer": "nvme", "nvme_path": "/tmp"}, "offload_optimizer='nvme'"),
     ({"gpu_share": 0.5}, "gpu_share"), ({"zero_stage": 1}, "offload_optimizer='cpu'")],
)
def test_host_memory_estimate_refuses_what_it_does_not_estimate(impl, area_api, change, named):
    """Where the estimate does not know the host buffers (``nvme``'s state comes and goes, R28's cut is decided
    at run time, the stage-0/1 host update) it raises a ``ConfigurationError`` naming the setting and what is
    allowed, rather than a number that is wrong; a bad argument is refused the same way."""
    import torch

    cls = engine_class(impl)
    with torch.device("meta"):
        model = MODEL.build(0)
    cfg = {"offload_optimizer": "cpu", "zero_stage": 2, "optimizer": {"type": "adamw"}, **change}
    with pytest.raises(ConfigurationError, match="allowed") as info:
        cls.estimate_host_memory(model, cfg, device="cuda")
    assert named in str(info.value), str(info.value)
    with pytest.raises(ConfigurationError, match="world_size"):
        cls.estimate_host_memory(model, {**cfg, **ESTIMATE_CONFIGS["s2"]}, world_size=0)
