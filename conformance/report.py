"""The conformance report: area x implementation x accelerator -> passed / failed / skipped.

It is what a vendor attaches to a port and what the main job prints at the end, so it records enough to reproduce
the run: versions, hardware, hypothesis profile, the selection, and the skip reasons per cell.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.failed:
            return "failed"
        if self.passed:
            return "passed"
        return "skipped" if self.skipped else "empty"


class ReportCollector:
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], Cell] = defaultdict(Cell)
        self.properties: dict[str, int] = defaultdict(int)

    def record(self, key: tuple[str, str, str], outcome: str, nodeid: str, reason: str | None = None) -> None:
        cell = self.cells[key]
        setattr(cell, outcome, getattr(cell, outcome) + 1)
        if outcome == "skipped" and reason:
            cell.skip_reasons[reason] = cell.skip_reasons.get(reason, 0) + 1
        if outcome == "failed":
            cell.failures.append(nodeid)

    def add_property(self, name: str, value: int) -> None:
        self.properties[name] += value


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "cpu_count": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # pragma: no cover - report must never fail the run
        pass
    return info


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "hypothesis", "pytest"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover
            out[mod] = "missing"
    try:
        from importlib.metadata import version

        out["hostoffload"] = version("hostoffload")
    except Exception:  # pragma: no cover
        out["hostoffload"] = "not installed"
    return out


def build_report(collector: ReportCollector, meta: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for (area, impl, acc), cell in sorted(collector.cells.items()):
        rows.append(
            {
                "area": area,
                "implementation": impl,
                "accelerator": acc,
                "status": cell.status,
                "passed": cell.passed,
                "failed": cell.failed,
                "skipped": cell.skipped,
                "skip_reasons": cell.skip_reasons,
                "failures": cell.failures,
            }
        )
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "hardware": hardware(),
        **meta,
        "properties": dict(collector.properties),
        "matrix": rows,
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# hostoffload conformance report",
        "",
        f"- date: {report['date']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
        f"- hardware: {json.dumps(report['hardware'])}",
        f"- hypothesis profile: {report.get('profile')}",
        f"- implementations: {', '.join(report.get('implementations', []))}",
        f"- accelerators: {', '.join(report.get('accelerators', []))}"
        + (f" (not available here: {', '.join(report['unavailable_accelerators'])})"
           if report.get("unavailable_accelerators") else ""),
    ]
    for name, value in report.get("properties", {}).items():
        lines.append(f"- {name}: {value}")
    lines += ["", "| area | implementation | accelerator | status | passed | failed | skipped | skip reasons |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["matrix"]:
        reasons = "; ".join(f"{k} (x{v})" for k, v in r["skip_reasons"].items())
        lines.append(
            f"| {r['area']} | {r['implementation']} | {r['accelerator']} | **{r['status']}** | {r['passed']} | "
            f"{r['failed']} | {r['skipped']} | {reasons.replace('|', '/')} |"
        )
    failures = [f for r in report["matrix"] for f in r["failures"]]
    if failures:
        lines += ["", "## Failures", ""] + [f"- `{f}`" for f in failures]
    return "\n".join(lines) + "\n"


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``<path>/report.json`` and ``<path>/report.md``; returns both paths."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / "report.json", folder / "report.md"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path
