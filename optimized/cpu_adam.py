"""Native CPU Adam / AdamW on flat fp32 host buffers (issue 6; formula: docs/accumulation.md R16).

Why a native kernel: the offloaded optimizer step is memory-bound (it streams 16 bytes in and 12 bytes out per
fp32 parameter, plus 2 bytes of bf16 copy), and torch's single-tensor AdamW makes a dozen passes over memory.
``optimized._native.cpu_adam`` makes one pass, vectorised (AVX2 / AVX-512F chosen at run time), on several threads,
and can write the bf16 copy of the updated weights (the buffer the accelerator reads back) in that same pass.

Threads: the kernel runs on a persistent pool of worker threads (csrc/worker_pool.h), started on first use and
grown to the largest ``threads`` asked for, with the calling thread working too; elements are handed out in
blocks of whole cache lines claimed dynamically, so a slow vCPU does not hold the step back. Calls from several
Python threads are correct and run one after the other (each gets the whole pool); a forked child builds its own
pool. The GIL is released while the kernel runs. Since the formula is element-wise, the thread count never
changes a bit of the result.

R29 (``state_precision``): the moments may be bf16 tensors. The kernel then reads them as bf16, widens them in
registers, and stores them rounded to nearest even in the same pass -- 4 bytes per parameter of moments instead of
8 each way -- with the contract's rounding (:func:`reference.contract.accumulation_state_precision.round_to_bf16`,
NaN stored as 0x7FC0). The precision is the moments' dtype (both alike); ``state_precision=`` may name it too.

The arithmetic is R16's sequence with one fp32 rounding per operation and no FMA, so the result equals
:func:`reference.accumulation.optimizers.optimizer_step` bitwise, element for element, on every ISA variant
(checked by conformance/suite/test_accumulation_engine_cpu_adam.py). Hyper-parameter expressions are evaluated
here in fp64 exactly as the reference writes them and rounded to fp32 once inside the kernel.
"""

from __future__ import annotations

import math
import os

import torch

from reference.contract import envvars
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import StatePrecision, resolve_state_precision
from reference.contract.accumulation_step import check_adam_kernel_call
from reference.contract.errors import ConfigurationError

try:
    from optimized import _native

    _cpu_adam = _native.cpu_adam  # the kernels' submodule of the one extension module
except (ImportError, AttributeError) as exc:  # pragma: no cover - only on a broken build
    _cpu_adam = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

__all__ = ["adam_step", "available", "available_isas", "best_isa", "cast_to_bf16", "default_threads"]


def available() -> bool:
    """Whether the native extension was built and loads."""
    return _cpu_adam is not None


def _module():
    if _cpu_adam is None:
        raise ImportError(f"optimized._native.cpu_adam is not built ({_IMPORT_ERROR}); rebuild with pip install -e .")
    return _cpu_adam


def available_isas() -> list[str]:
    """ISA variants this CPU can run (``scalar`` always)."""
    return list(_module().available_isas())


def best_isa() -> str:
    return str(_module().best_isa())


