"""``offload_optimizer: nvme`` in the multi-process ZeRO engine (R17): the optimizer state of each rank's
partition is in files between steps, moved by the swap handle straight from and to pinned memory, and
``destroy()`` gives back every pinned byte and every file.

The rank functions run inside the engine's worker processes (pickled by reference, so they live at module
level). State is pinned with the native backend here: that is the backend whose memory is in the range
registry the swap handle consults, and whose pinned bytes ``pinned_stats()`` counts on every machine.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from conformance.areas.accumulation_assertions import assert_traces_match, cross_implementation_tolerance
from conformance.areas.accumulation_engines import (
    IN_RANK_PROCESSES,
    REQUIRES_ENGINE,
    engine_api,
    engine_class,
    pinned_stats_of,
)
from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, compute_loss, micro_batch, scenario_calls

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, IN_RANK_PROCESSES]


def _nvme_rank(group, impl, stage: int, nvme_path: str, optimizer: str) -> dict:
    """Run the same three boundaries on a cpu-offload and an nvme-offload engine; report what the test checks."""
    import torch.distributed as dist

    ZeroEngine = engine_class(impl)
    pinned_stats = pinned_stats_of(impl)

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    opt = {"type": optimizer, "lr": 1e-2, "momentum": 0.9 if optimizer == "sgd" else 0.0}
    cfg = AccumulationConfig(zero_stage=stage, dtype="bf16", optimizer=opt, offload_optimizer="cpu")
    sc = Scenario(cfg, world, ())
    gc.collect()
    before = pinned_stats()
    cpu = ZeroEngine(ModelSpec().build(0), cfg, process_group=group)
    nvme = ZeroEngine(
        ModelSpec().build(0), cfg.replace(offload_optimizer="nvme", nvme_path=nvme_path), process_group=group
    )
    out: dict = {"resident_after_backward": [], "resident_after_step": [], "files": None}
    try:
        for k in range(3):
            for e in (cpu, nvme):
                e.backward(compute_loss(e.module, *micro_batch(sc, k, rank), cfg.model_dtype))
                if e is nvme:
                    # The previous step's writes are done and its buffers unpinned once backward() has begun.
                    out["resident_after_backward"].append(len(nvme.pinned_buffers()) - len(cpu.pinned_buffers()))
                assert e.step().boundary
            # Right after the step the state buffers are still pinned: the handle is writing them.
            out["resident_after_step"].append(len(nvme.pinned_buffers()) - len(cpu.pinned_buffers()))
        out["files"] = sorted(os.listdir(nvme.swap_directory))
        out["directory"] = nvme.swap_directory
        a, b = nvme.optimizer_state(), cpu.optimizer_state()
        out["state_equal"] = a.step == b.step and a.buffers.keys() == b.buffers.keys() and all(
            torch.equal(a.buffers[n], b.buffers[n]) for n in a.buffers
        )
        out["state_names"] = sorted(a.buffers)
        out["master_equal"] = torch.equal(nvme.master_partition(), cpu.master_partition())
        out["params_equal"] = all(
            torch.equal(x, y)
            for x, y in zip(nvme.full_parameters().values(), cpu.full_parameters().values(), strict=True)
        )
        out["stats"] = nvme.swap_stats()._asdict()
    finally:
        nvme.destroy()
        cpu.destroy()
    gc.collect()
    out["directory_left"] = os.path.exists(out.get("directory") or "")
    out["before"], out["after"] = tuple(before), tuple(pinned_stats())
    return out


@pytest.mark.parametrize(("stage", "optimizer"), [(0, "adam"), (1, "adamw"), (2, "sgd"), (3, "adam")])
def test_R17_nvme_swaps_directly_and_destroy_returns_everything(impl, area_api, native_pinning, tmp_path, stage,
                                                                optimizer):
    """R17 (nvme): at W = 2 each rank's optimizer state is one file per buffer under nvme_path between steps and
    in no pinned buffer after the next backward() begins; the swap handle moves every byte directly from and
    to the engine's pinned buffers (direct bytes > 0, bounced bytes 0); state, masters and parameters equal the
    cpu-offload engine's bitwise; destroy() deletes the files and unpins everything (pinned_stats back to the
    start)."""
    api = engine_api(impl)
    names = ["exp_avg", "exp_avg_sq"] if optimizer != "sgd" else ["momentum_buffer"]
    for r, out in enumerate(api.run_on_ranks(_nvme_rank, 2, impl, stage, str(tmp_path), optimizer)):
        assert out["files"] == sorted(f"rank{r}.{n}.swp" for n in names), out
        # Relative to the cpu-offload engine, which keeps its state buffers pinned all along.
        assert out["resident_after_backward"] == [-len(names)] * 3, out
        assert out["resident_after_step"] == [0] * 3, out
        assert out["state_equal"] and out["state_names"] == sorted(names), out
        assert out["master_equal"] and out["params_equal"], out
        stats = out["stats"]
        # Initial write + 3 x (read, write) per buffer, then optimizer_state()'s read.
        assert stats["requests"] == len(names) * 8 and stats["failed_requests"] == 0, stats
        assert stats["direct_bytes"] > 0 and stats["bounced_bytes"] == 0, stats
        assert stats["direct_bytes"] == stats["bytes_written"] + stats["bytes_read"], stats
        assert stats["pool_bytes"] == 0, stats  # only pinned tensors seen: the handle never built a bounce pool
        assert not out["directory_left"], out
        assert out["after"] == out["before"], f"rank {r}: pinned_stats before {out['before']} after {out['after']}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_R17_R25_nvme_engine_matches_reference_w2(area_api, reference_api, impl, accelerator, tmp_path, stage,
                                                  managed):
    """R17/R25: every stage, managed (with a step after a step: two boundaries without a backward between
    them) and unmanaged (a step after zero backwards), with nvme offload at W = 2: the engine's trace equals
    the reference's nvme trace, which equals its cpu-offload trace."""
    api = engine_api(impl)
    cfg = AccumulationConfig(
        zero_stage=stage,
        managed_gradient_accumulation=managed,
        dtype="bf16" if stage % 2 else "fp32",
        optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        offload_param="cpu" if stage == 3 else "none",
    )
    calls = scenario_calls("BSTSBSBS" if managed else "BSSBBS")
    sc = Scenario(cfg, 2, calls, model=ModelSpec(checkpoint=stage == 3), seed=5 + stage, name=f"nvme-s{stage}")
    expected = reference_api.run_scenario(sc)
    cpu = Scenario(cfg.replace(offload_optimizer="cpu"), 2, calls, model=sc.model, seed=sc.seed)
    assert_traces_match(expected, reference_api.run_scenario(cpu))
    assert_traces_match(api.run_scenario(sc), expected, cross_implementation_tolerance(sc, impl, accelerator))
    assert list(tmp_path.iterdir()) == []


