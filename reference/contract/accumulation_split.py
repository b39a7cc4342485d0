"""The split update (docs/accumulation.md R28): where a rank's partition is cut between the device and the host,
and how ``gpu_share: "auto"`` chooses the cut from a measurement -- the area's contract.

With ``offload_optimizer: cpu`` the whole optimizer step runs on the host, at the host's memory bandwidth (about 30
bytes of traffic per parameter per step), and only the next forward can hide it (R15 needs the global norm first).
The split keeps the fp32 master and optimizer state of the *leading* ``split_point(share, P)`` elements of each
rank's partition on the device and updates them there; the rest is updated on the host as before. The leading
elements are the first parameters in ``named_parameters()`` order -- the ones the next forward needs first -- so
the forward can start on device-updated weights while the host finishes the tail.

"auto" picks the smallest cut whose host part is hidden: the host updates ``P - d`` elements at ``host`` seconds
per element while the device updates ``d`` at ``device`` seconds per element and then does ``hide`` seconds of
work that does not need the host's result, so the host part is hidden when

    host * (P - d) <= device * d + hide,   i.e.   d >= (host * P - hide) / (host + device),

rounded up to :data:`FLAT_ALIGNMENT`, never past the budget (``budget // bytes_per_element`` elements, rounded
down) nor past P. The smallest such cut keeps the most device memory free (the reason for offloading); a budget
too small to hide the host part gives the largest cut it allows. Every implementation computes its cut with
these functions, so the cut and the choice are the same formula everywhere; what it measures (and how) is its own
and reported with the decision.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from fractions import Fraction

from reference.contract.accumulation_config import GPU_SHARE_AUTO, AccumulationConfig
from reference.contract.accumulation_limit import MemoryLimit
from reference.contract.accumulation_partition import FLAT_ALIGNMENT
from reference.contract.accumulation_step import state_buffer_names

__all__ = [
    "GPU_SHARE_AUTO", "DevicelessSplitWarning", "SplitDecision", "SplitMeasurement", "auto_budget", "choose_split",
    "default_budget",
    "device_bytes_per_element", "fixed_split", "sample_within", "split_point", "warn_if_auto_without_device",
]


class DevicelessSplitWarning(UserWarning):
    """``gpu_share: "auto"`` on an engine whose device is the host (the cpu accelerator)."""


def warn_if_auto_without_device(config: AccumulationConfig, device_type: str) -> bool:
    """Warn once per engine (at its construction) when ``gpu_share`` is "auto" and the engine's device is the
    host: both sides of the cut are then the same CPU, so the measurement compares the host with itself and the
    share it picks is timing noise (runs of one script chose 0.48, 0.43 and 0.0). The choice is still made as on
    a device (so the split path and its report work the same everywhere, and the result is bitwise the all-host
    update, R28), but nothing about it is worth reading. Returns whether it warned."""
    if config.gpu_share != GPU_SHARE_AUTO or device_type != "cpu":
        return False
    warnings.warn(
        "gpu_share='auto' on the cpu device: both sides of the split are the host, so the share 'auto' picks is "
        "timing noise (the update is the same either way); gpu_share means something only with an accelerator "
        "device -- set gpu_share=0.0 (without gpu_memory_limit) to silence this",
        DevicelessSplitWarning, stacklevel=3,
    )
    return True


def split_point(share: float, partition_elements: int) -> int:
    """How many leading elements of a partition of ``partition_elements`` a ``share`` in [0, 1] puts on the
    device: ``share * P`` rounded down to a multiple of :data:`FLAT_ALIGNMENT` (computed exactly), so 0 gives 0
    and 1 gives P (P is a multiple of the alignment, R8)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share!r} must be in [0, 1]")
    if share == 1.0:
        return partition_elements
    return int(Fraction(share) * partition_elements) // FLAT_ALIGNMENT * FLAT_ALIGNMENT


def device_bytes_per_element(config: AccumulationConfig) -> int:
    """Device bytes one element on the device side may cost: its fp32 master, its optimizer state buffers in the
    state precision (R29: 4 bytes each at fp32, 2 at bf16), and its accumulated gradient in ``grad_accum_dtype``
    (kept on the device by an engine that does not send it to the host and back): 16 for Adam with fp32
    accumulation, 12 with bf16 moments."""
    moment = config.moment_precision.bytes_per_moment
    return 4 + moment * len(state_buffer_names(config.optimizer)) + config.accum_dtype.itemsize


