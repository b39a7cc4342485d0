"""Adam on a device master: our fused kernel, the torch-op sequence it replaces, and torch's own fused AdamW.

Why: the no-offload update and the split update's device side (R28) step fp32 masters on the GPU. The torch-op
sequence (``optimizers.torch_step``, R16 one rounding at a time) makes ~16 passes over vectors per element; the
fused kernel (``device_adam``, Triton) makes one, with the same bits. A user's alternative is
``torch.optim.AdamW(fused=True)``, whose arithmetic differs (it is not R16's sequence), so it is timed beside them as
the speed a user could have, not as a replacement. Per size and arm: median milliseconds over ``--iters`` (CUDA
events on a GPU, wall clock on the CPU), nanoseconds and bytes-per-second per element counting the update's own
traffic (read master, gradient, both moments; write master, both moments; our kernels also write the bf16 weights:
30 bytes, torch's fused AdamW 28), and whether our fused kernel's master, moments and bf16 copy equal torch_step's
bitwise after the timed steps.

    python benchmarks/bench_device_adam.py --device cuda --sizes 1e6,1e7,1e8,6.4e8 --out OUT/device_adam.json
    python benchmarks/bench_device_adam.py --device cpu --sizes 4096 --iters 2      # smoke: Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from optimized.accumulation import device_adam
from optimized.accumulation.adam_kernels import kernel_named
from optimized.accumulation.optimizers import init_state, torch_step
from reference.contract.accumulation_config import OptimizerConfig

BYTES = {"ours-fused": 30, "ours-torch-ops": 30, "torch-fused-adamw": 28}


def _timer(device: torch.device):
    """A function timing ``fn`` in seconds on ``device``'s stream (events) or the wall clock."""
    if device.type == "cuda":
        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return timed


def _arms(cfg: OptimizerConfig, n: int, device: torch.device, gen: torch.Generator):
    """Each arm's (state, step function); every arm starts from the same master and gradient."""
    master = torch.randn(n, generator=gen).to(device)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(device)
    arms = {}
    if device_adam.available():
        p, state = master.clone(), init_state(cfg, master)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)

        kernel = kernel_named("fused-device-adam")  # the engine's own call of it (adam_kernels.py)

        def fused(p=p, state=state, out=out):
            kernel.run(cfg, p, grad, state, 0.5, out)
        arms["ours-fused"] = (p, state, out, fused)
    p2, state2 = master.clone(), init_state(cfg, master)
    out2 = torch.empty(n, dtype=torch.bfloat16, device=device)

    def ops(p=p2, state=state2, out=out2):
        torch_step(cfg, p, grad, state, clip_coef=0.5)
        out.copy_(p)
    arms["ours-torch-ops"] = (p2, state2, out2, ops)
    if device.type == "cuda":
        w = torch.nn.Parameter(master.clone())
        w.grad = grad.clone()
        opt = torch.optim.AdamW([w], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                fused=True)
        arms["torch-fused-adamw"] = (None, None, None, opt.step)
    return arms


def run_size(cfg: OptimizerConfig, n: int, device: torch.device, iters: int) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    arms = _arms(cfg, n, device, gen)
    timed = _timer(device)
    rows = []
    for name, (_, _, _, fn) in arms.items():
        fn()  # compile / first launch
        times = [timed(fn) for _ in range(iters)]
        ms = statistics.median(times) * 1e3
        rows.append({"arm": name, "elements": n, "median_ms": round(ms, 4),
                     "ns_per_element": round(ms * 1e6 / n, 5),
                     "gb_per_s": round(BYTES[name] * n / (ms / 1e3) / 1e9, 1)})
    if "ours-fused" in arms:
        p, s, out, _ = arms["ours-fused"]
        q, t, out2, _ = arms["ours-torch-ops"]
        same = (torch.equal(p.view(torch.int32), q.view(torch.int32))
                and torch.equal(out.view(torch.int16), out2.view(torch.int16))
                and all(torch.equal(s.buffers[k].view(torch.int32), t.buffers[k].view(torch.int32)) for k in s.buffers))
        for r in rows:
            if r["arm"] == "ours-fused":
                r["bitwise_equal_to_torch_ops"] = same
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="comma list of element counts")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = OptimizerConfig(type="adamw", lr=1e-4, weight_decay=0.01)
    rows = []
    print("| elements | arm | median ms | ns/element | GB/s | bitwise = torch ops |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        for r in run_size(cfg, int(float(size)), device, args.iters):
            rows.append(r)
            print(f"| {r['elements']:,} | {r['arm']} | {r['median_ms']} | {r['ns_per_element']} | {r['gb_per_s']} | "
                  f"{r.get('bitwise_equal_to_torch_ops', '-')} |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__,
                       "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "config": {"type": cfg.type, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
