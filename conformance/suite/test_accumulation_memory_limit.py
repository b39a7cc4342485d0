"""``gpu_memory_limit`` (docs/accumulation.md R28): a limit on an engine's whole peak device memory, fitted by
``gpu_share: "auto"`` from the floor the engine measures itself.

Every test needs ``accumulation_split_update``. The rule has three parts, each checked here on the cpu
accelerator: the config (the key, its domain, its refusals beside ``gpu_share`` and ``gpu_memory_budget``); the
arithmetic of the contract every implementation calls (budget = limit - floor - limit // 50, the smallest limit
that runs, the refusal's message); and the engines. An engine measures its floor through the accelerator
``HOSTOFFLOAD_ACCELERATOR`` names; the cpu accelerator counts nothing (the engine refuses the limit at
construction), so the engine tests install a test device in the process that builds the engine
(:class:`reference.contract.accelerators.counting.CountingHostAccelerator`) and drive its counter like a device's
allocations: a stale peak before the engine exists (the engine restarts the counter), one peak during the first
boundary and a higher one during the second accumulation (the floor is the peak until "auto" chooses, at the
second boundary). The engine's report must spend the limit on exactly that floor, its cut must be the contract's
formula within the budget, its run bitwise the all-host run (R28), and a floor the limit cannot hold must be
refused at the choice with the floor in the message.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_ENGINE, engine_api, pinned_stats_of
from reference.accumulation import AccumulationConfig, ModelSpec, compute_loss
from reference.contract.accelerators.counting import CountingHostAccelerator, installed
from reference.contract.accumulation_limit import MemoryLimit, fit_limit, smallest_limit
from reference.contract.accumulation_split import SplitMeasurement, choose_split
from reference.contract.errors import ConfigurationError

REQUIRES_SPLIT = pytest.mark.requires("accumulation_split_update")
pytestmark = pytest.mark.conformance_area("accumulation")

LIMIT = 1 << 24
VALID = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "gpu_memory_limit": LIMIT}


def _budget(limit: int, floor: int) -> int:
    """The rule as docs/accumulation.md states it: the split gets the limit less the floor and 2 % of the limit."""
    return limit - floor - limit // 50


# ---- the config (R19) ----------------------------------------------------------------------------------------


@REQUIRES_SPLIT
def test_R28_R19_limit_key_flat_and_nested_implies_auto(area_api):
    """R28/R19: ``gpu_memory_limit`` defaults to None (and ``gpu_share`` then to 0.0); given, flat or inside
    ``zero_optimization.offload_optimizer``, it makes a share left out "auto" (an explicit "auto" in any case is
    fine too), and survives ``replace``, which adding a limit to a share-0 config also makes "auto"."""
    cfg_cls = area_api.AccumulationConfig
    default = cfg_cls.from_dict({})
    assert (default.gpu_memory_limit, default.gpu_share) == (None, 0.0)
    flat = cfg_cls.from_dict(VALID)
    assert (flat.gpu_memory_limit, flat.gpu_share, flat.gpu_memory_budget) == (LIMIT, "auto", None)
    assert cfg_cls.from_dict({**VALID, "gpu_share": "AUTO"}).gpu_share == "auto"
    assert flat.replace(gradient_clipping=0.5).gpu_memory_limit == LIMIT
    at_zero = cfg_cls.from_dict({k: v for k, v in VALID.items() if k != "gpu_memory_limit"})
    assert at_zero.replace(gpu_memory_limit=LIMIT).gpu_share == "auto"  # the share 0 it had was the default
    nested = cfg_cls.from_dict({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "gpu_memory_limit": 10 << 30}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    })
    assert (nested.gpu_memory_limit, nested.gpu_share, nested.zero_stage) == (10 << 30, "auto", 3)


@REQUIRES_SPLIT
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"gpu_memory_limit": 0}, "gpu_memory_limit=0"),
        ({"gpu_memory_limit": -1}, "gpu_memory_limit=-1"),
        ({"gpu_memory_limit": True}, "gpu_memory_limit=True"),
        ({"gpu_memory_limit": 1.5e9}, "gpu_memory_limit=1500000000.0"),
        ({"gpu_memory_limit": "10GiB"}, "gpu_memory_limit='10GiB'"),
        ({"gpu_memory_budget": 1024}, "gpu_memory_budget=1024"),
        ({"gpu_share": 0.0}, "gpu_share=0.0"),
        ({"gpu_share": 0.5}, "gpu_share=0.5"),
        ({"gpu_share": 1}, "gpu_share=1"),
        ({"offload_optimizer": "none"}, "offload_optimizer='none'"),
        ({"zero_stage": 1}, "zero_stage=1"),
        ({"optimizer": {"type": "sgd"}}, "optimizer.type='sgd'"),
    ],
)
def test_R28_R19_bad_limits_are_rejected(area_api, change, named):
    """R19/R28: a limit that is not an int > 0 (bytes), a limit beside ``gpu_memory_budget`` (one or the other)
    or beside a numeric ``gpu_share`` (the limit is fitted by "auto"), and a limit outside the streamed host
    update (``offload_optimizer: cpu``, stage 2/3, Adam) are each a ConfigurationError naming
    ``gpu_memory_limit``, the offending setting and what is allowed -- flat and nested."""
    with pytest.raises(ConfigurationError, match="gpu_memory_limit") as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change})
    assert named in str(info.value) and "allowed" in str(info.value), str(info.value)
    off = {"device": "cpu", "gpu_memory_limit": LIMIT}
    off.update({k: v for k, v in change.items() if k in ("gpu_memory_limit", "gpu_memory_budget", "gpu_share")})
    if "offload_optimizer" in change:
        off["device"] = change["offload_optimizer"]
    nested = {"zero_optimization": {"stage": change.get("zero_stage", 2), "offload_optimizer": off},
              "optimizer": {"type": change.get("optimizer", {}).get("type", "AdamW")}}
    with pytest.raises(ConfigurationError, match="gpu_memory_limit"):
        area_api.AccumulationConfig.from_dict(nested)


# ---- the contract's arithmetic --------------------------------------------------------------------------------


@given(floor=st.integers(0, 1 << 40), limit=st.integers(1, 1 << 40))
def test_R28_limit_budget_is_limit_less_floor_less_margin(floor, limit):
    """R28: under a limit the split's budget is ``limit - floor - limit // 50``; a limit that leaves less than
    nothing is refused (ConfigurationError naming ``gpu_memory_limit``, the floor in bytes and GiB, and the
    smallest limit that runs); ``smallest_limit(floor)`` runs and one byte less does not."""
    need = smallest_limit(floor)
    assert need >= 1 and _budget(need, floor) >= 0 and (need == 1 or _budget(need - 1, floor) < 0), (floor, need)
    if _budget(limit, floor) >= 0:
        got = fit_limit(limit, floor)
        assert got == MemoryLimit(limit, floor, limit // 50, _budget(limit, floor)), got
        return
    with pytest.raises(ConfigurationError, match="gpu_memory_limit") as info:
        fit_limit(limit, floor)
    message = str(info.value)
    for part in (f"{floor} bytes", f"{floor / 2**30:.2f} GiB", f"{need} bytes", f"gpu_memory_limit >= {need}"):
        assert part in message, f"{part!r} missing from: {message}"


# ---- the reference engine (in this process) -------------------------------------------------------------------

#: The counter's readings (bytes): before the engine exists, between micro-steps, and the two peaks.
STALE, IDLE = 1 << 40, 1 << 20


def _reference_boundary(engine, k: int) -> None:
    spec = ModelSpec()
    gen = torch.Generator().manual_seed(k)
    losses = []
    for r in range(engine.world_size):
        x, y = torch.randn(2, spec.in_features, generator=gen), torch.randn(2, spec.out_features, generator=gen)
        losses.append(compute_loss(engine.module(r), x, y, engine.config.model_dtype))
    engine.backward(losses)
    assert engine.step().boundary


def _reference_run(reference_api, config: AccumulationConfig, peaks: tuple[int, int], boundaries: int):
    """The reference engine with the counting device installed: the counter is stale before construction,
    reaches ``peaks[0]`` during the first boundary and ``peaks[1]`` during the second accumulation; returns the
    reports after each boundary, the master and state, or the error and after which boundary it came."""
    device = CountingHostAccelerator(allocated=STALE)
    with installed(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" on the cpu device says its choice is timing noise
        device.allocate_to(IDLE)
        engine = reference_api.AccumulationEngine(lambda: ModelSpec().build(3), config, 2)
        reports = []
        try:
            for k in range(boundaries):
                if k < 2:
                    device.allocate_to(peaks[k])
                    device.allocate_to(IDLE)
                try:
                    _reference_boundary(engine, k)
                except ConfigurationError as exc:
                    return {"error": str(exc), "at": k, "reports": reports}
                reports.append(engine.split_report())
            return {"error": None, "reports": reports, "partition": engine.layout.partition_size,
                    "master": [engine.master_partition(r).clone() for r in range(2)]}
        finally:
            engine.destroy()


def _check_report(report: dict, partition: int, config, floor: int) -> None:
    """The report spends the limit on ``floor`` (the rule's budget), and its cut is the contract's formula."""
    limit = config.gpu_memory_limit
    spent = report["memory_limit"]
    assert spent == {"limit_bytes": limit, "floor_bytes": floor, "margin_bytes": limit // 50,
                     "budget_bytes": _budget(limit, floor)}, f"the limit was not spent on the measured floor: {spent}"
    assert report["budget_bytes"] == spent["budget_bytes"] and report["auto"], report
    assert 0 <= report["device_bytes"] <= spent["budget_bytes"], f"the cut is over the budget: {report}"
    expected = choose_split(partition, config, report["budget_bytes"], SplitMeasurement(**report["measurement"]),
                            MemoryLimit(**spent))
    assert report == expected.as_dict(), "the cut is not choose_split's for the reported measurement and limit"


@pytest.mark.parametrize("spare", [0, 1 << 20], ids=["exactly-enough", "room"])
def test_R28_reference_limit_spends_what_the_floor_leaves(reference_api, spare):
    """R28 on the oracle: with the floor measured from construction to the choice (a stale peak before the
    engine is ignored, the second accumulation's higher peak counts), ``split_report()["memory_limit"]`` is
    the limit, that floor, the 2 % margin and the rest as the split's budget (0 at the smallest limit that
    runs); the cut is within it and the trace is the all-host run's bitwise."""
    floor = 3 << 20
    limit = smallest_limit(floor) + spare
    cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", gradient_accumulation_steps=1,
                             gpu_memory_limit=limit)
    got = _reference_run(reference_api, cfg, (floor - 4096, floor), 3)
    assert got["error"] is None, got["error"]
    first, *after = got["reports"]
    assert first is None, f"the limit was spent before the second boundary: {first}"
    for report in after:
        _check_report(report, got["partition"], cfg, floor)
    if not spare:
        assert after[0]["budget_bytes"] == 0 and after[0]["device_bytes"] == 0, after[0]
    all_host = _reference_run(reference_api, cfg.replace(gpu_memory_limit=None, gpu_share=0.0), (IDLE, IDLE), 3)
    for r, (a, b) in enumerate(zip(got["master"], all_host["master"], strict=True)):
        assert torch.equal(a, b), f"rank {r}: the master under the limit differs from the all-host run's"


