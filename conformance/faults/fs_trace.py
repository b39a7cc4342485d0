"""The filesystem calls a process makes under one directory, in order, observed at the Python boundary.

The fault harness (:mod:`conformance.faults.checkpoint_faults`) simulates a kill that keeps the page cache, so a file
that is never fsynced before the rename that publishes it passes every fault test; only a power cut would lose
it, and CI cannot cut power. Durability is an order of operating-system calls, so the suite records that order
and judges it (:func:`durability_violations`), whatever the implementation's code or counters say.

:class:`FilesystemTrace` patches, inside ``with``, what every Python implementation writes through: ``open()``
for files (the file object it returns is a buffered writer over a recording raw file, so the trace holds the
``write`` system calls as they happen -- a buffer flushed after the fsync is seen after it), ``os.fsync`` /
``os.fdatasync`` (the path an fd names is read from ``/proc/self/fd``: a directory opened with ``os.open`` and
fsynced is recorded as that directory), ``os.sync``, ``os.rename`` / ``os.replace``, ``os.mkdir``,
``os.unlink`` / ``os.remove`` / ``os.rmdir``. Events are tuples ``(op, path)``, ``("write", path, offset,
bytes)`` or ``("rename", src, dst)``, with absolute paths; only paths under the directory are recorded. An
implementation that writes through native code bypasses ``open()``: a save with no write seen is not judged
(the test skips, saying so), and a file of the checkpoint with no write seen is reported by
:func:`durability_violations` (the rule cannot be judged blind).
"""

from __future__ import annotations

import builtins
import io
import os
from typing import Any

from conformance.faults.attribute_patches import AttributePatches

__all__ = ["FilesystemTrace", "durability_violations"]


def _abs(path: Any, dir_fd: int | None = None) -> str | None:
    if isinstance(path, int) or path is None:
        return None
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return None
    return os.path.abspath(path)


class _RecordingRaw(io.RawIOBase):
    """A raw file whose ``write`` calls (the system calls a buffered writer makes) are recorded."""

    def __init__(self, raw: io.FileIO, trace: FilesystemTrace, path: str) -> None:
        super().__init__()
        self._raw = raw
        self._trace = trace
        self._path = path

    def write(self, data: Any) -> int | None:
        at = self._raw.tell()
        n = self._raw.write(data)
        if n:
            self._trace.events.append(("write", self._path, at, n))
        return n

    def readinto(self, buffer: Any) -> int | None:
        return self._raw.readinto(buffer)

    def readable(self) -> bool:
        return self._raw.readable()

    def writable(self) -> bool:
        return self._raw.writable()

    def seekable(self) -> bool:
        return self._raw.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._raw.truncate(size)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()

    @property
    def name(self) -> Any:
        return self._raw.name


class FilesystemTrace:
    """Records the filesystem calls under ``directory`` made inside ``with`` (module docstring)."""

    def __init__(self, directory: str) -> None:
        self.root = os.path.abspath(directory)
        self.events: list[tuple[Any, ...]] = []
        self._patches = AttributePatches()

    def _under(self, path: str | None) -> bool:
        return path is not None and (path == self.root or path.startswith(self.root + os.sep))

    def __enter__(self) -> FilesystemTrace:
        real_open = builtins.open

        def recording_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                           errors: str | None = None, newline: str | None = None, closefd: bool = True,
                           opener: Any = None) -> Any:
            path = _abs(file)
            if not any(c in mode for c in "wax+") or not self._under(path):
                return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
            assert path is not None  # _under() holds for paths only
            self.events.append(("open", path))
            raw_mode = mode.replace("b", "").replace("t", "")
            raw = _RecordingRaw(io.FileIO(file, raw_mode, closefd=closefd, opener=opener), self, path)
            if buffering == 0:
                return raw
            size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
            buffered = io.BufferedRandom(raw, size) if "+" in mode else io.BufferedWriter(raw, size)
            if "b" in mode:
                return buffered
            return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, newline=newline,
                                    line_buffering=buffering == 1)

        self._patches.patch(builtins, "open", recording_open)
        for name in ("fsync", "fdatasync"):
            self._patches.patch(os, name, self._wrap_fd(getattr(os, name)))
        self._patches.patch(os, "sync", self._wrap_sync(os.sync))
        for name in ("rename", "replace"):
            self._patches.patch(os, name, self._wrap_rename(getattr(os, name)))
        for name, op in (("mkdir", "mkdir"), ("unlink", "unlink"), ("remove", "unlink"), ("rmdir", "rmdir")):
            self._patches.patch(os, name, self._wrap_path(getattr(os, name), op))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.restore()

    def _wrap_fd(self, real: Any) -> Any:
        def call(fd: Any) -> Any:
            out = real(fd)
            try:
                target = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            except (OSError, AttributeError):
                target = None
            if self._under(target):
                self.events.append(("fsync", target))
            return out

        return call

    def _wrap_sync(self, real: Any) -> Any:
        def call() -> Any:
            out = real()
            self.events.append(("sync", self.root))
            return out

        return call

    def _wrap_rename(self, real: Any) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(src, dst, *args, **kwargs)
            a, b = _abs(src, kwargs.get("src_dir_fd")), _abs(dst, kwargs.get("dst_dir_fd"))
            if self._under(a) or self._under(b):
                self.events.append(("rename", a, b))
            return out

        return call

    def _wrap_path(self, real: Any, op: str) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(path, *args, **kwargs)
            target = _abs(path, kwargs.get("dir_fd"))
            if self._under(target):
                self.events.append((op, target))
            return out

        return call


