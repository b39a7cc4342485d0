"""hostoffload's middle-backward adds on the host (issue 49 item 4), on host tensors.

On a CUDA device a middle backward of a managed accumulation sends its reduced gradient down at the comm dtype's
width and `optimized.accumulation.update_paths.host_sums.HostRunningSum` adds it into the pinned host accumulator
on a thread of its own. The engine tests run that path only on the GPU box; what it computes (R10's
``acc + red.to(accum_dtype)``, bitwise, after widening a packed first backward) and what it waits for (nothing is
read before the D2H says it landed; a reader waits for the add) are plain host code, so they are held here on the
CPU, where CI runs. This checks hostoffload's own code, not an implementation under judgment.
"""

from __future__ import annotations

import threading

import pytest
import torch

from optimized.accumulation.update_paths.gradient_stream import packed_view, widen_packed
from optimized.accumulation.update_paths.host_sums import HostRunningSum
from optimized.accumulation.update_paths.timings import UpdateTimings

pytestmark = pytest.mark.conformance_area("harness")

#: (comm dtype, accumulation dtype): bf16 into fp32 (the conversion exact), fp32 into bf16 (R10 converts first:
#: two roundings, which a direct mixed add would not make), the same dtype
PAIRS = ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _values(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so additions round (and fp32 -> bf16 conversions round before adding)
    return (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())).to(dtype)


@pytest.mark.parametrize(("comm", "accum"), PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_add_is_R10_bitwise(comm, accum):
    """Each queued add makes ``accumulator[lo:hi]`` exactly R10's ``acc + red.to(accum)`` and touches nothing else."""
    n = 64
    acc = _values(n, 1, accum)
    expected = acc.clone()
    landing = torch.empty(n, dtype=comm)
    adder = HostRunningSum(landing, accum, buckets=3, timings=UpdateTimings(torch.device("cpu")))
    try:
        for index, (lo, hi) in enumerate(((0, 20), (20, 21), (40, 64))):
            red = _values(hi - lo, 10 + index, comm)
            landing[lo:hi] = red
            adder.add(index, acc, lo, hi, lambda: None, None)
            expected[lo:hi] = expected[lo:hi] + red.to(accum)
        adder.wait_all()
    finally:
        adder.close()
    assert torch.equal(_bits(acc), _bits(expected))


def test_widen_then_add_is_zero_plus_red1_plus_red2():
    """After a packed first backward the bucket holds ``red_1`` in its first bytes; the middle backward's add
    widens it (``0 + red_1``) and adds ``red_2``: R10's order, bitwise, and the neighbouring bucket is untouched."""
    n, lo, hi = 32, 8, 24
    acc = _values(n, 2, torch.float32)
    outside = torch.cat([acc[:lo], acc[hi:]]).clone()
    red1, red2 = _values(hi - lo, 3, torch.bfloat16), _values(hi - lo, 4, torch.bfloat16)
    packed_view(acc, lo, hi, torch.bfloat16).copy_(red1)
    landing = torch.zeros(n, dtype=torch.bfloat16)
    landing[lo:hi] = red2
    adder = HostRunningSum(landing, torch.float32, buckets=1, timings=UpdateTimings(torch.device("cpu")))
    try:
        adder.add(0, acc, lo, hi, lambda: None, lambda: widen_packed(acc, lo, hi, torch.bfloat16))
        adder.wait(0)
    finally:
        adder.close()
    expected = (torch.zeros(hi - lo) + red1.float()) + red2.float()
    assert torch.equal(_bits(acc[lo:hi]), _bits(expected))
    assert torch.equal(_bits(torch.cat([acc[:lo], acc[hi:]])), _bits(outside))


def test_add_waits_for_the_landing_and_readers_wait_for_the_add():
    """Asynchrony, provable here: ``add`` returns before anything is added; nothing is read before ``landed()``
    returns (the D2H's event on a device); ``wait`` blocks until the add has run."""
    n = 16
    acc = torch.zeros(n)
    landing = torch.ones(n, dtype=torch.bfloat16)
    landed, entered = threading.Event(), threading.Event()

    def slow_landing() -> None:
        entered.set()
        assert landed.wait(10), "the test never let the landing finish"

    adder = HostRunningSum(landing, torch.float32, buckets=1, timings=UpdateTimings(torch.device("cpu")))
    try:
        adder.add(0, acc, 0, n, slow_landing, None)
        assert entered.wait(10), "the add never started waiting for its landing"
        assert torch.count_nonzero(acc) == 0, "the add read the landing buffer before it landed"
        waiter_done = threading.Event()
        waiter = threading.Thread(target=lambda: (adder.wait(0), waiter_done.set()))
        waiter.start()
        assert not waiter_done.wait(0.2), "wait() returned before the add ran"
        landed.set()
        waiter.join(10)
        assert waiter_done.is_set() and torch.equal(acc, torch.ones(n)), "wait() returned without the add"
    finally:
        landed.set()
        adder.close()


def test_an_add_that_fails_is_raised_by_the_wait_and_close_does_not_raise():
    """A failed add (here its landing fails) reaches the reader that waits for it; ``close`` (destroy's) never
    raises."""
    adder = HostRunningSum(torch.zeros(4, dtype=torch.bfloat16), torch.float32, buckets=2,
                           timings=UpdateTimings(torch.device("cpu")))

    def broken() -> None:
        raise RuntimeError("the D2H failed")

    adder.add(1, torch.zeros(4), 0, 4, broken, None)
    with pytest.raises(RuntimeError, match="the D2H failed"):
        adder.wait_all()
    adder.close()


def test_close_lets_the_add_in_flight_finish_and_stops_the_thread():
    """``close`` (from the engine's destroy, which unpins the accumulator next) returns only once the add in
    flight has written, and leaves no thread behind."""
    n = 8
    acc = torch.zeros(n)
    release = threading.Timer(0.3, lambda: None)
    adder = HostRunningSum(torch.ones(n, dtype=torch.bfloat16), torch.float32, buckets=1,
                           timings=UpdateTimings(torch.device("cpu")))
    release.start()
    adder.add(0, acc, 0, n, release.join, None)
    adder.close()
    assert torch.equal(acc, torch.ones(n)), "close() returned before the add in flight wrote"
    assert not [t for t in threading.enumerate() if t.name.startswith("hostoffload-running-sum")], (
        "close() left the adding thread running")
