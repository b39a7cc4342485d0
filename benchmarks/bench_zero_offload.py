"""ZeRO-Offload side by side: our ZeroEngine vs DeepSpeed ZeRO-Offload vs FSDP2 (+ CPUOffloadPolicy) (issue 16).

One HF ``LlamaForCausalLM`` built from a config (no weights: random init), bf16, AdamW, clipping ``--clip`` (1.0),
world size 1, ``--gas`` micro-batches per step. Each arm runs in its own subprocess (a fresh CUDA context and
allocator, so peak memory and host RSS are the arm's own; a crash or OOM of one arm is reported, not fatal):

- ``ours-s2``, ``ours-s2-offload`` (offload_optimizer cpu), ``ours-s3``, ``ours-s3-offload`` (optimizer and
  parameter offload): :class:`optimized.accumulation.ZeroEngine`; ``ours-s2-offload-dpu``,
  ``ours-s3-offload-dpu``: the offloaded arms with ``delayed_parameter_update`` (docs/accumulation.md R27: the
  CPU Adam of a step overlaps the whole next step, whose weights lag by one update);
- ``ds-z2-offload``, ``ds-z3-offload`` (+ offload_param cpu): DeepSpeed ZeRO with ``offload_optimizer: cpu`` in
  DeepSpeed's default configuration (bf16 gradient accumulation, buckets 5e8), ``-b5e7`` with buckets of 5e7 and
  ``-fp32acc`` with fp32 accumulation (``ds_configs.py`` says what each computes; every row names its
  configuration); our arms accumulate in fp32 unless their name carries ``-bf16acc`` (DeepSpeed's default numerics);
- ``fsdp2``, ``fsdp2-offload``: ``fully_shard`` per decoder layer and the root, bf16 parameters (the same
  arithmetic as the engines' bf16 model with fp32 optimizer state is not available in FSDP2's mixed precision
  policy, so FSDP2 keeps fp32 parameters and computes in bf16 -- the usual FSDP2 recipe), with and without
  ``CPUOffloadPolicy``;
- ``ours-s2-offload-overlap`` (issue 40 item 3, R30): share 0 with ``host_update_start: last_backward`` (each
  bucket's host Adam started under the last backward, redone where the norm clips; the timeline line prints the
  boundaries and buckets redone); ``ours-s2-offload-bf16state-overlap``: both R29 and R30, the configuration
  for a user short of memory;
- ``ours-s2-offload-matched`` (issue 40): our engine at DeepSpeed's GPU memory (the smallest peak of its
  default-numerics arms, issue 49): ``gpu_share: "auto"`` with a
  ``gpu_memory_budget`` of what DeepSpeed's peak leaves above our all-on-the-host arm's peak (see
  :func:`_memory_match`; the arms it needs run first); ``ours-s2-offload-bf16state-matched`` the same with R29's
  bf16 moments (12 instead of 16 bytes per element on the device side: a larger share in the same budget), and
  ``ours-s2-offload-bf16state-overlap-matched`` with R30 too (the host side started under the last backward);
- ``torchao-offload``, ``megatron-offload`` (issue 40): torchao's ``CPUOffloadOptimizer`` and Megatron-Core's
  ``HybridDeviceOptimizer`` (``offload_fraction`` 1.0), each from a plain loop; how each keeps its weights,
  master, gradients and clipping: ``zero_offload_peers.py``.

Reported per arm: step time (mean over ``--steps`` steps run back to back after ``--warmup``; a step = gas
forward/backward + step), tokens/s, peak
GPU memory (``max_memory_allocated``), peak host RSS (``ru_maxrss``) and, for our offloaded arms, the breakdown
of the streamed update (CPU Adam, D2H, H2D on their streams, and the time the training thread waited for the
update), and the model-FLOPs utilisation (``model_flops.py``: 6 N + 12 L h s FLOPs per token over the GPU's dense
bf16 peak, ``--peak-tflops`` or by the device's name). ``--gas 2,8`` runs every arm at each micro-batch count (a
row per arm, model and count). An arm whose package is missing is reported as ``not installed``; one that cannot
run on the device as ``needs cuda``. Output: a side-by-side table on stdout, ``bench_zero_offload.json`` and a plot
``bench_zero_offload.png`` (step time vs peak GPU memory per arm) in ``--out``.

``--mode converge`` trains each arm instead on a learnable synthetic task with a known loss floor (a sparse
bigram chain, ``convergence.py``; fresh, seeded batches every boundary, the same for every arm) and reports per
arm the median step time, the loss after ``--steps`` boundaries and the wall time to reach ``--target``, with the
per-phase timeline of our offloaded arms (compute, exposed wait, and beside them D2H, host Adam, H2D). Its arms by
default: no offload, synchronous offload, the same with bf16 moments (``-bf16state``: ``state_precision: bf16``,
R29; reported as absent on a tree without it), the split update (``-split``: ``gpu_share`` ``--gpu-share``, R28;
reported as absent on a tree without it), the delayed update without and with a warm-up (``-dpu``, ``-dpu-warmup``),
DeepSpeed ZeRO-Offload, the memory-matched arm and the two peers. Each arm's loss curve is compared with the first
arm's, and a ``-bf16state`` arm's with its fp32-moment counterpart's, from ``--compare-from`` (50) on, as
10-boundary running means (``curve_vs`` in the rows; a printed line each). Output:
``bench_zero_offload_converge.{json,csv,png}`` (``plot_convergence.py`` draws the loss against wall time per arm).

``--model`` takes a preset (``tiny``: CPU smoke test; ``886m``: the issue's 886M-parameter model, sequence 2048,
batch 4, gas 2; ``1.5b`` ... ``13b``: the same shape family, larger) or a comma list of presets; with
``--sweep`` the offloaded arms run each model in turn and the table says which was the largest that trained
(``--sweep down`` with the list largest first stops each arm at the first model that trains).

    python benchmarks/bench_zero_offload.py --device cpu --model tiny --out /tmp/bzo
    python benchmarks/bench_zero_offload.py --device cuda --model 886m --out results/
    python benchmarks/bench_zero_offload.py --device cuda --model 886m,1.5b,3b,5b,7b --sweep \\
        --arms ours-s2-offload,ds-z2-offload --steps 3 --out results/
    python benchmarks/bench_zero_offload.py --mode converge --device cpu --model tiny --chain-ids 64 --lr 3e-3 \\
        --steps 60 --target 3.0 --out /tmp/bzc
    python benchmarks/bench_zero_offload.py --device cuda --model 886m --seq 1024 --gas 2,8 --arms \\
        ours-s2,ours-s2-offload,ours-s2-offload-matched,ds-z2-offload,torchao-offload,megatron-offload --out results/
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from convergence import COMPARE_WINDOW, BigramChain, Schedule, Trainer, compare_curves, timeline, train
from ds_configs import DEFAULT_NUMERICS, DS_ARMS, ds_config, variant
from model_flops import peak_tflops, utilisation
from peak_breakdown import PeakRecorder
from peak_breakdown import table as breakdown_table
from zero_offload_peers import FP32_WEIGHT_PEERS, PEER_PACKAGES, build_peer

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    import torch

#: name -> (hidden, layers, heads, intermediate, vocab, seq, batch, gas)
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 176, 512, 32, 2, 2),
    # A CPU-sized model for time-to-loss curves on a development machine (3.7M parameters).
    "small": (256, 4, 4, 688, 1024, 128, 4, 2),
    # 32000 * 2048 * 2 (embeddings + untied head) + 15 * (4 * 2048^2 + 3 * 2048 * 5472 + 2 * 2048) + 2048 = 887M
    "886m": (2048, 15, 16, 5472, 32000, 2048, 4, 2),
    "1.5b": (2560, 18, 20, 6912, 32000, 2048, 4, 2),
    "3b": (3200, 24, 25, 8640, 32000, 2048, 4, 2),
    "5b": (4096, 24, 32, 11008, 32000, 2048, 4, 2),
    # Between 5b and 7b: 18 bytes of host memory per parameter (docs/zero.md) put 7B at the box's edge.
    "6b": (4096, 28, 32, 11008, 32000, 2048, 4, 2),
    "7b": (4096, 32, 32, 11008, 32000, 2048, 4, 2),
    # Issue 40's target for bf16 moments (R29: 14 instead of 18 bytes of host memory per parameter): 8.4B and 9.2B.
    "8b": (4096, 40, 32, 11008, 32000, 2048, 4, 2),
    "9b": (4096, 44, 32, 11008, 32000, 2048, 4, 2),
    "13b": (5120, 40, 40, 13824, 32000, 2048, 4, 2),
}

ARMS = ["ours-s2", "ours-s2-bf16acc", "ours-s2-offload", "ours-s2-offload-bf16acc", "ours-s2-offload-bf16state",
        "ours-s2-offload-overlap", "ours-s2-offload-bf16acc-bf16state-overlap",
        "ours-s2-offload-bf16state-overlap", "ours-s2-offload-split",
        "ours-s2-offload-dpu",
        "ours-s2-offload-dpu-warmup", "ours-s3", "ours-s3-offload", "ours-s3-offload-split", "ours-s3-offload-dpu",
        "ours-s3-offload-dpu-warmup", *DS_ARMS, "fsdp2", "fsdp2-offload",
        "ours-s2-offload-matched", "ours-s2-offload-bf16state-matched", "ours-s2-offload-bf16state-overlap-matched",
        "ours-s2-offload-bf16acc-bf16state-overlap-matched", *PEER_PACKAGES]
#: ``--mode converge``'s arms unless ``--arms`` is given (issue 27 item 6), most telling first: a run cut short by
#: its time box keeps those.
CONVERGE_ARMS = ["ours-s2", "ours-s2-offload", "ours-s2-offload-bf16state", "ours-s2-offload-bf16state-overlap",
                 "ours-s2-offload-split",
                 "ours-s2-offload-dpu-warmup", "ours-s2-offload-dpu", "ds-z2-offload", "ours-s2-offload-matched",
                 *PEER_PACKAGES]
#: The arm-name token of R29's compressed state (``state_precision: bf16``), e.g. ``ours-s2-offload-bf16state``.
BF16_STATE = "-bf16state"
#: The arm-name token of R30's overlapped update (``host_update_start: last_backward``), e.g.
#: ``ours-s2-offload-bf16state-overlap`` (share 0) and ``ours-s2-offload-bf16state-overlap-matched`` (with R28).
OVERLAP = "-overlap"
#: The arm-name suffix of the memory-matched arms (issue 40): ``ours-s2-offload-matched`` and, with R29's bf16
#: moments (12 instead of 16 bytes per element on the split's device side, so a larger share fits the same budget),
#: ``ours-s2-offload-bf16state-matched``. What they need measured before them: our arm with every update on the host
#: (its peak is the base the budget adds to; share 0's GPU memory does not depend on the state precision) and
#: DeepSpeed's (the peak to match; not needed with ``--match-memory-gib``).
MATCHED = "-matched"
MATCH_BASE_ARM = "ours-s2-offload"
#: The arm-name token of accumulation at the model dtype (bf16), DeepSpeed's default numerics (issue 49 item 1):
#: without it our arms accumulate in fp32 (``data_types.grad_accum_dtype: fp32``, R9).
BF16_ACC = "-bf16acc"
#: The files whose frames make an allocation an engine's own (peak_breakdown.py): ours and the peers'.
ENGINE_PATHS = ("/optimized/", "/reference/", "/deepspeed/", "/torchao/", "/megatron/", "zero_offload_peers.py")
#: The ``-dpu-warmup`` arm's undelayed boundaries on a tree whose config has no ``delayed_update_warmup``: the 30
#: ``apply_delayed_update()`` boundaries issue 27 measured.
DEFAULT_MANUAL_WARMUP = 30


def _engine_step(engine, micro: torch.Tensor) -> torch.Tensor:
    """One optimizer step through the DeepSpeed-style surface both ZeroEngine and DeepSpeed's engine offer: a
    forward, ``backward`` and ``step`` per micro-batch of ``micro`` (``[gas, batch, seq]``; the engine decides on
    which call the update happens). Returns the mean of the micro-batch losses, detached (read by the caller)."""
    total = None
    for ids in micro:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach() if total is None else total + loss.detach()
    return total / len(micro)


def _shape(opts, name: str) -> tuple[int, int, int, int]:
    """(vocab, seq, batch, gas) of preset ``name`` with the ``--seq/--batch/--gas`` overrides."""
    _, _, _, _, vocab, seq, batch, gas = MODELS[name]
    return vocab, opts.seq or seq, opts.batch or batch, opts.gas or gas


def _llama(name: str, seq: int):
    """The model, built on the current default device (the child builds it on the GPU: initialising a 5B model's
    random weights on the host took minutes, longer than the arm itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab, _, _, _ = MODELS[name]
    cfg = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def _progress(t0: float, what: str) -> None:
    """One line on stderr per phase of an arm: a time-boxed arm reports how far it got (the parent quotes it)."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def _offload_key_accepted(key: str, value) -> bool:
    """Whether this tree's config takes ``zero_optimization.offload_optimizer.<key>`` (the split update's
    ``gpu_share``, R28, and the delayed update's ``delayed_update_warmup`` arrived after this benchmark): False
    when the config rejects the key as unknown; a value the config rejects otherwise is the caller's error."""
    from reference.contract.accumulation_config import AccumulationConfig
    from reference.contract.errors import ConfigurationError

    off = {"device": "cpu", key: value}
    if key.startswith("delayed_update"):
        off["delayed_parameter_update"] = True
    try:
        AccumulationConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": off}})
    except ConfigurationError as exc:
        if "unknown" in str(exc):
            return False
        raise SystemExit(f"bench_zero_offload.py: {exc}") from None
    return True


def _gpu_share(text: str) -> float | str:
    """``--gpu-share``: "auto" or a number (the config validates its range)."""
    return text if text == "auto" else float(text)


def _ours_zero(arm: str, opts) -> tuple[dict, int]:
    """Our arm's ``zero_optimization`` section, and how many first boundaries get an ``apply_delayed_update()``
    (the ``-dpu-warmup`` arm on a tree whose config has no ``delayed_update_warmup`` yet: the warm-up the issue
    measured by hand)."""
    stage = 2 if "-s2" in arm else 3
    zero: dict = {"stage": stage}
    manual_warmup = 0
    if "-offload" in arm:
        off: dict = {"device": "cpu"}
        if BF16_STATE in arm:  # R29: Adam's moments stored in bf16 (share 0 unless the arm also splits)
            off["state_precision"] = "bf16"
        if OVERLAP in arm:  # R30: the host update started under the boundary's last backward
            off["host_update_start"] = "last_backward"
        if arm.endswith("-split"):
            off["gpu_share"] = _gpu_share(opts.gpu_share)
            if opts.gpu_memory_budget_gib is not None:
                off["gpu_memory_budget"] = int(opts.gpu_memory_budget_gib * 2**30)
            if opts.gpu_memory_limit_gib is not None:  # R28: the engine fits the split under this whole peak
                off["gpu_memory_limit"] = int(opts.gpu_memory_limit_gib * 2**30)
        if arm.endswith(MATCHED):  # the budget the parent derived from the peaks (_memory_match)
            off["gpu_share"] = "auto"
            off["gpu_memory_budget"] = int(opts.match_budget_gib * 2**30)
        if "-dpu" in arm:
            off["delayed_parameter_update"] = True
            warm = opts.dpu_warmup if arm.endswith("-warmup") else 0
            if _offload_key_accepted("delayed_update_warmup", 0):
                if warm is not None:  # None: the warm-up arm runs the engine's default
                    off["delayed_update_warmup"] = warm
            elif arm.endswith("-warmup"):
                manual_warmup = DEFAULT_MANUAL_WARMUP if warm is None else warm
        zero["offload_optimizer"] = off
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return zero, manual_warmup


def _ours_config(arm: str, opts, batch: int, gas: int, zero: dict) -> dict:
    """Our engine's config for ``arm``: bf16, AdamW, clipping, and the accumulation dtype the arm names (fp32
    unless ``-bf16acc``: then the model dtype, DeepSpeed's default numerics)."""
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": gas,
              "gradient_clipping": opts.clip, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.01}}}
    if BF16_ACC not in arm:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _configuration(arm: str) -> str:
    """What the arm's row is configured to compute, in words (every row names its configuration)."""
    if arm.startswith("ds-"):
        return "DeepSpeed: " + variant(arm).label()
    if arm.startswith("ours"):
        return "grad accumulation " + ("bf16 (model dtype)" if BF16_ACC in arm else "fp32")
    return ""


