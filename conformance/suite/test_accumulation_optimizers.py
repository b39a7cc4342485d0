"""The optimizer formulas of R16, checked element by element against scalar numpy float32 arithmetic.

numpy's float32 scalars round every operation to float32 exactly once and never fuse, which is what R16
prescribes; equality here therefore pins the reference to the documented formula bit for bit (and is the same
check a native CPU Adam must pass, issue 6).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import assert_tensor_equal
from conformance.areas.accumulation_strategies import optimizer_configs

pytestmark = pytest.mark.conformance_area("accumulation")

f32 = np.float32
values = st.lists(st.floats(-4.0, 4.0, width=32), min_size=1, max_size=8)


def _scalar_step(cfg, p, g, state, t):
    """One R16 step for one element, in numpy float32 scalars; hyper-parameter expressions in Python
    floats."""
    wd, lr = cfg.weight_decay, cfg.lr
    if cfg.type == "sgd":
        if wd > 0:
            g = g + p * f32(wd)
        if cfg.momentum > 0:
            state["b"] = state["b"] * f32(cfg.momentum) + g
            d = state["b"]
        else:
            d = g
        return p - d * f32(lr)
    b1, b2 = cfg.betas
    if wd > 0:
        if cfg.type == "adamw":
            p = p * f32(1.0 - lr * wd)
        else:
            g = g + p * f32(wd)
    state["m"] = state["m"] * f32(b1) + g * f32(1.0 - b1)
    state["v"] = state["v"] * f32(b2) + (g * g) * f32(1.0 - b2)
    denom = np.sqrt(state["v"]) * f32(1.0 / math.sqrt(1.0 - b2**t)) + f32(cfg.eps)
    return p - (state["m"] / denom) * f32(lr / (1.0 - b1**t))


@given(cfg=optimizer_configs(), params=values, grads=st.lists(values, min_size=1, max_size=3))
def test_R16_optimizer_matches_scalar_float32_formula(reference_api, cfg, params, grads):
    """R16: SGD (momentum, L2 decay), Adam (L2 decay) and AdamW (decoupled decay) over several steps equal the
    documented one-rounding-per-operation formula, bitwise, for every element."""
    api = reference_api
    n = len(params)
    master = torch.tensor(params, dtype=torch.float32)
    state = api.init_state(cfg, master)
    scalar = [f32(v) for v in params]
    scalar_state = [{"b": f32(0), "m": f32(0), "v": f32(0)} for _ in range(n)]
    for t, gs in enumerate(grads, start=1):
        g = torch.tensor([gs[i % len(gs)] for i in range(n)], dtype=torch.float32)
        g_before = g.clone()
        api.optimizer_step(cfg, master, g, state)
        assert_tensor_equal(g, g_before, "the gradient must not be modified")
        assert state.step == t
        for i in range(n):
            scalar[i] = _scalar_step(cfg, scalar[i], f32(g[i].item()), scalar_state[i], t)
        expected = torch.tensor(np.array(scalar, dtype=np.float32))
        assert_tensor_equal(master, expected, f"{cfg.type} master after step {t} ({cfg})")


def test_R16_optimizer_rejects_non_fp32(reference_api):
    """R16: the optimizer works on fp32 masters only; anything else is a TypeError naming the dtypes."""
    api = reference_api
    cfg = api.OptimizerConfig(type="adam")
    p = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(TypeError) as info:
        api.optimizer_step(cfg, p, torch.zeros(3, dtype=torch.bfloat16), api.init_state(cfg, p.float()))
    assert "fp32" in str(info.value) or "float32" in str(info.value), str(info.value)
