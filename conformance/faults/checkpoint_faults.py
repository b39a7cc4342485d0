"""Filesystem faults for checkpoint tests, injected at the Python boundary of the process, without root.

The suite cannot fill a disk, fail a rename or power a machine off on a CI runner, and it must not reach into an
implementation's code to do it. What every Python implementation shares is the boundary it writes through:
``open()`` for files, ``os.rename``/``os.replace``/``os.mkdir``/``os.unlink``/``os.rmdir``/``os.fsync`` for the
rest. :class:`FilesystemFaults` patches exactly those names, for paths under one directory, and acts once:

- ``write``: the file writes under the directory fail once ``k`` bytes have been written in total (the write that
  crosses ``k`` writes its first part, as a full disk does), with ``ENOSPC`` or ``EIO``;
- ``rename``: the ``n``-th rename or replace under the directory fails (``EIO``);
- ``kill``: at the ``n``-th mutation under the directory (an open for writing, an fsync, a mkdir, a rename, a
  replace, an unlink, an rmdir; single writes are not counted, so the steps are the same however a file is
  chunked, and ``at=0`` only counts them) the process "dies": the directory's contents at that instant are
  copied aside and :class:`Killed` (a ``BaseException``, which ``except Exception`` cleanups do not catch) is
  raised; :meth:`FilesystemFaults.restore_killed_state` then puts the copy back, so whatever cleanup the
  implementation ran while the exception unwound is undone, and the disk holds what a process killed at that
  point would have left (data still in the process's buffers is not in the copy either). A real kill in a child
  process checks the same claim once (``test_accumulation_checkpoint_faults``).

``fired`` says whether the fault happened; a save that never reached the point simply succeeded. An
implementation that writes through native code bypasses ``open()``: its writes then never fail here (the
harness cannot see them), which the tests tolerate -- they judge what a load returns, whichever faults fired.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from conformance.faults.attribute_patches import AttributePatches

__all__ = ["FilesystemFaults", "Killed"]

KINDS = ("write", "rename", "kill")


class Killed(BaseException):
    """The simulated death of the process at a filesystem step."""


def _under(path: Any, root: str, dir_fd: int | None = None) -> bool:
    if isinstance(path, int) or path is None:
        return False
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return False
    path = os.path.abspath(path)
    return path == root or path.startswith(root + os.sep)


class _FaultyFile:
    """A file opened for writing under the directory: writes go through the fault's budget."""

    def __init__(self, f: Any, faults: FilesystemFaults, path: str) -> None:
        self._f = f
        self._faults = faults
        self._path = path

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        allowed = self._faults._before_write(len(view), self._path)
        if allowed < len(view):
            self._f.write(view[:allowed])
            self._f.flush()
            self._faults._fail(self._faults.errno, self._path)
        return self._f.write(view)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class FilesystemFaults:
    """One fault of ``kind`` (see module docstring) under ``directory``, active inside ``with``.

    ``at``: the byte count (``write``) or the 1-based operation number (``rename``, ``kill``) it fires at.
    ``error``: ``ENOSPC`` or ``EIO`` for ``write`` faults. ``on_kill``: what a ``kill`` fault does instead of
    raising :class:`Killed` (a child process passes a real ``SIGKILL`` of itself)."""

    def __init__(
        self, directory: str, kind: str, at: int, error: int = errno.ENOSPC, on_kill: Callable[[], None] | None = None
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; allowed values: {', '.join(KINDS)}")
        self.root = os.path.abspath(directory)
        self.kind = kind
        self.at = at
        self.errno = error
        self.on_kill = on_kill
        self.fired = False
        self.count = 0
        #: ``kill`` faults: (operation, path) of each step counted so far (for a rename: its destination), so a
        #: counting pass (``at=0``) tells which step a later save must be killed at to stop before a given call
        self.steps: list[tuple[str, str]] = []
        self._written = 0
        self._snapshot: str | None = None
        self._patches = AttributePatches()

    # -- the patched names ------------------------------------------------------------------------------------
    def __enter__(self) -> FilesystemFaults:
        real_open = builtins.open

        def faulty_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            writing = any(c in mode for c in "wax+")
            if writing and _under(file, self.root):
                self._mutation(file, "open")
                return _FaultyFile(real_open(file, mode, *args, **kwargs), self, os.fspath(file))
            return real_open(file, mode, *args, **kwargs)

        self._patches.patch(builtins, "open", faulty_open)
        self._patches.patch(os, "fsync", self._wrap_fd(os.fsync))
        for name in ("rename", "replace"):
            self._patches.patch(os, name, self._wrap_rename(getattr(os, name)))
        for name in ("mkdir", "unlink", "rmdir", "remove"):
            self._patches.patch(os, name, self._wrap_path(getattr(os, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.restore()

    def _wrap_path(self, real: Any) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if _under(path, self.root, kwargs.get("dir_fd")):
                self._mutation(path, real.__name__)
            return real(path, *args, **kwargs)

        return call

    def _wrap_fd(self, real: Any) -> Any:
        def call(fd: Any) -> Any:
            try:
                target = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            except (OSError, AttributeError):
                target = None
            if target is not None and _under(target, self.root):
                self._mutation(target, "fsync")
            return real(fd)

        return call

    def _wrap_rename(self, real: Any) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if _under(src, self.root) or _under(dst, self.root):
                self._mutation(dst, "rename")
                if self.kind == "rename" and not self.fired:
                    self.count += 1
                    if self.count == self.at:
                        self._fail(errno.EIO, os.fspath(src))
            return real(src, dst, *args, **kwargs)

        return call

    # -- the faults ---------------------------------------------------------------------------------------------
    def _fail(self, code: int, path: str) -> None:
        self.fired = True
        raise OSError(code, os.strerror(code), path)

    def _mutation(self, path: Any, op: str) -> None:
        if self.kind != "kill" or self.fired:
            return
        self.count += 1
        self.steps.append((op, os.path.abspath(os.fspath(path))))
        if self.count == self.at:
            self.fired = True
            if self.on_kill is not None:
                self.on_kill()
            self._snapshot = tempfile.mkdtemp(prefix="killed-")
            shutil.copytree(self.root, os.path.join(self._snapshot, "d"), symlinks=True)
            raise Killed(f"process killed at filesystem step {self.at} ({os.fspath(path)})")

    def _before_write(self, size: int, path: str) -> int:
        """How many of ``size`` bytes may be written now."""
        if self.kind != "write" or self.fired:
            return size
        room = max(0, self.at - self._written)
        self._written += min(size, room)
        return min(size, room)

    def restore_killed_state(self) -> None:
        """After a ``kill`` fault: the directory as the killed process left it (see module docstring)."""
        if self._snapshot is None:
            return
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.copytree(os.path.join(self._snapshot, "d"), self.root, symlinks=True)
        shutil.rmtree(self._snapshot, ignore_errors=True)
        self._snapshot = None
