"""Train a small GPT on synthetic data with the optimized ZeRO engine (issue 6).

Shows the four knobs together: ZeRO stage, managed or unmanaged gradient accumulation, activation offload (the
project's ActivationOffload, optionally with its offloading checkpoint around each block), and CPU optimizer
offload (fp32 master + Adam state in pinned host memory, stepped by the native CPU Adam). Prints step time and
peak memory.

Single process (world size 1, gloo on CPU / NCCL on a GPU)::

    python examples/train_gpt.py --stage 3 --unmanaged --gas 4 --activation-offload --checkpoint --offload-optimizer

Several ranks: ``torchrun --nproc_per_node 2 examples/train_gpt.py --stage 2`` (one GPU per rank with NCCL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int, checkpoint_fn=None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = self.checkpoint_fn(blk, x) if self.checkpoint_fn is not None else blk(x)
        return self.head(self.ln(x))


def init_distributed(device_arg: str) -> torch.device:
    """torchrun's environment if present, else a world of one (file rendezvous in a temp dir)."""
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="train-gpt-"), "store")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The docstring as written, and every option's default in --help."""

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    ap.add_argument("--unmanaged", action="store_true", help="managed_gradient_accumulation=False")
    ap.add_argument("--gas", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer='cpu' (native CPU Adam)")
    ap.add_argument("--offload-param", action="store_true", help="offload_param='cpu' (stage 3)")
    ap.add_argument("--activation-offload", action="store_true", help="optimized.offload.ActivationOffload")
    ap.add_argument("--checkpoint", action="store_true", help="the project's offloading checkpoint per block")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"), help="training dtype")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--hidden", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps")
    args = ap.parse_args()

    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from optimized.accumulation import ZeroEngine

    checkpoint_fn = None
    activation_offload = None
    if args.checkpoint or args.activation_offload:
        from optimized import offload

        if args.checkpoint:
            checkpoint_fn = lambda fn, x: offload.checkpoint(fn, x, use_reentrant=False)
        if args.activation_offload:
            # One manager for the whole run, entered once per micro-batch (docs/offload.md: create once, reuse
            # every step): its pinned host pool is allocated once and reused, not pinned again per micro-batch.
            activation_offload = offload.ActivationOffload(offload.OffloadConfig(min_offload_bytes=1 << 14))
    torch.manual_seed(0)  # every rank builds the same model (the engine also broadcasts rank 0's)
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq, checkpoint_fn)
    config = {
        "zero_stage": args.stage,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.gas,
        "managed_gradient_accumulation": not args.unmanaged,
        "dtype": args.dtype,
        "grad_accum_dtype": "fp32",
        "gradient_clipping": 1.0,
        "optimizer": {"type": "adamw", "lr": 3e-4, "weight_decay": 0.01},
        "offload_optimizer": "cpu" if args.offload_optimizer else "none",
        "offload_param": "cpu" if args.offload_param else "none",
    }
    engine = ZeroEngine(model, config, device=device)
    n_params = sum(p.numel() for p in model.parameters()) if args.stage < 3 else engine.layout.total
    if rank == 0:
        print(f"GPT {args.layers}x{args.hidden}, ~{n_params / 1e6:.2f}M trainable parameters, world {world}, "
              f"stage {args.stage}, {'unmanaged' if args.unmanaged else 'managed'} accumulation (gas {args.gas}), "
              f"optimizer offload {args.offload_optimizer}, activation offload {args.activation_offload}, "
              f"checkpoint {args.checkpoint}, device {device}")
    gen = torch.Generator().manual_seed(1 + rank)

    def micro_batch():
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        return idx[:, :-1], idx[:, 1:]

    def forward_backward(scale: float | None):
        x, y = micro_batch()
        with activation_offload if activation_offload is not None else contextlib.nullcontext():
            logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).to(logits.dtype)
            if scale is None:
                engine.backward(loss)  # managed: the engine divides by gas (R5)
            else:
                engine.backward(loss * scale, scale_wrt_gas=False)  # unmanaged: the caller scales
        return float(loss.detach())

    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses = []
        if args.unmanaged:
            for _ in range(args.gas):
                losses.append(forward_backward(1.0 / args.gas))
            out = engine.step()  # every step() is a boundary in unmanaged mode (R6)
        else:
            for _ in range(args.gas):
                losses.append(forward_backward(None))
                out = engine.step()  # a boundary every gas-th micro-step (R2)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
        else:
            peak = f"peak host RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB"
        if rank == 0:
            print(f"step {step}: loss {sum(losses) / len(losses):.4f}  grad norm {out.grad_norm:.3f}  "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms  {peak}  global_steps {engine.global_steps}")
    if activation_offload is not None and rank == 0:
        print(f"activation offload: {activation_offload.stats}")
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
