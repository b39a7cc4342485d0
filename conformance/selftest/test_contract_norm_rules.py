"""R14/R15's contract helpers (reference/contract/accumulation_norm.py), held to figures written here: every engine
computes its norm and clipping coefficient through them, so the trace comparisons cannot see a slip in them."""

from __future__ import annotations

import math

import pytest

from reference.contract.accumulation_norm import clip_coefficient, fold_left, norm_from_total
from reference.contract.accumulation_step import CLIP_EPSILON

pytestmark = pytest.mark.conformance_area("harness")


def test_R14_sums_fold_left_from_zero_in_the_order_given():
    values = [1e16, 1.0, -1e16, 1.0]
    assert fold_left(values) == ((((0.0 + 1e16) + 1.0) - 1e16) + 1.0) == 1.0  # not math.fsum's 2.0
    assert fold_left([]) == 0.0
    assert norm_from_total(9.0) == 3.0


def test_R15_the_coefficient_and_when_there_is_none():
    """``clip / (norm + eps)`` when that is below 1; None with clipping off (0), when the norm is small enough, and
    when the quotient is exactly 1 (multiplying by 1 is no clipping)."""
    assert clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + CLIP_EPSILON)
    assert clip_coefficient(4.0, 0.0) is None
    assert clip_coefficient(0.5, 1.0) is None
    assert clip_coefficient(1.0, 1.0 + CLIP_EPSILON) is None  # (1 + eps) / (1 + eps) == 1.0 exactly
    assert math.isclose(clip_coefficient(10.0, 5.0), 0.5, rel_tol=1e-5)
