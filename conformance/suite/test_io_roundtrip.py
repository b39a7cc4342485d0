"""Swap I/O round trips: what is written comes back bitwise, whatever the tensor's dtype, shape, layout or memory.

Every test runs on every implementation providing area "io". Pinned tensors come from the implementation's own
pinning area with the native backend, so they are in the registry the implementation's handle consults; the
file written by the implementation is also read back with the reference handle (and vice versa), which pins the
record format down to the specification's.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.areas.io_assertions import (
    assert_bytes_equal,
    assert_decision,
    assert_round_trip,
    assert_stats_consistent,
    raw_bytes,
)
from conformance.areas.io_strategies import (
    DEST_KINDS,
    SOURCE_KINDS,
    handle_configs,
    offsets,
    swap_tensors,
    tensor_specs,
)
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")


@pytest.fixture
def apis(impl, accelerator, monkeypatch):
    """(pinning, ranges) areas of the implementation, with native pinning selected."""
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    return impl.load("pinning"), impl.load("ranges")


def _device_or_none(accelerator, use_device: bool):
    return accelerator.device() if use_device and accelerator.device_type != "cpu" else None


@given(
    src_spec=tensor_specs(SOURCE_KINDS),
    dst_kind=st.sampled_from(DEST_KINDS),
    offset=offsets(),
    config=handle_configs(),
    on_device=st.booleans(),
    data=st.data(),
)
@pytest.mark.requires(areas=("pinning", "ranges"))
def test_round_trip(area_api, reference_api, apis, accelerator, tmp_path_factory, src_spec, dst_kind, offset,
                    config, on_device, data):
    pinning, ranges = apis
    device = _device_or_none(accelerator, on_device)
    src = swap_tensors(src_spec, pinning.pin_empty, device)
    expected = src.detach().cpu().clone()
    dst_spec = data.draw(tensor_specs((dst_kind,), dtype=src_spec.dtype, shape=src_spec.shape), label="dst_spec")
    dst = swap_tensors(dst_spec, pinning.pin_empty, device, fill=False)
    path = str(tmp_path_factory.mktemp("rt") / "swap.bin")
    with area_api.SwapHandle(**config) as h:
        w = h.write(src, path, offset)
        r = h.read(dst, path, offset)  # same path: runs after the write, in submission order
        assert w.wait() is src
        assert r.wait() is dst
        assert_round_trip(dst, expected, f"read back ({src_spec} -> {dst_kind}, offset {offset})")
        assert_decision(w, src, ranges, "write")
        assert_decision(r, dst, ranges, "read")
        stats = h.stats()
        assert_stats_consistent(stats, "after one write and one read")
        n = src_spec.nbytes
        assert (stats.bytes_written, stats.bytes_read) == (n, n), stats
        expected_direct = n * (int(bool(w.direct)) + int(bool(r.direct)))
        assert stats.direct_bytes == expected_direct, f"direct_bytes {stats.direct_bytes} != {expected_direct}"
    # The record is the specification's: the reference reads it back, and its payload sits after the header.
    if area_api is not reference_api:
        back = torch.zeros(src_spec.shape, dtype=src_spec.dtype)
        with reference_api.SwapHandle() as ref:
            ref.read(back, path, offset).wait()
        assert_round_trip(back, expected, "reference reading the implementation's record")
    with open(path, "rb") as f:
        f.seek(offset + reference_api.HEADER_SIZE)
        assert_bytes_equal(f.read(n), raw_bytes(expected), "payload bytes on disk")


@given(spec=tensor_specs(("pageable", "pinned")), offset=offsets(), config=handle_configs())
@settings(max_examples=20)  # a cross-check of the format in the other direction; the round trip above is the sweep
@pytest.mark.requires(areas=("pinning", "ranges"))
def test_reads_what_the_reference_wrote(area_api, reference_api, apis, tmp_path_factory, spec, offset, config):
    pinning, _ = apis
    src = swap_tensors(spec, pinning.pin_empty)
    path = str(tmp_path_factory.mktemp("ref") / "swap.bin")
    with reference_api.SwapHandle() as ref:
        ref.write(src, path, offset).wait()
    dst = torch.empty(spec.shape, dtype=spec.dtype)
    with area_api.SwapHandle(**config) as h:
        h.read(dst, path, offset).wait()
    assert_round_trip(dst, src, "implementation reading the reference's record")


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_read_into_a_view_leaves_the_rest_of_its_buffer_alone(area_api, apis, tmp_path):
    """A direct read writes exactly the view's bytes: nothing before or after it in the pinned base changes."""
    pinning, _ = apis
    base = pinning.pin_empty(4 * 4096, dtype=torch.uint8)
    base.fill_(0xAB)
    src = (torch.arange(2 * 4096 + 1000) % 251).to(torch.uint8)  # 9192 bytes: unaligned tail on purpose
    path = str(tmp_path / "v.bin")
    with area_api.SwapHandle(block_size=4096) as h:
        h.write(src, path).wait()
        for start in (0, 7, 4096 - 1, 2):  # aligned and unaligned view addresses
            base.fill_(0xAB)
            view = base[start : start + src.numel()]
            h.read(view, path).wait()
            assert_round_trip(view, src, f"view at byte {start}")
            outside = torch.cat([base[:start], base[start + src.numel() :]])
            bad = (outside != 0xAB).nonzero()
            assert bad.numel() == 0, f"view at byte {start}: {bad.numel()} bytes outside the view changed"


