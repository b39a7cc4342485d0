"""Checkpoint cases the fault machine does not reach in the ci profile (issue 42): a rank file larger than one
checksum block, a crash between the commit's renames followed by a save of another tag, a crash right after the
rename that publishes a tag (the previous checkpoint still beside it), and the durability order of the
operating-system calls (docs/zero.md, "Checkpoints: what is guaranteed").

Why fixed cases: the state machine of :mod:`conformance.areas.checkpoint_machine` draws small models (its files are a
few hundred KiB) and kills at a drawn step, so a bug in how a write straddling a block boundary is checksummed,
or in the recovery of a half-committed tag that only the *next* save runs, passes it in the ci profile; and its
"kill" keeps the page cache, so a file never fsynced passes every fault test. Each case here reaches its point
deterministically and judges what the disk holds, what a fresh engine loads, and (for durability) the order of
the calls the save made, observed at the process's filesystem boundary by :mod:`conformance.faults.fs_trace`.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, engine_api, engine_class
from conformance.areas.checkpoint_machine import engine_state, same_state
from conformance.faults.checkpoint_faults import FilesystemFaults, Killed
from conformance.faults.fs_trace import FilesystemTrace, durability_violations
from reference.contract.accumulation_scenario import ModelSpec, compute_loss
from reference.contract.errors import CheckpointError

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_CHECKPOINT, pytest.mark.runs_in_subprocesses]

SEED = 11
CONFIG = {"zero_stage": 2, "offload_optimizer": "cpu", "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 1, "optimizer": {"type": "adamw", "lr": 0.01}}
#: docs/zero.md: the manifest records the CRC-32 of each 16 MiB block of every rank file.
BLOCK = 16 << 20
#: A frozen 2048 x 2048 layer (16 MiB + 8 KiB of fp32) and a 2048 x 256 trainable one with its master and Adam
#: state: one rank file of about 25 MiB, whose tensor writes cross the 16 MiB block boundary.
LARGE = ModelSpec(in_features=256, hidden=2048)
SMALL = ModelSpec()


def _boundary(engine, spec: ModelSpec, index: int) -> None:
    gen = torch.Generator().manual_seed(index)
    x, y = torch.randn(2, spec.in_features, generator=gen), torch.randn(2, spec.out_features, generator=gen)
    engine.backward(compute_loss(engine.module, x, y, engine.config.model_dtype))
    engine.step()


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder)
                  for f in files)


# ---- a rank file larger than one checksum block --------------------------------------------------------------


def _large_round_trip(group, impl, directory: str) -> dict:
    engine = engine_class(impl)(LARGE.build(SEED), CONFIG, process_group=group)
    try:
        _boundary(engine, LARGE, 0)
        with FilesystemTrace(directory) as trace:
            engine.save_checkpoint(directory, "big")
        saved = engine_state(engine)
    finally:
        engine.destroy()
    folder = os.path.join(directory, "big")
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in _files(folder)}
    # the system-call writes that cross a block boundary: the case the checksums must get right
    straddling = sum(e[2] // BLOCK != (e[2] + e[3] - 1) // BLOCK for e in trace.events if e[0] == "write")
    fresh = engine_class(impl)(LARGE.build(SEED + 1), CONFIG, process_group=group)
    try:
        try:
            fresh.load_checkpoint(directory, "big")
        except CheckpointError as exc:
            return {"sizes": sizes, "straddling": straddling, "error": str(exc)}
        return {"sizes": sizes, "straddling": straddling, "error": None,
                "restored": same_state(engine_state(fresh), saved)}
    finally:
        fresh.destroy()


def _documented_block_crcs(folder: str) -> list[str]:
    """Where the checkpoint is in docs/zero.md's format (``manifest.json``, format ``hostoffload.zero_checkpoint``):
    the block CRC-32s it records, recomputed here with zlib from the files' bytes; the mismatches."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("format") != "hostoffload.zero_checkpoint":
        return []
    bad = []
    for entry in manifest["ranks"]:
        block, crcs = entry["block"], []
        with open(os.path.join(folder, entry["file"]), "rb") as f:
            while chunk := f.read(block):
                crcs.append(zlib.crc32(chunk))
        if crcs != entry["crc32"]:
            differ = [i for i, (a, b) in enumerate(zip(crcs, entry["crc32"], strict=False)) if a != b]
            bad.append(f"{entry['file']}: blocks {differ} of {len(crcs)} (the manifest lists {len(entry['crc32'])})"
                       f" differ from the bytes")
    return bad


