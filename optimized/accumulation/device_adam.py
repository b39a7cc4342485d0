"""Adam / AdamW on a device master in one pass (Triton), bitwise the torch-op sequence it replaces.

Why: :func:`torch_optimizer.torch_step` writes R16 as a sequence of elementwise torch ops plus an fp64 square root, so
every element's update moves about 230 bytes of device memory (16 passes, each reading and writing whole
vectors; on an H200 the split update's device side took 4.7e-11 s per element, docs/benchmarks.md run U), where
the update itself needs to read master, gradient and moments and write master and moments: 28 bytes, 30 with the
bf16 weights written in the same pass (22 with R29's bf16 moments, which the kernel widens and rounds itself).
The no-offload path (``DeviceUpdate``) and R28's device side both step their masters through this module when it
is in use.

**Bitwise.** The kernel (``_device_adam_kernel.adam_kernel``) performs R16's operations in torch_step's order,
each one IEEE fp32 operation with one rounding: it is compiled with FP contraction off (``enable_fp_fusion=False``:
no multiply-add becomes an FMA), its square root and division are the correctly rounded ones (``sqrt_rn``,
``div_rn``, which is what torch_step's fp64 root rounded to fp32 is), and its constants are the fp32 roundings of
the same double expressions torch_step passes as Python scalars (torch rounds a scalar to the tensor's fp32 where
it meets it). The bf16 copy is rounded to nearest even in integer arithmetic, as torch's cast.

**Trust, then verify on the device.** Arithmetic reasoning is not a proof for a compiler on a device this
library has not seen, so the first use on each device runs the kernel and torch_step side by side on a probe
(:func:`self_check`: values across magnitudes, zeros, subnormal gradients, clipping, both optimizers, several
steps) and compares bits. ``HOSTOFFLOAD_DEVICE_ADAM`` decides what happens: ``auto`` (default) uses the kernel
where Triton is installed and the check passes on that device, and otherwise torch_step (a failed check is logged
once, with the first differing element); ``fused`` requires the kernel (an error naming the variable where
Triton is missing or the check fails); ``torch`` never uses it.

On CPU tensors the same kernel runs in Triton's interpreter (numpy, fp32 operation by operation): far too slow
for training and never chosen for it (CPU masters take the native CPU Adam), but it lets the CPU suite hold the
kernel's operation sequence to the reference formula bitwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading

import torch

from optimized.accumulation.torch_optimizer import init_state, torch_step
from reference.contract import envvars
from reference.contract.accumulation_config import OptimizerConfig
from reference.contract.accumulation_state_precision import STATE_PRECISIONS, StatePrecision
from reference.contract.accumulation_step import ADAM_KERNEL_TYPES, check_adam_kernel_call
from reference.contract.errors import ConfigurationError

__all__ = ["BLOCK", "adam_step", "available", "check_engine_device", "prepare", "self_check", "use_for", "verdicts"]

#: Elements per Triton program.
BLOCK = 1024

_log = logging.getLogger("optimized.accumulation")
_lock = threading.Lock()
_kernels: dict[str, object] = {}
#: per (device, optimizer type, weight decay on, state precision): the self-check's verdict, None (passed) or why
#: it failed. The kernel's code differs by those (AdamW's decay, Adam's L2 term, R29's bf16 moments), so each
#: variant is checked where it is used.
_verdicts: dict[tuple[str, str, bool, str], str | None] = {}


def _after_fork_in_child() -> None:
    """A fork while another thread held the lock (building the kernel, recording a verdict) would leave it held
    forever in the child: the child starts with a new one. The verdicts stay true of the same devices."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def available() -> bool:
    """Whether Triton is importable here (the kernel can be built). Asked once: ``step_master`` asks at every
    device step, and a failed import searches ``sys.path`` each time."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel(interpret: bool):
    """The decorated kernel: compiled for a device, or Triton's interpreter for CPU tensors (built once)."""
    key = "interpret" if interpret else "jit"
    with _lock:
        if key not in _kernels:
            from optimized.accumulation._device_adam_kernel import adam_kernel

            if interpret:
                from triton.runtime.interpreter import InterpretedFunction

                _kernels[key] = InterpretedFunction(adam_kernel)
            else:
                import triton

                _kernels[key] = triton.jit(adam_kernel)
        return _kernels[key]


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest), as torch rounds a Python scalar where it meets an fp32 tensor."""
    return float(torch.tensor(x, dtype=torch.float32))


def _check_flat(name: str, t: object, dtype: torch.dtype, like: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConfigurationError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or not t.is_contiguous():
        raise ConfigurationError(
            f"{name} must be a contiguous tensor of dtype {dtype}; got dtype={t.dtype}, contiguous={t.is_contiguous()}"
        )
    if like is not None and t.device != like.device:
        raise ConfigurationError(f"{name} is on {t.device}; allowed: the param's device, {like.device}")
    if like is not None and t.numel() != like.numel():
        raise ConfigurationError(f"{name} has {t.numel()} elements; allowed: exactly {like.numel()} (the param's size)")
    return t


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
) -> None:
    """One Adam/AdamW step (``config.type``) on flat contiguous tensors of one device, in place, queued on that
    device's current stream; ``step`` is the 1-based ``t``. Master and gradient fp32; the moments fp32 or (R29)
    both bf16, read and stored (rounded to nearest even) in the same pass. ``grad_scale``: R15's clipping
    coefficient (the gradient is multiplied by it rounded to fp32; ``grad`` is not modified). ``bf16_out``: receives
    the updated weights cast to bf16 (round to nearest even) in the same pass. CPU tensors run in Triton's
    interpreter (for verification only)."""
    if not available():
        raise ConfigurationError("the fused device Adam needs Triton (pip install triton); it is not installed")
    check_adam_kernel_call(config, step, "has no fused device kernel")
    _check_flat("param", param, torch.float32, None)
    _check_flat("grad", grad, torch.float32, param)
    moments = StatePrecision.of(exp_avg, "exp_avg") if isinstance(exp_avg, torch.Tensor) else STATE_PRECISIONS["fp32"]
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_flat(name, t, moments.dtype, param)
    bf16_state = moments.dtype == torch.bfloat16
    if bf16_state:  # the kernel reads and writes their bits
        exp_avg, exp_avg_sq = exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16)
    out = param  # any pointer of the right device when there is no output (HAS_OUT=False never touches it)
    if bf16_out is not None:
        out = _check_flat("bf16_out", bf16_out, torch.bfloat16, param).view(torch.int16)
    n = param.numel()
    if n == 0:
        return
    beta1, beta2 = config.betas
    wd, lr = config.weight_decay, config.lr
    decoupled = config.type == "adamw"
    # torch_step's double expressions, each rounded to fp32 as torch rounds the scalar it is given.
    consts = [
        _f32(1.0 if grad_scale is None else float(grad_scale)), _f32(1.0 - lr * wd), _f32(wd),
        _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2),
        _f32(1.0 / math.sqrt(1.0 - beta2**step)), _f32(config.eps), _f32(lr / (1.0 - beta1**step)),
    ]
    flags = dict(HAS_CLIP=grad_scale is not None, DECOUPLED=decoupled and wd > 0, L2=not decoupled and wd > 0,
                 HAS_OUT=bf16_out is not None, BLOCK=BLOCK, BF16_STATE=bf16_state)
    grid = (-(-n // BLOCK),)
    if param.device.type == "cpu":
        _kernel(True)[grid](param, grad, exp_avg, exp_avg_sq, out, n, *consts, **flags)
        return
    # Triton launches on the current device: make it the tensors' one.
    with torch.cuda.device(param.device) if param.device.type == "cuda" else contextlib.nullcontext():
        _kernel(False)[grid](param, grad, exp_avg, exp_avg_sq, out, n, *consts, **flags, num_warps=4,
                             enable_fp_fusion=False)


def _probe(device: torch.device, n: int = 1 << 16) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The self-check's inputs: master values from 1e-30 to 1e3 and zeros; gradients across magnitudes with
    zeros and subnormals (a flush-to-zero build differs there); three steps' worth."""
    gen = torch.Generator().manual_seed(20261205)
    scales = 10.0 ** torch.randint(-30, 4, (n,), generator=gen).double()
    master = (torch.randn(n, generator=gen, dtype=torch.float64) * scales).float()
    master[::97] = 0.0
    grads = []
    for k in range(3):
        g_scales = 10.0 ** torch.randint(-40, 3, (n,), generator=gen).double()
        g = (torch.randn(n, generator=gen, dtype=torch.float64) * g_scales).float()
        g[k::89] = 0.0
        g[k + 1 :: 101] = 1e-41  # subnormal
        grads.append(g.to(device))
    return master.to(device), grads


