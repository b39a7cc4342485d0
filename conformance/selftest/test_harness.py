"""Self-tests of the conformance harness: options, discovery, the report, and out-of-tree extension.

Each runs pytest in a child process, as a user or a vendor would, and reads what it printed or wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance_area("harness")

def source_root() -> Path | None:
    """The hostoffload source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it), else this file's checkout, if any."""
    env = os.environ.get("HOSTOFFLOAD_SOURCE_ROOT")
    for candidate in ([Path(env)] if env else []) + [Path(__file__).resolve().parents[2]]:
        if (candidate / "examples").is_dir():
            return candidate
    return None


def run_pytest(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_list_shows_discovered_plugins(tmp_path):
    proc = run_pytest("--conformance-list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "implementations (hostoffload.implementations):" in out
    assert "reference" in out and "areas pinning" in out
    assert "cpu:" in out and "cuda:" in out


def test_unknown_implementation_is_a_clear_error(tmp_path):
    proc = run_pytest("--pyargs", "conformance.suite", "--conformance-impl", "nonesuch", "--co", cwd=tmp_path)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "--conformance-impl" in text and "nonesuch" in text and "reference" in text


def test_report_matrix_is_written(tmp_path):
    report = tmp_path / "report"
    proc = run_pytest(
        "--pyargs",
        "conformance.suite.test_accelerators_contract",
        "conformance.suite.test_pinning_api",
        "-k",
        "contract or bad_arguments or unpin_of_unpinned",
        "--conformance-report",
        str(report),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"conformance report: {report / 'report.json'}" in proc.stdout
    data = json.loads((report / "report.json").read_text())
    assert {"date", "versions", "hardware", "profile", "matrix"} <= set(data)
    cells = {(r["area"], r["implementation"], r["accelerator"]): r for r in data["matrix"]}
    assert cells[("pinning", "reference", "cpu")]["status"] == "passed"
    assert cells[("pinning", "reference", "cpu")]["passed"] > 0
    assert cells[("accelerator", "-", "-")]["status"] == "passed"
    md = (report / "report.md").read_text()
    assert "| pinning | reference | cpu | **passed** |" in md


def test_out_of_tree_plugin_is_discovered_and_run(tmp_path):
    """docs/extending.md's example: install the package, run the suite on it, with no edit to the suite."""
    root = source_root()
    if root is None:
        pytest.skip("the example plugin ships in the source tree; set HOSTOFFLOAD_SOURCE_ROOT to a checkout")
    example = root / "examples" / "hostoffload-example-plugin"
    target = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    report = tmp_path / "report"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    proc = run_pytest(
        "--pyargs",
        "conformance.suite.test_pinning_api",
        "conformance.suite.test_accelerators_contract",
        "--conformance-impl",
        "example",
        "--conformance-accelerator",
        "example-host",
        "--conformance-report",
        str(report),
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["implementations"] == ["example"] and data["accelerators"] == ["example-host"]
    cells = {(r["area"], r["implementation"], r["accelerator"]): r["status"] for r in data["matrix"]}
    assert cells[("pinning", "example", "example-host")] == "passed", cells
    assert cells[("pinning", "example", "-")] == "passed", cells
    # The contract test covers every discovered accelerator, the example's included.
    assert (
        "acc=example-host"
        in run_pytest(
            "--pyargs", "conformance.suite.test_accelerators_contract", "--co", "-q", env=env, cwd=tmp_path
        ).stdout
    )
