"""Cost growth of the pinning API's lookups, ``is_pinned`` and ``unpin``, measured through the public calls alone
(conformance.areas.cost_growth explains the method): the other live ranges are buffers pinned with ``pin_empty``
(:class:`conformance.areas.cost_growth.PinnedBuffers`), so an implementation that keeps its table to itself is measured
exactly like one that exposes a registry. The per-operation time with the profile's fill of live buffers over the
time with 10 must stay within :data:`conformance.areas.cost_growth.MAX_PUBLIC_RATIO`: an O(log n) lookup does, a scan of
the live buffers does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conformance.areas.cost_growth import (
    MAX_PUBLIC_RATIO,
    MIN_PUBLIC_LARGE,
    SMALL,
    PinnedBuffers,
    best_again,
    growth_message,
    per_call_seconds,
    per_op_seconds,
    public_large,
)
from conformance.harness.profiles import current_profile
from reference.contract.envvars import PIN_BACKEND_ENV, PIN_REGISTER_DEVICE_ENV

pytestmark = pytest.mark.conformance_area("pinning")


@pytest.fixture
def buffers(area_api, monkeypatch):
    """Live buffers from the native backend, without device registration (the property is about the lookup, not
    the accelerator's hook); every one is unpinned and dropped after the test."""
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    monkeypatch.setenv(PIN_REGISTER_DEVICE_ENV, "0")
    with PinnedBuffers(area_api) as fill:
        yield fill


def _check_growth(ops: dict[str, Callable[[], float]], buffers: PinnedBuffers) -> None:
    """Times each op with 10 live buffers, then with :data:`MIN_PUBLIC_LARGE` and with the profile's fill; fails
    at the first size where an op's ratio is over the bound twice (conformance.areas.cost_growth.best_again). A scan is
    caught at the first step already, so a slow implementation's fill (and its teardown) stays small."""
    buffers.grow_to(SMALL)
    small = {what: op() for what, op in ops.items()}
    for target in (MIN_PUBLIC_LARGE, max(MIN_PUBLIC_LARGE, public_large(current_profile()))):
        n = buffers.grow_to(target)
        assert n >= MIN_PUBLIC_LARGE, (
            f"only {n} buffers could be pinned through pin_empty (stopped by {buffers.stopped_by}); the cost "
            f"growth of the lookups needs at least {MIN_PUBLIC_LARGE} live ones to be measured"
        )
        large = {what: best_again(op, op(), small[what], MAX_PUBLIC_RATIO) for what, op in ops.items()}
        slow = [what for what in ops if large[what] / small[what] > MAX_PUBLIC_RATIO]
        assert not slow, "; ".join(
            growth_message(what, small[what], large[what], MAX_PUBLIC_RATIO, large_n=n) for what in slow
        )
        if n < target:  # the fill stopped early (budget or locked-memory limit): this was its largest size
            return


@pytest.mark.requires(pin_backends="native")
def test_is_pinned_cost_is_logarithmic_in_live_buffers(area_api, buffers):
    """is_pinned of a pinned buffer (hit) and of a pageable one (miss) costs about the same with thousands of
    other live pinned buffers as with 10."""
    pinned = area_api.pin_empty(4096, dtype=torch.uint8)
    pageable = torch.empty(4096, dtype=torch.uint8)
    views = [pinned[i : i + 64] for i in range(0, 4096, 64)]
    pageable_views = [pageable[i : i + 64] for i in range(0, 4096, 64)]
    keys = list(range(len(views))) * 10

    def timed(probe: list[torch.Tensor], expected: bool) -> Callable[[], float]:
        def op() -> float:
            answers = {area_api.is_pinned(v) for v in probe}
            assert answers == {expected}, f"is_pinned answered {answers} for views that are all {expected}"
            return per_op_seconds(lambda k: area_api.is_pinned(probe[k]), keys)

        return op

    try:
        _check_growth({"is_pinned (hit)": timed(views, True), "is_pinned (miss)": timed(pageable_views, False)},
                      buffers)
    finally:
        views.clear()
        area_api.unpin(pinned)


@pytest.mark.requires(pin_backends="native")
def test_unpin_cost_is_logarithmic_in_live_buffers(area_api, buffers):
    """unpin costs about the same with thousands of other live pinned buffers as with 10: of a pinned buffer
    (True: the allocation is found by address, unlocked and its range dropped) and of pageable memory (False: a
    miss). Each timed call unpins a fresh one-page buffer; only the unpin is timed."""
    pageable = torch.empty(4096, dtype=torch.uint8)
    outcomes: list[bool] = []

    def fresh(_key: int) -> torch.Tensor:
        return area_api.pin_empty(4096, dtype=torch.uint8)

    def unpin(t: torch.Tensor) -> None:
        outcomes.append(area_api.unpin(t))

    def timed(op: Callable[[], float], expected: bool) -> Callable[[], float]:
        def run() -> float:
            took = op()
            assert outcomes and set(outcomes) == {expected}, f"unpin answered {set(outcomes)}, not {expected}"
            outcomes.clear()
            return took

        return run

    _check_growth(
        {
            "unpin (pinned buffer)": timed(lambda: per_call_seconds(fresh, unpin, list(range(300))), True),
            "unpin (pageable memory)": timed(
                lambda: per_op_seconds(lambda _k: outcomes.append(area_api.unpin(pageable)), list(range(640))), False
            ),
        },
        buffers,
    )