def self_check(device: torch.device | str, config: OptimizerConfig, step_fn=None,
               precision: StatePrecision | None = None) -> str | None:
    """Run ``step_fn`` (default :func:`adam_step`) and torch_step side by side on the probe for three steps, with
    and without clipping, and compare master, moments and the bf16 copy bitwise. None: identical; else a
    one-line reason (the first differing element, or the exception). ``precision``: the moments' (R29; fp32)."""
    step_fn = adam_step if step_fn is None else step_fn
    device = torch.device(device)
    try:
        for clip in (None, 0.37):
            master, grads = _probe(device)
            mine, theirs = master.clone(), master.clone()
            s_mine, s_theirs = init_state(config, mine, precision), init_state(config, theirs, precision)
            out = torch.empty(master.numel(), dtype=torch.bfloat16, device=device)
            for t, g in enumerate(grads, start=1):
                torch_step(config, theirs, g, s_theirs, clip_coef=clip)
                step_fn(config, mine, g, s_mine.buffers["exp_avg"], s_mine.buffers["exp_avg_sq"], t,
                        grad_scale=clip, bf16_out=out)
                for what, a, b in (("master", mine, theirs), ("bf16 weights", out, theirs.to(torch.bfloat16)),
                                   *((k, s_mine.buffers[k], s_theirs.buffers[k]) for k in s_theirs.buffers)):
                    differs = (a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32)
                               != b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
                    if bool(differs.any()):
                        i = int(differs.nonzero()[0])
                        return (f"{what} differs at step {t} (clip={clip}), element {i}: "
                                f"{a[i].item()!r} against torch's {b[i].item()!r}")
    except Exception as e:  # any failure of the kernel means: do not use it here
        return f"{type(e).__name__}: {e}"
    return None