def test_R28_reference_limit_below_the_floor_is_refused_at_the_choice(reference_api):
    """R28 on the oracle: a floor one byte above what the limit holds is refused at the second boundary (when
    "auto" chooses; the first runs), a ConfigurationError naming ``gpu_memory_limit`` with the measured floor
    and the smallest limit that runs."""
    floor = 3 << 20
    limit = smallest_limit(floor) - 1
    cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", gradient_accumulation_steps=1,
                             gpu_memory_limit=limit)
    got = _reference_run(reference_api, cfg, (IDLE, floor), 3)
    assert got["error"] is not None, f"a limit below floor + margin was not refused: {got['reports']}"
    assert got["at"] == 1, f"refused at boundary {got['at']}, not at the choice (the second boundary)"
    for part in ("gpu_memory_limit", f"{floor} bytes", f"{smallest_limit(floor)} bytes"):
        assert part in got["error"], f"{part!r} missing from: {got['error']}"


def test_R28_reference_limit_without_a_counter_is_refused_at_construction(reference_api, monkeypatch):
    """R28: on a device nothing counts (the cpu accelerator), the limit cannot be measured: the engine refuses
    it at construction, naming ``gpu_memory_limit``."""
    monkeypatch.setenv("HOSTOFFLOAD_ACCELERATOR", "cpu")
    cfg = AccumulationConfig(zero_stage=2, offload_optimizer="cpu", gpu_memory_limit=LIMIT)
    with pytest.raises(ConfigurationError, match="gpu_memory_limit"):
        reference_api.AccumulationEngine(lambda: ModelSpec().build(3), cfg, 2)


