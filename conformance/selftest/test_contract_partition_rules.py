"""R8's flat layout (reference/contract/accumulation_partition.py), held to figures from the rule's text: every
engine lays out its buffers through it, so the conformance comparisons cannot see a slip in it."""

from __future__ import annotations

import pytest

from reference.contract.accumulation_partition import FLAT_ALIGNMENT, build_layout
from reference.contract.errors import ConfigurationError

pytestmark = pytest.mark.conformance_area("harness")


def test_R8_offsets_padding_and_partitions_in_figures():
    """Each parameter starts at a multiple of 4 elements, the total is padded to a multiple of 4 x W, rank r owns
    ``[r P, (r + 1) P)``; a piece is the part of a parameter inside a partition."""
    assert FLAT_ALIGNMENT == 4
    layout = build_layout([("a", (3,)), ("b", (5,)), ("c", (2, 2))], 2)
    assert [(s.name, s.offset, s.numel, s.shape) for s in layout.segments] == [
        ("a", 0, 3, (3,)), ("b", 4, 5, (5,)), ("c", 12, 4, (2, 2))]
    assert layout.total == 16 and layout.partition_size == 8
    assert layout.partition_range(0) == (0, 8) and layout.partition_range(1) == (8, 16)
    assert [(p.name, p.flat_start, p.param_start, p.local_start, p.length) for p in layout.pieces(0)] == [
        ("a", 0, 0, 0, 3), ("b", 4, 0, 4, 4)]
    assert [(p.name, p.flat_start, p.param_start, p.local_start, p.length) for p in layout.pieces(1)] == [
        ("b", 8, 4, 0, 1), ("c", 12, 0, 4, 4)]
    three = build_layout([("a", (1,))], 3)
    assert three.total == 12 and three.partition_size == 4  # padded to 4 x W


@pytest.mark.parametrize("rank", [-1, 2, 1.0, "0"])
def test_a_rank_outside_the_world_is_refused(rank):
    layout = build_layout([("a", (3,))], 2)
    with pytest.raises(ConfigurationError, match="rank"):
        layout.partition_range(rank)
