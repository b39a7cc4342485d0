"""Checkpoints that never lose a run (issue 28; docs/zero.md, "Checkpoints: what is guaranteed").

For every implementation declaring ``distributed_engine`` and ``accumulation_checkpoint``: the state machine of
:mod:`conformance.areas.checkpoint_machine` (save / load / train / damage with a write failing at its k-th byte, a
rename failing, a process killed between two filesystem steps), a real kill of a child process in the middle of
a save, and one test per row of the issue's table: each names what the user did and what must happen. Faults
come from :mod:`conformance.faults.checkpoint_faults`, at the process's filesystem boundary; nothing of the
implementation is patched.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, engine_api, engine_class
from conformance.areas.checkpoint_machine import engine_state, run_machine, same_state, train_one_boundary
from conformance.faults.checkpoint_faults import FilesystemFaults
from conformance.harness.profiles import STATE_MACHINE_EXAMPLES, current_profile, state_machine_settings
from reference.contract.accumulation_scenario import ModelSpec
from reference.contract.errors import CheckpointError, ConfigurationError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_CHECKPOINT, pytest.mark.runs_in_subprocesses]

SEED = 3
CONFIG = {"zero_stage": 2, "offload_optimizer": "cpu", "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 1, "optimizer": {"type": "adamw", "lr": 0.01}}


def _listing(directory: str) -> dict[str, list[str]]:
    return {root: sorted(files + dirs) for root, dirs, files in os.walk(directory)}


def test_checkpoint_state_machine_with_faults(impl, tmp_path):
    """The invariant of :mod:`conformance.areas.checkpoint_machine` over the profile's examples: a load restores exactly
    the state of a save that returned (or, after a kill, of the save that was cut short), or raises
    CheckpointError where the checkpoint is missing or damaged -- never something else."""
    api = engine_api(impl)
    base = state_machine_settings()
    examples = max(6, STATE_MACHINE_EXAMPLES.get(current_profile() or "", 40) // 8)
    steps = api.run_on_ranks(run_machine, 1, impl, examples, min(base.stateful_step_count, 25), base.derandomize,
                             str(tmp_path))[0]
    print(f"checkpoint state-machine steps ({impl.name}): {steps}")
    assert steps >= examples, f"the machine ran {steps} steps for {examples} examples"


# ---- a real kill -------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, pickle, tempfile
    import torch, torch.distributed as dist
    from conformance.areas.accumulation_engines import engine_class
    from conformance.faults.checkpoint_faults import FilesystemFaults
    from conformance.areas.checkpoint_machine import engine_state, train_one_boundary
    from conformance.suite.test_accumulation_checkpoint_faults import CONFIG, SEED
    from reference.contract.accumulation_scenario import ModelSpec
    impl, directory, fraction, out = pickle.loads(bytes.fromhex(sys.argv[1]))
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG)
    train_one_boundary(engine, 0)
    with FilesystemFaults(directory, "kill", 0) as counting:  # at=0: counts the steps of a save, fires never
        engine.save_checkpoint(directory, "ck")
    step = max(1, round(fraction * counting.count))
    first = engine_state(engine)
    train_one_boundary(engine, 1)
    second = engine_state(engine)
    torch.save({"first": first, "second": second}, out)
    faults = FilesystemFaults(directory, "kill", step, on_kill=lambda: os.kill(os.getpid(), signal.SIGKILL))
    with faults:
        engine.save_checkpoint(directory, "ck")
    print("save returned", flush=True)
    """
)


def _load_after_kill(group, impl, directory: str) -> dict | str:
    engine = engine_class(impl)(ModelSpec().build(SEED + 1), CONFIG, process_group=group)
    try:
        engine.load_checkpoint(directory, "ck")
        return engine_state(engine)
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.destroy()


