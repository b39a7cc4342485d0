"""ZeRO-Offload side by side: our ZeroEngine vs DeepSpeed ZeRO-Offload vs FSDP2 (+ CPUOffloadPolicy) (issue 16).

This file is the driver (each arm in a subprocess, the time box, the options); what an arm is and how it is built
lives in ``zero_offload_arms.py``, the memory matching in ``zero_offload_match.py``, what is printed and written in
``zero_offload_report.py``, the issue-40 peers in ``zero_offload_peers.py``.

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
  :func:`memory_match`; the arms it needs run first); ``ours-s2-offload-bf16state-matched`` the same with R29's
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
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from convergence import BigramChain, Schedule, Trainer, timeline, train
from ds_configs import DEFAULT_NUMERICS
from model_flops import peak_tflops, utilisation
from peak_breakdown import PeakRecorder
from zero_offload_arms import (
    ARMS,
    BF16_STATE,
    CONVERGE_ARMS,
    DEFAULT_MANUAL_WARMUP,
    ENGINE_PATHS,
    MATCHED,
    MODELS,
    build_ds,
    build_fsdp2,
    build_ours,
    configuration,
    gpu_share,
    llama,
    offload_key_accepted,
    package_missing,
    predict_host_memory,
    preset_shape,
    progress,
    rss_peak_gib,
)
from zero_offload_match import memory_match, with_match_prerequisites
from zero_offload_peers import FP32_WEIGHT_PEERS, PEER_PACKAGES, build_peer
from zero_offload_report import report, write_results

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    import torch


def _child_setup(arm: str, model_name: str, opts, row: dict):
    """Process group, the model (bf16 for the engines, fp32 for FSDP2's and torchao's recipes) and the arm's
    Trainer; None (with ``row["status"]`` set) when the arm cannot run here."""
    import torch
    import torch.distributed as dist

    cuda = opts.device == "cuda"
    if package_missing(arm):
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
    shape = preset_shape(opts, model_name)
    # The engines keep bf16 weights (fp32 masters are built from them): build in bf16, which also halves the host
    # memory of model construction; FSDP2's and torchao's recipes keep fp32 parameters (bf16 compute via FSDP2's
    # policy, torchao's under autocast: zero_offload_peers.py).
    default_dtype = torch.get_default_dtype()
    if not arm.startswith(("fsdp2", *FP32_WEIGHT_PEERS)):
        torch.set_default_dtype(torch.bfloat16)
    if arm.startswith("ours"):
        predict_host_memory(arm, model_name, shape, opts, row)
    # issue 49 item 2: the allocator's trace from before the model exists, replayed after the warm-up
    opts.recorder = PeakRecorder(cuda and getattr(opts, "memory_breakdown", False), ENGINE_PATHS)
    opts.recorder.mark("model")
    progress(opts.t_start, f"{arm} {model_name}: building the model on {device}")
    try:
        with torch.device(device):
            model = llama(model_name, shape[1])
    finally:
        torch.set_default_dtype(default_dtype)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    # What the model FLOPs count (model_flops.py): every weight but the input embedding's lookup table.
    row["matmul_parameters"] = row["parameters"] - model.get_input_embeddings().weight.numel()
    progress(opts.t_start, f"built: {row['parameters']:,} parameters; setting up the engine")
    opts.recorder.mark("engine")
    if arm.startswith("ours"):
        trainer = build_ours(arm, model, device, shape, opts, row)
    elif arm.startswith("ds-"):
        trainer = build_ds(arm, model, shape, opts)
    elif arm in PEER_PACKAGES:
        trainer = build_peer(arm, model, opts.lr, opts.clip)
    else:
        trainer = build_fsdp2(arm, model, device, opts)
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
    progress(opts.t_start, "warm-up done; timing")
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
        row["breakdown_ms"] = {k.removesuffix("_s"): v / opts.steps * 1e3 for k, v in timings.items()
                               if k.endswith("_s")}
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
    row: dict = {"arm": arm, "configuration": configuration(arm), "model": model_name, "device": opts.device,
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
    progress(opts.t_start, f"engine ready; {opts.mode}")
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
               host_rss_peak_gib=rss_peak_gib())
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
    if arm.endswith("-split") and not offload_key_accepted("gpu_share", gpu_share(args.gpu_share)):
        return {"arm": arm, "model": model, "status": "no split update (config has no gpu_share: R28)"}
    if BF16_STATE in arm and not offload_key_accepted("state_precision", "bf16"):
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


def _run_matched(arm: str, model: str, args, gas: int, rows: list[dict]) -> dict:
    """Matched ``arm`` at (model, gas), its budget taken from the peaks measured before it."""
    info = memory_match(rows, model, gas, args)
    if info["match_budget_gib"] is None:
        return {"arm": arm, "model": model, "gas": gas, "status": "nothing to match",
                "error": info["match_error"], **info}
    row = _run_arm(arm, model, args, gas, {"match_budget_gib": info["match_budget_gib"]})
    row.update(info)
    if row.get("peak_gpu_gib") is not None and info["match_target_gib"]:
        row["peak_vs_match_target"] = row["peak_gpu_gib"] / info["match_target_gib"]
    return row


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
    return models, with_match_prerequisites(arms, args)


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
                    write_results(Path(args.out), rows, args)
                if (args.sweep == "up" and row["status"] != "ok") or (args.sweep == "down" and row["status"] == "ok"):
                    break
    report(rows, args)


if __name__ == "__main__":
    main()
