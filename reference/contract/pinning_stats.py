"""The counters ``pinned_stats()`` returns, as one type every implementation returns.

Contract, not oracle: the suite compares one implementation's ``pinned_stats()`` with what it observes of the
process (``VmLck``, the accelerator's registrations), and users print and compare the value whatever backend is
underneath. A second definition per implementation would let the fields (or their meaning) drift apart; this
NamedTuple is the vocabulary, each implementation fills it from its own bookkeeping.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PinnedStats"]


class PinnedStats(NamedTuple):
    """Counters of memory pinned by the native backend.

    ``allocations`` and ``bytes``: allocations that are pinned now and their page-rounded locked bytes.
    ``registered_bytes``: the part of ``bytes`` registered with the device. ``unpinned_alive``: allocations that
    were unpinned but are still mapped because a view references them.
    """

    allocations: int
    bytes: int
    registered_bytes: int
    unpinned_alive: int
