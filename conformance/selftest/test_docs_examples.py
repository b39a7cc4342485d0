"""Every Python example of README.md and docs/*.md runs as written, as a complete script on a CPU-only machine
(``conformance.harness.docs_examples`` says how blocks are found, marked and run). One child interpreter runs them all;
each block is reported as its own test, named by its page and line. The blocks marked as running under torchrun
run once more, in two child interpreters at once (ranks 0 and 1, gloo), as ``torchrun --nproc_per_node 2``
would start them."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.harness.docs_examples import PORTS_ENV, Block, all_blocks, blocks_of
from conformance.harness.optional_packages import MISSING_PREFIX
from conformance.selftest.runner import child_env, source_root

pytestmark = pytest.mark.conformance_area("harness")

ROOT = source_root()
BLOCKS = all_blocks(ROOT) if ROOT is not None else []
TORCHRUN_BLOCKS = [b for b in BLOCKS if b.torchrun and b.needs is None]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _unmet(block: Block) -> str | None:
    """Why ``block`` cannot run here (a skip reason), or None: CUDA for 'needs cuda', else its optional package
    (the reason starts as conformance.harness.optional_packages says, so the report names the package)."""
    if block.needs is None:
        return None
    if block.needs == "cuda":
        return None if _cuda_available() else f"{block.name} is marked 'needs cuda' and CUDA is not available here"
    if importlib.util.find_spec(block.needs) is not None:
        return None
    return f"{MISSING_PREFIX} '{block.needs}' ({block.name} is marked 'needs {block.needs}')"


def _free_port() -> str:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[str]:
    """``n`` distinct free ports (each socket stays bound until all are chosen, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [str(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _parse(stdout: str) -> dict[str, dict]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith('{"docs-example"'):
            result = json.loads(line)["docs-example"]
            out[result["name"]] = result
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """name -> result of every block this machine can run, from one child interpreter."""
    runnable = [b.name for b in BLOCKS if _unmet(b) is None]
    # Blocks that start a torch.distributed group of one (docs/zero.md) find it as torchrun would give it, on a
    # free port: the fixed port a block falls back to could be taken by another run on this machine.
    env = child_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": _free_port(), "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([sys.executable, "-m", "conformance.harness.docs_examples", str(ROOT), *runnable],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path_factory.mktemp("docs-examples"))  # not ROOT: import what is installed
    out = _parse(proc.stdout)
    missing = [n for n in runnable if n not in out]
    assert not missing, (f"the example runner stopped before {missing} (status {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory) -> list[dict[str, dict]]:
    """Per rank (0, 1): name -> result of every torchrun block, the two ranks run at once as torchrun starts them
    (the blocks one after another, each on its own port)."""
    names = [b.name for b in TORCHRUN_BLOCKS]
    base = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": None,
            PORTS_ENV: ",".join(_free_ports(len(names))), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "conformance.harness.docs_examples", str(ROOT), *names],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env({**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}),
                         cwd=tmp_path_factory.mktemp(f"docs-examples-rank{rank}"))
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    results = [_parse(stdout) for stdout, _ in outputs]
    for rank, (result, (stdout, stderr)) in enumerate(zip(results, outputs, strict=True)):
        missing = [n for n in names if n not in result]
        assert not missing, (f"rank {rank} of the torchrun examples stopped before {missing}:\n{stdout[-3000:]}\n"
                             f"{stderr[-3000:]}")
    return results


@pytest.mark.skipif(ROOT is None, reason="docs/ not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
def test_the_pages_have_examples():
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/zero.md", "docs/offload.md", "docs/io.md"} <= pages, pages


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_docs_example_runs_as_written(block: Block, results):
    reason = _unmet(block)
    if reason is not None:
        pytest.skip(reason)
    result = results[block.name]
    assert result["ok"], f"{block.name} failed:\n{result['error']}"


@pytest.mark.parametrize("block", TORCHRUN_BLOCKS, ids=[b.name for b in TORCHRUN_BLOCKS])
def test_docs_example_runs_under_torchrun_at_two_ranks(block: Block, torchrun_results):
    """A block marked ``torchrun`` runs as written in two processes at once (RANK 0 and 1, WORLD_SIZE 2, gloo):
    what it does with files and collectives is right at N ranks, not only at one (docs/zero.md's first example
    made a checkpoint directory per rank, and its save refused: ``ranks passed different (save_dir, tag)``)."""
    for rank, results in enumerate(torchrun_results):
        result = results[block.name]
        assert result["ok"], f"{block.name} failed on rank {rank} of 2:\n{result['error']}"


def test_blocks_that_start_a_process_group_are_marked_torchrun():
    """An example that starts a torch.distributed group is one that claims to run under torchrun: it must carry
    the marker, so that it is run at two ranks (above) and not only at one."""
    unmarked = [b.name for b in BLOCKS if "init_process_group" in b.code and not b.torchrun]
    assert not unmarked, f"examples that start a process group without <!-- docs-test: torchrun -->: {unmarked}"
    if ROOT is not None:
        assert TORCHRUN_BLOCKS, "no example is run under torchrun (docs/zero.md has some)"


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
    page.write_text("<!-- docs-test: torchrun -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    assert [(b.line, b.needs, b.torchrun) for b in blocks_of(page, tmp_path)] == [(3, None, True), (7, None, False)]


def test_a_block_marked_with_an_optional_package_is_skipped_only_where_it_is_missing(tmp_path: Path):
    """``needs lightning`` marks a block that imports an optional package: it runs where the package imports and is
    skipped elsewhere with the missing-package reason the report attributes (never failed for the environment)."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("<!-- docs-test: needs lightning -->\n```python\nimport lightning\n```\n")
    (block,) = blocks_of(page, tmp_path)
    assert block.needs == "lightning"
    absent = Block(block.page, block.line, block.code, "no_such_package_hostoffload")
    assert _unmet(absent) == f"{MISSING_PREFIX} 'no_such_package_hostoffload' (docs/page.md:3 is marked 'needs " \
                             f"no_such_package_hostoffload')"
    assert _unmet(Block(block.page, block.line, block.code, "json")) is None
