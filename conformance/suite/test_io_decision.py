"""The direct-versus-bounce decision, checked against the registry rule on every implementation providing "io".

A request uses the caller's memory directly iff the tensor is a contiguous CPU tensor whose whole extent lies in
one range of the implementation's process-wide registry (and, when the file is open with O_DIRECT, its address is
4 KiB aligned); see :func:`conformance.areas.io_assertions.expected_direct`, which restates the rule from the
registry, not from the implementation. Stats must count exactly the bytes of each kind.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.io_assertions import assert_decision, assert_round_trip, expected_direct
from conformance.areas.strategies import DTYPES, filled
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")


@pytest.fixture
def apis(impl, accelerator, monkeypatch):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    return impl.load("pinning"), impl.load("ranges")


def _move(h, t: torch.Tensor, path: str):
    """Write ``t`` then read it back into itself; returns both requests, waited."""
    values = t.detach().cpu().clone()
    w = h.write(t, path)
    w.wait()
    t.zero_()
    r = h.read(t, path)
    r.wait()
    assert_round_trip(t, values, "round trip through the decision under test")
    return w, r


@given(
    dtype=st.sampled_from(DTYPES),
    lead=st.integers(0, 5000),
    numel=st.integers(1, 6000),
    tail=st.integers(0, 64),
    use_o_direct=st.booleans(),
    strided=st.booleans(),
)
@pytest.mark.requires(areas=("pinning", "ranges"))
def test_views_of_a_pinned_buffer(area_api, apis, tmp_path_factory, dtype, lead, numel, tail, use_o_direct, strided):
    pinning, ranges = apis
    base = pinning.pin_empty(lead + 2 * numel + tail, dtype=dtype)
    base.copy_(filled(tuple(base.shape), dtype, lead + numel))
    view = base[lead : lead + 2 * numel : 2] if strided else base.narrow(0, lead, numel)
    path = str(tmp_path_factory.mktemp("dec") / "d.bin")
    with area_api.SwapHandle(block_size=4096, use_o_direct=use_o_direct) as h:
        w, r = _move(h, view, path)
        direct = assert_decision(w, view, ranges, "write of a view of a pinned buffer")
        assert_decision(r, view, ranges, "read into a view of a pinned buffer")
        nbytes = numel * view.element_size()
        stats = h.stats()
        assert stats.direct_bytes == (2 * nbytes if direct else 0), stats
        assert stats.bounced_bytes == (0 if direct else 2 * nbytes), stats
    if not strided and not use_o_direct:
        assert direct, "a contiguous view of a pinned buffer must be used directly when O_DIRECT is off"


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_pageable_memory_is_bounced(area_api, apis, tmp_path):
    _, ranges = apis
    t = torch.arange(10000, dtype=torch.float32)
    assert not expected_direct(t, ranges, False)[0]
    with area_api.SwapHandle(block_size=4096) as h:
        w, r = _move(h, t, str(tmp_path / "p.bin"))
        assert (w.direct, r.direct) == (False, False)
        s = h.stats()
        assert (s.direct_bytes, s.bounced_bytes) == (0, 80000), s


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_whole_pinned_buffer_is_direct(area_api, apis, tmp_path):
    pinning, ranges = apis
    t = pinning.pin_empty(10000, dtype=torch.float32)  # page-aligned: direct with or without O_DIRECT
    t.copy_(torch.arange(10000))
    with area_api.SwapHandle(block_size=4096) as h:
        w, r = _move(h, t, str(tmp_path / "p.bin"))
        assert (w.direct, r.direct) == (True, True)
        assert_decision(w, t, ranges)
        s = h.stats()
        assert (s.direct_bytes, s.bounced_bytes) == (80000, 0), s


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_unpinned_buffer_falls_back_to_bounce(area_api, apis, tmp_path):
    """unpin() drops the range at once: the same (still mapped) memory is bounced from then on."""
    pinning, ranges = apis
    t = pinning.pin_empty(8192, dtype=torch.uint8)
    t.copy_(torch.arange(8192) % 256)
    with area_api.SwapHandle(block_size=4096) as h:
        w, _ = _move(h, t, str(tmp_path / "a.bin"))
        assert w.direct is True
        assert pinning.unpin(t) is True
        w, r = _move(h, t, str(tmp_path / "b.bin"))
        assert (w.direct, r.direct) == (False, False)
        assert_decision(w, t, ranges, "write after unpin")


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_torch_backend_memory_follows_the_registry(area_api, apis, tmp_path, monkeypatch):
    """Memory pinned by torch's allocator is not in the registry, so the rule bounces it."""
    pinning, ranges = apis
    monkeypatch.setenv(PIN_BACKEND_ENV, "torch")
    t = pinning.pin_empty(4096, dtype=torch.float32)
    t.copy_(torch.arange(4096))
    with area_api.SwapHandle(block_size=4096) as h:
        w, r = _move(h, t, str(tmp_path / "t.bin"))
        assert_decision(w, t, ranges, "write of torch-pinned memory")
        assert_decision(r, t, ranges, "read into torch-pinned memory")


