"""Every declared Adam / AdamW kernel (area ``optimizer_kernels``) against R16: any kernel, anyone's.

An implementation declares its kernels in ``OPTIMIZER_KERNELS`` (reference/contract/optimizer_kernels.py: name,
arithmetic, optimizers, devices, variants, required packages, moment precisions). The suite takes each declared
kernel as a parameter of its own (``kernel=<name>``, so a report, an xfails file and a rerun can name it) and
judges it on every variant it names and every accelerator of the run whose device type it lists:

- A kernel that claims the reference's arithmetic is compared bitwise with R16's oracle
  (``reference.accumulation.optimizers.optimizer_step``): it performs the same roundings, so any difference is a
  bug. A kernel that declares a :class:`~reference.contract.optimizer_kernels.Tolerance` (another library's
  operation order) is compared within it, bounded by the contract's ceiling.
- The gradient is never modified; bad arguments are a ConfigurationError naming the argument, and nothing is
  written.
- R29: a kernel that declares ``"bfloat16"`` in ``state_precisions`` is given bf16 moments and judged, step by
  step from its own state, against R29's step (widen, R16, store rounded to nearest even): bitwise kernels to
  the bit pattern, tolerance kernels each stored moment the rounding of a value within the tolerance
  (conformance/areas/kernel_claims.py); special values (ties, overflow, subnormals, NaN/inf) included. A kernel that
  does not declare bf16 is not judged on R29: each R29 test skips for it, saying so.

A kernel whose required package is missing here is skipped with the reason the report lists at its top, with
the rules it leaves unjudged (conformance/harness/optional_packages.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import assert_tensor_equal, reference_optimizer_steps
from conformance.areas.accumulation_strategies import BF16_ROUNDING_CASES, optimizer_configs, optimizer_values
from conformance.areas.kernel_claims import assert_claim, assert_stored_moment_claim
from conformance.harness import optional_packages
from reference.contract.accumulation_state_precision import STATE_PRECISIONS
from reference.contract.errors import ConfigurationError
from reference.contract.optimizer_kernels import AdamKernel

pytestmark = pytest.mark.conformance_area("optimizer_kernels")
AREA = "optimizer_kernels"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One parameter per kernel any selected implementation declares (read from its area module at collection;
    an implementation that does not declare a kernel of that name is skipped for it in :func:`_kernel`)."""
    if "kernel_name" not in metafunc.fixturenames:
        return
    from conformance.harness.plugin import selected_implementations

    names: list[str] = []
    for impl in selected_implementations(metafunc.config):
        if impl.provides(AREA):
            try:
                declared = impl.load(AREA).OPTIMIZER_KERNELS
            except Exception:  # a broken module fails its interface test, not the collection
                continue
            names += [k.name for k in declared if isinstance(k, AdamKernel)]
    names = list(dict.fromkeys(names)) or ["none-declared"]
    metafunc.parametrize("kernel_name", names, ids=[f"kernel={n}" for n in names])


def _kernel(impl, area_api, accelerator, kernel_name: str) -> AdamKernel:
    declared = {k.name: k for k in area_api.OPTIMIZER_KERNELS}
    kernel = declared.get(kernel_name)
    if kernel is None:
        pytest.skip(f"{impl.name} declares no optimizer kernel '{kernel_name}' "
                    f"(it declares: {', '.join(declared) or 'none'})")
    if accelerator.device_type not in kernel.devices:
        pytest.skip(f"kernel {kernel.name} runs on {', '.join(kernel.devices)}, not {accelerator.device_type}")
    optional_packages.require(kernel.requires, f"needed by {impl.name}'s optimizer kernel {kernel.name}")
    return kernel


def _variants(kernel: AdamKernel) -> tuple[str | None, ...]:
    return kernel.variants or (None,)


