"""Lightning side by side: our ``ZeroStrategy`` vs Lightning's ``DeepSpeedStrategy`` at the same config (issue 52).

One HF ``LlamaForCausalLM`` built from a config (random init) in a ``LightningModule``, trained by a ``Trainer`` at
world size 1 with each strategy: ZeRO-2, optimizer offload to the CPU, ``precision="bf16-true"`` (bf16 weights,
fp32 masters and moments on the host, fp32 gradient accumulation), AdamW, ``gradient_clip_val`` ``--clip``,
``accumulate_grad_batches`` ``--gas``. Both strategies get the *same* DeepSpeed-shaped config dict (stage, offload,
bf16, accumulation dtype, micro-batch size, optimizer); accumulation and clipping come from the Trainer, as
Lightning's DeepSpeed strategy requires and ours accepts. Each arm runs in its own subprocess (a fresh CUDA context
and allocator: peak memory is the arm's own; a crash or OOM is reported in its row, not fatal):

- ``ours``: ``optimized.integrations.lightning.ZeroStrategy`` (the engine's streamed CPU Adam);
- ``deepspeed``: ``DeepSpeedStrategy`` of the same Lightning package (DeepSpeed's ZeRO-Offload, its CPU Adam).

Reported per arm: step time (one optimizer update = ``--gas`` micro-batches; mean over ``--steps`` updates after
``--warmup``), tokens/s, peak GPU memory (``max_memory_allocated``), peak host RSS and the last loss. A missing
package (Lightning, DeepSpeed, transformers) is a row saying ``not installed``; DeepSpeed on ``--device cpu`` is
``needs cuda``. Output: a side-by-side table on stdout and ``bench_lightning.json`` in ``--out``.

``--model``: ``tiny`` (CPU smoke test), ``350m``, ``886m`` (bench_zero_offload.py's 886M preset: hidden 2048,
15 layers, sequence 2048, batch 4, gas 2).

    python benchmarks/bench_lightning.py --device cpu --model tiny --steps 2 --warmup 1 --out /tmp/bl
    python benchmarks/bench_lightning.py --device cuda --model 886m --out results/
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: name -> (hidden, layers, heads, intermediate, vocab, seq, batch, gas)
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 176, 512, 32, 2, 2),
    "350m": (1024, 20, 16, 2816, 32000, 2048, 4, 2),
    "886m": (2048, 15, 16, 5472, 32000, 2048, 4, 2),
}
ARMS = ("ours", "deepspeed")
#: The packages each arm needs besides torch (a missing one makes the row "not installed").
NEEDS = {"ours": ("transformers",), "deepspeed": ("transformers", "deepspeed")}


def _shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(seq, batch, gas) of the preset with the ``--seq/--batch/--gas`` overrides."""
    *_, seq, batch, gas = MODELS[args.model]
    return args.seq or seq, args.batch or batch, args.gas or gas


def shared_config(args: argparse.Namespace) -> dict[str, Any]:
    """The one config both strategies get (DeepSpeed's shape; accumulation and clipping are the Trainer's)."""
    _, batch, _ = _shape(args)
    return {
        "train_micro_batch_size_per_gpu": batch,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
    }


def _missing(arm: str) -> str | None:
    """Why ``arm`` cannot run here (its row's status), or None."""
    try:
        from optimized.integrations.lightning import load_lightning

        load_lightning()
    except ImportError:  # MissingDependencyError is an ImportError too
        return "not installed (lightning)"
    for package in NEEDS[arm]:
        if importlib.util.find_spec(package) is None:
            return f"not installed ({package})"
    return None


# ---- the child: one arm ------------------------------------------------------------------------------------


