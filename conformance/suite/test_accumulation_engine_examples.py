"""docs/zero.md's usage example and examples/train_zero_resume.py run as written, against the implementation under
test (its accumulation module replaces ``optimized.accumulation`` in the text), in fresh processes with gloo.

Both need the source tree (``$HOSTOFFLOAD_SOURCE_ROOT``; docs/ and examples/ are not in the wheel) and are skipped
for implementations that do not declare a multi-process engine.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, REQUIRES_ENGINE, engine_api

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_ENGINE, pytest.mark.runs_in_subprocesses]

_ROOT = Path(os.environ.get("HOSTOFFLOAD_SOURCE_ROOT") or Path(__file__).resolve().parents[2])
DOC = _ROOT / "docs" / "zero.md"
SCRIPT = _ROOT / "examples" / "train_zero_resume.py"
DOCUMENTED_MODULE = "optimized.accumulation"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict[str, str], timeout: float = 240) -> str:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=_ROOT, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _usage_blocks() -> str:
    if not DOC.exists():
        pytest.skip(f"{DOC} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    text = DOC.read_text()
    section = text[text.index("## Using it") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, "docs/zero.md 'Using it' has no python block"
    return "\n".join(blocks)


@REQUIRES_CHECKPOINT
def test_R1_zero_md_usage_example_runs_as_written(impl, tmp_path):
    """The python blocks of docs/zero.md's "Using it" (DeepSpeed-shaped config, bf16 inputs cast as shown,
    scheduler, save_checkpoint, consolidated state_dict, load_checkpoint into a fresh engine, the flat config)
    run in a fresh single-rank process without an error (R1: one rank's engine)."""
    module = engine_api(impl).impl.load('accumulation').__name__
    code = _usage_blocks().replace(DOCUMENTED_MODULE, module)
    code += (f"\nfrom {module} import AccumulationConfig\nAccumulationConfig.from_dict(flat)\n"
             "print(open(os.path.join(ckpt, 'latest')).read())\nprint('doc ok')\n")
    path = tmp_path / "usage.py"
    path.write_text(code)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    assert _run([sys.executable, str(path)], env).splitlines()[-2:] == ["global_step2", "doc ok"]


@REQUIRES_CHECKPOINT
def test_R1_deepspeed_style_script_saves_on_two_ranks_and_resumes_on_one(impl, tmp_path):
    """examples/train_zero_resume.py (DeepSpeed config dict, LambdaLR, periodic save_checkpoint, resume)
    trains 2 boundaries on 2 gloo ranks (torchrun's environment) saving each, then resumes from ``latest`` on
    1 rank and trains a third: the resumed run reports the saved world size and step and finishes."""
    module = engine_api(impl).impl.load('accumulation').__name__
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not found: set HOSTOFFLOAD_SOURCE_ROOT to a source checkout")
    ck = str(tmp_path / "ck")
    common = [str(SCRIPT), "--backend", "gloo", "--save-every", "1", "--ckpt-dir", ck, "--engine-module", module]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # Two ranks as torchrun would start them (its environment variables), without its agent process.
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, *common, "--steps", "2", "--stage", "3"],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in ranks]
    for r, (p, (out, err)) in enumerate(zip(ranks, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed ({p.returncode}):\n{out}\n{err[-4000:]}"
    first = outs[0][0]
    assert "step 2 " in first and "final checksum" in first, first
    assert sorted(e for e in os.listdir(ck) if not e.startswith(".")) == ["global_step1", "global_step2", "latest"]
    env.update(MASTER_PORT=str(_free_port()))
    second = _run([sys.executable, *common, "--steps", "3", "--stage", "1", "--resume"], env)
    assert "at step 2 (saved by 2 ranks, now 1)" in second, second
    assert "step 3 " in second and "final checksum" in second, second
