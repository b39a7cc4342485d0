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
    edge = build_layout([("a", (4,)), ("b", (4,))], 2)  # "a" ends where rank 1's partition starts: no empty piece
    assert [(p.name, p.length) for p in edge.pieces(1)] == [("b", 4)]
    three = build_layout([("a", (1,))], 3)
    assert three.total == 12 and three.partition_size == 4  # padded to 4 x W


@pytest.mark.parametrize("rank", [-1, 2, 1.0, "0"])
def test_a_rank_outside_the_world_is_refused(rank):
    layout = build_layout([("a", (3,))], 2)
    with pytest.raises(ConfigurationError, match="rank"):
        layout.partition_range(rank)


def test_the_refusals_name_the_argument_and_the_allowed_values():
    layout = build_layout([("a", (3,))], 2)
    with pytest.raises(ConfigurationError, match=r"rank=2 must be an int in \[0, 1\]"):
        layout.partition_range(2)
    for bad in (0, -4, 1.0, "4"):
        with pytest.raises(ConfigurationError, match="alignment="):
            build_layout([("a", (3,))], 2, alignment=bad)  # type: ignore[arg-type]
    for bad in (0, 2.0):
        with pytest.raises(ConfigurationError, match="world_size="):
            build_layout([("a", (3,))], bad)  # type: ignore[arg-type]
    assert build_layout([("a", (3,)), ("b", (1,))], 1, alignment=1).total == 4  # alignment 1: no gaps


def test_the_layout_and_its_parts_are_frozen():
    """Every engine's buffers are cut by one layout for their whole life: it cannot be changed in place."""
    import dataclasses

    layout = build_layout([("a", (3,)), ("b", (5,))], 2)
    for obj, name in ((layout, "total"), (layout.segments[0], "offset"), (layout.pieces(0)[0], "length")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)
