"""Compressed optimizer state (docs/accumulation.md R29, config ``state_precision``).

The rule has one definition of its rounding (``reference.contract.accumulation_state_precision.round_to_bf16``),
checked here against a first-principles scalar model (the nearest bf16 value, ties to even, from the exact
binary value of the fp32 input); the reference's step is checked against scalar numpy float32 arithmetic with
that independent rounding; and the engines' traces at each precision, share, stage, accumulation and clipping are
the reference's -- bitwise on the cpu accelerator -- and replay from their own gradients. Checkpoints move between
precisions (fp32 -> bf16 rounds, bf16 -> fp32 widens exactly), shares and offload. Everything that runs an
engine needs the implementation to declare ``accumulation_state_precision``.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import (
    assert_bits_equal,
    assert_matches_reference,
    assert_replay_consistent,
    assert_tensor_equal,
    assert_traces_match,
    cross_implementation_tolerance,
)
from conformance.areas.accumulation_engines import IN_RANK_PROCESSES, REQUIRES_CHECKPOINT, REQUIRES_ENGINE, engine_api
from conformance.areas.accumulation_strategies import STATE_PRECISIONS as PRECISIONS
from conformance.areas.accumulation_strategies import optimizer_configs, split_update_scenarios
from conformance.suite.test_accumulation_split_update import WIDE, _assert_same, _config, _loop, _micro_steps
from reference.accumulation import Scenario, scenario_calls
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.accumulation_state_precision import STATE_PRECISIONS, adam_pass_bytes_per_element, round_to_bf16
from reference.contract.errors import ConfigurationError

REQUIRES_STATE_PRECISION = pytest.mark.requires("accumulation_state_precision")
pytestmark = pytest.mark.conformance_area("accumulation")

VALID = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "state_precision": "bf16"}


# ---- the config (R19) ----------------------------------------------------------------------------------------


@REQUIRES_STATE_PRECISION
def test_R29_R19_state_precision_flat_nested_any_case(area_api):
    """R29/R19: ``state_precision`` defaults to "fp32"; "bf16" / "BF16" / "Fp32" are accepted flat and in
    DeepSpeed's nested shape inside ``zero_optimization.offload_optimizer`` (with or without offload), and
    stored lower-case."""
    cfg_cls = area_api.AccumulationConfig
    assert cfg_cls.from_dict({}).state_precision == "fp32"
    assert cfg_cls.from_dict({**VALID, "state_precision": "BF16"}).state_precision == "bf16"
    assert cfg_cls.from_dict({**VALID, "state_precision": "Fp32"}).state_precision == "fp32"
    for device in ("cpu", "none"):
        nested = cfg_cls.from_dict({
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": device, "state_precision": "Bf16"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        })
        assert (nested.state_precision, nested.offload_optimizer) == ("bf16", device)
    with pytest.raises(ConfigurationError, match="state_precision"):
        cfg_cls.from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                "state_precision": "bf16"}}})


@REQUIRES_STATE_PRECISION
@pytest.mark.parametrize("value", ["fp16", "int8", "", None, 16, True, torch.bfloat16])
def test_R29_R19_unknown_state_precision_is_rejected(area_api, value):
    """R19/R29: anything but the names of a precision is a ConfigurationError naming the key and the allowed
    values."""
    with pytest.raises(ConfigurationError, match="state_precision") as info:
        area_api.AccumulationConfig.from_dict({**VALID, "state_precision": value})
    assert "allowed" in str(info.value) and "bf16" in str(info.value) and "fp32" in str(info.value)


@REQUIRES_STATE_PRECISION
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"optimizer": {"type": "sgd", "momentum": 0.9}}, "optimizer.type='sgd'"),
        ({"offload_optimizer": "nvme", "nvme_path": "."}, "offload_optimizer='nvme'"),
    ],
)
def test_R29_R19_bf16_outside_its_domain_is_rejected(area_api, change, named):
    """R19/R29: bf16 moments need Adam/AdamW and the state in memory; SGD or ``nvme`` names the key, the
    offending setting and the allowed values. The same config at fp32 is fine."""
    with pytest.raises(ConfigurationError, match="state_precision") as info:
        area_api.AccumulationConfig.from_dict({**VALID, **change})
    assert named in str(info.value) and "allowed" in str(info.value)
    area_api.AccumulationConfig.from_dict({**VALID, **change, "state_precision": "fp32"})


# ---- the rounding, defined once ------------------------------------------------------------------------------


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bf16_value(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b << 16))[0]


def _nearest_even_bf16(x: float) -> int:
    """The bf16 bit pattern R29 stores for the fp32 value ``x``, from first principles: NaN -> 0x7FC0; else the
    bf16 value nearest to ``x`` (exact rational comparison), ties to the even pattern; beyond the largest finite
    bf16 value by half an ulp or more, infinity of the same sign."""
    if math.isnan(x):
        return 0x7FC0
    sign = _bits(x) & 0x80000000
    mag = abs(x)
    if math.isinf(mag):
        return (sign >> 16) | 0x7F80
    low = (_bits(mag) >> 16)  # truncation: the bf16 value at or below |x|
    below, above = _bf16_value(low), _bf16_value(low + 1) if low + 1 < 0x7F80 else None
    if above is None:  # |x| above the largest finite bf16: its next value would be 2^128
        above = 2.0**128
    from fractions import Fraction

    d_low, d_high = Fraction(mag) - Fraction(below), Fraction(above) - Fraction(mag)
    pick = low if (d_low < d_high or (d_low == d_high and low % 2 == 0)) else low + 1
    return (sign >> 16) | pick


fp32_values = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@given(xs=st.lists(fp32_values, min_size=1, max_size=64))
@example(xs=[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.3961e38, -3.3961e38, 3.4028235e38, 1e-40, -1.4e-45, 0.0, -0.0])
@example(xs=[float("nan"), -float("nan"), float("inf"), -float("inf"), 2.0**-133, 2.0**-134, 3 * 2.0**-134])
# one fp32 ulp either side of a tie: the lowest bit decides (a rounding that dropped it took 0x3F808001 for a tie)
@example(xs=[1 + 2.0**-8 + 2.0**-23, 1 + 2.0**-8 - 2.0**-23, -(1 + 2.0**-8 + 2.0**-23), 1 + 3 * 2.0**-8 - 2.0**-23])
def test_R29_round_to_bf16_is_nearest_even(xs):
    """R29: ``round_to_bf16`` of every fp32 value (normal, subnormal, ties, the largest finite values that round
    to infinity, infinities, NaN of either sign) is the nearest bf16 value with ties to even, a NaN the quiet
    NaN 0x7FC0 -- and, NaN aside, what ``tensor.to(torch.bfloat16)`` gives."""
    x = torch.tensor(xs, dtype=torch.float32)
    got = round_to_bf16(x).view(torch.int16).to(torch.int64) & 0xFFFF
    for i, v in enumerate(x.tolist()):
        assert got[i].item() == _nearest_even_bf16(v), f"round_to_bf16({v!r}) = {got[i].item():#06x}"
    finite = ~torch.isnan(x)
    assert_tensor_equal(round_to_bf16(x)[finite], x[finite].to(torch.bfloat16), "round_to_bf16 vs torch's cast")


def test_R29_the_precision_table_cannot_be_changed():
    """R29's precisions are shared by every implementation through one table: its entries are frozen, so no
    implementation (or test) can retarget ``bf16`` at another dtype for everyone after the table was read."""
    for precision in STATE_PRECISIONS.values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            precision.dtype = torch.float16
    assert STATE_PRECISIONS["bf16"].dtype == torch.bfloat16 and STATE_PRECISIONS["bf16"].bytes_per_moment == 2


def test_R29_adam_pass_bytes_count_each_buffer_once():
    """The host update's floor (docs/zero.md, benchmarks/bench_zero.py) from its parts: the fp32 master read and
    written (4 + 4), the fp32 gradient read (4), both moments read and written at their stored size, and the bf16
    weights written where the kernel writes them (2)."""
    for name, moment in (("fp32", 4), ("bf16", 2)):
        for copy in (False, True):
            want = 4 + 4 + 4 + 2 * (moment + moment) + (2 if copy else 0)
            got = adam_pass_bytes_per_element(STATE_PRECISIONS[name], bf16_copy=copy)
            assert got == want, f"{name} moments, bf16_copy={copy}: {got} bytes per element, expected {want}"
    assert adam_pass_bytes_per_element(STATE_PRECISIONS["fp32"], bf16_copy=True) == 30  # the docstring's figures
    assert adam_pass_bytes_per_element(STATE_PRECISIONS["bf16"], bf16_copy=True) == 22


# ---- the reference's step against scalar float32 arithmetic --------------------------------------------------

f32 = np.float32


def _scalar_adam_bf16(cfg, p, g, state, t):
    """One R16 Adam/AdamW step of one element in numpy float32 scalars from the widened stored moments, the
    moments stored back by :func:`_nearest_even_bf16` (R29)."""
    wd, lr = cfg.weight_decay, cfg.lr
    b1, b2 = cfg.betas
    if wd > 0:
        if cfg.type == "adamw":
            p = p * f32(1.0 - lr * wd)
        else:
            g = g + p * f32(wd)
    m = f32(_bf16_value(state["m"])) * f32(b1) + g * f32(1.0 - b1)
    v = f32(_bf16_value(state["v"])) * f32(b2) + (g * g) * f32(1.0 - b2)
    denom = np.sqrt(v) * f32(1.0 / math.sqrt(1.0 - b2**t)) + f32(cfg.eps)
    state["m"], state["v"] = _nearest_even_bf16(float(m)), _nearest_even_bf16(float(v))
    return p - (m / denom) * f32(lr / (1.0 - b1**t))


values = st.lists(st.floats(-4.0, 4.0, width=32), min_size=1, max_size=8)


@given(cfg=optimizer_configs(types=("adam", "adamw")), params=values,
       grads=st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=8), min_size=1, max_size=4))
def test_R29_reference_step_matches_scalar_formula(reference_api, cfg, params, grads):
    """R29/R16: with bf16 moments, the reference's Adam and AdamW over several steps give the master of the scalar
    fp32 formula run from the widened moments, and store the moments as the independently computed nearest-even
    bf16 values, bitwise."""
    api = reference_api
    n = len(params)
    master = torch.tensor(params, dtype=torch.float32)
    state = api.init_state(cfg, master, STATE_PRECISIONS["bf16"])
    assert {b.dtype for b in state.buffers.values()} == {torch.bfloat16}
    scalar = [f32(v) for v in params]
    scalar_state = [{"m": 0, "v": 0} for _ in range(n)]
    for t, gs in enumerate(grads, start=1):
        g = torch.tensor([gs[i % len(gs)] for i in range(n)], dtype=torch.float32)
        api.optimizer_step(cfg, master, g, state)
        for i in range(n):
            scalar[i] = _scalar_adam_bf16(cfg, scalar[i], f32(g[i].item()), scalar_state[i], t)
        assert_tensor_equal(master, torch.tensor(np.array(scalar, dtype=np.float32)), f"master after step {t}")
        for key, name in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            stored = state.buffers[name].view(torch.int16).to(torch.int64) & 0xFFFF
            assert stored.tolist() == [s[key] for s in scalar_state], f"{name} after step {t}"


# ---- traces: each precision x placement x stage x clipping, against the reference ----------------------------

#: Where the optimizer runs: all on the host (share 0), split, all on the device (share 1), no offload.
PLACEMENTS = (0.0, 0.5, 1.0, "no offload")


def _matrix_config(stage: int, placement, precision: str, clip: float) -> AccumulationConfig:
    offload = placement != "no offload"
    return AccumulationConfig(
        zero_stage=stage, dtype="fp32", gradient_accumulation_steps=2, gradient_clipping=clip,
        optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer="cpu" if offload else "none", offload_param="cpu" if stage == 3 and offload else "none",
        gpu_share=placement if offload else 0.0, state_precision=precision,
    )


@REQUIRES_STATE_PRECISION
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"share-{p}" if p != "no offload" else "no-offload")
@pytest.mark.parametrize("stage", [2, 3])
def test_R29_R25_pinned_matrix_matches_reference(area_api, reference_api, impl, accelerator, placement, stage):
    """R29/R25, pinned by a seed: each precision, with clipping that triggers at every boundary (0.05) and that
    never does (1e3), W = 2, gas 2, AdamW, 4 boundaries, at this placement and stage: the implementation's trace is
    the reference's (bitwise on cpu, R25's tolerance on a device), the reference's replays from its own gradients
    (R13-R16 with the moments stored as configured), and bf16 moments change the run (the test would see them
    ignored)."""
    masters = {}
    for precision in ("fp32", "bf16"):
        for clip in (0.05, 1e3):
            config = _matrix_config(stage, placement, precision, clip)
            scenario = Scenario(config, 2, scenario_calls("BSBSBSBSBSBSBSBS"), seed=29, name=f"R29-{precision}")
            expected = reference_api.run_scenario(scenario)
            coefs = [r.clip_coef for r in expected.boundaries()]
            assert len(coefs) == 4 and all((c is not None) == (clip < 1) for c in coefs), coefs
            assert_replay_consistent(expected)
            actual = area_api.run_scenario(scenario)
            assert_traces_match(actual, expected, cross_implementation_tolerance(scenario, impl, accelerator))
            masters[precision, clip] = expected.boundaries()[-1].parameters
    for clip in (0.05, 1e3):
        fp32, bf16 = masters["fp32", clip], masters["bf16", clip]
        assert any(not torch.equal(fp32[n], bf16[n]) for n in fp32), (
            f"clip {clip}: bf16 moments gave the fp32 run's parameters exactly"
        )


@REQUIRES_STATE_PRECISION
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("stage", [0, 1])
def test_R29_R25_stages_0_1_match_reference(area_api, reference_api, impl, accelerator, stage, offload):
    """R29/R25 where the whole master is updated in one call (stages 0/1, with and without optimizer offload):
    bf16 moments, W = 2, gas 2, bf16 model, clipping that triggers: the trace is the reference's, which replays."""
    config = AccumulationConfig(
        zero_stage=stage, dtype="bf16", grad_accum_dtype="fp32", gradient_accumulation_steps=2,
        gradient_clipping=0.05, optimizer={"type": "adam", "lr": 1e-2, "weight_decay": 0.01},
        offload_optimizer=offload, state_precision="bf16",
    )
    scenario = Scenario(config, 2, scenario_calls("BSBSBSBS"), seed=290, name="R29-stage01")
    assert_matches_reference(
        area_api, reference_api, scenario, cross_implementation_tolerance(scenario, impl, accelerator),
        replay=assert_replay_consistent,
    )


