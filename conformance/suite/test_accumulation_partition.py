"""The flat layout of R8: alignment, padding, contiguous per-rank partitions, lossless flatten/gather."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.areas.accumulation_assertions import assert_tensor_equal
from conformance.areas.assertions import assert_names_argument
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("accumulation")

shape_lists = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6)


@given(shapes=shape_lists, world=st.integers(1, 4))
def test_R8_layout_is_aligned_padded_and_partitioned(reference_api, shapes, world):
    """R8: parameters in order, each starting at a multiple of FLAT_ALIGNMENT, no overlap, total the smallest
    multiple of FLAT_ALIGNMENT * W that holds them, equal contiguous partitions whose pieces cover every
    parameter element exactly once."""
    api = reference_api
    align = api.FLAT_ALIGNMENT
    layout = api.build_layout([(f"p{i}", s) for i, s in enumerate(shapes)], world)
    cursor = 0
    for i, seg in enumerate(layout.segments):
        assert seg.name == f"p{i}" and seg.shape == shapes[i]
        assert seg.offset % align == 0 and seg.offset >= cursor
        assert seg.offset - cursor < align, "only alignment padding between parameters"
        cursor = seg.end
    assert layout.total % (align * world) == 0
    assert layout.total - cursor < align * world
    covered = torch.zeros(layout.total, dtype=torch.int64)
    for r in range(world):
        start, end = layout.partition_range(r)
        assert (start, end) == (r * layout.partition_size, (r + 1) * layout.partition_size)
        for piece in layout.pieces(r):
            assert start <= piece.flat_start and piece.flat_start + piece.length <= end
            assert piece.local_start == piece.flat_start - start
            covered[piece.flat_start : piece.flat_start + piece.length] += 1
    for seg in layout.segments:
        assert bool((covered[seg.offset : seg.end] == 1).all()), f"{seg.name} not covered exactly once"
    assert int(covered.sum()) == sum(s.numel for s in layout.segments)


@given(shapes=shape_lists, world=st.integers(1, 4), dtype=st.sampled_from((torch.float32, torch.bfloat16)))
def test_R8_flatten_shard_gather_round_trip(reference_api, shapes, world, dtype):
    """R8: flatten puts every tensor at its segment with zero padding, a missing tensor (R7) is zeros, the
    shards gathered in rank order give the flat buffer back, and unflatten returns the tensors."""
    api = reference_api
    layout = api.build_layout([(f"p{i}", s) for i, s in enumerate(shapes)], world)
    gen = torch.Generator().manual_seed(len(shapes) * 10 + world)
    tensors = {f"p{i}": torch.randn(s, generator=gen).to(dtype) for i, s in enumerate(shapes)}
    tensors["p0"] = None
    flat = api.flatten(layout, tensors, dtype)
    mask = torch.zeros(layout.total, dtype=torch.bool)
    for seg in layout.segments:
        mask[seg.offset : seg.end] = True
    assert not bool(flat[~mask].any()), "padding must be zero"
    views = api.unflatten(layout, flat)
    assert not bool(views["p0"].any()), "a missing tensor must flatten to zeros"
    for name, t in tensors.items():
        if t is not None:
            assert_tensor_equal(views[name], t, f"unflatten {name}")
    shards = [api.shard(layout, flat, r) for r in range(world)]
    assert_tensor_equal(api.gather(layout, shards), flat, "gathered shards")


def test_R8_layout_rejects_bad_arguments(reference_api):
    """R8: a world size or rank outside the allowed range is a ConfigurationError naming it."""
    api = reference_api
    with pytest.raises(ConfigurationError) as info:
        api.build_layout([("a", (2,))], 0)
    assert_names_argument(info.value, "world_size")
    layout = api.build_layout([("a", (2,))], 2)
    with pytest.raises(ConfigurationError) as info:
        layout.partition_range(2)
    assert_names_argument(info.value, "rank", "2")