def test_a_rank_file_larger_than_one_checksum_block_round_trips(impl, tmp_path):
    """A rank file of about 25 MiB, written by tensor writes that cross the 16 MiB checksum block boundary: a
    fresh engine loads it and gets the saved state bitwise (every real checkpoint is larger than one block; a
    block checksummed wrongly where a write straddles it makes all of them unloadable). Where the checkpoint is
    in the documented format, the recorded block CRC-32s are also recomputed here from the bytes."""
    directory = str(tmp_path / "ck")
    out = engine_api(impl).run_on_ranks(_large_round_trip, 1, impl, directory)[0]
    assert max(out["sizes"].values()) > BLOCK, f"premise: a file larger than one block: {out['sizes']}"
    print(f"writes crossing a {BLOCK}-byte block boundary (seen through open()): {out['straddling']}")
    assert out["error"] is None, f"the checkpoint does not load: {out['error']}"
    assert out["restored"], "the loaded state differs from the saved one"
    bad = _documented_block_crcs(os.path.join(directory, "big"))
    assert not bad, f"block checksums recorded in the manifest do not match the files: {bad}"


# ---- a crash between the commit's renames, then a save of another tag ----------------------------------------


def _hidden(directory: str) -> list[str]:
    """Staging leftovers (as the state machine counts them): hidden entries and ``*.tmp`` files."""
    return sorted(e for e in os.listdir(directory) if e.startswith(".") or e.endswith(".tmp"))


def _loads(group, impl, directory: str, tags: tuple) -> dict:
    """What a fresh engine loads for each tag (None: the one ``latest`` names): its state, or the error."""
    fresh = engine_class(impl)(SMALL.build(SEED + 1), CONFIG, process_group=group)
    out = {}
    try:
        for tag in tags:
            try:
                fresh.load_checkpoint(directory, tag)
                out[tag] = engine_state(fresh)
            except CheckpointError as exc:
                out[tag] = str(exc)
    finally:
        fresh.destroy()
    return out


def _renames_onto(engine, directory: str, final: str) -> tuple[list[int], int]:
    """Save tag ``a`` once more while counting its filesystem steps (nothing fires): the step numbers of the
    renames onto ``final`` and the number of steps (a save that replaces a tag makes the same steps again)."""
    with FilesystemFaults(directory, "kill", 0) as counting:  # at=0: counts the steps, fires never
        engine.save_checkpoint(directory, "a")
    onto = [i for i, (op, path) in enumerate(counting.steps, start=1) if op == "rename" and path == final]
    return onto, len(counting.steps)


def _save_killed_at(engine, directory: str, step: int) -> bool:
    """Save tag ``a`` with the process "killed" just before filesystem step ``step``; the directory is then left
    as the killed process left it. Whether the kill fired."""
    faults = FilesystemFaults(directory, "kill", step)
    try:
        with faults:
            engine.save_checkpoint(directory, "a")
    except Killed:
        faults.restore_killed_state()
        return True
    return False


def _killed_between_renames_then_other_tag(group, impl, directory: str, latest_b: bool) -> dict:
    engine = engine_class(impl)(SMALL.build(SEED), CONFIG, process_group=group)
    final = os.path.abspath(os.path.join(directory, "a"))
    try:
        _boundary(engine, SMALL, 0)
        engine.save_checkpoint(directory, "a")
        _boundary(engine, SMALL, 1)
        onto, _ = _renames_onto(engine, directory, final)
        first = engine_state(engine)
        _boundary(engine, SMALL, 2)
        second = engine_state(engine)
        # dies just before the rename onto <dir>/a
        killed = _save_killed_at(engine, directory, onto[-1]) if onto else False
        after_kill = sorted(os.listdir(directory))
        _boundary(engine, SMALL, 3)
        other = engine_state(engine)
        engine.save_checkpoint(directory, "b", save_latest=latest_b)
        left = _hidden(directory)
    finally:
        engine.destroy()
    return {"renames_onto": onto, "killed": killed, "after_kill": after_kill, "left": left, "first": first,
            "second": second, "other": other, "loaded": _loads(group, impl, directory, ("a", None, "b"))}


@pytest.mark.parametrize("latest_b", [False, True], ids=["b-without-latest", "b-with-latest"])
def test_a_crash_between_the_commit_renames_then_another_save_keeps_the_first_tag(impl, tmp_path, latest_b):
    """Tag ``a`` is saved twice; a third save of ``a`` is killed just before the rename that publishes it (after
    the previous ``a`` was moved aside: docs/zero.md's table, "killed between the two renames of step 4"). Then
    a save of another tag ``b`` runs -- it is the one that finishes what the killed save left -- and a fresh
    engine loads ``a``, ``latest`` and ``b``. ``a`` gives a state one of its saves had (never an error, never a
    mixture); ``latest`` names ``b`` if that save moved it, else ``a``; the save of ``b`` leaves no staging
    leftovers. The state machine reaches this only if it kills at that exact step and then saves the other tag
    before loading, which the ci profile does not."""
    directory = str(tmp_path / "ck")
    out = engine_api(impl).run_on_ranks(_killed_between_renames_then_other_tag, 1, impl, directory, latest_b)[0]
    assert out["renames_onto"], "premise: the save commits by a rename onto <dir>/a (docs/zero.md, step 4)"
    assert out["killed"] and "a" not in out["after_kill"], f"premise: killed before the rename: {out['after_kill']}"
    assert not out["left"], f"the save of 'b' that returned left {out['left']} in the directory"
    saves_of_a = (out["first"], out["second"])
    for tag, want in (("a", saves_of_a), (None, (out["other"],) if latest_b else saves_of_a), ("b", (out["other"],))):
        got = out["loaded"][tag]
        assert not isinstance(got, str), f"load_checkpoint({tag!r}) raised after the crash and the save of 'b': {got}"
        assert any(same_state(got, s) for s in want), f"load_checkpoint({tag!r}) restored a state no save of it had"


