"""``gpu_memory_limit`` (docs/accumulation.md R28): a limit on an engine's whole peak device memory, which
``gpu_share: "auto"`` fits the split into by itself -- the area's contract.

``gpu_memory_budget`` counts only the split's device side (``device_bytes_per_element`` bytes per element), so a
user who wants "at most 10 GiB" would first have to measure everything else the engine holds at its peak. With a
limit the engine measures that itself: until "auto" chooses (at the second boundary) everything is updated on the
host, and the peak device memory over those boundaries -- read from the accelerator's counter
(:meth:`Accelerator.peak_memory_allocated`, restarted when the engine is built) -- is the engine's *floor*, what it
needs at share 0. The split is then given

    budget = limit - floor - margin,     margin = limit // LIMIT_MARGIN_DIVISOR  (2 % of the limit),

and "auto" chooses as with ``gpu_memory_budget`` (``choose_split``), so the cut's device bytes never exceed it.

**The margin.** The device side adds its ``device_bytes`` for the rest of the run, so the steady peak is the floor
plus those bytes; the margin is for what the floor's boundaries did not show: the device side's own transient
allocations at the boundary (the device step's temporaries; a gradient accumulated in bf16 is widened to fp32 for
it, 4 bytes per device element), the gradient buckets in flight, which vary from boundary to boundary with the
copy streams' timing, and the caching allocator's rounding of each block. None of these scales with the model in
a way the engine can predict before it runs, so the margin is a share of the limit: 2 %, the tolerance the issue
that asked for the limit allows the peak over it, spent here so that the measured peak lands under the limit
rather than up to 2 % over it. The counter is allocated bytes (torch's ``max_memory_allocated``), not the
allocator's reserved segments: fragmentation the allocator keeps cached is outside the limit, as in every peak
figure of docs/benchmarks.md.

**The refusal.** Where ``limit < floor + margin`` nothing fits, not even share 0: the engine raises
:class:`ConfigurationError` naming ``gpu_memory_limit``, with the measured floor and the smallest limit that would
run, from the ``step()`` of the boundary where "auto" chooses (the first moment the floor is known), before that
boundary's update. Where the engine's device has no counter (the cpu accelerator) the limit cannot be measured and
the engine refuses at construction. With several ranks each measures its own device; the largest floor decides
for all (one cut, R8's equal partitions), so every rank refuses or none does.

**Measuring on the host.** The conformance suite checks the limit on the cpu accelerator through a test device
whose counter reports what the test sets
(:class:`reference.contract.accelerators.counting.CountingHostAccelerator`), found through the same registry
(``HOSTOFFLOAD_ACCELERATOR``) as any accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.contract.accelerators import Accelerator, get_accelerator
from reference.contract.accumulation_config import AccumulationConfig
from reference.contract.errors import ConfigurationError

__all__ = [
    "LIMIT_MARGIN_DIVISOR", "FloorMeter", "MemoryLimit", "fit_limit", "floor_meter", "limit_margin",
    "smallest_limit",
]

#: The margin is ``limit // LIMIT_MARGIN_DIVISOR`` bytes: 2 % of the limit (module docstring says why).
LIMIT_MARGIN_DIVISOR = 50

_GIB = float(1 << 30)


def limit_margin(limit: int) -> int:
    """The bytes a ``limit`` keeps beside the floor and the split (2 %, rounded down)."""
    return limit // LIMIT_MARGIN_DIVISOR


def smallest_limit(floor: int) -> int:
    """The smallest limit that runs an engine whose floor is ``floor`` bytes (at share 0): the least ``L >= 1``
    with ``L - limit_margin(L) >= floor``."""
    # f(L) = L - L // k is non-decreasing; f(k*q + r) = (k-1)*q + r for 0 <= r < k, and f(k*q - 1) = f(k*q).
    k = LIMIT_MARGIN_DIVISOR
    q, r = divmod(floor, k - 1)
    return max(1, k * q - 1 if r == 0 and q > 0 else k * q + r)  # a limit is an int > 0


@dataclass(frozen=True)
class MemoryLimit:
    """How a limit was spent (``split_report()["memory_limit"]``): the ``limit_bytes`` given, the ``floor_bytes``
    measured (the largest of any rank), the ``margin_bytes`` kept and the ``budget_bytes`` left to the split
    (``limit - floor - margin``, never negative: a limit that leaves less is refused)."""

    limit_bytes: int
    floor_bytes: int
    margin_bytes: int
    budget_bytes: int

    def __post_init__(self) -> None:
        if self.margin_bytes != limit_margin(self.limit_bytes):
            raise ValueError(f"margin_bytes={self.margin_bytes} is not limit_margin({self.limit_bytes})")
        if self.budget_bytes != self.limit_bytes - self.floor_bytes - self.margin_bytes or self.budget_bytes < 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} is not limit - floor - margin (>= 0): {self}")


def fit_limit(limit: int, floor: int) -> MemoryLimit:
    """The split's budget under ``limit`` for an engine whose measured floor is ``floor`` bytes, or the refusal
    (module docstring) where the floor and the margin leave nothing."""
    margin = limit_margin(limit)
    budget = limit - floor - margin
    if budget < 0:
        need = smallest_limit(floor)
        raise ConfigurationError(
            f"gpu_memory_limit={limit} bytes ({limit / _GIB:.2f} GiB) is below what this engine needs at "
            f"gpu_share 0: its measured floor (the peak device memory from its construction to the boundary where "
            f"'auto' chooses, the largest of any rank) is {floor} bytes ({floor / _GIB:.2f} GiB), and the limit "
            f"keeps a margin of 1/{LIMIT_MARGIN_DIVISOR} of itself ({margin} bytes) beside it; the smallest limit "
            f"that runs is {need} bytes ({need / _GIB:.2f} GiB); allowed: gpu_memory_limit >= {need}, or leave "
            f"gpu_memory_limit out"
        )
    return MemoryLimit(limit_bytes=limit, floor_bytes=floor, margin_bytes=margin, budget_bytes=budget)


class FloorMeter:
    """The peak device memory of one engine's device from its construction (the meter restarts the counter)
    until :meth:`floor` is read, through the accelerator that ``HOSTOFFLOAD_ACCELERATOR`` names (else the
    default one), which must be the engine device's and keep a counter."""

    def __init__(self, accelerator: Accelerator, device: torch.device) -> None:
        self._accelerator = accelerator
        self._index = device.index
        accelerator.reset_peak_memory(self._index)

    def floor(self) -> int:
        """The peak since construction, in bytes (read before the measurement of "auto" allocates anything)."""
        peak = self._accelerator.peak_memory_allocated(self._index)
        if type(peak) is not int or peak < 0:
            raise RuntimeError(
                f"accelerator {self._accelerator.name!r} reported peak_memory_allocated()={peak!r} after it had "
                f"a counter; it must be an int >= 0"
            )
        return peak


def floor_meter(config: AccumulationConfig, device: torch.device) -> FloorMeter | None:
    """A started :class:`FloorMeter` for an engine on ``device`` where ``config`` sets ``gpu_memory_limit``
    (None without one); the refusal where nothing counts that device's memory."""
    limit = config.gpu_memory_limit
    if limit is None:
        return None
    accelerator = get_accelerator()
    counted = accelerator.device_type == device.type and accelerator.peak_memory_allocated(device.index) is not None
    if not counted:
        raise ConfigurationError(
            f"gpu_memory_limit={limit} needs the peak device memory of this engine's device ({device}) to measure "
            f"its floor, and the accelerator {accelerator.name!r} (device type {accelerator.device_type!r}) keeps "
            f"no such counter for it (peak_memory_allocated() is None or another device type); allowed: an engine "
            f"on an accelerator that counts its memory (cuda), or gpu_memory_budget (the split's bytes alone) "
            f"instead of gpu_memory_limit"
        )
    return FloorMeter(accelerator, device)
