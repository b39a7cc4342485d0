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
    for r in report["results"]:
        ax.scatter(r["peak_gib"], r["median_ms"], marker=markers.get(r["variant"], "x"), s=40)
        ax.annotate(
            f"{r['arm']} ({r['variant']})",
            (r["peak_gib"], r["median_ms"]),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("peak allocated memory (GiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"activation offload: {report['hardware']}, {report['date'][:10]}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
