"""A checkpoint save and load timed through the engine's public calls only, so one command times any tree.

Issue 28 asks that the durable format (checksums, fsyncs, manifest cross-checks) cost a save at most 10 % over
the writer it replaced. ``bench_checkpoint.py`` splits the checksum's own share inside today's writer; this script
compares whole trees: run it once with ``PYTHONPATH`` at a build of the old tree and once at the new one, on the same
machine, disk and model (the same stack of square linear layers as ``bench_checkpoint.py``, stage 2 with CPU
optimizer offload, one step so the Adam state exists), and compare the medians::

    PYTHONPATH=/tmp/old python benchmarks/bench_checkpoint_public.py --params 1e9 --dir /tmp/ck-old --label old
    python benchmarks/bench_checkpoint_public.py --params 1e9 --dir /tmp/ck-new --label new
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from optimized.accumulation import ZeroEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2e7, help="about this many parameters")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="", help="names the tree in the printed line and the JSON")
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    args = ap.parse_args()

    store = tempfile.mkdtemp(prefix="bench-ckpt-store-")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}/s", rank=0, world_size=1)
    hidden = max(8, int(math.sqrt(args.params / args.layers)))
    model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(args.layers)])
    cfg = {"zero_stage": 2, "dtype": "bf16", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "adamw", "lr": 1e-4}, "offload_optimizer": "cpu"}
    engine = ZeroEngine(model, cfg, device=args.device)
    x = torch.randn(2, hidden, device=args.device, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean().to(torch.bfloat16))
    engine.step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    directory = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    os.makedirs(directory, exist_ok=True)
    saves, loads = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        engine.save_checkpoint(directory, "t")  # each save replaces the last, as a periodic save does
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_checkpoint(directory, "t")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        loads.append(time.perf_counter() - t)
    size = sum(f.stat().st_size for f in Path(directory, "t").iterdir())
    n = sum(p.numel() for p in engine.module.parameters())
    engine.destroy()
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    row = {"label": args.label, "parameters": n, "bytes": size, "save_s": saves, "load_s": loads,
           "save_median_s": statistics.median(saves), "load_median_s": statistics.median(loads)}
    print(f"{args.label or 'tree'}: {n / 1e6:.1f}M parameters, {size / 1e9:.2f} GB; save median "
          f"{row['save_median_s']:.3f} s (all {', '.join(f'{s:.3f}' for s in saves)}), load median "
          f"{row['load_median_s']:.3f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"bench_checkpoint_public-{args.label or 'tree'}.json").write_text(json.dumps(row, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
