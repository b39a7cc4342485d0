"""A fused device Adam / AdamW kernel (an implementation's optional ``fused_device_adam``) against R16, bitwise.

The bound is zero ulps, as for the native CPU kernel: a one-pass kernel that performs R16's operations one IEEE
fp32 rounding at a time (no contraction into FMAs, the correctly rounded square root and division) computes what
the reference's torch sequence computes, so any difference is a bug, not a tolerance. The tensors live on the
accelerator under test: on the cpu accelerator an implementation may run its kernel in an interpreter (the
optimized one runs its Triton kernel in Triton's), which holds the kernel's *operation sequence* to the formula;
on a GPU the same tests hold the compiled kernel to it.

An implementation that chooses the kernel at run time must also refuse one that differs: its ``self_check``
is given a kernel one ulp off and must report it, and on a device where the real kernel passes it must be
used (``use_for``), else the speed it exists for is silently lost.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import assert_bits_equal, assert_tensor_equal, reference_optimizer_steps
from conformance.areas.accumulation_strategies import optimizer_configs, optimizer_values
from conformance.harness import optional_packages
from reference.contract.accumulation_state_precision import STATE_PRECISIONS
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")


def _kernel(impl, area_api):
    kernel = getattr(area_api, "fused_device_adam", None)
    if kernel is None:
        pytest.skip("this implementation declares no fused device Adam (fused_device_adam)")
    # The packages the implementation's optimizer_kernels area says this kernel needs (reference/contract/
    # optimizer_kernels.py); a missing one is reported at the top of the report with the rules it leaves unjudged.
    optional_packages.require(_declared_requirements(impl), "the fused device Adam's compiler")
    if not kernel.available():
        pytest.skip("the implementation reports its fused device Adam unavailable here (kernel.available())")
    return kernel


def _declared_requirements(impl) -> tuple[str, ...]:
    """The ``requires`` of the fused device Adam as the implementation declares it in its optimizer_kernels area
    (the kernel whose step is the accumulation area's ``fused_device_adam.adam_step``); () if not declared."""
    if not impl.provides("optimizer_kernels"):
        return ()
    step = impl.load("accumulation").fused_device_adam.adam_step
    kernels = getattr(impl.load("optimizer_kernels"), "OPTIMIZER_KERNELS", ())
    return next((k.requires for k in kernels if k.step is step), ())


@given(
    cfg=optimizer_configs(types=("adam", "adamw")),
    n=st.sampled_from((1, 7, 1023, 1024, 1025, 4099)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R16_fused_device_adam_equals_reference_formula_bitwise(
    impl, area_api, reference_api, accelerator, cfg, n, steps, clip, seed, data
):
    """R16/R15: Adam and AdamW (with and without weight decay), the clipping coefficient applied inside the
    kernel, several steps (bias corrections), sizes around the kernel's block: master and both moments equal
    the reference formula bitwise on the accelerator's device; the gradient is not modified."""
    kernel = _kernel(impl, area_api)
    device = accelerator.device()
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-6, 1))) for _ in range(steps)]
    expected, state = reference_optimizer_steps(reference_api, cfg, p0, grads, clip)
    p, m, v = p0.to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    for t, g in enumerate(grads, start=1):
        g = g.to(device)
        g_before = g.clone()
        kernel.adam_step(cfg, p, g, m, v, t, grad_scale=clip)
        assert_tensor_equal(g, g_before, "gradient must stay unmodified")
    what = f"{cfg.type} wd={cfg.weight_decay} n={n} steps={steps} clip={clip} on {device}"
    assert_tensor_equal(p.cpu(), expected, f"{what}: master")
    assert_tensor_equal(m.cpu(), state.buffers["exp_avg"], f"{what}: exp_avg")
    assert_tensor_equal(v.cpu(), state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")


@given(
    cfg=optimizer_configs(types=("adam", "adamw")),
    n=st.sampled_from((1, 7, 1025)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R29_fused_device_adam_bf16_moments_equal_reference_bitwise(
    impl, area_api, reference_api, accelerator, cfg, n, steps, clip, seed, data
):
    """R29/R16: with bf16 moments the kernel widens, steps and stores them rounded to nearest even in its pass:
    master and the moments' bit patterns equal the reference's on the accelerator's device, also where a
    gradient element is NaN (the moment stored as 0x7FC0), infinite or subnormal; a kernel check (``self_check``)
    with bf16 moments passes."""
    kernel = _kernel(impl, area_api)
    device = accelerator.device()
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-20, 3))) for _ in range(steps)]
    grads[0][n // 2] = data.draw(st.sampled_from((float("nan"), float("inf"), 1e-41, 3.3961e38)))
    bf16 = STATE_PRECISIONS["bf16"]
    expected, state = reference_optimizer_steps(reference_api, cfg, p0, grads, clip, bf16)
    p = p0.to(device)
    m, v = (torch.zeros(n, dtype=torch.bfloat16, device=device) for _ in range(2))
    for t, g in enumerate(grads, start=1):
        kernel.adam_step(cfg, p, g.to(device), m, v, t, grad_scale=clip)
    what = f"bf16 moments {cfg.type} wd={cfg.weight_decay} n={n} steps={steps} clip={clip} on {device}"
    assert_tensor_equal(p.cpu(), expected, f"{what}: master")
    assert_bits_equal(m.cpu(), state.buffers["exp_avg"], f"{what}: exp_avg")
    assert_bits_equal(v.cpu(), state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")
    if hasattr(kernel, "self_check") and device.type != "cpu":
        assert kernel.self_check(device, cfg, precision=bf16) is None


@pytest.mark.parametrize("n", [1, 9, 5000])
def test_R13_fused_device_bf16_copy_equals_cast_of_updated_master(impl, area_api, reference_api, accelerator, n):
    """R13 step 5: the bf16 weights the kernel writes in its pass equal ``master.to(torch.bfloat16)`` of the
    updated master: ties to even both ways, infinities, NaN (whatever its payload, a NaN stays a NaN), the
    largest finite values (which round to infinity) and subnormals."""
    kernel = _kernel(impl, area_api)
    device = accelerator.device()
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen) * 1e3
    # Without weight decay a zero gradient leaves an element exactly as it was (m = v = 0, the update 0 / eps),
    # so these special values are the updated master's: the ties below are ties when the kernel casts them.
    special = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, float("inf"), -float("inf"), float("nan"), 3.4e38,
                            1e-40, -(1.0 + 2.0**-8)])
    # A NaN with an all-ones payload (a GPU's canonical NaN): rounding its bits to nearest would carry into the
    # sign and make it -0.0.
    special[4] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    k = min(n, special.numel())
    p0[:k] = special[:k]
    g = torch.randn(n, generator=gen)
    g[:k] = 0.0
    p, m, v = p0.to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    kernel.adam_step(cfg, p, g.to(device), m, v, 1, bf16_out=out)
    assert_tensor_equal(out.cpu(), p.cpu().to(torch.bfloat16), "fused bf16 copy of the updated master")