def _llama(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab, *_ = MODELS[args.model]
    seq, _, _ = _shape(args)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=seq, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _module(pl: Any, args: argparse.Namespace) -> Any:
    import torch

    class Causal(pl.LightningModule):
        """The HF model; configure_optimizers states the config's AdamW (ours checks they agree; DeepSpeed's
        strategy uses the config's)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = _llama(args)
            self.last_loss = float("nan")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.last_loss = float(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.01)

    return Causal()


def _timer(pl: Any, device: str, gas: int) -> Any:
    import torch

    class UpdateTimer(pl.Callback):
        """The wall time of each optimizer update (``gas`` batches), synchronized with the device."""

        def __init__(self) -> None:
            self.marks: list[float] = []  # the start of training, then the end of each update

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % gas == 0:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.marks.append(time.perf_counter())

    return UpdateTimer()


def _strategy(pl: Any, arm: str, args: argparse.Namespace) -> Any:
    config = shared_config(args)
    if arm == "ours":
        from optimized.integrations.lightning import ZeroStrategy

        return ZeroStrategy(config)
    return pl.strategies.DeepSpeedStrategy(config=config)


def child(arm: str, args: argparse.Namespace, out: str) -> None:
    """Train ``arm`` for warmup + steps updates and write its row to ``out``."""
    import torch

    from optimized.integrations.lightning import load_lightning

    pl = load_lightning()
    seq, batch, gas = _shape(args)
    updates = args.warmup + args.steps
    torch.manual_seed(0)
    vocab = MODELS[args.model][4]
    ids = torch.randint(0, vocab, (updates * gas * batch, seq))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch, shuffle=False)
    with torch.device(args.device):  # random init on the GPU: minutes on the host for the larger presets
        module = _module(pl, args)
    timer = _timer(pl, args.device, gas)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, strategy=_strategy(pl, arm, args),
        precision="bf16-true", accumulate_grad_batches=gas, gradient_clip_val=args.clip, max_steps=updates,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[timer],
    )
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, loader)
    marks = timer.marks[args.warmup:]  # from the end of the last warm-up update (or the start) to the end
    step_s = (marks[-1] - marks[0]) / (len(marks) - 1)
    row = {
        "arm": arm, "model": args.model, "status": "ok", "updates": trainer.global_step, "seq": seq, "batch": batch,
        "gas": gas, "step_s": step_s, "tokens_per_s": seq * batch * gas / step_s if step_s > 0 else None,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        "last_loss": module.last_loss,
    }
    Path(out).write_text(json.dumps(row))


# ---- the parent: every arm, the table ----------------------------------------------------------------------


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """``arm`` in a subprocess (a process Lightning sees as started for it: rank 0 of 1); its row or its failure."""
    why = _missing(arm)
    if why is None and arm == "deepspeed" and args.device != "cuda":
        why = "needs cuda"
    if why is not None:
        return {"arm": arm, "model": args.model, "status": why}
    out = Path(args.out) / f".row-{arm}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", arm, "--child-out", str(out), *args.passthrough]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"arm": arm, "model": args.model, "status": f"timeout after {args.timeout}s"}
    if out.exists():
        row = json.loads(out.read_text())
        out.unlink()
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = any("out of memory" in line.lower() for line in tail)
        row = {"arm": arm, "model": args.model, "status": "OOM" if oom else f"failed (rc {proc.returncode})",
               "error": " | ".join(tail)}
    row["wall_s"] = time.perf_counter() - t0
    return row


def _fmt(value: Any, fmt: str) -> str:
    return "-".rjust(int(fmt.split(".")[0])) if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'arm':<10} {'model':<6} {'status':<34} {'step s':>8} {'tokens/s':>10} {'GPU GiB':>8} {'RSS GiB':>8} " \
           f"{'loss':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['arm']:<10} {r['model']:<6} {r['status'][:34]:<34} {_fmt(r.get('step_s'), '8.3f')} "
                     f"{_fmt(r.get('tokens_per_s'), '10.0f')} {_fmt(r.get('peak_gpu_gib'), '8.2f')} "
                     f"{_fmt(r.get('peak_rss_gib'), '8.2f')} {_fmt(r.get('last_loss'), '8.4f')}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=tuple(MODELS), default="886m")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer updates")
    p.add_argument("--warmup", type=int, default=2, help="updates before timing")
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--gas", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per arm")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; allowed: {', '.join(ARMS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    args.arm_list = arms
    # What a child needs to rebuild the same options (everything but the arm list, the output and the child's own).
    args.passthrough = [f"--{k}={v}" for k, v in (("device", args.device), ("model", args.model),
                                                  ("steps", args.steps), ("warmup", args.warmup), ("seq", args.seq),
                                                  ("batch", args.batch), ("gas", args.gas), ("lr", args.lr),
                                                  ("clip", args.clip), ("out", args.out))]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child, args, args.child_out)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [run_arm(arm, args) for arm in args.arm_list]
    print(table(rows))
    seq, batch, gas = _shape(args)
    result = {"benchmark": "bench_lightning", "device": args.device, "model": args.model, "seq": seq, "batch": batch,
              "gas": gas, "clip": args.clip, "config": shared_config(args), "host": platform.node(), "rows": rows}
    path = Path(args.out) / "bench_lightning.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
