"""Item 4 and docs/extending.md's flow: install the example plugin, run the whole suite on it, green.

The plugin is installed with pip into a folder put on PYTHONPATH (the environment's site-packages stays as it
was, so parallel runs are not disturbed); the child runs see it exactly like an installed distribution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance.selftest.runner import run_pytest, run_python, source_root
from reference.contract.accelerators import Accelerator, default_accelerator, discover_accelerators
from reference.contract.accelerators.cpu import CpuAccelerator

pytestmark = pytest.mark.conformance_area("harness")


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> dict[str, str]:
    root = source_root()
    if root is None:
        pytest.skip("the example plugin ships in the source tree; set HOSTOFFLOAD_SOURCE_ROOT to a checkout")
    target = tmp_path_factory.mktemp("example-site")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
         str(target), str(root / "examples" / "hostoffload-example-plugin")],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


def test_whole_suite_is_green_on_the_example(example_env, tmp_path):
    """Every suite module, on the example implementation and its accelerator: what it declares passes, the rest
    is skipped as not declared, and nothing fails."""
    report = tmp_path / "report"
    proc = run_pytest(
        "--pyargs", "conformance.suite",
        "--conformance-impl", "example",
        "--conformance-accelerator", "example-host",
        "--conformance-profile", "ci",
        "--conformance-report", str(report),
        # Every test that involves the example's implementation or accelerator (their ids name it); tests of the
        # reference alone (no impl, no accelerator parameter) say nothing about the example and are left out, and
        # so is the one whose name says "example" for another reason (examples/train_gpt.py --help, no plugin).
        "-k", "example and not test_example_help_shows_every_default",
        "-q",
        env=example_env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    data = json.loads((report / "report.json").read_text())
    assert data["verdict"] == "passed", data["totals"]
    assert data["implementations"] == ["example"] and data["accelerators"] == ["example-host"]
    cells = {(r["area"], r["implementation"], r["accelerator"]): r for r in data["matrix"]}
    for area in ("pinning", "ranges"):  # the areas the example declares
        assert cells[(area, "example", "example-host")]["status"] == "passed", cells
        assert cells[(area, "example", "-")]["status"] == "passed", cells
    for (area, impl, _acc), row in cells.items():
        if impl == "example" and area not in ("pinning", "ranges"):
            undeclared = all("not declared" in r or "does not declare" in r for r in row["skip_reasons"])
            assert row["status"] == "skipped" and undeclared, row


def test_example_accelerator_is_never_the_default(example_env, tmp_path):
    """Installing the example changes no program's default accelerator, yet it is there to be named."""
    code = (
        "import json, os; os.environ.pop('HOSTOFFLOAD_ACCELERATOR', None);"
        "from reference.contract.accelerators import discover_accelerators, get_accelerator;"
        "print(json.dumps([sorted(discover_accelerators()), get_accelerator().name]))"
    )
    with_example = run_python(code, env=example_env, cwd=tmp_path)
    assert with_example.returncode == 0, with_example.stderr
    installed, default = json.loads(with_example.stdout)
    # Without the example: this process's own environment (the example is only on the child's PYTHONPATH).
    without = (sorted(discover_accelerators()), default_accelerator().name)
    assert "example-host" in installed and "example-host" not in without[0], (installed, without)
    assert default == without[1] != "example-host", (with_example.stdout, without)


class _PretendDevice(CpuAccelerator):
    """An always-available non-cpu accelerator, for the selection rule alone."""

    def __init__(self, name: str, may_be_default: bool) -> None:
        self.name = name
        self.may_be_default = may_be_default


def test_default_rule_skips_accelerators_that_may_not_be_default():
    cpu = CpuAccelerator()
    known: dict[str, Accelerator] = {"cpu": cpu, "aaa-test": _PretendDevice("aaa-test", False)}
    assert default_accelerator(known) is cpu
    device = _PretendDevice("zzz-device", True)
    assert default_accelerator({**known, "zzz-device": device}) is device
    assert Accelerator.may_be_default is True  # a vendor's device is a default unless it says otherwise
