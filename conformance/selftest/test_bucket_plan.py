"""hostoffload's gradient buckets (`optimized.accumulation.buckets.plan_buckets`): how the flat gradient is cut.

Where a bucket ends changes no value (R10 adds per element, in rank order, whatever the bucket), so the suite's
traces cannot see the cut; what it changes is memory and overlap: a bucket is the unit of a reduce-scatter, of a
gradient buffer's lifetime and of a host update. The rule ``bucket_elements`` promises DeepSpeed users is greedy:
walking the parameters in reverse flat order (the order backward produces them), a bucket closes with the first
parameter that brings it to ``bucket_elements``. This checks hostoffload's own planner against that rule, on the
CPU; it judges no implementation.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from optimized.accumulation.buckets import plan_buckets
from reference.contract.accumulation_partition import build_layout

pytestmark = pytest.mark.conformance_area("harness")


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), bucket=st.integers(1, 100),
       world=st.integers(1, 3))
# sums that land exactly on bucket_elements (a bucket closes there, not one parameter later), and one just short
@example(sizes=[1, 1], bucket=1, world=1)
@example(sizes=[3, 2, 5, 4, 1], bucket=5, world=2)
@example(sizes=[2, 2, 2, 2, 2, 2], bucket=4, world=3)
@example(sizes=[7, 1, 1, 1], bucket=3, world=1)
@example(sizes=[1, 1, 1, 1], bucket=2, world=1)
def test_buckets_tile_the_flat_buffer_and_close_greedily(sizes, bucket, world):
    """The buckets tile ``[0, total)`` in flat order, each names the parameters inside it, indices are their
    positions, each rank's split is its share of the bucket, and in backward order each bucket but the first one
    backward fills (the lowest offsets) closed exactly when it reached ``bucket_elements``."""
    layout = build_layout([(f"p{i}", (n,)) for i, n in enumerate(sizes)], world)
    buckets = plan_buckets(layout, bucket)
    assert buckets[0].start == 0 and buckets[-1].end == layout.total
    assert all(a.end == b.start for a, b in itertools.pairwise(buckets)), "gaps or overlaps"
    assert [b.index for b in buckets] == list(range(len(buckets)))
    numel = {s.name: s.numel for s in layout.segments}
    offset = {s.name: s.offset for s in layout.segments}
    for b in buckets:
        assert all(b.start <= offset[n] < b.end for n in b.names), f"a parameter outside its bucket: {b}"
        assert sum(b.splits) == b.end - b.start and len(b.splits) == world, b
    # Backward order: the highest offsets first. No bucket could have closed before its last parameter (in that
    # order); each but the lowest (what is left when backward ends) closed with it.
    for b in reversed(buckets):
        in_backward_order = sorted(b.names, key=lambda n: -offset[n])
        before_last = sum(numel[n] for n in in_backward_order[:-1])
        closes = before_last + numel[in_backward_order[-1]]
        assert before_last < bucket, f"bucket {b.index} held {before_last} elements before its last parameter"
        assert b.index == 0 or closes >= bucket, (
            f"bucket {b.index} ({[numel[n] for n in in_backward_order]} elements in backward order) closed before "
            f"it reached {bucket}")


def test_one_bucket_per_parameter_and_one_for_all():
    """``bucket_elements`` 1 puts every parameter in a bucket of its own; one larger than the model puts all of
    them in one."""
    layout = build_layout([("a", (3,)), ("b", (5,)), ("c", (2,))], 1)
    assert [b.names for b in plan_buckets(layout, 1)] == [("a",), ("b",), ("c",)]
    assert [sorted(b.names) for b in plan_buckets(layout, 10**9)] == [["a", "b", "c"]]


def test_a_bucket_launches_at_its_last_gradient_and_is_consumed_once():
    """Within a backward a bucket says "launch" exactly at its last parameter's gradient (so its reduce-scatter
    overlaps the rest of backward), and its reduced slice can be taken once."""
    from optimized.accumulation.buckets import Bucket

    b = Bucket(0, 6, ("a", "b", "c"), [6], index=0)
    b.reset()
    assert [b.gradient_arrived() for _ in range(3)] == [False, False, True]
    b.reset()
    assert b.gradient_arrived() is False, "reset did not restore the count"
    with pytest.raises(RuntimeError, match="no reduce-scatter in flight"):
        b.take_reduced()
