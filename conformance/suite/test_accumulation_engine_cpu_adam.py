"""The native CPU Adam / AdamW kernel against the R16 formula, bitwise, on every ISA variant this CPU has.

The bound is zero ulps: the kernel performs R16's operations one IEEE fp32 rounding at a time, with no fused
multiply-add (its build uses -ffp-contract=off) and the hardware's correctly rounded sqrt and division, which is
exactly what the reference's torch sequence computes. So equality is asserted with ``torch.equal`` semantics,
element by element, against :func:`reference.accumulation.optimizers.optimizer_step` (itself checked against
scalar numpy float32 arithmetic in test_accumulation_optimizers.py).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import assert_bits_equal, assert_tensor_equal, reference_optimizer_steps
from conformance.areas.accumulation_strategies import BF16_ROUNDING_CASES, optimizer_configs, optimizer_values
from reference.contract.accumulation_state_precision import STATE_PRECISIONS
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")


def _kernel(area_api):
    kernel = getattr(area_api, "native_cpu_adam", None)
    if kernel is None or not kernel.available():
        pytest.skip("this implementation has no native CPU Adam kernel")
    return kernel


@given(
    cfg=optimizer_configs(types=("adam", "adamw")),
    n=st.sampled_from((1, 7, 8, 15, 16, 17, 63, 1000, 4099)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R16_native_adam_equals_reference_formula_bitwise(area_api, reference_api, cfg, n, steps, clip, seed, data):
    """R16/R15: Adam and AdamW (with and without weight decay), the clipping coefficient applied inside the
    kernel, several steps (bias corrections), odd sizes (vector tails), every available ISA and 1 or 3
    threads: master and both moments equal the reference formula bitwise; the gradient is not modified."""
    kernel = _kernel(area_api)
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-6, 1))) for _ in range(steps)]
    expected, state = reference_optimizer_steps(reference_api, cfg, p0, grads, clip)
    for isa in kernel.available_isas():
        for threads in (1, 3):
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            for t, g in enumerate(grads, start=1):
                g_before = g.clone()
                kernel.adam_step(cfg, p, g, m, v, t, grad_scale=clip, isa=isa, threads=threads)
                assert_tensor_equal(g, g_before, f"{isa}: gradient must stay unmodified")
            what = f"{cfg.type} isa={isa} threads={threads} n={n} steps={steps} clip={clip}"
            assert_tensor_equal(p, expected, f"{what}: master")
            assert_tensor_equal(m, state.buffers["exp_avg"], f"{what}: exp_avg")
            assert_tensor_equal(v, state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")


@given(
    cfg=optimizer_configs(types=("adam", "adamw")),
    n=st.sampled_from((1, 7, 8, 15, 16, 17, 63, 1000, 4099)),
    steps=st.integers(1, 3),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_R29_native_adam_bf16_moments_equal_reference_bitwise(area_api, reference_api, cfg, n, steps, clip, seed,
                                                               data):
    """R29/R16: with bf16 moments the kernel reads, widens, steps and stores them rounded in one pass: master and
    both stored moments (bit patterns) equal the reference's for every ISA, 1 or 3 threads, odd sizes, several
    steps, with and without clipping; the gradient is not modified."""
    kernel = _kernel(area_api)
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    grads = [optimizer_values(n, gen, 10.0 ** data.draw(st.integers(-20, 3))) for _ in range(steps)]
    expected, state = reference_optimizer_steps(reference_api, cfg, p0, grads, clip, STATE_PRECISIONS["bf16"])
    for isa in kernel.available_isas():
        for threads in (1, 3):
            p = p0.clone()
            m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
            for t, g in enumerate(grads, start=1):
                g_before = g.clone()
                kernel.adam_step(cfg, p, g, m, v, t, grad_scale=clip, isa=isa, threads=threads)
                assert_tensor_equal(g, g_before, f"{isa}: gradient must stay unmodified")
            what = f"bf16 moments {cfg.type} isa={isa} threads={threads} n={n} steps={steps} clip={clip}"
            assert_tensor_equal(p, expected, f"{what}: master")
            assert_bits_equal(m, state.buffers["exp_avg"], f"{what}: exp_avg")
            assert_bits_equal(v, state.buffers["exp_avg_sq"], f"{what}: exp_avg_sq")


@given(
    cfg=optimizer_configs(types=("adam", "adamw")),
    n=st.sampled_from((1, 7, 8, 15, 16, 17, 63, 1000, 4099)),
    moments=st.sampled_from(sorted(STATE_PRECISIONS)),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
)
def test_R11_native_adam_reads_a_bf16_gradient_as_its_exact_widening(area_api, reference_api, cfg, n, moments,
                                                                     clip, seed):
    """R11/R16: a bf16 accumulation hands the kernel a bf16 gradient; the kernel widens it as it reads it (exact),
    so every ISA and thread count gives bitwise the step on ``grad.float()`` -- special values (NaN, infinities,
    subnormals, signed zeros) included -- and the gradient is not modified."""
    kernel = _kernel(area_api)
    gen = torch.Generator().manual_seed(seed)
    p0 = optimizer_values(n, gen, 1.0)
    special = torch.tensor(BF16_ROUNDING_CASES, dtype=torch.float32)
    g = (optimizer_values(n, gen, 1.0) + special.repeat(n // len(special) + 1)[:n].roll(seed % n)).bfloat16()
    dtype = STATE_PRECISIONS[moments].dtype
    expected = [p0.clone(), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)]
    kernel.adam_step(cfg, expected[0], g.float(), expected[1], expected[2], 1, grad_scale=clip, threads=1)
    for isa in kernel.available_isas():
        for threads in (1, 3):
            got = [p0.clone(), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)]
            g_before = g.clone()
            kernel.adam_step(cfg, got[0], g, got[1], got[2], 1, grad_scale=clip, isa=isa, threads=threads)
            what = f"bf16 gradient, {moments} moments, isa={isa} threads={threads} n={n} clip={clip}"
            assert_bits_equal(g, g_before, f"{what}: gradient must stay unmodified")
            for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), got, expected, strict=True):
                assert_bits_equal(a, b, f"{what}: {name}")


@pytest.mark.parametrize("n", [len(BF16_ROUNDING_CASES), 16 * len(BF16_ROUNDING_CASES) + 5])
def test_R29_native_adam_bf16_rounding_of_special_values(area_api, reference_api, n):
    """R29: with betas (0, 0) a step stores ``m = g`` and ``v = g*g`` exactly before rounding, so the kernel's
    stored moments are the contract's rounding of chosen values -- ties, overflow to infinity, subnormals, signed
    zeros, infinities, NaN (stored as 0x7FC0) -- on every lane of every ISA; a second step from those stored
    moments (with betas (0.9, 0.999)) equals the reference too."""
    kernel = _kernel(area_api)
    special = torch.tensor(BF16_ROUNDING_CASES, dtype=torch.float32)
    g = special.repeat(n // len(BF16_ROUNDING_CASES) + 1)[:n].roll(n // 3)
    p0 = torch.linspace(-2.0, 2.0, n)
    configs = (reference_api.OptimizerConfig(type="adam", lr=1e-3, betas=(0.0, 0.0)),
               reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1))
    expected = p0.clone()
    state = reference_api.init_state(configs[0], expected, STATE_PRECISIONS["bf16"])
    for t, cfg in enumerate(configs, start=1):
        reference_api.optimizer_step(cfg, expected, g.flip(0) if t == 2 else g, state)
    for isa in kernel.available_isas():
        p = p0.clone()
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        for t, cfg in enumerate(configs, start=1):
            kernel.adam_step(cfg, p, g.flip(0) if t == 2 else g, m, v, t, isa=isa, threads=2)
        assert_tensor_equal(p, expected, f"isa={isa}: master")
        assert_bits_equal(m, state.buffers["exp_avg"], f"isa={isa}: exp_avg")
        assert_bits_equal(v, state.buffers["exp_avg_sq"], f"isa={isa}: exp_avg_sq")


@given(
    cfg=optimizer_configs(),
    n=st.sampled_from((1, 5, 64, 1001)),
    chunk=st.sampled_from((1, 7, 1 << 24)),
    clip=st.sampled_from((None, 0.37)),
    seed=st.integers(0, 2**16),
    precision=st.sampled_from(("fp32", "bf16")),
)
def test_R16_chunked_in_place_torch_step_equals_reference(area_api, reference_api, cfg, n, chunk, clip, seed,
                                                          precision):
    """R16/R15/R29: the engine's torch path (device masters, SGD), in place and chunked to bound its temporaries,
    equals the reference's out-of-place sequence bitwise for SGD (momentum, L2), Adam and AdamW over three
    steps, whatever the chunk size, with Adam's moments stored in fp32 or bf16 (bit patterns, a NaN gradient
    element included); the gradient is not modified."""
    step = getattr(area_api, "torch_step", None)
    if step is None:
        pytest.skip("this implementation has no chunked torch optimizer path")
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randn(n, generator=gen)
    actual = expected.clone()
    stored = STATE_PRECISIONS[precision]
    ref_state, state = reference_api.init_state(cfg, expected, stored), reference_api.init_state(cfg, actual, stored)
    for t in range(3):
        g = torch.randn(n, generator=gen) * 10.0**-t
        if precision == "bf16" and t == 1:
            g[n // 2] = float("nan")
        g_before = g.clone()
        reference_api.optimizer_step(cfg, expected, torch.mul(g, clip) if clip is not None else g, ref_state)
        step(cfg, actual, g, state, clip_coef=clip, chunk=chunk)
        assert_tensor_equal(g, g_before, "gradient after torch_step")
    assert_tensor_equal(actual, expected, f"{cfg.type} master (chunk={chunk}, clip={clip})")
    for name, buf in ref_state.buffers.items():
        assert_bits_equal(state.buffers[name], buf, f"{cfg.type} {name} ({precision} moments)")


@pytest.mark.parametrize("n", [1, 9, 100_003])
def test_R13_fused_bf16_copy_equals_cast_of_updated_master(area_api, reference_api, n):
    """R13 step 5: the bf16 weights the kernel writes in the same pass equal ``master.to(torch.bfloat16)`` of
    the updated master, for every ISA, including ties, infinities and NaN (a NaN stays a NaN)."""
    kernel = _kernel(area_api)
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen) * 1e3
    special = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, float("inf"), -float("inf"), float("nan"), 3e38, 1e-40])
    p0[: min(n, special.numel())] = special[: min(n, special.numel())]
    g = torch.randn(n, generator=gen)
    for isa in kernel.available_isas():
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        kernel.adam_step(cfg, p, g, m, v, 1, bf16_out=out, isa=isa, threads=2)
        assert_tensor_equal(out, p.to(torch.bfloat16), f"isa={isa}: fused bf16 copy")
        cast = torch.empty(n, dtype=torch.bfloat16)
        kernel.cast_to_bf16(p, cast, isa=isa)
        assert_tensor_equal(cast, p.to(torch.bfloat16), f"isa={isa}: cast_to_bf16")


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda k, c, t: k.adam_step(c, t, t[:-1].clone(), t.clone(), t.clone(), 1), ["grad", "exactly"]),
        (lambda k, c, t: k.adam_step(c, t.double(), t, t, t, 1), ["param", "float32"]),
        # a gradient is fp32 or bf16 (R11): a half or double one is refused, never read as fp32 bytes
        (lambda k, c, t: k.adam_step(c, t.clone(), t.half(), t.clone(), t.clone(), 1), ["grad", "float32"]),
        (lambda k, c, t: k.adam_step(c, t.clone(), t.double(), t.clone(), t.clone(), 1), ["grad", "float32"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 0), ["step", ">= 1"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, isa="avx1024"), ["isa", "allowed values"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, threads=0), ["threads", ">= 1"]),
        (
            lambda k, c, t: k.adam_step(c.__class__(type="sgd"), t, t, t, t, 1),
            ["config.type", "adam, adamw"],
        ),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, bf16_out=torch.empty(8)), ["bf16_out", "bfloat16"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t.bfloat16(), 1), ["exp_avg_sq", "float32"]),
        (lambda k, c, t: k.adam_step(c, t, t, t.bfloat16(), t, 1), ["exp_avg_sq", "bfloat16"]),
        (lambda k, c, t: k.adam_step(c, t, t, t.half(), t.half(), 1), ["float16", "allowed"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, state_precision="bf16"), ["exp_avg", "bfloat16"]),
        (lambda k, c, t: k.adam_step(c, t, t, t, t, 1, state_precision="int8"), ["state_precision", "allowed"]),
    ],
    ids=["size", "dtype", "grad-fp16", "grad-fp64", "step", "isa", "threads", "optimizer", "bf16_out", "mixed-fp32",
         "mixed-bf16", "fp16-moments", "precision-vs-dtype", "precision-name"],
)
def test_R16_native_adam_rejects_bad_arguments(area_api, reference_api, call, words):
    """R16/R29 (kernel inputs): wrong sizes, dtypes, step counts, ISA names, thread counts, optimizer types,
    output buffers, moments of two precisions or of one that is not a state precision, and a ``state_precision``
    that is unknown or disagrees with the moments raise ConfigurationError naming the argument and what is
    allowed; nothing is written."""
    kernel = _kernel(area_api)
    cfg = reference_api.OptimizerConfig(type="adam")
    t = torch.ones(8)
    with pytest.raises(ConfigurationError) as info:
        call(kernel, cfg, t)
    for w in words:
        assert w in str(info.value), f"{info.value!s} does not mention {w!r}"
    assert_tensor_equal(t, torch.ones(8), "input after a rejected call")


# ---- R30's backup: the state before the step, written by the kernel in its one pass ------------------------------


def _kernel_with_backup(area_api):
    """The kernel, if its ``adam_step`` declares R30's ``backup`` argument (an optional part of the kernel's API:
    an implementation's speculative update may back its state up itself)."""
    kernel = _kernel(area_api)
    if "backup" not in inspect.signature(kernel.adam_step).parameters:
        pytest.skip("this implementation's native adam_step declares no backup argument")
    return kernel


