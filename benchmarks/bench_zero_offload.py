"""ZeRO-Offload side by side: our ZeroEngine vs DeepSpeed ZeRO-Offload vs FSDP2 (+ CPUOffloadPolicy) (issue 16).

One HF ``LlamaForCausalLM`` built from a config (no weights: random init), bf16, AdamW, clipping 1.0, world size
1, ``--gas`` micro-batches per step. Each arm runs in its own subprocess (a fresh CUDA context and allocator, so
peak memory and host RSS are the arm's own; a crash or OOM of one arm is reported, not fatal):

- ``ours-s2``, ``ours-s2-offload`` (offload_optimizer cpu), ``ours-s3``, ``ours-s3-offload`` (optimizer and
  parameter offload): :class:`optimized.accumulation.ZeroEngine`; ``ours-s2-offload-dpu``,
  ``ours-s3-offload-dpu``: the offloaded arms with ``delayed_parameter_update`` (docs/accumulation.md R27: the
  CPU Adam of a step overlaps the whole next step, whose weights lag by one update);
- ``ds-z2-offload``, ``ds-z3-offload`` (+ offload_param cpu): DeepSpeed ZeRO with ``offload_optimizer: cpu``;
- ``fsdp2``, ``fsdp2-offload``: ``fully_shard`` per decoder layer and the root, bf16 parameters (the same
  arithmetic as the engines' bf16 model with fp32 optimizer state is not available in FSDP2's mixed precision
  policy, so FSDP2 keeps fp32 parameters and computes in bf16 -- the usual FSDP2 recipe), with and without
  ``CPUOffloadPolicy``.

Reported per arm: step time (mean over ``--steps`` steps run back to back after ``--warmup``; a step = gas
forward/backward + step), tokens/s, peak
GPU memory (``max_memory_allocated``), peak host RSS (``ru_maxrss``) and, for our offloaded arms, the breakdown
of the streamed update (CPU Adam, D2H, H2D on their streams, and the time the training thread waited for the
update). An arm whose package is missing is reported as ``not installed``; one that cannot run on the device as
``needs cuda``. Output: a side-by-side table on stdout, ``bench_zero_offload.json`` and a plot
``bench_zero_offload.png`` (step time vs peak GPU memory per arm) in ``--out``.

``--model`` takes a preset (``tiny``: CPU smoke test; ``886m``: the issue's 886M-parameter model, sequence 2048,
batch 4, gas 2; ``1.5b`` ... ``13b``: the same shape family, larger) or a comma list of presets; with
``--sweep`` the offloaded arms run each model in turn and the table says which was the largest that trained
(``--sweep down`` with the list largest first stops each arm at the first model that trains).

    python benchmarks/bench_zero_offload.py --device cpu --model tiny --out /tmp/bzo
    python benchmarks/bench_zero_offload.py --device cuda --model 886m --out results/
    python benchmarks/bench_zero_offload.py --device cuda --model 886m,1.5b,3b,5b,7b --sweep \\
        --arms ours-s2-offload,ds-z2-offload --steps 3 --out results/
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    import torch

#: name -> (hidden, layers, heads, intermediate, vocab, seq, batch, gas)
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 176, 512, 32, 2, 2),
    # 32000 * 2048 * 2 (embeddings + untied head) + 15 * (4 * 2048^2 + 3 * 2048 * 5472 + 2 * 2048) + 2048 = 887M
    "886m": (2048, 15, 16, 5472, 32000, 2048, 4, 2),
    "1.5b": (2560, 18, 20, 6912, 32000, 2048, 4, 2),
    "3b": (3200, 24, 25, 8640, 32000, 2048, 4, 2),
    "5b": (4096, 24, 32, 11008, 32000, 2048, 4, 2),
    # Between 5b and 7b: 18 bytes of host memory per parameter (docs/zero.md) put 7B at the box's edge.
    "6b": (4096, 28, 32, 11008, 32000, 2048, 4, 2),
    "7b": (4096, 32, 32, 11008, 32000, 2048, 4, 2),
    "13b": (5120, 40, 40, 13824, 32000, 2048, 4, 2),
}

ARMS = ["ours-s2", "ours-s2-offload", "ours-s2-offload-dpu", "ours-s3", "ours-s3-offload", "ours-s3-offload-dpu",
        "ds-z2-offload", "ds-z3-offload", "fsdp2", "fsdp2-offload"]


def _engine_step(engine, batches) -> torch.Tensor:
    """One optimizer step through the DeepSpeed-style surface both ZeroEngine and DeepSpeed's engine offer: a
    forward, ``backward`` and ``step`` per micro-batch (the engine decides on which call the update happens)."""
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return loss.detach()


def _llama(name: str):
    """The model, built on the current default device (the child builds it on the GPU: initialising a 5B model's
    random weights on the host took minutes, longer than the arm itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter, vocab, seq, _, _ = MODELS[name]
    cfg = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def _ds_config(stage: int, gas: int, batch: int) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}}, "steps_per_print": 10**9,
    }


