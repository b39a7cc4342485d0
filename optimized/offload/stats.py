"""Offload stats: the reference's snapshot and recorder classes (one definition keeps the fields
identical)."""

from reference.contract.offload_stats import OffloadStats, StatsRecorder

__all__ = ["OffloadStats", "StatsRecorder"]
