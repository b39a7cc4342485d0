"""The Python examples of README.md and docs/*.md, extracted and run as the scripts they claim to be.

Every fenced ``python`` block is one complete program: it defines what it uses (no ``model`` or ``loader`` left
to the reader) and runs on a CPU-only machine. A block that cannot (it needs a GPU) says so with an HTML comment
on the line right before its fence, which the rendered page does not show::

    <!-- docs-test: needs cuda -->

and is then skipped where CUDA is not available, with that reason. A block that needs an optional package (one of
the extras, e.g. Lightning) says ``<!-- docs-test: needs lightning -->`` and is skipped where that package does not
import, with the reason the report attributes to a missing package (conformance.harness.optional_packages). Nothing else
exempts a block.

A block that says it runs under ``torchrun`` (one process per rank, each reading ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``) carries ``<!-- docs-test: torchrun -->``: it is run as above (a world of one)
and also by two processes at once, as ``torchrun --nproc_per_node 2`` would start it (gloo, CPU). Every block that
starts a process group must carry it (``conformance/selftest/test_docs_examples.py`` checks), so no example can
claim to run at N ranks without being run at two.

To keep the cost of a fresh interpreter (torch's import) to one, :func:`main` runs all blocks in one child
process, one after the other, each as a script of its own: fresh globals named ``__main__``, the environment a
new user has (no ``HOSTOFFLOAD_*`` variable; restored after each block), the working directory a fresh temporary
one, and the block's lines numbered as in its page, so a traceback points into the page. It prints one JSON
line per block; ``conformance/selftest/test_docs_examples.py`` runs it and reports each block as one test.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<what>[^>]*?)\s*-->\s*$")
#: What a marker may say, and what it means: "cuda" (a device), else the name of an optional package to import.
NEEDS = {"needs cuda": "cuda", "needs lightning": "lightning"}
#: The marker of a block that runs under torchrun (at two ranks in the test, besides the run at one).
TORCHRUN = "torchrun"
#: With several ranks, the ``MASTER_PORT`` of each block run, in order (comma-separated): every block starts and
#: ends its own process group, and a rank starting the next one must not find the previous block's store.
PORTS_ENV = "DOCS_EXAMPLE_MASTER_PORTS"


@dataclass(frozen=True)
class Block:
    """One example: its page (relative to the source root), the page line of its first code line, its code, and
    what it needs beyond a CPU (None: nothing)."""

    page: str
    line: int
    code: str
    needs: str | None = None
    torchrun: bool = False

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path) -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def blocks_of(page: Path, root: Path) -> list[Block]:
    """The python blocks of ``page``, dedented (a block inside a list item is indented with it)."""
    text = page.read_text()
    out = []
    for match in _FENCE.finditer(text):
        indent = match.group("indent")
        code_lines = match.group("code").splitlines()
        if any(line.strip() and not line.startswith(indent) for line in code_lines):
            raise ValueError(f"{page}: a python block at offset {match.start()} is not indented like its fence")
        code = "\n".join(line[len(indent):] for line in code_lines) + "\n"
        fence_line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        needs, torchrun = None, False
        if marker:
            what = marker.group("what")
            if what not in NEEDS and what != TORCHRUN:
                raise ValueError(f"{page}:{fence_line - 1}: unknown docs-test marker {what!r}; allowed: "
                                 f"{', '.join([*NEEDS, TORCHRUN])}")
            needs, torchrun = NEEDS.get(what), what == TORCHRUN
        out.append(Block(str(page.relative_to(root)), fence_line + 1, code, needs, torchrun))
    return out


def all_blocks(root: Path) -> list[Block]:
    return [b for page in pages(root) for b in blocks_of(page, root)]


def _run_one(block: Block, root: Path, port: str | None = None) -> dict[str, object]:
    """Run ``block`` as ``__main__`` in this process; the environment and working directory are restored."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for key in [k for k in os.environ if k.startswith("HOSTOFFLOAD_")]:
        del os.environ[key]
    if port is not None:
        os.environ["MASTER_PORT"] = port
    result: dict[str, object] = {"name": block.name, "ok": True, "error": ""}
    with tempfile.TemporaryDirectory(prefix="docs-example-") as cwd:
        os.chdir(cwd)
        try:
            padded = "\n" * (block.line - 1) + block.code  # line numbers as in the page
            exec(compile(padded, str(root / block.page), "exec"), {"__name__": "__main__"})
        except BaseException:  # SystemExit too: a block must not end the run
            result.update(ok=False, error=traceback.format_exc()[-4000:])
        finally:
            _destroy_leftover_group()
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
    return result


def _destroy_leftover_group() -> None:
    """A block that failed before ``destroy_process_group()`` must not fail the next one ("initialize the default
    process group twice"): its group is destroyed here."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """``python -m conformance.harness.docs_examples ROOT NAME...``: run the named blocks, one JSON line each (the i-th
    block run on the i-th port of :data:`PORTS_ENV` when it is set)."""
    root, wanted = Path(argv[0]), set(argv[1:])
    ports = [p for p in os.environ.get(PORTS_ENV, "").split(",") if p]
    for block in all_blocks(root):
        if block.name in wanted:
            sys.stdout.flush()
            result = _run_one(block, root, ports.pop(0) if ports else None)
            sys.stdout.write("\n" + json.dumps({"docs-example": result}) + "\n")
            sys.stdout.flush()
    return 0


__all__ = ["NEEDS", "PORTS_ENV", "TORCHRUN", "Block", "all_blocks", "blocks_of", "main", "pages"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
