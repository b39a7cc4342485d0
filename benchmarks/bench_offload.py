"""Activation-offload benchmark: step time and peak device memory per arm, with and without host syncs.

Model: ``--blocks`` blocks of ``x + fc2(gelu(fc1(layer_norm(x))))`` (hidden 2048, fc1 2048->8192, bf16,
batch 8, sequence 4096 by default), every block checkpointed with ``torch.utils.checkpoint(...,
use_reentrant=False)``. Arms: no checkpointing; checkpointing only; checkpointing +
``torch.autograd.graph.save_on_cpu(pin_memory=True)``; checkpointing + reference offload; checkpointing +
optimized offload (``optimized_pN``: with ``prefetch_count=N``). Each arm runs ``--warmup`` steps, then
``--steps`` measured steps (forward + backward, no optimizer; gradients stay allocated); reported: median step
time and peak allocated memory. The ``host_sync`` variant synchronises the host after every block in forward
and after every block's backward (a gradient hook on each block output), so the host never runs ahead.

Usage: ``python benchmarks/bench_offload.py --out results.json`` (needs a CUDA device; ``--smoke-cpu`` only
checks the script). Prints one line per arm and writes everything (date, hardware, exact command) as JSON for
``benchmarks/plot_offload.py``. Through pytest-benchmark (``tox -e bench``): ``test_offload_step``, one case
per arm and variant, peak memory in ``extra_info``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint


class Block(torch.nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, inner)
        self.fc2 = torch.nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_step(blocks: torch.nn.ModuleList, x: torch.Tensor, checkpointed: bool, host_sync: bool) -> None:
    h = x
    for block in blocks:
        h = torch_checkpoint.checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        if host_sync:
            _sync()
            if h.requires_grad:
                h.register_hook(_sync_hook)
    loss = h.sum(dtype=torch.float32)
    loss.backward()


def _sync_hook(grad: torch.Tensor) -> torch.Tensor:
    _sync()
    return grad


def measure(
    name: str,
    blocks: torch.nn.ModuleList,
    x: torch.Tensor,
    checkpointed: bool,
    host_sync: bool,
    context: Any,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    times = []
    peaks = []
    for i in range(warmup + steps):
        # Gradients stay allocated across steps (zeroed, not freed), as in training with an optimizer, so the
        # peak compares activation memory and not the moment gradients get allocated.
        blocks.zero_grad(set_to_none=False)
        _sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with context() if context is not None else contextlib.nullcontext():
            run_step(blocks, x, checkpointed, host_sync)
        _sync()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed * 1000)
            peaks.append(torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0)
    return {
        "arm": name,
        "variant": "host_sync" if host_sync else "async",
        "median_ms": statistics.median(times),
        "peak_gib": max(peaks),
        "step_ms": times,
    }


def build(
    n_blocks: int, hidden: int, inner: int, batch: int, seq: int, arm_names: list[str]
) -> tuple[torch.nn.ModuleList, torch.Tensor, dict[str, tuple[bool, Any]], dict[str, Any]]:
    """The model, its input, every arm (checkpointed?, context factory) and the offload managers."""
    import optimized.offload as optimized_offload
    import reference.offload as reference_offload

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(hidden, inner) for _ in range(n_blocks))
    blocks = blocks.to(device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(batch, seq, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    managers: dict[str, Any] = {
        "reference": reference_offload.ActivationOffload(accelerator=DEVICE),
        "optimized": optimized_offload.ActivationOffload(accelerator=DEVICE),
    }
    for name in arm_names:
        # optimized_pN: the optimized engine with a look-ahead of N tensors (memory/time trade-off)
        suffix = name.removeprefix("optimized_p")
        if name.startswith("optimized_p") and suffix.isdigit():
            lookahead = int(suffix)
            managers[name] = optimized_offload.ActivationOffload(accelerator=DEVICE, prefetch_count=lookahead)
    arms: dict[str, tuple[bool, Any]] = {
        "no_ckpt": (False, None),
        "ckpt": (True, None),
        "save_on_cpu": (True, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
    }
    for name, manager in managers.items():
        arms[name] = (True, lambda manager=manager: manager)
    return blocks, x, arms, managers


def add_model_args(parser: argparse.ArgumentParser, blocks: int) -> None:
    """The model-shape options (issue 4's model by default), shared with diag_offload_prefetch.py."""
    parser.add_argument("--blocks", type=int, default=blocks)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, blocks=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--arms", default="no_ckpt,ckpt,save_on_cpu,reference,optimized")
    parser.add_argument("--variants", default="async,host_sync")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke-cpu", action="store_true", help="run on the CPU to check the script only")
    args = parser.parse_args(argv)
    global DEVICE
    if args.smoke_cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_offload: needs a CUDA device", file=sys.stderr)
        return 2

    blocks, x, arms, managers = build(args.blocks, args.hidden, args.inner, args.batch, args.seq, args.arms.split(","))
    arm_names = args.arms.split(",")
    results = []
    for variant in args.variants.split(","):
        for arm in arm_names:
            checkpointed, context = arms[arm]
            for m in managers.values():
                m.reset_stats()
            row = measure(arm, blocks, x, checkpointed, variant == "host_sync", context, args.warmup, args.steps)
            if arm in managers:
                stats = managers[arm].stats.as_dict()
                row["offload_stats"] = stats
            results.append(row)
            print(
                f"{variant:9s} {arm:12s} median {row['median_ms']:8.1f} ms  peak {row['peak_gib']:6.2f} GiB",
                flush=True,
            )
    for variant in args.variants.split(","):
        base = next((r for r in results if r["arm"] == "ckpt" and r["variant"] == variant), None)
        if base:
            for r in results:
                if r["variant"] == variant:
                    r["time_vs_ckpt_pct"] = 100.0 * (r["median_ms"] / base["median_ms"] - 1.0)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "config": vars(args),
        "results": results,
    }
    for r in results:
        print(f"{r['variant']:9s} {r['arm']:12s} {r.get('time_vs_ckpt_pct', 0.0):+6.1f} % vs ckpt")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


# -- pytest-benchmark entry points (``tox -e bench``; skipped without CUDA) --------------------------------------------
try:
    import pytest
except ImportError:  # script mode on a machine without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    ARMS = ("no_ckpt", "ckpt", "save_on_cpu", "reference", "optimized")

    @pytest.fixture(scope="module")
    def offload_model() -> Any:
        if not torch.cuda.is_available():
            pytest.skip("bench_offload needs a CUDA device")
        return build(24, 2048, 8192, 8, 4096, list(ARMS))

    @pytest.mark.gpu
    @pytest.mark.parametrize("variant", ("async", "host_sync"))
    @pytest.mark.parametrize("arm", ARMS)
    def test_offload_step(benchmark: Any, offload_model: Any, arm: str, variant: str) -> None:
        blocks, x, arms, _ = offload_model
        checkpointed, context = arms[arm]

        def one_step() -> None:
            with context() if context is not None else contextlib.nullcontext():
                run_step(blocks, x, checkpointed, variant == "host_sync")
            _sync()

        torch.cuda.reset_peak_memory_stats()
        benchmark.pedantic(
            one_step,
            setup=lambda: blocks.zero_grad(set_to_none=False),
            rounds=5,
            warmup_rounds=2,
            iterations=1,
        )
        benchmark.extra_info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


if __name__ == "__main__":
    raise SystemExit(main())