def default_threads() -> int:
    """``$HOSTOFFLOAD_CPU_ADAM_THREADS`` if set, else the cores this process may run on."""
    n = envvars.cpu_adam_threads()
    if n is not None:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _check_flat(name: str, t: object, dtype: torch.dtype, numel: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigurationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ConfigurationError(
            f"{name} must be a contiguous CPU tensor of dtype {dtype}; got device={t.device}, dtype={t.dtype}, "
            f"contiguous={t.is_contiguous()}"
        )
    if numel is not None and t.numel() != numel:
        raise ConfigurationError(f"{name} has {t.numel()} elements; allowed: exactly {numel} (the param's size)")
    return t


def _check_isa_threads(isa: str | None, threads: int | None) -> tuple[str, int]:
    isa = best_isa() if isa is None else isa
    if isa not in available_isas():
        raise ConfigurationError(f"isa={isa!r} is not available on this CPU; allowed values: {available_isas()}")
    threads = default_threads() if threads is None else threads
    if type(threads) is not int or threads < 1:
        raise ConfigurationError(f"threads={threads!r} must be an int >= 1")
    return isa, threads


def adam_step(
    config: OptimizerConfig,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    grad_scale: float | None = None,
    bf16_out: torch.Tensor | None = None,
    isa: str | None = None,
    threads: int | None = None,
    state_precision: str | None = None,
    backup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One Adam/AdamW step (``config.type``) on flat CPU tensors, in place; ``step`` is the 1-based ``t``.

    ``param`` is fp32; ``grad`` fp32 or bf16 (a bf16 accumulation's sum, R11: widened exactly as it is read, so
    the step equals the one on ``grad.float()`` without writing that copy); ``exp_avg`` and ``exp_avg_sq`` fp32 or
    (R29) both bf16. ``state_precision``
    ("fp32" / "bf16"; None: the moments' dtype) must agree with the moments' dtype when given. ``grad_scale``: the
    clipping coefficient of R15 (the gradient is multiplied by it rounded to fp32 before use, as
    ``torch.mul(grad, coef)`` would; ``grad`` itself is not modified). ``bf16_out``: a bf16 tensor of the same
    size that receives the updated weights cast with round-to-nearest-even, in the same pass. ``backup``:
    ``(param, exp_avg, exp_avg_sq)`` tensors like those three (R30's speculative update), which receive their
    values as they were before this step, block by block in the same pass (the state is read once).
    """
    check_adam_kernel_call(config, step, "is not handled natively")
    n = _check_flat("param", param, torch.float32, None).numel()
    grad_dtype = grad.dtype if isinstance(grad, torch.Tensor) and grad.dtype == torch.bfloat16 else torch.float32
    _check_flat("grad", grad, grad_dtype, n)
    precision = _moment_precision(exp_avg, state_precision)
    _check_flat("exp_avg", exp_avg, precision.dtype, n)
    _check_flat("exp_avg_sq", exp_avg_sq, precision.dtype, n)
    out_ptr = 0
    if bf16_out is not None:
        out_ptr = _check_flat("bf16_out", bf16_out, torch.bfloat16, n).data_ptr()
    backup_ptrs: tuple[int, ...] = (0, 0, 0)
    if backup is not None:
        if not isinstance(backup, tuple) or len(backup) != 3:
            raise ConfigurationError("backup must be None or a tuple (param, exp_avg, exp_avg_sq) of tensors")
        backup_ptrs = tuple(
            _check_flat(f"backup[{i}] ({name})", t, dtype, n).data_ptr()
            for i, (name, t, dtype) in enumerate(zip(("param", "exp_avg", "exp_avg_sq"), backup,
                                                     (torch.float32, precision.dtype, precision.dtype), strict=True))
        )
        _check_disjoint(backup, (param, grad, exp_avg, exp_avg_sq))
    isa, threads = _check_isa_threads(isa, threads)
    beta1, beta2 = config.betas
    wd, lr = config.weight_decay, config.lr
    decoupled = config.type == "adamw"
    # The fp64 expressions of reference.accumulation.optimizers._adam, written the same way.
    decay = (1.0 - lr * wd) if decoupled else wd
    _module().adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out_ptr,
        n,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        1.0 / math.sqrt(1.0 - beta2**step),
        config.eps,
        lr / (1.0 - beta1**step),
        decay,
        1.0 if grad_scale is None else float(grad_scale),
        decoupled,
        wd > 0,
        grad_scale is not None,
        isa,
        threads,
        precision.name,
        *backup_ptrs,
        "bf16" if grad_dtype == torch.bfloat16 else "fp32",
    )


def _check_disjoint(backup: tuple[torch.Tensor, ...], state: tuple[torch.Tensor, ...]) -> None:
    """The backup is written while the state is read: no backup tensor may share a byte with a state tensor."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    for i, b in enumerate(backup):
        lo, hi = span(b)
        for t in (*state, *backup[:i]):
            t_lo, t_hi = span(t)
            if lo < t_hi and t_lo < hi:
                raise ConfigurationError(f"backup[{i}] overlaps another argument of adam_step; allowed: backup "
                                         f"tensors that share no memory with param, grad, the moments or each other")


def _moment_precision(exp_avg: object, state_precision: str | None) -> StatePrecision:
    """R29: the precision the moments are stored in -- ``state_precision`` when given, else ``exp_avg``'s dtype."""
    if state_precision is not None:
        return resolve_state_precision(state_precision)
    if not isinstance(exp_avg, torch.Tensor):
        raise ConfigurationError(f"exp_avg must be a torch.Tensor, got {type(exp_avg).__name__}")
    return StatePrecision.of(exp_avg, "exp_avg")


def cast_to_bf16(src: torch.Tensor, dst: torch.Tensor, *, isa: str | None = None, threads: int | None = None) -> None:
    """``dst.copy_(src)`` for a flat fp32 -> bf16 pair, vectorised and threaded (same rounding as torch)."""
    n = _check_flat("src", src, torch.float32, None).numel()
    _check_flat("dst", dst, torch.bfloat16, n)
    isa, threads = _check_isa_threads(isa, threads)
    _module().cast_to_bf16(src.data_ptr(), dst.data_ptr(), n, isa, threads)
