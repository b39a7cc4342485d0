"""ZeRO engine and native CPU Adam benchmarks (issue 6; figures go to docs/benchmarks.md).

Two parts, each printing a table and writing JSON into the output directory:

``cpu-adam``: parameters/s and bytes/s of one optimizer step on N fp32 parameters (N from ``--sizes``) for
torch.optim.AdamW single-tensor, foreach and fused, the native kernel (optimized.cpu_adam), and the offload
path's two variants: fused AdamW followed by a separate fp32->bf16 cast-copy vs the native kernel writing the
bf16 copy in the same pass, and that kernel with bf16 moments (R29). Bytes per parameter (printed): 28 (read p, g,
m, v; write p, m, v) + 2 for the bf16 copy; 22 with bf16 moments; each arm's bandwidth is also printed as a fraction
of the host's in-place triad (STREAM-style, measured first).

``scenarios``: the accumulation scenarios of every stage x managed/unmanaged x offload x dtype at world size 1 (or
``--world``) on the chosen backend (NCCL on the GPU box), each compared with the reference trace -- bitwise on gloo,
within R25's tolerance on a GPU -- printing the largest differences and the run time per scenario.

``engine``: step time (``--gas`` micro-batches + step) and peak device memory of a GPT-style model on one rank for
ZeroEngine stages 0-3, with and without CPU optimizer offload, next to DDP (stage 0) and FSDP2 fully_shard
(stage 3) with the same model, batch and accumulation.

Defaults are small so that it runs on a CPU CI host in seconds; on the GPU box use e.g.::

    python benchmarks/bench_zero.py cpu-adam --sizes 10e6,100e6,1e9 --out results/
    python benchmarks/bench_zero.py engine --device cuda --layers 12 --hidden 1024 --seq 1024 --batch 8 --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# ---- CPU Adam -----------------------------------------------------------------------------------------------


def _time(fn, iters: int) -> float:
    fn()  # warm-up (first touch of pages, the native kernel's worker pool start-up)
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_host_bandwidth(threads: int, nbytes: int = 1 << 30, iters: int = 5) -> list[dict]:
    """The host's memory bandwidth, STREAM-style, as yardstick for the Adam figures (a step that streams 28-30
    bytes per parameter cannot beat it): torch's threaded kernels over arrays of ``nbytes`` each, bytes read +
    written per second. Several access patterns, because one alone can mislead: on the H200 box's VM a plain
    ``copy_`` reached 79.6 GB/s while both Adam kernels streamed more (run C in docs/benchmarks.md)."""
    torch.set_num_threads(threads)
    n = nbytes // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    kernels = {
        "copy": (lambda: c.copy_(a), 2),  # c = a: one read, one write stream
        "scale_inplace": (lambda: a.mul_(1.0000001), 2),  # a *= s: read and write the same stream
        "add": (lambda: torch.add(a, b, out=c), 3),  # c = a + b
        "triad_inplace": (lambda: a.add_(b, alpha=1e-7), 3),  # a += s*b: two reads, one write back
    }
    rows = []
    for name, (fn, streams) in kernels.items():
        sec = _time(fn, iters)
        bps = streams * nbytes / sec
        rows.append({"arm": f"host_{name}", "bytes": nbytes, "streams": streams, "seconds": sec, "bytes_per_s": bps,
                     "threads": threads})
        print(f"  host memory, {name:<14} ({streams} streams of {nbytes >> 20} MiB): {bps / 1e9:7.1f} GB/s")
    return rows


# Timed calls per arm at least this many parameter-steps in total (so at least iters, and 200 calls at 10 M). Why:
# at 10 M a step takes about 1 ms, and on the H200 box's VM the best of 9 such calls, repeated four times on one
# lease with one build, gave 0.66-1.19 ms for torch's fused AdamW and 0.98-1.38 ms for the native kernel (native /
# fused 0.55x-1.12x); with the best of 40 calls the native kernel gave 0.56-0.66 ms every time, fused 1.01-1.17 ms
# (benchmarks/results/h200-2026-12-02g-*).
_MIN_TIMED_PARAMS = 2e9


def bench_cpu_adam(sizes: list[int], iters: int, threads: int, host_bps: float | None = None) -> list[dict]:
    """Each arm's time per step on N parameters, its bytes per parameter (the one-pass floor,
    :func:`adam_pass_bytes_per_element`) and the bandwidth that implies, and with ``host_bps`` (the host's
    STREAM-style figure, :func:`bench_host_bandwidth`) its fraction of it."""
    from optimized import cpu_adam
    from reference.accumulation import OptimizerConfig
    from reference.contract.accumulation_state_precision import STATE_PRECISIONS, adam_pass_bytes_per_element

    torch.set_num_threads(threads)
    cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    rows = []
    for n in sizes:
        g = torch.randn(n)
        bf16 = torch.empty(n, dtype=torch.bfloat16)

        def torch_arm(cast: bool = False, n=n, g=g, bf16=bf16, **kw):
            """A torch AdamW over one flat parameter; built per arm and freed after it (1B params = 16 GB)."""
            p = nn.Parameter(torch.randn(n))
            p.grad = g
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
            if cast:
                return lambda: (opt.step(), bf16.copy_(p.detach()))
            return opt.step

        def native_arm(with_bf16: bool, n=n, g=g, bf16=bf16, moments: str = "fp32"):
            dtype = STATE_PRECISIONS[moments].dtype  # R29: the moments' stored precision
            p32, m, v = torch.randn(n), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
            step = [0]

            def run(p32=p32, m=m, v=v, g=g, bf16=bf16):
                step[0] += 1
                cpu_adam.adam_step(cfg, p32, g, m, v, step[0], bf16_out=bf16 if with_bf16 else None, threads=threads)

            return run

        fp32_state, bf16_state = STATE_PRECISIONS["fp32"], STATE_PRECISIONS["bf16"]
        plain = adam_pass_bytes_per_element(fp32_state, bf16_copy=False)  # 28
        arms = [
            ("torch_single", lambda: torch_arm(foreach=False), plain),
            ("torch_foreach", lambda: torch_arm(foreach=True), plain),
            ("torch_fused", lambda: torch_arm(fused=True), plain),
            ("native", lambda: native_arm(False), plain),
            ("torch_fused+cast", lambda: torch_arm(cast=True, fused=True),
             adam_pass_bytes_per_element(fp32_state, bf16_copy=True)),
            ("native+bf16", lambda: native_arm(True), adam_pass_bytes_per_element(fp32_state, bf16_copy=True)),
            # R29: the moments stored in bf16, read and written by the kernel in the same pass
            ("native+bf16 state=bf16", lambda: native_arm(True, moments="bf16"),
             adam_pass_bytes_per_element(bf16_state, bf16_copy=True)),
        ]
        for name, build, bytes_per in arms:
            try:
                fn = build()
            except (RuntimeError, ValueError) as exc:  # fused AdamW needs torch >= 2.4 on CPU
                print(f"  {name}: unavailable ({exc})")
                continue
            calls = max(iters, math.ceil(_MIN_TIMED_PARAMS / n))
            with torch.no_grad():
                sec = _time(fn, calls)
            # Free this arm's buffers (12 GB at 1e9 params) before the next one is built: peak memory stays one
            # arm plus the shared gradient and bf16 buffer (18 GB at 1e9), whatever the number of arms.
            del fn
            gc.collect()
            row = {"params": n, "arm": name, "seconds": sec, "calls": calls, "params_per_s": n / sec,
                   "bytes_per_param": bytes_per, "bytes_per_s": n * bytes_per / sec, "threads": threads,
                   "isa": cpu_adam.best_isa()}
            share = "" if host_bps is None else f"  {row['bytes_per_s'] / host_bps:6.1%} of host"
            if host_bps is not None:
                row["fraction_of_host_bandwidth"] = row["bytes_per_s"] / host_bps
            rows.append(row)
            print(f"  N={n:>13,d} {name:<24} {bytes_per:2d} B/param {sec * 1e3:9.2f} ms  "
                  f"{n / sec / 1e6:9.1f} M params/s  {n * bytes_per / sec / 1e9:7.2f} GB/s{share}")
    return rows


# ---- engine ------------------------------------------------------------------------------------------------


def _example_module():
    """examples/train_gpt.py, loaded from its path: the engine benchmark times the same GPT the example trains."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("hostoffload_example_train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPT = _example_module().GPT


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_engine(args) -> list[dict]:
    import torch.distributed as dist

    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = tempfile.mkdtemp(prefix="bench-zero-")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"file://{store}/s", rank=0, world_size=1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
            for _ in range(args.gas)]

    def build(on=device):
        """The model, initialised directly on ``on`` (a 200M-parameter init on the host takes seconds)."""
        torch.manual_seed(0)
        with torch.device(on):
            return GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq + 1)

    n_params = sum(p.numel() for p in build("meta").parameters())
    print(f"  model: {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.1f}M parameters, {args.dtype}, "
          f"batch {args.batch}x{args.seq}, gas {args.gas}, device {device}")
    rows = []

    def measure(name, stage, offload, run_step):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(args.warmup + args.iters):
            _sync(device)
            t0 = time.perf_counter()
            run_step()
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        med = sorted(times)[len(times) // 2]
        rows.append({"arm": name, "stage": stage, "offload_optimizer": offload, "step_seconds": med,
                     "peak_bytes": peak, "params": n_params})
        print(f"  {name:<28} {med * 1e3:9.1f} ms/step" + (f"  peak {peak / 2**30:7.2f} GiB" if peak else ""))

    from optimized.accumulation import ZeroEngine

    for stage in [int(s) for s in args.stages.split(",")]:
        for offload in (False, True):
            cfg = {"zero_stage": stage, "gradient_accumulation_steps": args.gas, "dtype": args.dtype,
                   "grad_accum_dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01},
                   "offload_optimizer": "cpu" if offload else "none"}
            engine = ZeroEngine(build(), cfg, device=device)

            def engine_step(engine=engine):
                for idx in data:
                    engine.backward(_loss(engine.module, idx))
                    engine.step()

            measure(f"zero stage {stage}" + (" +offload" if offload else ""), stage, offload, engine_step)
            engine.destroy()
            del engine

    def torch_baseline(name, stage, wrap, autocast: bool):
        """torch's own data parallelism on the same model, batch and accumulation. With a bf16 model the
        baselines keep fp32 parameters and compute in bf16 (DDP: autocast; FSDP2: its mixed-precision policy),
        which matches the engine's fp32 master + bf16 weights."""
        try:
            model = wrap(build().to(device=device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                    **({"fused": True} if device.type == "cuda" else {}))
        except Exception as exc:
            print(f"  {name}: unavailable ({type(exc).__name__}: {exc})")
            return
        amp = (lambda: torch.autocast(device.type, dtype=dtype)) if autocast and dtype != torch.float32 else (
            contextlib.nullcontext)

        def step():
            for k, idx in enumerate(data):
                sync_off = hasattr(model, "no_sync") and k < len(data) - 1
                with model.no_sync() if sync_off else contextlib.nullcontext(), amp():
                    loss = _loss(model, idx) / args.gas
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            measure(name, stage, False, step)
        except Exception as exc:
            print(f"  {name}: failed ({type(exc).__name__}: {exc})")

    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.cuda.current_device()] if device.type == "cuda" else None
    torch_baseline("torch DDP", 0, lambda m: DistributedDataParallel(m, device_ids=ids), autocast=True)

    def fsdp2(m):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for blk in m.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        return m

    torch_baseline("torch FSDP2 fully_shard", 3, fsdp2, autocast=False)
    dist.destroy_process_group()
    return rows


def bench_scenarios(args) -> list[dict]:
    from conformance.areas.accumulation_assertions import arithmetic_tolerance, assert_traces_match
    from conformance.harness.engine_runner import run_engine_scenario
    from optimized.accumulation import ZeroEngine
    from reference.accumulation import AccumulationConfig, ModelSpec, Scenario, scenario_calls
    from reference.accumulation import run_scenario as reference_run

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rows = []
    for stage in (0, 1, 2, 3):
        for managed in (True, False):
            for offload in (False, True):
                for dtype in ("fp32", "bf16"):
                    cfg = AccumulationConfig(
                        zero_stage=stage, managed_gradient_accumulation=managed, gradient_accumulation_steps=2,
                        dtype=dtype, gradient_clipping=0.05,
                        optimizer={"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
                        offload_optimizer="cpu" if offload else "none",
                        offload_param="cpu" if offload and stage == 3 else "none",
                    )
                    calls = scenario_calls("BSBSFBSTBS" if managed else "BBSBSBBBS")
                    sc = Scenario(cfg, args.world, calls, model=ModelSpec(checkpoint=stage == 3), seed=stage)
                    # The reference on the ranks' device: same kernels, so only reduction order and optimizer
                    # placement can differ (a CPU reference adds CPU-vs-GPU bf16 matmul differences).
                    expected = reference_run(sc, device="cuda" if backend == "nccl" else "cpu")
                    t0 = time.perf_counter()
                    actual = run_engine_scenario(ZeroEngine, sc, backend=backend)
                    sec = time.perf_counter() - t0
                    exact = backend == "gloo"
                    try:
                        assert_traces_match(actual, expected, None if exact else arithmetic_tolerance(sc))
                        status = "pass"
                    except AssertionError as exc:
                        status = f"FAIL: {exc}"
                    last_a, last_e = actual.steps()[-1], expected.steps()[-1]
                    pdiff = max((last_a.parameters[n].cpu().double() - last_e.parameters[n].cpu().double())
                                .abs().max().item() for n in last_e.parameters)
                    ga, ge = actual.boundaries()[0].gradients, expected.boundaries()[0].gradients
                    gdiff = max((ga[n].cpu().double() - ge[n].cpu().double()).abs().max().item() for n in ge)
                    rows.append({"stage": stage, "managed": managed, "offload": offload, "dtype": dtype,
                                 "world": args.world, "backend": backend, "status": status, "seconds": sec,
                                 "max_param_diff": pdiff, "max_first_grad_diff": gdiff,
                                 "exact_comparison": exact})
                    print(f"  stage {stage} {'managed  ' if managed else 'unmanaged'} offload={offload!s:<5} "
                          f"{dtype}: {status[:120]}  {sec * 1e3:7.1f} ms  max|dparam| {pdiff:.3e}  "
                          f"max|dgrad| {gdiff:.3e}")
    return rows


# ---- pytest-benchmark entry points (tox -e bench) -----------------------------------------------------------

_BENCH_PARAMS = 1 << 22  # 4M parameters: big enough to be memory-bound, small enough for a CI host


def _pytest_arm(arm: str):
    from optimized import cpu_adam
    from reference.accumulation import OptimizerConfig

    n = _BENCH_PARAMS
    g = torch.randn(n)
    if arm.startswith("native"):
        cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
        p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16) if arm == "native+bf16" else None
        step = [0]

        def run():
            step[0] += 1
            cpu_adam.adam_step(cfg, p, g, m, v, step[0], bf16_out=out)

        return run
    param = nn.Parameter(torch.randn(n))
    param.grad = g
    kw = {"torch_single": {"foreach": False}, "torch_foreach": {"foreach": True}, "torch_fused": {"fused": True}}[arm]
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kw)
    return opt.step