def _synced(events: list[tuple[Any, ...]], path: str, after: int, before: int) -> bool:
    """Whether ``path`` was fsynced (or everything synced) at an index in (after, before)."""
    return any(e[0] in ("fsync", "sync") and (e[0] == "sync" or e[1] == path) for e in events[after + 1 : before])


def durability_violations(events: list[tuple[Any, ...]], final: str, files: list[str]) -> list[str]:
    """What breaks the durability order in ``events`` (one save that returned) for the checkpoint directory
    ``final`` holding ``files`` (paths relative to it) when the save returned. The order, docs/zero.md
    ("Checkpoints: what is guaranteed", durability order): each file's data is fsynced after its last write;
    then the directory that holds the files is fsynced (its entries); then the rename that makes the checkpoint
    visible at ``final``; then the parent directory of ``final`` is fsynced, before the save returns. Without a
    rename onto ``final`` (a checkpoint written in place) the same holds with the save's return for the rename.
    Renames replacing another file of the parent (``latest``) must come after that parent fsync and obey the
    same order for what they publish."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    end = len(events)
    commits = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final]
    at = commits[-1] if commits else end
    source = events[at][1] if commits else final
    out = []
    for rel in files:
        path = os.path.join(source, rel)
        writes = [i for i, e in enumerate(events) if e[0] == "write" and e[1] == path]
        if not writes:
            out.append(f"{rel}: no write of {path} was seen through open() before it was published (not judged)")
            continue
        if not _synced(events, path, writes[-1], at):
            out.append(f"{rel}: its last write (event {writes[-1]}) is not followed by an fsync of the file before "
                       f"{'the rename onto ' + final if commits else 'the save returned'} (event {at})")
    holders = sorted({os.path.dirname(os.path.join(source, rel)) for rel in files})
    for holder in holders:
        created = [i for i, e in enumerate(events)
                   if (e[0] in ("open", "mkdir") and os.path.dirname(e[1]) == holder)
                   or (e[0] == "rename" and os.path.dirname(e[2]) == holder)]
        last = created[-1] if created else -1
        if not _synced(events, holder, last, at):
            out.append(f"directory {holder}: its entries (last created at event {last}) are not fsynced before "
                       f"{'the rename onto ' + final if commits else 'the save returned'} (event {at})")
    if commits:
        if not _synced(events, parent, at, end):
            out.append(f"{parent}: not fsynced after the rename onto {final} (event {at}) before the save returned")
        for i, e in enumerate(events[at + 1 :], start=at + 1):
            if e[0] != "rename" or os.path.dirname(e[2]) != parent or e[2] == final or not os.path.isfile(e[2]):
                continue
            if not _synced(events, parent, at, i):
                out.append(f"{e[2]} was replaced (event {i}) before the rename onto {final} was made durable by "
                           f"an fsync of {parent}")
            writes = [j for j, w in enumerate(events) if w[0] == "write" and w[1] == e[1]]
            if writes and not _synced(events, e[1], writes[-1], i):
                out.append(f"{e[1]} was renamed to {e[2]} (event {i}) without an fsync after its last write")
            if not _synced(events, parent, i, end):
                out.append(f"{parent}: not fsynced after {e[1]} -> {e[2]} (event {i}) before the save returned")
    return out
