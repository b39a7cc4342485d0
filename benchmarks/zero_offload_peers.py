"""Issue 40's peers for ``bench_zero_offload.py``: torchao's ``CPUOffloadOptimizer`` and Megatron-Core's
``HybridDeviceOptimizer``, each driven from a plain training loop on the benchmark's model and data.

Neither is an engine: each is a ``torch.optim.Optimizer`` that keeps AdamW's state on the host, so the loop around
it is ours and is the same for both (forward, ``loss / gas``, ``backward`` per micro-batch; clip; ``step``;
``zero_grad``). Each arm is set up the way that peer is meant to be used, and where that differs from our engines'
arithmetic (bf16 weights on the GPU, fp32 master and AdamW state on the host, fp32 gradient accumulation, clip 1.0
on the global norm) the difference is said here and in the arm's builder:

======================  ============================  ==============================  =============================
arm                     GPU weights (compute)         fp32 master and AdamW state     gradients, clipping
======================  ============================  ==============================  =============================
``torchao-offload``     fp32 (bf16 autocast)          host: torchao's pinned copy of  fp32, accumulated on the GPU
                                                      each weight, torch's fused CPU  and copied out after every
                                                      AdamW per tensor                backward; clip 1.0 on the
                                                                                      host copies (below)
``megatron-offload``    bf16                          host: ``param_update_in_fp32``  bf16, accumulated on the GPU
                                                      copies, torch AdamW (fused) on  by autograd; clip 1.0 with
                                                      the host (``offload_fraction``  ``clip_grad_norm_`` on the
                                                      1.0: none on the GPU)           GPU before ``step``
======================  ============================  ==============================  =============================

torchao keeps the weights in the dtype it is given and its host copies are of that dtype, so fp32 weights with
bf16 autocast is its mixed-precision recipe (bf16 weights would train without an fp32 master). It copies each
gradient to the host from a hook at the end of its accumulation, i.e. during backward, so clipping the GPU
gradients afterwards would not reach the copies its optimizer reads: the global norm is taken on the GPU
(``torch.nn.utils.get_total_norm`` of the model's gradients), and only when it exceeds 1.0 are the copies the
optimizer reads (its public ``param_groups``) scaled with ``clip_grads_with_norm_``, after the device has finished
the copies. Megatron's optimizer copies the gradients at ``step``, so a ``clip_grad_norm_`` on the GPU before it
is the ordinary recipe; Megatron's own DDP would keep an fp32 gradient buffer, which a plain loop does not have.

The packages are imported inside the builders: on the GPU box their wheels are installed into ``/tmp/site`` at the
start of the call (``run_gpu.sh``), and an arm whose package is missing is reported as ``not installed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convergence import Trainer

if TYPE_CHECKING:
    import torch

#: arm -> the importable package it needs (``bench_zero_offload.py`` reports "not installed" without it)
PEER_PACKAGES = {"torchao-offload": "torchao", "megatron-offload": "megatron.core"}
#: The peers whose model keeps fp32 weights on the GPU (the others build it in bf16, as our engines do).
FP32_WEIGHT_PEERS = ("torchao-offload",)
CLIP_NORM = 1.0


def _accumulate(model, micro: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Forward and backward of each micro-batch of ``micro`` (``[gas, batch, seq]``), the loss scaled by 1/gas so
    the accumulated gradient is that of the mean loss; returns the mean loss, detached."""
    import contextlib

    import torch

    total = None
    for ids in micro:
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def _lr_setter(opt):
    def set_lr(lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr

    return set_lr


def build_torchao(model, lr: float, clip: float = CLIP_NORM) -> Trainer:
    """torchao 0.18's ``CPUOffloadOptimizer`` around torch's AdamW (torchao's default, fused on the host), fp32
    weights on the GPU and bf16 autocast; ``offload_gradients`` stays off (torchao: not compatible with gradient
    accumulation). Clip 1.0 as the module docstring says."""
    import torch
    from torchao.optim import CPUOffloadOptimizer

    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01)
    params = [p for p in model.parameters() if p.requires_grad]

    def clip_gradients() -> None:  # not ``clip``: that name is the threshold
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if float(norm) > clip:
            torch.cuda.synchronize()  # the gradient copies run on torchao's own stream
            read = [p for group in opt.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(read, clip, norm)

    def step(micro: torch.Tensor) -> torch.Tensor:
        total = _accumulate(model, micro, autocast=True)
        clip_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return Trainer(step=step, set_lr=_lr_setter(opt))


def build_megatron(model, lr: float, clip: float = CLIP_NORM) -> Trainer:
    """Megatron-Core 0.19.2's ``HybridDeviceOptimizer`` with ``offload_fraction`` 1.0 (every parameter's update on
    the host), torch's AdamW on both sides (fused; the GPU side is empty at 1.0), ``param_update_in_fp32`` (an
    fp32 master of the bf16 weights, on the host), pinned host gradients and parameters, and its D2H/H2D overlap
    on. bf16 weights on the GPU, bf16 gradients; clip 1.0 on the GPU before ``step``."""
    import torch
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    opt = HybridDeviceOptimizer(
        model.parameters(), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, pin_cpu_grads=True, pin_cpu_params=True,
        overlap_cpu_optimizer_d2h_h2d=True, lr=lr, weight_decay=0.01, fused=True,
    )

    def step(micro: torch.Tensor) -> torch.Tensor:
        total = _accumulate(model, micro, autocast=False)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return Trainer(step=step, set_lr=_lr_setter(opt))


def build_peer(arm: str, model, lr: float, clip: float = CLIP_NORM) -> Trainer:
    """The Trainer of peer ``arm`` (a key of :data:`PEER_PACKAGES`) around ``model``, already on the GPU, clipping
    the global gradient norm at ``clip``."""
    return {"torchao-offload": build_torchao, "megatron-offload": build_megatron}[arm](model, lr, clip)
