"""The native CPU Adam's host update with a bf16 gradient (a bf16 accumulation's sum): converted to a fresh fp32
tensor first (the host update before the kernel read bf16) against the kernel widening it as it reads.

    python benchmarks/bench_bf16_grad.py --elements 33554432 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from optimized import cpu_adam
from reference.contract.accumulation_config import OptimizerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=32 * 2**20, help="gradient elements (one bucket)")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: the cores this may use)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    n = args.elements
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).bfloat16()

    def converted() -> None:
        cpu_adam.adam_step(cfg, p, g.to(torch.float32), m, v, 1, threads=args.threads)

    def widened_in_kernel() -> None:
        cpu_adam.adam_step(cfg, p, g, m, v, 1, threads=args.threads)

    for f in (converted, widened_in_kernel) * 2:  # interleaved: a drift of the machine shows in both
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        print(f"{f.__name__:>18}: median {statistics.median(times) * 1e3:7.1f} ms, min {min(times) * 1e3:7.1f} ms "
              f"({n:,} elements)")


if __name__ == "__main__":
    main()