@given(
    n=st.sampled_from((1, 7, 16, 17, 1023, 1025, 4099)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R16_declared_kernel_meets_the_reference_as_it_claims(
    impl, area_api, accelerator, kernel_name, n, steps, clip, seed, data
):
    """R16/R15: each declared optimizer (Adam, AdamW, with and without weight decay), the clipping coefficient
    applied inside the kernel, several steps (bias corrections), sizes around vector widths and blocks, every
    declared variant, on the accelerator's device: master and both fp32 moments equal the reference formula
    bitwise where the kernel claims the reference's arithmetic, else within its declared tolerance; the gradient
    is not modified."""
    import reference

    kernel = _kernel(impl, area_api, accelerator, kernel_name)
    if "float32" not in kernel.state_precisions:
        pytest.skip(f"kernel {kernel.name} keeps its moments in {', '.join(kernel.state_precisions)}, not R16's fp32")
    oracle = reference.IMPLEMENTATION.load("accumulation")
    cfg = data.draw(optimizer_configs(types=kernel.optimizers), label="config")
    device = accelerator.device()
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-6, 1))) for _ in range(steps)]
    expected, state = reference_optimizer_steps(oracle, cfg, p0, grads, clip)
    for variant in _variants(kernel):
        p, m, v = p0.to(device, copy=True), torch.zeros(n, device=device), torch.zeros(n, device=device)
        for t, g in enumerate(grads, start=1):
            g = g.to(device)
            g_before = g.clone()
            kernel.call(cfg, p, g, m, v, t, grad_scale=clip, variant=variant)
            assert_tensor_equal(g, g_before, f"{kernel.name} variant={variant}: gradient must stay unmodified")
        what = f"{kernel.describe()} variant={variant} {cfg} n={n} steps={steps} clip={clip} on {device}"
        assert_claim(kernel, p, expected, f"{what}: master")
        assert_claim(kernel, m, state.buffers["exp_avg"], f"{what}: exp_avg")
        assert_claim(kernel, v, state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")


# -- R29: bf16 moments -----------------------------------------------------------------------------------------
def _bf16_kernel(impl, area_api, accelerator, kernel_name: str) -> AdamKernel:
    """The kernel, if it declares bf16 moments; a kernel that does not is not judged on R29, and the skip says so
    (the report lists it under the kernel's cell)."""
    kernel = _kernel(impl, area_api, accelerator, kernel_name)
    if "bfloat16" not in kernel.state_precisions:
        pytest.skip(f"kernel {kernel.name} declares state_precisions {kernel.state_precisions}, not bfloat16: "
                    "R29 (bf16 moments) is not judged for it")
    return kernel


def _r29_reference_step(oracle, cfg, p, m, v, g, t: int, clip: float | None):
    """R29's step ``t`` from the state (``p``; bf16 moments ``m``, ``v``) the kernel was in before it: the master
    and stored moments of the reference's bf16 state, and the moments before rounding (R29 step 2: R16's fp32
    sequence from the widened moments), which a tolerance kernel's stored moments are judged against."""
    g = torch.mul(g, clip) if clip is not None else g
    out = {}
    for name, precision, widen in (("stored", STATE_PRECISIONS["bf16"], False), ("fp32", None, True)):
        master = p.detach().cpu().clone()
        state = oracle.init_state(cfg, master, precision)
        state.step = t - 1  # optimizer_step advances it to t
        for key, moment in (("exp_avg", m), ("exp_avg_sq", v)):
            state.buffers[key].copy_(moment.detach().cpu().float() if widen else moment.detach().cpu())
        oracle.optimizer_step(cfg, master, g, state)
        out[name] = (master, state.buffers["exp_avg"], state.buffers["exp_avg_sq"])
    return out


def _check_r29_step(kernel, oracle, cfg, p, m, v, g, t, clip, variant, what) -> None:
    """One kernel step on (``p``, ``m``, ``v``) in place, judged against R29's step from the same state."""
    expected = _r29_reference_step(oracle, cfg, p, m, v, g, t, clip)
    g = g.to(p.device)
    g_before = g.clone()
    kernel.call(cfg, p, g, m, v, t, grad_scale=clip, variant=variant)
    assert_tensor_equal(g, g_before, f"{what}: the gradient must stay unmodified")
    (e_p, e_m, e_v), (_, u_m, u_v) = expected["stored"], expected["fp32"]
    assert_claim(kernel, p, e_p, f"{what}: master")
    assert_stored_moment_claim(kernel, m, e_m, u_m, f"{what}: exp_avg (bf16)")
    assert_stored_moment_claim(kernel, v, e_v, u_v, f"{what}: exp_avg_sq (bf16)")


@given(
    n=st.sampled_from((1, 7, 16, 17, 1023, 1025, 4099)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R29_declared_kernel_bf16_moments_meet_the_reference_as_it_claims(
    impl, area_api, accelerator, kernel_name, n, steps, clip, seed, data
):
    """R29/R16/R15: a kernel that declares bf16 moments, given bf16 moment tensors, widens them, takes R16's step
    and stores them rounded to nearest even: each step, from the state the kernel is in, the master and both
    stored moments equal R29's step bitwise (bit patterns) where it claims the reference's arithmetic, else the
    master is within its tolerance and each stored moment is the rounding of a value within it; gradients from
    1e-20 to 1e3 (subnormal squares, moments far from 1), each declared optimizer, every variant, the clipping
    coefficient applied inside; the gradient is not modified."""
    import reference

    kernel = _bf16_kernel(impl, area_api, accelerator, kernel_name)
    oracle = reference.IMPLEMENTATION.load("accumulation")
    cfg = data.draw(optimizer_configs(types=kernel.optimizers), label="config")
    device = accelerator.device()
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-20, 3))) for _ in range(steps)]
    for variant in _variants(kernel):
        p = p0.to(device, copy=True)
        m, v = (torch.zeros(n, dtype=torch.bfloat16, device=device) for _ in range(2))
        for t, g in enumerate(grads, start=1):
            what = f"{kernel.describe()} variant={variant} {cfg} n={n} step {t} of {steps} clip={clip} on {device}"
            _check_r29_step(kernel, oracle, cfg, p, m, v, g, t, clip, variant, what)


