"""Plot the pinning benchmarks from ``bench_pinning.py``'s JSON (script mode or pytest-benchmark's --benchmark-json).

One figure, up to four panels: fresh allocation time vs size per arm; ``is_pinned`` latency vs live ranges per arm;
H2D and D2H bandwidth vs size per arm (from CUDA-event medians). Panels without data are left out, so a CPU-only
run still plots allocation and lookup latency.

Usage: ``python benchmarks/plot_pinning.py RESULTS.json OUT.png`` (needs matplotlib).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

MiB = 1 << 20


def _params(bench: dict[str, Any]) -> dict[str, Any]:
    """Parameters of one benchmark: script mode stores them in ``params``, pytest-benchmark in extra_info too."""
    extra = bench.get("extra_info") or {}
    params = dict(bench.get("params") or {})
    params.update(extra.get("params") or {})
    for key in ("arm", "nbytes", "direction", "live_ranges"):
        if key in extra and key not in params:
            params[key] = extra[key]
    if "ranges" not in params and "live_ranges" in params:
        params["ranges"] = params["live_ranges"]
    return params


def series(doc: dict[str, Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """panel -> arm -> sorted (x, y) points."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for bench in doc.get("benchmarks", []):
        group = bench.get("group")
        p = _params(bench)
        extra = bench.get("extra_info") or {}
        median = bench["stats"]["median"]
        if group == "alloc":
            out["alloc"][p["arm"]].append((p["nbytes"] / MiB, median * 1e3))
        elif group == "is_pinned":
            out["is_pinned"][p["arm"]].append((p["ranges"], median * 1e9))
        elif group == "bandwidth" and "gbps" in extra:
            out[f"bandwidth_{p['direction']}"][p["arm"]].append((p["nbytes"] / MiB, extra["gbps"]))
    return {panel: {arm: sorted(pts) for arm, pts in arms.items()} for panel, arms in out.items()}


PANELS = (
    ("alloc", "fresh pinned allocation", "size (MiB)", "median time (ms)", True),
    ("is_pinned", "is_pinned latency", "live ranges in the registry", "median per call (ns)", True),
    ("bandwidth_h2d", "H2D bandwidth (non_blocking, side stream)", "size (MiB)", "GB/s", False),
    ("bandwidth_d2h", "D2H bandwidth (non_blocking, side stream)", "size (MiB)", "GB/s", False),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: plot_pinning.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[0]) as fh:
        doc = json.load(fh)
    data = series(doc)
    panels = [p for p in PANELS if data.get(p[0])]
    if not panels:
        print(f"{argv[0]} holds no pinning benchmarks", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (key, title, xlabel, ylabel, log_y) in zip(axes[0], panels, strict=True):
        for arm, pts in sorted(data[key].items()):
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=arm)
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    info = doc.get("machine_info") or {}
    hardware = info.get("gpu") or info.get("cpu") or info.get("cpu", {}).get("brand_raw", "cpu")
    stamp = str(doc.get("datetime", ""))[:10]
    fig.suptitle(f"hostoffload pinning: {hardware}, torch {info.get('torch', '?')}, {stamp}", fontsize=11)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