@pytest.mark.parametrize("fraction", [0.3, 0.7, 0.85, 1.0])
def test_a_save_killed_part_way_leaves_the_previous_or_the_new_checkpoint(impl, tmp_path, fraction):
    """A child process saves (counting the filesystem steps of a save), trains, and is SIGKILLed at the step
    ``fraction`` of the way through its second save of the same tag (early: while files are staged; late:
    between the commit's renames). A fresh engine then loads the tag: it gets the first save's state or the
    second's, bitwise -- never an error, never a mixture."""
    import pickle

    step = fraction
    directory, out = str(tmp_path / "ck"), str(tmp_path / "states.pt")
    arg = pickle.dumps((impl, directory, fraction, out)).hex()
    proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -9 or "save returned" in proc.stdout, proc.stderr[-3000:]
    states = torch.load(out, weights_only=False)
    got = engine_api(impl).run_on_ranks(_load_after_kill, 1, impl, directory)[0]
    assert not isinstance(got, str), f"killed at step {step}: the tag does not load: {got}"
    assert same_state(got, states["first"]) or same_state(got, states["second"]), (
        f"killed at step {step}: the loaded state is neither the first nor the second save"
    )


# ---- the rows of issue 28 ----------------------------------------------------------------------------------


def _unstorable_values(handle) -> dict:
    """Values DeepSpeed-style scripts put in client_state, by the type name the refusal must show."""
    import numpy as np

    return {"float64": np.float64(0.3), "ndarray": np.arange(3.0), "Namespace": argparse.Namespace(lr=1),
            "function": (lambda: 0), "TextIOWrapper": handle}


def _client_states(group, impl, directory: str) -> dict:
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    out = {}
    handle = open(os.devnull)
    values = _unstorable_values(handle)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "last", client_state={"epoch": 1})
        good = engine_state(engine)
        train_one_boundary(engine, 1)
        for key, value in values.items():
            listing = _listing(directory)
            try:
                engine.save_checkpoint(directory, "last", client_state={"best": value})
            except ConfigurationError as exc:
                out[key] = ("refused", str(exc), _listing(directory) == listing)
                continue
            _, client = engine.load_checkpoint(directory, "last")
            out[key] = ("saved", repr(client.get("best")), repr(value))
        _, client = engine.load_checkpoint(directory, "last")
        out["last"] = (same_state(engine_state(engine), good), client)
    finally:
        handle.close()
        engine.destroy()
    return out


def test_client_state_round_trips_or_is_refused_before_the_disk_is_touched(impl, tmp_path):
    """Row 1 and 3: a numpy float, a numpy array, an argparse.Namespace, a lambda, an open file in client_state
    used to be saved (moving ``latest`` and replacing the good checkpoint) and then never load. Each is either
    stored so that it loads back, or refused with a ConfigurationError naming ``client_state['best']`` and its
    type before anything on disk changes; the previous checkpoint still loads."""
    pytest.importorskip("numpy")
    api = engine_api(impl)
    out = api.run_on_ranks(_client_states, 1, impl, str(tmp_path))[0]
    values = [k for k in out if k != "last"]
    assert len(values) == 5, out
    for key in values:
        outcome = out[key]
        if outcome[0] == "saved":
            assert outcome[1] == outcome[2], f"client_state['best']={outcome[2]} came back as {outcome[1]}"
            continue
        _, message, untouched = outcome
        assert "client_state['best']" in message and key in message, f"{key}: {message}"
        assert untouched, f"{key}: the refused save changed the checkpoint directory"
    restored, client = out["last"]
    if all(out[k][0] == "refused" for k in values):
        assert restored and client == {"epoch": 1}, "the previous checkpoint no longer loads as it was saved"


#: The client_state tensor of the stored-once test: 1 MiB, far more than anything else a rank file of the tiny
#: model holds, so where its bytes went is visible in the file sizes.
_CLIENT_BYTES = 1 << 20