@pytest.mark.parametrize("n", [len(BF16_ROUNDING_CASES), 16 * len(BF16_ROUNDING_CASES) + 5])
def test_R29_declared_kernel_rounds_special_values_as_the_contract(impl, area_api, accelerator, kernel_name, n):
    """R29: with betas (0, 0) a step stores ``m = g`` and ``v = g * g`` rounded, so the stored moments are the
    contract's rounding of chosen values on every lane: ties to even (down and up, in m and in v), values that
    round to infinity or stay the largest finite, fp32 and bf16 subnormals (no flush to zero), signed zeros,
    infinities and NaN gradients (NaN stored as 0x7FC0); then a step with betas (0.9, 0.999) and weight decay
    from those stored moments (NaN and infinite moments widened), and one more with the clipping coefficient.
    Each against R29's step from the kernel's own state, as the kernel claims (bitwise, or within its tolerance)."""
    import reference

    kernel = _bf16_kernel(impl, area_api, accelerator, kernel_name)
    oracle = reference.IMPLEMENTATION.load("accumulation")
    Config = oracle.OptimizerConfig
    special = torch.tensor(BF16_ROUNDING_CASES, dtype=torch.float32)
    g = special.repeat(n // len(BF16_ROUNDING_CASES) + 1)[:n].roll(n // 3)
    kinds = kernel.optimizers
    steps = ((Config(type=kinds[0], lr=1e-3, betas=(0.0, 0.0)), g, None),
             (Config(type=kinds[-1], lr=1e-2, weight_decay=0.1), g.flip(0), None),
             (Config(type=kinds[0], lr=1e-3), g.roll(5), 0.37))
    device = accelerator.device()
    for variant in _variants(kernel):
        p = torch.linspace(-2.0, 2.0, n).to(device)
        m, v = (torch.zeros(n, dtype=torch.bfloat16, device=device) for _ in range(2))
        for t, (cfg, grad, clip) in enumerate(steps, start=1):
            what = f"{kernel.describe()} variant={variant} special values n={n} step {t} ({cfg}) on {device}"
            _check_r29_step(kernel, oracle, cfg, p, m, v, grad, t, clip, variant, what)


_BAD_BF16_CALLS = {
    "mixed-bf16-fp32": (lambda t: (t.bfloat16(), t.clone()), ["exp_avg_sq"]),
    "mixed-fp32-bf16": (lambda t: (t.clone(), t.bfloat16()), ["exp_avg_sq"]),
    "float16": (lambda t: (t.half(), t.half()), ["exp_avg", "bfloat16"]),
}


@pytest.mark.parametrize("case", list(_BAD_BF16_CALLS))
def test_R29_declared_kernel_rejects_moments_of_two_or_no_state_precision(
    impl, area_api, accelerator, kernel_name, case
):
    """R29/R16 (kernel inputs): a kernel that declares bf16 moments refuses moments of two precisions (both are
    one state precision) or of a dtype that is no state precision (float16): ConfigurationError naming the
    argument (and, for a foreign dtype, the allowed ones), and the param and moments are left as they were."""
    import reference

    kernel = _bf16_kernel(impl, area_api, accelerator, kernel_name)
    cfg = reference.IMPLEMENTATION.load("accumulation").OptimizerConfig(type=kernel.optimizers[0])
    make, words = _BAD_BF16_CALLS[case]
    t = torch.arange(16, dtype=torch.float32, device=accelerator.device())
    m, v = make(t)
    before = [x.clone() for x in (t, m, v)]
    with pytest.raises(ConfigurationError) as info:
        kernel.call(cfg, t, t.clone(), m, v, 1)
    for word in words:
        assert word in str(info.value), f"{kernel.name}: {word!r} not in {info.value}"
    for x, b, name in zip((t, m, v), before, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        assert_tensor_equal(x, b, f"{kernel.name}: {name} after a refused call")



_BAD_CALLS = {
    "size": (lambda k, c, t: k.call(c, t, t[:-1].clone(), t.clone(), t.clone(), 1), ["grad"]),
    "dtype": (lambda k, c, t: k.call(c, t.double(), t, t.clone(), t.clone(), 1), ["param", "float32"]),
    "step": (lambda k, c, t: k.call(c, t, t.clone(), t.clone(), t.clone(), 0), ["step", ">= 1"]),
    "optimizer": (lambda k, c, t: k.call(c.__class__(type="sgd"), t, t.clone(), t.clone(), t.clone(), 1),
                  ["config.type"]),
    "strided": (lambda k, c, t: k.call(c, t, t.repeat(2)[::2], t.clone(), t.clone(), 1), ["grad", "contiguous"]),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_R16_declared_kernel_rejects_bad_arguments(impl, area_api, accelerator, kernel_name, case):
    """R16 (kernel inputs): a gradient of the wrong size or layout, a param that is not fp32, a step count that
    is not R16's 1-based t, an optimizer the kernel does not declare: ConfigurationError naming the argument,
    and the param is left as it was."""
    import reference

    kernel = _kernel(impl, area_api, accelerator, kernel_name)
    cfg = reference.IMPLEMENTATION.load("accumulation").OptimizerConfig(type=kernel.optimizers[0])
    call, words = _BAD_CALLS[case]
    t = torch.arange(16, dtype=torch.float32, device=accelerator.device())
    before = t.clone()
    with pytest.raises(ConfigurationError) as info:
        call(kernel, cfg, t)
    for word in words:
        assert word in str(info.value), f"{kernel.name}: {word!r} not in {info.value}"
    assert_tensor_equal(t, before, f"{kernel.name}: the param after a refused call")
