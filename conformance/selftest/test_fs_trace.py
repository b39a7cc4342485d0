"""The durability-order judge (conformance/faults/fs_trace.py) on hand-written saves: the documented order passes, and
each step left out, or a buffered write flushed only after the fsync, is named.

Why a self-test: the suite's durability test judges implementations by this recorder alone; if the recorder
missed a system-call write or a directory fsync, every implementation would pass (or fail) for the wrong reason.
"""

from __future__ import annotations

import os

import pytest

from conformance.faults.fs_trace import FilesystemTrace, durability_violations

STEPS = ("file_fsync", "dir_fsync", "parent_fsync", "latest_fsync", "parent_fsync_after_latest")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(directory: str, omit: str = "", flush_after_fsync: bool = False, use_sync: bool = False) -> list:
    """A save of tag ``t`` in docs/zero.md's order, with ``omit`` left out; returns the recorded events."""

    def fsync(f) -> None:
        if use_sync:
            os.sync()
        else:
            os.fsync(f.fileno())

    with FilesystemTrace(directory) as trace:
        staging, final = os.path.join(directory, ".t.partial"), os.path.join(directory, "t")
        os.mkdir(staging)
        with open(os.path.join(staging, "rank0.pt"), "wb") as f:
            f.write(b"x" * 100_000)  # past the buffer: a system call at once
            f.write(b"tail")  # buffered
            if not flush_after_fsync:
                f.flush()
            if omit != "file_fsync":
                fsync(f)
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            f.write("{}")
            f.flush()
            fsync(f)
        if omit != "dir_fsync":
            os.sync() if use_sync else _fsync_dir(staging)
        with open(os.path.join(directory, "latest.tmp"), "wb") as f:
            f.write(b"t")
            f.flush()
            if omit != "latest_fsync":
                fsync(f)
        os.rename(staging, final)
        if omit != "parent_fsync":
            os.sync() if use_sync else _fsync_dir(directory)
        os.replace(os.path.join(directory, "latest.tmp"), os.path.join(directory, "latest"))
        if omit != "parent_fsync_after_latest":
            os.sync() if use_sync else _fsync_dir(directory)
    return trace.events


def test_the_documented_order_passes(tmp_path):
    events = _save(str(tmp_path))
    assert next(e for e in events if e[0] == "write")[2:] == (0, 100_000), "the first system-call write: offset, size"
    assert durability_violations(events, str(tmp_path / "t"), ["manifest.json", "rank0.pt"]) == []


def test_a_global_sync_counts_as_every_fsync(tmp_path):
    events = _save(str(tmp_path), use_sync=True)
    assert durability_violations(events, str(tmp_path / "t"), ["manifest.json", "rank0.pt"]) == []


@pytest.mark.parametrize("omit", STEPS)
def test_each_step_left_out_is_named(tmp_path, omit):
    broken = durability_violations(_save(str(tmp_path), omit=omit), str(tmp_path / "t"),
                                   ["manifest.json", "rank0.pt"])
    assert len(broken) == 1, broken
    where = {"file_fsync": "rank0.pt", "dir_fsync": ".t.partial", "parent_fsync": "was made durable",
             "latest_fsync": "latest.tmp", "parent_fsync_after_latest": "latest.tmp -> "}[omit]
    assert where in broken[0], broken


def test_a_buffer_flushed_after_the_fsync_is_not_durable(tmp_path):
    """The last bytes reach the kernel when the file is closed, after its fsync: only the recorded system-call
    writes show it (the Python-level write came before the fsync)."""
    broken = durability_violations(_save(str(tmp_path), flush_after_fsync=True), str(tmp_path / "t"),
                                   ["manifest.json", "rank0.pt"])
    assert len(broken) == 1 and "rank0.pt" in broken[0], broken
