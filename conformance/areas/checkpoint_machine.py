"""The checkpoint state machine: save / load / train / damage, with filesystem faults, on one engine rank.

It runs inside a rank process of the harness's pool (the engine needs its process group), driven by hypothesis
there; the test in ``test_accumulation_checkpoint_faults`` passes the profile's counts and reads back how many
steps ran. The engine class is the implementation's own (``engine_class(impl)``).

The model of what the disk must hold, per tag: the states a load may restore. A save that returns makes its
state the only one; a save that raises (a write failing at its k-th byte with ENOSPC or EIO, a rename that
fails) changes nothing; a save killed part-way (:class:`~conformance.faults.checkpoint_faults.Killed`) may leave the
previous checkpoint or the new one, whichever side of the commit it died on, never a third; damage after the save
(bytes flipped, a file truncated) must make the load raise. **Invariant**: ``load_checkpoint`` either restores
exactly one of the allowed states -- parameters, fp32 master, optimizer state, counters, learning rate,
bitwise -- or raises ``CheckpointError`` (and only where the model allows an error), leaving the engine as it
was; after every save that returns, no staging leftovers remain in the directory, and a save that raises adds
none (leftovers of an earlier killed save may stay if the failing disk also fails their recovery).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conformance.areas.accumulation_engines import engine_class
from conformance.faults.checkpoint_faults import FilesystemFaults, Killed
from reference.contract.accumulation_scenario import ModelSpec, compute_loss
from reference.contract.errors import CheckpointError

SEED = 5
#: (zero_stage, extra config) the machine picks from: every stage, offload, a second dtype.
CONFIGS: tuple[tuple[int, dict[str, Any]], ...] = (
    (0, {}),
    (1, {"dtype": "bf16", "grad_accum_dtype": "fp32"}),
    (2, {"offload_optimizer": "cpu"}),
    (3, {"offload_optimizer": "cpu", "offload_param": "cpu"}),
)
TAGS = ("a", "b")
#: What a load of a tag may do that the model allows to fail (no state: the tag was never saved, or damaged).
RAISES = "raises"
#: tensor bytes dominate the files, so damage mostly lands in tensor data
SPEC = ModelSpec(hidden=48)
#: None, or (kind, where, errno): a write failing at its k-th byte, the n-th rename failing, a kill at step n.
FAULTS = st.one_of(
    st.none(),
    st.tuples(st.just("write"), st.integers(0, 12_000), st.sampled_from([errno.ENOSPC, errno.EIO])),
    st.tuples(st.just("rename"), st.integers(1, 3), st.just(errno.EIO)),
    st.tuples(st.just("kill"), st.integers(1, 20), st.just(0)),
)


def train_one_boundary(engine: Any, seed: int) -> None:
    """One backward and step of ``engine`` on a :class:`ModelSpec` batch of 2 drawn from ``seed``: a boundary of a
    config with ``gradient_accumulation_steps`` 1 (the checkpoint tests' unit of training)."""
    spec = ModelSpec()
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, spec.in_features, generator=gen), torch.randn(2, spec.out_features, generator=gen)
    engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
    engine.step()


