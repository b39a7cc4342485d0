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

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conformance.accumulation_assertions import assert_tensor_equal
from conformance.accumulation_strategies import optimizer_configs
from reference.contract.accumulation_state_precision import STATE_PRECISIONS, round_to_bf16
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