@pytest.mark.parametrize("use_o_direct", [False, True])
@pytest.mark.requires(areas=("pinning", "ranges"))
def test_extent_straddling_two_ranges_is_bounced(area_api, apis, tmp_path, use_o_direct):
    """The registry rule through the handle: an extent inside ONE range is direct, one straddling two adjacent
    ranges is not. The two ranges are registered by hand in the implementation's process-wide registry over an
    ordinary buffer (kept alive, removed again in ``finally``), the only way to get two ranges that touch."""
    _, ranges = apis
    page = 4096
    raw = torch.empty(4 * page, dtype=torch.uint8)
    skip = -raw.data_ptr() % page
    buf = raw[skip : skip + 2 * page]
    base = buf.data_ptr()
    registry = ranges.global_registry()
    registry.add(base, page, 0)
    try:
        registry.add(base + page, page, 0)
        try:
            cases = {"first range": buf[:page], "second range": buf[page:], "inside": buf[100:900],
                     "straddling": buf[page - 512 : page + 512], "both whole": buf}
            with area_api.SwapHandle(block_size=4096, use_o_direct=use_o_direct) as h:
                for k, (name, view) in enumerate(cases.items()):
                    view.copy_(torch.arange(view.numel()) % 253)
                    w, r = _move(h, view, str(tmp_path / f"{k}.bin"))
                    direct = assert_decision(w, view, ranges, f"write of {name}")
                    assert_decision(r, view, ranges, f"read into {name}")
                    if name in ("straddling", "both whole"):
                        assert not direct, f"{name}: an extent over two ranges must be bounced"
                    elif not use_o_direct:
                        assert direct, f"{name}: an extent inside one range must be direct"
        finally:
            registry.remove(base + page)
    finally:
        registry.remove(base)


@pytest.mark.requires("pinned_slab")
@pytest.mark.requires(areas=("pinning", "ranges"))
def test_slab_pieces_are_direct(impl, area_api, apis, tmp_path):
    """Pieces of a pinned slab (and views of them) lie in the slab's one registered range: direct."""
    module = impl.capabilities.pinned_slab
    slab_cls = importlib.import_module(module).PinnedSlab
    _, ranges = apis
    with slab_cls(1 << 20) as slab, area_api.SwapHandle(block_size=4096, use_o_direct=False) as h:
        piece = slab.allocate(5000, dtype=torch.float32)
        piece.copy_(torch.arange(5000))
        narrow = piece[13:4000]
        for k, t in enumerate((piece, narrow)):
            w, r = _move(h, t, str(tmp_path / f"s{k}.bin"))
            assert (w.direct, r.direct) == (True, True), f"slab piece view {k}"
            assert_decision(w, t, ranges, "write of a slab piece")


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_device_tensors_are_bounced(area_api, apis, accelerator, tmp_path):
    if accelerator.device_type == "cpu":
        pytest.skip("accelerator 'cpu' has no device memory")
    _, ranges = apis
    t = torch.arange(10000, dtype=torch.float32, device=accelerator.device())
    with area_api.SwapHandle(block_size=4096) as h:
        w, r = _move(h, t, str(tmp_path / "dev.bin"))
        assert (w.direct, r.direct) == (False, False)
        assert_decision(w, t, ranges, "write of a device tensor")
        assert h.stats().bounced_bytes == 80000