def sample_within(sample_elements: int, room_bytes: int | None, config: AccumulationConfig) -> int:
    """The elements "auto" times the device step on: ``sample_elements``, and under ``gpu_memory_limit`` no more
    than ``room_bytes`` (what the limit leaves beside the floor and the margin) hold, an fp32 master and gradient
    and the moments each (at least 1), so the measurement too stays within the limit. None: no limit."""
    if room_bytes is None:
        return sample_elements
    per = 8 + config.moment_precision.bytes_per_moment * len(state_buffer_names(config.optimizer))
    return max(1, min(sample_elements, room_bytes // per))


def auto_budget(config: AccumulationConfig, memory_limit: MemoryLimit | None,
                free_device_bytes: int | None) -> int | None:
    """The budget "auto" chooses within: the limit's (``gpu_memory_limit``, fitted by
    :func:`reference.contract.accumulation_limit.fit_limit`), else ``gpu_memory_budget``, else
    :func:`default_budget` of the device memory free now."""
    if memory_limit is not None:
        return memory_limit.budget_bytes
    if config.gpu_memory_budget is not None:
        return config.gpu_memory_budget
    return default_budget(free_device_bytes)


def default_budget(free_device_bytes: int | None) -> int | None:
    """The budget of "auto" when ``gpu_memory_budget`` is unset: half the device memory free when the choice is
    made (the other half stays for activations and the allocator's slack); None (unbounded) where the device
    reports no free memory (the cpu accelerator)."""
    return None if free_device_bytes is None else free_device_bytes // 2


@dataclass(frozen=True)
class SplitMeasurement:
    """What "auto" measured (seconds): the host and device optimizer step per element (timed on a sample of
    ``sample_elements``) and ``hide``, the device work per boundary the host part can run beside. For several
    ranks, the slowest host, the slowest device and the least ``hide`` of any rank (so every rank hides)."""

    host_s_per_element: float
    device_s_per_element: float
    hide_s: float
    sample_elements: int

    def __post_init__(self) -> None:
        for name in ("host_s_per_element", "device_s_per_element", "hide_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class SplitDecision:
    """A rank's cut: ``device_elements`` leading elements of its ``partition_elements`` on the device
    (``gpu_share`` = their fraction), costing ``device_bytes``; for "auto" also the ``budget_bytes`` it respected
    (None: unbounded), the ``measurement`` it came from and the host and device times that measurement predicts;
    under ``gpu_memory_limit`` also ``memory_limit``, how the limit was spent (its ``budget_bytes`` is this
    decision's)."""

    gpu_share: float
    device_elements: int
    partition_elements: int
    device_bytes: int
    auto: bool
    budget_bytes: int | None = None
    measurement: SplitMeasurement | None = None
    predicted_host_s: float | None = None
    predicted_device_s: float | None = None
    memory_limit: MemoryLimit | None = None

    def as_dict(self) -> dict:
        """A plain mapping (what ``split_report()`` returns and the log line prints)."""
        out = asdict(self)
        out["measurement"] = None if self.measurement is None else asdict(self.measurement)
        out["memory_limit"] = None if self.memory_limit is None else asdict(self.memory_limit)
        return out


def fixed_split(share: float, partition_elements: int, config: AccumulationConfig) -> SplitDecision:
    """The cut of a numeric ``gpu_share``."""
    d = split_point(share, partition_elements)
    return SplitDecision(
        gpu_share=d / partition_elements if partition_elements else 0.0, device_elements=d,
        partition_elements=partition_elements, device_bytes=d * device_bytes_per_element(config), auto=False,
    )


def choose_split(partition_elements: int, config: AccumulationConfig, budget_bytes: int | None,
                 measurement: SplitMeasurement, memory_limit: MemoryLimit | None = None) -> SplitDecision:
    """The cut "auto" makes (module docstring): the smallest aligned cut that hides the host part, within the
    budget and the partition. Under ``gpu_memory_limit`` the budget is the ``memory_limit``'s
    (:func:`reference.contract.accumulation_limit.fit_limit`), which the decision carries."""
    if memory_limit is not None and budget_bytes != memory_limit.budget_bytes:
        raise ValueError(f"budget_bytes={budget_bytes} is not the limit's budget {memory_limit.budget_bytes}")
    P = partition_elements
    per = device_bytes_per_element(config)
    h, g = measurement.host_s_per_element, measurement.device_s_per_element
    need = (h * P - measurement.hide_s) / (h + g) if h + g > 0 else 0.0
    d = min(P, math.ceil(max(0.0, need) / FLAT_ALIGNMENT) * FLAT_ALIGNMENT)
    if budget_bytes is not None:
        d = min(d, budget_bytes // per // FLAT_ALIGNMENT * FLAT_ALIGNMENT)
    return SplitDecision(
        gpu_share=d / P if P else 0.0, device_elements=d, partition_elements=P, device_bytes=d * per, auto=True,
        budget_bytes=budget_bytes, measurement=measurement, predicted_host_s=h * (P - d), predicted_device_s=g * d,
        memory_limit=memory_limit,
    )
