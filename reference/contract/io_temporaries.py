"""Temporary files of new-file writes: named after their writer, and removed once that writer is dead.

A write that creates a file builds it under a hidden temporary name in the same directory and renames it onto the
path at the end (see :mod:`reference.io.handle`). A writer that dies half way (SIGKILL, power loss, OOM killer)
cannot remove its temporary, and a swap write is often gigabytes: nothing else would ever reclaim that space.

So the temporary's name says who wrote it: ``.{name}.{pid}-{start}.{random}.hostoffload-tmp``, where ``start``
is the writer's process start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot). The first new-file
write of a handle into a directory sweeps that directory once: every temporary whose writer is not alive, or
whose pid now belongs to a different process (pid reuse: another start time), is removed. A temporary of a live
writer (another handle, another process, this process) has a matching pid and start time and is never touched, so
concurrent writers in one directory are safe. Temporaries whose name does not carry an owner in this form (written
by an older version) are left alone: their writer cannot be known.

Both implementations use this module, so their temporaries are recognised by each other's sweeps.

Contract: the name of a temporary is an on-disk format (each implementation's sweep must recognise the
other's), and the rule for when a temporary may be removed must be one rule for concurrent writers to be safe.
"""

from __future__ import annotations

import os
import re
import uuid

__all__ = ["SUFFIX", "owner_tag", "process_start_time", "sweep_stale_temporaries", "temporary_name"]

SUFFIX = ".hostoffload-tmp"
_OWNED = re.compile(r"^\..*\.(?P<pid>\d+)-(?P<start>\d+)\.[0-9a-f]{12}" + re.escape(SUFFIX) + r"$")


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


_own_tag: tuple[int, str] | None = None


def owner_tag() -> str:
    """``{pid}-{start}`` of the calling process (recomputed after a fork: the child is another writer)."""
    global _own_tag
    pid = os.getpid()
    if _own_tag is None or _own_tag[0] != pid:
        _own_tag = (pid, f"{pid}-{process_start_time(pid) or 0}")
    return _own_tag[1]


def temporary_name(path: str) -> str:
    """A fresh name next to ``path`` (same directory, so the final rename is atomic on one filesystem), naming
    its writer so a later sweep can tell a dead writer's leftover from a live writer's file."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{owner_tag()}.{uuid.uuid4().hex[:12]}{SUFFIX}")


def _writer_alive(pid: int, start: int) -> bool:
    actual = process_start_time(pid)
    if actual is None:
        return False
    # start 0: the writer could not read its own start time (no /proc); trust the pid alone.
    return start == 0 or actual == start


def sweep_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporaries of dead writers in ``directory``; return the paths removed.

    Errors are not the caller's business (the directory may be unreadable, another sweeper may win the race to
    unlink the same file): a temporary that cannot be removed now is left for a later sweep.
    """
    removed: list[str] = []
    try:
        entries = os.scandir(directory or ".")
    except OSError:
        return removed
    with entries:
        for entry in entries:
            match = _OWNED.match(entry.name)
            if match is None:
                continue
            if _writer_alive(int(match["pid"]), int(match["start"])):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                os.unlink(entry.path)
            except OSError:
                continue
            removed.append(entry.path)
    return removed
