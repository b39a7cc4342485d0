"""Cost growth of the io handle's pinned check: every request decides "direct or bounce" by asking whether the
tensor's extent lies in one live range of the process-wide registry (docs/io.md), and that check must not grow
with the number of live ranges (the contract's O(log n), docs/native.md).

The handle is observed from outside, through whole requests: a read or write of a small record, into or from a
pinned buffer (direct) and pageable memory (bounced), with 10 and with thousands of other live pinned buffers,
made through the pinning area's public ``pin_empty`` (:class:`conformance.areas.cost_growth.PinnedBuffers`: nothing is
written into an implementation's registry, so one that keeps its table to itself is measured too).
A request's own work does not depend on the ranges, so the
ratio of the two per-request times stays near 1 for an O(log n) check; the bound is
:data:`conformance.areas.cost_growth.MAX_REQUEST_RATIO`. Each request is waited before the next, so an asynchronous
handle is timed over its whole path (submission, the worker that decides, the file call).

What this cannot see: a scan of the ranges cheap enough to vanish under a request's own cost (a vectorised native
loop over thousands of ranges takes microseconds, less than a request). A scan that visits the ranges one Python
object at a time costs several times a request and is caught.
"""

from __future__ import annotations

import pytest
import torch

from conformance.areas.cost_growth import (
    MAX_REQUEST_RATIO,
    MIN_PUBLIC_LARGE,
    SMALL,
    PinnedBuffers,
    growth_message,
    per_op_seconds,
    public_large,
)
from conformance.harness.profiles import current_profile
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")

_PAYLOAD = 1024
_REQUESTS = 200


@pytest.mark.requires(pin_backends="native", areas=("pinning",))
def test_direct_decision_cost_is_logarithmic_in_live_ranges(impl, area_api, accelerator, monkeypatch, tmp_path):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")
    pinning = impl.load("pinning")
    pinned = pinning.pin_empty(_PAYLOAD, dtype=torch.uint8)
    pageable = torch.zeros(_PAYLOAD, dtype=torch.uint8)
    pinned.copy_(torch.arange(_PAYLOAD, dtype=torch.int64).remainder(251).to(torch.uint8))
    path = str(tmp_path / "record.bin")
    results: dict[int, dict[str, float]] = {}
    sizes: dict[int, int] = {}
    try:
        with area_api.SwapHandle(block_size=4096, use_o_direct=False) as h, PinnedBuffers(pinning) as fill:
            h.write(pinned, path).wait()
            for n in (SMALL, public_large(current_profile())):
                got = fill.grow_to(n)
                assert n == SMALL or got >= MIN_PUBLIC_LARGE, (
                    f"only {got} buffers could be pinned through pin_empty (stopped by {fill.stopped_by})"
                )
                sizes[n] = got
                # The decision itself, once per size: pinned is direct, pageable is bounced, the bytes arrive.
                pageable.zero_()
                assert h.read(pinned, path).wait() is not None and h.read(pageable, path).wait() is not None
                assert torch.equal(pageable, pinned), "a bounced read returned other bytes than were written"
                decided = (h.read(pinned, path), h.read(pageable, path))
                for req in decided:
                    req.wait()
                assert [r.direct for r in decided] == [True, False], (
                    f"with {n} live ranges: read into a pinned buffer direct={decided[0].direct}, into pageable "
                    f"memory direct={decided[1].direct}"
                )
                keys = list(range(_REQUESTS))
                results[n] = {
                    "read into a pinned buffer (direct)": per_op_seconds(lambda _k: h.read(pinned, path).wait(), keys),
                    "read into pageable memory (bounced)": per_op_seconds(
                        lambda _k: h.read(pageable, path).wait(), keys
                    ),
                    "write of a pinned buffer (direct)": per_op_seconds(lambda _k: h.write(pinned, path).wait(), keys),
                    "write of pageable memory (bounced)": per_op_seconds(
                        lambda _k: h.write(pageable, path).wait(), keys
                    ),
                }
    finally:
        pinning.unpin(pinned)
    large_n = max(results)
    slow = {
        what: (results[SMALL][what], results[large_n][what])
        for what in results[SMALL]
        if results[large_n][what] / results[SMALL][what] > MAX_REQUEST_RATIO
    }
    assert not slow, "; ".join(
        growth_message(f"SwapHandle {what}", small, large, MAX_REQUEST_RATIO, large_n=sizes[large_n])
        for what, (small, large) in slow.items()
    )
