"""What ``bench_zero_offload.py`` prints and writes: the side-by-side table, the convergence table and curve
comparisons, the per-phase timelines, the plot and the JSON/CSV results.
"""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import math
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from convergence import COMPARE_WINDOW, compare_curves
from peak_breakdown import table as breakdown_table
from zero_offload_arms import BF16_STATE, MATCH_BASE_ARM, MODELS

if TYPE_CHECKING:  # for annotations only: the functions import torch where they use it
    pass


def cell(r: dict, key: str, fmt: str) -> str:
    v = r.get(key)
    return "" if v is None else format(v, fmt)


def mfu(r: dict) -> str:
    """MFU in per cent, or the model TFLOP/s where the device's peak is unknown (model_flops.py)."""
    if r.get("mfu") is not None:
        return f"{r['mfu'] * 100:.1f} %"
    return f"({r['model_tflops_per_s']:.3g} TFLOP/s)" if r.get("model_tflops_per_s") is not None else ""


def table(rows: list[dict]) -> str:
    head = ("arm", "configuration", "model", "gas", "status", "step ms", "tokens/s", "MFU", "peak GPU GiB",
            "host RSS GiB", "pinned asked GiB", "breakdown ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bd = r.get("breakdown_ms")
        bd_text = ", ".join(f"{k} {v:.1f}" for k, v in bd.items()) if bd else ""
        lines.append("| " + " | ".join([r["arm"], r.get("configuration", ""), r["model"], cell(r, "gas", "d"),
                                          r["status"], cell(r, "step_ms", ".1f"), cell(r, "tokens_per_s", ".0f"),
                                          mfu(r),
                                          cell(r, "peak_gpu_gib", ".2f"),
                                          cell(r, "host_rss_peak_gib", ".2f"),
                                          cell(r, "host_pinned_requested_gib", ".2f"), bd_text]) + " |")
    return "\n".join(lines)


def converge_table(rows: list[dict]) -> str:
    head = ("arm", "model", "gas", "status", "boundaries", "median step ms", "tokens/s", "MFU", "loss after N",
            "time to target s", "boundaries to target", "peak GPU GiB", "setup s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        reached = r.get("time_to_target_s")
        to_target = format(reached, ".1f") if reached is not None else ("not reached" if "curve" in r else "")
        lines.append("| " + " | ".join([r["arm"], r["model"], cell(r, "gas", "d"), r["status"],
                                          cell(r, "boundaries", "d"), cell(r, "median_step_ms", ".1f"),
                                          cell(r, "tokens_per_s", ".0f"), mfu(r), cell(r, "final_loss", ".3f"),
                                          to_target, cell(r, "steps_to_target", "d"), cell(r, "peak_gpu_gib", ".2f"),
                                          cell(r, "setup_s", ".1f")]) + " |")
    return "\n".join(lines)


def curve_comparisons(rows: list[dict], start: int) -> str:
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


def timelines(rows: list[dict]) -> str:
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
                         f"measured peak RSS {cell(r, 'host_rss_peak_gib', '.2f')} GiB")
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


def plot_memory_time(rows: list[dict], path: Path) -> bool:
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


def write_results(out: Path, rows: list[dict], args) -> Path:
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


def report(rows: list[dict], args) -> None:
    if args.sweep:
        size = list(MODELS)  # presets are listed smallest first
        for arm in dict.fromkeys(r["arm"] for r in rows):
            ok = sorted((r for r in rows if r["arm"] == arm and r["status"] == "ok"),
                        key=lambda r: size.index(r["model"]))
            print(f"  largest model that trained with {arm}: {ok[-1]['model'] if ok else 'none'}"
                  + (f" (host RSS {ok[-1]['host_rss_peak_gib']:.1f} GiB)" if ok else ""))
    print(converge_table(rows) if args.mode == "converge" else table(rows))
    text = "\n".join(t for t in (timelines(rows), breakdown_table(rows)) if t)
    if args.mode == "converge":
        text = "\n".join(t for t in (text, curve_comparisons(rows, args.compare_from)) if t)
    if text:
        print(text)
    for r in rows:
        if r.get("error") or r.get("stopped"):
            print(f"  {r['arm']} ({r['model']}): {r.get('error') or r.get('stopped')}")
    if not args.out:
        return
    out = Path(args.out)
    path = write_results(out, rows, args)
    if args.mode == "converge":
        if importlib.util.find_spec("matplotlib") is not None:
            from plot_convergence import plot

            plot(json.loads(path.read_text()), out / "bench_zero_offload_converge.png")
            print(f"plot: {out / 'bench_zero_offload_converge.png'}")
        else:
            print(f"no plot: matplotlib is missing (later: python benchmarks/plot_convergence.py {path} OUT.png)")
    elif plot_memory_time(rows, out / "bench_zero_offload.png"):
        print(f"plot: {out / 'bench_zero_offload.png'}")
    else:
        print("no plot: no arm reported GPU memory (a cpu run), or matplotlib is missing")
