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

A kernel whose required package is missing here is skipped with the reason the report lists at its top, with
the rules it leaves unjudged (conformance/optional_packages.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance import optional_packages
from conformance.accumulation_assertions import assert_tensor_equal, reference_optimizer_steps
from conformance.accumulation_strategies import optimizer_configs, optimizer_values
from reference.contract.errors import ConfigurationError
from reference.contract.optimizer_kernels import AdamKernel

pytestmark = pytest.mark.conformance_area("optimizer_kernels")
AREA = "optimizer_kernels"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One parameter per kernel any selected implementation declares (read from its area module at collection;
    an implementation that does not declare a kernel of that name is skipped for it in :func:`_kernel`)."""
    if "kernel_name" not in metafunc.fixturenames:
        return
    from conformance.plugin import selected_implementations

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


def _assert_claim(kernel: AdamKernel, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise for the reference's arithmetic, else within the kernel's declared tolerance."""
    if kernel.bitwise:
        assert_tensor_equal(actual, expected, what)
        return
    tol = kernel.arithmetic
    a, e = actual.detach().cpu(), expected.detach().cpu()
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} != {e.shape}/{e.dtype}"
    nan = torch.isnan(e)
    assert torch.equal(torch.isnan(a), nan), f"{what}: NaN where the reference has none, or the reverse"
    excess = ((a.double() - e.double()).abs() - (tol.atol + tol.rtol * e.double().abs()))[~nan]
    if excess.numel() and bool((excess > 0).any()):
        i = int(excess.argmax())
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {a.numel()} elements differ by more than the "
                             f"declared {tol.describe()}; worst exceeds it by {float(excess[i]):.3g}")


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
        _assert_claim(kernel, p, expected, f"{what}: master")
        _assert_claim(kernel, m, state.buffers["exp_avg"], f"{what}: exp_avg")
        _assert_claim(kernel, v, state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")


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