def _current_rss_gib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def _predict_host_memory(arm: str, model_name: str, shape: tuple, opts, row: dict) -> None:
    """Before the model or the engine exists: what the engine's host buffers will take
    (``ZeroEngine.estimate_host_memory`` on the model built on the meta device) plus this process as it is now,
    the prediction the measured peak RSS is printed beside. A tree or config without the estimate says why."""
    import torch

    try:
        from optimized.accumulation import estimate_host_memory
    except ImportError:
        row["host_estimate"] = "not in this tree"
        return
    from reference.contract.errors import ConfigurationError

    zero, _ = _ours_zero(arm, opts)
    if "gpu_share" in zero.get("offload_optimizer", {}):
        row["host_estimate"] = "not estimated (the split's cut is decided at run time)"
        return
    _, _, batch, gas = shape
    with torch.device("meta"):
        meta = _llama(model_name, shape[1])
    try:
        est = estimate_host_memory(meta, _ours_config(arm, opts, batch, gas, zero), device=opts.device)
    except ConfigurationError as exc:
        row["host_estimate"] = f"not estimated: {exc}"
        return
    process = _current_rss_gib()
    row["host_estimate"] = {"buffers_gib": est.total_bytes / 2**30, "process_before_gib": process,
                            "predicted_peak_gib": est.total_bytes / 2**30 + process,
                            "bytes_per_parameter": est.total_bytes / est.parameters}
    _progress(opts.t_start, f"predicted host memory: {est.total_bytes / 2**30:.2f} GiB of engine buffers "
                            f"({est.total_bytes / est.parameters:.1f} B/parameter) + {process:.2f} GiB this process")