def _pytest_parametrize():
    import pytest

    return pytest.mark.parametrize("arm", ["torch_single", "torch_foreach", "torch_fused", "native", "native+bf16"])


try:
    _arms_mark = _pytest_parametrize()
except ImportError:  # pragma: no cover - running as a script without pytest
    _arms_mark = None

if _arms_mark is not None:

    @_arms_mark
    def test_cpu_adam_step(benchmark, arm: str) -> None:
        """One AdamW step on 4M fp32 parameters per arm; params/s in extra_info."""
        fn = _pytest_arm(arm)
        with torch.no_grad():
            benchmark(fn)
        benchmark.extra_info["params"] = _BENCH_PARAMS
        benchmark.extra_info["params_per_s"] = _BENCH_PARAMS / benchmark.stats.stats.min


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("cpu-adam", "engine", "scenarios", "all"))
    ap.add_argument("--out", default="bench-zero-results", help="directory for the JSON results")
    ap.add_argument("--sizes", default="1e6,1e7", help="cpu-adam: comma-separated parameter counts")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--world", type=int, default=1, help="scenarios: world size")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="scenarios: default nccl on a GPU")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
            "cpu": platform.processor(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "args": vars(args)}
    failed: list = []
    if args.part in ("cpu-adam", "all"):
        print("CPU Adam (AdamW, one flat fp32 tensor):")
        rows = bench_host_bandwidth(args.threads)
        # Adam updates its streams in place, so the in-place triad (two reads, one write back) is its yardstick.
        host_bps = max(r["bytes_per_s"] for r in rows if r["arm"] == "host_triad_inplace")
        rows += bench_cpu_adam([int(float(s)) for s in args.sizes.split(",")], args.iters, args.threads, host_bps)
        (out / "cpu_adam.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if args.part in ("scenarios", "all"):
        print("Accumulation scenarios vs the reference trace:")
        rows = bench_scenarios(args)
        (out / "scenarios.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        failed = [r for r in rows if r["status"] != "pass"]
        print(f"  {len(rows) - len(failed)} of {len(rows)} scenarios match the reference")
    if args.part in ("engine", "all"):
        print("Engine step time (one rank):")
        rows = bench_engine(args)
        (out / "engine.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"results written to {out}/")
    if args.part in ("scenarios", "all") and failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