@pytest.mark.parametrize("precision", sorted(STATE_PRECISIONS))
@pytest.mark.parametrize("n", [1, 9, 100_003])
def test_R30_native_adam_backup_holds_the_state_before_the_step(area_api, reference_api, precision, n):
    """R30 (the speculative update's backup): with ``backup=(param, exp_avg, exp_avg_sq)`` the kernel leaves there,
    bit for bit, the master and the stored moments as they were before the step -- every element, for every ISA and
    thread count over several blocks with an odd tail -- and the step itself is bitwise the step without a backup
    (master, moments and the fused bf16 copy). A restore from the backup and a redo therefore repeats the step
    exactly, which is what R30's redo of a boundary that clips relies on."""
    kernel = _kernel_with_backup(area_api)
    dtype = STATE_PRECISIONS[precision].dtype
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(n)
    p0 = optimizer_values(n, gen, 1.0)
    m0, v0 = optimizer_values(n, gen, 0.1).to(dtype), optimizer_values(n, gen, 0.01).abs().to(dtype)
    g = optimizer_values(n, gen, 1.0)
    for isa in kernel.available_isas():
        for threads in (1, 3):
            what = f"{precision} moments isa={isa} threads={threads} n={n}"
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            out = torch.empty(n, dtype=torch.bfloat16)
            kernel.adam_step(cfg, p, g, m, v, 2, bf16_out=out, isa=isa, threads=threads)
            bp, bm, bv = torch.full_like(p0, 7.0), torch.full_like(m0, 7.0), torch.full_like(v0, 7.0)
            p2, m2, v2 = p0.clone(), m0.clone(), v0.clone()
            out2 = torch.empty(n, dtype=torch.bfloat16)
            kernel.adam_step(cfg, p2, g, m2, v2, 2, bf16_out=out2, isa=isa, threads=threads, backup=(bp, bm, bv))
            assert_bits_equal(bp, p0, f"{what}: backup of the master")
            assert_bits_equal(bm, m0, f"{what}: backup of exp_avg")
            assert_bits_equal(bv, v0, f"{what}: backup of exp_avg_sq")
            for name, a, e in zip(_NAMES, (p2, m2, v2, out2), (p, m, v, out), strict=True):
                assert_bits_equal(a, e, f"{what}: {name} with a backup against without")