def _build_ours(arm: str, model, device, shape: tuple, opts, row: dict) -> Trainer:
    from optimized.accumulation import ZeroEngine
    from reference.contract.envvars import cpu_adam_threads, pin_backend, zero_host_memory

    _, _, batch, gas = shape
    zero, manual_warmup = _ours_zero(arm, opts)
    engine = ZeroEngine(model, _ours_config(arm, opts, batch, gas, zero), device=device)
    row["pin_backend"] = pin_backend()
    row["zero_host_memory"] = zero_host_memory()
    row["adam_threads"] = cpu_adam_threads()
    row["offload_optimizer"] = zero.get("offload_optimizer")
    # What the engine asked to pin; the host RSS column shows what the allocator really took.
    row["host_pinned_requested_gib"] = sum(t.numel() * t.element_size() for t in engine.pinned_buffers()) / 2**30
    if manual_warmup:
        row["dpu_warmup_by"] = (f"apply_delayed_update() after boundaries 1-{manual_warmup} (this config has no "
                                f"delayed_update_warmup)")

    def after_boundary(k: int) -> None:
        if k <= manual_warmup:
            engine.apply_delayed_update()

    def finish() -> None:
        engine.synchronize()
        report = getattr(engine, "split_report", None)  # R28's measurement, where the engine has one
        if callable(report):
            row["split"] = report()
        overlap = getattr(engine, "overlap_report", None)  # R30's redone boundaries, where the engine has them
        if callable(overlap):
            row["overlap"] = overlap()
        try:  # which kernel stepped the device masters (a tree without the fused device Adam has no module)
            from optimized.accumulation import device_adam
        except ImportError:
            return
        row["device_adam"] = {"triton": device_adam.available(), "checks": device_adam.verdicts()}

    return Trainer(step=lambda micro: _engine_step(engine, micro), set_lr=engine.set_lr,
                   after_boundary=after_boundary, timings=engine.offload_timings, finish=finish)