def engine_state(engine: Any) -> dict[str, Any]:
    """Everything a checkpoint restores that the public surface shows."""
    opt = engine.optimizer_state()
    return {
        "params": engine.state_dict(),
        "master": engine.master_partition(),
        "opt": {k: v.clone() for k, v in opt.buffers.items()},
        "opt_step": opt.step,
        "counters": (engine.micro_steps, engine.global_steps, engine.global_samples),
        "lr": engine.get_lr(),
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["counters"] != b["counters"] or a["lr"] != b["lr"] or a["opt_step"] != b["opt_step"]:
        return False
    if not torch.equal(a["master"], b["master"]) or a["opt"].keys() != b["opt"].keys():
        return False
    if any(not torch.equal(a["opt"][k], b["opt"][k]) for k in a["opt"]):
        return False
    return a["params"].keys() == b["params"].keys() and all(torch.equal(a["params"][k], b["params"][k])
                                                            for k in a["params"])


class CheckpointMachine(RuleBasedStateMachine):
    """The machine itself; :func:`run_machine` binds it to one rank (engine class, process group, directory)."""

    engine_class: Any = None
    group: Any = None
    workdir: str = ""
    counter: dict[str, int] = {}
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(dir=self.workdir)
        self.engine: Any = None  # the implementation's engine under test, built by a rule
        self.allowed: dict[str, list[Any]] = {t: [RAISES] for t in TAGS}
        self.latest: list[str | None] = [None]
        self.batch = 0

    @initialize(config=st.sampled_from(CONFIGS))
    def build(self, config: tuple[int, dict]) -> None:
        stage, extra = config
        cfg = {"zero_stage": stage, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "adamw", "lr": 0.01}, **extra}
        self.engine = self.engine_class(SPEC.build(SEED), cfg, process_group=self.group)

    @rule()
    def train(self) -> None:
        gen = torch.Generator().manual_seed(self.batch)
        self.batch += 1
        x, y = torch.randn(2, SPEC.in_features, generator=gen), torch.randn(2, SPEC.out_features, generator=gen)
        self.engine.backward(compute_loss(self.engine.module, x, y, self.engine.config.model_dtype))
        self.engine.step()

    @rule(tag=st.sampled_from(TAGS), save_latest=st.booleans(), fault=FAULTS)
    def save(self, tag: str, save_latest: bool, fault: Any) -> None:
        state = engine_state(self.engine)
        before = set(self._hidden())
        injected = FilesystemFaults(self.dir, fault[0], fault[1], fault[2]) if fault else None
        outcome = "returned"
        try:
            if injected is None:
                path = self.engine.save_checkpoint(self.dir, tag, save_latest=save_latest)
            else:
                with injected:
                    path = self.engine.save_checkpoint(self.dir, tag, save_latest=save_latest)
        except Killed:
            outcome = "killed"
            assert injected is not None  # only an injected fault kills a save
            injected.restore_killed_state()
        except CheckpointError as exc:
            outcome = "raised"
            assert injected is not None and injected.fired, f"save raised without a fault: {exc}"
            assert self.dir in str(exc), f"the error does not name save_dir {self.dir!r}: {exc}"
        if outcome == "returned":
            assert path == os.path.join(self.dir, tag), path
            self.allowed[tag] = [state]
            if save_latest:
                self.latest = [tag]
            hidden = self._hidden()
            assert not hidden, f"a save that returned left {hidden} in the directory"
        elif outcome == "killed":
            self.allowed[tag] = [*self.allowed[tag], state]
            if save_latest:
                self.latest = [*self.latest, tag]
        elif outcome == "raised":
            # What a killed save left before this one may stay (its recovery can fail on the same faulty disk);
            # a save that raises adds nothing.
            added = sorted(set(self._hidden()) - before)
            assert not added, f"a save that raised ({fault}) left {added} in the directory"
        if outcome != "returned":  # what the fault left is checked at once, before a later save replaces it
            self.load(tag)

    @precondition(lambda self: any(os.path.isdir(os.path.join(self.dir, t)) for t in TAGS))
    @rule(tag=st.sampled_from(TAGS), which=st.integers(0, 7), how=st.sampled_from(["flip", "truncate"]),
          where=st.floats(0, 1), length=st.integers(1, 64))
    def damage(self, tag: str, which: int, how: str, where: float, length: int) -> None:
        folder = os.path.join(self.dir, tag)
        if not os.path.isdir(folder):
            return
        names = sorted(os.listdir(folder))  # the manifest and the rank files, whatever their names
        path = os.path.join(folder, names[which % len(names)])
        size = os.path.getsize(path)
        if size == 0:
            return
        with open(path, "r+b") as f:
            if how == "truncate":
                f.truncate(int(where * (size - 1)))
            else:
                at = min(int(where * size), size - 1)
                f.seek(at)
                old = f.read(min(length, size - at))
                f.seek(at)
                f.write(bytes(b ^ 0xA5 for b in old))
        self.allowed[tag] = [RAISES]
        self.load(tag)  # at once, before another save of the tag can replace the damaged files

    @rule(tag=st.sampled_from((*TAGS, None)))
    def load(self, tag: str | None) -> None:
        before = engine_state(self.engine)
        allowed: list[Any] = (
            self.allowed[tag] if tag is not None
            else [s for t in self.latest for s in (self.allowed[t] if t is not None else [RAISES])]
        )
        try:
            self.engine.load_checkpoint(self.dir, tag)
        except CheckpointError as exc:
            assert RAISES in allowed, f"load_checkpoint({tag!r}) raised, but a good checkpoint is there: {exc}"
            assert same_state(engine_state(self.engine), before), "a failed load changed the engine"
            return
        got = engine_state(self.engine)
        states = [s for s in allowed if s is not RAISES]
        assert states, f"load_checkpoint({tag!r}) loaded something, but no complete save of it exists"
        assert any(same_state(got, s) for s in states), (
            f"load_checkpoint({tag!r}) restored a state that no save of it had"
        )

    def _hidden(self) -> list[str]:
        """Staging leftovers: hidden entries (``.<tag>.partial``, ``.<tag>.old``) and ``*.tmp`` files."""
        return [e for e in os.listdir(self.dir) if e.startswith(".") or e.endswith(".tmp")]

    @invariant()
    def count(self) -> None:
        self.counter["steps"] += 1

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_machine(group: Any, impl: Any, examples: int, steps: int, derandomize: bool, workdir: str) -> int:
    """Run the machine ``examples`` times (``steps`` rules each) in this rank process; returns the steps run."""
    counter = {"steps": 0}
    bound = type("BoundCheckpointMachine", (CheckpointMachine,), {
        "engine_class": engine_class(impl), "group": group, "workdir": workdir, "counter": counter})
    # No shrinking: the rank worker answers within the pool's timeout (two minutes by default), and shrinking
    # sequences that each build an engine can take longer; a failure prints the sequence as it was found.
    run_state_machine_as_test(
        bound,
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=derandomize,
                          database=None, suppress_health_check=list(HealthCheck),
                          phases=(Phase.explicit, Phase.reuse, Phase.generate)),
    )
    return counter["steps"]