@REQUIRES_STATE_PRECISION
@given(data=st.data())
def test_R29_R25_drawn_scenario_matches_reference(area_api, reference_api, impl, accelerator, data):
    """R29/R25 on drawn scenarios (R28's domain: stages 2/3, W 1-2, managed or not, gas, any model and
    communication dtypes, clipping off / on / always, Adam/AdamW, shares 0, 0.5, 1, "auto"; the delayed update
    where declared), each precision: the trace equals the reference's; the reference's replays."""
    scenario = data.draw(split_update_scenarios(state_precisions=PRECISIONS))
    assert_matches_reference(
        area_api, reference_api, scenario, cross_implementation_tolerance(scenario, impl, accelerator),
        replay=assert_replay_consistent,
    )


# ---- checkpoints across precisions, shares and offload ------------------------------------------------------


def _resume(group, engine_cls, config: dict, load: tuple, boundaries: int) -> dict:
    """One rank: load ``load`` into a fresh engine, record master and state, run ``boundaries`` boundaries (data
    as R28's checkpoint tests), record losses, weights, master and state again."""
    import torch.distributed as dist

    engine = engine_cls(WIDE.build(5), config, process_group=group, bucket_elements=16)
    try:
        engine.load_checkpoint(*load)
        loaded = {"master": engine.master_partition(), "state": engine.optimizer_state().buffers}
        losses = []
        for k in range(engine.global_steps, engine.global_steps + boundaries):
            _micro_steps(engine, dist.get_rank(group), k, losses)
        return {"loaded": loaded, "losses": losses, "weights": engine.state_dict(),
                "master": engine.master_partition(), "state": engine.optimizer_state().buffers}
    finally:
        engine.destroy()