@pytest.mark.parametrize(
    ("make_backup", "words"),
    [
        (lambda t, m, v: [t.clone(), m.clone(), v.clone()], ["backup", "tuple"]),
        (lambda t, m, v: (t.clone(), m.clone()), ["backup", "tuple"]),
        (lambda t, m, v: (t.clone(), m.clone(), v.clone()[:-1]), ["backup[2]", "exactly"]),
        (lambda t, m, v: (t.clone(), m.double(), v.clone()), ["backup[1]", "float32"]),
        (lambda t, m, v: (t.clone(), m, v.clone()), ["backup[1]", "overlaps"]),
        (lambda t, m, v: (t[:], m.clone(), v.clone()), ["backup[0]", "overlaps"]),
        (lambda t, m, v: (lambda b: (b, m.clone(), b))(t.clone()), ["backup[2]", "overlaps"]),
    ],
    ids=["list", "two", "size", "dtype", "is-exp-avg", "view-of-param", "shared"],
)
def test_R30_native_adam_rejects_a_bad_backup(area_api, reference_api, make_backup, words):
    """R30 (kernel inputs): a backup that is not a 3-tuple, of the wrong size or dtype, or sharing memory with the
    state it backs up (the kernel writes it while reading the state) or with another backup tensor raises
    ConfigurationError naming the backup tensor and what is allowed; nothing is written."""
    kernel = _kernel_with_backup(area_api)
    cfg = reference_api.OptimizerConfig(type="adam")
    p, g, m, v = torch.ones(8), torch.full((8,), 0.5), torch.full((8,), 0.25), torch.full((8,), 0.125)
    backup = make_backup(p, m, v)
    before = [t.clone() for t in (p, g, m, v, *backup)]
    with pytest.raises(ConfigurationError) as info:
        kernel.adam_step(cfg, p, g, m, v, 1, backup=backup)
    for w in words:
        assert w in str(info.value), f"{info.value!s} does not mention {w!r}"
    for after, was in zip((p, g, m, v, *backup), before, strict=True):
        assert_tensor_equal(after, was, "an argument after a rejected call")


