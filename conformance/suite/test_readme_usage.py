"""The README's usage example is true: it runs as written in a fresh interpreter with no hostoffload variables set,
on every implementation providing "pinning" (its import line is pointed at each), and every line the example
comments with ``# True`` / ``# False`` prints exactly that."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance_area("pinning")

# The source tree: $HOSTOFFLOAD_SOURCE_ROOT (tox sets it; the installed wheel has no README), else this checkout.
_ROOT = Path(os.environ.get("HOSTOFFLOAD_SOURCE_ROOT") or Path(__file__).resolve().parents[2])
README = _ROOT / "README.md"
IMPORT_LINE = re.compile(r"^import optimized as ho\b.*$", re.MULTILINE)
EXPECTED = re.compile(r"^print\(.*\)\s*#\s*(True|False)\b")


def _usage_example() -> str:
    if not README.exists():
        pytest.skip(f"{README} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    text = README.read_text()
    section = text[text.index("## Usage") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "README's Usage section has no python example"
    return match.group(1)


def test_readme_usage_example_runs_and_its_comments_are_true(impl):
    code = _usage_example()
    assert IMPORT_LINE.search(code), "the example no longer imports `optimized as ho`; update this test"
    code = IMPORT_LINE.sub(f"import {impl.areas['pinning']} as ho", code)
    expected = [(i, m.group(1)) for i, line in enumerate(code.splitlines()) if (m := EXPECTED.match(line))]
    assert len(expected) >= 3, "the example should show what is_pinned answers"
    # A fresh user: no hostoffload variable set, the default accelerator.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTOFFLOAD_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the README example failed:\n{proc.stderr[-3000:]}"
    printed = proc.stdout.splitlines()
    prints = [i for i, line in enumerate(code.splitlines()) if line.startswith("print(")]
    assert len(printed) == len(prints), f"expected {len(prints)} printed lines, got {printed}"
    by_line = dict(zip(prints, printed, strict=True))
    for line_no, want in expected:
        assert by_line[line_no] == want, (
            f"README line {code.splitlines()[line_no]!r} says {want}, prints {by_line[line_no]} ({impl.name})"
        )


def test_example_help_shows_every_default():
    """examples/train_gpt.py --help: every option with a value says its default (a first run starts there)."""
    script = _ROOT / "examples" / "train_gpt.py"
    if not script.exists():
        pytest.skip(f"{script} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    options = " ".join(proc.stdout.split("options:", 1)[1].split())  # re-flow wrapped help lines
    entries = re.split(r"\s(?=--[a-z])", options)[1:]
    assert len(entries) >= 10, options
    missing = [e.split()[0] for e in entries if "(default:" not in e and not e.startswith("--help")]
    assert not missing, f"--help shows no default for {missing}"