def _killed_after_publishing(group, impl, directory: str) -> dict:
    engine = engine_class(impl)(SMALL.build(SEED), CONFIG, process_group=group)
    final = os.path.abspath(os.path.join(directory, "a"))
    try:
        _boundary(engine, SMALL, 0)
        engine.save_checkpoint(directory, "a")
        first = engine_state(engine)
        _boundary(engine, SMALL, 1)
        onto, steps = _renames_onto(engine, directory, final)
        after = steps - onto[-1] if onto else 0  # steps the save makes after publishing
        _boundary(engine, SMALL, 2)
        new = engine_state(engine)
        # dies just after the rename onto <dir>/a
        killed = _save_killed_at(engine, directory, onto[-1] + 1) if onto and after else False
        after_kill = sorted(os.listdir(directory))
    finally:
        engine.destroy()
    return {"renames_onto": onto, "after": after, "killed": killed, "after_kill": after_kill, "first": first,
            "new": new, "loaded": _loads(group, impl, directory, ("a",))}


def test_a_crash_right_after_the_publishing_rename_loads_the_new_checkpoint(impl, tmp_path):
    """Tag ``a`` is saved, then saved again with a newer state, killed just after the rename that publishes it
    (docs/zero.md's table, "killed after ``.<tag>.partial`` -> ``<tag>``": the new checkpoint), so whatever the
    save still had to do -- the fsync of the directory, ``latest``, removing the previous ``a`` it had moved aside
    -- is left undone. A fresh engine loading ``a`` gets the newer state: a leftover copy of the previous
    checkpoint beside the published one must not be read in its place."""
    directory = str(tmp_path / "ck")
    out = engine_api(impl).run_on_ranks(_killed_after_publishing, 1, impl, directory)[0]
    assert out["renames_onto"], "premise: the save commits by a rename onto <dir>/a (docs/zero.md, step 4)"
    assert out["after"] and out["killed"], (
        f"premise: the save makes steps after publishing (docs/zero.md: at least the fsync of <dir>) and was killed "
        f"before them: {out['after']} steps after, killed {out['killed']}"
    )
    assert "a" in out["after_kill"], f"premise: killed after the rename onto <dir>/a: {out['after_kill']}"
    got = out["loaded"]["a"]
    assert not isinstance(got, str), f"load_checkpoint('a') raised after the crash: {got}"
    assert same_state(got, out["new"]), (
        "load_checkpoint('a') after a crash right after the publishing rename did not restore the published "
        "(newer) checkpoint" + (" but the previous one" if same_state(got, out["first"]) else "")
    )


# ---- the durability order ---------------------------------------------------------------------------------------


def _traced_saves(group, impl, directory: str) -> list:
    engine = engine_class(impl)(SMALL.build(SEED), CONFIG, process_group=group)
    out = []
    try:
        for i in range(2):  # a new tag, then the same tag again (the commit moves the previous one aside)
            _boundary(engine, SMALL, i)
            with FilesystemTrace(directory) as trace:
                engine.save_checkpoint(directory, "t")
            out.append((trace.events, _files(os.path.join(directory, "t"))))
    finally:
        engine.destroy()
    return out


def test_a_save_fsyncs_data_then_entries_then_renames_then_the_parent(impl, tmp_path):
    """docs/zero.md's durability order, observed in the filesystem calls a save makes (not in its counters): every
    file of the checkpoint is fsynced after its last write, then the directory holding them, then the rename that
    publishes the checkpoint, then the parent directory, before the save returns; ``latest`` is replaced only
    after that parent fsync, from a file fsynced after its last write, and the parent is fsynced after it.
    The fault harness's kill keeps the page cache, so only this catches a file that was never fsynced."""
    directory = str(tmp_path / "ck")
    saves = engine_api(impl).run_on_ranks(_traced_saves, 1, impl, directory)[0]
    for n, (events, files) in enumerate(saves):
        assert files, f"save {n}: the checkpoint directory holds no file"
        if not any(e[0] == "write" for e in events):
            pytest.skip("the save wrote no file through open() (native writes?): the order of its system calls "
                        "cannot be observed, so the durability order is not judged for this implementation")
        broken = durability_violations(events, os.path.join(directory, "t"), files)
        assert not broken, f"save {n} ({'new tag' if n == 0 else 'replacing the tag'}): " + "; ".join(broken)
