"""Plot the loss against wall time, one line per arm, from ``bench_zero_offload.py --mode converge``'s JSON.

Wall time is counted from the end of each arm's first boundary (convergence.py says why); the dotted lines are
the task's loss floor (ln successors) and the target loss, and a marker sits where an arm reached the target.

Usage: ``python benchmarks/plot_convergence.py bench_zero_offload_converge.json converge.png`` (needs matplotlib).
"""

from __future__ import annotations

import json
import sys


def plot(report: dict, path: str) -> None:
    """Draw ``report`` (the JSON's content) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = report["meta"]["task"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    rows = [r for r in report["rows"] if r.get("curve")]
    several_gas = len({r.get("gas") for r in rows}) > 1  # a --gas sweep: say which count each line is
    for i, row in enumerate(rows):
        color = f"C{i % 10}"
        walls = [wall for _, wall, _ in row["curve"]]
        losses = [loss for _, _, loss in row["curve"]]
        label = row["arm"] + (f" gas {row['gas']}" if several_gas else "")
        if row.get("median_step_ms"):
            label += f" ({row['median_step_ms']:.0f} ms/step)"
        ax.plot(walls, losses, color=color, lw=1.2, label=label)
        if row.get("time_to_target_s") is not None:
            ax.scatter([row["time_to_target_s"]], [task["target"]], color=color, s=30, zorder=3)
    ax.axhline(task["loss_floor"], color="gray", ls=":", lw=1, label=f"floor ln {task['successors']}")
    ax.axhline(task["target"], color="black", ls="--", lw=0.8, label=f"target {task['target']:g}")
    ax.set_xlabel("wall time since the first boundary (s)")
    ax.set_ylabel("training loss (nats/token)")
    model = report["rows"][0]["model"] if report["rows"] else "?"
    where = report["meta"].get("gpu", report["meta"].get("host", ""))
    ax.set_title(f"time to loss: {model}, bigram chain {task['chain_ids']}x{task['successors']}, {where}, "
                 f"{report['meta']['date'][:10]}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: plot_convergence.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        plot(json.load(fh), argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
