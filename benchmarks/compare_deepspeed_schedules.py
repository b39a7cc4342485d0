"""The ``scheduler`` section of a DeepSpeed config, run by DeepSpeed's own scheduler classes and by our engine: the
learning rate (and OneCycle's betas) of every boundary, compared exactly.

DeepSpeed's side builds ``deepspeed.runtime.lr_schedules.<type>(optimizer, **params)`` on a ``torch.optim.AdamW``
(what its engine does with a config's section), reads the group before each boundary and calls ``step()`` after it.
Our side builds ``ZeroEngine`` (one rank on gloo, CPU) from a config with the same section and reads
``engine.get_lr()`` and the group's betas before each boundary. Without DeepSpeed installed the script says so and
exits 0 (it runs where DeepSpeed is, the GPU box; nothing here imports DeepSpeed at module level).

    python benchmarks/compare_deepspeed_schedules.py [--impl optimized] [--boundaries 40]

Prints one line per section (``same`` or the first differing boundary) and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys

import torch

BASE_LR = 0.02
BETAS = (0.85, 0.95)

#: Hand-picked sections (every branch of every type within 40 boundaries); random ones are added per --seed.
SECTIONS: list[dict] = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_max_lr": 0.03}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_num_steps": 8, "warmup_type": "linear"}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 3, "warmup_num_steps": 6, "cos_min_ratio": 0.3}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 6,
                                    "cycle_second_step_size": 9, "decay_step_size": 3, "decay_lr_rate": 0.2,
                                    "decay_mom_rate": 0.001}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 8,
                                    "cycle_first_stair_count": 4, "cycle_second_stair_count": 2,
                                    "cycle_momentum": False}},
    {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 5,
                                       "lr_range_test_step_rate": 0.5}},
    {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 4, "lr_range_test_staircase": True}},
]


def random_sections(seed: int, count: int) -> list[dict]:
    """``count`` sections with drawn parameters (small step counts, so warm-up, cycle and decay are all crossed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.choice(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
        lr = lambda: round(rng.uniform(1e-4, 0.05), 6)
        if kind == "OneCycle":
            p = {"cycle_min_lr": lr(), "cycle_max_lr": lr(), "cycle_first_step_size": rng.randint(1, 8),
                 "cycle_second_step_size": rng.randint(0, 8), "cycle_first_stair_count": rng.randint(0, 3),
                 "decay_step_size": rng.randint(0, 4), "decay_lr_rate": rng.uniform(0, 1),
                 "cycle_min_mom": rng.uniform(0.5, 0.8), "cycle_max_mom": rng.uniform(0.8, 0.9),
                 "decay_mom_rate": rng.uniform(0, 0.002)}
        elif kind == "LRRangeTest":
            p = {"lr_range_test_min_lr": lr(), "lr_range_test_step_size": rng.randint(1, 6),
                 "lr_range_test_step_rate": rng.uniform(0, 2), "lr_range_test_staircase": rng.random() < 0.5}
        else:
            p = {"warmup_num_steps": rng.randint(1, 12), "warmup_type": rng.choice(["log", "linear"])}
            if kind == "WarmupCosineLR":
                p.update(total_num_steps=rng.randint(1, 40), warmup_min_ratio=rng.uniform(0, 1),
                         cos_min_ratio=rng.uniform(0, 1))
            else:
                p.update(warmup_min_lr=lr(), warmup_max_lr=lr())
                if kind == "WarmupDecayLR":
                    p["total_num_steps"] = rng.randint(1, 40)
        out.append({"type": kind, "params": p})
    return out


def deepspeed_values(section: dict, boundaries: int) -> list[tuple[float, tuple[float, float]]]:
    """(lr, betas) before each boundary, from DeepSpeed's own class stepped as its engine steps it."""
    from deepspeed.runtime import lr_schedules

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=BASE_LR, betas=BETAS)
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    out = []
    for _ in range(boundaries):
        group = optimizer.param_groups[0]
        out.append((float(group["lr"]), tuple(float(b) for b in group["betas"])))
        optimizer.step()
        scheduler.step()
    return out


def engine_values(engine_cls: type, section: dict, boundaries: int) -> list[tuple[float, tuple[float, float]]]:
    """(lr, betas) before each boundary of a one-rank engine built from a config with ``section``."""
    config = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "scheduler": section,
              "optimizer": {"type": "AdamW", "params": {"lr": BASE_LR, "betas": list(BETAS)}}}
    engine = engine_cls(torch.nn.Linear(4, 3), config)
    out = []
    try:
        for i in range(boundaries):
            group = engine.optimizer.param_groups[0]
            out.append((engine.get_lr()[0], tuple(float(b) for b in group["betas"])))
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x).square().mean())
            engine.step()
    finally:
        engine.destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="optimized", help="package whose accumulation.ZeroEngine is compared")
    parser.add_argument("--boundaries", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random", type=int, default=20, help="drawn sections besides the hand-picked ones")
    args = parser.parse_args(argv)
    try:
        importlib.import_module("deepspeed.runtime.lr_schedules")
    except ImportError as exc:
        print(f"SKIPPED: deepspeed is not importable here ({exc}); run this where DeepSpeed is installed")
        return 0
    import torch.distributed as dist

    engine_cls = importlib.import_module(f"{args.impl}.accumulation").ZeroEngine
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    failures = 0
    try:
        for section in SECTIONS + random_sections(args.seed, args.random):
            theirs = deepspeed_values(section, args.boundaries)
            ours = engine_values(engine_cls, section, args.boundaries)
            first = next((b for b, (t, o) in enumerate(zip(theirs, ours, strict=True)) if t != o), None)
            verdict = "same" if first is None else f"DIFFERS at boundary {first}: deepspeed {theirs[first]} " \
                                                   f"ours {ours[first]}"
            failures += first is not None
            print(f"{section['type']:15s} {section['params']}: {verdict}")
    finally:
        dist.destroy_process_group()
    print(f"{failures} of {len(SECTIONS) + args.random} sections differ ({args.boundaries} boundaries each)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
