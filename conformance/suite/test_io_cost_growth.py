"""Cost growth of the io handle's pinned check: every request decides "direct or bounce" by asking whether the
tensor's extent lies in one live range of the process-wide registry (docs/io.md), and that check must not grow
with the number of live ranges (the contract's O(log n), docs/native.md).

The handle is observed from outside, through whole requests: a read or write of a small record, into or from a
pinned buffer (direct) and pageable memory (bounced), with 10 and with 100 000 other live ranges
(:class:`conformance.cost_growth.SyntheticRanges`). A request's own work does not depend on the ranges, so the
ratio of the two per-request times stays near 1 for an O(log n) check; the bound is
:data:`conformance.cost_growth.MAX_REQUEST_RATIO`. Each request is waited before the next, so an asynchronous
handle is timed over its whole path (submission, the worker that decides, the file call).

What this cannot see: a scan of the ranges cheap enough to vanish under a request's own cost (a vectorised native
loop over 100 000 ranges takes tens of microseconds, less than a request). Any scan that visits the ranges one
Python object at a time, or chases 100 000 pointers, costs several times a request and is caught.
"""

from __future__ import annotations

import pytest
import torch

from conformance.cost_growth import LARGE, MAX_REQUEST_RATIO, SMALL, SyntheticRanges, growth_message, per_op_seconds
from reference.contract.envvars import PIN_BACKEND_ENV

pytestmark = pytest.mark.conformance_area("io")

_PAYLOAD = 1024
_REQUESTS = 200


@pytest.mark.requires(pin_backends="native", areas=("pinning", "ranges"))
def test_direct_decision_cost_is_logarithmic_in_live_ranges(impl, area_api, accelerator, monkeypatch, tmp_path):
    monkeypatch.setenv(PIN_BACKEND_ENV, "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")
    pinning, registry = impl.load("pinning"), impl.load("ranges").global_registry()
    pinned = pinning.pin_empty(_PAYLOAD, dtype=torch.uint8)
    pageable = torch.zeros(_PAYLOAD, dtype=torch.uint8)
    pinned.copy_(torch.arange(_PAYLOAD, dtype=torch.int64).remainder(251).to(torch.uint8))
    path = str(tmp_path / "record.bin")
    results: dict[int, dict[str, float]] = {}
    try:
        with area_api.SwapHandle(block_size=4096, use_o_direct=False) as h, SyntheticRanges(registry) as ranges:
            h.write(pinned, path).wait()
            for n in (SMALL, LARGE):
                ranges.grow_to(n)
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
    slow = {
        what: (results[SMALL][what], results[LARGE][what])
        for what in results[SMALL]
        if results[LARGE][what] / results[SMALL][what] > MAX_REQUEST_RATIO
    }
    assert not slow, "; ".join(
        growth_message(f"SwapHandle {what}", small, large, MAX_REQUEST_RATIO) for what, (small, large) in slow.items()
    )