def _build_ds(arm: str, model, shape: tuple, opts) -> Trainer:
    import deepspeed

    _, _, batch, gas = shape
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(arm, gas, batch, opts.lr, opts.clip))

    def set_lr(lr: float) -> None:
        for g in engine.optimizer.param_groups:
            g["lr"] = lr

    return Trainer(step=lambda micro: _engine_step(engine, micro), set_lr=set_lr)


def _build_fsdp2(arm: str, model, device, opts) -> Trainer:
    import torch

    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if arm.endswith("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    else:
        model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01, fused=not arm.endswith("offload"))

    def step(micro: torch.Tensor) -> torch.Tensor:
        total = None
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def set_lr(lr: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr

    return Trainer(step=step, set_lr=set_lr)


def _package_missing(arm: str) -> bool:
    """Whether the package a peer arm needs (DeepSpeed, torchao, Megatron-Core) cannot be imported here."""
    package = "deepspeed" if arm.startswith("ds-") else PEER_PACKAGES.get(arm)
    if package is None:
        return False
    try:
        return importlib.util.find_spec(package) is None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return True


def _child_setup(arm: str, model_name: str, opts, row: dict):
    """Process group, the model (bf16 for the engines, fp32 for FSDP2's and torchao's recipes) and the arm's
    Trainer; None (with ``row["status"]`` set) when the arm cannot run here."""
    import torch
    import torch.distributed as dist

    cuda = opts.device == "cuda"
    if _package_missing(arm):
        row["status"] = "not installed"
        return None
    if arm.startswith(("ds-", "fsdp2", *PEER_PACKAGES)) and not cuda:
        row["status"] = "needs cuda"
        return None
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29600 + os.getpid() % 1000))
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    if arm.startswith("ds-"):
        # The wheel built without ops records the build host's accelerator; pick CUDA explicitly.
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    shape = _shape(opts, model_name)
    # The engines keep bf16 weights (fp32 masters are built from them): build in bf16, which also halves the host
    # memory of model construction; FSDP2's and torchao's recipes keep fp32 parameters (bf16 compute via FSDP2's
    # policy, torchao's under autocast: zero_offload_peers.py).
    default_dtype = torch.get_default_dtype()
    if not arm.startswith(("fsdp2", *FP32_WEIGHT_PEERS)):
        torch.set_default_dtype(torch.bfloat16)
    if arm.startswith("ours"):
        _predict_host_memory(arm, model_name, shape, opts, row)
    # issue 49 item 2: the allocator's trace from before the model exists, replayed after the warm-up
    opts.recorder = PeakRecorder(cuda and getattr(opts, "memory_breakdown", False), ENGINE_PATHS)
    opts.recorder.mark("model")
    _progress(opts.t_start, f"{arm} {model_name}: building the model on {device}")
    try:
        with torch.device(device):
            model = _llama(model_name, shape[1])
    finally:
        torch.set_default_dtype(default_dtype)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    # What the model FLOPs count (model_flops.py): every weight but the input embedding's lookup table.
    row["matmul_parameters"] = row["parameters"] - model.get_input_embeddings().weight.numel()
    _progress(opts.t_start, f"built: {row['parameters']:,} parameters; setting up the engine")
    opts.recorder.mark("engine")
    if arm.startswith("ours"):
        trainer = _build_ours(arm, model, device, shape, opts, row)
    elif arm.startswith("ds-"):
        trainer = _build_ds(arm, model, shape, opts)
    elif arm in PEER_PACKAGES:
        trainer = build_peer(arm, model, opts.lr, opts.clip)
    else:
        trainer = _build_fsdp2(arm, model, device, opts)
    opts.recorder.mark("steps")
    return trainer, device, shape


def _time_steps(trainer: Trainer, micro: torch.Tensor, opts, row: dict) -> None:
    """``--mode step``: ``--warmup`` steps, then ``--steps`` steps run back to back, as in training (our offloaded
    update overlaps the next step's forward), timed as one window: synchronizing after each step would expose the
    overlapped tail in every step."""
    import torch

    cuda = opts.device == "cuda"
    for _ in range(opts.warmup):
        trainer.step(micro)
    trainer.finish()
    recorder = getattr(opts, "recorder", None)
    if recorder is not None and recorder.enabled:  # the warm-up's peak, by category; the timed steps run unrecorded
        row["peak_breakdown"] = recorder.result()
    _progress(opts.t_start, "warm-up done; timing")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if trainer.timings is not None:
        trainer.timings()  # drop the warm-up's share
    t0 = time.perf_counter()
    for _ in range(opts.steps):
        last = trainer.step(micro)
    trainer.finish()
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / opts.steps
    timings = (trainer.timings() if trainer.timings is not None else None) or {}
    row.update(step_ms=step_s * 1e3, tokens_per_s=micro.numel() / step_s, last_loss=float(last))
    if timings:
        row["breakdown_ms"] = {k.removesuffix("_s"): v / opts.steps * 1e3 for k, v in timings.items()}
        row["timeline_ms"] = timeline(timings, [step_s] * opts.steps)


def _converge(trainer: Trainer, device, shape: tuple, opts, row: dict) -> None:
    """``--mode converge``: train on the bigram chain (convergence.py) and record the curve and time to target."""
    import torch

    vocab, seq, batch, gas = shape
    task = BigramChain(vocab, opts.chain_ids, opts.successors, opts.seed)
    data = task.batches(opts.steps, gas, batch, seq).to(device)
    schedule = Schedule(steps=opts.steps, lr=opts.lr, lr_warmup=opts.lr_warmup, target=opts.target,
                        smooth=opts.smooth, arm_seconds=opts.arm_seconds)
    cuda = opts.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row.update(train(trainer, data, schedule, sync))
    row["loss_floor"] = task.loss_floor
    if row.get("mean_step_ms"):
        row["tokens_per_s"] = batch * seq * gas / (row["mean_step_ms"] / 1e3)


