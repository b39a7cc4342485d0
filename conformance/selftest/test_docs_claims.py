"""What README.md and docs/*.md promise a user in prose, held to the code and the build (issue 52's first-hour
defects: each was a page that told a new user something the code or the packaging did not do).

The examples themselves run in ``test_docs_examples.py``; these checks cover what an example cannot show: a
behaviour the docs call supported that the code refuses, a signature written differently from the function's,
an example needing a package that ``pip install .`` does not bring, a command whose cost the page does not warn
about.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance.docs_examples import pages
from conformance.selftest.runner import source_root

pytestmark = pytest.mark.conformance_area("harness")

ROOT = source_root()


def _root() -> Path:
    if ROOT is None:
        pytest.skip("no source checkout (README.md and docs/ are not in the wheel): set HOSTOFFLOAD_SOURCE_ROOT")
    return ROOT


def _sentences(text: str) -> list[str]:
    """The page's prose as sentences, line breaks and list markers folded into spaces (code blocks dropped)."""
    prose = re.sub(r"^```.*?^```", " ", text, flags=re.M | re.S)
    flat = re.sub(r"\s+", " ", prose)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(*])", flat)]


#: A checkpoint save placed between the boundary's last backward and its step.
_SAVE_BEFORE_STEP = re.compile(
    r"(save|checkpoint)[^.;]{0,80}between the (last )?backward and the step"
    r"|between the (last )?backward and the step[^.;]{0,80}(save|checkpoint)",
    re.I,
)


def test_no_page_calls_a_save_between_the_last_backward_and_step_supported():
    """Issue 52, defect 5: docs/zero.md listed "checkpoints (a save between the last backward and the step ...)"
    among what R30 supports, and docs/accumulation.md counted "a checkpoint save" among the reads there, while
    ``save_checkpoint`` refuses a save with a gradient accumulated since the last boundary
    (UnsupportedOperationError: the gradient is not part of a checkpoint; the conformance test
    ``test_R30_a_save_between_last_backward_and_step_is_refused_and_leaves_no_trace`` holds the engine to it).
    Every sentence of the docs that places a save or checkpoint between the last backward and the step says it is
    refused."""
    wrong = []
    for page in pages(_root()):
        for sentence in _sentences(page.read_text()):
            if _SAVE_BEFORE_STEP.search(sentence) and not re.search(r"refused|UnsupportedOperationError", sentence):
                wrong.append(f"{page.name}: {sentence[:300]}")
    assert not wrong, "sentences that call a save between the last backward and the step supported:\n" + "\n".join(
        wrong
    )