# ---- the kernel's threading: any thread count, concurrent callers, fork, exit ------------------------------------
# The formula is element-wise, so how the elements are split between threads cannot change a single bit: every
# multi-threaded result below is compared bitwise with a run on the calling thread alone (threads=1).

_POOL_N = 200_003  # several blocks for any thread count (and an odd tail), small enough for a CI host
_NAMES = ("master", "exp_avg", "exp_avg_sq", "bf16 copy")


def _step_inputs(seed: int, n: int = _POOL_N) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return optimizer_values(n, gen, 1.0), [optimizer_values(n, gen, 10.0**-k) for k in range(3)]


def _run_steps(kernel, cfg, p0, grads, threads: int, with_bf16: bool = False) -> list[torch.Tensor]:
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    out = torch.empty(p0.numel(), dtype=torch.bfloat16) if with_bf16 else None
    for t, g in enumerate(grads, start=1):
        kernel.adam_step(cfg, p, g, m, v, t, grad_scale=0.5 if t == 2 else None, bf16_out=out, threads=threads)
    return [p, m, v] + ([out] if with_bf16 else [])


@pytest.mark.parametrize("threads", [2, 3, 8, 33])
def test_R16_native_adam_any_thread_count_equals_one_thread_bitwise(area_api, reference_api, threads):
    """R16: more threads than this host has cores (8, 33), or fewer, over several blocks with an odd tail: master,
    moments and the fused bf16 copy equal the single-threaded run bitwise, for Adam and AdamW; cast_to_bf16 too."""
    kernel = _kernel(area_api)
    p0, grads = _step_inputs(threads)
    for cfg in (
        reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1),
        reference_api.OptimizerConfig(type="adam", lr=1e-3, weight_decay=0.01),
    ):
        expected = _run_steps(kernel, cfg, p0, grads, threads=1, with_bf16=True)
        actual = _run_steps(kernel, cfg, p0, grads, threads=threads, with_bf16=True)
        for name, a, e in zip(_NAMES, actual, expected, strict=True):
            assert_tensor_equal(a, e, f"{cfg.type} threads={threads}: {name}")
    one, many = torch.empty(p0.numel(), dtype=torch.bfloat16), torch.empty(p0.numel(), dtype=torch.bfloat16)
    kernel.cast_to_bf16(p0, one, threads=1)
    kernel.cast_to_bf16(p0, many, threads=threads)
    assert_tensor_equal(many, one, f"cast_to_bf16 threads={threads}")


