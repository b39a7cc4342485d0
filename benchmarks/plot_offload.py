"""Plot step time against peak memory, one point per arm and variant, from ``bench_offload.py``'s JSON.

Usage: ``python benchmarks/plot_offload.py results.json offload.png`` (needs matplotlib).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: plot_offload.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[0]) as fh:
        report = json.load(fh)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"async": "o", "host_sync": "s"}
    arms = list(dict.fromkeys(r["arm"] for r in report["results"]))
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    for r in report["results"]:
        ax.scatter(r["peak_gib"], r["median_ms"], marker=markers.get(r["variant"], "x"), color=colors[r["arm"]], s=45)
    # one legend entry per arm (colour) and per variant (marker), instead of overlapping point labels
    for arm in arms:
        ax.scatter([], [], color=colors[arm], marker="o", label=arm)
    for variant, marker in markers.items():
        ax.scatter([], [], color="gray", marker=marker, label=variant)
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("peak allocated memory (GiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"activation offload: {report['hardware']}, {report['date'][:10]}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
