"""What the harness observes about the process by itself, without asking the implementation.

Leak and lifetime checks compare two :class:`Observation` snapshots taken around a test: page-locked memory
(``VmLck`` in ``/proc/self/status``), live host registrations seen by the accelerator's own hooks (counted by a
:class:`RegistrationWatch` wrapped around them), device memory the accelerator reports, open file descriptors and
live threads. The implementation's ``pinned_stats()`` is then one more property checked against these, never the
instrument: an implementation that leaks outside its own accounting is still caught.
"""

from __future__ import annotations

import fcntl
import gc
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest


def vm_locked_kib() -> int:
    """VmLck of this process in KiB (page-locked memory), from /proc/self/status (0 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmLck:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def open_fds() -> frozenset[int]:
    """The process's open file descriptors. The listing opens one of its own (the lowest free number), which is
    closed again by the time it is returned: it is left out by asking which listed numbers are still open, or it
    would show up as a phantom in the next snapshot and a real leak that took its number would go unnamed."""
    try:
        listed = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return frozenset()
    return frozenset(fd for fd in listed if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def device_bytes(accelerator: Any) -> int:
    """Bytes the accelerator reports as allocated on the device (0 where it reports nothing)."""
    try:
        stats = accelerator.memory_stats() if accelerator is not None else {}
    except Exception:
        return 0
    return int(stats.get("allocated_bytes.all.current", 0))


class RegistrationWatch:
    """Counts host registrations through the accelerator's own hooks: wraps ``register_host_memory`` and
    ``unregister_host_memory`` of the accelerator's class (calling the originals) for one test."""

    def __init__(self, accelerator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live: dict[int, int] = {}
        self._lock = threading.Lock()
        cls = type(accelerator)
        register, unregister = cls.register_host_memory, cls.unregister_host_memory
        watch = self

        def counted_register(acc: Any, ptr: int, nbytes: int) -> bool:
            ok = register(acc, ptr, nbytes)
            if ok:
                with watch._lock:
                    watch.live[ptr] = nbytes
            return ok

        def counted_unregister(acc: Any, ptr: int) -> None:
            unregister(acc, ptr)
            with watch._lock:
                watch.live.pop(ptr, None)

        monkeypatch.setattr(cls, "register_host_memory", counted_register)
        monkeypatch.setattr(cls, "unregister_host_memory", counted_unregister)

    def count(self) -> int:
        with self._lock:
            return len(self.live)


@dataclass(frozen=True)
class Observation:
    locked_kib: int
    registrations: int
    device_bytes: int
    fds: frozenset[int]
    threads: frozenset[threading.Thread] = field(repr=False)

    @classmethod
    def now(cls, accelerator: Any = None, watch: RegistrationWatch | None = None) -> Observation:
        gc.collect()
        return cls(
            locked_kib=vm_locked_kib(),
            registrations=watch.count() if watch is not None else 0,
            device_bytes=device_bytes(accelerator),
            fds=open_fds(),
            threads=frozenset(t for t in threading.enumerate() if t.is_alive()),
        )

    def leaks_since(self, before: Observation, *, locked: bool = True) -> list[str]:
        """What this observation holds that ``before`` did not: one line per kind of leak."""
        out = []
        if locked and self.locked_kib > before.locked_kib:
            out.append(f"page-locked memory grew by {self.locked_kib - before.locked_kib} KiB (VmLck)")
        if self.registrations > before.registrations:
            out.append(f"{self.registrations - before.registrations} host registration(s) never unregistered")
        if self.device_bytes > before.device_bytes:
            out.append(f"device memory grew by {self.device_bytes - before.device_bytes} bytes")
        new_fds = sorted(self.fds - before.fds)
        if new_fds:
            targets = []
            for fd in new_fds[:5]:
                try:
                    targets.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
                except OSError:
                    targets.append(str(fd))
            out.append(f"{len(new_fds)} file descriptor(s) left open: {', '.join(targets)}")
        new_threads = [t.name for t in self.threads - before.threads]
        if new_threads:
            out.append(f"thread(s) still running: {', '.join(sorted(new_threads))}")
        return out