def test_R16_native_adam_concurrent_callers_equal_one_thread_bitwise(area_api, reference_api):
    """R16: four Python threads stepping their own tensors at the same time, each asking for 3 kernel threads,
    get exactly the single-threaded results: concurrent calls neither mix blocks of different steps nor lose any."""
    import threading

    kernel = _kernel(area_api)
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1)
    inputs = [_step_inputs(100 + i) for i in range(4)]
    expected = [_run_steps(kernel, cfg, p0, grads, threads=1, with_bf16=True) for p0, grads in inputs]
    errors: list = []
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            start.wait()
            for rep in range(20):  # many overlapping calls whatever the scheduling; every result is checked
                actual = _run_steps(kernel, cfg, *inputs[i], threads=3, with_bf16=True)
                for name, a, e in zip(_NAMES, actual, expected[i], strict=True):
                    assert_tensor_equal(a, e, f"caller {i} repetition {rep}: {name}")
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


_HANG_GUARD_S = 300  # not a timing assertion: only bounds how long a hung child can stall the suite


def test_R16_native_adam_works_in_a_forked_child(area_api, reference_api):
    """R16: after the parent has used its worker threads, a forked child (which has none of them) still completes a
    multi-threaded step, bitwise equal to the parent's single-threaded one, instead of waiting on dead threads."""
    import os
    import time
    import warnings

    kernel = _kernel(area_api)
    cfg = reference_api.OptimizerConfig(type="adamw", lr=1e-2, weight_decay=0.1)
    p0, grads = _step_inputs(7)
    expected = _run_steps(kernel, cfg, p0, grads[:1], threads=1)
    _run_steps(kernel, cfg, p0, grads[:1], threads=3)  # the parent's workers now exist
    shared = [p0.clone().share_memory_(), torch.zeros_like(p0).share_memory_(), torch.zeros_like(p0).share_memory_()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: exactly what is being tested
        pid = os.fork()
    if pid == 0:  # the child: only the kernel, then leave without running the parent's pytest machinery
        code = 1
        try:
            kernel.adam_step(cfg, *shared[:1], grads[0], *shared[1:], 1, threads=3)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + _HANG_GUARD_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in adam_step (waiting on the parent's worker threads?)")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child exit status {status}"
    for name, a, e in zip(("master", "exp_avg", "exp_avg_sq"), shared, expected, strict=True):
        assert_tensor_equal(a, e, f"forked child: {name}")


def test_R16_native_adam_process_exits_while_steps_run(area_api, reference_api):
    """R16: a process whose daemon thread is in the middle of multi-threaded steps when the interpreter exits
    terminates normally (exit status 0): the worker threads never block interpreter or process shutdown."""
    import subprocess
    import sys

    kernel = _kernel(area_api)
    script = f"""
import threading, torch
import {kernel.__name__} as kernel
from {type(reference_api.OptimizerConfig()).__module__} import OptimizerConfig
cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
n = 1 << 20
def loop():
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    t = 0
    while True:
        t += 1
        kernel.adam_step(cfg, p, g, m, v, t, threads=4)
        started.set()
started = threading.Event()
threading.Thread(target=loop, daemon=True).start()
started.wait()
p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
for t in range(1, 4):
    kernel.adam_step(cfg, p, g, m, v, t, threads=3)
print("exiting")
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=_HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter hung at exit while kernel threads were running")
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-2000:]
