"""A DeepSpeed-style training script on ZeroEngine: config dict, LR schedule, periodic checkpoints, resume.

Run it like a DeepSpeed script, one process per rank (gloo on CPU, NCCL on GPUs)::

    torchrun --standalone --nproc_per_node 2 examples/train_zero_resume.py --backend gloo --steps 8 \
        --save-every 4 --ckpt-dir /tmp/ckpt
    # later, possibly at another world size:
    torchrun --standalone --nproc_per_node 4 examples/train_zero_resume.py --backend gloo --steps 12 \
        --save-every 4 --ckpt-dir /tmp/ckpt --resume

Without torchrun's environment it runs as world size 1. ``--engine-module`` names the module that provides
``ZeroEngine`` (default ``optimized.accumulation``; the conformance suite runs this script against the
implementation under test). On rank 0 it prints one line per boundary and, at the end, ``final checksum <x>``:
the sum of the consolidated parameters, equal bitwise between an uninterrupted run and one resumed at the same
world size (give both the same ``--total-steps``, the length of the LR schedule).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--offload", choices=("none", "cpu"), default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (inputs are cast to the model dtype)")
    p.add_argument("--delayed-update", action="store_true",
                   help="delayed_parameter_update (docs/accumulation.md R27; stages 2/3 with --offload cpu): the "
                        "weights lag the master by one step; the checkpoint keeps both")
    p.add_argument("--delayed-update-warmup", type=int, default=None,
                   help="with --delayed-update: undelayed boundaries before the delay starts (default: the "
                        "engine's, docs/accumulation.md R27)")
    p.add_argument("--steps", type=int, default=8, help="boundary steps to reach (counted over resumes)")
    p.add_argument("--total-steps", type=int, default=None,
                   help="length of the LR schedule (default --steps; set it when a run will be resumed further)")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint in --ckpt-dir first")
    p.add_argument("--engine-module", default="optimized.accumulation")
    return p.parse_args()


def init_distributed(backend: str) -> torch.device:
    if "RANK" not in os.environ:  # plain `python examples/...`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same model (the engine also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batch(step: int, micro: int, rank: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch of a synthetic regression task (a pure function of step, micro-batch, rank)."""
    gen = torch.Generator().manual_seed(step * 100_003 + micro * 101 + rank)
    x = torch.randn(size, 16, generator=gen)
    return x.to(device), x[:, :4].sin().to(device)


def warmup_cosine(total: int, warmup: int = 2):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def main() -> None:
    args = parse_args()
    device = init_distributed(args.backend)
    ZeroEngine = importlib.import_module(args.engine_module).ZeroEngine
    world, rank = dist.get_world_size(), dist.get_rank()
    micro, gas = 4, 2
    config = {  # DeepSpeed's shape
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.bf16},
        "zero_optimization": {"stage": args.stage, "offload_optimizer": {"device": args.offload}},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.01}},
    }
    if args.delayed_update:
        config["zero_optimization"]["offload_optimizer"]["delayed_parameter_update"] = True
        if args.delayed_update_warmup is not None:
            config["zero_optimization"]["offload_optimizer"]["delayed_update_warmup"] = args.delayed_update_warmup
    engine = ZeroEngine(build_model(), config, device=device)
    engine.lr_scheduler = LambdaLR(engine.optimizer, warmup_cosine(args.total_steps or args.steps))
    start = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.ckpt_dir)  # the tag in <ckpt-dir>/latest
        start = client["step"]
        if rank == 0:
            print(f"resumed from {path} at step {start} (saved by {client['world_size']} ranks, now {world})")
    dtype = engine.config.model_dtype
    for step in range(start, args.steps):
        for m in range(gas):
            x, y = batch(step, m, rank, micro, device)
            out = engine(x.to(dtype))  # the engine keeps model-dtype weights: cast the inputs (as with DeepSpeed)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            engine.backward(loss)
            result = engine.step()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f} lr {engine.get_lr()[0]:.6f} norm {result.grad_norm:.4f}")
        if args.ckpt_dir and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.ckpt_dir, client_state={"step": step + 1, "world_size": world})
    if args.delayed_update:
        engine.apply_delayed_update()  # R27: the last update into the weights before exporting them
    state = engine.state_dict()  # consolidated (a collective at stage 3): every rank calls it
    if rank == 0:
        checksum = sum(v.double().sum().item() for v in state.values())
        print(f"final checksum {checksum!r}")
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