# ---- the distributed engine (rank processes) -----------------------------------------------------------------

WIDE = ModelSpec(in_features=24, hidden=96, out_features=32)


def _config(**extra) -> dict:
    return {
        "zero_stage": 2, "dtype": "bf16", "grad_accum_dtype": "fp32", "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "offload_optimizer": "cpu", **extra,
    }


def _micro_steps(engine, rank: int, k: int, losses: list, device=None, peak: int | None = None) -> None:
    cfg = engine.config
    for j in range(cfg.gradient_accumulation_steps):
        gen = torch.Generator().manual_seed(1000 * k + 10 * j + rank)
        x = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.in_features, generator=gen)
        y = torch.randn(cfg.train_micro_batch_size_per_gpu, WIDE.out_features, generator=gen)
        loss = compute_loss(engine.module, x, y, cfg.model_dtype)
        engine.backward(loss)
        if device is not None and peak is not None and j == 0:
            device.allocate_to(peak)  # the activations of this micro-batch's backward, say
            device.allocate_to(IDLE)
        engine.step()
        losses.append(loss.detach().clone())


def _limited_loop(group, impl, config: dict, boundaries: int, peaks: list | None) -> dict:
    """One rank: ``boundaries`` boundaries; with ``peaks`` (per rank: the first boundary's and the second
    accumulation's peak) the counting device installed and driven, else the plain accelerator. The losses,
    weights, master, state and the reports, or the error and the boundary it came at; the pinned allocations and
    what the OS sees left behind once the engine is destroyed."""
    import torch.distributed as dist

    from conformance.areas.accumulation_engines import engine_class
    from conformance.harness.observation import Observation

    rank = dist.get_rank(group)
    stats = pinned_stats_of(impl)
    before, seen = stats().allocations, Observation.now()
    device = CountingHostAccelerator(allocated=STALE)
    out: dict = {"error": None, "reports": [], "losses": []}
    with installed(device) if peaks is not None else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" on the cpu device says its choice is timing noise
        device.allocate_to(IDLE)
        engine = None
        try:
            engine = engine_class(impl)(WIDE.build(5), config, process_group=group, bucket_elements=16)
            for k in range(boundaries):
                peak = peaks[rank][k] if peaks is not None and k < 2 else None
                _micro_steps(engine, rank, k, out["losses"], device, peak)
                out["reports"].append(engine.split_report())
            out.update(weights=engine.state_dict(), master=engine.master_partition(),
                       state=engine.optimizer_state().buffers, partition=engine.master_partition().numel())
        except ConfigurationError as exc:
            out.update(error=str(exc), at=len(out["reports"]), built=engine is not None)
        finally:
            if engine is not None:
                engine.destroy()
    out.update(pinned=(before, stats().allocations), leaks=Observation.now().leaks_since(seen))
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    for key in ("losses", "weights", "master", "state"):
        a, b = got[key], want[key]
        if isinstance(a, dict):
            for name in b:
                assert torch.equal(a[name], b[name]), f"{what}: {key}[{name!r}] differs"
        elif isinstance(a, list):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"{what}: {key} differ"
        else:
            assert torch.equal(a, b), f"{what}: {key} differs"


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R28_engine_limit_spends_the_largest_floor_and_equals_the_all_host_run(impl):
    """R28 at W = 2, the ranks' floors different (rank 1's larger, reached in the second accumulation): every
    rank reports the limit spent on the largest floor (the rule's budget, the same cut on both ranks), a cut
    within it that is ``choose_split``'s, and 3 boundaries equal the all-host loop bitwise (losses, weights,
    master, optimizer state) at whatever cut "auto" made -- on the host, where both sides are the CPU, often none
    for a model this small; R28's own tests pin the equality at cuts of half and all of the partition."""
    api = engine_api(impl)
    floors = [5 << 20, (5 << 20) + 12345]
    limit = smallest_limit(max(floors)) + (1 << 20)
    peaks = [[floors[0], floors[0] - 1], [floors[1] - 7, floors[1]]]
    cfg = _config(gpu_memory_limit=limit)
    got = api.run_on_ranks(_limited_loop, 2, impl, cfg, 3, peaks)
    want = api.run_on_ranks(_limited_loop, 2, impl, _config(), 3, None)
    shares = set()
    for rank, out in enumerate(got):
        assert out["error"] is None, f"rank {rank}: {out['error']}"
        first, *after = out["reports"]
        assert first is None, f"rank {rank}: the limit was spent before the second boundary: {first}"
        for report in after:
            _check_report(report, out["partition"], AccumulationConfig.from_dict(cfg), max(floors))
        shares.add(after[0]["gpu_share"])
        _assert_same(out, want[rank], f"rank {rank} under gpu_memory_limit")
    assert len(shares) == 1, f"ranks cut differently: {shares}"


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize("mode", ["sync", "overlap", "delayed"])
def test_R28_engine_limit_below_one_ranks_floor_is_refused_on_every_rank(impl, mode):
    """R28 at W = 2: a limit that holds rank 0's floor but not rank 1's is refused on both ranks at the second
    boundary (where "auto" chooses; the first runs), a ConfigurationError naming ``gpu_memory_limit`` with the
    larger floor and the smallest limit that runs; destroying the engine then leaves no pinned allocation,
    locked page, descriptor or thread behind -- also where the host update started under the last backward (R30)
    or the update is delayed (R27)."""
    extra = {"sync": {}, "overlap": {"host_update_start": "last_backward"},
             "delayed": {"delayed_parameter_update": True, "delayed_update_warmup": 1}}[mode]
    if mode == "overlap" and not impl.capabilities.accumulation_overlapped_update:
        pytest.skip(f"{impl.name} does not declare accumulation_overlapped_update (R30)")
    if mode == "delayed" and not impl.capabilities.accumulation_delayed_parameter_update:
        pytest.skip(f"{impl.name} does not declare accumulation_delayed_parameter_update (R27)")
    api = engine_api(impl)
    floors = [5 << 20, 6 << 20]
    limit = smallest_limit(floors[1]) - 1
    got = api.run_on_ranks(_limited_loop, 2, impl, _config(gpu_memory_limit=limit, **extra), 3,
                           [[f, f] for f in floors])
    for rank, out in enumerate(got):
        assert out["error"] is not None, f"rank {rank}: a floor over the limit was not refused"
        assert out["at"] == 1, f"rank {rank}: refused after boundary {out['at']}, not at the choice (the second)"
        for part in ("gpu_memory_limit", f"{floors[1]} bytes", f"{smallest_limit(floors[1])} bytes"):
            assert part in out["error"], f"rank {rank}: {part!r} missing from: {out['error']}"
        assert out["pinned"][0] == out["pinned"][1], f"rank {rank}: pinned allocations left: {out['pinned']}"
        assert not out["leaks"], f"rank {rank}: left behind (seen by the OS): {out['leaks']}"


