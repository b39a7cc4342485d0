"""The collectives of the model, written as the arithmetic they perform (R9, R10, R24).

A real all-reduce leaves the summation order to the transport (ring, tree, NCCL's channel layout). The
reference has to pick one so that its result is a single well-defined value: every rank's contribution is
divided by the world size first (averaging before the sum keeps bf16/fp32 sums of large gradients from
overflowing, and is where DeepSpeed places it), then the quotients are added left to right in rank order. For
two ranks the order cannot matter (IEEE addition is commutative); from three ranks on it can, which is why
other implementations are compared with a tolerance there (R24/R25).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference.contract.errors import ConfigurationError


def average_across_ranks(contributions: Sequence[torch.Tensor], order: Sequence[int] | None = None) -> torch.Tensor:
    """All-reduce-mean of equally shaped tensors: ``sum over r in order of (x_r / world_size)``, in their
    dtype.

    ``order`` (a permutation of the ranks, default rank order) exists so that the suite can show the W=2
    order-independence property and the W>=3 order dependence on the same function.
    """
    world = len(contributions)
    if world == 0:
        raise ConfigurationError("contributions is empty; allowed: one tensor per rank (at least one)")
    order = list(range(world)) if order is None else list(order)
    if sorted(order) != list(range(world)):
        raise ConfigurationError(f"order={order!r} must be a permutation of range({world})")
    first = contributions[0]
    for r, t in enumerate(contributions):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigurationError(
                f"contributions[{r}] has shape {tuple(t.shape)} dtype {t.dtype}; "
                f"rank 0 has shape {tuple(first.shape)} dtype {first.dtype}"
            )
    total = torch.div(contributions[order[0]], world)
    for r in order[1:]:
        total = torch.add(total, torch.div(contributions[r], world))
    return total