def _converted(state: dict, precision: str) -> dict:
    """R29's conversion of saved moments into ``precision``: bf16 rounds by the contract, fp32 widens exactly."""
    out = {}
    for k, v in state.items():
        wide = v.to(torch.float32)
        out[k] = round_to_bf16(wide) if precision == "bf16" else wide
    return out


@REQUIRES_STATE_PRECISION
@pytest.mark.requires("accumulation_split_update")
@REQUIRES_CHECKPOINT
@IN_RANK_PROCESSES
@pytest.mark.parametrize(("saved", "loaded"), [("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_R29_checkpoint_loads_across_precisions_shares_and_offload(impl, tmp_path, saved, loaded):
    """R29 + checkpoints: 2 boundaries at share 0.5 with ``saved`` moments (stage 2, W = 2), saved; loaded with
    ``loaded`` moments at shares 0 and 1 and without offload: right after the load the master is the saved one
    and the state the saved moments converted (to bf16 rounded to nearest even, to fp32 widened exactly, bit for
    bit); 2 more boundaries give the same losses, weights, master and state at every placement; and at one
    precision the resumed run equals the uninterrupted 4-boundary run."""
    api = engine_api(impl)
    ck = (str(tmp_path), "ck")
    first = api.run_on_ranks(_loop, 2, api.ZeroEngine, _config(2, 0.5, state_precision=saved), 2, None, ck)
    none = {**_config(2, 0.0, state_precision=loaded), "offload_optimizer": "none"}
    runs = {}
    for label, cfg in (("share 0", _config(2, 0.0, state_precision=loaded)),
                       ("share 1", _config(2, 1.0, state_precision=loaded)), ("no offload", none)):
        runs[label] = api.run_on_ranks(_resume, 2, api.ZeroEngine, cfg, ck, 2)
        for rank, (got, before) in enumerate(zip(runs[label], first, strict=True)):
            what = f"{saved} -> {loaded} at {label}, rank {rank}"
            assert_bits_equal(got["loaded"]["master"], before["master"], f"{what}: master after the load")
            want = _converted(before["state"], loaded)
            assert set(got["loaded"]["state"]) == set(want), f"{what}: state names"
            for name, buf in want.items():
                assert_bits_equal(got["loaded"]["state"][name], buf, f"{what}: {name} after the load")
    for label, ranks in runs.items():
        for rank, got in enumerate(ranks):
            _assert_same(got, runs["share 0"][rank], f"{saved} -> {loaded}: {label} vs share 0, rank {rank}")
    if saved == loaded:
        full = api.run_on_ranks(_loop, 2, api.ZeroEngine, _config(2, 0.5, state_precision=saved), 4)[0]
        _assert_same({"losses": first[0]["losses"] + runs["share 0"][0]["losses"]}, full, "resumed losses",
                     keys=("losses",))
        _assert_same(runs["share 0"][0], full, f"{saved} resumed vs uninterrupted", keys=("weights", "master",
                                                                                            "state"))


# ---- host memory: the moments at half the bytes --------------------------------------------------------------


def _locked_by_engine(group, engine_cls, stage: int, precision: str) -> int:
    """Rank function: the locked memory (the OS's ``VmLck``) an offloading engine adds at construction."""
    import gc

    from conformance.probes.memlock import _status

    cfg = AccumulationConfig(zero_stage=stage, offload_optimizer="cpu", dtype="bf16", state_precision=precision,
                             offload_param="cpu" if stage == 3 else "none")
    gc.collect()
    before = _status("VmLck")
    engine = engine_cls(WIDE.build(0), cfg, process_group=group)
    try:
        return (_status("VmLck") - before) * 1024
    finally:
        engine.destroy()


@REQUIRES_STATE_PRECISION
@REQUIRES_ENGINE
@IN_RANK_PROCESSES
@pytest.mark.parametrize("stage", [2, 3])
def test_R29_bf16_moments_lock_half_their_host_bytes(impl, monkeypatch, stage):
    """R29, observed on the OS: an offloading engine (W = 2, exact-size pinning, the default) with bf16 moments
    locks, per rank, exactly the two moments' difference less than with fp32 moments: 2 buffers of the partition
    at 2 bytes instead of 4 (each page-rounded), nothing else changed."""
    import mmap

    from reference.contract.accumulation_partition import build_layout

    monkeypatch.delenv("HOSTOFFLOAD_ZERO_HOST_MEMORY", raising=False)
    api = engine_api(impl)
    trainable = [(n, p.shape) for n, p in WIDE.build(0).named_parameters() if p.requires_grad]
    P = build_layout(trainable, 2).partition_size

    def pages(nbytes: int) -> int:
        return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE

    fp32 = api.run_on_ranks(_locked_by_engine, 2, api.ZeroEngine, stage, "fp32")
    bf16 = api.run_on_ranks(_locked_by_engine, 2, api.ZeroEngine, stage, "bf16")
    for r, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        assert a - b == 2 * (pages(4 * P) - pages(2 * P)), (
            f"rank {r} stage {stage}: fp32 moments locked {a} bytes, bf16 moments {b}: the difference is not the "
            f"moments' {2 * (pages(4 * P) - pages(2 * P))} bytes"
        )