@REQUIRES_SPLIT
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R28_engine_limit_without_a_counter_is_refused_at_construction(impl):
    """R28: on a device nothing counts (the harness's accelerator counts no host memory; a device accelerator
    counts its own device, not a gloo engine's), the limit cannot be measured: the engine refuses it at
    construction, naming ``gpu_memory_limit``, and leaves nothing behind."""
    got = engine_api(impl).run_on_ranks(_limited_loop, 1, impl, _config(gpu_memory_limit=LIMIT), 1, None)[0]
    assert got["error"] is not None and not got["built"], f"the limit was not refused at construction: {got}"
    assert "gpu_memory_limit" in got["error"], got["error"]
    assert got["pinned"][0] == got["pinned"][1] and not got["leaks"], got


# ---- on the GPU (NCCL, world size 1) --------------------------------------------------------------------------

#: About 0.6M trainable elements: a device side of megabytes, well above the allocator's rounding.
LARGE = ModelSpec(in_features=256, hidden=1024, out_features=256)


def _cuda_run(group, engine_cls, config: dict, boundaries: int) -> tuple[dict | None, int]:
    """One engine on cuda: its split report after ``boundaries`` boundaries and the peak allocated bytes from the
    end of its construction (the counter restarted there) to the end. Micro-batches of 2048 rows: the backward's
    activations (megabytes) make the peak a training peak, not the boundary's (where the cut's one-off copy of
    the device side's gradient lands)."""
    device = torch.device("cuda", torch.cuda.current_device())
    engine = engine_cls(LARGE.build(5), config, process_group=group, bucket_elements=1 << 16)
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cfg = engine.config
        gen = torch.Generator().manual_seed(3)
        for _ in range(boundaries * cfg.gradient_accumulation_steps):
            x = torch.randn(2048, LARGE.in_features, generator=gen).to(device)
            y = torch.randn(2048, LARGE.out_features, generator=gen).to(device)
            engine.backward(compute_loss(engine.module, x, y, cfg.model_dtype))
            engine.step()
        engine.synchronize()
        torch.cuda.synchronize(device)
        return engine.split_report(), int(torch.cuda.max_memory_allocated(device))
    finally:
        engine.destroy()


