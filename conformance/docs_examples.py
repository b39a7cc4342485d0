"""The Python examples of README.md and docs/*.md, extracted and run as the scripts they claim to be.

Every fenced ``python`` block is one complete program: it defines what it uses (no ``model`` or ``loader`` left
to the reader) and runs on a CPU-only machine. A block that cannot (it needs a GPU) says so with an HTML comment
on the line right before its fence, which the rendered page does not show::

    <!-- docs-test: needs cuda -->

and is then skipped where CUDA is not available, with that reason. Nothing else exempts a block.

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
#: What a marker may say, and what it means.
NEEDS = {"needs cuda": "cuda"}


@dataclass(frozen=True)
class Block:
    """One example: its page (relative to the source root), the page line of its first code line, its code, and
    what it needs beyond a CPU (None: nothing)."""

    page: str
    line: int
    code: str
    needs: str | None = None

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
        needs = None
        if marker:
            what = marker.group("what")
            if what not in NEEDS:
                raise ValueError(f"{page}:{fence_line - 1}: unknown docs-test marker {what!r}; allowed: "
                                 f"{', '.join(NEEDS)}")
            needs = NEEDS[what]
        out.append(Block(str(page.relative_to(root)), fence_line + 1, code, needs))
    return out


def all_blocks(root: Path) -> list[Block]:
    return [b for page in pages(root) for b in blocks_of(page, root)]


def _run_one(block: Block, root: Path) -> dict[str, object]:
    """Run ``block`` as ``__main__`` in this process; the environment and working directory are restored."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for key in [k for k in os.environ if k.startswith("HOSTOFFLOAD_")]:
        del os.environ[key]
    result: dict[str, object] = {"name": block.name, "ok": True, "error": ""}
    with tempfile.TemporaryDirectory(prefix="docs-example-") as cwd:
        os.chdir(cwd)
        try:
            padded = "\n" * (block.line - 1) + block.code  # line numbers as in the page
            exec(compile(padded, str(root / block.page), "exec"), {"__name__": "__main__"})
        except BaseException:  # SystemExit too: a block must not end the run
            result.update(ok=False, error=traceback.format_exc()[-4000:])
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
    return result


def main(argv: list[str]) -> int:
    """``python -m conformance.docs_examples ROOT NAME...``: run the named blocks, one JSON line each."""
    root, wanted = Path(argv[0]), set(argv[1:])
    for block in all_blocks(root):
        if block.name in wanted:
            sys.stdout.flush()
            result = _run_one(block, root)
            sys.stdout.write("\n" + json.dumps({"docs-example": result}) + "\n")
            sys.stdout.flush()
    return 0


__all__ = ["NEEDS", "Block", "all_blocks", "blocks_of", "main", "pages"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
