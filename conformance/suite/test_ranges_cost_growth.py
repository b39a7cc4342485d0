"""Cost-growth properties of the range registry and of the pinning API's lookups, ``is_pinned`` and ``unpin``
(conformance.cost_growth explains the method): lookups (hit and miss) and removal at 10 vs 100 000 live ranges, as a
ratio with a generous bound. The io handle's check is in test_io_cost_growth."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.cost_growth import (
    LARGE,
    MAX_RATIO,
    SMALL,
    STRIDE,
    SyntheticRanges,
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


@pytest.fixture
def pinning(impl, accelerator, native_pinning):
    """The implementation's pinning area, on the native backend without device registration (``native_pinning``:
    the property is about the lookup, not the accelerator's hook)."""
    return impl.load("pinning")


@pytest.mark.requires(pin_backends="native", areas=("pinning",))
def test_is_pinned_cost_is_logarithmic_in_live_ranges(area_api, pinning):
    """is_pinned of a pinned buffer (hit) and of a pageable one (miss) costs about the same with 100 000 other
    live ranges in the process-wide registry as with 10 (conformance.cost_growth.SyntheticRanges)."""
    pinned = pinning.pin_empty(4096, dtype=torch.uint8)
    pageable = torch.empty(4096, dtype=torch.uint8)
    views = [pinned[i : i + 64] for i in range(0, 4096, 64)]
    pageable_views = [pageable[i : i + 64] for i in range(0, 4096, 64)]
    results: dict[int, tuple[float, float]] = {}
    try:
        with SyntheticRanges(area_api.global_registry()) as ranges:
            for n in (SMALL, LARGE):
                ranges.grow_to(n)
                assert all(pinning.is_pinned(v) for v in views)
                assert not any(pinning.is_pinned(v) for v in pageable_views)
                hit = per_op_seconds(lambda k: pinning.is_pinned(views[k]), list(range(len(views))) * 10)
                miss = per_op_seconds(lambda k: pinning.is_pinned(pageable_views[k]), list(range(len(views))) * 10)
                results[n] = (hit, miss)
    finally:
        views.clear()
        pinning.unpin(pinned)
    for k, what in ((0, "is_pinned (hit)"), (1, "is_pinned (miss)")):
        small, large = results[SMALL][k], results[LARGE][k]
        assert large / small <= MAX_RATIO, growth_message(what, small, large)


@pytest.mark.requires(pin_backends="native", areas=("pinning",))
def test_unpin_cost_is_logarithmic_in_live_ranges(area_api, pinning):
    """unpin through the pinning API costs about the same with 100 000 other live ranges as with 10: of a pinned
    buffer (True: the allocation is found by address, unlocked and its range dropped) and of pageable memory
    (False: a miss). Each timed call unpins a fresh one-page buffer; only the unpin is timed."""
    pageable = torch.empty(4096, dtype=torch.uint8)
    outcomes: list[bool] = []

    def fresh(_key: int) -> torch.Tensor:
        return pinning.pin_empty(4096, dtype=torch.uint8)

    def unpin(t: torch.Tensor) -> None:
        outcomes.append(pinning.unpin(t))

    results: dict[int, tuple[float, float]] = {}
    with SyntheticRanges(area_api.global_registry()) as ranges:
        for n in (SMALL, LARGE):
            ranges.grow_to(n)
            hit = per_call_seconds(fresh, unpin, list(range(300)))
            assert outcomes and all(o is True for o in outcomes), f"unpin of a pinned buffer answered {set(outcomes)}"
            outcomes.clear()
            miss = per_op_seconds(lambda _k: outcomes.append(pinning.unpin(pageable)), list(range(640)))
            assert outcomes and not any(outcomes), "unpin of pageable memory answered True"
            outcomes.clear()
            results[n] = (hit, miss)
    for k, what in ((0, "unpin (pinned buffer)"), (1, "unpin (pageable memory)")):
        small, large = results[SMALL][k], results[LARGE][k]
        assert large / small <= MAX_RATIO, growth_message(what, small, large)