def _limit_on_cuda(group, engine_cls, room: int) -> tuple:
    """One rank on cuda: the peak of 3 boundaries at share 0, then the report and peak of 3 boundaries under
    the limit that leaves the split ``room`` bytes above that peak and the margin."""
    floor = _cuda_run(group, engine_cls, _config(), 3)[1]
    limit = smallest_limit(floor) + room
    report, peak = _cuda_run(group, engine_cls, _config(gpu_memory_limit=limit), 3)
    return floor, limit, report, peak


@REQUIRES_SPLIT
@pytest.mark.gpu
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
def test_R28_engine_limit_holds_on_the_device(impl, accelerator):
    """R28, observed on the GPU: with a limit that leaves the split 8 MiB above the share-0 peak (and the
    margin), the engine reports the limit spent on a floor it measured (within the limit), and its peak over 3
    boundaries -- the split's device side included -- stays within the limit, give or take the 2 % the issue that
    asked for the limit allows (the margin is meant to keep it under; this is where that is observed)."""
    if accelerator.device_type != "cuda":
        pytest.skip("needs the cuda accelerator (NCCL)")
    api = engine_api(impl)
    floor, limit, report, peak = api.run_on_ranks(_limit_on_cuda, 1, api.ZeroEngine, 8 << 20, backend="nccl")[0]
    assert report is not None and report["memory_limit"] is not None, f"no limit in the report: {report}"
    spent = report["memory_limit"]
    assert spent["limit_bytes"] == limit and 0 < spent["floor_bytes"] <= limit, spent
    assert report["device_bytes"] <= spent["budget_bytes"], report
    assert peak <= limit + limit // 50, (
        f"peak {peak} bytes over the limit {limit} (share-0 peak {floor}, floor measured {spent['floor_bytes']}, "
        f"device side {report['device_bytes']} bytes)"
    )