def _lost_file_rank(group, impl, nvme_path: str) -> dict:
    """Delete this rank's swap files between two boundaries; report the error of the next step and what
    destroy() gives back."""
    import torch.distributed as dist

    ZeroEngine = engine_class(impl)
    pinned_stats = pinned_stats_of(impl)

    rank = dist.get_rank(group)
    cfg = AccumulationConfig(optimizer={"type": "adam"}, offload_optimizer="nvme", nvme_path=nvme_path)
    sc = Scenario(cfg, dist.get_world_size(group), ())
    gc.collect()
    before = pinned_stats()
    engine = ZeroEngine(ModelSpec().build(0), cfg, process_group=group)
    error = None
    try:
        for k in range(2):
            engine.backward(compute_loss(engine.module, *micro_batch(sc, k, rank), cfg.model_dtype))
            if k == 1:
                for name in os.listdir(engine.swap_directory):
                    os.unlink(os.path.join(engine.swap_directory, name))
            engine.step()
    except Exception as exc:
        error = exc
    out = {
        "error": None if error is None else type(error).__name__,
        "message": str(error),
        "is_file_not_found": isinstance(error, FileNotFoundError),
    }
    # The error's request refers to the buffer it failed on: drop it, as a caller who handled it would.
    del error
    directory = engine.swap_directory
    engine.destroy()
    gc.collect()
    out.update(directory_left=os.path.exists(directory), before=tuple(before), after=tuple(pinned_stats()))
    return out


def test_R17_nvme_lost_swap_file_is_a_clear_error_and_destroy_cleans_up(impl, area_api, native_pinning, tmp_path):
    """R17 (nvme): a swap file that vanished between steps makes the next boundary step raise the swap area's
    SwapFileNotFoundError (a FileNotFoundError) naming the file; destroy() afterwards still unpins every buffer
    and removes the engine's directory."""
    api = engine_api(impl)
    (out,) = api.run_on_ranks(_lost_file_rank, 1, impl, str(tmp_path))
    assert out["error"] == "SwapFileNotFoundError" and out["is_file_not_found"], out
    assert "rank0." in out["message"] and ".swp" in out["message"], out
    assert not out["directory_left"], out
    assert out["after"] == out["before"], out
    assert list(tmp_path.iterdir()) == []
