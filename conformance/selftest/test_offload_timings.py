"""hostoffload's own report of what its host update moved (``offload_timings()["cpu_adam_bytes"]``, issue 49 item
3): the bytes the timeline divides by the CPU Adam's seconds to print its GB/s beside the kernel's own.

A wrong count would print a wrong bandwidth and send the search for the missing 40 % the wrong way, and no
conformance test reads a benchmark report. One boundary of a host-offloaded engine on the CPU must count exactly
the one-pass bytes of every element of the partition: 30 per element with an fp32 gradient sum, fp32 moments and
the bf16 copy, 28 with a bf16 sum (read at 2 bytes), 22 with bf16 moments.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.harness.rank_pool import RankFailure, get_pool

pytestmark = pytest.mark.conformance_area("harness")


def _one_boundary(group, changes: dict) -> tuple[float, int]:
    from optimized.accumulation import ZeroEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    config = {"zero_stage": 2, "offload_optimizer": "cpu", "optimizer": {"type": "adamw"}, "dtype": "bf16",
              **changes}
    engine = ZeroEngine(model, config, process_group=group, device="cpu")
    try:
        engine.offload_timings()  # from here on, what one boundary moves
        loss = engine(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean()
        engine.backward(loss)
        engine.step()
        timings = engine.offload_timings()
        return timings["cpu_adam_bytes"], engine.layout.partition_size
    finally:
        engine.destroy()


@pytest.mark.parametrize(("changes", "per_element"), [
    ({"grad_accum_dtype": "fp32"}, 30),
    ({"grad_accum_dtype": "bf16"}, 28),
    ({"grad_accum_dtype": "fp32", "state_precision": "bf16"}, 22),
])
def test_one_boundary_counts_the_one_pass_bytes_of_the_partition(changes, per_element):
    out = get_pool(1, "gloo", timeout_s=120).run(_one_boundary, 1, (changes,), grace_s=10)[0]
    assert not isinstance(out, RankFailure), out
    moved, elements = out
    assert moved == per_element * elements, f"{moved} bytes for {elements} elements; expected {per_element} each"
