"""The host update's bandwidth: the CPU Adam kernel alone, then under each condition the engine adds (issue 49 item 3).

Why: inside the engine the host update ran at about 60 % of the kernel's own bandwidth (issue 49). The engine's
update differs from ``bench_zero.py``'s standalone arm in several ways at once; this script adds them one at a time
on the same elements, so the step where the bandwidth drops names the cause:

1. ``alone``: pageable buffers, one call over all elements, every core (``bench_zero.py``'s ``native+bf16``);
2. ``buckets``: the same, in calls of one bucket each (the engine calls the kernel per bucket);
3. ``pinned``: the buffers from the engine's own allocator (:class:`.HostBuffers`: page-locked, registered);
4. ``threads-1``: one thread fewer (a device run leaves a core to the thread that launches kernels);
5. ``+h2d``: each bucket's bf16 weights copied to the device on a side stream once its call returned (the engine's
   :class:`.WeightUpload`), sharing the memory bus with the next bucket's kernel;
6. ``+d2h``: the previous arm plus a gradient-sized D2H stream running throughout (the next backward's gradients
   under an R27/R30 update);
7. ``bf16-grad``: arm 5 reading a bf16 gradient sum (DeepSpeed's default accumulation, ``-bf16acc`` arms);
8. ``backup``: arm 5 with R30's backup (the kernel copies master and moments before updating them; the backup
   made once, as the engine's speculation keeps it).

Every arm counts bytes the way the engine's timeline does (:func:`adam_pass_bytes_per_element`, the one-pass
floor) and reports the best of ``--repeats`` passes over all elements (GB/s = 1e9 bytes/s), and its share of arm 1.

    python benchmarks/bench_host_update.py --device cuda --params 886e6 --bucket 25e6 --out OUT
    python benchmarks/bench_host_update.py --device cpu --params 2e7 --bucket 4e6   # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optimized import cpu_adam
from optimized.accumulation.host_buffers import HostBuffers
from reference.accumulation import OptimizerConfig
from reference.contract.accumulation_state_precision import STATE_PRECISIONS, adam_pass_bytes_per_element

FP32 = STATE_PRECISIONS["fp32"]


class State:
    """One set of the update's host buffers (master, moments, bf16 copy, gradient), pinned or pageable."""

    def __init__(self, n: int, pinned: bool, owner: HostBuffers) -> None:
        def make(dtype: torch.dtype) -> torch.Tensor:
            return owner.empty(n, dtype, pinned=pinned) if pinned else torch.empty(n, dtype=dtype)

        self.master, self.m, self.v = make(torch.float32), make(torch.float32), make(torch.float32)
        self.out, self.grad, self.grad16 = make(torch.bfloat16), make(torch.float32), make(torch.bfloat16)
        for t in (self.master, self.grad):  # random values: no zero-page or denormal shortcuts
            t.copy_(torch.randn(n))
        self.m.zero_()
        self.v.fill_(1e-4)
        self.grad16.copy_(self.grad)
        self.step = 0


def _pass(s: State, buckets: list[tuple[int, int]], cfg: OptimizerConfig, threads: int, *,
          grad16: bool = False, after_bucket: Callable[[int, int], None] | None = None,
          backup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    s.step += 1
    g_all = s.grad16 if grad16 else s.grad
    for lo, hi in buckets:
        b = None if backup is None else tuple(t[lo:hi] for t in backup)
        cpu_adam.adam_step(cfg, s.master[lo:hi], g_all[lo:hi], s.m[lo:hi], s.v[lo:hi], s.step, grad_scale=0.5,
                           bf16_out=s.out[lo:hi], threads=threads, backup=b)
        if after_bucket is not None:
            after_bucket(lo, hi)


def _best(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm: thread pool up, pages touched
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--params", type=float, default=886e6, help="elements updated per pass (the partition)")
    ap.add_argument("--bucket", type=float, default=25e6, help="elements per kernel call (the engine's bucket)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n, bucket = int(args.params), int(args.bucket)
    if n < 1 or bucket < 1:
        ap.error(f"--params {args.params} / --bucket {args.bucket}: allowed values: numbers >= 1")
    on_device = args.device == "cuda"
    if on_device and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; allowed values: cuda (with a GPU), cpu")
    cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    every = cpu_adam.default_threads()
    buckets = [(lo, min(n, lo + bucket)) for lo in range(0, n, bucket)]
    sync = torch.cuda.synchronize if on_device else (lambda: None)
    owner = HostBuffers()
    rows: list[dict] = []
    base_gbps: list[float] = []

    def arm(name: str, fn: Callable[[], None], bytes_per: int, threads: int) -> None:
        sec = _best(fn, args.repeats, sync)
        gbps = n * bytes_per / sec / 1e9
        if not base_gbps:
            base_gbps.append(gbps)
        row = {"arm": name, "elements": n, "bucket": bucket, "threads": threads, "bytes_per_element": bytes_per,
               "seconds": sec, "gbps": gbps, "of_alone": gbps / base_gbps[0]}
        rows.append(row)
        print(f"  {name:<22} {threads:3d} threads {bytes_per:2d} B/el {sec * 1e3:9.1f} ms {gbps:8.1f} GB/s "
              f"{row['of_alone']:7.1%} of alone", flush=True)

    plain = adam_pass_bytes_per_element(FP32, bf16_copy=True)
    try:
        print(f"host update: {n:,} elements, buckets of {bucket:,}, isa {cpu_adam.best_isa()}, {every} cores")
        pageable = [State(n, False, owner)]  # freed before the pinned set is made (2 x 16 GB at 886M)
        arm("alone", lambda: _pass(pageable[0], [(0, n)], cfg, every), plain, every)
        arm("buckets", lambda: _pass(pageable[0], buckets, cfg, every), plain, every)
        pageable.clear()
        pinned = State(n, on_device, owner)
        arm("pinned", lambda: _pass(pinned, buckets, cfg, every), plain, every)
        fewer = max(1, every - 1) if on_device else every
        arm("threads-1", lambda: _pass(pinned, buckets, cfg, fewer), plain, fewer)
        after = None
        if on_device:
            dev_w = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            side = torch.cuda.Stream()

            def h2d(lo: int, hi: int) -> None:
                with torch.cuda.stream(side):
                    dev_w[lo:hi].copy_(pinned.out[lo:hi], non_blocking=True)

            after = h2d
            arm("+h2d", lambda: _pass(pinned, buckets, cfg, fewer, after_bucket=h2d), plain, fewer)
            dev_g = torch.randn(n, device="cuda")
            d2h_stream = torch.cuda.Stream()
            sink = owner.empty(n, torch.float32, pinned=True)

            def with_d2h() -> None:
                with torch.cuda.stream(d2h_stream):
                    for lo, hi in buckets:  # one gradient's worth of D2H, queued at once
                        sink[lo:hi].copy_(dev_g[lo:hi], non_blocking=True)
                _pass(pinned, buckets, cfg, fewer, after_bucket=h2d)

            arm("+d2h", with_d2h, plain, fewer)
            del dev_g, sink
        arm("bf16-grad", lambda: _pass(pinned, buckets, cfg, fewer, grad16=True, after_bucket=after),
            adam_pass_bytes_per_element(FP32, bf16_copy=True, grad_bytes=2), fewer)
        with_backup = adam_pass_bytes_per_element(FP32, bf16_copy=True, backup=True)
        kept = tuple(torch.empty(n, dtype=torch.float32) for _ in range(3))
        arm("backup", lambda: _pass(pinned, buckets, cfg, fewer, after_bucket=after, backup=kept),
            with_backup, fewer)
    finally:
        owner.release()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_host_update.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
