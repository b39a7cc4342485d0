"""Counters of an offload manager, and the frozen snapshot users read.

The engines update a :class:`StatsRecorder` from the forward thread (pack) and from autograd's device
threads
(unpack, release), so every update takes one lock. Users get an immutable :class:`OffloadStats` snapshot:
a value that cannot change under them while they print or compare it.

Contract: the fields of ``OffloadStats`` and which of them are gauges (kept by ``reset_stats``) are what the
suite and users compare across implementations; the recorder is the one definition of how counters become a
snapshot, so both implementations fill the same value the same way.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_GB = 1e9


@dataclass(frozen=True)
class OffloadStats:
    """What an offload manager did since it was created (or since ``reset_stats``).

    ``*_offloaded``: copied to host. ``*_restored``: copied back to the device (each restore counts, so a
    second backward with ``retain_graph=True`` counts again). ``*_kept``: candidates that stayed on the
    device (newest
    ``keep_last_count``, or host pool full). ``*_skipped``: saved tensors never considered (parameters,
    buffers, host tensors, small tensors, ...), with the reason in ``skipped_by_reason``.
    ``d2h_gbps`` / ``h2d_gbps``: bytes over the time the copies themselves took (None until a copy was
    timed).
    ``compute_wait_seconds``: time the consumer (compute) stream spent waiting for restored data.
    ``host_bytes_in_use`` / ``device_bytes_held``: live gauges: host memory holding offloaded data now, and
    device memory the manager itself references now (kept tensors and prefetched buffers).
    """

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    tensors_restored: int = 0
    bytes_restored: int = 0
    tensors_prefetched: int = 0
    tensors_kept: int = 0
    bytes_kept: int = 0
    tensors_skipped: int = 0
    bytes_skipped: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    d2h_seconds: float = 0.0
    d2h_timed_bytes: int = 0
    h2d_seconds: float = 0.0
    h2d_timed_bytes: int = 0
    compute_wait_seconds: float = 0.0
    host_bytes_in_use: int = 0
    device_bytes_held: int = 0
    host_pool_bytes: int = 0
    host_allocations: int = 0

    @property
    def d2h_gbps(self) -> float | None:
        return self.d2h_timed_bytes / self.d2h_seconds / _GB if self.d2h_seconds > 0 else None

    @property
    def h2d_gbps(self) -> float | None:
        return self.h2d_timed_bytes / self.h2d_seconds / _GB if self.h2d_seconds > 0 else None

    def __repr__(self) -> str:
        """Every field, then the two rates: ``print(manager.stats)`` shows GB/s each way, as the docs promise
        (properties are not in a dataclass's generated repr)."""
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__dataclass_fields__)

        def rate(v: float | None) -> str:
            return "None" if v is None else f"{v:.3f}"

        return f"OffloadStats({fields}, d2h_gbps={rate(self.d2h_gbps)}, h2d_gbps={rate(self.h2d_gbps)})"

    def as_dict(self) -> dict[str, object]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["skipped_by_reason"] = dict(self.skipped_by_reason)
        out["d2h_gbps"] = self.d2h_gbps
        out["h2d_gbps"] = self.h2d_gbps
        return out


class StatsRecorder:
    """Thread-safe mutable counters behind :class:`OffloadStats`."""

    _COUNTERS = (
        "tensors_offloaded",
        "bytes_offloaded",
        "tensors_restored",
        "bytes_restored",
        "tensors_prefetched",
        "tensors_kept",
        "bytes_kept",
        "tensors_skipped",
        "bytes_skipped",
        "d2h_timed_bytes",
        "h2d_timed_bytes",
        "host_bytes_in_use",
        "device_bytes_held",
        "host_pool_bytes",
        "host_allocations",
    )
    _TIMERS = ("d2h_seconds", "h2d_seconds", "compute_wait_seconds")
    # Gauges describe the present, so reset_stats must not zero them.
    _GAUGES = ("host_bytes_in_use", "device_bytes_held", "host_pool_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self._COUNTERS + self._TIMERS, 0)
        self._reasons: Counter[str] = Counter()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for key, delta in deltas.items():
                self._values[key] += delta

    def set(self, **values: float) -> None:
        with self._lock:
            self._values.update(values)

    def skip(self, reason: str, nbytes: int) -> None:
        with self._lock:
            self._values["tensors_skipped"] += 1
            self._values["bytes_skipped"] += nbytes
            self._reasons[reason] += 1

    def get(self, key: str) -> float:
        with self._lock:
            return self._values[key]

    def reset(self) -> None:
        with self._lock:
            for key in self._values:
                if key not in self._GAUGES:
                    self._values[key] = 0
            self._reasons.clear()

    def snapshot(self) -> OffloadStats:
        with self._lock:
            values = dict(self._values)
            reasons = dict(self._reasons)
        # Any: mypy cannot match keyword unpacking to the dataclass's fields (the keys are its field names)
        ints: dict[str, Any] = {k: int(values[k]) for k in self._COUNTERS}
        floats: dict[str, Any] = {k: float(values[k]) for k in self._TIMERS}
        return OffloadStats(skipped_by_reason=reasons, **ints, **floats)

__all__ = [
    "OffloadStats",
    "StatsRecorder",
]
