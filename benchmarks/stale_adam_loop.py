"""A hand-written one-step-stale AdamW loop on the bigram chain: the yardstick for the delayed update (R27).

``bench_zero_offload.py --mode converge`` shows the delayed update (docs/accumulation.md R27) training far slower
than the synchronous one. Whether that is the rule's staleness or a bug of the engine is answered by training the
same model on the same batches with a loop that owns no engine code: plain PyTorch, an fp32 master per bf16
parameter, ``torch.optim.AdamW`` (weight decay 0.01, the benchmark's), ``clip_grad_norm_`` 1.0 on the fp32
gradients, and the staleness done by hand: after boundary k the model computes with the cast of the master after
boundary ``k - delay`` (kept in a short history). ``--delay 0`` is the synchronous update; ``--delay 1`` is the
textbook delayed parameter update of ZeRO-Offload (the update of step k runs while step k + 1 computes with the
weights before it, and lands before step k + 2), which R27 states; ``--delay 2`` is what a staleness off by one
would look like. ``--warm N``: the first N boundaries are synchronous (``delayed_update_warmup``).

The engine's arms and these rows should agree closely when the engine implements R27 and R27 is the textbook
rule (the AdamW arithmetic differs in the last bits, so the curves drift apart slowly, not systematically).
Measured on the CPU (``--model tiny --chain-ids 64 --lr 3e-3 --steps 60``, loss after 60 = mean of the last 5):
delay 0 2.143, delay 1 2.838, delay 1 after 20 synchronous 2.260, delay 2 3.921; the engine's arms
``ours-s2-offload`` 2.142, ``-dpu`` 2.833, ``-dpu-warmup`` (``--dpu-warmup 20``) 2.258.

    python benchmarks/stale_adam_loop.py --device cpu --model tiny --chain-ids 64 --lr 3e-3 --steps 60 \\
        --target 3.0 --runs 0:0,1:0,1:20,2:0
    python benchmarks/stale_adam_loop.py --device cuda --model 886m --seq 1024 --lr 3e-4 --steps 200 \\
        --target 2.0 --runs 0:0,1:0,1:100
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from bench_zero_offload import MODELS, _llama
from convergence import BigramChain, Schedule, Trainer, train


def _stale_trainer(model, delay: int, warm: int, lr: float, clip: float) -> Trainer:
    """One boundary = forward/backward of every micro-batch (loss / gas), then AdamW on the fp32 masters; the
    bf16 parameters then become the cast of the master of ``delay`` boundaries ago (0 during the warm-up)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=0.01, foreach=False)

    def casts() -> list[torch.Tensor]:
        return [m.detach().to(p.dtype) for m, p in zip(master, params, strict=True)]

    history = collections.deque([casts()], maxlen=delay + 1)
    done = [0]

    def step(micro: torch.Tensor) -> torch.Tensor:
        total = None
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(micro)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        for m, p in zip(master, params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done[0] += 1
        history.append(casts())
        lag = 0 if done[0] <= warm else min(delay, len(history) - 1)
        with torch.no_grad():
            for p, w in zip(params, history[-1 - lag], strict=True):
                p.copy_(w)
        return total / len(micro)

    def set_lr(value: float) -> None:
        for group in opt.param_groups:
            group["lr"] = value

    return Trainer(step=step, set_lr=set_lr)


def _runs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            delay, warm = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--runs: {item!r} is not DELAY:WARM (two ints, e.g. 1:0)") from None
        if delay < 0 or warm < 0:
            raise SystemExit(f"--runs: {item!r} needs DELAY >= 0 and WARM >= 0")
        out.append((delay, warm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    ap.add_argument("--batch", type=int, default=None, help="override the preset's micro-batch size")
    ap.add_argument("--gas", type=int, default=None, help="override the preset's micro-batches per step")
    ap.add_argument("--runs", type=_runs, default=_runs("0:0,1:0,2:0"),
                    help="comma list of DELAY:WARM (default 0:0,1:0,2:0)")
    ap.add_argument("--steps", type=int, default=60, help="boundaries trained")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=0, help="boundaries of linear LR warm-up")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    ap.add_argument("--target", type=float, default=3.0)
    ap.add_argument("--smooth", type=int, default=5)
    ap.add_argument("--chain-ids", type=int, default=1024)
    ap.add_argument("--successors", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write stale_adam_loop.json here")
    opts = ap.parse_args()
    for name in ("steps", "smooth"):
        if getattr(opts, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(opts, name)} must be >= 1")

    import torch

    device = torch.device(opts.device)
    _, _, _, _, vocab, seq, batch, gas = MODELS[opts.model]
    seq, batch, gas = opts.seq or seq, opts.batch or batch, opts.gas or gas
    task = BigramChain(vocab, opts.chain_ids, opts.successors, opts.seed)
    data = task.batches(opts.steps, gas, batch, seq).to(device)
    schedule = Schedule(steps=opts.steps, lr=opts.lr, lr_warmup=opts.lr_warmup, target=opts.target,
                        smooth=opts.smooth, arm_seconds=None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for delay, warm in opts.runs:
        torch.manual_seed(0)  # the benchmark's arms build their model after the same seed
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = _llama(opts.model, seq)
        finally:
            torch.set_default_dtype(default_dtype)
        row = train(_stale_trainer(model, delay, warm, opts.lr, opts.clip), data, schedule, sync)
        row.update(delay=delay, warm=warm)
        rows.append(row)
        print(f"delay {delay} warm {warm}: loss after {row['boundaries']} {row['final_loss']:.3f}, "
              f"boundaries to {opts.target} {row['steps_to_target']}", flush=True)
        del model
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "stale_adam_loop.json").write_text(json.dumps({"args": vars(opts) | {"out": str(opts.out)},
                                                                   "rows": rows}, default=str, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
