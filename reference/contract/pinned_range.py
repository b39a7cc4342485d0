"""The value a range registry hands out for one registered range.

Contract, not oracle: ``find()`` and ``ranges()`` of every implementation's ``RangeRegistry`` return this type,
and the conformance suite compares the two registries' answers field by field (the agreement and state-machine
tests). The registries themselves (how ranges are stored and looked up) are each implementation's own.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PinnedRange"]


class PinnedRange(NamedTuple):
    """One registered range: its first byte, its length, and an opaque owner token (an int)."""

    start: int
    nbytes: int
    owner: int