@pytest.mark.requires(areas=("pinning", "ranges"))
def test_concurrent_requests_on_one_handle(area_api, apis, tmp_path):
    """Many requests in flight at once over several files and offsets, submitted from several threads."""
    pinning, _ = apis
    n_files, per_file = 3, 6
    sizes = [1 + 997 * k for k in range(n_files * per_file)]
    span = area_api.record_span(max(sizes) * 4)
    tensors = []
    for k, n in enumerate(sizes):
        t = pinning.pin_empty(n, dtype=torch.float32) if k % 2 else torch.empty(n)
        t.copy_(torch.arange(n, dtype=torch.float32) * (k + 1))
        tensors.append(t)
    where = [(str(tmp_path / f"f{k % n_files}"), (k // n_files) * span) for k in range(len(sizes))]
    with area_api.SwapHandle(queue_depth=4, block_size=4096, num_threads=3) as h:
        def submit(ks):
            for k in ks:
                h.write(tensors[k], *where[k])

        threads = [threading.Thread(target=submit, args=(range(i, len(sizes), 3),)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        h.wait()
        outs = [torch.full((n,), -1.0) for n in sizes]
        reqs = [h.read(outs[k], *where[k]) for k in range(len(sizes))]
        h.wait()
        for k, req in enumerate(reqs):
            assert req.done()
            assert_round_trip(outs[k], tensors[k], f"request {k} ({where[k][0]} @ {where[k][1]})")
        stats = h.stats()
        assert stats.requests == 2 * len(sizes) and stats.failed_requests == 0, stats
        assert stats.in_flight == 0 and stats.bounce_in_use == 0, stats
        assert_stats_consistent(stats, "after concurrent requests")


def test_requests_on_one_path_apply_in_submission_order(area_api, tmp_path):
    """write A, read, write B, read on one path without waiting in between: the reads see A then B."""
    path = str(tmp_path / "order.bin")
    a, b = torch.full((5000,), 1.0), torch.full((5000,), 2.0)
    got_a, got_b = torch.empty(5000), torch.empty(5000)
    with area_api.SwapHandle(queue_depth=4, block_size=4096, num_threads=3) as h:
        h.write(a, path)
        h.read(got_a, path)
        h.write(b, path)
        h.read(got_b, path)
        h.wait()
    assert_round_trip(got_a, a, "read after the first write")
    assert_round_trip(got_b, b, "read after the second write")


def test_several_records_in_one_file(area_api, tmp_path):
    """Records placed record_span apart in one file are independent: updating one leaves the others intact."""
    path = str(tmp_path / "packed.bin")
    parts = [torch.arange(100 * (k + 1), dtype=torch.float64) + k for k in range(4)]
    offs = [0]
    for p in parts[:-1]:
        offs.append(offs[-1] + area_api.record_span(p.numel() * 8))
    with area_api.SwapHandle(block_size=4096) as h:
        for p, o in zip(parts, offs, strict=True):
            h.write(p, path, o)
        h.wait()
        parts[2] = parts[2] * -1
        h.write(parts[2], path, offs[2]).wait()
        for k, (p, o) in enumerate(zip(parts, offs, strict=True)):
            out = torch.empty_like(p)
            h.read(out, path, o).wait()
            assert_round_trip(out, p, f"record {k} at offset {o}")
    assert area_api.record_nbytes(8) == area_api.HEADER_SIZE + 8
