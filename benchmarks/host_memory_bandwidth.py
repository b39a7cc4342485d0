"""Host memory bandwidth as torch's CPU kernels see it, and what it implies for a CPU Adam step (issue 16).

Why: ZeRO-Offload's CPU AdamW streams every byte of optimizer state through DRAM once per step. Per parameter
it reads and writes the fp32 master weight and both fp32 moments (24 bytes), reads the fp32 gradient accumulator
(4) and writes the bf16 weight copy that goes back to the device (2): 30 bytes. Whether the measured Adam time
is near its floor is a question of this machine's bandwidth, so the two are printed side by side.

Three kernels, each counted by the bytes it asks for: ``copy`` (read one buffer, write another; the CPU also
reads the destination's lines before writing them, which this count leaves out, so it reads low), ``fill``
(write only, the same caveat) and ``add`` (``dst += 0.5 * src``: two reads, one write to a line just read, so
nothing is uncounted). Adam's updates are in place like ``add``, so its floor is printed at the ``add`` rate.

    python benchmarks/host_memory_bandwidth.py --gib 4 --params 886e6
"""

from __future__ import annotations

import argparse
import json
import time

import torch

ADAM_BYTES_PER_PARAM = 30


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="size of each buffer in GiB (several times the caches)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=float, default=886e6, help="parameters of the model whose Adam floor to print")
    args = ap.parse_args()
    if args.gib <= 0:
        ap.error(f"--gib {args.gib}: allowed values: a number > 0")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads {args.threads}: allowed values: an int >= 1")
        torch.set_num_threads(args.threads)
    n = int(args.gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    copy_s = _best_seconds(lambda: dst.copy_(src), args.repeats)  # reads n*4 bytes, writes n*4 bytes
    fill_s = _best_seconds(lambda: dst.fill_(2.0), args.repeats)  # writes n*4 bytes
    triad_s = _best_seconds(lambda: torch.add(dst, src, alpha=0.5, out=dst), args.repeats)  # 2 reads, 1 write
    nbytes = n * 4
    copy_gbs = 2 * nbytes / copy_s / 1e9
    add_gbs = 3 * nbytes / triad_s / 1e9
    result = {
        "threads": torch.get_num_threads(),
        "buffer_gib": args.gib,
        "copy_gb_per_s": round(copy_gbs, 1),
        "fill_gb_per_s": round(nbytes / fill_s / 1e9, 1),
        "add_gb_per_s": round(add_gbs, 1),
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM,
        "adam_floor_ms_at_add_rate": round(args.params * ADAM_BYTES_PER_PARAM / (add_gbs * 1e9) * 1e3, 1),
        "params": args.params,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