def _tag_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _client_state_once(group, impl, directory: str) -> dict:
    """Two ranks: save with and without a 1 MiB tensor in client_state (rank 0's value differs from rank 1's,
    as DeepSpeed's scripts may have it: rank 0's is the one stored), then load into a fresh engine."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    big = torch.arange(_CLIENT_BYTES // 4, dtype=torch.float32) + 7 * rank
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "plain", client_state={"epoch": 3})
        engine.save_checkpoint(directory, "tensor", client_state={"epoch": 3, "big": big})
        dist.barrier(group)
        sizes = {tag: _tag_bytes(os.path.join(directory, tag)) for tag in ("plain", "tensor")}
    finally:
        engine.destroy()
    fresh = engine_class(impl)(ModelSpec().build(SEED + 1), CONFIG, process_group=group)
    try:
        _, client = fresh.load_checkpoint(directory, "tensor")
        _, plain = fresh.load_checkpoint(directory, "plain")
    finally:
        fresh.destroy()
    return {"sizes": sizes, "client": client, "plain": plain}


def test_a_client_state_tensor_is_stored_once_and_every_rank_loads_it(impl, tmp_path):
    """docs/zero.md, "Checkpoints": client_state is stored once (rank 0's, as DeepSpeed keeps it in one model
    file), not once per rank -- a 1 MiB tensor in it adds about 1 MiB to the checkpoint at two ranks, not 2 MiB
    -- and ``load_checkpoint`` returns it on every rank, equal to what rank 0 saved."""
    api = engine_api(impl)
    out = api.run_on_ranks(_client_state_once, 2, impl, str(tmp_path))
    sizes = out[0]["sizes"]
    added = sizes["tensor"] - sizes["plain"]
    assert _CLIENT_BYTES <= added < _CLIENT_BYTES + (_CLIENT_BYTES // 2), (
        f"a {_CLIENT_BYTES}-byte client_state tensor added {added} bytes to a two-rank checkpoint: stored "
        f"{added / _CLIENT_BYTES:.2f} times, documented once"
    )
    expected = torch.arange(_CLIENT_BYTES // 4, dtype=torch.float32)
    for rank, o in enumerate(out):
        assert o["plain"] == {"epoch": 3}, f"rank {rank}: {o['plain']}"
        assert set(o["client"]) == {"epoch", "big"} and o["client"]["epoch"] == 3, f"rank {rank}: {o['client']}"
        assert torch.equal(o["client"]["big"], expected), f"rank {rank} did not load rank 0's client_state tensor"


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    | st.tuples(inner, inner),
    max_leaves=8,
)


def _round_trips(group, impl, directory: str, states: list) -> list:
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        back = []
        for i, state in enumerate(states):
            engine.save_checkpoint(directory, f"t{i}", client_state=state)
            back.append(engine.load_checkpoint(directory, f"t{i}")[1])
        return back
    finally:
        engine.destroy()


@settings(max_examples=3)
@given(states=st.lists(st.dictionaries(st.text(min_size=1, max_size=4), _PLAIN, max_size=4), min_size=1,
                       max_size=4))
def test_plain_client_state_round_trips_exactly(impl, tmp_path_factory, states):
    """Plain data (None, bools, ints, floats, str, bytes, and lists, tuples, dicts of them) is stored, not
    refused, and loads back equal."""
    api = engine_api(impl)
    back = api.run_on_ranks(_round_trips, 1, impl, str(tmp_path_factory.mktemp("cs")), states)[0]
    assert back == states


def _full_disk(group, impl, directory: str, code: int, at: int) -> dict:
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "x")
        good = engine_state(engine)
        train_one_boundary(engine, 1)
        listing = _listing(directory)
        faults = FilesystemFaults(directory, "write", at, code)
        try:
            with faults:
                engine.save_checkpoint(directory, "x")
            error = None
        except CheckpointError as exc:
            error = str(exc)
        left = _listing(directory)
        engine.load_checkpoint(directory, None)
        return {"fired": faults.fired, "error": error, "same_listing": left == listing, "listing": left,
                "restored": same_state(engine_state(engine), good)}
    finally:
        engine.destroy()


@pytest.mark.parametrize(("code", "at"), [(errno.ENOSPC, 100), (errno.ENOSPC, 0), (errno.EIO, 3000),
                                         (errno.EACCES, 0)],
                         ids=["ENOSPC-100", "ENOSPC-0", "EIO-3000", "EACCES-0"])
def test_a_full_disk_is_a_checkpoint_error_and_leaves_the_previous_checkpoint(impl, tmp_path, code, at):
    """Row 2: a save to a full disk raised torch's ``[enforce fail at inline_container.cc]`` and left an empty
    ``.<tag>.partial/``. Now: CheckpointError naming save_dir and the errno (for ENOSPC: the bytes needed; an
    I/O error and a permission error the same way);
    the directory is exactly as before the save; the previous checkpoint (and ``latest``) loads."""
    directory = str(tmp_path / "ck")
    out = engine_api(impl).run_on_ranks(_full_disk, 1, impl, directory, code, at)[0]
    assert out["fired"], "premise: the save wrote through open() and reached the failing byte"
    assert out["error"] is not None, "the save reported success although a write failed"
    name = errno.errorcode[code]
    assert directory in out["error"] and name in out["error"], out["error"]
    if code == errno.ENOSPC:
        assert "bytes" in out["error"], f"the ENOSPC error does not say how many bytes are needed: {out['error']}"
    assert out["same_listing"], f"the failed save left files behind: {out['listing']}"
    assert out["restored"], "the previous checkpoint does not load as it was saved"


def _stale(group, impl, directory: str) -> list[str]:
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        os.makedirs(os.path.join(directory, ".other.partial"))
        with open(os.path.join(directory, ".other.partial", "rank0.pt"), "wb") as f:
            f.write(b"half")
        engine.save_checkpoint(directory, "mine")
        return sorted(os.listdir(directory))
    finally:
        engine.destroy()


def test_stale_partial_directories_are_swept_by_the_next_save(impl, tmp_path):
    """Row 3: a save that failed left ``.<tag>.partial/`` that only a later save of the *same* tag removed. The
    next save of any tag sweeps it."""
    left = engine_api(impl).run_on_ranks(_stale, 1, impl, str(tmp_path))[0]
    assert left == ["latest", "mine"], left


def _damaged(group, impl, directory: str, edit: str) -> str | None:
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "ck")
        folder = os.path.join(directory, "ck")
        if edit == "world_size":
            manifests = [n for n in os.listdir(folder) if n.endswith(".json")]
            path = os.path.join(folder, manifests[0])
            with open(path) as f:
                data = json.load(f)
            data["world_size"] = 3
            with open(path, "w") as f:
                json.dump(data, f)
        else:
            largest = max(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
            path = os.path.join(folder, largest)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(size // 2 if edit == "middle" else 30)
                chunk = f.read(64)
                f.seek(size // 2 if edit == "middle" else 30)
                f.write(bytes(b ^ 0xFF for b in chunk))
        try:
            engine.load_checkpoint(directory, "ck")
        except CheckpointError as exc:
            return str(exc)
        return None
    finally:
        engine.destroy()


@pytest.mark.parametrize("edit", ["middle", "header", "world_size"])
def test_damaged_or_edited_checkpoints_are_refused_by_name(impl, tmp_path, edit):
    """Row 4 and 5: 64 bytes flipped in the middle of the largest file (tensor data) loaded silently with
    corrupted weights; flipped in the pickle header they gave torch's multi-paragraph weights_only advice with
    ANSI escapes; a manifest edited to ``world_size: 3`` loaded anyway. Each is now a one-paragraph
    CheckpointError saying the checkpoint is damaged (or that the manifest and the files disagree)."""
    msg = engine_api(impl).run_on_ranks(_damaged, 1, impl, str(tmp_path), edit)[0]
    assert msg is not None, f"{edit}: the damaged checkpoint loaded"
    assert "\x1b" not in msg and "\n" not in msg and len(msg) < 600, f"{edit}: not one clear paragraph: {msg!r}"
    words = ("damaged", "edited", "world_size", "partial")
    assert any(w in msg for w in words), f"{edit}: the message names none of {words}: {msg}"


def _refused_on_one_rank(group, impl, directory: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "ck")
        good = engine_state(engine)
        train_one_boundary(engine, 1)
        listing = _listing(directory)
        try:
            engine.save_checkpoint(directory, "ck", client_state={"hook": (lambda: 0)} if rank == 1 else {})
            error = None
        except Exception as exc:  # classified by the test
            error = (type(exc).__name__, str(exc))
        same = _listing(directory) == listing
        engine.load_checkpoint(directory, "ck")
        return {"error": error, "same_listing": same, "restored": same_state(engine_state(engine), good)}
    finally:
        engine.destroy()


def test_a_save_refused_on_one_rank_changes_nothing_on_disk(impl, tmp_path):
    """W=2, rank 1's client_state holds a lambda: every rank raises (rank 0 naming rank 1), the directory is
    exactly as before -- no staging directory that rank 0 prepared for a save that could not happen -- and the
    tag still loads the previous checkpoint."""
    out = engine_api(impl).run_on_ranks(_refused_on_one_rank, 2, impl, str(tmp_path))
    for r, o in enumerate(out):
        assert o["error"] is not None, f"rank {r}: the save did not raise"
        assert o["same_listing"], f"rank {r}: the refused save changed the directory"
        assert o["restored"], f"rank {r}: the tag no longer loads the previous checkpoint"
    assert "rank 1" in out[0]["error"][1] and "client_state" in out[0]["error"][1], out[0]["error"]