def _child(arm: str, model_name: str, opts, out_file: str) -> None:
    """One arm in this process; writes a JSON row to ``out_file``."""
    opts.t_start = time.perf_counter()
    row: dict = {"arm": arm, "configuration": _configuration(arm), "model": model_name, "device": opts.device,
                 "mode": opts.mode}
    setup = _child_setup(arm, model_name, opts, row)
    if setup is None:
        Path(out_file).write_text(json.dumps(row))
        return
    import torch
    import torch.distributed as dist

    trainer, device, shape = setup
    vocab, seq, batch, gas = shape
    row.update(seq=seq, batch=batch, gas=gas, setup_s=time.perf_counter() - opts.t_start)
    _progress(opts.t_start, f"engine ready; {opts.mode}")
    if opts.mode == "converge":
        _converge(trainer, device, shape, opts, row)
    else:
        gen = torch.Generator().manual_seed(1)
        micro = torch.randint(0, vocab, (gas, batch, seq), generator=gen).to(device)
        _time_steps(trainer, micro, opts, row)
    cuda = opts.device == "cuda"
    row.update(status="ok", steps=opts.steps, warmup=opts.warmup,
               peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
               host_rss_peak_gib=_rss_peak_gib())
    row["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    hidden, layers = MODELS[model_name][:2]
    utilisation(row, layers, hidden, opts.peak_tflops or peak_tflops(row["gpu"]))
    Path(out_file).write_text(json.dumps(row))
    dist.destroy_process_group()


def _run_arm(arm: str, model: str, args, gas: int, extra: dict | None = None) -> dict:
    """Arm ``arm`` on preset ``model`` at ``gas`` micro-batches per step in a subprocess; ``extra`` adds options
    for the child (the matched arm's budget). Returns its row (a failure's too), keyed by arm, model and gas."""
    row = _run_child(arm, model, args, {"gas": gas, **(extra or {})})
    row.setdefault("gas", gas)
    return row


def _run_child(arm: str, model: str, args, child_opts: dict) -> dict:
    if arm.endswith("-split") and not _offload_key_accepted("gpu_share", _gpu_share(args.gpu_share)):
        return {"arm": arm, "model": model, "status": "no split update (config has no gpu_share: R28)"}
    if BF16_STATE in arm and not _offload_key_accepted("state_precision", "bf16"):
        return {"arm": arm, "model": model, "status": "no compressed state (config has no state_precision: R29)"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        opts = os.path.join(tmp, "opts.json")
        Path(opts).write_text(json.dumps({**vars(args), **child_opts}))
        cmd = [sys.executable, __file__, "--child", arm, "--model", model, "--child-opts", opts, "--child-out", out]
        env = dict(os.environ)
        if args.pin_backend:
            from reference.contract.envvars import PIN_BACKEND_ENV

            env[PIN_BACKEND_ENV] = args.pin_backend
        if args.adam_threads:
            from reference.contract.envvars import CPU_ADAM_THREADS_ENV

            env[CPU_ADAM_THREADS_ENV] = str(args.adam_threads)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return {"arm": arm, "model": model, "status": f"timeout after {args.timeout}s",
                    "error": " | ".join(err.strip().splitlines()[-3:])}
        if os.path.exists(out):
            row = json.loads(Path(out).read_text())
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            oom = any("out of memory" in line.lower() or "OutOfMemory" in line for line in tail)
            if oom:
                status = "OOM"
            elif proc.returncode == -9:
                # Nothing in the arm sends SIGKILL; on the H200 box (no swap) the kernel's OOM killer did, when
                # the host memory ran out (run L, docs/benchmarks.md): the arm cannot say so itself.
                status = "killed (SIGKILL: host memory?)"
            else:
                status = f"failed (rc {proc.returncode})"
            row = {"arm": arm, "model": model, "status": status, "error": " | ".join(tail)}
        row["wall_s"] = time.perf_counter() - t0
        return row


def _memory_match(rows: list[dict], model: str, gas: int, args) -> dict:
    """The matched arm's budget at (model, gas): ``gpu_memory_budget`` counts only the device side of the split
    (16 bytes per element on the GPU, docs/accumulation.md R28), so matching DeepSpeed's peak GPU memory means a
    budget of what that peak leaves above our peak with everything on the host (share 0), both measured on this
    shape in this run (DeepSpeed's peak may be given instead: ``--match-memory-gib``). Setting the budget to
    DeepSpeed's whole peak would put that much *beside* the share-0 arm's own memory, about twice DeepSpeed's
    (that reading is ``--arms ours-s2-offload-split --gpu-memory-budget-gib PEAK``).
    Returns the row fields: ``match_budget_gib`` (None, with ``match_error``, when a peak is missing); a target at
    or below the base gives a budget of 0 ("auto" then keeps everything on the host)."""

    def peak(arm: str) -> float | None:
        for r in rows:
            if (r["arm"], r["model"], r.get("gas")) == (arm, model, gas) and r.get("peak_gpu_gib") is not None:
                return r["peak_gpu_gib"]
        return None

    measured = {a: peak(a) for a in DEFAULT_NUMERICS if peak(a) is not None}
    target_arm = min(measured, key=measured.get) if measured else None
    matched = args.match_memory_gib if args.match_memory_gib is not None else measured.get(target_arm)
    # issue 40's memory target is "<= 1.1x DeepSpeed's peak": --match-memory-factor 1.1 measures at that bound
    target = None if matched is None else matched * args.match_memory_factor
    base = peak(MATCH_BASE_ARM)
    info = {"match_target_gib": target, "match_target_from": "--match-memory-gib" if args.match_memory_gib
            is not None else f"{target_arm} (the smallest peak of {', '.join(DEFAULT_NUMERICS)} measured)",
            "match_factor": args.match_memory_factor, "match_base_gib": base, "match_budget_gib": None}
    if target is None or base is None:
        missing = MATCH_BASE_ARM if base is None else " or ".join(DEFAULT_NUMERICS)
        info["match_error"] = (f"no peak GPU memory from {missing} at {model}, gas {gas} (not run, failed or on "
                               f"the cpu) to match" + ("" if base is None else "; give --match-memory-gib"))
        return info
    info["match_budget_gib"] = max(0.0, target - base)
    return info


def _with_match_prerequisites(arms: list[str], args) -> list[str]:
    """``arms`` in run order: the arms the matched arms read (:func:`_memory_match`) moved or added before the
    first of them."""
    matched = [a for a in arms if a.endswith(MATCHED)]
    if not matched:
        return arms
    needs = [MATCH_BASE_ARM] + (list(DEFAULT_NUMERICS) if args.match_memory_gib is None else [])
    added = [a for a in needs if a not in arms]
    if added:
        print(f"  {', '.join(matched)} need(s) {', '.join(added)} measured first: added", flush=True)
    rest = [a for a in arms if a not in needs]
    i = rest.index(matched[0])
    before = [a for a in arms if a in needs] + added
    return rest[:i] + before + rest[i:]


def _run_matched(arm: str, model: str, args, gas: int, rows: list[dict]) -> dict:
    """Matched ``arm`` at (model, gas), its budget taken from the peaks measured before it."""
    info = _memory_match(rows, model, gas, args)
    if info["match_budget_gib"] is None:
        return {"arm": arm, "model": model, "gas": gas, "status": "nothing to match",
                "error": info["match_error"], **info}
    row = _run_arm(arm, model, args, gas, {"match_budget_gib": info["match_budget_gib"]})
    row.update(info)
    if row.get("peak_gpu_gib") is not None and info["match_target_gib"]:
        row["peak_vs_match_target"] = row["peak_gpu_gib"] / info["match_target_gib"]
    return row


def _fmt(r: dict, key: str, fmt: str) -> str:
    v = r.get(key)
    return "" if v is None else format(v, fmt)


def _mfu(r: dict) -> str:
    """MFU in per cent, or the model TFLOP/s where the device's peak is unknown (model_flops.py)."""
    if r.get("mfu") is not None:
        return f"{r['mfu'] * 100:.1f} %"
    return f"({r['model_tflops_per_s']:.3g} TFLOP/s)" if r.get("model_tflops_per_s") is not None else ""


def _table(rows: list[dict]) -> str:
    head = ("arm", "configuration", "model", "gas", "status", "step ms", "tokens/s", "MFU", "peak GPU GiB",
            "host RSS GiB", "pinned asked GiB", "breakdown ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bd = r.get("breakdown_ms")
        bd_text = ", ".join(f"{k} {v:.1f}" for k, v in bd.items()) if bd else ""
        lines.append("| " + " | ".join([r["arm"], r.get("configuration", ""), r["model"], _fmt(r, "gas", "d"),
                                          r["status"], _fmt(r, "step_ms", ".1f"), _fmt(r, "tokens_per_s", ".0f"),
                                          _mfu(r),
                                          _fmt(r, "peak_gpu_gib", ".2f"),
                                          _fmt(r, "host_rss_peak_gib", ".2f"),
                                          _fmt(r, "host_pinned_requested_gib", ".2f"), bd_text]) + " |")
    return "\n".join(lines)


def _converge_table(rows: list[dict]) -> str:
    head = ("arm", "model", "gas", "status", "boundaries", "median step ms", "tokens/s", "MFU", "loss after N",
            "time to target s", "boundaries to target", "peak GPU GiB", "setup s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        reached = r.get("time_to_target_s")
        to_target = format(reached, ".1f") if reached is not None else ("not reached" if "curve" in r else "")
        lines.append("| " + " | ".join([r["arm"], r["model"], _fmt(r, "gas", "d"), r["status"],
                                          _fmt(r, "boundaries", "d"), _fmt(r, "median_step_ms", ".1f"),
                                          _fmt(r, "tokens_per_s", ".0f"), _mfu(r), _fmt(r, "final_loss", ".3f"),
                                          to_target, _fmt(r, "steps_to_target", "d"), _fmt(r, "peak_gpu_gib", ".2f"),
                                          _fmt(r, "setup_s", ".1f")]) + " |")
    return "\n".join(lines)


def _curve_comparisons(rows: list[dict], start: int) -> str:
    """``--mode converge``: each arm's loss curve against the first arm's (the exact path, e.g. no offload) and a
    ``-bf16state`` arm's against its fp32-moment counterpart (the same name without the token, else share 0 with
    fp32 moments), from boundary ``start`` on (issue 40: "within 1 % of the fp32-state curve from boundary 50").
    Stored in each row as ``curve_vs``; the lines say what two arms of the same arithmetic differ by too, the run's
    noise."""
    curves = {r["arm"]: r["curve"] for r in rows if r.get("curve")}
    if len(curves) < 2:
        return ""
    first = next(iter(curves))
    lines = []
    for r in rows:
        arm = r["arm"]
        if arm not in curves or arm == first:
            continue
        others = [first]
        if BF16_STATE in arm:
            fp32 = arm.replace(BF16_STATE, "")
            fp32 = fp32 if fp32 in curves else MATCH_BASE_ARM
            if fp32 in curves and fp32 not in others:
                others.append(fp32)
        r["curve_vs"] = {o: compare_curves(curves[arm], curves[o], start) for o in others}
        parts = [f"vs {o}: mean {c['mean_pct']:.2f} %, max {c['max_pct']:.2f} % (boundary {c['max_at']})"
                 for o, c in r["curve_vs"].items() if c is not None]
        if parts:
            lines.append(f"  {arm} ({r['model']}) loss curve from boundary {start} ({COMPARE_WINDOW}-boundary means) "
                         + "; ".join(parts))
    return "\n".join(lines)


def _timelines(rows: list[dict]) -> str:
    """Item 3 of issue 27: per arm, where a boundary's time went (engines that report ``offload_timings``)."""
    lines = []
    for r in rows:
        t = r.get("timeline_ms")
        if t:
            lines.append(f"  {r['arm']} ({r['model']}, gas {r.get('gas')}) per boundary: step {t['step']:.1f} ms "
                         f"= compute {t['compute']:.1f} (model {t.get('model', t['compute']):.1f} + gradient tail "
                         f"{t.get('grad_exposed', 0.0):.1f} + device Adam {t.get('device_adam', 0.0):.1f}) + "
                         f"exposed wait {t['exposed_wait']:.1f} (GPU idle in it {t.get('gpu_idle', 0.0):.1f}); "
                         f"beside it: D2H {t['d2h']:.1f}, gradient "
                         f"up {t.get('grad_up', 0.0):.1f}, host add {t.get('host_add', 0.0):.1f}, "
                         f"host Adam {t['host_adam']:.1f} "
                         f"({t.get('host_adam_gbps', 0.0):.1f} GB/s), H2D {t['h2d']:.1f}")
        if r.get("split"):
            lines.append(f"  {r['arm']} ({r['model']}) split: {r['split']}")
        h = r.get("host_estimate")
        if isinstance(h, dict):
            lines.append(f"  {r['arm']} ({r['model']}) host memory: predicted before construction "
                         f"{h['predicted_peak_gib']:.2f} GiB ({h['buffers_gib']:.2f} of engine buffers, "
                         f"{h['bytes_per_parameter']:.1f} B/parameter, + {h['process_before_gib']:.2f} process), "
                         f"measured peak RSS {_fmt(r, 'host_rss_peak_gib', '.2f')} GiB")
        elif h:
            lines.append(f"  {r['arm']} ({r['model']}) host memory: {h}")
        o = r.get("overlap")
        if o:
            lines.append(f"  {r['arm']} ({r['model']}, gas {r.get('gas')}) update under the last backward: "
                         f"{o['boundaries_redone']} of {o['boundaries_speculated']} boundaries redone "
                         f"({o['buckets_redone']} of {o['buckets_speculated']} buckets; "
                         f"{o['speculations_discarded']} discarded; "
                         f"{o.get('boundaries_not_speculated', 0)} not speculated after a clipped one), "
                         "warm-up included")
        if r.get("dpu_warmup_by"):
            lines.append(f"  {r['arm']} ({r['model']}) warm-up: {r['dpu_warmup_by']}")
        if r.get("match_budget_gib") is not None:
            ratio = r.get("peak_vs_match_target")
            lines.append(f"  {r['arm']} ({r['model']}, gas {r['gas']}) matched: peak to match "
                         f"{r['match_target_gib']:.2f} GiB ({r.get('match_factor', 1.0):g}x "
                         f"{r['match_target_from']}) - share-0 peak "
                         f"{r['match_base_gib']:.2f} GiB ({MATCH_BASE_ARM}) = gpu_memory_budget "
                         f"{r['match_budget_gib']:.2f} GiB" + (f"; its peak {ratio:.2f}x the peak to match"
                                                              if ratio is not None else ""))
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> bool:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("peak_gpu_gib") is not None]
    if not ok or importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        ax.scatter(r["peak_gpu_gib"], r["step_ms"], s=40)
        ax.annotate(f"{r['arm']} ({r['model']}, gas {r.get('gas')})", (r["peak_gpu_gib"], r["step_ms"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("ZeRO offload: step time vs GPU memory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


def _write_results(out: Path, rows: list[dict], args) -> Path:
    """``bench_zero_offload.json`` (``--mode step``) or ``bench_zero_offload_converge.json`` and ``.csv`` (one
    line per arm and boundary: arm, model, gas, boundary, wall_s, loss) in ``out``: the run's metadata and every row
    measured so far (rewritten after every arm, so a run cut short by an outer time box keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "argv": sys.argv, "mode": args.mode}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if args.mode == "step":
        path = out / "bench_zero_offload.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return path
    meta["task"] = {"kind": "bigram chain", "chain_ids": args.chain_ids, "successors": args.successors,
                    "seed": args.seed, "loss_floor": math.log(args.successors), "lr": args.lr,
                    "lr_warmup": args.lr_warmup, "target": args.target, "smooth": args.smooth}
    path = out / "bench_zero_offload_converge.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out / "bench_zero_offload_converge.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arm", "model", "gas", "boundary", "wall_s", "loss"])
        for r in rows:
            for k, wall, loss in r.get("curve", []):
                w.writerow([r["arm"], r["model"], r.get("gas"), k, f"{wall:.4f}", f"{loss:.5f}"])
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["step", "converge"], default="step",
                    help="step: step time and memory on fixed random batches; converge: time to a target loss on "
                         "the bigram-chain task (convergence.py), fresh batches every boundary")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default="886m", help=f"preset or comma list of presets: {', '.join(MODELS)}")
    ap.add_argument("--arms", default=None, help=f"comma list of: {', '.join(ARMS)} (default: every arm in step "
                                                 f"mode; {', '.join(CONVERGE_ARMS)} in converge mode)")
    ap.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    ap.add_argument("--batch", type=int, default=None, help="override the preset's micro-batch size")
    ap.add_argument("--gas", default=None,
                    help="micro-batches per step (gradient accumulation): a count or a comma list of counts "
                         "(e.g. 2,8: every arm runs at each, a row per count); default: the preset's")
    ap.add_argument("--sweep", nargs="?", const="up", choices=["up", "down"], default=None,
                    help="run the arms over the --model list in order. up (the default): each arm stops at its "
                         "first failure; down (list the models largest first): each arm stops at its first "
                         "success, so a box that fits only the smaller models does not spend its time on each")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (step mode, default 5) or boundaries trained (converge mode, default 200)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (step mode)")
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-5 step, 3e-4 converge)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient clipping (max global norm) of every arm (default 1.0; R30's speculation stands "
                         "only on boundaries that do not clip: a large value shows its best case)")
    ap.add_argument("--lr-warmup", type=int, default=0, help="boundaries of linear LR warm-up (converge mode)")
    ap.add_argument("--target", type=float, default=2.0, help="target loss (converge mode; floor: ln successors)")
    ap.add_argument("--smooth", type=int, default=5,
                    help="the target counts as reached when the mean loss of this many boundaries is <= it, and "
                         "'loss after N' is the mean of the last this many (converge mode)")
    ap.add_argument("--compare-from", type=int, default=50,
                    help="the loss curves are compared from this boundary on (converge mode; issue 40: 50)")
    ap.add_argument("--chain-ids", type=int, default=1024, help="token ids the bigram chain uses (converge mode)")
    ap.add_argument("--successors", type=int, default=4, help="successors per id (converge mode)")
    ap.add_argument("--seed", type=int, default=0, help="the bigram chain's and its batches' seed (converge mode)")
    ap.add_argument("--arm-seconds", type=float, default=None,
                    help="stop an arm once it has trained this long (converge mode; its row says so)")
    ap.add_argument("--gpu-share", default="auto",
                    help="the -split arms' offload_optimizer.gpu_share: 'auto' or a share in [0, 1] (R28)")
    ap.add_argument("--gpu-memory-budget-gib", type=float, default=None,
                    help="the -split arms' offload_optimizer.gpu_memory_budget, GiB (default: the engine's)")
    ap.add_argument("--gpu-memory-limit-gib", type=float, default=None,
                    help="the -split arms' offload_optimizer.gpu_memory_limit, GiB: a limit on the engine's whole "
                         "peak GPU memory, fitted by gpu_share 'auto' from the floor it measures (R28; not with "
                         "--gpu-memory-budget-gib or a numeric --gpu-share)")
    ap.add_argument("--match-memory-gib", type=float, default=None,
                    help=f"the peak GPU memory the {MATCHED} arms are matched to, GiB (default: the smallest peak of "
                         f"{', '.join(DEFAULT_NUMERICS)} (DeepSpeed's default numerics) measured in this run at the "
                         "same model and gas)")
    ap.add_argument("--memory-breakdown", action="store_true",
                    help="record the CUDA allocator's trace through the warm-up and print what each arm's peak is "
                         "made of (peak_breakdown.py); the timed steps run unrecorded")
    ap.add_argument("--match-memory-factor", type=float, default=1.0,
                    help="the matched arms' peak to match is this times --match-memory-gib (or the measured peak): "
                         "1.1 measures at issue 40's bound of 1.1x DeepSpeed's peak (default 1.0: equal memory)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak for the MFU column, TFLOP/s (default: by the device's name, "
                         "model_flops.py: H100 SXM and H200 989, H100 NVL 835, H100 PCIe 756, A100 312)")
    ap.add_argument("--dpu-warmup", type=int, default=None,
                    help="the -dpu-warmup arm's undelayed boundaries (default: the engine's delayed_update_warmup "
                         f"default; {DEFAULT_MANUAL_WARMUP} by apply_delayed_update() on a tree without that key). "
                         "The -dpu arm always runs without a warm-up")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per arm subprocess")
    ap.add_argument("--pin-backend", choices=["torch", "native"], default=None,
                    help="HOSTOFFLOAD_PIN_BACKEND for the arms (default: as set in the environment, else torch). "
                         "The engine's own buffers are pinned at their exact size whatever this says, unless "
                         "HOSTOFFLOAD_ZERO_HOST_MEMORY=pin_backend (docs/zero.md, 'Host memory')")
    ap.add_argument("--adam-threads", type=int, default=None,
                    help="HOSTOFFLOAD_CPU_ADAM_THREADS for our arms (default: the cores the process may use). "
                         "With the delayed update (R27) the CPU Adam shares the host with a running step: fewer "
                         "threads may leave the training thread a core")
    ap.add_argument("--out", default=None, help="directory for the JSON (CSV in converge mode) and the plot")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-opts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap


def _check_args(ap: argparse.ArgumentParser, args) -> tuple[list[str], list[str]]:
    """Defaults that depend on the mode, and every option checked (naming it and its allowed values)."""
    converge = args.mode == "converge"
    if args.steps is None:
        args.steps = 200 if converge else 5
    if args.lr is None:
        args.lr = 3e-4 if converge else 1e-5
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    arms = [a.strip() for a in (args.arms or ",".join(CONVERGE_ARMS if converge else ARMS)).split(",") if a.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"--model {m!r}: allowed values: {', '.join(MODELS)}")
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms {a!r}: allowed values: {', '.join(ARMS)}")
    for name in ("steps", "warmup", "smooth", "chain_ids", "successors"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed values: an int >= 1")
    for name in ("seq", "batch", "adam_threads", "dpu_warmup"):
        value, low = getattr(args, name), 0 if name == "dpu_warmup" else 1
        if value is not None and value < low:
            ap.error(f"--{name.replace('_', '-')} {value}: allowed values: an int >= {low}")
    try:
        args.gas_counts = [int(g) for g in args.gas.split(",") if g.strip()] if args.gas else [None]
    except ValueError:
        args.gas_counts = []
    if not args.gas_counts or any(g is not None and g < 1 for g in args.gas_counts):
        ap.error(f"--gas {args.gas!r}: allowed values: an int >= 1 or a comma list of them")
    for name in ("match_memory_gib", "match_memory_factor", "peak_tflops"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            ap.error(f"--{name.replace('_', '-')} {value}: allowed values: a number > 0")
    if args.lr_warmup < 0 or not args.lr >= 0:
        ap.error("--lr and --lr-warmup: allowed values: numbers >= 0")
    if args.gpu_share != "auto":
        try:
            float(args.gpu_share)
        except ValueError:
            ap.error(f"--gpu-share {args.gpu_share!r}: allowed values: 'auto' or a number in [0, 1]")
    if converge and args.sweep:
        ap.error("--sweep: allowed in --mode step only")
    return models, _with_match_prerequisites(arms, args)


def _report(rows: list[dict], args) -> None:
    if args.sweep:
        size = list(MODELS)  # presets are listed smallest first
        for arm in dict.fromkeys(r["arm"] for r in rows):
            ok = sorted((r for r in rows if r["arm"] == arm and r["status"] == "ok"),
                        key=lambda r: size.index(r["model"]))
            print(f"  largest model that trained with {arm}: {ok[-1]['model'] if ok else 'none'}"
                  + (f" (host RSS {ok[-1]['host_rss_peak_gib']:.1f} GiB)" if ok else ""))
    print(_converge_table(rows) if args.mode == "converge" else _table(rows))
    text = "\n".join(t for t in (_timelines(rows), breakdown_table(rows)) if t)
    if args.mode == "converge":
        text = "\n".join(t for t in (text, _curve_comparisons(rows, args.compare_from)) if t)
    if text:
        print(text)
    for r in rows:
        if r.get("error") or r.get("stopped"):
            print(f"  {r['arm']} ({r['model']}): {r.get('error') or r.get('stopped')}")
    if not args.out:
        return
    out = Path(args.out)
    path = _write_results(out, rows, args)
    if args.mode == "converge":
        if importlib.util.find_spec("matplotlib") is not None:
            from plot_convergence import plot

            plot(json.loads(path.read_text()), out / "bench_zero_offload_converge.png")
            print(f"plot: {out / 'bench_zero_offload_converge.png'}")
        else:
            print(f"no plot: matplotlib is missing (later: python benchmarks/plot_convergence.py {path} OUT.png)")
    elif _plot(rows, out / "bench_zero_offload.png"):
        print(f"plot: {out / 'bench_zero_offload.png'}")
    else:
        print("no plot: no arm reported GPU memory (a cpu run), or matplotlib is missing")


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if args.child:
        opts = argparse.Namespace(**json.loads(Path(args.child_opts).read_text()))
        _child(args.child, args.model, opts, args.child_out)
        return
    models, arms = _check_args(ap, args)
    if importlib.util.find_spec("transformers") is None:
        sys.exit("bench_zero_offload.py needs transformers (pip install 'hostoffload[hf]')")
    rows = []
    for arm in arms:
        for gas_count in args.gas_counts:
            for m in models:
                gas = gas_count or MODELS[m][7]
                row = (_run_matched(arm, m, args, gas, rows) if arm.endswith(MATCHED)
                       else _run_arm(arm, m, args, gas))
                rows.append(row)
                step = row.get("median_step_ms", row.get("step_ms"))
                extra = f"  loss {row['final_loss']:.3f}" if "final_loss" in row else ""
                print(f"  {arm:<26} {m:<6} gas {gas:<3} {row['status']:<14} "
                      f"{step if step is not None else float('nan'):9.1f} ms" + extra, flush=True)
                if args.out:
                    _write_results(Path(args.out), rows, args)
                if (args.sweep == "up" and row["status"] != "ok") or (args.sweep == "down" and row["status"] == "ok"):
                    break
    _report(rows, args)


if __name__ == "__main__":
    main()