def use_for(config: OptimizerConfig, master: torch.Tensor, precision: StatePrecision | None = None) -> bool:
    """Whether a device master with moments in ``precision`` (R29; default fp32) steps through the kernel (the
    module docstring's rule), deciding once per device and precision."""
    return _decide(config, master.device, precision or STATE_PRECISIONS["fp32"])


def _device_key(device: torch.device) -> str:
    """``cuda`` and ``cuda:0`` are one device to the verdicts (a master's device always carries its index)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _decide(config: OptimizerConfig, device: torch.device, precision: StatePrecision) -> bool:
    mode = envvars.device_adam()
    if mode == "torch" or device.type == "cpu" or config.type not in ADAM_KERNEL_TYPES:
        return False
    if not available():
        if mode == "fused":
            raise ConfigurationError(
                f"{envvars.DEVICE_ADAM_ENV}=fused needs Triton, which is not installed; allowed values: "
                f"{', '.join(envvars.DEVICE_ADAM_MODES)} (auto falls back to torch ops)"
            )
        return False
    key = (_device_key(device), config.type, config.weight_decay > 0, precision.name)
    with _lock:
        known = key in _verdicts
    if not known:
        verdict = self_check(device, config, precision=precision)
        with _lock:
            _verdicts[key] = verdict
        if verdict is not None and mode == "auto":
            _log.warning("fused device Adam (%s, weight decay %s) disabled on %s (its results differ from torch's "
                         "ops: %s); using torch ops", config.type, config.weight_decay, key[0], verdict)
    verdict = _verdicts[key]
    if verdict is not None and mode == "fused":
        raise ConfigurationError(
            f"{envvars.DEVICE_ADAM_ENV}=fused: the fused device Adam fails its check on {key[0]} ({verdict}); "
            f"allowed values: {', '.join(envvars.DEVICE_ADAM_MODES)}"
        )
    return verdict is None


def check_engine_device(device: torch.device) -> None:
    """An engine on ``device``, built while ``HOSTOFFLOAD_DEVICE_ADAM`` is read: ``fused`` where the kernel can never
    step a master of this engine is a :class:`ConfigurationError` naming the variable, at construction.

    What "available" means for ``fused``: the kernel can be built (Triton installed) *and* the engine's device is
    one it is compiled for. On the cpu accelerator it only runs in Triton's interpreter (the CPU suite uses that to
    hold its operation sequence to the formula), which :func:`use_for` never chooses for training: a CPU engine's
    masters take the native CPU Adam or torch ops. Accepting ``fused`` there would silently train with another
    kernel than the one the user demanded. (Whether the kernel passes its check on an accelerator is decided by
    :func:`prepare` where a path steps a device master.)"""
    if envvars.device_adam() != "fused":
        return
    allowed = f"allowed values: {', '.join(envvars.DEVICE_ADAM_MODES)} (auto uses the kernel where it applies)"
    if not available():
        raise ConfigurationError(f"{envvars.DEVICE_ADAM_ENV}=fused needs Triton, which is not installed; {allowed}")
    if torch.device(device).type == "cpu":
        raise ConfigurationError(
            f"{envvars.DEVICE_ADAM_ENV}=fused: the fused device Adam steps masters on an accelerator, and this "
            f"engine runs on {device} (its masters take the native CPU Adam or torch ops; on the cpu the kernel "
            f"runs only in Triton's interpreter, for verification); {allowed}"
        )


def prepare(config: OptimizerConfig, device: torch.device | str, precision: StatePrecision | None = None) -> bool:
    """Make :func:`use_for`'s decision for masters on ``device`` now and launch each variant of the kernel once,
    so that training does not pay for them; returns that decision.

    Why: the first use in a process runs the self-check and Triton builds (or loads from its cache) one program
    per specialization -- with or without clipping, with or without the bf16 copy, a size that is a multiple of
    16 or not. Where the first use falls inside training it stalls one step by about a second (H200, run Z1: the
    split's cut boundary took 1967 ms against a 218 ms median, 822 ms before the kernel existed). Engines call this
    at construction, beside their other start-up costs; an unusable ``HOSTOFFLOAD_DEVICE_ADAM=fused`` then fails
    there too, before any buffer is pinned."""
    device = torch.device(device)
    precision = precision or STATE_PRECISIONS["fp32"]
    if not _decide(config, device, precision):
        return False
    for n in (32, 33):  # Triton specializes an int argument on divisibility by 16
        master = torch.zeros(n, dtype=torch.float32, device=device)
        grad = torch.zeros_like(master)
        exp_avg, exp_avg_sq = (torch.zeros_like(master, dtype=precision.dtype) for _ in range(2))
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        for clip in (None, 1.0):
            for bf16_out in (None, out):
                adam_step(config, master, grad, exp_avg, exp_avg_sq, 1, grad_scale=clip, bf16_out=bf16_out)
    return True


def verdicts() -> dict[str, str]:
    """What the self-checks of this process found, for reports: ``"cuda:0/adamw/decay"`` -> ``"passed"`` or why
    the kernel is not used there."""
    with _lock:
        return {f"{d}/{t}/{'decay' if w else 'no decay'}{'' if p == 'fp32' else '/' + p + ' state'}": v or "passed"
                for (d, t, w, p), v in _verdicts.items()}
