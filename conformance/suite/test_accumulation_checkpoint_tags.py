"""Checkpoint tags and the ``latest`` file (issue 52, first-hour defects 1, 3, 4, 8; docs/zero.md, "Checkpoints").

A tag names a directory inside ``save_dir`` and ``<save_dir>/latest`` names the newest tag, so what a save accepts
is what a load from ``latest`` must find again: a tag a save writes and ``load_checkpoint(dir)`` cannot resume is a
run lost after a save that reported success. The rule every implementation keeps is
``reference.contract.accumulation_checkpoint_names.check_tag``; these tests hold an engine to it through its own
``save_checkpoint`` / ``load_checkpoint``, nothing patched:

- a tag with leading or trailing whitespace is refused at save time (``ConfigurationError`` naming ``tag``);
  the old engine saved ``'run1 '``, wrote it into ``latest``, and the load from ``latest`` stripped it and found
  nothing;
- a tag containing NUL is refused by name (it raised the OS layer's raw ``ValueError``); any case-variant of a
  reserved name (``'LATEST'``) is refused like the name itself, since on a case-insensitive filesystem it is the
  same file;
- an unusable ``latest`` file (empty, ``../x``) is the checkpoint's fault, not the caller's: a ``CheckpointError``
  naming the ``latest`` file's path, not a ``ConfigurationError`` about a ``tag=`` the caller never passed;
- damage is reported where it is: a flipped byte in a small rank file names a byte range inside the file (not
  the 16 MiB checksum block's nominal one), and a missing ``client_state.pt`` is a partial checkpoint naming it.
"""

from __future__ import annotations

import os
import re

import pytest

from conformance.areas.accumulation_engines import REQUIRES_CHECKPOINT, engine_api, engine_class
from conformance.areas.checkpoint_machine import train_one_boundary
from reference.contract.accumulation_checkpoint_names import LATEST, RESERVED_TAGS
from reference.contract.accumulation_scenario import ModelSpec

pytestmark = [pytest.mark.conformance_area("accumulation"), REQUIRES_CHECKPOINT, pytest.mark.runs_in_subprocesses]

SEED = 5
CONFIG = {"zero_stage": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "adamw", "lr": 0.01}}

#: Tags a save must refuse, with the words the refusal must contain besides ``tag``.
_WHITESPACE = ("run1 ", " run1", "run1\n", "\trun1", "run 1 ")
_NUL = ("run\x001", "\x00")


def _case_variants() -> list[str]:
    """Case-variants of every reserved name (``LATEST``, ``Latest``, ``LATEST.TMP`` ...), the name itself excluded."""
    out = []
    for name in RESERVED_TAGS:
        out += [v for v in (name.upper(), name.capitalize(), name.swapcase()) if v != name and v not in out]
    return out


def _listing(directory: str) -> list[tuple[str, list[str]]]:
    return sorted((root, sorted(dirs + files)) for root, dirs, files in os.walk(directory))


def _attempt(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # classified by the test
        return (type(exc).__name__, str(exc))


def _refused_tags(group, impl, directory: str, tags: list[str]) -> dict:
    """One rank: a good save, then a save (and a load) under each tag; what each raised, whether the directory
    changed, and what ``load_checkpoint(dir)`` resumes afterwards."""
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "good")
        listing = _listing(directory)
        out: dict = {"saves": {}, "loads": {}}
        for tag in tags:
            out["saves"][tag] = (_attempt(lambda t=tag: engine.save_checkpoint(directory, t)),
                                 _listing(directory) == listing)
            out["loads"][tag] = _attempt(lambda t=tag: engine.load_checkpoint(directory, t))
        path, _ = engine.load_checkpoint(directory)
        out["resumed"] = os.path.basename(path)
        return out
    finally:
        engine.destroy()


def _check_refusals(out: dict, words: tuple[str, ...]) -> None:
    for tag, (got, unchanged) in out["saves"].items():
        assert got[0] == "ConfigurationError", f"save_checkpoint(tag={tag!r}): {got}"
        assert "tag" in got[1] and all(w in got[1] for w in words), f"tag={tag!r}: {got[1]}"
        assert unchanged, f"the refused save of tag={tag!r} changed the checkpoint directory"
    for tag, got in out["loads"].items():
        assert got[0] == "ConfigurationError", f"load_checkpoint(tag={tag!r}): {got}"
    assert out["resumed"] == "good", out["resumed"]


def test_a_tag_with_surrounding_whitespace_is_refused_at_save_time(impl, tmp_path):
    """Defect 1: ``save_checkpoint(d, tag='run1 ')`` saved and wrote ``'run1 '`` into ``latest``; the load from
    ``latest`` stripped it and found no checkpoint. A tag with leading or trailing whitespace (a space, a tab, a
    newline) is now a ConfigurationError naming ``tag`` and the rule, before anything is written; the same tag
    given to ``load_checkpoint`` is refused the same way, and ``latest`` still resumes the last good save."""
    out = engine_api(impl).run_on_ranks(_refused_tags, 1, impl, str(tmp_path), list(_WHITESPACE))[0]
    _check_refusals(out, ("whitespace",))


