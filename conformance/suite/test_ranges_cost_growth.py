"""Cost-growth property of the range registry, through its public ``RangeRegistry`` (conformance.areas.cost_growth
explains the method): lookups (hit and miss) and removal at 10 vs 100 000 live ranges, as a ratio with a generous
bound. The pinning API's lookups are in test_pinning_cost_growth, the io handle's check in test_io_cost_growth."""

from __future__ import annotations

import random

import pytest

from conformance.areas.cost_growth import (
    LARGE,
    MAX_RATIO,
    SMALL,
    STRIDE,
    growth_message,
    per_call_seconds,
    per_op_seconds,
)

pytestmark = pytest.mark.conformance_area("ranges")

_PROBES = 2000


def _fill(registry, base: int, n: int) -> list[int]:
    starts = [base + i * STRIDE for i in range(n)]
    for s in starts:  # ascending: cheap for any sorted structure
        registry.add(s, STRIDE // 2)
    return starts


def _measure_registry(registry_cls, n: int, seed: int) -> dict[str, float]:
    registry = registry_cls()
    base = 1 << 40
    starts = _fill(registry, base, n)
    rng = random.Random(seed)
    hits = [s + rng.randrange(STRIDE // 2 - 64) for s in rng.choices(starts, k=_PROBES)]
    misses = [s + STRIDE // 2 + rng.randrange(STRIDE // 2 - 64) for s in rng.choices(starts, k=_PROBES)]
    out = {
        "contains (hit)": per_op_seconds(lambda p: registry.contains(p, 64), hits),
        "contains (miss)": per_op_seconds(lambda p: registry.contains(p, 64), misses),
        "find (hit)": per_op_seconds(registry.find, hits),
    }
    victims = rng.sample(starts, k=min(200, n))

    def setup(s: int) -> int:
        if not registry.contains(s, 1):
            registry.add(s, STRIDE // 2)
        return s

    out["remove"] = per_call_seconds(setup, registry.remove, victims * max(1, 200 // len(victims)))
    return out


def test_registry_lookup_and_remove_cost_is_logarithmic(area_api):
    """contains (hit and miss), find and remove cost about the same with 100 000 live ranges as with 10."""
    small = _measure_registry(area_api.RangeRegistry, SMALL, 1)
    large = _measure_registry(area_api.RangeRegistry, LARGE, 2)
    ratios = {op: large[op] / small[op] for op in small}
    slow = {op: r for op, r in ratios.items() if r > MAX_RATIO}
    assert not slow, "; ".join(growth_message(f"RangeRegistry.{op}", small[op], large[op]) for op in slow)