def test_R16_fused_device_adam_self_check_refuses_a_kernel_one_ulp_off(impl, area_api, reference_api, accelerator):
    """The run-time check that guards the kernel's use finds a kernel whose master is one ulp off in a single
    element (and passes the real one), so that a compiler that rounds differently on some device falls back to
    the torch sequence instead of changing results."""
    kernel = _kernel(impl, area_api)
    if not hasattr(kernel, "self_check"):
        pytest.skip("this implementation's fused device Adam has no run-time check (self_check)")
    device = accelerator.device()
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)

    def one_ulp_off(config, p, g, m, v, t, grad_scale=None, bf16_out=None):
        kernel.adam_step(config, p, g, m, v, t, grad_scale=grad_scale, bf16_out=bf16_out)
        p[p.numel() // 2] = torch.nextafter(p[p.numel() // 2], torch.tensor(float("inf"), device=p.device))

    assert kernel.self_check(device, cfg) is None, "the real kernel must pass its own check"
    reason = kernel.self_check(device, cfg, step_fn=one_ulp_off)
    assert reason is not None and "master" in reason, f"a kernel one ulp off was accepted: {reason!r}"


def test_R16_fused_device_adam_is_used_where_it_passes(impl, area_api, reference_api, accelerator, monkeypatch):
    """On a device (not the cpu, whose masters take the CPU kernel) the kernel is chosen for Adam/AdamW masters
    when it passes its check; ``HOSTOFFLOAD_DEVICE_ADAM=torch`` turns it off, and an unknown value is a
    ConfigurationError naming the variable and its values."""
    kernel = _kernel(impl, area_api)
    if not hasattr(kernel, "use_for"):
        pytest.skip("this implementation's fused device Adam declares no run-time choice (use_for)")
    device = accelerator.device()
    cfg = reference_api.OptimizerConfig(type="adamw")
    master = torch.zeros(8, device=device)
    monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", "torch")
    assert kernel.use_for(cfg, master) is False
    monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", "fastest")
    with pytest.raises(ConfigurationError, match=r"HOSTOFFLOAD_DEVICE_ADAM.*auto, fused, torch"):
        kernel.use_for(cfg, master)
    monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", "auto")
    assert kernel.use_for(reference_api.OptimizerConfig(type="sgd"), master) is False
    expected = device.type != "cpu" and kernel.self_check(device, cfg) is None
    assert kernel.use_for(cfg, master) is expected
    if device.type != "cpu":
        assert expected, f"the fused device Adam fails its check on {device}: {kernel.self_check(device, cfg)}"


def test_R16_fused_device_adam_prepare_decides_as_use_for(impl, area_api, reference_api, accelerator, monkeypatch):
    """An implementation may make the run-time choice ahead of training (``prepare(config, device)``: engines call
    it at construction so that the first step does not carry the check and the kernel's first launches). It must
    answer what ``use_for`` answers for a master on that device in each mode and optimizer, refuse an unknown
    ``HOSTOFFLOAD_DEVICE_ADAM`` as ``use_for`` does (on every device), and where it answers True the kernel has
    been checked on that device (``verdicts()`` names it)."""
    kernel = _kernel(impl, area_api)
    if not hasattr(kernel, "prepare"):
        pytest.skip("this implementation's fused device Adam declares no ahead-of-time choice (prepare)")
    device = accelerator.device()
    master = torch.zeros(8, device=device)
    configs = [reference_api.OptimizerConfig(type="adamw"), reference_api.OptimizerConfig(type="adam"),
               reference_api.OptimizerConfig(type="adam", weight_decay=0.01), reference_api.OptimizerConfig(type="sgd")]
    for mode in ("torch", "auto"):
        monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", mode)
        for cfg in configs:
            assert kernel.prepare(cfg, device) is kernel.use_for(cfg, master), f"{mode}, {cfg.type}"
    monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", "fastest")
    with pytest.raises(ConfigurationError, match=r"HOSTOFFLOAD_DEVICE_ADAM.*auto, fused, torch"):
        kernel.prepare(configs[0], device)
    monkeypatch.setenv("HOSTOFFLOAD_DEVICE_ADAM", "auto")
    if kernel.prepare(configs[0], device):
        assert any(k.startswith(f"{master.device}/adamw") for k in kernel.verdicts()), kernel.verdicts()


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda k, c, t: k.adam_step(c, t, t[:-1].clone(), t.clone(), t.clone(), 1), ["grad", "exactly"]),
        (lambda k, c, t: k.adam_step(c, t.double(), t, t, t, 1), ["param", "float32"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 0), ["step", ">= 1"]),
        (lambda k, c, t: k.adam_step(c.__class__(type="sgd"), t, t, t, t, 1), ["config.type", "adam, adamw"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, bf16_out=torch.empty_like(t)), ["bf16_out", "bfloat16"]),
        (lambda k, c, t: k.adam_step(c, t, t[::2], t, t, 1), ["grad", "contiguous"]),
    ],
    ids=["size", "dtype", "step", "optimizer", "bf16_out", "strided"],
)
def test_R16_fused_device_adam_rejects_bad_arguments(impl, area_api, reference_api, accelerator, call, words):
    """R16 (kernel inputs): wrong sizes, dtypes, layouts, step counts, optimizer types and output buffers raise
    ConfigurationError naming the argument and what is allowed; nothing is written."""
    kernel = _kernel(impl, area_api)
    cfg = reference_api.OptimizerConfig(type="adamw")
    t = torch.arange(16, dtype=torch.float32, device=accelerator.device())
    before = t.clone()
    with pytest.raises(ConfigurationError) as info:
        call(kernel, cfg, t)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert_tensor_equal(t, before, "the param after a refused call")
