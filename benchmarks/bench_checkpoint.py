"""What the durable checkpoint format costs a save (issue 28: at most 10 % over the writer without checksums).

One rank (world size 1) of ``ZeroEngine`` at stage 2 with CPU optimizer offload (``--stage``/``--offload`` to
change) over a stack of ``--layers`` square linear layers sized to about ``--params`` parameters, one training
step so the Adam state exists, then ``--repeats`` saves of the same tag (each replaces the last, as a periodic save
does) per arm, arms interleaved so drift in the disk's speed hits both:

- ``checksummed``: the shipped writer (CRC-32 computed on a helper thread while the bytes are written);
- ``no-checksum``: the same writer with the CRC-32 skipped (the file object only counts bytes): today's writer
  before issue 28 as far as the checksum is concerned, so the difference is the checksum's cost;
- ``load``: ``load_checkpoint`` of the tag (every rank file's CRC-32 is verified before it is unpickled).

Prints a table and writes JSON to ``--out``. On the GPU box (1B parameters, 12 GB of fp32 master + Adam state per
save, on the disk the checkpoints go to)::

    python benchmarks/bench_checkpoint.py --params 1e9 --dir /path/on/nvme --repeats 3 --out results/

and on a CPU host at a small size (seconds)::

    python benchmarks/bench_checkpoint.py --params 2e7 --device cpu --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
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

from optimized.accumulation import ZeroEngine, checkpoint_files


class _CountingOnly(checkpoint_files._ChecksummedFile):
    """The writer's file object without the CRC-32: the no-checksum arm."""

    def _write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        self._f.write(data)
        self.size += n
        return n


def _model(params: float, layers: int) -> nn.Module:
    hidden = max(8, int(math.sqrt(params / layers)))
    return nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])


def _init_group(device: str) -> None:
    store = tempfile.mkdtemp(prefix="bench-ckpt-store-")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}/s", rank=0, world_size=1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2e7, help="about this many parameters")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--offload", default="cpu", choices=("none", "cpu"))
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    args = ap.parse_args()

    _init_group(args.device)
    cfg = {"zero_stage": args.stage, "dtype": args.dtype, "train_micro_batch_size_per_gpu": 2,
           "gradient_accumulation_steps": 1, "optimizer": {"type": "adamw", "lr": 1e-4}}
    if args.offload == "cpu":
        cfg["offload_optimizer"] = "cpu"
    engine = ZeroEngine(_model(args.params, args.layers), cfg, device=args.device)
    n = sum(p.numel() for p in engine.module.parameters())
    hidden = engine.module[0].in_features
    x = torch.randn(2, hidden, device=args.device, dtype=engine.config.model_dtype)
    engine.backward(engine(x).float().pow(2).mean().to(engine.config.model_dtype))
    engine.step()
    _sync(args.device)

    directory = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    os.makedirs(directory, exist_ok=True)
    arms = {"checksummed": checkpoint_files._ChecksummedFile, "no-checksum": _CountingOnly}
    times: dict[str, list[float]] = {a: [] for a in (*arms, "load")}
    shipped = checkpoint_files._ChecksummedFile
    try:
        for _ in range(args.repeats):
            for arm, cls in arms.items():
                checkpoint_files._ChecksummedFile = cls
                t = time.perf_counter()
                engine.save_checkpoint(directory, arm)
                times[arm].append(time.perf_counter() - t)
            checkpoint_files._ChecksummedFile = shipped
            t = time.perf_counter()
            engine.load_checkpoint(directory, "checksummed")
            _sync(args.device)
            times["load"].append(time.perf_counter() - t)
    finally:
        checkpoint_files._ChecksummedFile = shipped
    size = sum(f.stat().st_size for f in Path(directory, "checksummed").iterdir())
    engine.destroy()
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)

    rows = {a: {"median_s": statistics.median(v), "min_s": min(v), "GB_per_s": size / statistics.median(v) / 1e9}
            for a, v in times.items()}
    overhead = rows["checksummed"]["median_s"] / rows["no-checksum"]["median_s"] - 1.0
    print(f"{n / 1e6:.1f}M parameters, stage {args.stage}, offload {args.offload}, {args.dtype}, {args.device}; "
          f"checkpoint {size / 1e9:.2f} GB in {directory}")
    print(f"{'arm':<12} {'median s':>9} {'min s':>8} {'GB/s':>6}")
    for arm, r in rows.items():
        print(f"{arm:<12} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['GB_per_s']:>6.2f}")
    print(f"checksum overhead of a save (median): {100 * overhead:+.1f} % (issue 28 budget: +10 %)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        result = {"parameters": n, "bytes": size, "args": vars(args), "arms": rows, "overhead": overhead,
                  "torch": torch.__version__}
        Path(args.out, f"bench_checkpoint-{stamp}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
