"""The optimizer-kernel area's comparison (conformance/areas/kernel_claims.py) on kernels built here, for the branch no
shipped kernel reaches: a *tolerance* kernel with R29's bf16 moments (hostoffload's kernels are bitwise, the
example's torch.optim kernel keeps fp32 moments). A kernel that widens, steps in another operation order and
stores with torch's own round-to-nearest-even is accepted; the same kernel storing by truncation is refused; a
bitwise claim is refused for any difference of one bit.
"""

from __future__ import annotations

import pytest
import torch

from conformance.areas.kernel_claims import assert_claim, assert_stored_moment_claim
from reference.accumulation.optimizers import init_state, optimizer_step
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import STATE_PRECISIONS
from reference.contract.optimizer_kernels import AdamKernel, Tolerance

pytestmark = pytest.mark.conformance_area("harness")

TOL = Tolerance(rtol=1e-6, atol=1e-7, reason="another operation order")


def _foreign_step(cfg, p, g, m, v, t, *, truncate: bool) -> None:
    """An Adam of another operation order (lerp for m, bias correction inside the square root) on widened bf16
    moments, stored with torch's rounding or by truncation."""
    b1, b2 = cfg.betas
    m32 = m.float().lerp(g, 1 - b1)
    v32 = v.float().mul(b2).addcmul(g, g, value=1 - b2)
    denom = (v32 / (1 - b2**t)).sqrt().add(cfg.eps)
    p.sub_(m32 / denom * (cfg.lr / (1 - b1**t)))
    for dst, src in ((m, m32), (v, v32)):
        dst.copy_((src.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16) if truncate else src)


def _judge(kernel: AdamKernel, truncate: bool) -> None:
    cfg = OptimizerConfig(type="adam", lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    p0, g = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen) * 1e-2
    ref_p, wide_p = p0.clone(), p0.clone()
    stored, wide = init_state(cfg, ref_p, STATE_PRECISIONS["bf16"]), init_state(cfg, wide_p)
    optimizer_step(cfg, ref_p, g, stored)
    optimizer_step(cfg, wide_p, g, wide)
    p, m, v = p0.clone(), torch.zeros(4099, dtype=torch.bfloat16), torch.zeros(4099, dtype=torch.bfloat16)
    _foreign_step(cfg, p, g, m, v, 1, truncate=truncate)
    assert_claim(kernel, p, ref_p, "master")
    assert_stored_moment_claim(kernel, m, stored.buffers["exp_avg"], wide.buffers["exp_avg"], "exp_avg")
    assert_stored_moment_claim(kernel, v, stored.buffers["exp_avg_sq"], wide.buffers["exp_avg_sq"], "exp_avg_sq")


def test_tolerance_kernel_rounding_to_nearest_passes_and_truncating_fails():
    tolerant = AdamKernel(name="foreign", step=_foreign_step, arithmetic=TOL, state_precisions=("bfloat16",))
    _judge(tolerant, truncate=False)
    with pytest.raises(AssertionError, match="not R29's rounding of a value within rtol"):
        _judge(tolerant, truncate=True)


def test_bitwise_claim_refuses_another_operation_order():
    bitwise = AdamKernel(name="claims-bitwise", step=_foreign_step, state_precisions=("bfloat16",))
    with pytest.raises(AssertionError):
        _judge(bitwise, truncate=False)


def test_tolerance_claim_on_special_values():
    """NaN where the reference has NaN, the reference's infinities, and nothing else, for a tolerance kernel."""
    kernel = AdamKernel(name="foreign", step=_foreign_step, arithmetic=TOL, state_precisions=("bfloat16",))
    u = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 0.0])
    s = u.to(torch.bfloat16)
    assert_stored_moment_claim(kernel, s, s, u, "specials")
    for i, wrong in ((0, 1.0), (1, 3e38), (3, float("nan")), (4, 1e-3)):
        bad = s.clone()
        bad[i] = wrong
        with pytest.raises(AssertionError):
            assert_stored_moment_claim(kernel, bad, s, u, f"specials[{i}]")
