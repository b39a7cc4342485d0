"""The harness's own leak observation (conformance.harness.observation) shown real leaks: a file descriptor left open, a
thread left running, pages left locked, a registration never undone and device memory never freed are each
reported by ``Observation.leaks_since``, naming what leaked; released again, nothing is reported, and the
comparison taken the wrong way round (a resource *released* over the test) reports nothing either. Without
these, a comparison written backwards would pass every leak through the suite's leak checks unnoticed."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from conformance.harness.observation import Observation, RegistrationWatch

pytestmark = pytest.mark.conformance_area("harness")



def test_a_file_descriptor_left_open_is_reported():
    before = Observation.now()
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        during = Observation.now()
        leaks = during.leaks_since(before)
        assert len(leaks) == 1 and "1 file descriptor(s) left open" in leaks[0], leaks
        assert f"{fd} -> {os.devnull}" in leaks[0], leaks
    finally:
        os.close(fd)
    assert Observation.now().leaks_since(before) == [], "a closed descriptor is still reported"
    assert before.leaks_since(during) == [], "a descriptor closed over the test is reported as a leak"


def test_a_thread_left_running_is_reported():
    before = Observation.now()
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, name="selftest-leaked-thread")
    th.start()
    try:
        during = Observation.now()
        leaks = during.leaks_since(before)
        assert leaks == ["thread(s) still running: selftest-leaked-thread"], leaks
    finally:
        stop.set()
        th.join()
    assert Observation.now().leaks_since(before) == [], "a joined thread is still reported"
    assert before.leaks_since(during) == [], "a thread that ended over the test is reported as a leak"


def test_pages_left_locked_are_reported():
    libc = ctypes.CDLL(None, use_errno=True)
    buf = mmap.mmap(-1, 16 * 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    before = Observation.now()
    assert libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(16 * 4096)) == 0, os.strerror(ctypes.get_errno())
    try:
        during = Observation.now()
        leaks = during.leaks_since(before)
        assert leaks == ["page-locked memory grew by 64 KiB (VmLck)"], leaks
        assert during.leaks_since(before, locked=False) == [], "locked=False must leave VmLck out"
    finally:
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(16 * 4096))
    assert Observation.now().leaks_since(before) == []
    assert before.leaks_since(during) == [], "pages unlocked over the test are reported as a leak"


class _CountingDevice:
    """An accelerator stand-in: registrations through its own hooks, and device memory it reports."""

    def __init__(self) -> None:
        self.allocated = 0

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        return True

    def unregister_host_memory(self, ptr: int) -> None:
        pass

    def memory_stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.allocated}


def test_registrations_and_device_memory_left_behind_are_reported(monkeypatch):
    device = _CountingDevice()
    watch = RegistrationWatch(device, monkeypatch)
    before = Observation.now(device, watch)
    device.register_host_memory(0x10000, 4096)
    device.allocated += 512
    during = Observation.now(device, watch)
    assert during.leaks_since(before) == [
        "1 host registration(s) never unregistered", "device memory grew by 512 bytes"
    ], during.leaks_since(before)
    device.unregister_host_memory(0x10000)
    device.allocated -= 512
    assert Observation.now(device, watch).leaks_since(before) == []
    assert before.leaks_since(during) == [], "resources released over the test are reported as leaks"
