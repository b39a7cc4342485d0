"""Handle lifetime and O_DIRECT reporting, on every implementation providing "io".

A closed handle leaves nothing behind: no worker thread (``threading.active_count``), no bounce buffer, no pinned
memory (``pinned_stats`` of the implementation's pinning area back to its value before the handle), also after
failed requests and when the handle is dropped without ``close()``. O_DIRECT is used where the filesystem allows
it and the stats say so; where a filesystem refuses it, requests still succeed, buffered, and the fallback is
reported.
"""

from __future__ import annotations

import errno
import gc
import os
import tempfile

import pytest
import torch

from conformance.areas.io_assertions import (
    assert_no_new_threads,
    assert_released,
    assert_round_trip,
    assert_stats_consistent,
    thread_baseline,
)
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")


@pytest.fixture
def pinning(impl, accelerator, monkeypatch):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    return impl.load("pinning")


def _baseline(pinning):
    threads = thread_baseline()
    return threads, pinning.pinned_stats()


def _exercise(h, tmp_path, pinning) -> None:
    """Bounced and direct requests, successful and failing."""
    src = torch.arange(20000, dtype=torch.float32)
    pinned = pinning.pin_empty(20000, dtype=torch.float32)
    h.write(src, str(tmp_path / "a.bin"))
    h.write(pinned, str(tmp_path / "b.bin"))
    bad = h.read(src, str(tmp_path / "missing.bin"))
    h.read(pinned, str(tmp_path / "a.bin"))
    with pytest.raises(Exception):  # noqa: B017 - the failure itself is checked in test_io_errors
        h.wait()
    assert bad.exception() is not None
    assert_round_trip(pinned, src, "bounced write, direct read")


@pytest.mark.requires(areas=("pinning",))
def test_close_releases_threads_pool_and_pinned_memory(area_api, pinning, tmp_path):
    threads0, pinned0 = _baseline(pinning)
    h = area_api.SwapHandle(queue_depth=3, block_size=8192, num_threads=3)
    _exercise(h, tmp_path, pinning)
    s = h.stats()
    assert s.pool_bytes > 0, f"bounced requests ran but the pool holds nothing: {s}"
    assert s.bounce_in_use == 0 and s.in_flight == 0, s
    h.close()
    assert_released(h, pinning, threads0, pinned0, "after close()")


@pytest.mark.requires(areas=("pinning",))
def test_context_manager_releases_even_when_the_block_raises(area_api, pinning, tmp_path):
    threads0, pinned0 = _baseline(pinning)
    with pytest.raises(KeyError):
        with area_api.SwapHandle(block_size=4096, num_threads=2) as h:
            h.write(torch.ones(10000), str(tmp_path / "x.bin"))
            raise KeyError("user error inside the block")
    assert h.closed
    assert_released(h, pinning, threads0, pinned0, "after an exception in the with-block")
    out = torch.empty(10000)
    with area_api.SwapHandle() as h2:
        h2.read(out, str(tmp_path / "x.bin")).wait()  # the queued write was finished by close()
    assert_round_trip(out, torch.ones(10000), "write queued before the exception")


@pytest.mark.requires(areas=("pinning",))
def test_with_block_raises_unreported_failures_and_still_closes(area_api, reference_api, pinning, tmp_path):
    threads0, pinned0 = _baseline(pinning)
    with pytest.raises(reference_api.SwapFileNotFoundError):
        with area_api.SwapHandle(num_threads=2) as h:
            h.read(torch.empty(10), str(tmp_path / "missing.bin"))
    assert_released(h, pinning, threads0, pinned0, "after a failure raised by the with-block")


@pytest.mark.requires(areas=("pinning",))
def test_dropped_handle_leaves_nothing(area_api, pinning, tmp_path):
    threads0, pinned0 = _baseline(pinning)
    h = area_api.SwapHandle(queue_depth=2, block_size=4096, num_threads=4)
    h.write(torch.ones(30000), str(tmp_path / "x.bin")).wait()
    del h
    gc.collect()
    assert_no_new_threads(threads0, "after dropping an open handle")
    assert pinning.pinned_stats() == pinned0


def test_o_direct_is_used_or_its_absence_reported(area_api, tmp_path):
    t = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB at offset 0: fully O_DIRECT eligible
    with area_api.SwapHandle(block_size=65536, use_o_direct=True) as h:
        w = h.write(t, str(tmp_path / "d.bin"))
        out = torch.empty_like(t)
        r = h.read(out, str(tmp_path / "d.bin"))
        h.wait()
        assert_round_trip(out, t, "O_DIRECT round trip")
        s = h.stats()
        assert_stats_consistent(s, "O_DIRECT eligible requests")
        if w.o_direct or r.o_direct:
            assert s.o_direct_bytes > 0, s
        else:
            assert s.o_direct_bytes == 0 and s.fallback_reason, f"no O_DIRECT and no reason given: {s}"
        # Unaligned offsets are never O_DIRECT; the bytes go through the page cache.
        u = h.write(t, str(tmp_path / "u.bin"), 100)
        u.wait()
        assert u.o_direct is False
    with area_api.SwapHandle(use_o_direct=False) as h:
        w = h.write(t, str(tmp_path / "b.bin"))
        w.wait()
        assert w.o_direct is False and h.stats().o_direct_bytes == 0, h.stats()


def _dir_refusing_o_direct() -> str | None:
    """A writable directory on a filesystem that rejects O_DIRECT (tmpfs before Linux 6.6), if there is one."""
    candidates = [os.environ.get("HOSTOFFLOAD_IO_NO_O_DIRECT_DIR"), "/dev/shm", "/run/shm", "/run"]
    for d in filter(None, candidates):
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            continue
        fd, probe = tempfile.mkstemp(dir=d)
        os.close(fd)
        try:
            os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return d
        finally:
            os.unlink(probe)
    return None


def test_o_direct_fallback_is_clean_and_reported(area_api):
    d = _dir_refusing_o_direct()
    if d is None:
        pytest.skip("no writable filesystem here refuses O_DIRECT (tmpfs accepts it since Linux 6.6); set "
                    "HOSTOFFLOAD_IO_NO_O_DIRECT_DIR to a directory on one that does (e.g. a ramfs mount)")
    path = tempfile.mkdtemp(dir=d)
    try:
        t = torch.arange(64 * 1024, dtype=torch.float32)
        out = torch.empty_like(t)
        with area_api.SwapHandle(block_size=65536, use_o_direct=True) as h:
            w = h.write(t, os.path.join(path, "f.bin"))
            r = h.read(out, os.path.join(path, "f.bin"))
            h.wait()
            assert (w.o_direct, r.o_direct) == (False, False)
            s = h.stats()
            assert s.o_direct_bytes == 0 and s.fallback_reason, s
            assert_stats_consistent(s, "after the fallback")
        assert_round_trip(out, t, "round trip on a filesystem without O_DIRECT")
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)