def _progress(t0: float, what: str) -> None:
    """One line on stderr per phase of an arm: a time-boxed arm reports how far it got (the parent quotes it)."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def _child(arm: str, model_name: str, device_name: str, steps: int, warmup: int, out_file: str) -> None:
    """One arm in this process; writes a JSON row to ``out_file``."""
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    _, _, _, _, vocab, seq, batch, gas = MODELS[model_name]
    row: dict = {"arm": arm, "model": model_name, "device": device_name}
    cuda = device_name == "cuda"
    if arm.startswith("ds-") and importlib.util.find_spec("deepspeed") is None:
        row["status"] = "not installed"
        Path(out_file).write_text(json.dumps(row))
        return
    if arm.startswith(("ds-", "fsdp2")) and not cuda:
        row["status"] = "needs cuda"
        Path(out_file).write_text(json.dumps(row))
        return
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
    # The engines keep bf16 weights (fp32 masters are built from them): build in bf16, which also halves the host
    # memory of model construction; FSDP2's recipe keeps fp32 parameters (bf16 compute via its policy).
    default_dtype = torch.get_default_dtype()
    if not arm.startswith("fsdp2"):
        torch.set_default_dtype(torch.bfloat16)
    _progress(t_start, f"{arm} {model_name}: building the model on {device}")
    try:
        with torch.device(device):
            model = _llama(model_name)
    finally:
        torch.set_default_dtype(default_dtype)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    _progress(t_start, f"built: {row['parameters']:,} parameters; setting up the engine")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(gas)]
    batches = [b.to(device) for b in batches]
    timings = None

    if arm.startswith("ours"):
        from optimized.accumulation import ZeroEngine

        stage = 2 if "-s2" in arm else 3
        offload = "-offload" in arm
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if arm.endswith("-dpu"):
                zero["offload_optimizer"]["delayed_parameter_update"] = True
            if stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        engine = ZeroEngine(model, {
            "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        }, device=device)

        def step() -> torch.Tensor:
            return _engine_step(engine, batches)

        def finish() -> None:
            engine.synchronize()

        timings = engine.offload_timings
        from reference.contract.envvars import cpu_adam_threads, pin_backend

        row["pin_backend"] = pin_backend()
        row["adam_threads"] = cpu_adam_threads()
        # What the engine asked to pin; the host RSS column shows what the allocator really took.
        row["host_pinned_requested_gib"] = sum(t.numel() * t.element_size() for t in engine.pinned_buffers()) / 2**30
    elif arm.startswith("ds-"):
        import deepspeed

        stage = 2 if "-z2" in arm else 3
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_ds_config(stage, gas, batch))

        def step() -> torch.Tensor:
            return _engine_step(engine, batches)

        def finish() -> None:
            pass
    else:
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
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=not arm.endswith("offload"))

        def step() -> torch.Tensor:
            for ids in batches:
                loss = model(input_ids=ids, labels=ids).loss / gas
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def finish() -> None:
            pass

    # Steps run back to back, as in training (our offloaded update overlaps the next step's forward), and are timed
    # as one window: synchronizing after each step would expose the overlapped tail in every step.
    row["setup_s"] = time.perf_counter() - t_start
    _progress(t_start, "engine ready; warm-up")
    for _ in range(warmup):
        step()
    finish()
    _progress(t_start, "warm-up done; timing")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if timings is not None:
        timings()  # drop the warm-up's share
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    finish()
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    breakdown = {k: v / steps for k, v in ((timings() if timings is not None else None) or {}).items()}
    row.update(status="ok", step_ms=step_s * 1e3, tokens_per_s=batch * seq * gas / step_s,
               peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
               host_rss_peak_gib=_rss_peak_gib(), steps=steps, warmup=warmup, seq=seq, batch=batch, gas=gas,
               last_loss=float(last))
    if breakdown:
        row["breakdown_ms"] = {k.removesuffix("_s"): v * 1e3 for k, v in breakdown.items()}
    Path(out_file).write_text(json.dumps(row))
    dist.destroy_process_group()


def _run_arm(arm: str, model: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, __file__, "--child", arm, "--model", model, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--child-out", out]
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


def _table(rows: list[dict]) -> str:
    head = ("arm", "model", "status", "step ms", "tokens/s", "peak GPU GiB", "host RSS GiB", "pinned asked GiB",
            "breakdown ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bd = r.get("breakdown_ms")
        bd_text = ", ".join(f"{k} {v:.1f}" for k, v in bd.items()) if bd else ""

        def f(key, fmt, r=r):
            v = r.get(key)
            return "" if v is None else format(v, fmt)

        lines.append("| " + " | ".join([r["arm"], r["model"], r["status"], f("step_ms", ".1f"),
                                          f("tokens_per_s", ".0f"), f("peak_gpu_gib", ".2f"),
                                          f("host_rss_peak_gib", ".2f"), f("host_pinned_requested_gib", ".2f"),
                                          bd_text]) + " |")
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
        ax.annotate(f"{r['arm']} ({r['model']})", (r["peak_gpu_gib"], r["step_ms"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("ZeRO offload: step time vs GPU memory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return True


def _write_json(out: Path, rows: list[dict]) -> None:
    """``bench_zero_offload.json`` in ``out``: the run's metadata and every row measured so far."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "argv": sys.argv}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    (out / "bench_zero_offload.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default="886m", help=f"preset or comma list of presets: {', '.join(MODELS)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of: {', '.join(ARMS)}")
    ap.add_argument("--sweep", nargs="?", const="up", choices=["up", "down"], default=None,
                    help="run the arms over the --model list in order. up (the default): each arm stops at its "
                         "first failure; down (list the models largest first): each arm stops at its first "
                         "success, so a box that fits only the smaller models does not spend its time on each")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per arm subprocess")
    ap.add_argument("--pin-backend", choices=["torch", "native"], default=None,
                    help="HOSTOFFLOAD_PIN_BACKEND for the arms (default: as set in the environment, else torch). "
                         "torch's pinned allocator rounds every buffer up to a power of two (docs/zero.md, "
                         "'Host memory'); native pins exactly what is asked")
    ap.add_argument("--adam-threads", type=int, default=None,
                    help="HOSTOFFLOAD_CPU_ADAM_THREADS for our arms (default: the cores the process may use). "
                         "With the delayed update (R27) the CPU Adam shares the host with a running step: fewer "
                         "threads may leave the training thread a core")
    ap.add_argument("--out", default=None, help="directory for the JSON and the plot")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"--model {m!r}: allowed values: {', '.join(MODELS)}")
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms {a!r}: allowed values: {', '.join(ARMS)}")
    if args.adam_threads is not None and args.adam_threads < 1:
        ap.error(f"--adam-threads {args.adam_threads}: allowed values: an int >= 1")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    if args.child:
        _child(args.child, models[0], args.device, args.steps, args.warmup, args.child_out)
        return
    if importlib.util.find_spec("transformers") is None:
        sys.exit("bench_zero_offload.py needs transformers (pip install 'hostoffload[hf]')")
    rows = []
    for arm in arms:
        for m in models:
            row = _run_arm(arm, m, args)
            rows.append(row)
            print(f"  {arm:<20} {m:<6} {row['status']:<14} {row.get('step_ms', float('nan')):9.1f} ms", flush=True)
            if args.out:  # after every arm: a run cut short by an outer time box keeps what it measured
                _write_json(Path(args.out), rows)
            if (args.sweep == "up" and row["status"] != "ok") or (args.sweep == "down" and row["status"] == "ok"):
                break
    if args.sweep:
        size = list(MODELS)  # presets are listed smallest first
        for arm in arms:
            ok = sorted((r for r in rows if r["arm"] == arm and r["status"] == "ok"),
                        key=lambda r: size.index(r["model"]))
            print(f"  largest model that trained with {arm}: {ok[-1]['model'] if ok else 'none'}"
                  + (f" (host RSS {ok[-1]['host_rss_peak_gib']:.1f} GiB)" if ok else ""))
    print(_table(rows))
    for r in rows:
        if r.get("error"):
            print(f"  {r['arm']} ({r['model']}): {r['error']}")
    if args.out:
        out = Path(args.out)
        _write_json(out, rows)
        if _plot(rows, out / "bench_zero_offload.png"):
            print(f"plot: {out / 'bench_zero_offload.png'}")
        else:
            print("no plot: no arm reported GPU memory (a cpu run), or matplotlib is missing")


if __name__ == "__main__":
    main()
