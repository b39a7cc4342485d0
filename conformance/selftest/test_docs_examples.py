"""Every Python example of README.md and docs/*.md runs as written, as a complete script on a CPU-only machine
(``conformance.docs_examples`` says how blocks are found, marked and run). One child interpreter runs them all;
each block is reported as its own test, named by its page and line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.docs_examples import Block, all_blocks, blocks_of
from conformance.selftest.runner import child_env, source_root

pytestmark = pytest.mark.conformance_area("harness")

ROOT = source_root()
BLOCKS = all_blocks(ROOT) if ROOT is not None else []


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """name -> result of every block this machine can run, from one child interpreter."""
    runnable = [b.name for b in BLOCKS if b.needs is None or (b.needs == "cuda" and _cuda_available())]
    # Blocks that start a torch.distributed group of one (docs/zero.md) find it as torchrun would give it, on a
    # free port: the fixed port a block falls back to could be taken by another run on this machine.
    env = child_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": _free_port(), "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([sys.executable, "-m", "conformance.docs_examples", str(ROOT), *runnable],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path_factory.mktemp("docs-examples"))  # not ROOT: import what is installed
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"docs-example"'):
            result = json.loads(line)["docs-example"]
            out[result["name"]] = result
    missing = [n for n in runnable if n not in out]
    assert not missing, (f"the example runner stopped before {missing} (status {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out


@pytest.mark.skipif(ROOT is None, reason="docs/ not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
def test_the_pages_have_examples():
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/zero.md", "docs/offload.md", "docs/io.md"} <= pages, pages


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_docs_example_runs_as_written(block: Block, results):
    if block.needs == "cuda" and not _cuda_available():
        pytest.skip(f"{block.name} is marked 'needs cuda' and CUDA is not available here")
    result = results[block.name]
    assert result["ok"], f"{block.name} failed:\n{result['error']}"


def test_blocks_are_found_dedented_and_marked(tmp_path: Path):
    """The extraction the test above relies on: a block in a list item is dedented, the marker applies to the
    block right after it only, an unknown marker is an error, and other languages are not taken."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("text\n\n1. step\n\n   ```python\n   x = 1\n   ```\n\n<!-- docs-test: needs cuda -->\n"
                    "```python\nimport torch\n```\n\n```bash\nls\n```\n\n```python\ny = 2\n```\n")
    got = blocks_of(page, tmp_path)
    assert [(b.line, b.code, b.needs) for b in got] == [(6, "x = 1\n", None), (11, "import torch\n", "cuda"),
                                                       (19, "y = 2\n", None)]
    page.write_text("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker 'skip'"):
        blocks_of(page, tmp_path)
