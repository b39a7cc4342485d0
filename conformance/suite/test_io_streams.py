"""Rules IO1-IO2 of docs/io.md for handles that run requests asynchronously (capability ``io_streams``).

The suite observes the operating system itself instead of the handle's flags: ``os.open`` is wrapped to see which
descriptors were opened with ``O_DIRECT``, and ``os.pwrite`` to check that a buffer handed to the kernel is not
changed while the call runs. The pwrite wrapper holds each call until another worker's call has started (or a
short while passed), so a buffer handed back to the pool too early is taken and refilled by that other worker
inside the window: the rewrite is then seen for certain by comparing the bytes before and after the call.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conformance.areas.io_assertions import expected_direct
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")

ALIGN = 4096
_FEW = settings(max_examples=max(5, settings.default.max_examples // 4), deadline=None)


@pytest.fixture
def io_apis(impl, area_api, monkeypatch):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    return area_api, impl.load("pinning"), impl.load("ranges")


class _OpenWatch:
    """Records, per path, whether an ``O_DIRECT`` open was attempted and whether it succeeded."""

    def __init__(self) -> None:
        self.direct: dict[str, bool] = {}
        self._real = os.open

    def __call__(self, path, flags, *args, **kwargs):
        direct = bool(flags & getattr(os, "O_DIRECT", 0))
        try:
            fd = self._real(path, flags, *args, **kwargs)
        except OSError:
            if direct:
                self.direct.setdefault(os.fspath(path), False)
            raise
        if direct:
            self.direct[os.fspath(path)] = True
        return fd


@_FEW
@given(
    lead=st.integers(0, 3 * ALIGN),
    nbytes=st.one_of(st.integers(1, ALIGN - 1), st.integers(ALIGN, 5 * ALIGN)),
    offset=st.sampled_from((0, ALIGN, 100, ALIGN + 8)),
    use_o_direct=st.booleans(),
)
@pytest.mark.requires("io_streams", areas=("pinning", "ranges"))
@example(lead=0, nbytes=ALIGN - 1, offset=0, use_o_direct=True)
@example(lead=0, nbytes=ALIGN, offset=0, use_o_direct=True)
@example(lead=8, nbytes=3 * ALIGN, offset=0, use_o_direct=True)
def test_IO1_decision_for_every_length_and_alignment(io_apis, tmp_path_factory, lead, nbytes, offset, use_o_direct):
    """IO1: O_DIRECT is used iff asked for, the record offset is 4 KiB aligned and the payload is at least 4 KiB
    (seen on the OS's open calls); the tensor's own memory is used iff the registry rule holds for the file mode
    actually used, whatever the length (payloads shorter than 4 KiB included) and alignment of the view."""
    api, pinning, ranges = io_apis
    base = pinning.pin_empty(16 * ALIGN, dtype=torch.uint8)  # one size for all: large enough to be registered
    base.copy_(torch.arange(base.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    view = base.narrow(0, lead, nbytes)
    values = view.clone()
    assert ranges.global_registry().contains(*ranges.tensor_extent(base)), "pin_empty's buffer is not registered"
    path = str(tmp_path_factory.mktemp("io1") / "d.bin")
    watch = _OpenWatch()
    with pytest.MonkeyPatch.context() as patch:  # a private patch: undoing it keeps the fixture's environment
        patch.setattr(os, "open", watch)
        with api.SwapHandle(block_size=ALIGN, use_o_direct=use_o_direct) as h:
            w = h.write(view, path, offset)
            w.wait()
            view.zero_()
            r = h.read(view, path, offset)
            r.wait()
    assert torch.equal(view, values), "round trip changed the bytes"
    wants = use_o_direct and offset % ALIGN == 0 and nbytes >= ALIGN
    attempted = path in watch.direct or any(p.startswith(os.path.join(os.path.dirname(path), ".d.bin"))
                                            for p in watch.direct)
    assert attempted == wants, (
        f"O_DIRECT open attempted={attempted}, rule says {wants} (use_o_direct={use_o_direct}, offset={offset}, "
        f"payload={nbytes})"
    )
    for req, what in ((w, "write"), (r, "read")):
        opened = any(watch.direct.values()) if wants else False
        assert req.o_direct == opened, f"{what}: o_direct={req.o_direct} but the OS saw O_DIRECT open={opened}"
        expected, reason = expected_direct(view, ranges, opened)
        assert req.direct is expected, f"{what}: direct={req.direct}, rule says {expected} ({reason})"


class _PwriteWatch:
    """Wraps ``os.pwrite``: holds each call until another call started (bounded), then checks the buffer did not
    change while the kernel was given it."""

    def __init__(self, hold_s: float = 0.05) -> None:
        self._real = os.pwrite
        self._cond = threading.Condition()
        self._started = 0
        self._hold_s = hold_s
        self.calls = 0
        self.violations: list[str] = []

    def __call__(self, fd, data, pos):
        before = bytes(data)
        with self._cond:
            self._started += 1
            self.calls += 1
            mine = self._started
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._started > mine, timeout=self._hold_s)
        n = self._real(fd, data, pos)
        if bytes(data) != before:
            self.violations.append(f"buffer of pwrite(fd={fd}, pos={pos}, {len(before)} bytes) was rewritten while "
                                   "the write was in flight")
        return n


@pytest.mark.requires("io_streams", areas=("pinning", "ranges"))
@pytest.mark.parametrize("threads", [2, 4])
def test_IO2_bounce_buffer_not_reused_before_its_write_completed(io_apis, tmp_path, threads):
    """IO2: a bounce buffer goes back to the pool only after the write that reads it completed (and a read's
    buffer only after its bytes were copied out): with several workers sharing a small pool, no pwrite sees its
    buffer change, and every block lands in the file intact."""
    api, _, _ = io_apis
    nblocks = 16
    t = torch.arange(nblocks * ALIGN // 4, dtype=torch.int32)  # pageable: bounced, each block distinct
    watch = _PwriteWatch()
    paths = [str(tmp_path / f"b{i}.bin") for i in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "pwrite", watch)
        with api.SwapHandle(queue_depth=2, block_size=ALIGN, num_threads=threads, use_o_direct=False) as h:
            reqs = [h.write(t, p) for p in paths]
            for q in reqs:
                q.wait()
            assert h.stats().bounced_bytes > 0, "the test needs bounced requests"
    assert watch.calls >= nblocks, f"only {watch.calls} pwrite calls seen"
    assert not watch.violations, watch.violations[:3]
    with api.SwapHandle(queue_depth=2, block_size=ALIGN, num_threads=threads, use_o_direct=False) as h:
        for p in paths:
            back = torch.zeros_like(t)
            h.read(back, p).wait()
            assert torch.equal(back, t), f"{p}: blocks came back scrambled"