def test_a_tag_with_nul_or_a_reserved_name_in_any_case_is_refused(impl, tmp_path):
    """Defect 4: a tag containing NUL raised the OS layer's raw ``ValueError`` (no file name can hold it); it is a
    ConfigurationError naming ``tag`` and NUL. ``'LATEST'`` was accepted: on a case-insensitive filesystem (macOS,
    Windows shares) it is the ``latest`` file itself, so every case-variant of a reserved name is refused as
    reserved, nothing written."""
    api = engine_api(impl)
    out = api.run_on_ranks(_refused_tags, 1, impl, str(tmp_path / "nul"), list(_NUL))[0]
    _check_refusals(out, ("NUL",))
    out = api.run_on_ranks(_refused_tags, 1, impl, str(tmp_path / "case"), _case_variants())[0]
    _check_refusals(out, ("reserved",))


def _load_with_latest(group, impl, directory: str, contents: dict[str, bytes]) -> dict:
    """One rank: a good save of tag ``good``, then ``latest`` overwritten with each of ``contents`` and a load
    from it; what each load raised."""
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "good")
        out = {}
        for key, data in contents.items():
            with open(os.path.join(directory, LATEST), "wb") as f:
                f.write(data)
            got = _attempt(lambda: engine.load_checkpoint(directory))
            out[key] = (got[0], os.path.basename(got[1][0]) if got[0] == "ok" else got[1])
        return out
    finally:
        engine.destroy()


def test_an_unusable_latest_file_is_a_checkpoint_error_naming_it(impl, tmp_path):
    """Defect 3: an empty ``latest`` file, or one naming ``../x``, was reported as a bad ``tag=`` argument
    (ConfigurationError) although the caller passed none. It is a CheckpointError naming the ``latest`` file's
    path (the checkpoint directory is what is wrong). A ``latest`` file a person wrote with ``echo good >
    latest`` (a trailing newline) still resumes ``good``: a line ending is not part of any tag a save accepts."""
    directory = str(tmp_path)
    bad = {"empty": b"", "parent": b"../x", "blank": b" \n", "hidden": b".good.partial", "undecodable": b"\xff\xfe",
           "spaced": b"good "}
    out = engine_api(impl).run_on_ranks(_load_with_latest, 1, impl, directory,
                                        {**bad, "newline": b"good\n", "plain": b"good"})[0]
    latest = os.path.join(directory, LATEST)
    for key in bad:
        kind, text = out[key]
        assert kind == "CheckpointError", f"latest={bad[key]!r}: {kind}: {text}"
        assert latest in text, f"latest={bad[key]!r}: the error does not name {latest!r}: {text}"
    assert out["newline"] == ("ok", "good"), out["newline"]
    assert out["plain"] == ("ok", "good"), out["plain"]


def _damage(group, impl, directory: str, what: str) -> dict:
    """One rank: save tag ``ck`` with a client_state, damage it (``flip``: one byte of the rank file, at a third
    of its length; ``client_state``: remove client_state.pt), load it."""
    engine = engine_class(impl)(ModelSpec().build(SEED), CONFIG, process_group=group)
    try:
        train_one_boundary(engine, 0)
        engine.save_checkpoint(directory, "ck", client_state={"epoch": 2})
        folder = os.path.join(directory, "ck")
        names = sorted(os.listdir(folder))
        out: dict = {"names": names}
        if what == "flip":
            rank_file = next(n for n in names if re.fullmatch(r"rank0\.pt", n))
            path = os.path.join(folder, rank_file)
            size = os.path.getsize(path)
            offset = size // 3
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
            out.update(size=size, offset=offset)
        else:
            os.remove(os.path.join(folder, "client_state.pt"))
        out["got"] = _attempt(lambda: engine.load_checkpoint(directory, "ck"))
        return out
    finally:
        engine.destroy()


def test_a_flipped_byte_is_reported_with_the_bytes_the_check_covers(impl, tmp_path):
    """Defect 8: one flipped byte in a rank file of a few KB was reported as damage to "bytes 0 to 16777216" --
    the 16 MiB checksum block's nominal range, far past the end of the file. The CheckpointError names the rank
    file and a byte range (``bytes A to B``) that contains the flipped byte and ends inside the file."""
    out = engine_api(impl).run_on_ranks(_damage, 1, impl, str(tmp_path), "flip")[0]
    kind, text = out["got"]
    assert kind == "CheckpointError", out["got"]
    assert "rank0.pt" in text and "damaged" in text, text
    ranges = [(int(a), int(b)) for a, b in re.findall(r"bytes (\d+) to (\d+)", text)]
    assert ranges, f"the error names no byte range ('bytes A to B'): {text}"
    lo, hi = ranges[0]
    assert lo <= out["offset"] < hi <= out["size"], (
        f"the flipped byte is at {out['offset']} of a {out['size']}-byte file; the error names bytes {lo} to {hi}"
    )


def test_a_missing_client_state_file_is_a_partial_checkpoint(impl, tmp_path):
    """Defect 8: with ``client_state.pt`` removed the load said "rank file ... cannot be read". A checkpoint
    missing one of the files its manifest lists is partial: the CheckpointError says so and names the file."""
    out = engine_api(impl).run_on_ranks(_damage, 1, impl, str(tmp_path), "client_state")[0]
    if "client_state.pt" not in out["names"]:
        pytest.skip(f"this implementation stores client_state elsewhere (files: {out['names']})")
    kind, text = out["got"]
    assert kind == "CheckpointError", out["got"]
    assert "client_state.pt" in text and "partial" in text and "missing" in text, text
    assert "rank file" not in text, f"the client_state file is called a rank file: {text}"
