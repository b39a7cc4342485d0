"""Trace when the optimized offload engine issues its deferred prefetches (issue 4 diagnostics, GPU).

The benchmark model of ``bench_offload.py`` (fewer blocks by default) runs a few steps under the optimized
manager while the engine's prefetch planner is observed from outside: for every restore, the autograd node it
happened in and the allocation then; for every post-hook that ran, the node, ``memory_allocated`` and whether
the planned prefetch was issued. That is what decides whether a look-ahead buffer lands before or after a
block's memory peak, which the step-time and peak-memory figures alone cannot show.

    python benchmarks/diag_offload_prefetch.py --blocks 6 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.utils.checkpoint as torch_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_offload import Block, add_model_args

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, blocks=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (the planner only defers where the device reports its allocation)")
        return 0

    import optimized.offload as offload
    from optimized.offload import engine as engine_mod
    from optimized.offload import prefetch as prefetch_mod

    log: list[str] = []
    mem = lambda: torch.cuda.memory_allocated() / MiB

    original_attach = prefetch_mod.DeferredPrefetch.attach
    original_done = prefetch_mod.DeferredPrefetch._on_node_done
    original_issue = engine_mod.StreamedOffloadEngine.issue_planned_prefetch

    def attach(self, node):
        log.append(f"restore in {type(node).__name__:<24} allocated {mem():9.1f} MiB")
        return original_attach(self, node)

    def on_node_done(self, grad_inputs, grad_outputs):
        node = torch._C._current_autograd_node()
        name = type(node).__name__ if node is not None else "?"
        log.append(f"  hook {self._calls + 1} {name:<24} allocated {mem():9.1f} MiB pending {len(self._pending)}")
        return original_done(self, grad_inputs, grad_outputs)

    def issue(self, candidate, epoch):
        log.append(f"  -> prefetch issued ({candidate.nbytes / MiB:.0f} MiB) at allocated {mem():9.1f} MiB")
        return original_issue(self, candidate, epoch)

    prefetch_mod.DeferredPrefetch.attach = attach
    prefetch_mod.DeferredPrefetch._on_node_done = on_node_done
    engine_mod.StreamedOffloadEngine.issue_planned_prefetch = issue

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(args.hidden, args.inner) for _ in range(args.blocks))
    blocks = blocks.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    manager = offload.ActivationOffload(accelerator="cuda", prefetch_count=args.prefetch)
    for step in range(args.steps):
        log.clear()
        blocks.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with manager:
            h = x
            for block in blocks:
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
            h.sum(dtype=torch.float32).backward()
        torch.cuda.synchronize()
        print(f"step {step}: peak {torch.cuda.max_memory_allocated() / MiB:.1f} MiB")
    print("\n".join(log))
    print(manager.stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
