"""Offload stats: the reference's snapshot and recorder classes (one definition keeps the fields
identical)."""

from reference.offload.stats import OffloadStats, StatsRecorder

__all__ = ["OffloadStats", "StatsRecorder"]
